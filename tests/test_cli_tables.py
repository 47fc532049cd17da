"""The final stats table fits the terminal: names are shortened and columns left out, never
a number cut."""

from __future__ import annotations

import io
import re

import pytest
from rich.console import Console

from omnitrace.cli.tables import stats_table

STATS = {
    "vision": {
        "graph_hits": 35, "graph_misses": 16, "hit_rate": 35 / 51, "num_graphs": 4,
        "ineligible_misses": 0, "capacity_misses": 6, "warmup_misses": 10, "memory_misses": 0,
        "capture_failures": 0,
    },
    "audio-encoder-with-a-long-name": {
        "graph_hits": 1235, "graph_misses": 1016, "hit_rate": 1235 / 2251, "num_graphs": 4,
        "ineligible_misses": 100, "capacity_misses": 600, "warmup_misses": 300,
        "memory_misses": 16, "capture_failures": 1,
    },
}  # fmt: skip
CAPS = dict.fromkeys(STATS, 4)


def _text(width: int, compact: bool = True) -> str:
    console = Console(record=True, width=width, file=io.StringIO())
    console.print(stats_table(STATS, max_graphs=CAPS, compact=compact))
    return console.export_text()


@pytest.mark.parametrize("width", [40, 80, 100])
def test_numbers_are_never_cut_at_any_width(width: int) -> None:
    """Every row keeps its calls and hit rate whole; no line passes the width; a cell that
    is a number is never cut (an ellipsis only ever ends a name)."""
    text = _text(width)
    lines = text.splitlines()
    assert all(len(line.rstrip()) <= width for line in lines)
    rows = [line for line in lines if line.startswith(("vision", "audio"))]
    assert len(rows) == 2
    assert re.search(r"\b51 +(35 +)?68\.6 %", rows[0]), text
    assert re.search(r"\b2251 +(1235 +)?54\.9 %", rows[1]), text
    for row in rows:
        for cell in row.split()[1:]:
            assert "…" not in cell, text


def test_at_40_columns_names_are_shortened_and_the_caption_names_what_is_left_out() -> None:
    """A 40-column terminal shows each encoder's calls, rate and graphs, and says which
    columns it left out."""
    text = _text(40)
    assert "audio-enc" in text
    assert "4/4" in text
    caption = " ".join(text.split("not shown at this width:", 1)[1].split())
    assert caption.startswith("hits")
    assert "state" in caption


def test_at_80_columns_a_long_name_is_shortened_before_a_column_goes() -> None:
    """At 80 columns every column is shown: the long name gives up its tail instead."""
    text = _text(80)
    assert "not shown" not in text
    assert "audio-encode…" in text
    assert "terminal" in text
    assert "audio-encoder-with-a-long-name" in _text(120)


def test_a_wide_table_that_does_not_fit_is_drawn_compact() -> None:
    """Asked for the wide table on a terminal too narrow for it, the compact one is drawn."""
    assert "┃" in _text(200, compact=False)
    text = _text(100, compact=False)
    assert "┃" not in text
    assert "54.9 %" in text
