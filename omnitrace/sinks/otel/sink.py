"""OpenTelemetry sink on the API only: spans for captures, deferrals, failures and profiling
runs, made after the fact off the hot path; metrics read from the stats fold."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Literal

from opentelemetry import context as otel_context
from opentelemetry import metrics as otel_metrics
from opentelemetry import trace as otel_trace
from opentelemetry.metrics import CallbackOptions, Observation
from opentelemetry.trace import SpanKind, Status, StatusCode

from omnitrace import events as ev
from omnitrace.signature import Signature
from omnitrace.sinks.names import ATTR, METRICS, SPANS

if TYPE_CHECKING:
    from omnitrace.bus import EventBus
    from omnitrace.coverage import AdapterCoverage
    from omnitrace.stats import AdapterStats

__all__ = [
    "CALL_DURATION_BUCKETS",
    "CAPTURE_DURATION_BUCKETS",
    "OTLP_PROTOCOLS",
    "OTLPProtocol",
    "OTelSink",
]

logger = logging.getLogger(__name__)

OTLPProtocol = Literal["http/protobuf", "grpc"]
#: The OTLP protocols omnitrace exports with (``OTEL_EXPORTER_OTLP_PROTOCOL``'s values).
OTLP_PROTOCOLS: tuple[str, ...] = ("http/protobuf", "grpc")
_DEFAULT_ENDPOINTS = {"http/protobuf": "http://localhost:4318", "grpc": "http://localhost:4317"}


def _ladder(low: float, high: float) -> tuple[float, ...]:
    """Bucket bounds 1, 2.5 and 5 times each power of ten, from ``low`` to ``high``."""
    # Parsed from decimal text, so every bound is exactly the float its literal would be.
    bounds = (float(f"{m}e{e}") for e in range(-6, 4) for m in (1, 2.5, 5))
    return tuple(b for b in bounds if low <= b <= high)


#: Bucket bounds (seconds) of the capture-duration histogram. The SDK's default bounds are
#: sized for milliseconds and would put every capture (tens of ms to seconds) in one bucket.
CAPTURE_DURATION_BUCKETS: tuple[float, ...] = (*_ladder(0.005, 10.0), 30.0)

#: Bucket bounds (seconds) of the call-time histograms: an encoder call takes from a tenth of
#: a millisecond (a small replay) to a few hundred (a long eager clip).
CALL_DURATION_BUCKETS: tuple[float, ...] = _ladder(0.0001, 1.0)

#: Bucket bounds (seconds) of the request-phase histogram: a phase takes from a tenth of a
#: millisecond (the hand-offs) to tens of seconds (a queue under overload).
REQUEST_PHASE_BUCKETS: tuple[float, ...] = (*_ladder(0.0001, 10.0), 30.0, 60.0)

_SCOPE = "omnitrace"
# An empty context: spans made after the fact must be roots, never children of whatever span
# happens to be current on the worker thread.
_ROOT_CONTEXT = otel_context.Context()


def _scope_version() -> str:
    from omnitrace._version import __version__

    return __version__


def _key_attributes(signature: Signature) -> dict[str, str | tuple[str, ...]]:
    """Span attributes of a signature: its text, its dtypes and the shape of each input."""
    attributes: dict[str, str | tuple[str, ...]] = {ATTR.KEY: signature.text}
    dtypes = signature.dtypes
    if dtypes:
        attributes[ATTR.DTYPE] = ",".join(dtypes)
    if signature.inputs:
        attributes[ATTR.SHAPES] = tuple(
            "None" if spec is None else f"[{','.join(map(str, spec.shape))}]"
            for spec in signature.inputs
        )
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
    deferral, and an ERROR span with an ``exception`` event per capture failure; each carries
    the phase. Metrics: observable counters and gauges that read ``bus.adapter_stats()``,
    ``bus.coverage()`` (calls and captures by phase), ``bus.adapters()`` and
    ``bus.statistics()`` at each collection, the capture-duration histogram, and the host and
    device call-time histograms by kind (``replay``, ``eager``) and phase, recorded from the
    events this sink receives. Create one per bus and meter provider: a second one would
    report every counter twice.

    Args:
        bus: the bus whose stats the metrics read (the sink still has to be added to it).
        tracer_provider: where spans go; default None (the global tracer provider).
        meter_provider: where metrics go; default None (the global meter provider).
        name: the sink's name in bus statistics (and in ``omnitrace.bus.dropped``);
            default ``"otel"``.
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
            ("hits", self._per_encoder(lambda stats: stats.graph_hits)),
            ("misses", self._observe_misses),
            ("captures", self._per_encoder(lambda stats: stats.num_graphs)),
            ("capture_failures", self._per_encoder(lambda stats: stats.capture_failures)),
            ("memory_deferrals", self._per_encoder(lambda stats: stats.memory_deferrals)),
            ("phase_calls", self._observe_phase_calls),
            ("phase_captures", self._observe_phase_captures),
            ("bus_dropped", self._observe_dropped),
        ):
            spec = METRICS[key]
            meter.create_observable_counter(
                spec.otel, observable(key, read), unit=spec.unit, description=spec.description
            )
        for key, read in (
            ("graphs", self._per_encoder(lambda stats: stats.num_graphs)),
            ("max_graphs", self._observe_cap),
            ("pool_memory", self._per_encoder(_pool_bytes)),
        ):
            spec = METRICS[key]
            meter.create_observable_gauge(
                spec.otel, observable(key, read), unit=spec.unit, description=spec.description
            )

        def histogram(key: str, buckets: tuple[float, ...]) -> Any:
            spec = METRICS[key]
            return meter.create_histogram(
                spec.otel,
                unit=spec.unit,
                description=spec.description,
                explicit_bucket_boundaries_advisory=buckets,
            )

        self._capture_duration = histogram("capture_duration", CAPTURE_DURATION_BUCKETS)
        self._call_duration = histogram("call_duration", CALL_DURATION_BUCKETS)
        self._call_device_duration = histogram("call_device_duration", CALL_DURATION_BUCKETS)
        self._request_phase_duration = histogram("request_phase_duration", REQUEST_PHASE_BUCKETS)
        # One attribute dict per (encoder, kind, phase): a call's record builds none.
        self._call_attributes: dict[tuple[str, str, ev.Phase], dict[str, str]] = {}

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

    def handle(self, events: Sequence[ev.Event]) -> None:
        """Make the spans of ``events``, record their call times, and record new captures
        in the duration histogram.

        An event that fails is counted in :attr:`errors` (the first failure is logged);
        the rest of the batch goes on, and nothing is raised.

        Args:
            events: one batch, in emission order.
        """
        for event in events:
            try:
                if isinstance(event, (ev.GraphReplayed, ev.GraphMissed, ev.DeviceTimed)):
                    self._record_call(event)
                else:
                    self._span_for(event)
            except Exception as exc:
                self._errors(
                    "OTel sink failed on %s: %s: %s", type(event).__name__, _name(exc), exc
                )
        self._record_capture_durations()

    def close(self) -> None:
        """Record captures not yet in the histogram; the providers stay the app's to shut down."""
        self._record_capture_durations()

    # -- call times -----------------------------------------------------------------------

    def _attributes(self, adapter: str, kind: str, phase: ev.Phase) -> dict[str, str]:
        key = (adapter, kind, phase)
        attributes = self._call_attributes.get(key)
        if attributes is None:
            attributes = self._call_attributes[key] = {
                ATTR.ENCODER: adapter,
                ATTR.CALL_KIND: kind,
                ATTR.PHASE: phase.value,
            }
        return attributes

    def _record_call(self, event: ev.GraphReplayed | ev.GraphMissed | ev.DeviceTimed) -> None:
        if isinstance(event, ev.DeviceTimed):
            attributes = self._attributes(event.adapter, event.kind, event.phase)
            self._call_device_duration.record(event.device_s, attributes)
            return
        duration = event.duration_s
        if duration is None:  # a model-level fallback: the adapter did not run it
            return
        kind = "replay" if isinstance(event, ev.GraphReplayed) else "eager"
        self._call_duration.record(duration, self._attributes(event.adapter, kind, event.phase))

    # -- spans ----------------------------------------------------------------------------

    def _span_for(self, event: ev.Event) -> None:
        match event:
            case ev.GraphCaptured():
                attributes: dict[str, Any] = {
                    ATTR.ENCODER: event.adapter,
                    **_key_attributes(event.signature),
                    ATTR.DEVICE: event.device,
                    ATTR.STREAM: event.stream,
                    ATTR.CAPTURE_STREAM: event.capture_stream,
                    ATTR.POOL_ID: event.pool_id,
                    ATTR.CAPTURE_DURATION: event.duration_s,
                    ATTR.BYTES_RESERVED: event.bytes_reserved,
                    ATTR.STATIC_BYTES: event.static_bytes,
                    ATTR.GRAPH_INDEX: event.graph_index,
                    ATTR.PHASE: event.phase.value,
                }
                if event.free_bytes is not None:  # OTel attributes cannot be None
                    attributes[ATTR.FREE_BYTES] = event.free_bytes
                end_ns = event.epoch_ns + max(0, round(event.duration_s * 1e9))
                self._emit_span(SPANS.CAPTURE, event.epoch_ns, end_ns, attributes)
            case ev.MemoryDeferred():
                attributes = {
                    ATTR.ENCODER: event.adapter,
                    **_key_attributes(event.signature),
                    ATTR.DEVICE: event.device,
                    ATTR.FREE_BYTES: event.free_bytes,
                    ATTR.FLOOR_BYTES: event.floor_bytes,
                    ATTR.PHASE: event.phase.value,
                }
                if event.cached_bytes is not None:  # OTel attributes cannot be None
                    attributes[ATTR.CACHED_BYTES] = event.cached_bytes
                if event.need_bytes is not None:
                    attributes[ATTR.NEED_BYTES] = event.need_bytes
                self._emit_span(SPANS.MEMORY_DEFERRAL, event.epoch_ns, event.epoch_ns, attributes)
            case ev.CaptureFailed():
                # The event marks the moment the capture raised; its start is not recorded,
                # so the failure is an instant on the timeline.
                attributes = {
                    ATTR.ENCODER: event.adapter,
                    **_key_attributes(event.signature),
                    ATTR.DEVICE: event.device,
                    ATTR.STREAM: event.stream,
                    ATTR.ERROR_TYPE: event.error_type,
                    ATTR.PHASE: event.phase.value,
                }
                self._emit_span(
                    SPANS.CAPTURE_FAILURE, event.epoch_ns, event.epoch_ns, attributes, event
                )
            case ev.ProfilingObserved():
                # An instant on the encoder's timeline, before its captures: a trace then
                # shows whether the first captures came after a run that never called it.
                attributes = {
                    ATTR.ENCODER: event.adapter,
                    ATTR.PROFILING_RUNNER: event.runner,
                    ATTR.PROFILING_CALLS: event.encoder_calls,
                    ATTR.PHASE: event.phase.value,
                }
                self._emit_span(SPANS.PROFILING_RUN, event.epoch_ns, event.epoch_ns, attributes)
            case ev.RequestTimed():
                self._request_spans(event)
            case _:
                # Hits and misses are counters and histograms: a span event per replay on a
                # long-lived span would hit the SDK's per-span event cap within seconds.
                pass

    def _request_spans(self, event: ev.RequestTimed) -> None:
        """A request span from arrival to first token, in the client's trace when it sent
        a ``traceparent``, with a child span per phase this process observed."""
        from omnitrace.requests import PHASES, kind_of, phases_of

        # The event's monotonic timestamps, put on the epoch clock of its own stamp.
        offset = event.epoch_ns - event.monotonic_ns
        if event.arrival_ns + offset < 0:
            # An epoch stamp before its own arrival (a hand-edited or foreign log line): the
            # exporter refuses negative times and would drop the whole batch with it.
            offset = -event.arrival_ns
        parent = _ROOT_CONTEXT
        if event.trace_id and event.parent_span_id:
            remote = otel_trace.SpanContext(
                int(event.trace_id, 16),
                int(event.parent_span_id, 16),
                is_remote=True,
                trace_flags=otel_trace.TraceFlags(otel_trace.TraceFlags.SAMPLED),
            )
            parent = otel_trace.set_span_in_context(otel_trace.NonRecordingSpan(remote))
        kind = kind_of(event)
        phases = phases_of(event)
        # Every phase once per request (zeros too): each phase's count is the requests, and
        # the phases' sums add up to the TTFT's.
        for phase in PHASES:
            self._request_phase_duration.record(
                phases[phase], {ATTR.REQUEST_KIND: kind, ATTR.REQUEST_PHASE: phase}
            )
        span = self._tracer.start_span(
            SPANS.REQUEST,
            context=parent,
            kind=SpanKind.INTERNAL,
            attributes={
                ATTR.REQUEST_ID: event.request_id,
                ATTR.REQUEST_ENGINE_ID: event.engine_request_id,
                ATTR.REQUEST_KIND: kind,
                ATTR.REQUEST_TTFT: event.ttft_s,
            },
            start_time=event.arrival_ns + offset,
        )
        inside = otel_trace.set_span_in_context(span)
        start = event.arrival_ns
        for phase in PHASES:
            seconds = phases[phase]
            if seconds <= 0:
                continue
            end = start + int(seconds * 1e9)
            child = self._tracer.start_span(
                SPANS.REQUEST_PHASE,
                context=inside,
                kind=SpanKind.INTERNAL,
                attributes={ATTR.REQUEST_PHASE: phase, ATTR.REQUEST_KIND: kind},
                start_time=start + offset,
            )
            child.end(end_time=end + offset)
            self._spans += 1
            start = end
        span.end(end_time=event.monotonic_ns + offset)
        self._spans += 1

    def _emit_span(
        self,
        name: str,
        start_ns: int,
        end_ns: int,
        attributes: Mapping[str, Any],
        failure: ev.CaptureFailed | None = None,
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

    def _per_encoder(
        self, value: Callable[[AdapterStats], int]
    ) -> Callable[[], Iterator[Observation]]:
        """One observation per encoder of ``value(stats)``, 0 for one that has no stats yet."""

        def read() -> Iterator[Observation]:
            for name, stats in self._adapters():
                yield Observation(value(stats) if stats else 0, {ATTR.ENCODER: name})

        return read

    def _observe_misses(self) -> Iterator[Observation]:
        for name, stats in self._adapters():
            for reason in ev.MissReason:
                value = stats.misses[reason] if stats else 0
                yield Observation(value, {ATTR.ENCODER: name, ATTR.MISS_REASON: reason.value})

    def _coverage(self) -> Iterator[tuple[str, AdapterCoverage | None]]:
        coverage = self._bus.coverage()
        for name in (*coverage, *(n for n in self._bus.adapters() if n not in coverage)):
            yield name, coverage.get(name)

    def _observe_phase_calls(self) -> Iterator[Observation]:
        for name, coverage in self._coverage():
            for phase in ev.Phase:
                calls = coverage.in_phase(phase).calls if coverage else 0
                yield Observation(calls, {ATTR.ENCODER: name, ATTR.PHASE: phase.value})

    def _observe_phase_captures(self) -> Iterator[Observation]:
        for name, coverage in self._coverage():
            for phase in ev.Phase:
                captures = coverage.in_phase(phase).captures if coverage else 0
                yield Observation(captures, {ATTR.ENCODER: name, ATTR.PHASE: phase.value})

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


def _pool_bytes(stats: AdapterStats) -> int:
    """Device memory an adapter's graphs hold: pool growth plus static buffers."""
    return sum(g.bytes_reserved + g.static_bytes for g in stats.graphs)


# -- the app edge: SDK, exporters, Prometheus ----------------------------------------------
