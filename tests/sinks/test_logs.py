"""The structlog sink: event names, levels, fields, sampling and trace correlation."""

from __future__ import annotations

import io
import json
import time
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


@pytest.mark.parametrize("json_lines", [True, False])
def test_each_line_is_one_write_with_its_new_line(json_lines: bool) -> None:
    """A line goes out in one write() that ends it, so another writer of the same stream (a
    server's own logger, on another thread) cannot put its text between a line and its end."""

    class Writes(io.StringIO):
        def __init__(self) -> None:
            super().__init__()
            self.calls: list[str] = []

        def write(self, text: str) -> int:
            self.calls.append(text)
            return super().write(text)

    stream = Writes()
    configure_logging(level="info", json=json_lines, stream=stream)
    structlog.get_logger("omnitrace").info("graph_summary", encoder="vision", calls=3)
    structlog.get_logger("omnitrace").warning("graph_missed", reason="warmup")
    assert len(stream.calls) == 2
    assert all(call.endswith("\n") and call.count("\n") == 1 for call in stream.calls)


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


def _summaries(logs: list[dict[str, object]]) -> list[dict[str, object]]:
    return [line for line in logs if line["event"] == "graph_summary"]


def _serve(bus: EventBus) -> EncoderCudaGraph:
    """Run an adapter with one hot shape (captured) and one the cap keeps out."""
    graph = EncoderCudaGraph(
        lambda x: x * 2,
        name="vision",
        config=EncoderGraphConfig(max_graphs=1, min_free_bytes=0),
        bus=bus,
        backend=SimulatedGraphBackend(),
    )
    with torch.no_grad():
        graph.set_phase("profiling")
        graph(torch.ones(1, 64))
        graph.set_phase("serving")
        for _ in range(5):
            graph(torch.ones(1, 8))
        for _ in range(3):
            graph(torch.ones(1, 16))
    return graph


def test_close_writes_a_final_graph_summary_per_encoder_with_its_top_missed_keys() -> None:
    """At close the sink logs one graph_summary per encoder: its stats, the missed
    signatures with their reason and share of calls, the eager time and the profiling calls."""
    bus = EventBus()
    sink = LogSink(bus=bus, summary_interval=0)
    bus.add_sink(sink)
    with capture_logs() as logs:
        graph = _serve(bus)
        bus.close()
    (line,) = _summaries(logs)
    assert LOG_EVENTS["graph_summary"] == "info"
    assert line["log_level"] == "info"
    assert line["final"] is True
    stats = graph.get_cumulative_stats()
    assert {k: line[k] for k in stats} == stats
    assert (line["calls"], line["max_graphs"], line["backend"]) == (9, 1, "simulated")
    assert line["top_missed"] == [
        {"key": "float32[1,16] @cpu s=0", "misses": 3, "reason": "capacity", "share": 0.3333},
        {"key": "float32[1,8] @cpu s=0", "misses": 1, "reason": "warmup", "share": 0.1111},
        {"key": "float32[1,64] @cpu s=0", "misses": 1, "reason": "warmup", "share": 0.1111},
    ]
    assert line["profiling"] == {"calls": 1, "hits": 0, "captures": 0, "replayed_in_serving": 0}
    assert line["time_source"] == "host"
    assert isinstance(line["eager_s"], float)
    assert line["eager_s"] > 0
    assert sink.summaries == 1


def test_summaries_repeat_at_the_interval_while_serving() -> None:
    """With an interval, graph_summary lines come periodically (final false), then once
    more at close (final true)."""
    bus = EventBus()
    sink = LogSink(bus=bus, summary_interval=0.1)
    bus.add_sink(sink)
    with capture_logs() as logs:
        _serve(bus)
        assert bus.flush()
        deadline = time.monotonic() + 5
        while sink.summaries < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        bus.close()
    lines = _summaries(logs)
    assert len(lines) >= 3
    assert [line["final"] for line in lines[:-1]] == [False] * (len(lines) - 1)
    assert lines[-1]["final"] is True


@pytest.mark.parametrize("value", ["-1", "abc", "1e7", "nan", "1e-300", "0.05", "1e300", "86401"])
def test_a_bad_summary_interval_is_a_one_line_config_error(value: str) -> None:
    """OMNITRACE_SUMMARY_INTERVAL must be 0 or seconds from 0.1 to a day (1e-300 once wrote
    thousands of summaries a second); the message names the variable, range and value."""
    with pytest.raises(ConfigError) as info:
        LogSink(bus=EventBus(), environ={"OMNITRACE_SUMMARY_INTERVAL": value})
    assert str(info.value) == (
        "OMNITRACE_SUMMARY_INTERVAL: expected 0 (the summary only at shutdown) or a number of "
        f"seconds from 0.1 to 86400, got {value!r}"
    )


@pytest.mark.parametrize("value", [1e-300, 0.05, 1e300, float("nan"), -1, True, 10**400])
def test_the_summary_interval_argument_has_the_same_range(value: object) -> None:
    """LogSink(summary_interval=...) takes what the variable takes: 0, or 0.1 s to a day."""
    with pytest.raises(ConfigError, match=r"^summary_interval: expected 0 \(the summary only "):
        LogSink(summary_interval=value)  # type: ignore[arg-type]
    assert LogSink(summary_interval=0.1).summary_interval == 0.1
    assert LogSink(summary_interval=86_400).summary_interval == 86_400.0


def test_the_summary_interval_comes_from_the_environment_default_60() -> None:
    """Unset, the interval is 60 s; the variable sets it; 0 keeps only the final line."""
    assert LogSink(environ={}).summary_interval == 60.0
    assert LogSink(environ={"OMNITRACE_SUMMARY_INTERVAL": "2.5"}).summary_interval == 2.5
    assert LogSink(environ={"OMNITRACE_SUMMARY_INTERVAL": "0"}).summary_interval == 0.0


def test_console_lines_show_control_characters_as_escapes() -> None:
    """With json=False, an event's text (key, error message) is written with its ESC, BEL
    and new lines escaped, so a console line never drives the terminal or splits."""
    stream = io.StringIO()
    configure_logging(level="info", json=False, stream=stream)
    try:
        structlog.get_logger("omnitrace").error(
            "capture_failed", encoder="a\x1b[31mb\x07", message="line one\nline two"
        )
    finally:
        structlog.reset_defaults()
    text = stream.getvalue()
    assert "encoder=a\\x1b[31mb\\x07 " in text
    assert "\x1b" not in text
    assert "\x07" not in text
    assert text.count("\n") == 1  # the message's new line is escaped too
