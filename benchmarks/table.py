"""A titled table of preformatted cells: what a benchmark's results render into.

:mod:`benchmarks.report` turns tables into markdown and text; a benchmark that renders its
own results builds them from here, so it never imports the report (which imports it).
"""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["Table"]


@dataclass
class Table:
    """A titled table of preformatted cells."""

    title: str
    headers: list[str]
    rows: list[list[str]] = field(default_factory=list)
    note: str = ""
