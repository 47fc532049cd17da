"""The structlog sink: event names, levels, fields, sampling and trace correlation."""

from __future__ import annotations

import io
import json
from collections.abc import Iterator

import pytest
import structlog
import torch
from opentelemetry.sdk.trace import TracerProvider
from structlog.testing import capture_logs

from omnitrace import (
    CaptureFailed,
    ConfigError,
    EncoderCudaGraph,
    EncoderGraphConfig,
    EventBus,
    GraphCaptured,
    GraphMissed,
    GraphReplayed,
    MemoryDeferred,
    MissReason,
)
from omnitrace.sinks.logs import LogSink, configure_logging
from omnitrace.sinks.names import LOG_EVENTS
from omnitrace.testing import SimulatedGraphBackend, sig

CAPTURED = GraphCaptured("vision", sig("float32[1,4]"), 10, 20, 0.5, 7, "cuda:0", 0, 9, 1024, 64, 0)
REPLAYED = GraphReplayed("vision", sig("float32[1,4]"), 11, 21, 0.001)
MISSED = GraphMissed("audio", sig("float32[1,80,100]"), 12, 22, MissReason.WARMUP, "call 1 of 2")
DEFERRED = MemoryDeferred("audio", sig("float32[1,80,300]"), 13, 23, 512, 1024, "cuda:0")
FAILED = CaptureFailed(
    "vision", sig("float32[1,8]"), 14, 24, "RuntimeError", "capture broke", "cuda:0", 0
)


@pytest.fixture(autouse=True)
def _reset_structlog() -> Iterator[None]:
    yield
    structlog.reset_defaults()


def test_each_event_is_logged_under_its_name_at_its_level() -> None:
    """Every event type becomes one line whose event name and level come from LOG_EVENTS."""
    sink = LogSink()
    with capture_logs() as logs:
        sink.handle([CAPTURED, REPLAYED, MISSED, DEFERRED, FAILED])
    assert [(line["event"], line["log_level"]) for line in logs] == [
        (name, LOG_EVENTS[name])
        for name in (
            "graph_captured",
            "graph_replayed",
            "graph_missed",
            "memory_deferred",
            "capture_failed",
        )
    ]
    assert [(line["event"], line["log_level"]) for line in logs][-1] == ("capture_failed", "error")


def test_capture_failed_line_carries_exception_type_and_message() -> None:
    """A capture failure is logged at error level with the encoder, key, type and message."""
    with capture_logs() as logs:
        LogSink().handle([FAILED])
    (line,) = logs
    assert line == {
        "event": "capture_failed",
        "log_level": "error",
        "encoder": "vision",
        "key": "float32[1,8]",
        "error_type": "RuntimeError",
        "message": "capture broke",
        "device": "cuda:0",
        "stream": 0,
        "event_epoch_ns": 24,
    }


def test_capture_and_deferral_lines_carry_pool_duration_and_memory() -> None:
    """Captures log pool id and duration; deferrals log free bytes against the floor."""
    with capture_logs() as logs:
        LogSink().handle([CAPTURED, DEFERRED])
    captured, deferred = logs
    assert (captured["pool_id"], captured["duration_s"], captured["graph_index"]) == (7, 0.5, 0)
    assert (captured["bytes_reserved"], captured["capture_stream"]) == (1024, 9)
    assert deferred["log_level"] == "warning"
    assert (deferred["free_bytes"], deferred["floor_bytes"]) == (512, 1024)


def test_miss_line_has_reason_and_detail_as_text() -> None:
    """A miss is logged with its reason as the plain enum value and its detail."""
    with capture_logs() as logs:
        LogSink().handle([MISSED])
    assert (logs[0]["reason"], logs[0]["detail"]) == ("warmup", "call 1 of 2")
    assert type(logs[0]["reason"]) is str


def test_sampling_keeps_one_in_n_per_encoder_and_counts_the_rest() -> None:
    """With sample_every=3, replays are logged 1st, 4th, 7th and the skipped ones counted."""
    sink = LogSink(sample_every=3)
    replays = [GraphReplayed("vision", sig("float32[1]"), i, i, 0.0) for i in range(7)]
    with capture_logs() as logs:
        sink.handle([*replays, CAPTURED, FAILED])
    logged = [line for line in logs if line["event"] == "graph_replayed"]
    assert [line["event_epoch_ns"] for line in logged] == [0, 3, 6]
    assert [line["skipped"] for line in logged] == [0, 2, 2]
    assert sink.skipped == 4
    assert [line["event"] for line in logs][-2:] == ["graph_captured", "capture_failed"]


def test_sample_every_must_be_positive() -> None:
    """A zero sampling rate is rejected with the option named."""
    with pytest.raises(
        ConfigError, match=r"^sample_every: expected a positive integer, got 0 \(int\)$"
    ):
        LogSink(sample_every=0)


def test_lines_inside_an_otel_span_carry_its_trace_and_span_ids() -> None:
    """When a span is current, each line gets its hex trace_id and span_id."""
    tracer = TracerProvider().get_tracer("test")
    with tracer.start_as_current_span("serve") as span, capture_logs() as logs:
        LogSink().handle([CAPTURED])
    context = span.get_span_context()
    assert logs[0]["trace_id"] == format(context.trace_id, "032x")
    assert logs[0]["span_id"] == format(context.span_id, "016x")


def test_lines_outside_a_span_have_no_trace_ids() -> None:
    """Without a current span, no trace fields are invented."""
    with capture_logs() as logs:
        LogSink().handle([CAPTURED])
    assert "trace_id" not in logs[0]


def test_configure_logging_writes_filtered_json_lines() -> None:
    """configure_logging renders JSON with level and timestamp and drops lines below level."""
    stream = io.StringIO()
    configure_logging(level="info", json=True, stream=stream)
    LogSink().handle([REPLAYED, FAILED])
    lines = [json.loads(line) for line in stream.getvalue().splitlines()]
    assert [line["event"] for line in lines] == ["capture_failed"]
    assert lines[0]["level"] == "error"
    assert lines[0]["timestamp"].endswith("Z")


def test_configure_logging_rejects_unknown_level() -> None:
    """A misspelt level is a ConfigError that lists the valid ones."""
    with pytest.raises(
        ConfigError, match=r"^log level: expected one of debug, info, .* got 'loud'$"
    ):
        configure_logging(level="loud")


def test_real_adapter_run_through_the_bus_logs_capture_and_failure() -> None:
    """An adapter on a bus with the sink yields warmup, capture and failure lines in order."""
    backend = SimulatedGraphBackend()
    config = EncoderGraphConfig(min_free_bytes=0)
    with capture_logs() as logs:
        bus = EventBus(sinks=[LogSink()])
        try:
            graph = EncoderCudaGraph(
                lambda x: x * 2, name="vision", config=config, bus=bus, backend=backend
            )
            x = torch.ones(2, 3)
            with torch.no_grad():
                graph(x)
                graph(x)
                backend.fail_on_capture = True
                graph(torch.ones(5))
                with pytest.raises(RuntimeError, match="simulated"):
                    graph(torch.ones(5))
            assert bus.flush()
        finally:
            bus.close()
    names = [line["event"] for line in logs]
    assert names == [
        "graph_missed",
        "graph_captured",
        "graph_replayed",
        "graph_missed",
        "capture_failed",
    ]
    assert logs[-1]["error_type"] == "RuntimeError"
    assert logs[-1]["message"] == "simulated CUDA graph capture failure"


def test_filtered_debug_events_are_skipped_before_their_fields_are_built(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """At info level, replays and misses cost no field building: only the capture is described."""
    import omnitrace.sinks.logs as logs

    described: list[str] = []
    real = logs._describe

    def counting(event: object) -> tuple[str, dict[str, object]]:
        name, fields = real(event)  # type: ignore[arg-type]
        described.append(name)
        return name, fields

    monkeypatch.setattr(logs, "_describe", counting)
    stream = io.StringIO()
    configure_logging(level="info", json=True, stream=stream)
    try:
        events = [
            GraphCaptured("vision", sig("float32[1]"), 1, 2, 0.1, 1, "cuda:0", 0, 9, 10, 20, 0),
            *(GraphReplayed("vision", sig("float32[1]"), i, i, 0.0) for i in range(50)),
            GraphMissed("vision", sig("float32[1]"), 3, 3, MissReason.WARMUP, "call 1 of 2"),
        ]
        LogSink().handle(events)
    finally:
        structlog.reset_defaults()
    assert described == ["graph_captured"]
    lines = [json.loads(line) for line in stream.getvalue().splitlines()]
    assert [line["event"] for line in lines] == ["graph_captured"]
