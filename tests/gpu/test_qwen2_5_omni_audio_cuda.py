"""transformers' Qwen2.5-Omni audio tower graphed on CUDA with omnitrace's masked attention.

The tower is the real ``Qwen2_5OmniAudioEncoder`` in bfloat16 with ``sdpa`` attention (what
vLLM gives it without ``flash_attn``), random weights, on the torch backend. The natively
routed tower never graphs on CUDA (its per-chunk loop syncs with the host); with
``encoder_cuda_graph_audio_attention: "masked"`` it does. Needs transformers, not vLLM.
"""

from __future__ import annotations

import types
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch import nn

pytest.importorskip("transformers", reason="transformers is not installed")

from omnitrace import EventBus, GraphCaptured, GraphReplayed
from omnitrace.integrations.qwen2_5_omni import instrument
from omnitrace.testing import capture_events

pytestmark = pytest.mark.gpu

OVERRIDES = {
    "encoder_cuda_graph_audio_attention": "masked",
    "encoder_cuda_graph_min_free_bytes": 0,
    "encoder_cuda_graph_max_graphs": 8,
}
# Mel frames of one call's audio items: two items, one, three (a short tail), 30 s.
FRAMES = [[350, 120], [1000], [200, 200, 17], [3000]]
#: The bound measured on the CPU against the per-chunk forward in bfloat16 (one bf16 step
#: at the outputs' magnitude); a CUDA kernel may round differently, so twice that.
NATIVE_BOUND = 2 * 2.0**-7


@pytest.fixture(autouse=True)
def _inference() -> Iterator[None]:
    with torch.no_grad():
        yield
    torch.cuda.synchronize()


def tower() -> nn.Module:
    """A small random-weight Qwen2.5-Omni audio tower on CUDA in bfloat16, sdpa attention."""
    from transformers.models.qwen2_5_omni.configuration_qwen2_5_omni import (
        Qwen2_5OmniAudioEncoderConfig,
    )
    from transformers.models.qwen2_5_omni.modeling_qwen2_5_omni import Qwen2_5OmniAudioEncoder

    config = Qwen2_5OmniAudioEncoderConfig(
        d_model=256,
        encoder_layers=2,
        encoder_attention_heads=4,
        encoder_ffn_dim=512,
        num_mel_bins=128,
        output_dim=96,
        n_window=100,
        max_source_positions=1500,
    )
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return Qwen2_5OmniAudioEncoder(config).to("cuda", torch.bfloat16).eval()


class Host(nn.Module):
    """A thinker's audio tower and its encoder graph overrides."""

    def __init__(self, audio_tower: nn.Module) -> None:
        super().__init__()
        self.audio_tower = audio_tower
        self.config = types.SimpleNamespace(**OVERRIDES)


def _call(model: nn.Module, mel: torch.Tensor, frames: list[int]) -> torch.Tensor:
    lengths = torch.tensor(frames, device="cuda")
    out: Any = model(mel, feature_lens=lengths)
    return out.last_hidden_state  # type: ignore[no-any-return]


@pytest.mark.parametrize("frames", FRAMES, ids=["+".join(map(str, f)) for f in FRAMES])
def test_masked_audio_tower_graphs_and_matches_eager_and_native(
    frames: list[int], bus: EventBus
) -> None:
    """Three same-shape calls capture one graph and replay it; replays equal the eager masked
    forward bitwise and the native per-chunk forward within the measured bound."""
    native = tower()
    model = tower()
    result = instrument(Host(model), bus=bus)
    assert result.audio is not None
    g = torch.Generator().manual_seed(0)
    mel = torch.randn(128, sum(frames), generator=g).to("cuda", torch.bfloat16)
    with capture_events(bus) as events:
        outs = [_call(model, mel, frames).clone() for _ in range(3)]
    stats = result.audio.get_cumulative_stats()
    assert sum(isinstance(e, GraphCaptured) for e in events) == 1, stats
    assert sum(isinstance(e, GraphReplayed) for e in events) >= 1, stats
    assert (stats["num_graphs"], stats["graph_hits"], stats["graph_misses"]) == (1, 2, 1), stats
    # The warm-up call ran the adapter's forward eagerly: the replays must equal it.
    assert torch.equal(outs[1], outs[0])
    assert torch.equal(outs[2], outs[0])
    want = _call(native, mel, frames)
    difference = float((outs[2].float() - want.float()).abs().max())
    print(f"\n{frames}: graphed vs native per-chunk max abs difference {difference:.3g}")
    assert difference <= NATIVE_BOUND
