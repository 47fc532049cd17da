"""MiniCPM-o wiring on CPU stand-ins, with the simulated graph backend (no GPU, no vLLM)."""

from __future__ import annotations

import logging
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from integrations.standins import HIDDEN, MiniCPMOStandIn, audio_batch, build, image, mel
from omnitrace import ConfigError, EventBus, GraphMissed, MissReason, derive_stats
from omnitrace.integrations.minicpmo import (
    Instrumented,
    audio_batch_method,
    config_from_model,
    encode_audio,
    encode_audio_streaming,
    instrument,
)
from omnitrace.testing import SimulatedGraphBackend, capture_events

FAST = {"encoder_cuda_graph_min_free_bytes": 0}


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


def test_requested_hidden_states_come_from_vpms_own_forward_around_the_graph(
    bus: EventBus,
) -> None:
    """output_hidden_states=True still runs vpm's own forward; the graph serves its encoder."""
    model = build(**FAST)
    pixels, mask = image()
    with torch.no_grad():
        expected, (embedded,) = model.vpm(pixels, mask, output_hidden_states=True)
        _, backend = _instrument(model, bus)
        outs = [model.vpm(pixels, mask, output_hidden_states=True) for _ in range(3)]
    for out, (hidden,) in ((o, o[1]) for o in outs):
        assert torch.equal(out[0], expected)
        assert torch.equal(hidden, embedded)
    assert backend.captures == 1


def test_extra_encoder_arguments_run_the_original_encoder(bus: EventBus) -> None:
    """An encoder call with arguments vLLM never passes runs the original and is recorded."""
    model = build(**FAST)
    hidden = torch.randn(1, 16, HIDDEN)
    with torch.no_grad():
        expected, states = model.vpm.encoder(hidden, attention_mask=None, output_hidden_states=True)
        _, backend = _instrument(model, bus)
        with capture_events(bus) as events:
            outs = [
                model.vpm.encoder(hidden, attention_mask=None, output_hidden_states=True)
                for _ in range(3)
            ]
    assert all(torch.equal(out[0], expected) and len(out[1]) == len(states) for out in outs)
    assert backend.captures == 0
    assert _details(events) == ["arguments"] * 3


def test_vision_follows_the_towers_own_mask_rule(bus: EventBus) -> None:
    """A tower that passes no mask for unpadded patches (vLLM 0.26) is graphed without one."""
    model = build(**FAST)
    model.vpm.mask_unpadded = False
    pixels = torch.randn(1, 3, 16, 16)
    full = torch.ones(1, 4, 4, dtype=torch.bool)
    with torch.no_grad():
        expected = model.vpm(pixels, full)
        _, backend = _instrument(model, bus)
        with capture_events(bus) as events:
            outs = [model.vpm(pixels, full) for _ in range(3)]
    assert all(torch.equal(out, expected) for out in outs)
    assert backend.captures == 1
    assert all(e.key.endswith("None") or ", None" in e.key for e in events)


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


# -- the model's own batch audio method (vLLM's get_audio_hidden_states) --------------------


def _same(got: list[torch.Tensor], want: list[torch.Tensor]) -> bool:
    return len(got) == len(want) and all(
        g.shape == w.shape and torch.equal(g, w) for g, w in zip(got, want, strict=True)
    )


def _variants() -> list[dict[str, Any]]:
    """List features with per-item slices, stacked features, and stacked slice lengths."""
    listed = audio_batch()
    stacked = audio_batch(((20,), (20,)), seed=4)
    stacked["audio_features"] = torch.stack(stacked["audio_features"])
    stacked["audio_feature_lens"] = torch.stack(stacked["audio_feature_lens"])
    return [listed, stacked]


def test_instrument_routes_the_models_batch_audio_method_through_the_adapter() -> None:
    """vLLM's self.get_audio_hidden_states(data) warms up, captures, then replays the graph."""
    model = build(**FAST)
    result, backend = _instrument(model)
    assert result.audio_method == "get_audio_hidden_states"
    data = audio_batch()
    with torch.no_grad():
        for _ in range(4):
            model.get_audio_hidden_states(data)
    assert backend.captures == 1
    assert backend.replays >= 3
    stats = result.audio.get_cumulative_stats()  # type: ignore[union-attr]
    assert (stats["graph_hits"], stats["warmup_misses"], stats["ineligible_misses"]) == (3, 1, 0)


@pytest.mark.parametrize("chunk_length", [0.1, 0])
def test_routed_batch_audio_equals_the_uninstrumented_method(chunk_length: float) -> None:
    """Every call returns exactly the original method's per-item list (padding, mask, cuts)."""
    reference = build(**FAST, audio_chunk_length=chunk_length)
    model = build(**FAST, audio_chunk_length=chunk_length)
    result, backend = _instrument(model)
    with torch.no_grad():
        for data in _variants():
            want = reference.get_audio_hidden_states(data)
            outs = [model.get_audio_hidden_states(data) for _ in range(3)]
            assert all(_same(out, want) for out in outs)
    assert backend.captures == 2
    assert result.audio.get_cumulative_stats()["graph_hits"] == 4  # type: ignore[union-attr]


def _alone(reference: MiniCPMOStandIn, data: dict[str, Any]) -> list[torch.Tensor]:
    """vLLM's method on each slice of ``data`` alone, at its own length, joined per item."""
    features, lens = data["audio_features"], data["audio_feature_lens"]
    lengths = [int(n) for item in lens for n in item]
    out = [
        reference.get_audio_hidden_states(
            {"audio_features": [mel[..., :n]], "audio_feature_lens": [torch.tensor([n])]}
        )[0]
        for mel, n in zip(features, lengths, strict=True)
    ]
    final, idx = [], 0
    for item in lens:
        final.append(torch.cat(out[idx : idx + len(item)]))
        idx += len(item)
    return final


def test_split_items_serves_each_audio_slice_alone() -> None:
    """encoder_cuda_graph_split_items: each slice is one call at its own length, its result
    exactly the method's on that slice alone, the slices of an item joined as vLLM joins them.
    Batched, slices of 14 and 6 frames beside one of 20 saw part of their padding (vLLM's
    mask); two slices of 20 frames, unpadded, give the batch's result up to rounding."""
    reference = build(**FAST)
    model = build(**FAST, encoder_cuda_graph_split_items=True)
    result, backend = _instrument(model)
    with torch.no_grad():
        for data, padded in zip(_variants(), (True, False), strict=True):
            want = _alone(reference, data)
            outs = [model.get_audio_hidden_states(data) for _ in range(3)]
            assert all(_same(out, want) for out in outs)
            batched = reference.get_audio_hidden_states(data)
            apart = max(float((b - w).abs().max()) for b, w in zip(batched, want, strict=True))
            assert (apart > 1e-4) is padded, apart
    stats = result.audio.get_cumulative_stats()  # type: ignore[union-attr]
    # Slices of 20, 14 and 6 frames, then two of 20: three shapes, six calls a round.
    assert stats["num_graphs"] == backend.captures == 3
    assert stats["graph_hits"] + stats["graph_misses"] == 3 * (3 + 2)


def test_split_items_keeps_a_call_whole_where_a_length_passes_its_mel() -> None:
    """A slice length beyond its mel's frames: one batched call, exactly vLLM's method, as
    without the option."""
    reference = build(**FAST)
    model = build(**FAST, encoder_cuda_graph_split_items=True)
    result, _ = _instrument(model)
    data = audio_batch(((20,), (6,)))
    data["audio_feature_lens"] = [torch.tensor([20]), torch.tensor([7])]
    with torch.no_grad():
        assert _same(model.get_audio_hidden_states(data), reference.get_audio_hidden_states(data))
    stats = result.audio.get_cumulative_stats()  # type: ignore[union-attr]
    assert stats["graph_hits"] + stats["graph_misses"] == 1


def test_routed_batch_audio_masks_padding_and_later_chunks() -> None:
    """The graphed call sees the mask: a padded short item and chunked frames change the output."""
    model = build(**FAST)
    _instrument(model)
    data = audio_batch(((20,), (6,)))
    with torch.no_grad():
        for _ in range(3):
            got = model.get_audio_hidden_states(data)
        alone = [model.eager_audio(x.unsqueeze(0))[0] for x in data["audio_features"]]
    assert [g.shape[0] for g in got] == [5, 1]
    # Unmasked full-attention encodings differ from vLLM's masked, chunked batch encoding.
    assert not torch.equal(got[0], alone[0][:5])


def test_batch_audio_wrapper_leaves_the_class_and_other_models_alone() -> None:
    """The wrapper is an instance attribute: the class method and another instance stay original."""
    model = build(**FAST)
    other = build(**FAST)
    _instrument(model)
    assert type(model).get_audio_hidden_states is MiniCPMOStandIn.get_audio_hidden_states
    assert "get_audio_hidden_states" in vars(model)
    assert "get_audio_hidden_states" not in vars(other)
    second, _ = _instrument(model)
    assert second.audio_method == "get_audio_hidden_states"
    wrapper = vars(model)["get_audio_hidden_states"]
    assert wrapper.original.__func__ is MiniCPMOStandIn.get_audio_hidden_states


def test_streaming_never_calls_the_graph_between_routed_batch_calls(bus: EventBus) -> None:
    """Streaming chunks run eagerly with their cache while routed batch calls replay the graph."""
    model = build(**FAST)
    result, backend = _instrument(model, bus)
    data = audio_batch(((20,),))
    features = data["audio_features"][0].unsqueeze(0)
    with torch.no_grad():
        for _ in range(2):
            model.get_audio_hidden_states(data)  # captures (1, MEL_BINS, 20) with its mask
        cache = None
        with capture_events(bus) as events:
            for _ in range(3):
                replays = backend.replays
                _, cache = encode_audio_streaming(model, features, cache)
                assert backend.replays == replays
                model.get_audio_hidden_states(data)
                assert backend.replays == replays + 1
    assert backend.captures == 1
    assert model.apm.stateful_calls == 3
    assert _details(events) == ["streaming"] * 3
    stats = result.audio.get_cumulative_stats()  # type: ignore[union-attr]
    assert (stats["ineligible_misses"], stats["graph_hits"]) == (3, 4)


def test_batch_audio_fallbacks_run_the_original_method_and_are_recorded(bus: EventBus) -> None:
    """Unrecognised arguments (the original's own error) and training mode are ineligible misses."""
    reference = build(**FAST)
    model = build(**FAST)
    result, backend = _instrument(model, bus)
    data = audio_batch()
    odd = {**data, "audio_feature_lens": [[20, 14], [6]]}
    with torch.no_grad():
        want = reference.get_audio_hidden_states(data)
        with capture_events(bus) as events:
            with pytest.raises(TypeError, match="positional argument"):
                model.get_audio_hidden_states(data, 7)
            with pytest.raises(TypeError):
                model.get_audio_hidden_states(odd)
            with pytest.raises(KeyError):
                model.get_audio_hidden_states({"audio_features": data["audio_features"]})
            model.train()
            outs = [model.get_audio_hidden_states(data) for _ in range(3)]
    assert all(_same(out, want) for out in outs)
    assert backend.captures == 0
    assert _details(events) == ["arguments"] * 3 + ["training"] * 3
    assert derive_stats(events)["audio"] == result.audio.get_cumulative_stats()  # type: ignore[union-attr]


def test_fp16_batch_audio_runs_the_original_method(bus: EventBus) -> None:
    """fp16 batch audio stays eager (an 'fp16' miss) and equals the original method's output."""
    reference = build(**FAST).half()
    model = build(**FAST).half()
    _, backend = _instrument(model, bus)
    data = audio_batch()
    data["audio_features"] = [x.half() for x in data["audio_features"]]
    with torch.no_grad(), capture_events(bus) as events:
        want = reference.get_audio_hidden_states(data)
        outs = [model.get_audio_hidden_states(data) for _ in range(3)]
    assert all(_same(out, want) for out in outs)
    assert backend.captures == 0
    assert _details(events) == ["fp16"] * 3


def test_model_without_a_batch_audio_method_logs_and_keeps_encode_audio(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Without a recognised method, one 'omnitrace' line says so and encode_audio still graphs."""

    class Older(MiniCPMOStandIn):
        # An older vLLM's shape: two arguments, one padded tensor back.
        def get_audio_hidden_states(  # type: ignore[override]
            self, data: Any, chunk_length: int
        ) -> torch.Tensor:
            return self.eager_audio(data["audio_features"])

    torch.manual_seed(0)
    model = Older(**FAST).eval()
    assert audio_batch_method(model) is None
    with caplog.at_level(logging.INFO, logger="omnitrace"):
        result, backend = _instrument(model)
    lines = [r.getMessage() for r in caplog.records if r.name.startswith("omnitrace.integrations.")]
    assert len(lines) == 1
    assert "no recognised batch audio method" in lines[0]
    assert result.audio is not None
    assert result.audio_method is None
    assert "get_audio_hidden_states" not in vars(model)
    with torch.no_grad():
        for _ in range(2):
            encode_audio(model, mel())
    assert backend.captures == 1


def test_audio_batch_method_finds_the_standins_vllm_structure() -> None:
    """Introspection names get_audio_hidden_states on the class and on an instance."""
    assert audio_batch_method(MiniCPMOStandIn) == "get_audio_hidden_states"
    assert audio_batch_method(build()) == "get_audio_hidden_states"
    assert audio_batch_method(torch.nn.Linear) is None


@pytest.mark.parametrize("split", [False, True])
def test_the_audio_adapter_registers_how_it_serves_a_calls_slices(split: bool) -> None:
    """The audio adapter's facts say whether a call's slices go as one batch or one by one;
    the vision path keeps its batches and says nothing of items."""
    bus = EventBus()
    try:
        model = build(**FAST, encoder_cuda_graph_split_items=split)
        _instrument(model, bus=bus)
        infos = bus.adapters()
        assert infos["audio"]["items"] == ("split" if split else "batched")
        assert "items" not in infos["vision"]
    finally:
        bus.close()
