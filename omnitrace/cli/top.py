"""``omnitrace top``: the stats of event logs, or the logs a serving process writes, followed."""

from __future__ import annotations

import argparse
import contextlib
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import omnitrace.cli.options as opt
from omnitrace.cli.follow import _follow, _followable, _signal_stops, _unmatched_patterns
from omnitrace.cli.output import _print_json, _say, _stdout_console, command_error

if TYPE_CHECKING:
    from omnitrace.eventlog import EventRecord

    #: What ``_record_filter`` returns: the filter of a chunk of records, the encoders and
    #: the ranks it has seen.
    _Selection = tuple[Callable[[Sequence[EventRecord]], list[EventRecord]], set[str], set[int]]

__all__ = ["add_top_parser", "_cmd_top"]


def _top_json(board: Any, paths: Sequence[Path], requests: Any = None) -> dict[str, Any]:
    from omnitrace.ranks import totals, totals_json

    snapshot = board.snapshot()
    workers = [((e.rank, e.pid), e.stats) for e in snapshot.encoders]
    caps: dict[str, set[int | None]] = {}
    for e in snapshot.encoders:
        caps.setdefault(e.stats.adapter, set()).add(e.max_graphs)
    # A cap the workers do not agree on is unknown.
    cap = {name: next(iter(c)) if len(c) == 1 else None for name, c in caps.items()}
    return {
        "logs": [str(p) for p in paths],
        "events": snapshot.emitted,
        # Each worker's encoders, with what every output says of them (their misses by
        # reason and detail, cpu, disabled, paused, ..., included: what to change).
        "encoders": [_top_encoder_json(e) for e in snapshot.encoders],
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
    from omnitrace.coverage import encoder_summary

    info = {"max_graphs": encoder.max_graphs, "backend": encoder.backend}
    fields = encoder_summary(encoder.stats, encoder.coverage, info)
    return {"encoder": fields.pop("encoder"), "rank": encoder.rank, "pid": encoder.pid, **fields}


def _record_filter(
    args: argparse.Namespace,
) -> _Selection | None:
    """Keep the records of the encoders (``--encoder``) and ranks (``--rank``) asked for,
    noting every encoder and rank seen; None when neither is asked for.

    Request events are kept whatever the filter: a request is no encoder's, and the TTFT
    table is of all of them.
    """
    encoders = set(args.encoder or ())
    ranks = set(args.rank or ())
    if not encoders and not ranks:
        return None
    from omnitrace.events import REQUEST_EVENT_TYPES

    seen_encoders: set[str] = set()
    seen_ranks: set[int] = set()

    def keep(records: Sequence[EventRecord]) -> list[EventRecord]:
        kept = []
        for record in records:
            item = record.item
            if type(item) in REQUEST_EVENT_TYPES:
                kept.append(record)
                continue
            seen_encoders.add(item.adapter)
            seen_ranks.add(record.rank)
            if (not ranks or record.rank in ranks) and (not encoders or item.adapter in encoders):
                kept.append(record)
        return kept

    return keep, seen_encoders, seen_ranks


def _unseen(args: argparse.Namespace, encoders: set[str], ranks: set[int]) -> int | None:
    """Refuse an ``--encoder`` or ``--rank`` no record of the logs has (exit status 2)."""
    for name in args.encoder or ():
        if name not in encoders:
            known = ", ".join(sorted(encoders)) or "none"
            return command_error("top", f"--encoder {name}: no such encoder in the logs ({known})")
    for rank in args.rank or ():
        if rank not in ranks:
            known = ", ".join(str(r) for r in sorted(ranks)) or "none"
            return command_error("top", f"--rank {rank}: no such rank in the logs (ranks: {known})")
    return None


def _cmd_top(args: argparse.Namespace) -> int:
    names = ", ".join(str(p) for p in args.paths)
    selected = _record_filter(args)
    if not args.follow:
        return _top_recorded(args, names, selected)
    return _top_followed(args, names, selected)


def _top_recorded(args: argparse.Namespace, names: str, selected: _Selection | None) -> int:
    """``top`` of recorded logs: read them at once, print one snapshot (or its JSON)."""
    if args.duration is not None:
        return command_error("top", "--duration needs --follow (a recorded log is read at once)")
    refused = _unmatched_patterns("top", args.paths)
    if refused is not None:
        return refused
    # No live view here: its terminal code (rich, loaded for the table) is not needed
    # for JSON, and omnitrace.sinks.live loads only the names asked of it.
    from omnitrace.eventlog.chunks import LogReadError, ReadProgress, read_logs, total_bytes
    from omnitrace.events import REQUEST_EVENT_TYPES
    from omnitrace.requests import RequestJoin
    from omnitrace.sinks.live import RecordBoard

    board = RecordBoard(title=f"omnitrace top · {names}")
    requests = RequestJoin()
    try:
        with ReadProgress(total_bytes(args.paths), enabled=not args.json) as progress:
            for _, chunk in read_logs(args.paths, progress=progress.advance):
                if selected is not None:
                    chunk = selected[0](chunk)
                board.add(chunk)
                for record in chunk:
                    if type(record.item) in REQUEST_EVENT_TYPES:
                        requests.add(record.item, record.pid)
    except LogReadError as exc:
        return command_error("top", str(exc), exc.status)
    if selected is not None:
        refused = _unseen(args, selected[1], selected[2])
        if refused is not None:
            return refused
    if args.json:
        _print_json(_top_json(board, args.paths, requests))
    else:
        from omnitrace.sinks.live import render

        console = _stdout_console()
        console.print(render(board.snapshot()))
        panel = _requests_panel(requests)
        if panel["kinds"]:
            console.print(_requests_table(panel))
    return 0


def _top_followed(args: argparse.Namespace, names: str, selected: _Selection | None) -> int:
    """``top --follow``: read the logs as they grow, in the live view on a terminal."""
    if args.json:
        return command_error(
            "top", "--json prints one snapshot; it cannot be combined with --follow"
        )
    refused = _followable("top", args.paths)
    if refused is not None:
        return refused
    from omnitrace.eventlog import EventLogError, EventLogFollower
    from omnitrace.eventlog.patterns import LogSet
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
            records = follower.poll()
            board.add(records if selected is None else selected[0](records))

    stop = threading.Event()
    try:
        with (
            _signal_stops(stop),
            LiveView(board, console=console) if tui else contextlib.nullcontext(),
        ):
            _follow(poll, args.duration, stop, keys=tui)
            poll()
    except KeyboardInterrupt:
        pass  # Ctrl-C during the last read ends it too.
    except EventLogError as exc:
        return command_error("top", str(exc))
    finally:
        for follower in followers:
            follower.close()
    if not tui:
        console.print(render(board.snapshot()))
    return 0


def add_top_parser(commands: Any) -> None:
    """Add ``top`` to the command line's subcommands."""
    top = opt.log_command(
        commands,
        "top",
        help="show the stats of event logs, or follow logs a serving process writes",
        description=(
            "Show per-encoder graph stats from JSONL event logs (several worker processes "
            "side by side). With --follow, keep reading as the writers append; q, Ctrl-C or "
            "SIGTERM quits."
        ),
    )
    top.add_argument("--follow", "-f", action="store_true", help="follow the logs as they grow")
    top.add_argument(
        "--duration",
        type=opt.positive_float,
        default=None,
        metavar="SECONDS",
        help="with --follow: stop after this many seconds (default: until q, Ctrl-C or SIGTERM)",
    )
    top.add_argument(
        "--encoder",
        action="append",
        default=None,
        metavar="NAME",
        help="show only this encoder (repeat for more; default: all)",
    )
    top.add_argument(
        "--rank",
        action="append",
        type=opt.int_range(0, (1 << 31) - 1, "a rank"),
        default=None,
        metavar="N",
        help="show only this worker rank's encoders (repeat for more; default: all)",
    )
    top.add_argument("--no-tui", action="store_true", help="print one final frame only")
    top.add_argument(
        "--json", action="store_true", help="print the stats as JSON instead (not with --follow)"
    )
    top.set_defaults(handler=_cmd_top)
