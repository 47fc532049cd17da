"""The JSONL event log: schema, rotation, the reader, the follower and stats reproduction."""

from __future__ import annotations

import dataclasses
import errno
import json
import logging
import os
import re
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

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
    derive_stats,
)
from omnitrace.bus import EventsNotWritten
from omnitrace.events import Event
from omnitrace.signature import InputSpec, Signature
from omnitrace.sinks.jsonl import (
    SCHEMA_VERSION,
    AdapterInfo,
    EventLogError,
    EventLogFollower,
    JsonlSink,
    follow,
    log_gap,
    read_events,
    read_records,
    worker_rank,
)
from omnitrace.sinks.registry import build_sinks
from omnitrace.testing import SimulatedGraphBackend, sig

EVENTS: list[Event] = [
    GraphMissed("audio", sig("float32[1,80,100]"), 1, 11, MissReason.WARMUP, "call 1 of 2"),
    GraphCaptured("audio", sig("float32[1,80,100]"), 2, 12, 0.25, 3, "cuda:0", 0, 9, 4096, 512, 0),
    GraphReplayed("audio", sig("float32[1,80,100]"), 3, 13, 0.0015),
    MemoryDeferred("vision", sig("float32[1,1024,64]"), 4, 14, 100, 200, "cuda:0"),
    GraphMissed("vision", sig("float32[1,1024,64]"), 5, 15, MissReason.MEMORY, "floor"),
    CaptureFailed(
        "vision", sig("float32[1,256,64]"), 6, 16, "RuntimeError", "boom \u2603", "cuda:0", 0
    ),
    MemoryDeferred("vision", sig("float32[2,1024,64]"), 7, 17, 100, 200, "cuda:0", 300),
    MemoryDeferred("vision", sig("float32[3,1024,64]"), 8, 18, 100, 200, "cuda:0", 300, 900),
]


def _write(path: Path, events: list[Event], **kwargs: Any) -> JsonlSink:
    sink = JsonlSink(path, **kwargs)
    try:
        sink.handle(events)
    finally:
        sink.close()
    return sink


def test_every_line_has_version_type_pid_and_rank(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each event is one JSON line with v, type, the writer's pid and its RANK."""
    monkeypatch.setenv("RANK", "3")
    path = tmp_path / "events.jsonl"
    _write(path, EVENTS)
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert len(lines) == len(EVENTS)
    assert {(line["v"], line["pid"], line["rank"]) for line in lines} == {
        (SCHEMA_VERSION, os.getpid(), 3)
    }
    assert [line["type"] for line in lines] == [type(e).__name__ for e in EVENTS]
    assert lines[0]["reason"] == "warmup"


def test_round_trip_restores_typed_events_and_enum(tmp_path: Path) -> None:
    """read_events gives back equal typed events, with MissReason restored as the enum."""
    path = tmp_path / "events.jsonl"
    _write(path, EVENTS)
    back = list(read_events(path))
    assert back == EVENTS
    assert back[0].reason is MissReason.WARMUP  # type: ignore[union-attr]


def test_a_deferral_written_before_cached_bytes_existed_reads_back_without_it(
    tmp_path: Path,
) -> None:
    """Fields added to an event after a log was written take their defaults on reading."""
    path = tmp_path / "events.jsonl"
    _write(path, EVENTS[-1:])
    (line,) = [json.loads(text) for text in path.read_text().splitlines()]
    assert line["cached_bytes"] == 300
    del line["cached_bytes"]
    path.write_text(json.dumps(line) + "\n")
    (back,) = read_events(path)
    assert back == dataclasses.replace(EVENTS[-1], cached_bytes=None)  # type: ignore[type-var]


def test_rank_falls_back_to_local_rank_then_zero() -> None:
    """RANK wins over LOCAL_RANK; neither set means rank 0; garbage is a ConfigError."""
    assert worker_rank({"RANK": "2", "LOCAL_RANK": "5"}) == 2
    assert worker_rank({"LOCAL_RANK": "5"}) == 5
    assert worker_rank({}) == 0
    with pytest.raises(ConfigError, match=r"^RANK: expected a nonnegative integer, got 'x'$"):
        worker_rank({"RANK": "x"})


def test_path_placeholders_name_the_worker(tmp_path: Path) -> None:
    """{pid} and {rank} in the path are replaced so workers write separate files."""
    sink = _write(tmp_path / "events-{rank}-{pid}.jsonl", EVENTS[:1])
    assert sink.path == tmp_path / f"events-0-{os.getpid()}.jsonl"
    assert sink.path.exists()


def test_the_rank_the_plugin_found_names_the_file_and_every_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """vLLM's tensor-parallel workers set no RANK: the rank passed to the sinks (vLLM's world
    group) fills {rank} and is on every line, so two ranks never write one file as rank 0."""
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    bus = EventBus()
    template = str(tmp_path / "events-{rank}.jsonl")
    (sink,) = build_sinks(bus, {"OMNITRACE_EVENTS_LOG": template}, rank=1)
    try:
        sink.handle(EVENTS[:2])
    finally:
        sink.close()
        bus.close()
    assert sink.path == tmp_path / "events-1.jsonl"
    assert {record.rank for record in read_records(sink.path)} == {1}


def test_torn_last_line_is_skipped(tmp_path: Path) -> None:
    """A half-written final line (no newline) is ignored by the reader."""
    path = tmp_path / "events.jsonl"
    _write(path, EVENTS[:3])
    with open(path, "ab") as f:
        f.write(b'{"v": 1, "type": "GraphRepl')
    assert list(read_events(path)) == EVENTS[:3]


def test_a_directory_is_refused_naming_it(tmp_path: Path) -> None:
    """Reading a directory raises EventLogError naming the path, not IsADirectoryError."""
    with pytest.raises(EventLogError, match=rf"^{tmp_path}: is a directory, not an event log$"):
        list(read_records(tmp_path))


def test_a_file_without_any_event_record_is_not_an_event_log(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A plain text file is an error naming its first bad line, not zero events, nor N warnings."""
    path = tmp_path / "notes.txt"
    path.write_text("first\nsecond\nthird")
    expected = (
        rf"^{path}: not an omnitrace event log \(no line is an event record; "
        r"line 1 is not JSON\)$"
    )
    with pytest.raises(EventLogError, match=expected):
        list(read_records(path))
    assert caplog.records == []


def test_unreadable_line_among_records_is_logged_as_unreadable_with_its_line_number(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A line that is not JSON between good records is skipped with one warning naming file
    and line and calling it unreadable: only the last line of a file can be torn."""
    path = tmp_path / "events.jsonl"
    _write(path, EVENTS[:2])
    with open(path, "ab") as f:
        f.write(b'{"v": 1, "type": "Gra\n')
    _write(path, EVENTS[2:])
    assert list(read_events(path)) == EVENTS
    assert [r.getMessage() for r in caplog.records] == [
        f"{path}:3: skipping an unreadable line (not JSON)"
    ]


def test_torn_last_line_is_logged_as_torn(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A last line cut short (no newline) is called torn, with its line number."""
    path = tmp_path / "events.jsonl"
    _write(path, EVENTS[:2])
    with open(path, "ab") as f:
        f.write(b'{"v": 2, "type": "GraphRepl')
    assert list(read_events(path)) == EVENTS[:2]
    assert [r.getMessage() for r in caplog.records] == [f"{path}:3: skipping a torn last line"]


def test_many_unreadable_lines_are_shown_up_to_a_bound_and_counted(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Past the first UNREADABLE_SHOWN unreadable lines of a file, one line counts them all."""
    from omnitrace.eventlog import UNREADABLE_SHOWN

    path = tmp_path / "events.jsonl"
    _write(path, EVENTS[:1])
    with open(path, "ab") as f:
        f.write(b"garbage\n" * (UNREADABLE_SHOWN + 5))
    _write(path, EVENTS[1:])
    assert list(read_events(path)) == EVENTS
    messages = [r.getMessage() for r in caplog.records]
    assert messages[:2] == [
        f"{path}:2: skipping an unreadable line (not JSON)",
        f"{path}:3: skipping an unreadable line (not JSON)",
    ]
    assert len(messages) == UNREADABLE_SHOWN + 1
    assert messages[-1] == (
        f"{path}: {UNREADABLE_SHOWN + 5} unreadable lines skipped in all (5 more than shown)"
    )


def test_writer_after_a_crash_starts_on_a_fresh_line(tmp_path: Path) -> None:
    """A new writer terminates a torn line, so the reader loses only the torn record."""
    path = tmp_path / "events.jsonl"
    _write(path, EVENTS[:2])
    with open(path, "ab") as f:
        f.write(b'{"v": 1, "type": "Gra')
    _write(path, EVENTS[2:])
    assert list(read_events(path)) == EVENTS


def test_newer_schema_version_is_a_clear_error(tmp_path: Path) -> None:
    """A line of a future schema version names the versions and says to upgrade."""
    path = tmp_path / "events.jsonl"
    path.write_text('{"v": 3, "type": "GraphReplayed", "pid": 1, "rank": 0}\n')
    expected = (
        rf"^{path}:1: event log schema version 3 is newer than this omnitrace reads "
        r"\(version 2\); upgrade omnitrace to read this log$"
    )
    with pytest.raises(EventLogError, match=expected):
        list(read_events(path))


def test_unknown_type_and_missing_field_are_errors(tmp_path: Path) -> None:
    """A record of an unknown type or without a required field names the problem."""
    path = tmp_path / "a.jsonl"
    path.write_text('{"v": 1, "type": "GraphExploded", "pid": 1, "rank": 0}\n')
    with pytest.raises(EventLogError, match=r"unknown record type 'GraphExploded'"):
        list(read_events(path))
    path.write_text('{"v": 1, "type": "GraphReplayed", "pid": 1, "rank": 0, "adapter": "a"}\n')
    with pytest.raises(EventLogError, match=r"GraphReplayed is missing field 'key'"):
        list(read_events(path))


def test_unknown_type_lists_every_record_type_a_log_holds(tmp_path: Path) -> None:
    """The error for an unknown record type names every type a reader takes, the segment
    header a rotated file starts with included."""
    path = tmp_path / "a.jsonl"
    path.write_text('{"v": 2, "type": "GraphExploded", "pid": 1, "rank": 0}\n')
    with pytest.raises(EventLogError) as caught:
        list(read_events(path))
    valid = str(caught.value).split("(valid: ")[1].rstrip(")").split(", ")
    assert valid == sorted(valid)
    assert {"AdapterInfo", "LogSegment", "GraphReplayed", "ProfilingObserved"} <= set(valid)


def test_bad_reason_and_wrong_field_type_are_errors(tmp_path: Path) -> None:
    """An unknown miss reason or a string where a number belongs is rejected."""
    record = json.loads(
        json.dumps(
            {"v": 1, "type": "GraphMissed", "pid": 1, "rank": 0, "adapter": "a", "key": "f32[1]"}
            | {"monotonic_ns": 1, "epoch_ns": 1, "reason": "bored", "detail": ""}
        )
    )
    path = tmp_path / "a.jsonl"
    path.write_text(json.dumps(record) + "\n")
    with pytest.raises(EventLogError, match=r"GraphMissed.reason: expected one of ineligible"):
        list(read_events(path))
    record |= {"reason": "warmup", "epoch_ns": "soon"}
    path.write_text(json.dumps(record) + "\n")
    with pytest.raises(EventLogError, match=r"GraphMissed.epoch_ns: expected int, got 'soon'"):
        list(read_events(path))


def test_rotation_caps_file_size_and_reader_spans_the_backups(tmp_path: Path) -> None:
    """Past max_bytes the file rotates to .1, .2; the reader reads them oldest first."""
    path = tmp_path / "events.jsonl"
    sink = JsonlSink(path, max_bytes=700, backups=5)
    try:
        for event in EVENTS:
            sink.handle([event])
    finally:
        sink.close()
    assert sink.rotations >= 2
    assert all(p.stat().st_size <= 700 for p in tmp_path.iterdir())
    assert list(read_events(path)) == EVENTS
    assert list(read_events(path, include_rotated=False)) != EVENTS


def test_rotation_drops_the_oldest_beyond_backups(tmp_path: Path) -> None:
    """With backups=1 only the newest rotated file survives, so the oldest events are gone."""
    path = tmp_path / "events.jsonl"
    sink = JsonlSink(path, max_bytes=300, backups=1)
    try:
        for event in EVENTS:
            sink.handle([event])
    finally:
        sink.close()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["events.jsonl", "events.jsonl.1"]
    survivors = list(read_events(path))
    assert survivors == EVENTS[len(EVENTS) - len(survivors) :]
    assert len(survivors) < len(EVENTS)


def test_follower_sees_batches_holds_partial_lines_and_crosses_rotation(tmp_path: Path) -> None:
    """The follower returns new records per poll, waits for a line's end, survives rotation."""
    path = tmp_path / "events.jsonl"
    with EventLogFollower(path) as follower:
        assert follower.poll() == []  # not created yet
        sink = JsonlSink(path, max_bytes=900, backups=2)
        try:
            sink.handle(EVENTS[:2])
            assert [r.item for r in follower.poll()] == EVENTS[:2]
            with open(path, "ab") as f:
                line = json.dumps({"v": 1, "type": "GraphReplayed", "pid": 1, "rank": 7})
                f.write(line[:20].encode())
            assert follower.poll() == []
            with open(path, "ab") as f:
                f.write(
                    line[20:-1].encode()
                    + b', "adapter": "x", "key": "float32[1]", "monotonic_ns": 0, "epoch_ns": 0,'
                    + b' "duration_s": 0.0}\n'
                )
            (record,) = follower.poll()
            assert (record.rank, record.item) == (
                7,
                GraphReplayed("x", sig("float32[1]"), 0, 0, 0.0),
            )
            seen = []
            for event in EVENTS[2:]:
                sink.handle([event])
                seen.extend(r.item for r in follower.poll())
            assert sink.rotations >= 1
            assert seen == EVENTS[2:]
        finally:
            sink.close()


def _run_adapters(bus: EventBus) -> dict[str, dict[str, int | float]]:
    backend = SimulatedGraphBackend(free_bytes=(1 << 30) + (200 << 20), graph_bytes=128 << 20)
    config = EncoderGraphConfig(max_graphs=2, min_free_bytes=1 << 30)
    vision = EncoderCudaGraph(torch.tanh, name="vision", config=config, bus=bus, backend=backend)
    audio = EncoderCudaGraph(torch.relu, name="audio", config=config, bus=bus, backend=backend)
    shapes = [(1, 8), (1, 8), (2, 8), (1, 8), (2, 8), (3, 8), (3, 8), (4, 8), (4, 8), (1, 8)]
    with torch.no_grad():
        for i, shape in enumerate(shapes * 3):
            (vision if i % 2 else audio)(torch.randn(shape))
        vision(torch.randn(2, 2).requires_grad_())
    return {"vision": vision.get_cumulative_stats(), "audio": audio.get_cumulative_stats()}


def test_derive_stats_over_the_log_reproduces_live_adapter_stats(tmp_path: Path) -> None:
    """A real adapter run on the simulated backend gives the same stats live and from the log."""
    path = tmp_path / "events.jsonl"
    bus = EventBus()
    try:
        sink = JsonlSink(path, bus=bus)
        bus.add_sink(sink)
        live = _run_adapters(bus)
        assert bus.flush()
    finally:
        bus.close()
    from_log = derive_stats(read_events(path))
    assert from_log == live
    assert from_log == {name: s.as_dict() for name, s in bus.adapter_stats().items()}
    assert live["vision"]["memory_misses"] + live["audio"]["memory_misses"] > 0
    assert live["vision"]["graph_hits"] > 0
    infos = [r.item for r in read_records(path) if isinstance(r.item, AdapterInfo)]
    assert {i.adapter: i.info["max_graphs"] for i in infos} == {"vision": 2, "audio": 2}


def test_closed_sink_refuses_to_write(tmp_path: Path) -> None:
    """Writing after close raises, so the bus disables the sink instead of losing silently."""
    sink = JsonlSink(tmp_path / "e.jsonl")
    sink.close()
    with pytest.raises(RuntimeError, match="is closed"):
        sink.handle(EVENTS[:1])


def test_negative_limits_are_rejected(tmp_path: Path) -> None:
    """max_bytes and backups must be nonnegative integers."""
    with pytest.raises(
        ConfigError, match=r"^max_bytes: expected a nonnegative integer, got -1 \(int\)$"
    ):
        JsonlSink(tmp_path / "e.jsonl", max_bytes=-1)


def test_missing_log_is_file_not_found(tmp_path: Path) -> None:
    """Reading a log that does not exist says where it looked."""
    with pytest.raises(FileNotFoundError, match="no event log at"):
        list(read_events(tmp_path / "nope.jsonl"))


def test_fresh_sink_replaces_the_log_and_its_backups(tmp_path: Path) -> None:
    """fresh=True starts an empty log, removing rotated files of an earlier run."""
    path = tmp_path / "events.jsonl"
    sink = JsonlSink(path, max_bytes=300, backups=2)
    try:
        for event in EVENTS:
            sink.handle([event])
    finally:
        sink.close()
    assert (tmp_path / "events.jsonl.1").exists()
    _write(path, EVENTS[:1], fresh=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["events.jsonl"]
    assert list(read_events(path)) == EVENTS[:1]


def test_follow_yields_events_until_stop(tmp_path: Path) -> None:
    """follow() yields events written before and during the follow, then ends on stop()."""
    path = tmp_path / "events.jsonl"
    sink = JsonlSink(path)
    try:
        sink.handle(EVENTS[:3])
        seen: list[Event] = []
        for event in follow(path, poll_interval=0.01, stop=lambda: len(seen) >= 3):
            seen.append(event)
            if len(seen) == 3:
                sink.handle(EVENTS[3:])
    finally:
        sink.close()
    assert seen == EVENTS


# -- only regular files ---------------------------------------------------------------------


def _refusal(path: Path, kind: str) -> str:
    return re.escape(
        f"event log: {path} is {kind}, not a regular file; omnitrace only writes, rotates "
        "and deletes regular files"
    )


def _make(tmp_path: Path, kind: str) -> tuple[Path, str]:
    """Put a thing of ``kind`` at a log path; return the path and how it is described."""
    path = tmp_path / "events.jsonl"
    target = tmp_path / "precious.txt"
    target.write_text("keep me\n")
    if kind == "link to a regular file":
        path.symlink_to(target)
        return path, "a symbolic link"
    if kind == "link to /dev/null":
        path.symlink_to("/dev/null")
        return path, "a symbolic link"
    if kind == "named pipe":
        os.mkfifo(path)
        return path, "a named pipe"
    if kind == "directory":
        path.mkdir()
        return path, "a directory"
    return Path("/dev/null"), "a character device"


def _construct(path: Path, **kwargs: Any) -> BaseException | None:
    """Build a JsonlSink on a thread with a deadline (opening a pipe could block forever)."""
    outcome: list[BaseException | None] = []

    def build() -> None:
        try:
            JsonlSink(path, **kwargs).close()
            outcome.append(None)
        except BaseException as exc:
            outcome.append(exc)

    thread = threading.Thread(target=build, daemon=True)
    thread.start()
    thread.join(5)
    assert outcome, f"JsonlSink({path}) blocked"
    return outcome[0]


@pytest.mark.parametrize("fresh", [True, False], ids=["fresh", "append"])
@pytest.mark.parametrize(
    "kind",
    ["link to a regular file", "link to /dev/null", "named pipe", "directory", "/dev/null"],
)
def test_sink_refuses_and_keeps_anything_but_a_regular_file(
    tmp_path: Path, kind: str, fresh: bool
) -> None:
    """A log path that is a link, a pipe, a directory or a device is refused in one line,
    and left exactly as it was (nothing is deleted, replaced or written through)."""
    path, described = _make(tmp_path, kind)
    before = os.lstat(path)
    error = _construct(path, fresh=fresh)
    assert isinstance(error, ConfigError)
    assert re.fullmatch(_refusal(path, described), str(error))
    after = os.lstat(path)
    assert (after.st_mode, after.st_ino, after.st_rdev) == (
        before.st_mode,
        before.st_ino,
        before.st_rdev,
    )
    assert (tmp_path / "precious.txt").read_text() == "keep me\n"


def test_a_rotated_file_that_is_a_link_is_refused_up_front(tmp_path: Path) -> None:
    """A planted events.jsonl.2 link is refused before anything is written or rotated."""
    path = tmp_path / "events.jsonl"
    target = tmp_path / "precious.txt"
    target.write_text("keep me\n")
    link = tmp_path / "events.jsonl.2"
    link.symlink_to(target)
    with pytest.raises(ConfigError, match=_refusal(link, "a symbolic link")):
        JsonlSink(path, fresh=True)
    assert link.is_symlink()
    assert target.read_text() == "keep me\n"


def test_rotation_refuses_to_replace_a_link_planted_later(tmp_path: Path) -> None:
    """A link planted at a rotation target makes handle() raise (the bus then disables the
    sink and counts its events); the link and its target stay untouched."""
    path = tmp_path / "events.jsonl"
    target = tmp_path / "precious.txt"
    target.write_text("keep me\n")
    sink = JsonlSink(path, max_bytes=300, backups=2)
    try:
        sink.handle(EVENTS[:1])
        link = tmp_path / "events.jsonl.1"
        link.symlink_to(target)
        with pytest.raises(ConfigError, match=_refusal(link, "a symbolic link")):
            sink.handle(EVENTS[1:])  # too big for one file: rotates
    finally:
        sink.close()
    assert link.is_symlink()
    assert target.read_text() == "keep me\n"


# -- rotation: split batches, count what is deleted -----------------------------------------


def _many(n: int, key: str = "float32[1,80,100]") -> list[Event]:
    return [GraphReplayed("audio", sig(key), i, i, 0.001) for i in range(n)]


def test_one_big_batch_is_split_so_no_file_exceeds_max_bytes(tmp_path: Path) -> None:
    """A batch far larger than max_bytes is spread over files, none past max_bytes, and the
    reader gets every event back in order."""
    path = tmp_path / "events.jsonl"
    events = _many(2000)
    sink = JsonlSink(path, max_bytes=4096, backups=1000)
    try:
        sink.handle(events)
    finally:
        sink.close()
    sizes = [p.stat().st_size for p in tmp_path.iterdir()]
    assert len(sizes) == sink.rotations + 1 > 50
    assert max(sizes) <= 4096
    assert list(read_events(path)) == events


def test_a_line_longer_than_max_bytes_gets_a_file_of_its_own(tmp_path: Path) -> None:
    """A single line over max_bytes is the only event of its file: the overshoot is one line."""
    path = tmp_path / "events.jsonl"
    long_key = "float32[" + ",".join("1" * 2500) + "]"
    events = [*_many(3), *_many(1, long_key), *_many(3)]
    sink = JsonlSink(path, max_bytes=1024, backups=10)
    try:
        sink.handle(events)
    finally:
        sink.close()
    oversized = [p for p in tmp_path.iterdir() if p.stat().st_size > 1024]
    assert len(oversized) == 1
    lines = oversized[0].read_bytes().splitlines()
    assert [json.loads(line)["type"] for line in lines] == ["LogSegment", "GraphReplayed"]
    assert list(read_events(path)) == events


@pytest.mark.parametrize("backups", [0, 1, 3])
def test_rotation_counts_the_events_it_deletes(
    tmp_path: Path, backups: int, caplog: pytest.LogCaptureFixture
) -> None:
    """Deleted events are counted by the sink, logged, and recorded at the start of the
    next file: what survives plus what was deleted is everything written."""
    path = tmp_path / "events.jsonl"
    events = _many(3000)
    sink = JsonlSink(path, max_bytes=8192, backups=backups)
    with caplog.at_level(logging.WARNING, logger="omnitrace.sinks.jsonl"):
        try:
            for start in range(0, len(events), 100):
                sink.handle(events[start : start + 100])
        finally:
            sink.close()
    survivors = list(read_events(path))
    assert sink.deleted_events > 0
    assert survivors == events[sink.deleted_events :]
    gap = log_gap(path)
    assert gap is not None
    assert gap.events_before == gap.events_deleted == sink.deleted_events
    assert any("rotation deleted" in r.getMessage() for r in caplog.records)


def test_deleted_events_are_counted_across_writer_restarts(tmp_path: Path) -> None:
    """A restarted writer appending to the log counts events of files it did not write."""
    path = tmp_path / "events.jsonl"
    events = _many(2000)
    for part in (events[:700], events[700:1400], events[1400:]):
        sink = JsonlSink(path, max_bytes=8192, backups=2)
        try:
            for start in range(0, len(part), 50):
                sink.handle(part[start : start + 50])
        finally:
            sink.close()
    survivors = list(read_events(path))
    gap = log_gap(path)
    assert gap is not None
    assert survivors == events[gap.events_before :]
    assert gap.events_deleted == gap.events_before


def test_a_complete_log_has_no_gap(tmp_path: Path) -> None:
    """A log whose rotation kept every file, or that never rotated, reports no gap."""
    path = tmp_path / "events.jsonl"
    assert log_gap(path) is None
    _write(path, _many(100), max_bytes=2048, backups=100)
    assert log_gap(path) is None
    assert len(list(read_events(path))) == 100


# -- a full disk, unencodable events, the path template, headers within max_bytes ---------


@pytest.fixture
def small_tmpfs(tmp_path: Path) -> Iterator[Path]:
    """A 256 KiB tmpfs mounted for the test (needs root, as in CI), unmounted after it."""
    if os.geteuid() != 0:
        pytest.skip("mounting a 256 KiB tmpfs to fill up needs root (CI runs as root)")
    mount = tmp_path / "small"
    mount.mkdir()
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(mount)],
        capture_output=True,
        text=True,
    )
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
    try:
        yield mount
    finally:
        # Lazily: a test that failed with the log still open must not leave the mount.
        subprocess.run(["umount", "--lazy", str(mount)], check=True)


def _fill(path: Path, leave: int) -> None:
    """Fill the file system of ``path`` (a file created for it), then free ``leave`` bytes."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT)
    try:
        while os.write(fd, b"x" * 4096):
            pass
    except OSError as exc:
        if exc.errno != errno.ENOSPC:
            raise
    finally:
        os.close(fd)
    os.truncate(path, max(path.stat().st_size - leave, 0))


def _jsonl_stats(bus: EventBus) -> Any:
    return next(s for s in bus.statistics().sinks if s.name == "jsonl")


def test_a_full_disk_is_counted_and_writing_resumes_when_space_returns(
    small_tmpfs: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """On a full tmpfs the sink stays attached, counts what it could not write (delivered is
    what the file holds, with no torn line), logs the outage, and once space is freed writes
    every later event."""
    path = small_tmpfs / "events.jsonl"
    filler = small_tmpfs / "filler"
    bus = EventBus()
    sink = JsonlSink(path, max_bytes=32 << 10, backups=2, bus=bus)
    bus.add_sink(sink)
    _fill(filler, leave=20_000)
    with caplog.at_level(logging.WARNING, logger="omnitrace.sinks.jsonl"):
        for _ in range(12):
            for event in _many(250):
                bus.emit(event)
            bus.flush()
        full = _jsonl_stats(bus)
        assert full.dropped_by.get("write_failed", 0) > 0
        assert full.delivered == len(list(read_events(path))) == sink.written
        assert full.delivered + full.dropped == 3000
        assert path.read_bytes().endswith(b"\n")
        filler.unlink()
        before = sink.written
        for start in range(0, 20_003, 500):
            for event in _many(min(500, 20_003 - start)):
                bus.emit(event)
            bus.flush()
        bus.close()
    after = _jsonl_stats(bus)
    assert not after.disabled
    assert sink.written - before == 20_003
    assert after.dropped_by == full.dropped_by == {"write_failed": sink.not_written}
    messages = [r.getMessage() for r in caplog.records]
    assert any(
        m.endswith("No space left on device; events are counted as not written until space "
                   "is freed")
        for m in messages
    )  # fmt: skip
    assert any(
        m.endswith(f"writing again; {sink.not_written} events were not written while the disk "
                   "was full")
        for m in messages
    )  # fmt: skip


def test_a_partly_written_batch_keeps_only_its_whole_lines(small_tmpfs: Path) -> None:
    """A batch the disk takes only part of leaves whole lines: the file ends on a newline
    and reads back exactly the events counted as written."""
    path = small_tmpfs / "events.jsonl"
    sink = JsonlSink(path, max_bytes=0)
    _fill(small_tmpfs / "filler", leave=10_000)
    events = _many(2000)
    try:
        with pytest.raises(EventsNotWritten, match=r"^\d+ events not written: No space left"):
            sink.handle(events)
    finally:
        sink.close()
    assert 0 < sink.written < len(events)
    assert sink.written + sink.not_written == len(events)
    assert path.read_bytes().endswith(b"\n")
    assert list(read_events(path)) == events[: sink.written]


def test_an_event_json_cannot_carry_is_counted_and_the_rest_written(
    tmp_path: Path,
) -> None:
    """A lone surrogate in a name or a dimension past 2**64 loses that event only (counted
    as write_failed); the sink stays attached and the log stays readable."""
    path = tmp_path / "events.jsonl"
    bus = EventBus()
    bus.add_sink(JsonlSink(path, bus=bus))
    good = _many(3)
    huge = Signature((InputSpec("float32", (2**65,), "cpu"),), 0)
    bus.emit(good[0])
    bus.emit(GraphReplayed("bad\udc80", sig("float32[1,80,100]"), 1, 1, 0.001))
    bus.emit(good[1])
    bus.emit(GraphReplayed("audio", huge, 2, 2, 0.001))
    bus.emit(good[2])
    bus.close()
    stats = _jsonl_stats(bus)
    assert not stats.disabled
    assert stats.dropped_by == {"write_failed": 2}
    assert list(read_events(path)) == good


@pytest.mark.parametrize(
    "template", ["{foo}.jsonl", "{", "{0}", "{pid:099999999}", "ev{pid.__class__}.jsonl", "a}b"]
)
def test_a_path_template_has_only_pid_and_rank(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, template: str
) -> None:
    """Any brace in OMNITRACE_EVENTS_LOG but {pid} and {rank} is a one-line ConfigError
    naming the variable, at once and creating nothing."""
    monkeypatch.chdir(tmp_path)
    value = template
    start = time.monotonic()
    with pytest.raises(ConfigError) as caught:
        build_sinks(EventBus(), {"OMNITRACE_EVENTS_LOG": value})
    assert time.monotonic() - start < 1
    assert str(caught.value) == (
        "OMNITRACE_EVENTS_LOG: expected a path whose only braces are {pid} and {rank}, "
        f"got {value!r} (str)"
    )
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(ConfigError, match=r"^path: expected a path whose only braces"):
        JsonlSink(value)


def test_pid_and_rank_are_substituted(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """{pid} and {rank} are filled in, each as often as it appears."""
    monkeypatch.setenv("RANK", "3")
    sink = JsonlSink(tmp_path / "ev-{rank}-{pid}-{rank}.jsonl")
    sink.close()
    assert sink.path.name == f"ev-3-{os.getpid()}-3.jsonl"


INFO = {"max_graphs": 4, "min_free_bytes": 1 << 30, "backend": "simulated"}


def test_a_max_bytes_smaller_than_the_header_lines_is_refused(tmp_path: Path) -> None:
    """With 12 adapters registered, max_bytes=1200 cannot hold a file's LogSegment and
    AdapterInfo lines: refused where the sink is built, naming the size needed."""
    bus = EventBus()
    for index in range(12):
        bus.register_adapter(f"encoder{index}", INFO)
    with pytest.raises(
        ConfigError,
        match=r"^max_bytes: expected 0 \(never rotate\) or at least \d+, the bytes of a "
        r"file's own header lines, got 1200$",
    ):
        JsonlSink(tmp_path / "events.jsonl", max_bytes=1200, bus=bus)
    assert list(tmp_path.iterdir()) == []


def test_an_adapter_registered_late_never_pushes_a_file_past_max_bytes(tmp_path: Path) -> None:
    """The info line of an adapter registered when the file is nearly full starts the next
    file: when every line fits, every file fits."""
    for late_at in range(1, 12):
        directory = tmp_path / str(late_at)
        bus = EventBus()
        bus.register_adapter("audio", INFO)
        bus.register_adapter("vision", INFO)
        sink = JsonlSink(directory / "events.jsonl", max_bytes=1000, backups=100, bus=bus)
        events = _many(24)
        for index, event in enumerate(events):
            if index == late_at:
                bus.register_adapter("late", INFO)
            sink.handle([event])
        sink.close()
        sizes = [p.stat().st_size for p in directory.iterdir()]
        assert max(sizes) <= 1000, (late_at, sizes)
        assert list(read_events(directory / "events.jsonl")) == events
        lines = (directory / "events.jsonl").read_bytes().splitlines()
        assert b'"adapter":"late"' in b"".join(lines)  # every file describes every adapter
