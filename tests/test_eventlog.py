"""The event log format: schema version 2 carries signatures; version 1 logs still read."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from omnitrace import GraphCaptured, GraphMissed, MissReason, derive_stats
from omnitrace.eventlog import (
    SCHEMA_VERSION,
    EventLogError,
    decode_record,
    encode_event,
    read_events,
)
from omnitrace.events import DeviceTimed
from omnitrace.signature import InputSpec, Signature

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
