"""OpenTelemetry spans and metrics through the SDK: providers, OTLP and Prometheus exporters,
and a sink on them, configured by OpenTelemetry's ``OTEL_*`` variables.

The application edge, apart from the API-only sink (:mod:`omnitrace.sinks.otel`), as
OpenTelemetry keeps its API and SDK packages apart. :func:`configure_sdk` imports the SDK and
the exporters (OTLP over http/protobuf or gRPC, Prometheus) only when called and returns an
:class:`OTelSetup` that owns their shutdown; :func:`sdk_sink` wires them and attaches an
:class:`~omnitrace.sinks.otel.OTelSink` in one call (the vLLM plugin, the demo and replay use
it). Settings follow OpenTelemetry's precedence: an explicit argument, else its standard
variable (``OTEL_SERVICE_NAME``, ``OTEL_RESOURCE_ATTRIBUTES``, ``OTEL_METRIC_EXPORT_INTERVAL``,
``OTEL_BSP_SCHEDULE_DELAY``), else a default.

Export problems never reach the host: a failing exporter is counted and reported once on this
module's logger (and again only after it has recovered and failed anew), exporter timeouts are
short, and shutdown is bounded (0.8 s by default): it skips attempts against an endpoint already
known dead, cancels retry back-offs and abandons an export still waiting.
"""

from __future__ import annotations

import atexit
import logging
import os
import re
import threading
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

from opentelemetry import metrics as otel_metrics
from opentelemetry import trace as otel_trace

from omnitrace._env import env_endpoints, env_seconds
from omnitrace._validate import check_duration, check_endpoint, check_int, check_text
from omnitrace._worker import env_rank
from omnitrace.errors import ConfigError, MissingExtraError
from omnitrace.sinks.names import ATTR
from omnitrace.sinks.otel import (
    _DEFAULT_ENDPOINTS,
    _PROTOCOLS,
    OTelSink,
    OTLPProtocol,
    _name,
)
from omnitrace.sinks.registry import SinkDeclaration, SinkRequest

if TYPE_CHECKING:
    from opentelemetry.sdk.metrics import MeterProvider as SDKMeterProvider
    from opentelemetry.sdk.trace import TracerProvider as SDKTracerProvider
    from prometheus_client import CollectorRegistry

    from omnitrace.bus import EventBus

__all__ = ["OTelSetup", "SdkSink", "configure_sdk", "sdk_sink"]

logger = logging.getLogger(__name__)


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
        self.causes: dict[str, str] = {}
        self.reported = False
        self.closing = False
        self.unfinished: float | None = None
        """The shutdown deadline (s) an export was still running at, if one was."""
        #: The exporters by signal, shut down to cancel a retry once the host is closing.
        self.exporters: dict[str, Any] = {}

    def filter(self, record: logging.LogRecord) -> bool:
        # Every failure reaches the host as this monitor's own report, so the exporters'
        # per-attempt lines ("Transient error ... retrying") are kept only as the cause.
        signal = _LOGGER_SIGNALS.get(record.name, "any")
        if record.levelno >= logging.WARNING:
            with self._lock:
                self.causes.setdefault(signal, _cause(record.getMessage()))
        if self.closing and "retrying" in str(record.msg):
            # Waiting out a back-off at exit only delays it: the exporter's shutdown ends
            # the wait, and the batch is reported as failed.
            for name, exporter in self.exporters.items():
                if signal in (name, "any"):
                    exporter.shutdown()
        return False

    def skip(self, signal: str) -> bool:
        """Whether to drop a batch without trying: shutting down, and the endpoint is dead."""
        return self.closing and self.in_outage[signal]

    def error(self) -> str | None:
        """One line saying what failed and where, or None when every export succeeded."""
        with self._lock:
            failed = [signal for signal, count in self.failures.items() if count]
            if not failed and self.unfinished is None:
                return None
            signals = failed or [s for s in ("traces", "metrics") if s in self.causes]
            parts = []
            for signal in signals:
                cause = self.causes.get(signal) or self.causes.get("any")
                parts.append(f"{signal}: {cause}" if cause else signal)
            if not parts:
                parts.append(
                    self.causes.get("any")
                    or f"no answer within {self.unfinished:g} s, the shutdown deadline"
                )
        return f"OTLP export to {self.endpoint} ({self.protocol}) failed: {', '.join(parts)}"

    def outcome(self, signal: str, ok: bool, error: str | None = None) -> None:
        with self._lock:
            self.in_outage[signal] = not ok
            if ok:
                self.successes[signal] += 1
            else:
                self.failures[signal] += 1
                if error:
                    self.causes.setdefault(signal, _cause(error))
            report = not ok and not self.reported
            recovered = ok and self.reported and not any(self.in_outage.values())
            if report:
                self.reported = True
            elif recovered:
                self.reported = False
                self.causes.clear()
            cause = self.causes.get(signal) or self.causes.get("any")
        if report:
            logger.warning(
                "OpenTelemetry %s export to %s (%s) failed%s; telemetry is dropped until the "
                "endpoint recovers. Further failures are counted, not logged.",
                signal,
                self.endpoint,
                self.protocol,
                f": {cause}" if cause else "",
            )
        elif recovered:
            logger.info("OpenTelemetry export to %s recovered", self.endpoint)


_ERRNO = re.compile(r"\[Errno -?\d+\] ([^'\")\]]+)")
_HTTP_STATUS = re.compile(r"code: (\d{3}), reason: ([^,]+)")
_GRPC_STATUS = re.compile(r"StatusCode\.([A-Z_]+)")


def _cause(message: str) -> str:
    """Return the gist of an exporter's error text ("Connection refused", "HTTP 404 ...")."""
    if match := _ERRNO.search(message):
        return match[1].strip()
    if match := _HTTP_STATUS.search(message):
        return f"HTTP {match[1]} {match[2].strip()}"
    if match := _GRPC_STATUS.search(message):
        return f"gRPC {match[1]}"
    if "timed out" in message.lower() or "timeout" in message.lower():
        return "timed out"
    return message if len(message) <= 120 else message[:119] + "…"


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
        exporters: Sequence[Any] = (),
    ) -> None:
        self.tracer_provider = tracer_provider
        self.meter_provider = meter_provider
        self.protocol = protocol
        self.endpoint = endpoint
        self.prometheus_reader = prometheus_reader
        self._monitor = monitor
        self._server = prometheus_server
        self._server_thread = prometheus_thread
        self._exporters = tuple(exporters)
        self._shutdown = False
        self._lock = threading.Lock()
        # What the SDK providers' own exit hooks did, but bounded like shutdown() is.
        atexit.register(self.shutdown)

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

    @property
    def export_error(self) -> str | None:
        """One line saying which OTLP export failed, where and why; None when none did."""
        return None if self._monitor is None else self._monitor.error()

    def shutdown(self, timeout_s: float = 0.8) -> bool:
        """Flush what can still be exported, then stop exporters and the scrape endpoint.

        Idempotent. Takes at most about ``timeout_s``: attempts against an endpoint already
        known to be dead are skipped, and an export still waiting for an answer at the
        deadline is abandoned (its retries are cancelled; it is reported by
        :attr:`export_error`), so a dead collector never holds up the host's exit.

        Returns:
            True when everything handed to the exporters was exported.
        """
        with self._lock:
            if self._shutdown:
                return self.export_error is None
            self._shutdown = True
        atexit.unregister(self.shutdown)
        monitor = self._monitor
        if monitor is not None:
            monitor.closing = True
        done = threading.Event()

        def close_providers() -> None:
            try:
                self.tracer_provider.shutdown()
                self.meter_provider.shutdown(timeout_millis=timeout_s * 1000)
            except Exception:
                logger.debug("OpenTelemetry provider shutdown raised", exc_info=True)
            finally:
                done.set()
                # Only now: an abandoned export may still log its retries until it ends.
                if monitor is not None:
                    for name in _EXPORTER_LOGGERS:
                        logging.getLogger(name).removeFilter(monitor)

        # A daemon thread, so an export stuck on a silent endpoint cannot delay the exit.
        closer = threading.Thread(target=close_providers, name="omnitrace-otel-shutdown")
        closer.daemon = True
        closer.start()
        try:
            if not done.wait(timeout_s):
                if monitor is not None:
                    monitor.unfinished = timeout_s
                for exporter in self._exporters:
                    exporter.shutdown()  # cancels retry back-offs of the abandoned export
        finally:
            if self._server is not None:
                self._server.shutdown()
                self._server.server_close()
                if self._server_thread is not None:
                    self._server_thread.join(timeout_s)
        return self.export_error is None

    def __enter__(self) -> OTelSetup:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    def __repr__(self) -> str:
        target = f"{self.protocol} {self.endpoint}" if self.endpoint else "no OTLP"
        return f"<OTelSetup {target} prometheus={self.prometheus_reader is not None}>"


def _resource(
    service_name: str | None,
    default_service_name: str,
    extra: Mapping[str, str | int | float | bool] | None,
    defaults_of_source: Mapping[str, str | int | float | bool] | None = None,
) -> Any:
    """Build the SDK resource: explicit arguments, else OTel's variables, else defaults.

    ``OTEL_SERVICE_NAME`` and ``OTEL_RESOURCE_ATTRIBUTES`` (read by the SDK's own detector)
    override omnitrace's defaults (service name, pid, worker ranks) and are overridden by
    ``service_name`` and ``resource_attributes`` when those are given.
    """
    from opentelemetry.sdk.resources import OTELResourceDetector, Resource

    defaults: dict[str, str | int | float | bool] = {
        ATTR.SERVICE_NAME: default_service_name,
        ATTR.PROCESS_PID: os.getpid(),
    }
    # torchrun and most launchers export these; they tell the workers of one job apart.
    for variable, key in (("RANK", ATTR.RANK), ("LOCAL_RANK", ATTR.LOCAL_RANK)):
        rank = env_rank(variable)
        if rank is not None:
            defaults[key] = rank
    # The process the telemetry describes, when it is not this one (a replayed worker).
    defaults.update(defaults_of_source or {})
    from_env = OTELResourceDetector().detect().attributes
    attributes = {key: value for key, value in defaults.items() if key not in from_env}
    if service_name is not None:
        attributes[ATTR.SERVICE_NAME] = service_name
    if extra:
        attributes.update(extra)
    # Resource.create merges the same variables again, under these attributes.
    return Resource.create(attributes)


#: Export intervals and delays, in seconds: from 10 ms (shorter only spins the SDK's export
#: thread) to a day. The SDK takes any positive number, but past threading.TIMEOUT_MAX
#: (about 292 years) its thread's wait raises OverflowError, far from where it was set.
INTERVAL_RANGE_S = (0.01, 86_400.0)
#: The deadline of one export, retries included: 10 ms to 10 minutes.
TIMEOUT_RANGE_S = (0.01, 600.0)


def _env_millis(name: str) -> float | None:
    """Return the seconds in the millisecond variable ``name``; None when it is unset.

    Raises:
        ConfigError: the value is no number of milliseconds in :data:`INTERVAL_RANGE_S`.
    """
    if not os.environ.get(name, "").strip():
        return None
    low, high = INTERVAL_RANGE_S
    millis = env_seconds(
        os.environ, name, 0.0, low=low * 1000, high=high * 1000, unit="milliseconds"
    )
    return millis / 1000


def configure_sdk(
    *,
    service_name: str | None = None,
    default_service_name: str = "omnitrace",
    endpoint: str | None = None,
    protocol: OTLPProtocol | None = None,
    otlp: bool = True,
    otlp_metrics: bool = True,
    prometheus: bool = False,
    prometheus_port: int | None = None,
    prometheus_host: str = "127.0.0.1",
    prometheus_registry: CollectorRegistry | None = None,
    export_interval_s: float | None = None,
    export_timeout_s: float = 3.0,
    resource_attributes: Mapping[str, str | int | float | bool] | None = None,
    resource_defaults: Mapping[str, str | int | float | bool] | None = None,
    install_global: bool = False,
) -> OTelSetup:
    """Wire the OpenTelemetry SDK for omnitrace at the application edge.

    Settings follow OpenTelemetry's precedence: an argument given here wins, else the
    standard variable (``OTEL_SERVICE_NAME``, ``OTEL_RESOURCE_ATTRIBUTES``,
    ``OTEL_EXPORTER_OTLP_ENDPOINT``, ``OTEL_EXPORTER_OTLP_PROTOCOL``,
    ``OTEL_METRIC_EXPORT_INTERVAL``, ``OTEL_BSP_SCHEDULE_DELAY``), else omnitrace's default.

    Args:
        service_name: the ``service.name`` resource attribute. None: ``OTEL_SERVICE_NAME``,
            else ``service.name`` in ``OTEL_RESOURCE_ATTRIBUTES``, else
            ``default_service_name``.
        default_service_name: the service name when neither argument nor variable gives one
            (the CLI passes ``omnitrace-demo`` and ``omnitrace-replay``).
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
        export_interval_s: seconds between OTLP metric exports, 0.01 to 86400. None:
            ``OTEL_METRIC_EXPORT_INTERVAL`` (milliseconds, 10 to 86400000), else 10 s.
            ``OTEL_BSP_SCHEDULE_DELAY`` (the span batch delay) has the same range.
        export_timeout_s: deadline of one OTLP export, retries included, 0.01 to 600 s;
            short, so a dead collector cannot stall shutdown.
        resource_attributes: more resource attributes (override the defaults and
            ``OTEL_RESOURCE_ATTRIBUTES``).
        resource_defaults: resource attributes that replace omnitrace's defaults (this
            process's pid, ``RANK``) and that ``OTEL_RESOURCE_ATTRIBUTES`` overrides: the
            identity of a worker whose log is replayed.
        install_global: also install the providers as the global ones (once per process).

    Returns:
        The providers and their ``force_flush()`` / ``shutdown()``.

    Raises:
        ConfigError: an argument or a standard variable is out of range (the message names
            it; a ValueError).
        MissingExtraError: the gRPC exporter is asked for but not installed (the message
            says which extra to install; an ImportError).
    """
    if protocol is None:
        protocol_name = "OTEL_EXPORTER_OTLP_PROTOCOL"
        protocol_text = os.environ.get(protocol_name, "").strip() or "http/protobuf"
    else:
        protocol_name, protocol_text = "protocol", protocol
    if protocol_text not in _PROTOCOLS:
        # http/json is a valid OTLP protocol, but no OpenTelemetry Python exporter speaks it:
        # say so, rather than let the value look like a typo.
        raise ConfigError(
            f"{protocol_name}: expected one of {', '.join(_PROTOCOLS)} (the OTLP protocols the "
            f"OpenTelemetry Python exporters support), got {protocol_text!r}"
        )
    if otlp:
        # The exporters read the variables only when no endpoint is given.
        example = _DEFAULT_ENDPOINTS[protocol_text]
        if endpoint is not None:
            check_endpoint("endpoint", endpoint, example=example)
        else:
            env_endpoints(os.environ, example=example)
    if export_interval_s is None:
        interval = _env_millis("OTEL_METRIC_EXPORT_INTERVAL") or 10.0
    else:
        low, high = INTERVAL_RANGE_S
        interval = check_duration("export_interval_s", export_interval_s, low=low, high=high)
    span_delay = _env_millis("OTEL_BSP_SCHEDULE_DELAY")
    low, high = TIMEOUT_RANGE_S
    timeout = check_duration("export_timeout_s", export_timeout_s, low=low, high=high)
    if prometheus_port is not None:
        check_int("prometheus_port", prometheus_port, maximum=65535, meaning="a port in [0, 65535]")
        if not prometheus:
            raise ConfigError("prometheus_port: set prometheus=True to serve a scrape endpoint")
    if service_name is not None:
        check_text("service_name", service_name)
    if default_service_name is not None:
        check_text("default_service_name", default_service_name)

    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import MetricReader, PeriodicExportingMetricReader
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    resource = _resource(service_name, default_service_name, resource_attributes, resource_defaults)
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
        monitor.exporters = {"traces": span_exporter}
        if metric_exporter is not None:
            monitor.exporters["metrics"] = metric_exporter

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

    # OTelSetup.shutdown (bounded) replaces the providers' own exit hooks (unbounded).
    tracer_provider = TracerProvider(resource=resource, shutdown_on_exit=False)
    # The batch processor and the periodic reader export under the same deadline.
    deadline: dict[str, Any] = {"export_timeout_millis": timeout * 1000}
    if span_exporter is not None:
        delay = span_delay if span_delay is not None else min(5.0, interval)
        tracer_provider.add_span_processor(
            BatchSpanProcessor(span_exporter, schedule_delay_millis=delay * 1000, **deadline)
        )
    if metric_exporter is not None:
        readers.append(
            PeriodicExportingMetricReader(
                metric_exporter, export_interval_millis=interval * 1000, **deadline
            )
        )
    if monitor is not None:
        for name in _EXPORTER_LOGGERS:
            logging.getLogger(name).addFilter(monitor)

    meter_provider = MeterProvider(
        resource=resource, metric_readers=readers, shutdown_on_exit=False
    )
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
        exporters=[e for e in (span_exporter, metric_exporter) if e is not None],
    )


class SdkSink(NamedTuple):
    """An :class:`OTelSink` on providers :func:`configure_sdk` built, and their setup."""

    sink: OTelSink
    setup: OTelSetup


def sdk_sink(bus: EventBus, **settings: Any) -> SdkSink:
    """Wire the OpenTelemetry SDK and return a sink for ``bus`` that exports through it.

    The one place the command line, the demo and the vLLM plugin wire OpenTelemetry:
    :func:`configure_sdk` with ``settings``, then an :class:`OTelSink` on its providers.
    The caller adds the sink to ``bus`` and owns the setup (``setup.shutdown()`` after the
    bus is closed; it also runs, bounded, at exit).

    Args:
        bus: the bus whose stats the sink's metrics read.
        settings: arguments of :func:`configure_sdk`.

    Raises:
        ConfigError: a setting or a standard variable is out of range (as configure_sdk).
        ImportError: an exporter that is asked for is not installed (as configure_sdk).
    """
    setup = configure_sdk(**settings)
    try:
        sink = OTelSink(
            bus, tracer_provider=setup.tracer_provider, meter_provider=setup.meter_provider
        )
    except BaseException:
        # Exporter threads and a scrape endpoint may already run: stop them, then report.
        setup.shutdown()
        raise
    return SdkSink(sink, setup)


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
            raise MissingExtraError(
                "protocol 'grpc' needs the OTLP gRPC exporter: pip install "
                "'opentelemetry-exporter-otlp-proto-grpc>=1.25' (omnitrace's grpc extra)"
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
        closed = False

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
            # Called by the provider and, when an export outlives the shutdown deadline,
            # by OTelSetup.shutdown too.
            if self.closed:
                return
            self.closed = True
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
        closed = False

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
            if self.closed:
                return
            self.closed = True
            try:
                metric_exporter.shutdown(timeout_millis=timeout_millis)
            except Exception:
                logger.debug("OTLP metric exporter raised on shutdown", exc_info=True)

    return GuardedSpanExporter(), GuardedMetricExporter()


def _build_sink(request: SinkRequest) -> OTelSink:
    attributes: dict[str, str | int | float | bool] = {"process.pid": request.pid}
    if request.rank is not None:
        attributes["omnitrace.worker.rank"] = request.rank
    # OTEL_SERVICE_NAME is read from the request's environment (the worker's); the other
    # OTEL_* variables are read by configure_sdk and the SDK. The SDK shuts down at exit.
    return sdk_sink(
        request.bus,
        service_name=request.environ.get("OTEL_SERVICE_NAME", "").strip() or None,
        default_service_name="omnitrace",
        resource_attributes=attributes,
    ).sink


#: This sink's entry in the table of omnitrace.sinks.registry, which reads it from here (its
#: description is the first paragraph of this module's docstring).
SINK = SinkDeclaration(name="otlp", env="OMNITRACE_OTLP", order=20, build=_build_sink, switch=True)
