"""The vLLM plugin's environment handling and worker identity (no vLLM needed)."""

from __future__ import annotations

import json
import os
import sys
import types
import weakref
from pathlib import Path
from typing import Any

import pytest
import torch

from integrations.standins import build, image
from omnitrace import ConfigError, EncoderCudaGraph, EncoderGraphConfig, MissReason
from omnitrace.events import Phase
from omnitrace.integrations import vllm_plugin
from omnitrace.integrations.worker import worker_identity


def test_worker_identity_reads_rank_then_local_rank() -> None:
    """RANK wins over LOCAL_RANK; the pid is this process's."""
    assert worker_identity({"RANK": "3", "LOCAL_RANK": "1"}) == (os.getpid(), 3)
    assert worker_identity({"LOCAL_RANK": "1"}) == (os.getpid(), 1)


def test_worker_identity_without_rank_is_none() -> None:
    """Without rank variables (and no vLLM world group) the rank is None."""
    assert worker_identity({}) == (os.getpid(), None)


def test_disabled_plugin_does_not_touch_vllm() -> None:
    """OMNITRACE_PLUGIN=0 returns False before importing vLLM's loader."""
    assert vllm_plugin.register({"OMNITRACE_PLUGIN": "0"}) is False


def test_invalid_flag_names_the_variable() -> None:
    """A flag value that is not a boolean word raises ConfigError naming the variable."""
    with pytest.raises(ConfigError, match="OMNITRACE_PLUGIN: expected 1/0"):
        vllm_plugin.register({"OMNITRACE_PLUGIN": "maybe"})


def test_worker_bus_is_one_per_process(monkeypatch: pytest.MonkeyPatch) -> None:
    """worker_bus returns the same bus in one process and a new one after a pid change."""
    monkeypatch.setattr(vllm_plugin, "_bus", None)
    first = vllm_plugin.worker_bus({})
    assert vllm_plugin.worker_bus({}) is first
    monkeypatch.setattr(vllm_plugin, "_bus_pid", -1)
    second = vllm_plugin.worker_bus({})
    assert second is not first
    first.close()
    second.close()


def test_events_log_variable_writes_jsonl_with_pid_and_rank(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """OMNITRACE_EVENTS_LOG attaches a JSONL sink whose lines carry the worker's pid and rank."""
    pytest.importorskip("omnitrace.sinks.jsonl")
    monkeypatch.setattr(vllm_plugin, "_bus", None)
    monkeypatch.setenv("RANK", "2")
    path = tmp_path / "events.jsonl"
    bus = vllm_plugin.worker_bus({"OMNITRACE_EVENTS_LOG": str(path), "RANK": "2"})
    graph = EncoderCudaGraph(lambda x: x, name="vision", config=EncoderGraphConfig(), bus=bus)

    graph(torch.ones(2))
    bus.close()
    records = [json.loads(line) for line in path.read_text().splitlines()]
    events = [r for r in records if r.get("type") == "GraphMissed"]
    assert events
    assert {(r["pid"], r["rank"]) for r in events} == {(os.getpid(), 2)}


def test_missing_sink_module_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    """A sink the environment asks for that cannot be imported raises PluginError naming it."""
    import sys

    monkeypatch.setattr(vllm_plugin, "_bus", None)
    monkeypatch.setitem(sys.modules, "omnitrace.sinks.jsonl", None)
    with pytest.raises(vllm_plugin.PluginError, match="OMNITRACE_EVENTS_LOG is set but"):
        vllm_plugin.worker_bus({"OMNITRACE_EVENTS_LOG": "/tmp/x.jsonl"})


def test_select_backend_without_config_logs_why_and_picks_torch(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """select_backend(None) returns the torch backend with one 'omnitrace' log line."""
    import logging

    from omnitrace.graphs.backends.select import select_backend
    from omnitrace.graphs.backends.torch import TorchGraphBackend

    with caplog.at_level(logging.INFO, logger="omnitrace"):
        backend = select_backend(None)
    assert isinstance(backend, TorchGraphBackend)
    lines = [r for r in caplog.records if r.name == "omnitrace.graphs.backends.select"]
    assert len(lines) == 1
    assert "no vllm_config was given" in lines[0].getMessage()


def test_select_backend_without_vllm_logs_why(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With a config but no importable vLLM, the torch backend is chosen and the log says so."""
    import importlib.util
    import logging

    from omnitrace.graphs.backends import select
    from omnitrace.graphs.backends.torch import TorchGraphBackend

    real = importlib.util.find_spec
    monkeypatch.setattr(
        select.importlib.util, "find_spec", lambda n, *a: None if n == "vllm" else real(n, *a)
    )
    with caplog.at_level(logging.INFO, logger="omnitrace"):
        backend = select.select_backend(object())
    assert isinstance(backend, TorchGraphBackend)
    assert [
        r.getMessage() for r in caplog.records if r.name == "omnitrace.graphs.backends.select"
    ] == ["omnitrace: using the torch graph backend (vLLM is not importable)"]


# -- vLLM's start-up profiling run ----------------------------------------------------------


class _Runner:
    """A stand-in for vLLM's GPUModelRunner: profile_run calls the encoders with dummies."""

    def __init__(self, model: Any) -> None:
        self.model = model
        self.seen: list[tuple[Phase, Phase]] = []

    def profile_run(self, randomize_inputs: bool = False) -> None:
        # vLLM's profiling runs the vision tower on dummy maximum-size inputs.
        vision, audio = self.model.vpm._encoder_graph, self.model._audio_encoder_graph
        self.seen.append((vision.phase, audio.phase))
        self.model.vpm(*image(side=32))
        if randomize_inputs:
            raise RuntimeError("profiling failed")


@pytest.fixture
def runner_module(monkeypatch: pytest.MonkeyPatch) -> types.ModuleType:
    """vLLM's model runner module, stood in for (the real one is checked in the vLLM tier)."""
    module = types.ModuleType(vllm_plugin._RUNNER_MODULE)
    runner = type("GPUModelRunner", (), {"profile_run": _Runner.profile_run})
    module.GPUModelRunner = runner  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, vllm_plugin._RUNNER_MODULE, module)
    monkeypatch.setattr(vllm_plugin, "_bus", None)
    monkeypatch.setattr(vllm_plugin, "_attached", weakref.WeakSet())
    return module


def _attach(model: Any) -> tuple[Any, list[Any]]:
    """Load ``model`` through the plugin; return a runner of it and the bus's event list."""
    vllm_plugin._after_load(model, None)
    bus = vllm_plugin._bus
    assert bus is not None
    events: list[Any] = []
    bus.add_fold(events.append)
    runner = sys.modules[vllm_plugin._RUNNER_MODULE].GPUModelRunner()
    _Runner.__init__(runner, model)
    return runner, events


def test_the_profiling_run_tags_every_attached_adapter_then_restores_serving(
    runner_module: types.ModuleType,
) -> None:
    """Inside vLLM's profile_run both adapters are in the profiling phase, and the vision
    call it makes is a profiling event; afterwards both serve again."""
    model = build()
    runner, events = _attach(model)
    assert getattr(runner_module.GPUModelRunner.profile_run, "_omnitrace_patched", False)
    runner.profile_run()
    assert runner.seen == [(Phase.PROFILING, Phase.PROFILING)]
    assert [e.phase for e in events] == [Phase.PROFILING]
    vision = model.vpm._encoder_graph
    assert (vision.phase, model._audio_encoder_graph.phase) == (Phase.SERVING, Phase.SERVING)
    model.vpm(*image(side=32))
    assert [e.phase for e in events] == [Phase.PROFILING, Phase.SERVING]
    vllm_plugin._bus.close()  # type: ignore[union-attr]


def test_phases_are_restored_when_the_profiling_run_raises(
    runner_module: types.ModuleType,
) -> None:
    """A profiling run that raises still leaves the adapters serving."""
    model = build()
    runner, _ = _attach(model)
    with pytest.raises(RuntimeError, match="profiling failed"):
        runner.profile_run(randomize_inputs=True)
    assert model.vpm._encoder_graph.phase is Phase.SERVING
    vllm_plugin._bus.close()  # type: ignore[union-attr]


def test_the_profiling_run_is_wrapped_once_however_many_models_load(
    runner_module: types.ModuleType,
) -> None:
    """A second model load leaves one wrapper, which tags both models' adapters."""
    first, second = build(), build(seed=1)
    runner, _ = _attach(first)
    wrapped = runner_module.GPUModelRunner.profile_run
    vllm_plugin._after_load(second, None)
    assert runner_module.GPUModelRunner.profile_run is wrapped
    assert wrapped.__wrapped__ is _Runner.profile_run
    assert len(vllm_plugin._attached) == 4
    other = runner_module.GPUModelRunner()
    _Runner.__init__(other, second)
    for each in (runner, other):
        each.profile_run()
        assert each.seen == [(Phase.PROFILING, Phase.PROFILING)]
    vllm_plugin._bus.close()  # type: ignore[union-attr]


def test_skip_profiling_keeps_profiling_calls_eager_and_out_of_admission(
    runner_module: types.ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With encoder_cuda_graph_skip_profiling the profiling run's calls are ineligible
    (detail profiling), and serving still captures its own shapes on their own calls."""
    from omnitrace.graphs.backends import select
    from omnitrace.testing import SimulatedGraphBackend

    # The CPU stands in for the device: the plugin's adapters get the simulated backend.
    monkeypatch.setattr(select, "select_backend", lambda config: SimulatedGraphBackend())
    model = build(encoder_cuda_graph_skip_profiling=True, encoder_cuda_graph_min_free_bytes=0)
    runner, events = _attach(model)
    with torch.no_grad():  # as vLLM serves
        for _ in range(3):
            runner.profile_run()
        profiling = [e for e in events if e.phase is Phase.PROFILING]
        assert [(e.reason, e.detail) for e in profiling] == [
            (MissReason.INELIGIBLE, "profiling")
        ] * 3
        vision = model.vpm._encoder_graph
        assert vision.num_graphs == 0
        for _ in range(2):
            model.vpm(*image(side=16))
    assert vision.num_graphs == 1
    assert vision.captured_keys()[0].startswith("float32[1,16,32]")
    vllm_plugin._bus.close()  # type: ignore[union-attr]


def test_without_vllms_profiling_run_the_plugin_says_so_once(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A vLLM without GPUModelRunner.profile_run gets one warning; loading goes on."""
    import logging

    module = types.ModuleType(vllm_plugin._RUNNER_MODULE)
    monkeypatch.setitem(sys.modules, vllm_plugin._RUNNER_MODULE, module)
    monkeypatch.setattr(vllm_plugin, "_profiling_missing_reported", False)
    with caplog.at_level(logging.WARNING, logger="omnitrace"):
        assert vllm_plugin._hook_profiling() is False
        assert vllm_plugin._hook_profiling() is False
    (line,) = [r.getMessage() for r in caplog.records if "profiling run" in r.getMessage()]
    assert line.startswith(
        "omnitrace: vLLM's profiling run vllm.v1.worker.gpu_model_runner.GPUModelRunner."
        "profile_run is not there ("
    )
    assert line.endswith("); encoder calls it makes are tagged as serving")
