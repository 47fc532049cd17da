"""vLLM's encoder graph protocol as each release spells it, detected rather than pinned: API,
config copies, the exact-shape model, the captured graph's layout, vLLM 0.26's default capture
stream and the allocator caches a capture keeps (docs/vllm.md, "vLLM versions")."""

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

from omnitrace.config import OmnitraceError
from omnitrace.graphs.backends.base import flatten_outputs, unflatten_outputs

__all__ = [
    "ExactShapeEncoder",
    "UnsupportedVllmError",
    "VllmApi",
    "caches_kept",
    "captured_budget_graph",
    "copy_vllm_config",
    "default_capture_stream",
    "detect_vllm_api",
    "load_vllm_api",
]

_MANAGER_MODULE = "vllm.v1.worker.encoder_cudagraph"
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
        warmed: the forward already ran at this signature on the replay stream, so the
            manager's warm-up (which only sizes its output buffer from what it returns)
            gets an unfilled buffer of the output's size instead of another run.
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
        warmed: bool = False,
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
        # What the manager's warm-up gets when the forward already ran: allocated now, on
        # the current (replay) stream, before the backend measures the capture's memory.
        device = next((x.device for x in static_inputs if x is not None), None)
        self._unfilled: torch.Tensor | None = None
        if warmed and device is not None:
            self._unfilled = torch.empty(self._out_shape, dtype=self._out_dtype, device=device)

    @property
    def output_bytes(self) -> int:
        """Bytes of the manager's one output buffer (the packed bytes, or the one tensor)."""
        return _nbytes(self._out_shape, self._out_dtype)

    @property
    def _out_dtype(self) -> torch.dtype:
        return torch.uint8 if self._packed else self._leaves[0][1]

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
                unfilled, self._unfilled = self._unfilled, None
                return unfilled if unfilled is not None else self._call(inputs)
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
_caches_lock = threading.Lock()
_keeping = threading.local()
# Where torch.cuda.graph empties the device allocator's cache (newer releases through
# torch.accelerator) and the pinned host allocator's, as it starts a capture.
_EMPTYING = (
    ("torch.cuda", "empty_cache"),
    ("torch.accelerator", "empty_cache"),
    ("torch._C", "_host_emptyCache"),
)


def _unless_keeping(empty: Callable[..., Any]) -> Callable[..., Any]:
    def maybe_empty(*args: Any, **kwargs: Any) -> Any:
        if getattr(_keeping, "on", False):
            return None
        return empty(*args, **kwargs)

    return maybe_empty


@contextlib.contextmanager
def caches_kept() -> Iterator[None]:
    """Keep the allocators' caches through the captures this thread makes in the block.

    ``torch.cuda.graph`` synchronises the device and empties the caching allocator's cache
    and the pinned host memory cache before it captures. vLLM's manager captures through
    it, so in a serving engine every capture would free the blocks the engine's next steps
    allocate again: on this thread, for the block, those two calls do nothing. Other
    threads' calls go through; the functions are restored on exit, under a process-wide
    lock.
    """
    with _caches_lock:
        saved = []
        for module_name, name in _EMPTYING:
            try:
                module = importlib.import_module(module_name)
            except ImportError:
                continue
            empty = getattr(module, name, None)
            if empty is not None:
                saved.append((module, name, empty))
                setattr(module, name, _unless_keeping(empty))
        _keeping.on = True
        try:
            yield
        finally:
            _keeping.on = False
            for module, name, empty in saved:
                setattr(module, name, empty)


@contextlib.contextmanager
def default_capture_stream(stream: Any) -> Iterator[None]:
    """Make ``stream`` the default capture stream of ``torch.cuda.graph`` for one capture.

    vLLM 0.26's manager calls ``torch.cuda.graph(graph, pool=...)`` without a stream, which
    captures on a process-wide stream shared with every graph captured that way (docs/vllm.md,
    "Backends and statistics"). Newer vLLM passes the current stream
    and ignores the default. The swap is held under a process-wide lock and always undone.
    """
    graph_cls = torch.cuda.graph
    with _default_stream_lock:
        saved = getattr(graph_cls, "default_capture_stream", None)
        graph_cls.default_capture_stream = stream
        try:
            yield
        finally:
            graph_cls.default_capture_stream = saved
