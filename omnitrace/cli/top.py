"""``omnitrace top``: the stats of event logs, or the logs a serving process writes, followed."""

from __future__ import annotations

import argparse
import contextlib
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from omnitrace.cli.follow import _follow, _followable, _sigterm_stops
from omnitrace.cli.output import _error, _print_json, _say, _stdout_console

__all__ = ["_cmd_top"]


def _top_json(board: Any, paths: Sequence[Path], requests: Any = None) -> dict[str, Any]:
    from omnitrace.ranks import totals, totals_json

    snapshot = board.snapshot()
    from omnitrace.misses import causes_json
    workers = [((e.rank, e.pid), e.stats) for e in snapshot.encoders]
    caps: dict[str, set[int | None]] = {}
    for e in snapshot.encoders:
        caps.setdefault(e.stats.adapter, set()).add(e.max_graphs)
    # A cap the workers do not agree on is unknown.
    cap = {name: next(iter(c)) if len(c) == 1 else None for name, c in caps.items()}
    return {
        "logs": [str(p) for p in paths],
        "events": snapshot.emitted,
        # Beside each encoder's summary, its misses by reason and detail (cpu, disabled,
        # paused, ...): what to change.
        "encoders": [
            {**_top_encoder_json(e), "miss_details": causes_json(e.causes)}
            for e in snapshot.encoders
        ],
        # Every worker's encoders summed (the view's total row, with several workers).
        "total": totals_json(totals(workers), cap),
        # Where each kind of request's TTFT goes (omnitrace.requests.phases_panel).
        "requests": _requests_panel(requests),
    }


def _requests_panel(requests: Any) -> dict[str, Any]:
    from omnitrace.requests import phases_panel

    return phases_panel([] if requests is None else requests.requests())


def _requests_table(panel: dict[str, Any]) -> Any:
    """The "where TTFT goes" table of ``top``: p50 of each phase per request kind."""
    from rich.table import Table

    from omnitrace.requests import PHASES

    table = Table(title=f"where TTFT goes · last {panel['window']} requests (p50, ms)")
    table.add_column("kind")
    table.add_column("n", justify="right")
    table.add_column("TTFT p50/p99", justify="right")
    for phase in PHASES:
        table.add_column(phase, justify="right")
    table.add_column("encoders share (means)", justify="right")
    for kind in panel["kinds"]:
        table.add_row(
            kind["kind"],
            str(kind["requests"]),
            f"{kind['ttft_p50_s'] * 1e3:.1f}/{kind['ttft_p99_s'] * 1e3:.1f}",
            *(f"{kind['phases'][p]['p50_s'] * 1e3:.1f}" for p in PHASES),
            f"{kind['encoder_share']:.0%} "
            f"(graphs save ≤ {kind['graphs_save_at_most_s'] * 1e3:.1f} ms)",
        )
    return table


def _top_encoder_json(encoder: Any) -> dict[str, Any]:
    """One worker's encoder in ``top --json``: the worker, then what every output of a run
    says of the encoder (``encoder_summary``: the ``graph_summary`` line's fields)."""
    from omnitrace.coverage_snapshot import encoder_summary

    info = {"max_graphs": encoder.max_graphs, "backend": encoder.backend}
    fields = encoder_summary(encoder.stats, encoder.coverage, info)
    return {"encoder": fields.pop("encoder"), "rank": encoder.rank, "pid": encoder.pid, **fields}


def _cmd_top(args: argparse.Namespace) -> int:
    names = ", ".join(str(p) for p in args.paths)
    if not args.follow:
        # No live view here: its terminal code (rich, loaded for the table) is not needed
        # for JSON.
        from omnitrace.events import REQUEST_EVENT_TYPES
        from omnitrace.logread import LogReadError, ReadProgress, read_logs, total_bytes
        from omnitrace.requests import RequestJoin
        from omnitrace.sinks.live_model import RecordBoard

        board = RecordBoard(title=f"omnitrace top · {names}")
        requests = RequestJoin()
        try:
            with ReadProgress(total_bytes(args.paths), enabled=not args.json) as progress:
                for _, chunk in read_logs(args.paths, progress=progress.advance):
                    board.add(chunk)
                    for record in chunk:
                        if type(record.item) in REQUEST_EVENT_TYPES:
                            requests.add(record.item, record.pid)
        except LogReadError as exc:
            return _error("top", str(exc), exc.status)
        if args.json:
            _print_json(_top_json(board, args.paths, requests))
        else:
            from omnitrace.sinks.live_layout import render

            console = _stdout_console()
            console.print(render(board.snapshot()))
            panel = _requests_panel(requests)
            if panel["kinds"]:
                console.print(_requests_table(panel))
        return 0
    if args.json:
        return _error("top", "--json prints one snapshot; it cannot be combined with --follow")
    refused = _followable("top", args.paths)
    if refused is not None:
        return refused
    from omnitrace.eventlog import EventLogError, EventLogFollower
    from omnitrace.logset import LogSet
    from omnitrace.sinks.live import LiveView, RecordBoard, render

    console = _stdout_console()
    tui = not args.no_tui and console.is_terminal
    board = RecordBoard(title=f"omnitrace top · following {names}")
    board.footer = ("q or Ctrl-C quits",) if tui else ()
    followers = [EventLogFollower(path) for path in args.paths]
    logset = LogSet(args.patterns)

    def poll() -> None:
        for path in logset.new_paths():  # a rank that started late matches the pattern now
            _say(f"following {path} too")
            followers.append(EventLogFollower(path))
        for follower in followers:
            board.add(follower.poll())

    stop = threading.Event()
    try:
        with (
            _sigterm_stops(stop),
            LiveView(board, console=console) if tui else contextlib.nullcontext(),
        ):
            _follow(poll, args.duration, stop, keys=tui)
            poll()
    except KeyboardInterrupt:
        pass  # Ctrl-C during the last read ends it too.
    except EventLogError as exc:
        return _error("top", str(exc))
    finally:
        for follower in followers:
            follower.close()
    if not tui:
        console.print(render(board.snapshot()))
    return 0
