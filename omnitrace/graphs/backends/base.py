"""The contract between the adapter and a graph backend, and the capture discipline they share:
no eager work on a capture stream, so every graph owns the memory it touches
(docs/architecture.md, "Graph backends", says why)."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch

from omnitrace.graphs.timing import DeviceClock

__all__ = [
    "CAPTURE_LOCK",
    "CaptureRequest",
    "CapturedGraph",
    "GraphBackend",
    "OutputLayout",
    "OutputSpec",
    "StaticBuffers",
    "capture_ordering",
    "flatten_outputs",
    "static_copies",
    "unflatten_outputs",
    "warm_up",
]


#: One capture at a time in this process, whatever adapter, backend or thread asks. A capture
#: may synchronise the device first (vLLM's manager always does), which would break a capture
#: another thread has under way; PyTorch serialises its own CUDA-graph recordings the same
#: way.
CAPTURE_LOCK = threading.RLock()


@dataclass(frozen=True, slots=True)
class CaptureRequest:
    """What a backend needs to capture one graph."""

    forward: Callable[..., Any]
    """The forward to capture (the encoder, or torch.compile of it)."""
    inputs: Sequence[torch.Tensor | None]
    """The call's inputs; the backend copies them into static buffers."""
    device: torch.device
    pool: Any
    """The memory pool the adapter chose (shared per encoder, device and replay stream)."""
    capture_stream: Any
    capture_error_mode: str = "global"
    """``torch.cuda.graph``'s: ``"thread_local"`` lets other threads keep running CUDA work
    during the capture (background capture)."""
    quiet: bool = False
    """Capture without a device-wide synchronisation first, for background captures, so
    other threads' calls never stall on them (the torch backend honours it; vLLM's manager
    always synchronises). No capture empties the allocators' caches."""
    expandable: bool = False
    """Allocate the capture's pool memory in the caching allocator's expandable segments
    (switched on for the capture alone): a larger capture then reuses what smaller ones
    in the same pool freed. Simulated and non-native allocators ignore it."""
    layout: OutputLayout | None = None
    """The output layout of warm-ups already run for this key (a background preparation):
    the backend skips its own warm-up and sizes the static outputs from it. A backend that
    warms up on its own terms (vLLM's manager) may ignore it."""


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
    error_modes: tuple[str, ...]
    """``torch.cuda.graph`` capture error modes the backend honours, preferred first.
    ``"thread_local"`` lets other threads keep running CUDA work (allocations, syncs) during
    a capture; ``"global"`` makes such work fail in whichever thread does it."""

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

    def warm_up(
        self, forward: Callable[..., Any], inputs: Sequence[torch.Tensor | None]
    ) -> OutputLayout:
        """Run ``forward`` eagerly on the current stream as this backend warms up before a
        capture, and return the output layout (a background preparation's step)."""
        ...

    def capture(self, request: CaptureRequest) -> CapturedGraph:
        """Warm up and capture ``request.forward(*request.inputs)``.

        The current stream is the replay stream: static inputs are copied and the warm-up
        runs there, never on the capture stream. The original exception propagates.
        """
        ...

    def device_clock(self, device: torch.device) -> DeviceClock:
        """Return a clock of markers on ``device``'s timeline, for device timing."""
        ...


def static_copies(inputs: Sequence[torch.Tensor | None]) -> list[torch.Tensor | None]:
    """Copy ``inputs`` into fresh contiguous buffers on the current (replay) stream.

    Called before capture, so the buffers are ordinary allocations outside every graph pool;
    the graph object holds them, and replays copy new inputs into them. They are never
    inference tensors, even under ``torch.inference_mode``: a later call outside inference
    mode (under ``no_grad``) must still be able to copy into them.
    """
    with torch.inference_mode(False):
        return [
            None
            if x is None
            else torch.empty_like(x, memory_format=torch.contiguous_format).copy_(x)
            for x in inputs
        ]


@dataclass(frozen=True, slots=True)
class OutputLayout:
    """What a warm-up tells a capture about the forward's outputs: leaf shapes and dtypes,
    and the tree they form."""

    leaves: tuple[tuple[torch.Size, torch.dtype], ...]
    spec: OutputSpec

    def empty(self, device: torch.device) -> list[torch.Tensor]:
        """Allocate static outputs of this layout on ``device`` (outside inference mode)."""
        with torch.inference_mode(False):
            return [torch.empty(shape, dtype=dtype, device=device) for shape, dtype in self.leaves]

    def check(self, leaves: Sequence[torch.Tensor]) -> None:
        """Raise unless a captured forward returned leaves of this layout."""
        if [(t.shape, t.dtype) for t in leaves] != list(self.leaves):
            raise RuntimeError(
                "encoder returned different outputs during capture than during warm-up "
                f"({len(leaves)} leaves against {len(self.leaves)}, or other shapes or dtypes)"
            )


def _layout(out: Any) -> OutputLayout:
    leaves, spec = flatten_outputs(out)
    return OutputLayout(tuple((t.shape, t.dtype) for t in leaves), spec)


def warm_up(
    forward: Callable[..., Any], inputs: Sequence[torch.Tensor | None], iters: int = 1
) -> OutputLayout:
    """Run ``forward`` eagerly ``iters`` times (at least once) and return its output layout.

    Lazy initialisation and autotuning happen here, outside any capture; run it on the
    replay stream or on a side stream, never on a capture stream (docs/architecture.md,
    "Graph backends: who owns which memory").
    """
    out = None
    for _ in range(max(1, iters)):
        out = forward(*inputs)
    return _layout(out)


@contextlib.contextmanager
def capture_ordering(
    replay_stream: Any,
    capture_stream: Any,
    stream_scope: Callable[[Any], contextlib.AbstractContextManager[Any]],
) -> Iterator[None]:
    """Make ``capture_stream`` current for a capture ordered between replay-stream work.

    On entry the capture stream waits for the replay stream: earlier replays and output
    clones may still read pool memory this capture will reuse, and the static inputs were
    written there. On exit the replay stream is current again (also when the capture
    raised) and, after a capture that succeeded, waits for the capture stream; a failed
    capture's stream is left alone, so nothing masks the original exception. Run warm-ups
    *before* entering: eager work on a capture stream would give it a cuBLAS workspace the
    graph does not own (docs/architecture.md, "Graph backends: who owns which memory").
    """
    capture_stream.wait_stream(replay_stream)
    with stream_scope(capture_stream):
        yield
    replay_stream.wait_stream(capture_stream)


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

    __slots__ = (
        "_single",
        "_spec",
        "_static_inputs",
        "_static_outputs",
        "bytes_reserved",
        "static_bytes",
    )

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
        # One tensor out (the usual encoder): clone it without rebuilding a tree.
        self._single = static_outputs[0] if spec == 0 and len(static_outputs) == 1 else None
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
        single = self._single
        if single is not None:
            return single.clone()
        return unflatten_outputs(self._spec, [out.clone() for out in self._static_outputs])
