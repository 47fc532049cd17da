"""The follower under fast rotation: every event is delivered once, or counted as lost."""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path
from typing import IO

import pytest

from omnitrace import GraphReplayed
from omnitrace.eventlog import AdapterInfo, EventLogFollower, EventRecord, LineEncoder
from omnitrace.eventlog import reader as eventlog
from omnitrace.sinks.jsonl import JsonlSink
from omnitrace.testing import sig

SIG = sig("float32[1,8] @cpu s=0")


def _write(sink: JsonlSink, total: int, batch: int) -> None:
    _write_from(sink, 0, total, batch)


def _write_from(sink: JsonlSink, first: int, end: int, batch: int) -> None:
    """Write the events numbered ``first`` to ``end`` (their monotonic time), ``batch`` at
    a time."""
    for start in range(first, end, batch):
        stop = min(start + batch, end)
        sink.handle([GraphReplayed("vision", SIG, i, i, 1e-4) for i in range(start, stop)])


def _ids(records: list[EventRecord]) -> list[int]:
    return [r.item.monotonic_ns for r in records if not isinstance(r.item, AdapterInfo)]


def _poll_all(follower: EventLogFollower) -> list[int]:
    ids = _ids(follower.poll())
    while follower.behind:
        ids += _ids(follower.poll())
    return ids


@pytest.mark.parametrize("backups", [1, 3])
def test_fast_rotation_delivers_each_event_once_or_counts_it_lost(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, backups: int
) -> None:
    """A writer rotating every few events while the follower polls (and sometimes falls
    behind past the backups): no event comes twice, and the ones missing are exactly the
    ones the follower counts and warns about as deleted by rotation before it read them."""
    path = tmp_path / "events.jsonl"
    total = 30_000
    sink = JsonlSink(path, max_bytes=3_000, backups=backups)
    writer = threading.Thread(target=_write, args=(sink, total, 6))
    ids: list[int] = []
    caplog.set_level(logging.WARNING, logger="omnitrace.eventlog")
    with EventLogFollower(path) as follower:
        assert follower.poll() == []  # the log's first file is open before the writer starts
        writer.start()
        polls = 0
        while writer.is_alive():
            polls += 1
            ids += _ids(follower.poll())
            if polls % 40 == 0:
                time.sleep(0.01)  # fall behind: rotation deletes files not read yet
        writer.join()
        sink.close()
        ids += _poll_all(follower)
        lost = follower.lost_to_rotation
    assert sink.rotations > 500
    assert sink.written == total
    assert len(ids) == len(set(ids)), f"{len(ids) - len(set(ids))} events delivered twice"
    assert ids == sorted(ids)
    missing = total - len(ids)
    assert lost == missing
    assert missing <= sink.deleted_events
    assert missing > 0  # the sleeps made the follower fall behind past the backups
    warned = [r.getMessage() for r in caplog.records if "before they were read" in r.getMessage()]
    assert warned
    assert sum(int(m.split("rotation deleted ")[1].split()[0]) for m in warned) == missing


def test_files_rotated_while_the_follower_looks_for_them_come_in_order(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """When the writer rotates several times while the follower opens the rotated files
    (so their suffixes no longer give their age), the follower looks again, and on a later
    poll reads every file once, oldest first."""
    path = tmp_path / "events.jsonl"
    sink = JsonlSink(path, max_bytes=1_000, backups=60)
    written = 0

    def write(count: int) -> None:
        nonlocal written
        sink.handle(
            [GraphReplayed("vision", SIG, i, i, 1e-4) for i in range(written, written + count)]
        )
        written += count

    def rotate(times: int) -> None:
        target = sink.rotations + times
        while sink.rotations < target:
            write(1)

    opened = eventlog._open_log
    meddling = [0]

    def open_log(file: Path) -> IO[bytes]:
        handle = opened(file)
        if file.name == "events.jsonl.1" and meddling[0]:
            meddling[0] -= 1
            rotate(3)  # the files move up three places while the follower is at .1
        return handle

    monkeypatch.setattr(eventlog, "_open_log", open_log)
    with EventLogFollower(path) as follower:
        write(2)
        ids = _poll_all(follower)
        rotate(1)
        meddling[0] = eventlog._SCAN_TRIES  # every look of the next poll is disturbed
        ids += _poll_all(follower)
        assert meddling[0] == 0
        write(5)
        ids += _poll_all(follower)
        lost = follower.lost_to_rotation
    sink.close()
    assert sink.deleted_events == 0
    assert sink.rotations > 3 * eventlog._SCAN_TRIES
    assert ids == list(range(written))
    assert lost == 0


def test_a_follower_joined_past_the_top_counts_what_rotation_deleted(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A follower that joined a log at a byte (a relay started for a running writer) and
    then fell behind past the backups counts exactly the events it could not read, those
    before the byte it joined at not included."""
    path = tmp_path / "events.jsonl"
    sink = JsonlSink(path, max_bytes=20_000, backups=1)
    _write(sink, 30, 6)
    caplog.set_level(logging.WARNING, logger="omnitrace.eventlog")
    with EventLogFollower(path, start_offset=path.stat().st_size) as follower:
        ids = _poll_all(follower)
        _write_from(sink, 30, 600, 6)
        assert sink.deleted_events > 0
        ids += _poll_all(follower)
        lost = follower.lost_to_rotation
    sink.close()
    assert ids == sorted(set(ids))
    assert ids[0] == 30
    assert ids[-1] == 599
    assert lost == 570 - len(ids) > 0
    warned = [r.getMessage() for r in caplog.records if "before they were read" in r.getMessage()]
    assert warned == [
        f"{path}: rotation deleted {lost} events before they were read ({lost} in all): the "
        "follower fell behind the writer by more than the log's backups"
    ]


def test_a_poll_reads_at_most_poll_bytes_and_says_it_is_behind(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A follower of a large log reads it over several polls of at most ``poll_bytes`` each,
    saying it is behind until it has read everything, and a follower closed while behind
    warns how many bytes it left unread."""
    path = tmp_path / "events.jsonl"
    sink = JsonlSink(path)
    _write(sink, 12_000, 100)
    sink.close()
    size = path.stat().st_size
    budget = 256 << 10
    with EventLogFollower(path, poll_bytes=budget) as follower:
        ids: list[int] = []
        polls = 0
        while True:
            before = follower._files[0].file.tell() if follower._files else 0
            ids += _ids(follower.poll())
            polls += 1
            assert follower._files[0].file.tell() - before <= budget
            if not follower.behind:
                break
    assert ids == list(range(12_000))
    assert polls == size // budget + 1  # the last poll finds the end
    caplog.set_level(logging.WARNING, logger="omnitrace.eventlog")
    with EventLogFollower(path, poll_bytes=budget) as follower:
        first = follower.poll()
        assert follower.behind
        read = follower._files[0].file.tell()
    assert 0 < len(first) < 12_000
    assert [r.getMessage() for r in caplog.records] == [
        f"{path}: stopped following with {size - read} bytes of the log not read yet"
    ]


def test_a_line_that_grows_past_max_line_is_skipped_and_the_next_line_read(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A followed line that grows past MAX_LINE over several polls is skipped by its line
    number once its newline comes; the record after it is read."""
    caplog.set_level(logging.WARNING, logger="omnitrace.eventlog")
    path = tmp_path / "events.jsonl"
    encode = LineEncoder(pid=1, rank=0)
    path.write_bytes(b"".join(encode(GraphReplayed("vision", SIG, i, i, 1e-4)) for i in (0, 1)))
    with EventLogFollower(path) as follower:
        ids = _ids(follower.poll())
        with path.open("ab") as file:
            for _ in range(5):
                file.write(b"w" * (eventlog.MAX_LINE // 2))
                file.flush()
                assert follower.poll() == []
            file.write(b"\n" + encode(GraphReplayed("vision", SIG, 2, 2, 1e-4)))
        ids += _poll_all(follower)
    assert ids == [0, 1, 2]
    assert [r.getMessage() for r in caplog.records] == [
        f"{path}:3: skipping an unreadable line (longer than {eventlog.MAX_LINE} bytes)"
    ]
