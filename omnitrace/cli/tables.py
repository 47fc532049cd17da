"""The final stats table of ``demo`` and ``replay``: one row per encoder."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rich.table import Table

__all__ = ["stats_table"]


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


def stats_table(
    encoders: Mapping[str, Mapping[str, int | float]],
    *,
    max_graphs: Mapping[str, int] | None = None,
    title: str = "encoder graph stats",
    compact: bool = False,
) -> Table:
    """Return the final stats table: one row per encoder (calls, hits, misses by reason...).

    ``compact`` uses short headers and no vertical rules, to fit an 80-column terminal.
    """
    from rich import box
    from rich.table import Table
    from rich.text import Text

    from omnitrace._display import safe

    table = Table(
        title=title,
        title_justify="left",
        box=box.SIMPLE_HEAD if compact else box.HEAVY_HEAD,
        show_edge=not compact,
        pad_edge=not compact,
        # Compact: one space of padding plus the rule's blank column between cells.
        padding=(0, 1, 0, 0) if compact else (0, 1),
    )
    from omnitrace.events import MissReason

    columns = _columns()
    for index, (wide, short) in enumerate(columns):
        table.add_column(
            short if compact else wide,
            justify="left" if index in (0, len(columns) - 1) else "right",
        )
    for name, stats in encoders.items():
        calls = int(stats["graph_hits"] + stats["graph_misses"])
        cap = (max_graphs or {}).get(name)
        failures = int(stats["capture_failures"])
        table.add_row(
            # Text: a str cell is parsed as rich markup, and the name comes from a log.
            Text(safe(name)),
            str(calls),
            str(stats["graph_hits"]),
            f"{stats['hit_rate'] * 100:.1f} %",
            *(str(stats[reason.stats_key]) for reason in MissReason.display_order()),
            f"{stats['num_graphs']}/{cap}" if cap is not None else str(stats["num_graphs"]),
            f"[bold red]{failures}[/]" if failures else "0",
            # A capture failure is fatal for the adapter: it never captures again.
            "[bold red]terminal[/]" if failures else "ok",
        )
    return table
