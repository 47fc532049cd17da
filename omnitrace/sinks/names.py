"""Every telemetry name omnitrace exports, in one place: the dashboards and alert rules are
generated from it, and tests hold the code and the docs to it."""

from __future__ import annotations

from dataclasses import dataclass

from omnitrace.events import MissReason

__all__ = [
    "ATTR",
    "LOG_EVENTS",
    "METRICS",
    "SPANS",
    "MetricName",
]

NAMESPACE = "omnitrace"


@dataclass(frozen=True, slots=True)
class MetricName:
    """An OTel instrument and the name the Prometheus exporter gives it."""

    otel: str
    kind: str
    """counter, histogram, gauge (observable) or updowncounter, as Prometheus types it."""
    unit: str
    description: str
    attributes: tuple[str, ...]
    prometheus: str
    """Series name as Prometheus scrapes it (histograms add _bucket/_sum/_count)."""


class ATTR:
    """Span and metric attribute keys (metric attributes are low-cardinality only)."""

    ENCODER = "omnitrace.encoder"
    MISS_REASON = "omnitrace.miss.reason"
    MISS_DETAIL = "omnitrace.miss.detail"
    SINK = "omnitrace.sink"
    KEY = "omnitrace.graph.key"
    DEVICE = "omnitrace.graph.device"
    STREAM = "omnitrace.graph.stream"
    CAPTURE_STREAM = "omnitrace.graph.capture_stream"
    POOL_ID = "omnitrace.graph.pool_id"
    CAPTURE_DURATION = "omnitrace.graph.capture.duration"
    BYTES_RESERVED = "omnitrace.graph.bytes_reserved"
    STATIC_BYTES = "omnitrace.graph.static_bytes"
    GRAPH_INDEX = "omnitrace.graph.index"
    FREE_BYTES = "omnitrace.memory.free_bytes"
    FLOOR_BYTES = "omnitrace.memory.floor_bytes"
    CACHED_BYTES = "omnitrace.memory.cached_bytes"
    NEED_BYTES = "omnitrace.memory.need_bytes"
    DTYPE = "omnitrace.graph.dtype"
    """Distinct dtypes of the key's tensor inputs, in input order, comma-separated."""
    SHAPES = "omnitrace.graph.shapes"
    """One ``[d0,d1,...]`` (or ``None``) per positional input, parsed from the key text."""
    PROFILING_RUNNER = "omnitrace.profiling.runner"
    """The engine's profiling method that ran (``...GPUModelRunner.profile_run``)."""
    PROFILING_CALLS = "omnitrace.profiling.encoder_calls"
    """Calls of the encoder during that profiling run (0: its memory was not profiled)."""
    PHASE = "omnitrace.phase"
    REQUEST_ID = "gen_ai.request.id"
    REQUEST_KIND = "omnitrace.request.kind"
    REQUEST_PHASE = "omnitrace.request.phase"
    REQUEST_TTFT = "omnitrace.request.ttft"
    REQUEST_ENGINE_ID = "omnitrace.request.engine_id"
    """``serving``, or ``profiling`` during vLLM's start-up profiling run."""
    CALL_KIND = "omnitrace.call.kind"
    """``replay`` (a hit) or ``eager`` (a miss the adapter ran)."""
    ERROR_TYPE = "error.type"  # OTel semantic convention
    EXCEPTION_TYPE = "exception.type"  # OTel semantic convention (exception event)
    EXCEPTION_MESSAGE = "exception.message"  # OTel semantic convention (exception event)
    # Resource attributes (not per span or metric point): which worker of a distributed job.
    SERVICE_NAME = "service.name"
    PROCESS_PID = "process.pid"
    SERVICE_INSTANCE_ID = "service.instance.id"
    RANK = "omnitrace.worker.rank"
    LOCAL_RANK = "omnitrace.worker.local_rank"


class SPANS:
    """Span names."""

    CAPTURE = "omnitrace.graph.capture"
    MEMORY_DEFERRAL = "omnitrace.graph.memory_deferral"
    CAPTURE_FAILURE = "omnitrace.graph.capture"  # same operation, ERROR status
    PROFILING_RUN = "omnitrace.graph.profiling_run"
    """An instant per encoder when the engine's start-up profiling run ended."""
    REQUEST = "omnitrace.request"
    """A served request from its arrival to its first token, in the client's trace."""
    REQUEST_PHASE = "omnitrace.request.phase"
    """One phase of a request (a child of its request span)."""
    EXCEPTION_EVENT = "exception"  # span event name the OTel semantic conventions fix


# Every counter is an observable counter that reads the bus's folds (stats, and coverage for
# the counts by phase), so its value is the stats' value exactly; the call-time histograms are
# recorded from the events the sink receives. Signatures never become labels. The Prometheus
# names follow the exporter's translation (a unit in braces is an annotation and adds no
# suffix, counters gain _total, seconds gain _seconds, bytes _bytes) and a test scrapes a real
# exporter to hold them to it.
_UNIT_SUFFIXES = {"s": "_seconds", "By": "_bytes"}

_ENCODER = (ATTR.ENCODER,)
_BY_REASON = (ATTR.ENCODER, ATTR.MISS_REASON)
_BY_PHASE = (ATTR.ENCODER, ATTR.PHASE)
_BY_CALL = (ATTR.ENCODER, ATTR.CALL_KIND, ATTR.PHASE)

#: Each metric's OTel name, kind, unit and attributes, by its key in :data:`METRICS`.
_INSTRUMENTS: dict[str, tuple[str, str, str, tuple[str, ...]]] = {
    "hits": ("omnitrace.encoder.graph.hits", "counter", "{call}", _ENCODER),
    "misses": ("omnitrace.encoder.graph.misses", "counter", "{call}", _BY_REASON),
    "captures": ("omnitrace.encoder.graph.captures", "counter", "{graph}", _ENCODER),
    "capture_failures": (
        "omnitrace.encoder.graph.capture_failures",
        "counter",
        "{failure}",
        _ENCODER,
    ),
    "memory_deferrals": (
        "omnitrace.encoder.graph.memory_deferrals",
        "counter",
        "{deferral}",
        _ENCODER,
    ),
    "graphs": ("omnitrace.encoder.graph.graphs", "gauge", "{graph}", _ENCODER),
    "max_graphs": ("omnitrace.encoder.graph.max_graphs", "gauge", "{graph}", _ENCODER),
    "capture_duration": ("omnitrace.encoder.graph.capture.duration", "histogram", "s", _ENCODER),
    "phase_calls": ("omnitrace.encoder.calls", "counter", "{call}", _BY_PHASE),
    "phase_captures": ("omnitrace.encoder.graph.phase_captures", "counter", "{graph}", _BY_PHASE),
    "pool_memory": ("omnitrace.encoder.graph.pool_memory", "gauge", "By", _ENCODER),
    "call_duration": ("omnitrace.encoder.call.duration", "histogram", "s", _BY_CALL),
    "call_device_duration": ("omnitrace.encoder.call.device_duration", "histogram", "s", _BY_CALL),
    "bus_dropped": ("omnitrace.bus.dropped", "counter", "{event}", (ATTR.SINK,)),
    "request_phase_duration": (
        "omnitrace.request.phase.duration",
        "histogram",
        "s",
        (ATTR.REQUEST_KIND, ATTR.REQUEST_PHASE),
    ),
}

#: Each metric's description, by its key in :data:`METRICS`.
_DESCRIPTIONS: dict[str, str] = {
    "hits": "Encoder calls served by a CUDA graph replay (capturing calls included).",
    "misses": (
        "Encoder calls that ran eagerly, by reason "
        f"({', '.join(reason.value for reason in MissReason)})."
    ),
    "captures": "CUDA graphs captured.",
    "capture_failures": "CUDA graph captures that failed; the adapter is terminal after one.",
    "memory_deferrals": "Captures deferred because device-free memory was under the floor.",
    "graphs": "CUDA graphs held by the encoder adapter.",
    "max_graphs": "Graph cap of the encoder adapter (max_graphs).",
    "capture_duration": "Host wall time of warm-up plus capture.",
    "phase_calls": (
        "Encoder calls by phase (serving, or profiling during vLLM's start-up profiling "
        "run); hits plus misses of each encoder."
    ),
    "phase_captures": "CUDA graphs captured, by the phase they were captured in.",
    "pool_memory": (
        "Device memory the encoder's graphs took at capture: allocator growth across "
        "each capture plus its static input and output buffers."
    ),
    "call_duration": (
        "Host time of encoder calls: replays (copy-in, replay launch, clone-out) and the "
        "eager runs of misses, by kind and phase."
    ),
    "call_device_duration": (
        "Device time of encoder calls (CUDA events, with encoder_cuda_graph_device_timing), "
        "by kind and phase."
    ),
    "bus_dropped": "Events a sink lost because its queue was full or it was disabled.",
    "request_phase_duration": (
        "Time each request spent in each phase from its arrival to its first token (vLLM "
        "plugin, API server; every phase recorded once per request, so a phase's sum over "
        "all phases' sum is its share of TTFT); encoder steps are inside prefill here."
    ),
}


def _metric(key: str) -> MetricName:
    otel, kind, unit, attributes = _INSTRUMENTS[key]
    suffix = _UNIT_SUFFIXES.get(unit, "") + ("_total" if kind == "counter" else "")
    prometheus = otel.replace(".", "_") + suffix
    return MetricName(otel, kind, unit, _DESCRIPTIONS[key], attributes, prometheus)


METRICS: dict[str, MetricName] = {key: _metric(key) for key in _INSTRUMENTS}

#: structlog ``event`` names, with the level each is logged at.
LOG_EVENTS: dict[str, str] = {
    "graph_captured": "info",
    "graph_replayed": "debug",
    "graph_missed": "debug",
    "device_timed": "debug",
    "memory_deferred": "warning",
    "capture_failed": "error",
    "profiling_observed": "info",
    "request_timed": "debug",
    "encoder_batch_ran": "debug",
    "graph_summary": "info",
}
