"""The grid's shared replay gives, for every setting, what the per-call replay gives.

:func:`~omnitrace.advise.replay_grid` skips calls, reuses runs across floors and shares
history counts across ``min_capture_calls``; :func:`~omnitrace.advise.replay` runs every
call through the adapter's own admission policy. On random traffic (several workers and
encoders, ineligible and profiling calls, calls kept out of admission as profiling, free
memory known, estimated (moving over the run) or unknown, pool budgets) the two must agree
setting by setting.
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
                deferred = ev.MemoryDeferred(adapter, signature, n, n, free, GIB, "cuda:0")
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
        (0, 120 * MiB, 600 * MiB),  # pool budgets: after one or two of these captures
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
