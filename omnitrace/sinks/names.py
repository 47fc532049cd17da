"""Every telemetry name omnitrace exports, in one place.

Dashboards, alert rules and the README table are generated from or checked against this
module, so a rename here that is not carried through fails CI.
"""

from __future__ import annotations

from dataclasses import dataclass

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
    """counter, histogram, gauge (observable) or updowncounter."""
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
    ERROR_TYPE = "error.type"  # OTel semantic convention


class SPANS:
    """Span names."""

    CAPTURE = "omnitrace.graph.capture"
    MEMORY_DEFERRAL = "omnitrace.graph.memory_deferral"
    CAPTURE_FAILURE = "omnitrace.graph.capture"  # same operation, ERROR status


def _metric(
    otel: str, kind: str, unit: str, description: str, attributes: tuple[str, ...], prometheus: str
) -> MetricName:
    return MetricName(otel, kind, unit, description, attributes, prometheus)


METRICS: dict[str, MetricName] = {
    "hits": _metric(
        "omnitrace.encoder.graph.hits", "counter", "{call}",
        "Encoder calls served by a CUDA graph replay (capturing calls included).",
        (ATTR.ENCODER,), "omnitrace_encoder_graph_hits_total",
    ),
    "misses": _metric(
        "omnitrace.encoder.graph.misses", "counter", "{call}",
        "Encoder calls that ran eagerly, by reason (ineligible, capacity, warmup, memory).",
        (ATTR.ENCODER, ATTR.MISS_REASON), "omnitrace_encoder_graph_misses_total",
    ),
    "captures": _metric(
        "omnitrace.encoder.graph.captures", "counter", "{graph}",
        "CUDA graphs captured.",
        (ATTR.ENCODER,), "omnitrace_encoder_graph_captures_total",
    ),
    "capture_failures": _metric(
        "omnitrace.encoder.graph.capture_failures", "counter", "{failure}",
        "CUDA graph captures that failed; the adapter is terminal after one.",
        (ATTR.ENCODER,), "omnitrace_encoder_graph_capture_failures_total",
    ),
    "memory_deferrals": _metric(
        "omnitrace.encoder.graph.memory_deferrals", "counter", "{deferral}",
        "Captures deferred because device-free memory was under the floor.",
        (ATTR.ENCODER,), "omnitrace_encoder_graph_memory_deferrals_total",
    ),
    "graphs": _metric(
        "omnitrace.encoder.graph.graphs", "gauge", "{graph}",
        "CUDA graphs held by the encoder adapter.",
        (ATTR.ENCODER,), "omnitrace_encoder_graph_graphs",
    ),
    "max_graphs": _metric(
        "omnitrace.encoder.graph.max_graphs", "gauge", "{graph}",
        "Graph cap of the encoder adapter (max_graphs).",
        (ATTR.ENCODER,), "omnitrace_encoder_graph_max_graphs",
    ),
    "capture_duration": _metric(
        "omnitrace.encoder.graph.capture.duration", "histogram", "s",
        "Host wall time of warm-up plus capture.",
        (ATTR.ENCODER,), "omnitrace_encoder_graph_capture_duration_seconds",
    ),
    "bus_dropped": _metric(
        "omnitrace.bus.dropped", "counter", "{event}",
        "Events a sink lost because its queue was full or it was disabled.",
        (ATTR.SINK,), "omnitrace_bus_dropped_total",
    ),
}

#: structlog ``event`` names, with the level each is logged at.
LOG_EVENTS: dict[str, str] = {
    "graph_captured": "info",
    "graph_replayed": "debug",
    "graph_missed": "debug",
    "memory_deferred": "warning",
    "capture_failed": "error",
}
