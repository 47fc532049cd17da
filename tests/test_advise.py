"""omnitrace advise: recorded traffic replayed through the admission policy, checked against
the real adapter run setting by setting."""

from __future__ import annotations

import dataclasses
import io
import json
import math
import re
from collections import Counter
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
from rich.console import Console

from omnitrace import EncoderCudaGraph, EncoderGraphConfig, EventBus
from omnitrace.advise import Recording, Result, Setting, advise, default_grid, replay
from omnitrace.cli import main
from omnitrace.eventlog import (
    INFO_TYPE,
    AdapterInfo,
    EventRecord,
    dumps,
    encode_event,
    read_records,
)
from omnitrace.events import (
    NO_SIGNATURE,
    DeviceTimed,
    Event,
    GraphCaptured,
    GraphMissed,
    GraphReplayed,
    MemoryDeferred,
    MissReason,
    Phase,
    ProfilingObserved,
)
from omnitrace.graphs.backends.base import CaptureRequest
from omnitrace.signature import Signature
from omnitrace.testing import SimulatedGraphBackend, capture_events

MiB = 1 << 20
GiB = 1 << 30
WORKER = (0, 4242)

Call = tuple[str, tuple[int, ...], Phase]
"""(adapter, input shape, phase) of one encoder call."""


def _tensor(shape: Sequence[int], dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.zeros(tuple(shape), dtype=dtype)


class _SizedBackend(SimulatedGraphBackend):
    """A simulated device whose captures take the size given per input shape."""

    def __init__(self, free_bytes: int, sizes: dict[tuple[int, ...], int], default: int) -> None:
        super().__init__(free_bytes=free_bytes, graph_bytes=default)
        self.sizes = sizes
        self.default = default

    def capture(self, request: CaptureRequest) -> Any:
        self.graph_bytes = self.sizes.get(tuple(request.inputs[0].shape), self.default)
        return super().capture(request)


def _run(
    calls: Iterable[Call],
    config: EncoderGraphConfig,
    *,
    free_bytes: int = 80 * GiB,
    sizes: dict[tuple[int, ...], int] | None = None,
    graph_bytes: int = 64 * MiB,
    cached_bytes: int = 0,
    taken: dict[int, int] | None = None,
) -> list[Event]:
    """Run ``calls`` through real adapters (one per encoder) on one simulated device;
    ``taken``: bytes the rest of the process takes from the device's free memory before the
    call of that index (an engine's allocator cache growing, say)."""
    backend = _SizedBackend(free_bytes, sizes or {}, graph_bytes)
    backend.cached_bytes = cached_bytes
    bus = EventBus()
    adapters: dict[str, EncoderCudaGraph] = {}
    tensors: dict[tuple[int, ...], torch.Tensor] = {}
    try:
        with capture_events(bus) as events, torch.no_grad():
            for index, (name, shape, phase) in enumerate(calls):
                backend.free_bytes -= (taken or {}).get(index, 0)
                adapter = adapters.get(name)
                if adapter is None:
                    adapter = adapters[name] = EncoderCudaGraph(
                        lambda x: x * 2, name=name, config=config, bus=bus, backend=backend
                    )
                adapter.set_phase(phase)
                x = tensors.get(shape)
                if x is None:
                    x = tensors[shape] = _tensor(shape)
                adapter(x)
        return list(events)
    finally:
        bus.close()


def _retimed(
    events: Iterable[Event],
    eager: dict[tuple[int, ...], float],
    replay_s: dict[tuple[int, ...], float],
    *,
    device: bool = False,
) -> list[Event]:
    """Give every call its key's eager or replay time (and a DeviceTimed when ``device``)."""
    out: list[Event] = []
    for event in events:
        shape = event.signature.inputs[0].shape  # type: ignore[union-attr]
        if isinstance(event, GraphMissed):
            event = dataclasses.replace(event, duration_s=eager[shape] * (3 if device else 1))
            out.append(event)
            if device:
                out.append(DeviceTimed(event.adapter, event.signature, 0, 0, "eager", eager[shape]))
            continue
        if isinstance(event, GraphReplayed):
            event = dataclasses.replace(event, duration_s=replay_s[shape] * (3 if device else 1))
            out.append(event)
            if device:
                out.append(
                    DeviceTimed(event.adapter, event.signature, 0, 0, "replay", replay_s[shape])
                )
            continue
        out.append(event)
    return out


def _records(
    events: Iterable[Event], config: EncoderGraphConfig, *, simulated: bool = False
) -> list[EventRecord]:
    """Records as a GPU worker's log holds them: its adapters' facts, then its events."""
    events = list(events)
    info = {
        "max_graphs": config.max_graphs,
        "min_capture_calls": config.min_capture_calls,
        "min_free_bytes": config.min_free_bytes,
        "pool_budget_bytes": config.pool_budget_bytes,
        "backend": "torch",
        "simulated": simulated,
    }
    names = dict.fromkeys(e.adapter for e in events)
    return [
        *(EventRecord(AdapterInfo(name, info), *reversed(WORKER)) for name in names),
        *(EventRecord(e, WORKER[1], WORKER[0]) for e in events),
    ]


def _write(path: Path, records: Iterable[EventRecord]) -> Path:
    with path.open("wb") as file:
        for record in records:
            item = record.item
            if isinstance(item, AdapterInfo):
                line = {"v": 2, "type": INFO_TYPE, "pid": record.pid, "rank": record.rank}
                line |= {"adapter": item.adapter, "info": dict(item.info)}
                file.write(dumps(line))
            else:
                file.write(dumps(encode_event(item, pid=record.pid, rank=record.rank)))
    return path


@dataclasses.dataclass(frozen=True)
class _Truth:
    """What the real adapter did under one setting."""

    hits: int
    calls: int
    graphs: int
    pool_bytes: int
    saved_s: float


def _brute_force(
    recording: Recording,
    calls: Sequence[Call],
    grid: Iterable[Setting],
    *,
    free_bytes: int,
    sizes: dict[tuple[int, ...], int],
    graph_bytes: int,
) -> dict[Setting, _Truth]:
    """Run the real adapter over the traffic once per setting and total what it did."""
    truth: dict[Setting, _Truth] = {}
    for setting in grid:
        events = _run(
            calls, setting.config(), free_bytes=free_bytes, sizes=sizes, graph_bytes=graph_bytes
        )
        hits = Counter((e.adapter, e.signature) for e in events if isinstance(e, GraphReplayed))
        captured = [(e.adapter, e.signature) for e in events if isinstance(e, GraphCaptured)]
        saved = 0.0
        for adapter, signature in captured:
            saving = recording.costs[adapter][signature].saving_s
            assert saving is not None
            saved += (hits[(adapter, signature)] - 1) * saving
        truth[setting] = _Truth(
            hits=sum(hits.values()),
            calls=sum(isinstance(e, (GraphReplayed, GraphMissed)) for e in events),
            graphs=len(captured),
            pool_bytes=sum(
                e.bytes_reserved + e.static_bytes for e in events if isinstance(e, GraphCaptured)
            ),
            saved_s=saved,
        )
    return truth


def _best(truth: dict[Setting, _Truth], budget: int | None = None) -> Setting:
    """The best setting by saving, then the documented tie-breaks, found by plain search."""
    fitting = [s for s, t in truth.items() if budget is None or t.pool_bytes <= budget]
    return min(
        fitting,
        key=lambda s: (
            -round(truth[s].saved_s, 9),
            truth[s].graphs,
            truth[s].pool_bytes,
            s.pool_budget_bytes or 1 << 63,
            s.max_graphs,
            -s.min_free_bytes,
            -s.min_capture_calls,
            -s.skip_profiling,
        ),
    )


def _check_against_brute_force(
    recording: Recording, truth: dict[Setting, _Truth], results: Sequence[Result]
) -> None:
    by_setting = {r.setting: r for r in results}
    assert set(by_setting) == set(truth)
    for setting, real in truth.items():
        mine = by_setting[setting]
        assert (mine.hits, mine.calls, mine.graphs) == (real.hits, real.calls, real.graphs), setting
        assert mine.saved_s == pytest.approx(real.saved_s), setting


SIX = [(1, 16 * (n + 1), 8) for n in range(6)]


def _six_hot_shapes() -> list[Call]:
    """Six shapes called round-robin, 50 times each."""
    return [("vision", shape, Phase.SERVING) for _ in range(50) for shape in SIX]


def test_six_hot_shapes_with_four_graphs_lose_a_third_and_six_is_recommended() -> None:
    """With max_graphs 4 two of six equally hot shapes never get a graph (a third of the
    calls); advise recommends max_graphs 6, the smallest cap that graphs them all, and the
    brute-force run of the real adapter agrees setting by setting."""
    logged = EncoderGraphConfig(max_graphs=4, min_capture_calls=2, min_free_bytes=0)
    calls = _six_hot_shapes()
    eager = {shape: 0.004 for shape in SIX}
    replay_s = {shape: 0.001 for shape in SIX}
    events = _retimed(_run(calls, logged), eager, replay_s)
    recording = Recording.from_records(_records(events, logged))
    advice = advise(recording)

    assert advice.objective == "time"
    assert advice.logged is not None
    assert advice.logged.hits == 4 * 49
    assert advice.logged.calls - advice.logged.hits == 100 + 4  # a third, plus warm-ups
    assert advice.overrides == {
        "encoder_cuda_graph_max_graphs": 6,
        "encoder_cuda_graph_min_capture_calls": 2,
        "encoder_cuda_graph_min_free_bytes": 0,
    }
    assert advice.best is not None
    assert advice.best.saved_s == pytest.approx(6 * 48 * 0.003)
    assert advice.best.hit_rate == pytest.approx(294 / 300)
    assert "max_graphs" not in advice.why()
    assert advice.why().startswith(
        "it saves the most estimated host time over the recorded traffic, 864.0 ms "
        "(hit rate 98.0 %), with 6 graphs holding "
    )

    grid = default_grid(recording)
    truth = _brute_force(
        recording, calls, grid, free_bytes=80 * GiB, sizes={}, graph_bytes=64 * MiB
    )
    _check_against_brute_force(recording, truth, advice.results)
    assert advice.best.setting == _best(truth)


def test_a_pool_budget_is_replayed_as_the_adapter_applies_it_and_named_in_the_overrides() -> None:
    """Pool budgets in the grid: each setting's replay matches the real adapter's run under
    it; unbounded, six graphs win and the overrides say the budget is off (0); within a
    worker's memory budget that fits four graphs, a budget that stops at four is preferred
    to a bare count among equals, and the reason names it."""
    logged = EncoderGraphConfig(max_graphs=4, min_capture_calls=2, min_free_bytes=0)
    calls = _six_hot_shapes()
    events = _retimed(_run(calls, logged), dict.fromkeys(SIX, 0.004), dict.fromkeys(SIX, 0.001))
    recording = Recording.from_records(_records(events, logged))
    # 64 MiB a graph: three take 192 MiB (under), the fourth passes the budget, so four fit.
    grid = default_grid(recording, min_capture_calls=[2], pool_budget_bytes=[0, 200 * MiB])
    assert {s.pool_budget_bytes for s in grid} == {0, 200 * MiB}
    truth = _brute_force(
        recording, calls, grid, free_bytes=80 * GiB, sizes={}, graph_bytes=64 * MiB
    )
    advice = advise(recording, grid)
    _check_against_brute_force(recording, truth, advice.results)
    assert truth[Setting(6, 2, 0, False, 200 * MiB)].graphs == 4
    assert advice.best is not None
    assert advice.best.setting == _best(truth) == Setting(6, 2, 0)
    assert advice.overrides == {
        "encoder_cuda_graph_max_graphs": 6,
        "encoder_cuda_graph_min_capture_calls": 2,
        "encoder_cuda_graph_min_free_bytes": 0,
        "encoder_cuda_graph_pool_budget_bytes": 0,
    }

    within = advise(recording, grid, memory_budget=300 * MiB)
    assert within.best is not None
    assert within.best.setting == _best(truth, 300 * MiB) == Setting(4, 2, 0, False, 200 * MiB)
    assert within.overrides is not None
    assert within.overrides["encoder_cuda_graph_pool_budget_bytes"] == 200 * MiB
    assert "(no new shape past a pool budget of 200.0 MiB an encoder)" in within.why()


def test_the_logged_pool_budget_is_the_grid_s_default_and_kept_in_the_overrides() -> None:
    """A log whose adapters ran with a budget: the default grid keeps that budget, and the
    recommendation repeats it."""
    logged = EncoderGraphConfig(max_graphs=8, min_capture_calls=2, min_free_bytes=0)
    logged = dataclasses.replace(logged, pool_budget_bytes=200 * MiB)
    events = _retimed(
        _run(_six_hot_shapes(), logged), dict.fromkeys(SIX, 0.004), dict.fromkeys(SIX, 0.001)
    )
    assert sum(isinstance(e, GraphCaptured) for e in events) == 4  # the budget stopped it
    recording = Recording.from_records(_records(events, logged))
    assert recording.logged["vision"] == Setting(8, 2, 0, False, 200 * MiB)
    assert {s.pool_budget_bytes for s in default_grid(recording)} == {200 * MiB}
    advice = advise(recording)
    assert advice.logged is not None
    assert advice.logged.graphs == 4
    assert advice.overrides is not None
    assert advice.overrides["encoder_cuda_graph_pool_budget_bytes"] == 200 * MiB


def test_advise_pool_budget_option_adds_a_column_and_the_key(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """--pool-budget puts the budgets in the grid: the table gains a budget column and the
    recommended overrides name the key."""
    path = _six_hot_log(tmp_path)
    args = ["advise", str(path), "--pool-budget", "0,200MiB", "--memory-budget", "300MiB"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert " budget " in out
    assert '"encoder_cuda_graph_pool_budget_bytes": 209715200' in out
    assert main([*args, "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["recommended"]["encoder_cuda_graph_pool_budget_bytes"] == 200 * MiB
    assert {r["setting"]["encoder_cuda_graph_pool_budget_bytes"] for r in data["results"]} == {
        0,
        200 * MiB,
    }


def test_one_off_pairs_fill_the_slots_and_a_budget_makes_three_calls_win() -> None:
    """Shapes seen twice at the start take the slots with min_capture_calls 2; within a
    budget of two graphs, min_capture_calls 3 keeps them out and graphs the hot shapes."""
    logged = EncoderGraphConfig(max_graphs=4, min_capture_calls=2, min_free_bytes=0)
    pairs = [(1, 8 * (n + 1), 4) for n in range(4)]
    hot = [(1, 100, 4), (1, 200, 4)]
    calls: list[Call] = [("audio", s, Phase.SERVING) for s in pairs for _ in range(2)]
    calls += [("audio", s, Phase.SERVING) for _ in range(100) for s in hot]
    # Capture memory grows with the input, as the advice's estimate for unseen keys assumes.
    sizes = {shape: shape[1] * shape[2] * 256 * 1024 for shape in pairs + hot}
    times = {shape: 0.005 for shape in pairs + hot}
    events = _retimed(_run(calls, logged, sizes=sizes), times, {s: 0.002 for s in times})
    recording = Recording.from_records(_records(events, logged))
    assert recording.estimated_sizes == 2
    budget = 300 * MiB + 64 * 1024  # the two hot graphs with their static buffers

    advice = advise(recording, memory_budget=budget)
    assert advice.best is not None
    assert advice.best.setting == Setting(2, 3, 0)
    assert advice.best.graphs == 2
    assert advice.logged is not None
    assert advice.logged.hits == 4
    assert advice.logged.saved_s == 0  # its four graphs went to shapes never seen again
    unbounded = advise(recording)

    grid = default_grid(recording)
    truth = _brute_force(
        recording, calls, grid, free_bytes=80 * GiB, sizes=sizes, graph_bytes=64 * MiB
    )
    _check_against_brute_force(recording, truth, advice.results)
    assert advice.best.setting == _best(truth, budget)
    assert unbounded.best is not None
    assert unbounded.best.setting == _best(truth)
    assert unbounded.best.graphs > 2


def test_the_floor_is_replayed_from_the_free_memory_the_deferrals_imply() -> None:
    """A log whose 1 GiB floor deferred the fourth capture gives the device's free memory
    at start; a 512 MiB floor graphs all four shapes and leaves 512 MiB free."""
    logged = EncoderGraphConfig(max_graphs=4, min_capture_calls=2, min_free_bytes=GiB)
    # As many input elements each: the fourth, never captured, is sized like the others.
    shapes = [(1, 32 << n, 64 >> n) for n in range(4)]
    calls: list[Call] = [("vision", s, Phase.SERVING) for _ in range(30) for s in shapes]
    sizes = {shape: 256 * MiB for shape in shapes}
    start = 3 * GiB // 2
    events = _run(calls, logged, free_bytes=start, sizes=sizes)
    assert sum(isinstance(e, GraphCaptured) for e in events) == 3
    events = _retimed(events, {s: 0.004 for s in shapes}, {s: 0.001 for s in shapes})
    recording = Recording.from_records(_records(events, logged))
    static = sum(e.static_bytes for e in events if isinstance(e, GraphCaptured)) // 3
    assert recording.free_source == "estimated"
    # Read at the first capture; the simulated device leaves the static buffers out of its
    # free memory, so each later reading adds back one capture's static bytes.
    assert recording.free_bytes == {(WORKER, "cpu"): start}
    steps = recording.free_changes[(WORKER, "cpu")]
    assert [delta for _, delta in steps] == [0, static, 2 * static, 3 * static]
    assert recording.free_at(WORKER, "cpu", steps[-1][0]) == start + 3 * static

    advice = advise(recording)
    assert advice.best is not None
    assert advice.best.setting == Setting(4, 2, 512 * MiB)
    assert advice.best.graphs == 4
    assert advice.best.min_free_bytes == 512 * MiB - static
    assert "it lowers the memory floor from 1.0 GiB" in advice.why()
    grid = default_grid(recording)
    assert {s.min_free_bytes for s in grid} == {0, 256 * MiB, 512 * MiB, GiB, 2 * GiB, 4 * GiB}
    # The brute force's device counts static buffers too, as the advice's model does.
    truth = _brute_force(
        recording,
        calls,
        grid,
        free_bytes=start + 3 * static,
        sizes={s: 256 * MiB + static for s in shapes},
        graph_bytes=64 * MiB,
    )
    by_setting = {r.setting: r for r in advice.results}
    for setting, real in truth.items():
        assert by_setting[setting].graphs == real.graphs, setting
        assert by_setting[setting].hits == real.hits, setting


def test_free_memory_the_engine_takes_mid_run_is_replayed_where_it_was_read() -> None:
    """Two shapes captured with 3 GiB free; then the engine takes 2 GiB (its allocator's
    cache, say) and a 1 GiB floor defers the next shapes. The replay reads the free memory
    as it was at each call: the logged setting gives what the log did, not a device that
    had the deferrals' little memory from the start (which would capture nothing)."""
    logged = EncoderGraphConfig(max_graphs=8, min_capture_calls=2, min_free_bytes=GiB)
    shapes = [(1, 32 << n, 128 >> n) for n in range(5)]  # as many input elements each
    sizes = {shape: 256 * MiB for shape in shapes}
    calls: list[Call] = [("vision", s, Phase.SERVING) for _ in range(10) for s in shapes[:2]]
    calls += [("vision", s, Phase.SERVING) for _ in range(10) for s in shapes]
    events = _run(calls, logged, free_bytes=3 * GiB, sizes=sizes, taken={20: 2 * GiB})
    events = _retimed(events, {s: 0.004 for s in shapes}, {s: 0.001 for s in shapes})
    graphs = sum(isinstance(e, GraphCaptured) for e in events)
    hits = sum(isinstance(e, GraphReplayed) for e in events)
    deferred = sum(isinstance(e, MemoryDeferred) for e in events)
    # Under the floor after the 2 GiB went: the other shapes, past their warm-up call.
    assert (graphs, deferred) == (2, 3 * 9)
    recording = Recording.from_records(_records(events, logged))
    assert recording.free_source == "estimated"
    assert recording.free_bytes == {(WORKER, "cpu"): 3 * GiB}
    result = replay(recording, Setting(8, 2, GiB))
    assert (result.graphs, result.hits) == (graphs, hits)
    assert result.encoders[0].misses[MissReason.MEMORY] == deferred
    # A lower floor would have captured a third shape while the memory was there.
    lower = replay(recording, Setting(8, 2, GiB // 2))
    assert lower.graphs == 3
    notes = advise(recording, [Setting(8, 2, GiB)]).notes
    assert "device-free memory at start: 3.0 GiB, over the run 1.0 GiB to 3.0 GiB besides" in (
        " ".join(notes)
    )


def _memory_bound(
    shapes: Sequence[tuple[int, ...]],
    floor: int,
    cached_bytes: int = 0,
    profiling: Sequence[tuple[str, int]] = (),
) -> Recording:
    """A log of 30 calls of each of ``shapes`` (256 MiB a graph per 4096 input elements) on
    a device with 1 GiB free, read as a recording that knows the free memory; its
    deferrals report ``cached_bytes`` held by the allocator. ``profiling``: a start-up
    profiling run's ``ProfilingObserved`` event first, per (runner, encoder calls)."""
    logged = EncoderGraphConfig(max_graphs=8, min_capture_calls=2, min_free_bytes=floor)
    calls: list[Call] = [("vision", s, Phase.SERVING) for _ in range(30) for s in shapes]
    sizes = {shape: 256 * MiB * math.prod(shape) // 4096 for shape in shapes}
    events = _run(calls, logged, free_bytes=GiB, sizes=sizes, cached_bytes=cached_bytes)
    events = _retimed(events, {s: 0.004 for s in shapes}, {s: 0.001 for s in shapes})
    start = events[0].monotonic_ns - 1
    observed = [
        ProfilingObserved(
            "vision", NO_SIGNATURE, start, start, runner, calls, phase=Phase.PROFILING
        )
        for runner, calls in profiling
    ]
    return Recording.from_records(_records([*observed, *events], logged), free_bytes=GiB)


def test_the_memory_note_says_how_much_more_free_memory_would_graph_the_memory_misses() -> None:
    """Six shapes of 256 MiB on a device with 1 GiB free and a 256 MiB floor: three are
    captured, the calls of the other three run eagerly under the floor; 768 MiB more free
    memory (the fewest 256 MiB steps that fit the sixth capture and the static buffers)
    graphs them all."""
    shapes = [(1, 32 << n, 128 >> n) for n in range(6)]  # as many input elements each
    recording = _memory_bound(shapes, 256 * MiB, cached_bytes=300 * MiB)
    setting = Setting(8, 2, 256 * MiB)
    advice = advise(recording, [setting])
    assert advice.best is not None
    assert advice.best.hits == 3 * 29
    assert advice.best.encoders[0].misses[MissReason.MEMORY] == 3 * 29
    (note,) = [n for n in advice.notes if n.startswith("memory:")]
    assert note == (
        "memory: 87 of 180 calls run eagerly because the device-free memory is under the "
        "floor (256.0 MiB); at its deferrals the caching allocator held up to 300.0 MiB "
        "without tensors, which the engine reuses and a new graph pool cannot; with 768.0 "
        "MiB more free at each worker's start (memory the engine "
        "holds: for vLLM, a lower --gpu-memory-utilization, which takes it from the KV cache) "
        "the recommended setting would serve 174 of its 180 calls from graphs instead of 87"
    )
    # The figure is the least that does it: 512 MiB more leaves memory misses.
    for extra, left in ((512 * MiB, True), (768 * MiB, False)):
        more = dataclasses.replace(
            recording, free_bytes={k: v + extra for k, v in recording.free_bytes.items()}
        )
        assert (replay(more, setting).encoders[0].misses[MissReason.MEMORY] > 0) is left
    # A setting whose cap refuses the shapes first has no memory miss, and no note.
    capped = advise(recording, [Setting(3, 2, 256 * MiB)])
    assert capped.best is not None
    assert capped.best.encoders[0].misses[MissReason.MEMORY] == 0
    assert not [n for n in capped.notes if n.startswith("memory:")]


RUNNER = "vllm.v1.worker.gpu.model_runner.GPUModelRunner.profile_run"


@pytest.mark.parametrize(
    ("profiling", "named"),
    [
        ([(RUNNER, 0)], True),
        ([(RUNNER, 0), ("other.Runner.profile_run", 3)], False),
        ([], False),
    ],
    ids=["no-encoder-called", "one-run-called-one", "no-profiling-logged"],
)
def test_the_memory_note_says_when_the_profiling_run_called_no_encoder(
    profiling: list[tuple[str, int]], named: bool
) -> None:
    """Where every profiling run the log saw called no encoder, the memory note says that
    the engine sized its memory without the encoders' activations, naming the runner."""
    shapes = [(1, 32 << n, 128 >> n) for n in range(6)]
    recording = _memory_bound(shapes, 256 * MiB, profiling=profiling)
    assert recording.unprofiled_runner == (RUNNER if named else None)
    advice = advise(recording, [Setting(8, 2, 256 * MiB)])
    (note,) = [n for n in advice.notes if n.startswith("memory:")]
    said = (
        f"the engine's profiling run ({RUNNER}) called no encoder, so it sized the KV cache "
        "without the encoders' activations"
    )
    assert (said in note) is named


@pytest.mark.parametrize("profiled", [False, True])
def test_a_lower_floor_says_when_the_engine_did_not_plan_for_the_encoders(
    profiled: bool,
) -> None:
    """A recommendation that lowers the floor says, where every profiling run called no
    encoder, that the engine planned no memory for the encoders' activations."""
    shapes = [(1, 32 << n, 128 >> n) for n in range(6)]
    recording = _memory_bound(shapes, 512 * MiB, profiling=[(RUNNER, int(profiled))])
    advice = advise(recording, [Setting(8, 2, 512 * MiB), Setting(8, 2, 256 * MiB)])
    assert advice.best is not None
    assert advice.best.setting == Setting(8, 2, 256 * MiB)
    why = advice.why()
    assert "it lowers the memory floor from 512.0 MiB: less headroom for activations" in why
    said = f"which the engine did not plan for: its profiling run ({RUNNER}) called no encoder"
    assert (said in why) is not profiled


def test_the_memory_note_names_no_figure_where_no_step_fits() -> None:
    """A shape whose graph would take 64 GiB: no step up to 16 GiB fits it, so the note
    says so rather than naming a figure."""
    shapes = [(1, 32, 128), (1, 64, 64), (1, 128, 32), (1, 1024, 1024)]
    recording = _memory_bound(shapes, 512 * MiB)
    advice = advise(recording, [Setting(8, 2, 512 * MiB)])
    assert advice.best is not None
    assert advice.best.hits > 0
    (note,) = [n for n in advice.notes if n.startswith("memory:")]
    assert note.startswith("memory: ")
    assert note.endswith("; even 16.0 GiB more free at the start leaves some of them eager")


def test_profiling_captures_that_take_a_slot_make_skipping_profiling_win() -> None:
    """A maximum-size profiling shape captured before serving takes one of four slots; the
    advice is to skip profiling, keeping four graphs for the four serving shapes."""
    logged = EncoderGraphConfig(max_graphs=4, min_capture_calls=2, min_free_bytes=0)
    dummy = (1, 4096, 8)
    shapes = [(1, 64 * (n + 1), 8) for n in range(4)]
    calls: list[Call] = [("vision", dummy, Phase.PROFILING)] * 2
    calls += [("vision", s, Phase.SERVING) for _ in range(40) for s in shapes]
    times = {s: 0.004 for s in [dummy, *shapes]}
    events = _retimed(_run(calls, logged), times, {s: 0.001 for s in times})
    recording = Recording.from_records(_records(events, logged))
    assert recording.profiling

    advice = advise(recording)
    assert advice.overrides == {
        "encoder_cuda_graph_max_graphs": 4,
        "encoder_cuda_graph_min_capture_calls": 2,
        "encoder_cuda_graph_min_free_bytes": 0,
        "encoder_cuda_graph_skip_profiling": True,
    }
    assert advice.logged is not None
    assert advice.logged.hits == 1 + 3 * 39
    grid = default_grid(recording)
    truth = _brute_force(
        recording, calls, grid, free_bytes=80 * GiB, sizes={}, graph_bytes=64 * MiB
    )
    _check_against_brute_force(recording, truth, advice.results)
    assert advice.best is not None
    assert advice.best.setting == _best(truth)


def test_workers_replay_apart_and_pool_memory_is_the_largest_worker(tmp_path: Path) -> None:
    """Two workers' logs replay as two processes: their hits add up, each fills its own
    graph slots, and the pool memory is what the fuller worker's device holds."""
    logged = EncoderGraphConfig(max_graphs=4, min_capture_calls=2, min_free_bytes=0)
    eager = {shape: 0.004 for shape in SIX}
    events = _retimed(_run(_six_hot_shapes(), logged), eager, {s: 0.001 for s in SIX})
    records = _records(events, logged)
    second = [EventRecord(r.item, 5151, 1) for r in records]
    paths = [_write(tmp_path / "w0.jsonl", records), _write(tmp_path / "w1.jsonl", second)]
    both = Recording.from_records([*records, *second])
    one = Recording.from_records(records)
    assert len(both.calls) == 2
    for setting in (Setting(4, 2, 0), Setting(6, 2, 0)):
        alone, together = replay(one, setting), replay(both, setting)
        assert together.hits == 2 * alone.hits
        assert together.graphs == 2 * alone.graphs
        assert together.pool_bytes == alone.pool_bytes
    assert main(["advise", "--json", *map(str, paths)]) == 0


def test_device_times_are_preferred_and_labelled() -> None:
    """With DeviceTimed events the saving is in device time (host times are three times
    larger here and ignored)."""
    logged = EncoderGraphConfig(max_graphs=1, min_capture_calls=2, min_free_bytes=0)
    shape = (1, 16, 8)
    calls: list[Call] = [("audio", shape, Phase.SERVING)] * 10
    events = _retimed(_run(calls, logged), {shape: 0.004}, {shape: 0.001}, device=True)
    recording = Recording.from_records(_records(events, logged))
    assert recording.time_source == {"audio": "device"}
    result = replay(recording, Setting(1, 2, 0))
    assert result.saved_s == pytest.approx(8 * 0.003)
    assert "estimated device time" in advise(recording).why()


def test_sizes_of_keys_never_captured_are_estimated_per_input_element() -> None:
    """A key the log never captured is sized at the encoder's recorded bytes per input
    element times its own elements, and counted as estimated."""
    logged = EncoderGraphConfig(max_graphs=1, min_capture_calls=2, min_free_bytes=0)
    small, large = (1, 16, 8), (1, 64, 8)
    calls: list[Call] = [("audio", small, Phase.SERVING)] * 3 + [
        ("audio", large, Phase.SERVING)
    ] * 3
    events = _run(calls, logged, sizes={small: 128 * 1024})
    recording = Recording.from_records(_records(events, logged))
    costs = {key.inputs[0].shape: cost for key, cost in recording.costs["audio"].items()}  # type: ignore[union-attr]
    recorded = costs[small].capture_bytes
    assert not costs[small].estimated_bytes
    assert costs[large].estimated_bytes
    assert costs[large].capture_bytes == pytest.approx(recorded * 4, abs=1)
    both = replay(recording, Setting(2, 2, 0))
    assert both.graphs == 2
    assert both.estimated_sizes == 1


def test_a_simulated_log_is_ranked_by_calls_graphed() -> None:
    """Replays on the simulated backend run the forward again: the advice ranks by hits and
    says why."""
    logged = EncoderGraphConfig(max_graphs=4, min_capture_calls=2, min_free_bytes=0)
    events = _run(_six_hot_shapes(), logged)
    recording = Recording.from_records(_records(events, logged, simulated=True))
    advice = advise(recording)
    assert advice.objective == "hits"
    assert advice.best is not None
    assert advice.best.setting.max_graphs == 6
    assert any("simulated backend" in note for note in advice.notes)
    assert advice.why().startswith("it graphs the most calls of the recorded traffic, 294 of 300")
    # The six shapes' first calls stay eager under every setting; starting from these logs'
    # shapes takes them.
    (prepare,) = [note for note in advice.notes if note.startswith("warm-up:")]
    assert prepare.startswith("warm-up: 6 of 300 calls run eagerly before their shape is")
    assert "encoder_cuda_graph_prepare_from" in prepare


@pytest.mark.parametrize("items", [None, "batched", "split"])
def test_warm_up_misses_are_told_apart_and_split_items_named_where_batches_were_served(
    items: str | None,
) -> None:
    """Three shapes called again and again, then four called once (a step's mix of images
    formed once): prepare_from takes the first calls of the three; the four stay eager under
    every setting, and where the encoder served a call's items as one batch the note names
    encoder_cuda_graph_split_items."""
    logged = EncoderGraphConfig(max_graphs=8, min_capture_calls=2, min_free_bytes=0)
    hot = [(1, 16, 8), (2, 16, 8), (3, 16, 8)]
    once = [(4, 16, 8), (5, 16, 8), (6, 16, 8), (7, 16, 8)]
    calls: list[Call] = [("vision", shape, Phase.SERVING) for _ in range(10) for shape in hot]
    calls += [("vision", shape, Phase.SERVING) for shape in once]
    records = _records(_run(calls, logged), logged)
    if items is not None:
        (info,) = [r for r in records if isinstance(r.item, AdapterInfo)]
        described = AdapterInfo("vision", {**info.item.info, "items": items})  # type: ignore[union-attr]
        records[records.index(info)] = EventRecord(described, info.pid, info.rank)
    recording = Recording.from_records(records)
    advice = advise(recording, default_grid(recording, min_capture_calls=[2]))
    assert advice.best is not None
    (warmup,) = [n for n in advice.notes if n.startswith("warm-up:")]
    assert warmup.startswith("warm-up: 3 of 34 calls run eagerly before their shape is captured")
    # What the three captures made their calls wait, as logged.
    held = r"; this run's 3 captures while serving held up their calls [\d.]+ m?s in all "
    assert re.search(held + r"\(the longest [\d.]+ m?s\); a server restarted", warmup), warmup
    assert "encoder_cuda_graph_prepare_from" in warmup
    (seldom,) = [n for n in advice.notes if n.startswith("seldom shapes:")]
    assert seldom.startswith(
        "seldom shapes: 4 of 34 calls are of shapes called once, which min_capture_calls 2 "
        "never captures"
    )
    assert ("encoder_cuda_graph_split_items" in seldom) is (items == "batched")


@pytest.mark.parametrize("expandable", [None, False, True])
def test_the_capture_sizes_note_says_which_segments_they_were_recorded_in(
    expandable: bool | None,
) -> None:
    """The replay takes recorded capture sizes as they are: the note says whether they came
    from fixed segments (upper bounds under the default) or expandable ones, and nothing
    where the log's adapter facts do not say."""
    logged = EncoderGraphConfig(max_graphs=8, min_capture_calls=2, min_free_bytes=0)
    calls: list[Call] = [("vision", (n, 16, 8), Phase.SERVING) for n in (1, 2) for _ in range(5)]
    records = _records(_run(calls, logged), logged)
    if expandable is not None:
        (info,) = [r for r in records if isinstance(r.item, AdapterInfo)]
        facts = {**info.item.info, "expandable_pools": expandable}  # type: ignore[union-attr]
        records[records.index(info)] = EventRecord(
            AdapterInfo("vision", facts), info.pid, info.rank
        )
    recording = Recording.from_records(records)
    advice = advise(recording, default_grid(recording, min_capture_calls=[2]))
    (sizes,) = [n for n in advice.notes if n.startswith("capture sizes:")]
    base = "capture sizes: 2 keys recorded, 0 estimated from the recorded bytes per input element"
    if expandable is None:
        assert sizes == base
    elif expandable:
        assert sizes == base + (
            "; vision captured in expandable segments: with "
            "encoder_cuda_graph_expandable_pools false the pools would take more"
        )
    else:
        assert sizes.startswith(base + "; vision captured in fixed segments (expandable_pools off)")
        assert sizes.endswith("so the pool figures are upper bounds there")


@pytest.mark.parametrize("need", [0, 1, 3])
def test_the_logs_need_misses_are_named_with_the_keys_the_replay_checks(need: int) -> None:
    """A log's ``memory`` misses of detail ``need`` are counted per encoder and named in a
    note, with the keys whose need the log read (none here: no deferral event carries one),
    which are all the replay can check; a log without such misses gets no note."""
    logged = EncoderGraphConfig(max_graphs=8, min_capture_calls=2, min_free_bytes=0)
    calls: list[Call] = [("vision", (n, 16, 8), Phase.SERVING) for n in (1, 2) for _ in range(5)]
    calls += [("audio", (1, 16, 8), Phase.SERVING) for _ in range(4)]
    events = _run(calls, logged)
    # Stand-ins for the adapter's own check: the first ``need`` warm-up misses, relabelled.
    deferred = [e for e in events if isinstance(e, GraphMissed) and e.reason is MissReason.WARMUP][
        :need
    ]
    for event in deferred:
        events[events.index(event)] = dataclasses.replace(
            event, reason=MissReason.MEMORY, detail="need"
        )
    recording = Recording.from_records(_records(events, logged))
    expected = Counter(e.adapter for e in deferred)
    assert recording.need_misses == dict(expected)
    advice = advise(recording, default_grid(recording, min_capture_calls=[2]))
    notes = [n for n in advice.notes if n.startswith("need:")]
    if not need:
        assert notes == []
        return
    each = ", ".join(f"{adapter} {n}" for adapter, n in sorted(expected.items()))
    assert notes == [
        f"need: {need} of the log's {recording.call_count} calls ran eagerly because "
        "device-free memory could not hold what their shape's eager calls took (memory "
        f"misses, detail need: {each}); no deferral event read a need, so the replay applies "
        "that check to no key; a key's need is logged only where it deferred, so the others' "
        "go unchecked"
    ]


def test_only_captures_while_serving_count_as_holding_up_calls() -> None:
    """A capture at start-up held up no call: the warm-up note sums the serving ones."""
    logged = EncoderGraphConfig(max_graphs=8, min_capture_calls=2, min_free_bytes=0)
    calls: list[Call] = [("vision", (n, 16, 8), Phase.SERVING) for n in (1, 2) for _ in range(5)]
    events = _run(calls, logged)
    first, second = [e for e in events if isinstance(e, GraphCaptured)]
    events[events.index(first)] = dataclasses.replace(first, phase=Phase.STARTUP)
    events[events.index(second)] = dataclasses.replace(second, duration_s=0.25)
    recording = Recording.from_records(_records(events, logged))
    assert recording.serving_captures == (0.25,)
    advice = advise(recording, default_grid(recording, min_capture_calls=[2]))
    (warmup,) = [n for n in advice.notes if n.startswith("warm-up:")]
    assert "; this run's one capture while serving held up its call 250.0 ms; " in warmup


def test_calls_no_setting_can_graph_are_counted_and_left_out_of_a_second_hit_rate() -> None:
    """Calls run while graphs were paused are misses under every setting: a note counts them
    by detail and gives the recommended setting's hit rate over the other calls."""
    logged = EncoderGraphConfig(max_graphs=8, min_capture_calls=2, min_free_bytes=0)
    bus = EventBus()
    graph = EncoderCudaGraph(
        lambda x: x * 2, name="vision", config=logged, bus=bus, backend=SimulatedGraphBackend()
    )
    x = _tensor((1, 16, 8))
    try:
        with capture_events(bus) as events, torch.no_grad():
            for paused in [False] * 10 + [True] * 6 + [False] * 4:
                graph.pause_graphs(paused)
                graph(x)
    finally:
        bus.close()
    recording = Recording.from_records(_records(events, logged))
    advice = advise(recording, default_grid(recording, min_capture_calls=[2]))
    assert advice.best is not None
    # 20 calls: the first is a warm-up miss, 6 were paused, 13 replayed.
    assert (advice.best.calls, advice.best.hits) == (20, 13)
    (note,) = [n for n in advice.notes if n.startswith("ineligible:")]
    assert note == (
        "ineligible: 6 of 20 calls could use no graph under any setting (vision: paused 6); "
        "the hit rates count them as misses, and of the other calls the recommended setting "
        "serves 92.9 % from graphs"
    )


def test_no_ineligible_note_where_every_call_could_use_a_graph() -> None:
    logged = EncoderGraphConfig(max_graphs=8, min_capture_calls=2, min_free_bytes=0)
    calls: list[Call] = [("vision", (1, 16, 8), Phase.SERVING)] * 5
    recording = Recording.from_records(_records(_run(calls, logged), logged))
    advice = advise(recording, default_grid(recording, min_capture_calls=[2]))
    assert advice.best is not None
    assert not [n for n in advice.notes if n.startswith("ineligible:")]


def test_advise_recommends_what_a_brute_force_of_the_demo_log_confirms(tmp_path: Path) -> None:
    """On the demo's own event log the recommendation is the best of the grid when every
    setting is run through the real adapters."""
    from omnitrace.demo.run import DemoOptions, run_demo

    log = tmp_path / "demo.jsonl"
    run_demo(
        DemoOptions(requests=160, events_log=log),
        console=Console(file=io.StringIO()),
        say=lambda _: None,
    )
    records = list(read_records(log))
    recording = Recording.from_records(records)
    grid = default_grid(recording, min_capture_calls=[2, 3])
    advice = advise(recording, grid)
    assert advice.objective == "hits"
    assert advice.best is not None
    # The real adapters, each call of the recorded order with its recorded key.
    sizes: dict[Signature, int] = {}
    for costs in recording.costs.values():
        sizes.update({key: cost.capture_bytes for key, cost in costs.items()})
    ((worker, calls),) = recording.calls.items()
    truth: dict[Setting, tuple[int, int]] = {}
    tensors: dict[Signature, tuple[torch.Tensor | None, ...]] = {}
    for setting in grid:
        backend = _KeyedBackend(recording.free_bytes.get((worker, "cpu"), 80 * GiB), sizes)
        adapters = {
            name: EncoderCudaGraph(
                lambda *xs: xs[0] * 2, name=name, config=setting.config(), backend=backend
            )
            for name in recording.adapters
        }
        misses = 0
        with torch.no_grad():
            for call in calls:
                if not call.eligible:
                    misses += 1
                    continue
                inputs = tensors.get(call.key)
                if inputs is None:
                    inputs = tensors[call.key] = tuple(
                        None if spec is None else _tensor(spec.shape, getattr(torch, spec.dtype))
                        for spec in call.key.inputs
                    )
                backend.key = call.key
                with backend.stream(call.key.stream or 0):
                    adapters[call.adapter](*inputs)
        hits = sum(a.get_cumulative_stats()["graph_hits"] for a in adapters.values())
        truth[setting] = (int(hits), sum(a.num_graphs for a in adapters.values()))
    by_setting = {r.setting: r for r in advice.results}
    for setting, (hits, graphs) in truth.items():
        assert (by_setting[setting].hits, by_setting[setting].graphs) == (hits, graphs), setting
    feasible = [s for s in grid if not by_setting[s].exhausts_memory]
    best = min(
        feasible,
        key=lambda s: (
            -truth[s][0],
            truth[s][1],
            by_setting[s].pool_bytes,
            s.max_graphs,
            -s.min_free_bytes,
            -s.min_capture_calls,
        ),
    )
    assert advice.best.setting == best


class _KeyedBackend(SimulatedGraphBackend):
    """A simulated device whose captures take the size the advice gives their key."""

    def __init__(self, free_bytes: int, sizes: dict[Signature, int]) -> None:
        super().__init__(free_bytes=free_bytes)
        self.sizes = sizes
        self.key: Signature | None = None

    def capture(self, request: CaptureRequest) -> Any:
        assert self.key is not None
        self.graph_bytes = self.sizes[self.key]
        return super().capture(request)


# -- the command --------------------------------------------------------------------------------


def _six_hot_log(tmp_path: Path) -> Path:
    logged = EncoderGraphConfig(max_graphs=4, min_capture_calls=2, min_free_bytes=0)
    eager = {shape: 0.004 for shape in SIX}
    events = _retimed(_run(_six_hot_shapes(), logged), eager, {s: 0.001 for s in SIX})
    return _write(tmp_path / "events.jsonl", _records(events, logged))


def test_advise_prints_the_table_the_overrides_and_why(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The text output lists the settings, then the --hf-overrides line and the reason."""
    assert main(["advise", str(_six_hot_log(tmp_path)), "--top", "3"]) == 0
    out = capsys.readouterr().out
    assert "replayed 300 encoder calls of 1 worker (vision) under " in out
    assert (
        '  --hf-overrides \'{"encoder_cuda_graph_max_graphs": 6, '
        '"encoder_cuda_graph_min_capture_calls": 2, "encoder_cuda_graph_min_free_bytes": 0}\''
    ) in out
    assert "why: it saves the most estimated host time" in out
    assert "recommended" in out
    assert "logged" in out


def test_advise_json_is_for_scripts(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """--json prints the recommendation, the reason and every setting's figures."""
    assert main(["advise", str(_six_hot_log(tmp_path)), "--json", "--max-graphs", "4,6"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["recommended"]["encoder_cuda_graph_max_graphs"] == 6
    assert data["objective"] == "time"
    assert [r["setting"]["encoder_cuda_graph_max_graphs"] for r in data["results"]][:2] == [6, 6]
    assert {r["setting"]["encoder_cuda_graph_max_graphs"] for r in data["results"]} == {4, 6}
    assert data["logged"]["hits"] == 196
    assert data["best"]["encoders"]["vision"]["graphs"] == 6


def test_no_setting_within_the_budget_is_one_line_and_exit_status_one(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A budget no setting with a graph fits is one error line with exit status 1 that names
    the smallest pool, never a recommendation of max_graphs 0."""
    path = _six_hot_log(tmp_path)
    assert main(["advise", str(path), "--memory-budget", "1KiB"]) == 1
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err == (
        "omnitrace advise: error: no recommendation: no setting of the grid that graphs a "
        "call fits the budget of 1.0 KiB: the smallest holds 128.0 MiB (max_graphs 2, 2 graphs); "
        "raise --memory-budget\n"
    )


def test_a_grid_of_max_graphs_zero_is_no_recommendation(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Graphs off (max_graphs 0) is never the recommendation: a grid of it alone is one error
    line with exit status 1, in text and --json alike."""
    path = _six_hot_log(tmp_path)
    assert main(["advise", str(path), "--max-graphs", "0"]) == 1
    assert capsys.readouterr().err == (
        "omnitrace advise: error: no recommendation: no setting of the grid graphs any of the "
        "300 recorded calls (max_graphs is 0 in every one)\n"
    )
    assert main(["advise", str(path), "--max-graphs", "0", "--json"]) == 1
    assert json.loads(capsys.readouterr().out)["recommended"] is None


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--max-graphs", "2,2000"], "--max-graphs: expected integers from 0 to 1024, got '2000'"),
        (
            ["--min-capture-calls", "1"],
            "--min-capture-calls: expected integers from 2 to 1000000, got '1'",
        ),
        (
            ["--memory-budget", "12XB"],
            "--memory-budget: expected a size in bytes (1073741824, 512MiB, 1.5GiB, 2GB), got "
            "'12XB'",
        ),
    ],
)
def test_bad_grid_values_are_usage_errors(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], args: list[str], message: str
) -> None:
    """A bad grid value or size is one usage line with exit status 2."""
    with pytest.raises(SystemExit) as exit_info:
        main(["advise", str(tmp_path / "x.jsonl"), *args])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.strip().endswith(f"error: argument {message}")


@pytest.mark.parametrize(
    ("text", "size"),
    [("2GB", 2 * 10**9), ("2GiB", 2 * GiB), ("500MB", 500 * 10**6), ("64kB", 64_000), ("7", 7)],
)
def test_sizes_take_binary_and_decimal_units(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], text: str, size: int
) -> None:
    """--memory-budget reads binary units (GiB) and decimal ones (GB is 10**9 bytes)."""
    path = _six_hot_log(tmp_path)
    main(["advise", str(path), "--json", "--max-graphs", "6", "--memory-budget", text])
    assert json.loads(capsys.readouterr().out)["memory_budget"] == size


def test_a_log_without_graphable_calls_is_exit_status_one(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A log whose calls were all ineligible says so in one line, with why and how many."""
    from omnitrace.testing import sig

    event = GraphMissed("vision", sig("float32[1,4] @cpu"), 1, 1, MissReason.INELIGIBLE, "cpu")
    path = _write(tmp_path / "e.jsonl", [EventRecord(event, 1, 0)])
    assert main(["advise", str(path)]) == 1
    assert capsys.readouterr().err.strip() == (
        f"omnitrace advise: error: {path}: no encoder call could use a graph: "
        "every call was ineligible (vision: cpu 1)"
    )


def _with_requests(events: Sequence[Event]) -> list[Event]:
    """Each call served one request of its own: its step and its RequestTimed around it.

    Calls 10 ms apart; each step runs 5 ms up to its call, each request arrives 8 ms before
    it and has its first token 2 ms after (TTFT 10 ms). A request whose call missed for
    ``capacity`` holds two images, the others one: two kinds to tell apart.
    """
    from omnitrace.events import NO_SIGNATURE, EncoderBatchRan, RequestTimed

    ms = 1_000_000
    out: list[Event] = []
    at = 10_000 * ms
    for event in events:
        if not isinstance(event, (GraphReplayed, GraphMissed)):
            out.append(dataclasses.replace(event, monotonic_ns=at))
            continue
        at += 10 * ms
        out.append(dataclasses.replace(event, monotonic_ns=at))
        rid = f"r{len(out)}"
        out.append(
            EncoderBatchRan(
                "", NO_SIGNATURE, at + 1, 0, at - 5 * ms, (f"{rid}-e",), (64,), ("image",)
            )
        )
        capacity = isinstance(event, GraphMissed) and event.reason is MissReason.CAPACITY
        out.append(
            RequestTimed(
                "",
                NO_SIGNATURE,
                at + 2 * ms,
                0,
                request_id=rid,
                engine_request_id=f"{rid}-e",
                arrival_ns=at - 8 * ms,
                render_ns=None,
                processor_ns=None,
                processed_ns=None,
                queued_ns=None,
                scheduled_ns=at - 6 * ms,
                first_token_ns=at + 2 * ms,
                ttft_s=0.010,
                images=2 if capacity else 1,
                image_pixels=0,
                audios=0,
                audio_s=0.0,
                trace_id="",
                parent_span_id="",
            )
        )
    return out


def test_advise_predicts_each_request_kinds_ttft_under_the_recommended_setting(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Requests whose calls missed for capacity lose the graphs' saving (4 - 1 ms); the
    others, already served by graphs the recommendation keeps, do not change."""
    logged = EncoderGraphConfig(max_graphs=4, min_capture_calls=2, min_free_bytes=0)
    eager = {shape: 0.004 for shape in SIX}
    events = _retimed(_run(_six_hot_shapes(), logged), eager, {s: 0.001 for s in SIX})
    log = _write(tmp_path / "events.jsonl", _records(_with_requests(events), logged))
    assert main(["advise", str(log), "--json", "--max-graphs", "4,6"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["recommended"]["encoder_cuda_graph_max_graphs"] == 6
    kinds = {row["kind"]: row for row in data["requests"]}
    assert set(kinds) == {"image", "2 images"}
    two, one = kinds["2 images"], kinds["image"]
    # The two shapes past the logged four graphs: every call after the first (a warm-up
    # miss under any setting) a capacity miss.
    assert (two["requests"], two["calls"], two["changed_calls"]) == (98, 98, 98)
    assert two["ttft_p50_s"] == pytest.approx(0.010)
    assert two["predicted_ttft_p50_s"] == pytest.approx(0.007)
    assert two["change_p50_s"] == pytest.approx(-0.003)
    assert two["encoders_p50_s"] == pytest.approx(0.005)
    assert (one["requests"], one["changed_calls"]) == (202, 0)
    assert one["predicted_ttft_p50_s"] == pytest.approx(one["ttft_p50_s"])
    assert main(["advise", str(log), "--max-graphs", "4,6"]) == 0
    out = capsys.readouterr().out
    assert "end to end" in out
    assert "-3.0 ms (-30.0 %)" in out


def test_advise_without_request_events_has_no_end_to_end_rows(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A log of encoder calls alone (no vLLM request hooks) gives an empty ``requests``."""
    assert main(["advise", str(_six_hot_log(tmp_path)), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["requests"] == []
    assert main(["advise", str(_six_hot_log(tmp_path))]) == 0
    assert "end to end" not in capsys.readouterr().out


H200_RESULTS = Path(__file__).resolve().parents[1] / "benchmarks" / "results" / "h200"


def _calls_before(log: Path, calls_after: int, out: Path) -> Path:
    """The head of ``log`` up to the encoder call that leaves ``calls_after`` calls after it."""
    lines = log.read_text().splitlines(keepends=True)
    at = [
        i
        for i, line in enumerate(lines)
        if '"type":"GraphReplayed"' in line or '"type":"GraphMissed"' in line
    ]
    out.write_text("".join(lines[: at[len(at) - calls_after - 1] + 1]))
    return out


@pytest.mark.parametrize("model", ["minicpmo", "qwen2_5_omni"])
def test_advise_on_the_h200_engine_benchmark_logs_names_a_budget_past_95_percent(
    model: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The worker logs of the H200 engine benchmark (``vllm serve``, omnitrace's defaults): the
    replay of the logged setting gives exactly the hits the served engine had after its warm-up,
    and the setting advise recommends, which names a pool budget, takes them past 95 %."""
    import tarfile

    with tarfile.open(H200_RESULTS / "engine_c32_events.tar.xz") as archive:
        archive.extractall(tmp_path, filter="data")
    served = json.loads((H200_RESULTS / f"engine_{model}_c32.json").read_text())
    measured = served["result"]["models"][model]["configurations"]["omnitrace"]["after_warmup"]
    (log,) = (tmp_path / model / "omnitrace").glob("events-0-*.jsonl")
    warmup = _calls_before(log, measured["calls"], tmp_path / "warmup.jsonl")
    grid = ["--pool-budget", "0,512MiB,1GiB,2GiB", "--max-graphs", "4,8,16,64", "--json"]

    def advised(path: Path) -> dict[str, Any]:
        assert main(["advise", str(path), *grid]) == 0
        return dict(json.loads(capsys.readouterr().out))

    whole, head = advised(log), advised(warmup)

    def after_warmup(setting: dict[str, int]) -> tuple[int, int]:
        (w,) = [r for r in whole["results"] if r["setting"] == setting]
        (h,) = [r for r in head["results"] if r["setting"] == setting]
        return w["hits"] - h["hits"], w["calls"] - h["calls"]

    assert after_warmup(whole["logged"]["setting"]) == (measured["hits"], measured["calls"])
    recommended = whole["recommended"]
    assert recommended["encoder_cuda_graph_pool_budget_bytes"] > 0
    hits, calls = after_warmup(recommended)
    assert hits / calls >= 0.95


H100_RESULTS = (
    Path(__file__).resolve().parents[1] / "benchmarks" / "results" / "h100-2026-12-07f-both"
)


@pytest.mark.parametrize(
    "run",
    [
        "minicpmo_defaults",
        "minicpmo_defaults_again",
        "minicpmo_floor_512mib",
        "qwen2_5_omni_defaults",
    ],
)
def test_the_replay_of_the_logged_setting_is_the_h100_engine_benchmarks_run(
    run: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The worker logs of the H100 engine benchmark (``vllm serve``, the defaults, and one
    server with the floor at 512 MiB whose captures waited for their need): replayed under
    the logged setting, every encoder has exactly the run's hits and misses by reason, and
    the run's graphs. The 512 MiB run's ``need`` deferrals are among them."""
    import tarfile

    with tarfile.open(H100_RESULTS / f"engine_events_{run}.tar.xz") as archive:
        archive.extractall(tmp_path, filter="data")
    (log,) = tmp_path.glob("events-0-*.jsonl")
    text = log.read_text()
    run_counts: dict[str, Counter[str]] = {}
    graphs = 0
    for line in text.splitlines():
        event = json.loads(line)
        kind = event["type"]
        graphs += kind == "GraphCaptured"
        if kind in ("GraphReplayed", "GraphMissed"):
            outcome = "hits" if kind == "GraphReplayed" else event["reason"]
            run_counts.setdefault(event["adapter"], Counter())[outcome] += 1
    if run == "minicpmo_floor_512mib":
        assert text.count('"detail":"need"') == 7
    assert main(["advise", str(log), "--max-graphs", "32", "--json"]) == 0
    logged = json.loads(capsys.readouterr().out)["logged"]
    assert logged["graphs"] == graphs
    replayed = {
        adapter: Counter({"hits": e["hits"], **e["misses"]})
        for adapter, e in logged["encoders"].items()
    }
    assert {a: +c for a, c in replayed.items()} == run_counts
