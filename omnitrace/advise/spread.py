"""How one setting of ``omnitrace advise`` spreads over a job's workers, replayed rank by rank,
since a sum can hide a rank that gains little or holds more memory."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from omnitrace._units import format_bytes
from omnitrace.advise.grid import Recording, Result, Setting, format_seconds, replay_grid

if TYPE_CHECKING:
    from rich.table import Table

__all__ = ["WorkerResult", "per_worker", "spread_json", "spread_line", "spread_table"]


@dataclass(frozen=True, slots=True)
class WorkerResult:
    """What a setting would have done with one worker's calls."""

    rank: int
    pid: int
    result: Result


def per_worker(recording: Recording, setting: Setting) -> tuple[WorkerResult, ...]:
    """Replay ``setting`` on each worker's calls alone, in ``(rank, pid)`` order."""
    rows = []
    for worker in sorted(recording.sequences):
        alone = dataclasses.replace(
            recording,
            sequences={worker: recording.sequences[worker]},
            free_bytes={k: v for k, v in recording.free_bytes.items() if k[0] == worker},
        )
        # The grid's replay, not the reference one: it never makes an object per call, so a
        # worker of ten million calls replays in the memory of its recording.
        (result,) = replay_grid(alone, [setting])
        rows.append(WorkerResult(worker[0], worker[1], result))
    return tuple(rows)


def _low_high(values: Sequence[float]) -> tuple[float, float]:
    return (min(values), max(values)) if values else (0.0, 0.0)


def spread_line(rows: Sequence[WorkerResult]) -> str:
    """Say in one line how far apart the workers are: hit rate, graphs and pool memory."""
    low, high = _low_high([row.result.hit_rate for row in rows if row.result.calls])
    graphs = [row.result.graphs for row in rows]
    pools = [row.result.pool_bytes for row in rows]
    return (
        f"spread over {len(rows)} workers: hit rate {low * 100:.1f} to {high * 100:.1f} %, "
        f"graphs {min(graphs, default=0)} to {max(graphs, default=0)}, "
        f"pool {format_bytes(min(pools, default=0))} to {format_bytes(max(pools, default=0))}"
    )


def spread_table(rows: Sequence[WorkerResult], *, timed: bool) -> Table:
    """Return the table of each worker's calls, hit rate, graphs, pool and saving (or hits)."""
    from rich import box
    from rich.table import Table

    table = Table(
        title="per worker, under the recommended setting",
        title_justify="left",
        box=box.SIMPLE_HEAD,
        padding=(0, 1, 0, 0),
    )
    for heading in ("rank", "pid", "calls", "hit rate", "graphs", "pool"):
        table.add_column(heading, justify="right")
    free = any(row.result.min_free_bytes is not None for row in rows)
    if free:
        table.add_column("least free", justify="right")
    table.add_column("saved" if timed else "hits", justify="right")
    for row in rows:
        result = row.result
        cells = [
            str(row.rank),
            str(row.pid),
            str(result.calls),
            f"{result.hit_rate * 100:.1f} %",
            str(result.graphs),
            format_bytes(result.pool_bytes),
        ]
        if free:
            cells.append(format_bytes(result.min_free_bytes))
        cells.append(format_seconds(result.saved_s) if timed else str(result.hits))
        table.add_row(*cells)
    return table


def spread_json(rows: Sequence[WorkerResult]) -> dict[str, Any]:
    """Return each worker's result and the spread as JSON data (``advise --json``)."""
    low, high = _low_high([row.result.hit_rate for row in rows if row.result.calls])
    return {
        "hit_rate_low": low,
        "hit_rate_high": high,
        "pool_bytes_high": max((row.result.pool_bytes for row in rows), default=0),
        "workers": [
            {
                "rank": row.rank,
                "pid": row.pid,
                "calls": row.result.calls,
                "hits": row.result.hits,
                "hit_rate": row.result.hit_rate,
                "graphs": row.result.graphs,
                "pool_bytes": row.result.pool_bytes,
                "min_free_bytes": row.result.min_free_bytes,
                "saved_s": row.result.saved_s,
            }
            for row in rows
        ],
    }
