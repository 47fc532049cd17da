"""Graphs prepared before serving from an earlier run's event logs
(``encoder_cuda_graph_prepare_from``), on the simulated backend."""

from __future__ import annotations

import logging
import sys
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from omnitrace import (
    ConfigError,
    EncoderCudaGraph,
    EncoderGraphConfig,
    EventBus,
    GraphCaptured,
    GraphMissed,
    GraphReplayed,
)
from omnitrace.events import Phase
from omnitrace.graphs import startup
from omnitrace.graphs.startup import (
    capture_order,
    prepare_adapters,
    recorded_signatures,
    zero_inputs,
)
from omnitrace.integrations import vllm_startup
from omnitrace.signature import Signature
from omnitrace.sinks.jsonl import JsonlSink
from omnitrace.testing import SimulatedGraphBackend, capture_events

CPU = torch.device("cpu")
CFG = EncoderGraphConfig(min_free_bytes=0)


class Encoder(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = torch.nn.Linear(8, 4)
        self.calls = 0

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        self.calls += 1
        y = self.lin(x)
        return y if mask is None else y * mask


@pytest.fixture(autouse=True)
def _no_grad() -> Iterator[None]:
    with torch.no_grad():
        yield


def record(path: Path, traffic: dict[str, list[tuple[int, int]]]) -> None:
    """Serve ``traffic`` (per adapter name, (rows, calls) per shape) and log it to ``path``."""
    bus = EventBus(sinks=[JsonlSink(path)])
    try:
        for name, shapes in traffic.items():
            graph = EncoderCudaGraph(
                Encoder(), name=name, config=CFG, bus=bus, backend=SimulatedGraphBackend()
            )
            for rows, calls in shapes:
                for _ in range(calls):
                    graph(torch.randn(rows, 8))
    finally:
        bus.close()


def adapter(
    config: EncoderGraphConfig, name: str = "vision", backend: SimulatedGraphBackend | None = None
) -> tuple[EncoderCudaGraph, Encoder, EventBus]:
    model = Encoder()
    bus = EventBus()
    graph = EncoderCudaGraph(
        model, name=name, config=config, bus=bus, backend=backend or SimulatedGraphBackend()
    )
    return graph, model, bus


def test_recorded_shapes_are_served_by_a_graph_from_their_first_call(tmp_path: Path) -> None:
    log = tmp_path / "events-0-1.jsonl"
    record(log, {"vision": [(3, 3), (5, 6)], "audio": [(7, 2)]})
    graph, model, bus = adapter(CFG.replace(prepare_from=str(tmp_path / "events-*.jsonl")))
    try:
        with capture_events(bus) as events:
            outcomes = prepare_adapters([graph], CPU)
        assert outcomes == {"vision": {"captured": 2}}
        # Captured, not called: no hit and no miss is counted.
        assert [type(e) for e in events] == [GraphCaptured, GraphCaptured]
        # The larger shape first (it is the more replayed one too).
        assert [e.signature.inputs[0].shape for e in events] == [(5, 8), (3, 8)]
        assert graph.stats().calls == 0
        x = torch.randn(3, 8)
        with capture_events(bus) as events:
            out = graph(x)
        assert [type(e) for e in events] == [GraphReplayed]
        torch.testing.assert_close(out, model.lin(x), rtol=0, atol=0)
    finally:
        bus.close()


MiB = 1 << 20


def write_log(path: Path, shapes: list[tuple[str, int, int]]) -> None:
    """Log, per ``(signature text, bytes its capture took, replays)``, a capture and its
    replays, as a server would have."""
    sink = JsonlSink(path)
    for index, (text, took, replays) in enumerate(shapes):
        signature = Signature.parse(text)
        args = (1, 1, 0.0, 1, "cpu", 0, 0, took - 64, 64, index)
        sink.handle([GraphCaptured("vision", signature, *args)])
        sink.handle([GraphReplayed("vision", signature, 1, 1, 0.001)] * replays)
    sink.close()


def test_recorded_shapes_are_captured_largest_first_where_the_budget_allows() -> None:
    small, mid, big = (Signature.parse(f"float32[{n},8]") for n in (2, 4, 9))
    ranked = [small, mid, big]  # the most replayed first
    costs = {startup._shapes(s): c for s, c in ((small, 100), (mid, 100), (big, 1000))}
    # No budget, or one the recorded captures fit together: the largest first.
    assert capture_order(ranked, costs, slots=16, budget=0) == [big, mid, small]
    assert capture_order(ranked, costs, slots=16, budget=1200) == [big, mid, small]
    # A budget they do not fit: the replay order stands (the large graph captured first
    # could take the budget the more replayed ones would have used).
    assert capture_order(ranked, costs, slots=16, budget=1199) == ranked
    # The cap: the most replayed shapes it admits, the largest first; then the others.
    assert capture_order(ranked, costs, slots=2, budget=0) == [mid, small, big]
    assert capture_order(ranked, costs, slots=2, budget=250) == [mid, small, big]
    assert capture_order(ranked, costs, slots=0, budget=0) == ranked
    assert capture_order(ranked, costs, slots=-1, budget=0) == ranked
    # Equal sizes keep the replay order; a dtype torch lacks counts as no bytes.
    odd = Signature.parse("Tensor[99,99]")
    twin = Signature.parse("float32[8,4]")
    assert capture_order([odd, twin, mid], {}, slots=16, budget=0) == [twin, mid, odd]


def test_a_budget_the_recorded_captures_fit_prepares_them_largest_first(tmp_path: Path) -> None:
    log = tmp_path / "events.jsonl"
    shapes = [
        ("float32[2,8]", 100 * MiB, 9),
        ("float32[9,8]", 100 * MiB, 1),
        ("float32[4,8]", 100 * MiB, 5),
    ]
    write_log(log, shapes)
    found, _ = recorded_signatures(str(log))
    assert [s.inputs[0].shape for s in found["vision"]] == [(2, 8), (4, 8), (9, 8)]
    config = CFG.replace(prepare_from=str(log), pool_budget_bytes=300 * MiB)
    graph, _, bus = adapter(config, backend=SimulatedGraphBackend(graph_bytes=100 * MiB))
    try:
        with capture_events(bus) as events:
            assert prepare_adapters([graph], CPU) == {"vision": {"captured": 3}}
        assert [e.signature.inputs[0].shape for e in events] == [(9, 8), (4, 8), (2, 8)]
    finally:
        bus.close()
    # Recorded larger than the budget: the most replayed first, until the budget is taken.
    log = tmp_path / "larger.jsonl"
    write_log(log, [(text, 150 * MiB, replays) for text, _, replays in shapes])
    config = config.replace(prepare_from=str(log))
    graph, _, bus = adapter(config, backend=SimulatedGraphBackend(graph_bytes=150 * MiB))
    try:
        with capture_events(bus) as events:
            outcomes = prepare_adapters([graph], CPU)
        assert outcomes == {"vision": {"captured": 2, "capacity: budget": 1}}
        assert [e.signature.inputs[0].shape for e in events] == [(2, 8), (4, 8)]
    finally:
        bus.close()


def test_a_key_unlike_the_recorded_ones_warms_up_as_before(tmp_path: Path) -> None:
    log = tmp_path / "events.jsonl"
    record(log, {"vision": [(3, 3)]})
    graph, _, bus = adapter(CFG.replace(prepare_from=str(log)))
    try:
        prepare_adapters([graph], CPU)
        with capture_events(bus) as events:
            graph(torch.randn(4, 8))
        assert [type(e) for e in events] == [GraphMissed]
        assert events[0].detail == "call 1 of 2"
    finally:
        bus.close()


def test_the_cap_and_the_floor_bound_what_is_prepared(tmp_path: Path) -> None:
    log = tmp_path / "events.jsonl"
    record(log, {"vision": [(1, 2), (2, 5), (3, 4)]})
    graph, _, bus = adapter(CFG.replace(prepare_from=str(log), max_graphs=1))
    try:
        assert prepare_adapters([graph], CPU) == {"vision": {"captured": 1, "capacity: cap": 1}}
        assert [s.inputs[0].shape for s in graph.captured_signatures()] == [(2, 8)]
    finally:
        bus.close()
    low = SimulatedGraphBackend(free_bytes=1 << 20)
    graph, _, bus = adapter(CFG.replace(prepare_from=str(log), min_free_bytes=2 << 20), backend=low)
    try:
        assert prepare_adapters([graph], CPU) == {"vision": {"memory: floor": 1}}
        assert graph.num_graphs == 0
    finally:
        bus.close()


def test_each_shape_logs_how_long_the_rest_should_take_when_captures_are_slow(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A compiled capture takes about 30 s: each shape's line says how long the shapes still
    to come should take at the pace so far; fast (plain) captures add nothing."""
    log = tmp_path / "events.jsonl"
    record(log, {"vision": [(1, 4), (2, 3), (3, 2)]})
    caplog.set_level(logging.INFO, logger="omnitrace")
    graph, _, bus = adapter(CFG.replace(prepare_from=str(log)))
    try:
        prepare_adapters([graph], CPU)
    finally:
        bus.close()
    lines = [r.getMessage() for r in caplog.records if " shape " in r.getMessage()]
    assert len(lines) == 3
    assert not any("left" in line for line in lines)

    now = [0.0]

    class SlowBackend(SimulatedGraphBackend):
        def capture(self, request: Any) -> Any:
            now[0] += 40.0  # a compile's pace
            return super().capture(request)

    monkeypatch.setattr(startup, "_clock", lambda: now[0])
    caplog.clear()
    graph, _, bus = adapter(CFG.replace(prepare_from=str(log)), backend=SlowBackend())
    try:
        prepare_adapters([graph], CPU)
    finally:
        bus.close()
    lines = [r.getMessage() for r in caplog.records if " shape " in r.getMessage()]
    assert [line.split(": ", 2)[2] for line in lines] == [
        "captured in 40.0 s; about 1 min 20 s left",
        "captured in 40.0 s; about 40 s left",
        "captured in 40.0 s",
    ]


def test_held_and_ineligible_shapes_are_counted_not_captured(tmp_path: Path) -> None:
    log = tmp_path / "events.jsonl"
    record(log, {"vision": [(2, 3)]})
    graph, _, bus = adapter(CFG.replace(prepare_from=str(log)))
    try:
        assert prepare_adapters([graph], CPU) == {"vision": {"captured": 1}}
        assert prepare_adapters([graph], CPU) == {"vision": {"held": 1}}
    finally:
        bus.close()
    graph, _, bus = adapter(CFG.replace(prepare_from=str(log), enabled=False))
    try:
        assert prepare_adapters([graph], CPU) == {"vision": {"ineligible: disabled": 1}}
    finally:
        bus.close()


def test_no_log_and_a_hostile_log_prepare_nothing_with_a_line_each(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    hostile = tmp_path / "hostile.jsonl"
    hostile.write_bytes(b"\x1b[31mnot json\n" * 3)
    caplog.set_level(logging.WARNING, logger="omnitrace")
    assert recorded_signatures(str(tmp_path / "none-*.jsonl")) == ({}, [])
    assert "no event log at" in caplog.text
    caplog.clear()
    found, read = recorded_signatures(str(hostile))
    assert (found, read) == ({}, [])
    assert f"cannot read {hostile}" in caplog.text
    graph, _, bus = adapter(CFG.replace(prepare_from=str(tmp_path / "missing.jsonl")))
    try:
        assert prepare_adapters([graph], CPU) == {"vision": {}}
        assert graph.num_graphs == 0
    finally:
        bus.close()


def test_zero_inputs_follow_the_signature_and_refuse_an_unknown_dtype() -> None:
    inputs = zero_inputs(Signature.parse("bfloat16[2,3], None, int64[4]"), CPU)
    assert inputs[1] is None
    first, last = inputs[0], inputs[2]
    assert first is not None
    assert last is not None
    assert (first.dtype, first.shape) == (torch.bfloat16, (2, 3))
    assert (last.dtype, tuple(last.shape), int(last.abs().sum())) == (torch.int64, (4,), 0)
    with pytest.raises(ValueError, match="not a torch dtype: 'Tensor'"):
        zero_inputs(Signature.parse("Tensor[2]"), CPU)


def test_first_prepared_call_is_true_once_per_prepared_key(tmp_path: Path) -> None:
    log = tmp_path / "events.jsonl"
    record(log, {"vision": [(2, 3)]})
    graph, _, bus = adapter(CFG.replace(prepare_from=str(log)))
    try:
        assert not graph.unchecked_prepared
        prepare_adapters([graph], CPU)
        assert graph.unchecked_prepared
        other, same = torch.randn(5, 8), torch.randn(2, 8)
        assert not graph.first_prepared_call(other)
        assert graph.first_prepared_call(same)
        assert not graph.first_prepared_call(same)
        assert not graph.unchecked_prepared
    finally:
        bus.close()


def test_prepare_from_is_a_non_blank_path_without_control_characters() -> None:
    config = EncoderGraphConfig.from_hf_overrides(
        {"encoder_cuda_graph_prepare_from": "/var/log/omnitrace/events-*.jsonl"}
    )
    assert config.prepare_from == "/var/log/omnitrace/events-*.jsonl"
    assert EncoderGraphConfig.from_hf_overrides(config.to_hf_overrides()) == config
    for bad in (3, "  ", "/tmp/a\x1b[2Jb"):
        with pytest.raises(ConfigError, match="encoder_cuda_graph_prepare_from"):
            EncoderGraphConfig(prepare_from=bad)  # type: ignore[arg-type]


def test_vllm_warm_up_prepares_in_the_startup_phase_then_stops_compiling(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    log = tmp_path / "events.jsonl"
    record(log, {"vision": [(2, 3)]})
    compiled: list[str] = []

    def fake_compile(forward: object, *, name: str, max_graphs: int) -> object:
        def run(*inputs: torch.Tensor) -> torch.Tensor:
            compiled.append(name)
            return forward(*inputs)  # type: ignore[operator]

        return run

    monkeypatch.setattr("omnitrace.graphs.adapter.compile_forward", fake_compile)
    graph, model, bus = adapter(CFG.replace(prepare_from=str(log), compile=True))

    class Worker:
        device = CPU

        def compile_or_warm_up_model(self) -> str:
            return "warmed"

    module = types.ModuleType("vllm.v1.worker.gpu_worker")
    module.Worker = Worker  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "vllm.v1.worker.gpu_worker", module)

    def adapters() -> list[EncoderCudaGraph]:
        return [graph]

    try:
        assert vllm_startup.hook_warm_up(adapters)
        assert vllm_startup.hook_warm_up(adapters)  # wrapped once
        with torch.enable_grad(), capture_events(bus) as events:
            assert Worker().compile_or_warm_up_model() == "warmed"
        assert [(type(e), e.phase) for e in events] == [(GraphCaptured, Phase.STARTUP)]
        assert graph.phase is Phase.SERVING
        # The prepared shape was compiled; one first seen while serving is not.
        assert compiled
        calls = len(compiled)
        x = torch.randn(6, 8)
        graph(x)
        out = graph(x)
        assert len(compiled) == calls
        assert graph.num_graphs == 2
        torch.testing.assert_close(out, model.lin(x), rtol=0, atol=0)
    finally:
        bus.close()


def test_a_capture_that_fails_stops_the_preparation_with_its_own_error(tmp_path: Path) -> None:
    log = tmp_path / "events.jsonl"
    record(log, {"vision": [(2, 3), (3, 3)]})
    failing = SimulatedGraphBackend(fail_on_capture=ValueError("bad capture"))
    graph, _, bus = adapter(CFG.replace(prepare_from=str(log)), backend=failing)
    try:
        with pytest.raises(ValueError, match="bad capture"):
            prepare_adapters([graph], CPU)
        assert graph.terminal
    finally:
        bus.close()


def test_a_recorded_dtype_torch_lacks_is_counted_unusable(tmp_path: Path) -> None:
    log = tmp_path / "events.jsonl"
    sink = JsonlSink(log)
    for text in ("Tensor[2,8]", "float32[2,8]"):
        event = GraphCaptured("vision", Signature.parse(text), 1, 1, 0.0, 1, "cpu", 0, 0, 0, 0, 0)
        sink.handle([event])
    sink.close()
    graph, _, bus = adapter(CFG.replace(prepare_from=str(log)))
    try:
        assert prepare_adapters([graph], CPU) == {
            "vision": {"unusable: not a torch dtype: 'Tensor'": 1, "captured": 1}
        }
    finally:
        bus.close()


def test_a_log_that_fails_part_way_gives_none_of_its_shapes(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    from omnitrace.eventlog import reader

    # Small reads, so that the records before the bad line are handed out before it is met.
    monkeypatch.setattr(reader, "READ_CHUNK", 256)
    good, broken = tmp_path / "events-0-1.jsonl", tmp_path / "events-0-2.jsonl"
    record(good, {"vision": [(3, 4)]})
    record(broken, {"vision": [(5, 4)], "audio": [(2, 4)]})
    with broken.open("ab") as log:
        log.write(b'{"type": "NoSuchEvent", "adapter": "vision"}\n')
    caplog.set_level(logging.WARNING, logger="omnitrace")
    found, read = recorded_signatures(str(tmp_path / "events-*.jsonl"))
    # The warning says the broken log's shapes are not prepared: none of them is.
    assert f"cannot read {broken}" in caplog.text
    assert read == [good]
    assert list(found) == ["vision"]
    assert [s.inputs[0].shape for s in found["vision"]] == [(3, 8)]


class PacedBackend(SimulatedGraphBackend):
    """A simulated backend whose captures step a shared clock, as compiles take seconds."""

    def __init__(self, now: list[float], seconds: float) -> None:
        super().__init__()
        self.now, self.seconds = now, seconds

    def capture(self, request: Any) -> Any:
        self.now[0] += self.seconds
        return super().capture(request)


def test_the_encoders_take_turns_so_each_gets_its_most_replayed_shapes_first(
    tmp_path: Path,
) -> None:
    log = tmp_path / "events.jsonl"
    record(log, {"vision": [(2, 3), (3, 3), (4, 3)], "audio": [(5, 2), (6, 2)]})
    pattern = CFG.replace(prepare_from=str(log))
    bus = EventBus()  # one stream of events, in the order they happened
    vision, audio = (
        EncoderCudaGraph(
            Encoder(), name=name, config=pattern, bus=bus, backend=SimulatedGraphBackend()
        )
        for name in ("vision", "audio")
    )
    try:
        with capture_events(bus) as events:
            outcomes = prepare_adapters([vision, audio], CPU)
        assert outcomes == {"vision": {"captured": 3}, "audio": {"captured": 2}}
        assert [(e.adapter, e.signature.inputs[0].shape[0]) for e in events] == [
            ("vision", 4),
            ("audio", 6),
            ("vision", 3),
            ("audio", 5),
            ("vision", 2),
        ]
    finally:
        bus.close()


def test_shapes_that_would_end_past_the_time_given_are_left_to_serving(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    log = tmp_path / "events.jsonl"
    record(log, {"vision": [(2, 3), (3, 3), (4, 3)], "audio": [(5, 2), (6, 2)]})
    now = [0.0]
    monkeypatch.setattr(startup, "_clock", lambda: now[0])
    pattern = CFG.replace(prepare_from=str(log))
    vision, model, bus = adapter(pattern, "vision", backend=PacedBackend(now, 40.0))
    audio, _, bus2 = adapter(pattern, "audio", backend=PacedBackend(now, 40.0))
    caplog.set_level(logging.INFO, logger="omnitrace")
    try:
        # 0 → 40 (vision), 40 → 80 (audio, at vision's pace); vision's next would end at 120.
        outcomes = prepare_adapters([vision, audio], CPU, seconds=100.0)
        assert outcomes == {
            "vision": {"captured": 1, "left: time": 2},
            "audio": {"captured": 1, "left: time": 1},
        }
        assert now[0] == 80.0
        assert (
            "out of start-up time to prepare recorded shapes (vision 2, audio 1 left, about "
            "2 min 00 s more at the pace so far)" in caplog.text
        )
        assert "'vision' prepared 1 of 3 recorded shapes before serving in 40.0 s" in caplog.text
        # A shape left is captured as while serving: warmed up by its first call.
        x = torch.randn(3, 8)
        with capture_events(bus) as events:
            vision(x)
            out = vision(x)
        assert [type(e) for e in events] == [GraphMissed, GraphCaptured, GraphReplayed]
        torch.testing.assert_close(out, model.lin(x), rtol=0, atol=0)
        # No time left at all: nothing is started.
        now[0] = 0.0
        other, _, bus3 = adapter(pattern, "audio", backend=PacedBackend(now, 40.0))
        try:
            assert prepare_adapters([other], CPU, seconds=-1.0) == {"audio": {"left: time": 2}}
            assert other.num_graphs == 0
        finally:
            bus3.close()
    finally:
        bus.close()
        bus2.close()


class _Parallel:
    def __init__(self, servers: int) -> None:
        self._api_process_count = servers


class _Config:
    def __init__(self, servers: int) -> None:
        self.parallel_config = _Parallel(servers)


def _fake_vllm_envs(monkeypatch: pytest.MonkeyPatch, timeout: object) -> None:
    package = types.ModuleType("vllm")
    envs = types.ModuleType("vllm.envs")
    envs.VLLM_ENGINE_READY_TIMEOUT_S = timeout  # type: ignore[attr-defined]
    package.envs = envs  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "vllm", package)
    monkeypatch.setitem(sys.modules, "vllm.envs", envs)


def test_only_several_api_servers_bound_the_preparation_by_vllms_ready_timeout(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _fake_vllm_envs(monkeypatch, 600)
    # One API server waits for the engine's start with no timeout.
    assert vllm_startup._ready_timeout_s(_Config(1)) is None
    assert vllm_startup._ready_timeout_s(_Config(4)) == 600
    # A config that does not say counts as several servers.
    assert vllm_startup._ready_timeout_s(None) == 600
    _fake_vllm_envs(monkeypatch, "600")
    assert vllm_startup._ready_timeout_s(_Config(4)) is None


def test_the_process_age_is_read_from_proc() -> None:
    import subprocess
    import time

    age = vllm_startup._process_age_s()
    if not Path("/proc/self/stat").exists():
        assert age is None
        return
    assert age is not None
    # This process started before the module was imported.
    assert age >= time.monotonic() - vllm_startup._IMPORTED - 0.1
    code = "from omnitrace.integrations import vllm_startup; print(vllm_startup._process_age_s())"
    began = time.monotonic()
    child = float(subprocess.check_output([sys.executable, "-c", code], text=True))
    assert 0.0 <= child <= time.monotonic() - began + 0.1


def test_vllm_warm_up_with_several_api_servers_prepares_within_their_timeout(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    log = tmp_path / "events.jsonl"
    record(log, {"vision": [(2, 3), (3, 3), (4, 3)]})
    now = [0.0]
    monkeypatch.setattr(startup, "_clock", lambda: now[0])
    _fake_vllm_envs(monkeypatch, 600)
    # Started 520 s ago: 600 - 520 - 30 (the margin) = 50 s are left, a 40-s shape's worth.
    monkeypatch.setattr(vllm_startup, "_process_age_s", lambda: 520.0)
    graph, _, bus = adapter(CFG.replace(prepare_from=str(log)), backend=PacedBackend(now, 40.0))

    class Worker:
        device = CPU
        vllm_config = _Config(4)

        def compile_or_warm_up_model(self) -> None:
            return None

    module = types.ModuleType("vllm.v1.worker.gpu_worker")
    module.Worker = Worker  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "vllm.v1.worker.gpu_worker", module)
    caplog.set_level(logging.INFO, logger="omnitrace")
    try:
        assert vllm_startup.hook_warm_up(lambda: [graph])
        Worker().compile_or_warm_up_model()
        assert graph.num_graphs == 1
        assert "in the 50 s left before vLLM's API servers stop waiting" in caplog.text
        assert "raise it to prepare every recorded shape before serving" in caplog.text
        # With one API server there is no limit.
        caplog.clear()
        Worker.vllm_config = _Config(1)
        graph2, _, bus2 = adapter(
            CFG.replace(prepare_from=str(log)), backend=PacedBackend(now, 40.0)
        )
        try:
            vllm_startup.prepare_before_serving([graph2], CPU, _Config(1))
            assert graph2.num_graphs == 3
            assert "stop waiting" not in caplog.text
        finally:
            bus2.close()
    finally:
        bus.close()
