"""Attach encoder graph adapters to a loaded Qwen2.5-Omni thinker (vLLM): each tower's
value-dependent host work stays eager, the rest is graphed with the host values it bakes in
made part of its key (docs/vllm.md, "Qwen2.5-Omni", says what each graph holds and why)."""

from __future__ import annotations

import inspect
import logging
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from typing_extensions import Unpack

from omnitrace.graphs.adapter import EncoderCudaGraph
from omnitrace.integrations.base import (
    AdapterChoices,
    Adapters,
    ModelIntegration,
    attach_lock,
    describe_items,
    output_tensor,
    record_ineligible,
    route_method,
    warn_unsupported,
)
from omnitrace.integrations.qwen2_5_omni_masked_attention import (
    AUDIO_ATTENTION_LAYER,
    MASKED_AUDIO_ATTENTION,
    AttentionBinding,
    masked_audio_attention,
    masked_binding,
)

__all__ = [
    "AUDIO_TOWER",
    "GRAPH_SAFE_VISION_ATTENTION",
    "INTEGRATION",
    "MASKED_AUDIO_ATTENTION",
    "VISION_TOWER",
    "AudioSeam",
    "Instrumented",
    "audio_seam",
    "detect",
    "instrument",
    "masked_audio_attention",
]

logger = logging.getLogger(__name__)

#: Class names of the towers this module serves (vLLM's vision, transformers' audio).
VISION_TOWER = "Qwen2_5_VisionTransformer"
AUDIO_TOWER = "Qwen2_5OmniAudioEncoder"
#: Where each adapter lives, on its tower.
GRAPH_ATTR = "_encoder_graph"

#: vLLM vision attention backends whose kernels read sequence boundaries on the device and
#: take the longest length as a host launch bound (part of the key).
GRAPH_SAFE_VISION_ATTENTION = frozenset({"FLASH_ATTN", "ROCM_AITER_FA", "TRITON_ATTN"})

# vLLM's encoder metadata layout (0.26 and 0.33): device tensors, in the order the graph
# takes them (the last two are FlashInfer's and None otherwise), and the host scalars.
_VISION_TENSORS = (
    "rotary_pos_emb_cos",
    "rotary_pos_emb_sin",
    "window_index",
    "reverse_indices",
    "cu_seqlens",
    "cu_window_seqlens",
    "sequence_lengths_full",
    "sequence_lengths_window",
)
_VISION_OPTIONAL = frozenset({"sequence_lengths_full", "sequence_lengths_window"})
_VISION_SCALARS = ("max_seqlen_full", "max_seqlen_window")


@dataclass(frozen=True, slots=True)
class Instrumented:
    """The adapters :func:`instrument` attached (None where the model has no such tower)."""

    vision: EncoderCudaGraph | None
    audio: EncoderCudaGraph | None


# -- vision ------------------------------------------------------------------------------------


def _vision_stack(original: Callable[..., Any]) -> Callable[..., torch.Tensor]:
    def stack(x: torch.Tensor, bounds: torch.Tensor, *tensors: torch.Tensor | None) -> Any:
        metadata: dict[str, Any] = dict(zip(_VISION_TENSORS, tensors, strict=True))
        for name, value in zip(_VISION_SCALARS, bounds.shape[1:], strict=True):
            # Host scalars, as vLLM makes them: created on the CPU, so never captured.
            metadata[name] = torch.tensor(value, dtype=torch.int32)
        return original(x, None, encoder_metadata=metadata)

    return stack


def _vision_inputs(metadata: Any) -> tuple[torch.Tensor, ...] | None:
    """Return ``(bounds, *tensors)`` for the graph, or None for a layout this module lacks."""
    if not isinstance(metadata, Mapping):
        return None
    names = set(metadata)
    required = set(_VISION_TENSORS) - _VISION_OPTIONAL | set(_VISION_SCALARS)
    if not required <= names <= set(_VISION_TENSORS) | set(_VISION_SCALARS):
        return None
    tensors: list[Any] = []
    for name in _VISION_TENSORS:
        value = metadata.get(name)
        if not isinstance(value, torch.Tensor) and not (value is None and name in _VISION_OPTIONAL):
            return None
        tensors.append(value)
    scalars = []
    for name in _VISION_SCALARS:
        value = metadata[name]
        if (
            not isinstance(value, torch.Tensor)
            or value.device.type != "cpu"
            or value.dim() != 0
            or value.dtype != torch.int32
            or int(value) < 0
        ):
            return None
        scalars.append(int(value))
    bounds = torch.empty((0, *scalars), dtype=torch.int32, device=metadata["cu_seqlens"].device)
    return (bounds, *tensors)


def _attention_name(module: Any) -> str:
    backend = getattr(module, "attn_backend", None)
    return str(getattr(backend, "name", backend))


def _captures_on(graph: EncoderCudaGraph, device: torch.device) -> bool:
    """Whether the adapter's backend would really capture a call on ``device``."""
    # The simulated backend captures nothing, so host syncs cannot break its "capture".
    backend = graph.backend
    return not backend.simulated and backend.is_graph_device(device)


def _item_rows(grid_thw: Any, rows: int) -> list[int] | None:
    """The patch rows of each item of ``grid_thw`` (``t * h * w``), or None where its layout
    is not one row of three per item or the rows do not add up to ``rows``."""
    grid = grid_thw.tolist() if isinstance(grid_thw, torch.Tensor) else grid_thw
    try:
        sizes = [int(t) * int(h) * int(w) for t, h, w in grid]
    except (TypeError, ValueError):
        return None
    return sizes if sum(sizes) == rows and min(sizes, default=0) > 0 else None


class _VisionForward:
    """``visual.forward`` with everything after the metadata served by the adapter."""

    def __init__(self, visual: Any, graph: EncoderCudaGraph, original: Callable[..., Any]):
        self._visual = visual
        self._graph = graph
        self.original = original

    def __call__(
        self,
        x: Any,
        grid_thw: Any = None,
        *args: Any,
        encoder_metadata: Any = None,
        **kwargs: Any,
    ) -> Any:
        visual, graph = self._visual, self._graph
        detail = None
        own = args or kwargs or encoder_metadata is not None or grid_thw is None
        if own or not isinstance(x, torch.Tensor):
            # A caller's own metadata, or arguments vLLM never passes: the original decides.
            detail = "arguments"
        elif visual.training:
            detail = "training"
        elif (
            _captures_on(graph, x.device)
            and _attention_name(visual) not in GRAPH_SAFE_VISION_ATTENTION
        ):
            detail = "attention_backend"
        if detail is not None:
            record_ineligible(graph, detail, x)
            return self.original(x, grid_thw, *args, encoder_metadata=encoder_metadata, **kwargs)
        if self._graph.split_items and len(grid_thw) > 1:
            sizes = _item_rows(grid_thw, x.shape[0])
            if sizes is not None:
                # One call per image: each image's rows, its own grid row and metadata.
                pieces = x.split(sizes)
                return torch.cat(
                    [self._serve(p, grid_thw[i : i + 1]) for i, p in enumerate(pieces)]
                )
        return self._serve(x, grid_thw)

    def _serve(self, x: torch.Tensor, grid_thw: Any) -> Any:
        visual, graph = self._visual, self._graph
        metadata = visual.prepare_encoder_metadata(grid_thw)
        inputs = _vision_inputs(metadata)
        if inputs is None:
            record_ineligible(graph, "metadata", x)
            return self.original(x, None, encoder_metadata=metadata)
        return graph(x, *inputs)


# -- audio -------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class AudioSeam:
    """The functions of the audio tower's module that compute its forward's host metadata."""

    chunk_and_pad_features: Callable[..., Any]
    get_valid_indices: Callable[..., Any]
    get_pool_indices: Callable[..., Any]
    get_audio_cu_seqlens: Callable[..., Any]
    get_max_seqlen: Callable[..., Any]
    output: Callable[..., Any]
    """The forward's output class (``BaseModelOutputWithPooling``)."""


def audio_seam(tower: Any) -> AudioSeam | None:
    """Find the metadata functions the audio tower's forward accepts precomputed, if any.

    Looks in the module that defines ``type(tower)`` for transformers' functions
    ``chunk_and_pad_features``, ``get_valid_indices``, ``get_pool_indices``,
    ``get_audio_cu_seqlens`` and ``get_max_seqlen`` (each taking the caller's ``kwargs``,
    from which the forward pops precomputed values) and the output class.
    """
    module = sys.modules.get(type(tower).__module__)
    found: dict[str, Any] = {
        field: getattr(module, name, None)
        for field, name in (
            ("chunk_and_pad_features", "chunk_and_pad_features"),
            ("get_valid_indices", "get_valid_indices"),
            ("get_pool_indices", "get_pool_indices"),
            ("get_audio_cu_seqlens", "get_audio_cu_seqlens"),
            ("get_max_seqlen", "get_max_seqlen"),
            ("output", "BaseModelOutputWithPooling"),
        )
    }
    if not all(callable(f) for f in found.values()):
        return None
    for field, function in found.items():
        if field == "output":
            continue
        try:
            parameters = inspect.signature(function).parameters
        except (TypeError, ValueError):
            return None
        if "kwargs" not in parameters:
            return None
    return AudioSeam(**found)


def _audio_stack(
    original: Callable[..., Any], masked: AttentionBinding | None = None
) -> Callable[..., torch.Tensor]:
    def stack(
        padded: torch.Tensor,
        chunk_lengths: torch.Tensor,
        valid_indices: torch.Tensor,
        pool_indices: torch.Tensor,
        cu_seqlens: torch.Tensor,
        bound: torch.Tensor | None,
    ) -> torch.Tensor:
        def run(max_seqlen: int | None) -> torch.Tensor:
            result = original(
                None,
                None,
                None,
                padded_feature=padded,
                chunk_lengths=chunk_lengths,
                valid_indices=valid_indices,
                pool_indices=pool_indices,
                cu_seqlens=cu_seqlens,
                max_seqlen=max_seqlen,
            )
            return output_tensor(result)

        if bound is not None:
            return run(bound.shape[1])
        if masked is None:
            return run(None)
        with masked:
            # The longest chunk after the stride-2 convolution, off the padded shape: under a
            # "flash" name transformers would otherwise compute it with .item().
            return run((padded.shape[2] - 1) // 2 + 1)

    return stack


class _AudioForward:
    """``audio_tower.forward`` with its host metadata eager and the rest served by the adapter."""

    def __init__(
        self,
        tower: nn.Module,
        graph: EncoderCudaGraph,
        original: Callable[..., Any],
        seam: AudioSeam,
        masked: AttentionBinding | None = None,
    ):
        self._tower = tower
        self._graph = graph
        self._seam = seam
        self._masked = masked is not None
        self._stack = _audio_stack(original)
        self.original = original

    def __call__(
        self,
        input_features: Any = None,
        feature_lens: Any = None,
        aftercnn_lens: Any = None,
        **kwargs: Any,
    ) -> Any:
        tower, graph, seam = self._tower, self._graph, self._seam
        detail = None
        tensors = isinstance(input_features, torch.Tensor) and isinstance(
            feature_lens, torch.Tensor
        )
        if kwargs or not tensors:
            detail = "arguments"
        elif tower.training:
            detail = "training"
        if detail is not None:
            record_ineligible(graph, detail, input_features)
            return self.original(input_features, feature_lens, aftercnn_lens, **kwargs)
        if self._graph.split_items and feature_lens.dim() == 1 and len(feature_lens) > 1:
            frames = [int(n) for n in feature_lens.tolist()]
            if min(frames) > 0 and sum(frames) == input_features.shape[-1]:
                # One call per clip: its frames and its length; the outputs in clip order.
                pieces = input_features.split(frames, dim=-1)
                states = [self._serve(p, feature_lens[i : i + 1]) for i, p in enumerate(pieces)]
                return seam.output(last_hidden_state=torch.cat(states))
        return seam.output(last_hidden_state=self._serve(input_features, feature_lens))

    def _serve(self, input_features: torch.Tensor, feature_lens: torch.Tensor) -> torch.Tensor:
        tower, graph, seam = self._tower, self._graph, self._seam
        # The forward's own metadata steps, in its order; aftercnn_lens is not used by it.
        padded, chunk_lengths = seam.chunk_and_pad_features(
            input_features, feature_lens, tower.n_window
        )
        valid_indices = seam.get_valid_indices(chunk_lengths)
        pool_indices = seam.get_pool_indices(feature_lens)
        cu_seqlens = seam.get_audio_cu_seqlens(chunk_lengths)
        max_seqlen = seam.get_max_seqlen(cu_seqlens, tower.config)
        # The graph's inputs must share the features' device. vLLM passes the lengths on
        # the device, so these are no-ops there; a caller passing them on the host gets
        # them moved rather than a device mismatch inside the captured forward.
        chunk_lengths, valid_indices, pool_indices, cu_seqlens = (
            t.to(padded.device) if isinstance(t, torch.Tensor) else t
            for t in (chunk_lengths, valid_indices, pool_indices, cu_seqlens)
        )
        inputs = (padded, chunk_lengths, valid_indices, pool_indices, cu_seqlens)
        if max_seqlen is None:
            if not self._masked and _captures_on(graph, padded.device):
                # Not flash attention: every layer splits by lengths.tolist() on the host.
                record_ineligible(graph, "attention_backend", *inputs, None)
                return self._stack(*inputs, None)
            bound = None
        else:
            bound = torch.empty((0, int(max_seqlen)), dtype=torch.int32, device=padded.device)
        state: torch.Tensor = graph(*inputs, bound)
        return state


# -- attaching ---------------------------------------------------------------------------------


def _tower(model: Any, attribute: str, class_name: str) -> nn.Module | None:
    tower = getattr(model, attribute, None)
    if isinstance(tower, nn.Module) and type(tower).__name__ == class_name:
        return tower
    return None


def detect(model: Any) -> bool:
    """Whether ``model`` is a Qwen2.5-Omni thinker: vLLM's vision or transformers' audio tower.

    A model with vLLM's own encoder graph protocol (``encoder_cudagraph_forward``) is not
    claimed: its encoder graphs are vLLM's.
    """
    if callable(getattr(model, "encoder_cudagraph_forward", None)):
        return False
    return (
        _tower(model, "visual", VISION_TOWER) is not None
        or _tower(model, "audio_tower", AUDIO_TOWER) is not None
    )


def instrument(
    model: Any, vllm_config: Any = None, **choices: Unpack[AdapterChoices]
) -> Instrumented:
    """Attach the vision and audio adapters to a loaded Qwen2.5-Omni thinker, once.

    A thinker that already carries adapters gets them back unchanged. ``vllm_config`` and
    ``choices`` (``bus``, ``hf_config``, ``enforce_eager``, ``backend``) mean what they mean
    for every integration (:meth:`omnitrace.integrations.base.Adapters.for_model`).

    Raises:
        ConfigError: an ``encoder_cuda_graph*`` override is invalid.
    """
    adapters = Adapters.for_model(model, vllm_config, **choices)
    visual = _tower(model, "visual", VISION_TOWER)
    tower = _tower(model, "audio_tower", AUDIO_TOWER)
    with attach_lock:
        return Instrumented(
            vision=None if visual is None else _attach_vision(adapters, visual),
            audio=None if tower is None else _attach_audio(adapters, tower),
        )


def _attach_vision(adapters: Adapters, visual: nn.Module) -> EncoderCudaGraph:
    graph, made = adapters.attach(
        visual, GRAPH_ATTR, "vision", lambda: _vision_stack(visual.forward)
    )
    if made:
        route_method(visual, "forward", lambda original: _VisionForward(visual, graph, original))
        describe_items(graph)
    return graph


def _attach_audio(adapters: Adapters, tower: nn.Module) -> EncoderCudaGraph | None:
    seam = audio_seam(tower)
    if seam is None:
        warn_unsupported(
            logger,
            tower,
            "'s module lacks the metadata functions its forward accepts precomputed "
            "(transformers 5); the audio tower runs without graphs",
        )
        return None
    masked = None
    if adapters.config.audio_attention == "masked" and getattr(tower, GRAPH_ATTR, None) is None:
        masked = masked_binding(tower)
        if masked is None:
            warn_unsupported(
                logger,
                tower,
                " has no %s layers dispatched through its module's ALL_ATTENTION_FUNCTIONS; "
                "encoder_cuda_graph_audio_attention 'masked' is not applied (native attention)",
                AUDIO_ATTENTION_LAYER,
            )
    graph, made = adapters.attach(
        tower, GRAPH_ATTR, "audio", lambda: _audio_stack(tower.forward, masked)
    )
    if made:
        route_method(
            tower, "forward", lambda original: _AudioForward(tower, graph, original, seam, masked)
        )
        describe_items(graph)
    return graph


#: This model's integration, which omnitrace.integrations.registry finds in this module.
INTEGRATION = ModelIntegration(
    name="qwen2_5_omni",
    detect=detect,
    instrument=instrument,
    description=(
        "Qwen2.5-Omni thinker: vLLM's Qwen2.5 vision transformer (visual) and transformers' "
        "audio encoder (audio_tower)"
    ),
)
