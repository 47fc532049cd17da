"""Conformance with the installed vLLM: protocol, copied configs, API detection, plugin.

Runs wherever vLLM imports (CI installs it on CPU torch, see .ci/tiers/vllm.sh); skips
cleanly elsewhere. The CPU graph below records the ATen ops of the capture and re-runs them
on replay, reading the same static input buffers and writing the same output buffer, so the
real vLLM manager's capture, replay, copy-in and postprocessing all run without a GPU.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import itertools
import os
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, ClassVar

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves, tree_map

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
vllm = pytest.importorskip("vllm", reason="vLLM is not installed (CI installs it)")

from omnitrace import EncoderCudaGraph, EncoderGraphConfig  # noqa: E402
from omnitrace.graphs.backends.select import select_backend  # noqa: E402
from omnitrace.graphs.backends.vllm import (  # noqa: E402
    ExactShapeEncoder,
    UnsupportedVllmError,
    VllmGraphBackend,
    copy_vllm_config,
    detect_vllm_api,
    load_vllm_api,
)
from omnitrace.graphs.eligibility import signature_of  # noqa: E402

pytestmark = pytest.mark.vllm

defs = pytest.importorskip("vllm.v1.worker.encoder_cudagraph_defs")
manager_module = pytest.importorskip("vllm.v1.worker.encoder_cudagraph")
interfaces = pytest.importorskip("vllm.model_executor.models.interfaces")


def _config() -> Any:
    from vllm.config import VllmConfig

    return VllmConfig()


def _encoder(x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    y = torch.tanh(x @ x.transpose(-1, -2)) @ x
    return y if mask is None else y + mask


def _exact_model(api: Any, *inputs: torch.Tensor | None) -> ExactShapeEncoder:
    out = _encoder(*inputs)  # type: ignore[arg-type]
    return ExactShapeEncoder(api, _encoder, list(inputs), None, [(out.shape, out.dtype)])


# -- the CPU graph: record ATen ops at capture, re-run them at replay -----------------------


class _Tape(TorchDispatchMode):
    def __init__(self, tape: list[tuple[Any, Any, Any, Any]]) -> None:
        super().__init__()
        self.tape = tape

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        self.tape.append((func, args, kwargs, out))
        return out


class CpuGraph:
    """Stands in for torch.cuda.CUDAGraph: replays recorded ops on the same buffers."""

    instances: ClassVar[list[CpuGraph]] = []

    def __init__(self) -> None:
        self.tape: list[tuple[Any, Any, Any, Any]] = []
        self.pool: Any = None
        self.stream: Any = None
        CpuGraph.instances.append(self)

    def replay(self) -> None:
        env: dict[int, torch.Tensor] = {}

        def sub(x: Any) -> Any:
            return env.get(id(x), x) if isinstance(x, torch.Tensor) else x

        with torch.inference_mode():
            for func, args, kwargs, out in self.tape:
                new = func(*tree_map(sub, args), **tree_map(sub, kwargs))
                for old, fresh in zip(tree_leaves(out), tree_leaves(new), strict=True):
                    if isinstance(old, torch.Tensor):
                        env[id(old)] = fresh


class _Stream:
    """A named stand-in for a CUDA stream; the stack below says which one is current."""

    def __init__(self, name: str) -> None:
        self.name = name

    def wait_stream(self, other: object) -> None:
        pass

    def __repr__(self) -> str:
        return f"<stream {self.name}>"


REPLAY = _Stream("replay")
_current: list[_Stream] = [REPLAY]
_capturing: list[bool] = [False]
# (stream current at the call, whether a capture was recording) for every encoder forward.
forward_log: list[tuple[_Stream, bool]] = []
#: Whether each logged forward ran in inference mode, as vLLM's manager captures.
inference_log: list[bool] = []


@contextlib.contextmanager
def _stream_scope(stream: _Stream) -> Iterator[None]:
    _current.append(stream)
    try:
        yield
    finally:
        _current.pop()


@contextlib.contextmanager
def _cpu_graph_capture(
    graph: CpuGraph, pool: Any = None, stream: Any = None, **_: Any
) -> Iterator[None]:
    # Like torch.cuda.graph: without a stream argument, the class's default capture stream.
    if stream is None:
        stream = getattr(_cpu_graph_capture, "default_capture_stream", None)
    # Like torch.cuda.graph: empty the device and pinned-host allocators' caches first.
    torch.cuda.empty_cache()
    host_empty = getattr(torch._C, "_host_emptyCache", None)
    if host_empty is not None:
        host_empty()
    graph.pool, graph.stream = pool, stream
    with _stream_scope(stream), _Tape(graph.tape):
        _capturing[0] = True
        try:
            yield
        finally:
            _capturing[0] = False


def _logged(forward: Callable[..., Any]) -> Callable[..., Any]:
    def run(*args: Any) -> Any:
        forward_log.append((_current[-1], _capturing[0]))
        inference_log.append(torch.is_inference_mode_enabled())
        return forward(*args)

    return run


class CpuVllmBackend(VllmGraphBackend):
    """The vLLM backend with CPU answers to the device questions (test double)."""

    _ids = itertools.count(1)

    def is_graph_device(self, device: torch.device) -> bool:
        return True

    def is_capturing(self, device: torch.device) -> bool:
        return False

    def stream_id(self, device: torch.device) -> int:
        return 0

    def device_free_bytes(self, device: torch.device) -> int:
        return 1 << 40

    def new_pool(self, device: torch.device) -> Any:
        return ("pool", next(self._ids))

    def new_capture_stream(self, device: torch.device) -> tuple[Any, int]:
        stream = _Stream(f"capture-{next(self._ids)}")
        return stream, id(stream)

    def _device_scope(self, device: torch.device) -> Any:
        return contextlib.nullcontext()

    def _current_stream(self, device: torch.device) -> Any:
        return _current[-1]

    def _stream_scope(self, stream: Any) -> Any:
        return _stream_scope(stream)

    def _capturing(self) -> bool:
        return _capturing[0]

    def _allocated(self, device: torch.device) -> int:
        return 0

    def _device_index(self, device: torch.device) -> int | None:
        return None


@pytest.fixture
def cpu_graphs(monkeypatch: pytest.MonkeyPatch) -> list[CpuGraph]:
    CpuGraph.instances = []
    forward_log.clear()
    inference_log.clear()
    monkeypatch.setattr(torch.cuda, "CUDAGraph", CpuGraph)
    monkeypatch.setattr(torch.cuda, "graph", _cpu_graph_capture)
    # Newer vLLM captures on vllm's current_stream(); 0.26 passes no stream at all.
    monkeypatch.setattr(manager_module, "current_stream", lambda: _current[-1], raising=False)
    return CpuGraph.instances


# -- tests -----------------------------------------------------------------------------------


def test_detected_api_matches_the_installed_vllm() -> None:
    """load_vllm_api reports the installed version and the 'values' buffer layout."""
    api = load_vllm_api()
    assert api.version == vllm.__version__
    assert api.values_field == "values"
    assert api.manager_cls is manager_module.EncoderCudaGraphManager


def test_exact_shape_model_satisfies_supports_encoder_cudagraph() -> None:
    """vLLM's own supports_encoder_cudagraph() accepts the exact-shape model."""
    model = _exact_model(load_vllm_api(), torch.randn(1, 6, 4), None)
    assert interfaces.supports_encoder_cudagraph(model)


def test_exact_shape_model_builds_vllm_data_classes() -> None:
    """Config, item spec and buffers are vLLM's classes with one item filling the budget."""
    api = load_vllm_api()
    x = torch.randn(2, 6, 4)
    model = _exact_model(api, x, None)
    config = model.get_encoder_cudagraph_config()
    assert isinstance(config, defs.EncoderCudaGraphConfig)
    assert config.buffer_keys == ["input_0"]
    assert config.out_hidden_size == 4
    assert model.token_budget == 12
    (spec,) = model.get_encoder_cudagraph_item_specs({"input_0": x})
    assert spec.output_tokens == 12
    capture = model.prepare_encoder_cudagraph_capture_inputs(12, 1, 0, x.device, x.dtype)
    assert isinstance(capture, defs.EncoderCudaGraphCaptureInputs)
    assert capture.values["input_0"] is x


def test_manager_is_built_from_copied_configs_without_touching_the_originals() -> None:
    """The manager sees one budget and one item; the caller's config objects are unchanged."""
    config = _config()
    compilation = config.compilation_config
    before = (
        list(compilation.encoder_cudagraph_token_budgets),
        compilation.encoder_cudagraph_max_vision_items_per_batch,
        compilation.encoder_cudagraph_max_frames_per_batch,
    )
    model_config = config.model_config
    api = load_vllm_api()
    model = _exact_model(api, torch.randn(1, 6, 4), None)
    copied = copy_vllm_config(config, model.token_budget)
    manager = api.manager_cls(copied, torch.device("cpu"), torch.float32, model)
    assert manager.token_budgets == [6]
    assert manager.max_batch_size == 1
    assert manager.max_frames_per_batch == 0
    assert manager.use_dp is False
    assert copied.compilation_config is not compilation
    assert config.compilation_config is compilation
    assert config.model_config is model_config
    after = (
        list(compilation.encoder_cudagraph_token_budgets),
        compilation.encoder_cudagraph_max_vision_items_per_batch,
        compilation.encoder_cudagraph_max_frames_per_batch,
    )
    assert after == before


def test_legacy_buffer_layout_is_rejected_naming_the_version() -> None:
    """A vLLM whose capture inputs have (mm_kwargs, buffers) fields is refused by version."""
    from dataclasses import make_dataclass

    legacy = type(
        "Defs",
        (),
        {
            "EncoderCudaGraphConfig": defs.EncoderCudaGraphConfig,
            "EncoderItemSpec": defs.EncoderItemSpec,
            "EncoderCudaGraphCaptureInputs": make_dataclass("C", ["mm_kwargs", "buffers"]),
            "EncoderCudaGraphReplayBuffers": make_dataclass("R", ["buffers"]),
        },
    )
    with pytest.raises(UnsupportedVllmError, match=r"vLLM 0\.22\.0 .*mm_kwargs, buffers"):
        detect_vllm_api("0.22.0", legacy, manager_module.EncoderCudaGraphManager)


def test_select_backend_returns_the_vllm_backend_with_a_config() -> None:
    """With vLLM importable and a config given, select_backend picks the vLLM backend."""
    backend = select_backend(_config())
    assert isinstance(backend, VllmGraphBackend)
    assert backend.vllm_version == vllm.__version__


def _run(
    backend: VllmGraphBackend,
    forward: Callable[..., Any],
    calls: list[tuple[Any, ...]],
    config: EncoderGraphConfig,
) -> tuple[EncoderCudaGraph, list[Any]]:
    graph = EncoderCudaGraph(forward, name="vision", config=config, backend=backend)
    with torch.no_grad():
        outs = [graph(*args) for args in calls]
    return graph, outs


def test_replays_through_vllm_manager_equal_eager(cpu_graphs: list[CpuGraph]) -> None:
    """Outputs served by vLLM's manager equal eager outputs and are cloned, not buffers."""
    backend = CpuVllmBackend(_config())
    x = torch.randn(1, 6, 4)
    mask = torch.randn(1, 6, 4)
    calls = [(x * i, mask) for i in range(1, 6)]
    config = EncoderGraphConfig(min_free_bytes=0)
    graph, outs = _run(backend, _encoder, calls, config)
    for (a, m), out in zip(calls, outs, strict=True):
        assert torch.equal(out, _encoder(a, m))
    assert len(cpu_graphs) == 1
    assert outs[1].data_ptr() != outs[2].data_ptr()
    assert graph.get_cumulative_stats()["graph_hits"] == 4


def test_manager_receives_the_adapters_pool(cpu_graphs: list[CpuGraph]) -> None:
    """With shared pools one pool handle reaches every manager; with separate pools each differs."""
    for share, distinct in ((True, 1), (False, 2)):
        CpuGraph.instances.clear()
        backend = CpuVllmBackend(_config())
        calls = [(torch.randn(1, n, 4), None) for n in (3, 3, 5, 5)]
        _run(backend, _encoder, calls, EncoderGraphConfig(min_free_bytes=0, share_pools=share))
        pools = {g.pool for g in CpuGraph.instances}
        streams = {g.stream.name for g in CpuGraph.instances}
        assert len(CpuGraph.instances) == 2
        assert len(pools) == distinct
        assert len(streams) == distinct
        assert all(name.startswith("capture-") for name in streams)


def test_vllm_captures_on_the_adapters_stream_and_warms_up_off_it(
    cpu_graphs: list[CpuGraph],
) -> None:
    """Every vLLM version captures on the adapter's capture stream; no eager run happens there."""
    backend = CpuVllmBackend(_config())
    calls = [(torch.randn(1, n, 4), None) for n in (3, 3, 3, 5, 5)]
    graph, _ = _run(backend, _logged(_encoder), calls, EncoderGraphConfig(min_free_bytes=0))
    assert graph.num_graphs == 2
    captured = [stream for stream, capturing in forward_log if capturing]
    eager = [stream for stream, capturing in forward_log if not capturing]
    assert len(captured) == 2
    assert {g.stream for g in CpuGraph.instances} == set(captured)
    # The warm-up misses, then one run before each capture, on replay; vLLM's own warm-up
    # runs no forward.
    assert len(eager) == 4
    assert all(stream is REPLAY for stream in eager)
    assert getattr(torch.cuda.graph, "default_capture_stream", None) is None


def test_a_capture_runs_the_forward_once_in_vllms_inference_mode_before_vllms_capture(
    cpu_graphs: list[CpuGraph],
) -> None:
    """The capturing call runs the forward once off the capture stream, in inference mode as
    vLLM's manager captures (code torch.compile built inside the forward recompiles for
    inference tensors, and must not do so inside the capture), then only the capture; a key
    prepared with no call before does the same. The eager calls keep the caller's mode."""
    backend = CpuVllmBackend(_config())
    x = torch.randn(1, 4, 4)
    graph = EncoderCudaGraph(
        _logged(_encoder),
        name="vision",
        config=EncoderGraphConfig(min_free_bytes=0),
        backend=backend,
    )
    with torch.no_grad():
        first = graph(x, None)
        assert inference_log == [False]
        del forward_log[:], inference_log[:]
        second = graph(x * 2, None)
        assert [capturing for _, capturing in forward_log] == [False, True]
        assert inference_log == [True, True]
        assert torch.equal(first, _encoder(x, None))
        assert torch.equal(second, _encoder(x * 2, None))
        del forward_log[:], inference_log[:]
        signature = signature_of((torch.randn(1, 7, 4), None))
        assert graph.prepare(signature, torch.device("cpu")) == "captured"
        assert [capturing for _, capturing in forward_log] == [False, True]
        assert inference_log == [True, True]
        y = torch.randn(1, 7, 4)
        assert torch.equal(graph(y, None), _encoder(y, None))
    stats = graph.get_cumulative_stats()
    assert (stats["num_graphs"], stats["graph_hits"], stats["graph_misses"]) == (2, 2, 1)


def test_a_compiled_capture_runs_its_own_forward_before_vllms_capture(
    cpu_graphs: list[CpuGraph], monkeypatch: pytest.MonkeyPatch
) -> None:
    """With ``compile``, the eager calls ran another forward than the one captured: the
    capturing call runs the compiled forward once on replay (where it compiles), then
    captures it, instead of sizing the model from the eager call."""
    compiled_log: list[bool] = []

    def compile_forward(forward: Callable[..., Any], **_: Any) -> Callable[..., Any]:
        def compiled(*args: Any) -> Any:
            compiled_log.append(_capturing[0])
            return forward(*args)

        return compiled

    monkeypatch.setattr("omnitrace.graphs.adapter.compile_forward", compile_forward)
    config = EncoderGraphConfig(min_free_bytes=0, compile=True)
    graph = EncoderCudaGraph(
        _logged(_encoder), name="vision", config=config, backend=CpuVllmBackend(_config())
    )
    x = torch.randn(1, 4, 4)
    with torch.no_grad():
        graph(x, None)
        assert compiled_log == []
        assert torch.equal(graph(x * 2, None), _encoder(x * 2, None))
    assert compiled_log == [False, True]
    assert graph.num_graphs == 1


def test_captures_keep_the_allocator_caches_on_their_thread_only(
    cpu_graphs: list[CpuGraph], monkeypatch: pytest.MonkeyPatch
) -> None:
    """torch.cuda.graph's emptying of the device and pinned-host caches does nothing on the
    capturing thread, goes through on others during the capture, and is restored after a
    capture, also after one that failed."""
    emptied: list[str] = []
    device_empty = lambda: emptied.append(threading.current_thread().name)  # noqa: E731
    host_empty = lambda: emptied.append("host")  # noqa: E731
    monkeypatch.setattr(torch.cuda, "empty_cache", device_empty)
    monkeypatch.setattr(torch._C, "_host_emptyCache", host_empty, raising=False)

    def encoder(x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        if _capturing[0]:
            other = threading.Thread(target=torch.cuda.empty_cache, name="other")
            other.start()
            other.join()
            if x.shape[1] == 9:
                raise RuntimeError("capture failed")
        return _encoder(x, mask)

    backend = CpuVllmBackend(_config())
    calls = [(torch.randn(1, n, 4), None) for n in (3, 3, 5, 5)]
    graph, outs = _run(backend, encoder, calls, EncoderGraphConfig(min_free_bytes=0))
    assert graph.num_graphs == 2
    assert all(torch.equal(o, _encoder(*c)) for o, c in zip(outs, calls, strict=True))
    assert emptied == ["other", "other"]
    assert torch.cuda.empty_cache is device_empty
    assert torch._C._host_emptyCache is host_empty
    failing = EncoderCudaGraph(
        encoder,
        name="v2",
        config=EncoderGraphConfig(min_free_bytes=0),
        backend=CpuVllmBackend(_config()),
    )
    x = torch.randn(1, 9, 4)
    with torch.no_grad():
        failing(x, None)
        with pytest.raises(RuntimeError, match="capture failed"):
            failing(x, None)
    assert torch.cuda.empty_cache is device_empty
    assert torch._C._host_emptyCache is host_empty
    torch.cuda.empty_cache()
    assert emptied == ["other", "other", "other", "MainThread"]


def test_bytes_reserved_is_the_allocators_growth_across_the_capture(
    cpu_graphs: list[CpuGraph],
) -> None:
    """A graph's bytes are what the allocator took from the device during its capture (the
    counter's growth), and never negative when the counter was reset meanwhile."""

    class Counting(CpuVllmBackend):
        def __init__(self, readings: list[int]) -> None:
            super().__init__(_config())
            self.readings = readings

        def _allocated(self, device: torch.device) -> int:
            return self.readings.pop(0)

    backend = Counting([1000, 1000 + 4096, 9000, 0])
    config = EncoderGraphConfig(min_free_bytes=0)
    graph, _ = _run(backend, _encoder, [(torch.randn(1, n, 4), None) for n in (3, 3, 5, 5)], config)
    assert [g.bytes_reserved for g in backend._graphs] == [4096, 0]
    assert backend.readings == []
    assert graph.num_graphs == 2


def test_merged_manager_stats_agree_with_the_adapter_fold(cpu_graphs: list[CpuGraph]) -> None:
    """vLLM's counters plus the calls rejected before any manager equal the adapter's stats."""
    backend = CpuVllmBackend(_config())
    shapes = [3, 3, 3, 5, 7, 5, 9, 9, 3, 7, 7]
    calls = [(torch.randn(1, n, 4), None) for n in shapes]
    config = EncoderGraphConfig(min_free_bytes=0, max_graphs=2)
    graph, _ = _run(backend, _encoder, calls, config)
    with torch.enable_grad():
        graph(torch.randn(1, 3, 4), None)  # ineligible: never reaches a manager
    adapter = graph.get_cumulative_stats()
    manager = backend.manager_stats()
    assert manager.graph_hits == adapter["graph_hits"] > 0
    assert manager.graph_misses == 0
    assert adapter["capacity_misses"] > 0
    assert backend.merged_stats(adapter) == adapter


def test_multiple_outputs_round_trip_through_one_vllm_buffer(cpu_graphs: list[CpuGraph]) -> None:
    """A forward returning a dict of tensors of different dtypes is packed and unpacked exactly."""

    def forward(x: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"h": x * 2, "n": (x > 0).sum(-1)}

    backend = CpuVllmBackend(_config())
    x = torch.randn(2, 5)
    graph, outs = _run(backend, forward, [(x,)] * 3, EncoderGraphConfig(min_free_bytes=0))
    for out in outs:
        assert torch.equal(out["h"], x * 2)
        assert torch.equal(out["n"], (x > 0).sum(-1))
    assert graph.num_graphs == 1


def test_plugin_entry_point_is_declared_by_the_installed_package() -> None:
    """omnitrace's metadata declares vllm.general_plugins: omnitrace -> vllm_plugin:register."""
    points = importlib.metadata.entry_points(group="vllm.general_plugins")
    ours = [p for p in points if p.name == "omnitrace"]
    assert ours, 'pyproject.toml lacks [project.entry-points."vllm.general_plugins"] omnitrace'
    from omnitrace.integrations.vllm_plugin import register

    assert ours[0].load() is register


def test_vllm_plugin_loader_finds_and_loads_the_entry_point(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """vLLM's own plugin loader resolves the entry point spec to omnitrace's register()."""
    dist = tmp_path / "omnitrace_ep_probe-0.0.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: omnitrace-ep-probe\nVersion: 0.0.0\n"
    )
    (dist / "entry_points.txt").write_text(
        "[vllm.general_plugins]\nomnitrace_probe = omnitrace.integrations.vllm_plugin:register\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delenv("VLLM_PLUGINS", raising=False)
    from vllm.plugins import load_plugins_by_group

    from omnitrace.integrations.vllm_plugin import register

    plugins = load_plugins_by_group("vllm.general_plugins")
    assert plugins.get("omnitrace_probe") is register


def test_plugin_register_hooks_vllms_model_loader(monkeypatch: pytest.MonkeyPatch) -> None:
    """register() wraps BaseModelLoader.load_model once, however often vLLM calls it."""
    from vllm.model_executor.model_loader import base_loader

    original = base_loader.BaseModelLoader.load_model
    monkeypatch.setattr(base_loader.BaseModelLoader, "load_model", original)
    from omnitrace.integrations.vllm_plugin import register

    assert register({}) is True
    wrapped = base_loader.BaseModelLoader.load_model
    assert wrapped is not original
    assert register({}) is True
    assert base_loader.BaseModelLoader.load_model is wrapped
    assert register({"OMNITRACE_PLUGIN": "0"}) is False


def test_importing_omnitrace_does_not_import_vllm() -> None:
    """A fresh interpreter importing omnitrace and its integrations leaves vLLM unimported."""
    import subprocess

    code = (
        "import sys, omnitrace, omnitrace.graphs.backends.vllm, omnitrace.graphs.backends.select, "
        "omnitrace.integrations.minicpmo, omnitrace.integrations.vllm_plugin; "
        "print('vllm' in sys.modules)"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    )
    assert result.stdout.strip() == "False"


def test_the_preparation_reads_vllms_api_server_count_and_ready_timeout(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Preparing before serving stops within ``VLLM_ENGINE_READY_TIMEOUT_S`` only where
    several API servers wait for the engine: the count vLLM's ``serve`` gives the engine's
    config and the timeout are read from this vLLM's own names."""
    import inspect

    from vllm.config import ParallelConfig
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.worker.worker_base import WorkerBase

    from omnitrace.integrations import vllm_startup

    # The warm-up wrapper reads the worker's config.
    assert "self.vllm_config = vllm_config" in inspect.getsource(WorkerBase.__init__)
    monkeypatch.setenv("VLLM_ENGINE_READY_TIMEOUT_S", "123")
    config = _config()
    assert vllm_startup._ready_timeout_s(config) is None  # one API server: no limit
    # `vllm serve --api-server-count 4` sets the engine arguments' count, which make the
    # engine's parallel config with it.
    assert EngineArgs._api_process_count == 1
    config.parallel_config = ParallelConfig(_api_process_count=4)
    assert vllm_startup._ready_timeout_s(config) == 123


# -- MiniCPM-o's batch audio method ---------------------------------------------------------


def _vllm_minicpmo() -> Any:
    return pytest.importorskip("vllm.model_executor.models.minicpmo")


def test_audio_wrapper_targets_a_method_of_vllms_minicpmo_classes() -> None:
    """The batch audio method instrument() wraps exists, in its known shape, on vLLM's classes."""
    from omnitrace.integrations.minicpmo import AUDIO_BATCH_METHODS, audio_batch_method

    minicpmo = _vllm_minicpmo()
    for cls in (minicpmo.MiniCPMO, minicpmo.MiniCPMO2_6, minicpmo.MiniCPMO4_5):
        name = audio_batch_method(cls)
        assert name in AUDIO_BATCH_METHODS, f"{cls.__name__}: no recognised batch audio method"
        assert callable(getattr(cls, name))


def test_routed_audio_equals_vllms_own_batch_audio_method() -> None:
    """With vLLM's real method bound on a stand-in, the routed calls equal the original exactly."""
    from integrations.standins import MiniCPMOStandIn, audio_batch
    from omnitrace.integrations.minicpmo import audio_batch_method, instrument
    from omnitrace.testing import SimulatedGraphBackend

    base = _vllm_minicpmo().MiniCPMOBaseModel
    name = audio_batch_method(base)
    assert name is not None
    members = {
        attr: getattr(base, attr)
        for attr in (name, "subsequent_chunk_mask", "_get_feat_extract_output_lengths")
    }
    upstream = type("UpstreamAudio", (MiniCPMOStandIn,), members)

    def build() -> Any:
        torch.manual_seed(0)
        return upstream(encoder_cuda_graph_min_free_bytes=0).eval()

    reference, model = build(), build()
    backend = SimulatedGraphBackend()
    result = instrument(model, backend=backend)
    assert result.audio_method == name
    with torch.no_grad():
        for slices in (((20, 14), (6,)), ((12,), (20,), (9, 9))):
            data = audio_batch(slices)
            want = getattr(reference, name)(data)
            for _ in range(3):
                got = getattr(model, name)(data)
                assert len(got) == len(want)
                assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))
    assert backend.captures == 2
    assert result.audio.get_cumulative_stats()["graph_hits"] == 4  # type: ignore[union-attr]


def test_hits_replay_the_managers_graph_directly_and_count_in_the_manager(
    cpu_graphs: list[CpuGraph], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A hit replays the manager's captured graph without execute(); vLLM still counts it."""
    backend = CpuVllmBackend(_config())
    x = torch.randn(1, 6, 4)
    calls = [(x * i, None) for i in range(1, 6)]
    executed: list[int] = []
    original = manager_module.EncoderCudaGraphManager.execute

    def counting_execute(self: Any, mm_kwargs: Any) -> Any:
        executed.append(1)
        return original(self, mm_kwargs)

    monkeypatch.setattr(manager_module.EncoderCudaGraphManager, "execute", counting_execute)
    graph, outs = _run(backend, _encoder, calls, EncoderGraphConfig(min_free_bytes=0))
    for (a, m), out in zip(calls, outs, strict=True):
        assert torch.equal(out, _encoder(a, m))
    (captured,) = backend._graphs
    assert captured.direct
    assert executed == []
    assert backend.manager_stats().graph_hits == graph.get_cumulative_stats()["graph_hits"] == 4


def test_an_unknown_graph_layout_replays_through_execute(cpu_graphs: list[CpuGraph]) -> None:
    """A manager whose captured graphs are laid out otherwise is driven through execute()."""
    from omnitrace.graphs.backends.vllm import captured_budget_graph

    class Other:
        def __init__(self) -> None:
            self.budget_graphs: dict[str, dict[int, Any]] = {"default": {}}
            self.graph_hits = 0

    assert captured_budget_graph(Other()) is None
    assert captured_budget_graph(object()) is None


# -- the start-up profiling run ----------------------------------------------------------------


def test_plugin_wraps_the_profiling_run_vllms_worker_calls(monkeypatch: pytest.MonkeyPatch) -> None:
    """GPUModelRunner.profile_run, which vLLM's worker calls to profile at start-up (and the
    CPU runner inherits), is wrapped once, keeps its signature, and runs vLLM's own code with
    the attached adapters in the profiling phase, restoring serving when it ends."""
    import inspect
    import weakref

    from vllm.v1.worker import gpu_model_runner, gpu_worker

    from omnitrace.events import Phase
    from omnitrace.integrations import vllm_plugin
    from omnitrace.testing import SimulatedGraphBackend

    runner = gpu_model_runner.GPUModelRunner
    # Another test's model load may have wrapped it already: start from vLLM's own.
    original = inspect.unwrap(runner.profile_run)
    assert original.__module__ == gpu_model_runner.__name__
    assert "model_runner.profile_run(" in inspect.getsource(gpu_worker.Worker)
    monkeypatch.setattr(runner, "profile_run", original)
    graph = EncoderCudaGraph(lambda x: x, name="probe", backend=SimulatedGraphBackend())
    monkeypatch.setattr(vllm_plugin, "_attached", weakref.WeakSet([graph]))

    assert vllm_plugin._hook_profiling() is True
    assert vllm_plugin._hook_profiling() is True
    wrapped = runner.profile_run
    assert wrapped is not original
    assert wrapped.__wrapped__ is original  # type: ignore[attr-defined]
    assert inspect.signature(wrapped) == inspect.signature(original)

    seen: list[Phase] = []

    class Stop(Exception):
        pass

    class Probe(runner):  # type: ignore[misc, valid-type]
        @property
        def supports_mm_inputs(self) -> bool:
            # vLLM's profile_run reads this first: its own code runs under the wrapper.
            seen.append(graph.phase)
            raise Stop

    with pytest.raises(Stop):
        Probe.profile_run(object.__new__(Probe))
    assert seen == [Phase.PROFILING]
    assert graph.phase is Phase.SERVING
    try:
        from vllm.v1.worker import cpu_model_runner
    except ImportError:
        return
    assert cpu_model_runner.CPUModelRunner.profile_run is wrapped


def test_plugin_wraps_the_v2_runners_profiling_run(monkeypatch: pytest.MonkeyPatch) -> None:
    """V2's GPUModelRunner.profile_run (vLLM 0.26's default runner), which vLLM's worker
    imports itself, is wrapped too and runs vLLM's own code in the profiling phase."""
    import importlib
    import inspect
    import sys
    import weakref

    from vllm.v1.worker import gpu_worker  # noqa: F401 -- imports the V2 runner, as vLLM does

    from omnitrace.events import Phase
    from omnitrace.integrations import vllm_plugin
    from omnitrace.testing import SimulatedGraphBackend

    if vllm_plugin._RUNNER_V2_MODULE not in sys.modules:
        pytest.skip("this vLLM's worker does not import the V2 model runner")
    module = importlib.import_module(vllm_plugin._RUNNER_V2_MODULE)
    runner = module.GPUModelRunner
    original = inspect.unwrap(runner.profile_run)
    assert original.__module__ == module.__name__
    monkeypatch.setattr(runner, "profile_run", original)
    graph = EncoderCudaGraph(lambda x: x, name="probe", backend=SimulatedGraphBackend())
    monkeypatch.setattr(vllm_plugin, "_attached", weakref.WeakSet([graph]))

    assert vllm_plugin._hook_profiling() is True
    wrapped = runner.profile_run
    assert wrapped.__wrapped__ is original  # type: ignore[attr-defined]

    seen: list[Phase] = []

    class Stop(Exception):
        pass

    class Probe(runner):  # type: ignore[misc, valid-type]
        def _dummy_run(self, *args: Any, **kwargs: Any) -> Any:
            # V2's profile_run starts with a dummy run of the language model.
            seen.append(graph.phase)
            raise Stop

        max_num_tokens = 1
        # vLLM 0.33's V2 profile_run profiles the encoders first where the model takes
        # multimodal inputs; this probe has none, so both releases reach the dummy run.
        supports_mm_inputs = False
        is_first_pp_rank = True
        is_last_pp_rank = True

    with pytest.raises(Stop):
        Probe.profile_run(object.__new__(Probe))
    assert seen == [Phase.PROFILING]
    assert graph.phase is Phase.SERVING


@pytest.mark.parametrize(
    ("mode", "size", "warned"),
    [("FULL_AND_PIECEWISE", 64, True), ("FULL_AND_PIECEWISE", 512, False), ("NONE", 64, False)],
)
def test_the_language_model_graph_notice_reads_vllms_compilation_config(
    mode: str, size: int, warned: bool
) -> None:
    """The start-up notice reads the names vLLM's own CompilationConfig and CUDAGraphMode use."""
    import types

    from vllm.config import CompilationConfig, CUDAGraphMode

    from omnitrace.integrations.vllm_plugin import language_model_graph_notice

    compilation = CompilationConfig(
        cudagraph_mode=getattr(CUDAGraphMode, mode), max_cudagraph_capture_size=size
    )
    config = types.SimpleNamespace(
        model_config=types.SimpleNamespace(enforce_eager=False), compilation_config=compilation
    )
    notice = language_model_graph_notice(config)
    assert (notice is not None) is warned
    if warned:
        assert notice is not None
        assert f"at most {size} tokens" in notice
