"""``omnitrace receive``: listen for OTLP exports on loopback and say what arrives.

What an operator needs to check exporter settings (``OTEL_EXPORTER_OTLP_ENDPOINT``, the
protocol, the service name) without running a collector: a
:class:`~omnitrace.testing_otlp.OTLPReceiver` on a fixed port (4318 for http/protobuf, 4317
for gRPC, the exporters' defaults), one line per export request (its signal, the services
that sent it, how many spans, metrics or log records and their names), and when it stops
(SIGINT, SIGTERM, ``--duration``) a summary of everything received. ``--json`` prints the
same as JSON lines. Nothing is kept but the counts, so it can run for as long as needed.
"""

from __future__ import annotations

import importlib.util
import json
import queue
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import IO, Any

from omnitrace._display import safe
from omnitrace.errors import MissingExtraError
from omnitrace.testing_otlp import OTLPReceiver, ReceiverProtocol, attributes

__all__ = ["DEFAULT_PORTS", "Received", "Tally", "describe_request", "receive"]

#: The port each protocol's exporters send to by default.
DEFAULT_PORTS: dict[str, int] = {"http/protobuf": 4318, "grpc": 4317}
#: What a request of each signal carries, as the lines name it.
_ITEMS = {"traces": "spans", "metrics": "metrics", "logs": "log records"}
#: Names listed on one line before the rest are counted ("… 3 more").
_NAMES_SHOWN = 6


@dataclass(frozen=True, slots=True)
class Received:
    """What one export request carried."""

    signal: str
    """``traces``, ``metrics`` or ``logs``."""
    services: tuple[str, ...]
    items: int
    """Spans, metrics or log records."""
    names: Counter[str]
    """Span names, metric names or log event names (else bodies), with their counts."""
    points: int = 0
    """Metric data points (metrics only)."""

    def as_json(self) -> dict[str, Any]:
        data: dict[str, Any] = {
            "signal": self.signal,
            "services": list(self.services),
            _ITEMS[self.signal].replace(" ", "_"): self.items,
            "names": dict(self.names),
        }
        if self.signal == "metrics":
            data["points"] = self.points
        return data

    def line(self) -> str:
        """The request in one line: ``traces from svc: 3 spans: a (2), b``."""
        services = ", ".join(self.services) or "no service.name"
        what = f"{self.items} {_ITEMS[self.signal]}"
        if self.signal == "metrics":
            what += f" ({self.points} points)"
        return safe(f"{self.signal:<7} from {services}: {what}{_listed(self.names)}")


def _listed(names: Counter[str]) -> str:
    if not names:
        return ""
    shown = [
        name if count == 1 else f"{name} ({count})"
        for name, count in names.most_common(_NAMES_SHOWN)
    ]
    rest = len(names) - len(shown)
    return ": " + ", ".join(shown) + (f", … {rest} more" if rest > 0 else "")


def _services(resources: Iterable[Any]) -> tuple[str, ...]:
    found = []
    for resource in resources:
        name = attributes(resource.attributes).get("service.name")
        if isinstance(name, str) and name not in found:
            found.append(name)
    return tuple(found)


def _points(metric: Any) -> int:
    kind = metric.WhichOneof("data")
    return 0 if kind is None else len(getattr(metric, kind).data_points)


def _log_name(record: Any) -> str:
    event_name = getattr(record, "event_name", "")  # a newer field of the OTLP proto
    if event_name:
        return str(event_name)
    body = record.body
    text = body.string_value if body.WhichOneof("value") == "string_value" else ""
    if text:
        return text if len(text) <= 40 else text[:39] + "…"
    return record.severity_text or "(no body)"


def describe_request(signal: str, request: Any) -> Received:
    """Count and name what an export request of ``signal`` carried."""
    if signal == "traces":
        spans = [
            span.name
            for rs in request.resource_spans
            for scope in rs.scope_spans
            for span in scope.spans
        ]
        services = _services(rs.resource for rs in request.resource_spans)
        return Received(signal, services, len(spans), Counter(spans))
    if signal == "metrics":
        metrics = [
            metric
            for rm in request.resource_metrics
            for scope in rm.scope_metrics
            for metric in scope.metrics
        ]
        services = _services(rm.resource for rm in request.resource_metrics)
        points = sum(_points(metric) for metric in metrics)
        return Received(signal, services, len(metrics), Counter(m.name for m in metrics), points)
    records = [
        record
        for rl in request.resource_logs
        for scope in rl.scope_logs
        for record in scope.log_records
    ]
    services = _services(rl.resource for rl in request.resource_logs)
    return Received(signal, services, len(records), Counter(_log_name(r) for r in records))


@dataclass
class Tally:
    """Everything received so far, per signal."""

    requests: Counter[str] = field(default_factory=Counter)
    items: Counter[str] = field(default_factory=Counter)
    points: int = 0
    names: dict[str, Counter[str]] = field(default_factory=dict)
    services: list[str] = field(default_factory=list)

    def add(self, received: Received) -> None:
        self.requests[received.signal] += 1
        self.items[received.signal] += received.items
        self.points += received.points
        self.names.setdefault(received.signal, Counter()).update(received.names)
        self.services.extend(s for s in received.services if s not in self.services)

    @property
    def empty(self) -> bool:
        return not self.requests

    def as_json(self, elapsed_s: float) -> dict[str, Any]:
        return {
            "summary": {
                "elapsed_s": round(elapsed_s, 3),
                "services": self.services,
                "requests": {signal: self.requests[signal] for signal in _ITEMS},
                "spans": self.items["traces"],
                "metrics": self.items["metrics"],
                "points": self.points,
                "log_records": self.items["logs"],
                "names": {signal: dict(self.names.get(signal, {})) for signal in _ITEMS},
            }
        }

    def lines(self, elapsed_s: float) -> list[str]:
        """The summary: what arrived in total, then the names per signal."""
        counts = []
        for signal, items in _ITEMS.items():
            requests = self.requests[signal]
            what = f"{requests} request{'' if requests == 1 else 's'}"
            if requests:
                what += f", {self.items[signal]} {items}"
                if signal == "metrics":
                    what += f", {self.points} points"
            counts.append(f"{signal}: {what}")
        services = ", ".join(self.services) or "no service"
        lines = [f"received in {elapsed_s:.1f} s from {services}; " + "; ".join(counts)]
        for signal, items in _ITEMS.items():
            names = self.names.get(signal)
            if not names:
                continue
            if signal == "metrics":  # each export repeats every metric: the names say it all
                listed = ", ".join(sorted(names))
            else:
                listed = ", ".join(f"{name} {count}" for name, count in sorted(names.items()))
            lines.append(f"  {items}: {listed}")
        return [safe(line) for line in lines]


def receive(
    *,
    protocol: ReceiverProtocol,
    host: str,
    port: int,
    as_json: bool,
    duration_s: float | None,
    stop: threading.Event,
    out: IO[str],
    say: Callable[[str], None],
) -> Tally:
    """Listen until ``stop`` is set, ``duration_s`` passed or Ctrl-C; print each request on
    ``out`` as it arrives and the summary at the end; return what arrived.

    Raises:
        MissingExtraError: gRPC is asked for without grpcio (the grpc extra).
        OSError: the port cannot be listened on (in use, not allowed).
    """
    if protocol == "grpc" and importlib.util.find_spec("grpc") is None:
        raise MissingExtraError(
            "--protocol grpc needs grpcio: pip install 'omnitrace-graphs[grpc]'"
        )
    arrived: queue.SimpleQueue[tuple[str, Any]] = queue.SimpleQueue()
    receiver = OTLPReceiver(
        protocol,
        host=host,
        port=port,
        keep=False,
        on_request=lambda signal, request: arrived.put((signal, request)),
    )
    tally = Tally()
    receiver.start()
    start = time.monotonic()
    deadline = None if duration_s is None else start + duration_s

    def drain(wait: float) -> None:
        # Printed here, on the one thread that writes ``out``, in arrival order.
        try:
            signal, request = arrived.get(timeout=wait) if wait else arrived.get_nowait()
        except queue.Empty:
            return
        while True:
            received = describe_request(signal, request)
            tally.add(received)
            print(json.dumps(received.as_json()) if as_json else received.line(), file=out)
            out.flush()
            try:
                signal, request = arrived.get_nowait()
            except queue.Empty:
                return

    try:
        say(
            f"listening for OTLP ({protocol}) on {receiver.endpoint}: point the exporter "
            f"there (OTEL_EXPORTER_OTLP_ENDPOINT={receiver.endpoint}); Ctrl-C stops"
        )
        try:
            while not stop.is_set() and (deadline is None or time.monotonic() < deadline):
                drain(0.1)
        except KeyboardInterrupt:
            pass  # Ctrl-C is how a receiver is stopped.
    finally:
        receiver.stop()
    drain(0)
    elapsed = time.monotonic() - start
    if as_json:
        print(json.dumps(tally.as_json(elapsed)), file=out)
    else:
        for line in tally.lines(elapsed):
            print(line, file=out)
    out.flush()
    return tally
