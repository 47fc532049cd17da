"""The OpenTelemetry sink and SDK wiring, exported for real to loopback OTLP receivers."""

from __future__ import annotations

import logging
import os
import re
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from opentelemetry.proto.metrics.v1.metrics_pb2 import AggregationTemporality, Metric
from opentelemetry.proto.trace.v1.trace_pb2 import Span, Status
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from omnitrace import (
    CaptureFailed,
    EncoderCudaGraph,
    EncoderGraphConfig,
    Event,
    EventBus,
    GraphCaptured,
    GraphMissed,
    GraphReplayed,
    MemoryDeferred,
    MissReason,
    derive_stats,
)
from omnitrace.events import DeviceTimed, profiling_observed
from omnitrace.otlp_receiver import OTLPReceiver, attributes
from omnitrace.signature import Signature
from omnitrace.sinks.names import ATTR, METRICS, SPANS
from omnitrace.sinks.otel import CALL_DURATION_BUCKETS, CAPTURE_DURATION_BUCKETS, OTelSink
from omnitrace.sinks.otel.sdk import OTelSetup, configure_sdk
from omnitrace.testing import SimulatedGraphBackend, capture_events

PROTOCOLS = ["http/protobuf", "grpc"]

VISION_CFG = EncoderGraphConfig(
    max_graphs=1, min_capture_calls=2, min_free_bytes=0, device_timing=True
)
AUDIO_CFG = EncoderGraphConfig(max_graphs=2, min_free_bytes=1 << 30)
BROKEN_CFG = EncoderGraphConfig(min_free_bytes=0)
CAPTURE_ERROR = "simulated capture failure: out of memory"


def _vision(x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    return x * 2 if mask is None else x * mask


def _audio(x: torch.Tensor) -> torch.Tensor:
    return x.cumsum(-1)


@dataclass
class Scenario:
    """What one run of real adapters emitted, and the adapters themselves."""

    events: list[Event]
    graphs: dict[str, EncoderCudaGraph]

    def of(self, kind: type[Any]) -> list[Any]:
        return [e for e in self.events if isinstance(e, kind)]


def _request_event() -> Any:
    """One image request timed from arrival to first token (10 ms to 100 ms), with a
    traceparent; every phase but ``encoders`` observed."""
    from omnitrace.events import NO_SIGNATURE, RequestTimed

    ms = 1_000_000
    return RequestTimed(
        "",
        NO_SIGNATURE,
        100 * ms,
        5_000 * ms,
        "chatcmpl-1",
        "chatcmpl-1-ab",
        10 * ms,
        12 * ms,
        20 * ms,
        50 * ms,
        51 * ms,
        52 * ms,
        99 * ms,
        0.090,
        1,
        448 * 448,
        0,
        0.0,
        "4bf92f3577b34da6a3ce929d0e0e4736",
        "00f067aa0ba902b7",
    )


def run_scenario(bus: EventBus) -> Scenario:
    """Drive three adapters through a capture, hits, every miss reason, a deferral, a failure."""
    vision = EncoderCudaGraph(
        _vision, name="vision", config=VISION_CFG, bus=bus, backend=SimulatedGraphBackend()
    )
    audio = EncoderCudaGraph(
        _audio,
        name="audio",
        config=AUDIO_CFG,
        bus=bus,
        backend=SimulatedGraphBackend(free_bytes=1 << 20, cached_bytes=3 << 20),
    )
    broken = EncoderCudaGraph(
        _audio,
        name="broken",
        config=BROKEN_CFG,
        bus=bus,
        backend=SimulatedGraphBackend(fail_on_capture=RuntimeError(CAPTURE_ERROR)),
    )
    x = torch.ones(1, 8, 16, dtype=torch.bfloat16)
    with capture_events(bus) as events, torch.no_grad():
        vision.set_phase("profiling")
        vision(x, None)  # warm-up miss, in the profiling phase
        vision.set_phase("serving")
        for _ in range(2):  # capture (a hit), hit
            vision(x, None)
        vision(torch.ones(1, 4, 16), None)  # capacity miss: the one slot is taken
        with torch.enable_grad():
            vision(x, None)  # ineligible miss
        for _ in range(2):  # warm-up miss, then deferred under the memory floor
            audio(torch.ones(2, 50))
        broken(torch.ones(3, 5))
        with pytest.raises(RuntimeError, match="out of memory"):
            broken(torch.ones(3, 5))
        assert vision.flush_device_timing()
    return Scenario(list(events), {"vision": vision, "audio": audio, "broken": broken})


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(params=PROTOCOLS)
def exported(
    request: pytest.FixtureRequest, bus: EventBus, monkeypatch: pytest.MonkeyPatch
) -> Iterator[tuple[OTLPReceiver, OTelSetup, OTelSink]]:
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("LOCAL_RANK", "1")
    with OTLPReceiver(request.param) as receiver:
        setup = configure_sdk(
            service_name="omnitrace-test",
            endpoint=receiver.endpoint,
            protocol=request.param,
            export_interval_s=600,
        )
        sink = OTelSink(
            bus, tracer_provider=setup.tracer_provider, meter_provider=setup.meter_provider
        )
        bus.add_sink(sink)
        try:
            yield receiver, setup, sink
        finally:
            bus.close()
            setup.shutdown()


def _span_for(spans: Sequence[Span], name: str, encoder: str) -> Span:
    found = [
        s for s in spans if s.name == name and attributes(s.attributes)[ATTR.ENCODER] == encoder
    ]
    assert len(found) == 1, [(s.name, attributes(s.attributes)) for s in spans]
    return found[0]


def _points(metric: Metric) -> dict[tuple[tuple[str, Any], ...], Any]:
    data = getattr(metric, metric.WhichOneof("data"))
    return {tuple(sorted(attributes(p.attributes).items())): p for p in data.data_points}


def _value(point: Any) -> float:
    return point.as_int if point.WhichOneof("value") == "as_int" else point.as_double


# -- spans over OTLP ---------------------------------------------------------------------


def test_capture_span_carries_the_event_times_and_attributes(
    exported: tuple[OTLPReceiver, OTelSetup, OTelSink], bus: EventBus
) -> None:
    """A capture becomes one root span from its start to start + duration, with its facts."""
    receiver, setup, sink = exported
    scenario = run_scenario(bus)
    assert bus.flush(5.0)
    assert setup.force_flush()
    assert receiver.wait_for(lambda r: len(r.spans()) >= 3)

    (captured,) = scenario.of(GraphCaptured)
    span = _span_for(receiver.spans(), SPANS.CAPTURE, "vision")
    assert span.start_time_unix_nano == captured.epoch_ns
    assert span.end_time_unix_nano == captured.epoch_ns + round(captured.duration_s * 1e9)
    assert span.end_time_unix_nano > span.start_time_unix_nano
    assert span.kind == Span.SpanKind.SPAN_KIND_INTERNAL
    assert span.parent_span_id == b""
    assert span.status.code == Status.StatusCode.STATUS_CODE_UNSET
    assert attributes(span.attributes) == {
        ATTR.ENCODER: "vision",
        ATTR.KEY: captured.key,
        ATTR.DTYPE: "bfloat16",
        ATTR.SHAPES: ("[1,8,16]", "None"),
        ATTR.DEVICE: "cpu",
        ATTR.STREAM: captured.stream,
        ATTR.CAPTURE_STREAM: captured.capture_stream,
        ATTR.POOL_ID: captured.pool_id,
        ATTR.CAPTURE_DURATION: captured.duration_s,
        ATTR.BYTES_RESERVED: captured.bytes_reserved,
        ATTR.STATIC_BYTES: captured.static_bytes,
        ATTR.GRAPH_INDEX: 0,
        ATTR.FREE_BYTES: captured.free_bytes,
        ATTR.PHASE: "serving",
    }
    assert captured.key == "bfloat16[1,8,16], None @cpu s=0"
    assert captured.free_bytes == 80 << 30  # the simulated device's free memory
    assert sink.spans == 3


def test_a_profiling_run_is_an_instant_span_per_encoder_with_its_calls(
    exported: tuple[OTLPReceiver, OTelSetup, OTelSink], bus: EventBus
) -> None:
    """A ProfilingObserved becomes an instant span naming the runner and the encoder's calls."""
    receiver, setup, _ = exported
    runner = "vllm.v1.worker.gpu.model_runner.GPUModelRunner.profile_run"
    observed = profiling_observed("vision", runner, 0)
    bus.emit(observed)
    assert bus.flush(5.0)
    assert setup.force_flush()
    assert receiver.wait_for(lambda r: r.spans(SPANS.PROFILING_RUN))
    span = _span_for(receiver.spans(), SPANS.PROFILING_RUN, "vision")
    assert span.start_time_unix_nano == span.end_time_unix_nano == observed.epoch_ns
    assert attributes(span.attributes) == {
        ATTR.ENCODER: "vision",
        ATTR.PROFILING_RUNNER: runner,
        ATTR.PROFILING_CALLS: 0,
        ATTR.PHASE: "profiling",
    }


def test_memory_deferral_span_records_free_bytes_and_floor(
    exported: tuple[OTLPReceiver, OTelSetup, OTelSink], bus: EventBus
) -> None:
    """A memory deferral becomes an instant span with the free bytes and the floor it was under."""
    receiver, setup, _ = exported
    scenario = run_scenario(bus)
    assert bus.flush(5.0)
    assert setup.force_flush()
    assert receiver.wait_for(lambda r: r.spans(SPANS.MEMORY_DEFERRAL))

    (deferred,) = scenario.of(MemoryDeferred)
    span = _span_for(receiver.spans(), SPANS.MEMORY_DEFERRAL, "audio")
    assert span.start_time_unix_nano == span.end_time_unix_nano == deferred.epoch_ns
    assert attributes(span.attributes) == {
        ATTR.ENCODER: "audio",
        ATTR.KEY: deferred.key,
        ATTR.DTYPE: "float32",
        ATTR.SHAPES: ("[2,50]",),
        ATTR.DEVICE: "cpu",
        ATTR.FREE_BYTES: 1 << 20,
        ATTR.FLOOR_BYTES: AUDIO_CFG.min_free_bytes,
        ATTR.CACHED_BYTES: 3 << 20,
        ATTR.PHASE: "serving",
    }
    assert span.status.code == Status.StatusCode.STATUS_CODE_UNSET


def test_capture_failure_span_has_error_status_and_exception_event(
    exported: tuple[OTLPReceiver, OTelSetup, OTelSink], bus: EventBus
) -> None:
    """A capture failure becomes an ERROR span with error.type and an exception event."""
    receiver, setup, _ = exported
    scenario = run_scenario(bus)
    assert bus.flush(5.0)
    assert setup.force_flush()
    assert receiver.wait_for(lambda r: len(r.spans()) >= 3)

    (failed,) = scenario.of(CaptureFailed)
    span = _span_for(receiver.spans(), SPANS.CAPTURE_FAILURE, "broken")
    assert span.status.code == Status.StatusCode.STATUS_CODE_ERROR
    assert span.status.message == f"RuntimeError: {CAPTURE_ERROR}"
    assert span.start_time_unix_nano == span.end_time_unix_nano == failed.epoch_ns
    assert attributes(span.attributes) == {
        ATTR.ENCODER: "broken",
        ATTR.KEY: failed.key,
        ATTR.DTYPE: "float32",
        ATTR.SHAPES: ("[3,5]",),
        ATTR.DEVICE: "cpu",
        ATTR.STREAM: failed.stream,
        ATTR.ERROR_TYPE: "RuntimeError",
        ATTR.PHASE: "serving",
    }
    (event,) = span.events
    assert event.name == "exception"
    assert event.time_unix_nano == failed.epoch_ns
    assert attributes(event.attributes) == {
        "exception.type": "RuntimeError",
        "exception.message": CAPTURE_ERROR,
    }


def test_exported_resource_names_service_pid_and_rank(
    exported: tuple[OTLPReceiver, OTelSetup, OTelSink], bus: EventBus
) -> None:
    """Spans and metrics carry service.name, process.pid and the rank from RANK/LOCAL_RANK."""
    receiver, setup, _ = exported
    run_scenario(bus)
    assert bus.flush(5.0)
    assert setup.force_flush()
    assert receiver.wait_for(lambda r: r.spans() and r.metrics_requests)
    span_resource = attributes(receiver.resource_spans()[0].resource.attributes)
    metric_resource = attributes(
        receiver.metrics_requests[-1].resource_metrics[0].resource.attributes
    )
    for resource in (span_resource, metric_resource):
        assert resource[ATTR.SERVICE_NAME] == "omnitrace-test"
        assert resource[ATTR.PROCESS_PID] == os.getpid()
        assert resource[ATTR.RANK] == 3
        assert resource[ATTR.LOCAL_RANK] == 1
    scope = receiver.trace_requests[0].resource_spans[0].scope_spans[0].scope
    assert scope.name == "omnitrace"


# -- metrics over OTLP -------------------------------------------------------------------


def test_exported_counters_equal_the_stats_fold(
    exported: tuple[OTLPReceiver, OTelSetup, OTelSink], bus: EventBus
) -> None:
    """Hits, misses by reason, captures, failures and deferrals equal each adapter's own stats."""
    receiver, setup, _ = exported
    scenario = run_scenario(bus)
    assert bus.flush(5.0)
    assert setup.force_flush()
    assert receiver.wait_for(lambda r: r.latest_metric(METRICS["hits"].otel) is not None)

    derived = derive_stats(scenario.events)
    expected: dict[str, dict[tuple[tuple[str, Any], ...], float]] = {
        key: {} for key in ("hits", "misses", "captures", "capture_failures", "memory_deferrals")
    }
    for name, graph in scenario.graphs.items():
        stats = graph.get_cumulative_stats()
        assert stats == derived[name]
        enc = ((ATTR.ENCODER, name),)
        expected["hits"][enc] = stats["graph_hits"]
        expected["captures"][enc] = stats["num_graphs"]
        expected["capture_failures"][enc] = stats["capture_failures"]
        expected["memory_deferrals"][enc] = graph.stats().memory_deferrals
        for reason in MissReason:
            labels = tuple(sorted({ATTR.ENCODER: name, ATTR.MISS_REASON: reason.value}.items()))
            expected["misses"][labels] = stats[f"{reason.value}_misses"]
    # The scenario really exercises every counter, so equality is not trivially 0 == 0.
    assert derived["vision"]["graph_hits"] == 2
    assert {r: derived["vision"][f"{r}_misses"] for r in ("warmup", "capacity", "ineligible")} == {
        "warmup": 1,
        "capacity": 1,
        "ineligible": 1,
    }
    assert derived["audio"]["memory_misses"] == 1
    assert derived["broken"]["capture_failures"] == 1

    for key, want in expected.items():
        spec = METRICS[key]
        metric = receiver.latest_metric(spec.otel)
        assert metric is not None, spec.otel
        assert metric.WhichOneof("data") == "sum"
        assert metric.sum.is_monotonic
        assert (
            metric.sum.aggregation_temporality
            == AggregationTemporality.AGGREGATION_TEMPORALITY_CUMULATIVE
        )
        assert metric.unit == spec.unit
        assert metric.description == spec.description
        got = {labels: _value(p) for labels, p in _points(metric).items()}
        assert got == want, key


def test_exported_gauges_report_graphs_held_and_the_cap(
    exported: tuple[OTLPReceiver, OTelSetup, OTelSink], bus: EventBus
) -> None:
    """The graphs gauge reports graphs held and max_graphs the configured cap, per encoder."""
    receiver, setup, _ = exported
    scenario = run_scenario(bus)
    assert bus.flush(5.0)
    assert setup.force_flush()
    assert receiver.wait_for(lambda r: r.latest_metric(METRICS["max_graphs"].otel) is not None)
    configs = {"vision": VISION_CFG, "audio": AUDIO_CFG, "broken": BROKEN_CFG}
    for key, want in (
        ("graphs", {n: g.num_graphs for n, g in scenario.graphs.items()}),
        ("max_graphs", {n: c.max_graphs for n, c in configs.items()}),
    ):
        metric = receiver.latest_metric(METRICS[key].otel)
        assert metric is not None
        assert metric.WhichOneof("data") == "gauge"
        got = {dict(labels)[ATTR.ENCODER]: _value(p) for labels, p in _points(metric).items()}
        assert got == want
    assert scenario.graphs["vision"].num_graphs == 1


def test_exported_capture_histogram_counts_each_capture_duration(
    exported: tuple[OTLPReceiver, OTelSetup, OTelSink], bus: EventBus
) -> None:
    """The capture-duration histogram holds one observation per capture, in seconds buckets."""
    receiver, setup, _ = exported
    scenario = run_scenario(bus)
    assert bus.flush(5.0)
    assert setup.force_flush()
    spec = METRICS["capture_duration"]
    assert receiver.wait_for(lambda r: r.latest_metric(spec.otel) is not None)
    metric = receiver.latest_metric(spec.otel)
    assert metric is not None
    assert metric.unit == "s"
    ((labels, point),) = _points(metric).items()
    assert dict(labels) == {ATTR.ENCODER: "vision"}
    captures = scenario.of(GraphCaptured)
    assert point.count == len(captures) == 1
    assert point.sum == pytest.approx(sum(c.duration_s for c in captures))
    assert sum(point.bucket_counts) == point.count
    assert tuple(point.explicit_bounds) == CAPTURE_DURATION_BUCKETS


def test_call_time_histograms_count_each_call_by_kind_and_phase(
    exported: tuple[OTLPReceiver, OTelSetup, OTelSink], bus: EventBus
) -> None:
    """Host times of replays and eager runs, and device times where the adapter measures
    them, land in histograms per encoder, kind and phase, one observation per call."""
    receiver, setup, _ = exported
    scenario = run_scenario(bus)
    assert bus.flush(5.0)
    assert setup.force_flush()
    host, device = METRICS["call_duration"], METRICS["call_device_duration"]
    assert receiver.wait_for(lambda r: r.latest_metric(device.otel) is not None)
    expected: dict[tuple[str, str, str], list[float]] = {}
    measured: dict[tuple[str, str, str], list[float]] = {}
    for event in scenario.events:
        if isinstance(event, (GraphReplayed, GraphMissed)) and event.duration_s is not None:
            kind = "replay" if isinstance(event, GraphReplayed) else "eager"
            key = (event.adapter, kind, event.phase.value)
            expected.setdefault(key, []).append(event.duration_s)
        elif isinstance(event, DeviceTimed):
            key = (event.adapter, event.kind, event.phase.value)
            measured.setdefault(key, []).append(event.device_s)
    assert ("vision", "eager", "profiling") in expected
    assert {k for k in measured if k[0] != "vision"} == set()
    for spec, want in ((host, expected), (device, measured)):
        metric = receiver.latest_metric(spec.otel)
        assert metric is not None
        assert metric.unit == "s"
        got = {}
        for labels, point in _points(metric).items():
            named = dict(labels)
            key = (named[ATTR.ENCODER], named[ATTR.CALL_KIND], named[ATTR.PHASE])
            got[key] = (point.count, point.sum)
            assert tuple(point.explicit_bounds) == CALL_DURATION_BUCKETS
        assert got == {k: (len(v), pytest.approx(sum(v))) for k, v in want.items()}, spec.otel


def test_calls_and_captures_by_phase_and_pool_memory_read_the_folds(
    exported: tuple[OTLPReceiver, OTelSetup, OTelSink], bus: EventBus
) -> None:
    """Calls and captures per phase come from the coverage fold and add up to the stats;
    pool memory is what each encoder's captures took."""
    receiver, setup, _ = exported
    scenario = run_scenario(bus)
    assert bus.flush(5.0)
    assert setup.force_flush()
    assert receiver.wait_for(lambda r: r.latest_metric(METRICS["pool_memory"].otel) is not None)
    calls = receiver.latest_metric(METRICS["phase_calls"].otel)
    captures = receiver.latest_metric(METRICS["phase_captures"].otel)
    pool = receiver.latest_metric(METRICS["pool_memory"].otel)
    assert calls is not None
    assert captures is not None
    assert pool is not None
    by_phase = {
        (dict(labels)[ATTR.ENCODER], dict(labels)[ATTR.PHASE]): _value(p)
        for labels, p in _points(calls).items()
    }
    assert by_phase[("vision", "profiling")] == 1
    for name, graph in scenario.graphs.items():
        stats = graph.get_cumulative_stats()
        total = by_phase[(name, "serving")] + by_phase[(name, "profiling")]
        assert total == stats["graph_hits"] + stats["graph_misses"]
    captured = {
        (dict(labels)[ATTR.ENCODER], dict(labels)[ATTR.PHASE]): _value(p)
        for labels, p in _points(captures).items()
    }
    assert captured[("vision", "serving")] == 1
    assert captured[("vision", "profiling")] == 0
    held = {dict(labels)[ATTR.ENCODER]: _value(p) for labels, p in _points(pool).items()}
    sizes = {name: 0 for name in scenario.graphs}
    for event in scenario.of(GraphCaptured):
        sizes[event.adapter] += event.bytes_reserved + event.static_bytes
    assert held == sizes
    assert held["vision"] > 0


def test_exported_metric_attributes_are_the_declared_low_cardinality_ones(
    exported: tuple[OTLPReceiver, OTelSetup, OTelSink], bus: EventBus
) -> None:
    """Every exported data point uses exactly the attribute keys names.METRICS declares."""
    receiver, setup, _ = exported
    run_scenario(bus)
    bus.emit(_request_event())  # the vLLM plugin's API server: a timed request
    assert bus.flush(5.0)
    assert setup.force_flush()
    assert receiver.wait_for(lambda r: r.latest_metric(METRICS["bus_dropped"].otel) is not None)
    seen = set()
    for spec in METRICS.values():
        metric = receiver.latest_metric(spec.otel)
        assert metric is not None, spec.otel
        seen.add(metric.name)
        for labels in _points(metric):
            assert {k for k, _ in labels} == set(spec.attributes), spec.otel
    assert {m.name for m in receiver.metrics() if m.name.startswith("omnitrace.")} == seen


def test_bus_dropped_counter_reports_each_sinks_losses(
    exported: tuple[OTLPReceiver, OTelSetup, OTelSink], bus: EventBus
) -> None:
    """omnitrace.bus.dropped reports each sink's dropped events under its name."""
    receiver, setup, _ = exported
    release = threading.Event()

    class Stuck:
        name = "stuck"

        def handle(self, events: Sequence[Event]) -> None:
            release.wait(10.0)

    bus.add_sink(Stuck(), queue_size=1)
    try:
        run_scenario(bus)
        # The bus counts a drop when its pump moves events into the full queue, not at emit.
        deadline = time.monotonic() + 5.0
        while not (dropped := {s.name: s.dropped for s in bus.statistics().sinks})["stuck"]:
            assert time.monotonic() < deadline, "the stuck sink never dropped an event"
            time.sleep(0.01)
        assert setup.force_flush()
    finally:
        release.set()
    metric = receiver.latest_metric(METRICS["bus_dropped"].otel)
    assert metric is not None
    got = {dict(labels)[ATTR.SINK]: _value(p) for labels, p in _points(metric).items()}
    assert got["otel"] == dropped["otel"] == 0
    # Later events may also be dropped after the snapshot; the counter is at least as large.
    assert got["stuck"] >= dropped["stuck"]


# -- the sink without a network ----------------------------------------------------------


@pytest.fixture
def in_memory() -> Iterator[tuple[InMemorySpanExporter, InMemoryMetricReader, TracerProvider]]:
    spans = InMemorySpanExporter()
    tracer_provider = TracerProvider()
    tracer_provider.add_span_processor(SimpleSpanProcessor(spans))
    reader = InMemoryMetricReader()
    meter_provider = MeterProvider(metric_readers=[reader])
    yield spans, reader, tracer_provider
    tracer_provider.shutdown()
    meter_provider.shutdown()


def _sdk_points(reader: InMemoryMetricReader, name: str) -> list[Any]:
    data = reader.get_metrics_data()
    assert data is not None
    return [
        point
        for rm in data.resource_metrics
        for sm in rm.scope_metrics
        for metric in sm.metrics
        if metric.name == name
        for point in metric.data.data_points
    ]


def test_histogram_counts_every_capture_even_when_the_sink_queue_drops() -> None:
    """The histogram is fed from the stats fold, so captures lost to a full queue still count."""
    reader = InMemoryMetricReader()
    meter_provider = MeterProvider(metric_readers=[reader])
    tracer_provider = TracerProvider()
    # A long drain interval and a one-event queue: nearly every event is dropped for the sink.
    bus = EventBus(drain_interval=30.0)
    try:
        sink = OTelSink(bus, tracer_provider=tracer_provider, meter_provider=meter_provider)
        bus.add_sink(sink, queue_size=1)
        graph = EncoderCudaGraph(
            _audio,
            name="audio",
            config=EncoderGraphConfig(max_graphs=3, min_free_bytes=0),
            bus=bus,
            backend=SimulatedGraphBackend(),
        )
        with torch.no_grad():
            for width in (4, 5, 6):
                for _ in range(2):
                    graph(torch.ones(1, width))
        assert bus.flush(5.0)
        dropped = {s.name: s.dropped for s in bus.statistics().sinks}["otel"]
        assert dropped > 0
        (point,) = _sdk_points(reader, METRICS["capture_duration"].otel)
        assert point.count == graph.num_graphs == 3
        (captures,) = _sdk_points(reader, METRICS["captures"].otel)
        assert captures.value == 3
        (lost,) = _sdk_points(reader, METRICS["bus_dropped"].otel)
        assert lost.value == dropped
        assert sink.spans < 3
    finally:
        bus.close()
        meter_provider.shutdown()
        tracer_provider.shutdown()


def test_registered_adapters_report_zero_series_before_their_first_call() -> None:
    """An adapter that has not been called yet still reports its cap and zero hits."""
    reader = InMemoryMetricReader()
    provider = MeterProvider(metric_readers=[reader])
    bus = EventBus()
    try:
        OTelSink(bus, tracer_provider=TracerProvider(), meter_provider=provider)
        EncoderCudaGraph(
            _audio,
            name="idle",
            config=EncoderGraphConfig(max_graphs=7),
            bus=bus,
            backend=SimulatedGraphBackend(),
        )
        (cap,) = _sdk_points(reader, METRICS["max_graphs"].otel)
        assert (dict(cap.attributes), cap.value) == ({ATTR.ENCODER: "idle"}, 7)
        (hits,) = _sdk_points(reader, METRICS["hits"].otel)
        assert (dict(hits.attributes), hits.value) == ({ATTR.ENCODER: "idle"}, 0)
    finally:
        bus.close()
        provider.shutdown()


def test_a_signature_without_tensors_keeps_its_key_and_has_no_dtype(
    in_memory: tuple[InMemorySpanExporter, InMemoryMetricReader, TracerProvider],
) -> None:
    """Attributes come from the signature's fields: no tensor input, no dtype attribute."""
    spans, _, tracer_provider = in_memory
    bus = EventBus()
    try:
        sink = OTelSink(bus, tracer_provider=tracer_provider, meter_provider=MeterProvider())
        event = MemoryDeferred("custom", Signature((None,), 3), 1, 2_000, 10, 20, "cuda:1")
        sink.handle([event])
        (span,) = spans.get_finished_spans()
        assert span.attributes is not None
        assert dict(span.attributes) == {
            ATTR.ENCODER: "custom",
            ATTR.KEY: "None s=3",
            ATTR.SHAPES: ("None",),
            ATTR.DEVICE: "cuda:1",
            ATTR.FREE_BYTES: 10,
            ATTR.FLOOR_BYTES: 20,
            ATTR.PHASE: "serving",
        }
        assert (span.start_time, span.end_time) == (2_000, 2_000)
        needed = MemoryDeferred("custom", Signature((None,), 3), 3, 4_000, 10, 20, "cuda:1", 5, 70)
        sink.handle([needed])
        attributes = spans.get_finished_spans()[-1].attributes
        assert attributes is not None
        assert (attributes[ATTR.CACHED_BYTES], attributes[ATTR.NEED_BYTES]) == (5, 70)
    finally:
        bus.close()


def test_sink_defaults_to_the_global_providers(
    in_memory: tuple[InMemorySpanExporter, InMemoryMetricReader, TracerProvider],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Without explicit providers the sink takes the global tracer and meter providers."""
    spans, _, tracer_provider = in_memory
    local = InMemoryMetricReader()
    meter_provider = MeterProvider(metric_readers=[local])
    monkeypatch.setattr("opentelemetry.trace.get_tracer_provider", lambda: tracer_provider)
    monkeypatch.setattr("opentelemetry.metrics.get_meter_provider", lambda: meter_provider)
    bus = EventBus()
    try:
        bus.add_sink(OTelSink(bus))
        run_scenario(bus)
        assert bus.flush(5.0)
        assert {s.name for s in spans.get_finished_spans()} == {
            SPANS.CAPTURE,
            SPANS.MEMORY_DEFERRAL,
        }
        assert _sdk_points(local, METRICS["hits"].otel)
    finally:
        bus.close()
        meter_provider.shutdown()


def test_a_failing_tracer_is_counted_and_logged_once_never_raised(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """handle() swallows tracer errors per event, counts them and logs the first one only."""

    class BrokenTracer:
        def start_span(self, *args: Any, **kwargs: Any) -> Any:
            raise RuntimeError("tracer is broken")

    class BrokenProvider(TracerProvider):
        def get_tracer(self, *args: Any, **kwargs: Any) -> Any:
            return BrokenTracer()

    bus = EventBus()
    provider = MeterProvider()
    try:
        sink = OTelSink(bus, tracer_provider=BrokenProvider(), meter_provider=provider)
        bus.add_sink(sink)
        with caplog.at_level(logging.ERROR, logger="omnitrace.sinks.otel.sink"):
            run_scenario(bus)
            assert bus.flush(5.0)
        assert sink.errors == 3
        records = [r for r in caplog.records if r.name == "omnitrace.sinks.otel.sink"]
        assert len(records) == 1
        assert "tracer is broken" in records[0].getMessage()
        (stats,) = bus.statistics().sinks
        assert not stats.disabled
        assert stats.error is None
    finally:
        bus.close()
        provider.shutdown()


# -- a dead or failing endpoint ----------------------------------------------------------


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_dead_endpoint_neither_raises_nor_blocks_and_is_logged_once(
    protocol: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Exports to a closed port fail quietly: counted, one log line, no delay for the bus."""
    setup = configure_sdk(
        endpoint=f"http://127.0.0.1:{_free_port()}",
        protocol=protocol,  # type: ignore[arg-type]
        export_interval_s=600,
        export_timeout_s=1.0,
    )
    bus = EventBus()
    sink = OTelSink(bus, tracer_provider=setup.tracer_provider, meter_provider=setup.meter_provider)
    bus.add_sink(sink)
    try:
        with caplog.at_level(logging.INFO):
            start = time.monotonic()
            run_scenario(bus)
            assert bus.flush(5.0)
            # Span creation only enqueues in the batch processor; no network on this path.
            assert time.monotonic() - start < 2.0
            assert setup.force_flush() is False
            exporter_logs = len([r for r in caplog.records if r.name.startswith("opentelemetry")])
            assert setup.force_flush() is False
            assert len([r for r in caplog.records if r.name.startswith("opentelemetry")]) == (
                exporter_logs
            )
        failures = setup.export_failures
        assert failures["traces"] >= 1
        assert failures["metrics"] >= 2
        assert setup.export_successes == {"traces": 0, "metrics": 0}
        ours = [r for r in caplog.records if r.name == "omnitrace.sinks.otel.sdk"]
        assert len(ours) == 1
        assert ours[0].levelno == logging.WARNING
        assert "failed" in ours[0].getMessage()
        assert sink.errors == 0
        (stats,) = bus.statistics().sinks
        assert (stats.disabled, stats.dropped) == (False, 0)
    finally:
        bus.close()
        start = time.monotonic()
        setup.shutdown()
        assert time.monotonic() - start < 5.0


def test_export_failure_is_reported_again_only_after_a_recovery(
    caplog: pytest.LogCaptureFixture, bus: EventBus
) -> None:
    """A rejecting collector is logged once, its recovery once, and a new outage once more."""
    with OTLPReceiver() as receiver:
        setup = configure_sdk(endpoint=receiver.endpoint, export_interval_s=600)
        try:
            # Attached, so the bus-dropped counter has a point and every flush exports.
            bus.add_sink(
                OTelSink(
                    bus, tracer_provider=setup.tracer_provider, meter_provider=setup.meter_provider
                )
            )
            with caplog.at_level(logging.INFO, logger="omnitrace.sinks.otel.sdk"):
                receiver.reject = True
                assert setup.force_flush() is False
                assert setup.force_flush() is False
                warnings = [r for r in caplog.records if r.name == "omnitrace.sinks.otel.sdk"]
                assert [r.levelno for r in warnings] == [logging.WARNING]
                receiver.reject = False
                assert setup.force_flush() is True
                receiver.reject = True
                assert setup.force_flush() is False
            levels = [r.levelno for r in caplog.records if r.name == "omnitrace.sinks.otel.sdk"]
            assert levels == [logging.WARNING, logging.INFO, logging.WARNING]
            assert receiver.rejected == setup.export_failures["metrics"] == 3
            assert setup.export_successes["metrics"] == 1
        finally:
            setup.shutdown()


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_a_traces_only_backend_logs_the_metrics_outage_once_and_traces_still_flow(
    protocol: str, caplog: pytest.LogCaptureFixture, bus: EventBus
) -> None:
    """A backend refusing metrics (a bare Jaeger) costs one warning; spans keep arriving."""
    with OTLPReceiver(protocol) as receiver:  # type: ignore[arg-type]
        receiver.reject_signals = {"metrics"}
        setup = configure_sdk(
            endpoint=receiver.endpoint,
            protocol=protocol,  # type: ignore[arg-type]
            export_interval_s=600,
        )
        try:
            sink = OTelSink(
                bus, tracer_provider=setup.tracer_provider, meter_provider=setup.meter_provider
            )
            bus.add_sink(sink)
            with caplog.at_level(logging.INFO, logger="omnitrace.sinks.otel.sdk"):
                for _ in range(3):
                    run_scenario(bus)
                    assert bus.flush(5.0)
                    assert setup.force_flush() is False
            ours = [r for r in caplog.records if r.name == "omnitrace.sinks.otel.sdk"]
            assert [(r.levelno, "metrics" in r.getMessage()) for r in ours] == [
                (logging.WARNING, True)
            ]
            assert setup.export_failures == {"traces": 0, "metrics": 3}
            assert setup.export_successes["traces"] == 3
            # Three spans per scenario: a capture, a deferral and a failure.
            assert len(receiver.spans()) == 9
        finally:
            bus.close()
            setup.shutdown()


def test_otlp_metrics_off_sends_traces_only(bus: EventBus) -> None:
    """otlp_metrics=False exports spans over OTLP and no metrics at all."""
    with OTLPReceiver() as receiver:
        setup = configure_sdk(endpoint=receiver.endpoint, otlp_metrics=False)
        try:
            bus.add_sink(
                OTelSink(
                    bus, tracer_provider=setup.tracer_provider, meter_provider=setup.meter_provider
                )
            )
            run_scenario(bus)
            assert bus.flush(5.0)
            assert setup.force_flush() is True
            assert len(receiver.spans()) == 3
            assert receiver.metrics_requests == []
            assert setup.export_successes == {"traces": 1, "metrics": 0}
        finally:
            bus.close()
            setup.shutdown()


def test_a_busy_prometheus_port_raises_and_leaves_nothing_registered() -> None:
    """A scrape port already in use raises OSError and unregisters the reader again."""
    registry = CollectorRegistry()
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = int(taken.getsockname()[1])
        with pytest.raises(OSError, match="in use"):
            configure_sdk(
                otlp=False, prometheus=True, prometheus_port=port, prometheus_registry=registry
            )
    assert list(registry.collect()) == []


# -- SDK wiring --------------------------------------------------------------------------


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_endpoint_and_protocol_default_from_the_standard_environment(
    protocol: str, monkeypatch: pytest.MonkeyPatch, bus: EventBus
) -> None:
    """OTEL_EXPORTER_OTLP_ENDPOINT and OTEL_EXPORTER_OTLP_PROTOCOL pick the collector."""
    with OTLPReceiver(protocol) as receiver:  # type: ignore[arg-type]
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", receiver.endpoint)
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", protocol)
        setup = configure_sdk(export_interval_s=600)
        try:
            assert (setup.protocol, setup.endpoint) == (protocol, receiver.endpoint)
            bus.add_sink(
                OTelSink(
                    bus, tracer_provider=setup.tracer_provider, meter_provider=setup.meter_provider
                )
            )
            run_scenario(bus)
            assert bus.flush(5.0)
            assert setup.force_flush()
            assert receiver.wait_for(lambda r: len(r.spans()) == 3)
            assert receiver.wait_for(lambda r: r.latest_metric(METRICS["hits"].otel))
        finally:
            bus.close()
            setup.shutdown()


def test_receiver_decodes_gzip_compressed_exports(
    monkeypatch: pytest.MonkeyPatch, bus: EventBus
) -> None:
    """The HTTP receiver accepts gzip bodies, as exporters send with compression on."""
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_COMPRESSION", "gzip")
    with OTLPReceiver() as receiver:
        setup = configure_sdk(endpoint=receiver.endpoint, export_interval_s=600)
        try:
            bus.add_sink(
                OTelSink(
                    bus, tracer_provider=setup.tracer_provider, meter_provider=setup.meter_provider
                )
            )
            run_scenario(bus)
            assert bus.flush(5.0)
            assert setup.force_flush()
            assert {s.name for s in receiver.spans()} == {SPANS.CAPTURE, SPANS.MEMORY_DEFERRAL}
        finally:
            bus.close()
            setup.shutdown()


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (
            {"protocol": "http/json"},
            "protocol: expected one of http/protobuf, grpc (the OTLP protocols the "
            "OpenTelemetry Python exporters support), got 'http/json'",
        ),
        (
            {"export_timeout_s": 0},
            "export_timeout_s: expected a number of seconds from 0.01 to 600, got 0",
        ),
        (
            {"export_interval_s": True},
            "export_interval_s: expected a number of seconds from 0.01 to 86400, got True",
        ),
        ({"prometheus_port": 9464}, "prometheus_port: set prometheus=True to serve a scrape"),
        (
            {"prometheus": True, "prometheus_port": 70000},
            "prometheus_port: expected a port in [0, 65535], got 70000",
        ),
        ({"service_name": ""}, "service_name: expected a non-empty string, got ''"),
    ],
)
def test_configure_sdk_rejects_bad_arguments_naming_them(
    kwargs: dict[str, Any], message: str
) -> None:
    """A bad argument raises ValueError naming the argument, the expectation and the value."""
    with pytest.raises(ValueError, match=re.escape(message)):
        configure_sdk(**kwargs)


# -- Prometheus ----------------------------------------------------------------------------


def test_prometheus_scrape_exposes_exactly_the_declared_names(bus: EventBus) -> None:
    """Scraping the Prometheus endpoint yields exactly the prometheus names in names.METRICS."""
    registry = CollectorRegistry()
    setup = configure_sdk(
        otlp=False, prometheus=True, prometheus_port=0, prometheus_registry=registry
    )
    try:
        bus.add_sink(
            OTelSink(
                bus, tracer_provider=setup.tracer_provider, meter_provider=setup.meter_provider
            )
        )
        scenario = run_scenario(bus)
        bus.emit(_request_event())  # the vLLM plugin's API server: a timed request
        assert bus.flush(5.0)
        url = f"http://127.0.0.1:{setup.prometheus_port}/metrics"
        with urllib.request.urlopen(url, timeout=5.0) as response:
            text = response.read().decode()
    finally:
        bus.close()
        setup.shutdown()
    samples = [s for family in text_string_to_metric_families(text) for s in family.samples]
    scraped = {s.name for s in samples if s.name.startswith("omnitrace")}
    expected: set[str] = set()
    for spec in METRICS.values():
        if spec.kind == "histogram":
            expected |= {f"{spec.prometheus}_{suffix}" for suffix in ("bucket", "sum", "count")}
        else:
            expected.add(spec.prometheus)
    assert scraped == expected
    hits = {
        s.labels["omnitrace_encoder"]: s.value
        for s in samples
        if s.name == METRICS["hits"].prometheus
    }
    assert hits == {n: g.get_cumulative_stats()["graph_hits"] for n, g in scenario.graphs.items()}


# -- names and imports -------------------------------------------------------------------


def test_metric_names_follow_otel_naming_rules_in_one_namespace() -> None:
    """Every instrument name is a lowercase dotted name under omnitrace., unique, <= 255 chars."""
    pattern = re.compile(r"omnitrace(\.[a-z][a-z0-9_]*)+")
    names = [spec.otel for spec in METRICS.values()]
    assert len(set(names)) == len(names)
    for spec in METRICS.values():
        assert pattern.fullmatch(spec.otel), spec.otel
        assert len(spec.otel) <= 255
        assert not spec.otel.endswith("_total")
        # A request's kind is its modalities and item counts (bounded by vLLM's
        # limit_mm_per_prompt), never an id or a size.
        low_cardinality = {
            ATTR.ENCODER,
            ATTR.MISS_REASON,
            ATTR.SINK,
            ATTR.PHASE,
            ATTR.CALL_KIND,
            ATTR.REQUEST_KIND,
            ATTR.REQUEST_PHASE,
        }
        assert set(spec.attributes) <= low_cardinality
    for name in (SPANS.CAPTURE, SPANS.MEMORY_DEFERRAL, SPANS.CAPTURE_FAILURE):
        assert pattern.fullmatch(name), name


def test_importing_omnitrace_does_not_import_opentelemetry() -> None:
    """import omnitrace (and omnitrace.sinks) loads no OTel, nor do the OpenTelemetry face and
    the relay (which runs the export in a child); the sink module loads no SDK."""
    code = (
        "import sys, omnitrace, omnitrace.sinks\n"
        "assert not [m for m in sys.modules if m.startswith('opentelemetry')], 'core'\n"
        "import omnitrace.sinks.otel, omnitrace.sinks.otel.relay\n"
        "assert not [m for m in sys.modules if m.startswith('opentelemetry')], 'relay'\n"
        "from omnitrace.sinks.otel import OTelSink\n"
        "assert 'opentelemetry.trace' in sys.modules\n"
        "assert not [m for m in sys.modules if m.startswith('opentelemetry.sdk')], 'sdk'\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False
    )
    assert result.returncode == 0, result.stderr


def test_install_global_lets_a_sink_without_providers_export() -> None:
    """configure_sdk(install_global=True) makes OTelSink(bus) export through the new SDK."""
    # Global providers can be set once per process, so this runs in a fresh interpreter.
    code = (
        "import torch\n"
        "from omnitrace import EncoderCudaGraph, EncoderGraphConfig, EventBus\n"
        "from omnitrace.sinks.otel import OTelSink\n"
        "from omnitrace.sinks.otel.sdk import configure_sdk\n"
        "from omnitrace.testing import SimulatedGraphBackend\n"
        "from omnitrace.otlp_receiver import OTLPReceiver\n"
        "with OTLPReceiver() as receiver:\n"
        "    setup = configure_sdk(endpoint=receiver.endpoint, install_global=True)\n"
        "    bus = EventBus()\n"
        "    bus.add_sink(OTelSink(bus))\n"
        "    graph = EncoderCudaGraph(lambda x: x + 1, name='g', bus=bus,\n"
        "        config=EncoderGraphConfig(min_free_bytes=0), backend=SimulatedGraphBackend())\n"
        "    with torch.no_grad():\n"
        "        graph(torch.ones(2)); graph(torch.ones(2))\n"
        "    bus.close()\n"
        "    assert setup.force_flush()\n"
        "    print(sorted(s.name for s in receiver.spans()))\n"
        "    hits = receiver.latest_metric('omnitrace.encoder.graph.hits')\n"
        "    print(hits.sum.data_points[0].as_int)\n"
        "    setup.shutdown()\n"
    )
    result = subprocess.run(
        [sys.executable, "-W", "error", "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.split("\n")[:2] == [f"['{SPANS.CAPTURE}']", "1"]


def test_telemetry_doc_lists_every_exported_name() -> None:
    """docs/telemetry.md names every span, span attribute and metric (OTel and Prometheus)."""
    doc = (Path(__file__).resolve().parents[2] / "docs" / "telemetry.md").read_text()
    names = {SPANS.CAPTURE, SPANS.MEMORY_DEFERRAL, SPANS.PROFILING_RUN, SPANS.EXCEPTION_EVENT}
    names |= {v for k, v in vars(ATTR).items() if k.isupper()}
    for spec in METRICS.values():
        names |= {spec.otel, spec.prometheus, spec.unit}
    missing = sorted(n for n in names if f"`{n}`" not in doc)
    assert missing == []


def test_a_timed_request_is_a_span_in_the_client_s_trace_with_a_child_per_phase(
    in_memory: tuple[InMemorySpanExporter, InMemoryMetricReader, TracerProvider],
) -> None:
    """A RequestTimed with a traceparent becomes an ``omnitrace.request`` span in that trace,
    parented on the client's span, with one phase span per observed phase inside it."""
    spans, _, tracer_provider = in_memory
    ms = 1_000_000
    event = _request_event()
    bus = EventBus()
    try:
        sink = OTelSink(bus, tracer_provider=tracer_provider, meter_provider=MeterProvider())
        sink.handle([event])
    finally:
        bus.close()
    finished = spans.get_finished_spans()
    (request,) = [s for s in finished if s.name == SPANS.REQUEST]
    assert format(request.context.trace_id, "032x") == event.trace_id
    assert request.parent is not None
    assert format(request.parent.span_id, "016x") == event.parent_span_id
    assert request.attributes[ATTR.REQUEST_ID] == "chatcmpl-1"
    assert request.start_time == 4_910 * ms  # arrival on the epoch clock
    assert request.end_time == 5_000 * ms
    phases = [s for s in finished if s.name == SPANS.REQUEST_PHASE]
    assert [s.attributes[ATTR.REQUEST_PHASE] for s in phases] == [
        "http",
        "render",
        "processor",
        "to_engine",
        "queue",
        "prefill",
        "output",
    ]
    assert all(s.parent is not None and s.parent.span_id == request.context.span_id for s in phases)
    assert phases[0].start_time == request.start_time
    assert phases[-1].end_time == request.end_time


def test_each_request_records_every_phase_once_and_the_phases_add_up_to_its_ttft() -> None:
    """The request-phase histogram: one point per phase and request kind, each counted once
    per request (zeros too), their sums adding up to the requests' TTFT."""
    from omnitrace.requests import PHASES

    reader = InMemoryMetricReader()
    meter_provider = MeterProvider(metric_readers=[reader])
    tracer_provider = TracerProvider()
    bus = EventBus()
    try:
        sink = OTelSink(bus, tracer_provider=tracer_provider, meter_provider=meter_provider)
        sink.handle([_request_event(), _request_event()])
        points = {
            (p.attributes[ATTR.REQUEST_KIND], p.attributes[ATTR.REQUEST_PHASE]): p
            for p in _sdk_points(reader, METRICS["request_phase_duration"].otel)
        }
    finally:
        bus.close()
        tracer_provider.shutdown()
        meter_provider.shutdown()
    assert set(points) == {("image", phase) for phase in PHASES}
    assert all(p.count == 2 for p in points.values())
    assert sum(p.sum for p in points.values()) == pytest.approx(2 * 0.090)
    assert points[("image", "processor")].sum == pytest.approx(2 * 0.030)
    assert points[("image", "encoders")].sum == 0.0
