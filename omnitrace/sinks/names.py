"""Every telemetry name omnitrace exports, in one place.

Dashboards, alert rules and the README table are generated from or checked against this
module, so a rename here that is not carried through fails CI.
"""

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
    DTYPE = "omnitrace.graph.dtype"
    """Distinct dtypes of the key's tensor inputs, in input order, comma-separated."""
    SHAPES = "omnitrace.graph.shapes"
    """One ``[d0,d1,...]`` (or ``None``) per positional input, parsed from the key text."""
    PHASE = "omnitrace.phase"
    """``serving``, or ``profiling`` during vLLM's start-up profiling run."""
    CALL_KIND = "omnitrace.call.kind"
    """``replay`` (a hit) or ``eager`` (a miss the adapter ran)."""
    ERROR_TYPE = "error.type"  # OTel semantic convention
    EXCEPTION_TYPE = "exception.type"  # OTel semantic convention (exception event)
    EXCEPTION_MESSAGE = "exception.message"  # OTel semantic convention (exception event)
    # Resource attributes (not per span or metric point): which worker of a distributed job.
    SERVICE_NAME = "service.name"
    PROCESS_PID = "process.pid"
    RANK = "omnitrace.worker.rank"
    LOCAL_RANK = "omnitrace.worker.local_rank"


class SPANS:
    """Span names."""

    CAPTURE = "omnitrace.graph.capture"
    MEMORY_DEFERRAL = "omnitrace.graph.memory_deferral"
    CAPTURE_FAILURE = "omnitrace.graph.capture"  # same operation, ERROR status
    EXCEPTION_EVENT = "exception"  # span event name the OTel semantic conventions fix


# Every counter is an observable counter that reads the bus's folds (stats, and coverage for
# the counts by phase), so its value is the stats' value exactly; the call-time histograms are
# recorded from the events the sink receives. Signatures never become labels. The Prometheus
# names follow the exporter's translation (a unit in braces is an annotation and adds no
# suffix, counters gain _total, seconds gain _seconds, bytes _bytes) and a test scrapes a real
# exporter to hold them to it.
METRICS: dict[str, MetricName] = {
    "hits": MetricName(
        otel="omnitrace.encoder.graph.hits",
        kind="counter",
        unit="{call}",
        description="Encoder calls served by a CUDA graph replay (capturing calls included).",
        attributes=(ATTR.ENCODER,),
        prometheus="omnitrace_encoder_graph_hits_total",
    ),
    "misses": MetricName(
        otel="omnitrace.encoder.graph.misses",
        kind="counter",
        unit="{call}",
        description=(
            "Encoder calls that ran eagerly, by reason "
            f"({', '.join(reason.value for reason in MissReason)})."
        ),
        attributes=(ATTR.ENCODER, ATTR.MISS_REASON),
        prometheus="omnitrace_encoder_graph_misses_total",
    ),
    "captures": MetricName(
        otel="omnitrace.encoder.graph.captures",
        kind="counter",
        unit="{graph}",
        description="CUDA graphs captured.",
        attributes=(ATTR.ENCODER,),
        prometheus="omnitrace_encoder_graph_captures_total",
    ),
    "capture_failures": MetricName(
        otel="omnitrace.encoder.graph.capture_failures",
        kind="counter",
        unit="{failure}",
        description="CUDA graph captures that failed; the adapter is terminal after one.",
        attributes=(ATTR.ENCODER,),
        prometheus="omnitrace_encoder_graph_capture_failures_total",
    ),
    "memory_deferrals": MetricName(
        otel="omnitrace.encoder.graph.memory_deferrals",
        kind="counter",
        unit="{deferral}",
        description="Captures deferred because device-free memory was under the floor.",
        attributes=(ATTR.ENCODER,),
        prometheus="omnitrace_encoder_graph_memory_deferrals_total",
    ),
    "graphs": MetricName(
        otel="omnitrace.encoder.graph.graphs",
        kind="gauge",
        unit="{graph}",
        description="CUDA graphs held by the encoder adapter.",
        attributes=(ATTR.ENCODER,),
        prometheus="omnitrace_encoder_graph_graphs",
    ),
    "max_graphs": MetricName(
        otel="omnitrace.encoder.graph.max_graphs",
        kind="gauge",
        unit="{graph}",
        description="Graph cap of the encoder adapter (max_graphs).",
        attributes=(ATTR.ENCODER,),
        prometheus="omnitrace_encoder_graph_max_graphs",
    ),
    "capture_duration": MetricName(
        otel="omnitrace.encoder.graph.capture.duration",
        kind="histogram",
        unit="s",
        description="Host wall time of warm-up plus capture.",
        attributes=(ATTR.ENCODER,),
        prometheus="omnitrace_encoder_graph_capture_duration_seconds",
    ),
    "phase_calls": MetricName(
        otel="omnitrace.encoder.calls",
        kind="counter",
        unit="{call}",
        description=(
            "Encoder calls by phase (serving, or profiling during vLLM's start-up profiling "
            "run); hits plus misses of each encoder."
        ),
        attributes=(ATTR.ENCODER, ATTR.PHASE),
        prometheus="omnitrace_encoder_calls_total",
    ),
    "phase_captures": MetricName(
        otel="omnitrace.encoder.graph.phase_captures",
        kind="counter",
        unit="{graph}",
        description="CUDA graphs captured, by the phase they were captured in.",
        attributes=(ATTR.ENCODER, ATTR.PHASE),
        prometheus="omnitrace_encoder_graph_phase_captures_total",
    ),
    "pool_memory": MetricName(
        otel="omnitrace.encoder.graph.pool_memory",
        kind="gauge",
        unit="By",
        description=(
            "Device memory the encoder's graphs took at capture: allocator growth across "
            "each capture plus its static input and output buffers."
        ),
        attributes=(ATTR.ENCODER,),
        prometheus="omnitrace_encoder_graph_pool_memory_bytes",
    ),
    "call_duration": MetricName(
        otel="omnitrace.encoder.call.duration",
        kind="histogram",
        unit="s",
        description=(
            "Host time of encoder calls: replays (copy-in, replay launch, clone-out) and the "
            "eager runs of misses, by kind and phase."
        ),
        attributes=(ATTR.ENCODER, ATTR.CALL_KIND, ATTR.PHASE),
        prometheus="omnitrace_encoder_call_duration_seconds",
    ),
    "call_device_duration": MetricName(
        otel="omnitrace.encoder.call.device_duration",
        kind="histogram",
        unit="s",
        description=(
            "Device time of encoder calls (CUDA events, with encoder_cuda_graph_device_timing), "
            "by kind and phase."
        ),
        attributes=(ATTR.ENCODER, ATTR.CALL_KIND, ATTR.PHASE),
        prometheus="omnitrace_encoder_call_device_duration_seconds",
    ),
    "bus_dropped": MetricName(
        otel="omnitrace.bus.dropped",
        kind="counter",
        unit="{event}",
        description="Events a sink lost because its queue was full or it was disabled.",
        attributes=(ATTR.SINK,),
        prometheus="omnitrace_bus_dropped_total",
    ),
}

#: structlog ``event`` names, with the level each is logged at.
LOG_EVENTS: dict[str, str] = {
    "graph_captured": "info",
    "graph_replayed": "debug",
    "graph_missed": "debug",
    "device_timed": "debug",
    "memory_deferred": "warning",
    "capture_failed": "error",
    "graph_summary": "info",
}
