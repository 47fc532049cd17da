"""The JSONL sink with several processes on one log path, and its accounting at close.

Every writer emits events with ids of its own (its adapter name and a counter); the files
are read back line by line with :mod:`json` and reconciled against what each writer's bus
counted: every event is read back once, or counted as dropped or as deleted by rotation.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from omnitrace import EventBus, GraphReplayed
from omnitrace.events import Event
from omnitrace.sinks import jsonl
from omnitrace.sinks.jsonl import JsonlSink
from omnitrace.testing import sig

WRITER = """
    import json, sys
    from omnitrace import EventBus, GraphReplayed
    from omnitrace.signature import Signature
    from omnitrace.sinks.jsonl import JsonlSink

    template, name, events, max_bytes, backups, fresh = sys.argv[1:7]
    key = Signature.parse("float32[1,1024,1152]")
    print("ready", flush=True)
    sys.stdin.readline()
    sink = JsonlSink(
        template, max_bytes=int(max_bytes), backups=int(backups), rank=0, fresh=fresh == "1"
    )
    bus = EventBus(sinks=[sink], queue_size=100_000, drain_interval=0.002)
    for i in range(int(events)):
        bus.emit(GraphReplayed(name, key, i, i, 0.0))
        if i % 50 == 0:
            bus.flush()
    bus.close(timeout=30.0)
    (stats,) = bus.statistics().sinks
    print(json.dumps({
        "delivered": stats.delivered,
        "dropped_by": dict(stats.dropped_by),
        "disabled": stats.disabled,
        "written": sink.written,
        "deleted": sink.deleted_events,
        "rotations": sink.rotations,
    }), flush=True)
"""


def _start(script: Path, *args: str) -> subprocess.Popen[str]:
    proc = subprocess.Popen(
        [sys.executable, str(script), *args],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    assert proc.stdout.readline() == "ready\n"
    return proc


def _run_writers(
    tmp_path: Path, count: int, events: int, max_bytes: int, backups: int
) -> list[tuple[dict[str, Any], str]]:
    """Start ``count`` writers of ``events-{rank}.jsonl`` (all rank 0), let them go at once,
    and return each one's report and log output."""
    script = tmp_path / "writer.py"
    script.write_text(textwrap.dedent(WRITER))
    template = str(tmp_path / "logs" / "events-{rank}.jsonl")
    procs = [
        _start(script, template, f"w{n}", str(events), str(max_bytes), str(backups), "0")
        for n in range(count)
    ]
    for proc in procs:
        assert proc.stdin is not None
        proc.stdin.write("go\n")
        proc.stdin.flush()
    out = []
    for proc in procs:
        stdout, stderr = proc.communicate(timeout=120)
        assert proc.returncode == 0, stderr
        out.append((json.loads(stdout.splitlines()[-1]), stderr))
    return out


def _files(folder: Path) -> list[Path]:
    """The log and its rotated files, oldest first."""
    backups = sorted(
        (int(p.name.rsplit(".", 1)[1]), p) for p in folder.iterdir() if p.suffix[1:].isdigit()
    )
    return [p for _, p in reversed(backups)] + [folder / "events-0.jsonl"]


def _read_back(folder: Path) -> tuple[dict[str, list[int]], list[dict[str, Any]]]:
    """Every event id per adapter, in file order, and each file's first line."""
    ids: dict[str, list[int]] = {}
    heads = []
    for file in _files(folder):
        lines = file.read_bytes().splitlines()
        heads.append(json.loads(lines[0]))
        for line in lines:
            record = json.loads(line)  # a torn or glued line fails the test here
            if record["type"] == "GraphReplayed":
                ids.setdefault(record["adapter"], []).append(record["monotonic_ns"])
    return ids, heads


def test_several_processes_on_one_path_lose_nothing_and_keep_max_bytes(tmp_path: Path) -> None:
    """Six processes writing one path (a template without {pid}, every rank 0): no sink is
    disabled, every event is read back exactly once, no file passes max_bytes, each file's
    LogSegment line counts the events of all the files before it, and each writer says once
    that it shares the log, naming the {pid} template."""
    count, events, max_bytes = 6, 1500, 20_000
    reports = _run_writers(tmp_path, count, events, max_bytes, backups=10_000)
    folder = tmp_path / "logs"
    ids, heads = _read_back(folder)
    for n, (report, stderr) in enumerate(reports):
        assert not report["disabled"]
        assert (report["delivered"], report["dropped_by"]) == (events, {})
        assert report["written"] == events
        assert ids[f"w{n}"] == list(range(events))  # once each, in order
        assert stderr.count("put {pid} in the path") == 1, stderr
        assert "events-{rank}-{pid}.jsonl" in stderr
    assert sum(report["rotations"] for report, _ in reports) == len(heads) - 1
    assert all(p.stat().st_size <= max_bytes for p in folder.iterdir())
    files = _files(folder)
    before = 0
    for file, head in zip(files, heads, strict=True):
        if file != files[0]:
            assert head["type"] == "LogSegment"
            assert (head["events_before"], head["events_deleted"]) == (before, 0)
        before += sum(b'"type":"GraphReplayed"' in line for line in file.read_bytes().splitlines())
    assert before == count * events


def test_rotation_shared_by_several_processes_counts_every_deleted_event(tmp_path: Path) -> None:
    """With few backups, what the six writers' files hold plus what their rotations deleted
    is every event emitted, exactly; the newest file's header counts the deleted ones."""
    count, events = 6, 1500
    reports = _run_writers(tmp_path, count, events, max_bytes=20_000, backups=2)
    ids, heads = _read_back(tmp_path / "logs")
    deleted = sum(report["deleted"] for report, _ in reports)
    assert all((r["delivered"], r["dropped_by"]) == (events, {}) for r, _ in reports)
    assert deleted > 0
    assert sum(len(got) for got in ids.values()) + deleted == count * events
    for got in ids.values():
        assert got == list(range(events - len(got), events))  # the newest survive, once
    assert heads[-1]["events_deleted"] == deleted
    assert heads[0]["events_before"] == deleted


def test_a_fresh_writer_leaves_a_log_another_process_writes_alone(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """fresh=True deletes a log only when no process writes it: a second process started
    fresh on a log this process writes appends to it (and says so), and this process's
    events stay, with its later ones after the other's."""
    path = tmp_path / "logs" / "events-0.jsonl"
    script = tmp_path / "writer.py"
    script.write_text(textwrap.dedent(WRITER))
    ours = [GraphReplayed("here", sig("float32[1]"), i, i, 0.0) for i in range(200)]
    sink = JsonlSink(path, max_bytes=0, rank=0)
    try:
        sink.handle(ours[:100])
        with caplog.at_level(logging.WARNING, logger="omnitrace.sinks.jsonl"):
            other = _start(script, str(path), "there", "300", "0", "0", "1")
            assert other.stdin is not None
            other.stdin.write("go\n")
            stdout, stderr = other.communicate(timeout=60)
            sink.handle(ours[100:])
    finally:
        sink.close()
    report = json.loads(stdout.splitlines()[-1])
    assert report["delivered"] == 300
    assert "is being written by another process too" in stderr
    ids, _ = _read_back(path.parent)
    assert ids == {"here": list(range(200)), "there": list(range(300))}
    assert sink.shared
    assert any("appended to by another process" in r.getMessage() for r in caplog.records)


def test_a_rotation_looks_only_at_the_files_there_are(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With 100,000 backups allowed and a few files present, a rotation asks about the
    files there are, not about every name it could give a backup; gaps in the numbering
    shift as before (.1 .3 .7 become .2 .4 .8)."""
    path = tmp_path / "events.jsonl"
    line = [GraphReplayed("v", sig("float32[1]"), 10**9, 10**9, 0.0)]
    sink = JsonlSink(path, max_bytes=400, backups=100_000)
    try:
        for index in (1, 3, 7):
            (tmp_path / f"events.jsonl.{index}").write_bytes(b"")
        sink.handle(line)
        calls = []
        for name in ("stat", "lstat"):
            real = getattr(os, name)

            def counting(*args: Any, _real: Any = real, **kwargs: Any) -> Any:
                calls.append(args[0])
                return _real(*args, **kwargs)

            monkeypatch.setattr(os, name, counting)
        sink.handle(line)  # the second line does not fit: rotates
        monkeypatch.undo()
    finally:
        sink.close()
    assert sink.rotations == 1
    assert len(calls) < 20, calls[:30]
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == ["events.jsonl", *(f"events.jsonl.{i}" for i in (1, 2, 4, 8))]


def _events(n: int, offset: int = 0) -> list[Event]:
    return [GraphReplayed("v", sig("float32[1,80,100]"), offset + i, i, 0.0) for i in range(n)]


def _ids(path: Path) -> list[int]:
    out = []
    for file in [*sorted(path.parent.glob(path.name + ".*")), path]:
        for line in file.read_bytes().splitlines():
            record = json.loads(line)
            if record["type"] == "GraphReplayed":
                out.append(record["monotonic_ns"])
    return out


def test_close_returns_with_the_final_accounting_of_a_batch_stuck_in_a_rotation(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A batch still inside the sink's handle() when close() gives up (here: half written,
    then stuck counting the events of a file an earlier run wrote, before a rotation):
    close() counts what the file holds as delivered and the rest as abandoned, and nothing
    moves afterwards: once the rotation comes unstuck the sink writes none of the
    abandoned events, and the counters stay as close() left them."""
    path = tmp_path / "events.jsonl"
    earlier = JsonlSink(path, max_bytes=0)
    earlier.handle(_events(5, offset=10**6))
    earlier.close()
    stuck, release, counted = threading.Event(), threading.Event(), threading.Event()
    real = jsonl.count_events

    def slow_count(file: Path) -> int:
        stuck.set()
        release.wait(10)
        try:
            return real(file)
        finally:
            counted.set()

    monkeypatch.setattr(jsonl, "count_events", slow_count)
    sink = JsonlSink(path, max_bytes=20_000, backups=50)
    bus = EventBus(sinks=[sink], queue_size=10_000)
    try:
        for event in _events(1000):
            bus.emit(event)
        assert stuck.wait(10)
        bus.close(timeout=0.2)
        (closed,) = bus.statistics().sinks
        written = [i for i in _ids(path) if i < 10**6]
        assert closed.delivered + closed.dropped == 1000
        assert 0 < closed.delivered < 1000
        assert closed.dropped_by == {"abandoned": 1000 - closed.delivered}
        assert written == list(range(closed.delivered))
    finally:
        release.set()
    assert counted.wait(10)
    time.sleep(0.2)  # the rest of the stuck handle() runs
    (after,) = bus.statistics().sinks
    assert after == closed
    assert [i for i in _ids(path) if i < 10**6] == written
    assert sink.written == closed.delivered
