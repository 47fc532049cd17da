"""Small real transformer encoders with MiniCPM-o 4.5's vision and audio input signatures:
random weights, at sizes from the CPU demo's tiny ones to the benchmarks' SigLIP so400m and
Whisper-medium."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from omnitrace._validate import check_int

__all__ = [
    "AUDIO_FULL",
    "AUDIO_TINY",
    "VISION_FULL",
    "VISION_TINY",
    "AudioEncoder",
    "EncoderGeometry",
    "VisionEncoder",
]


@dataclass(frozen=True, slots=True)
class EncoderGeometry:
    """Transformer sizes of one encoder."""

    hidden: int
    layers: int
    heads: int
    mlp: int

    def __post_init__(self) -> None:
        for name in ("hidden", "layers", "heads", "mlp"):
            value = getattr(self, name)
            check_int(name, value, minimum=1)
        if self.hidden % self.heads:
            raise ValueError(f"hidden ({self.hidden}) must be a multiple of heads ({self.heads})")


#: SigLIP so400m as MiniCPM-o 4.5 uses it (27 layers; 1024 tokens per 448x448 slice).
VISION_FULL = EncoderGeometry(hidden=1152, layers=27, heads=16, mlp=4304)
#: Whisper-medium encoder (24 layers; 50 tokens per second of audio).
AUDIO_FULL = EncoderGeometry(hidden=1024, layers=24, heads=16, mlp=4096)
#: Sizes small enough for a 2-core CPU demo.
VISION_TINY = EncoderGeometry(hidden=64, layers=2, heads=4, mlp=128)
AUDIO_TINY = EncoderGeometry(hidden=64, layers=2, heads=4, mlp=128)

MEL_BINS = 80


class _Block(nn.Module):
    """Pre-norm transformer block (attention + GELU MLP)."""

    def __init__(self, g: EncoderGeometry) -> None:
        super().__init__()
        self.heads = g.heads
        self.ln1 = nn.LayerNorm(g.hidden)
        self.qkv = nn.Linear(g.hidden, 3 * g.hidden)
        self.proj = nn.Linear(g.hidden, g.hidden)
        self.ln2 = nn.LayerNorm(g.hidden)
        self.fc1 = nn.Linear(g.hidden, g.mlp)
        self.fc2 = nn.Linear(g.mlp, g.hidden)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        b, n, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, n, 3, self.heads, d // self.heads).unbind(2)
        attn = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask
        )
        x = x + self.proj(attn.transpose(1, 2).reshape(b, n, d))
        out: torch.Tensor = x + self.fc2(F.gelu(self.fc1(self.ln2(x)), approximate="tanh"))
        return out


class VisionEncoder(nn.Module):
    """SigLIP-like encoder stack plus post-layernorm: ``(B, L, hidden)`` (+ mask) in and out.

    Patch embedding and mask building stay outside, as in MiniCPM-o, where only the encoder
    stack and the post-layernorm are graphed.
    """

    def __init__(self, geometry: EncoderGeometry = VISION_TINY) -> None:
        super().__init__()
        self.geometry = geometry
        self.layers = nn.ModuleList(_Block(geometry) for _ in range(geometry.layers))
        self.post_layernorm = nn.LayerNorm(geometry.hidden)

    def forward(self, hidden: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        if mask is not None and mask.dtype != torch.bool:
            mask = mask.to(hidden.dtype)
        for layer in self.layers:
            hidden = layer(hidden, mask)
        out: torch.Tensor = self.post_layernorm(hidden)
        return out


class AudioEncoder(nn.Module):
    """Whisper-like encoder: ``(B, 80, frames)`` mel in, ``(B, frames // 2, hidden)`` out.

    Two convolutions (the second with stride 2) turn 100 frames/s into 50 tokens/s, then
    sinusoid positions, the transformer stack and a final layernorm.
    """

    def __init__(self, geometry: EncoderGeometry = AUDIO_TINY) -> None:
        super().__init__()
        self.geometry = geometry
        d = geometry.hidden
        self.conv1 = nn.Conv1d(MEL_BINS, d, kernel_size=3, padding=1)
        self.conv2 = nn.Conv1d(d, d, kernel_size=3, stride=2, padding=1)
        self.layers = nn.ModuleList(_Block(geometry) for _ in range(geometry.layers))
        self.layer_norm = nn.LayerNorm(d)

    def forward(self, mel: torch.Tensor) -> torch.Tensor:
        x = F.gelu(self.conv1(mel))
        x = F.gelu(self.conv2(x)).transpose(1, 2)
        n, d = x.shape[1], x.shape[2]
        position = torch.arange(n, device=x.device, dtype=torch.float32)[:, None]
        freq = torch.exp(
            torch.arange(0, d, 2, device=x.device, dtype=torch.float32) * (-9.2103 / d)
        )
        pos = torch.cat([torch.sin(position * freq), torch.cos(position * freq)], dim=1)
        x = x + pos.to(x.dtype)
        for layer in self.layers:
            x = layer(x, None)
        out: torch.Tensor = self.layer_norm(x)
        return out
