"""The typed events every adapter decision produces: frozen, plain-data facts, exactly one hit
or miss per encoder call (docs/architecture.md, "The core", gives their order)."""

from __future__ import annotations

import enum
import time
from collections.abc import Callable
from dataclasses import Field, dataclass, field, fields
from typing import Any, TypeAlias, TypeVar

from omnitrace.signature import Signature

__all__ = [
    "EVENT_TYPES",
    "REQUEST_EVENT_TYPES",
    "CaptureFailed",
    "DeviceTimed",
    "EncoderBatchRan",
    "Event",
    "GraphCaptured",
    "GraphMissed",
    "GraphReplayed",
    "MemoryDeferred",
    "MissReason",
    "NO_SIGNATURE",
    "Phase",
    "ProfilingObserved",
    "RequestTimed",
    "event_fields",
    "fast_constructor",
    "missed",
    "now",
    "profiling_observed",
    "replayed",
]

_E = TypeVar("_E")


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


class Phase(str, enum.Enum):
    """What the engine was doing when an event happened."""

    SERVING = "serving"
    """Requests (the default)."""
    PROFILING = "profiling"
    """vLLM's start-up profiling run: dummy maximum-size inputs, before serving."""
    STARTUP = "startup"
    """After vLLM's warm-up, before serving: graphs prepared for the shapes of an earlier
    run's event logs (``encoder_cuda_graph_prepare_from``)."""

    def __str__(self) -> str:
        return self.value


def now() -> tuple[int, int]:
    """Return ``(monotonic_ns, epoch_ns)`` for an event stamped now."""
    return time.monotonic_ns(), time.time_ns()


@dataclass(frozen=True, slots=True)
class _Keyed:
    """The fields every event starts with, and the signature's text form as ``key``."""

    adapter: str
    """Name of the adapter (encoder) the event is about."""
    signature: Signature
    """The call's inputs and replay stream."""
    monotonic_ns: int
    """``time.monotonic_ns()`` when the event was made."""
    epoch_ns: int
    """``time.time_ns()`` at the same moment (for spans and logs)."""
    phase: Phase = field(default=Phase.SERVING, kw_only=True)
    """What the engine was doing. Keyword-only here, it comes last in every event's
    constructor (after the event's own fields) and in :func:`event_fields`."""

    @property
    def key(self) -> str:
        """The call's signature as text: ``bfloat16[1,1024,1152], None @cuda:0 s=94``."""
        return self.signature.text


@dataclass(frozen=True, slots=True)
class GraphCaptured(_Keyed):
    """A CUDA graph was captured for its signature (the capturing call then counts as a hit).

    Args:
        adapter, signature, monotonic_ns, epoch_ns: the adapter's name, the call's signature
            and the monotonic and epoch clocks when the event was made, in that order.
        duration_s, pool_id, device, stream, capture_stream, bytes_reserved, static_bytes,
            graph_index: then these, positional, each documented on its attribute.
        free_bytes: device-free memory before the capture; default None (not read).
        phase: keyword-only, last; default ``Phase.SERVING``.
    """

    duration_s: float
    """Wall time of warm-up plus capture, on the host."""
    pool_id: int
    """Memory pool the graph was captured into (shared per encoder, device and stream)."""
    device: str
    """Device of the graph, ``cuda:0`` (``cpu`` on the simulated backend)."""
    stream: int
    """Replay stream the graph belongs to (the stream current at the call)."""
    capture_stream: int
    """Side stream the capture ran on."""
    bytes_reserved: int
    """Growth of the device allocator's reserved memory across the capture."""
    static_bytes: int
    """Bytes of the graph's static input and output buffers (outside the pool)."""
    graph_index: int
    """How many graphs the adapter held before this one (0 for the first)."""
    free_bytes: int | None = None
    """Device-free memory read just before the capture (the memory floor's read when
    admission made one for this call); None where it could not be read, and in logs written
    before the field existed. Captured while serving, after vLLM's KV cache took its share,
    this is what the graph had to fit in."""


@dataclass(frozen=True, slots=True)
class GraphReplayed(_Keyed):
    """A call was served by replaying the graph for its signature.

    Args:
        adapter, signature, monotonic_ns, epoch_ns: the adapter's name, the call's signature
            and the monotonic and epoch clocks when the event was made, in that order.
        duration_s: host-side time of the replay.
        phase: keyword-only, last; default ``Phase.SERVING``.
    """

    duration_s: float
    """Host-side time of copy-in, replay launch and output clones."""


@dataclass(frozen=True, slots=True)
class GraphMissed(_Keyed):
    """A call ran the encoder eagerly.

    Args:
        adapter, signature, monotonic_ns, epoch_ns: the adapter's name, the call's signature
            and the monotonic and epoch clocks when the event was made, in that order.
        reason, detail: why no graph served the call, then the finer cause.
        duration_s: host time of the eager forward; default None (not run by the adapter).
        phase: keyword-only, last; default ``Phase.SERVING``.
    """

    reason: MissReason
    """Why no graph served the call."""
    detail: str
    """Finer cause: ``cpu``, ``grad``, ``autocast``, ``capturing``, ``disabled``, ``cap`` ..."""
    duration_s: float | None = None
    """Host time of the eager forward (launch, not device, time); None when the adapter did
    not run it (a model-level fallback recorded with ``record_ineligible``)."""


@dataclass(frozen=True, slots=True)
class MemoryDeferred(_Keyed):
    """Admission wanted to capture its signature but device-free memory was under the floor,
    or (with a pool budget) could not hold what the signature's eager calls took.

    Args:
        adapter, signature, monotonic_ns, epoch_ns: the adapter's name, the call's signature
            and the monotonic and epoch clocks when the event was made, in that order.
        free_bytes, floor_bytes, device: then these, positional, as on the attributes.
        cached_bytes: the allocator's cached bytes; default None (not read).
        need_bytes: what the eager calls took, when that deferred it; default None.
        phase: keyword-only, last; default ``Phase.SERVING``.
    """

    free_bytes: int
    """Device-free memory when admission looked."""
    floor_bytes: int
    """The floor a capture must leave free (``min_free_bytes``)."""
    device: str
    """Device whose memory was read."""
    cached_bytes: int | None = None
    """Memory this process's caching allocator held on the device without a tensor in it
    (reserved, not allocated): the engine's next allocations reuse it, a new graph pool
    cannot. None where the backend could not read it, and in logs written before the field
    existed."""
    need_bytes: int | None = None
    """What the signature's eager calls allocated at their peak (the least of their figures;
    an upper bound where a call did not raise the allocator's peak), when that, more than
    device-free memory holds with an eighth to spare, deferred the capture (the miss detail
    ``need``); None when the floor deferred it, and in logs written before the field
    existed."""


@dataclass(frozen=True, slots=True)
class CaptureFailed(_Keyed):
    """Capturing its signature raised; the adapter is terminal from now on.

    Args:
        adapter, signature, monotonic_ns, epoch_ns: the adapter's name, the call's signature
            and the monotonic and epoch clocks when the event was made, in that order.
        error_type, message, device, stream: then these, positional, as on the attributes.
        phase: keyword-only, last; default ``Phase.SERVING``.
    """

    error_type: str
    """Class name of the exception the capture raised."""
    message: str
    """First line of the exception's message, at most 300 characters (the cut counted as
    ``... [+N chars]``), tensor and array contents replaced with ``...``: it goes to logs,
    spans and event logs, and the exception may carry model values."""
    device: str
    """Device the capture ran on."""
    stream: int
    """Replay stream of the failed capture."""


@dataclass(frozen=True, slots=True)
class DeviceTimed(_Keyed):
    """The device time of one call, measured with CUDA events and resolved after it ran.

    Emitted only with ``device_timing`` on, after the call's GraphReplayed or GraphMissed,
    once the device finished the work; not a call of its own (stats ignore it).
    """

    kind: str
    """``"replay"`` or ``"eager"``."""
    device_s: float
    """Seconds between the events recorded before and after the call on its stream."""


#: The signature of an event that is about an encoder, not one of its calls: no inputs.
NO_SIGNATURE = Signature(())


@dataclass(frozen=True, slots=True)
class ProfilingObserved(_Keyed):
    """An engine's start-up profiling run finished; it called this encoder ``encoder_calls``
    times.

    Emitted by the vLLM plugin after every profiling run it wraps, once per attached
    adapter, in the ``profiling`` phase. Not a call (stats ignore it) and about no input:
    its signature is :data:`NO_SIGNATURE` (``key`` is empty). ``encoder_calls == 0`` means
    the run profiled the engine's memory without this encoder, so the encoder's graphs are
    first captured while serving, after the KV cache took its memory.
    """

    runner: str
    """Qualified name of the profiling method that ran
    (``vllm.v1.worker.gpu.model_runner.GPUModelRunner.profile_run``)."""
    encoder_calls: int
    """Calls of this encoder during the run (hits and misses, skipped-profiling ones too)."""


@dataclass(frozen=True, slots=True)
class RequestTimed(_Keyed):
    """One served request reached its first token: the timestamps taken on its way.

    Emitted by the vLLM plugin in the process that sees the first token (vLLM's API server
    in ``vllm serve``, the engine's own process offline), once per request, with an empty
    ``adapter`` and :data:`NO_SIGNATURE`. Every ``*_ns`` field is ``time.monotonic_ns()`` of
    one host (CLOCK_MONOTONIC, shared by vLLM's processes there), or None where that point
    was not observed (offline there is no HTTP arrival; without vLLM's request stats no
    engine-core timestamps). ``monotonic_ns`` is when the first token was seen.
    """

    request_id: str
    """The request id clients and vLLM's own ``llm_request`` span show."""
    engine_request_id: str
    """The id the engine core and the workers know the request by (the join key)."""
    arrival_ns: int
    """The request arrived: the HTTP request's headers reached the server, else vLLM's own
    arrival time."""
    render_ns: int | None
    """vLLM's renderer started: chat template, media fetch and decode."""
    processor_ns: int | None
    """The model's multimodal processor started (after rendering and tokenising)."""
    processed_ns: int | None
    """The processor finished; the request goes to the engine core."""
    queued_ns: int | None
    """The engine core queued the request (vLLM's QUEUED event)."""
    scheduled_ns: int | None
    """The scheduler first scheduled it (vLLM's SCHEDULED event)."""
    first_token_ns: int | None
    """The engine core produced its first token."""
    ttft_s: float
    """Arrival to the first token seen here."""
    images: int
    """Image items of the request."""
    image_pixels: int
    """Pixels of its images, summed (0 where not known)."""
    audios: int
    """Audio items of the request."""
    audio_s: float
    """Seconds of its audio, summed (0 where not known)."""
    trace_id: str
    """The W3C trace id of the request's ``traceparent`` header ('' without one)."""
    parent_span_id: str
    """The span id of that header ('' without one)."""


@dataclass(frozen=True, slots=True)
class EncoderBatchRan(_Keyed):
    """The engine ran its encoder step for the multimodal items of one or more requests.

    Emitted by the vLLM plugin in the worker after vLLM's model runner encoded the items
    scheduled in one step (empty ``adapter``, :data:`NO_SIGNATURE`; ``monotonic_ns`` is when
    the step ended). The encoder calls of the step are the calls of the same process whose
    events fall between ``start_ns`` and ``monotonic_ns``; :mod:`omnitrace.requests`
    attributes them to the requests by their items' tokens.
    """

    start_ns: int
    """``time.monotonic_ns()`` when the step started."""
    request_ids: tuple[str, ...]
    """The engine request ids the step encoded items of, in the engine's order."""
    request_tokens: tuple[int, ...]
    """Embedding tokens of each request's items in this step (same order)."""
    modalities: tuple[str, ...]
    """The modalities of each request's items in this step, ``+``-joined (same order)."""


Event: TypeAlias = (
    GraphCaptured
    | GraphReplayed
    | GraphMissed
    | MemoryDeferred
    | CaptureFailed
    | DeviceTimed
    | ProfilingObserved
    | RequestTimed
    | EncoderBatchRan
)

EVENT_TYPES: tuple[type[Event], ...] = (
    GraphCaptured,
    GraphReplayed,
    GraphMissed,
    MemoryDeferred,
    CaptureFailed,
    DeviceTimed,
    ProfilingObserved,
    RequestTimed,
    EncoderBatchRan,
)

#: The event types about requests rather than one adapter: the adapter folds skip them.
REQUEST_EVENT_TYPES: frozenset[type[Event]] = frozenset({RequestTimed, EncoderBatchRan})


def profiling_observed(adapter: str, runner: str, encoder_calls: int) -> ProfilingObserved:
    """Return a ProfilingObserved of ``adapter`` stamped now, in the profiling phase."""
    monotonic_ns, epoch_ns = now()
    return ProfilingObserved(
        adapter,
        NO_SIGNATURE,
        monotonic_ns,
        epoch_ns,
        runner,
        encoder_calls,
        phase=Phase.PROFILING,
    )


def event_fields(cls: type[Any]) -> tuple[Field[Any], ...]:
    """Return an event class's fields in constructor order: its positional fields, then
    the keyword-only ones (``phase``), as event logs write them."""
    every = fields(cls)
    return tuple(f for f in every if not f.kw_only) + tuple(f for f in every if f.kw_only)


def fast_constructor(cls: type[_E]) -> Callable[..., _E]:
    """Build ``cls`` from all its fields positionally, without dataclass __init__'s cost.

    A frozen dataclass's __init__ sets each field with ``object.__setattr__``; the slot
    descriptors set them at half the cost. The result is the same frozen event (equal,
    hashable, immutable). For the adapter's per-call events only.
    """
    names = [f.name for f in event_fields(cls)]
    namespace: dict[str, Any] = {"_new": object.__new__, "_cls": cls}
    namespace.update({f"_set_{n}": getattr(cls, n).__set__ for n in names})
    body = "".join(f"    _set_{n}(event, {n})\n" for n in names)
    # The source is built from the class's own field names only.
    exec(
        f"def make({', '.join(names)}):\n    event = _new(_cls)\n{body}    return event\n",
        namespace,
    )
    maker: Callable[..., _E] = namespace["make"]
    return maker


#: ``replayed(adapter, signature, monotonic_ns, epoch_ns, duration_s, phase)``: a
#: GraphReplayed built for the hit path (all fields, positional).
replayed = fast_constructor(GraphReplayed)
#: ``missed(adapter, signature, monotonic_ns, epoch_ns, reason, detail, duration_s, phase)``.
missed = fast_constructor(GraphMissed)
