"""The stats fold: a pure function of the event stream."""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import given
from hypothesis import strategies as st

from omnitrace import (
    STATS_KEYS,
    CaptureFailed,
    GraphCaptured,
    GraphMissed,
    GraphReplayed,
    MemoryDeferred,
    MissReason,
    StatsFold,
    derive_stats,
)
from omnitrace.events import Event
from omnitrace.testing import sig

adapters = st.sampled_from(["vision", "audio"])
signatures = st.integers(0, 99).map(lambda n: sig(f"float32[{n}]"))
events = st.one_of(
    st.builds(
        GraphReplayed,
        adapters,
        signatures,
        st.integers(0),
        st.integers(0),
        st.floats(0, 1),
    ),
    st.builds(
        GraphMissed,
        adapters,
        signatures,
        st.integers(0),
        st.integers(0),
        st.sampled_from(list(MissReason)),
        st.just("d"),
    ),
    st.builds(
        GraphCaptured,
        adapters,
        signatures,
        st.integers(0),
        st.integers(0),
        st.floats(0, 1),
        st.integers(1, 9),
        st.just("cuda:0"),
        st.integers(0),
        st.integers(0),
        st.integers(0),
        st.integers(0),
        st.integers(0),
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
    ),
    st.builds(
        CaptureFailed,
        adapters,
        signatures,
        st.integers(0),
        st.integers(0),
        st.just("RuntimeError"),
        signatures,
        st.just("cuda:0"),
        st.integers(0),
    ),
)


@given(st.lists(events, max_size=80))
def test_derive_stats_counts_each_event_kind(stream: list[Event]) -> None:
    """Hits, misses by reason, graphs and failures are plain counts of the events."""
    derived = derive_stats(stream)
    for name, stats in derived.items():
        mine = [e for e in stream if e.adapter == name]
        kinds = Counter(type(e) for e in mine)
        reasons = Counter(e.reason for e in mine if isinstance(e, GraphMissed))
        assert tuple(stats) == STATS_KEYS
        assert stats["graph_hits"] == kinds[GraphReplayed]
        assert stats["graph_misses"] == kinds[GraphMissed]
        assert stats["num_graphs"] == kinds[GraphCaptured]
        assert stats["capture_failures"] == kinds[CaptureFailed]
        for reason in MissReason:
            assert stats[f"{reason.value}_misses"] == reasons[reason]
        calls = kinds[GraphReplayed] + kinds[GraphMissed]
        assert stats["hit_rate"] == (kinds[GraphReplayed] / calls if calls else 0.0)
    assert set(derived) == {e.adapter for e in stream}


@given(st.lists(events, max_size=40), st.lists(events, max_size=40))
def test_fold_is_incremental(first: list[Event], second: list[Event]) -> None:
    """Folding in two parts gives the same result as folding the whole stream."""
    fold = StatsFold()
    fold.extend(first)
    fold.extend(second)
    assert {n: s.as_dict() for n, s in fold.snapshots().items()} == derive_stats(first + second)


def test_snapshot_keeps_capture_details_and_first_failure() -> None:
    """The frozen snapshot lists held graphs, the latest deferral and the first failure."""
    fold = StatsFold()
    fold.fold(GraphCaptured("v", sig("float32[1]"), 1, 10, 0.5, 3, "cuda:0", 0, 9, 100, 20, 0))
    fold.fold(MemoryDeferred("v", sig("float32[2]"), 2, 20, 5, 50, "cuda:0"))
    fold.fold(CaptureFailed("v", sig("float32[3]"), 3, 30, "RuntimeError", "first", "cuda:0", 0))
    fold.fold(CaptureFailed("v", sig("float32[4]"), 4, 40, "ValueError", "second", "cuda:0", 0))
    snap = fold.snapshot("v")
    assert [g.key for g in snap.graphs] == ["float32[1]"]
    assert (snap.graphs[0].pool_id, snap.graphs[0].bytes_reserved) == (3, 100)
    assert (snap.last_free_bytes, snap.floor_bytes, snap.memory_deferrals) == (5, 50, 1)
    assert snap.failure == "RuntimeError: first"
    assert snap.last_epoch_ns == 40
    with pytest.raises(AttributeError):
        snap.graph_hits = 3  # type: ignore[misc]


def test_unknown_adapter_snapshot_is_zero() -> None:
    """Asking for an adapter that emitted nothing gives zeros, not an error."""
    assert StatsFold().snapshot("none").as_dict()["graph_hits"] == 0


def test_fold_rejects_non_events() -> None:
    """A non-event raises instead of being silently miscounted."""
    with pytest.raises(AttributeError):
        StatsFold().fold("x")  # type: ignore[arg-type]
