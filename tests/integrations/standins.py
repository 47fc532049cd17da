"""Small stand-ins with MiniCPM-o 4.5's attribute layout (random weights, CPU-sized).

``vpm`` has ``embeddings``, ``encoder.layers`` and ``post_layernorm`` like vLLM's SigLIP
tower; the model has a Whisper-like ``apm`` returning every hidden state, an
``audio_projection_layer`` and an ``audio_avg_pooler``, and an hf ``config`` object.
``get_audio_hidden_states(data)`` reproduces vLLM 0.33's batch audio method (same attribute
names, same call sequence): pad list features, build the padding-and-chunk mask, run ``apm``,
the projection and the pooler once on the batch, then cut and concatenate per audio item.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

PATCH = 4
HIDDEN = 32
MEL_BINS = 8


class Layer(nn.Module):
    """Pre-norm attention + MLP block taking an additive mask."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.ln2 = nn.LayerNorm(d)
        self.fc = nn.Linear(d, d)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        # One head: (B, 1, L, D) takes the (B, 1, 1, L) additive mask as vLLM's layers do.
        q, k, v = self.qkv(self.ln1(x)).unsqueeze(1).chunk(3, dim=-1)
        x = x + F.scaled_dot_product_attention(q, k, v, attn_mask=mask).squeeze(1)
        return x + self.fc(F.gelu(self.ln2(x)))


class Embeddings(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(3 * PATCH * PATCH, HIDDEN)
        self.calls = 0

    def forward(
        self,
        pixel_values: torch.Tensor,
        patch_attention_mask: torch.Tensor | None = None,
        tgt_sizes: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        self.calls += 1
        patches = F.unfold(pixel_values, kernel_size=PATCH, stride=PATCH).transpose(1, 2)
        return self.proj(patches)


class Encoder(nn.Module):
    def __init__(self, layers: int = 2) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Layer(HIDDEN) for _ in range(layers))

    def forward(
        self,
        inputs_embeds: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        output_hidden_states: bool = False,
    ) -> Any:
        x = inputs_embeds
        states = [x]
        for layer in self.layers:
            x = layer(x, attention_mask)
            states.append(x)
        # Hugging Face-style encoders can return every hidden state; vLLM's never do.
        return (x, tuple(states)) if output_hidden_states else x


class VisionTower(nn.Module):
    """SigLIP-like: eager patch embedding and mask, then encoder stack + post-layernorm."""

    def __init__(self) -> None:
        super().__init__()
        self.embeddings = Embeddings()
        self.encoder = Encoder()
        self.post_layernorm = nn.LayerNorm(HIDDEN)
        self.apply_encoder_attention_mask = True
        # vLLM 0.33 passes a mask whenever a patch mask is given; 0.26 passes none when no
        # patch is padded.
        self.mask_unpadded = True

    def forward(
        self,
        pixel_values: torch.Tensor,
        patch_attention_mask: torch.Tensor | None = None,
        tgt_sizes: torch.Tensor | None = None,
        output_hidden_states: bool = False,
        output_attentions: bool = False,
    ) -> Any:
        hidden = self.embeddings(
            pixel_values=pixel_values, patch_attention_mask=patch_attention_mask
        )
        mask = None
        if patch_attention_mask is not None:
            flat = patch_attention_mask.view(patch_attention_mask.shape[0], -1)
            if self.mask_unpadded or bool(torch.any(~flat)):
                mask = (~flat).to(hidden.dtype) * torch.finfo(hidden.dtype).min
                mask = mask[:, None, None, :]
        out = self.post_layernorm(self.encoder(inputs_embeds=hidden, attention_mask=mask))
        if output_hidden_states:
            return out, (hidden,)
        return out


@dataclass
class WhisperOutput:
    last_hidden_state: torch.Tensor
    hidden_states: tuple[torch.Tensor, ...]
    past_key_values: Any = None


class WhisperLike(nn.Module):
    """Two convolutions (stride 2), a transformer stack and every hidden state out."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv1d(MEL_BINS, HIDDEN, kernel_size=3, padding=1)
        self.conv2 = nn.Conv1d(HIDDEN, HIDDEN, kernel_size=3, stride=2, padding=1)
        self.layers = nn.ModuleList(Layer(HIDDEN) for _ in range(2))
        self.layer_norm = nn.LayerNorm(HIDDEN)
        self.stateful_calls = 0

    def forward(
        self,
        input_features: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        past_key_values: Any = None,
        use_cache: bool = False,
    ) -> WhisperOutput:
        x = F.gelu(self.conv2(F.gelu(self.conv1(input_features)))).transpose(1, 2)
        states = [x]
        if use_cache:
            self.stateful_calls += 1
            if past_key_values is not None:
                x = x + past_key_values[-1].mean()
        for layer in self.layers:
            x = layer(x, attention_mask)
            states.append(x)
        x = self.layer_norm(x)
        states.append(x)
        cache = (*(past_key_values or ()), x) if use_cache else None
        return WhisperOutput(x, tuple(states), cache)


class Projector(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear1 = nn.Linear(HIDDEN, HIDDEN)
        self.relu = nn.ReLU()
        self.linear2 = nn.Linear(HIDDEN, HIDDEN)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear2(self.relu(self.linear1(x)))


class MiniCPMOStandIn(nn.Module):
    """The attributes omnitrace's MiniCPM-o integration touches, nothing more."""

    def __init__(self, **hf_overrides: Any) -> None:
        super().__init__()
        self.vpm = VisionTower()
        self.apm = WhisperLike()
        self.audio_projection_layer = Projector()
        self.audio_avg_pooler = nn.AvgPool1d(2, stride=2)
        self.audio_encoder_layer = -1
        config = {"audio_chunk_length": 0.1, "audio_pool_step": 2, **hf_overrides}
        self.config = SimpleNamespace(**config)

    def eager_audio(self, mel: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        states = self.apm(mel, attention_mask=mask).hidden_states[self.audio_encoder_layer]
        embeds = self.audio_projection_layer(states)
        return self.audio_avg_pooler(embeds.transpose(1, 2)).transpose(1, 2)

    # -- vLLM 0.33's batch audio method, structure for structure ---------------------------

    def subsequent_chunk_mask(
        self,
        size: int,
        chunk_size: int,
        num_left_chunks: int = -1,
        device: torch.device = torch.device("cpu"),  # noqa: B008
        num_lookhead: int = 0,
    ) -> torch.Tensor:
        rows = torch.arange(size, device=device)
        chunks = rows // chunk_size
        if num_left_chunks < 0:
            starts = torch.zeros_like(rows)
        else:
            starts = torch.clamp(chunks - num_left_chunks, min=0) * chunk_size
        ends = torch.clamp((chunks + 1) * chunk_size + num_lookhead, max=size)
        cols = torch.arange(size, device=device).unsqueeze(0)
        return (cols >= starts.unsqueeze(1)) & (cols < ends.unsqueeze(1))

    def _get_feat_extract_output_lengths(
        self, input_lengths: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        after_cnn = (input_lengths - 1) // 2 + 1
        step = self.config.audio_pool_step
        after_pooling = ((after_cnn - step) // step + 1).to(dtype=torch.int32)
        return after_cnn, after_pooling

    def get_audio_hidden_states(self, data: Any) -> list[torch.Tensor]:
        chunk_length = self.config.audio_chunk_length
        wavforms_raw = data["audio_features"]
        if isinstance(wavforms_raw, list):
            length = max(item.shape[-1] for item in wavforms_raw)
            first = wavforms_raw[0]
            wavforms = torch.zeros(
                (len(wavforms_raw), first.shape[-2], length), dtype=first.dtype, device=first.device
            )
            for i, item in enumerate(wavforms_raw):
                wavforms[i, ..., : item.shape[-1]] = item
        else:
            wavforms = wavforms_raw
        audio_feature_lens_raw = data["audio_feature_lens"]
        if isinstance(audio_feature_lens_raw, torch.Tensor):
            audio_feature_lens_raw = audio_feature_lens_raw.unbind(0)
        audio_feature_lens = torch.hstack(audio_feature_lens_raw)
        batch_size, _, max_mel_seq_len = wavforms.shape
        max_seq_len = (max_mel_seq_len - 1) // 2 + 1
        seq_range = (
            torch.arange(
                0, max_seq_len, dtype=audio_feature_lens.dtype, device=audio_feature_lens.device
            )
            .unsqueeze(0)
            .expand(batch_size, max_seq_len)
        )
        lengths_expand = audio_feature_lens.unsqueeze(1).expand(batch_size, max_seq_len)
        padding_mask = seq_range >= lengths_expand
        masked = padding_mask.view(batch_size, 1, 1, max_seq_len).expand(
            batch_size, 1, max_seq_len, max_seq_len
        )
        mask = masked.to(dtype=self.apm.conv1.weight.dtype, device=self.apm.conv1.weight.device)
        if chunk_length > 0:
            chunk_mask = self.subsequent_chunk_mask(
                size=max_seq_len,
                chunk_size=int(chunk_length * 50),
                num_left_chunks=-1,
                device=masked.device,
            )
            masked = torch.logical_or(masked, torch.logical_not(chunk_mask))
        mask[masked] = float("-inf")
        audio_states = self.apm(wavforms, attention_mask=mask).hidden_states[
            self.audio_encoder_layer
        ]
        audio_embeds = self.audio_projection_layer(audio_states)
        audio_embeds = self.audio_avg_pooler(audio_embeds.transpose(1, 2)).transpose(1, 2)
        _, num_audio_tokens = self._get_feat_extract_output_lengths(audio_feature_lens)
        final: list[torch.Tensor] = []
        idx = 0
        for item in audio_feature_lens_raw:
            parts = []
            for _ in range(len(item)):
                parts.append(audio_embeds[idx, : num_audio_tokens[idx], :])
                idx += 1
            final.append(torch.cat(parts))
        return final


def build(seed: int = 0, **hf_overrides: Any) -> MiniCPMOStandIn:
    torch.manual_seed(seed)
    return MiniCPMOStandIn(**hf_overrides).eval()


def image(batch: int = 1, side: int = 16, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Pixels and a patch mask with the last patch row masked out."""
    g = torch.Generator().manual_seed(seed)
    pixels = torch.randn(batch, 3, side, side, generator=g)
    mask = torch.ones(batch, side // PATCH, side // PATCH, dtype=torch.bool)
    mask[:, -1, :] = False
    return pixels, mask


def mel(frames: int = 20, seed: int = 2) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(1, MEL_BINS, frames, generator=g)


def audio_batch(
    slices: tuple[tuple[int, ...], ...] = ((20, 14), (6,)), seed: int = 3
) -> dict[str, Any]:
    """vLLM's audio_features inputs: one mel per slice (listed), slice lengths per audio item."""
    g = torch.Generator().manual_seed(seed)
    frames = [n for item in slices for n in item]
    return {
        "type": "audio_features",
        "audio_features": [torch.randn(MEL_BINS, n, generator=g) for n in frames],
        "audio_feature_lens": [torch.tensor(item) for item in slices],
    }
