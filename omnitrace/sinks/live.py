"""A rich live terminal view of graph coverage, fed from the stats fold.

The view never renders per event: a board keeps the folded stats (and a short list of
recent deferrals and failures), ``snapshot()`` freezes them, and rich's ``Live`` pulls
``render(board.snapshot())`` at a fixed rate (4 Hz), whatever the event rate. ``render`` is
a pure function of the frozen snapshot, so what an operator sees can be tested exactly on
a recording console.

Two boards feed the same view: :class:`BusBoard` (in-process, from an EventBus) and
:class:`RecordBoard` (from event-log records, one column per worker pid and rank).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any, Protocol

from rich.console import Console, Group, RenderableType
from rich.live import Live
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from omnitrace.bus import EventBus
from omnitrace.events import CaptureFailed, Event, MemoryDeferred
from omnitrace.sinks.jsonl import AdapterInfo, EventRecord
from omnitrace.stats import AdapterStats, StatsFold

__all__ = [
    "REFRESH_PER_SECOND",
    "Board",
    "BusBoard",
    "EncoderSnapshot",
    "LiveSnapshot",
    "LiveView",
    "Notice",
    "RecordBoard",
    "format_bytes",
    "render",
]

REFRESH_PER_SECOND = 4.0
_RECENT = 5


@dataclass(frozen=True, slots=True)
class Notice:
    """A recent memory deferral or capture failure, as one line of text."""

    epoch_ns: int
    failed: bool
    text: str


@dataclass(frozen=True, slots=True)
class EncoderSnapshot:
    """What the view shows of one encoder adapter (of one worker)."""

    stats: AdapterStats
    source: str = ""
    """The worker it belongs to (``"rank 0 · pid 4242"``), empty in-process."""
    max_graphs: int | None = None
    min_free_bytes: int | None = None
    backend: str | None = None
    notices: tuple[Notice, ...] = ()


@dataclass(frozen=True, slots=True)
class LiveSnapshot:
    """Everything one frame of the view shows; ``render`` reads nothing else."""

    title: str
    taken_epoch_ns: int
    encoders: tuple[EncoderSnapshot, ...]
    emitted: int | None = None
    dropped: int | None = None
    """Events the bus's sinks lost; None where unknown (a log read from another process)."""
    footer: tuple[str, ...] = ()


class Board(Protocol):
    """Something that can freeze the current state into a :class:`LiveSnapshot`."""

    def snapshot(self) -> LiveSnapshot: ...


def format_bytes(value: int | None) -> str:
    """Format bytes with a binary unit: ``1.0 GiB``; ``—`` when unknown."""
    if value is None:
        return "—"
    size = float(value)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(size) < 1024 or unit == "GiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    raise AssertionError("unreachable")


def _clock(epoch_ns: int) -> str:
    return datetime.fromtimestamp(epoch_ns / 1e9, tz=timezone.utc).strftime("%H:%M:%SZ")


def _notice(event: Event) -> Notice | None:
    match event:
        case MemoryDeferred():
            return Notice(
                event.epoch_ns,
                False,
                f"{_clock(event.epoch_ns)} deferred {event.key}: free "
                f"{format_bytes(event.free_bytes)} < floor {format_bytes(event.floor_bytes)}",
            )
        case CaptureFailed():
            return Notice(
                event.epoch_ns,
                True,
                f"{_clock(event.epoch_ns)} FAILED {event.key}: {event.error_type}: {event.message}",
            )
    return None


def _int_or_none(info: Mapping[str, Any], key: str) -> int | None:
    value = info.get(key)
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _backend(info: Mapping[str, Any]) -> str | None:
    value = info.get("backend")
    return value if isinstance(value, str) else None


class BusBoard:
    """Board of an in-process bus: stats from its fold, notices from a tiny sink.

    Args:
        bus: the bus the adapters emit on (a notice collector sink is attached to it).
        title: the header line.
        footer: called at each frame for extra lines (e.g. the demo's streaming calls).
    """

    def __init__(
        self,
        bus: EventBus,
        *,
        title: str = "omnitrace",
        footer: Callable[[], Sequence[str]] | None = None,
    ) -> None:
        self._bus = bus
        self._title = title
        self._footer = footer
        self._lock = threading.Lock()
        self._notices: dict[str, deque[Notice]] = {}
        bus.add_sink(self)

    name = "live"

    def handle(self, events: Sequence[Event]) -> None:
        """Keep the last few deferrals and failures per encoder (the rest is in the fold)."""
        for event in events:
            notice = _notice(event)
            if notice is not None:
                with self._lock:
                    self._notices.setdefault(event.adapter, deque(maxlen=_RECENT)).append(notice)

    def snapshot(self) -> LiveSnapshot:
        """Freeze the bus's stats fold, adapter facts and counters."""
        stats = self._bus.adapter_stats()
        infos = self._bus.adapters()
        bus_stats = self._bus.statistics()
        names = list(infos) + [name for name in stats if name not in infos]
        with self._lock:
            notices = {name: tuple(q) for name, q in self._notices.items()}
        encoders = tuple(
            EncoderSnapshot(
                stats=stats.get(name, AdapterStats(adapter=name)),
                max_graphs=_int_or_none(infos.get(name, {}), "max_graphs"),
                min_free_bytes=_int_or_none(infos.get(name, {}), "min_free_bytes"),
                backend=_backend(infos.get(name, {})),
                notices=notices.get(name, ()),
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
        )


class RecordBoard:
    """Board of event-log records, folded per worker (rank, pid) and adapter."""

    def __init__(self, *, title: str = "omnitrace") -> None:
        self._title = title
        self._lock = threading.Lock()
        self._folds: dict[tuple[int, int], StatsFold] = {}
        self._infos: dict[tuple[int, int], dict[str, Mapping[str, Any]]] = {}
        self._notices: dict[tuple[tuple[int, int], str], deque[Notice]] = {}
        self._count = 0
        self.footer: tuple[str, ...] = ()

    def add(self, records: Iterable[EventRecord]) -> None:
        """Fold ``records`` (thread-safe against ``snapshot``)."""
        with self._lock:
            for record in records:
                source = record.source
                item = record.item
                if isinstance(item, AdapterInfo):
                    self._infos.setdefault(source, {})[item.adapter] = item.info
                    continue
                self._count += 1
                self._folds.setdefault(source, StatsFold()).fold(item)
                notice = _notice(item)
                if notice is not None:
                    key = (source, item.adapter)
                    self._notices.setdefault(key, deque(maxlen=_RECENT)).append(notice)

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
                infos = self._infos.get(source, {})
                names = list(infos) + [n for n in fold.adapters() if n not in infos]
                label = f"rank {source[0]} · pid {source[1]}" if len(sources) > 1 else ""
                for name in names:
                    info = infos.get(name, {})
                    encoders.append(
                        EncoderSnapshot(
                            stats=fold.snapshot(name),
                            source=label,
                            max_graphs=_int_or_none(info, "max_graphs"),
                            min_free_bytes=_int_or_none(info, "min_free_bytes"),
                            backend=_backend(info),
                            notices=tuple(self._notices.get((source, name), ())),
                        )
                    )
            return LiveSnapshot(
                title=self._title,
                taken_epoch_ns=time.time_ns(),
                encoders=tuple(encoders),
                emitted=self._count,
                dropped=None,
                footer=self.footer,
            )


def _misses(stats: AdapterStats) -> Text:
    parts = [
        ("warmup", stats.warmup_misses),
        ("capacity", stats.capacity_misses),
        ("memory", stats.memory_misses),
        ("ineligible", stats.ineligible_misses),
    ]
    text = Text()
    for index, (label, count) in enumerate(parts):
        if index:
            text.append(" · ")
        text.append(f"{label} {count}", style="yellow" if count and label != "warmup" else "")
    return text


def _encoder_panel(encoder: EncoderSnapshot) -> Panel:
    stats = encoder.stats
    grid = Table.grid(padding=(0, 1))
    grid.add_column(style="bold", no_wrap=True)
    grid.add_column()
    rate_style = (
        "green" if stats.hit_rate >= 0.8 else ("yellow" if stats.hit_rate >= 0.5 else "red")
    )
    rate = Text(f"{stats.hit_rate * 100:5.1f} %", style=rate_style)
    rate.append(f"   hits {stats.graph_hits} / calls {stats.calls}", style="")
    grid.add_row("hit rate", rate)
    grid.add_row("misses", _misses(stats))
    cap = "?" if encoder.max_graphs is None else str(encoder.max_graphs)
    held = Text(f"{stats.num_graphs} / {cap}")
    if encoder.max_graphs is not None and stats.num_graphs >= encoder.max_graphs:
        held.append(" full", style="yellow")
    if encoder.backend:
        held.append(f"  backend {encoder.backend}", style="dim")
    grid.add_row("graphs", held)
    floor = encoder.min_free_bytes if encoder.min_free_bytes is not None else stats.floor_bytes
    # Free memory is only measured when admission checks it, i.e. at a deferral.
    memory = Text(f"floor {format_bytes(floor)} · last free {format_bytes(stats.last_free_bytes)}")
    memory.append(
        f" · deferrals {stats.memory_deferrals}",
        style="yellow" if stats.memory_deferrals else "",
    )
    grid.add_row("memory", memory)
    if stats.failure is not None:
        grid.add_row("TERMINAL", Text(stats.failure, style="bold red"))

    body: list[RenderableType] = [grid]
    if stats.graphs:
        keys = Table(box=None, padding=(0, 1), show_edge=False, header_style="bold")
        keys.add_column("captured key", overflow="fold")
        keys.add_column("at", no_wrap=True)
        keys.add_column("capture", justify="right", no_wrap=True)
        for graph in stats.graphs:
            keys.add_row(graph.key, _clock(graph.epoch_ns), f"{graph.duration_s * 1e3:.1f} ms")
        body.append(keys)
    if encoder.notices:
        recent = Text()
        for index, notice in enumerate(encoder.notices):
            if index:
                recent.append("\n")
            recent.append(notice.text, style="bold red" if notice.failed else "yellow")
        body.append(recent)
    title = stats.adapter if not encoder.source else f"{stats.adapter} · {encoder.source}"
    return Panel(
        Group(*body),
        title=f"[bold]{title}[/]",
        title_align="left",
        border_style="red" if stats.failure is not None else "blue",
        expand=True,
    )


def _layout(encoders: Sequence[EncoderSnapshot]) -> Table:
    """Lay panels side by side: one column per worker, or per encoder for a single worker."""
    columns: dict[str, list[EncoderSnapshot]] = {}
    for encoder in encoders:
        columns.setdefault(encoder.source, []).append(encoder)
    if len(columns) == 1:
        columns = {e.stats.adapter: [e] for e in encoders}
    grid = Table.grid(expand=True, padding=(0, 1))
    for _ in columns:
        grid.add_column(ratio=1)
    grid.add_row(*(Group(*(_encoder_panel(e) for e in group)) for group in columns.values()))
    return grid


def render(snapshot: LiveSnapshot) -> RenderableType:
    """Return the renderable of one frame (a pure function of ``snapshot``)."""
    header = Text(f"{snapshot.title}", style="bold")
    header.append(f"   {_clock(snapshot.taken_epoch_ns)}", style="dim")
    parts: list[RenderableType] = [header]
    if snapshot.encoders:
        parts.append(_layout(snapshot.encoders))
    else:
        parts.append(Text("no encoder events yet", style="dim"))
    bus = Text("bus  ")
    bus.append("events " + ("—" if snapshot.emitted is None else str(snapshot.emitted)))
    bus.append(" · dropped ")
    if snapshot.dropped is None:
        bus.append("— (not in the event log)", style="dim")
    else:
        bus.append(str(snapshot.dropped), style="bold red" if snapshot.dropped else "green")
    parts.append(bus)
    parts.extend(Text(line) for line in snapshot.footer)
    return Group(*parts)


class LiveView:
    """Show ``render(board.snapshot())`` in the terminal, refreshed at a fixed rate.

    Use as a context manager around the work; leaving the block draws a final frame and
    restores the terminal (also on Ctrl-C).
    """

    def __init__(
        self,
        board: Board,
        *,
        console: Console | None = None,
        refresh_per_second: float = REFRESH_PER_SECOND,
    ) -> None:
        self._board = board
        self._live = Live(
            console=console,
            refresh_per_second=refresh_per_second,
            get_renderable=self._frame,
            # Logs written to stderr while the view is up print above it, not through it.
            redirect_stderr=True,
            redirect_stdout=True,
        )

    def _frame(self) -> RenderableType:
        return render(self._board.snapshot())

    def __enter__(self) -> LiveView:
        self._live.start(refresh=True)
        return self

    def __exit__(self, *exc: object) -> None:
        self._live.refresh()
        self._live.stop()
