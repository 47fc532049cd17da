"""The event log format: schema version 2 carries signatures; version 1 logs still read."""

from __future__ import annotations

import json
import math
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

import orjson
import pytest

from omnitrace import GraphCaptured, GraphMissed, GraphReplayed, MissReason, derive_stats
from omnitrace.eventlog import (
    SCHEMA_VERSION,
    EventLogError,
    decode_record,
    encode_event,
    read_events,
)
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
