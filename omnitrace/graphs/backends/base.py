"""The contract between the adapter and a graph backend."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol, runtime_checkable

import torch

__all__ = [
    "CapturedGraph",
    "GraphBackend",
    "OutputSpec",
    "StaticBuffers",
    "flatten_outputs",
    "unflatten_outputs",
]


@runtime_checkable
class CapturedGraph(Protocol):
    """One captured graph with its static buffers."""

    bytes_reserved: int
    static_bytes: int

    def replay(self, inputs: Sequence[torch.Tensor | None]) -> Any:
        """Copy ``inputs`` into the static inputs, replay, and return cloned outputs."""
        ...


@runtime_checkable
class GraphBackend(Protocol):
    """Captures and replays graphs for one kind of device.

    The adapter owns every policy decision; a backend only answers questions about the
    device and does the capture it is told to do.
    """

    name: str
    simulated: bool

    def is_graph_device(self, device: torch.device) -> bool:
        """Whether tensors on ``device`` can be graphed at all."""
        ...

    def is_capturing(self, device: torch.device) -> bool:
        """Whether the current stream of ``device`` is capturing a graph right now."""
        ...

    def stream_id(self, device: torch.device) -> int:
        """Identify the current (replay) stream of ``device``."""
        ...

    def device_free_bytes(self, device: torch.device) -> int:
        """Device-free memory in bytes, as the driver reports it."""
        ...

    def new_pool(self, device: torch.device) -> Any:
        """Create a graph memory pool handle for ``device``."""
        ...

    def new_capture_stream(self, device: torch.device) -> tuple[Any, int]:
        """Create a side stream for captures on ``device``; return it and its id."""
        ...

    def capture(
        self,
        forward: Callable[..., Any],
        inputs: Sequence[torch.Tensor | None],
        *,
        device: torch.device,
        pool: Any,
        capture_stream: Any,
    ) -> CapturedGraph:
        """Warm up and capture ``forward(*inputs)``; the original exception propagates."""
        ...


# Output trees: a tensor, None, or tuples / lists / dicts of them. The spec is rebuilt
# around cloned leaves on every replay, so it must be cheap and carry no tensors.
OutputSpec = Any


def flatten_outputs(obj: Any) -> tuple[list[torch.Tensor], OutputSpec]:
    """Split an output tree into its tensor leaves and a tensor-free spec.

    Raises:
        TypeError: a leaf is neither a tensor nor None.
    """
    leaves: list[torch.Tensor] = []

    def walk(node: Any, path: str) -> OutputSpec:
        if isinstance(node, torch.Tensor):
            leaves.append(node)
            return 0
        if node is None:
            return None
        if isinstance(node, tuple) and not hasattr(node, "_fields"):
            return ("t", tuple(walk(v, f"{path}[{i}]") for i, v in enumerate(node)))
        if isinstance(node, list):
            return ("l", tuple(walk(v, f"{path}[{i}]") for i, v in enumerate(node)))
        if isinstance(node, dict):
            return ("d", tuple((k, walk(v, f"{path}[{k!r}]")) for k, v in node.items()))
        raise TypeError(
            f"encoder output{path} is a {type(node).__name__}; a graphed encoder must return "
            "tensors, None, or tuples/lists/dicts of them"
        )

    spec = walk(obj, "")
    return leaves, spec


def unflatten_outputs(spec: OutputSpec, leaves: Sequence[torch.Tensor]) -> Any:
    """Rebuild the output tree described by ``spec`` around ``leaves``."""
    if spec == 0 and len(leaves) == 1:
        return leaves[0]
    it = iter(leaves)

    def build(node: OutputSpec) -> Any:
        if node is None:
            return None
        if node == 0:
            return next(it)
        kind, children = node
        if kind == "t":
            return tuple(build(c) for c in children)
        if kind == "l":
            return [build(c) for c in children]
        return {k: build(c) for k, c in children}

    return build(spec)


class StaticBuffers:
    """A graph's static input and output buffers, shared by the backends' graph classes.

    The buffers are ordinary allocations made outside capture (never in the graph pool);
    ``copy_in`` fills the inputs before a replay and ``clone_out`` returns fresh tensors so
    a caller's outputs survive the next replay.
    """

    __slots__ = ("_spec", "_static_inputs", "_static_outputs", "bytes_reserved", "static_bytes")

    def __init__(
        self,
        static_inputs: list[torch.Tensor | None],
        static_outputs: list[torch.Tensor],
        spec: OutputSpec,
        bytes_reserved: int,
    ) -> None:
        self._static_inputs = static_inputs
        self._static_outputs = static_outputs
        self._spec = spec
        self.bytes_reserved = bytes_reserved
        self.static_bytes = sum(t.nbytes for t in static_inputs if t is not None) + sum(
            t.nbytes for t in static_outputs
        )

    def copy_in(self, inputs: Sequence[torch.Tensor | None]) -> None:
        """Copy ``inputs`` into the static inputs (the key guarantees matching shapes)."""
        for static, value in zip(self._static_inputs, inputs, strict=True):
            if static is not None:
                static.copy_(value)  # type: ignore[arg-type]

    def clone_out(self) -> Any:
        """Return clones of the static outputs, in the forward's output structure."""
        return unflatten_outputs(self._spec, [out.clone() for out in self._static_outputs])
