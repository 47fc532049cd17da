"""The live view's total across workers: a row per encoder summed over its ranks."""

from __future__ import annotations

import io

from rich.console import Console

from omnitrace.events import GraphCaptured, GraphMissed, GraphReplayed, MissReason
from omnitrace.sinks.jsonl import AdapterInfo, EventRecord
from omnitrace.sinks.live import RecordBoard, render
from omnitrace.sinks.live.total import total_panel
from omnitrace.stats import AdapterStats
from omnitrace.testing import sig

T0 = 1_700_000_000_000_000_000
KEY = sig("float32[1,256,64]")


def _text(renderable: object, width: int) -> str:
    console = Console(record=True, width=width, file=io.StringIO())
    console.print(renderable)
    return console.export_text()


def _rank(board: RecordBoard, rank: int, pid: int, hits: int, misses: int) -> None:
    """Fold one worker: a capture, ``hits`` replays and ``misses`` capacity misses."""
    events = [GraphCaptured("vision", KEY, 1, T0, 0.01, 1, "cuda:0", 0, 5, 1 << 20, 64, 0)]
    events += [GraphReplayed("vision", KEY, 2, T0, 0.001) for _ in range(hits)]
    events += [GraphMissed("vision", KEY, 3, T0, MissReason.CAPACITY, "cap") for _ in range(misses)]
    board.add([EventRecord(AdapterInfo("vision", {"max_graphs": 4}), pid, rank)])
    board.add(EventRecord(event, pid, rank) for event in events)


def _row(text: str, name: str) -> list[str]:
    """The cells of the total panel's row that starts with ``name``."""
    rows = [line.strip(" │").split() for line in text.splitlines()]
    (row,) = [cells for cells in rows if cells and cells[0] == name]
    return row


def test_two_ranks_show_their_sum_under_their_panels() -> None:
    """Rank 0 hits 9 of 10 calls, rank 1 hits 5 of 10: the total row, under the workers'
    panels, says 2 ranks, 20 calls, 70 %, the spread 50-90 % and two graphs."""
    board = RecordBoard(title="top")
    _rank(board, 0, 100, hits=9, misses=1)
    _rank(board, 1, 200, hits=5, misses=5)
    text = _text(render(board.snapshot()), width=160)
    assert "total · 2 workers" in text
    assert text.index("vision · rank 1 · pid 200") < text.index("total · 2 workers")
    start = text.index("total · 2 workers")
    panel = text[start : text.index("╰", start)]
    assert _row(panel, "vision")[:8] == ["vision", "2", "20", "70.0", "%", "50-90", "%", "2"]


def _stats(hits: int, misses: int) -> AdapterStats:
    """The stats of one worker folded as :func:`_rank` writes it."""
    board = RecordBoard()
    _rank(board, 0, 1, hits, misses)
    return board.snapshot().encoders[0].stats


def test_one_worker_has_no_total() -> None:
    """A single worker's panel is its total already: no total panel."""
    board = RecordBoard(title="top")
    _rank(board, 0, 100, hits=3, misses=1)
    assert "total ·" not in _text(render(board.snapshot()), width=160)
    assert total_panel([((0, 100), _stats(3, 1))], 160) is None


def test_a_narrow_frame_keeps_the_total_without_the_misses_by_reason() -> None:
    """At 80 columns the row keeps calls, hit rate, spread and graphs; at 160 it adds the
    misses by reason."""
    workers = [((0, 100), _stats(9, 1)), ((1, 200), _stats(5, 5))]
    narrow = _text(total_panel(workers, 80), 80)
    wide = _text(total_panel(workers, 160), 160)
    assert _row(narrow, "encoder") == [
        "encoder",
        "ranks",
        "calls",
        "hit",
        "rate",
        "spread",
        "graphs",
        "fail",
    ]
    assert "cap" in _row(wide, "encoder")
    assert _row(narrow, "vision") == ["vision", "2", "20", "70.0", "%", "50-90", "%", "2", "0"]
