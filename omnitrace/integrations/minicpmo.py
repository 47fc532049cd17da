"""Attach encoder graph adapters to a loaded MiniCPM-o 4.5 model: the whole vision path (or the
SigLIP stack alone) and the batch audio path, each fallback recorded as an ineligible miss
(docs/vllm.md, "MiniCPM-o 4.5", says what each graph holds and why)."""

from __future__ import annotations

import functools
import inspect
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from typing_extensions import Unpack

from omnitrace.graphs.adapter import EncoderCudaGraph
from omnitrace.integrations import minicpmo_vision
from omnitrace.integrations.base import (
    AdapterChoices,
    Adapters,
    ModelIntegration,
    attach_lock,
    code_names,
    code_strings,
    config_from_model,
    describe_items,
    output_tensor,
    record_ineligible,
    route_method,
    warn_unsupported,
)

__all__ = [
    "AUDIO_ATTR",
    "AUDIO_BATCH_METHODS",
    "INTEGRATION",
    "VISION_ATTR",
    "Instrumented",
    "audio_batch_method",
    "config_from_model",
    "detect",
    "encode_audio",
    "encode_audio_streaming",
    "instrument",
]

logger = logging.getLogger(__name__)

#: Where the vision adapter lives, on ``model.vpm``.
VISION_ATTR = "_encoder_graph"
#: Where the audio adapter lives, on the model.
AUDIO_ATTR = "_audio_encoder_graph"

#: Names of vLLM's batch (stateless) audio method on MiniCPM-o models, tried in order.
AUDIO_BATCH_METHODS = ("get_audio_hidden_states",)

_AUDIO_METHOD = "_omnitrace_audio_method"
_VISION_METHOD = "_omnitrace_vision_method"


@dataclass(frozen=True, slots=True)
class Instrumented:
    """The adapters :func:`instrument` attached (None where the model has no such encoder)."""

    vision: EncoderCudaGraph | None
    audio: EncoderCudaGraph | None
    #: The model's batch audio method routed through ``audio`` (None: only
    #: :func:`encode_audio` uses the audio adapter).
    audio_method: str | None = None
    #: The model's vision method whose whole path ``vision`` serves (None: the SigLIP
    #: encoder stack alone).
    vision_path: str | None = None


# -- vision ------------------------------------------------------------------------------------


def _vision_stack(encoder_forward: Callable[..., Any]) -> Callable[..., torch.Tensor]:
    def stack(hidden: torch.Tensor, attention_mask: torch.Tensor | None) -> torch.Tensor:
        return output_tensor(encoder_forward(hidden, attention_mask=attention_mask))

    return stack


class _VisionEncoderForward:
    """``vpm.encoder.forward`` served by the adapter; ``vpm.forward`` runs unchanged around it."""

    def __init__(self, vpm: Any, graph: EncoderCudaGraph, original: Callable[..., Any]):
        self._vpm = vpm
        self._graph = graph
        self.original = original

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        vpm, graph = self._vpm, self._graph
        hidden = args[0] if args else kwargs.get("inputs_embeds")
        mask = args[1] if len(args) > 1 else kwargs.get("attention_mask")
        # vLLM calls encoder(hidden, attention_mask=mask); anything more (Hugging Face's
        # output_attentions, output_hidden_states, return_dict ...) runs the original.
        allowed = {"attention_mask"} if args else {"inputs_embeds", "attention_mask"}
        detail = None
        if vpm.training or vpm.encoder.training:
            detail = "training"
        elif len(args) > 2 or set(kwargs) - allowed:
            detail = "arguments"
        elif getattr(vpm, "use_data_parallel", False):
            # Data-parallel vision sharding splits the batch across ranks inside vpm.forward.
            detail = "data_parallel"
        if detail is not None or not isinstance(hidden, torch.Tensor):
            record_ineligible(graph, detail or "arguments", hidden, mask)
            return self.original(*args, **kwargs)
        return graph(hidden, mask)


# -- audio -------------------------------------------------------------------------------------


def _pool(model: Any, states: torch.Tensor) -> torch.Tensor:
    embeds = model.audio_projection_layer(states)
    pooled: torch.Tensor = model.audio_avg_pooler(embeds.transpose(1, 2))
    return pooled.transpose(1, 2)


def _audio_states(model: Any, result: Any) -> torch.Tensor:
    hidden_states = getattr(result, "hidden_states", None)
    layer = getattr(model, "audio_encoder_layer", -1)
    if hidden_states is not None:
        states: torch.Tensor = hidden_states[layer]
        return states
    return output_tensor(result)


def _audio_stack(model: Any) -> Callable[[torch.Tensor, torch.Tensor | None], torch.Tensor]:
    def stack(mel: torch.Tensor, attention_mask: torch.Tensor | None) -> torch.Tensor:
        return _pool(model, _audio_states(model, model.apm(mel, attention_mask=attention_mask)))

    return stack


def _audio_dtype(model: Any) -> torch.dtype | None:
    for parameter in model.apm.parameters():
        dtype: torch.dtype = parameter.dtype
        return dtype
    return None


def _audio_ineligible(model: Any, mel: torch.Tensor | None) -> str | None:
    """Name the model-level reason the audio encoder must run eagerly, if any."""
    if model.training or model.apm.training:
        return "training"
    mel_fp16 = mel is not None and mel.dtype == torch.float16
    if mel_fp16 or _audio_dtype(model) == torch.float16:
        # The Whisper layers clamp fp16 overflow after a host-side check of the values.
        return "fp16"
    return None


def encode_audio(
    model: Any, mel: torch.Tensor, attention_mask: torch.Tensor | None = None
) -> torch.Tensor:
    """Run the stateless audio encoder (Whisper, projection, pooling) on ``mel``.

    Uses ``model._audio_encoder_graph`` when it is attached and the call is eligible;
    training mode and fp16 stay eager (recorded as ineligible misses).
    """
    graph: EncoderCudaGraph | None = getattr(model, AUDIO_ATTR, None)
    stack = _audio_stack(model)
    if graph is None:
        return stack(mel, attention_mask)
    detail = _audio_ineligible(model, mel)
    if detail is not None:
        record_ineligible(graph, detail, mel, attention_mask)
        return stack(mel, attention_mask)
    out: torch.Tensor = graph(mel, attention_mask)
    return out


def encode_audio_streaming(
    model: Any,
    mel: torch.Tensor,
    past_key_values: Any = None,
    attention_mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, Any]:
    """Run one chunk of the stateful streaming audio path; never uses the graph.

    The Whisper encoder runs with its key/value cache (``use_cache=True``), whose state
    changes on every chunk, so a replayed graph would be wrong. The call is recorded as an
    ineligible miss with detail ``streaming`` when an audio adapter is attached.

    Returns:
        ``(embeddings, past_key_values)`` for the next chunk.
    """
    graph: EncoderCudaGraph | None = getattr(model, AUDIO_ATTR, None)
    if graph is not None:
        record_ineligible(graph, "streaming", mel, attention_mask)
    result = model.apm(
        mel, attention_mask=attention_mask, past_key_values=past_key_values, use_cache=True
    )
    return _pool(model, _audio_states(model, result)), getattr(result, "past_key_values", None)


# -- the model's own batch audio method -------------------------------------------------------

# What vLLM's get_audio_hidden_states(data) reads, in the order it uses them: the recognised
# structure. A method of that name without these (an older vLLM's two-argument version that
# returns one padded tensor, say) is left alone.
_BATCH_METHOD_NAMES = frozenset(
    {
        "audio_chunk_length",
        "apm",
        "subsequent_chunk_mask",
        "hidden_states",
        "audio_encoder_layer",
        "audio_projection_layer",
        "audio_avg_pooler",
        "_get_feat_extract_output_lengths",
    }
)
_BATCH_METHOD_KEYS = frozenset({"audio_features", "audio_feature_lens"})


def _batch_method_structure(function: Any) -> bool:
    code = getattr(function, "__code__", None)
    if code is None:
        return False
    try:
        parameters = list(inspect.signature(function).parameters.values())
    except (TypeError, ValueError):
        return False
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    if len(parameters) != 2 or any(p.kind not in positional for p in parameters):
        return False
    return (
        code_names(function) >= _BATCH_METHOD_NAMES and code_strings(function) >= _BATCH_METHOD_KEYS
    )


def audio_batch_method(model: Any) -> str | None:
    """Name ``model``'s batch audio method that the audio adapter can serve, if it has one.

    Looks on the class (``model`` may be the class itself) for a method named in
    :data:`AUDIO_BATCH_METHODS` with vLLM's structure: ``method(self, data)`` reading
    ``data["audio_features"]`` and ``data["audio_feature_lens"]`` and running ``apm``, the
    projection and the average pooler with the chunked padding mask.
    """
    cls = model if isinstance(model, type) else type(model)
    for name in AUDIO_BATCH_METHODS:
        if _batch_method_structure(inspect.getattr_static(cls, name, None)):
            return name
    return None


def _padded_features(raw: torch.Tensor | list[torch.Tensor]) -> torch.Tensor:
    # vLLM: a list of (C, L_i) features is zero-padded on the right to (B, C, max L_i).
    if not isinstance(raw, list):
        return raw
    batch = len(raw)
    channels = raw[0].shape[-2]
    length = max(item.shape[-1] for item in raw)
    padded = torch.zeros((batch, channels, length), dtype=raw[0].dtype, device=raw[0].device)
    for i, item in enumerate(raw):
        padded[i, ..., : item.shape[-1]] = item
    return padded


def _batch_attention_mask(model: Any, wavforms: torch.Tensor, lens: torch.Tensor) -> torch.Tensor:
    """vLLM's additive ``(B, 1, T, T)`` mask: padded frames and later chunks are ``-inf``."""
    batch_size, _, max_mel_seq_len = wavforms.shape
    max_seq_len = (max_mel_seq_len - 1) // 2 + 1
    seq_range = (
        torch.arange(0, max_seq_len, dtype=lens.dtype, device=lens.device)
        .unsqueeze(0)
        .expand(batch_size, max_seq_len)
    )
    lengths_expand = lens.unsqueeze(1).expand(batch_size, max_seq_len)
    padding_mask = seq_range >= lengths_expand
    masked = padding_mask.view(batch_size, 1, 1, max_seq_len).expand(
        batch_size, 1, max_seq_len, max_seq_len
    )
    weight = model.apm.conv1.weight
    mask = masked.to(dtype=weight.dtype, device=weight.device)
    chunk_length = model.config.audio_chunk_length
    if chunk_length > 0:
        chunk_mask = model.subsequent_chunk_mask(
            size=max_seq_len,
            chunk_size=int(chunk_length * 50),
            num_left_chunks=-1,
            device=masked.device,
        )
        masked = torch.logical_or(masked, torch.logical_not(chunk_mask))
    # vLLM writes mask[masked] = -inf: a boolean index, whose nonzero() waits for the device.
    # masked_fill_ gives the same tensor without that wait.
    return mask.masked_fill_(masked.to(mask.device), float("-inf"))


class _AudioBatchMethod:
    """The model's batch audio method with apm + projection + pooling served by the adapter.

    Everything around that stack is vLLM's ``get_audio_hidden_states`` step for step: list
    features are zero-padded to one ``(B, C, L)`` batch, the per-slice lengths
    (``audio_feature_lens``, one row per audio item) build the padding-and-chunk mask, the
    whole batch goes through one adapter call, and each item's slices are cut to their pooled
    lengths and concatenated, one tensor per audio item.
    """

    def __init__(self, model: Any, graph: EncoderCudaGraph, original: Callable[..., Any]):
        self._model = model
        self._graph = graph
        self.original = original

    def __call__(self, data: Any, *args: Any, **kwargs: Any) -> Any:
        model, graph = self._model, self._graph
        features: Any = None
        lens_raw: Any = None
        detail = None
        if args or kwargs:
            detail = "arguments"
        else:
            try:
                features = data["audio_features"]
                lens_raw = data["audio_feature_lens"]
            except (KeyError, AttributeError, TypeError, IndexError):
                detail = "arguments"
            else:
                if not _batch_arguments(features, lens_raw):
                    detail = "arguments"
        sample = features if detail is None and isinstance(features, list) else [features]
        first = sample[0] if isinstance(sample[0], torch.Tensor) else None
        if detail is None:
            detail = _audio_ineligible(model, first)
        if detail is not None:
            record_ineligible(graph, detail, first)
            return self.original(data, *args, **kwargs)

        if isinstance(lens_raw, torch.Tensor):
            lens_raw = lens_raw.unbind(0)
        lens = torch.hstack(lens_raw)
        slices = self._slices_alone(features, lens) if self._graph.split_items else None
        if slices is None:
            wavforms = _padded_features(features)
            audio_embeds = encode_audio(
                model, wavforms, _batch_attention_mask(model, wavforms, lens)
            )
            rows = list(audio_embeds)
        else:
            # One call per slice, at its own length: no other slice's padding in its batch.
            rows = [
                encode_audio(model, mel, _batch_attention_mask(model, mel, length))[0]
                for mel, length in slices
            ]
        _, num_audio_tokens = model._get_feat_extract_output_lengths(lens)
        # One read of the lengths, where vLLM's slicing by a device tensor waits once a slice.
        counts = [int(n) for n in num_audio_tokens.tolist()]
        final: list[torch.Tensor] = []
        idx = 0
        for item in lens_raw:
            parts: list[torch.Tensor] = []
            for _ in range(len(item)):
                parts.append(rows[idx][: counts[idx], :])
                idx += 1
            final.append(torch.cat(parts))
        return final

    def _slices_alone(
        self, features: Any, lens: torch.Tensor
    ) -> list[tuple[torch.Tensor, torch.Tensor]] | None:
        """Each slice's ``(1, C, length)`` mel and its length, for a call of several slices
        whose lengths fit their mels; None to serve the call as one batch."""
        count = len(features)
        if count < 2 or lens.dim() != 1 or len(lens) != count:
            return None
        frames = [int(n) for n in lens.tolist()]
        pieces = []
        for mel, n in zip(features, frames, strict=True):
            # A slice is (C, L) or (1, C, L), as vLLM's method copies it into its batch row.
            if mel.dim() not in (2, 3) or mel.numel() != mel.shape[-2] * mel.shape[-1]:
                return None
            if not 0 < n <= mel.shape[-1]:
                return None
            pieces.append(mel[..., :n].reshape(1, *mel.shape[-2:-1], n))
        return [(piece, lens[i : i + 1]) for i, piece in enumerate(pieces)]


def _batch_arguments(features: Any, lens_raw: Any) -> bool:
    """Whether the features and lengths have the types vLLM's batch method handles."""
    if isinstance(features, list):
        if not features or not all(isinstance(x, torch.Tensor) for x in features):
            return False
    elif not isinstance(features, torch.Tensor) or features.dim() != 3:
        return False
    if isinstance(lens_raw, torch.Tensor):
        return lens_raw.dim() == 2
    return (
        isinstance(lens_raw, (list, tuple))
        and bool(lens_raw)
        and all(isinstance(x, torch.Tensor) and x.dim() == 1 for x in lens_raw)
    )


def _route_audio_batch_method(model: Any, graph: EncoderCudaGraph) -> str | None:
    name = audio_batch_method(model)
    if name is None:
        methods = ", ".join(AUDIO_BATCH_METHODS)
        warn_unsupported(
            logger,
            model,
            " has no recognised batch audio method (%s); audio graphs are used only through "
            "omnitrace.integrations.minicpmo.encode_audio",
            methods,
        )
        return None
    # vLLM's self.<name>(data) finds the instance attribute first; the class is untouched.
    route_method(model, name, lambda original: _AudioBatchMethod(model, graph, original))
    describe_items(graph)
    object.__setattr__(model, _AUDIO_METHOD, name)
    return name


# -- attaching ---------------------------------------------------------------------------------


def _take_table(table: minicpmo_vision.PositionTable, model: Any, device: Any) -> None:
    table.take(model, device)


def detect(model: Any) -> bool:
    """Whether ``model`` has a MiniCPM-o vision tower (``vpm``) or audio encoder (``apm``)."""
    return hasattr(model, "vpm") or hasattr(model, "apm")


def instrument(
    model: Any, vllm_config: Any = None, **choices: Unpack[AdapterChoices]
) -> Instrumented:
    """Attach the vision and audio adapters to a loaded MiniCPM-o model.

    Idempotent: a model that already carries adapters gets them back unchanged.

    Args:
        model: the loaded model (``vpm`` vision tower and/or ``apm`` audio encoder).
        vllm_config: the engine's ``VllmConfig`` (config source and backend choice).
        choices: ``bus``, ``hf_config``, ``enforce_eager``, ``backend``, as for every
            integration (:meth:`omnitrace.integrations.base.Adapters.for_model`).

    Raises:
        ConfigError: an ``encoder_cuda_graph*`` override is invalid.
    """
    adapters = Adapters.for_model(model, vllm_config, **choices)
    with attach_lock:
        vision: EncoderCudaGraph | None = None
        vision_path: str | None = None
        vpm = getattr(model, "vpm", None)
        encoder = getattr(vpm, "encoder", None)
        if isinstance(vpm, nn.Module) and getattr(vpm, VISION_ATTR, None) is not None:
            vision = getattr(vpm, VISION_ATTR)
            vision_path = getattr(model, _VISION_METHOD, None)
        elif isinstance(vpm, nn.Module) and minicpmo_vision.supports_path(model) is None:
            table = minicpmo_vision.PositionTable()
            vision, _ = adapters.attach(
                vpm, VISION_ATTR, "vision", lambda: minicpmo_vision.path_forward(model, table)
            )
            graph = vision
            # A graph prepared before serving reads the table a first call would take.
            graph.prepare_hook = functools.partial(_take_table, table, model)
            vision_path = minicpmo_vision.VISION_METHOD
            route_method(
                model,
                vision_path,
                lambda original: minicpmo_vision.VisionPathMethod(model, graph, original, table),
            )
            object.__setattr__(model, _VISION_METHOD, vision_path)
        elif isinstance(vpm, nn.Module) and isinstance(encoder, nn.Module):
            vision, made = adapters.attach(
                vpm, VISION_ATTR, "vision", lambda: _vision_stack(encoder.forward)
            )
            if made:
                graph = vision
                route_method(
                    encoder,
                    "forward",
                    lambda original: _VisionEncoderForward(vpm, graph, original),
                )
        audio: EncoderCudaGraph | None = None
        audio_method: str | None = None
        if isinstance(getattr(model, "apm", None), nn.Module):
            audio, made = adapters.attach(model, AUDIO_ATTR, "audio", lambda: _audio_stack(model))
            if made:
                audio_method = _route_audio_batch_method(model, audio)
            else:
                audio_method = getattr(model, _AUDIO_METHOD, None)
    return Instrumented(
        vision=vision, audio=audio, audio_method=audio_method, vision_path=vision_path
    )


#: This model's integration, which omnitrace.integrations.registry finds in this module.
INTEGRATION = ModelIntegration(
    name="minicpmo",
    detect=detect,
    instrument=instrument,
    description="MiniCPM-o: SigLIP vision encoder (vpm) and stateless Whisper audio (apm)",
)
