"""The live view: pure rendering of frozen snapshots, the boards feeding it, its refresh rate."""

from __future__ import annotations

import dataclasses
import io
import re
import sys
import time
from pathlib import Path

import pytest
import torch
from rich.console import Console

from omnitrace import (
    CaptureFailed,
    EncoderCudaGraph,
    EncoderGraphConfig,
    EventBus,
    GraphCaptured,
    GraphMissed,
    GraphReplayed,
    MemoryDeferred,
    MissReason,
    derive_coverage,
)
from omnitrace.events import NO_SIGNATURE, Event, Phase, missed, now
from omnitrace.sinks.jsonl import AdapterInfo, EventRecord, JsonlSink, read_records
from omnitrace.sinks.live import (
    BusBoard,
    EncoderSnapshot,
    LiveSnapshot,
    LiveView,
    Notice,
    RecordBoard,
    format_bytes,
    render,
)
from omnitrace.stats import AdapterStats, CapturedGraphInfo, StatsFold
from omnitrace.testing import SimulatedGraphBackend, sig

T0 = 1_700_000_000_000_000_000  # 2023-11-14 22:13:20 UTC
MiB = 1 << 20
GiB = 1 << 30


def _text(renderable: object, width: int = 140) -> str:
    console = Console(record=True, width=width, file=io.StringIO())
    console.print(renderable)
    return console.export_text()


def _lines(text: str) -> list[str]:
    return [line.rstrip() for line in text.splitlines()]


def _snapshot() -> LiveSnapshot:
    vision = AdapterStats(
        "vision",
        graph_hits=30,
        warmup_misses=4,
        capacity_misses=3,
        memory_misses=2,
        ineligible_misses=1,
        graphs=(
            CapturedGraphInfo("float32[1,1024,64]", T0, 0.0123, 1, "cpu", 0, 64 * MiB, 1024),
            CapturedGraphInfo("float32[1,256,64]", T0 + 5 * 10**9, 0.004, 1, "cpu", 0, MiB, 64),
        ),
        memory_deferrals=2,
        last_free_bytes=900 * MiB,
        floor_bytes=1 << 30,
    )
    audio = AdapterStats("audio", graph_hits=3, capture_failures=1, failure="RuntimeError: boom")
    return LiveSnapshot(
        title="omnitrace demo",
        taken_epoch_ns=T0 + 61 * 10**9,
        encoders=(
            EncoderSnapshot(
                vision,
                max_graphs=2,
                min_free_bytes=1 << 30,
                backend="simulated",
                notices=(Notice(T0, False, "22:13:20Z deferred k: free 900.0 MiB"),),
            ),
            EncoderSnapshot(
                audio, max_graphs=4, notices=(Notice(T0, True, "22:13:20Z FAILED k2"),)
            ),
        ),
        emitted=120,
        dropped=0,
        footer=("streaming audio: 3 eager calls (never graphed)",),
    )


def test_render_shows_rates_misses_caps_keys_memory_and_bus() -> None:
    """A frame lists, per encoder, hit rate, misses by reason, graphs vs cap, keys and memory."""
    lines = _lines(_text(render(_snapshot())))
    assert lines[0] == "omnitrace demo   22:14:21Z"
    body = "\n".join(lines)
    assert "│ hit rate  75.0 %   hits 30 / calls 40" in body
    assert "│ misses   warmup 4 · capacity 3 · memory 2 · ineligible 1" in body
    assert "│ graphs   2 / 2 full  backend simulated" in body
    assert "│ memory   floor 1.0 GiB · last free 900.0 MiB · deferrals 2" in body
    assert "float32[1,1024,64]  22:13:20Z   12.3 ms" in body
    assert "float32[1,256,64]   22:13:25Z    4.0 ms" in body
    assert "│ graphs   0 / 4 " in body
    assert "│ TERMINAL RuntimeError: boom" in body
    assert lines[-2:] == [
        "bus  events 120 · dropped 0",
        "streaming audio: 3 eager calls (never graphed)",
    ]


def test_two_encoders_of_one_process_are_side_by_side() -> None:
    """With one worker, the vision and audio panels share the same rows."""
    lines = _lines(_text(render(_snapshot())))
    assert lines[1].startswith("╭─ vision ")
    assert "╭─ audio " in lines[1]


def test_failures_are_red_and_deferrals_yellow() -> None:
    """Failure notices and the terminal line use red; deferral notices use yellow."""
    console = Console(record=True, width=140, file=io.StringIO(), color_system="standard")
    console.print(render(_snapshot()))
    styled = console.export_text(styles=True)
    assert "\x1b[1;31mRuntimeError: boom" in styled
    assert "\x1b[1;31m22:13:20Z FAILED k2" in styled
    assert "\x1b[33m22:13:20Z deferred k" in styled


def test_unknown_drop_count_is_said_to_be_unknown() -> None:
    """A snapshot built from a log (drops unknown) shows a dash and why, not zero."""
    snapshot = LiveSnapshot("t", T0, (), emitted=5, dropped=None)
    lines = _lines(_text(render(snapshot)))
    assert lines[1:] == [
        "no encoder events yet",
        "bus  events 5 · dropped — (not in the event log)",
    ]


def test_format_bytes_uses_binary_units() -> None:
    """Bytes are shown with KiB/MiB/GiB and one decimal; None is a dash."""
    assert [format_bytes(v) for v in (512, 1536, 900 * MiB, 3 << 30, None)] == [
        "512 B",
        "1.5 KiB",
        "900.0 MiB",
        "3.0 GiB",
        "—",
    ]


def _run(bus: EventBus, backend: SimulatedGraphBackend) -> EncoderCudaGraph:
    config = EncoderGraphConfig(max_graphs=1, min_free_bytes=1 << 30)
    graph = EncoderCudaGraph(torch.tanh, name="vision", config=config, bus=bus, backend=backend)
    with torch.no_grad():
        for shape in [(1, 4), (1, 4), (1, 4), (2, 4), (2, 4)]:
            graph(torch.ones(shape))
    return graph


def test_bus_board_snapshot_matches_the_adapter_and_collects_deferrals() -> None:
    """The bus board shows the adapter's cap, floor, stats and its memory deferral notice."""
    backend = SimulatedGraphBackend(free_bytes=(1 << 30) + 10 * MiB, graph_bytes=20 * MiB)
    bus = EventBus()
    try:
        board = BusBoard(bus, title="demo", footer=lambda: ["extra"])
        graph = _run(bus, backend)
        backend.free_bytes = 100 * MiB
        assert bus.flush()
        snapshot = board.snapshot()
    finally:
        bus.close()
    (encoder,) = snapshot.encoders
    assert encoder.stats.as_dict() == graph.get_cumulative_stats()
    assert (encoder.max_graphs, encoder.min_free_bytes, encoder.backend) == (
        1,
        1 << 30,
        "simulated",
    )
    assert snapshot.emitted == bus.statistics().emitted
    assert snapshot.footer == ("extra",)
    assert encoder.stats.capacity_misses == 2
    body = _text(render(snapshot))
    assert "graphs   1 / 1 full" in body


def test_bus_board_keeps_failure_notice_for_terminal_adapter() -> None:
    """A capture failure on the bus shows as a red notice and a terminal line."""
    backend = SimulatedGraphBackend(fail_on_capture=True)
    bus = EventBus()
    try:
        board = BusBoard(bus)
        graph = EncoderCudaGraph(
            torch.tanh,
            name="audio",
            config=EncoderGraphConfig(min_free_bytes=0),
            bus=bus,
            backend=backend,
        )
        with torch.no_grad():
            graph(torch.ones(3))
            with pytest.raises(RuntimeError, match="simulated"):
                graph(torch.ones(3))
        assert bus.flush()
        (encoder,) = board.snapshot().encoders
    finally:
        bus.close()
    assert [n.failed for n in encoder.notices] == [True]
    assert "FAILED float32[3] @cpu s=0: RuntimeError: simulated CUDA graph capture failure" in (
        encoder.notices[0].text
    )
    assert encoder.stats.failure == "RuntimeError: simulated CUDA graph capture failure"


def test_record_board_puts_workers_side_by_side() -> None:
    """Records of two worker pids fold separately and render as two labelled columns."""
    board = RecordBoard(title="top")
    events = [
        GraphMissed("vision", sig("float32[1]"), 1, T0, MissReason.WARMUP, "call 1 of 2"),
        GraphCaptured("vision", sig("float32[1]"), 2, T0, 0.01, 1, "cuda:0", 0, 5, MiB, 64, 0),
        GraphReplayed("vision", sig("float32[1]"), 3, T0, 0.001),
    ]
    board.add([EventRecord(AdapterInfo("vision", {"max_graphs": 4}), 100, 0)])
    board.add(EventRecord(e, 100, 0) for e in events)
    board.add(EventRecord(e, 200, 1) for e in events[:1])
    board.add(
        [EventRecord(MemoryDeferred("vision", sig("float32[1]"), 4, T0, 5, 10, "cuda:1"), 200, 1)]
    )
    board.add(
        [
            EventRecord(
                CaptureFailed("vision", sig("float32[2]"), 5, T0, "E", "m", "cuda:1", 0), 200, 1
            )
        ]
    )
    snapshot = board.snapshot()
    assert [(e.source, e.stats.graph_hits, e.max_graphs) for e in snapshot.encoders] == [
        ("rank 0 · pid 100", 1, 4),
        ("rank 1 · pid 200", 0, None),
    ]
    assert snapshot.emitted == 6
    lines = _lines(_text(render(snapshot), width=160))
    assert lines[1].startswith("╭─ vision · rank 0 · pid 100 ")
    assert "╭─ vision · rank 1 · pid 200 " in lines[1]
    assert "graphs   1 / 4 " in "\n".join(lines)
    assert "graphs   0 / ? " in "\n".join(lines)


def test_a_deferral_notice_names_the_allocators_cache_when_it_was_read() -> None:
    """Free memory under the floor next to what the allocator held cached (memory the
    engine reuses and a new pool cannot); a log without the reading shows no cache."""
    board = RecordBoard()
    read = MemoryDeferred("vision", sig("float32[1]"), 1, T0, 5 * MiB, GiB, "cuda:0", 700 * MiB)
    unread = MemoryDeferred("vision", sig("float32[2]"), 2, T0, 6 * MiB, GiB, "cuda:0")
    need = MemoryDeferred("vision", sig("float32[3]"), 3, T0, 2 * GiB, GiB, "cuda:0", 0, 3 * GiB)
    board.add([EventRecord(e, 100, 0) for e in (read, unread, need)])
    (encoder,) = board.snapshot().encoders
    assert [n.text for n in encoder.notices] == [
        "22:13:20Z deferred float32[1]: free 5.0 MiB < floor 1.0 GiB (allocator cache 700.0 MiB)",
        "22:13:20Z deferred float32[2]: free 6.0 MiB < floor 1.0 GiB",
        "22:13:20Z deferred float32[3]: free 2.0 GiB < 3.4 GiB (eager need 3.0 GiB and an eighth)"
        " (allocator cache 0 B)",
    ]


def test_record_board_folds_interleaved_writers_apart_and_keeps_their_last_notices() -> None:
    """Two writers' records interleaved one by one in one add: each worker's stats and
    coverage are the folds of its own events, and its notices are its last five deferrals
    and failures, oldest first, worded when the snapshot is taken."""
    mine: dict[int, list[Event]] = {100: [], 200: []}
    records = []
    for n in range(8):
        for pid in (100, 200):
            key = sig(f"float32[{n + 1}]")
            step = [
                GraphMissed("vision", key, n, T0 + n, MissReason.WARMUP, "call 1 of 2", 0.01),
                GraphReplayed("vision", key, n, T0 + n, 0.001),
                MemoryDeferred("vision", key, n, T0 + n, pid * MiB + n, 10 * GiB, "cuda:0"),
            ]
            if n == 6:
                step.append(CaptureFailed("vision", key, n, T0 + n, "E", f"m{pid}", "cuda:0", 0))
            mine[pid] += step
            records += [EventRecord(e, pid, 0) for e in step]
    board = RecordBoard()
    board.add(records)
    snapshot = board.snapshot()
    assert [e.pid for e in snapshot.encoders] == [100, 200]
    for encoder in snapshot.encoders:
        events = mine[encoder.pid or 0]
        stats = StatsFold()
        stats.extend(events)
        assert encoder.stats == stats.snapshot("vision")
        assert encoder.coverage == derive_coverage(events)["vision"]
        noticed = [e for e in events if isinstance(e, (MemoryDeferred, CaptureFailed))][-5:]
        assert [n.failed for n in encoder.notices] == [
            isinstance(e, CaptureFailed) for e in noticed
        ]
        assert [n.key for n in encoder.notices] == [e.key for e in noticed]
        last = noticed[-1]
        assert isinstance(last, MemoryDeferred)
        assert encoder.notices[-1].text == (
            f"22:13:20Z deferred {last.key}: free {format_bytes(last.free_bytes)} < floor 10.0 GiB"
        )
    assert snapshot.emitted == len(records)


def test_record_board_from_a_written_log_equals_the_bus_board(tmp_path: Path) -> None:
    """Stats folded from the JSONL log equal the in-process board's, caps included."""
    path = tmp_path / "e.jsonl"
    bus = EventBus()
    try:
        bus_board = BusBoard(bus)
        bus.add_sink(JsonlSink(path, bus=bus))
        _run(bus, SimulatedGraphBackend())
        assert bus.flush()
        live = bus_board.snapshot()
    finally:
        bus.close()
    board = RecordBoard()
    board.add(read_records(path))
    from_log = board.snapshot()
    assert [(e.stats, e.max_graphs) for e in from_log.encoders] == [
        (e.stats, e.max_graphs) for e in live.encoders
    ]
    assert from_log.encoders[0].source == ""


class _CountingBoard:
    def __init__(self, bus: EventBus) -> None:
        self.inner = BusBoard(bus)
        self.calls = 0

    def snapshot(self) -> LiveSnapshot:
        self.calls += 1
        return self.inner.snapshot()


def test_live_view_refreshes_at_a_fixed_rate_not_per_event() -> None:
    """Thousands of events in half a second produce only a handful of frames."""
    bus = EventBus()
    try:
        board = _CountingBoard(bus)
        console = Console(file=io.StringIO(), force_terminal=True, width=120)
        graph = EncoderCudaGraph(
            torch.tanh,
            name="vision",
            config=EncoderGraphConfig(min_free_bytes=0),
            bus=bus,
            backend=SimulatedGraphBackend(),
        )
        x = torch.ones(2)
        start = time.monotonic()
        with LiveView(board, console=console, refresh_per_second=4), torch.no_grad():
            while time.monotonic() - start < 0.5:
                graph(x)
        calls = graph.get_cumulative_stats()["graph_hits"]
    finally:
        bus.close()
    assert calls > 200
    assert 2 <= board.calls <= 8
    assert "hit rate" in console.file.getvalue()  # type: ignore[attr-defined]


# -- an 80x24 terminal ---------------------------------------------------------------------

KEYS = (
    "float32[1,256,64], None @cpu s=0",
    "float32[1,1008,64], None @cpu s=0",
    "float32[1,1024,64], None @cpu s=0",
    "float32[2,1024,64], bool[2,1,1024,1024] @cpu s=0",
)


def _busy_snapshot() -> LiveSnapshot:
    """A demo-like frame with every row filled: four keys, five notices, log lines."""
    graphs = tuple(CapturedGraphInfo(k, T0, 0.1102, 1, "cpu", 0, 64 * MiB, 1024) for k in KEYS)
    vision = AdapterStats(
        "vision",
        graph_hits=173,
        warmup_misses=6,
        capacity_misses=51,
        graphs=graphs,
        memory_deferrals=5,
        last_free_bytes=952 * MiB,
        floor_bytes=1 << 30,
    )
    audio = AdapterStats(
        "audio", graph_hits=3, capture_failures=1, failure="RuntimeError: boom", graphs=graphs[:2]
    )
    deferral = f"22:13:20Z deferred {KEYS[3]}: free 952.0 MiB < floor 1.0 GiB"
    log_line = '{"event": "graph_captured", "level": "info", "encoder": "vision", "key": "k"}'
    return LiveSnapshot(
        title="omnitrace demo · simulated backend on cpu",
        taken_epoch_ns=T0,
        encoders=(
            EncoderSnapshot(
                vision,
                max_graphs=4,
                min_free_bytes=1 << 30,
                backend="simulated",
                notices=tuple(Notice(T0, False, deferral, KEYS[3]) for _ in range(5)),
            ),
            EncoderSnapshot(
                audio,
                max_graphs=4,
                backend="simulated",
                notices=(Notice(T0, True, "22:13:20Z FAILED k: RuntimeError: boom", "k"),),
            ),
        ),
        emitted=300,
        dropped=0,
        footer=("streaming audio  11 eager calls (stateful, never graphed)",),
        progress=("requests 362 / 400 · elapsed 7.7 s",),
        log=(log_line,) * 3,
    )


def test_frame_fits_an_80x24_terminal_without_wrapping() -> None:
    """At 80x24 the frame has at most 24 rows of at most 80 columns and panels stay aligned."""
    console = Console(record=True, width=80, height=24, file=io.StringIO())
    console.print(render(_busy_snapshot(), height=24))
    lines = _lines(console.export_text())
    assert len(lines) <= 24
    assert max(len(line) for line in lines) <= 80
    assert lines[:2] == [
        "omnitrace demo · simulated backend on cpu   22:13:20Z",
        "requests 362 / 400 · elapsed 7.7 s",
    ]
    # Both panels open on one row and their right borders line up on every shared row.
    assert lines[2].startswith("╭─ vision ")
    assert "╭─ audio " in lines[2]
    panel_rows = [line for line in lines if line.startswith("│")]
    assert {line.index("│", 1) for line in panel_rows} == {38}
    body = "\n".join(lines)
    # Keys are shortened (dtype, placement in the header) and elided in the middle, whole rows.
    assert "captured key @cpu s=0" in body
    assert "│  f32[1,1008,64]           110.2 ms  │" in body
    assert "f32[2,1024,…,1024,1024]  110.2 ms" in body
    assert "│ 22:13:20Z deferred f32[2,1024,64],… │" in body
    assert "│ TERMINAL RuntimeError: boom" in body
    assert lines[-1] == "info    graph_captured vision k"


def test_frame_leaves_out_old_notices_before_it_would_be_cut() -> None:
    """Short of rows, the frame drops older notices, then keys, never its bottom lines."""
    full = _lines(_text(render(_busy_snapshot()), width=80))
    assert sum("deferred f32[" in line for line in full) == 5
    for height in (24, 20, 16):
        console = Console(record=True, width=80, height=height, file=io.StringIO())
        console.print(render(_busy_snapshot(), height=height))
        lines = _lines(console.export_text())
        assert len(lines) <= height, height
        assert "bus  events 300 · dropped 0" in lines, height
    assert sum("deferred f32[" in line for line in lines) == 0
    assert "… 2 more" in "\n".join(lines)


def test_bus_board_shows_progress_lines_under_the_title(bus: EventBus) -> None:
    """BusBoard(progress=...) puts the demo's requests done and elapsed time in the frame."""
    board = BusBoard(bus, title="demo", progress=lambda: ["requests 3 / 10 · elapsed 0.5 s"])
    lines = _lines(_text(render(board.snapshot())))
    assert lines[1] == "requests 3 / 10 · elapsed 0.5 s"


class _Stream(io.StringIO):
    def __init__(self, tty: bool) -> None:
        super().__init__()
        self.tty = tty

    def isatty(self) -> bool:
        return self.tty


@pytest.mark.parametrize("tty", [False, True])
def test_stderr_lines_go_into_the_view_never_across_it(
    monkeypatch: pytest.MonkeyPatch, bus: EventBus, tty: bool
) -> None:
    """While the view runs, stderr lines land in its log rows; after, a redirected stderr
    gets them all and a terminal gets one line saying how many there were."""
    real = _Stream(tty)
    monkeypatch.setattr("sys.stderr", real)
    console = Console(file=io.StringIO(), force_terminal=True, width=80, height=24)
    with LiveView(BusBoard(bus), console=console, log_hint="; --log-file keeps them") as view:
        for index in range(5):
            print(f"line {index}", file=sys.stderr)
        assert sys.stderr is view.log
        assert view.log.recent(3) == ("line 2", "line 3", "line 4")
        time.sleep(0.6)  # a few frames
    assert sys.stderr is real
    assert "line 4" in console.file.getvalue()  # type: ignore[attr-defined]
    if tty:
        assert real.getvalue() == (
            "omnitrace: 5 log lines were shown in the live view; --log-file keeps them\n"
        )
    else:
        assert real.getvalue() == "".join(f"line {i}\n" for i in range(5))


# -- coverage: missed signatures, eager time, profiling -----------------------------------


def _coverage_events() -> list[Event]:
    """Vision: a profiling capture never replayed, a hot key, two keys the cap keeps out."""
    hot, dummy = sig("float32[1,1024,64], None @cpu s=0"), sig("float32[4,1024,64], None @cpu s=0")
    late = [sig(f"float32[1,{n},64], None @cpu s=0") for n in (960, 798)]
    events: list[Event] = [
        GraphMissed(
            "vision", dummy, 0, T0, MissReason.WARMUP, "call 1 of 2", 0.02, phase=Phase.PROFILING
        ),
        GraphCaptured(
            "vision", dummy, 0, T0, 0.1, 1, "cpu", 0, 5, 64 * MiB, 1024, 0, phase=Phase.PROFILING
        ),
        GraphReplayed("vision", dummy, 0, T0, 0.005, phase=Phase.PROFILING),
        GraphMissed("vision", hot, 0, T0, MissReason.WARMUP, "call 1 of 2", 0.010),
        GraphCaptured("vision", hot, 0, T0, 0.1, 1, "cpu", 0, 5, 64 * MiB, 1024, 1),
    ]
    events += [GraphReplayed("vision", hot, 0, T0, 0.002) for _ in range(20)]
    events += [GraphMissed("vision", late[0], 0, T0, MissReason.CAPACITY, "cap", 0.009)] * 10
    events += [GraphMissed("vision", late[1], 0, T0, MissReason.CAPACITY, "cap", 0.008)] * 4
    audio = sig("float32[1,80,100] @cpu s=0")
    events += [GraphMissed("audio", audio, 0, T0, MissReason.MEMORY, "floor", 0.004)] * 3
    return events


def _covered(snapshot: LiveSnapshot, backend: str | None = "torch") -> LiveSnapshot:
    coverage = derive_coverage(_coverage_events())
    encoders = tuple(
        dataclasses.replace(e, coverage=coverage.get(e.stats.adapter), backend=backend)
        for e in snapshot.encoders
    )
    return dataclasses.replace(snapshot, encoders=encoders)


def test_missed_panel_lists_signatures_with_reason_and_share_and_the_eager_time_lost() -> None:
    """The frame lists the most-missed signatures across encoders with their reason and
    share of the encoder's calls; each panel shows the eager time and what graphs would
    have saved, and the profiling calls with how many of their graphs serving replayed."""
    lines = _lines(_text(render(_covered(_snapshot())), width=140))
    body = "\n".join(lines)
    header = next(line for line in lines if "encoder" in line and "share" in line)
    assert header.split() == [
        "│",
        "encoder",
        "missed",
        "signature",
        "reason",
        "misses",
        "share",
        "│",
    ]
    rows = [line.split("│")[1].split() for line in lines if "capacity" in line and "@cpu" in line]
    assert rows == [
        ["vision", "float32[1,960,64],", "None", "@cpu", "s=0", "capacity", "10", "27.0", "%"],
        ["vision", "float32[1,798,64],", "None", "@cpu", "s=0", "capacity", "4", "10.8", "%"],
    ]
    assert "audio    float32[1,80,100] @cpu s=0" in body
    # 16 graphable misses: 2 warm-ups (20 + 10 ms), 14 capacity (10 x 9 + 4 x 8 ms).
    # 16 graphable misses; the two late keys never replayed get the replay-to-eager ratio
    # of the others, (20 x 2 + 5) / (20 x 10 + 20) ms: 15 + 8 + 10 x 9 x (1 - r) + 4 x 8 x (1 - r).
    assert "│ eager    152.0 ms in 16 misses · lost ≈ 120.0 ms host" in body
    assert "│ eager    12.0 ms in 3 misses · lost ? host" in body  # audio: no replay to go by
    assert "│ profile  calls 2 · captures 1 · 0 of 1 replayed while serving" in body


def test_a_missed_signature_with_several_reasons_gives_each_its_count() -> None:
    """A key with one warm-up and one capacity miss shows both reasons with their counts
    beside its 2 misses, not "warmup" alone; a narrow panel uses the short names."""
    key = sig("float32[1,960,64], None @cpu s=0")
    events = [
        GraphMissed("vision", key, 0, T0, MissReason.WARMUP, "call 1 of 2", 0.01),
        GraphMissed("vision", key, 0, T0, MissReason.CAPACITY, "cap", 0.01),
        GraphMissed("vision", key, 0, T0, MissReason.CAPACITY, "cap", 0.01),
    ]
    board = RecordBoard(title="top")
    board.add(EventRecord(e, 100, 0) for e in events)
    wide = [line for line in _lines(_text(render(board.snapshot()), width=140)) if "960" in line]
    assert [line.split("│")[1].split() for line in wide] == [
        [
            *("vision", "float32[1,960,64],", "None", "@cpu", "s=0"),
            *("capacity", "2,", "warmup", "1", "3", "100.0", "%"),
        ]
    ]
    narrow = _text(render(board.snapshot()), width=80)
    assert "│  vision   f32[1,960,64]     cap 2, warm 1       3  100.0 %" in narrow


def test_keys_captured_while_profiling_are_tagged() -> None:
    """A captured key of the profiling phase is marked (prof) in the captured keys."""
    events = _coverage_events()
    stats = StatsFold()
    stats.extend(events)
    coverage = derive_coverage(events)
    encoder = EncoderSnapshot(stats.snapshot("vision"), max_graphs=2, coverage=coverage["vision"])
    body = _text(render(LiveSnapshot("t", T0, (encoder,))))
    assert "float32[4,1024,64], None (prof)  22:13:20Z  100.0 ms" in body
    assert "float32[1,1024,64], None         22:13:20Z  100.0 ms" in body


def test_a_simulated_backend_shows_no_time_lost() -> None:
    """On the simulated backend a replay runs the forward again: the panel says n/a."""
    body = _text(render(_covered(_snapshot(), backend="simulated")))
    assert "eager    152.0 ms in 16 misses · lost n/a (simulated) host" in body
    compact = _text(render(_covered(_busy_snapshot(), backend="simulated")), width=80)
    assert "│ eager  152ms host, lost n/a (sim)   │" in compact


def test_frame_with_the_missed_panel_fits_an_80x24_terminal() -> None:
    """With coverage the busy frame still fits 80x24, keeping the missed panel's top rows."""
    console = Console(record=True, width=80, height=24, file=io.StringIO())
    console.print(render(_covered(_busy_snapshot()), height=24))
    lines = _lines(console.export_text())
    assert len(lines) <= 24
    assert max(len(line) for line in lines) <= 80
    body = "\n".join(lines)
    assert "╭─ top missed signatures" in body
    assert "│  vision   f32[1,960,64]     capacity      10  27.0 %" in body
    assert "│ eager  lost ≈120ms of 152ms host    │" in body
    assert "bus  events 300 · dropped 0" in lines
    for height in (20, 16):
        console = Console(record=True, width=80, height=height, file=io.StringIO())
        console.print(render(_covered(_busy_snapshot()), height=height))
        assert len(_lines(console.export_text())) <= height, height


def test_record_board_shows_the_coverage_of_each_worker() -> None:
    """omnitrace top folds the per-signature coverage from the log, per worker."""
    board = RecordBoard(title="top")
    board.add(EventRecord(e, 100, 0) for e in _coverage_events())
    vision, _ = board.snapshot().encoders
    assert vision.coverage is not None
    assert vision.coverage == derive_coverage(_coverage_events())["vision"]
    assert "top missed signatures" in _text(render(board.snapshot()))


# -- untrusted text: names, keys and messages are data, never markup or terminal controls ---

#: Names a log (or a model) can carry: an unbalanced closing tag, markup that would style the
#: frame, and an ESC colour sequence with a BEL.
HOSTILE = ("vision[/]", "[bold red]x", "a\x1b[31mb\x07")
CONTROLS = ("\x1b", "\x07", "\r", "\x9b")


def _hostile_snapshot(name: str) -> LiveSnapshot:
    key = f"float32[1,64,16] {name} @cpu s=0"
    stats = AdapterStats(
        name,
        graph_hits=3,
        warmup_misses=1,
        capture_failures=1,
        failure=f"RuntimeError: {name}",
        graphs=(CapturedGraphInfo(key, T0, 0.01, 1, "cpu", 0, MiB, 64),),
    )
    notice = Notice(T0, True, f"22:13:20Z FAILED {key}: RuntimeError: {name}\r", key)
    return LiveSnapshot(
        title=f"omnitrace top · {name}.jsonl",
        taken_epoch_ns=T0,
        encoders=(EncoderSnapshot(stats, backend=name, notices=(notice,)),),
        log=(f'{{"level": "error", "event": "capture_failed", "message": "{name}"}}', name),
    )


@pytest.mark.parametrize("name", HOSTILE)
def test_text_from_a_log_is_shown_literally_never_as_markup_or_controls(name: str) -> None:
    """A name, key, message, backend or log line is drawn as its literal text: no markup is
    parsed (no MarkupError, no style), and control characters appear as escapes."""
    console = Console(record=True, width=140, file=io.StringIO(), force_terminal=True)
    console.print(render(_hostile_snapshot(name)))
    text = console.export_text()
    shown = name.replace("\x1b", "\\x1b").replace("\x07", "\\x07")
    # Title, panel title, TERMINAL row, key, notice, backend and both log rows.
    assert text.count(shown) >= 7
    assert "\\r" in text
    assert not any(c in text for c in CONTROLS)
    # The only styles are the frame's own: nothing the name says, such as "bold red" on "x".
    styled = console.export_text(styles=True)
    assert "\x1b[31mb" not in styled
    if name == "[bold red]x":
        title = next(line for line in text.splitlines() if "╭─" in line)
        assert "[bold red]x" in title


@pytest.mark.parametrize("name", HOSTILE)
def test_live_view_of_a_hostile_adapter_name_keeps_drawing_and_restores_the_streams(
    bus: EventBus, name: str
) -> None:
    """In-process, events of an encoder named like markup or with an ESC keep the refresh
    thread alive, show the name literally, and sys.stdout and sys.stderr are restored after.

    The events are emitted on the bus directly: an adapter refuses such a name where it is
    built, but a bus fed from a recorded log (``replay --follow``) carries whatever it read.
    """
    stdout, stderr = sys.stdout, sys.stderr
    console = Console(file=io.StringIO(), force_terminal=True, width=100, height=30)
    view = LiveView(BusBoard(bus), console=console, refresh_per_second=20)
    with view:
        for _ in range(5):
            mono, epoch = now()
            bus.emit(
                missed(name, NO_SIGNATURE, mono, epoch, MissReason.WARMUP, "", 0.001, Phase.SERVING)
            )
        assert bus.flush()
        time.sleep(0.3)  # several frames from the refresh thread
        thread = view._live._refresh_thread
        assert thread is not None
        assert thread.is_alive()
    assert sys.stdout is stdout
    assert sys.stderr is stderr
    out = console.file.getvalue()  # type: ignore[attr-defined]
    assert name.replace("\x1b", "\\x1b").replace("\x07", "\\x07") in out
    assert "\x07" not in out
    assert "could not be drawn" not in out
    assert view.log.lines() == []  # no traceback of a dead thread


class _BrokenBoard:
    def __init__(self) -> None:
        self.calls = 0

    def snapshot(self) -> LiveSnapshot:
        self.calls += 1
        raise RuntimeError("board broke\x1b[2J")


def test_a_frame_that_cannot_be_drawn_is_one_line_and_the_streams_come_back() -> None:
    """A board that raises never ends the refresh thread or escapes the view: each frame says
    it could not be drawn, and leaving the block restores sys.stdout and sys.stderr."""
    stdout, stderr = sys.stdout, sys.stderr
    board = _BrokenBoard()
    console = Console(file=io.StringIO(), force_terminal=True, width=100, height=30)
    view = LiveView(board, console=console, refresh_per_second=20)
    with view:
        time.sleep(0.3)
        thread = view._live._refresh_thread
        assert thread is not None
        assert thread.is_alive()
    assert sys.stdout is stdout
    assert sys.stderr is stderr
    assert board.calls >= 3
    out = console.file.getvalue()  # type: ignore[attr-defined]
    assert "omnitrace: this frame could not be drawn: RuntimeError: board broke\\x1b[2J" in out
    assert "\x1b[2J" not in out


@pytest.mark.parametrize("width", [40, 60, 80, 100, 140])
def test_the_missed_panel_never_cuts_a_name_a_reason_or_a_number(width: int) -> None:
    """A long key shortens first; then the share and then the key column go, named in the
    panel's caption: the encoder, the reason and the counts stay whole at every width."""
    from omnitrace.sinks.live.layout import _missed_panel

    long_key = sig(
        "bfloat16[5,3,14,14336], int64[5,1024], None, int64[5,1024], bool[5,1024] @cuda:0 s=0"
    )
    events: list[Event] = [
        GraphMissed("vision", long_key, 0, T0, MissReason.INELIGIBLE, "paused", 0.01)
    ] * 13
    events += [GraphReplayed("vision", long_key, 0, T0, 0.002)] * 106
    coverage = derive_coverage(events)
    snapshot = _snapshot()
    encoders = tuple(
        dataclasses.replace(e, coverage=coverage.get(e.stats.adapter))
        for e in snapshot.encoders
        if e.stats.adapter == "vision"
    )
    panel = _missed_panel(encoders, width, 5)
    assert panel is not None
    text = _text(panel, width=width)
    lines = _lines(text)
    assert all(len(line) <= width for line in lines), text
    row = next(line for line in lines if line.startswith("│  vision"))
    assert "ineligible" in row, text
    assert " 13 " in row + " ", text
    assert "…" not in row.replace(row[row.find("bf") : row.find("ineligible")], ""), text
    if width >= 60:
        assert "10.9 %" in row, text
        assert "left out" not in text
    else:
        assert "%" not in row
        assert "signature and share left out" in text


@pytest.mark.parametrize("width", [100, 120, 139, 140, 141, 160])
def test_captured_keys_shorten_so_clock_capture_and_free_stay_whole(width: int) -> None:
    """Side by side panels of either width: the key is elided, the clock, the capture time
    and the free memory before it are never cut."""
    long_key = "bfloat16[5,3,14,14336], int64[5,1024], None, int64[5,1024], bool[5,1024] @cuda:0"
    graphs = tuple(
        CapturedGraphInfo(long_key, T0, 0.0427, 1, "cuda:0", 0, MiB, 64, free_bytes=11 << 30)
        for _ in range(2)
    )
    snapshot = _snapshot()
    encoders = tuple(
        dataclasses.replace(e, stats=AdapterStats(e.stats.adapter, graph_hits=40, graphs=graphs))
        for e in snapshot.encoders
    )
    text = _text(render(dataclasses.replace(snapshot, encoders=encoders)), width=width)
    rows = [line for line in _lines(text) if "42.7 ms" in line]
    assert len(rows) == 2, text  # two keys, the two panels side by side
    for row in rows:
        assert row.count("42.7 ms") == 2, text
        # Shown whole or not at all (a compact panel leaves the clock and free memory out).
        assert row.count("22:1") == row.count("22:13:20Z"), text
        assert row.count("11.") == row.count("11.0 GiB"), text
        if width >= 139:
            assert row.count("22:13:20Z") == 2, text
            assert row.count("11.0 GiB") == 2, text


@pytest.mark.parametrize(("width", "height"), [(40, 10), (80, 24), (100, 30)])
def test_a_whole_frame_fits_its_terminal_and_never_cuts_a_number(width: int, height: int) -> None:
    """The busy frame with coverage, at the terminal sizes operators run it in: within the
    width and the height, the bus line kept, and every figure whole. At 40x10 no panel fits
    at all: a row per encoder says the hit rate, the hits of the calls and the graphs."""
    console = Console(record=True, width=width, height=height, file=io.StringIO())
    console.print(render(_covered(_busy_snapshot()), height=height))
    text = console.export_text()
    lines = _lines(text)
    assert len(lines) <= height, text
    assert all(len(line) <= width for line in lines), text
    assert "bus  events 300 · dropped 0" in lines, text
    if height < 24:
        assert re.search(r"vision +75\.2 % +173/230 +4/4", text), text
        assert re.search(r"audio +100\.0 % +3/3 +2/4", text), text
        return
    for figure in ("75.2 %", "173 of 230 calls", "capacity 51", "952.0 MiB", "110.2 ms"):
        assert figure in text, (figure, text)


@pytest.mark.parametrize("width", [40, 50, 60, 70, 80, 90, 100, 120, 140, 160])
def test_panels_keep_every_figure_whole_at_any_width(width: int) -> None:
    """Panels side by side where each has room, else one under another; their rows take
    the compact wording, then wrap, before a number is cut."""
    text = _text(render(_covered(_busy_snapshot())), width=width)
    lines = _lines(text)
    assert all(len(line) <= width for line in lines), text
    flat = re.sub(r"\s*│\s*", " ", text)
    for figure in ("75.2 %", "100.0 %", "capacity 51", "ineligible 0", "952.0 MiB", "110.2 ms"):
        assert figure in flat, (figure, text)
    assert re.search(r"173 of 230 calls|hits 173 / calls 230", flat), text
    assert re.search(r"deferred 5|deferrals 5", flat), text
    side_by_side = "╮ ╭─ audio" in text
    assert side_by_side == (width >= 80), text
