"""The typed events every adapter decision produces.

Events are past-tense facts: frozen, slotted, plain data (numbers, strings, tuples and the
:class:`~omnitrace.signature.Signature` of the call), never tensors or CUDA objects, so a
consumer on another thread or in another process can hold them without keeping device memory
alive. Every event names its adapter and the call's signature; ``event.key`` is the
signature's text form.

Every encoder call produces exactly one :class:`GraphReplayed` (a hit) or one
:class:`GraphMissed` (an eager run). A capture adds :class:`GraphCaptured` before the
capturing call's :class:`GraphReplayed`; a memory deferral adds :class:`MemoryDeferred`
before its :class:`GraphMissed`; a failed capture emits :class:`CaptureFailed` and the call
raises. Calls rejected by a terminal adapter raise without an event.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass
from typing import TypeAlias

from omnitrace.signature import Signature

__all__ = [
    "CaptureFailed",
    "Event",
    "GraphCaptured",
    "GraphMissed",
    "GraphReplayed",
    "MemoryDeferred",
    "MissReason",
    "now",
]


class MissReason(str, enum.Enum):
    """Why a call ran eagerly."""

    INELIGIBLE = "ineligible"
    """The call can never be graphed (CPU, grad, autocast, capturing, ...), or graphs are
    switched off (detail ``disabled``: ``encoder_cuda_graph: false`` or enforce-eager)."""
    CAPACITY = "capacity"
    """The encoder already holds ``max_graphs`` graphs (with ``max_graphs: 0``, every
    eligible call); graphs are never evicted."""
    WARMUP = "warmup"
    """The key has been seen fewer than ``min_capture_calls`` times."""
    MEMORY = "memory"
    """Device-free memory is under ``min_free_bytes``; a later call may try again."""

    def __str__(self) -> str:
        return self.value

    @property
    def stats_key(self) -> str:
        """The ``get_cumulative_stats()`` key counting these misses (``capacity_misses``)."""
        return f"{self.value}_misses"

    @property
    def short(self) -> str:
        """A column heading of at most five letters (``cap``)."""
        return _MISS_DISPLAY[self][1]

    @property
    def loses_coverage(self) -> bool:
        """Whether a count above zero is worth an operator's attention (all but warm-up)."""
        return self is not MissReason.WARMUP

    @classmethod
    def display_order(cls) -> tuple[MissReason, ...]:
        """The reasons as tables and panels list them: warm-up (expected) first."""
        return tuple(sorted(cls, key=lambda reason: _MISS_DISPLAY[reason][0]))


# Per reason: its place in tables and panels, and its short heading. Stats keys and the
# enum keep the design note's order (ineligible, capacity, warmup, memory).
_MISS_DISPLAY: dict[MissReason, tuple[int, str]] = {
    MissReason.WARMUP: (0, "warm"),
    MissReason.CAPACITY: (1, "cap"),
    MissReason.MEMORY: (2, "mem"),
    MissReason.INELIGIBLE: (3, "inel"),
}


def now() -> tuple[int, int]:
    """Return ``(monotonic_ns, epoch_ns)`` for an event stamped now."""
    return time.monotonic_ns(), time.time_ns()


class _Keyed:
    """What every event has beside its fields: the signature's text form as ``key``."""

    __slots__ = ()
    signature: Signature

    @property
    def key(self) -> str:
        """The call's signature as text: ``bfloat16[1,1024,1152], None @cuda:0 s=94``."""
        return self.signature.text


@dataclass(frozen=True, slots=True)
class GraphCaptured(_Keyed):
    """A CUDA graph was captured for its signature (the capturing call then counts as a hit)."""

    adapter: str
    signature: Signature
    monotonic_ns: int
    epoch_ns: int
    duration_s: float
    """Wall time of warm-up plus capture, on the host."""
    pool_id: int
    device: str
    stream: int
    """Replay stream the graph belongs to (the stream current at the call)."""
    capture_stream: int
    bytes_reserved: int
    """Growth of the device allocator's reserved memory across the capture."""
    static_bytes: int
    """Bytes of the graph's static input and output buffers (outside the pool)."""
    graph_index: int
    """How many graphs the adapter held before this one (0 for the first)."""


@dataclass(frozen=True, slots=True)
class GraphReplayed(_Keyed):
    """A call was served by replaying the graph for its signature."""

    adapter: str
    signature: Signature
    monotonic_ns: int
    epoch_ns: int
    duration_s: float
    """Host-side time of copy-in, replay launch and output clones."""


@dataclass(frozen=True, slots=True)
class GraphMissed(_Keyed):
    """A call ran the encoder eagerly."""

    adapter: str
    signature: Signature
    monotonic_ns: int
    epoch_ns: int
    reason: MissReason
    detail: str
    """Finer cause: ``cpu``, ``grad``, ``autocast``, ``capturing``, ``disabled``, ``cap`` ..."""


@dataclass(frozen=True, slots=True)
class MemoryDeferred(_Keyed):
    """Admission wanted to capture its signature but device-free memory was under the floor."""

    adapter: str
    signature: Signature
    monotonic_ns: int
    epoch_ns: int
    free_bytes: int
    floor_bytes: int
    device: str


@dataclass(frozen=True, slots=True)
class CaptureFailed(_Keyed):
    """Capturing its signature raised; the adapter is terminal from now on."""

    adapter: str
    signature: Signature
    monotonic_ns: int
    epoch_ns: int
    error_type: str
    message: str
    """First line of the exception's message, at most 300 characters (the cut counted as
    ``... [+N chars]``), tensor and array contents replaced with ``...``: it goes to logs,
    spans and event logs, and the exception may carry model values."""
    device: str
    stream: int


Event: TypeAlias = GraphCaptured | GraphReplayed | GraphMissed | MemoryDeferred | CaptureFailed

EVENT_TYPES: tuple[type[Event], ...] = (
    GraphCaptured,
    GraphReplayed,
    GraphMissed,
    MemoryDeferred,
    CaptureFailed,
)
