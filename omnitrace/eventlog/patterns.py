"""The event logs a reader is given: paths, and quoted patterns it expands itself (rotated
files left out, new matches found while following)."""

from __future__ import annotations

import glob
import os
import time
from collections.abc import Sequence
from pathlib import Path

__all__ = ["RESCAN_S", "LogSet", "expand", "is_pattern"]

#: Seconds between two looks for new matches of a followed pattern.
RESCAN_S = 1.0
_PATTERN_CHARS = frozenset("*?[")


def is_pattern(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` is a pattern to expand: it holds ``*``, ``?`` or ``[`` and no file or
    directory of that very name exists."""
    text = os.fspath(path)
    return bool(_PATTERN_CHARS.intersection(text)) and not os.path.lexists(text)


def _matches(pattern: Path) -> list[Path]:
    """The files ``pattern`` matches, sorted, without the rotated files of other matches."""
    found = sorted(Path(match) for match in glob.glob(os.fspath(pattern)))
    names = set(found)
    out = []
    for path in found:
        base, dot, suffix = path.name.rpartition(".")
        if dot and suffix.isdigit() and path.with_name(base) in names:
            continue  # read with its log
        out.append(path)
    return out


def expand(paths: Sequence[Path]) -> list[Path]:
    """Return ``paths`` with every pattern replaced by its matches (each path once, in the
    order given). A pattern that matches nothing stays as it is, for the reader to report."""
    out: dict[Path, None] = {}
    for path in paths:
        matches = _matches(path) if is_pattern(path) else []
        for match in matches or [path]:
            out.setdefault(match)
    return list(out)


class LogSet:
    """The logs of ``paths`` and, while following, the new files their patterns match.

    Args:
        paths: the paths and patterns as given (a pattern is expanded now and at each scan).
        rescan_s: seconds between two scans of the patterns.
    """

    def __init__(self, paths: Sequence[Path], *, rescan_s: float = RESCAN_S) -> None:
        self.patterns = [path for path in paths if is_pattern(path)]
        self.paths = expand(paths)
        self._seen = set(self.paths)
        self._rescan_s = rescan_s
        self._next = time.monotonic() + rescan_s

    def new_paths(self) -> list[Path]:
        """Return the files the patterns match that were not matched before (at most one
        scan per ``rescan_s``; an empty list between scans)."""
        if not self.patterns or time.monotonic() < self._next:
            return []
        self._next = time.monotonic() + self._rescan_s
        new = []
        for pattern in self.patterns:
            for match in _matches(pattern):
                if match not in self._seen:
                    self._seen.add(match)
                    self.paths.append(match)
                    new.append(match)
        return new
