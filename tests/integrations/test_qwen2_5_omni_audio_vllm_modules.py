"""transformers' Qwen2.5-Omni audio tower with omnitrace's masked attention, on the CPU.

The tower is the real ``Qwen2_5OmniAudioEncoder`` vLLM's thinker builds, from transformers'
``Qwen2_5OmniAudioEncoderConfig`` (head_dim 64, 128 mel bins, random weights), with the
``sdpa`` attention vLLM gives it without the ``flash_attn`` package. Only transformers is
needed, not vLLM: the tests skip without it (the README's environment has none), and the
vLLM CI tiers, which install transformers and forbid skips, run this file by its name
(``test_*_vllm_modules.py``).

``MEASURED`` pins the largest difference from the tower's own per-chunk forward measured on
the CPU (torch 2.13, transformers 5.17) over the lengths of ``FRAMES``: float32 5.4e-7,
bfloat16 2**-7 (one bf16 step at the outputs' magnitude, about 1.1).
"""

from __future__ import annotations

import logging
import types
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch import nn
from torch.overrides import TorchFunctionMode

pytest.importorskip("transformers", reason="transformers is not installed (the vLLM tiers have it)")

from integrations.test_qwen2_5_omni import CapturingBackend
from omnitrace import EventBus, GraphMissed, derive_stats
from omnitrace.integrations import qwen2_5_omni, qwen2_5_omni_masked_attention
from omnitrace.integrations.qwen2_5_omni import (
    MASKED_AUDIO_ATTENTION,
    audio_seam,
    instrument,
    masked_audio_attention,
)
from omnitrace.testing import SimulatedGraphBackend, capture_events

MASKED = {
    "encoder_cuda_graph_audio_attention": "masked",
    "encoder_cuda_graph_max_graphs": 16,
    "encoder_cuda_graph_min_free_bytes": 0,
}
NATIVE = {k: v for k, v in MASKED.items() if k != "encoder_cuda_graph_audio_attention"}
# Mel frames of a call's audio items (chunks of 200 frames): 3000 is one 30 s item.
FRAMES = [[350, 120], [1000], [200, 200, 17], [3000]]
#: Largest measured difference from the per-chunk forward, per dtype (see the docstring).
MEASURED = {torch.float32: 1e-6, torch.bfloat16: 2.0**-7}
#: Functions whose results need the host to see a device value (or make a shape from one).
HOST_SYNCS = frozenset(
    {
        "tolist",
        "item",
        "nonzero",
        "argwhere",
        "masked_select",
        "unique",
        "repeat_interleave",
        "__bool__",
        "__int__",
        "__float__",
        "__index__",
    }
)


class _NoHostSync(TorchFunctionMode):
    """Raise on every torch call that reads a tensor's value on the host."""

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        name = getattr(func, "__name__", "")
        if name in HOST_SYNCS:
            raise AssertionError(f"host sync in the graphed forward: {name}")
        return func(*args, **(kwargs or {}))


def tower(dtype: torch.dtype = torch.float32, attention: str = "sdpa") -> nn.Module:
    """A small random-weight Qwen2.5-Omni audio tower with vLLM's attention choice."""
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
    config._attn_implementation = attention
    torch.manual_seed(0)
    return Qwen2_5OmniAudioEncoder(config).to(dtype).eval()


class Host(nn.Module):
    """A thinker's audio tower and vLLM's call into it (``_process_audio_input``)."""

    def __init__(self, audio_tower: nn.Module, overrides: dict[str, Any]) -> None:
        super().__init__()
        self.audio_tower = audio_tower
        self.config = types.SimpleNamespace(**overrides)

    def embed(self, frames: list[int], seed: int = 0) -> torch.Tensor:
        """Call the tower as vLLM does: concatenated mels and their lengths."""
        g = torch.Generator().manual_seed(seed)
        dtype = self.audio_tower.conv1.weight.dtype
        mel = torch.randn(128, sum(frames), generator=g).to(dtype)
        lengths = torch.tensor(frames)
        after, _ = self.audio_tower._get_feat_extract_output_lengths(lengths)
        out = self.audio_tower(mel, feature_lens=lengths, aftercnn_lens=after)
        return out.last_hidden_state  # type: ignore[no-any-return]


@pytest.fixture(autouse=True)
def _inference() -> Iterator[None]:
    with torch.no_grad():
        yield


def _details(events: list[Any]) -> list[str]:
    return [e.detail for e in events if isinstance(e, GraphMissed)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_masked_route_stays_within_the_measured_bound_of_the_per_chunk_forward(
    dtype: torch.dtype, bus: EventBus
) -> None:
    """Warm-up, capture and replay agree bitwise and stay within the pinned bound of sdpa's loop."""
    reference = tower(dtype)
    host = Host(tower(dtype), MASKED)
    result = instrument(host, bus=bus, backend=SimulatedGraphBackend())
    assert result.audio is not None
    with capture_events(bus) as events:
        for seed, frames in enumerate(FRAMES):
            g = torch.Generator().manual_seed(seed)
            mel = torch.randn(128, sum(frames), generator=g).to(dtype)
            want = reference(mel, feature_lens=torch.tensor(frames)).last_hidden_state
            outs = [host.embed(frames, seed) for _ in range(3)]
            assert all(torch.equal(out, outs[0]) for out in outs), frames
            difference = float((outs[0].float() - want.float()).abs().max())
            print(f"\n{dtype} {frames}: max abs difference {difference:.3g}")
            assert outs[0].shape == want.shape
            assert difference <= MEASURED[dtype], (frames, difference)
    stats = result.audio.get_cumulative_stats()
    assert (stats["num_graphs"], stats["graph_hits"]) == (len(FRAMES), 2 * len(FRAMES))
    assert derive_stats(events) == {"audio": stats}


def test_masked_route_differs_from_full_attention_over_the_packed_chunks() -> None:
    """The block-diagonal mask matters: attending across chunks gives other embeddings."""
    model = tower()
    q, k, v = (
        torch.randn(1, 4, 150, 64, generator=torch.Generator().manual_seed(i)) for i in range(3)
    )
    cu_seqlens = torch.tensor([0, 100, 150], dtype=torch.int32)
    masked, _ = masked_audio_attention(model, q, k, v, None, cu_seq_lens_q=cu_seqlens)
    # Each chunk alone, as transformers' loop attends (one SDPA per chunk).
    parts = [
        torch.nn.functional.scaled_dot_product_attention(q[:, :, a:b], k[:, :, a:b], v[:, :, a:b])
        for a, b in ((0, 100), (100, 150))
    ]
    chunked = torch.cat(parts, dim=2).transpose(1, 2)
    whole = torch.nn.functional.scaled_dot_product_attention(q, k, v).transpose(1, 2)
    assert masked.shape == (1, 150, 4, 64)
    torch.testing.assert_close(masked, chunked, rtol=0, atol=1e-6)
    assert float((masked - whole).abs().max()) > 1e-2


def test_masked_route_graphs_where_the_backend_really_captures(bus: EventBus) -> None:
    """With a capturing backend sdpa calls are graphed, where the native route keeps them eager."""
    for overrides, graphs in ((NATIVE, 0), (MASKED, 1)):
        host = Host(tower(), overrides)
        result = instrument(host, bus=bus, backend=CapturingBackend())
        assert result.audio is not None
        with capture_events(bus) as events:
            outs = [host.embed(FRAMES[0]) for _ in range(3)]
        assert result.audio.num_graphs == graphs
        expected = ["attention_backend"] * 3 if graphs == 0 else ["call 1 of 2"]
        assert _details(events) == expected, overrides
        assert all(torch.equal(out, outs[0]) for out in outs)


def test_masked_graphed_forward_reads_no_device_value_on_the_host() -> None:
    """The callable the adapter captures makes no host sync with the masked route; native does."""
    for masked, syncs in ((True, False), (False, True)):
        model = tower()
        seam = audio_seam(model)
        assert seam is not None
        binding = qwen2_5_omni_masked_attention.masked_binding(model) if masked else None
        stack = qwen2_5_omni._audio_stack(model.forward, binding)
        lengths = torch.tensor(FRAMES[2])
        padded, chunk_lengths = seam.chunk_and_pad_features(
            torch.randn(128, sum(FRAMES[2])), lengths, model.n_window
        )
        inputs = (
            padded,
            chunk_lengths,
            seam.get_valid_indices(chunk_lengths),
            seam.get_pool_indices(lengths),
            seam.get_audio_cu_seqlens(chunk_lengths),
            None,
        )
        if syncs:
            with (
                pytest.raises(AssertionError, match="host sync in the graphed forward"),
                _NoHostSync(),
            ):
                stack(*inputs)
        else:
            with _NoHostSync():
                stack(*inputs)


def test_masked_route_binds_per_call_and_leaves_transformers_as_it_was() -> None:
    """Only while the adapter's forward runs do this tower's layers name omnitrace's attention."""
    from transformers.models.qwen2_5_omni import modeling_qwen2_5_omni as module

    forward = module.Qwen2_5OmniAudioAttention.forward
    host, other = Host(tower(), MASKED), tower()
    seen: list[str] = []
    layer = host.audio_tower.layers[0].self_attn
    layer.register_forward_pre_hook(lambda m, args: seen.append(m.config._attn_implementation))
    instrument(host, backend=SimulatedGraphBackend())
    host.embed(FRAMES[0])
    assert seen == [MASKED_AUDIO_ATTENTION]
    assert host.audio_tower.config._attn_implementation == "sdpa"
    assert other.config._attn_implementation == "sdpa"
    assert module.Qwen2_5OmniAudioAttention.forward is forward
    assert module.ALL_ATTENTION_FUNCTIONS[MASKED_AUDIO_ATTENTION] is masked_audio_attention
    assert module.ALL_ATTENTION_FUNCTIONS["sdpa"] is not masked_audio_attention
    # A call the adapter does not serve runs the tower's own forward, native.
    host.audio_tower(
        torch.randn(128, 50), feature_lens=torch.tensor([50]), output_hidden_states=True
    )
    assert seen[-1] == "sdpa"


def test_binding_restores_only_when_the_last_overlapping_forward_leaves() -> None:
    """Overlapping forwards (a capture beside an eager call) keep the name until both are done."""
    model = tower()
    binding = qwen2_5_omni_masked_attention.masked_binding(model)
    assert binding is not None
    with binding:
        with binding:
            assert model.config._attn_implementation == MASKED_AUDIO_ATTENTION
        assert model.config._attn_implementation == MASKED_AUDIO_ATTENTION
    assert model.config._attn_implementation == "sdpa"


def test_masked_attention_refuses_calls_it_was_not_made_for() -> None:
    """An attention mask of the caller's is refused with the fix named, not silently dropped."""
    q = torch.randn(1, 2, 8, 16)
    with pytest.raises(ValueError, match="set encoder_cuda_graph_audio_attention to 'native'"):
        masked_audio_attention(tower(), q, q, q, torch.ones(8, 8, dtype=torch.bool))


def test_masked_route_on_transformers_logs_nothing(caplog: pytest.LogCaptureFixture) -> None:
    """On transformers' own tower the option applies without a warning."""
    with caplog.at_level(logging.WARNING, logger="omnitrace"):
        instrument(Host(tower(), MASKED), backend=SimulatedGraphBackend())
    assert caplog.records == []
