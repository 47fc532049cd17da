"""What every model integration shares: its registry record (``ModelIntegration``), the config
from the model, adapters per encoder, routing a method on one instance, recording fallbacks
(docs/vllm.md, "Adding a model")."""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, TypedDict

import torch
from typing_extensions import Unpack

from omnitrace.bus import EventBus
from omnitrace.config import HF_OVERRIDE_KEYS, EncoderGraphConfig, spelt_like_a_key
from omnitrace.graphs.adapter import EncoderCudaGraph, items_fact
from omnitrace.graphs.backends.base import GraphBackend

__all__ = [
    "AdapterChoices",
    "Adapters",
    "ModelIntegration",
    "attach_lock",
    "attached_summary",
    "code_names",
    "code_strings",
    "config_from_model",
    "describe_items",
    "original_method",
    "output_tensor",
    "record_ineligible",
    "route_method",
    "warn_unsupported",
]

#: Held while any integration attaches adapters (attaching is rare; one lock is enough).
attach_lock = threading.Lock()

_ORIGINAL_PREFIX = "_omnitrace_original_"


@dataclass(frozen=True, slots=True)
class ModelIntegration:
    """How omnitrace recognises one model family and attaches its adapters.

    Attributes:
        name: short name, the same as the entry point's (``minicpmo``).
        detect: ``detect(model) -> bool``: whether a loaded model is of this family. It must
            be cheap and never import anything.
        instrument: ``instrument(model, vllm_config, *, bus) -> result``: attach the
            adapters; the result is a dataclass whose fields name the adapters attached.
        description: one line for logs and docs.
    """

    name: str
    detect: Callable[[Any], bool]
    instrument: Callable[..., Any]
    description: str


# -- configuration -------------------------------------------------------------------------


def _hf_overrides_of(hf_config: Any) -> dict[str, Any]:
    """omnitrace's keys in a model's hf config, and keys spelt like them (refused later).

    The config also holds the model's own keys: only a key with omnitrace's prefix, in any
    spelling, is taken as a misspelling here; near misses are looked for in the user's
    overrides alone (:func:`_user_overrides_of`).
    """
    if hf_config is None:
        return {}
    if isinstance(hf_config, Mapping):
        items = hf_config.items()
    else:
        found = {k: getattr(hf_config, k) for k in HF_OVERRIDE_KEYS if hasattr(hf_config, k)}
        items = {**getattr(hf_config, "__dict__", {}), **found}.items()
    return {
        k: v
        for k, v in items
        if isinstance(k, str) and (k in HF_OVERRIDE_KEYS or spelt_like_a_key(k))
    }


def _user_overrides_of(model_config: Any) -> dict[str, Any]:
    """The ``--hf-overrides`` mapping vLLM keeps as given (``model_config.hf_overrides``)."""
    overrides = getattr(model_config, "hf_overrides", None)
    if not isinstance(overrides, Mapping):  # None, or a function of the config
        return {}
    return {k: v for k, v in overrides.items() if isinstance(k, str)}


def config_from_model(
    model: Any,
    vllm_config: Any = None,
    *,
    hf_config: Any = None,
    enforce_eager: bool | None = None,
) -> EncoderGraphConfig:
    """Build the encoder graph config of ``model``.

    The ``encoder_cuda_graph*`` keys are read from ``hf_config`` (default: vLLM's
    ``model_config.hf_config``, else ``model.config``), and, without ``hf_config``, the
    keys of vLLM's ``model_config.hf_overrides`` (the ``--hf-overrides`` as given) are
    checked for misspellings of omnitrace's (:func:`omnitrace.config.misspelt_key`);
    ``enforce_eager`` defaults to vLLM's ``model_config.enforce_eager``.

    Raises:
        ConfigError: an override has the wrong type, range or name (a misspelt key
            included; a bare option name such as ``max_graphs`` is a logged warning).
    """
    model_config = getattr(vllm_config, "model_config", None)
    # The keys the user gave, as given: vLLM sets them on the hf config, where a misspelt one
    # could not be told from the model's own keys.
    given = _user_overrides_of(model_config) if hf_config is None else {}
    if hf_config is None:
        hf_config = getattr(model_config, "hf_config", None)
    if hf_config is None:
        hf_config = getattr(model, "config", None)
    if enforce_eager is None:
        enforce_eager = bool(getattr(model_config, "enforce_eager", False))
    return EncoderGraphConfig.from_hf_overrides(
        {**_hf_overrides_of(hf_config), **given}, enforce_eager=enforce_eager
    )


# -- adapters ----------------------------------------------------------------------------------


class AdapterChoices(TypedDict, total=False):
    """The keyword arguments every integration's ``instrument`` takes (see Adapters.for_model)."""

    bus: EventBus | None
    hf_config: Any
    enforce_eager: bool | None
    backend: GraphBackend | None


@dataclass(frozen=True, slots=True)
class Adapters:
    """Make a model's adapters: one config, one bus, one backend choice for all of them.

    Attributes:
        config: the encoder graph config every adapter gets.
        bus: where the adapters emit events.
        backend: one backend for every adapter (tests pass a SimulatedGraphBackend); None:
            :func:`~omnitrace.graphs.backends.select.select_backend` picks one per adapter.
        vllm_config: the engine's ``VllmConfig``, which makes that choice vLLM's graph
            manager when vLLM is importable (the torch backend with ``background_capture``,
            which needs thread-local captures).
    """

    config: EncoderGraphConfig
    bus: EventBus | None = None
    backend: GraphBackend | None = None
    vllm_config: Any = None

    @classmethod
    def for_model(
        cls, model: Any, vllm_config: Any = None, **choices: Unpack[AdapterChoices]
    ) -> Adapters:
        """Read ``model``'s config (:func:`config_from_model`) and keep the other choices.

        Args:
            model: the loaded model.
            vllm_config: the engine's ``VllmConfig``: source of ``enforce_eager`` and the hf
                config, and selects vLLM's graph manager as the backend.
            choices: ``bus``, where the adapters emit events; ``hf_config``, overriding the
                hf config the ``encoder_cuda_graph*`` keys are read from; ``enforce_eager``,
                overriding vLLM's; ``backend``, one backend for every adapter (default: one
                selected per adapter).

        Raises:
            ConfigError: an ``encoder_cuda_graph*`` override is invalid.
        """
        config = config_from_model(
            model,
            vllm_config,
            hf_config=choices.get("hf_config"),
            enforce_eager=choices.get("enforce_eager"),
        )
        return cls(
            config=config,
            bus=choices.get("bus"),
            backend=choices.get("backend"),
            vllm_config=vllm_config,
        )

    def make(self, stack: Callable[..., Any], *, name: str) -> EncoderCudaGraph:
        """Return a new adapter named ``name`` serving ``stack``."""
        # With no backend given, the adapter selects one from vllm_config and its config.
        return EncoderCudaGraph(
            stack,
            name=name,
            config=self.config,
            bus=self.bus,
            backend=self.backend,
            vllm_config=self.vllm_config,
        )

    def attach(
        self, owner: Any, attribute: str, name: str, stack: Callable[[], Callable[..., Any]]
    ) -> tuple[EncoderCudaGraph, bool]:
        """Return the adapter at ``owner.<attribute>``, or make one serving ``stack()`` there.

        Call with :data:`attach_lock` held.

        Returns:
            The adapter, and whether it was made now (then the caller routes the model's
            calls through it; an adapter found attached is already routed).
        """
        graph: EncoderCudaGraph | None = getattr(owner, attribute, None)
        if graph is not None:
            return graph, False
        graph = self.make(stack(), name=name)
        # An instance attribute: the class, shared with other models, is untouched.
        object.__setattr__(owner, attribute, graph)
        return graph, True


def record_ineligible(graph: EncoderCudaGraph, detail: str, *inputs: Any) -> None:
    """Record an eager run the model chose before reaching the adapter.

    Args:
        graph: the adapter the call would have gone through.
        detail: why it stays eager (``training``, ``arguments`` ...).
        inputs: what the call had; tensors give the key, anything else shows as ``None``.
    """
    # The adapter's own fold and its bus both see the miss, so adapter stats, bus stats and
    # derive_stats() over a recorded log agree on calls that never reached the graph.
    graph.record_ineligible(detail, *(x if isinstance(x, torch.Tensor) else None for x in inputs))


def describe_items(graph: EncoderCudaGraph) -> None:
    """Add to the adapter's registered facts how its calls' items (the images or clips of a
    step) are served: ``items`` is ``"split"`` (one call per item,
    ``encoder_cuda_graph_split_items``) or ``"batched"``. Event logs carry it, and
    ``omnitrace advise`` names the setting where batches' mixes seldom recur."""
    bus = graph.bus
    if bus is None:
        return
    info = dict(bus.adapters().get(graph.name, {}))
    info["items"] = items_fact(graph.split_items)
    bus.register_adapter(graph.name, info)


def code_names(function: object) -> frozenset[str]:
    """The global and attribute names ``function``'s code reads (empty without code)."""
    code = getattr(function, "__code__", None)
    return frozenset(code.co_names) if code is not None else frozenset()


def code_strings(function: object) -> frozenset[str]:
    """The string constants in ``function``'s code (empty without code)."""
    code = getattr(function, "__code__", None)
    if code is None:
        return frozenset()
    return frozenset(c for c in code.co_consts if isinstance(c, str))


def warn_unsupported(logger: logging.Logger, module: object, problem: str, *args: object) -> None:
    """Warn ``"omnitrace: <module's type name><problem>"``, ``problem`` formatted with ``args``.

    For a module an integration leaves (partly) without graphs because it lacks what the
    graph path needs; ``problem`` says what and what runs instead.
    """
    logger.warning("omnitrace: %s" + problem, type(module).__name__, *args)


def output_tensor(result: Any) -> torch.Tensor:
    """Return the hidden-state tensor of an encoder's result.

    vLLM's encoders return the tensor; Hugging Face's return a ``ModelOutput`` (its
    ``last_hidden_state``) or a tuple (its first item).

    Raises:
        TypeError: the result holds no such tensor.
    """
    if isinstance(result, torch.Tensor):
        return result
    last = getattr(result, "last_hidden_state", None)
    if isinstance(last, torch.Tensor):
        return last
    first = result[0]
    if not isinstance(first, torch.Tensor):
        raise TypeError(f"encoder returned {type(result).__name__} without a tensor")
    return first


# -- routing methods ---------------------------------------------------------------------------


def route_method(
    owner: Any, name: str, make: Callable[[Callable[..., Any]], Callable[..., Any]]
) -> Callable[..., Any]:
    """Serve ``owner.<name>`` through ``make(original)``, bound on this instance only.

    The wrapper becomes an instance attribute, which ``owner.<name>(...)`` (and, for
    ``forward``, ``nn.Module.__call__``) finds before the class's method; the class and every
    other instance keep the original. The original stays reachable through
    :func:`original_method`.

    Returns:
        The wrapper.
    """
    original = getattr(owner, name)
    wrapper = make(original)
    # object.__setattr__: nn.Module.__setattr__ would try to register callables as modules.
    object.__setattr__(owner, _ORIGINAL_PREFIX + name, original)
    object.__setattr__(owner, name, wrapper)
    return wrapper


def original_method(owner: Any, name: str) -> Callable[..., Any] | None:
    """Return the method :func:`route_method` replaced on ``owner``, or None if none was."""
    original: Callable[..., Any] | None = getattr(owner, _ORIGINAL_PREFIX + name, None)
    return original


def attached_summary(result: Any) -> str:
    """Describe what an ``instrument`` result attached: ``vision=True, audio=False, ...``.

    Adapter fields read True when attached; other fields show their value.
    """
    if not dataclasses.is_dataclass(result):
        return repr(result)
    parts = []
    for field in dataclasses.fields(result):
        value = getattr(result, field.name)
        # An adapter field (annotated with EncoderCudaGraph) reads as whether it is attached.
        if isinstance(value, EncoderCudaGraph) or "EncoderCudaGraph" in str(field.type):
            value = value is not None
        parts.append(f"{field.name}={value}")
    return ", ".join(parts)
