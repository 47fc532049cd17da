"""The fast path of the line decoder takes what the reference decoder takes, and no more.

Whatever a line holds, the fast decoder either returns exactly the record
:func:`~omnitrace.eventlog.decode_record` returns for it, or declines (None), and the line
then goes the reference way, which converts it or says what is wrong with it. The same holds
for raw lines read from their head and tail (:meth:`FastDecoder.lines`): a line it takes
is JSON, and what it returns is what the whole line, parsed and decoded, gives.
"""

from __future__ import annotations

import copy
import json
from typing import Any

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from omnitrace import events as ev
from omnitrace.eventlog import (
    EventLogError,
    EventRecord,
    LineEncoder,
    decode_record,
    dumps,
    encode_event,
)
from omnitrace.eventlog import fast as eventlog_fast
from omnitrace.eventlog.fast import FastDecoder
from omnitrace.events import MissReason, Phase
from omnitrace.signature import InputSpec, Signature

SIG = Signature((InputSpec("bfloat16", (1, 1024, 1152), "cuda:0"), None), 94)
EVENTS: list[ev.Event] = [
    ev.GraphCaptured("vision", SIG, 1, 2, 0.5, 1, "cuda:0", 94, 95, 1 << 20, 4096, 0, 1 << 30),
    ev.GraphCaptured("vision", SIG, 1, 2, 0.5, 1, "cuda:0", 94, 95, 1 << 20, 4096, 0),
    ev.GraphReplayed("vision", SIG, 3, 4, 0.001),
    ev.GraphMissed("audio", SIG, 5, 6, MissReason.WARMUP, "call 1 of 2", 0.004),
    ev.GraphMissed("audio", SIG, 5, 6, MissReason.INELIGIBLE, "cpu", phase=Phase.PROFILING),
    ev.MemoryDeferred("vision", SIG, 7, 8, 100, 200, "cuda:0"),
    ev.CaptureFailed("vision", SIG, 9, 10, "RuntimeError", "boom", "cuda:0", 94),
    ev.DeviceTimed("vision", SIG, 11, 12, "replay", 0.0009),
    ev.ProfilingObserved("vision", ev.NO_SIGNATURE, 13, 14, "runner", 2, phase=Phase.PROFILING),
    ev.MemoryDeferred("vision", SIG, 7, 8, 100, 200, "cuda:0", 50, 900),
]


def _reference(record: dict[str, Any]) -> EventRecord | EventLogError:
    try:
        return decode_record(record, where="line")
    except EventLogError as exc:
        return exc


def _check(decoder: FastDecoder, record: dict[str, Any]) -> bool:
    """Check the fast result against the reference; return whether the fast path took it."""
    fast = decoder(copy.deepcopy(record))
    if fast is None:
        return False
    want = _reference(record)
    assert isinstance(want, EventRecord), (record, want)
    assert fast == want
    return True


def _line(event: ev.Event) -> dict[str, Any]:
    # Through the writer's JSON, as a reader sees it.
    parsed: dict[str, Any] = orjson.loads(orjson.dumps(encode_event(event, pid=7, rank=1)))
    return parsed


@pytest.mark.parametrize("event", EVENTS, ids=lambda e: type(e).__name__)
def test_the_writers_lines_take_the_fast_path_and_equal_the_reference(event: ev.Event) -> None:
    """Every event type as the writer writes it is decoded fast, equal to the reference."""
    assert _check(FastDecoder(), _line(event))


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("monotonic_ns", True),  # a bool is no integer
        ("monotonic_ns", 1.0),
        ("duration_s", 1),  # an integer time: the reference keeps it an int
        ("duration_s", None),  # a non-finite time written as null: NaN
        ("phase", "idle"),
        ("v", 1),  # schema 1: the signature comes from the key text
        ("v", 3),
        ("pid", "7"),
        ("pid", False),
        ("type", "GraphExploded"),
        ("adapter", 5),
    ],
)
def test_values_the_reference_converts_or_refuses_are_declined(field: str, value: Any) -> None:
    """A value the reference decoder would convert or refuse is left to it."""
    record = _line(EVENTS[0])
    record[field] = value
    assert not _check(FastDecoder(), record)


def test_a_device_timing_of_another_kind_is_declined() -> None:
    """DeviceTimed's kind must be replay or eager; anything else goes the reference way."""
    record = _line(EVENTS[7])
    record["kind"] = "compile"
    assert FastDecoder()(record) is None
    assert isinstance(_reference(record), EventLogError)


def test_a_cached_signature_is_not_reused_for_a_different_json_text() -> None:
    """A signature that equals a cached one as Python values (true == 1) but not as JSON is
    decoded anew, and refused as the reference refuses it."""
    decoder = FastDecoder()
    good = _line(EVENTS[2])
    good["signature"]["stream"] = 1
    assert _check(decoder, good)
    bad = copy.deepcopy(good)
    bad["signature"]["stream"] = True
    assert not _check(decoder, bad)
    assert isinstance(_reference(bad), EventLogError)
    floats = copy.deepcopy(good)
    floats["signature"]["inputs"][0]["shape"] = [1.0, 1024, 1152]
    assert not _check(decoder, floats)


def test_repeated_signatures_are_one_object() -> None:
    """Lines of the same key share one decoded signature (and its cached hash)."""
    decoder = FastDecoder()
    first, second = decoder(_line(EVENTS[2])), decoder(_line(EVENTS[3]))
    assert first is not None
    assert second is not None
    assert first.item.signature is second.item.signature


_JSON = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-3, 3)
    | st.floats(allow_nan=False)
    | st.text(max_size=4),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3)
    ),
    max_leaves=6,
)


@settings(max_examples=400, deadline=None)
@given(
    st.sampled_from(EVENTS),
    st.lists(st.tuples(st.integers(0, 30), _JSON | st.just("<drop>")), max_size=3),
)
def test_any_mutation_is_declined_or_decoded_as_the_reference(
    event: ev.Event, mutations: list[tuple[int, Any]]
) -> None:
    """Changing or dropping any field, nested ones included, never makes the fast path
    return something the reference decoder would not."""
    record = _line(event)
    paths: list[tuple[Any, Any]] = []

    def walk(node: Any) -> None:
        items = node.items() if isinstance(node, dict) else enumerate(node)
        for key, value in list(items):
            paths.append((node, key))
            if isinstance(value, (dict, list)):
                walk(value)

    walk(record)
    for index, value in mutations:
        if not paths:
            break
        node, key = paths[index % len(paths)]
        if value == "<drop>" and isinstance(node, dict):
            del node[key]
        elif value != "<drop>":
            node[key] = value
        paths = []
        walk(record)
    # Only values a JSON line can hold.
    record = json.loads(json.dumps(record))
    _check(FastDecoder(), record)


# -- raw lines: a head parsed once, a tail per line --------------------------------------------


def _raw(event: ev.Event) -> bytes:
    # The writer's own bytes, without the newline.
    return LineEncoder(pid=7, rank=1)(event).rstrip(b"\n")


def _check_line(decoder: FastDecoder, raw: bytes) -> bool:
    """Check the line path against parsing the line whole and the reference decoder; return
    whether the line path took it."""
    (fast,), declined = decoder.lines([raw])
    assert declined == (fast is None)
    if fast is None:
        return False
    parsed = orjson.loads(raw)  # a line the line path takes is JSON ...
    assert isinstance(parsed, dict)
    want = _reference(parsed)  # ... and a record the reference decoder reads the same
    assert isinstance(want, EventRecord), (raw, want)
    assert fast == want
    return True


@pytest.mark.parametrize("event", EVENTS, ids=lambda e: type(e).__name__)
def test_the_writers_raw_lines_take_the_line_path_and_equal_the_reference(event: ev.Event) -> None:
    """Every event type as the writer's bytes is decoded from its head and tail, equal to the
    reference, the first time (head checked) and again (head remembered)."""
    decoder = FastDecoder()
    assert _check_line(decoder, _raw(event))
    assert _check_line(decoder, _raw(event))


def test_lines_keeps_the_order_and_marks_the_lines_it_leaves() -> None:
    """Records come in line order, None where a line is left to the caller, with a count."""
    decoder = FastDecoder()
    good = [_raw(event) for event in EVENTS[2:5]]
    info = dumps(
        {"v": 2, "type": "AdapterInfo", "pid": 7, "rank": 1, "adapter": "vision", "info": {}}
    )
    lines = [good[0], b"", info.rstrip(b"\n"), good[1], b"not json", good[2]]
    records, declined = decoder.lines(lines)
    assert declined == 3
    assert [r is None for r in records] == [False, True, True, False, True, False]
    assert [r.item for r in records if r is not None] == EVENTS[2:5]


@pytest.mark.parametrize(
    ("old", "new"),
    [
        # A tail field in the head too: the line holds a key twice.
        (b'"adapter":', b'"phase":"profiling","adapter":'),
        (b'"adapter":', b'"duration_s":0.5,"adapter":'),
        # The tail holds a field of the head, or one no event has.
        (b'"phase":', b'"adapter":"audio","phase":'),
        (b'"phase":', b'"extra":1,"phase":'),
        # A field missing from the tail (the reference fills in its default).
        (b',"duration_s":0.004', b""),
        # The cut falls inside the signature: the head is no object.
        (b'"stream":94}', b'"stream":94,"monotonic_ns":1}'),
        # Not JSON after the cut.
        (b'"phase":"serving"', b'"phase":serving'),
    ],
)
def test_lines_whose_head_and_tail_would_not_read_as_the_whole_are_left(
    old: bytes, new: bytes
) -> None:
    """A line the head-and-tail split might read otherwise than the whole line is left to
    the caller (who parses it whole), also once the same head was taken before."""
    raw = _raw(EVENTS[3])
    assert old in raw
    changed = raw.replace(old, new, 1)
    decoder = FastDecoder()
    assert _check_line(decoder, raw)
    assert not _check_line(decoder, changed)


def test_a_full_head_cache_starts_again_and_still_decodes_right(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Past HEADS_KEPT distinct heads the cache is emptied; every line still decodes."""
    monkeypatch.setattr(eventlog_fast, "HEADS_KEPT", 3)
    decoder = FastDecoder()
    for adapter in ("a", "b", "c", "d", "e", "a"):
        event = ev.GraphReplayed(adapter, SIG, 3, 4, 0.001)
        assert _check_line(decoder, _raw(event))


_BYTES = st.sampled_from([*b'{}[]",:\\ .-+eE0123456789truefalsnul', 0xE9, 0x00])


@settings(max_examples=600, deadline=None)
@given(
    st.sampled_from(EVENTS),
    st.lists(
        st.tuples(st.integers(0, 400), st.integers(0, 3), st.lists(_BYTES, max_size=4)),
        min_size=1,
        max_size=3,
    ),
)
def test_any_byte_edit_is_left_or_decoded_as_the_whole_line(
    event: ev.Event, edits: list[tuple[int, int, list[int]]]
) -> None:
    """Deleting or inserting bytes anywhere in a writer's line never makes the line path
    return something the whole line, parsed and decoded by the reference, would not."""
    raw = _raw(event)
    decoder = FastDecoder()
    decoder.lines([raw])  # its head is remembered: an edited line may share it
    for position, cut, inserted in edits:
        at = position % (len(raw) + 1)
        raw = raw[:at] + bytes(inserted) + raw[at + cut :]
    _check_line(decoder, raw)


@settings(max_examples=300, deadline=None)
@given(
    st.sampled_from(EVENTS),
    st.lists(st.tuples(st.integers(0, 30), _JSON | st.just("<drop>")), min_size=1, max_size=3),
)
def test_any_value_change_in_the_writers_layout_is_left_or_decoded_as_the_reference(
    event: ev.Event, mutations: list[tuple[int, Any]]
) -> None:
    """Values changed or dropped in place (the writer's key order kept, so the line still
    splits where the writer's does) never make the line path differ from the reference."""
    record: dict[str, Any] = orjson.loads(_raw(event))
    keys = list(record)
    for index, value in mutations:
        key = keys[index % len(keys)]
        if value == "<drop>":
            record.pop(key, None)
        else:
            record[key] = value
    decoder = FastDecoder()
    decoder.lines([_raw(event)])
    _check_line(decoder, orjson.dumps(json.loads(json.dumps(record))))
