"""A loopback OTLP receiver (http/protobuf or gRPC) that keeps what a collector would have
received, as protobufs: for tests and ``omnitrace receive``."""

from __future__ import annotations

import errno
import functools
import http.server
import importlib
import io
import socket
import socketserver
import threading
import time
import zlib
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from concurrent import futures
from dataclasses import dataclass
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

from omnitrace._validate import check_duration, check_int
from omnitrace.errors import ConfigError

__all__ = [
    "DEFAULT_LIMITS",
    "OTLPReceiver",
    "ReceiverLimits",
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


_MIB = 1 << 20
#: Bytes read from the socket, or fed to the inflater, per step.
_READ_STEP = 1 << 16
#: Bytes an inflater may produce per step: the body grows by this much, never two copies
#: of it at once (64 KiB of zeros inflates to 64 MiB in one call otherwise).
_INFLATE_STEP = 1 << 20
#: After a 413, the rest of the body is read and thrown away for at most this long (and no
#: longer than the client stays silent for ``_LINGER_SILENCE_S``), so that a client still
#: sending reads the answer instead of a reset; nothing read is kept.
_LINGER_S = 2.0
_LINGER_SILENCE_S = 0.2


@dataclass(frozen=True, slots=True)
class ReceiverLimits:
    """What one HTTP receiver accepts: each request's size, its pace, the connections.

    A request past a size limit is answered 413 without its body being kept (or inflated)
    further; a connection past ``max_connections`` is answered 503 and closed by the
    listening thread; one that is silent longer than ``idle_timeout_s`` (before a request,
    or in the middle of a body) or whose request line and headers take longer than
    ``header_timeout_s`` is closed. A body is held as it arrives, not as announced, and one
    request at a time is inflated and parsed: memory stays under ``max_connections *
    max_body_bytes`` for the bodies plus ``max_decompressed_bytes`` and its parsed message.
    Each refusal is counted by its reason (:attr:`OTLPReceiver.refusals`).

    Raises:
        ConfigError: a limit that is not a positive integer, or a timeout not within
            [0.001, 86400] seconds.
    """

    max_body_bytes: int = 16 * _MIB
    """The largest body accepted, as sent (compressed or not); gRPC's largest message."""
    max_decompressed_bytes: int = 64 * _MIB
    """The largest body accepted once a gzip or deflate body is inflated."""
    header_timeout_s: float = 10.0
    """Seconds from a request's first byte to the end of its headers."""
    idle_timeout_s: float = 30.0
    """Seconds a connection may stay silent: waiting for a request, or within one."""
    max_connections: int = 32
    """HTTP connections served at once; each holds a thread and at most one body."""

    def __post_init__(self) -> None:
        for name in ("max_body_bytes", "max_decompressed_bytes", "max_connections"):
            check_int(name, getattr(self, name), minimum=1)
        for name in ("header_timeout_s", "idle_timeout_s"):
            check_duration(name, getattr(self, name), low=0.001, high=86400.0)


DEFAULT_LIMITS = ReceiverLimits()


class _TooLarge(Exception):
    """A body past a size limit (answered 413)."""


class _DeadlineReader(io.RawIOBase):
    """A socket's reading side whose every wait ends by ``deadline``, or ``idle_s`` from now.

    The request line and headers are read through it by the standard library; a set
    ``deadline`` bounds them as a whole, where a socket timeout alone bounds each read and
    lets a client that trickles a byte at a time hold the connection forever. ``expired``
    tells the two timeouts apart once one has been raised.
    """

    def __init__(self, sock: socket.socket, idle_s: float) -> None:
        super().__init__()
        self._sock = sock
        self.idle_s = idle_s
        self.deadline: float | None = None
        self.expired: str | None = None

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        wait, why = self.idle_s, "idle timeout"
        if self.deadline is not None and self.deadline - time.monotonic() < wait:
            wait, why = self.deadline - time.monotonic(), "header timeout"
            if wait <= 0:
                self.expired = why
                raise TimeoutError("the request's headers took too long")
        self._sock.settimeout(wait)
        try:
            return self._sock.recv_into(buffer)
        except TimeoutError:
            self.expired = why
            raise


def _inflate(body: memoryview, encoding: str, limit: int) -> bytearray:
    """Return ``body`` inflated (gzip or deflate), a step of input at a time, never holding
    more than ``limit`` bytes of output.

    Raises:
        _TooLarge: it inflates past ``limit`` bytes.
        ValueError: it is not a whole gzip or deflate stream.
    """
    wbits = 16 + zlib.MAX_WBITS if encoding == "gzip" else zlib.MAX_WBITS
    out = bytearray()
    inflater = zlib.decompressobj(wbits)
    offset = 0
    pending: bytes | memoryview = b""
    while True:
        if not pending and offset < len(body):
            pending = body[offset : offset + _READ_STEP]
            offset += len(pending)
        # At most one byte past the limit is ever produced: enough to know it is past.
        produced = inflater.decompress(pending, min(_INFLATE_STEP, limit + 1 - len(out)))
        out += produced
        if len(out) > limit:
            raise _TooLarge(f"inflates past {limit} bytes")
        pending = inflater.unconsumed_tail
        if inflater.eof:
            # gzip members may follow one another (RFC 1952); a zlib stream is one, and
            # what trails it is ignored, as zlib.decompress ignores it.
            rest = inflater.unused_data
            if encoding != "gzip" or not (rest or offset < len(body)):
                return out
            inflater = zlib.decompressobj(wbits)
            pending = rest
        elif not (produced or pending or offset < len(body)):
            # Output held back by a full step comes out above, with no input: only
            # when nothing more comes and no input is left is the stream cut short.
            raise ValueError(f"the {encoding} stream is cut short")


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
            the parsed request of each export accepted, on the server's thread; it may
            return False to turn the request away (HTTP 503, gRPC UNAVAILABLE: both tell
            the exporter to retry), as a receiver that is stopping does.
        keep: keep the accepted requests (for :meth:`spans`, :meth:`metrics`...); a
            long-running receiver that only reports them passes False.
        limits: what one request and the connections may cost (:class:`ReceiverLimits`;
            gRPC takes ``max_body_bytes`` as its largest message).

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
        on_request: Callable[[str, _Request], bool | None] | None = None,
        keep: bool = True,
        limits: ReceiverLimits = DEFAULT_LIMITS,
    ):
        if protocol not in ("http/protobuf", "grpc"):
            raise ConfigError(f"protocol: expected 'http/protobuf' or 'grpc', got {protocol!r}")
        self.protocol = protocol
        self.host = host
        self._bind_port = check_int("port", port, maximum=65535, meaning="a port in [0, 65535]")
        self._on_request = on_request
        self._keep = keep
        if not isinstance(limits, ReceiverLimits):
            raise ConfigError(f"limits: expected ReceiverLimits, got {limits!r}")
        self.limits = limits
        self._refusals: Counter[str] = Counter()
        self.reject = False
        self.reject_signals: set[str] = set()
        self.rejected = 0
        self._port: int | None = None
        self._changed = threading.Condition()
        self._traces: list[ExportTraceServiceRequest] = []
        self._metrics: list[ExportMetricsServiceRequest] = []
        self._logs: list[ExportLogsServiceRequest] = []
        self._http: _LimitedServer | None = None
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

    def stop(self, grace_s: float = 0.0) -> None:
        """Stop listening and release the port (idempotent).

        Args:
            grace_s: how long the requests in flight may take to be answered (those
                ``on_request`` turns away get their 503 or UNAVAILABLE then); what is still
                running after it is cut off.
        """
        if self._http is not None:
            self._http.shutdown()
            self._http.wait_idle(grace_s)
            self._http.server_close()
            if self._http_thread is not None:
                self._http_thread.join(5.0)
            self._http = None
        if self._grpc is not None:
            self._grpc.stop(grace=grace_s or None).wait(5.0 + grace_s)
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
            self._refusals.clear()

    @property
    def refusals(self) -> Counter[str]:
        """Requests and connections refused or cut off, by reason: ``"413 body past
        max_body_bytes"``, ``"413 inflated past max_decompressed_bytes"``, ``"400 bad
        Content-Length"``, ``"411 no Content-Length"``, ``"400 malformed request"`` (and the
        standard library's other answers to a malformed request line or headers: 414, 431,
        501...), ``"503 too many connections"``, ``"503 turned away"`` (by ``on_request``),
        ``"closed: header timeout"``, ``"closed: idle timeout"``, ``"closed: connection
        error"``. A copy."""
        with self._changed:
            return Counter(self._refusals)

    @property
    def refused(self) -> int:
        """How many requests or connections were refused or cut off, for any reason."""
        with self._changed:
            return sum(self._refusals.values())

    def __repr__(self) -> str:
        where = self.endpoint if self._port is not None else "stopped"
        return (
            f"<OTLPReceiver {self.protocol} {where} traces={len(self._traces)} "
            f"metrics={len(self._metrics)} logs={len(self._logs)}>"
        )

    # -- storage shared by both protocols -------------------------------------------------

    def _accept(self, request: _Request) -> str:
        """Decide on one parsed export: ``"accepted"``, ``"rejected"`` (the ``reject``
        switches) or ``"turned away"`` (``on_request`` returned False)."""
        store: list[Any]
        if isinstance(request, ExportTraceServiceRequest):
            signal, store = "traces", self._traces
        elif isinstance(request, ExportMetricsServiceRequest):
            signal, store = "metrics", self._metrics
        else:
            signal, store = "logs", self._logs
        with self._changed:
            if self.reject or signal in self.reject_signals:
                self.rejected += 1
                self._changed.notify_all()
                return "rejected"
        # Called without the lock: a slow callback must not hold up the readers.
        if self._on_request is not None and self._on_request(signal, request) is False:
            self._refuse("503 turned away")
            return "turned away"
        with self._changed:
            if self._keep:
                store.append(request)
            self._changed.notify_all()
        return "accepted"

    def _refuse(self, reason: str) -> None:
        with self._changed:
            self._refusals[reason] += 1
            self._changed.notify_all()

    # -- HTTP -----------------------------------------------------------------------------

    def _start_http(self) -> None:
        # One request at a time is inflated, parsed and reported: what a request costs
        # beyond its body is held once, however many connections are open. (Parsing holds
        # the interpreter lock anyway.)
        handler = functools.partial(
            _HTTPHandler, receiver=self, limits=self.limits, decoding=threading.Lock()
        )
        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        server = _LimitedServer((self.host, self._bind_port), handler, family, self)
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
            verdict = receiver._accept(request)
            if verdict == "rejected":
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, "rejected by the test receiver")
            elif verdict == "turned away":
                context.abort(grpc.StatusCode.UNAVAILABLE, "the receiver is not taking requests")

        def servicer(base: Any, response: Callable[[], Any]) -> Any:
            """A ``base`` servicer whose Export keeps the request and answers ``response()``."""

            class Servicer(base):  # type: ignore[misc]
                def Export(self, request: _Request, context: Any) -> Any:
                    accept(request, context)
                    return response()

            return Servicer()

        # gRPC bounds a message after it is decompressed too; calls past the bound on
        # concurrent ones are answered RESOURCE_EXHAUSTED by grpcio.
        size = self.limits.max_body_bytes
        server = grpc.server(
            futures.ThreadPoolExecutor(max_workers=4),
            options=[("grpc.max_receive_message_length", size)],
            maximum_concurrent_rpcs=self.limits.max_connections,
        )
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


class _HTTPHandler(http.server.BaseHTTPRequestHandler):
    """One HTTP connection to an :class:`OTLPReceiver`: its requests read within the
    ``limits``, decoded one at a time (under ``decoding``), and handed to the receiver."""

    _reader: _DeadlineReader
    _buffered: io.BufferedReader
    _announced = "0"

    def __init__(
        self,
        request: Any,
        client_address: Any,
        server: socketserver.BaseServer,
        *,
        receiver: OTLPReceiver,
        limits: ReceiverLimits,
        decoding: threading.Lock,
    ) -> None:
        self._receiver = receiver
        self._limits = limits
        self._decoding = decoding
        # The base class serves the connection from its constructor.
        super().__init__(request, client_address, server)

    def setup(self) -> None:
        super().setup()
        self.rfile.close()
        self._reader = _DeadlineReader(self.connection, self._limits.idle_timeout_s)
        self._buffered = io.BufferedReader(self._reader, _READ_STEP)
        self.rfile = self._buffered

    def handle_one_request(self) -> None:
        # Wait for a request no longer than the idle timeout; then its request
        # line and headers get the header timeout, as a whole.
        self._reader.deadline = None
        try:
            if not self._buffered.peek(1):
                self.close_connection = True
                return
        except OSError:  # timed out, or reset
            self._cut_off()
            return
        self._reader.deadline = time.monotonic() + self._limits.header_timeout_s
        try:
            # The standard library ends the connection on a timeout itself.
            super().handle_one_request()
        except OSError:  # reset mid-request: nothing left to answer
            self._cut_off()
            return
        if self._reader.expired is not None:
            self._cut_off()

    def _cut_off(self) -> None:
        """Count a connection ended by a timeout or an error, and end it."""
        self.close_connection = True
        why = self._reader.expired
        self._receiver._refuse("closed: connection error" if why is None else f"closed: {why}")
        self._reader.expired = None

    def do_POST(self) -> None:
        self._reader.deadline = None  # the body: no silence past the idle timeout
        self.connection.settimeout(self._limits.idle_timeout_s)
        length = self._length()
        if length is None:
            return
        if length > self._limits.max_body_bytes:
            self._refuse(
                413,
                "413 body past max_body_bytes",
                f"the body of {self._announced} bytes is past the limit of "
                f"{self._limits.max_body_bytes} bytes",
                length,
            )
            return
        body = self._body(length)
        if body is None:
            return
        route = _HTTP_PATHS.get(self.path.split("?", 1)[0])
        if route is None:
            self._reply(404, b"", "text/plain")
            return
        with self._decoding:
            self._decode(body, *route)

    def _decode(self, body: bytearray, message_type: type[_Request], ok: bytes) -> None:
        encoding = (self.headers.get("Content-Encoding") or "").strip().lower()
        data: bytes | bytearray | memoryview = memoryview(body)
        try:
            if encoding in ("gzip", "deflate"):
                data = memoryview(
                    _inflate(memoryview(body), encoding, self._limits.max_decompressed_bytes)
                )
                del body  # the compressed copy is no longer needed
            request = message_type.FromString(data)
        except _TooLarge:
            self._refuse(
                413,
                "413 inflated past max_decompressed_bytes",
                f"the body inflates past the limit of {self._limits.max_decompressed_bytes} bytes",
            )
            return
        except Exception as exc:
            self._reply(400, f"cannot parse the request: {exc}".encode(), "text/plain")
            return
        del data
        verdict = self._receiver._accept(request)
        if verdict == "accepted":
            self._reply(200, ok, "application/x-protobuf")
        elif verdict == "rejected":
            self._reply(400, b"rejected by the test receiver", "text/plain")
        else:
            self._reply(503, b"the receiver is not taking requests", "text/plain", close=True)

    def _length(self) -> int | None:
        """The body's length, or None when the request was answered here."""
        if self.headers.get("Transfer-Encoding"):
            self._refuse(
                411,
                "411 no Content-Length",
                "a Content-Length is needed (no chunked bodies)",
            )
            return None
        values = [v.strip() for v in self.headers.get_all("Content-Length") or []]
        text = values[0] if values else "0"
        if len(set(values)) > 1 or not text.isascii() or not text.isdigit():
            self._refuse(400, "400 bad Content-Length", f"bad Content-Length: {text[:40]!r}")
            return None
        # A well-formed length too long to be a size: past any limit, not malformed.
        self._announced = text if len(text) <= 18 else f"{text[:18]}… ({len(text)} digits)"
        return int(text) if len(text) <= 18 else 1 << 62

    def _body(self, length: int) -> bytearray | None:
        """Read ``length`` bytes as they arrive (held as sent, not as announced);
        None if the client stopped or went silent first."""
        body = bytearray()
        step = bytearray(_READ_STEP)
        try:
            while len(body) < length:
                n = self._buffered.readinto(memoryview(step)[: length - len(body)])
                if not n:
                    self.close_connection = True
                    return None
                body += memoryview(step)[:n]
        except OSError:
            self._cut_off()
            return None
        return body

    def _refuse(self, status: int, reason: str, why: str, pending: int = 0) -> None:
        """Answer ``status`` and close; of the ``pending`` bytes of body not read,
        some are read and thrown away, briefly, so the client sees the answer."""
        self._receiver._refuse(reason)
        self.close_connection = True
        try:
            self._reply(status, why.encode(), "text/plain", close=True)
            self.wfile.flush()
            self.connection.shutdown(socket.SHUT_WR)
        except OSError:
            return
        self._linger(pending)

    def _linger(self, pending: int) -> None:
        # Closing a socket with unread data sends a reset, which can reach the
        # client before the answer it has not read yet.
        end = time.monotonic() + _LINGER_S
        scrap = bytearray(_READ_STEP)
        try:
            while pending > 0 and (left := end - time.monotonic()) > 0:
                self._reader.idle_s = min(_LINGER_SILENCE_S, left)
                n = self._buffered.readinto(scrap)
                if not n:
                    return
                pending -= n
        except OSError:
            return

    def _reply(self, status: int, body: bytes, content_type: str, *, close: bool = False) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        if close:
            self.send_header("Connection", "close")
        self.end_headers()
        self.wfile.write(body)

    def send_error(self, code: int, message: str | None = None, explain: str | None = None) -> None:
        # A malformed request line or headers (400, 414, 431...): counted, answered.
        self._receiver._refuse(f"{int(code)} malformed request")
        self.connection.settimeout(self._limits.idle_timeout_s)
        super().send_error(code, message, explain)

    def log_message(self, format: str, *args: Any) -> None:
        # Test output should show assertions, not an access log.
        return


_BUSY = (
    b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: text/plain\r\nRetry-After: 1\r\n"
    b"Connection: close\r\nContent-Length: 34\r\n\r\nthe receiver serves enough already"
)


class _LimitedServer(http.server.ThreadingHTTPServer):
    """A threading HTTP server of at most ``limits.max_connections`` connections at once:
    one more is answered 503 and closed by the listening thread, without a thread."""

    daemon_threads = True
    request_queue_size = 128  # the listen backlog: socketserver's 5 drops a burst's SYNs

    def __init__(
        self,
        address: tuple[str, int],
        handler: Callable[..., socketserver.BaseRequestHandler],
        family: socket.AddressFamily,
        receiver: OTLPReceiver,
    ) -> None:
        self.address_family = family
        self._receiver = receiver
        self._active = 0
        self._changed = threading.Condition()
        super().__init__(address, handler)

    def wait_idle(self, timeout: float) -> None:
        """Wait until no connection is being served, or ``timeout`` passed."""
        with self._changed:
            self._changed.wait_for(lambda: not self._active, timeout)

    def _release(self) -> None:
        with self._changed:
            self._active -= 1
            self._changed.notify_all()

    def process_request(self, request: Any, client_address: Any) -> None:
        with self._changed:
            busy = self._active >= self._receiver.limits.max_connections
            if not busy:
                self._active += 1
        if busy:
            self._receiver._refuse("503 too many connections")
            try:
                request.settimeout(0.2)
                request.sendall(_BUSY)
                request.shutdown(socket.SHUT_WR)
            except OSError:
                pass
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._release()
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._release()

    def handle_error(self, request: Any, client_address: Any) -> None:
        # A client that misbehaves ends its own connection; no traceback on the console.
        self._receiver._refuse("closed: connection error")
