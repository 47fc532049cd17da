"""Per-signature coverage: a bounded fold whose totals stay exact."""

from __future__ import annotations

import gc
import tracemalloc
from collections import Counter
from collections.abc import Iterator

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from omnitrace import (
    AdapterCoverage,
    CaptureFailed,
    ConfigError,
    CoverageFold,
    EventBus,
    GraphCaptured,
    GraphMissed,
    GraphReplayed,
    MemoryDeferred,
    MissReason,
    StatsFold,
    derive_coverage,
    derive_stats,
)
from omnitrace.events import DeviceTimed, Event, Phase
from omnitrace.signature import InputSpec, Signature
from omnitrace.testing import sig

adapters = st.sampled_from(["vision", "audio"])
signatures = st.integers(0, 7).map(lambda n: sig(f"float32[{n}] @cuda:0 s=0"))
phases = st.sampled_from(list(Phase))
durations = st.floats(0, 1)
events = st.one_of(
    st.builds(
        GraphReplayed, adapters, signatures, st.integers(0), st.integers(0), durations, phase=phases
    ),
    st.builds(
        GraphMissed,
        adapters,
        signatures,
        st.integers(0),
        st.integers(0),
        st.sampled_from(list(MissReason)),
        st.just("d"),
        st.one_of(st.none(), durations),
        phase=phases,
    ),
    st.builds(
        GraphCaptured,
        adapters,
        signatures,
        st.integers(0),
        st.integers(0),
        durations,
        st.integers(1, 9),
        st.just("cuda:0"),
        st.integers(0),
        st.integers(0),
        st.integers(0, 1 << 30),
        st.integers(0, 1 << 20),
        st.integers(0),
        phase=phases,
    ),
    st.builds(
        DeviceTimed,
        adapters,
        signatures,
        st.integers(0),
        st.integers(0),
        st.sampled_from(["replay", "eager"]),
        durations,
        phase=phases,
    ),
    st.builds(
        MemoryDeferred,
        adapters,
        signatures,
        st.integers(0),
        st.integers(0),
        st.integers(0),
        st.integers(0),
        st.just("cuda:0"),
        phase=phases,
    ),
    st.builds(
        CaptureFailed,
        adapters,
        signatures,
        st.integers(0),
        st.integers(0),
        st.just("RuntimeError"),
        st.just("boom"),
        st.just("cuda:0"),
        st.integers(0),
        phase=phases,
    ),
)
limits = st.integers(1, 5)


@settings(deadline=None)
@given(st.lists(events, max_size=120), limits)
def test_derive_coverage_equals_the_bus_fold(stream: list[Event], limit: int) -> None:
    """The bus's live fold and derive_coverage over the same events give equal snapshots,
    and the bus's stats (kept by the same fold) equal derive_stats."""
    bus = EventBus(coverage_keys=limit)
    try:
        for event in stream:
            bus.emit(event)
        live = bus.coverage()
        stats = bus.adapter_stats()
    finally:
        bus.close()
    assert live == derive_coverage(stream, limit=limit)
    reference = StatsFold()
    reference.extend(stream)
    assert stats == reference.snapshots()
    assert {name: s.as_dict() for name, s in stats.items()} == derive_stats(stream)


@settings(deadline=None)
@given(st.lists(events, max_size=120), limits)
def test_tracked_rows_plus_other_add_up_to_every_call(stream: list[Event], limit: int) -> None:
    """Per adapter and phase, rows plus the other bucket count every hit, miss by reason,
    capture and timing in the stream, whatever was folded away."""
    coverage = derive_coverage(stream, limit=limit)
    assert set(coverage) == {event.adapter for event in stream}
    for name, adapter in coverage.items():
        for phase in Phase:
            mine = [e for e in stream if e.adapter == name and e.phase is phase]
            total = adapter.in_phase(phase)
            replays = [e.duration_s for e in mine if isinstance(e, GraphReplayed)]
            misses = [e for e in mine if isinstance(e, GraphMissed)]
            eager = [e.duration_s for e in misses if e.duration_s is not None]
            timed = [e for e in mine if isinstance(e, DeviceTimed)]
            assert total.hits == len(replays)
            assert all(total.misses[r] == sum(e.reason is r for e in misses) for r in MissReason)
            assert total.captures == sum(isinstance(e, GraphCaptured) for e in mine)
            assert (total.replay.count, total.eager.count) == (len(replays), len(eager))
            assert total.replay.total_s == pytest.approx(sum(replays))
            assert total.eager.total_s == pytest.approx(sum(eager))
            device = {k: [e.device_s for e in timed if e.kind == k] for k in ("replay", "eager")}
            assert total.replay_device.count == len(device["replay"])
            assert total.eager_device.count == len(device["eager"])
            assert total.replay_device.total_s == pytest.approx(sum(device["replay"]))
            assert total.eager_device.total_s == pytest.approx(sum(device["eager"]))
        assert adapter.total.calls == sum(
            isinstance(e, (GraphReplayed, GraphMissed)) for e in stream if e.adapter == name
        )


@settings(deadline=None)
@given(st.lists(events, max_size=120), limits)
def test_captured_signatures_keep_their_rows_and_the_table_stays_bounded(
    stream: list[Event], limit: int
) -> None:
    """Every captured signature has a captured row; rows never outnumber the limit or the
    captured signatures, whichever is larger."""
    coverage = derive_coverage(stream, limit=limit)
    for name, adapter in coverage.items():
        captured = {
            e.signature for e in stream if e.adapter == name and isinstance(e, GraphCaptured)
        }
        rows = {row.signature: row for row in adapter.keys}
        assert captured <= set(rows)
        assert all(rows[s].captured for s in captured)
        assert len(adapter.keys) <= max(limit, len(captured))
        assert adapter.other.signature is None
        assert not adapter.other.captured
        calls = [row.calls for row in adapter.keys]
        assert calls == sorted(calls, reverse=True)


@settings(deadline=None)
@given(st.lists(events, max_size=120))
def test_without_eviction_every_row_counts_its_signature_exactly(stream: list[Event]) -> None:
    """With room for every signature, each row counts exactly its signature's calls."""
    coverage = derive_coverage(stream, limit=8)
    for name, adapter in coverage.items():
        mine = [e for e in stream if e.adapter == name]
        calls = Counter(e.signature for e in mine if isinstance(e, (GraphReplayed, GraphMissed)))
        hits = Counter(e.signature for e in mine if isinstance(e, GraphReplayed))
        assert {row.signature: row.calls for row in adapter.keys} == {
            s: calls[s] for s in {row.signature for row in adapter.keys}
        }
        assert all(row.hits == hits[row.signature] for row in adapter.keys)
        assert adapter.other.calls == 0
        assert adapter.evictions == 0


@settings(deadline=None)
@given(st.lists(events, max_size=60), st.lists(events, max_size=60), limits)
def test_folding_in_two_parts_equals_folding_the_whole(
    first: list[Event], second: list[Event], limit: int
) -> None:
    """The fold is incremental: two extends give what one fold of both lists gives."""
    fold = CoverageFold(limit)
    fold.extend(first)
    fold.extend(second)
    assert fold.snapshots() == derive_coverage(first + second, limit=limit)


def _flood(distinct: int, hot: tuple[Signature, ...]) -> Iterator[Event]:
    """Yield captures of ``hot``, then ``distinct`` one-off shapes with a hit of a hot
    signature after every tenth."""
    for index, signature in enumerate(hot):
        yield GraphCaptured("vision", signature, 0, 0, 0.1, 1, "cuda:0", 0, 1, 1 << 20, 4096, index)
    for n in range(distinct):
        shape = Signature((InputSpec("float16", (1, n + 1, 1152), "cuda:0"),), 0)
        yield GraphMissed("vision", shape, n, n, MissReason.CAPACITY, "cap", 0.004)
        if n % 10 == 9:
            yield GraphReplayed("vision", hot[(n // 10) % len(hot)], n, n, 0.001)


def test_memory_stays_flat_with_100000_distinct_shapes() -> None:
    """100,000 one-off shapes leave 32 rows (the captured ones among them), exact totals,
    and the fold's memory no larger than after 1,000 shapes."""
    hot = tuple(sig(f"bfloat16[1,{n},1152] @cuda:0 s=0") for n in (4096, 2048, 1024, 512))

    def retained(distinct: int) -> tuple[int, AdapterCoverage]:
        gc.collect()
        tracemalloc.start()
        try:
            fold = CoverageFold()
            fold.extend(_flood(distinct, hot))
            gc.collect()
            size, _ = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        return size, fold.snapshot("vision")

    small, _ = retained(1_000)
    large, coverage = retained(100_000)
    assert len(coverage.keys) == 32
    assert {row.signature for row in coverage.captured} == set(hot)
    assert all(row.hits == 2_500 for row in coverage.captured)
    assert coverage.total.calls == 100_000 + 10_000
    assert coverage.total.misses[MissReason.CAPACITY] == 100_000
    assert coverage.other.calls == 100_000 - 28
    assert coverage.evictions == 100_000 - 28
    # The same rows whatever the traffic: a few KiB of float and int churn at most.
    assert large - small < 16 * 1024, (small, large)


def test_a_full_table_of_captured_rows_sends_newcomers_to_other() -> None:
    """With every row captured, a new signature counts in other and takes no row, and a
    capture past the limit still gets one."""
    fold = CoverageFold(2)
    a, b, c, d = (sig(f"float32[{n}] @cuda:0 s=0") for n in range(4))
    for index, signature in enumerate((a, b)):
        fold.fold(GraphCaptured("v", signature, 0, 0, 0.1, 1, "cuda:0", 0, 1, 100, 10, index))
    fold.fold(GraphMissed("v", c, 0, 0, MissReason.CAPACITY, "cap", 0.5))
    fold.fold(GraphCaptured("v", d, 0, 0, 0.1, 1, "cuda:0", 0, 1, 100, 10, 2))
    coverage = fold.snapshot("v")
    assert [row.signature for row in coverage.keys] == [a, b, d]
    assert coverage.other.graph_misses == 1
    assert coverage.other.total.eager.total_s == 0.5
    assert coverage.pool_bytes == 330
    assert coverage.evictions == 0


def test_the_row_with_fewest_calls_leaves_first_earliest_tracked_among_equals() -> None:
    """At a full table the newcomer replaces the row with the fewest calls; among equal
    counts, the one tracked first."""
    fold = CoverageFold(2)
    a, b, c = (sig(f"float32[{n}] @cuda:0 s=0") for n in range(3))
    for signature in (a, a, b, c):
        fold.fold(GraphMissed("v", signature, 0, 0, MissReason.WARMUP, "w", 0.01))
    assert [row.signature for row in fold.snapshot("v").keys] == [a, c]
    assert fold.snapshot("v").other.calls == 1
    fold.fold(GraphMissed("v", b, 0, 0, MissReason.WARMUP, "w", 0.01))
    # c and a: c has 1 call and is the only candidate below a's 2.
    assert [row.signature for row in fold.snapshot("v").keys] == [a, b]


def test_phases_are_counted_apart() -> None:
    """Profiling calls and captures count in the profiling phase, serving ones apart."""
    s = sig("float32[1,1024,1152] @cuda:0 s=0")
    stream = [
        GraphMissed("v", s, 0, 0, MissReason.WARMUP, "w", 0.02, phase=Phase.PROFILING),
        GraphCaptured("v", s, 0, 0, 0.1, 1, "cuda:0", 0, 1, 1000, 24, 0, phase=Phase.PROFILING),
        GraphReplayed("v", s, 0, 0, 0.005, phase=Phase.PROFILING),
        GraphReplayed("v", s, 0, 0, 0.004),
    ]
    row = derive_coverage(stream)["v"].keys[0]
    assert row.capture_phase is Phase.PROFILING
    assert row.capture_bytes == 1024
    profiling, serving = row.in_phase(Phase.PROFILING), row.in_phase(Phase.SERVING)
    assert (profiling.calls, profiling.hits, profiling.captures) == (2, 1, 1)
    assert (serving.calls, serving.hits, serving.captures) == (1, 1, 0)
    assert row.total.calls == 3


def test_eager_loss_uses_each_keys_times_and_the_ratio_for_keys_never_replayed() -> None:
    """Time lost is graphable misses times eager minus replay time; a key never replayed
    gets the replay-to-eager ratio of the keys that were; ineligible misses are not lost."""
    a = sig("float32[1,100] @cuda:0 s=0")
    b = sig("float32[1,200] @cuda:0 s=0")
    stream: list[Event] = [
        GraphMissed("v", a, 0, 0, MissReason.WARMUP, "w", 0.010),
        GraphCaptured("v", a, 0, 0, 0.1, 1, "cuda:0", 0, 1, 100, 10, 0),
        GraphReplayed("v", a, 0, 0, 0.002),
        GraphReplayed("v", a, 0, 0, 0.002),
        *(GraphMissed("v", b, 0, 0, MissReason.CAPACITY, "cap", 0.008) for _ in range(5)),
        GraphMissed("v", b, 0, 0, MissReason.INELIGIBLE, "grad", 0.008),
    ]
    loss = derive_coverage(stream)["v"].eager_loss()
    assert loss.source == "host"
    assert (loss.misses, loss.timed, loss.estimated) == (6, 6, 1)
    # The eager mean of b includes its ineligible call: 8 ms. Ratio 2/10.
    assert loss.eager_s == pytest.approx(0.010 + 5 * 0.008)
    assert loss.lost_s == pytest.approx((0.010 - 0.002) + 5 * (0.008 - 0.008 * 0.2))


def test_eager_loss_prefers_device_time_and_is_unknown_without_any_replay() -> None:
    """With DeviceTimed events the loss is in device time; with no replay at all it is
    unknown (None) while the eager time is still summed."""
    a = sig("float32[1,100] @cuda:0 s=0")
    stream: list[Event] = [
        GraphMissed("v", a, 0, 0, MissReason.CAPACITY, "cap", 0.010),
        DeviceTimed("v", a, 0, 0, "eager", 0.004),
    ]
    loss = derive_coverage(stream)["v"].eager_loss()
    assert (loss.source, loss.lost_s) == ("device", None)
    assert loss.eager_s == pytest.approx(0.004)
    stream += [
        GraphCaptured("v", a, 0, 0, 0.1, 1, "cuda:0", 0, 1, 100, 10, 0),
        GraphReplayed("v", a, 0, 0, 0.003),
        DeviceTimed("v", a, 0, 0, "replay", 0.001),
    ]
    loss = derive_coverage(stream)["v"].eager_loss()
    assert loss.lost_s == pytest.approx(0.004 - 0.001)


def test_top_missed_ranks_rows_by_misses_with_their_main_reason() -> None:
    """top_missed lists the rows with most misses first, other included, each with the
    reason most of its misses had."""
    a, b = sig("float32[1] @cuda:0 s=0"), sig("float32[2] @cuda:0 s=0")
    stream: list[Event] = [
        GraphMissed("v", a, 0, 0, MissReason.WARMUP, "w"),
        *(GraphMissed("v", b, 0, 0, MissReason.CAPACITY, "cap") for _ in range(3)),
        GraphMissed("v", b, 0, 0, MissReason.WARMUP, "w"),
    ]
    top = derive_coverage(stream)["v"].top_missed(5)
    assert [(row.signature, row.graph_misses, row.main_reason) for row in top] == [
        (b, 4, MissReason.CAPACITY),
        (a, 1, MissReason.WARMUP),
    ]
    # One row: a, then b in a's place, then a in b's: two calls folded into other.
    churn = [GraphMissed("v", s, 0, 0, MissReason.CAPACITY, "cap") for s in (a, b, a)]
    top = derive_coverage(churn, limit=1)["v"].top_missed(2)
    assert [(row.key, row.graph_misses) for row in top] == [("other", 2), (a.text, 1)]


@pytest.mark.parametrize("limit", [0, 4097, True, 2.0])
def test_coverage_keys_out_of_range_is_a_config_error(limit: object) -> None:
    """coverage_keys must be an integer from 1 to 4096; the message names it."""
    with pytest.raises(
        ConfigError, match=r"^coverage_keys: expected an integer from 1 to 4096, got "
    ):
        EventBus(coverage_keys=limit)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"^coverage_keys: "):
        CoverageFold(limit)  # type: ignore[arg-type]


def test_the_fold_refuses_what_is_not_an_event() -> None:
    """A non-event raises instead of being silently skipped."""
    with pytest.raises((TypeError, AttributeError)):
        CoverageFold().fold("x")  # type: ignore[arg-type]
