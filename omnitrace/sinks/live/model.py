"""The live view's data model: the frozen snapshot of a frame (:class:`LiveSnapshot`) and the
boards that freeze it, of an in-process bus (:class:`BusBoard`) or of event-log records
(:class:`RecordBoard`, one column per worker)."""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Any, Protocol

from omnitrace._display import safe
from omnitrace._units import format_bytes
from omnitrace.config import needed_free_bytes
from omnitrace.coverage import AdapterCoverage, CoverageFold
from omnitrace.eventlog import AdapterInfo, EventRecord
from omnitrace.events import (
    REQUEST_EVENT_TYPES,
    CaptureFailed,
    EncoderBatchRan,
    Event,
    MemoryDeferred,
    RequestTimed,
)
from omnitrace.misses import MissCause
from omnitrace.requests import RequestJoin, phases_panel
from omnitrace.stats import AdapterStats, StatsFold

if TYPE_CHECKING:
    # Only BusBoard's argument: a board of event logs runs without the bus's machinery.
    from omnitrace.bus import EventBus

__all__ = [
    "RECENT_NOTICES",
    "Board",
    "BusBoard",
    "EncoderSnapshot",
    "LiveSnapshot",
    "Notice",
    "RecordBoard",
    "clock",
]

#: Deferrals and failures a board keeps per encoder.
RECENT_NOTICES = 5
#: Requests the view's "where TTFT goes" panel covers: the newest this many.
REQUEST_WINDOW = 1000
#: The events that make a notice (see _notice).
_NOTICED = (MemoryDeferred, CaptureFailed)


@dataclass(frozen=True, slots=True)
class Notice:
    """A recent memory deferral or capture failure, as one line of text.

    Args:
        epoch_ns: when it happened (epoch nanoseconds).
        failed: True for a capture failure, False for a deferral.
        text: the line shown.
        key: the graph key quoted in ``text``; default "".
    """

    epoch_ns: int
    failed: bool
    text: str
    key: str = ""
    """The graph key quoted in ``text`` (shortened there when the panel is narrow)."""


@dataclass(frozen=True, slots=True)
class EncoderSnapshot:
    """What the view shows of one encoder adapter (of one worker).

    Args:
        stats: the adapter's stats.
        source: the worker it belongs to; default "" (in-process).
        max_graphs, min_free_bytes, backend: the adapter's registered cap, floor and
            backend; each default None (unknown).
        notices: its recent deferrals and failures; default ().
        rank, pid: the writing worker's rank and pid; default None (in-process).
        coverage: its per-signature coverage; default None (unknown).
        causes: its misses by reason and detail, most first; default ().
    """

    stats: AdapterStats
    source: str = ""
    """The worker it belongs to (``"rank 0 · pid 4242"``), empty in-process."""
    max_graphs: int | None = None
    min_free_bytes: int | None = None
    backend: str | None = None
    notices: tuple[Notice, ...] = ()
    rank: int | None = None
    """The writing worker's rank and pid (from an event log); None in-process."""
    pid: int | None = None
    coverage: AdapterCoverage | None = None
    """Per-signature coverage (missed signatures, eager time, profiling), when known."""
    causes: tuple[MissCause, ...] = ()
    """The misses by reason and detail (``cpu``, ``disabled``, ...), most first."""


@dataclass(frozen=True, slots=True)
class LiveSnapshot:
    """Everything one frame of the view shows; ``render`` reads nothing else.

    Args:
        title: the header line.
        taken_epoch_ns: when the snapshot was taken (epoch nanoseconds).
        encoders: one snapshot per encoder adapter (and worker).
        emitted: events emitted; default None (unknown).
        dropped: events the bus's sinks lost; default None (unknown).
        footer: extra lines at the bottom; default ().
        progress: lines under the title; default ().
        log: the last log lines; default ().
        requests: the "where TTFT goes" panel; default None (no request timed).
    """

    title: str
    taken_epoch_ns: int
    encoders: tuple[EncoderSnapshot, ...]
    emitted: int | None = None
    dropped: int | None = None
    """Events the bus's sinks lost; None where unknown (a log read from another process)."""
    footer: tuple[str, ...] = ()
    progress: tuple[str, ...] = ()
    """Lines under the title (the demo's requests done of total and elapsed time)."""
    log: tuple[str, ...] = ()
    """The last log lines written while the view is up (the view adds them)."""
    requests: Mapping[str, Any] | None = None
    """The "where TTFT goes" panel (:func:`omnitrace.requests.phases_panel` of the newest
    :data:`REQUEST_WINDOW` requests); None while no request was timed."""


def _requests_panel(join: RequestJoin) -> Mapping[str, Any] | None:
    views = join.requests()
    return phases_panel(views, window=REQUEST_WINDOW) if views else None


class Board(Protocol):
    """Something that can freeze the current state into a :class:`LiveSnapshot`."""

    def snapshot(self) -> LiveSnapshot:
        """Return the frame to show now."""
        ...


def clock(epoch_ns: int) -> str:
    """Return the UTC time of day of ``epoch_ns``, as the view prints it (``14:03:07Z``).

    Args:
        epoch_ns: epoch time, in nanoseconds.
    """
    return datetime.fromtimestamp(epoch_ns / 1e9, tz=timezone.utc).strftime("%H:%M:%SZ")


def _notice(event: Event) -> Notice | None:
    # The key, error type and message are data (from a log, or a model's exception text).
    # The key's text is made only for the events that make a notice: every event comes here.
    match event:
        case MemoryDeferred():
            key = safe(event.key)
            return Notice(
                event.epoch_ns,
                False,
                f"{clock(event.epoch_ns)} deferred {key}: free "
                f"{format_bytes(event.free_bytes)} < "
                + (
                    f"floor {format_bytes(event.floor_bytes)}"
                    if event.need_bytes is None
                    else f"{format_bytes(needed_free_bytes(event.need_bytes))} (eager need "
                    f"{format_bytes(event.need_bytes)} and an eighth)"
                )
                + (
                    ""
                    if event.cached_bytes is None
                    else f" (allocator cache {format_bytes(event.cached_bytes)})"
                ),
                key,
            )
        case CaptureFailed():
            key = safe(event.key)
            return Notice(
                event.epoch_ns,
                True,
                f"{clock(event.epoch_ns)} FAILED {key}: {safe(event.error_type)}: "
                f"{safe(event.message)}",
                key,
            )
    return None


def _notices(events: Iterable[Event]) -> tuple[Notice, ...]:
    return tuple(notice for event in events if (notice := _notice(event)) is not None)


def _int_or_none(info: Mapping[str, Any], key: str) -> int | None:
    value = info.get(key)
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _backend(info: Mapping[str, Any]) -> str | None:
    value = info.get("backend")
    return value if isinstance(value, str) else None


class BusBoard:
    """Board of an in-process bus: stats from its fold, notices from a tiny sink.

    Args:
        bus: the bus the adapters emit on (the board attaches itself to it as a sink).
        title: the header line; default ``"omnitrace"``.
        footer: called at each frame for extra lines (e.g. the demo's streaming calls);
            default None (none).
        progress: called at each frame for the lines under the title (e.g. requests done);
            default None (none).

    Raises:
        RuntimeError: ``bus`` is closed (as :meth:`EventBus.add_sink`).
    """

    def __init__(
        self,
        bus: EventBus,
        *,
        title: str = "omnitrace",
        footer: Callable[[], Sequence[str]] | None = None,
        progress: Callable[[], Sequence[str]] | None = None,
    ) -> None:
        self._bus = bus
        self._title = title
        self._footer = footer
        self._progress = progress
        self._lock = threading.Lock()
        self._notices: dict[str, deque[Notice]] = {}
        self._requests = RequestJoin(keep=REQUEST_WINDOW)
        bus.add_sink(self)

    name = "live"

    def handle(self, events: Sequence[Event]) -> None:
        """Keep the last few deferrals and failures per encoder (the rest is in the fold),
        and the request events for the "where TTFT goes" panel.

        Args:
            events: one batch from the bus.
        """
        for event in events:
            if isinstance(event, (RequestTimed, EncoderBatchRan)):
                with self._lock:
                    self._requests.add(event, 0)  # one process
                continue
            notice = _notice(event)
            if notice is not None:
                with self._lock:
                    recent = self._notices.setdefault(event.adapter, deque(maxlen=RECENT_NOTICES))
                    recent.append(notice)

    def snapshot(self) -> LiveSnapshot:
        """Freeze the bus's stats fold, adapter facts and counters.

        Raises:
            RuntimeError: called from one of the bus's folds.
        """
        stats = self._bus.adapter_stats()
        coverage = self._bus.coverage()
        infos = self._bus.adapters()
        bus_stats = self._bus.statistics()
        names = list(infos) + [name for name in stats if name not in infos]
        with self._lock:
            notices = {name: tuple(q) for name, q in self._notices.items()}
            requests = _requests_panel(self._requests)
        encoders = tuple(
            EncoderSnapshot(
                stats=stats.get(name, AdapterStats(adapter=name)),
                max_graphs=_int_or_none(infos.get(name, {}), "max_graphs"),
                min_free_bytes=_int_or_none(infos.get(name, {}), "min_free_bytes"),
                backend=_backend(infos.get(name, {})),
                notices=notices.get(name, ()),
                coverage=coverage.get(name),
                # The bus's coverage fold counts them: exact when the sink's queue drops.
                causes=_causes(coverage.get(name)),
            )
            for name in names
        )
        return LiveSnapshot(
            title=self._title,
            taken_epoch_ns=time.time_ns(),
            encoders=encoders,
            emitted=bus_stats.emitted,
            dropped=bus_stats.dropped,
            footer=tuple(self._footer()) if self._footer is not None else (),
            progress=tuple(self._progress()) if self._progress is not None else (),
            requests=requests,
        )


class RecordBoard:
    """Board of event-log records, folded per worker (rank, pid) and adapter.

    Args:
        title: the header line; default ``"omnitrace"``.
    """

    def __init__(self, *, title: str = "omnitrace") -> None:
        self._title = title
        self._lock = threading.Lock()
        self._folds: dict[tuple[int, int], StatsFold] = {}
        self._coverage: dict[tuple[int, int], CoverageFold] = {}
        self._infos: dict[tuple[int, int], dict[str, Mapping[str, Any]]] = {}
        self._notices: dict[tuple[tuple[int, int], str], deque[Event]] = {}
        self._requests = RequestJoin(keep=REQUEST_WINDOW)
        self._count = 0
        self.footer: tuple[str, ...] = ()
        self.progress: tuple[str, ...] = ()

    def add(self, records: Iterable[EventRecord]) -> None:
        """Fold ``records`` (thread-safe against ``snapshot``).

        Args:
            records: event-log records, each writer's in the order written.

        Raises:
            TypeError: a record's item is neither an event nor adapter info.
        """
        with self._lock:
            # The folds of the last record's writer: a log's records come in long runs of
            # one writer, so most records need no lookup.
            pid = rank = None
            fold: CoverageFold | None = None
            for record in records:
                item = record.item
                if isinstance(item, AdapterInfo):
                    self._infos.setdefault(record.source, {})[item.adapter] = item.info
                    continue
                if type(item) in REQUEST_EVENT_TYPES:
                    # About requests, not an adapter: joined across the logs' processes.
                    self._count += 1
                    self._requests.add(item, record.pid)
                    continue
                if record.pid != pid or record.rank != rank or fold is None:
                    pid, rank = record.pid, record.rank
                    fold = self._fold((rank, pid))
                self._count += 1
                fold.fold(item)  # the stats and the misses' details too: one call per event
                if isinstance(item, _NOTICED):
                    # Kept as events: a snapshot words the few it shows.
                    key = ((rank, pid), item.adapter)
                    self._notices.setdefault(key, deque(maxlen=RECENT_NOTICES)).append(item)

    def _fold(self, source: tuple[int, int]) -> CoverageFold:
        """The coverage fold of ``source``, which also applies its events to its stats."""
        coverage = self._coverage.get(source)
        if coverage is None:
            stats = self._folds[source] = StatsFold()
            coverage = self._coverage[source] = CoverageFold(stats=stats)
        return coverage

    @property
    def events(self) -> int:
        """Events folded so far."""
        return self._count

    def snapshot(self) -> LiveSnapshot:
        """Freeze the per-worker stats."""
        with self._lock:
            sources = sorted(set(self._folds) | set(self._infos))
            encoders: list[EncoderSnapshot] = []
            for source in sources:
                fold = self._folds.get(source, StatsFold())
                coverage = self._coverage.get(source, CoverageFold())
                infos = self._infos.get(source, {})
                names = list(infos) + [n for n in fold.adapters() if n not in infos]
                label = f"rank {source[0]} · pid {source[1]}" if len(sources) > 1 else ""
                for name in names:
                    info = infos.get(name, {})
                    covered = coverage.snapshot(name)
                    encoders.append(
                        EncoderSnapshot(
                            stats=fold.snapshot(name),
                            source=label,
                            max_graphs=_int_or_none(info, "max_graphs"),
                            min_free_bytes=_int_or_none(info, "min_free_bytes"),
                            backend=_backend(info),
                            notices=_notices(self._notices.get((source, name), ())),
                            rank=source[0],
                            pid=source[1],
                            coverage=covered,
                            causes=_causes(covered),
                        )
                    )
            return LiveSnapshot(
                title=self._title,
                taken_epoch_ns=time.time_ns(),
                encoders=tuple(encoders),
                emitted=self._count,
                dropped=None,
                footer=self.footer,
                progress=self.progress,
                requests=_requests_panel(self._requests),
            )


def _causes(coverage: AdapterCoverage | None) -> tuple[MissCause, ...]:
    """An encoder's misses by reason and detail, as its coverage counted them."""
    return () if coverage is None else coverage.miss_details
