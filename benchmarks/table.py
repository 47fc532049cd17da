"""A titled table of preformatted cells, and the cell formats: what each benchmark's
``tables(result)`` builds and :mod:`benchmarks.report` renders."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

MiB = 1 << 20
GiB = 1 << 30


@dataclass
class Table:
    """A titled table of preformatted cells."""

    title: str
    headers: list[str]
    rows: list[list[str]] = field(default_factory=list)
    note: str = ""


def columns(
    title: str, spec: Sequence[tuple[str, Callable[[Any], str]]], items: Iterable[Any]
) -> Table:
    """A table with a column per ``(header, cell)`` of ``spec`` and a row per item."""
    return Table(title, [h for h, _ in spec], [[cell(i) for _, cell in spec] for i in items])


def markdown(table: Table) -> str:
    """``table`` as Markdown: its title in bold, the table, its note."""
    lines = [f"**{table.title}**", "", "| " + " | ".join(table.headers) + " |"]
    lines.append("|" + "|".join("---" for _ in table.headers) + "|")
    lines += ["| " + " | ".join(row) + " |" for row in table.rows]
    return "\n".join(lines + (["", table.note] if table.note else []))


def us(value: float | None, digits: int = 1) -> str:
    return "n/a" if value is None else f"{value:,.{digits}f}"


def ns(value_us: float | None) -> str:
    return "n/a" if value_us is None else f"{value_us * 1000:,.0f}"


def times(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.2f}x"


def pct(value: float | None) -> str:
    return "n/a" if value is None else f"{value * 100:+.2f} %"


def mib(value: float | None) -> str:
    return "n/a" if value is None else f"{value / MiB:,.1f}"


def ms(value: float | None) -> str:
    return "n/a" if value is None else f"{value:,.0f}"


def verdict(met: bool | None) -> str:
    return {True: "met", False: "MISSED", None: "not measured"}[met]


def bar(item: dict[str, Any]) -> str:
    """A target's bar: its operator, limit and unit."""
    return f"{item['op']} {item['limit']:g} {item['unit']}".rstrip()


def measured(item: dict[str, Any], unit: str | None = None) -> str:
    """A target's or figure's value with its unit (``unit`` instead, when given)."""
    shown = f" {item['unit']}" if unit is None else unit
    return "n/a" if item["value"] is None else f"{item['value']:,.3g}{shown}"
