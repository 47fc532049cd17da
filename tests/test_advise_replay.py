"""The grid's shared replay gives, for every setting, what the per-call replay gives.

:func:`~omnitrace.advise.replay_grid` skips calls, reuses runs across floors and shares
history counts across ``min_capture_calls``; :func:`~omnitrace.advise.replay` runs every
call through the adapter's own admission policy. On random traffic (several workers and
encoders, ineligible and profiling calls, calls kept out of admission as profiling, free
memory known, estimated (moving over the run) or unknown, pool budgets, needs read at
deferrals, larger keys whose graphs lift the need) the two must agree setting by setting.
"""

from __future__ import annotations

import itertools

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from omnitrace import events as ev
from omnitrace.advise import Recording, Setting, replay, replay_grid
from omnitrace.eventlog import EventRecord
from omnitrace.events import MissReason, Phase
from omnitrace.signature import InputSpec, Signature

MiB = 1 << 20


def _signature(key: int, stream: int | None = 7) -> Signature:
    return Signature((InputSpec("float32", (1, 16 * (key + 1)), "cuda:0"),), stream)


_CALL = st.tuples(
    st.integers(0, 1),  # worker
    st.sampled_from(["vision", "audio"]),
    st.integers(0, 9),  # key
    st.sampled_from(["hit", "warmup", "ineligible", "profiling", "skipped", "capture"]),
)


def _records(calls: list[tuple[int, str, int, str]], deferrals: bool) -> list[EventRecord]:
    records = []
    for n, (worker, adapter, key, kind) in enumerate(calls):
        source = (worker, 100 + worker)
        signature = _signature(key)
        phase = Phase.PROFILING if kind == "profiling" else Phase.SERVING
        event: ev.Event
        if kind == "capture":
            size = (key + 1) * 50 * MiB
            # Free memory read at some captures; it falls and rises over the run, as an
            # engine's own allocations (its allocator's cache) take and give back memory.
            read = (1500 - 37 * n % 1100) * MiB if n % 2 else None
            captured = ev.GraphCaptured(
                adapter, signature, n, n, 0.5, 1, "cuda:0", 7, 8, size, MiB, 0, read
            )
            records.append(EventRecord(captured, source[1], source[0]))
            if deferrals and n % 3 == 0:
                free = (900 - 23 * n % 700) * MiB
                # Some deferrals read the key's need (several, of one key, its least counts).
                need = (key + 1) * (60 + n % 250) * MiB if n % 2 == 0 else None
                deferred = ev.MemoryDeferred(
                    adapter, signature, n, n, free, GIB, "cuda:0", need_bytes=need
                )
                records.append(EventRecord(deferred, source[1], source[0]))
        if kind in ("hit", "capture"):
            event = ev.GraphReplayed(adapter, signature, n, n, 0.001 + key * 1e-4)
        elif kind == "skipped":
            plain = _signature(key, stream=None)
            event = ev.GraphMissed(
                adapter,
                plain,
                n,
                n,
                MissReason.INELIGIBLE,
                "profiling",
                0.004,
                phase=Phase.PROFILING,
            )
        elif kind == "ineligible":
            event = ev.GraphMissed(adapter, signature, n, n, MissReason.INELIGIBLE, "grad", 0.004)
        else:
            event = ev.GraphMissed(
                adapter,
                signature,
                n,
                n,
                MissReason.WARMUP,
                "call 1 of 2",
                0.003 + key * 1e-4,
                phase=phase,
            )
        records.append(EventRecord(event, source[1], source[0]))
    return records


GIB = 1 << 30
GRID = [
    Setting(g, c, floor, skip, budget)
    for g, c, floor, skip, budget in itertools.product(
        (0, 1, 2, 3, 5, 12),
        (2, 3, 5),
        (0, 100 * MiB, 700 * MiB, GIB, 8 * GIB),
        (False, True),
        # Pool budgets: after one or two of these captures, or enough for the needs to bite.
        (0, 120 * MiB, 600 * MiB, 8 * GIB),
    )
]


@settings(max_examples=60, deadline=None)
@given(
    st.lists(_CALL, min_size=1, max_size=160),
    st.sampled_from(["unknown", "estimated", "given"]),
)
def test_every_setting_of_the_grid_equals_the_per_call_replay(
    calls: list[tuple[int, str, int, str]], memory: str
) -> None:
    """replay_grid's result of each setting equals replay's, field by field."""
    records = _records(calls, deferrals=memory == "estimated")
    free = 900 * MiB if memory == "given" else None
    recording = Recording.from_records(records, free_bytes=free)
    fast = replay_grid(recording, GRID)
    for setting, result in zip(GRID, fast, strict=True):
        assert result == replay(recording, setting), setting


def test_a_long_log_past_several_blocks_equals_the_per_call_replay() -> None:
    """Traffic longer than one block of the shared replay, with keys captured mid-block and
    an encoder filling up, gives replay's results."""
    import random

    rng = random.Random(5)
    calls = [
        (
            rng.randrange(2),
            rng.choice(["vision", "audio"]),
            min(int(rng.expovariate(0.3)), 40),
            rng.choice(["hit", "warmup", "warmup", "ineligible", "capture", "skipped"]),
        )
        for _ in range(20_000)
    ]
    recording = Recording.from_records(_records(calls, deferrals=True))
    grid = [s for s in GRID if s.min_capture_calls in (2, 5)]
    for setting, result in zip(grid, replay_grid(recording, grid), strict=True):
        assert result == replay(recording, setting), setting


@settings(
    max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(keys=st.lists(st.integers(0, 12), max_size=200), limit=st.integers(1, 16))
def test_history_counts_are_those_of_admission_with_nothing_captured(
    keys: list[int], limit: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each call's count of its key in a history of ``limit`` keys, as Admission keeps it
    when no key is ever captured (the counts every min_capture_calls shares)."""
    import numpy as np

    from omnitrace.advise import replaying as advise_replay
    from omnitrace.config import EncoderGraphConfig
    from omnitrace.graphs.admission import Admission

    admission = Admission(EncoderGraphConfig(max_graphs=limit // 4 or 1, min_capture_calls=10**9))
    admission._limit = limit  # any bound, not only multiples of four
    want = [admission.decide(key, lambda: 0).calls for key in keys]
    histogram = np.bincount(np.asarray(want, dtype=np.int64), minlength=1)
    # Blocks of 7 calls: the history and the counts carry over from block to block.
    monkeypatch.setattr(advise_replay, "_COUNT_BLOCK", 7)
    # Two adapters' calls interleaved: only the first one's are counted.
    every = np.asarray([k for key in keys for k in (key, 13 + key % 3)], dtype=np.int32)
    adapter_of = np.asarray([0] * 13 + [1] * 3, dtype=np.int32)
    got = advise_replay._count_histogram(every, adapter_of, 0, limit, 10**9)
    assert got.tolist() == histogram.tolist()
    # Counts from the cap on are one bin: the last.
    capped = advise_replay._count_histogram(every, adapter_of, 0, limit, 3)
    assert capped[:3].tolist() == histogram[:3].tolist()
    assert capped.sum() == histogram.sum()


def _deferred_log(*, larger_first: bool) -> list[EventRecord]:
    """One worker's vision calls: a key called four times, whose capture the log deferred
    three times for a need of 900 then 600 MiB with 300 MiB free; with ``larger_first``, a
    key larger in every dimension was captured before it, reading 400 MiB free."""
    small, large = _signature(0), _signature(3)
    events: list[ev.Event] = []
    if larger_first:
        events.append(
            ev.GraphMissed("vision", large, 0, 0, MissReason.WARMUP, "call 1 of 2", 0.003)
        )
        events.append(
            ev.GraphCaptured(
                "vision", large, 1, 1, 0.5, 1, "cuda:0", 7, 8, 100 * MiB, 0, 0, 400 * MiB
            )
        )
        events.append(ev.GraphReplayed("vision", large, 1, 1, 0.001))
    events.append(ev.GraphMissed("vision", small, 2, 2, MissReason.WARMUP, "call 1 of 2", 0.003))
    for n, need in ((3, 900 * MiB), (4, 600 * MiB), (5, 600 * MiB)):
        events.append(
            ev.MemoryDeferred("vision", small, n, n, 300 * MiB, 0, "cuda:0", need_bytes=need)
        )
        events.append(ev.GraphMissed("vision", small, n, n, MissReason.MEMORY, "need", 0.003))
    return [EventRecord(event, 100, 0) for event in events]


@pytest.mark.parametrize("larger_first", [False, True])
def test_a_key_the_log_deferred_for_its_need_waits_in_the_replay_unless_a_larger_graph_holds_it(
    larger_first: bool,
) -> None:
    """The replay defers a key's capture for the least need its log read while free memory
    is short of it, under a pool budget only, and not where its encoder holds a graph of a
    key at least as large in every dimension (whose pool memory the capture reuses)."""
    recording = Recording.from_records(_deferred_log(larger_first=larger_first))
    assert recording.needs == {"vision": {_signature(0): 600 * MiB}}
    budget, none = Setting(8, 2, 0, False, GIB), Setting(8, 2, 0, False, 0)
    for setting in (budget, none):
        (vision,) = replay(recording, setting).encoders
        (fast,) = replay_grid(recording, [setting])[0].encoders
        assert fast == vision
        small_hits = vision.hits - (1 if larger_first else 0)
        if setting is budget and not larger_first:
            assert (small_hits, vision.misses[MissReason.MEMORY]) == (0, 3)
        else:
            assert (small_hits, vision.misses[MissReason.MEMORY]) == (3, 0)
