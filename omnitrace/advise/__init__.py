"""What-if replay of recorded encoder traffic (``omnitrace advise``): the recording, its
replays, the grid with its ranking and advice, each request kind's outlook and the spread
over the ranks. This face hands on the grid's names."""

from __future__ import annotations

from omnitrace.advise.grid import (
    Advice,
    EncoderOutcome,
    KeyCost,
    Recording,
    Result,
    Setting,
    Worker,
    advice_json,
    advise,
    default_grid,
    format_seconds,
    parse_size,
    replay,
    replay_grid,
)

__all__ = [
    "Advice",
    "EncoderOutcome",
    "KeyCost",
    "Recording",
    "Result",
    "Setting",
    "Worker",
    "advise",
    "advice_json",
    "default_grid",
    "format_seconds",
    "parse_size",
    "replay",
    "replay_grid",
]
