"""``omnitrace receive``: listen for OTLP exports on loopback and say what arrives, keeping
only bounded counts."""

from __future__ import annotations

import importlib.util
import json
import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import IO, Any

from omnitrace._display import safe
from omnitrace.errors import MissingExtraError
from omnitrace.otlp_receiver import (
    DEFAULT_LIMITS,
    OTLPReceiver,
    ReceiverLimits,
    ReceiverProtocol,
    attributes,
)

__all__ = ["DEFAULT_MAX_NAMES", "DEFAULT_PORTS", "Received", "Tally", "describe_request", "receive"]

#: The port each protocol's exporters send to by default.
DEFAULT_PORTS: dict[str, int] = {"http/protobuf": 4318, "grpc": 4317}
#: What a request of each signal carries, as the lines name it.
_ITEMS = {"traces": "spans", "metrics": "metrics", "logs": "log records"}
#: Names listed on one line before the rest are counted ("… 3 more").
_NAMES_SHOWN = 6
#: Distinct names of each signal counted by name in the summary; the rest are counted together.
DEFAULT_MAX_NAMES = 1000
#: Requests described but not yet printed: a sender past this waits for its answer.
_BACKLOG = 16
#: Characters of a name or service kept (the rest is cut, marked "…"): the memory the
#: names take is bounded by their number and this.
_NAME_CHARS = 200
#: Seconds between two looks at ``stop`` and at the receiver's refusals.
_POLL_S = 0.1
#: Seconds the requests in flight at a stop have to be answered (503: sent again later).
_STOP_GRACE_S = 0.5


def _short(name: str) -> str:
    return name if len(name) <= _NAME_CHARS else name[: _NAME_CHARS - 1] + "…"


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
        if isinstance(name, str) and _short(name) not in found:
            found.append(_short(name))
    return tuple(found)


def _points(metric: Any) -> int:
    kind = metric.WhichOneof("data")
    return 0 if kind is None else len(getattr(metric, kind).data_points)


def _log_name(record: Any) -> str:
    event_name = getattr(record, "event_name", "")  # a newer field of the OTLP proto
    if event_name:
        return _short(str(event_name))
    body = record.body
    text = body.string_value if body.WhichOneof("value") == "string_value" else ""
    if text:
        return text if len(text) <= 40 else text[:39] + "…"
    return _short(record.severity_text) or "(no body)"


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
        return Received(signal, services, len(spans), Counter(map(_short, spans)))
    if signal == "metrics":
        metrics = [
            metric
            for rm in request.resource_metrics
            for scope in rm.scope_metrics
            for metric in scope.metrics
        ]
        services = _services(rm.resource for rm in request.resource_metrics)
        points = sum(_points(metric) for metric in metrics)
        names = Counter(_short(m.name) for m in metrics)
        return Received(signal, services, len(metrics), names, points)
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
    max_names: int = DEFAULT_MAX_NAMES
    """Distinct names kept per signal (and services kept); the rest go to :attr:`other`."""
    other: Counter[str] = field(default_factory=Counter)
    """Per signal, the items whose names came after the first ``max_names``."""
    other_services: int = 0
    """Requests that named a service after the first ``max_names`` services."""
    refused: Counter[str] = field(default_factory=Counter)
    """Requests and connections the receiver refused, by reason
    (:attr:`~omnitrace.otlp_receiver.OTLPReceiver.refusals`)."""

    def add(self, received: Received) -> None:
        self.requests[received.signal] += 1
        self.items[received.signal] += received.items
        self.points += received.points
        names = self.names.setdefault(received.signal, Counter())
        for name, count in received.names.items():
            if name in names or len(names) < self.max_names:
                names[name] += count
            else:
                self.other[received.signal] += count
        unlisted = False
        for service in received.services:
            if service in self.services:
                continue
            if len(self.services) < self.max_names:
                self.services.append(service)
            else:
                unlisted = True
        self.other_services += unlisted

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
                "other_names": {signal: self.other[signal] for signal in _ITEMS},
                "other_services": self.other_services,
                "refused": dict(self.refused),
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
        if self.other_services:
            services += (
                f" and others ({self.other_services} requests named a service past the first "
                f"{self.max_names})"
            )
        lines = [f"received in {elapsed_s:.1f} s from {services}; " + "; ".join(counts)]
        for signal, items in _ITEMS.items():
            names = self.names.get(signal)
            if not names:
                continue
            if signal == "metrics":  # each export repeats every metric: the names say it all
                listed = ", ".join(sorted(names))
            else:
                listed = ", ".join(f"{name} {count}" for name, count in sorted(names.items()))
            if self.other[signal]:
                listed += (
                    f"; {self.other[signal]} more under other names (past the first "
                    f"{self.max_names})"
                )
            lines.append(f"  {items}: {listed}")
        if self.refused:
            lines.append(f"  refused: {_refusals(self.refused)}")
        return [safe(line) for line in lines]


def _refusals(counts: Counter[str]) -> str:
    return ", ".join(f"{reason} ({count})" for reason, count in sorted(counts.items()))


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
    limits: ReceiverLimits = DEFAULT_LIMITS,
    max_names: int = DEFAULT_MAX_NAMES,
) -> Tally:
    """Listen until ``stop`` is set, ``duration_s`` passed or Ctrl-C; print each request on
    ``out`` as it arrives, and what the receiver refused (a size limit, a bad length, a
    timeout, too many connections: :class:`~omnitrace.otlp_receiver.ReceiverLimits`), and the
    summary at the end; return what arrived.

    Requests are described on the server's threads and printed here, at most a backlog of
    them at a time, so ``stop`` is looked at every 0.1 s whatever arrives and the summary
    follows it within a second. A request that arrives once the summary is being made is
    answered 503 (the exporter retries it), never taken and left out of the count; those
    in flight at the stop get half a second to be answered so.

    Raises:
        MissingExtraError: gRPC is asked for without grpcio (the grpc extra).
        OSError: the port cannot be listened on (in use, not allowed).
    """
    if protocol == "grpc" and importlib.util.find_spec("grpc") is None:
        raise MissingExtraError(
            "--protocol grpc needs grpcio: pip install 'omnitrace-graphs[grpc]'"
        )
    backlog = _Backlog()
    receiver = OTLPReceiver(
        protocol, host=host, port=port, keep=False, on_request=backlog.on_request, limits=limits
    )
    tally = Tally(max_names=max_names)
    receiver.start()
    start = time.monotonic()
    deadline = None if duration_s is None else start + duration_s
    try:
        say(
            f"listening for OTLP ({protocol}) on {receiver.endpoint}: point the exporter "
            f"there (OTEL_EXPORTER_OTLP_ENDPOINT={receiver.endpoint}); Ctrl-C stops"
        )
        try:
            while not stop.is_set() and (deadline is None or time.monotonic() < deadline):
                _show(backlog.take(_POLL_S), tally, receiver, as_json, out)
        except KeyboardInterrupt:
            pass  # Ctrl-C is how a receiver is stopped.
    finally:
        backlog.close()
        receiver.stop(_STOP_GRACE_S)
    _show(backlog.take(0), tally, receiver, as_json, out)
    elapsed = time.monotonic() - start
    if as_json:
        print(json.dumps(tally.as_json(elapsed)), file=out)
    else:
        for line in tally.lines(elapsed):
            print(line, file=out)
    out.flush()
    return tally


class _Backlog:
    """The requests described on the server's threads and not printed yet.

    Bounded: a sender faster than the printing waits for its answer, so the backlog of
    described requests stays small. ``closed`` is set under the same lock as the last
    take: a request is either in the summary or answered 503.
    """

    def __init__(self) -> None:
        self._received: deque[Received] = deque()
        self._changed = threading.Condition()
        self._closed = False

    def on_request(self, signal: str, request: Any) -> bool:
        """Describe one request and queue it; False (answered 503) once closed."""
        if self._closed:  # no time spent describing what is turned away
            return False
        received = describe_request(signal, request)
        with self._changed:
            while len(self._received) >= _BACKLOG and not self._closed:
                self._changed.wait(_POLL_S)
            if self._closed:
                return False
            self._received.append(received)
            self._changed.notify_all()
        return True

    def take(self, wait: float) -> list[Received]:
        """Every request queued, after waiting up to ``wait`` seconds for one if none is."""
        with self._changed:
            if not self._received and wait:
                self._changed.wait(wait)
            taken = list(self._received)
            self._received.clear()
            self._changed.notify_all()
        return taken

    def close(self) -> None:
        """Turn away every request from now on, and wake the senders waiting for room."""
        with self._changed:
            self._closed = True
            self._changed.notify_all()


def _show(
    taken: list[Received], tally: Tally, receiver: OTLPReceiver, as_json: bool, out: IO[str]
) -> None:
    """Print ``taken`` and the receiver's new refusals on ``out``, counting them in ``tally``.

    Printed on the one thread that writes ``out``, in arrival order.
    """
    for received in taken:
        tally.add(received)
        print(json.dumps(received.as_json()) if as_json else received.line(), file=out)
    refusals = receiver.refusals
    new = refusals - tally.refused
    if new:
        tally.refused = refusals
        if as_json:
            print(json.dumps({"refused": dict(new)}), file=out)
        else:
            print(safe(f"refused {_refusals(new)}"), file=out)
    if taken or new:
        out.flush()
