"""The fast path of the line decoder takes what the reference decoder takes, and no more.

Whatever a line holds, the fast decoder either returns exactly the record
:func:`~omnitrace.eventlog.decode_record` returns for it, or declines (None), and the line
then goes the reference way, which converts it or says what is wrong with it.
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
from omnitrace.eventlog import EventLogError, EventRecord, decode_record, encode_event
from omnitrace.eventlog_fast import FastDecoder
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
