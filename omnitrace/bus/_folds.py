"""The folds: what every event goes through synchronously, in order, on the hot path."""

from __future__ import annotations

import logging
import threading

from omnitrace.bus._types import Fold
from omnitrace.coverage import DEFAULT_COVERAGE_KEYS, CoverageFold
from omnitrace.stats import StatsFold

__all__ = ["FoldRegistry"]

logger = logging.getLogger(__name__)


class FoldRegistry:
    """The folds of one bus, the stats and coverage folds first; a fold that raises is removed.

    Not thread-safe on its own: the bus calls it under its lock. ``folds`` is a tuple that
    is replaced, never changed, so ``emit()`` can iterate it without a copy.

    Args:
        coverage_keys: signatures the coverage fold tracks per adapter.
    """

    __slots__ = ("added", "coverage", "disabled", "folds", "stats")

    def __init__(self, coverage_keys: int = DEFAULT_COVERAGE_KEYS) -> None:
        self.stats = StatsFold()
        # One fold call per event keeps both: the coverage fold applies events to the stats.
        self.coverage = CoverageFold(coverage_keys, stats=self.stats)
        self.folds: tuple[Fold, ...] = (self.coverage.fold,)
        # Whether folds from add() are attached: only those can call back into the bus.
        self.added = False
        self.disabled = 0

    def add(self, fold: Fold) -> None:
        """Append ``fold``; it sees every later event.

        Raises:
            TypeError: ``fold`` is not callable.
        """
        if not callable(fold):
            raise TypeError(f"fold must be callable, got {type(fold).__name__}")
        self.folds = (*self.folds, fold)
        self.added = True

    def remove(self, fold: Fold) -> None:
        """Drop ``fold`` (no error if it is not there)."""
        self.folds = tuple(f for f in self.folds if f != fold)
        self.added = any(f != self.coverage.fold for f in self.folds)

    def disable(self, fold: Fold, exc: Exception) -> None:
        """Remove ``fold``, which raised ``exc``, count it and report it once."""
        self.remove(fold)
        self.disabled += 1
        # Reporting is deferred to a thread of its own: the hot path never does I/O.
        threading.Thread(
            target=logger.error,
            args=("event fold %r raised %s: %s; it is disabled", fold, type(exc).__name__, exc),
            daemon=True,
        ).start()
