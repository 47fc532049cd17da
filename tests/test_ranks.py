"""Totals across a job's workers: each encoder's stats summed over its ranks."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from omnitrace.events import (
    CaptureFailed,
    Event,
    GraphCaptured,
    GraphMissed,
    GraphReplayed,
    MemoryDeferred,
    MissReason,
)
from omnitrace.ranks import merge_stats, totals, totals_json
from omnitrace.stats import AdapterStats, StatsFold
from omnitrace.testing import sig

KEY = sig("float32[1,256,64]")


def _event(kind: int, adapter: str, t: int) -> Event:
    """One event of each kind the stats fold counts, by ``kind``."""
    match kind:
        case 0:
            return GraphReplayed(adapter, KEY, t, t, 0.001)
        case 1:
            return GraphMissed(adapter, KEY, t, t, MissReason.WARMUP, "call 1 of 2")
        case 2:
            return GraphMissed(adapter, KEY, t, t, MissReason.CAPACITY, "cap")
        case 3:
            return GraphCaptured(adapter, KEY, t, t, 0.01, 1, "cuda:0", 0, 5, 1 << 20, 64, 0)
        case 4:
            return MemoryDeferred(adapter, KEY, t, t, 100 + t, 200, "cuda:0")
    return CaptureFailed(adapter, KEY, t, t, "RuntimeError", f"boom {t}", "cuda:0", 0)


workers_traffic = st.lists(
    st.lists(st.tuples(st.integers(0, 5), st.sampled_from(["vision", "audio"])), max_size=30),
    min_size=1,
    max_size=4,
)


@given(workers_traffic)
def test_a_total_counts_what_one_fold_of_every_workers_events_counts(
    traffic: list[list[tuple[int, str]]],
) -> None:
    """Summing each worker's fold gives the counts of one fold over all their events."""
    everything = StatsFold()
    per_worker = []
    t = 0
    for rank, calls in enumerate(traffic):
        fold = StatsFold()
        for kind, adapter in calls:
            t += 1
            event = _event(kind, adapter, t)
            fold.fold(event)
            everything.fold(event)
        per_worker += [((rank, 100 + rank), fold.snapshot(name)) for name in fold.adapters()]
    summed = {total.adapter: total.stats for total in totals(per_worker)}
    assert set(summed) == set(everything.adapters())
    for name, stats in summed.items():
        alone = everything.snapshot(name)
        assert stats.as_dict() == alone.as_dict()
        assert stats.memory_deferrals == alone.memory_deferrals
        assert stats.graphs == alone.graphs  # every worker's, in capture order


def test_the_spread_is_the_lowest_and_highest_hit_rate_of_a_worker_with_calls() -> None:
    """Rank 0 hits 3 of 4, rank 1 hits 1 of 4, rank 2 had no call: spread 25 % to 75 %."""
    per_worker = [
        ((0, 10), AdapterStats("vision", 3, warmup_misses=1)),
        ((1, 11), AdapterStats("vision", 1, capacity_misses=3)),
        ((2, 12), AdapterStats("vision")),
    ]
    (total,) = totals(per_worker)
    assert total.workers == ((0, 10), (1, 11), (2, 12))
    assert (total.stats.calls, total.stats.graph_hits) == (8, 4)
    assert total.stats.hit_rate == 0.5
    assert (total.hit_rate_low, total.hit_rate_high) == (0.25, 0.75)


def test_a_worker_named_twice_counts_once() -> None:
    """The same (rank, pid) twice (its log given twice) is not counted twice."""
    stats = AdapterStats("audio", 2, warmup_misses=1)
    (total,) = totals([((0, 5), stats), ((0, 5), stats)])
    assert total.stats.calls == 3


def test_merged_memory_facts_are_the_latest_deferrals_and_the_failure_the_first() -> None:
    """The free memory and floor of the latest deferral; the first failure's text."""
    early = AdapterStats(
        "vision",
        memory_deferrals=1,
        last_free_bytes=5,
        floor_bytes=10,
        last_epoch_ns=1,
        failure="E: first",
        capture_failures=1,
    )
    late = AdapterStats(
        "vision",
        memory_deferrals=2,
        last_free_bytes=7,
        floor_bytes=20,
        last_epoch_ns=9,
        failure="E: second",
        capture_failures=1,
    )
    merged = merge_stats("vision", [early, late])
    assert (merged.memory_deferrals, merged.last_free_bytes, merged.floor_bytes) == (3, 7, 20)
    assert (merged.failure, merged.capture_failures, merged.last_epoch_ns) == ("E: first", 2, 9)


def test_totals_json_names_the_workers_and_sums_every_encoder() -> None:
    """The JSON lists every worker once, each encoder's sum and spread, and the overall rate."""
    per_worker = [
        ((0, 10), AdapterStats("vision", 3, warmup_misses=1)),
        ((0, 10), AdapterStats("audio", 0, ineligible_misses=2)),
        ((1, 11), AdapterStats("vision", 1, capacity_misses=1)),
    ]
    data = totals_json(totals(per_worker), {"vision": 4})
    assert data["workers"] == [{"rank": 0, "pid": 10}, {"rank": 1, "pid": 11}]
    assert (data["calls"], data["graph_hits"], data["hit_rate"]) == (8, 4, 0.5)
    vision, audio = data["encoders"]
    assert (vision["encoder"], vision["workers"], vision["calls"]) == ("vision", 2, 6)
    assert (vision["graph_hits"], vision["capacity_misses"], vision["warmup_misses"]) == (4, 1, 1)
    assert (vision["hit_rate_low"], vision["hit_rate_high"]) == (0.5, 0.75)
    assert vision["max_graphs_per_worker"] == 4
    assert (audio["workers"], audio["max_graphs_per_worker"]) == (1, None)
