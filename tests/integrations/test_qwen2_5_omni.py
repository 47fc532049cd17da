"""Qwen2.5-Omni wiring on CPU stand-ins, with the simulated graph backend (no GPU, no vLLM)."""

from __future__ import annotations

import logging
from typing import Any

import pytest
import torch

from integrations import qwen_standins
from integrations.qwen_standins import audio_batch, build, image_batch
from integrations.standins import build as build_minicpmo
from omnitrace import EventBus, GraphMissed, MissReason, derive_stats
from omnitrace.integrations import qwen2_5_omni, vllm_plugin
from omnitrace.integrations.qwen2_5_omni import INTEGRATION, Instrumented, detect, instrument
from omnitrace.integrations.registry import find_integration
from omnitrace.testing import SimulatedGraphBackend, capture_events

FAST = {"encoder_cuda_graph_min_free_bytes": 0, "encoder_cuda_graph_max_graphs": 8}
GRIDS = [[(1, 4, 4)], [(1, 4, 4), (1, 8, 4)], [(2, 4, 8)]]
FRAMES = [[23, 7], [50], [10, 10, 3]]


class CapturingBackend(SimulatedGraphBackend):
    """The simulated backend, declaring that it really captures (as the CUDA backends do)."""

    simulated = False


def _instrument(model: Any, bus: EventBus | None = None, **kwargs: Any) -> Instrumented:
    kwargs.setdefault("backend", SimulatedGraphBackend())
    return instrument(model, bus=bus, **kwargs)


def _equal(got: Any, want: Any) -> bool:
    return len(got) == len(want) and all(
        g.shape == w.shape and torch.equal(g, w) for g, w in zip(got, want, strict=True)
    )


def _details(events: list[Any]) -> list[str]:
    return [e.detail for e in events if isinstance(e, GraphMissed)]


# -- detection and attaching -----------------------------------------------------------------


def test_detect_claims_qwen_thinkers_only() -> None:
    """The thinker's towers are claimed; MiniCPM-o and vLLM-graphed models are not."""
    assert detect(build())
    assert not detect(build_minicpmo())
    graphed = build()
    graphed.encoder_cudagraph_forward = lambda values: values  # type: ignore[attr-defined]
    assert not detect(graphed)
    other = build()
    other.visual = torch.nn.Linear(2, 2)
    other.audio_tower = torch.nn.Linear(2, 2)
    assert not detect(other)


def test_registry_finds_this_integration_for_a_thinker() -> None:
    """The registry finds this module's INTEGRATION, so the plugin picks it."""
    assert find_integration(build()) is INTEGRATION
    assert INTEGRATION.instrument is instrument


def test_instrument_attaches_one_adapter_on_each_tower() -> None:
    """Vision lands on model.visual._encoder_graph, audio on model.audio_tower._encoder_graph."""
    model = build(**FAST)
    result = _instrument(model)
    assert result.vision is model.visual._encoder_graph
    assert result.audio is model.audio_tower._encoder_graph
    assert (result.vision.name, result.audio.name) == ("vision", "audio")
    assert "forward" in vars(model.visual)
    assert "forward" not in vars(build().visual)


def test_instrument_twice_returns_the_same_adapters() -> None:
    """A second instrument() hands back the attached adapters and wraps nothing again."""
    model = build(**FAST)
    first = _instrument(model)
    wrapper = vars(model.visual)["forward"]
    assert _instrument(model) == first
    assert vars(model.visual)["forward"] is wrapper


def test_tower_without_the_metadata_functions_gets_no_audio_adapter(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """An audio tower whose module lacks transformers' metadata functions keeps running eagerly."""

    class Qwen2_5OmniAudioEncoder(qwen_standins.Qwen2_5OmniAudioEncoder):
        """The class name, defined where no metadata functions live."""

    model = build(**FAST)
    model.audio_tower = Qwen2_5OmniAudioEncoder()
    with caplog.at_level(logging.WARNING, logger="omnitrace"):
        result = _instrument(model)
    assert result.audio is None
    assert result.vision is not None
    assert [r.getMessage() for r in caplog.records] == [
        "omnitrace: Qwen2_5OmniAudioEncoder's module lacks the metadata functions its forward "
        "accepts precomputed (transformers 5); the audio tower runs without graphs"
    ]
    assert "forward" not in vars(model.audio_tower)


# -- vision ----------------------------------------------------------------------------------


def test_vision_through_the_graph_equals_the_uninstrumented_tower(bus: EventBus) -> None:
    """Warm-up, capture and replay each return exactly what the tower's own forward returns."""
    reference, model = build(**FAST), build(**FAST)
    result = _instrument(model, bus)
    with torch.no_grad(), capture_events(bus) as events:
        for seed, grids in enumerate(GRIDS):
            data = image_batch(grids, seed)
            want = reference._process_image_input(data)
            for _ in range(3):
                assert _equal(model._process_image_input(data), want), grids
    stats = result.vision.get_cumulative_stats()  # type: ignore[union-attr]
    assert (stats["num_graphs"], stats["graph_hits"], stats["warmup_misses"]) == (3, 6, 3)
    assert derive_stats(events)["vision"] == stats


def test_vision_metadata_is_prepared_once_per_call_outside_the_graph() -> None:
    """prepare_encoder_metadata runs eagerly once per call, as in the tower's own forward."""
    model = build(**FAST)
    _instrument(model)
    data = image_batch(GRIDS[1])
    with torch.no_grad():
        for calls in range(1, 4):
            model._process_image_input(data)
            assert model.visual.prepared == calls


def test_vision_key_holds_the_host_launch_bounds() -> None:
    """Same tensor shapes but another longest sequence is another graph under flash attention."""
    model = build(attn_backend="FLASH_ATTN", **FAST)
    reference = build(attn_backend="FLASH_ATTN", **FAST)
    result = _instrument(model)
    # 64 patches in two frames either way; the longest frame is 48 or 32 patches.
    uneven, even = [(1, 4, 4), (1, 4, 12)], [(1, 4, 8), (1, 4, 8)]
    with torch.no_grad():
        for grids in (uneven, even):
            data = image_batch(grids)
            for _ in range(2):
                assert _equal(
                    model._process_image_input(data), reference._process_image_input(data)
                )
    keys = result.vision.captured_keys()  # type: ignore[union-attr]
    assert len(keys) == 2
    assert "int32[0,48,16]" in keys[0]
    assert "int32[0,32,16]" in keys[1]
    assert keys[0].replace("48", "32") == keys[1]


def test_vision_with_host_side_attention_stays_eager_where_graphs_capture(bus: EventBus) -> None:
    """SDPA's .tolist() split cannot be captured: such calls run eagerly, recorded; flash graphs."""
    for attention, graphs in (("TORCH_SDPA", 0), ("FLASH_ATTN", 1)):
        reference = build(attn_backend=attention, **FAST)
        model = build(attn_backend=attention, **FAST)
        result = _instrument(model, bus, backend=CapturingBackend())
        data = image_batch(GRIDS[0])
        with torch.no_grad(), capture_events(bus) as events:
            for _ in range(3):
                assert _equal(
                    model._process_image_input(data), reference._process_image_input(data)
                )
        assert result.vision.num_graphs == graphs  # type: ignore[union-attr]
        expected = ["attention_backend"] * 3 if graphs == 0 else ["call 1 of 2"]
        assert _details(events) == expected, attention


def test_vision_call_with_its_own_metadata_runs_the_original(bus: EventBus) -> None:
    """A caller that passes encoder_metadata gets the tower's forward, recorded as arguments."""
    reference, model = build(**FAST), build(**FAST)
    _instrument(model, bus)
    data = image_batch(GRIDS[1])
    x = data["pixel_values"]
    with torch.no_grad(), capture_events(bus) as events:
        metadata = model.visual.prepare_encoder_metadata(data["image_grid_thw"])
        got = model.visual(x, None, encoder_metadata=metadata)
    assert torch.equal(got, reference.visual(x, data["image_grid_thw"]))
    (event,) = events
    assert (event.reason, event.detail) == (MissReason.INELIGIBLE, "arguments")


def test_vision_metadata_of_another_layout_runs_the_original(
    bus: EventBus, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Metadata with keys this module does not know is passed to the original, recorded."""
    reference, model = build(**FAST), build(**FAST)
    _instrument(model, bus)
    prepare = model.visual.prepare_encoder_metadata

    def newer_layout(grid_thw: Any) -> dict[str, Any]:
        return {**prepare(grid_thw), "cu_seqlens_extra": torch.zeros(1)}

    monkeypatch.setattr(model.visual, "prepare_encoder_metadata", newer_layout)
    data = image_batch(GRIDS[0])
    with torch.no_grad(), capture_events(bus) as events:
        assert _equal(model._process_image_input(data), reference._process_image_input(data))
    assert _details(events) == ["metadata"]


# -- audio -----------------------------------------------------------------------------------


def test_audio_through_the_graph_equals_the_uninstrumented_tower(bus: EventBus) -> None:
    """Each item's embeddings equal the tower's own, on warm-up, capture and replay."""
    reference, model = build(**FAST), build(**FAST)
    result = _instrument(model, bus)
    with torch.no_grad(), capture_events(bus) as events:
        for seed, frames in enumerate(FRAMES):
            data = audio_batch(frames, seed)
            want = reference._process_audio_input(data)
            for _ in range(3):
                assert _equal(model._process_audio_input(data), want), frames
    stats = result.audio.get_cumulative_stats()  # type: ignore[union-attr]
    assert (stats["num_graphs"], stats["graph_hits"], stats["warmup_misses"]) == (3, 6, 3)
    assert derive_stats(events)["audio"] == stats


def test_audio_metadata_is_computed_once_per_call_outside_the_graph() -> None:
    """Each metadata function does its host work once per call; the graphed forward pops it."""
    model = build(attn_implementation="flash_attention_2", **FAST)
    _instrument(model)
    data = audio_batch(FRAMES[0])
    qwen_standins.HOST_WORK.clear()
    with torch.no_grad():
        for _ in range(3):  # warm-up, capture (two forwards), replay
            model._process_audio_input(data)
    assert model.audio_tower.calls == 5
    assert dict(qwen_standins.HOST_WORK) == {
        "chunk_and_pad_features": 3,
        "get_valid_indices": 3,
        "get_pool_indices": 3,
        "get_audio_cu_seqlens": 3,
        "get_max_seqlen": 3,
    }


def test_audio_returns_the_towers_output_class() -> None:
    """vLLM reads last_hidden_state: the wrapper returns the tower's own output class."""
    model = build(**FAST)
    _instrument(model)
    data = audio_batch(FRAMES[0])
    with torch.no_grad():
        out = model.audio_tower(data["input_features"], feature_lens=data["audio_feature_lengths"])
    assert type(out) is qwen_standins.BaseModelOutputWithPooling
    assert out.last_hidden_state.shape == (
        sum((((n - 1) // 2 + 1) - 2) // 2 + 1 for n in [23, 7]),
        24,
    )


def test_audio_key_holds_the_flash_bound() -> None:
    """Under flash attention the longest chunk is a key dimension the graph keeps."""
    model = build(attn_implementation="flash_attention_2", **FAST)
    reference = build(attn_implementation="flash_attention_2", **FAST)
    result = _instrument(model)
    # Two chunks of 10 and 2 frames, or 6 and 6: the same shapes, another longest chunk.
    with torch.no_grad():
        for frames in ([12], [6, 6]):
            data = audio_batch(frames)
            for _ in range(2):
                assert _equal(
                    model._process_audio_input(data), reference._process_audio_input(data)
                )
    keys = result.audio.captured_keys()  # type: ignore[union-attr]
    assert len(keys) == 2
    assert keys[0].endswith("int32[0,5] @cpu s=0")
    assert keys[1].endswith("int32[0,3] @cpu s=0")


def test_audio_without_flash_attention_stays_eager_where_graphs_capture(bus: EventBus) -> None:
    """Per-chunk attention after .tolist() cannot be captured: recorded, eager, same output."""
    for attention, graphs in (("sdpa", 0), ("flash_attention_2", 1)):
        reference = build(attn_implementation=attention, **FAST)
        model = build(attn_implementation=attention, **FAST)
        result = _instrument(model, bus, backend=CapturingBackend())
        data = audio_batch(FRAMES[0])
        with torch.no_grad(), capture_events(bus) as events:
            for _ in range(3):
                assert _equal(
                    model._process_audio_input(data), reference._process_audio_input(data)
                )
        assert result.audio.num_graphs == graphs  # type: ignore[union-attr]
        expected = ["attention_backend"] * 3 if graphs == 0 else ["call 1 of 2"]
        assert _details(events) == expected, attention


def test_masked_audio_attention_needs_transformers_dispatch(
    bus: EventBus, caplog: pytest.LogCaptureFixture
) -> None:
    """A tower whose attention does not go through ALL_ATTENTION_FUNCTIONS keeps native, logged."""
    reference = build(**FAST)
    model = build(encoder_cuda_graph_audio_attention="masked", **FAST)
    with caplog.at_level(logging.WARNING, logger="omnitrace"):
        result = _instrument(model, bus, backend=CapturingBackend())
    assert [r.getMessage() for r in caplog.records] == [
        "omnitrace: Qwen2_5OmniAudioEncoder has no Qwen2_5OmniAudioAttention layers dispatched "
        "through its module's ALL_ATTENTION_FUNCTIONS; encoder_cuda_graph_audio_attention "
        "'masked' is not applied (native attention)"
    ]
    data = audio_batch(FRAMES[0])
    with torch.no_grad(), capture_events(bus) as events:
        for _ in range(3):
            assert _equal(model._process_audio_input(data), reference._process_audio_input(data))
    assert result.audio.num_graphs == 0  # type: ignore[union-attr]
    assert _details(events) == ["attention_backend"] * 3


def test_audio_extra_arguments_run_the_original(bus: EventBus) -> None:
    """output_hidden_states is the original's business: it runs, recorded as arguments."""
    model = build(**FAST)
    _instrument(model, bus)
    data = audio_batch(FRAMES[1])
    with torch.no_grad(), capture_events(bus) as events:
        out = model.audio_tower(
            data["input_features"],
            feature_lens=data["audio_feature_lengths"],
            output_hidden_states=True,
        )
    assert out.hidden_states is not None
    assert _details(events) == ["arguments"]


# -- one call per item ------------------------------------------------------------------------

SPLIT = {**FAST, "encoder_cuda_graph_split_items": True}


def _close(got: Any, want: Any) -> bool:
    """Equal shapes, values within float32 rounding: an item alone may round differently."""
    return len(got) == len(want) and all(
        g.shape == w.shape and torch.allclose(g, w, rtol=1e-5, atol=1e-6)
        for g, w in zip(got, want, strict=True)
    )


#: Per tower: the adapter, vLLM's call into the tower, its input maker, two items' sizes.
_TOWERS = {
    "vision": ("_process_image_input", image_batch, [(1, 4, 4), (1, 8, 4)]),
    "audio": ("_process_audio_input", audio_batch, [23, 7]),
}


@pytest.mark.parametrize("split", [False, True])
@pytest.mark.parametrize("tower", sorted(_TOWERS))
def test_a_batch_of_known_items_replays_their_graphs_when_split(
    bus: EventBus, tower: str, split: bool
) -> None:
    """Two images (or clips) seen alone (captured), then together: split, the batch is two
    hits on their graphs whose outputs, in item order, equal the tower's batched forward;
    whole, a new shape's warm-up miss."""
    process, inputs, items = _TOWERS[tower]
    reference, model = build(**FAST), build(**(SPLIT if split else FAST))
    result = _instrument(model, bus)
    with torch.no_grad():
        for item in items:
            for _ in range(2):
                getattr(model, process)(inputs([item], seed=7))
        data = inputs(items, seed=8)
        want = getattr(reference, process)(data)
        with capture_events(bus) as events:
            got = getattr(model, process)(data)
    assert _close(got, want)
    stats = getattr(result, tower).get_cumulative_stats()
    # Before the batch: each item's first call a warm-up miss, its second captured and hit.
    hits, warmups = (4, 2) if split else (2, 3)
    assert (stats["num_graphs"], stats["graph_hits"], stats["warmup_misses"]) == (2, hits, warmups)
    assert len([e for e in events if isinstance(e, GraphMissed)]) == (0 if split else 1)


def test_split_items_leaves_single_items_and_odd_layouts_whole(bus: EventBus) -> None:
    """One image or clip is one call as before; a grid whose rows do not match the patches
    goes whole to the tower, which decides (here: its own error)."""
    model = build(**SPLIT)
    result = _instrument(model, bus)
    with torch.no_grad():
        model._process_image_input(image_batch([(2, 4, 8)]))
        model._process_audio_input(audio_batch([50]))
        vision = result.vision.get_cumulative_stats()  # type: ignore[union-attr]
        audio = result.audio.get_cumulative_stats()  # type: ignore[union-attr]
        assert vision["graph_misses"] == audio["graph_misses"] == 1
        data = image_batch([(1, 4, 4), (1, 8, 4)])
        data["pixel_values"] = data["pixel_values"][:-4]
        with pytest.raises(IndexError):
            model._process_image_input(data)
    assert result.vision.get_cumulative_stats()["graph_misses"] == 2  # type: ignore[union-attr]


# -- both ------------------------------------------------------------------------------------


def test_training_mode_stays_eager_for_both_towers(bus: EventBus) -> None:
    """A tower in training mode runs its own forward, recorded as a training miss."""
    model = build(**FAST)
    _instrument(model, bus)
    model.train()
    with torch.no_grad(), capture_events(bus) as events:
        model._process_image_input(image_batch(GRIDS[0]))
        model._process_audio_input(audio_batch(FRAMES[0]))
    assert _details(events) == ["training", "training"]


def test_enforce_eager_disables_both_graphs(bus: EventBus) -> None:
    """With vLLM's enforce_eager every call is an ineligible 'disabled' miss."""
    model = build(**FAST)
    _instrument(model, bus, enforce_eager=True)
    with torch.no_grad(), capture_events(bus) as events:
        model._process_image_input(image_batch(GRIDS[0]))
        model._process_audio_input(audio_batch(FRAMES[0]))
    assert _details(events) == ["disabled", "disabled"]


def test_hf_overrides_configure_both_adapters() -> None:
    """encoder_cuda_graph_* keys on the model's config set both adapters' caps."""
    model = build(encoder_cuda_graph_max_graphs=3)
    result = _instrument(model)
    assert result.vision.config.max_graphs == result.audio.config.max_graphs == 3  # type: ignore[union-attr]


def test_plugin_attaches_both_adapters_and_names_the_model(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Through the vLLM plugin a thinker gets both adapters; the attached line names the model."""
    monkeypatch.setattr(vllm_plugin, "_bus", None)
    model = build(**FAST)
    with caplog.at_level(logging.INFO, logger="omnitrace"):
        vllm_plugin._after_load(model, None)
    assert model.visual._encoder_graph is not None
    assert model.audio_tower._encoder_graph is not None
    (line,) = [r.getMessage() for r in caplog.records if "encoder graphs attached" in r.msg]
    assert line.startswith(
        "omnitrace: encoder graphs attached (vision=True, audio=True, model=qwen2_5_omni, pid="
    )
    assert vllm_plugin._bus is not None
    vllm_plugin._bus.close()


def test_module_constants_name_vllms_and_transformers_classes() -> None:
    """The detector looks for the class names vLLM and transformers give the two towers."""
    assert qwen2_5_omni.VISION_TOWER == "Qwen2_5_VisionTransformer"
    assert qwen2_5_omni.AUDIO_TOWER == "Qwen2_5OmniAudioEncoder"


@pytest.mark.parametrize("split", [False, True])
def test_both_towers_register_how_they_serve_a_calls_items(bus: EventBus, split: bool) -> None:
    """Each tower's adapter facts say whether a call's images or clips go as one batch or one
    by one: event logs carry them, and advise reads them."""
    _instrument(build(**(SPLIT if split else FAST)), bus)
    infos = bus.adapters()
    assert {infos[name]["items"] for name in ("vision", "audio")} == {
        "split" if split else "batched"
    }
    # The adapter's own facts are kept beside it.
    assert infos["vision"]["max_graphs"] == FAST["encoder_cuda_graph_max_graphs"]
