"""Cumulative statistics as a pure fold over the event stream."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, fields
from operator import attrgetter
from types import MappingProxyType
from typing import Any, Protocol

from omnitrace import events as ev
from omnitrace.events import Event, MissReason
from omnitrace.signature import Signature

__all__ = [
    "STATS_KEYS",
    "AdapterStats",
    "CapturedGraphInfo",
    "StatsFold",
    "derive_stats",
]

#: The keys of ``get_cumulative_stats()``, in their documented order: one ``<reason>_misses``
#: key per :class:`MissReason`, in the enum's order.
STATS_KEYS: tuple[str, ...] = (
    "graph_hits",
    "graph_misses",
    "hit_rate",
    "num_graphs",
    *(reason.stats_key for reason in MissReason),
    "capture_failures",
)
_MISS_KEYS = {reason.stats_key: reason for reason in MissReason}


class _Counted(Protocol):
    @property
    def hits(self) -> int: ...

    @property
    def calls(self) -> int: ...


class HitRate:
    """Mixin: ``hit_rate``, the share of ``calls`` that were ``hits`` (0.0 without calls)."""

    __slots__ = ()

    @property
    def hit_rate(self: _Counted) -> float:
        calls = self.calls
        return self.hits / calls if calls else 0.0


@dataclass(frozen=True, slots=True)
class CapturedGraphInfo:
    """One graph an adapter holds, as its GraphCaptured event described it."""

    key: str
    epoch_ns: int
    duration_s: float
    pool_id: int
    device: str
    stream: int
    bytes_reserved: int
    static_bytes: int
    signature: Signature | None = None
    """The captured signature (None only for infos built by hand)."""
    free_bytes: int | None = None
    """Device-free memory just before the capture (None where it was not read)."""


#: The fields of a CapturedGraphInfo, read from the GraphCaptured event it describes (whose
#: ``key`` is its signature's text).
_graph_info_fields = attrgetter(*(f.name for f in fields(CapturedGraphInfo)))
#: AdapterStats' keyword-only fields: what pickling passes back and what a fold's tally fills.
_KEYWORDS = (
    "misses",
    "capture_failures",
    "graphs",
    "memory_deferrals",
    "last_free_bytes",
    "floor_bytes",
    "failure",
    "last_epoch_ns",
)


class AdapterStats:
    """A frozen snapshot of one adapter's cumulative statistics.

    Misses are counted per :class:`MissReason`: ``stats.misses[MissReason.CAPACITY]``, or by
    the stats key as an attribute or keyword (``stats.capacity_misses``,
    ``AdapterStats("vision", capacity_misses=3)``), for every reason the enum has.

    Args:
        adapter: the adapter's name.
        graph_hits: calls served by a graph; default 0.
        misses: misses per reason; default None (all zero). Reasons left out count 0.
        capture_failures: captures that raised; default 0.
        graphs: the graphs the adapter holds; default ().
        memory_deferrals: captures deferred under the memory floor; default 0.
        last_free_bytes: device-free bytes at the latest deferral; default None.
        floor_bytes: the floor of the latest deferral; default None.
        failure: ``"Type: message"`` of the failure that made it terminal; default None.
        last_epoch_ns: epoch time of the latest event folded; default 0.
        **miss_counts: ``<reason>_misses=N`` for a reason, over ``misses``.

    Raises:
        TypeError: a keyword of ``miss_counts`` names no :class:`MissReason`.
    """

    __slots__ = (
        "adapter",
        "capture_failures",
        "failure",
        "floor_bytes",
        "graph_hits",
        "graphs",
        "last_epoch_ns",
        "last_free_bytes",
        "memory_deferrals",
        "misses",
    )
    adapter: str
    graph_hits: int
    misses: Mapping[MissReason, int]
    capture_failures: int
    graphs: tuple[CapturedGraphInfo, ...]
    memory_deferrals: int
    last_free_bytes: int | None
    """Device-free bytes seen at the latest memory deferral, if any."""
    floor_bytes: int | None
    failure: str | None
    """``"Type: message"`` of the capture failure that made the adapter terminal."""
    last_epoch_ns: int

    def __init__(
        self,
        adapter: str,
        graph_hits: int = 0,
        *,
        misses: Mapping[MissReason, int] | None = None,
        capture_failures: int = 0,
        graphs: tuple[CapturedGraphInfo, ...] = (),
        memory_deferrals: int = 0,
        last_free_bytes: int | None = None,
        floor_bytes: int | None = None,
        failure: str | None = None,
        last_epoch_ns: int = 0,
        **miss_counts: int,
    ) -> None:
        counts = dict.fromkeys(MissReason, 0)
        if misses is not None:
            counts.update(misses)
        for key, value in miss_counts.items():
            reason = _MISS_KEYS.get(key)
            if reason is None:
                raise TypeError(f"AdapterStats() got an unexpected keyword argument {key!r}")
            counts[reason] = value
        values: dict[str, object] = {
            "adapter": adapter,
            "graph_hits": graph_hits,
            "misses": MappingProxyType(counts),
            "capture_failures": capture_failures,
            "graphs": tuple(graphs),
            "memory_deferrals": memory_deferrals,
            "last_free_bytes": last_free_bytes,
            "floor_bytes": floor_bytes,
            "failure": failure,
            "last_epoch_ns": last_epoch_ns,
        }
        for slot, slot_value in values.items():
            object.__setattr__(self, slot, slot_value)

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError(f"AdapterStats is frozen: cannot set {name!r}")

    def __reduce__(self) -> tuple[object, ...]:
        return (_rebuild_stats, (self.adapter, self.graph_hits, self._keywords()))

    def _keywords(self) -> dict[str, object]:
        keywords = {name: getattr(self, name) for name in _KEYWORDS}
        keywords["misses"] = dict(self.misses)  # the read-only view does not pickle
        return keywords

    def __getattr__(self, name: str) -> int:
        # Only reached for names that are not slots: <reason>_misses of any MissReason.
        reason = _MISS_KEYS.get(name)
        if reason is None:
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        return self.misses[reason]

    def _fields(self) -> tuple[object, ...]:
        return (
            self.adapter,
            self.graph_hits,
            tuple(self.misses.items()),
            self.capture_failures,
            self.graphs,
            self.memory_deferrals,
            self.last_free_bytes,
            self.floor_bytes,
            self.failure,
            self.last_epoch_ns,
        )

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, AdapterStats):
            return NotImplemented
        return self._fields() == other._fields()

    def __hash__(self) -> int:
        return hash(self._fields())

    def __repr__(self) -> str:
        misses = ", ".join(f"{r.stats_key}={n}" for r, n in self.misses.items())
        return (
            f"AdapterStats(adapter={self.adapter!r}, graph_hits={self.graph_hits}, {misses}, "
            f"capture_failures={self.capture_failures}, num_graphs={self.num_graphs})"
        )

    @property
    def graph_misses(self) -> int:
        """Misses of every reason."""
        return sum(self.misses.values())

    @property
    def calls(self) -> int:
        """Hits and misses."""
        return self.graph_hits + self.graph_misses

    @property
    def hit_rate(self) -> float:
        """The share of calls that were hits (0.0 without calls)."""
        calls = self.calls
        return self.graph_hits / calls if calls else 0.0

    @property
    def num_graphs(self) -> int:
        """Graphs the adapter holds."""
        return len(self.graphs)

    def as_dict(self) -> dict[str, int | float]:
        """Return the ``get_cumulative_stats()`` dict: exactly :data:`STATS_KEYS`."""
        return {
            "graph_hits": self.graph_hits,
            "graph_misses": self.graph_misses,
            "hit_rate": self.hit_rate,
            "num_graphs": self.num_graphs,
            **{reason.stats_key: count for reason, count in self.misses.items()},
            "capture_failures": self.capture_failures,
        }


def _rebuild_stats(adapter: str, graph_hits: int, keywords: dict[str, Any]) -> AdapterStats:
    return AdapterStats(adapter, graph_hits, **keywords)


@dataclass(slots=True)
class _Tally:
    """Mutable per-adapter accumulator behind :class:`StatsFold` (cheap to update)."""

    hits: int = 0
    misses: dict[MissReason, int] = field(default_factory=lambda: dict.fromkeys(MissReason, 0))
    graphs: list[CapturedGraphInfo] = field(default_factory=list)
    capture_failures: int = 0
    memory_deferrals: int = 0
    last_free_bytes: int | None = None
    floor_bytes: int | None = None
    failure: str | None = None
    last_epoch_ns: int = 0

    def snapshot(self, adapter: str) -> AdapterStats:
        # AdapterStats copies the misses and makes the graphs a tuple.
        return AdapterStats(adapter, self.hits, **{name: getattr(self, name) for name in _KEYWORDS})


class StatsFold:
    """Fold events into per-adapter statistics; ``fold(event)`` is the whole update.

    Not thread-safe on its own: the bus and the adapter call it under their locks.
    """

    __slots__ = ("_tallies",)

    def __init__(self) -> None:
        self._tallies: dict[str, _Tally] = {}

    def __call__(self, event: Event) -> None:
        self.fold(event)

    def fold(self, event: Event) -> None:
        """Apply one event.

        Args:
            event: the event; request events (empty adapter) open no adapter's stats.

        Raises:
            TypeError: ``event`` is not an omnitrace event.
        """
        tally = self._tallies.get(event.adapter)
        if tally is None:
            if type(event) in ev.REQUEST_EVENT_TYPES:
                # About requests, not an adapter (their adapter is empty): no tally.
                return
            tally = self._tallies[event.adapter] = _Tally()
        tally.last_epoch_ns = event.epoch_ns
        match event:
            case ev.GraphReplayed():
                tally.hits += 1
            case ev.DeviceTimed() | ev.ProfilingObserved():
                # A measurement of a call already counted (with device timing on, every
                # call has one: tested second), or a fact about a profiling run: neither is
                # a call.
                pass
            case ev.GraphMissed():
                tally.misses[event.reason] += 1
            case ev.GraphCaptured():
                tally.graphs.append(CapturedGraphInfo(*_graph_info_fields(event)))
            case ev.MemoryDeferred():
                tally.memory_deferrals += 1
                tally.last_free_bytes = event.free_bytes
                tally.floor_bytes = event.floor_bytes
            case ev.CaptureFailed():
                tally.capture_failures += 1
                if tally.failure is None:
                    tally.failure = f"{event.error_type}: {event.message}"
            case _:
                raise TypeError(f"not an omnitrace event: {type(event).__name__}")

    def extend(self, events: Iterable[Event]) -> None:
        """Apply events in order.

        Args:
            events: the events, each applied as :meth:`fold` does.

        Raises:
            TypeError: one of them is not an omnitrace event.
        """
        for event in events:
            self.fold(event)

    def count_hit(self, adapter: str) -> _Tally:
        """Return the accumulator a hit of ``adapter`` updates (created if new).

        For a fold that applies hits to these stats on its own fast path, as the bus's
        coverage fold does: one fold call per event instead of two. A hit does
        ``tally.hits += 1`` and sets ``tally.last_epoch_ns``; every other event goes
        through :meth:`fold`.

        Args:
            adapter: the adapter's name.

        Returns:
            The adapter's mutable accumulator.
        """
        tally = self._tallies.get(adapter)
        if tally is None:
            tally = self._tallies[adapter] = _Tally()
        return tally

    def adapters(self) -> tuple[str, ...]:
        """Names of the adapters seen so far, in first-seen order."""
        return tuple(self._tallies)

    def snapshot(self, adapter: str) -> AdapterStats:
        """Return the frozen stats of ``adapter`` (all zero if it has emitted nothing).

        Args:
            adapter: the adapter's name.
        """
        tally = self._tallies.get(adapter)
        return tally.snapshot(adapter) if tally is not None else AdapterStats(adapter=adapter)

    def snapshots(self) -> dict[str, AdapterStats]:
        """Return the frozen stats of every adapter seen."""
        return {name: tally.snapshot(name) for name, tally in self._tallies.items()}


def derive_stats(events: Iterable[Event]) -> dict[str, dict[str, int | float]]:
    """Fold ``events`` and return ``{adapter name: get_cumulative_stats() dict}``.

    Args:
        events: the events, in order.

    Raises:
        TypeError: one of them is not an omnitrace event.
    """
    fold = StatsFold()
    fold.extend(events)
    return {name: snap.as_dict() for name, snap in fold.snapshots().items()}
