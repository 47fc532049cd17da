"""MiniCPM-o wiring on CPU stand-ins, with the simulated graph backend (no GPU, no vLLM)."""

from __future__ import annotations

from collections.abc import Iterator
from types import SimpleNamespace

import pytest
import torch

from integrations.standins import MiniCPMOStandIn, build, image, mel
from omnitrace import ConfigError, EventBus, GraphMissed, MissReason, derive_stats
from omnitrace.integrations.minicpmo import (
    Instrumented,
    config_from_model,
    encode_audio,
    encode_audio_streaming,
    instrument,
)
from omnitrace.testing import SimulatedGraphBackend, capture_events

FAST = {"encoder_cuda_graph_min_free_bytes": 0}


@pytest.fixture
def bus() -> Iterator[EventBus]:
    with EventBus() as b:
        yield b


def _instrument(
    model: MiniCPMOStandIn, bus: EventBus | None = None, **kwargs: object
) -> tuple[Instrumented, SimulatedGraphBackend]:
    backend = SimulatedGraphBackend()
    return instrument(model, bus=bus, backend=backend, **kwargs), backend  # type: ignore[arg-type]


def _details(events: list[object]) -> list[str]:
    return [e.detail for e in events if isinstance(e, GraphMissed)]


def test_instrument_attaches_adapters_where_the_note_names_them() -> None:
    """Vision lands on model.vpm._encoder_graph and audio on model._audio_encoder_graph."""
    model = build(**FAST)
    result, _ = _instrument(model)
    assert result.vision is model.vpm._encoder_graph
    assert result.audio is model._audio_encoder_graph
    assert (result.vision.name, result.audio.name) == ("vision", "audio")


def test_instrument_twice_returns_the_same_adapters() -> None:
    """A second instrument() call reuses the attached adapters instead of stacking new ones."""
    model = build(**FAST)
    first, _ = _instrument(model)
    second, _ = _instrument(model)
    assert first.vision is second.vision
    assert first.audio is second.audio


def test_vision_graph_output_equals_the_unwrapped_eager_path() -> None:
    """Warm-up, capturing and replaying calls of vpm all equal the original vpm forward."""
    model = build(**FAST)
    pixels, mask = image()
    with torch.no_grad():
        expected = model.vpm(pixels, mask)
        result, backend = _instrument(model)
        outs = [model.vpm(pixels, mask) for _ in range(3)]
    assert all(torch.equal(out, expected) for out in outs)
    assert backend.captures == 1
    assert backend.replays >= 2
    stats = result.vision.get_cumulative_stats()  # type: ignore[union-attr]
    assert (stats["graph_hits"], stats["warmup_misses"]) == (2, 1)


def test_vision_keeps_patch_embedding_eager() -> None:
    """Patch embedding runs on every call, outside the graph, so replays still run it."""
    model = build(**FAST)
    pixels, mask = image()
    _instrument(model)
    with torch.no_grad():
        for _ in range(3):
            model.vpm(pixels, mask)
    assert model.vpm.embeddings.calls == 3


def test_audio_graph_output_equals_the_unwrapped_eager_path() -> None:
    """encode_audio's graphed Whisper + projection + pooling equals the eager composition."""
    model = build(**FAST)
    features = mel()
    with torch.no_grad():
        expected = model.eager_audio(features)
        result, backend = _instrument(model)
        outs = [encode_audio(model, features) for _ in range(3)]
    assert all(torch.equal(out, expected) for out in outs)
    assert backend.captures == 1
    assert result.audio.get_cumulative_stats()["graph_hits"] == 2  # type: ignore[union-attr]


def test_streaming_audio_never_calls_the_graph(bus: EventBus) -> None:
    """The stateful streaming path runs eagerly even for a captured shape, as a 'streaming' miss."""
    model = build(**FAST)
    features = mel()
    result, backend = _instrument(model, bus)
    with torch.no_grad():
        for _ in range(2):
            encode_audio(model, features)  # captures this exact shape
        replays = backend.replays
        cache = None
        with capture_events(bus) as events:
            for _ in range(3):
                _, cache = encode_audio_streaming(model, features, cache)
    assert backend.replays == replays
    assert backend.captures == 1
    assert model.apm.stateful_calls == 3
    assert len(cache) == 3
    assert _details(events) == ["streaming"] * 3
    assert result.audio.get_cumulative_stats()["ineligible_misses"] == 3  # type: ignore[union-attr]


def test_streaming_output_matches_the_eager_streaming_computation() -> None:
    """Streaming embeddings equal running apm with the cache, projection and pooling by hand."""
    model = build(**FAST)
    features = mel()
    _instrument(model)
    with torch.no_grad():
        got, cache = encode_audio_streaming(model, features)
        raw = model.apm(features, past_key_values=None, use_cache=True)
        states = raw.hidden_states[-1]
        want = model.audio_avg_pooler(model.audio_projection_layer(states).transpose(1, 2))
    assert torch.equal(got, want.transpose(1, 2))
    assert len(cache) == 1


def test_training_mode_stays_eager_for_both_encoders(bus: EventBus) -> None:
    """In training mode neither encoder captures; each call is a 'training' miss."""
    model = build(**FAST)
    _, backend = _instrument(model, bus)
    model.train()
    pixels, mask = image()
    features = mel()
    with torch.no_grad(), capture_events(bus) as events:
        for _ in range(3):
            model.vpm(pixels, mask)
            encode_audio(model, features)
    assert backend.captures == 0
    assert _details(events) == ["training"] * 6


def test_requested_hidden_states_run_the_original_vision_forward(bus: EventBus) -> None:
    """output_hidden_states=True returns the original forward's result, never a graph's."""
    model = build(**FAST)
    pixels, mask = image()
    with torch.no_grad():
        expected, _ = model.vpm(pixels, mask, output_hidden_states=True)
        _, backend = _instrument(model, bus)
        with capture_events(bus) as events:
            outs = [model.vpm(pixels, mask, output_hidden_states=True) for _ in range(3)]
    assert all(isinstance(out, tuple) and torch.equal(out[0], expected) for out in outs)
    assert backend.captures == 0
    assert _details(events) == ["extra_outputs"] * 3


def test_fp16_audio_stays_eager(bus: EventBus) -> None:
    """fp16 audio never captures (host-side overflow guard) and still returns eager output."""
    model = build(**FAST).half()
    features = mel().half()
    _, backend = _instrument(model, bus)
    with torch.no_grad(), capture_events(bus) as events:
        outs = [encode_audio(model, features) for _ in range(3)]
        expected = model.eager_audio(features)
    assert backend.captures == 0
    assert all(torch.equal(out, expected) for out in outs)
    assert _details(events) == ["fp16"] * 3


def test_grad_mode_is_an_adapter_miss() -> None:
    """Outside no_grad the adapter itself refuses the graph (detail 'grad')."""
    model = build(**FAST)
    result, backend = _instrument(model)
    pixels, mask = image()
    for _ in range(3):
        model.vpm(pixels, mask)
    assert backend.captures == 0
    assert result.vision.get_cumulative_stats()["ineligible_misses"] == 3  # type: ignore[union-attr]


def test_hf_config_overrides_configure_both_adapters() -> None:
    """encoder_cuda_graph_* attributes on the model's hf config become the adapters' config."""
    model = build(
        encoder_cuda_graph_max_graphs=1,
        encoder_cuda_graph_min_capture_calls=3,
        encoder_cuda_graph_share_pools=False,
        unrelated_key=7,
    )
    result, _ = _instrument(model)
    for graph in (result.vision, result.audio):
        assert graph is not None
        assert (graph.config.max_graphs, graph.config.min_capture_calls) == (1, 3)
        assert graph.config.share_pools is False


def test_vllm_model_config_supplies_hf_config_and_enforce_eager() -> None:
    """vllm_config.model_config's hf_config and enforce_eager are used when not overridden."""
    hf = SimpleNamespace(encoder_cuda_graph_max_graphs=2)
    vllm_config = SimpleNamespace(model_config=SimpleNamespace(hf_config=hf, enforce_eager=True))
    config = config_from_model(build(), vllm_config)
    assert config.max_graphs == 2
    assert config.enabled is False
    assert config_from_model(build(), vllm_config, enforce_eager=False).enabled is True


def test_enforce_eager_disables_both_graphs(bus: EventBus) -> None:
    """enforce_eager=True makes every call a 'disabled' miss and never captures."""
    model = build(**FAST)
    _, backend = _instrument(model, bus, enforce_eager=True)
    pixels, mask = image()
    with torch.no_grad(), capture_events(bus) as events:
        for _ in range(3):
            model.vpm(pixels, mask)
            encode_audio(model, mel())
    assert backend.captures == 0
    assert set(_details(events)) == {"disabled"}


def test_invalid_override_is_rejected_naming_the_key() -> None:
    """A bad override on the hf config raises ConfigError naming the key."""
    model = build(encoder_cuda_graph_max_graphs=-1)
    with pytest.raises(ConfigError, match="encoder_cuda_graph_max_graphs"):
        _instrument(model)


def test_adapter_stats_equal_the_fold_of_the_bus_events(bus: EventBus) -> None:
    """Model-level fallbacks reach both the adapter's stats and the event stream identically."""
    model = build(**FAST)
    result, _ = _instrument(model, bus)
    pixels, mask = image()
    with torch.no_grad(), capture_events(bus) as events:
        for _ in range(3):
            model.vpm(pixels, mask)
            encode_audio(model, mel())
        encode_audio_streaming(model, mel())
        model.train()
        model.vpm(pixels, mask)
    derived = derive_stats(events)
    assert derived["vision"] == result.vision.get_cumulative_stats()  # type: ignore[union-attr]
    assert derived["audio"] == result.audio.get_cumulative_stats()  # type: ignore[union-attr]
    assert derived["audio"]["ineligible_misses"] == 1


def test_model_without_audio_gets_only_a_vision_adapter() -> None:
    """A vision-only model gets a vision adapter and None for audio."""
    model = build(**FAST)
    del model.apm
    result, _ = _instrument(model)
    assert result.vision is not None
    assert result.audio is None


def test_miss_reason_of_model_fallbacks_is_ineligible(bus: EventBus) -> None:
    """Model-specific fallbacks are ineligible misses, not warm-up or capacity misses."""
    model = build(**FAST)
    _instrument(model, bus)
    with torch.no_grad(), capture_events(bus) as events:
        encode_audio_streaming(model, mel())
    assert [e.reason for e in events if isinstance(e, GraphMissed)] == [MissReason.INELIGIBLE]
