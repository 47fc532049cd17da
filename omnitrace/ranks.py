"""Totals across the workers of one job: each encoder's stats summed, never averaged, over its
ranks, and how far apart the workers are."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from omnitrace.events import MissReason
from omnitrace.stats import AdapterStats, CapturedGraphInfo

__all__ = ["EncoderTotal", "Worker", "merge_stats", "totals", "totals_json"]

Worker = tuple[int, int]
"""``(rank, pid)`` of the process that wrote a log line."""


@dataclass(frozen=True, slots=True)
class EncoderTotal:
    """One encoder's stats summed over the workers that ran it."""

    stats: AdapterStats
    """The sum (its graphs are every worker's, in capture order)."""
    workers: tuple[Worker, ...]
    """The workers whose stats are in the sum, in ``(rank, pid)`` order."""
    hit_rate_low: float
    """The lowest hit rate of a worker that had calls (0.0 when none had)."""
    hit_rate_high: float
    """The highest hit rate of a worker that had calls (0.0 when none had)."""

    @property
    def adapter(self) -> str:
        return self.stats.adapter


def merge_stats(adapter: str, parts: Iterable[AdapterStats]) -> AdapterStats:
    """Return the stats of ``adapter`` summed over ``parts`` (one per worker).

    Counts add up; the graphs of every worker are kept, in capture order; the free memory
    and the floor are those of the latest memory deferral; the failure is the first one.
    """
    hits = failures = deferrals = 0
    misses = dict.fromkeys(MissReason, 0)
    graphs: list[CapturedGraphInfo] = []
    failure: str | None = None
    last = 0
    deferral: AdapterStats | None = None
    for part in parts:
        hits += part.graph_hits
        for reason, count in part.misses.items():
            misses[reason] += count
        failures += part.capture_failures
        deferrals += part.memory_deferrals
        graphs.extend(part.graphs)
        if failure is None:
            failure = part.failure
        last = max(last, part.last_epoch_ns)
        if part.memory_deferrals and (
            deferral is None or part.last_epoch_ns >= deferral.last_epoch_ns
        ):
            deferral = part
    graphs.sort(key=lambda graph: graph.epoch_ns)
    return AdapterStats(
        adapter,
        hits,
        misses=misses,
        capture_failures=failures,
        graphs=tuple(graphs),
        memory_deferrals=deferrals,
        last_free_bytes=None if deferral is None else deferral.last_free_bytes,
        floor_bytes=None if deferral is None else deferral.floor_bytes,
        failure=failure,
        last_epoch_ns=last,
    )


def totals(per_worker: Iterable[tuple[Worker, AdapterStats]]) -> tuple[EncoderTotal, ...]:
    """Sum each encoder's stats over the workers, in the order encoders are first seen.

    Args:
        per_worker: ``((rank, pid), stats)`` pairs, one per worker and encoder.
    """
    grouped: dict[str, dict[Worker, AdapterStats]] = {}
    for worker, stats in per_worker:
        by_worker = grouped.setdefault(stats.adapter, {})
        if worker in by_worker:
            # The same worker twice (its log named twice): its stats count once.
            continue
        by_worker[worker] = stats
    out = []
    for adapter, by_worker in grouped.items():
        rates = [stats.hit_rate for stats in by_worker.values() if stats.calls]
        out.append(
            EncoderTotal(
                stats=merge_stats(adapter, by_worker.values()),
                workers=tuple(sorted(by_worker)),
                hit_rate_low=min(rates, default=0.0),
                hit_rate_high=max(rates, default=0.0),
            )
        )
    return tuple(out)


def totals_json(
    encoder_totals: Iterable[EncoderTotal], max_graphs: Mapping[str, int | None] | None = None
) -> dict[str, Any]:
    """Return the totals as JSON data: every worker, each encoder's sum and spread.

    ``max_graphs`` maps an encoder to its cap per worker (None: unknown); the total holds
    up to that many graphs on each worker.
    """
    rows = []
    workers: set[Worker] = set()
    calls = hits = 0
    for total in encoder_totals:
        stats = total.stats
        workers.update(total.workers)
        calls += stats.calls
        hits += stats.graph_hits
        rows.append(
            {
                "encoder": total.adapter,
                "workers": len(total.workers),
                **stats.as_dict(),
                "calls": stats.calls,
                "max_graphs_per_worker": (max_graphs or {}).get(total.adapter),
                "hit_rate_low": total.hit_rate_low,
                "hit_rate_high": total.hit_rate_high,
            }
        )
    return {
        "workers": [{"rank": rank, "pid": pid} for rank, pid in sorted(workers)],
        "calls": calls,
        "graph_hits": hits,
        "hit_rate": hits / calls if calls else 0.0,
        "encoders": rows,
    }
