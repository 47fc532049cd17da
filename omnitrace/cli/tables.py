"""The final stats table of ``demo`` and ``replay``: one row per encoder."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rich.console import Console, ConsoleOptions, RenderableType, RenderResult
    from rich.table import Table

__all__ = ["stats_table"]

#: Encoder names are shortened to no fewer columns than this (an ellipsis included).
_MIN_NAME = 4


def _columns() -> tuple[tuple[str, str], ...]:
    """(wide, compact) headings of the stats table: one miss column per MissReason."""
    from omnitrace.events import MissReason

    return (
        ("encoder", "encoder"),
        ("calls", "calls"),
        ("hits", "hits"),
        ("hit rate", "rate"),
        *((reason.value, reason.short) for reason in MissReason.display_order()),
        ("graphs", "graphs"),
        ("capture failures", "fail"),
        ("state", "state"),
    )


def _rows(
    encoders: Mapping[str, Mapping[str, int | float]], max_graphs: Mapping[str, int] | None
) -> list[list[str]]:
    """Each encoder's cells as plain text, in the order of :func:`_columns`."""
    from omnitrace.events import MissReason

    rows = []
    for name, stats in encoders.items():
        calls = int(stats["graph_hits"] + stats["graph_misses"])
        cap = (max_graphs or {}).get(name)
        failures = int(stats["capture_failures"])
        rows.append(
            [
                name,
                str(calls),
                str(stats["graph_hits"]),
                f"{stats['hit_rate'] * 100:.1f} %",
                *(str(stats[reason.stats_key]) for reason in MissReason.display_order()),
                f"{stats['num_graphs']}/{cap}" if cap is not None else str(stats["num_graphs"]),
                str(failures),
                # A capture failure is fatal for the adapter: it never captures again.
                "terminal" if failures else "ok",
            ]
        )
    return rows


def _drop_order(rows: Sequence[Sequence[str]]) -> list[int]:
    """The columns a narrow table leaves out, first to last: what the rest already says
    (state: the failures column; hits: calls and rate), miss columns of zeros, an expected
    warm-up, the other misses (smallest first), failures of zero, then the graphs.

    The encoder, its calls and its hit rate are always shown.
    """
    headings = _columns()
    index = {short: i for i, (_, short) in enumerate(headings)}
    misses = [index[short] for _, short in headings[4:-3]]

    def total(column: int) -> int:
        return sum(int(row[column]) for row in rows)

    zero = [c for c in misses if total(c) == 0]
    warm = [index["warm"]] if index["warm"] not in zero else []
    rest = sorted((c for c in misses if c not in zero and c not in warm), key=total)
    fail = index["fail"]
    order = [index["state"], index["hits"], *zero, *warm]
    order += [fail] if total(fail) == 0 else []
    order += rest
    order += [fail] if total(fail) else []
    return [*order, index["graphs"]]


def _elide(text: str, width: int) -> str:
    return text if len(text) <= width else text[: max(width - 1, 1)] + "…"


class _FittedStats:
    """The stats table laid out for the width it is drawn in: wide (full headings, rules)
    where asked for and where it fits, else compact.

    Numbers are never cut: encoder names are shortened first, then whole columns are left
    out by priority (:func:`_drop_order`), and a caption names those left out.
    """

    def __init__(self, rows: list[list[str]], title: str, *, wide: bool = False) -> None:
        self.rows = rows
        self.title = title
        self.wide = wide

    def wide_table(self) -> Table:
        """The table with full headings and rules, as a wide terminal shows it."""
        from rich import box
        from rich.table import Table
        from rich.text import Text

        from omnitrace._display import safe

        table = Table(title=self.title, title_justify="left", box=box.HEAVY_HEAD, padding=(0, 1))
        columns = _columns()
        for index, (wide, _) in enumerate(columns):
            table.add_column(
                wide, justify="left" if index in (0, len(columns) - 1) else "right", no_wrap=True
            )
        for row in self.rows:
            failed = row[-1] == "terminal"
            table.add_row(
                # Text: a str cell is parsed as rich markup, and the name comes from a log.
                Text(safe(row[0])),
                *row[1:-2],
                Text(row[-2], style="bold red" if failed else ""),
                Text(row[-1], style="bold red" if failed else ""),
            )
        return table

    def table(self, dropped: Sequence[int], name_width: int | None) -> Table:
        from rich import box
        from rich.table import Table
        from rich.text import Text

        from omnitrace._display import safe

        headings = _columns()
        table = Table(
            title=self.title,
            title_justify="left",
            box=box.SIMPLE_HEAD,
            show_edge=False,
            pad_edge=False,
            # One space of padding plus the rule's blank column between cells.
            padding=(0, 1, 0, 0),
        )
        shown = [i for i in range(len(headings)) if i not in dropped]
        last = len(headings) - 1
        for i in shown:
            table.add_column(
                headings[i][1], justify="left" if i in (0, last) else "right", no_wrap=True
            )
        for row in self.rows:
            cells: list[Text] = []
            for i in shown:
                text = safe(row[i])
                if i == 0 and name_width is not None:
                    text = _elide(text, name_width)
                failed = (i == last and row[i] == "terminal") or (i == last - 1 and row[i] != "0")
                # Text, never a markup string: the name comes from a log.
                cells.append(Text(text, style="bold red" if failed else ""))
            table.add_row(*cells)
        if dropped:
            left_out = ", ".join(headings[i][1] for i in sorted(dropped))
            table.caption = f"not shown at this width: {left_out}"
            table.caption_justify = "left"
        return table

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        width = options.max_width
        longest = max((len(row[0]) for row in self.rows), default=0)

        # Measured unbounded: a measurement within the width is clamped to it.
        unbounded = options.update_width(1 << 16)

        def fits(table: Table) -> bool:
            return console.measure(table, options=unbounded).maximum <= width

        if self.wide:
            table = self.wide_table()
            if fits(table):
                yield table
                return
        dropped: list[int] = []
        order = _drop_order(self.rows)
        while True:
            table = self.table(dropped, None)
            if fits(table):
                break
            # Shorten the names before a column goes: as far as what they need to fit.
            for name_width in range(longest - 1, _MIN_NAME - 1, -1):
                shorter = self.table(dropped, name_width)
                if fits(shorter):
                    table = shorter
                    break
            else:
                if order:
                    dropped.append(order.pop(0))
                    continue
                table = self.table(dropped, _MIN_NAME)
            break
        yield table


def stats_table(
    encoders: Mapping[str, Mapping[str, int | float]],
    *,
    max_graphs: Mapping[str, int] | None = None,
    title: str = "encoder graph stats",
    compact: bool = False,
) -> RenderableType:
    """Return the final stats table: one row per encoder (calls, hits, misses by reason...).

    ``compact`` uses short headers and no vertical rules; a wide table that does not fit the
    width it is drawn in is drawn compact too. A compact table fits that width: numbers are
    never cut; encoder names are shortened, then columns are left out by priority (the
    caption names them).
    """
    return _FittedStats(_rows(encoders, max_graphs), title, wide=not compact)
