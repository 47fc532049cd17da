"""The live view's total across workers: one row per encoder, summed over its ranks by
:func:`omnitrace.ranks.totals`, under the workers' panels when a frame holds several."""

from __future__ import annotations

from collections.abc import Iterable

from rich import box
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from omnitrace._display import safe
from omnitrace.events import MissReason
from omnitrace.ranks import Worker, totals
from omnitrace.stats import AdapterStats

__all__ = ["total_panel"]

#: Interior width under which the misses by reason are left out of the rows.
_WIDE = 78


def _percent(rate: float) -> str:
    return f"{rate * 100:.1f} %"


def total_panel(per_worker: Iterable[tuple[Worker, AdapterStats]], width: int) -> Panel | None:
    """Return the panel of totals across workers; None with fewer than two workers.

    Args:
        per_worker: ``((rank, pid), stats)`` of each worker's encoders.
        width: the frame's width, in columns.
    """
    encoder_totals = totals(per_worker)
    workers = {worker for total in encoder_totals for worker in total.workers}
    if len(workers) < 2:
        return None
    wide = width - 4 >= _WIDE
    table = Table(box=box.SIMPLE_HEAD, padding=(0, 1, 0, 0), show_edge=False, expand=True)
    table.add_column("encoder", no_wrap=True, overflow="ellipsis")
    for heading in ("ranks", "calls", "hit rate", "spread", "graphs"):
        table.add_column(heading, justify="right", no_wrap=True)
    reasons = MissReason.display_order() if wide else ()
    for reason in reasons:
        table.add_column(reason.short, justify="right", no_wrap=True)
    table.add_column("fail", justify="right", no_wrap=True)
    for total in encoder_totals:
        stats = total.stats
        spread = f"{total.hit_rate_low * 100:.0f}-{total.hit_rate_high * 100:.0f} %"
        failures = Text(str(stats.capture_failures), style="bold red" if stats.failure else "")
        table.add_row(
            # Text, never a markup string: the name comes from a log.
            Text(safe(stats.adapter)),
            str(len(total.workers)),
            str(stats.calls),
            _percent(stats.hit_rate),
            spread,
            str(stats.num_graphs),
            *(str(stats.misses[reason]) for reason in reasons),
            failures,
        )
    return Panel(
        table,
        title=Text(f"total · {len(workers)} workers", style="bold"),
        title_align="left",
        border_style="green",
        expand=True,
    )
