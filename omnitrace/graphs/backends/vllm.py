"""Graph backend on vLLM's ``EncoderCudaGraphManager``, used for exact input shapes.

vLLM's manager keys graphs by *token budget* and packs several items into one padded batch.
The omnitrace adapter keys graphs by the exact signature of the inputs, so this backend builds
one manager per captured key, around an exact-shape model object (:class:`ExactShapeEncoder`)
that satisfies vLLM's ``SupportsEncoderCudaGraph`` protocol: one indivisible item per batch,
a single token budget equal to the product of the output shape without its last dimension,
static input buffers filled with an exact ``copy_`` (no zero padding: the shapes always
match), and outputs cloned in the manager's postprocessing step.

Every manager gets its own *copy* of the vLLM config with the budget, batch size and frame
limit of that one key; the caller's config is never mutated. The manager is handed the pool
the adapter chose (shared per encoder, device and replay stream, or separate for the A/B
comparison).

Streams, and why the graph owns every buffer it touches (see
:mod:`omnitrace.graphs.backends.base`). ``manager.capture(pool)`` runs one eager warm-up
forward on the current stream and then captures. Newer vLLM captures on the current stream
(``stream=current_stream()``); vLLM 0.26 passes no stream, so ``torch.cuda.graph`` uses its
process-wide default capture stream, shared with every other graph captured that way: such
graphs would share one cuBLAS workspace across encoders and replay streams, allocated in
whichever pool captured first. This backend therefore:

* makes the adapter's capture stream current around ``manager.capture(pool)`` and, for that
  call only and under a process-wide lock, makes it ``torch.cuda.graph``'s default capture
  stream as well, so every vLLM version captures on the adapter's own capture stream;
* routes the manager's warm-up forward (the call made outside capture) to the replay
  stream, so no eager GEMM ever runs on the capture stream and its cuBLAS workspace is
  allocated inside the capture, from the adapter's pool.

Statistics: the manager counts only the calls that reach it, which are the adapter's hits
(a manager exists only for a key that was captured). Calls the adapter rejects before any
manager (ineligible, capacity, warm-up, memory) are never seen by vLLM.
:meth:`VllmGraphBackend.merged_stats` adds the two together; it must agree with the adapter's
own ``get_cumulative_stats()``, which is the fold of its events.

Importing this module does not import vLLM: :class:`VllmGraphBackend` imports it when it is
constructed. Note that importing vLLM's torch utilities patches ``torch.cuda.set_stream``
process-wide (vLLM tracks the current stream itself); that is vLLM's behaviour, not ours.

Exceptions::

    OmnitraceError
     └── UnsupportedVllmError (also a RuntimeError)   vLLM lacks a usable encoder graph API
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import importlib
import inspect
import math
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

import torch

from omnitrace.config import ConfigError, OmnitraceError
from omnitrace.events import MissReason
from omnitrace.graphs.backends.base import (
    CaptureRequest,
    OutputLayout,
    capture_ordering,
    flatten_outputs,
    static_copies,
    unflatten_outputs,
    warm_up,
)
from omnitrace.graphs.backends.torch import CudaDeviceQuestions
from omnitrace.stats import STATS_KEYS

__all__ = [
    "ExactShapeEncoder",
    "ManagerStats",
    "UnsupportedVllmError",
    "VllmApi",
    "VllmCapturedGraph",
    "VllmGraphBackend",
    "captured_budget_graph",
    "copy_vllm_config",
    "default_capture_stream",
    "detect_vllm_api",
    "load_vllm_api",
]

_MANAGER_MODULE = "vllm.v1.worker.encoder_cudagraph"
_current_device: Any = getattr(torch._C, "_cuda_getDevice", torch.cuda.current_device)
_DEFS_MODULE = "vllm.v1.worker.encoder_cudagraph_defs"
_PATH = "default"


class UnsupportedVllmError(OmnitraceError, RuntimeError):
    """The installed vLLM has no encoder graph manager this backend can drive."""


@dataclass(frozen=True, slots=True)
class VllmApi:
    """The pieces of vLLM's encoder graph API, as found by introspection."""

    version: str
    manager_cls: Any
    config_cls: Any
    item_spec_cls: Any
    capture_inputs_cls: Any
    replay_buffers_cls: Any
    values_field: str
    """Field of the capture-input and replay-buffer classes that holds the tensors."""
    has_padding_logics: bool
    """Whether the config accepts per-buffer copy functions (else: zero + slice copy)."""


def _field_names(cls: Any) -> frozenset[str]:
    if dataclasses.is_dataclass(cls):
        return frozenset(f.name for f in dataclasses.fields(cls))
    return frozenset(getattr(cls, "__annotations__", {}))


def detect_vllm_api(version: str, defs: Any, manager_cls: Any) -> VllmApi:
    """Check that ``defs`` and ``manager_cls`` have the API this backend drives.

    Args:
        version: vLLM's version string, for error messages.
        defs: the ``encoder_cudagraph_defs`` module (or an object with the same classes).
        manager_cls: the ``EncoderCudaGraphManager`` class.

    Raises:
        UnsupportedVllmError: a class is missing, the buffer classes have the older field
            layout, or ``capture()`` takes no graph pool.
    """
    names = (
        "EncoderCudaGraphConfig",
        "EncoderItemSpec",
        "EncoderCudaGraphCaptureInputs",
        "EncoderCudaGraphReplayBuffers",
    )
    missing = [name for name in names if not hasattr(defs, name)]
    if missing:
        raise UnsupportedVllmError(
            f"vLLM {version} is not supported by omnitrace's vllm backend: "
            f"{_DEFS_MODULE} lacks {', '.join(missing)}. Use the torch backend or another vLLM."
        )
    capture_fields = _field_names(defs.EncoderCudaGraphCaptureInputs)
    replay_fields = _field_names(defs.EncoderCudaGraphReplayBuffers)
    if "values" in capture_fields and "values" in replay_fields:
        values_field = "values"
    elif {"mm_kwargs", "buffers"} <= capture_fields:
        # The older layout split forward inputs from graph buffers, and its manager captured
        # into a private pool of its own, so the pool contract cannot be honoured there.
        raise UnsupportedVllmError(
            f"vLLM {version} is not supported by omnitrace's vllm backend: its encoder graph "
            "capture inputs use the older field layout (mm_kwargs, buffers) and its manager "
            "cannot capture into a given memory pool. Upgrade vLLM (the 'values' layout) or "
            "use the torch backend (omnitrace.graphs.backends.TorchGraphBackend)."
        )
    else:
        raise UnsupportedVllmError(
            f"vLLM {version} is not supported by omnitrace's vllm backend: unknown encoder "
            f"graph capture-input fields {sorted(capture_fields)} / replay-buffer fields "
            f"{sorted(replay_fields)}."
        )
    capture = getattr(manager_cls, "capture", None)
    params = list(inspect.signature(capture).parameters) if callable(capture) else []
    if len(params) < 2:  # (self, graph_pool)
        raise UnsupportedVllmError(
            f"vLLM {version} is not supported by omnitrace's vllm backend: "
            "EncoderCudaGraphManager.capture() takes no graph pool."
        )
    return VllmApi(
        version=version,
        manager_cls=manager_cls,
        config_cls=defs.EncoderCudaGraphConfig,
        item_spec_cls=defs.EncoderItemSpec,
        capture_inputs_cls=defs.EncoderCudaGraphCaptureInputs,
        replay_buffers_cls=defs.EncoderCudaGraphReplayBuffers,
        values_field=values_field,
        has_padding_logics="padding_logics" in _field_names(defs.EncoderCudaGraphConfig),
    )


def load_vllm_api() -> VllmApi:
    """Import vLLM's encoder graph modules and detect their API.

    Raises:
        UnsupportedVllmError: vLLM is not installed, has no encoder graph manager, or has an
            API this backend cannot drive (the message names the version).
    """
    try:
        vllm = importlib.import_module("vllm")
    except ImportError as exc:
        raise UnsupportedVllmError(
            f"vLLM is not importable ({exc}); install it or use the torch backend"
        ) from exc
    version = str(getattr(vllm, "__version__", "unknown"))
    try:
        defs = importlib.import_module(_DEFS_MODULE)
        manager_module = importlib.import_module(_MANAGER_MODULE)
    except ImportError as exc:
        raise UnsupportedVllmError(
            f"vLLM {version} is not supported by omnitrace's vllm backend: cannot import "
            f"its encoder graph manager ({exc})."
        ) from exc
    manager_cls = getattr(manager_module, "EncoderCudaGraphManager", None)
    if manager_cls is None:
        raise UnsupportedVllmError(
            f"vLLM {version} is not supported by omnitrace's vllm backend: "
            f"{_MANAGER_MODULE} has no EncoderCudaGraphManager."
        )
    return detect_vllm_api(version, defs, manager_cls)


def _set(obj: Any, name: str, value: Any) -> None:
    # vLLM configs are pydantic dataclasses; plain setattr validates where they ask for it.
    setattr(obj, name, value)


def copy_vllm_config(vllm_config: Any, token_budget: int) -> Any:
    """Return a copy of ``vllm_config`` set up for one exact-shape manager.

    The copy shares every sub-config with the original except the ones it changes
    (compilation, model and multimodal config), which are copied first, so the caller's
    objects are never mutated. The copy has one token budget, one item per batch, no video
    frames, and no data-parallel encoder sharding (one indivisible item cannot be split).
    """
    config = copy.copy(vllm_config)
    compilation = copy.copy(vllm_config.compilation_config)
    _set(compilation, "encoder_cudagraph_token_budgets", [token_budget])
    _set(compilation, "encoder_cudagraph_max_vision_items_per_batch", 1)
    _set(compilation, "encoder_cudagraph_max_frames_per_batch", 0)
    _set(config, "compilation_config", compilation)

    model_config = getattr(vllm_config, "model_config", None)
    multimodal = getattr(model_config, "multimodal_config", None)
    if multimodal is not None:
        multimodal = copy.copy(multimodal)
        if hasattr(multimodal, "mm_encoder_tp_mode"):
            _set(multimodal, "mm_encoder_tp_mode", "weights")
    else:
        # A text-only or model-less config: the manager still reads a multimodal config.
        multimodal_cls = importlib.import_module("vllm.config.multimodal").MultiModalConfig
        multimodal = multimodal_cls(limit_per_prompt={"image": 1, "video": 0})
    if model_config is not None:
        model_config = copy.copy(model_config)
        _set(model_config, "multimodal_config", multimodal)
    else:
        model_config = _ModelConfigView(multimodal)
    # object.__setattr__: a ModelConfig view is not a pydantic ModelConfig, and the
    # manager only reads ``multimodal_config`` from it.
    object.__setattr__(config, "model_config", model_config)
    return config


class _ModelConfigView:
    """The one model-config attribute the manager reads, for configs without a model."""

    __slots__ = ("multimodal_config",)

    def __init__(self, multimodal_config: Any) -> None:
        self.multimodal_config = multimodal_config


def _exact_copy(dst: torch.Tensor, src: torch.Tensor) -> None:
    # Shapes always match (the adapter keys by exact shape): no zero fill, no slicing.
    dst.copy_(src)


class ExactShapeEncoder:
    """One encoder forward at one exact input signature, as a vLLM encoder graph model.

    Implements vLLM's ``SupportsEncoderCudaGraph`` protocol for a batch of exactly one
    indivisible item whose token count is the whole budget.

    Args:
        api: the detected vLLM API.
        forward: the encoder forward (positional tensors or None).
        static_inputs: the static input buffers, allocated outside the graph pool.
        output_spec: the output structure (from ``flatten_outputs``).
        output_leaves: ``(shape, dtype)`` of every output tensor, in order.
        warmup_scope: context for forwards run outside capture (the manager's warm-up):
            the backend passes one that makes the replay stream current, so no eager work
            runs on the capture stream.
        capturing: whether the current stream is capturing (the backend passes
            ``torch.cuda.is_current_stream_capturing``).
    """

    supports_encoder_cudagraph: ClassVar[Literal[True]] = True

    def __init__(
        self,
        api: VllmApi,
        forward: Callable[..., Any],
        static_inputs: Sequence[torch.Tensor | None],
        output_spec: Any,
        output_leaves: Sequence[tuple[torch.Size, torch.dtype]],
        *,
        warmup_scope: Callable[[], contextlib.AbstractContextManager[Any]] | None = None,
        capturing: Callable[[], bool] | None = None,
    ) -> None:
        self._api = api
        self._forward = forward
        self._warmup_scope = warmup_scope
        self._capturing = capturing
        self._arity = len(static_inputs)
        self._names = tuple(f"input_{i}" for i, x in enumerate(static_inputs) if x is not None)
        self.input_names = self._names
        self._static = {f"input_{i}": x for i, x in enumerate(static_inputs) if x is not None}
        self._spec = output_spec
        self._leaves = tuple((torch.Size(shape), dtype) for shape, dtype in output_leaves)
        # A single output tensor is handed to vLLM as is; several are packed into one byte
        # buffer, because the manager keeps exactly one output buffer per graph.
        self._packed = len(self._leaves) != 1
        if self._packed:
            self._out_shape = torch.Size((sum(_nbytes(s, d) for s, d in self._leaves),))
        else:
            self._out_shape = self._leaves[0][0]
        self.token_budget = max(1, math.prod(self._out_shape[:-1]))
        self.out_hidden_size = int(self._out_shape[-1]) if len(self._out_shape) else 1

    # -- what the manager asks about the model ---------------------------------------------

    def get_encoder_cudagraph_config(self) -> Any:
        kwargs: dict[str, Any] = {
            "modalities": ["image"],
            "buffer_keys": list(self._names),
            "out_hidden_size": self.out_hidden_size,
        }
        if self._api.has_padding_logics:
            kwargs["padding_logics"] = dict.fromkeys(self._names, _exact_copy)
        return self._api.config_cls(**kwargs)

    def get_input_modality(self, mm_kwargs: dict[str, Any]) -> str:
        return "image"

    def get_max_frames_per_video(self) -> int:
        return 1

    def get_encoder_cudagraph_budget_range(self, vllm_config: Any) -> tuple[int, int]:
        return self.token_budget, self.token_budget

    def get_encoder_cudagraph_item_specs(self, mm_kwargs: dict[str, Any]) -> list[Any]:
        input_size = sum(int(t.numel()) for t in mm_kwargs.values() if isinstance(t, torch.Tensor))
        return [self._api.item_spec_cls(input_size=input_size, output_tokens=self.token_budget)]

    def select_encoder_cudagraph_items(
        self, mm_kwargs: dict[str, Any], indices: list[int]
    ) -> dict[str, Any]:
        # One indivisible item: the only selections are all of it or nothing.
        return dict(mm_kwargs) if indices else {}

    # -- capture and replay -----------------------------------------------------------------

    def prepare_encoder_cudagraph_capture_inputs(
        self,
        token_budget: int,
        max_batch_size: int,
        max_frames_per_batch: int,
        device: torch.device,
        dtype: torch.dtype,
        path: str = _PATH,
        axis_keys: Any = None,
    ) -> Any:
        # The buffers were allocated before capture on the replay stream, outside the pool;
        # the manager keeps these exact tensor objects and copies into them on replay.
        return self._api.capture_inputs_cls(**{self._api.values_field: dict(self._static)})

    def prepare_encoder_cudagraph_replay_buffers(
        self,
        mm_kwargs: dict[str, Any],
        max_batch_size: int,
        max_frames_per_batch: int,
        path: str = _PATH,
    ) -> Any:
        values = {name: mm_kwargs.get(name) for name in self._names}
        return self._api.replay_buffers_cls(**{self._api.values_field: values})

    def _call(self, tensors: Mapping[str, Any]) -> torch.Tensor:
        args = [tensors.get(f"input_{i}") for i in range(self._arity)]
        leaves, _ = flatten_outputs(self._forward(*args))
        if len(leaves) != len(self._leaves):
            raise RuntimeError(
                "encoder returned a different output structure during capture than during warm-up"
            )
        if not self._packed:
            return leaves[0]
        return torch.cat([t.contiguous().view(-1).view(torch.uint8) for t in leaves])

    def encoder_cudagraph_forward(
        self, inputs: dict[str, torch.Tensor], path: str = _PATH
    ) -> torch.Tensor:
        scope = self._warmup_scope
        if scope is not None and not (self._capturing is not None and self._capturing()):
            # The manager's warm-up, outside capture: keep it off the capture stream.
            with scope():
                return self._call(inputs)
        return self._call(inputs)

    def encoder_eager_forward(self, mm_kwargs: dict[str, Any], path: str = _PATH) -> torch.Tensor:
        return self._call(mm_kwargs)

    def postprocess_encoder_output(
        self,
        outputs: Any,
        indices: list[int],
        per_item_out_tokens: list[int],
        dest: Any,
        clone: bool = False,
        batch_mm_kwargs: dict[str, Any] | None = None,
    ) -> None:
        # Newer vLLM passes {path: tensor}, older vLLM the tensor itself.
        out = outputs[_PATH] if isinstance(outputs, Mapping) else outputs
        if clone:
            # The output buffer is overwritten by the next replay; callers keep embeddings.
            out = out.clone()
        dest[indices[0]] = self.unpack(out)

    def unpack(self, out: torch.Tensor) -> Any:
        """Turn the manager's output tensor back into the forward's output structure."""
        if not self._packed:
            return unflatten_outputs(self._spec, [out])
        leaves = []
        offset = 0
        for shape, dtype in self._leaves:
            size = _nbytes(shape, dtype)
            leaves.append(out[offset : offset + size].view(dtype).view(shape))
            offset += size
        return unflatten_outputs(self._spec, leaves)


def _nbytes(shape: torch.Size, dtype: torch.dtype) -> int:
    return math.prod(shape) * torch.empty((), dtype=dtype).element_size()


@dataclass(frozen=True, slots=True)
class ManagerStats:
    """vLLM's own counters, summed over the managers of one backend."""

    managers: int
    graph_hits: int
    graph_misses: int
    num_budgets: int


class VllmCapturedGraph:
    """One key's manager, with its exact-shape model, replayed through the manager's graph.

    ``manager.execute()`` is generic: it sorts and packs several items into padded budgets,
    selects and slices inputs, and post-processes a list, tens of microseconds of Python per
    call that an exact-shape key never needs. A hit therefore replays the graph the manager
    captured directly: the inputs go into the manager's own input buffers (the static
    buffers this backend gave it), its graph replays, its output buffer is cloned through the
    model's unpacking, and the hit is counted in the manager's own ``graph_hits``, as
    ``execute()`` would count it. When a vLLM release lays its captured graphs out otherwise,
    replays go through ``execute()``.
    """

    __slots__ = (
        "_buffers",
        "_device_index",
        "_meta",
        "_unpack",
        "bytes_reserved",
        "manager",
        "static_bytes",
    )

    def __init__(
        self,
        manager: Any,
        model: ExactShapeEncoder,
        device_index: int | None,
        bytes_reserved: int,
        static_bytes: int,
    ) -> None:
        self.manager = manager
        # The model's output unpacking, bound once: one lookup less per hit.
        self._unpack = model.unpack
        self._device_index = device_index
        self.bytes_reserved = bytes_reserved
        self.static_bytes = static_bytes
        self._meta = captured_budget_graph(manager)
        # (input position, the manager's buffer for it), for the direct replay.
        self._buffers: tuple[tuple[int, torch.Tensor], ...] = ()
        if self._meta is not None:
            buffers = self._meta.input_buffers
            self._buffers = tuple(
                (int(name.removeprefix("input_")), buffers[name]) for name in model.input_names
            )

    @property
    def direct(self) -> bool:
        """Whether hits replay the manager's graph directly (else through ``execute()``)."""
        return self._meta is not None

    def replay(self, inputs: Sequence[torch.Tensor | None]) -> Any:
        index = self._device_index
        if index is not None and _current_device() != index:
            with torch.cuda.device(index):
                return self._replay(inputs)
        return self._replay(inputs)

    def _replay(self, inputs: Sequence[torch.Tensor | None]) -> Any:
        meta = self._meta
        if meta is None:
            mm_kwargs = {f"input_{i}": x for i, x in enumerate(inputs) if x is not None}
            return self.manager.execute(mm_kwargs)[0]
        for position, buffer in self._buffers:
            buffer.copy_(inputs[position])  # type: ignore[arg-type]
        meta.graph.replay()
        self.manager.graph_hits += 1
        # The output buffer is overwritten by the next replay; callers keep embeddings.
        return self._unpack(meta.output_buffer.clone())


def captured_budget_graph(manager: Any) -> Any | None:
    """Return the one captured graph's metadata of an exact-shape manager, if laid out as known.

    vLLM keeps ``budget_graphs[path][budget key]`` with ``graph``, ``input_buffers`` and
    ``output_buffer`` (0.26 and 0.33); an exact-shape manager captured exactly one.
    """
    sets = getattr(manager, "budget_graphs", None)
    if not isinstance(sets, Mapping):
        return None
    metas = [meta for graph_set in sets.values() for meta in graph_set.values()]
    if len(metas) != 1:
        return None
    meta = metas[0]
    if not all(hasattr(meta, name) for name in ("graph", "input_buffers", "output_buffer")):
        return None
    if not hasattr(manager, "graph_hits"):
        return None
    return meta


_default_stream_lock = threading.Lock()


@contextlib.contextmanager
def default_capture_stream(stream: Any) -> Iterator[None]:
    """Make ``stream`` the default capture stream of ``torch.cuda.graph`` for one capture.

    vLLM 0.26's manager calls ``torch.cuda.graph(graph, pool=...)`` without a stream, which
    captures on a process-wide stream shared with every graph captured that way (module
    docstring). Newer vLLM passes the current stream and ignores the default. The swap is
    held under a process-wide lock and always undone.
    """
    graph_cls = torch.cuda.graph
    with _default_stream_lock:
        saved = getattr(graph_cls, "default_capture_stream", None)
        graph_cls.default_capture_stream = stream
        try:
            yield
        finally:
            graph_cls.default_capture_stream = saved


class VllmGraphBackend(CudaDeviceQuestions):
    """Capture and replay through vLLM's ``EncoderCudaGraphManager``, one per exact key.

    Args:
        vllm_config: the engine's ``VllmConfig``; each manager gets a modified copy.
        api: the vLLM API to use (detected from the installed vLLM when omitted).

    Raises:
        UnsupportedVllmError: vLLM is missing or its encoder graph API is not supported.
    """

    name = "vllm"
    error_modes: tuple[str, ...] = ("global",)
    simulated = False

    def __init__(self, vllm_config: Any, *, api: VllmApi | None = None) -> None:
        if vllm_config is None:
            raise TypeError("VllmGraphBackend needs a vllm_config (the engine's VllmConfig)")
        self.api = api if api is not None else load_vllm_api()
        self.vllm_config = vllm_config
        self._graphs: list[VllmCapturedGraph] = []
        self._lock = threading.Lock()

    @property
    def vllm_version(self) -> str:
        return self.api.version

    # -- hooks a CPU test double overrides --------------------------------------------------

    def _device_scope(self, device: torch.device) -> Any:
        return torch.cuda.device(device)

    def _current_stream(self, device: torch.device) -> Any:
        return torch.cuda.current_stream(device)

    def _stream_scope(self, stream: Any) -> Any:
        return torch.cuda.stream(stream)

    def _capturing(self) -> bool:
        return torch.cuda.is_current_stream_capturing()

    def _settle(self, device: torch.device) -> int:
        """Synchronize, release cached blocks and return reserved bytes."""
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        return int(torch.cuda.memory_reserved(device))

    def _device_index(self, device: torch.device) -> int | None:
        return device.index if device.index is not None else torch.cuda.current_device()

    # -- GraphBackend: capture ---------------------------------------------------------------

    def warm_up(
        self, forward: Callable[..., Any], inputs: Sequence[torch.Tensor | None]
    ) -> OutputLayout:
        # The manager warms up inside its own capture (request.layout is not used); this
        # only serves the protocol: adapters refuse background preparation for this backend.
        return warm_up(forward, inputs)

    def capture(self, request: CaptureRequest) -> VllmCapturedGraph:
        if request.capture_error_mode != "global":
            # vLLM's manager opens torch.cuda.graph itself, always in the global mode.
            raise ConfigError(
                f"capture_error_mode: vLLM's encoder graph manager captures in the 'global' "
                f"mode only, got {request.capture_error_mode!r}"
            )
        forward, inputs, device = request.forward, request.inputs, request.device
        pool, capture_stream = request.pool, request.capture_stream
        with self._device_scope(device):
            replay_stream = self._current_stream(device)
            static_inputs = static_copies(inputs)
            # One eager run on the replay stream for the output structure; the manager's own
            # warm-up is routed back to the replay stream by the model's warmup_scope.
            leaves, spec = flatten_outputs(forward(*static_inputs))
            shapes = [(t.shape, t.dtype) for t in leaves]
            del leaves
            model = ExactShapeEncoder(
                self.api,
                forward,
                static_inputs,
                spec,
                shapes,
                warmup_scope=lambda: self._stream_scope(replay_stream),
                capturing=self._capturing,
            )
            dtype = _encoder_dtype(static_inputs, shapes)
            manager = self.api.manager_cls(
                copy_vllm_config(self.vllm_config, model.token_budget), device, dtype, model
            )
            reserved_before = self._settle(device)
            with (
                capture_ordering(replay_stream, capture_stream, self._stream_scope),
                default_capture_stream(capture_stream),
            ):
                manager.capture(pool)
            reserved_after = self._settle(device)
        out_bytes = _nbytes(model._out_shape, torch.uint8 if model._packed else shapes[0][1])
        static_bytes = sum(t.nbytes for t in static_inputs if t is not None) + out_bytes
        graph = VllmCapturedGraph(
            manager,
            model,
            self._device_index(device),
            max(0, reserved_after - reserved_before),
            static_bytes,
        )
        with self._lock:
            self._graphs.append(graph)
        return graph

    # -- statistics ---------------------------------------------------------------------------

    def manager_stats(self) -> ManagerStats:
        """Sum vLLM's own counters over every manager this backend built."""
        with self._lock:
            graphs = list(self._graphs)
        hits = misses = budgets = 0
        for graph in graphs:
            stats = graph.manager.get_cumulative_stats()
            hits += int(stats.get("graph_hits", 0))
            misses += int(stats.get("graph_misses", 0))
            budgets += int(stats.get("num_budgets", 0))
        return ManagerStats(len(graphs), hits, misses, budgets)

    def merged_stats(self, adapter_stats: Mapping[str, int | float]) -> dict[str, int | float]:
        """Merge vLLM's counters with the calls the adapter rejected before any manager.

        ``adapter_stats`` is the adapter's ``get_cumulative_stats()``. Hits and graph count
        come from vLLM's managers; misses are the adapter's (ineligible, capacity, warm-up
        and memory calls never reach a manager) plus any miss a manager counted itself (none,
        in exact-shape use). The result has the keys of ``get_cumulative_stats()`` and, when
        the backend and adapter agree, equals it.
        """
        manager = self.manager_stats()
        pre_manager = {
            key: int(adapter_stats[key]) for key in (reason.stats_key for reason in MissReason)
        }
        misses = sum(pre_manager.values()) + manager.graph_misses
        calls = manager.graph_hits + misses
        merged: dict[str, int | float] = {
            "graph_hits": manager.graph_hits,
            "graph_misses": misses,
            "hit_rate": manager.graph_hits / calls if calls else 0.0,
            "num_graphs": manager.managers,
            **pre_manager,
            "capture_failures": int(adapter_stats["capture_failures"]),
        }
        return {key: merged[key] for key in STATS_KEYS}


def _encoder_dtype(
    inputs: Sequence[torch.Tensor | None], outputs: Sequence[tuple[torch.Size, torch.dtype]]
) -> torch.dtype:
    # The manager uses its dtype for dummy inputs and data-parallel gather buffers, neither
    # of which exact-shape use needs; pass the encoder's floating dtype for consistency.
    for _, dtype in outputs:
        if dtype.is_floating_point:
            return dtype
    for x in inputs:
        if x is not None and x.dtype.is_floating_point:
            return x.dtype
    return torch.get_default_dtype()
