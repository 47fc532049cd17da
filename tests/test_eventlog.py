"""The event log format: schema version 2 carries signatures; version 1 logs still read."""

from __future__ import annotations

import json
import logging
import math
import os
import resource
import subprocess
import sys
import time
import tracemalloc
from collections.abc import Callable
from pathlib import Path

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from omnitrace import (
    GraphCaptured,
    GraphMissed,
    GraphReplayed,
    MissReason,
    derive_stats,
)
from omnitrace.eventlog import (
    SCHEMA_VERSION,
    EventLogError,
    EventLogFollower,
    EventRecord,
    count_events,
    decode_record,
    encode_event,
    read_events,
)
from omnitrace.eventlog import reader as eventlog
from omnitrace.events import DeviceTimed
from omnitrace.signature import InputSpec, Signature
from omnitrace.sinks.jsonl import JsonlSink

SIG = Signature((InputSpec("bfloat16", (1, 1024, 1152), "cuda:0"), None), 94)


def test_version_2_writes_the_structured_signature_and_its_text() -> None:
    """A v2 record has the signature's fields and, for readers of the file, its text."""
    record = encode_event(
        GraphMissed("vision", SIG, 1, 2, MissReason.WARMUP, "call 1 of 2"), pid=7, rank=1
    )
    assert SCHEMA_VERSION == 2
    assert record["v"] == 2
    assert record["signature"] == {
        "inputs": [{"dtype": "bfloat16", "shape": [1, 1024, 1152], "device": "cuda:0"}, None],
        "stream": 94,
    }
    assert record["key"] == "bfloat16[1,1024,1152], None @cuda:0 s=94"
    assert decode_record(json.loads(json.dumps(record))).item.signature == SIG


def test_a_version_1_log_is_read_by_parsing_its_keys(tmp_path: Path) -> None:
    """Lines written by omnitrace 0.1 (text keys only) come back with their signatures."""
    log = tmp_path / "old.jsonl"
    lines = [
        {
            "v": 1, "type": "GraphMissed", "pid": 1, "rank": 0, "adapter": "vision",
            "key": "bfloat16[1,1024,1152], None @cuda:0 s=94", "monotonic_ns": 1,
            "epoch_ns": 1, "reason": "warmup", "detail": "call 1 of 2",
        },
        {
            "v": 1, "type": "GraphCaptured", "pid": 1, "rank": 0, "adapter": "vision",
            "key": "bfloat16[1,1024,1152], None @cuda:0 s=94", "monotonic_ns": 2,
            "epoch_ns": 2, "duration_s": 0.01, "pool_id": 1, "device": "cuda:0", "stream": 94,
            "capture_stream": 95, "bytes_reserved": 1, "static_bytes": 2, "graph_index": 0,
        },
    ]  # fmt: skip
    log.write_text("".join(json.dumps(line) + "\n" for line in lines))
    missed, captured = read_events(log)
    assert isinstance(captured, GraphCaptured)
    assert missed.signature == captured.signature == SIG
    assert derive_stats([missed, captured])["vision"]["num_graphs"] == 1


def test_a_version_2_record_with_a_malformed_signature_is_an_error() -> None:
    """A signature that is not {inputs, stream} is named in a one-line EventLogError."""
    record = encode_event(GraphMissed("v", SIG, 1, 2, MissReason.CAPACITY, "cap"), pid=1, rank=0)
    record["signature"] = {"inputs": [{"dtype": "f", "shape": [-1], "device": "x"}], "stream": 0}
    with pytest.raises(EventLogError, match=r"GraphMissed.signature: expected an input"):
        decode_record(record)
    del record["signature"]
    with pytest.raises(EventLogError, match=r"GraphMissed is missing field 'signature'"):
        decode_record(record)


def test_a_device_timing_of_an_unknown_kind_is_an_error() -> None:
    """DeviceTimed.kind is replay or eager; anything else is a one-line EventLogError."""
    record = encode_event(DeviceTimed("v", SIG, 1, 2, "replay", 0.001), pid=1, rank=0)
    assert decode_record(record).item == DeviceTimed("v", SIG, 1, 2, "replay", 0.001)
    record["kind"] = "warmup"
    with pytest.raises(
        EventLogError,
        match=r"^record: DeviceTimed.kind: expected one of replay, eager, got 'warmup'$",
    ):
        decode_record(record)


@pytest.mark.parametrize(
    "command",
    [
        ["top"],
        ["top", "--json"],
        ["replay"],
        ["advise"],
        ["top", "--follow", "--duration", "5"],
        ["replay", "--follow", "--tui", "--duration", "5"],
    ],
    ids=" ".join,
)
def test_every_reader_refuses_a_named_pipe_at_once(tmp_path: Path, command: list[str]) -> None:
    """A log path that is a FIFO is a one-line error within a second, never a blocked read."""
    fifo = tmp_path / "events.jsonl"
    os.mkfifo(fifo)
    start = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "omnitrace", *command, str(fifo)],
        capture_output=True,
        text=True,
        timeout=30,
        stdin=subprocess.DEVNULL,
    )
    elapsed = time.monotonic() - start
    assert done.returncode == 2, done.stderr
    refusal = f"omnitrace {command[0]}: error: {fifo}: is a named pipe, not an event log\n"
    assert done.stderr == refusal
    assert elapsed < 10  # the interpreter's start-up included; the refusal itself is at once


def _python(code: str, *args: str) -> subprocess.CompletedProcess[str]:
    """Run ``code`` in a child with a 15 s deadline and 2 GiB of address space, so a reader
    that blocks or reads without end fails the test instead of stalling or exhausting the
    machine."""

    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (2 << 30, 2 << 30))

    return subprocess.run(
        [sys.executable, "-c", code, *args],
        capture_output=True,
        text=True,
        timeout=15,
        preexec_fn=limit,
        stdin=subprocess.DEVNULL,
    )


_READ = """
import sys
from omnitrace.eventlog import EventLogError, read_events
try:
    list(read_events(sys.argv[1]))
except EventLogError as exc:
    print(exc)
"""


def test_a_character_device_is_refused_not_read_to_exhaustion() -> None:
    """``/dev/zero`` is refused by kind, instead of being read until memory runs out."""
    done = _python(_READ, "/dev/zero")
    assert done.stdout == "/dev/zero: is a character device, not an event log\n", done.stderr


def test_a_follower_refuses_a_pipe_that_appears_later(tmp_path: Path) -> None:
    """A followed path that turns up as a FIFO makes poll() raise instead of blocking."""
    code = """
import os, sys
from omnitrace.eventlog import EventLogError, EventLogFollower
with EventLogFollower(sys.argv[1]) as follower:
    assert follower.poll() == []
    os.mkfifo(sys.argv[1])
    try:
        follower.poll()
    except EventLogError as exc:
        print(exc)
"""
    path = tmp_path / "events.jsonl"
    done = _python(code, str(path))
    assert done.stdout == f"{path}: is a named pipe, not an event log\n", done.stderr


def test_a_rotated_file_that_is_a_pipe_is_refused(tmp_path: Path) -> None:
    """The rotated files are read with the same check as the log itself."""
    path = tmp_path / "events.jsonl"
    event = GraphMissed("v", SIG, 1, 2, MissReason.CAPACITY, "cap")
    path.write_bytes(orjson.dumps(encode_event(event, pid=1, rank=0)) + b"\n")
    os.mkfifo(tmp_path / "events.jsonl.1")
    done = _python(_READ, str(path))
    assert done.stdout == f"{path}.1: is a named pipe, not an event log\n", done.stderr


def test_a_nan_float_is_written_as_null_and_reads_back_as_nan(tmp_path: Path) -> None:
    """JSON has no NaN: the writer's null in a float field reads back as NaN, so one such
    event does not make every reader refuse the log."""
    path = tmp_path / "events.jsonl"
    sink = JsonlSink(path)
    sink.handle(
        [GraphReplayed("vision", SIG, 1, 2, math.nan), GraphReplayed("vision", SIG, 3, 4, 0.5)]
    )
    sink.close()
    assert b'"duration_s":null' in path.read_bytes()
    first, second = read_events(path)
    assert isinstance(first, GraphReplayed)
    assert math.isnan(first.duration_s)
    assert second == GraphReplayed("vision", SIG, 3, 4, 0.5)
    record = encode_event(GraphMissed("v", SIG, 1, 2, MissReason.CAPACITY, "cap"), pid=1, rank=0)
    record["epoch_ns"] = None  # an int field: null is still an error there
    with pytest.raises(EventLogError, match=r"GraphMissed.epoch_ns: expected int, got None"):
        decode_record(record)


@settings(max_examples=300, deadline=None)
@given(
    pieces=st.lists(st.tuples(st.integers(0, 40), st.booleans()), max_size=12),
    cuts=st.lists(st.integers(1, 16), min_size=1, max_size=8),
)
def test_the_line_splitter_hands_out_each_line_once_and_drops_the_long_ones(
    pieces: list[tuple[int, bool]], cuts: list[int]
) -> None:
    """Whatever the blocks a file is read in, the splitter hands out every line up to
    MAX_LINE bytes once, numbered as in the file, holds back only an unfinished last line,
    and names each longer line (finished or not) instead of handing it out."""
    data = b"".join(b"x" * size + (b"\n" if ended else b"") for size, ended in pieces)
    lines = data.split(b"\n")
    last = lines.pop()
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(eventlog, "MAX_LINE", 16)
        cutter = eventlog._Lines()
        handed: dict[int, bytes] = {}
        too_long: list[int] = []
        offset, turn = 0, 0
        while offset < len(data):
            block = data[offset : offset + cuts[turn % len(cuts)]]
            offset += len(block)
            turn += 1
            out, first = cutter.feed(block)
            assert out == b"" or out.endswith(b"\n")
            for number, line in enumerate(out.split(b"\n")[:-1], first + 1):
                assert number not in handed
                handed[number] = line
            too_long += cutter.too_long
            cutter.too_long.clear()
            assert cutter.held <= 16
        rest = cutter.rest()
    assert handed == {n: line for n, line in enumerate(lines, 1) if len(line) <= 16}
    long_ones = [n for n, line in enumerate(lines, 1) if len(line) > 16]
    assert too_long == long_ones + ([len(lines) + 1] if len(last) > 16 else [])
    assert rest == (last if len(last) <= 16 else b"")
    assert cutter.line == len(lines)


def _huge_line_log(path: Path, size: int) -> list[GraphReplayed]:
    """Two events, a line of ``size`` bytes, an event, and a line as long without a newline."""
    events = [GraphReplayed("vision", SIG, n, n, 0.5) for n in range(3)]
    lines = [orjson.dumps(encode_event(e, pid=1, rank=0)) + b"\n" for e in events]
    with path.open("wb") as file:
        file.write(lines[0] + lines[1])
        file.write(b"y" * size + b"\n")
        file.write(lines[2])
        file.write(b"z" * size)
    return events


def test_a_line_longer_than_max_line_is_skipped_by_its_number(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A line past MAX_LINE bytes, finished or not, is skipped as unreadable with its line
    number and the bound; the events around it are read."""
    path = tmp_path / "events.jsonl"
    events = _huge_line_log(path, eventlog.MAX_LINE + 10)
    with caplog.at_level(logging.WARNING, logger="omnitrace.eventlog"):
        assert list(read_events(path)) == events
        assert count_events(path) == 4  # the long finished line is a line all the same
    assert [r.getMessage() for r in caplog.records] == [
        f"{path}:3: skipping an unreadable line (longer than 1048576 bytes)",
        f"{path}:5: skipping an unreadable line (longer than 1048576 bytes)",
    ]


def test_a_log_of_only_an_overlong_line_is_no_event_log(tmp_path: Path) -> None:
    """A file whose one line is past MAX_LINE bytes is refused, naming that line."""
    path = tmp_path / "events.jsonl"
    path.write_bytes(b"q" * (eventlog.MAX_LINE + 1) + b"\n")
    with pytest.raises(EventLogError) as caught:
        list(read_events(path))
    assert str(caught.value) == (
        f"{path}: not an omnitrace event log (no line is an event record; "
        "line 1 is longer than 1048576 bytes)"
    )


def test_reading_a_huge_line_holds_at_most_max_line_of_it(tmp_path: Path) -> None:
    """Reading, counting and following a log with a 16 MiB line keep at most MAX_LINE of
    the line (plus a chunk) in memory, instead of the line whole, copied on every read."""
    path = tmp_path / "events.jsonl"
    events = _huge_line_log(path, 16 << 20)
    bound = eventlog.MAX_LINE + 4 * eventlog.READ_CHUNK + (256 << 10)

    def peak(work: Callable[[], object]) -> int:
        tracemalloc.start()
        try:
            work()
            return tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()

    assert peak(lambda: list(read_events(path))) < bound
    assert peak(lambda: count_events(path)) < bound
    with EventLogFollower(path) as follower:
        got: list[EventRecord] = []

        def follow() -> None:
            got.extend(follower.poll())
            while follower.behind:
                got.extend(follower.poll())

        assert peak(follow) < bound
    assert [r.item for r in got] == events
