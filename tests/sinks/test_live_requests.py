"""The live view's "where TTFT goes" panel: the same numbers as ``top --json``, whole on
any terminal width, from a log's records or an in-process bus."""

from __future__ import annotations

import io
import re
from typing import Any

from rich.console import Console

from omnitrace import events as ev
from omnitrace.bus import EventBus
from omnitrace.eventlog.codec import EventRecord
from omnitrace.requests import RequestJoin, phases_panel
from omnitrace.sinks.live.layout import render
from omnitrace.sinks.live.model import BusBoard, RecordBoard

MS = 1_000_000


def _request(i: int, *, images: int = 1, audios: int = 0) -> ev.RequestTimed:
    base = 1_000 * MS * i
    return ev.RequestTimed(
        "",
        ev.NO_SIGNATURE,
        base + (61 + i) * MS,
        1_800_000_000 * 10**9 + base,
        f"chatcmpl-{i}",
        f"chatcmpl-{i}-e",
        base,
        base + 2 * MS,
        base + 3 * MS,
        base + (20 + i) * MS,
        base + (22 + i) * MS,
        base + (25 + i) * MS,
        base + (60 + i) * MS,
        (61 + i) / 1e3,
        images,
        images * 448 * 448,
        audios,
        float(audios),
        "",
        "",
    )


def _step(i: int) -> ev.EncoderBatchRan:
    base = 1_000 * MS * i
    return ev.EncoderBatchRan(
        "",
        ev.NO_SIGNATURE,
        base + 40 * MS,
        1,
        base + 30 * MS,
        (f"chatcmpl-{i}-e",),
        (64,),
        ("image",),
    )


def _records() -> list[Any]:
    # The API server's requests (pid 1) and the worker's steps (pid 2), as two logs give them.
    out: list[Any] = []
    for i in range(12):
        out.append(EventRecord(_step(i), 2, 0))
        out.append(
            EventRecord(_request(i, images=0 if i % 3 else 1, audios=1 if i % 3 else 0), 1, 0)
        )
    return out


def _text(renderable: object, width: int) -> str:
    console = Console(record=True, width=width, file=io.StringIO())
    console.print(renderable)
    return console.export_text()


def test_the_panel_of_a_log_equals_the_fold_top_json_prints() -> None:
    """RecordBoard's panel is phases_panel of the requests joined across the processes."""
    board = RecordBoard(title="top")
    board.add(_records())
    join = RequestJoin()
    for record in _records():
        join.add(record.item, record.pid)
    snapshot = board.snapshot()
    assert snapshot.requests == phases_panel(join.requests(), window=1000)
    assert snapshot.requests is not None
    image = next(k for k in snapshot.requests["kinds"] if k["kind"] == "image")
    assert image["requests"] == 4
    assert image["phases"]["encoders"]["p50_s"] > 0
    # Request events are events of the log, counted with the rest.
    assert snapshot.emitted == 24


def test_every_number_is_whole_at_40_80_and_120_columns() -> None:
    """Narrow terminals lose phase columns (said in a caption), never a digit."""
    board = RecordBoard(title="top")
    board.add(_records())
    snapshot = board.snapshot()
    assert snapshot.requests is not None
    for width in (40, 80, 120):
        text = _text(render(snapshot), width)
        assert ("where TTFT goes" if width > 60 else "TTFT · last 12") in text, width
        for kind in snapshot.requests["kinds"]:
            ttft = f"{kind['ttft_p50_s'] * 1e3:.1f}/{kind['ttft_p99_s'] * 1e3:.1f}"
            assert ttft in text, (width, ttft)
            ceiling = f"≤{kind['graphs_save_at_most_s'] * 1e3:.1f}"
            assert ceiling in text, (width, ceiling)
        assert not re.search(r"\d…", text), width
    assert "phases left out for width" in _text(render(snapshot), 40)
    assert "1 phase left out for width" in _text(render(snapshot), 100)
    wide = _text(render(snapshot), 160)
    assert "phases left out" not in wide
    for phase in ("processor", "encoders", "prefill"):
        assert phase in wide


def test_an_in_process_bus_shows_its_requests_and_none_before_any() -> None:
    """The demo's board (BusBoard) joins the requests its sink sees."""
    bus = EventBus()
    try:
        board = BusBoard(bus, title="demo")
        assert board.snapshot().requests is None
        for record in _records():
            bus.emit(record.item)
        assert bus.flush(5.0)
        snapshot = board.snapshot()
    finally:
        bus.close()
    assert snapshot.requests is not None
    assert sum(k["requests"] for k in snapshot.requests["kinds"]) == 12
    assert "where TTFT goes · last 12 requests" in _text(render(snapshot), 120)


def test_a_long_follow_keeps_a_bounded_window_of_steps() -> None:
    """RequestJoin keeps at most a few steps per kept request and process."""
    join = RequestJoin(keep=5)
    for i in range(1_000):
        join.add(_step(i), 2)
        join.add(_request(i), 1)
    views = join.requests()
    assert len(views) == 5
    assert join.dropped == 995
    assert sum(len(steps) for steps in join._steps.values()) <= 20
    # The newest requests still find their steps.
    assert all(view.steps for view in views)
