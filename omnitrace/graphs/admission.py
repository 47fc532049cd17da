"""Admission policy: which call of an uncaptured key gets a graph.

Pure bookkeeping with no torch and no clock, so it can be checked exhaustively against a
reference model of the rules:

* an encoder holds at most ``max_graphs`` graphs; they are never evicted or replaced, so once
  the cache is full every call of an uncaptured key is a capacity miss (its first call too);
* a key is captured on its ``min_capture_calls``-th call; fewer calls are warm-up misses;
* the call history holds at most ``4 * max_graphs`` keys; the least recently called key
  leaves first and, if it comes back, counts its calls from zero again;
* before a capture, device-free memory below ``min_free_bytes`` defers it (a memory miss);
  the key keeps its count, so the next call tries again.
"""

from __future__ import annotations

import enum
from collections import OrderedDict
from collections.abc import Callable, Hashable
from dataclasses import dataclass

from omnitrace.config import EncoderGraphConfig

__all__ = ["Admission", "Decision", "Verdict"]


class Verdict(enum.Enum):
    CAPTURE = "capture"
    CAPACITY = "capacity"
    WARMUP = "warmup"
    MEMORY = "memory"


@dataclass(frozen=True, slots=True)
class Decision:
    """What admission decided for one call of an uncaptured key."""

    verdict: Verdict
    calls: int = 0
    """Calls of the key in the history, this one included (0 for capacity)."""
    free_bytes: int | None = None
    """Device-free bytes read for the memory check, when it ran."""


class Admission:
    """Track calls of uncaptured keys and decide when one is captured.

    Args:
        config: supplies ``max_graphs``, ``min_capture_calls`` and ``min_free_bytes``.
    """

    __slots__ = ("_floor", "_history", "_limit", "_max_graphs", "_min_calls", "num_graphs")

    def __init__(self, config: EncoderGraphConfig) -> None:
        self._max_graphs = config.max_graphs
        self._min_calls = config.min_capture_calls
        self._floor = config.min_free_bytes
        self._limit = config.history_size
        self._history: OrderedDict[Hashable, int] = OrderedDict()
        self.num_graphs = 0

    @property
    def full(self) -> bool:
        return self.num_graphs >= self._max_graphs

    def history(self) -> dict[Hashable, int]:
        """Return the call counts of the remembered keys, oldest first."""
        return dict(self._history)

    def decide(self, key: Hashable, free_bytes: Callable[[], int]) -> Decision:
        """Count a call of the uncaptured ``key`` and decide its fate.

        ``free_bytes`` is only called when the memory floor is enabled and the key is due
        for capture, because reading device memory costs a driver call.
        """
        if self.num_graphs >= self._max_graphs:
            return Decision(Verdict.CAPACITY)
        history = self._history
        calls = history.pop(key, 0) + 1
        history[key] = calls
        if len(history) > self._limit:
            history.popitem(last=False)
        if calls < self._min_calls:
            return Decision(Verdict.WARMUP, calls)
        if self._floor > 0:
            free = free_bytes()
            if free < self._floor:
                return Decision(Verdict.MEMORY, calls, free)
            return Decision(Verdict.CAPTURE, calls, free)
        return Decision(Verdict.CAPTURE, calls)

    def captured(self, key: Hashable) -> None:
        """Record that ``key`` now has a graph: it leaves the history and takes a slot."""
        self._history.pop(key, None)
        self.num_graphs += 1
