"""MiniCPM-o's whole vision path in one graph (patch embedding, SigLIP, post-norm, resampler),
what depends on the slices' sizes prepared once per size tuple, each capture checked against
vLLM's own method (docs/vllm.md, "MiniCPM-o 4.5")."""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from omnitrace.graphs.adapter import EncoderCudaGraph
from omnitrace.integrations.base import code_names, code_strings, record_ineligible

__all__ = ["VISION_METHOD", "PositionTable", "VisionPathMethod", "path_forward", "supports_path"]

logger = logging.getLogger(__name__)

#: vLLM's batch vision method of MiniCPM-V/-o, which the whole-path adapter serves.
VISION_METHOD = "get_vision_hidden_states"

# Per-size-tuple tensors kept on the device; a server sees a handful of slice layouts.
_CACHE_ENTRIES = 256

# The names each vLLM function reads that the path below reproduces; a release whose code
# reads otherwise keeps the tower-only graph.
_METHOD_NAMES = frozenset({"vpm", "resampler", "prod", "max", "item", "zeros"})
_METHOD_KEYS = frozenset({"pixel_values", "tgt_sizes"})
_VPM_NAMES = frozenset({"embeddings", "encoder", "post_layernorm", "apply_encoder_attention_mask"})
_RESAMPLER_NAMES = frozenset({"kv_proj", "ln_kv", "ln_q", "query", "pos_embed", "attn", "_repeat"})
_RESAMPLER_TAIL = frozenset({"ln_post", "proj"})
_RESAMPLERS = frozenset({"Resampler2_5", "Resampler4_5"})


def supports_path(model: Any) -> str | None:
    """Say why ``model``'s vision path cannot be one graph here, or None when it can.

    The path is served where the model's ``get_vision_hidden_states`` is vLLM's MiniCPM-V
    2.5-and-later method (slices padded into one batch, ``vpm`` then ``resampler``), the
    ``vpm`` is vLLM's Idefics2/SigLIP tower and the resampler vLLM's ``Resampler2_5`` or
    ``Resampler4_5``.
    """
    cls = type(model)
    method = getattr(cls, VISION_METHOD, None)
    if method is None:
        return f"no {VISION_METHOD}"
    if not (code_names(method) >= _METHOD_NAMES and code_strings(method) >= _METHOD_KEYS):
        return f"{VISION_METHOD} is not vLLM's MiniCPM-V 2.5+ method"
    vpm = getattr(model, "vpm", None)
    embeddings = getattr(vpm, "embeddings", None)
    if vpm is None or embeddings is None or not hasattr(vpm, "encoder"):
        return "no vpm tower with embeddings and encoder"
    if not code_names(type(vpm).forward) >= _VPM_NAMES:
        return "vpm.forward is not vLLM's Idefics2 tower"
    for part in ("patch_embedding", "position_embedding", "num_patches_per_side"):
        if not hasattr(embeddings, part):
            return f"vpm.embeddings has no {part}"
    resampler = getattr(model, "resampler", None)
    names = {c.__name__ for c in type(resampler).__mro__}
    if not names & _RESAMPLERS:
        return "the resampler is not vLLM's Resampler2_5/4_5"
    forward_names = code_names(getattr(type(resampler), "forward", None))
    if not forward_names >= (_RESAMPLER_NAMES | _RESAMPLER_TAIL):
        return "the resampler's forward is not vLLM's"
    return None


class PositionTable:
    """The resampler's positional table the graphs read: a copy taken once and held.

    A graph keeps the address of every tensor it read at capture. vLLM's resampler replaces
    its table when a slice outgrows it and may keep it on the CPU, so the graphs read a copy
    of their own on the pixels' device, in the embeddings' dtype, taken on the first
    eligible call and held for the model's lifetime. Slices beyond it run vLLM's method.
    """

    __slots__ = ("_lock", "tensor")

    def __init__(self) -> None:
        self.tensor: torch.Tensor | None = None
        self._lock = threading.Lock()

    def take(self, model: Any, device: torch.device) -> torch.Tensor:
        """The copy the graphs read: taken now on ``device`` if none was taken yet.

        Called on the first eligible call, and before a graph is prepared at start-up
        (the adapter's ``prepare_hook``), never inside a capture.
        """
        table = self.tensor
        if table is None:
            with self._lock:
                if self.tensor is None:
                    self.tensor = _device_table(model, device)
                table = self.tensor
        return table


def path_forward(model: Any, table: PositionTable) -> Callable[..., torch.Tensor]:
    """The whole vision path for fixed slice sizes: what the adapter captures per shape.

    ``forward(pixels, position_ids, attention_mask, pos_index, key_padding_mask)`` takes
    the padded ``(B, 3, 14, L)`` pixels and the per-size tensors :class:`VisionPathMethod`
    prepares, and returns the resampler's ``(B, Q, D)`` output, step for step as vLLM's
    embeddings, tower and ``Resampler2_5``/``Resampler4_5`` compute it. ``table`` is the
    positional table :class:`VisionPathMethod` took; ``pos_index`` indexes its rows.
    """
    vpm = model.vpm
    resampler = model.resampler
    embeddings = vpm.embeddings

    def forward(
        pixels: torch.Tensor,
        position_ids: torch.Tensor,
        attention_mask: torch.Tensor | None,
        pos_index: torch.Tensor,
        key_padding_mask: torch.Tensor,
    ) -> torch.Tensor:
        weight = embeddings.patch_embedding.weight
        hidden = embeddings.patch_embedding(pixels.to(weight.dtype)).flatten(2).transpose(1, 2)
        hidden += embeddings.position_embedding(position_ids)
        hidden = vpm.encoder(hidden, attention_mask=attention_mask)
        hidden = vpm.post_layernorm(hidden)

        batch = hidden.shape[0]
        positions = table.tensor
        if positions is None:
            # Reading vLLM's own table here would bake an address vLLM may replace.
            raise RuntimeError(
                "the whole vision path runs through VisionPathMethod, which takes the "
                "positional table first"
            )
        flat = positions.reshape(-1, positions.shape[-1])
        # vLLM slices table[:h, :w] per slice, casts it, and zero-pads to the longest slice.
        pos = flat[pos_index].to(dtype=hidden.dtype)
        pos = torch.where(key_padding_mask.unsqueeze(-1), torch.zeros_like(pos), pos)
        x, _ = resampler.kv_proj(hidden)
        x = resampler.ln_kv(x).permute(1, 0, 2)
        q = resampler.ln_q(resampler.query)
        out = resampler.attn(
            resampler._repeat(q, batch),
            x + pos.permute(1, 0, 2),
            x,
            key_padding_mask=key_padding_mask,
        )[0]
        x = out.permute(1, 0, 2)
        x = resampler.ln_post(x)
        result: torch.Tensor = x @ resampler.proj
        return result

    return forward


class _Prepared(NamedTuple):
    position_ids: torch.Tensor
    attention_mask: torch.Tensor | None
    pos_index: torch.Tensor
    key_padding_mask: torch.Tensor


@dataclass(frozen=True, slots=True)
class _Call:
    """What one recognised call of vLLM's method holds."""

    pixels: list[torch.Tensor]
    sizes: tuple[tuple[int, int], ...]
    tgt_sizes: torch.Tensor


def _recognise(data: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> _Call | str:
    """The call's slices and sizes, or the detail of why it is not one this path serves."""
    if args or kwargs:
        return "arguments"
    try:
        pixels = data["pixel_values"]
        tgt_sizes = data["tgt_sizes"]
        temporal = data.get("temporal_ids", None)
    except (KeyError, AttributeError, TypeError, IndexError):
        return "arguments"
    if temporal is not None:
        return "temporal"
    if isinstance(pixels, torch.Tensor) and pixels.dim() == 4:
        # Slices of one length may come stacked; vLLM's method iterates them the same way.
        pixels = list(pixels.unbind(0))
    if (
        not isinstance(pixels, (list, tuple))
        or not pixels
        or not all(isinstance(p, torch.Tensor) and p.dim() == 3 for p in pixels)
        or not isinstance(tgt_sizes, torch.Tensor)
        or tgt_sizes.dim() != 2
        or tgt_sizes.shape != (len(pixels), 2)
        or tgt_sizes.is_floating_point()
    ):
        return "arguments"
    first = pixels[0]
    if any(p.shape[:2] != first.shape[:2] or p.device != first.device for p in pixels):
        return "arguments"
    # One host read of the sizes; vLLM's own method syncs on them several times.
    sizes = tuple((int(h), int(w)) for h, w in tgt_sizes.tolist())
    if any(h < 1 or w < 1 for h, w in sizes):
        return "arguments"
    return _Call(list(pixels), sizes, tgt_sizes)


class VisionPathMethod:
    """vLLM's ``get_vision_hidden_states`` served by the whole-path adapter.

    Args:
        model: the MiniCPM-V/-o model (``vpm``, ``resampler``).
        graph: the vision adapter, serving :func:`path_forward` of ``model`` and ``table``.
        original: vLLM's bound method, for the calls this path leaves and for the check of
            every capture.
        table: the positional table the graphs read, taken on the first eligible call.
    """

    def __init__(
        self,
        model: Any,
        graph: EncoderCudaGraph,
        original: Callable[..., Any],
        table: PositionTable,
    ):
        self._model = model
        self._graph = graph
        self.original = original
        self._table = table
        self._lock = threading.Lock()
        self._cache: OrderedDict[tuple[Any, ...], _Prepared] = OrderedDict()
        self._diverged = False
        forward = type(model.vpm).forward
        # vLLM 0.26 passes no mask when no slice is padded; later releases always pass one.
        self._mask_when_unpadded = "any" not in code_names(forward)

    @property
    def diverged(self) -> bool:
        """Whether a capture's result differed from vLLM's, which turned this path off."""
        return self._diverged

    def __call__(self, data: Any, *args: Any, **kwargs: Any) -> Any:
        graph = self._graph
        call = _recognise(data, args, kwargs)
        pixels0 = call.pixels[0] if isinstance(call, _Call) else None
        detail = call if isinstance(call, str) else self._ineligible(call)
        if detail is not None:
            record_ineligible(graph, detail, pixels0)
            return self.original(data, *args, **kwargs)
        assert isinstance(call, _Call)
        padded = _padded(call.pixels)
        prepared = self._prepare(call, padded)
        before = graph.num_graphs
        out = graph(padded, *prepared)
        # A new graph, or one prepared before serving (captured from zeros), meets its first
        # real inputs here: checked against vLLM's method once.
        if graph.num_graphs != before or (
            graph.unchecked_prepared and graph.first_prepared_call(padded, *prepared)
        ):
            out = self._check(data, out)
        return out

    def _ineligible(self, call: _Call) -> str | None:
        model = self._model
        vpm = model.vpm
        if model.training or vpm.training or model.resampler.training:
            return "training"
        if getattr(vpm, "use_data_parallel", False):
            return "data_parallel"
        if self._diverged:
            return "diverged"
        table = self._table.take(model, call.pixels[0].device)
        rows, cols = table.shape[0], table.shape[1]
        if any(h > rows or w > cols for h, w in call.sizes):
            # vLLM's method grows its table for such a slice; the graphs keep theirs.
            return "pos_cache"
        return None

    def _check(self, data: Any, out: torch.Tensor) -> torch.Tensor:
        """Compare a new graph's result with vLLM's method on the same inputs."""
        want: torch.Tensor = self.original(data)
        if want.shape == out.shape and want.dtype == out.dtype and torch.equal(want, out):
            return out
        with self._lock:
            first = not self._diverged
            self._diverged = True
        if first:
            difference = _difference(out, want)
            logger.warning(
                "omnitrace: %s's whole vision path gave another result than vLLM's %s on "
                "the first call of a new graph (%s); vision calls now run vLLM's method",
                type(self._model).__name__,
                VISION_METHOD,
                difference,
            )
        return want

    def _prepare(self, call: _Call, padded: torch.Tensor) -> _Prepared:
        model = self._model
        dtype = model.vpm.embeddings.patch_embedding.weight.dtype
        patches = padded.shape[-1] // padded.shape[-2]
        key = (call.sizes, patches, padded.device, dtype)
        with self._lock:
            found = self._cache.get(key)
            if found is not None:
                self._cache.move_to_end(key)
                return found
        prepared = self._build(call, patches, padded.device, dtype)
        with self._lock:
            self._cache[key] = prepared
            while len(self._cache) > _CACHE_ENTRIES:
                self._cache.popitem(last=False)
        return prepared

    def _build(
        self, call: _Call, patches: int, device: torch.device, dtype: torch.dtype
    ) -> _Prepared:
        model = self._model
        batch = len(call.sizes)
        counts = [h * w for h, w in call.sizes]
        if max(counts) != patches:
            raise ValueError(
                f"MiniCPM-V slices of {patches} patches with tgt_sizes {list(call.sizes)}: "
                "the longest slice must hold as many patches as its sizes say"
            )
        valid = torch.zeros((batch, patches), dtype=torch.bool)
        for i, count in enumerate(counts):
            valid[i, :count] = True
        valid = valid.to(device)
        position_ids = _position_ids(model.vpm.embeddings, valid, call.tgt_sizes, call.sizes)
        position_ids = position_ids.to(model.vpm.embeddings.position_embedding.weight.device)
        padded_any = min(counts) < patches
        attention_mask: torch.Tensor | None = None
        if model.vpm.apply_encoder_attention_mask and (padded_any or self._mask_when_unpadded):
            min_value = torch.finfo(dtype).min
            attention_mask = ((~valid).to(dtype=dtype) * min_value)[:, None, None, :]
        table = self._table.tensor
        assert table is not None  # taken by _ineligible before any call is prepared
        cols = table.shape[1]
        pos_index = torch.zeros((batch, patches), dtype=torch.long)
        for i, (h, w) in enumerate(call.sizes):
            rows = torch.arange(h).unsqueeze(1) * cols
            pos_index[i, : h * w] = (rows + torch.arange(w)).flatten()
        return _Prepared(position_ids, attention_mask, pos_index.to(device), ~valid)


def _device_table(model: Any, device: torch.device) -> torch.Tensor:
    """The resampler's positional table on ``device``, in the embeddings' dtype.

    vLLM's resampler may keep its table on the CPU (its move to the device runs inside the
    language model's forward, which vLLM compiles) and copies each slice's rows to the
    device and casts them on every call. One copy, cast once, serves every graph: a cast is
    the same rounding wherever it runs, and a copy of our own keeps its address for the
    graphs however vLLM replaces its table.
    """
    table: torch.Tensor = model.resampler.pos_embed
    dtype = model.vpm.embeddings.patch_embedding.weight.dtype
    return table.to(device=device, dtype=dtype, copy=True)


def _padded(pixels: Sequence[torch.Tensor]) -> torch.Tensor:
    """vLLM's zero-padded ``(B, 3, P, L)`` batch of the flattened slices."""
    first = pixels[0]
    length = max(p.shape[-1] for p in pixels)
    if all(p.shape[-1] == length for p in pixels):
        return torch.stack(list(pixels))
    out = torch.zeros(
        (len(pixels), *first.shape[:2], length), dtype=first.dtype, device=first.device
    )
    for i, item in enumerate(pixels):
        out[i, ..., : item.shape[-1]] = item
    return out


def _position_ids(
    embeddings: Any,
    valid: torch.Tensor,
    tgt_sizes: torch.Tensor,
    sizes: Sequence[tuple[int, int]],
) -> torch.Tensor:
    """The embeddings' position ids of each slice, as the loaded vLLM computes them."""
    method = getattr(embeddings, "get_position_ids", None)
    if method is not None:
        ids: torch.Tensor = method(valid.unsqueeze(1), tgt_sizes)
        return ids
    # vLLM 0.26's embeddings.forward, per slice: the step is 1 / a tensor of tgt_sizes's
    # dtype (so float32, as there), the buckets follow the tower's patch grid.
    per_side = embeddings.num_patches_per_side
    boundaries = torch.arange(1 / per_side, 1.0, 1 / per_side)
    out = torch.full(size=valid.shape, fill_value=0)
    for i, (h, w) in enumerate(sizes):
        nb_h = torch.tensor(h, dtype=tgt_sizes.dtype)
        nb_w = torch.tensor(w, dtype=tgt_sizes.dtype)
        # arange takes the 0-dim float32 step as vLLM passes it (typed as a number).
        step_h: Any = 1 / nb_h
        step_w: Any = 1 / nb_w
        coords_h = torch.bucketize(torch.arange(0, 1 - 1e-6, step_h), boundaries, right=True)
        coords_w = torch.bucketize(torch.arange(0, 1 - 1e-6, step_w), boundaries, right=True)
        out[i, : h * w] = (coords_h[:, None] * per_side + coords_w).flatten()
    return out


def _difference(out: torch.Tensor, want: torch.Tensor) -> str:
    if out.shape != want.shape or out.dtype != want.dtype:
        return f"{out.dtype}{list(out.shape)} against {want.dtype}{list(want.shape)}"
    delta = (out.float() - want.float()).abs().max().item()
    return f"largest difference {delta:.3g}"
