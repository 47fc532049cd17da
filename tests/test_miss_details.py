"""Why calls missed, by reason and detail: the coverage fold counts it, the live view, top
and advise show it."""

from __future__ import annotations

import io
import json
import re
from collections import Counter
from pathlib import Path

import pytest
from rich.console import Console

from omnitrace import EventBus, GraphMissed, GraphReplayed, MissReason
from omnitrace.cli import main
from omnitrace.coverage import derive_coverage
from omnitrace.eventlog import EventRecord
from omnitrace.misses import MissCause, causes_json, telling
from omnitrace.sinks.jsonl import JsonlSink
from omnitrace.sinks.live import BusBoard, RecordBoard, render
from omnitrace.testing import sig

CPU = sig("float32[1,4] @cpu")
DEV = sig("float32[1,4] @cuda:0 s=0")

#: (adapter, reason, detail) of each miss of a small log, and one hit.
MISSES = [
    ("vision", MissReason.INELIGIBLE, "cpu"),
    ("vision", MissReason.INELIGIBLE, "cpu"),
    ("vision", MissReason.INELIGIBLE, "cpu"),
    ("vision", MissReason.INELIGIBLE, "paused"),
    ("vision", MissReason.WARMUP, "call 1 of 2"),
    ("vision", MissReason.CAPACITY, "cap"),
    ("audio", MissReason.INELIGIBLE, "attention_backend"),
    ("audio", MissReason.INELIGIBLE, "disabled"),
    ("audio", MissReason.INELIGIBLE, "disabled"),
]


def _events() -> list[GraphMissed | GraphReplayed]:
    events: list[GraphMissed | GraphReplayed] = [
        GraphMissed(name, CPU, i, i, reason, detail)
        for i, (name, reason, detail) in enumerate(MISSES)
    ]
    events.append(GraphReplayed("vision", DEV, 99, 99, 0.001))
    return events


def _text(renderable: object, width: int = 120) -> str:
    console = Console(record=True, width=width, file=io.StringIO())
    console.print(renderable)
    return console.export_text()


def test_the_fold_counts_each_reason_and_detail_most_first() -> None:
    """Misses are counted per (reason, detail); hits are not; the most frequent comes first;
    an encoder's coverage with few tracked keys still counts every miss."""
    coverage = derive_coverage(_events())
    assert derive_coverage(_events(), limit=1)["vision"].miss_details == (
        coverage["vision"].miss_details
    )
    assert coverage["vision"].miss_details == (
        MissCause(MissReason.INELIGIBLE, "cpu", 3),
        MissCause(MissReason.WARMUP, "call 1 of 2", 1),
        MissCause(MissReason.CAPACITY, "cap", 1),
        MissCause(MissReason.INELIGIBLE, "paused", 1),
    )
    assert causes_json(coverage["audio"].miss_details) == {
        "warmup": {},
        "capacity": {},
        "memory": {},
        "ineligible": {"disabled": 2, "attention_backend": 1},
    }


def test_warmups_and_details_that_repeat_their_reason_are_not_telling() -> None:
    """A warm-up is expected and a capacity miss's "cap" says no more than its reason."""
    causes = derive_coverage(_events())["vision"].miss_details
    assert [c.detail for c in telling(causes)] == ["cpu", "paused"]


def test_a_bus_board_shows_why_calls_missed_with_counts() -> None:
    """The live view's encoder panel has a "why" row: each detail and its misses."""
    bus = EventBus()
    board = BusBoard(bus)
    for event in _events():
        bus.emit(event)
    text = _text(render(board.snapshot()))
    assert re.search(r"│ why +cpu 3 · paused 1 ", text), text
    assert re.search(r"│ why +disabled 2 · attention_backend 1 ", text), text
    bus.close()


def test_a_record_board_shows_why_per_worker_and_escapes_the_detail() -> None:
    """A detail read from a log is data: control characters are escaped, markup is not run."""
    board = RecordBoard()
    board.add(
        [
            EventRecord(
                GraphMissed("vision", CPU, 1, 1, MissReason.INELIGIBLE, "[red]x\x1b[2J"), 7, 0
            ),
            EventRecord(GraphMissed("vision", CPU, 2, 2, MissReason.INELIGIBLE, "cpu"), 7, 0),
            EventRecord(GraphMissed("vision", CPU, 3, 3, MissReason.INELIGIBLE, "cpu"), 7, 0),
        ]
    )
    snapshot = board.snapshot()
    assert snapshot.encoders[0].causes[0] == MissCause(MissReason.INELIGIBLE, "cpu", 2)
    text = _text(render(snapshot))
    assert "\x1b" not in text
    assert re.search(r"│ why +cpu 2 · \[red\]x\\x1b\[2J 1 ", text), text


@pytest.mark.parametrize("width", [40, 80, 100])
def test_the_why_row_keeps_its_counts_on_narrow_terminals(width: int) -> None:
    """However narrow the panel, the first detail's count is shown whole."""
    bus = EventBus()
    board = BusBoard(bus)
    for event in _events():
        bus.emit(event)
    text = _text(render(board.snapshot()), width=width)
    assert "cpu 3" in text, text
    bus.close()


def test_top_json_holds_the_misses_by_detail_equal_to_a_fold_of_the_events(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """top --json's miss_details of each encoder are the events' (reason, detail) counts."""
    path = tmp_path / "events.jsonl"
    bus = EventBus()
    bus.add_sink(JsonlSink(path, bus=bus))
    for event in _events():
        bus.emit(event)
    bus.close()
    assert main(["top", "--json", str(path)]) == 0
    encoders = json.loads(capsys.readouterr().out)["encoders"]
    counts = Counter(MISSES)
    for entry in encoders:
        expected: dict[str, dict[str, int]] = {r.value: {} for r in MissReason.display_order()}
        for (name, reason, detail), count in counts.items():
            if name == entry["encoder"]:
                expected[reason.value][detail] = count
        assert entry["miss_details"] == expected
    assert {entry["encoder"] for entry in encoders} == {"vision", "audio"}


def test_advise_on_a_log_of_ineligible_calls_names_why_per_encoder(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """advise's one line on a log no graph could serve gives each encoder's details."""
    path = tmp_path / "events.jsonl"
    bus = EventBus()
    bus.add_sink(JsonlSink(path, bus=bus))
    for name, reason, detail in MISSES:
        if reason is MissReason.INELIGIBLE:
            bus.emit(GraphMissed(name, CPU, 1, 1, reason, detail))
    bus.close()
    assert main(["advise", str(path)]) == 1
    assert capsys.readouterr().err.strip() == (
        f"omnitrace advise: error: {path}: no encoder call could use a graph: every call was "
        "ineligible (vision: cpu 3, paused 1; audio: disabled 2, attention_backend 1)"
    )
