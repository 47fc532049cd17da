"""vLLM's Qwen2.5-Omni encoder modules, instrumented, against their uninstrumented forward.

The encoders are the real classes the thinker builds, not stand-ins: the vision tower is
vLLM's ``Qwen2_5_VisionTransformer`` and the audio tower transformers'
``Qwen2_5OmniAudioEncoder``, each from its Qwen2.5-Omni config class, and the calls into them
are vLLM's own ``Qwen2_5OmniConditionalGenerationMixin._process_image_input`` and
``_process_audio_input``, bound to a host object that holds the two towers (a whole thinker
would also need the language model). Sizes are small and weights random.

vLLM's ``qwen2_vl`` module imports ``smart_resize`` (image preprocessing, which no encoder
uses) from transformers' torchvision image processor. Where torchvision cannot be imported
(the CPU tiers: there is no torchvision build for their CPU torch), the test takes
``smart_resize`` from transformers' PIL image processor instead, for that import only.

vLLM 0.26 cannot build the vision tower on the CPU: its ``SiluAndMul`` binds
``torch.ops._C.silu_and_mul`` at construction, which the CUDA wheel lacks on a CPU; the 0.26
tier deselects that test, and the GPU machine runs it.

On the CPU, vLLM's vision attention is SDPA and transformers' audio attention is SDPA: the
simulated backend captures nothing, so both are graphed there. On a CUDA device the adapters
graph only flash-type attention; other calls are eager ``attention_backend`` misses, which
the CUDA cases expect according to the backends the towers chose.
"""

from __future__ import annotations

import importlib.util
import os
import sys
import types
from typing import Any

import pytest
import torch
from torch import nn

if not torch.cuda.is_available():
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
pytest.importorskip("vllm", reason="vLLM is not installed (CI installs it)")

from integrations.vllm_modules import SETUPS, equal, setup_for
from omnitrace import EventBus, GraphMissed, GraphReplayed, derive_stats
from omnitrace.integrations import qwen2_5_omni
from omnitrace.integrations.qwen2_5_omni import audio_seam, detect, instrument
from omnitrace.testing import capture_events

pytestmark = [
    pytest.mark.vllm,
    # Raised inside torch when vLLM's CPU layers import torch.utils.mkldnn.
    pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning"),
]

OVERRIDES = {"encoder_cuda_graph_max_graphs": 16, "encoder_cuda_graph_min_free_bytes": 0}
# Images and videos in patches (t, h, w): one image, two in a call, a two-frame video.
GRIDS = [[(1, 8, 12)], [(1, 8, 12), (1, 16, 16)], [(2, 8, 8)]]
# Mel frames of the audio items of a call (100 frames per second, chunks of 200 frames).
FRAMES = [[350, 120], [1000], [200, 200, 17]]

_SHIMMED = "transformers.models.qwen2_vl.image_processing_qwen2_vl"


def _import_thinker() -> Any:
    """Import vLLM's Qwen2.5-Omni thinker module (with the smart_resize shim where needed)."""
    if importlib.util.find_spec("torchvision") is None and _SHIMMED not in sys.modules:
        from transformers.models.qwen2_vl import image_processing_pil_qwen2_vl as pil

        shim = types.ModuleType(_SHIMMED)
        shim.smart_resize = pil.smart_resize  # type: ignore[attr-defined]
        sys.modules[_SHIMMED] = shim
    from vllm.model_executor.models import qwen2_5_omni_thinker

    return qwen2_5_omni_thinker


def _host(vllm_config: Any, *, vision: bool, audio: bool, split: bool = False) -> nn.Module:
    """The thinker's towers on a host that has vLLM's calls into them."""
    thinker = _import_thinker()
    from transformers.models.qwen2_5_omni.configuration_qwen2_5_omni import (
        Qwen2_5OmniAudioEncoderConfig,
        Qwen2_5OmniVisionEncoderConfig,
    )

    class Host(nn.Module, thinker.Qwen2_5OmniConditionalGenerationMixin):
        def __init__(self) -> None:
            super().__init__()
            if vision:
                config = Qwen2_5OmniVisionEncoderConfig(
                    depth=2,
                    hidden_size=64,
                    intermediate_size=128,
                    num_heads=4,
                    out_hidden_size=96,
                    fullatt_block_indexes=[1],
                    window_size=112,
                    patch_size=14,
                    spatial_merge_size=2,
                    temporal_patch_size=2,
                    in_channels=3,
                )
                self.visual = thinker.Qwen2_5_VisionTransformer(
                    vision_config=config, norm_eps=1e-6, prefix="visual"
                )
            if audio:
                self.audio_tower = thinker.Qwen2_5OmniAudioEncoder(
                    Qwen2_5OmniAudioEncoderConfig(
                        d_model=64,
                        encoder_layers=2,
                        encoder_attention_heads=4,
                        encoder_ffn_dim=128,
                        num_mel_bins=128,
                        output_dim=96,
                        n_window=100,
                        max_source_positions=1500,
                    )
                )
            self.vllm_config = vllm_config
            split_items = {"encoder_cuda_graph_split_items": True} if split else {}
            self.config = types.SimpleNamespace(**OVERRIDES, **split_items)

    return Host()


def _build(vllm_config: Any, device: torch.device, dtype: torch.dtype, **towers: bool) -> nn.Module:
    """The host of :func:`_host` (``towers``: its keyword arguments) on ``device``."""
    from vllm.utils.torch_utils import set_default_torch_dtype

    torch.manual_seed(0)
    with set_default_torch_dtype(dtype), device:
        host = _host(vllm_config, **towers)
    with torch.no_grad():
        # vLLM allocates its linear weights uninitialised; the loader would fill them.
        for parameter in host.parameters():
            parameter.normal_(0.0, 0.05)
    for module in host.modules():
        method = getattr(module, "quant_method", None)
        if method is not None and hasattr(method, "process_weights_after_loading"):
            method.process_weights_after_loading(module)
    return host.to(device).eval()


def _expect(stats: dict[str, Any], events: list[Any], calls: int, graphed: bool) -> None:
    """Three calls per shape: warm-up, capture, replay; or every call eager for its attention."""
    if graphed:
        assert (stats["num_graphs"], stats["graph_hits"]) == (calls, 2 * calls), stats
        assert stats["warmup_misses"] == stats["graph_misses"] == calls, stats
    else:
        assert stats["ineligible_misses"] == stats["graph_misses"] == 3 * calls, stats
        details = {e.detail for e in events if isinstance(e, GraphMissed)}
        assert details == {"attention_backend"}


@pytest.mark.parametrize("setup", SETUPS)
def test_vllm_vision_tower_through_the_graph_equals_its_own_forward(
    setup: str, vllm_env: Any
) -> None:
    """vLLM's Qwen2.5 vision tower gives bitwise vLLM's embeddings through the adapter."""
    device, dtype, extra = setup_for(setup, vllm_env)
    reference = _build(vllm_env, device, dtype, vision=True, audio=False)
    model = _build(vllm_env, device, dtype, vision=True, audio=False)
    bus = EventBus()
    result = instrument(model, bus=bus, **extra)
    assert result.vision is not None
    assert result.audio is None
    patch = 3 * 2 * 14 * 14
    with torch.no_grad(), capture_events(bus) as events:
        for seed, grids in enumerate(GRIDS):
            g = torch.Generator().manual_seed(seed)
            patches = sum(t * h * w for t, h, w in grids)
            data = {
                "type": "pixel_values",
                "pixel_values": torch.randn(patches, patch, generator=g).to(device, dtype),
                "image_grid_thw": torch.tensor(grids),
            }
            want = reference._process_image_input(data)
            for _ in range(3):
                assert equal(model._process_image_input(data), want), grids
    stats = result.vision.get_cumulative_stats()
    graphed = setup == "cpu-simulated" or (
        qwen2_5_omni._attention_name(model.visual) in qwen2_5_omni.GRAPH_SAFE_VISION_ATTENTION
    )
    _expect(stats, events, len(GRIDS), graphed)
    assert derive_stats(events) == {"vision": stats}
    bus.close()


@pytest.mark.parametrize("setup", SETUPS)
def test_transformers_audio_tower_through_the_graph_equals_vllms_call(
    setup: str, vllm_env: Any
) -> None:
    """transformers' Qwen2.5-Omni audio tower, called as vLLM calls it, is bitwise unchanged."""
    device, dtype, extra = setup_for(setup, vllm_env)
    reference = _build(vllm_env, device, dtype, vision=False, audio=True)
    model = _build(vllm_env, device, dtype, vision=False, audio=True)
    bus = EventBus()
    result = instrument(model, bus=bus, **extra)
    assert result.audio is not None
    assert result.vision is None
    with torch.no_grad(), capture_events(bus) as events:
        for seed, frames in enumerate(FRAMES):
            g = torch.Generator().manual_seed(seed)
            data = {
                "input_features": torch.randn(128, sum(frames), generator=g).to(device, dtype),
                # vLLM's runner moves every multimodal tensor to the model's device.
                "audio_feature_lengths": torch.tensor(frames, device=device),
            }
            want = reference._process_audio_input(data)
            for _ in range(3):
                assert equal(model._process_audio_input(data), want), frames
    stats = result.audio.get_cumulative_stats()
    flash = "flash" in str(model.audio_tower.config._attn_implementation)
    _expect(stats, events, len(FRAMES), setup == "cpu-simulated" or flash)
    assert derive_stats(events) == {"audio": stats}
    bus.close()


def _items_alone(
    reference: Any, model: Any, bus: EventBus, process: str, batch: dict[str, Any], items: list[Any]
) -> None:
    """``model`` (items split) serves ``batch`` as its ``items``, each bitwise the reference's
    forward of that item alone, and close to the reference's forward of the whole batch."""
    alone = [getattr(reference, process)(item)[0] for item in items]
    whole = getattr(reference, process)(batch)
    for _ in range(3):  # warm-up, capture, replay of each item's shape
        with capture_events(bus) as events:
            got = getattr(model, process)(batch)
        assert equal(got, tuple(alone))
        # One decision per item: a replay or a miss each.
        assert len([e for e in events if isinstance(e, (GraphReplayed, GraphMissed))]) == 2
    for g, w in zip(got, whole, strict=True):
        # float32 on the CPU, bfloat16 on CUDA: a batch mix may round each item differently.
        tolerance = 1e-5 if g.dtype == torch.float32 else 2**-5
        assert (g - w).abs().max() <= tolerance * max(1.0, float(w.abs().max()))


def _two_items(tower: str, device: torch.device, dtype: torch.dtype) -> tuple[Any, list[Any]]:
    """A call of two images (or clips) as vLLM makes it, and each of its items as a call."""
    if tower == "vision":
        grids = GRIDS[1]
        rows = [t * h * w for t, h, w in grids]
        pixels = torch.randn(sum(rows), 3 * 2 * 14 * 14).to(device, dtype)
        batch = {
            "type": "pixel_values",
            "pixel_values": pixels,
            "image_grid_thw": torch.tensor(grids),
        }
        items = [
            {"type": "pixel_values", "pixel_values": p, "image_grid_thw": torch.tensor([g])}
            for p, g in zip(pixels.split(rows), grids, strict=True)
        ]
        return batch, items
    frames = FRAMES[0]
    features = torch.randn(128, sum(frames)).to(device, dtype)
    lengths = torch.tensor(frames, device=device)
    batch = {"input_features": features, "audio_feature_lengths": lengths}
    items = [
        {"input_features": f, "audio_feature_lengths": lengths[i : i + 1]}
        for i, f in enumerate(features.split(frames, dim=-1))
    ]
    return batch, items


@pytest.mark.parametrize("setup", SETUPS)
@pytest.mark.parametrize("tower", ["vision", "audio"])
def test_each_tower_serves_a_calls_items_one_by_one_when_split(
    tower: str, setup: str, vllm_env: Any
) -> None:
    """encoder_cuda_graph_split_items: a call of two images (vLLM's vision tower) or two
    clips (transformers' audio tower) is two calls of one item."""
    device, dtype, extra = setup_for(setup, vllm_env)
    towers = {"vision": tower == "vision", "audio": tower == "audio"}
    reference = _build(vllm_env, device, dtype, **towers)
    model = _build(vllm_env, device, dtype, split=True, **towers)
    bus = EventBus()
    result = instrument(model, bus=bus, **extra)
    batch, items = _two_items(tower, device, dtype)
    process = "_process_image_input" if tower == "vision" else "_process_audio_input"
    with torch.no_grad():
        _items_alone(reference, model, bus, process, batch, items)
    stats = getattr(result, tower).get_cumulative_stats()
    assert stats["graph_hits"] + stats["graph_misses"] == 3 * len(items)
    bus.close()


def test_vllms_thinker_has_the_towers_this_module_serves() -> None:
    """The thinker builds the two classes detect() looks for, without vLLM's own encoder graphs."""
    thinker = _import_thinker()
    cls = thinker.Qwen2_5OmniThinkerForConditionalGeneration
    assert thinker.Qwen2_5_VisionTransformer.__name__ == qwen2_5_omni.VISION_TOWER
    assert thinker.Qwen2_5OmniAudioEncoder.__name__ == qwen2_5_omni.AUDIO_TOWER
    assert not callable(getattr(cls, "encoder_cudagraph_forward", None))
    assert callable(thinker.Qwen2_5_VisionTransformer.prepare_encoder_metadata)
    forward = thinker.Qwen2_5_VisionTransformer.forward
    assert "encoder_metadata" in forward.__code__.co_varnames


def test_transformers_audio_tower_accepts_its_metadata_precomputed(vllm_env: Any) -> None:
    """transformers' audio tower module has the functions whose results its forward pops."""
    model = _build(vllm_env, torch.device("cpu"), torch.float32, vision=False, audio=True)
    seam = audio_seam(model.audio_tower)
    assert seam is not None
    assert seam.output.__name__ == "BaseModelOutputWithPooling"
    assert detect(model)
