"""A loopback OTLP receiver for tests: what a collector would have received, as protobufs.

``OTLPReceiver`` listens on 127.0.0.1 and a free port, speaks OTLP over http/protobuf
(``/v1/traces``, ``/v1/metrics``, ``/v1/logs``) or gRPC (the collector's TraceService,
MetricsService and LogsService), and keeps every export request it accepts, parsed into the
``opentelemetry-proto`` messages. Tests point an exporter at ``receiver.endpoint``, flush, and
check the messages field by field::

    with OTLPReceiver("grpc") as receiver:
        setup = configure_sdk(endpoint=receiver.endpoint, protocol="grpc")
        ...
        setup.force_flush()
        assert receiver.wait_for(lambda r: r.spans())

It needs ``opentelemetry-proto`` (both protocols; the OTLP exporter omnitrace depends on
installs it) and ``grpcio`` (gRPC only: the ``grpc`` extra). It is a test double, not a
collector: nothing is forwarded or kept beyond the process. ``omnitrace receive`` runs one
as a command (:mod:`omnitrace.receive`), to check an exporter's settings without a
collector; it passes ``keep=False`` and an ``on_request`` callback, so a long run keeps
nothing.
"""

from __future__ import annotations

import errno
import gzip
import http.server
import importlib
import socket
import threading
import time
import zlib
from collections.abc import Callable, Mapping, Sequence
from concurrent import futures
from typing import Any, Literal

from opentelemetry.proto.collector.logs.v1.logs_service_pb2 import (
    ExportLogsServiceRequest,
    ExportLogsServiceResponse,
)
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import (
    ExportMetricsServiceRequest,
    ExportMetricsServiceResponse,
)
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue
from opentelemetry.proto.metrics.v1.metrics_pb2 import Metric
from opentelemetry.proto.trace.v1.trace_pb2 import ResourceSpans, Span

from omnitrace._validate import check_int
from omnitrace.errors import ConfigError

__all__ = [
    "OTLPReceiver",
    "attributes",
    "value",
]

ReceiverProtocol = Literal["http/protobuf", "grpc"]

_Request = ExportTraceServiceRequest | ExportMetricsServiceRequest | ExportLogsServiceRequest
_HTTP_PATHS: Mapping[str, tuple[type[_Request], bytes]] = {
    "/v1/traces": (ExportTraceServiceRequest, ExportTraceServiceResponse().SerializeToString()),
    "/v1/metrics": (
        ExportMetricsServiceRequest,
        ExportMetricsServiceResponse().SerializeToString(),
    ),
    "/v1/logs": (ExportLogsServiceRequest, ExportLogsServiceResponse().SerializeToString()),
}


def value(any_value: AnyValue) -> Any:
    """Return the Python value of an OTLP ``AnyValue`` (arrays as tuples, kvlists as dicts)."""
    kind = any_value.WhichOneof("value")
    if kind is None:
        return None
    if kind == "array_value":
        return tuple(value(v) for v in any_value.array_value.values)
    if kind == "kvlist_value":
        return attributes(any_value.kvlist_value.values)
    return getattr(any_value, kind)


def attributes(key_values: Sequence[KeyValue]) -> dict[str, Any]:
    """Return OTLP ``KeyValue`` attributes as a plain dict."""
    return {kv.key: value(kv.value) for kv in key_values}


class OTLPReceiver:
    """Accept OTLP exports on loopback and keep the parsed requests (a context manager).

    Args:
        protocol: ``"http/protobuf"`` or ``"grpc"``.
        host: the address to bind (loopback by default; tests should keep it so).
        port: the port to listen on (0, the default: a free one, see :attr:`port`).
        on_request: called with the signal (``"traces"``, ``"metrics"``, ``"logs"``) and
            the parsed request of each export accepted, on the server's thread.
        keep: keep the accepted requests (for :meth:`spans`, :meth:`metrics`...); a
            long-running receiver that only reports them passes False.

    Attributes:
        reject: when true, answer every export with a non-retryable error (HTTP 400, gRPC
            INVALID_ARGUMENT) instead of accepting it; rejected requests are only counted.
        reject_signals: reject only these signals (``"traces"``, ``"metrics"``, ``"logs"``),
            like a backend that takes traces but not metrics.
        rejected: how many export requests were rejected.
    """

    def __init__(
        self,
        protocol: ReceiverProtocol = "http/protobuf",
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        on_request: Callable[[str, _Request], None] | None = None,
        keep: bool = True,
    ):
        if protocol not in ("http/protobuf", "grpc"):
            raise ConfigError(f"protocol: expected 'http/protobuf' or 'grpc', got {protocol!r}")
        self.protocol = protocol
        self.host = host
        self._bind_port = check_int("port", port, maximum=65535, meaning="a port in [0, 65535]")
        self._on_request = on_request
        self._keep = keep
        self.reject = False
        self.reject_signals: set[str] = set()
        self.rejected = 0
        self._port: int | None = None
        self._changed = threading.Condition()
        self._traces: list[ExportTraceServiceRequest] = []
        self._metrics: list[ExportMetricsServiceRequest] = []
        self._logs: list[ExportLogsServiceRequest] = []
        self._http: http.server.ThreadingHTTPServer | None = None
        self._http_thread: threading.Thread | None = None
        self._grpc: Any = None

    # -- lifecycle ------------------------------------------------------------------------

    def start(self) -> OTLPReceiver:
        """Start listening; returns self."""
        if self._port is not None:
            raise RuntimeError("OTLPReceiver is already started")
        if self.protocol == "grpc":
            self._start_grpc()
        else:
            self._start_http()
        return self

    def stop(self) -> None:
        """Stop listening and release the port (idempotent)."""
        if self._http is not None:
            self._http.shutdown()
            self._http.server_close()
            if self._http_thread is not None:
                self._http_thread.join(5.0)
            self._http = None
        if self._grpc is not None:
            self._grpc.stop(grace=None).wait(5.0)
            self._grpc = None

    def __enter__(self) -> OTLPReceiver:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def port(self) -> int:
        if self._port is None:
            raise RuntimeError("OTLPReceiver is not started")
        return self._port

    @property
    def endpoint(self) -> str:
        """The base endpoint to give an OTLP exporter (``http://127.0.0.1:PORT``)."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    # -- what was received ----------------------------------------------------------------

    @property
    def trace_requests(self) -> list[ExportTraceServiceRequest]:
        with self._changed:
            return list(self._traces)

    @property
    def metrics_requests(self) -> list[ExportMetricsServiceRequest]:
        with self._changed:
            return list(self._metrics)

    @property
    def logs_requests(self) -> list[ExportLogsServiceRequest]:
        with self._changed:
            return list(self._logs)

    def resource_spans(self) -> list[ResourceSpans]:
        """Every ``ResourceSpans`` received, in arrival order."""
        return [rs for request in self.trace_requests for rs in request.resource_spans]

    def spans(self, name: str | None = None) -> list[Span]:
        """Every span received (only those called ``name``, if given), in arrival order."""
        return [
            span
            for rs in self.resource_spans()
            for scope in rs.scope_spans
            for span in scope.spans
            if name is None or span.name == name
        ]

    def metrics(self, name: str | None = None) -> list[Metric]:
        """Every metric received (only those called ``name``, if given), in arrival order."""
        return [
            metric
            for request in self.metrics_requests
            for rm in request.resource_metrics
            for scope in rm.scope_metrics
            for metric in scope.metrics
            if name is None or metric.name == name
        ]

    def latest_metric(self, name: str) -> Metric | None:
        """The last metric called ``name`` received (cumulative metrics: the current value)."""
        found = self.metrics(name)
        return found[-1] if found else None

    def wait_for(self, predicate: Callable[[OTLPReceiver], object], timeout: float = 5.0) -> bool:
        """Wait until ``predicate(self)`` is truthy; return whether it became so in time."""
        deadline = time.monotonic() + timeout
        with self._changed:
            while not predicate(self):
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return False
                # predicate() reads through the same (reentrant) condition lock.
                self._changed.wait(remaining)
        return True

    def clear(self) -> None:
        """Forget every request received so far."""
        with self._changed:
            self._traces.clear()
            self._metrics.clear()
            self._logs.clear()
            self.rejected = 0

    def __repr__(self) -> str:
        where = self.endpoint if self._port is not None else "stopped"
        return (
            f"<OTLPReceiver {self.protocol} {where} traces={len(self._traces)} "
            f"metrics={len(self._metrics)} logs={len(self._logs)}>"
        )

    # -- storage shared by both protocols -------------------------------------------------

    def _accept(self, request: _Request) -> bool:
        store: list[Any]
        if isinstance(request, ExportTraceServiceRequest):
            signal, store = "traces", self._traces
        elif isinstance(request, ExportMetricsServiceRequest):
            signal, store = "metrics", self._metrics
        else:
            signal, store = "logs", self._logs
        with self._changed:
            accepted = not (self.reject or signal in self.reject_signals)
            if not accepted:
                self.rejected += 1
            elif self._keep:
                store.append(request)
            self._changed.notify_all()
        if accepted and self._on_request is not None:
            self._on_request(signal, request)
        return accepted

    # -- HTTP -----------------------------------------------------------------------------

    def _start_http(self) -> None:
        receiver = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                route = _HTTP_PATHS.get(self.path.split("?", 1)[0])
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length)
                if route is None:
                    self._reply(404, b"", "text/plain")
                    return
                message_type, response = route
                try:
                    encoding = (self.headers.get("Content-Encoding") or "").lower()
                    if encoding == "gzip":
                        body = gzip.decompress(body)
                    elif encoding == "deflate":
                        body = zlib.decompress(body)
                    request = message_type.FromString(body)
                except Exception as exc:
                    self._reply(400, f"cannot parse the request: {exc}".encode(), "text/plain")
                    return
                if receiver._accept(request):
                    self._reply(200, response, "application/x-protobuf")
                else:
                    self._reply(400, b"rejected by the test receiver", "text/plain")

            def _reply(self, status: int, body: bytes, content_type: str) -> None:
                self.send_response(status)
                self.send_header("Content-Type", content_type)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: Any) -> None:
                # Test output should show assertions, not an access log.
                return

        server_class = http.server.ThreadingHTTPServer
        if ":" in self.host:  # an IPv6 address, such as ::1

            class ServerV6(http.server.ThreadingHTTPServer):
                address_family = socket.AF_INET6

            server_class = ServerV6
        server = server_class((self.host, self._bind_port), Handler)
        server.daemon_threads = True
        self._http = server
        self._port = int(server.server_address[1])
        self._http_thread = threading.Thread(
            target=server.serve_forever,
            kwargs={"poll_interval": 0.05},
            name=f"otlp-http-receiver-{self._port}",
            daemon=True,
        )
        self._http_thread.start()

    # -- gRPC -----------------------------------------------------------------------------

    def _start_grpc(self) -> None:
        # grpcio ships no type stubs; importing it as a module object keeps mypy strict
        # without an ignore that turns stale the day the stubs are installed.
        grpc: Any = importlib.import_module("grpc")
        from opentelemetry.proto.collector.logs.v1 import logs_service_pb2_grpc
        from opentelemetry.proto.collector.metrics.v1 import metrics_service_pb2_grpc
        from opentelemetry.proto.collector.trace.v1 import trace_service_pb2_grpc

        receiver = self

        def accept(request: _Request, context: Any) -> None:
            if not receiver._accept(request):
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, "rejected by the test receiver")

        def servicer(base: Any, response: Callable[[], Any]) -> Any:
            """A ``base`` servicer whose Export keeps the request and answers ``response()``."""

            class Servicer(base):  # type: ignore[misc]
                def Export(self, request: _Request, context: Any) -> Any:
                    accept(request, context)
                    return response()

            return Servicer()

        server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        # The generated *_pb2_grpc modules are untyped: their names are looked up.
        for module, service, response in (
            (trace_service_pb2_grpc, "TraceService", ExportTraceServiceResponse),
            (metrics_service_pb2_grpc, "MetricsService", ExportMetricsServiceResponse),
            (logs_service_pb2_grpc, "LogsService", ExportLogsServiceResponse),
        ):
            add = getattr(module, f"add_{service}Servicer_to_server")
            add(servicer(getattr(module, f"{service}Servicer"), response), server)
        where = f"[{self.host}]" if ":" in self.host else self.host
        try:
            port = server.add_insecure_port(f"{where}:{self._bind_port}")
        except RuntimeError:  # grpcio raises this for a port it cannot bind
            port = 0
        if not port:
            server.stop(None)
            raise OSError(errno.EADDRINUSE, f"cannot listen on {where}:{self._bind_port} (gRPC)")
        server.start()
        self._grpc = server
        self._port = int(port)
