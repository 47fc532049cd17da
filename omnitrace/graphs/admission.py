"""Exact-shape admission: which call of an uncaptured key gets a graph, and when (pure
bookkeeping, no torch, no clock; the rules are in docs/architecture.md, "The graph adapter")."""

from __future__ import annotations

import enum
from collections import OrderedDict
from collections.abc import Callable, Hashable
from dataclasses import dataclass

from omnitrace.config import EncoderGraphConfig, needed_free_bytes

__all__ = ["Admission", "Decision", "Verdict"]


class Verdict(enum.Enum):
    CAPTURE = "capture"
    CAPACITY = "capacity"
    WARMUP = "warmup"
    MEMORY = "memory"


@dataclass(frozen=True, slots=True)
class Decision:
    """What admission decided for one call of an uncaptured key."""

    verdict: Verdict
    calls: int = 0
    """Calls of the key in the history, this one included (0 for capacity)."""
    free_bytes: int | None = None
    """Device-free bytes read for the memory check, when it ran."""
    budget: bool = False
    """For capacity: the byte budget, not the graph count, is what is full."""
    need: int | None = None
    """For memory: what the key's eager calls took, which device-free memory could not
    hold; None when the floor deferred it."""

    @property
    def detail(self) -> str:
        """The miss detail of a capacity or memory verdict: ``budget`` or ``cap``,
        ``need`` or ``floor``; empty for the others."""
        if self.verdict is Verdict.CAPACITY:
            return "budget" if self.budget else "cap"
        if self.verdict is Verdict.MEMORY:
            return "floor" if self.need is None else "need"
        return ""


class Admission:
    """Track calls of uncaptured keys and decide when one is captured.

    Args:
        config: supplies ``max_graphs``, ``min_capture_calls``, ``min_free_bytes`` and
            ``pool_budget_bytes``; with a pool budget, a key whose eager calls took more
            memory (:meth:`took_eagerly`) than device-free memory holds with an eighth to
            spare is deferred too.
    """

    __slots__ = (
        "_budget",
        "_floor",
        "_history",
        "_limit",
        "_max_graphs",
        "_min_calls",
        "_need",
        "num_graphs",
        "pool_bytes",
    )

    def __init__(self, config: EncoderGraphConfig) -> None:
        self._budget = config.pool_budget_bytes
        #: Bytes the captured graphs took (see :meth:`took`).
        self.pool_bytes = 0
        self._max_graphs = config.max_graphs
        self._min_calls = config.min_capture_calls
        self._floor = config.min_free_bytes
        self._limit = config.history_size
        self._history: OrderedDict[Hashable, int] = OrderedDict()
        #: With a budget: per remembered key, the least bound its eager calls gave.
        self._need: dict[Hashable, int] | None = {} if self._budget > 0 else None
        self.num_graphs = 0

    @property
    def measures_need(self) -> bool:
        """Whether eager calls' peaks count (:meth:`took_eagerly`): with a pool budget."""
        return self._need is not None

    @property
    def full(self) -> bool:
        return self.num_graphs >= self._max_graphs or self._over_budget()

    def _over_budget(self) -> bool:
        return self._budget > 0 and self.pool_bytes >= self._budget

    def history(self) -> dict[Hashable, int]:
        """Return the call counts of the remembered keys, oldest first."""
        return dict(self._history)

    def decide(
        self,
        key: Hashable,
        free_bytes: Callable[[], int],
        *,
        recorded: bool = False,
        reused: Callable[[], bool] | None = None,
    ) -> Decision:
        """Count a call of the uncaptured ``key`` and decide its fate.

        ``free_bytes`` is only called when the memory floor is enabled and the key is due
        for capture, because reading device memory costs a driver call. A ``recorded`` key
        (one an earlier run captured, prepared at start-up) needs no warm-up calls; the
        cap, the budget and the floor apply as to any key. ``reused`` is asked only where
        the key's eager need would defer it: whether the pool its capture would use already
        holds a graph of inputs at least as large in every dimension. That capture's
        transient memory is free in the pool again and holds this one's, so the need does
        not defer it; the floor still does.
        """
        if self.num_graphs >= self._max_graphs:
            return Decision(Verdict.CAPACITY)
        if self._over_budget():
            return Decision(Verdict.CAPACITY, budget=True)
        history = self._history
        calls = history.pop(key, 0) + 1
        history[key] = calls
        if len(history) > self._limit:
            forgotten, _ = history.popitem(last=False)
            if self._need is not None:
                self._need.pop(forgotten, None)
        if calls < self._min_calls and not recorded:
            return Decision(Verdict.WARMUP, calls)
        need = None if self._need is None else self._need.get(key)
        if self._floor > 0 or need is not None:
            free = free_bytes()
            if free < self._floor:
                return Decision(Verdict.MEMORY, calls, free)
            # A capture allocates in its own pool, from device-free memory: the allocator's
            # cache, which served the eager calls, cannot serve it, and an allocation that
            # fails during a capture is fatal. So a key whose eager calls took more than the
            # device holds free (with an eighth to spare) waits, as under the floor.
            if (
                need is not None
                and needed_free_bytes(need) > free
                and (reused is None or not reused())
            ):
                return Decision(Verdict.MEMORY, calls, free, need=need)
            return Decision(Verdict.CAPTURE, calls, free)
        return Decision(Verdict.CAPTURE, calls)

    def took_eagerly(self, key: Hashable, nbytes: int) -> None:
        """Record what an eager call of the remembered ``key`` took at its peak; ignored
        without a pool budget, or for a forgotten key.

        Each figure bounds the same need from above (calls of one key allocate alike, and a
        call under an earlier, higher peak reads that peak), so the least of a key's
        figures is kept: the tightest bound.

        Args:
            key: the call's key.
            nbytes: the device memory the call allocated at its peak beyond what was
                allocated before it (an upper bound is fine: it only defers).
        """
        need = self._need
        if need is not None and nbytes > 0 and key in self._history:
            nbytes = int(nbytes)
            need[key] = min(need.get(key, nbytes), nbytes)

    def took(self, nbytes: int) -> None:
        """Record the memory a captured graph took (counted against the budget)."""
        self.pool_bytes += max(0, int(nbytes))

    def captured(self, key: Hashable) -> None:
        """Record that ``key`` now has a graph: it leaves the history and takes a slot."""
        self._history.pop(key, None)
        if self._need is not None:
            self._need.pop(key, None)
        self.num_graphs += 1
