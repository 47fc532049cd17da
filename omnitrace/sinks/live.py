"""A rich live terminal view of graph coverage, fed from the stats fold.

The view never renders per event: a board keeps the folded stats (and a short list of
recent deferrals and failures), ``snapshot()`` freezes them, and rich's ``Live`` pulls
``render(board.snapshot())`` at a fixed rate (4 Hz), whatever the event rate. ``render`` is
a pure function of the frozen snapshot, so what an operator sees can be tested exactly on
a recording console.

Two boards feed the same view: :class:`BusBoard` (in-process, from an EventBus) and
:class:`RecordBoard` (from event-log records, one column per worker pid and rank). Beside the
stats, each encoder's per-signature coverage feeds the panel of the top missed signatures
(their reason and share of calls), the estimated time eager calls lost, and the calls and
captures of vLLM's start-up profiling run, or, where that run called the encoder not at all,
a note saying so with the device-free memory its first graph was captured in.
"""

from __future__ import annotations

import dataclasses
import io
import json
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any, Protocol

from rich.console import Console, ConsoleOptions, Group, RenderableType, RenderResult
from rich.live import Live
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from omnitrace._display import safe
from omnitrace._units import format_bytes
from omnitrace.bus import EventBus
from omnitrace.coverage import AdapterCoverage, CoverageFold, KeyCoverage
from omnitrace.eventlog import AdapterInfo, EventRecord
from omnitrace.events import CaptureFailed, Event, MemoryDeferred, MissReason, Phase
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
    key: str = ""
    """The graph key quoted in ``text`` (shortened there when the panel is narrow)."""


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
    rank: int | None = None
    """The writing worker's rank and pid (from an event log); None in-process."""
    pid: int | None = None
    coverage: AdapterCoverage | None = None
    """Per-signature coverage (missed signatures, eager time, profiling), when known."""


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
    progress: tuple[str, ...] = ()
    """Lines under the title (the demo's requests done of total and elapsed time)."""
    log: tuple[str, ...] = ()
    """The last log lines written while the view is up (the view adds them)."""


class Board(Protocol):
    """Something that can freeze the current state into a :class:`LiveSnapshot`."""

    def snapshot(self) -> LiveSnapshot: ...


def _clock(epoch_ns: int) -> str:
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
                f"{_clock(event.epoch_ns)} deferred {key}: free "
                f"{format_bytes(event.free_bytes)} < floor {format_bytes(event.floor_bytes)}",
                key,
            )
        case CaptureFailed():
            key = safe(event.key)
            return Notice(
                event.epoch_ns,
                True,
                f"{_clock(event.epoch_ns)} FAILED {key}: {safe(event.error_type)}: "
                f"{safe(event.message)}",
                key,
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
        progress: called at each frame for the lines under the title (e.g. requests done).
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
        coverage = self._bus.coverage()
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
                coverage=coverage.get(name),
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
        )


class RecordBoard:
    """Board of event-log records, folded per worker (rank, pid) and adapter."""

    def __init__(self, *, title: str = "omnitrace") -> None:
        self._title = title
        self._lock = threading.Lock()
        self._folds: dict[tuple[int, int], StatsFold] = {}
        self._coverage: dict[tuple[int, int], CoverageFold] = {}
        self._infos: dict[tuple[int, int], dict[str, Mapping[str, Any]]] = {}
        self._notices: dict[tuple[tuple[int, int], str], deque[Notice]] = {}
        self._count = 0
        self.footer: tuple[str, ...] = ()
        self.progress: tuple[str, ...] = ()

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
                # get() first: setdefault would build (and validate) two folds per event.
                fold = self._folds.get(source)
                if fold is None:
                    fold = self._folds[source] = StatsFold()
                coverage = self._coverage.get(source)
                if coverage is None:
                    coverage = self._coverage[source] = CoverageFold()
                fold.fold(item)
                coverage.fold(item)
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
                coverage = self._coverage.get(source, CoverageFold())
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
                            rank=source[0],
                            pid=source[1],
                            coverage=coverage.snapshot(name),
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
            )


#: Panel interior width under which rows switch to their compact wording.
_COMPACT_BELOW = 56
#: Missed signatures the frame lists at most.
_MISSED = 5
#: (notices, captured keys, log lines, missed signatures), tried in order until a frame fits:
#: old notices go first, then missed rows beyond three, log lines, keys, the last rows.
_BUDGETS: tuple[tuple[int, int | None, int, int], ...] = (
    (_RECENT, None, 3, _MISSED),
    (2, None, 3, _MISSED),
    (1, None, 2, _MISSED),
    (0, None, 2, _MISSED),
    (0, None, 2, 3),
    (0, None, 1, 3),
    (0, 3, 1, 3),
    (0, 2, 1, 2),
    (0, 1, 1, 1),
    (0, 0, 0, 1),
    (0, 0, 0, 0),
)
_DTYPES = {
    "float32": "f32",
    "float16": "f16",
    "bfloat16": "bf16",
    "float64": "f64",
    "int64": "i64",
    "int32": "i32",
}


def _line(text: str | Text, style: str = "") -> Text:
    """Return one row that never wraps: past the width it ends in an ellipsis.

    A string is shown as it is, never parsed as markup, its control characters escaped.
    """
    line = Text(safe(text), style=style) if isinstance(text, str) else text
    line.no_wrap = True
    line.overflow = "ellipsis"
    return line


def _elide(text: str, width: int) -> str:
    """Shorten ``text`` to ``width`` columns by cutting its middle (shapes end in news)."""
    if len(text) <= width:
        return text
    if width <= 1:
        return "…"[:width]
    head = (width - 1) // 2 + (width - 1) % 2
    return text[:head] + "…" + text[len(text) - (width - 1 - head) :]


def _split_key(key: str) -> tuple[str, str]:
    """Split a graph key into its inputs and its ``@device s=stream`` placement."""
    inputs, sep, where = key.partition(" @")
    return inputs, (f"@{where}" if sep else "")


def _short_inputs(inputs: str) -> str:
    """Abbreviate dtypes and drop absent inputs: ``f32[1,256,64]`` for the key's inputs."""
    parts = [part for part in inputs.split(", ") if part != "None"]
    short = []
    for part in parts:
        dtype, bracket, rest = part.partition("[")
        short.append(_DTYPES.get(dtype, dtype) + bracket + rest)
    return ", ".join(short) or inputs


def _misses(stats: AdapterStats, compact: bool) -> list[Text]:
    parts = [(reason, stats.misses[reason]) for reason in MissReason.display_order()]
    half = (len(parts) + 1) // 2
    rows = [parts[:half], parts[half:]] if compact else [parts]
    out = []
    for row in rows:
        text = Text()
        for index, (reason, count) in enumerate(row):
            if index:
                text.append(" · ")
            style = "yellow" if count and reason.loses_coverage else ""
            text.append(f"{reason.value} {count}", style=style)
        out.append(_line(text))
    return out


def _keys_table(
    encoder: EncoderSnapshot, width: int, compact: bool, limit: int | None
) -> RenderableType:
    graphs = encoder.stats.graphs
    shown = graphs if limit is None else graphs[:limit]
    places = {_split_key(graph.key)[1] for graph in graphs}
    # One placement for every graph (the usual case) goes in the header, once.
    common = places.pop() if len(places) == 1 else None
    keys = Table(box=None, padding=(0, 1), show_edge=False, header_style="bold")
    key_header = "captured key" if not common else f"captured key {common}"
    keys.add_column(key_header, no_wrap=True, overflow="ellipsis")
    if not compact:
        keys.add_column("at", no_wrap=True)
    keys.add_column("capture", justify="right", no_wrap=True, min_width=8)
    # Free memory before each capture, where the events carry it and the panel is wide.
    free = not compact and any(graph.free_bytes is not None for graph in graphs)
    if free:
        keys.add_column("free", justify="right", no_wrap=True, min_width=9)
    # What is left beside the capture time (and the clock): the key is elided to fit it.
    key_width = width - (11 if compact else 22) - (10 if free else 0)
    profiled = _profiling_captures(encoder.coverage)
    for graph in shown:
        inputs, place = _split_key(safe(graph.key))
        label = _short_inputs(inputs) if compact else inputs
        if common is None and place:
            label = f"{label} {place}"
        tag = " (prof)" if graph.signature in profiled else ""
        # Text cells: a str cell would be parsed as rich markup, and the key is data.
        cells: list[str | Text] = [Text(_elide(label, max(8, key_width - len(tag))) + tag)]
        if not compact:
            cells.append(_clock(graph.epoch_ns))
        cells.append(f"{graph.duration_s * 1e3:.1f} ms")
        if free:
            cells.append(format_bytes(graph.free_bytes))
        keys.add_row(*cells)
    if len(shown) < len(graphs):
        keys.add_row(Text(f"… {len(graphs) - len(shown)} more", style="dim"))
    return keys


def _profiling_captures(coverage: AdapterCoverage | None) -> set[Any]:
    """The signatures captured during the profiling phase."""
    if coverage is None:
        return set()
    return {row.signature for row in coverage.captured if row.capture_phase is Phase.PROFILING}


def _seconds(value: float, compact: bool = False) -> str:
    if compact:
        return f"{value:.1f}s" if value >= 1 else f"{value * 1e3:.0f}ms"
    return f"{value:.2f} s" if value >= 1 else f"{value * 1e3:.1f} ms"


def _eager_row(coverage: AdapterCoverage, backend: str | None, compact: bool) -> Text | None:
    """The eager time of misses a graph could have served, and what graphs would save."""
    loss = coverage.eager_loss()
    if not loss.misses:
        return None
    eager = _seconds(loss.eager_s, compact)
    if backend == "simulated":
        # A simulated replay runs the forward again: there is no saving to estimate.
        if compact:
            return Text(f"{eager} {loss.source}, lost n/a (sim)")
        lost = Text("lost n/a (simulated)", style="dim")
    elif loss.lost_s is None:
        lost = Text("lost ?", style="dim")
    else:
        lost = Text("lost ≈ " if not compact else "lost ≈")
        lost.append(_seconds(loss.lost_s, compact), style="yellow" if loss.lost_s > 0 else "")
    if compact:
        text = lost
        text.append(f" of {eager} {loss.source}")
        return text
    text = Text(f"{eager} in {loss.timed} misses · ")
    text.append_text(lost)
    text.append(f" {loss.source}", style="dim")
    return text


def _unprofiled_row(encoder: EncoderSnapshot, compact: bool) -> Text:
    """The note of an encoder the profiling run never called, with the free memory of its
    first capture: that graph was captured after the KV cache took its memory."""
    text = Text("0 calls" if compact else "not called in profiling", style="yellow")
    graphs = encoder.stats.graphs
    if graphs and graphs[0].free_bytes is not None:
        where = " · cap " if compact else " · first capture at "
        text.append(f"{where}{format_bytes(graphs[0].free_bytes)} free")
    return text


def _profiling_row(
    encoder: EncoderSnapshot, coverage: AdapterCoverage, compact: bool
) -> Text | None:
    """Calls and captures of the profiling phase, and whether serving replayed them."""
    profiling = coverage.in_phase(Phase.PROFILING)
    if not profiling.calls and not profiling.captures:
        if coverage.profiling_runs.runs:
            return _unprofiled_row(encoder, compact)
        return None
    captured = [row for row in coverage.captured if row.capture_phase is Phase.PROFILING]
    used = sum(1 for row in captured if row.in_phase(Phase.SERVING).hits)
    if compact:
        text = Text(f"{profiling.calls} calls · {len(captured)} cap")
        if captured:
            text.append(f" · {used} served", style="yellow" if used < len(captured) else "")
        return text
    text = Text(f"calls {profiling.calls} · captures {len(captured)}")
    if captured:
        text.append(
            f" · {used} of {len(captured)} replayed while serving",
            style="yellow" if used < len(captured) else "",
        )
    return text


def _missed_rows(
    encoders: Sequence[EncoderSnapshot], limit: int
) -> list[tuple[EncoderSnapshot, KeyCoverage, float]]:
    """The signatures with the most misses across encoders, with their share of calls."""
    rows = []
    for encoder in encoders:
        coverage = encoder.coverage
        if coverage is None:
            continue
        calls = coverage.total.calls or 1
        rows += [(encoder, row, row.graph_misses / calls) for row in coverage.top_missed(limit)]
    rows.sort(key=lambda item: -item[1].graph_misses)
    return rows[:limit]


def _reasons_text(row: KeyCoverage, compact: bool) -> Text:
    """A missed signature's reason, or with several reasons each with its count, most first.

    ``warmup`` beside 2 misses reads as two warm-ups: a key with one warm-up and one capacity
    miss shows ``warmup 1, capacity 1`` instead (ties in display order).
    """
    misses = row.total.misses
    present = [reason for reason in MissReason.display_order() if misses[reason]]
    present.sort(key=lambda reason: -misses[reason])
    text = Text()
    for reason in present:
        if len(present) == 1:
            label = reason.value  # the misses column beside it is its count
        else:
            # Short names keep a narrow panel's key column readable.
            label = f"{reason.short if compact else reason.value} {misses[reason]}"
        if text:
            text.append(", ")
        text.append(label, style="yellow" if reason.loses_coverage else "")
    return text


def _missed_panel(
    encoders: Sequence[EncoderSnapshot], width: int, limit: int
) -> RenderableType | None:
    """The panel of the top missed signatures: encoder, signature, reason, misses, share."""
    rows = _missed_rows(encoders, limit)
    if not rows:
        return None
    compact = width < 100
    sources = len({encoder.source for encoder, _, _ in rows}) > 1
    table = Table(box=None, padding=(0, 1), show_edge=False, header_style="bold", expand=False)
    table.add_column("encoder", no_wrap=True)
    table.add_column("missed signature", no_wrap=True, overflow="ellipsis")
    table.add_column("reason", no_wrap=True)
    table.add_column("misses", justify="right", no_wrap=True)
    table.add_column("share", justify="right", no_wrap=True)
    names = [
        safe(encoder.stats.adapter)
        + (f" r{encoder.rank}" if sources and encoder.rank is not None else "")
        for encoder, _, _ in rows
    ]
    reasons = [_reasons_text(row, compact) for _, row, _ in rows]
    reason_width = max(9, max(len(text) for text in reasons) + 1)
    # What the other columns leave (borders, padding, reason, misses, share) goes to the key.
    key_width = max(8, width - 4 - max(len(n) for n in names) - 1 - reason_width - 7 - 7 - 3)
    for name, reason, (_, row, share) in zip(names, reasons, rows, strict=True):
        if row.signature is None:
            label = "(shapes not tracked)"
        else:
            inputs, place = _split_key(safe(row.key))
            label = _short_inputs(inputs) if compact else f"{inputs} {place}".rstrip()
        # Text, not str: the name and the key are data, never rich markup.
        table.add_row(
            Text(name),
            Text(_elide(label, key_width)),
            reason,
            str(row.graph_misses),
            f"{share * 100:.1f} %",
        )
    return Panel(
        table,
        title="[bold]top missed signatures[/]",
        title_align="left",
        border_style="yellow",
        expand=True,
    )


def _encoder_panel(
    encoder: EncoderSnapshot, width: int, notices: int, key_limit: int | None
) -> Panel:
    """Return one encoder's panel for an interior of ``width`` columns."""
    stats = encoder.stats
    compact = width < _COMPACT_BELOW
    grid = Table.grid(padding=(0, 1))
    labels = 8 if not compact or stats.failure is not None else 6  # "hit rate", "TERMINAL"
    grid.add_column(style="bold", no_wrap=True, min_width=labels)
    grid.add_column(no_wrap=True, overflow="ellipsis")
    rate_style = (
        "green" if stats.hit_rate >= 0.8 else ("yellow" if stats.hit_rate >= 0.5 else "red")
    )
    rate = Text(f"{stats.hit_rate * 100:5.1f} %", style=rate_style)
    if compact:
        rate.append(f"  {stats.graph_hits} of {stats.calls} calls", style="")
    else:
        rate.append(f"   hits {stats.graph_hits} / calls {stats.calls}", style="")
    grid.add_row("hits" if compact else "hit rate", _line(rate))
    for index, row in enumerate(_misses(stats, compact)):
        grid.add_row("misses" if index == 0 else "", row)
    cap = "?" if encoder.max_graphs is None else str(encoder.max_graphs)
    held = Text(f"{stats.num_graphs} / {cap}")
    if encoder.max_graphs is not None and stats.num_graphs >= encoder.max_graphs:
        held.append(" full", style="yellow")
    if encoder.backend:
        held.append(f"  {'' if compact else 'backend '}{safe(encoder.backend)}", style="dim")
    grid.add_row("graphs", _line(held))
    floor = encoder.min_free_bytes if encoder.min_free_bytes is not None else stats.floor_bytes
    # Free memory is only measured when admission checks it, i.e. at a deferral.
    deferred = stats.memory_deferrals
    deferral_style = "yellow" if deferred else ""
    if compact:
        memory = Text(f"floor {format_bytes(floor)} · ")
        memory.append(f"deferred {deferred}", style=deferral_style)
        grid.add_row("memory", _line(memory))
        grid.add_row("", _line(f"last free {format_bytes(stats.last_free_bytes)}"))
    else:
        memory = Text(
            f"floor {format_bytes(floor)} · last free {format_bytes(stats.last_free_bytes)} · "
        )
        memory.append(f"deferrals {deferred}", style=deferral_style)
        grid.add_row("memory", _line(memory))
    coverage = encoder.coverage
    if coverage is not None:
        eager = _eager_row(coverage, encoder.backend, compact)
        if eager is not None:
            grid.add_row("eager", _line(eager))
        profiling = _profiling_row(encoder, coverage, compact)
        if profiling is not None:
            grid.add_row("profile" if not compact else "prof", _line(profiling))
    if stats.failure is not None:
        grid.add_row("TERMINAL", _line(stats.failure, style="bold red"))

    body: list[RenderableType] = [grid]
    if stats.graphs:
        body.append(_keys_table(encoder, width, compact, key_limit))
    for notice in encoder.notices[len(encoder.notices) - notices :] if notices else ():
        text = notice.text
        if compact and notice.key:
            text = text.replace(notice.key, _short_inputs(_split_key(notice.key)[0]), 1)
        body.append(_line(text, style="bold red" if notice.failed else "yellow"))
    name = safe(stats.adapter)
    title = name if not encoder.source else f"{name} · {safe(encoder.source)}"
    return Panel(
        Group(*body),
        # A Text title: a markup string would style, or fail on, a name such as "vision[/]".
        title=Text(title, style="bold"),
        title_align="left",
        border_style="red" if stats.failure is not None else "blue",
        expand=True,
    )


def _columns(encoders: Sequence[EncoderSnapshot]) -> list[list[EncoderSnapshot]]:
    """Group panels into columns: one per worker, or per encoder for a single worker."""
    columns: dict[str, list[EncoderSnapshot]] = {}
    for encoder in encoders:
        columns.setdefault(encoder.source, []).append(encoder)
    if len(columns) == 1:
        return [[e] for e in encoders]
    return list(columns.values())


def _layout(
    encoders: Sequence[EncoderSnapshot], width: int, notices: int, key_limit: int | None
) -> Table:
    """Lay panels side by side in columns of equal width."""
    columns = _columns(encoders)
    grid = Table.grid(expand=True, padding=(0, 1))
    for _ in columns:
        grid.add_column(ratio=1)
    # Each column loses one separating space, then two borders and two padding columns.
    inner = (width - (len(columns) - 1)) // len(columns) - 4
    grid.add_row(
        *(
            Group(*(_encoder_panel(e, inner, notices, key_limit) for e in group))
            for group in columns
        )
    )
    return grid


def _log_line(raw: str) -> Text:
    """Return a log line as one short row: level, event and encoder of a JSON line."""
    try:
        record = json.loads(raw)
    except ValueError:
        record = None
    if not isinstance(record, dict):
        return _line(raw, style="dim")
    level = safe(record.get("level", ""))
    text = Text(f"{level:<7} ", style=_LEVEL_STYLES.get(level, "dim"))
    text.append(safe(record.get("event", "")))
    for key in ("encoder", "key", "error_type", "message"):
        if key in record:
            text.append(f" {safe(record[key])}", style="dim")
    return _line(text)


_LEVEL_STYLES = {"error": "bold red", "critical": "bold red", "warning": "yellow"}


def _frame(
    snapshot: LiveSnapshot,
    width: int,
    notices: int,
    key_limit: int | None,
    logs: int,
    missed: int = _MISSED,
) -> Group:
    header = Text(safe(snapshot.title), style="bold")
    header.append(f"   {_clock(snapshot.taken_epoch_ns)}", style="dim")
    parts: list[RenderableType] = [_line(header)]
    parts.extend(_line(line) for line in snapshot.progress)
    if snapshot.encoders:
        parts.append(_layout(snapshot.encoders, width, notices, key_limit))
        panel = _missed_panel(snapshot.encoders, width, missed) if missed else None
        if panel is not None:
            parts.append(panel)
    else:
        parts.append(Text("no encoder events yet", style="dim"))
    bus = Text("bus  ")
    bus.append("events " + ("—" if snapshot.emitted is None else str(snapshot.emitted)))
    bus.append(" · dropped ")
    if snapshot.dropped is None:
        bus.append("— (not in the event log)", style="dim")
    else:
        bus.append(str(snapshot.dropped), style="bold red" if snapshot.dropped else "green")
    parts.append(_line(bus))
    parts.extend(_line(line) for line in snapshot.footer)
    if logs and snapshot.log:
        parts.extend(_log_line(line) for line in snapshot.log[-logs:])
    return Group(*parts)


class _Frame:
    """A frame that fits its console: fewer notices, keys and log lines when space is short."""

    def __init__(self, snapshot: LiveSnapshot, height: int | None) -> None:
        self.snapshot = snapshot
        self.height = height

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        width = options.max_width
        if self.height is None:
            yield _frame(self.snapshot, width, *_BUDGETS[0])
            return
        measure = options.update(height=None)
        for budget in _BUDGETS:
            frame = _frame(self.snapshot, width, *budget)
            if len(console.render_lines(frame, measure, pad=False)) <= self.height:
                break
        yield frame


def render(snapshot: LiveSnapshot, *, height: int | None = None) -> RenderableType:
    """Return the renderable of one frame (a pure function of ``snapshot``).

    Args:
        snapshot: what to show.
        height: rows available (the live view passes the terminal's); when the full frame
            is taller, older notices, then captured keys and log lines are left out, so
            the frame is never cut. None: show everything.
    """
    return _Frame(snapshot, height)


def _failed_frame(exc: BaseException) -> Text:
    """The one line a frame that could not be drawn is replaced with."""
    return _line(f"omnitrace: this frame could not be drawn: {type(exc).__name__}: {exc}", "red")


class _Drawn:
    """A renderable rendered whole before any of it is yielded.

    Rich's ``Live`` draws from its own refresh thread: an exception there ends the thread
    (the view freezes) and, at exit, would skip restoring ``sys.stdout``. Rendered here,
    any failure becomes one line in the frame instead, and the next frame tries again.
    """

    def __init__(self, renderable: RenderableType) -> None:
        self.renderable = renderable

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        try:
            segments = list(console.render(self.renderable, options))
        except Exception as exc:
            yield _failed_frame(exc)
            return
        yield from segments


class LogTail(io.TextIOBase):
    """A text stream that keeps what is written to it while the live view is up.

    The view shows its last lines in place, and :meth:`lines` hands everything back
    afterwards, so log lines never print across the view and none is lost (beyond
    ``keep`` lines, the oldest are dropped and counted in :attr:`dropped`).
    """

    def __init__(self, keep: int = 10_000) -> None:
        super().__init__()
        self._lock = threading.Lock()
        self._lines: deque[str] = deque(maxlen=keep)
        self._partial = ""
        self.dropped = 0

    def writable(self) -> bool:
        return True

    def write(self, text: str) -> int:
        with self._lock:
            pieces = (self._partial + text).split("\n")
            self._partial = pieces.pop()
            for piece in pieces:
                if len(self._lines) == self._lines.maxlen:
                    self.dropped += 1
                self._lines.append(piece)
        return len(text)

    def recent(self, count: int) -> tuple[str, ...]:
        """Return the last ``count`` complete lines."""
        with self._lock:
            return tuple(self._lines)[-count:] if count else ()

    def lines(self) -> list[str]:
        """Return every line kept, the unfinished last one included."""
        with self._lock:
            return [*self._lines, *([self._partial] if self._partial else [])]


class LiveView:
    """Show ``render(board.snapshot())`` in the terminal, refreshed at a fixed rate.

    Use as a context manager around the work; leaving the block draws a final frame and
    restores the terminal (also on Ctrl-C). While the view is up, whatever is written to
    ``sys.stderr`` (log lines, warnings) goes into a :class:`LogTail`: the frame shows its
    last lines. When the view closes, they are written to stderr if it is redirected (a file,
    a pipe); on the view's own terminal one line says how many there were instead, so the
    final frame is not scrolled away.

    Args:
        board: what to show.
        console: where to draw (a terminal).
        refresh_per_second: frames per second, whatever the event rate.
        log_hint: appended to that line (e.g. which option keeps the lines in a file).
    """

    def __init__(
        self,
        board: Board,
        *,
        console: Console | None = None,
        refresh_per_second: float = REFRESH_PER_SECOND,
        log_hint: str = "",
    ) -> None:
        self._board = board
        self._log_hint = log_hint
        self._console = console if console is not None else Console()
        self.log = LogTail()
        self._stderr: Any = None
        self._stdout: Any = None
        self._live = Live(
            console=self._console,
            refresh_per_second=refresh_per_second,
            get_renderable=self._frame,
            # Stray prints to stdout go above the view; stderr is taken over in __enter__.
            redirect_stderr=False,
            redirect_stdout=True,
        )

    def _frame(self) -> RenderableType:
        # Called from rich's refresh thread: nothing a board or a text holds may end it.
        try:
            snapshot = dataclasses.replace(self._board.snapshot(), log=self.log.recent(3))
            return _Drawn(render(snapshot, height=self._console.height))
        except Exception as exc:
            return _failed_frame(exc)

    def __enter__(self) -> LiveView:
        self._stderr = sys.stderr
        self._stdout = sys.stdout
        sys.stderr = self.log
        try:
            self._live.start(refresh=True)
        except BaseException:
            sys.stderr = self._stderr
            sys.stdout = self._stdout
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            try:
                self._live.refresh()
            finally:
                # Stopping also puts back the sys.stdout Live redirected, so it runs whatever
                # the last refresh did.
                self._live.stop()
        finally:
            # And should stop itself fail, the streams are put back all the same.
            sys.stderr = self._stderr
            sys.stdout = self._stdout
            self._hand_back_logs()

    def _hand_back_logs(self) -> None:
        lines = self.log.lines()
        if not lines:
            return
        stream = self._stderr
        if _isatty(stream):
            count = len(lines) + self.log.dropped
            hint = self._log_hint
            stream.write(f"omnitrace: {count} log lines were shown in the live view{hint}\n")
        else:
            if self.log.dropped:
                lines.insert(0, f"({self.log.dropped} earlier log lines were dropped)")
            stream.write("\n".join(lines) + "\n")
        stream.flush()


def _isatty(stream: Any) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):
        return False
