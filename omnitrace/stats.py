"""Cumulative statistics as a pure fold over the event stream.

Nothing here counts anything on its own: every number is derived from events, so the stats
an adapter reports, the stats a sink shows and the stats recomputed from an event log agree
exactly.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from omnitrace.events import (
    CaptureFailed,
    Event,
    GraphCaptured,
    GraphMissed,
    GraphReplayed,
    MemoryDeferred,
    MissReason,
)

__all__ = [
    "STATS_KEYS",
    "AdapterStats",
    "CapturedGraphInfo",
    "StatsFold",
    "derive_stats",
]

#: The keys of ``get_cumulative_stats()``, in their documented order.
STATS_KEYS: tuple[str, ...] = (
    "graph_hits",
    "graph_misses",
    "hit_rate",
    "num_graphs",
    "ineligible_misses",
    "capacity_misses",
    "warmup_misses",
    "memory_misses",
    "capture_failures",
)


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


@dataclass(frozen=True, slots=True)
class AdapterStats:
    """A frozen snapshot of one adapter's cumulative statistics."""

    adapter: str
    graph_hits: int = 0
    ineligible_misses: int = 0
    capacity_misses: int = 0
    warmup_misses: int = 0
    memory_misses: int = 0
    capture_failures: int = 0
    graphs: tuple[CapturedGraphInfo, ...] = ()
    memory_deferrals: int = 0
    last_free_bytes: int | None = None
    """Device-free bytes seen at the latest memory deferral, if any."""
    floor_bytes: int | None = None
    failure: str | None = None
    """``"Type: message"`` of the capture failure that made the adapter terminal."""
    last_epoch_ns: int = 0

    @property
    def graph_misses(self) -> int:
        return (
            self.ineligible_misses + self.capacity_misses + self.warmup_misses + self.memory_misses
        )

    @property
    def calls(self) -> int:
        return self.graph_hits + self.graph_misses

    @property
    def hit_rate(self) -> float:
        calls = self.calls
        return self.graph_hits / calls if calls else 0.0

    @property
    def num_graphs(self) -> int:
        return len(self.graphs)

    def as_dict(self) -> dict[str, int | float]:
        """Return the ``get_cumulative_stats()`` dict: exactly :data:`STATS_KEYS`."""
        return {
            "graph_hits": self.graph_hits,
            "graph_misses": self.graph_misses,
            "hit_rate": self.hit_rate,
            "num_graphs": self.num_graphs,
            "ineligible_misses": self.ineligible_misses,
            "capacity_misses": self.capacity_misses,
            "warmup_misses": self.warmup_misses,
            "memory_misses": self.memory_misses,
            "capture_failures": self.capture_failures,
        }


@dataclass(slots=True)
class _Tally:
    """Mutable per-adapter accumulator behind :class:`StatsFold` (cheap to update)."""

    hits: int = 0
    misses: dict[MissReason, int] = field(default_factory=lambda: dict.fromkeys(MissReason, 0))
    graphs: list[CapturedGraphInfo] = field(default_factory=list)
    failures: int = 0
    deferrals: int = 0
    last_free: int | None = None
    floor: int | None = None
    failure: str | None = None
    last_epoch_ns: int = 0

    def snapshot(self, adapter: str) -> AdapterStats:
        return AdapterStats(
            adapter=adapter,
            graph_hits=self.hits,
            ineligible_misses=self.misses[MissReason.INELIGIBLE],
            capacity_misses=self.misses[MissReason.CAPACITY],
            warmup_misses=self.misses[MissReason.WARMUP],
            memory_misses=self.misses[MissReason.MEMORY],
            capture_failures=self.failures,
            graphs=tuple(self.graphs),
            memory_deferrals=self.deferrals,
            last_free_bytes=self.last_free,
            floor_bytes=self.floor,
            failure=self.failure,
            last_epoch_ns=self.last_epoch_ns,
        )


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
        """Apply one event."""
        tally = self._tallies.get(event.adapter)
        if tally is None:
            tally = self._tallies[event.adapter] = _Tally()
        tally.last_epoch_ns = event.epoch_ns
        match event:
            case GraphReplayed():
                tally.hits += 1
            case GraphMissed():
                tally.misses[event.reason] += 1
            case GraphCaptured():
                tally.graphs.append(
                    CapturedGraphInfo(
                        key=event.key,
                        epoch_ns=event.epoch_ns,
                        duration_s=event.duration_s,
                        pool_id=event.pool_id,
                        device=event.device,
                        stream=event.stream,
                        bytes_reserved=event.bytes_reserved,
                        static_bytes=event.static_bytes,
                    )
                )
            case MemoryDeferred():
                tally.deferrals += 1
                tally.last_free = event.free_bytes
                tally.floor = event.floor_bytes
            case CaptureFailed():
                tally.failures += 1
                if tally.failure is None:
                    tally.failure = f"{event.error_type}: {event.message}"
            case _:
                raise TypeError(f"not an omnitrace event: {type(event).__name__}")

    def extend(self, events: Iterable[Event]) -> None:
        """Apply events in order."""
        for event in events:
            self.fold(event)

    def adapters(self) -> tuple[str, ...]:
        """Names of the adapters seen so far, in first-seen order."""
        return tuple(self._tallies)

    def snapshot(self, adapter: str) -> AdapterStats:
        """Return the frozen stats of ``adapter`` (all zero if it has emitted nothing)."""
        tally = self._tallies.get(adapter)
        return tally.snapshot(adapter) if tally is not None else AdapterStats(adapter=adapter)

    def snapshots(self) -> dict[str, AdapterStats]:
        """Return the frozen stats of every adapter seen."""
        return {name: tally.snapshot(name) for name, tally in self._tallies.items()}


def derive_stats(events: Iterable[Event]) -> dict[str, dict[str, int | float]]:
    """Fold ``events`` and return ``{adapter name: get_cumulative_stats() dict}``."""
    fold = StatsFold()
    fold.extend(events)
    return {name: snap.as_dict() for name, snap in fold.snapshots().items()}
