"""OpenTelemetry sink: spans for captures, deferrals and failures; metrics from the stats fold.

Two halves, split the way OpenTelemetry splits library and application code:

* :class:`OTelSink` is library code. It uses only the OTel *API* (a tracer and a meter from
  the providers it is given, or the global ones), so it works with any SDK or vendor
  distribution the host has wired, and costs nothing but no-op calls when none is.
* :func:`configure_sdk` is the app-edge helper. It imports the SDK and the exporters (OTLP
  over http/protobuf or gRPC, Prometheus) only when called, and returns an
  :class:`OTelSetup` that owns their shutdown.

Spans are created after the fact on the sink's worker thread, with the explicit start and end
times the events carry: nothing here runs on the encoder's hot path. Counters and gauges are
observable instruments that read ``bus.adapter_stats()``, so every exported number equals the
stats fold exactly, including events a full sink queue dropped.

Export problems never reach the host: a failing exporter is counted and reported once on the
``omnitrace.otel`` logger (and again only after it has recovered and failed anew), exporter
timeouts are short, and shutdown skips further attempts against an endpoint already known dead.
"""

from __future__ import annotations

import functools
import logging
import os
import re
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Literal

from opentelemetry import context as otel_context
from opentelemetry import metrics as otel_metrics
from opentelemetry import trace as otel_trace
from opentelemetry.metrics import CallbackOptions, Observation
from opentelemetry.trace import SpanKind, Status, StatusCode

from omnitrace.events import (
    CaptureFailed,
    Event,
    GraphCaptured,
    MemoryDeferred,
    MissReason,
)
from omnitrace.sinks.names import ATTR, METRICS, SPANS

if TYPE_CHECKING:
    from opentelemetry.sdk.metrics import MeterProvider as SDKMeterProvider
    from opentelemetry.sdk.trace import TracerProvider as SDKTracerProvider
    from prometheus_client import CollectorRegistry

    from omnitrace.bus import EventBus
    from omnitrace.stats import AdapterStats

__all__ = [
    "CAPTURE_DURATION_BUCKETS",
    "OTLPProtocol",
    "OTelSetup",
    "OTelSink",
    "configure_sdk",
]

logger = logging.getLogger("omnitrace.otel")

OTLPProtocol = Literal["http/protobuf", "grpc"]
_PROTOCOLS: tuple[str, ...] = ("http/protobuf", "grpc")
_DEFAULT_ENDPOINTS = {"http/protobuf": "http://localhost:4318", "grpc": "http://localhost:4317"}

#: Bucket bounds (seconds) of the capture-duration histogram. The SDK's default bounds are
#: sized for milliseconds and would put every capture (tens of ms to seconds) in one bucket.
CAPTURE_DURATION_BUCKETS: tuple[float, ...] = (
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
)

_SCOPE = "omnitrace"
# An empty context: spans made after the fact must be roots, never children of whatever span
# happens to be current on the worker thread.
_ROOT_CONTEXT = otel_context.Context()
_KEY_PART = re.compile(r"(?P<dtype>\w+)\[(?P<shape>[0-9,]*)\]")


def _scope_version() -> str:
    from omnitrace import __version__

    return __version__


@functools.lru_cache(maxsize=1024)
def _key_inputs(key: str) -> tuple[str, tuple[str, ...]] | None:
    """Parse ``describe_key`` text into ``(dtypes, shapes)``; None when it is not that format."""
    specs = key.split(" @", 1)[0]
    if not specs:
        return None
    dtypes: list[str] = []
    shapes: list[str] = []
    for part in specs.split(", "):
        if part == "None":
            shapes.append("None")
            continue
        match = _KEY_PART.fullmatch(part)
        if match is None:
            return None
        if match["dtype"] not in dtypes:
            dtypes.append(match["dtype"])
        shapes.append(f"[{match['shape']}]")
    return ",".join(dtypes), tuple(shapes)


def _key_attributes(key: str) -> dict[str, str | tuple[str, ...]]:
    attributes: dict[str, str | tuple[str, ...]] = {ATTR.KEY: key}
    parsed = _key_inputs(key)
    if parsed is not None:
        dtype, shapes = parsed
        if dtype:
            attributes[ATTR.DTYPE] = dtype
        attributes[ATTR.SHAPES] = shapes
    return attributes


class _ReportOnce:
    """Log the first problem of a kind, count every one; never raise."""

    __slots__ = ("_lock", "_reported", "count")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._reported = False
        self.count = 0

    def __call__(self, message: str, *args: object) -> None:
        with self._lock:
            self.count += 1
            first = not self._reported
            self._reported = True
        if first:
            logger.error(message + " (reported once; later errors are only counted)", *args)


class OTelSink:
    """Turn omnitrace events into OpenTelemetry spans and metrics (API only).

    Attach it with ``bus.add_sink(OTelSink(bus))``. Spans: one per capture
    (``omnitrace.graph.capture``, from the capture's start to its end), one per memory
    deferral, and an ERROR span with an ``exception`` event per capture failure. Metrics:
    observable counters and gauges that read ``bus.adapter_stats()``, ``bus.adapters()`` and
    ``bus.statistics()`` at each collection, plus the capture-duration histogram. Create one
    per bus and meter provider: a second one would report every counter twice.

    Args:
        bus: the bus whose stats the metrics read (the sink still has to be added to it).
        tracer_provider: where spans go; the global tracer provider by default.
        meter_provider: where metrics go; the global meter provider by default.
        name: the sink's name in bus statistics (and in ``omnitrace.bus.dropped``).
    """

    def __init__(
        self,
        bus: EventBus,
        *,
        tracer_provider: otel_trace.TracerProvider | None = None,
        meter_provider: otel_metrics.MeterProvider | None = None,
        name: str = "otel",
    ) -> None:
        if tracer_provider is None:
            tracer_provider = otel_trace.get_tracer_provider()
        if meter_provider is None:
            meter_provider = otel_metrics.get_meter_provider()
        self.name = name
        self._bus = bus
        version = _scope_version()
        self._tracer = tracer_provider.get_tracer(_SCOPE, version)
        meter = meter_provider.get_meter(_SCOPE, version)
        self._lock = threading.Lock()
        self._histogrammed: dict[str, int] = {}
        self._errors = _ReportOnce()
        self._spans = 0

        def observable(
            key: str, read: Callable[[], Iterable[Observation]]
        ) -> list[Callable[[CallbackOptions], Iterable[Observation]]]:
            return [self._safe_callback(key, read)]

        for key, read in (
            ("hits", self._observe_hits),
            ("misses", self._observe_misses),
            ("captures", self._observe_captures),
            ("capture_failures", self._observe_failures),
            ("memory_deferrals", self._observe_deferrals),
            ("bus_dropped", self._observe_dropped),
        ):
            spec = METRICS[key]
            meter.create_observable_counter(
                spec.otel, observable(key, read), unit=spec.unit, description=spec.description
            )
        for key, read in (("graphs", self._observe_graphs), ("max_graphs", self._observe_cap)):
            spec = METRICS[key]
            meter.create_observable_gauge(
                spec.otel, observable(key, read), unit=spec.unit, description=spec.description
            )
        spec = METRICS["capture_duration"]
        self._capture_duration = meter.create_histogram(
            spec.otel,
            unit=spec.unit,
            description=spec.description,
            explicit_bucket_boundaries_advisory=CAPTURE_DURATION_BUCKETS,
        )

    # -- introspection --------------------------------------------------------------------

    @property
    def spans(self) -> int:
        """Spans this sink has ended (handed to the tracer provider)."""
        return self._spans

    @property
    def errors(self) -> int:
        """Events or metric callbacks this sink failed on (each was skipped, none raised)."""
        return self._errors.count

    def __repr__(self) -> str:
        return f"<OTelSink {self.name!r} spans={self._spans} errors={self._errors.count}>"

    # -- Sink protocol --------------------------------------------------------------------

    def handle(self, events: Sequence[Event]) -> None:
        """Make the spans of ``events`` and record new captures in the duration histogram."""
        for event in events:
            try:
                self._span_for(event)
            except Exception as exc:
                self._errors(
                    "OTel sink failed on %s: %s: %s", type(event).__name__, _name(exc), exc
                )
        self._record_capture_durations()

    def close(self) -> None:
        """Record captures not yet in the histogram; the providers stay the app's to shut down."""
        self._record_capture_durations()

    # -- spans ----------------------------------------------------------------------------

    def _span_for(self, event: Event) -> None:
        match event:
            case GraphCaptured():
                attributes: dict[str, Any] = {
                    ATTR.ENCODER: event.adapter,
                    **_key_attributes(event.key),
                    ATTR.DEVICE: event.device,
                    ATTR.STREAM: event.stream,
                    ATTR.CAPTURE_STREAM: event.capture_stream,
                    ATTR.POOL_ID: event.pool_id,
                    ATTR.CAPTURE_DURATION: event.duration_s,
                    ATTR.BYTES_RESERVED: event.bytes_reserved,
                    ATTR.STATIC_BYTES: event.static_bytes,
                    ATTR.GRAPH_INDEX: event.graph_index,
                }
                end_ns = event.epoch_ns + max(0, round(event.duration_s * 1e9))
                self._emit_span(SPANS.CAPTURE, event.epoch_ns, end_ns, attributes)
            case MemoryDeferred():
                attributes = {
                    ATTR.ENCODER: event.adapter,
                    **_key_attributes(event.key),
                    ATTR.DEVICE: event.device,
                    ATTR.FREE_BYTES: event.free_bytes,
                    ATTR.FLOOR_BYTES: event.floor_bytes,
                }
                self._emit_span(SPANS.MEMORY_DEFERRAL, event.epoch_ns, event.epoch_ns, attributes)
            case CaptureFailed():
                # The event marks the moment the capture raised; its start is not recorded,
                # so the failure is an instant on the timeline.
                attributes = {
                    ATTR.ENCODER: event.adapter,
                    **_key_attributes(event.key),
                    ATTR.DEVICE: event.device,
                    ATTR.STREAM: event.stream,
                    ATTR.ERROR_TYPE: event.error_type,
                }
                self._emit_span(
                    SPANS.CAPTURE_FAILURE, event.epoch_ns, event.epoch_ns, attributes, event
                )
            case _:
                # Hits and misses are counters: a span event per replay on a long-lived span
                # would hit the SDK's per-span event cap within seconds of serving.
                pass

    def _emit_span(
        self,
        name: str,
        start_ns: int,
        end_ns: int,
        attributes: Mapping[str, Any],
        failure: CaptureFailed | None = None,
    ) -> None:
        span = self._tracer.start_span(
            name,
            context=_ROOT_CONTEXT,
            kind=SpanKind.INTERNAL,
            attributes=attributes,
            start_time=start_ns,
        )
        if failure is not None:
            span.add_event(
                SPANS.EXCEPTION_EVENT,
                {ATTR.EXCEPTION_TYPE: failure.error_type, ATTR.EXCEPTION_MESSAGE: failure.message},
                timestamp=failure.epoch_ns,
            )
            span.set_status(Status(StatusCode.ERROR, f"{failure.error_type}: {failure.message}"))
        span.end(end_time=end_ns)
        self._spans += 1

    # -- metrics --------------------------------------------------------------------------

    def _record_capture_durations(self) -> None:
        # Read from the stats fold rather than from the events this sink saw, so the
        # histogram's count always equals the captures counter, even after queue drops.
        # Graphs are never evicted, so "graphs past the ones already recorded" is exact.
        try:
            snapshots = self._bus.adapter_stats()
            with self._lock:
                for adapter, stats in snapshots.items():
                    done = self._histogrammed.get(adapter, 0)
                    for graph in stats.graphs[done:]:
                        self._capture_duration.record(graph.duration_s, {ATTR.ENCODER: adapter})
                    self._histogrammed[adapter] = len(stats.graphs)
        except Exception as exc:
            self._errors("OTel sink failed to record capture durations: %s: %s", _name(exc), exc)

    def _safe_callback(
        self, key: str, read: Callable[[], Iterable[Observation]]
    ) -> Callable[[CallbackOptions], Iterable[Observation]]:
        def callback(options: CallbackOptions) -> Iterable[Observation]:
            try:
                return list(read())
            except Exception as exc:
                self._errors("OTel metric %s failed to read the bus: %s: %s", key, _name(exc), exc)
                return []

        return callback

    def _adapters(self) -> Iterator[tuple[str, AdapterStats | None]]:
        # Registered adapters that have not emitted yet still get their zero series, so a
        # dashboard shows them from startup rather than from their first call.
        stats = self._bus.adapter_stats()
        for name in (*stats, *(n for n in self._bus.adapters() if n not in stats)):
            yield name, stats.get(name)

    def _observe_hits(self) -> Iterator[Observation]:
        for name, stats in self._adapters():
            yield Observation(stats.graph_hits if stats else 0, {ATTR.ENCODER: name})

    def _observe_misses(self) -> Iterator[Observation]:
        for name, stats in self._adapters():
            for reason in MissReason:
                value = getattr(stats, f"{reason.value}_misses") if stats else 0
                yield Observation(value, {ATTR.ENCODER: name, ATTR.MISS_REASON: reason.value})

    def _observe_captures(self) -> Iterator[Observation]:
        for name, stats in self._adapters():
            yield Observation(stats.num_graphs if stats else 0, {ATTR.ENCODER: name})

    def _observe_failures(self) -> Iterator[Observation]:
        for name, stats in self._adapters():
            yield Observation(stats.capture_failures if stats else 0, {ATTR.ENCODER: name})

    def _observe_deferrals(self) -> Iterator[Observation]:
        for name, stats in self._adapters():
            yield Observation(stats.memory_deferrals if stats else 0, {ATTR.ENCODER: name})

    def _observe_graphs(self) -> Iterator[Observation]:
        for name, stats in self._adapters():
            yield Observation(stats.num_graphs if stats else 0, {ATTR.ENCODER: name})

    def _observe_cap(self) -> Iterator[Observation]:
        for name, info in self._bus.adapters().items():
            cap = info.get("max_graphs")
            if isinstance(cap, int) and not isinstance(cap, bool):
                yield Observation(cap, {ATTR.ENCODER: name})

    def _observe_dropped(self) -> Iterator[Observation]:
        # Two sinks may share a name; one series per name keeps the attribute set unique.
        dropped: dict[str, int] = {}
        for sink in self._bus.statistics().sinks:
            dropped[sink.name] = dropped.get(sink.name, 0) + sink.dropped
        for sink_name, value in dropped.items():
            yield Observation(value, {ATTR.SINK: sink_name})


def _name(obj: object) -> str:
    return type(obj).__name__


# -- the app edge: SDK, exporters, Prometheus ----------------------------------------------


class _ExportMonitor(logging.Filter):
    """Count export outcomes per signal; report an outage once and its end once.

    Signals are tracked apart because one endpoint may take one and refuse the other (Jaeger
    takes traces, not metrics), but reported together: a dead endpoint fails both, and that
    is one problem for the operator, logged once; the all-clear comes when every signal
    exports again.

    Also a logging filter for the OTLP exporters' own loggers: while an outage is reported,
    their per-attempt errors and retry warnings for the failing signal are suppressed, so a
    dead collector costs the host one log line instead of one per export interval.
    """

    def __init__(self, protocol: str, endpoint: str) -> None:
        super().__init__()
        self.protocol = protocol
        self.endpoint = endpoint
        self._lock = threading.Lock()
        self.failures: dict[str, int] = {"traces": 0, "metrics": 0}
        self.successes: dict[str, int] = {"traces": 0, "metrics": 0}
        self.in_outage: dict[str, bool] = {"traces": False, "metrics": False}
        self.reported = False
        self.closing = False

    def filter(self, record: logging.LogRecord) -> bool:
        if not self.reported:
            return True
        signal = _LOGGER_SIGNALS.get(record.name)
        if signal is None:  # a logger shared by both signals (gRPC)
            return not any(self.in_outage.values())
        return not self.in_outage[signal]

    def skip(self, signal: str) -> bool:
        """Whether to drop a batch without trying: shutting down, and the endpoint is dead."""
        return self.closing and self.in_outage[signal]

    def outcome(self, signal: str, ok: bool, error: str | None = None) -> None:
        with self._lock:
            self.in_outage[signal] = not ok
            if ok:
                self.successes[signal] += 1
            else:
                self.failures[signal] += 1
            report = not ok and not self.reported
            recovered = ok and self.reported and not any(self.in_outage.values())
            if report:
                self.reported = True
            elif recovered:
                self.reported = False
        if report:
            logger.warning(
                "OpenTelemetry %s export to %s (%s) failed%s; telemetry is dropped until the "
                "endpoint recovers. Further failures are counted, not logged.",
                signal,
                self.endpoint,
                self.protocol,
                f": {error}" if error else "",
            )
        elif recovered:
            logger.info("OpenTelemetry export to %s recovered", self.endpoint)


_LOGGER_SIGNALS: Mapping[str, str] = {
    "opentelemetry.exporter.otlp.proto.http.trace_exporter": "traces",
    "opentelemetry.exporter.otlp.proto.http.metric_exporter": "metrics",
}
_EXPORTER_LOGGERS = (
    *_LOGGER_SIGNALS,
    "opentelemetry.exporter.otlp.proto.grpc.exporter",
    "opentelemetry.exporter.otlp.common.http",
)


class OTelSetup:
    """The SDK providers :func:`configure_sdk` built, and their lifecycle.

    Attributes:
        tracer_provider: pass it to :class:`OTelSink` (or install it globally).
        meter_provider: likewise.
        protocol: the OTLP protocol, or None when OTLP export is off.
        endpoint: the OTLP base endpoint, or None when OTLP export is off.
        prometheus_reader: the Prometheus metric reader, if one was asked for.
        prometheus_port: the port the scrape endpoint listens on, if one was started.
    """

    def __init__(
        self,
        *,
        tracer_provider: SDKTracerProvider,
        meter_provider: SDKMeterProvider,
        protocol: str | None,
        endpoint: str | None,
        monitor: _ExportMonitor | None,
        prometheus_reader: Any = None,
        prometheus_server: Any = None,
        prometheus_thread: threading.Thread | None = None,
    ) -> None:
        self.tracer_provider = tracer_provider
        self.meter_provider = meter_provider
        self.protocol = protocol
        self.endpoint = endpoint
        self.prometheus_reader = prometheus_reader
        self._monitor = monitor
        self._server = prometheus_server
        self._server_thread = prometheus_thread
        self._shutdown = False
        self._lock = threading.Lock()

    @property
    def prometheus_port(self) -> int | None:
        return None if self._server is None else int(self._server.server_port)

    @property
    def export_failures(self) -> Mapping[str, int]:
        """Failed OTLP export batches by signal (``traces``, ``metrics``)."""
        return dict(self._monitor.failures) if self._monitor else {"traces": 0, "metrics": 0}

    @property
    def export_successes(self) -> Mapping[str, int]:
        """Successful OTLP export batches by signal."""
        return dict(self._monitor.successes) if self._monitor else {"traces": 0, "metrics": 0}

    def force_flush(self, timeout_s: float = 5.0) -> bool:
        """Export pending spans and collect and export metrics now.

        Returns:
            True when both providers flushed and no export failed meanwhile.
        """
        if self._shutdown:
            return False
        before = sum(self.export_failures.values())
        millis = int(timeout_s * 1000)
        traces = self.tracer_provider.force_flush(millis)
        metrics = self.meter_provider.force_flush(millis)
        return bool(traces and metrics) and sum(self.export_failures.values()) == before

    def shutdown(self, timeout_s: float = 5.0) -> None:
        """Flush what can still be exported, then stop exporters and the scrape endpoint.

        Idempotent; bounded by the exporters' timeouts, and attempts against an endpoint
        already known to be dead are skipped.
        """
        with self._lock:
            if self._shutdown:
                return
            self._shutdown = True
        monitor = self._monitor
        if monitor is not None:
            monitor.closing = True
        try:
            self.tracer_provider.shutdown()
            self.meter_provider.shutdown(timeout_millis=timeout_s * 1000)
        finally:
            if self._server is not None:
                self._server.shutdown()
                self._server.server_close()
                if self._server_thread is not None:
                    self._server_thread.join(timeout_s)
            if monitor is not None:
                for name in _EXPORTER_LOGGERS:
                    logging.getLogger(name).removeFilter(monitor)

    def __enter__(self) -> OTelSetup:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    def __repr__(self) -> str:
        target = f"{self.protocol} {self.endpoint}" if self.endpoint else "no OTLP"
        return f"<OTelSetup {target} prometheus={self.prometheus_reader is not None}>"


def _resource_attributes(
    service_name: str, extra: Mapping[str, str | int | float | bool] | None
) -> dict[str, str | int | float | bool]:
    attributes: dict[str, str | int | float | bool] = {
        ATTR.SERVICE_NAME: service_name,
        ATTR.PROCESS_PID: os.getpid(),
    }
    # torchrun and most launchers export these; they tell the workers of one job apart.
    for variable, key in (("RANK", ATTR.RANK), ("LOCAL_RANK", ATTR.LOCAL_RANK)):
        value = os.environ.get(variable, "").strip()
        if value:
            attributes[key] = int(value) if value.isdigit() else value
    if extra:
        attributes.update(extra)
    return attributes


def _check_positive(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ValueError(f"{name}: expected a positive number of seconds, got {value!r}")
    return float(value)


def configure_sdk(
    *,
    service_name: str = "omnitrace",
    endpoint: str | None = None,
    protocol: OTLPProtocol | None = None,
    otlp: bool = True,
    otlp_metrics: bool = True,
    prometheus: bool = False,
    prometheus_port: int | None = None,
    prometheus_host: str = "127.0.0.1",
    prometheus_registry: CollectorRegistry | None = None,
    export_interval_s: float = 10.0,
    export_timeout_s: float = 3.0,
    resource_attributes: Mapping[str, str | int | float | bool] | None = None,
    install_global: bool = False,
) -> OTelSetup:
    """Wire the OpenTelemetry SDK for omnitrace at the application edge.

    Args:
        service_name: the ``service.name`` resource attribute.
        endpoint: OTLP base endpoint (``http://host:4318`` for http/protobuf,
            ``http://host:4317`` for gRPC). None: the exporters read
            ``OTEL_EXPORTER_OTLP_ENDPOINT`` (and the per-signal variables), then the
            protocol's localhost default.
        protocol: ``"http/protobuf"`` or ``"grpc"``; None reads
            ``OTEL_EXPORTER_OTLP_PROTOCOL``, then defaults to http/protobuf.
        otlp: export over OTLP at all.
        otlp_metrics: also export metrics over OTLP (false for a traces-only backend such
            as a bare Jaeger; scrape the Prometheus endpoint for metrics then).
        prometheus: add a Prometheus metric reader (pull; metrics only).
        prometheus_port: also serve ``/metrics`` on this port (0 picks a free one).
        prometheus_host: address the scrape endpoint binds.
        prometheus_registry: the prometheus_client registry to register with (the global
            one by default).
        export_interval_s: seconds between OTLP metric exports.
        export_timeout_s: deadline of one OTLP export, retries included; short, so a dead
            collector cannot stall shutdown.
        resource_attributes: more resource attributes (override the defaults).
        install_global: also install the providers as the global ones (once per process).

    Returns:
        The providers and their ``force_flush()`` / ``shutdown()``.

    Raises:
        ValueError: an argument is out of range (the message names it).
        ImportError: the gRPC exporter is asked for but not installed (the message says
            which extra to install).
    """
    if protocol is None:
        protocol_text = os.environ.get("OTEL_EXPORTER_OTLP_PROTOCOL", "").strip() or "http/protobuf"
    else:
        protocol_text = protocol
    if protocol_text not in _PROTOCOLS:
        raise ValueError(
            f"protocol: expected one of {', '.join(_PROTOCOLS)}, got {protocol_text!r}"
        )
    interval = _check_positive("export_interval_s", export_interval_s)
    timeout = _check_positive("export_timeout_s", export_timeout_s)
    if prometheus_port is not None and (
        isinstance(prometheus_port, bool)
        or not isinstance(prometheus_port, int)
        or not 0 <= prometheus_port <= 65535
    ):
        raise ValueError(f"prometheus_port: expected a port in [0, 65535], got {prometheus_port!r}")
    if prometheus_port is not None and not prometheus:
        raise ValueError("prometheus_port: set prometheus=True to serve a scrape endpoint")
    if not isinstance(service_name, str) or not service_name:
        raise ValueError(f"service_name: expected a non-empty string, got {service_name!r}")

    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import MetricReader, PeriodicExportingMetricReader
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    resource = Resource.create(_resource_attributes(service_name, resource_attributes))
    # Exporters first (a missing gRPC extra fails here, before anything runs), then the
    # scrape endpoint (a port in use fails there), and only then the threads of the batch
    # processor and the periodic reader, so a failed call leaves nothing running behind.
    monitor: _ExportMonitor | None = None
    span_exporter = metric_exporter = None
    base: str | None = None
    if otlp:
        base = (
            endpoint
            or os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT", "").strip()
            or _DEFAULT_ENDPOINTS[protocol_text]
        )
        monitor = _ExportMonitor(protocol_text, base)
        span_exporter, metric_exporter = _guarded_exporters(
            protocol_text, endpoint, timeout, monitor, metrics=otlp_metrics
        )

    readers: list[MetricReader] = []
    prometheus_reader = server = thread = None
    if prometheus:
        from opentelemetry.exporter.prometheus import PrometheusMetricReader
        from prometheus_client import REGISTRY, start_http_server

        registry = REGISTRY if prometheus_registry is None else prometheus_registry
        prometheus_reader = PrometheusMetricReader(registry=registry)
        readers.append(prometheus_reader)
        if prometheus_port is not None:
            try:
                server, thread = start_http_server(
                    prometheus_port, addr=prometheus_host, registry=registry
                )
            except BaseException:
                prometheus_reader.shutdown()  # unregisters it from the registry
                for exporter in (span_exporter, metric_exporter):
                    if exporter is not None:
                        exporter.shutdown()
                raise

    tracer_provider = TracerProvider(resource=resource)
    if span_exporter is not None:
        tracer_provider.add_span_processor(
            BatchSpanProcessor(
                span_exporter,
                schedule_delay_millis=min(5000.0, interval * 1000),
                export_timeout_millis=timeout * 1000,
            )
        )
    if metric_exporter is not None:
        readers.append(
            PeriodicExportingMetricReader(
                metric_exporter,
                export_interval_millis=interval * 1000,
                export_timeout_millis=timeout * 1000,
            )
        )
    if monitor is not None:
        for name in _EXPORTER_LOGGERS:
            logging.getLogger(name).addFilter(monitor)

    meter_provider = MeterProvider(resource=resource, metric_readers=readers)
    if install_global:
        otel_trace.set_tracer_provider(tracer_provider)
        otel_metrics.set_meter_provider(meter_provider)
    return OTelSetup(
        tracer_provider=tracer_provider,
        meter_provider=meter_provider,
        protocol=protocol_text if otlp else None,
        endpoint=base,
        monitor=monitor,
        prometheus_reader=prometheus_reader,
        prometheus_server=server,
        prometheus_thread=thread,
    )


def _guarded_exporters(
    protocol: str, endpoint: str | None, timeout: float, monitor: _ExportMonitor, *, metrics: bool
) -> tuple[Any, Any | None]:
    """Build the OTLP span and metric exporters, wrapped so they count and never raise."""
    from opentelemetry.sdk.metrics.export import MetricExporter, MetricExportResult, MetricsData
    from opentelemetry.sdk.trace import ReadableSpan
    from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

    inner_spans: SpanExporter
    inner_metrics: MetricExporter | None = None
    if protocol == "grpc":
        try:
            from opentelemetry.exporter.otlp.proto.grpc.metric_exporter import (
                OTLPMetricExporter as GrpcMetricExporter,
            )
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import (
                OTLPSpanExporter as GrpcSpanExporter,
            )
        except ImportError as exc:
            raise ImportError(
                "protocol 'grpc' needs the OTLP gRPC exporter: pip install 'omnitrace[grpc]'"
            ) from exc
        inner_spans = GrpcSpanExporter(endpoint=endpoint, timeout=timeout)
        if metrics:
            inner_metrics = GrpcMetricExporter(endpoint=endpoint, timeout=timeout)
    else:
        from opentelemetry.exporter.otlp.proto.http.metric_exporter import (
            OTLPMetricExporter as HttpMetricExporter,
        )
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import (
            OTLPSpanExporter as HttpSpanExporter,
        )

        def url(path: str) -> str | None:
            return None if endpoint is None else f"{endpoint.rstrip('/')}/{path}"

        inner_spans = HttpSpanExporter(endpoint=url("v1/traces"), timeout=timeout)
        if metrics:
            inner_metrics = HttpMetricExporter(endpoint=url("v1/metrics"), timeout=timeout)

    class GuardedSpanExporter(SpanExporter):
        def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
            if monitor.skip("traces"):
                monitor.outcome("traces", False)
                return SpanExportResult.FAILURE
            try:
                result = inner_spans.export(spans)
            except Exception as exc:
                monitor.outcome("traces", False, f"{_name(exc)}: {exc}")
                return SpanExportResult.FAILURE
            monitor.outcome("traces", result is SpanExportResult.SUCCESS)
            return result

        def shutdown(self) -> None:
            try:
                inner_spans.shutdown()
            except Exception:
                logger.debug("OTLP span exporter raised on shutdown", exc_info=True)

        def force_flush(self, timeout_millis: int = 30000) -> bool:
            return inner_spans.force_flush(timeout_millis)

    if inner_metrics is None:
        return GuardedSpanExporter(), None
    metric_exporter: MetricExporter = inner_metrics

    class GuardedMetricExporter(MetricExporter):
        def __init__(self) -> None:
            super().__init__(
                preferred_temporality=metric_exporter._preferred_temporality,
                preferred_aggregation=metric_exporter._preferred_aggregation,
            )

        def export(
            self, metrics_data: MetricsData, timeout_millis: float = 10_000, **kwargs: Any
        ) -> MetricExportResult:
            if monitor.skip("metrics"):
                monitor.outcome("metrics", False)
                return MetricExportResult.FAILURE
            try:
                result = metric_exporter.export(metrics_data, timeout_millis=timeout_millis)
            except Exception as exc:
                monitor.outcome("metrics", False, f"{_name(exc)}: {exc}")
                return MetricExportResult.FAILURE
            monitor.outcome("metrics", result is MetricExportResult.SUCCESS)
            return result

        def force_flush(self, timeout_millis: float = 10_000) -> bool:
            return metric_exporter.force_flush(timeout_millis=timeout_millis)

        def shutdown(self, timeout_millis: float = 30_000, **kwargs: Any) -> None:
            try:
                metric_exporter.shutdown(timeout_millis=timeout_millis)
            except Exception:
                logger.debug("OTLP metric exporter raised on shutdown", exc_info=True)

    return GuardedSpanExporter(), GuardedMetricExporter()
