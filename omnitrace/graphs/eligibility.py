"""Eligibility: can this call be graphed at all, and what is its key? (The checks and their
order: docs/architecture.md, "The graph adapter".)"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from omnitrace.graphs.backends.base import GraphBackend
from omnitrace.signature import InputSpec, Signature

__all__ = [
    "Call",
    "KeySpecs",
    "call_key",
    "examine",
    "ineligible_detail",
    "signature_of",
    "state_detail",
]

#: Per input: ``(shape, dtype)`` or None. ``torch.Size`` is a hashable tuple, so building
#: this costs no conversion on the hot path.
KeySpecs = tuple[tuple[torch.Size, torch.dtype] | None, ...]

_DTYPE_NAMES: dict[torch.dtype, str] = {}


def _dtype_name(dtype: torch.dtype) -> str:
    name = _DTYPE_NAMES.get(dtype)
    if name is None:
        name = _DTYPE_NAMES[dtype] = str(dtype).removeprefix("torch.")
    return name


class Call(NamedTuple):
    """What one call's inputs say: the key's specs, the device, and two layout facts.

    A named tuple, not a dataclass: it is built on every call, hits included.
    """

    specs: KeySpecs
    device: torch.device | None
    """The first tensor's device (None: no tensor input)."""
    mixed: bool
    """Inputs on more than one device."""
    strided: bool
    """Every tensor input has the strided layout."""


def examine(name: str, inputs: tuple[Any, ...]) -> Call:
    """Read the inputs of one call of adapter ``name``.

    Raises:
        TypeError: an input is neither a tensor nor None.
    """
    device: torch.device | None = None
    mixed = False
    strided = True
    specs: list[tuple[torch.Size, torch.dtype] | None] = []
    for index, x in enumerate(inputs):
        if x is None:
            specs.append(None)
            continue
        if not isinstance(x, torch.Tensor):
            raise TypeError(
                f"encoder graph {name!r} takes tensors or None as positional inputs; "
                f"input {index} is a {type(x).__name__}"
            )
        specs.append((x.shape, x.dtype))
        x_device = x.device
        if device is None:
            device = x_device
        elif x_device != device:
            mixed = True
        if x.layout is not torch.strided:
            strided = False
    return Call(tuple(specs), device, mixed, strided)


def ineligible_detail(call: Call, *, enabled: bool, backend: GraphBackend) -> str | None:
    """Name why ``call`` must run eagerly, or return None when it may use a graph.

    Reads the process state a graph depends on (grad mode, autocast, stream capture) but
    changes nothing.
    """
    if not enabled:
        return "disabled"
    device = call.device
    if device is None:
        return "no_tensors"
    if call.mixed:
        return "mixed_devices"
    if not backend.is_graph_device(device):
        return device.type
    if not call.strided:
        return "layout"
    return state_detail(device, backend)


def state_detail(device: torch.device, backend: GraphBackend) -> str | None:
    """The process-state checks alone: grad, autocast on ``device``, a capture in progress."""
    if torch.is_grad_enabled():
        return "grad"
    if torch.is_autocast_enabled(device.type):
        return "autocast"
    if backend.is_capturing(device):
        return "capturing"
    return None


def call_key(inputs: tuple[Any, ...]) -> tuple[torch.device | None, tuple[Any, ...]] | None:
    """Return ``(first device, per-input parts)`` for a key, or None if an input is no tensor.

    Each part is ``(shape, dtype, device, layout)`` or None: everything eligibility depends
    on among the inputs, read once, so equal parts mean equally eligible inputs.
    """
    device = None
    parts: list[Any] = []
    try:
        for x in inputs:
            if x is None:
                parts.append(None)
                continue
            x_device = x.device
            if device is None:
                device = x_device
            parts.append((x.shape, x.dtype, x_device, x.layout))
    except AttributeError:
        return None
    return device, tuple(parts)


def signature_of(inputs: tuple[Any, ...], stream: int | None = None) -> Signature:
    """Return the :class:`~omnitrace.signature.Signature` of a call's inputs (events' data).

    Anything that is not a tensor is recorded as an absent input.
    """
    return Signature(
        tuple(
            InputSpec(_dtype_name(x.dtype), tuple(x.shape), str(x.device))
            if isinstance(x, torch.Tensor)
            else None
            for x in inputs
        ),
        stream,
    )
