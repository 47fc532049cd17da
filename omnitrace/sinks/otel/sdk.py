"""OpenTelemetry spans and metrics through the SDK: providers, OTLP and Prometheus exporters,
and a sink on them, configured by OpenTelemetry's ``OTEL_*`` variables."""

from __future__ import annotations

import atexit
import logging
import os
import threading
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

from opentelemetry import metrics as otel_metrics
from opentelemetry import trace as otel_trace

from omnitrace._env import OTLPEndpoint, otlp_endpoint_errors, otlp_endpoints, otlp_where
from omnitrace._validate import check_duration, check_int, check_text
from omnitrace.errors import ConfigError
from omnitrace.sinks.otel.env import INTERVAL_RANGE_S, TIMEOUT_RANGE_S, env_millis, sdk_resource
from omnitrace.sinks.otel.export import EXPORTER_LOGGERS, ExportMonitor, guarded_exporters
from omnitrace.sinks.otel.sink import OTLP_PROTOCOLS, OTelSink, OTLPProtocol
from omnitrace.sinks.registry import SinkDeclaration, SinkRequest

if TYPE_CHECKING:
    from opentelemetry.sdk.metrics import MeterProvider as SDKMeterProvider
    from opentelemetry.sdk.trace import TracerProvider as SDKTracerProvider
    from prometheus_client import CollectorRegistry

    from omnitrace.bus import EventBus

__all__ = ["OTelSetup", "SdkSink", "configure_sdk", "sdk_sink"]

logger = logging.getLogger(__name__)


class OTelSetup:
    """The SDK providers :func:`configure_sdk` built, and their lifecycle.

    Attributes:
        tracer_provider: pass it to :class:`OTelSink` (or install it globally).
        meter_provider: likewise.
        protocol: the OTLP protocol, or None when OTLP export is off.
        endpoint: where the signals go, in a few words (their shared base, else each
            signal's URL), or None when OTLP export is off.
        endpoints: each exported signal's endpoint (empty when OTLP export is off).
        prometheus_reader: the Prometheus metric reader, if one was asked for.
        prometheus_port: the port the scrape endpoint listens on, if one was started.

    Args:
        tracer_provider, meter_provider, protocol, endpoint: the attributes of those names.
        monitor: what counts the OTLP exports' failures and successes; None without OTLP.
        endpoints: each exported signal's endpoint; default None (none).
        prometheus_reader: the Prometheus metric reader; default None.
        prometheus_server, prometheus_thread: the scrape endpoint's server and its thread,
            stopped by :meth:`shutdown`; default None.
        exporters: the OTLP exporters, shut down when :meth:`shutdown` gives up waiting;
            default ().
    """

    def __init__(
        self,
        *,
        tracer_provider: SDKTracerProvider,
        meter_provider: SDKMeterProvider,
        protocol: str | None,
        endpoint: str | None,
        monitor: ExportMonitor | None,
        endpoints: Mapping[str, OTLPEndpoint] | None = None,
        prometheus_reader: Any = None,
        prometheus_server: Any = None,
        prometheus_thread: threading.Thread | None = None,
        exporters: Sequence[Any] = (),
    ) -> None:
        self.tracer_provider = tracer_provider
        self.meter_provider = meter_provider
        self.protocol = protocol
        self.endpoint = endpoint
        self.endpoints: Mapping[str, OTLPEndpoint] = dict(endpoints or {})
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
        """The port the scrape endpoint listens on; None when none was started."""
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

        Args:
            timeout_s: seconds each provider may take; default 5.0.

        Returns:
            True when both providers flushed and no export failed meanwhile; False after
            :meth:`shutdown`.
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

        Args:
            timeout_s: seconds to wait for the providers (and the scrape thread); default 0.8.

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
                    for name in EXPORTER_LOGGERS:
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
        service_name: the ``service.name`` resource attribute. None (default):
            ``OTEL_SERVICE_NAME``, else ``service.name`` in ``OTEL_RESOURCE_ATTRIBUTES``,
            else ``default_service_name``.
        default_service_name: the service name when neither argument nor variable gives one;
            default ``"omnitrace"`` (the CLI passes ``omnitrace-demo``, ``omnitrace-replay``).
        endpoint: OTLP base endpoint of both signals (``http://host:4318`` for
            http/protobuf, ``http://host:4317`` for gRPC). None (default): each signal's own
            variable (``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``, ``..._METRICS_ENDPOINT``) as
            given, else ``OTEL_EXPORTER_OTLP_ENDPOINT`` as the base, else the protocol's
            localhost default (see :func:`omnitrace._env.otlp_endpoints`, the lookup
            ``omnitrace config`` shows).
        protocol: ``"http/protobuf"`` or ``"grpc"``; None (default) reads
            ``OTEL_EXPORTER_OTLP_PROTOCOL``, then defaults to http/protobuf.
        otlp: export over OTLP at all; default True.
        otlp_metrics: also export metrics over OTLP; default True (false for a traces-only
            backend such as a bare Jaeger: scrape the Prometheus endpoint for metrics then).
        prometheus: add a Prometheus metric reader (pull; metrics only); default False.
        prometheus_port: also serve ``/metrics`` on this port (0 picks a free one); default None.
        prometheus_host: address the scrape endpoint binds; default ``"127.0.0.1"``.
        prometheus_registry: the prometheus_client registry to register with; None (default):
            the global one.
        export_interval_s: seconds between OTLP metric exports, 0.01 to 86400. None (default):
            ``OTEL_METRIC_EXPORT_INTERVAL`` (milliseconds, 10 to 86400000), else 10 s.
            ``OTEL_BSP_SCHEDULE_DELAY`` (the span batch delay) has the same range.
        export_timeout_s: deadline of one OTLP export, retries included, 0.01 to 600 s;
            short, so a dead collector cannot stall shutdown. Default 3.0.
        resource_attributes: more resource attributes (override the defaults and
            ``OTEL_RESOURCE_ATTRIBUTES``); default None.
        resource_defaults: resource attributes that replace omnitrace's defaults (this
            process's pid, ``RANK``) and that ``OTEL_RESOURCE_ATTRIBUTES`` overrides: the
            identity of a worker whose log is replayed. Default None.
        install_global: also install the providers as the global ones (once per process);
            default False.

    Returns:
        The providers and their ``force_flush()`` / ``shutdown()``.

    Raises:
        ConfigError: an argument or a standard variable is out of range (the message names
            it; a ValueError).
        MissingExtraError: the gRPC exporter is asked for but not installed (the message
            says which extra to install; an ImportError).
    """
    protocol_text = _protocol(protocol)
    endpoints = _otlp_endpoints(protocol_text, endpoint, otlp_metrics) if otlp else {}
    timings = _timings(export_interval_s, export_timeout_s)
    _check_settings(prometheus, prometheus_port, service_name, default_service_name)
    resource = sdk_resource(
        service_name, default_service_name, resource_attributes, resource_defaults
    )
    scrape = _Scrape(prometheus_registry, prometheus_port, prometheus_host) if prometheus else None
    return _start(
        resource, protocol_text if otlp else None, endpoints, timings, scrape, install_global
    )


class _Timings(NamedTuple):
    """Seconds between metric exports, the span batch delay (None: not set), the export
    deadline."""

    interval: float
    span_delay: float | None
    timeout: float


class _Scrape(NamedTuple):
    """The Prometheus reader's registry (None: the global one), and where it is served."""

    registry: CollectorRegistry | None
    port: int | None
    host: str


def _start(
    resource: Any,
    protocol: str | None,
    endpoints: Mapping[str, OTLPEndpoint],
    timings: _Timings,
    scrape: _Scrape | None,
    install_global: bool,
) -> OTelSetup:
    """Start the OTLP export over ``protocol`` (None: none), the Prometheus reader and its
    scrape endpoint, and the providers on ``resource`` (also the global ones with
    ``install_global``).

    Exporters first (a missing gRPC extra fails here, before anything runs), then the scrape
    endpoint (a port in use fails there), and only then the threads of the batch processor
    and the periodic reader, so a failed call leaves nothing running behind.
    """
    export = None if protocol is None else _otlp_export(protocol, endpoints, timings.timeout)
    prometheus_reader = server = thread = None
    if scrape is not None:
        try:
            prometheus_reader, server, thread = _prometheus_reader(*scrape)
        except BaseException:
            if export is not None:
                export.shutdown()
            raise
    tracer_provider, meter_provider = _providers(resource, export, prometheus_reader, timings)
    if install_global:
        otel_trace.set_tracer_provider(tracer_provider)
        otel_metrics.set_meter_provider(meter_provider)
    return OTelSetup(
        tracer_provider=tracer_provider,
        meter_provider=meter_provider,
        protocol=protocol,
        endpoint=None if export is None else export.where,
        endpoints=endpoints,
        monitor=None if export is None else export.monitor,
        prometheus_reader=prometheus_reader,
        prometheus_server=server,
        prometheus_thread=thread,
        exporters=() if export is None else export.exporters,
    )


def _otlp_endpoints(protocol: str, base: str | None, metrics: bool) -> dict[str, OTLPEndpoint]:
    """Each exported signal's endpoint: both under ``base``, else as the variables give them
    (every one of which is checked, also one a signal's own variable hides); traces only
    without ``metrics``."""
    if base is None:
        errors = otlp_endpoint_errors(os.environ, protocol)
        if errors:
            raise ConfigError("; ".join(errors))
    # Resolved here and given to the exporters, so what omnitrace says it exports to is where
    # the exporters send.
    endpoints = otlp_endpoints(os.environ, protocol, base=base)
    if not metrics:
        del endpoints["metrics"]
    return endpoints


def _check_settings(
    prometheus: bool,
    prometheus_port: int | None,
    service_name: str | None,
    default_service_name: str | None,
) -> None:
    """Check the scrape port (which needs ``prometheus``) and the service names."""
    if prometheus_port is not None:
        check_int("prometheus_port", prometheus_port, maximum=65535, meaning="a port in [0, 65535]")
        if not prometheus:
            raise ConfigError("prometheus_port: set prometheus=True to serve a scrape endpoint")
    if service_name is not None:
        check_text("service_name", service_name)
    if default_service_name is not None:
        check_text("default_service_name", default_service_name)


class _OtlpExport(NamedTuple):
    """The OTLP side of a setup: where it exports, its monitor and its guarded exporters."""

    where: str
    monitor: ExportMonitor
    spans: Any
    metrics: Any | None
    """None when metrics are not exported over OTLP."""

    @property
    def exporters(self) -> tuple[Any, ...]:
        return (self.spans,) if self.metrics is None else (self.spans, self.metrics)

    def shutdown(self) -> None:
        for exporter in self.exporters:
            exporter.shutdown()


def _otlp_export(
    protocol: str, endpoints: Mapping[str, OTLPEndpoint], timeout: float
) -> _OtlpExport:
    """The guarded exporters of the ``endpoints``' signals, and the monitor counting their
    outcomes on this module's logger; a missing gRPC extra fails here."""
    where = otlp_where(endpoints, protocol)
    monitor = ExportMonitor(protocol, where, logger)
    spans, metrics = guarded_exporters(
        protocol, {s: e.url for s, e in endpoints.items()}, timeout, monitor
    )
    monitor.exporters = {"traces": spans}
    if metrics is not None:
        monitor.exporters["metrics"] = metrics
    return _OtlpExport(where, monitor, spans, metrics)


def _providers(
    resource: Any, export: _OtlpExport | None, prometheus_reader: Any, timings: _Timings
) -> tuple[SDKTracerProvider, SDKMeterProvider]:
    """The tracer and meter providers on ``resource``: spans batched to the OTLP exporter,
    metrics read by the Prometheus reader and periodically exported over OTLP (the OTLP
    exporters' loggers filtered by the export's monitor)."""
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import MetricReader, PeriodicExportingMetricReader
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    readers: list[MetricReader] = [] if prometheus_reader is None else [prometheus_reader]
    # OTelSetup.shutdown (bounded) replaces the providers' own exit hooks (unbounded).
    tracer_provider = TracerProvider(resource=resource, shutdown_on_exit=False)
    if export is not None:
        interval, span_delay, timeout = timings
        # The batch processor and the periodic reader export under the same deadline.
        deadline: dict[str, Any] = {"export_timeout_millis": timeout * 1000}
        delay = span_delay if span_delay is not None else min(5.0, interval)
        tracer_provider.add_span_processor(
            BatchSpanProcessor(export.spans, schedule_delay_millis=delay * 1000, **deadline)
        )
        if export.metrics is not None:
            readers.append(
                PeriodicExportingMetricReader(
                    export.metrics, export_interval_millis=interval * 1000, **deadline
                )
            )
        for name in EXPORTER_LOGGERS:
            logging.getLogger(name).addFilter(export.monitor)
    meter_provider = MeterProvider(
        resource=resource, metric_readers=readers, shutdown_on_exit=False
    )
    return tracer_provider, meter_provider


def _protocol(protocol: str | None) -> str:
    """The OTLP protocol: ``protocol``, else ``OTEL_EXPORTER_OTLP_PROTOCOL``, else
    http/protobuf; one the Python exporters do not speak is a ConfigError naming it."""
    if protocol is None:
        name = "OTEL_EXPORTER_OTLP_PROTOCOL"
        text = os.environ.get(name, "").strip() or "http/protobuf"
    else:
        name, text = "protocol", protocol
    if text not in OTLP_PROTOCOLS:
        # http/json is a valid OTLP protocol, but no OpenTelemetry Python exporter speaks it:
        # say so, rather than let the value look like a typo.
        raise ConfigError(
            f"{name}: expected one of {', '.join(OTLP_PROTOCOLS)} (the OTLP protocols the "
            f"OpenTelemetry Python exporters support), got {text!r}"
        )
    return text


def _timings(export_interval_s: float | None, export_timeout_s: float) -> _Timings:
    """Seconds between metric exports, the span batch delay (None: not set) and the export
    deadline, each checked against its range (see :func:`configure_sdk`)."""
    if export_interval_s is None:
        interval = env_millis("OTEL_METRIC_EXPORT_INTERVAL") or 10.0
    else:
        low, high = INTERVAL_RANGE_S
        interval = check_duration("export_interval_s", export_interval_s, low=low, high=high)
    span_delay = env_millis("OTEL_BSP_SCHEDULE_DELAY")
    low, high = TIMEOUT_RANGE_S
    timeout = check_duration("export_timeout_s", export_timeout_s, low=low, high=high)
    return _Timings(interval, span_delay, timeout)


def _prometheus_reader(
    registry: CollectorRegistry | None, port: int | None, host: str
) -> tuple[Any, Any, Any]:
    """A Prometheus metric reader on ``registry`` (the global one by default) and, with a
    ``port``, the scrape server and its thread; a server that cannot start leaves no reader
    registered."""
    from opentelemetry.exporter.prometheus import PrometheusMetricReader
    from prometheus_client import REGISTRY, start_http_server

    registry = REGISTRY if registry is None else registry
    reader = PrometheusMetricReader(registry=registry)
    server = thread = None
    if port is not None:
        try:
            server, thread = start_http_server(port, addr=host, registry=registry)
        except BaseException:
            reader.shutdown()  # unregisters it from the registry
            raise
    return reader, server, thread


class SdkSink(NamedTuple):
    """An :class:`OTelSink` on providers :func:`configure_sdk` built, and their setup.

    Args:
        sink: the sink, for the caller to add to its bus.
        setup: the providers' setup, for the caller to shut down.
    """

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
        **settings: keyword arguments of :func:`configure_sdk`.

    Returns:
        The sink and the setup it exports through.

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
