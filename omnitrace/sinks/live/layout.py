"""The live view's rich layout: ``render`` lays a :class:`LiveSnapshot` out as one frame of
panels and rows, shedding rows on a short terminal rather than cutting the frame."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from rich.console import Console, ConsoleOptions, Group, RenderableType, RenderResult
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from omnitrace._display import safe
from omnitrace._units import format_bytes
from omnitrace.coverage import AdapterCoverage, KeyCoverage
from omnitrace.events import MissReason, Phase
from omnitrace.misses import MissCause, cause_label, telling
from omnitrace.requests import PHASES
from omnitrace.sinks.live.model import RECENT_NOTICES, EncoderSnapshot, LiveSnapshot, clock
from omnitrace.sinks.live.total import total_panel
from omnitrace.stats import AdapterStats

__all__ = ["Drawn", "failed_frame", "render"]

#: Panel interior width under which rows switch to their compact wording.
_COMPACT_BELOW = 56
#: Narrowest panel interior for panels side by side (80 columns, two panels): narrower
#: columns are stacked, one panel under another, each the full width.
_MIN_INTERIOR = 35
#: Missed signatures the frame lists at most.
_MISSED = 5
#: (notices, captured keys, log lines, missed signatures), tried in order until a frame fits:
#: old notices go first, then missed rows beyond three, log lines, keys, the last rows.
_BUDGETS: tuple[tuple[int, int | None, int, int], ...] = (
    (RECENT_NOTICES, None, 3, _MISSED),
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


#: Miss causes a "why" row names; the rest are counted in one "+N more".
_CAUSES = 3


def _causes_row(causes: Sequence[MissCause]) -> Text | None:
    """The details of the misses an operator acts on, with their counts: ``cpu 17 · paused 2``.

    Warm-ups are expected, and a detail that only repeats its reason adds nothing: both are
    left to the misses row.
    """
    shown = telling(causes)
    if not shown:
        return None
    text = Text()
    for index, cause in enumerate(shown[:_CAUSES]):
        if index:
            text.append(" · ")
        # The detail is data (from a log, or a model wrapper): escaped, never markup.
        text.append(f"{safe(cause_label(cause))} ")
        text.append(str(cause.misses), style="yellow")
    if len(shown) > _CAUSES:
        text.append(f" · +{len(shown) - _CAUSES} more", style="dim")
    return text


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
        # A clock is a number: as wide as its longest value (HH:MM:SSZ), never cut.
        keys.add_column("at", no_wrap=True, min_width=9)
    keys.add_column("capture", justify="right", no_wrap=True, min_width=8)
    # Free memory before each capture, where the events carry it and the panel is wide.
    free = not compact and any(graph.free_bytes is not None for graph in graphs)
    if free:
        keys.add_column("free", justify="right", no_wrap=True, min_width=9)
    # What is left beside the capture time (and the clock and free memory), each column
    # with its two cells of padding: the key is elided to fit it, so no number is cut.
    key_width = width - 2 - (8 + 2) - (0 if compact else 9 + 2) - (9 + 2 if free else 0)
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
            cells.append(clock(graph.epoch_ns))
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
        calls = "1 call" if profiling.calls == 1 else f"{profiling.calls} calls"
        text = Text(f"{calls} · {len(captured)} cap")
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
    names = [
        safe(encoder.stats.adapter)
        + (f" r{encoder.rank}" if sources and encoder.rank is not None else "")
        for encoder, _, _ in rows
    ]
    reasons = [_reasons_text(row, compact) for _, row, _ in rows]
    shares = [f"{share * 100:.1f} %" for _, _, share in rows]
    counts = [str(row.graph_misses) for _, row, _ in rows]
    # Every column but the key is as wide as its widest cell (header included), so a
    # narrow panel shortens the key, never a name, a reason or a number.
    widths = {
        "encoder": max(len("encoder"), *(len(n) for n in names)),
        "reason": max(len("reason"), *(len(r) for r in reasons)),
        "misses": max(len("misses"), *(len(c) for c in counts)),
        "share": max(len("share"), *(len(x) for x in shares)),
    }
    # The panel's border and padding, two cells of padding a column, and at least 8 cells of
    # key: past that width the share goes first, then the key itself (a caption says so).
    shown = ["encoder", "missed signature", "reason", "misses", "share"]
    for column in ("share", "missed signature"):
        key = 8 if "missed signature" in shown else 0
        need = 4 + sum(widths[c] for c in shown if c in widths) + 2 * len(shown) + key
        if need <= width:
            break
        shown.remove(column)
    left_out = [c for c in ("missed signature", "share") if c not in shown]
    table = Table(box=None, padding=(0, 1), show_edge=False, header_style="bold", expand=False)
    for column in shown:
        if column == "missed signature":
            table.add_column(column, no_wrap=True, overflow="ellipsis")
        else:
            numeric = column in ("misses", "share")
            table.add_column(
                column,
                justify="right" if numeric else "left",
                no_wrap=True,
                min_width=widths[column],
            )
    key_width = max(8, width - 4 - sum(widths[c] for c in shown if c in widths) - 2 * len(shown))
    for name, reason, count, share_text, (_, row, _) in zip(
        names, reasons, counts, shares, rows, strict=True
    ):
        if row.signature is None:
            label = "(shapes not tracked)"
        else:
            inputs, place = _split_key(safe(row.key))
            label = _short_inputs(inputs) if compact else f"{inputs} {place}".rstrip()
        # Text, not str: the name and the key are data, never rich markup.
        cells: dict[str, str | Text] = {
            "encoder": Text(name),
            "missed signature": Text(_elide(label, key_width)),
            "reason": reason,
            "misses": count,
            "share": share_text,
        }
        table.add_row(*(cells[c] for c in shown))
    # Short: it must fit the bottom border of a 40-column panel.
    named = ["signature" if c == "missed signature" else c for c in left_out]
    caption = f"{' and '.join(named)} left out" if left_out else None
    return Panel(
        table,
        title="[bold]top missed signatures[/]",
        title_align="left",
        subtitle=caption,
        subtitle_align="left",
        border_style="yellow",
        expand=True,
    )


def _encoder_panel(
    encoder: EncoderSnapshot, width: int, notices: int, key_limit: int | None
) -> Panel:
    """Return one encoder's panel for an interior of ``width`` columns.

    Its rows take their full wording where every one fits, else the compact one, whose rows
    wrap at a space rather than lose a number where even they are too long.
    """
    stats = encoder.stats
    rows = _stats_rows(encoder, compact=False)
    compact = width < _COMPACT_BELOW or any(
        max(8, len(label)) + 1 + row.cell_len > width for label, row in rows
    )
    grid = Table.grid(padding=(0, 1))
    labels = 8 if not compact or stats.failure is not None else 6  # "hit rate", "TERMINAL"
    grid.add_column(style="bold", no_wrap=True, min_width=labels)
    if compact:
        grid.add_column(overflow="fold")
        for label, row in _stats_rows(encoder, compact=True):
            row.no_wrap = False
            row.overflow = "fold"
            grid.add_row(label, row)
    else:
        grid.add_column(no_wrap=True, overflow="ellipsis")
        for label, row in rows:
            grid.add_row(label, row)

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


def _stats_rows(encoder: EncoderSnapshot, *, compact: bool) -> list[tuple[str, Text]]:
    """The labelled rows of an encoder's panel above its keys, in either wording."""
    stats = encoder.stats
    rows: list[tuple[str, Text]] = []
    rate_style = (
        "green" if stats.hit_rate >= 0.8 else ("yellow" if stats.hit_rate >= 0.5 else "red")
    )
    rate = Text(f"{stats.hit_rate * 100:5.1f} %", style=rate_style)
    if compact:
        rate.append(f"  {stats.graph_hits} of {stats.calls} calls", style="")
    else:
        rate.append(f"   hits {stats.graph_hits} / calls {stats.calls}", style="")
    rows.append(("hits" if compact else "hit rate", _line(rate)))
    for index, row in enumerate(_misses(stats, compact)):
        rows.append(("misses" if index == 0 else "", row))
    cap = "?" if encoder.max_graphs is None else str(encoder.max_graphs)
    why = _causes_row(encoder.causes)
    if why is not None:
        rows.append(("why", _line(why)))
    held = Text(f"{stats.num_graphs} / {cap}")
    if encoder.max_graphs is not None and stats.num_graphs >= encoder.max_graphs:
        held.append(" full", style="yellow")
    if encoder.backend:
        held.append(f"  {'' if compact else 'backend '}{safe(encoder.backend)}", style="dim")
    rows.append(("graphs", _line(held)))
    floor = encoder.min_free_bytes if encoder.min_free_bytes is not None else stats.floor_bytes
    # Free memory is only measured when admission checks it, i.e. at a deferral.
    deferred = stats.memory_deferrals
    deferral_style = "yellow" if deferred else ""
    if compact:
        memory = Text(f"floor {format_bytes(floor)} · ")
        memory.append(f"deferred {deferred}", style=deferral_style)
        rows.append(("memory", _line(memory)))
        rows.append(("", _line(f"last free {format_bytes(stats.last_free_bytes)}")))
    else:
        memory = Text(
            f"floor {format_bytes(floor)} · last free {format_bytes(stats.last_free_bytes)} · "
        )
        memory.append(f"deferrals {deferred}", style=deferral_style)
        rows.append(("memory", _line(memory)))
    coverage = encoder.coverage
    if coverage is not None:
        eager = _eager_row(coverage, encoder.backend, compact)
        if eager is not None:
            rows.append(("eager", _line(eager)))
        profiling = _profiling_row(encoder, coverage, compact)
        if profiling is not None:
            rows.append(("profile" if not compact else "prof", _line(profiling)))
    if stats.failure is not None:
        rows.append(("TERMINAL", _line(stats.failure, style="bold red")))
    return rows


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
    """Lay panels side by side in columns of equal width, or one under another where a
    column would be too narrow for a panel's rows to stay whole."""
    columns = _columns(encoders)
    # Each column loses one separating space, then two borders and two padding columns.
    inner = (width - (len(columns) - 1)) // len(columns) - 4
    if len(columns) > 1 and inner < _MIN_INTERIOR:
        columns = [list(encoders)]
        inner = width - 4
    grid = Table.grid(expand=True, padding=(0, 1))
    for _ in columns:
        grid.add_column(ratio=1)
    grid.add_row(
        *(
            Group(*(_encoder_panel(e, inner, notices, key_limit) for e in group))
            for group in columns
        )
    )
    return grid


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f}"


def _requests_panel(panel: Any, width: int) -> Panel:
    """The "where TTFT goes" panel: per request kind, the TTFT's p50/p99 and each phase's
    p50 (ms), and the encoders' ceiling (their share of TTFT, and the most graphs can save).

    Numbers are never cut: where the width runs short, the phases with the least time go
    first (a caption counts them), then the headers shorten; the kind, the request count,
    the TTFT and the ceiling always stay whole.
    """
    kinds = panel["kinds"]
    rows = [
        {
            "kind": safe(k["kind"]),
            "n": str(k["requests"]),
            "ttft": f"{_ms(k['ttft_p50_s'])}/{_ms(k['ttft_p99_s'])}",
            "ceiling": f"{k['encoder_share'] * 100:.0f}% ≤{_ms(k['graphs_save_at_most_s'])}",
            **{p: _ms(k["phases"][p]["p50_s"]) for p in PHASES},
        }
        for k in kinds
    ]
    spent = {p: max(k["phases"][p]["mean_s"] for k in kinds) for p in PHASES}
    wanted = [p for p in PHASES if spent[p] > 0]
    wide = {"n": "n", "ttft": "TTFT p50/p99", "ceiling": "encoders · save"}
    short = {"n": "n", "ttft": "TTFT", "ceiling": "enc · save"}

    def column(name: str, header: str) -> int:
        return max(len(header), *(len(row[name]) for row in rows)) + 1

    def base(headers: dict[str, str], kind_width: int) -> int:
        return kind_width + 1 + sum(column(n, h) for n, h in headers.items())

    kind_width = min(18, max(4, *(len(row["kind"]) for row in rows)))
    headers = wide
    if base(wide, kind_width) > width:
        headers = short
    while kind_width > 4 and base(headers, kind_width) > width:
        kind_width -= 1
    room = width - base(headers, kind_width)
    shown: set[str] = set()
    for phase in sorted(wanted, key=lambda p: -spent[p]):
        need = column(phase, phase)
        if need <= room:
            shown.add(phase)
            room -= need
    phases = [p for p in wanted if p in shown]
    table = Table(box=None, pad_edge=False, expand=False, padding=(0, 1, 0, 0))
    table.add_column("kind", no_wrap=True, overflow="ellipsis", max_width=kind_width)
    for name in ("n", "ttft"):
        table.add_column(headers[name], justify="right", no_wrap=True)
    for phase in phases:
        table.add_column(phase, justify="right", no_wrap=True)
    table.add_column(headers["ceiling"], justify="right", no_wrap=True)
    for row in rows:
        table.add_row(row["kind"], row["n"], row["ttft"], *(row[p] for p in phases), row["ceiling"])
    left_out = len(wanted) - len(phases)
    title = f"where TTFT goes · last {panel['window']} requests (p50, ms)"
    if len(title) + 4 > width:
        title = f"TTFT · last {panel['window']} (ms)"
    caption = None
    if left_out:
        caption = f"{left_out} phase{'s' if left_out > 1 else ''} left out for width"
    return Panel(
        table,
        title=title,
        title_align="left",
        subtitle=caption,
        subtitle_align="left",
        border_style="dim",
    )


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


def _header(snapshot: LiveSnapshot) -> Text:
    """The frame's first row: the title and the snapshot's clock."""
    header = Text(safe(snapshot.title), style="bold")
    header.append(f"   {clock(snapshot.taken_epoch_ns)}", style="dim")
    return _line(header)


def _bus_line(snapshot: LiveSnapshot) -> Text:
    """The bus's counts: events emitted and dropped (drops in red)."""
    bus = Text("bus  ")
    bus.append("events " + ("—" if snapshot.emitted is None else str(snapshot.emitted)))
    bus.append(" · dropped ")
    if snapshot.dropped is None:
        bus.append("— (not in the event log)", style="dim")
    else:
        bus.append(str(snapshot.dropped), style="bold red" if snapshot.dropped else "green")
    return _line(bus)


def _frame(
    snapshot: LiveSnapshot,
    width: int,
    notices: int,
    key_limit: int | None,
    logs: int,
    missed: int = _MISSED,
) -> Group:
    parts: list[RenderableType] = [_header(snapshot)]
    parts.extend(_line(line) for line in snapshot.progress)
    if snapshot.encoders:
        parts.append(_layout(snapshot.encoders, width, notices, key_limit))
        # Several workers (a tensor-parallel engine's ranks): their sum, under their panels.
        total = total_panel(
            [
                ((e.rank, e.pid), e.stats)
                for e in snapshot.encoders
                if e.rank is not None and e.pid is not None
            ],
            width,
        )
        if total is not None:
            parts.append(total)
        panel = _missed_panel(snapshot.encoders, width, missed) if missed else None
        if panel is not None:
            parts.append(panel)
    else:
        parts.append(Text("no encoder events yet", style="dim"))
    if snapshot.requests is not None and snapshot.requests.get("kinds"):
        parts.append(_requests_panel(snapshot.requests, width - 4))
    parts.append(_bus_line(snapshot))
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
                yield frame
                return
        # Not even the panels' bare rows fit: a row per encoder, the title, the bus; then
        # without the progress and footer lines.
        for lines in (True, False):
            frame = _summary_frame(self.snapshot, lines)
            if len(console.render_lines(frame, measure, pad=False)) <= self.height:
                break
        yield frame


def _summary_frame(snapshot: LiveSnapshot, lines: bool) -> Group:
    """The frame of a terminal too small for the panels: one row per encoder (hit rate,
    hits of calls, graphs held of the cap), the bus's counts, and with ``lines`` the
    progress and footer lines; numbers stay whole, the names shorten."""
    parts: list[RenderableType] = [_header(snapshot)]
    if lines:
        parts.extend(_line(line) for line in snapshot.progress)
    table = Table.grid(padding=(0, 2))
    table.add_column(no_wrap=True, overflow="ellipsis", min_width=3, ratio=1)
    for _ in range(3):
        table.add_column(no_wrap=True, justify="right")
    table.add_row(*(Text(h, style="bold") for h in ("encoder", "hit rate", "hits/calls", "graphs")))
    for encoder in snapshot.encoders:
        stats = encoder.stats
        name = safe(stats.adapter) + (f" · {safe(encoder.source)}" if encoder.source else "")
        cap = "?" if encoder.max_graphs is None else str(encoder.max_graphs)
        table.add_row(
            Text(name, style="bold red" if stats.failure is not None else ""),
            f"{stats.hit_rate * 100:.1f} %",
            f"{stats.graph_hits}/{stats.calls}",
            f"{stats.num_graphs}/{cap}",
        )
    parts.append(table)
    parts.append(_bus_line(snapshot))
    if lines:
        parts.extend(_line(line) for line in snapshot.footer)
    return Group(*parts)


def render(snapshot: LiveSnapshot, *, height: int | None = None) -> RenderableType:
    """Return the renderable of one frame (a pure function of ``snapshot``).

    Args:
        snapshot: what to show.
        height: rows available (the live view passes the terminal's); when the full frame
            is taller, older notices, then captured keys and log lines are left out, so
            the frame is never cut. Keyword-only; default None: show everything.
    """
    return _Frame(snapshot, height)


def failed_frame(exc: BaseException) -> Text:
    """The one line a frame that could not be drawn is replaced with."""
    return _line(f"omnitrace: this frame could not be drawn: {type(exc).__name__}: {exc}", "red")


class Drawn:
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
            yield failed_frame(exc)
            return
        yield from segments
