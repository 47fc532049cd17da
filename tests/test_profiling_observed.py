"""ProfilingObserved and GraphCaptured.free_bytes through every consumer: stats, coverage,
the event log, the log sink, the live view and ``omnitrace top --json``."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
import structlog
import torch
from rich.console import Console
from structlog.testing import capture_logs

from omnitrace import (
    STATS_KEYS,
    EncoderCudaGraph,
    EncoderGraphConfig,
    EventBus,
    GraphCaptured,
    GraphMissed,
    MissReason,
    derive_coverage,
    derive_stats,
)
from omnitrace.eventlog import EventLogError, decode_record, encode_event, read_events
from omnitrace.events import NO_SIGNATURE, Event, Phase, ProfilingObserved, profiling_observed
from omnitrace.sinks.jsonl import JsonlSink
from omnitrace.sinks.live import EncoderSnapshot, LiveSnapshot, RecordBoard, render
from omnitrace.sinks.logs import LogSink
from omnitrace.sinks.names import LOG_EVENTS
from omnitrace.stats import StatsFold
from omnitrace.testing import SimulatedGraphBackend, captured, sig

V2 = "vllm.v1.worker.gpu.model_runner.GPUModelRunner.profile_run"
GiB = 1 << 30
KEY = "float32[1,256,64] @cpu s=0"


@pytest.fixture(autouse=True)
def _reset_structlog() -> object:
    yield
    structlog.reset_defaults()


def _v2_start_up() -> list[Event]:
    """A V2 worker: the profiling run calls neither encoder, serving then captures vision."""
    return [
        profiling_observed("vision", V2, 0),
        profiling_observed("audio", V2, 0),
        GraphMissed("vision", sig(KEY), 1, 1, MissReason.WARMUP, "call 1 of 2", 0.01),
        captured("vision", KEY, epoch_ns=2, free_bytes=3 * GiB),
    ]


# -- the event and the folds ----------------------------------------------------------------


def test_profiling_observed_is_a_frozen_profiling_fact_about_no_input() -> None:
    """profiling_observed() stamps a frozen event in the profiling phase with no signature."""
    event = profiling_observed("vision", V2, 0)
    assert (event.runner, event.encoder_calls, event.phase) == (V2, 0, Phase.PROFILING)
    assert event.signature == NO_SIGNATURE
    assert event.key == ""
    assert event.epoch_ns > 0
    with pytest.raises(AttributeError):
        event.encoder_calls = 1  # type: ignore[misc]


def test_stats_ignore_it_and_keep_exactly_the_nine_keys() -> None:
    """derive_stats counts no call for a ProfilingObserved and returns only STATS_KEYS."""
    events = _v2_start_up()
    stats = derive_stats(events)
    assert set(stats) == {"vision", "audio"}
    for values in stats.values():
        assert tuple(values) == STATS_KEYS
    assert stats["audio"]["graph_hits"] == stats["audio"]["graph_misses"] == 0
    assert stats["vision"]["graph_misses"] == 1
    assert stats["vision"]["num_graphs"] == 1
    assert derive_stats(events[2:])["vision"] == stats["vision"]


def test_coverage_counts_the_runs_and_those_without_calls() -> None:
    """The coverage fold keeps, per encoder, the runs observed, their calls, the runs that
    made none and the latest runner, and takes no row for them."""
    v1 = "vllm.v1.worker.gpu_model_runner.GPUModelRunner.profile_run"
    events = [*_v2_start_up(), profiling_observed("vision", v1, 2)]
    coverage = derive_coverage(events)
    runs = coverage["vision"].profiling_runs
    assert (runs.runs, runs.encoder_calls, runs.without_calls, runs.runner) == (2, 2, 1, v1)
    assert coverage["audio"].keys == ()
    assert coverage["audio"].total.calls == 0
    assert coverage["audio"].profiling_runs.without_calls == 1


def test_the_summary_reports_a_run_that_made_no_call() -> None:
    """An encoder whose only profiling fact is a run without calls still gets a profiling
    entry in its summary (graph_summary lines, top --json)."""
    summary = derive_coverage(_v2_start_up())["audio"].summary()
    assert summary["profiling"] == {
        "calls": 0,
        "hits": 0,
        "captures": 0,
        "replayed_in_serving": 0,
        "runs": 1,
        "runs_without_calls": 1,
        "runner": V2,
    }
    assert "profiling" not in derive_coverage(_v2_start_up()[2:])["vision"].summary()


def test_the_bus_folds_it_like_derive_coverage() -> None:
    """A bus given the events shows the same coverage and stats as the pure folds."""
    bus = EventBus()
    for event in _v2_start_up():
        bus.emit(event)
    assert bus.coverage() == derive_coverage(_v2_start_up())
    assert {n: s.as_dict() for n, s in bus.adapter_stats().items()} == derive_stats(_v2_start_up())
    assert bus.statistics().emitted == 4
    bus.close()


# -- the event log ---------------------------------------------------------------------------


def test_the_event_log_round_trips_both(tmp_path: Path) -> None:
    """The JSONL sink writes ProfilingObserved and a capture's free bytes; the reader gives
    back equal events and the same stats."""
    path = tmp_path / "events.jsonl"
    sink = JsonlSink(path)
    bus = EventBus(sinks=[sink])
    for event in _v2_start_up():
        bus.emit(event)
    bus.close()
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    observed = next(line for line in lines if line["type"] == "ProfilingObserved")
    assert (observed["runner"], observed["encoder_calls"], observed["phase"]) == (
        V2,
        0,
        "profiling",
    )
    assert observed["key"] == ""
    assert next(line for line in lines if line["type"] == "GraphCaptured")["free_bytes"] == 3 * GiB
    back = list(read_events(path))
    assert back == _v2_start_up_without_stamps(back)
    assert derive_stats(back) == derive_stats(_v2_start_up())


def _v2_start_up_without_stamps(back: list[Event]) -> list[Event]:
    """The start-up events with the timestamps ``back`` has (profiling_observed stamps now)."""
    events = _v2_start_up()
    out: list[Event] = []
    for want, got in zip(events, back, strict=True):
        if isinstance(want, ProfilingObserved):
            want = ProfilingObserved(
                want.adapter,
                want.signature,
                got.monotonic_ns,
                got.epoch_ns,
                want.runner,
                want.encoder_calls,
                phase=want.phase,
            )
        out.append(want)
    return out


def test_a_capture_written_before_free_bytes_reads_as_none() -> None:
    """A GraphCaptured line without free_bytes (older writers) reads with free_bytes None;
    a free_bytes that is not an integer is a one-line error."""
    record = encode_event(captured("vision", KEY, free_bytes=5), pid=1, rank=0)
    assert decode_record(record).item.free_bytes == 5  # type: ignore[union-attr]
    del record["free_bytes"]
    item = decode_record(record).item
    assert isinstance(item, GraphCaptured)
    assert item.free_bytes is None
    record["free_bytes"] = "lots"
    with pytest.raises(EventLogError, match=r"GraphCaptured.free_bytes: expected int \| None"):
        decode_record(record)


def test_a_profiling_observed_line_needs_its_fields() -> None:
    """A ProfilingObserved line without encoder_calls is refused naming the field."""
    record = encode_event(profiling_observed("vision", V2, 0), pid=1, rank=0)
    del record["encoder_calls"]
    with pytest.raises(EventLogError, match="ProfilingObserved is missing field 'encoder_calls'"):
        decode_record(record)


# -- the adapter fills free_bytes --------------------------------------------------------------


class _CountingBackend(SimulatedGraphBackend):
    """The simulated backend, counting its free-memory reads (or failing them)."""

    def __init__(self, *, fail: bool = False, **kwargs: object) -> None:
        super().__init__(**kwargs)  # type: ignore[arg-type]
        self.reads = 0
        self.fail = fail

    def device_free_bytes(self, device: torch.device) -> int:
        self.reads += 1
        if self.fail:
            raise RuntimeError("no driver")
        return super().device_free_bytes(device)


def _capture(config: EncoderGraphConfig, backend: SimulatedGraphBackend) -> list[Event]:
    bus = EventBus()
    events: list[Event] = []
    bus.add_fold(events.append)
    graph = EncoderCudaGraph(
        lambda x: x * 2, name="vision", config=config, bus=bus, backend=backend
    )
    x = torch.ones(2, 3)
    with torch.no_grad():  # as vLLM serves: calls with grad are never graphed
        for _ in range(4):  # warm-up, capture, two hits
            graph(x)
    bus.close()
    return events


def test_a_capture_reuses_the_floor_read_and_hits_read_nothing() -> None:
    """With a memory floor, the capture's free_bytes is admission's read (no second read),
    taken before the capture consumed its memory; hits never read device memory."""
    backend = _CountingBackend(free_bytes=10 * GiB, graph_bytes=GiB)
    events = _capture(EncoderGraphConfig(min_free_bytes=1), backend)
    (capture,) = [e for e in events if isinstance(e, GraphCaptured)]
    assert capture.free_bytes == 10 * GiB
    assert backend.free_bytes == 9 * GiB
    assert backend.reads == 1


def test_without_a_floor_a_capture_reads_free_memory_once() -> None:
    """With the floor off, the capture reads device-free memory once, just before it."""
    backend = _CountingBackend(free_bytes=7 * GiB)
    events = _capture(EncoderGraphConfig(min_free_bytes=0), backend)
    (capture,) = [e for e in events if isinstance(e, GraphCaptured)]
    assert (capture.free_bytes, backend.reads) == (7 * GiB, 1)


def test_a_failed_free_memory_read_leaves_none_and_the_capture_stands() -> None:
    """A backend that cannot read free memory still captures; the event says None."""
    backend = _CountingBackend(fail=True)
    events = _capture(EncoderGraphConfig(min_free_bytes=0), backend)
    (capture,) = [e for e in events if isinstance(e, GraphCaptured)]
    assert capture.free_bytes is None
    assert backend.captures == 1


# -- logs, live view, top --------------------------------------------------------------------


def test_the_log_sink_writes_profiling_observed_at_info_without_a_key() -> None:
    """ProfilingObserved becomes one info line profiling_observed with runner and calls;
    a capture's line carries free_bytes."""
    observed = profiling_observed("audio", V2, 0)
    with capture_logs() as logs:
        LogSink().handle([observed, captured("vision", KEY, epoch_ns=9, free_bytes=GiB)])
    assert LOG_EVENTS["profiling_observed"] == "info"
    assert logs[0] == {
        "event": "profiling_observed",
        "log_level": "info",
        "encoder": "audio",
        "runner": V2,
        "encoder_calls": 0,
        "phase": "profiling",
        "event_epoch_ns": observed.epoch_ns,
    }
    assert logs[1]["event"] == "graph_captured"
    assert logs[1]["free_bytes"] == GiB
    with capture_logs() as logs:
        LogSink().handle([captured("vision", KEY)])
    assert "free_bytes" not in logs[0]


def _frame(events: list[Event], width: int) -> str:
    board = RecordBoard(title="top")
    from omnitrace.eventlog import EventRecord

    board.add(EventRecord(e, 100, 0) for e in events)
    console = Console(record=True, width=width, file=io.StringIO())
    console.print(render(board.snapshot()))
    return console.export_text()


def test_the_live_view_notes_an_encoder_the_profiling_run_never_called() -> None:
    """Each encoder a profiling run did not call gets a yellow profile note, with the free
    memory of its first capture where it has one; the keys table shows each capture's."""
    body = _frame(_v2_start_up(), 140)
    assert "│ profile  not called in profiling · first capture at 3.0 GiB free " in body
    # Audio has no graph yet: the note alone.
    assert "│ profile  not called in profiling    " in body
    assert "float32[1,256,64]" in body
    assert "3.0 GiB" in body.split("captured key")[1]
    compact = _frame(_v2_start_up(), 80)
    assert "│ prof   0 calls · cap 3.0 GiB free " in compact


def test_an_encoder_without_profiling_facts_shows_no_profile_row() -> None:
    """Without a profiling run or profiling calls there is no profile row, nor a free column
    for captures that did not record free memory."""
    events: list[Event] = [captured("vision", KEY)]
    stats = StatsFold()
    stats.extend(events)
    encoder = EncoderSnapshot(stats.snapshot("vision"), coverage=derive_coverage(events)["vision"])
    console = Console(record=True, width=140, file=io.StringIO())
    console.print(render(LiveSnapshot("t", 0, (encoder,))))
    body = console.export_text()
    assert "profile" not in body
    assert " free " not in body.split("captured key")[1]


def test_top_json_reports_the_run_and_the_first_capture_free_bytes(tmp_path: Path) -> None:
    """omnitrace top --json gives each encoder its profiling runs and its first capture's
    free memory."""
    import contextlib

    from omnitrace import cli

    path = tmp_path / "events.jsonl"
    bus = EventBus(sinks=[JsonlSink(path)])
    for event in _v2_start_up():
        bus.emit(event)
    bus.close()
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert cli.main(["top", str(path), "--json"]) == 0
    encoders = {e["encoder"]: e for e in json.loads(out.getvalue())["encoders"]}
    assert encoders["vision"]["first_capture_free_bytes"] == 3 * GiB
    assert encoders["audio"]["first_capture_free_bytes"] is None
    assert encoders["audio"]["profiling"]["runs_without_calls"] == 1
    assert encoders["vision"]["profiling"]["runner"] == V2
