"""Structured JSON logs of adapter decisions through structlog: captures, deferrals,
failures and what start-up profiling runs did with each encoder, and a ``graph_summary``
line per encoder every ``OMNITRACE_SUMMARY_INTERVAL`` seconds and at exit."""

from __future__ import annotations

import dataclasses
import logging
import os
import sys
import threading
from collections.abc import Mapping, MutableMapping, Sequence
from typing import IO, TYPE_CHECKING, Any, TextIO

import structlog

from omnitrace import events as ev
from omnitrace._display import safe
from omnitrace._env import env_seconds
from omnitrace._validate import check_duration, check_int
from omnitrace.config import ConfigError
from omnitrace.events import Event, MissReason, Phase
from omnitrace.requests import phases_of
from omnitrace.sinks.names import LOG_EVENTS
from omnitrace.sinks.registry import SinkDeclaration, SinkRequest

if TYPE_CHECKING:
    from omnitrace.bus import EventBus
    from omnitrace.coverage import AdapterCoverage
    from omnitrace.stats import AdapterStats

__all__ = [
    "ENV_SUMMARY_INTERVAL",
    "LOGGER_NAME",
    "LogSink",
    "add_trace_context",
    "configure_logging",
    "summary_fields",
    "trace_context",
]

LOGGER_NAME = "omnitrace"
logger = logging.getLogger(__name__)
#: Seconds between ``graph_summary`` lines (default 60; 0: only the one at close).
ENV_SUMMARY_INTERVAL = "OMNITRACE_SUMMARY_INTERVAL"
#: The summary interval's range: below 0.1 s the summaries would flood the log (1e-300 wrote
#: thousands of lines a second), and a day is as good as never for a periodic line.
SUMMARY_INTERVAL_RANGE: dict[str, Any] = {
    "low": 0.1,
    "high": 86_400.0,
    "zero": "the summary only at shutdown",
}
#: Missed signatures a summary line lists per encoder.
SUMMARY_TOP_MISSED = 5

_LEVELS: Mapping[str, int] = {
    "debug": logging.DEBUG,
    "info": logging.INFO,
    "warning": logging.WARNING,
    "error": logging.ERROR,
    "critical": logging.CRITICAL,
}


def trace_context() -> dict[str, str]:
    """Return ``trace_id``/``span_id`` of the current OpenTelemetry span, if there is one.

    Uses only the OTel API, and only when it is importable; without it, or outside a
    recording span, the result is empty.
    """
    try:
        from opentelemetry import trace
    except ImportError:
        return {}
    context = trace.get_current_span().get_span_context()
    if not context.is_valid:
        return {}
    return {
        "trace_id": format(context.trace_id, "032x"),
        "span_id": format(context.span_id, "016x"),
    }


def add_trace_context(
    logger: object, method_name: str, event_dict: MutableMapping[str, Any]
) -> MutableMapping[str, Any]:
    """Structlog processor: add the current OTel ``trace_id``/``span_id`` when a span is active."""
    for key, value in trace_context().items():
        event_dict.setdefault(key, value)
    return event_dict


def _escape_text(
    logger: object, method: str, event_dict: structlog.typing.EventDict
) -> structlog.typing.EventDict:
    """Show the control characters of string values as escapes (console lines only).

    The formatted traceback (``exception``) keeps its new lines; its other controls go.
    """
    for key, value in event_dict.items():
        if isinstance(value, str):
            if key == "exception":
                event_dict[key] = "\n".join(safe(line) for line in value.split("\n"))
            else:
                event_dict[key] = safe(value)
    return event_dict


class _StderrProxy:
    """A file that writes to whatever ``sys.stderr`` is at the time of each write.

    A live terminal view swaps ``sys.stderr`` for a proxy that prints above the display;
    looking it up per line keeps log lines from tearing through the view.
    """

    def write(self, text: str) -> int:
        return sys.stderr.write(text)

    def flush(self) -> None:
        sys.stderr.flush()


def configure_logging(
    *,
    level: str = "info",
    json: bool = True,
    stream: IO[str] | TextIO | None = None,
) -> None:
    """Configure structlog for an application that uses omnitrace (call it once, at startup).

    Args:
        level: lowest level written: debug, info, warning, error or critical.
        json: one JSON object per line (for log shipping); false gives coloured console lines.
        stream: where lines go; default: the current ``sys.stderr`` at each write.

    Raises:
        ConfigError: ``level`` is not one of the names above.
    """
    if not isinstance(level, str) or level.lower() not in _LEVELS:
        raise ConfigError(f"log level: expected one of {', '.join(_LEVELS)}, got {level!r}")
    # JSON escapes control characters itself; console lines get them escaped first, so an
    # event's text (a key, a model's error message) never reaches a terminal raw.
    renderers: list[structlog.typing.Processor] = (
        [structlog.processors.JSONRenderer(sort_keys=False)]
        if json
        else [_escape_text, structlog.dev.ConsoleRenderer(colors=False)]
    )
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            add_trace_context,
            structlog.processors.format_exc_info,
            *renderers,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(_LEVELS[level.lower()]),
        # One write() per line, its new line included (print() writes the two apart): a line
        # from another writer of the stream (vLLM's own logger) cannot land inside it.
        logger_factory=structlog.WriteLoggerFactory(
            file=stream if stream is not None else _StderrProxy()  # type: ignore[arg-type]
        ),
        # Not cached: a test or a CLI run may reconfigure, and the sink is not on the hot path.
        cache_logger_on_first_use=False,
    )


class LogSink:
    """Write one structured log line per adapter decision (a bus sink).

    Args:
        sample_every: log one in N replays and misses per encoder (1 logs all of them);
            captures, deferrals and failures are always logged.
        bus: the bus the sink is attached to; given, the sink writes ``graph_summary``
            lines from its folds, periodically and at close.
        summary_interval: seconds between summaries (0: only the one at close); None reads
            ``OMNITRACE_SUMMARY_INTERVAL`` from ``environ``, default 60.
        environ: where to read that variable (default: the process environment).

    Raises:
        ConfigError: ``sample_every`` is not a positive integer, or the interval is neither
            0 nor a number of seconds from 0.1 to 86400 (the message names the variable).
    """

    name = "logs"

    def __init__(
        self,
        *,
        sample_every: int = 1,
        bus: EventBus | None = None,
        summary_interval: float | None = None,
        environ: Mapping[str, str] | None = None,
    ) -> None:
        self.sample_every = check_int("sample_every", sample_every, minimum=1)
        if summary_interval is None:
            summary_interval = env_seconds(
                os.environ if environ is None else environ,
                ENV_SUMMARY_INTERVAL,
                60.0,
                **SUMMARY_INTERVAL_RANGE,
            )
        else:
            summary_interval = check_duration(
                "summary_interval", summary_interval, **SUMMARY_INTERVAL_RANGE
            )
        self.summary_interval = summary_interval
        self._bus = bus
        self._seen: dict[tuple[str, str], int] = {}
        self._skipped_since: dict[tuple[str, str], int] = {}
        self._skipped = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._timer: threading.Thread | None = None
        self._timer_pid = 0
        self._closed = False
        self.summaries = 0
        """``graph_summary`` lines written so far."""

    @property
    def skipped(self) -> int:
        """Replays and misses not logged because of sampling."""
        return self._skipped

    def _sampled(self, encoder: str, name: str) -> int | None:
        """Return how many were skipped before this one if it is logged, else None."""
        key = (encoder, name)
        with self._lock:
            seen = self._seen.get(key, 0)
            self._seen[key] = seen + 1
            if seen % self.sample_every == 0:
                return self._skipped_since.pop(key, 0)
            self._skipped_since[key] = self._skipped_since.get(key, 0) + 1
            self._skipped += 1
            return None

    def handle(self, events: Sequence[Event]) -> None:
        """Log ``events`` in order."""
        self._start_timer()
        log = structlog.get_logger(LOGGER_NAME).bind()
        # Replays and misses are debug lines, one per encoder call: when the logger filters
        # them out, skip them before building their fields. This sink shares the GIL with
        # the serving thread, so work it does not need to do is throughput it gives back.
        is_enabled_for = getattr(log, "is_enabled_for", None)
        debug_on = True if is_enabled_for is None else bool(is_enabled_for(logging.DEBUG))
        # One span lookup per batch: the sink runs on the bus's worker thread, where the
        # context is that of whoever drives the bus, not of the encoder call.
        trace = trace_context()
        for event in events:
            per_call = isinstance(event, _PER_CALL)
            if not debug_on and (per_call or isinstance(event, _PER_REQUEST)):
                continue
            name, fields = _describe(event)
            fields.update(trace)
            if per_call and self.sample_every > 1:
                skipped = self._sampled(event.adapter, name)
                if skipped is None:
                    continue
                fields["sample_every"] = self.sample_every
                fields["skipped"] = skipped
            getattr(log, LOG_EVENTS[name])(name, **fields)

    def close(self) -> None:
        """Stop the periodic summaries and write the final ``graph_summary`` lines.

        The logger's stream belongs to the application and stays open.
        """
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._stop.set()
        timer = self._timer
        if timer is not None and timer is not threading.current_thread():
            timer.join(timeout=1.0)
        self.summarize(final=True)

    # -- graph_summary ----------------------------------------------------------------------

    def _start_timer(self) -> None:
        """Start the summary thread once per process (a forked child starts its own)."""
        if self._bus is None or not self.summary_interval or self._closed:
            return
        pid = os.getpid()
        if self._timer is not None and self._timer_pid == pid:
            return
        with self._lock:
            if (self._timer is not None and self._timer_pid == pid) or self._closed:
                return
            self._timer_pid = pid
            self._timer = threading.Thread(
                target=self._run_timer, name="omnitrace-log-summary", daemon=True
            )
            self._timer.start()

    def _run_timer(self) -> None:
        while not self._stop.wait(self.summary_interval):
            self.summarize(final=False)

    def summarize(self, *, final: bool = False) -> int:
        """Write one ``graph_summary`` line per encoder that was called; return how many.

        Never raises: a failure to read the bus or to log is logged once on this module's
        logger instead (the summary is a report, not part of serving).
        """
        bus = self._bus
        if bus is None:
            return 0
        try:
            stats = bus.adapter_stats()
            coverage = bus.coverage()
            infos = bus.adapters()
            log = structlog.get_logger(LOGGER_NAME)
            written = 0
            for name, adapter_stats in stats.items():
                if not adapter_stats.calls:
                    continue
                fields = summary_fields(adapter_stats, coverage.get(name), infos.get(name))
                log.info("graph_summary", **fields, final=final, **trace_context())
                written += 1
        except Exception as exc:  # a report must never take the sink down
            logger.warning("graph_summary failed: %s: %s", type(exc).__name__, exc)
            return 0
        self.summaries += written
        return written


def summary_fields(
    stats: AdapterStats,
    coverage: AdapterCoverage | None,
    info: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """Return the fields of one encoder's ``graph_summary`` line.

    Those of :func:`omnitrace.coverage.encoder_summary`, the fields ``omnitrace
    top --json`` and ``replay --json`` give each encoder too: ``encoder``, the nine stats
    keys, ``calls``, ``max_graphs`` and ``backend`` (from the adapter's registered ``info``),
    ``first_capture_free_bytes``, ``top_missed`` (per signature: ``key``, ``misses``,
    ``reason`` most of them had, ``share`` of the encoder's calls), ``eager_s`` and
    ``lost_s`` (eager time of the misses a graph could have served, and what graphs would
    have saved of it, ``None`` when no replay time is known or on the simulated backend) in
    ``time_source`` time, and ``profiling`` when there was any.
    """
    from omnitrace.coverage import encoder_summary

    return encoder_summary(stats, coverage, info, SUMMARY_TOP_MISSED)


#: Events of which there is one (or, with device timing, two) per encoder call: debug lines.
_PER_CALL = (ev.GraphReplayed, ev.GraphMissed, ev.DeviceTimed)
#: Events of which there is one per request or encoder step: debug lines, never sampled.
_PER_REQUEST = (ev.RequestTimed, ev.EncoderBatchRan)

#: The log event name of each event type (one of :data:`names.LOG_EVENTS`).
_LOG_NAMES: dict[type[Event], str] = {
    ev.GraphCaptured: "graph_captured",
    ev.GraphReplayed: "graph_replayed",
    ev.GraphMissed: "graph_missed",
    ev.DeviceTimed: "device_timed",
    ev.MemoryDeferred: "memory_deferred",
    ev.CaptureFailed: "capture_failed",
    ev.ProfilingObserved: "profiling_observed",
    ev.RequestTimed: "request_timed",
    ev.EncoderBatchRan: "encoder_batch_ran",
}
# Fields every event has: the line names the encoder and key instead, the phase only off
# serving, and the epoch as event_epoch_ns.
_COMMON_FIELDS = frozenset({"adapter", "signature", "monotonic_ns", "epoch_ns", "phase"})
#: The fields of its own each event type logs, in the event's field order.
_OWN_FIELDS: dict[type[Event], tuple[str, ...]] = {
    cls: tuple(f.name for f in dataclasses.fields(cls) if f.name not in _COMMON_FIELDS)
    for cls in _LOG_NAMES
}


def _describe(event: Event) -> tuple[str, dict[str, Any]]:
    """Return the log event name and fields of ``event``."""
    cls = type(event)
    if cls in ev.REQUEST_EVENT_TYPES:
        # About a request, not an encoder: its own fields, and a request's phases as seen
        # from this process alone (the encoders' share needs the workers' logs).
        fields = {name: getattr(event, name) for name in _OWN_FIELDS[cls]}
        if isinstance(event, ev.RequestTimed):
            fields["phases"] = phases_of(event)
        fields["event_epoch_ns"] = event.epoch_ns
        return _LOG_NAMES[cls], fields
    fields = {"encoder": event.adapter}
    if not isinstance(event, ev.ProfilingObserved):
        # A profiling run's report is about the encoder, not one of its calls: no key.
        fields["key"] = event.key
    for name in _OWN_FIELDS[cls]:
        value = getattr(event, name)
        # None: a miss's duration when the adapter did not run the forward, a capture's
        # free memory where it could not be read; left out.
        if value is not None:
            fields[name] = value.value if isinstance(value, MissReason) else value
    if event.phase is not Phase.SERVING:
        fields["phase"] = event.phase.value
    fields["event_epoch_ns"] = event.epoch_ns
    return _LOG_NAMES[cls], fields


def _build_sink(request: SinkRequest) -> LogSink:
    # A host that configured structlog keeps its own rendering; otherwise JSON lines go to
    # stderr at info level (captures, deferrals, failures and graph_summary lines).
    if not structlog.is_configured():
        configure_logging(level="info", json=True)
    return LogSink(bus=request.bus, environ=request.environ)


#: This sink's entry in the table of omnitrace.sinks.registry, which reads it from here (its
#: description is the first paragraph of this module's docstring).
SINK = SinkDeclaration(name="logs", env="OMNITRACE_LOGS", order=30, build=_build_sink, switch=True)
