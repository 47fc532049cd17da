"""Small stand-ins with Qwen2.5-Omni's thinker layout (random weights, CPU-sized).

``Qwen2_5_VisionTransformer`` follows vLLM's: ``prepare_encoder_metadata(grid_thw)`` does the
host work (a window permutation per frame, ``cu_seqlens`` through ``.tolist()``, the rotary
table) and returns vLLM's metadata layout, with ``max_seqlen_*`` as CPU int32 scalars that
are 0 unless the attention backend is a flash-attention kind; ``forward(x, grid_thw, *,
encoder_metadata=None)`` embeds patches, reorders windows, runs blocks over full and window
sequences (split with ``.tolist()``, as vLLM's SDPA wrapper does), merges and reorders back.

``Qwen2_5OmniAudioEncoder`` follows transformers': this module defines the metadata
functions its forward calls (``chunk_and_pad_features``, ``get_valid_indices``,
``get_pool_indices``, ``get_audio_cu_seqlens``, ``get_max_seqlen``), each popping a
precomputed value from the caller's ``kwargs`` when given, and the output class.

Both attention layers check a non-zero ``max_seqlen`` against the real longest sequence, as
a flash kernel's launch bound must cover it. ``Qwen2_5OmniStandIn`` holds both towers and
vLLM's ``_process_image_input`` / ``_process_audio_input`` call sequence.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

PATCH_DIM = 24
HIDDEN = 16
OUT = 24
MERGE = 2
UNIT = MERGE * MERGE
WINDOW_UNITS = 4
MEL = 8
N_WINDOW = 5
FLASH_KINDS = frozenset({"FLASH_ATTN", "ROCM_AITER_FA", "TRITON_ATTN", "FLASHINFER"})
#: How often each audio metadata function did its host work (rather than pop a given value).
HOST_WORK: Counter[str] = Counter()


@dataclass(frozen=True)
class Backend:
    """An attention backend enum member's stand-in (vLLM's code reads ``.name``)."""

    name: str


def _attend(
    x: torch.Tensor, qkv: nn.Linear, cu_seqlens: torch.Tensor, max_seqlen: int | None
) -> torch.Tensor:
    lens = (cu_seqlens[1:] - cu_seqlens[:-1]).tolist()
    if max_seqlen:
        # A flash kernel launches for max_seqlen: a smaller bound would drop positions.
        assert max_seqlen >= max(lens), (max_seqlen, lens)
    q, k, v = qkv(x).chunk(3, dim=-1)
    outs = [
        F.scaled_dot_product_attention(qi[None], ki[None], vi[None])[0]
        for qi, ki, vi in zip(q.split(lens), k.split(lens), v.split(lens), strict=True)
    ]
    return torch.cat(outs)


class Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.mlp = nn.Linear(d, d)

    def forward(self, x: torch.Tensor, cu: torch.Tensor, max_seqlen: int | None) -> torch.Tensor:
        x = x + _attend(self.norm(x), self.qkv, cu, max_seqlen)
        return x + self.mlp(F.gelu(x))


class Qwen2_5_VisionTransformer(nn.Module):
    """vLLM's Qwen2.5 vision tower, in miniature."""

    def __init__(self, attn_backend: str = "TORCH_SDPA") -> None:
        super().__init__()
        self.attn_backend = Backend(attn_backend)
        self.spatial_merge_size = MERGE
        self.fullatt_block_indexes = [1]
        self.patch_embed = nn.Linear(PATCH_DIM, HIDDEN)
        self.blocks = nn.ModuleList(Block(HIDDEN) for _ in range(2))
        self.merger = nn.Linear(UNIT * HIDDEN, OUT)
        self.prepared = 0

    @property
    def device(self) -> torch.device:
        return self.patch_embed.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.patch_embed.weight.dtype

    def prepare_encoder_metadata(self, grid_thw: Any) -> dict[str, torch.Tensor | None]:
        self.prepared += 1
        rows = grid_thw.tolist() if isinstance(grid_thw, torch.Tensor) else list(grid_thw)
        window_index: list[int] = []
        frames: list[int] = []
        windows: list[int] = []
        offset = 0
        positions: list[int] = []
        for t, h, w in rows:
            # Positions within each image, as vLLM's rotary table (from its h and w) has them.
            positions += range(t * h * w)
            units_h, units_w = h // MERGE, w // MERGE
            for _ in range(t):
                # Column-major within a frame: the order depends on h and w, not on h * w.
                order = [r * units_w + c for c in range(units_w) for r in range(units_h)]
                window_index += [offset + i for i in order]
                offset += units_h * units_w
                frames.append(h * w)
                units = units_h * units_w
                windows += [
                    min(WINDOW_UNITS, units - s) * UNIT for s in range(0, units, WINDOW_UNITS)
                ]
        index = torch.tensor(window_index)
        reverse = torch.empty_like(index)
        reverse[index] = torch.arange(index.numel())
        angles = torch.tensor(positions, dtype=torch.float32)[:, None]
        flash = self.attn_backend.name in FLASH_KINDS
        device = self.device
        return {
            "rotary_pos_emb_cos": torch.cos(angles / 7).expand(-1, 4).to(device),
            "rotary_pos_emb_sin": torch.sin(angles / 7).expand(-1, 4).to(device),
            "window_index": index.to(device),
            "reverse_indices": reverse.to(device),
            "cu_seqlens": F.pad(torch.tensor(frames).cumsum(0), (1, 0)).to(device, torch.int32),
            "cu_window_seqlens": F.pad(torch.tensor(windows).cumsum(0), (1, 0)).to(
                device, torch.int32
            ),
            "max_seqlen_full": torch.tensor(max(frames) if flash else 0, dtype=torch.int32),
            "max_seqlen_window": torch.tensor(max(windows) if flash else 0, dtype=torch.int32),
            "sequence_lengths_full": None,
            "sequence_lengths_window": None,
        }

    def forward(
        self,
        x: torch.Tensor,
        grid_thw: Any,
        *,
        encoder_metadata: dict[str, torch.Tensor | None] | None = None,
    ) -> torch.Tensor:
        hidden = self.patch_embed(x.to(device=self.device, dtype=self.dtype))
        if encoder_metadata is None:
            encoder_metadata = self.prepare_encoder_metadata(grid_thw)
        m: Any = encoder_metadata
        seq = hidden.shape[0]
        hidden = hidden.reshape(seq // UNIT, UNIT, -1)[m["window_index"]].reshape(seq, -1)
        hidden = torch.cat([hidden[:, :4] * m["rotary_pos_emb_cos"], hidden[:, 4:]], dim=-1)
        hidden = torch.cat([hidden[:, :4] + m["rotary_pos_emb_sin"], hidden[:, 4:]], dim=-1)
        for i, block in enumerate(self.blocks):
            full = i in self.fullatt_block_indexes
            cu = m["cu_seqlens"] if full else m["cu_window_seqlens"]
            bound = m["max_seqlen_full"] if full else m["max_seqlen_window"]
            hidden = block(hidden, cu, int(bound.item()))
        out: torch.Tensor = self.merger(hidden.reshape(seq // UNIT, -1))
        return out[m["reverse_indices"]]


# -- audio: transformers' module-level metadata functions and the tower --------------------


@dataclass
class BaseModelOutputWithPooling:
    """transformers' output class (what vLLM reads: ``last_hidden_state``)."""

    last_hidden_state: torch.Tensor
    hidden_states: tuple[torch.Tensor, ...] | None = None


def chunk_and_pad_features(
    input_features: torch.Tensor,
    feature_lens: torch.Tensor,
    n_window: int,
    kwargs: dict[str, Any] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    if kwargs is not None:
        padded = kwargs.pop("padded_feature", None)
        lengths = kwargs.pop("chunk_lengths", None)
        if padded is not None and lengths is not None:
            return padded, lengths
    HOST_WORK["chunk_and_pad_features"] += 1
    chunks: list[int] = []
    for n in feature_lens.tolist():
        full, rest = divmod(n, 2 * n_window)
        chunks += [2 * n_window] * full + ([rest] if rest else [])
    pieces = input_features.T.split(chunks, dim=0)
    padded = nn.utils.rnn.pad_sequence(list(pieces), batch_first=True).transpose(1, 2)
    return padded, torch.tensor(chunks, device=feature_lens.device)


def _after_conv(lengths: torch.Tensor) -> torch.Tensor:
    return (lengths - 1) // 2 + 1


def get_valid_indices(
    chunk_lengths: torch.Tensor, kwargs: dict[str, Any] | None = None
) -> torch.Tensor:
    if kwargs is not None and (given := kwargs.pop("valid_indices", None)) is not None:
        return given
    HOST_WORK["get_valid_indices"] += 1
    after = _after_conv(chunk_lengths)
    longest = int(after.max().item())
    mask = torch.arange(longest, device=chunk_lengths.device) < after[:, None]
    return mask.flatten().nonzero().squeeze(-1)


def get_pool_indices(
    feature_lens: torch.Tensor, kwargs: dict[str, Any] | None = None
) -> torch.Tensor:
    if kwargs is not None and (given := kwargs.pop("pool_indices", None)) is not None:
        return given
    HOST_WORK["get_pool_indices"] += 1
    indices: list[int] = []
    offset = 0
    for n in _after_conv(feature_lens).tolist():
        indices += [offset + 2 * k for k in range((n - 2) // 2 + 1)]
        offset += n
    return torch.tensor(indices, device=feature_lens.device)


def get_audio_cu_seqlens(
    chunk_lengths: torch.Tensor, kwargs: dict[str, Any] | None = None
) -> torch.Tensor:
    if kwargs is not None and (given := kwargs.pop("cu_seqlens", None)) is not None:
        return given
    HOST_WORK["get_audio_cu_seqlens"] += 1
    return F.pad(_after_conv(chunk_lengths).cumsum(0), (1, 0)).to(torch.int32)


def get_max_seqlen(
    cu_seqlens: torch.Tensor, config: Any, kwargs: dict[str, Any] | None = None
) -> int | None:
    if kwargs is not None and (given := kwargs.pop("max_seqlen", None)) is not None:
        return int(given)
    if config._attn_implementation != "flash_attention_2":
        return None
    HOST_WORK["get_max_seqlen"] += 1
    return int((cu_seqlens[1:] - cu_seqlens[:-1]).max().item())


class Qwen2_5OmniAudioEncoder(nn.Module):
    """transformers' Qwen2.5-Omni audio encoder, in miniature."""

    def __init__(self, attn_implementation: str = "sdpa") -> None:
        super().__init__()
        self.config = SimpleNamespace(_attn_implementation=attn_implementation)
        self.n_window = N_WINDOW
        self.conv1 = nn.Conv1d(MEL, HIDDEN, kernel_size=3, padding=1)
        self.conv2 = nn.Conv1d(HIDDEN, HIDDEN, kernel_size=3, stride=2, padding=1)
        self.layers = nn.ModuleList(Block(HIDDEN) for _ in range(2))
        self.ln_post = nn.LayerNorm(HIDDEN)
        self.proj = nn.Linear(HIDDEN, OUT)
        self.calls = 0

    def forward(
        self,
        input_features: torch.Tensor | None = None,
        feature_lens: torch.Tensor | None = None,
        aftercnn_lens: torch.Tensor | None = None,
        **kwargs: Any,
    ) -> BaseModelOutputWithPooling:
        self.calls += 1
        output_hidden_states = kwargs.pop("output_hidden_states", False)
        padded, lengths = chunk_and_pad_features(
            input_features,  # type: ignore[arg-type]
            feature_lens,  # type: ignore[arg-type]
            self.n_window,
            kwargs=kwargs,
        )
        valid = get_valid_indices(lengths, kwargs=kwargs)
        pool = get_pool_indices(feature_lens, kwargs=kwargs)  # type: ignore[arg-type]
        cu_seqlens = get_audio_cu_seqlens(lengths, kwargs=kwargs)
        max_seqlen = get_max_seqlen(cu_seqlens, self.config, kwargs=kwargs)
        if kwargs:
            raise TypeError(f"unexpected keyword arguments {sorted(kwargs)}")
        padded = padded.to(self.conv1.weight.dtype)
        mask = (torch.arange(padded.shape[2], device=padded.device) < lengths[:, None])[:, None]
        embedded = F.gelu(self.conv1(padded)) * mask
        embedded = F.gelu(self.conv2(embedded)).transpose(1, 2)
        hidden = embedded.reshape(-1, HIDDEN).index_select(0, valid)
        states = [hidden]
        for layer in self.layers:
            hidden = layer(hidden, cu_seqlens, max_seqlen)
            states.append(hidden)
        hidden = (hidden[pool] + hidden[pool + 1]) / 2
        return BaseModelOutputWithPooling(
            self.proj(self.ln_post(hidden)), tuple(states) if output_hidden_states else None
        )

    def _get_feat_extract_output_lengths(
        self, input_lengths: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        after = _after_conv(input_lengths)
        return after, (after - 2) // 2 + 1


class Qwen2_5OmniStandIn(nn.Module):
    """The thinker's encoders and vLLM's calls into them."""

    def __init__(
        self,
        attn_backend: str = "TORCH_SDPA",
        attn_implementation: str = "sdpa",
        **hf_overrides: Any,
    ) -> None:
        super().__init__()
        self.visual = Qwen2_5_VisionTransformer(attn_backend)
        self.audio_tower = Qwen2_5OmniAudioEncoder(attn_implementation)
        self.config = SimpleNamespace(**hf_overrides)

    def _process_image_input(self, image_input: dict[str, Any]) -> tuple[torch.Tensor, ...]:
        grid_thw = image_input["image_grid_thw"]
        embeds = self.visual(image_input["pixel_values"], grid_thw=grid_thw)
        sizes = grid_thw.prod(-1) // UNIT
        return embeds.split(sizes.tolist())

    def _process_audio_input(self, audio_input: dict[str, Any]) -> tuple[torch.Tensor, ...]:
        features = audio_input["input_features"]
        lengths = audio_input["audio_feature_lengths"]
        after, out_lengths = self.audio_tower._get_feat_extract_output_lengths(lengths)
        outputs = self.audio_tower(features, feature_lens=lengths, aftercnn_lens=after)
        return outputs.last_hidden_state.split(out_lengths.tolist())


def build(seed: int = 0, **kwargs: Any) -> Qwen2_5OmniStandIn:
    torch.manual_seed(seed)
    return Qwen2_5OmniStandIn(**kwargs).eval()


def image_batch(grids: list[tuple[int, int, int]], seed: int = 1) -> dict[str, Any]:
    """vLLM's pixel input for images (t, h, w in patches): flattened patches and the grid."""
    g = torch.Generator().manual_seed(seed)
    patches = sum(t * h * w for t, h, w in grids)
    return {
        "type": "pixel_values",
        "pixel_values": torch.randn(patches, PATCH_DIM, generator=g),
        "image_grid_thw": torch.tensor(grids),
    }


def audio_batch(frames: list[int], seed: int = 2) -> dict[str, Any]:
    """vLLM's audio input: the mels of every item concatenated, and their lengths."""
    g = torch.Generator().manual_seed(seed)
    return {
        "input_features": torch.randn(MEL, sum(frames), generator=g),
        "audio_feature_lengths": torch.tensor(frames),
    }
