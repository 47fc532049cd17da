"""The helpers every model integration shares (config, adapters, routing, recording)."""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch import nn

from omnitrace import EncoderCudaGraph, EncoderGraphConfig, EventBus, GraphMissed, MissReason
from omnitrace.graphs.backends.torch import TorchGraphBackend
from omnitrace.integrations.base import (
    Adapters,
    attached_summary,
    config_from_model,
    original_method,
    output_tensor,
    record_ineligible,
    route_method,
)
from omnitrace.testing import SimulatedGraphBackend, capture_events


def test_config_prefers_vllms_hf_config_to_the_models_own() -> None:
    """vLLM's model_config.hf_config (where --hf-overrides land) wins over model.config."""
    model = SimpleNamespace(config={"encoder_cuda_graph_max_graphs": 2})
    vllm_config = SimpleNamespace(
        model_config=SimpleNamespace(
            hf_config=SimpleNamespace(encoder_cuda_graph_max_graphs=7), enforce_eager=True
        )
    )
    config = config_from_model(model, vllm_config)
    assert config.max_graphs == 7
    assert config.enabled is False  # vLLM's enforce_eager
    assert config_from_model(model).max_graphs == 2
    explicit = config_from_model(model, vllm_config, hf_config={}, enforce_eager=False)
    assert (explicit.max_graphs, explicit.enabled) == (EncoderGraphConfig().max_graphs, True)


def test_adapters_use_the_given_backend_else_select_one() -> None:
    """A passed backend serves every adapter; without one the torch backend is selected."""
    backend = SimulatedGraphBackend()
    given = Adapters(EncoderGraphConfig(), backend=backend).make(torch.tanh, name="a")
    assert given.backend is backend
    chosen = Adapters(EncoderGraphConfig()).make(torch.tanh, name="b")
    assert isinstance(chosen.backend, TorchGraphBackend)


def test_adapters_for_a_model_carry_its_config_and_the_callers_choices(bus: EventBus) -> None:
    """for_model reads the model's hf config and keeps the bus, backend and vLLM config."""
    model = SimpleNamespace(config={"encoder_cuda_graph_max_graphs": 5})
    backend = SimulatedGraphBackend()
    adapters = Adapters.for_model(model, None, bus=bus, backend=backend, enforce_eager=True)
    assert (adapters.config.max_graphs, adapters.config.enabled) == (5, False)
    assert (adapters.bus, adapters.backend, adapters.vllm_config) == (bus, backend, None)
    graph = adapters.make(torch.tanh, name="vision")
    assert (graph.config, graph.name) == (adapters.config, "vision")
    assert "vision" in bus.adapters()


def test_attach_makes_one_adapter_per_owner_and_says_when_it_made_it() -> None:
    """The first attach stores a new adapter on the instance; the next returns that one."""
    adapters = Adapters(EncoderGraphConfig(), backend=SimulatedGraphBackend())
    owner, other = _Host(), _Host()
    stacks: list[str] = []

    def stack() -> Any:
        stacks.append("made")
        return torch.tanh

    graph, made = adapters.attach(owner, "_encoder_graph", "vision", stack)
    assert made
    assert vars(owner)["_encoder_graph"] is graph
    assert adapters.attach(owner, "_encoder_graph", "vision", stack) == (graph, False)
    assert stacks == ["made"]
    assert not hasattr(other, "_encoder_graph")


class _Host(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + 1


def test_route_method_binds_on_the_instance_only_and_keeps_the_original() -> None:
    """The wrapper is an instance attribute nn.Module.__call__ uses; class and others untouched."""
    host, other = _Host(), _Host()
    seen: list[Any] = []

    def make(original: Any) -> Any:
        def wrapper(x: torch.Tensor) -> torch.Tensor:
            seen.append(x)
            out: torch.Tensor = original(x) * 10
            return out

        return wrapper

    wrapper = route_method(host, "forward", make)
    x = torch.ones(2)
    assert torch.equal(host(x), torch.full((2,), 20.0))
    assert seen == [x]
    assert vars(host)["forward"] is wrapper
    assert "forward" not in vars(other)
    assert torch.equal(other(x), torch.full((2,), 2.0))
    original = original_method(host, "forward")
    assert original is not None
    assert original.__func__ is _Host.forward  # type: ignore[attr-defined]
    assert original_method(other, "forward") is None


def test_record_ineligible_emits_an_ineligible_miss_keyed_by_the_tensors(bus: EventBus) -> None:
    """A model-level eager run becomes one ineligible miss; non-tensors show as None in the key."""
    graph = EncoderCudaGraph(torch.tanh, name="vision", bus=bus, backend=SimulatedGraphBackend())
    with capture_events(bus) as events:
        record_ineligible(graph, "training", torch.ones(2, 3), [1, 2], None)
    (event,) = events
    assert isinstance(event, GraphMissed)
    assert (event.reason, event.detail) == (MissReason.INELIGIBLE, "training")
    assert event.key == "float32[2,3], None, None @cpu"
    assert graph.get_cumulative_stats()["ineligible_misses"] == 1


def test_output_tensor_reads_tensors_model_outputs_and_tuples() -> None:
    """A tensor is itself; a ModelOutput gives last_hidden_state; a tuple its first item."""
    x = torch.ones(1)
    assert output_tensor(x) is x
    assert output_tensor(SimpleNamespace(last_hidden_state=x)) is x
    assert output_tensor((x, "states")) is x
    with pytest.raises(TypeError, match=r"^encoder returned tuple without a tensor$"):
        output_tensor(("no", x))


def test_attached_summary_shows_adapters_as_attached_flags() -> None:
    """Adapter fields read True/False; other fields show their values, in field order."""

    @dataclass
    class Attached:
        vision: EncoderCudaGraph | None
        audio: EncoderCudaGraph | None
        method: str | None

    graph = EncoderCudaGraph(torch.tanh, name="v", backend=SimulatedGraphBackend())
    assert attached_summary(Attached(graph, None, "m")) == "vision=True, audio=False, method=m"
    assert attached_summary(Attached(None, graph, None)) == "vision=False, audio=True, method=None"
