"""OTLP export that never reaches the host: each outcome counted, an outage reported once
(docs/telemetry.md, "A dead or refusing endpoint")."""

from __future__ import annotations

import logging
import re
import threading
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from omnitrace.errors import MissingExtraError
from omnitrace.sinks.otel.sink import _name

if TYPE_CHECKING:
    from opentelemetry.sdk.metrics.export import MetricExporter
    from opentelemetry.sdk.trace.export import SpanExporter

__all__ = ["EXPORTER_LOGGERS", "ExportMonitor", "guarded_exporters"]


class ExportMonitor(logging.Filter):
    """Count export outcomes per signal; report an outage once and its end once.

    Signals are tracked apart because one endpoint may take one and refuse the other (Jaeger
    takes traces, not metrics), but reported together: a dead endpoint fails both, and that
    is one problem for the operator, logged once; the all-clear comes when every signal
    exports again.

    Also a logging filter for the OTLP exporters' own loggers: while an outage is reported,
    their per-attempt errors and retry warnings for the failing signal are suppressed, so a
    dead collector costs the host one log line instead of one per export interval.
    """

    def __init__(self, protocol: str, endpoint: str, logger: logging.Logger) -> None:
        super().__init__()
        self.logger = logger
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
            self.logger.warning(
                "OpenTelemetry %s export to %s (%s) failed%s; telemetry is dropped until the "
                "endpoint recovers. Further failures are counted, not logged.",
                signal,
                self.endpoint,
                self.protocol,
                f": {cause}" if cause else "",
            )
        elif recovered:
            self.logger.info("OpenTelemetry export to %s recovered", self.endpoint)


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
EXPORTER_LOGGERS = (
    *_LOGGER_SIGNALS,
    "opentelemetry.exporter.otlp.proto.grpc.exporter",
    "opentelemetry.exporter.otlp.common.http",
)


def guarded_exporters(
    protocol: str, endpoints: Mapping[str, str], timeout: float, monitor: ExportMonitor
) -> tuple[Any, Any | None]:
    """Build the OTLP span and metric exporters, wrapped so they count and never raise.

    ``endpoints`` gives each signal's URL as the exporter takes it (over http/protobuf,
    with its path); without ``metrics`` in it, no metric exporter is built.
    """
    spans, metrics = _otlp_exporters(protocol, endpoints, timeout)
    guarded = _guarded_spans(spans, monitor)
    return guarded, None if metrics is None else _guarded_metrics(metrics, monitor)


def _otlp_exporters(
    protocol: str, endpoints: Mapping[str, str], timeout: float
) -> tuple[SpanExporter, MetricExporter | None]:
    """The OTLP span exporter over ``protocol``, and the metric exporter when ``endpoints``
    has ``metrics``.

    Raises:
        MissingExtraError: gRPC is asked for but its exporter is not installed.
    """
    inner_spans: SpanExporter
    inner_metrics: MetricExporter | None = None
    metrics = "metrics" in endpoints
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
        inner_spans = GrpcSpanExporter(endpoint=endpoints["traces"], timeout=timeout)
        if metrics:
            inner_metrics = GrpcMetricExporter(endpoint=endpoints["metrics"], timeout=timeout)
    else:
        from opentelemetry.exporter.otlp.proto.http.metric_exporter import (
            OTLPMetricExporter as HttpMetricExporter,
        )
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import (
            OTLPSpanExporter as HttpSpanExporter,
        )

        inner_spans = HttpSpanExporter(endpoint=endpoints["traces"], timeout=timeout)
        if metrics:
            inner_metrics = HttpMetricExporter(endpoint=endpoints["metrics"], timeout=timeout)
    return inner_spans, inner_metrics


def _guarded_spans(inner_spans: SpanExporter, monitor: ExportMonitor) -> SpanExporter:
    """``inner_spans`` exporting through ``monitor``: each outcome counted, nothing raised."""
    from opentelemetry.sdk.trace import ReadableSpan
    from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

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
                monitor.logger.debug("OTLP span exporter raised on shutdown", exc_info=True)

        def force_flush(self, timeout_millis: int = 30000) -> bool:
            return inner_spans.force_flush(timeout_millis)

    return GuardedSpanExporter()


def _guarded_metrics(metric_exporter: MetricExporter, monitor: ExportMonitor) -> MetricExporter:
    """``metric_exporter`` exporting through ``monitor``: each outcome counted, nothing
    raised."""
    from opentelemetry.sdk.metrics.export import MetricExporter, MetricExportResult, MetricsData

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
                monitor.logger.debug("OTLP metric exporter raised on shutdown", exc_info=True)

    return GuardedMetricExporter()
