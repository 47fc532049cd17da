"""The vLLM plugin's environment handling and worker identity (no vLLM needed)."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import types
import weakref
from pathlib import Path
from typing import Any

import pytest
import torch

from integrations.qwen_standins import build as build_qwen
from integrations.standins import build, image
from omnitrace import ConfigError, EncoderCudaGraph, EncoderGraphConfig, MissReason
from omnitrace.events import NO_SIGNATURE, Phase, ProfilingObserved
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


def _vllm_importable(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make backend selection find a vLLM (a spec only: nothing of vLLM is imported)."""
    import importlib.machinery
    import importlib.util

    from omnitrace.graphs.backends import select

    real = importlib.util.find_spec
    spec = importlib.machinery.ModuleSpec("vllm", None)
    monkeypatch.setattr(
        select.importlib.util, "find_spec", lambda n, *a: spec if n == "vllm" else real(n, *a)
    )


def test_background_capture_picks_the_thread_local_torch_backend_in_vllm_too(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """vLLM's manager captures in the global mode only: an adapter with background capture
    gets the torch backend even where vLLM is importable, through Adapters.make too, and the
    log says why; without it the vLLM backend is chosen."""
    from omnitrace.config import EncoderGraphConfig
    from omnitrace.graphs.backends import select
    from omnitrace.graphs.backends.torch import TorchGraphBackend
    from omnitrace.integrations.base import Adapters

    _vllm_importable(monkeypatch)
    chosen: list[object] = []

    class FakeVllmBackend:
        def __init__(self, vllm_config: object) -> None:
            chosen.append(vllm_config)

    fake = types.ModuleType("omnitrace.graphs.backends.vllm")
    fake.VllmGraphBackend = FakeVllmBackend  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "omnitrace.graphs.backends.vllm", fake)
    vllm_config = object()
    with caplog.at_level(logging.INFO, logger="omnitrace"):
        backend = select.select_backend(vllm_config, background_capture=True)
        adapter = Adapters(
            EncoderGraphConfig(background_capture=True), vllm_config=vllm_config
        ).make(lambda x: x, name="v")
    assert isinstance(backend, TorchGraphBackend)
    assert isinstance(adapter.backend, TorchGraphBackend)
    assert chosen == []
    lines = [r.getMessage() for r in caplog.records if r.name == select.__name__]
    assert (
        lines
        == [
            "omnitrace: using the torch graph backend (background capture captures in CUDA's "
            "thread-local mode; vLLM's encoder graph manager captures in the global mode only)"
        ]
        * 2
    )
    assert isinstance(select.select_backend(vllm_config), FakeVllmBackend)
    assert chosen == [vllm_config]


def test_background_compile_is_refused_inside_vllm(monkeypatch: pytest.MonkeyPatch) -> None:
    """Compiling on the preparation thread stops a vLLM engine (FX tracing patches module
    calls process-wide): with a vLLM config it is a ConfigError naming both keys, through
    select_backend and Adapters.make; each of the two alone is accepted."""
    from omnitrace.graphs.backends import select
    from omnitrace.graphs.backends.torch import TorchGraphBackend
    from omnitrace.integrations.base import Adapters

    _vllm_importable(monkeypatch)
    both = EncoderGraphConfig(background_capture=True, compile=True)
    pattern = (
        r"^encoder_cuda_graph_compile with encoder_cuda_graph_background_capture cannot run "
        r"inside vLLM: .*Detected that you are using FX"
    )
    with pytest.raises(ConfigError, match=pattern):
        select.select_backend(object(), background_capture=True, compile=True)
    with pytest.raises(ConfigError, match=pattern):
        Adapters(both, vllm_config=object()).make(lambda x: x, name="v")
    with pytest.raises(ConfigError, match=pattern):
        EncoderCudaGraph(lambda x: x, name="v", config=both, vllm_config=object())
    # Outside vLLM the combination stays allowed (with its documented warning).
    assert isinstance(Adapters(both).make(lambda x: x, name="v").backend, TorchGraphBackend)
    plain = select.select_backend(object(), background_capture=True)
    assert isinstance(plain, TorchGraphBackend)


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


def _language_model_only(self: Any) -> None:
    """V2's profile_run as vLLM 0.26 has it: a dummy run of the language model alone."""
    vision, audio = self.model.vpm._encoder_graph, self.model._audio_encoder_graph
    self.seen.append((vision.phase, audio.phase))


def _stand_in(monkeypatch: pytest.MonkeyPatch, name: str, profile_run: Any) -> types.ModuleType:
    """Put a stand-in of one of vLLM's model runner modules in sys.modules."""
    module = types.ModuleType(name)
    runner = type("GPUModelRunner", (), {"profile_run": profile_run})
    runner.__module__ = name
    module.GPUModelRunner = runner  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, name, module)
    return module


@pytest.fixture
def fresh_plugin(monkeypatch: pytest.MonkeyPatch) -> None:
    """The plugin as a new worker process has it: no bus, no adapter, nothing reported,
    and neither of vLLM's runner modules imported."""
    for name in vllm_plugin._RUNNER_MODULES:
        monkeypatch.delitem(sys.modules, name, raising=False)
    monkeypatch.setattr(vllm_plugin, "_bus", None)
    monkeypatch.setattr(vllm_plugin, "_attached", weakref.WeakSet())
    monkeypatch.setattr(vllm_plugin, "_no_encoder_reported_pid", None)
    monkeypatch.setattr(vllm_plugin, "_profiling_missing_reported", False)


@pytest.fixture
def runner_module(monkeypatch: pytest.MonkeyPatch, fresh_plugin: None) -> types.ModuleType:
    """vLLM's V1 model runner module, stood in for (the real one is checked in the vLLM
    tier); its profile_run calls the vision encoder."""
    return _stand_in(monkeypatch, vllm_plugin._RUNNER_MODULE, _Runner.profile_run)


@pytest.fixture
def v2_runner_module(monkeypatch: pytest.MonkeyPatch, fresh_plugin: None) -> types.ModuleType:
    """vLLM's V2 model runner module, stood in for; its profile_run calls no encoder."""
    return _stand_in(monkeypatch, vllm_plugin._RUNNER_V2_MODULE, _language_model_only)


def _attach(model: Any, module: str = vllm_plugin._RUNNER_MODULE) -> tuple[Any, list[Any]]:
    """Load ``model`` through the plugin; return a runner of it (of the runner class in
    ``module``) and the bus's event list."""
    vllm_plugin._after_load(model, None)
    bus = vllm_plugin._bus
    assert bus is not None
    events: list[Any] = []
    bus.add_fold(events.append)
    runner = sys.modules[module].GPUModelRunner()
    _Runner.__init__(runner, model)
    return runner, events


def _calls(events: list[Any]) -> list[Any]:
    """The call events among ``events`` (without the plugin's reports of profiling runs)."""
    return [e for e in events if not isinstance(e, ProfilingObserved)]


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
    assert [e.phase for e in _calls(events)] == [Phase.PROFILING]
    vision = model.vpm._encoder_graph
    assert (vision.phase, model._audio_encoder_graph.phase) == (Phase.SERVING, Phase.SERVING)
    model.vpm(*image(side=32))
    assert [e.phase for e in _calls(events)] == [Phase.PROFILING, Phase.SERVING]
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
    monkeypatch.setattr(select, "select_backend", lambda config, **_: SimulatedGraphBackend())
    model = build(encoder_cuda_graph_skip_profiling=True, encoder_cuda_graph_min_free_bytes=0)
    runner, events = _attach(model)
    with torch.no_grad():  # as vLLM serves
        for _ in range(3):
            runner.profile_run()
        profiling = [e for e in _calls(events) if e.phase is Phase.PROFILING]
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
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, fresh_plugin: None
) -> None:
    """A vLLM whose imported runner module has no GPUModelRunner.profile_run gets one
    warning naming it; loading goes on."""

    module = types.ModuleType(vllm_plugin._RUNNER_MODULE)
    monkeypatch.setitem(sys.modules, vllm_plugin._RUNNER_MODULE, module)
    with caplog.at_level(logging.WARNING, logger="omnitrace"):
        assert vllm_plugin._hook_profiling() is False
        assert vllm_plugin._hook_profiling() is False
    (line,) = [r.getMessage() for r in caplog.records if "profiling run" in r.getMessage()]
    assert line == (
        "omnitrace: vLLM's profiling run is not there (no vllm.v1.worker.gpu_model_runner."
        "GPUModelRunner.profile_run); encoder calls it makes are tagged as serving"
    )


def test_without_any_runner_module_the_warning_names_both(
    caplog: pytest.LogCaptureFixture, fresh_plugin: None
) -> None:
    """With neither runner module imported, nothing is imported for it and the one warning
    names both modules."""

    with caplog.at_level(logging.WARNING, logger="omnitrace"):
        assert vllm_plugin._hook_profiling() is False
    assert not set(vllm_plugin._RUNNER_MODULES) & set(sys.modules)
    (line,) = [r.getMessage() for r in caplog.records if "profiling run" in r.getMessage()]
    assert line == (
        "omnitrace: vLLM's profiling run is not there (neither model runner module is "
        "imported: vllm.v1.worker.gpu_model_runner, vllm.v1.worker.gpu.model_runner); "
        "encoder calls it makes are tagged as serving"
    )


# -- what the profiling run did with the encoders -------------------------------------------

V2_RUNNER = "vllm.v1.worker.gpu.model_runner.GPUModelRunner.profile_run"
V1_RUNNER = "vllm.v1.worker.gpu_model_runner.GPUModelRunner.profile_run"
NO_ENCODER_LINE = (
    f"omnitrace: vLLM's profiling run ({V2_RUNNER}) called no encoder; encoder graphs are "
    "first captured while serving, after the KV cache took its memory (each capture's free "
    "device memory is on its GraphCaptured event)"
)


def _plugin_lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == vllm_plugin.__name__]


def test_only_the_runner_module_vllm_imported_is_wrapped(
    v2_runner_module: types.ModuleType,
) -> None:
    """With only V2's runner imported, its profile_run is wrapped and V1's module is not
    imported by the plugin."""
    runner, _ = _attach(build(), vllm_plugin._RUNNER_V2_MODULE)
    wrapped = v2_runner_module.GPUModelRunner.profile_run
    assert getattr(wrapped, "_omnitrace_patched", False)
    assert wrapped.__wrapped__ is _language_model_only
    assert vllm_plugin._RUNNER_MODULE not in sys.modules
    runner.profile_run()
    assert runner.seen == [(Phase.PROFILING, Phase.PROFILING)]
    vllm_plugin._bus.close()  # type: ignore[union-attr]


def test_both_runners_are_wrapped_once_when_both_are_imported(
    runner_module: types.ModuleType, v2_runner_module: types.ModuleType
) -> None:
    """Where vLLM imported both runner modules, each profile_run gets one wrapper, however
    many models load."""
    _attach(build())
    vllm_plugin._after_load(build(seed=1), None)
    for module, original in (
        (runner_module, _Runner.profile_run),
        (v2_runner_module, _language_model_only),
    ):
        method = module.GPUModelRunner.profile_run
        assert method.__wrapped__ is original
        assert not hasattr(original, "__wrapped__")
    vllm_plugin._bus.close()  # type: ignore[union-attr]


def test_a_run_that_calls_no_encoder_is_reported_per_adapter_and_logged_once(
    v2_runner_module: types.ModuleType,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """V2's profiling run, which calls no encoder, yields a ProfilingObserved with zero
    calls per adapter after every run and one info line per worker process."""

    model = build()
    runner, events = _attach(model, vllm_plugin._RUNNER_V2_MODULE)
    with caplog.at_level(logging.INFO, logger="omnitrace"):
        runner.profile_run()
        runner.profile_run()
    observed = [e for e in events if isinstance(e, ProfilingObserved)]
    # Per run, one report per adapter (in no set order: the attached adapters are a set).
    assert sorted((e.adapter, e.runner, e.encoder_calls, e.phase) for e in observed) == [
        ("audio", V2_RUNNER, 0, Phase.PROFILING),
        ("audio", V2_RUNNER, 0, Phase.PROFILING),
        ("vision", V2_RUNNER, 0, Phase.PROFILING),
        ("vision", V2_RUNNER, 0, Phase.PROFILING),
    ]
    assert {e.signature for e in observed} == {NO_SIGNATURE}
    assert _calls(events) == []
    assert [line for line in _plugin_lines(caplog) if "called no encoder" in line] == [
        NO_ENCODER_LINE
    ]
    # A forked worker is another process: it says so once more.
    monkeypatch.setattr(vllm_plugin, "_no_encoder_reported_pid", -1)
    with caplog.at_level(logging.INFO, logger="omnitrace"):
        runner.profile_run()
    assert [line for line in _plugin_lines(caplog) if "called no encoder" in line] == [
        NO_ENCODER_LINE
    ] * 2
    vllm_plugin._bus.close()  # type: ignore[union-attr]


def test_a_run_that_calls_an_encoder_reports_its_calls_and_logs_nothing(
    runner_module: types.ModuleType, caplog: pytest.LogCaptureFixture
) -> None:
    """V1's profiling run, which calls the vision encoder, reports 1 call of vision and 0 of
    audio, and writes no 'called no encoder' line."""

    model = build()
    runner, events = _attach(model)
    with caplog.at_level(logging.INFO, logger="omnitrace"):
        runner.profile_run()
    observed = {e.adapter: e for e in events if isinstance(e, ProfilingObserved)}
    assert {name: (e.runner, e.encoder_calls) for name, e in observed.items()} == {
        "vision": (V1_RUNNER, 1),
        "audio": (V1_RUNNER, 0),
    }
    # The reports follow the run's call on the bus.
    assert events[0] is _calls(events)[0]
    assert set(events[1:]) == set(observed.values())
    assert not [line for line in _plugin_lines(caplog) if "called no encoder" in line]
    vllm_plugin._bus.close()  # type: ignore[union-attr]


def test_a_profiling_run_that_raises_reports_nothing(runner_module: types.ModuleType) -> None:
    """A profiling run that raises emits no ProfilingObserved (it did not finish)."""
    model = build()
    runner, events = _attach(model)
    with pytest.raises(RuntimeError, match="profiling failed"):
        runner.profile_run(randomize_inputs=True)
    assert not [e for e in events if isinstance(e, ProfilingObserved)]
    vllm_plugin._bus.close()  # type: ignore[union-attr]


# -- the plugin's log lines in a vLLM process -------------------------------------------------


def test_an_invalid_override_logs_one_error_line_then_raises(
    caplog: pytest.LogCaptureFixture, fresh_plugin: None
) -> None:
    """A bad ``encoder_cuda_graph_*`` value logs what to fix once, and the load still fails."""
    model = build(encoder_cuda_graph_max_graphs=-1)
    with (
        caplog.at_level(logging.INFO, logger="omnitrace"),
        pytest.raises(ConfigError, match="encoder_cuda_graph_max_graphs"),
    ):
        vllm_plugin._after_load(model, None)
    errors = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert [r.getMessage() for r in errors] == [
        "omnitrace: encoder_cuda_graph_max_graphs: expected an integer from 0 to 1024 "
        "(0 keeps no graph), got -1 (int); the worker stops (fix --hf-overrides, or set "
        "OMNITRACE_PLUGIN=0 to run without omnitrace)"
    ]


_SHOW_LOGS = """
import logging, sys
from omnitrace.integrations.vllm_logging import show_plugin_logs
vllm = logging.getLogger("vllm")
handler = logging.StreamHandler(sys.stdout)
handler.setFormatter(logging.Formatter("VLLM %(levelname)s %(message)s"))
vllm.addHandler(handler)
env = dict(a.split("=", 1) for a in sys.argv[1:])
added = show_plugin_logs(env)
again = show_plugin_logs(env)
logging.getLogger("omnitrace.integrations.vllm_plugin").info("omnitrace: attached")
print("added" if added is not None else "none", "again" if again is not None else "none")
"""


@pytest.mark.parametrize(
    ("environ", "expected"),
    [
        ((), "VLLM INFO omnitrace: attached\nadded none\n"),
        (("VLLM_CONFIGURE_LOGGING=0",), "none none\n"),
    ],
)
def test_plugin_lines_print_beside_vllms_in_its_format(
    environ: tuple[str, ...], expected: str
) -> None:
    """In a process where only vLLM's logger has a handler, omnitrace's INFO lines use it."""
    done = subprocess.run(
        [sys.executable, "-c", _SHOW_LOGS, *environ],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    assert done.stdout == expected
    assert done.stderr == ""


def test_a_host_that_configured_logging_keeps_it() -> None:
    """With a handler on the root logger, the plugin adds none of its own."""
    from omnitrace.integrations.vllm_logging import show_plugin_logs

    assert logging.getLogger().handlers, "pytest's own handler is on the root logger"
    assert show_plugin_logs({}) is None
    assert not logging.getLogger("omnitrace").handlers


def _engine_config(size: int, *, mode: str = "FULL_AND_PIECEWISE", eager: bool = False) -> Any:
    """The parts of a VllmConfig the language-model graph notice reads."""
    return types.SimpleNamespace(
        model_config=types.SimpleNamespace(enforce_eager=eager),
        compilation_config=types.SimpleNamespace(
            cudagraph_mode=types.SimpleNamespace(name=mode), max_cudagraph_capture_size=size
        ),
    )


@pytest.mark.parametrize(
    ("config", "warned"),
    [
        (_engine_config(64), True),
        (_engine_config(511), True),
        (_engine_config(512), False),
        (_engine_config(64, eager=True), False),
        (_engine_config(64, mode="NONE"), False),
        (None, False),
    ],
)
def test_a_small_language_model_graph_size_is_named_with_the_setting_that_raises_it(
    config: Any, warned: bool
) -> None:
    """Below 512 tokens a multimodal prompt's prefill runs outside vLLM's graphs: the notice
    names the size and the option; graphs off, or at 512, say nothing."""
    notice = vllm_plugin.language_model_graph_notice(config)
    if not warned:
        assert notice is None
        return
    assert notice is not None
    size = config.compilation_config.max_cudagraph_capture_size
    assert f"at most {size} tokens" in notice
    option = notice.split("--compilation-config ")[1].split("'")[1]
    assert json.loads(option) == {"max_cudagraph_capture_size": vllm_plugin.LM_GRAPH_TOKENS}


def test_the_plugin_logs_the_language_model_graph_notice_when_it_attaches(
    fresh_plugin: None, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger=vllm_plugin.__name__):
        vllm_plugin._after_load(build(), _engine_config(64))
    notices = [r for r in caplog.records if "CUDA graphs for steps of at most 64" in r.getMessage()]
    assert len(notices) == 1
    assert notices[0].levelno == logging.WARNING


def test_the_plugin_logs_the_audio_processor_notice_once_when_it_attaches(
    fresh_plugin: None, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A Qwen2.5-Omni thinker attached with a 300-s pad: one warning, before serving."""
    (tmp_path / "preprocessor_config.json").write_text(json.dumps({"n_samples": 4_800_000}))
    config = types.SimpleNamespace(
        model_config=types.SimpleNamespace(model=str(tmp_path), enforce_eager=True)
    )
    with caplog.at_level(logging.WARNING, logger=vllm_plugin.__name__):
        vllm_plugin._after_load(build_qwen(encoder_cuda_graph_min_free_bytes=0), config)
    notices = [r for r in caplog.records if "pads every audio clip" in r.getMessage()]
    assert len(notices) == 1
    assert notices[0].levelno == logging.WARNING
