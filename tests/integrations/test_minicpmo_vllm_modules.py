"""vLLM's own MiniCPM-o 4.5 encoder modules, instrumented, against their uninstrumented forward.

The encoders are vLLM's classes, not stand-ins: the vision tower is vLLM's
``Idefics2VisionTransformer`` built as ``MiniCPMV4_5.init_vision_module`` builds the ``vpm``
of ``MiniCPMO4_5`` (with ``apply_encoder_attention_mask=True``), the audio encoder is vLLM's
``MiniCPMWhisperEncoder`` with the projection and average pooler of
``MiniCPMOBaseModel.init_audio_module``, and the batch methods that call them are vLLM's own
``MiniCPMV4_5.get_vision_hidden_states`` and ``MiniCPMOBaseModel.get_audio_hidden_states``,
bound to a host object that holds those modules (a whole ``MiniCPMO4_5`` would also need
the language model and the hub's remote config classes). Sizes are small and weights random.

Inputs are shaped the way MiniCPM-o's processor shapes them: every image becomes an
overview slice plus a grid of slices, each resized (aspect kept) to about 448x448 in whole
14-pixel patches and flattened to ``(3, 14, patches * 14)``, with its ``tgt_sizes``; audio is
80-bin log-mel at 100 frames per second, from a 1-second chunk up to the 30-second maximum.

Runs wherever vLLM imports: on the CPU with the simulated backend (the vLLM CI tiers), and on a
CUDA device with the torch and the vLLM graph backends.
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch import nn

if not torch.cuda.is_available():
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
pytest.importorskip("vllm", reason="vLLM is not installed (CI installs it)")

from integrations.vllm_modules import SETUPS, equal, setup_for
from omnitrace import EventBus, derive_stats
from omnitrace.integrations.minicpmo import instrument
from omnitrace.testing import SimulatedGraphBackend, capture_events

pytestmark = [
    pytest.mark.vllm,
    # Raised inside torch when vLLM's CPU layers import torch.utils.mkldnn.
    pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning"),
]

PATCH = 14
#: The processor's slice size in pixels and its most slices an image.
SCALE = 448
MAX_SLICES = 9
OVERRIDES = {"encoder_cuda_graph_max_graphs": 16, "encoder_cuda_graph_min_free_bytes": 0}


# -- inputs as MiniCPM-o's processor shapes them ------------------------------------------


def _fit(width: float, height: float) -> tuple[int, int]:
    """Resize to about SCALE x SCALE keeping the aspect ratio, in whole patches (rows, cols)."""
    ratio = width / height
    h = SCALE / math.sqrt(ratio)
    w = h * ratio
    return max(1, round(h / PATCH)), max(1, round(w / PATCH))


def _grid(width: int, height: int) -> tuple[int, int]:
    """The slice grid (cols, rows) whose aspect ratio is closest to the image's."""
    multiple = min(math.ceil(width * height / SCALE**2), MAX_SLICES)
    log_ratio = math.log(width / height)
    candidates = [
        (cols, n // cols)
        for n in (multiple - 1, multiple, multiple + 1)
        if 1 < n <= MAX_SLICES
        for cols in range(1, n + 1)
        if n % cols == 0
    ]
    return min(candidates, key=lambda g: abs(log_ratio - math.log(g[0] / g[1])))


def slice_sizes(width: int, height: int) -> list[tuple[int, int]]:
    """Target sizes (patch rows, patch cols) of an image's overview and its slices."""
    sizes = [_fit(width, height)]
    if width * height > SCALE * SCALE:
        cols, rows = _grid(width, height)
        sizes += [_fit(width / cols, height / rows)] * (cols * rows)
    return sizes


def vision_batch(
    images: list[tuple[int, int]], device: torch.device, dtype: torch.dtype, seed: int
) -> dict[str, Any]:
    """vLLM's pixel inputs for ``images`` (width, height): flattened slices and tgt_sizes."""
    g = torch.Generator().manual_seed(seed)
    pixels, sizes = [], []
    for width, height in images:
        for rows, cols in slice_sizes(width, height):
            pixels.append(torch.randn(3, PATCH, rows * cols * PATCH, generator=g))
            sizes.append((rows, cols))
    return {
        "type": "pixel_values",
        "pixel_values": [p.to(device, dtype) for p in pixels],
        "tgt_sizes": torch.tensor(sizes, dtype=torch.int32, device=device),
    }


# -- vLLM's modules on a host object ------------------------------------------------------


def _host_class(base: type[nn.Module] | None = None) -> type[nn.Module]:
    from vllm.model_executor.models.minicpmo import MiniCPMOBaseModel
    from vllm.model_executor.models.minicpmv import MiniCPMV4_5

    members = {
        name: getattr(MiniCPMOBaseModel, name)
        for name in ("get_audio_hidden_states", "subsequent_chunk_mask")
    }
    members["_get_feat_extract_output_lengths"] = MiniCPMOBaseModel._get_feat_extract_output_lengths
    members["get_vision_hidden_states"] = MiniCPMV4_5.get_vision_hidden_states
    return type("MiniCPMO45Encoders", (base or _Host,), members)


class _Encoders(nn.Module):
    """The encoder attributes of MiniCPMO4_5, built by vLLM's own classes."""

    def __init__(self) -> None:
        super().__init__()
        from transformers import WhisperConfig
        from transformers.models.idefics2.configuration_idefics2 import Idefics2VisionConfig
        from vllm.model_executor.models.idefics2_vision_model import Idefics2VisionTransformer
        from vllm.model_executor.models.minicpmo import (
            MiniCPMWhisperEncoder,
            MultiModalProjector,
        )

        vision = Idefics2VisionConfig(
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            image_size=980,
            patch_size=PATCH,
        )
        self.vpm = Idefics2VisionTransformer(
            vision, apply_encoder_attention_mask=True, prefix="vpm"
        )
        audio = WhisperConfig(
            d_model=64,
            encoder_layers=2,
            encoder_attention_heads=4,
            encoder_ffn_dim=256,
            num_mel_bins=80,
            max_source_positions=1500,
        )
        self.apm = MiniCPMWhisperEncoder(audio)
        self.audio_avg_pooler = nn.AvgPool1d(2, stride=2)
        self.audio_projection_layer = MultiModalProjector(
            in_dim=audio.encoder_ffn_dim // 4, out_dim=96
        )
        self.audio_encoder_layer = -1
        self.config = SimpleNamespace(audio_chunk_length=1.0, audio_pool_step=2, **OVERRIDES)


class _Host(_Encoders):
    """The encoders with the resampler left out."""

    def resampler(self, embeds: torch.Tensor, tgt_sizes: Any, temporal_ids: Any) -> torch.Tensor:
        # The resampler is not an encoder; the vision output is compared before it.
        return embeds


class _HostWithResampler(_Encoders):
    """The encoder attributes plus vLLM's own ``Resampler4_5``, as MiniCPMV4_5 makes it."""

    def __init__(self) -> None:
        super().__init__()
        from vllm.model_executor.models.minicpmv import Resampler4_5

        # embed_dim // 128 heads, as MiniCPMV4_5.init_resampler sets them.
        self.resampler = Resampler4_5(
            num_queries=8, embed_dim=256, num_heads=2, kv_dim=64, prefix="resampler"
        )


def _build(device: torch.device, dtype: torch.dtype, *, resampler: bool = False) -> nn.Module:
    from vllm.utils.torch_utils import set_default_torch_dtype

    torch.manual_seed(0)
    with set_default_torch_dtype(dtype), device:
        host = _host_class(_HostWithResampler if resampler else None)()
    with torch.no_grad():
        # vLLM allocates its linear weights uninitialised; the loader would fill them.
        for parameter in host.parameters():
            parameter.normal_(0.0, 0.05)
    for module in host.modules():
        method = getattr(module, "quant_method", None)
        if method is not None and hasattr(method, "process_weights_after_loading"):
            method.process_weights_after_loading(module)
    # vLLM's resampler keeps its positional table on the CPU (it moves it inside the
    # compiled language model's forward, which does not run here), as in the engine.
    return host.eval()


def audio_batch(
    seconds: list[float], device: torch.device, dtype: torch.dtype, seed: int
) -> dict[str, Any]:
    """vLLM's audio inputs: one 80-bin mel per audio at 100 frames/s, one slice each."""
    g = torch.Generator().manual_seed(seed)
    frames = [round(s * 100) for s in seconds]
    return {
        "type": "audio_features",
        "audio_features": [torch.randn(80, n, generator=g).to(device, dtype) for n in frames],
        "audio_feature_lens": [torch.tensor([n], device=device) for n in frames],
    }


# -- the runs -------------------------------------------------------------------------------

IMAGE_CALLS = [
    [(448, 448)],  # one full slice, no padding
    [(1344, 896)],  # wide: overview + 3x2 grid, padded to the longest slice
    [(600, 1000)],  # tall
    [(448, 448), (900, 700)],  # two images in one call
]
AUDIO_CALLS = [[1.0], [5.0], [30.0], [1.0, 3.0]]


@pytest.mark.parametrize("setup", SETUPS)
def test_instrumented_vllm_encoders_equal_vllms_forward_bitwise(
    setup: str, vllm_env: Any, tmp_path: Path
) -> None:
    """vLLM's vision tower and Whisper encoder give bitwise vLLM's results through the graphs."""
    from rich.console import Console

    from omnitrace.sinks.jsonl import JsonlSink, read_events
    from omnitrace.sinks.live import BusBoard, render

    device, dtype, extra = setup_for(setup, vllm_env)
    reference, model = _build(device, dtype), _build(device, dtype)
    bus = EventBus()
    log = tmp_path / "events.jsonl"
    bus.add_sink(JsonlSink(log, bus=bus))
    board = BusBoard(bus)
    result = instrument(model, bus=bus, **extra)
    assert result.vision is not None
    assert result.audio is not None
    assert result.audio_method == "get_audio_hidden_states"
    with torch.no_grad(), capture_events(bus) as events:
        for seed, images in enumerate(IMAGE_CALLS):
            data = vision_batch(images, device, dtype, seed)
            want = reference.get_vision_hidden_states(data)
            for _ in range(3):  # warm-up miss, capture, replay
                assert equal(model.get_vision_hidden_states(data), want), images
        for seed, seconds in enumerate(AUDIO_CALLS):
            data = audio_batch(seconds, device, dtype, seed)
            want = reference.get_audio_hidden_states(data)
            for _ in range(3):
                assert equal(model.get_audio_hidden_states(data), want), seconds
    stats = {
        "vision": result.vision.get_cumulative_stats(),
        "audio": result.audio.get_cumulative_stats(),
    }
    for name, count in (("vision", len(IMAGE_CALLS)), ("audio", len(AUDIO_CALLS))):
        assert stats[name]["num_graphs"] == count, stats[name]
        assert stats[name]["graph_hits"] == 2 * count
        assert stats[name]["warmup_misses"] == count
        assert stats[name]["graph_misses"] == count
    assert derive_stats(events) == stats
    console = Console(record=True, width=120, color_system=None)
    console.print(render(board.snapshot()))
    screen = console.export_text()
    assert "vision" in screen
    assert "audio" in screen
    assert bus.flush(10)
    bus.close()
    logged = list(read_events(log))
    assert derive_stats(logged) == stats
    print("\n" + screen)


def test_slices_follow_the_processors_grid() -> None:
    """A square image is one slice; a 1344x896 image is an overview plus a 3x2 grid."""
    assert slice_sizes(448, 448) == [(32, 32)]
    sizes = slice_sizes(1344, 896)
    assert len(sizes) == 1 + 6
    assert all(abs(r * c - 1024) < 80 for r, c in sizes)


# -- the whole vision path: embeddings, tower, post-norm and vLLM's Resampler4_5 -------------

PATH_CALLS = [
    [(448, 448)],  # one full slice, no padding
    [(1344, 896)],  # overview + 3x2 grid, padded
    [(600, 1000)],  # tall
    [(448, 448), (900, 700)],  # two images in one call
    [(448, 448)],  # a size tuple seen before: prepared tensors come from the cache
]


@pytest.mark.parametrize("setup", SETUPS)
def test_the_whole_vision_path_equals_vllms_method_bitwise(setup: str, vllm_env: Any) -> None:
    """With vLLM's resampler, the graph serves embeddings to resampler, bitwise as vLLM."""
    device, dtype, extra = setup_for(setup, vllm_env)
    reference = _build(device, dtype, resampler=True)
    model = _build(device, dtype, resampler=True)
    bus = EventBus()
    result = instrument(model, bus=bus, **extra)
    assert result.vision is not None
    assert result.vision_path == "get_vision_hidden_states"
    # The tower is not routed: the whole path is one graph.
    assert "forward" not in vars(model.vpm.encoder)
    with torch.no_grad(), capture_events(bus) as events:
        for seed, images in enumerate(PATH_CALLS):
            data = vision_batch(images, device, dtype, seed)
            want = reference.get_vision_hidden_states(data)
            assert want.shape[1:] == (8, 256)
            for _ in range(3):  # warm-up miss, capture (checked against vLLM's), replay
                assert equal(model.get_vision_hidden_states(data), want), images
    stats = result.vision.get_cumulative_stats()
    assert stats["num_graphs"] == 4, stats
    assert stats["warmup_misses"] == 4
    assert stats["graph_hits"] == 3 * len(PATH_CALLS) - 4
    assert stats["ineligible_misses"] == 0
    assert derive_stats(events)["vision"] == stats
    method = vars(model)["get_vision_hidden_states"]
    assert not method.diverged
    bus.close()


def test_a_graph_that_differs_from_vllm_turns_the_path_off(vllm_env: Any, caplog: Any) -> None:
    """A capture whose result is not vLLM's returns vLLM's; later calls run vLLM's method."""
    from omnitrace.integrations import minicpmo_vision

    device, dtype = torch.device("cpu"), torch.float32
    reference = _build(device, dtype, resampler=True)
    model = _build(device, dtype, resampler=True)
    correct = minicpmo_vision.path_forward

    def off_by_one(m: Any, table: Any) -> Any:
        forward = correct(m, table)
        return lambda *inputs: forward(*inputs) + 1.0

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(minicpmo_vision, "path_forward", off_by_one)
        result = instrument(model, backend=SimulatedGraphBackend())
    assert result.vision is not None
    data = vision_batch([(1344, 896)], device, dtype, 0)
    want = reference.get_vision_hidden_states(data)
    with torch.no_grad(), caplog.at_level("WARNING"):
        first = model.get_vision_hidden_states(data)  # warm-up miss: the path's own result
        assert not equal(first, want)
        assert equal(model.get_vision_hidden_states(data), want)  # the capture, checked
        assert equal(model.get_vision_hidden_states(data), want)  # vLLM's method from now
    assert vars(model)["get_vision_hidden_states"].diverged
    warnings = [r.getMessage() for r in caplog.records if "whole vision path" in r.getMessage()]
    assert len(warnings) == 1, warnings
    assert "largest difference 1" in warnings[0]
    stats = result.vision.get_cumulative_stats()
    assert stats["ineligible_misses"] == 1
    assert stats["num_graphs"] == 1


@pytest.mark.parametrize(
    ("change", "detail"),
    [
        (lambda d: {**d, "temporal_ids": [[3]] * len(d["pixel_values"])}, "temporal"),
        (lambda d: {**d, "tgt_sizes": d["tgt_sizes"][:1]}, "arguments"),
        (
            lambda d: {**d, "tgt_sizes": torch.tensor([[80, 13]] * len(d["pixel_values"]))},
            "pos_cache",
        ),
    ],
    ids=["temporal", "sizes", "pos_cache"],
)
def test_calls_the_path_does_not_cover_run_vllms_method(
    vllm_env: Any, change: Any, detail: str
) -> None:
    """Video temporal ids, mismatched sizes and a table too small run vLLM's own method."""
    from omnitrace.integrations import minicpmo_vision

    device, dtype = torch.device("cpu"), torch.float32
    model = _build(device, dtype, resampler=True)
    bus = EventBus()
    result = instrument(model, bus=bus, backend=SimulatedGraphBackend())
    assert result.vision is not None
    calls: list[Any] = []
    method = vars(model)["get_vision_hidden_states"]
    assert isinstance(method, minicpmo_vision.VisionPathMethod)
    method.original = lambda data, *a, **k: calls.append(data) or "vllm's"
    data = change(vision_batch([(1344, 896)], device, dtype, 0))
    with torch.no_grad(), capture_events(bus) as events:
        assert model.get_vision_hidden_states(data) == "vllm's"
    assert len(calls) == 1
    assert [(type(e).__name__, e.reason, e.detail) for e in events] == [
        ("GraphMissed", "ineligible", detail)
    ]
    bus.close()


@pytest.mark.parametrize(("seconds", "apart"), [(1.0, False), (1.5, True)])
def test_vllms_batch_audio_lets_a_clips_last_chunk_see_the_batchs_padding(
    vllm_env: Any, seconds: float, apart: bool
) -> None:
    """docs/vllm.md ("A clip's embeddings depend on its batch"): vLLM's method masks padding
    by mel frames, not by positions after the convolution, so a clip batched with a longer
    one differs from the clip alone where its last 1-s chunk is partial (1.5 s), and only by
    rounding where it is whole (1 s)."""
    device, dtype = torch.device("cpu"), torch.float32
    host = _build(device, dtype)
    both = audio_batch([seconds, 3.0], device, dtype, 0)
    alone = {key: value[:1] if isinstance(value, list) else value for key, value in both.items()}
    with torch.no_grad():
        batched = host.get_audio_hidden_states(both)[0]
        single = host.get_audio_hidden_states(alone)[0]
    assert batched.shape == single.shape
    difference = float((batched - single).abs().max())
    scale = float(single.abs().max())
    assert (difference > 1e-4 * scale) == apart, (difference, scale)
    assert difference < 1e-2 * scale


@pytest.mark.parametrize("setup", SETUPS)
def test_split_items_gives_each_clip_vllms_result_for_it_alone(setup: str, vllm_env: Any) -> None:
    """encoder_cuda_graph_split_items: a call of a 1.5-s and a 3-s clip is two calls, each
    clip's embeddings exactly vLLM's method's for that clip alone (no batch padding seen)."""
    device, dtype, extra = setup_for(setup, vllm_env)
    reference, model = _build(device, dtype), _build(device, dtype)
    model.config.encoder_cuda_graph_split_items = True
    bus = EventBus()
    result = instrument(model, bus=bus, **extra)
    assert result.audio is not None
    data = audio_batch([1.5, 3.0], device, dtype, 0)
    with torch.no_grad():
        want = [
            reference.get_audio_hidden_states(
                {"audio_features": [mel], "audio_feature_lens": [length]}
            )[0]
            for mel, length in zip(data["audio_features"], data["audio_feature_lens"], strict=True)
        ]
        with capture_events(bus) as events:
            for _ in range(3):  # warm-up miss, capture, replay of each clip's shape
                assert equal(model.get_audio_hidden_states(data), want)
    stats = result.audio.get_cumulative_stats()
    assert stats["graph_hits"] + stats["graph_misses"] == 3 * 2
    assert derive_stats(events) == {"audio": stats}
    bus.close()


def test_a_vpm_without_vllms_resampler_keeps_the_tower_graph(vllm_env: Any) -> None:
    """The host without a resampler module keeps the SigLIP-stack adapter on vpm.encoder."""
    model = _build(torch.device("cpu"), torch.float32)
    result = instrument(model, backend=SimulatedGraphBackend())
    assert result.vision is not None
    assert result.vision_path is None
    assert "forward" in vars(model.vpm.encoder)


def test_a_graph_prepared_before_serving_is_checked_on_its_first_call(
    vllm_env: Any, caplog: Any
) -> None:
    """A graph prepared from a recorded shape reads the table it takes before the capture,
    and its first real result is checked against vLLM's method like a captured one's."""
    from omnitrace.integrations import minicpmo_vision

    device, dtype = torch.device("cpu"), torch.float32
    reference = _build(device, dtype, resampler=True)
    data = vision_batch([(1344, 896)], device, dtype, 0)
    want = reference.get_vision_hidden_states(data)
    # The shape a first server captured.
    recorder = _build(device, dtype, resampler=True)
    recorded = instrument(recorder, backend=SimulatedGraphBackend())
    assert recorded.vision is not None
    with torch.no_grad():
        for _ in range(2):
            recorder.get_vision_hidden_states(data)
    (signature,) = recorded.vision.captured_signatures()
    # A second server prepares it; one whose path is right, one whose path is off.
    correct = minicpmo_vision.path_forward

    def off_by_one(m: Any, table: Any) -> Any:
        forward = correct(m, table)
        return lambda *inputs: forward(*inputs) + 1.0

    for path, diverges in ((correct, False), (off_by_one, True)):
        model = _build(device, dtype, resampler=True)
        bus = EventBus()
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(minicpmo_vision, "path_forward", path)
            result = instrument(model, bus=bus, backend=SimulatedGraphBackend())
        assert result.vision is not None
        with torch.no_grad(), capture_events(bus) as events, caplog.at_level("WARNING"):
            assert result.vision.prepare(signature, device) == "captured"
            assert equal(model.get_vision_hidden_states(data), want)
            assert equal(model.get_vision_hidden_states(data), want)
        assert [type(e).__name__ for e in events][:2] == ["GraphCaptured", "GraphReplayed"]
        assert vars(model)["get_vision_hidden_states"].diverged is diverges
        assert not result.vision.unchecked_prepared
        bus.close()
    warnings = [r.getMessage() for r in caplog.records if "whole vision path" in r.getMessage()]
    assert len(warnings) == 1, warnings
