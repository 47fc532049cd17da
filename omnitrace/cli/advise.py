"""``omnitrace advise``: recorded traffic replayed under other graph settings, and the best."""

from __future__ import annotations

import argparse
import json
from typing import TYPE_CHECKING, Any

import omnitrace.cli.options as opt
from omnitrace.cli.output import _print_json, _stdout_console, command_error
from omnitrace.config import MAX_GRAPHS_CAP

if TYPE_CHECKING:
    from rich.table import Table

__all__ = ["add_advise_parser", "_cmd_advise"]


def _advise_table(advice: Any, top: int) -> Table:
    """Return the table of the best ``top`` settings, and the logged one if it is not there."""
    from rich import box
    from rich.table import Table

    from omnitrace._display import safe_markup
    from omnitrace._units import format_bytes
    from omnitrace.advise import format_seconds

    recording = advice.recording
    table = Table(
        title="settings, best first",
        title_justify="left",
        box=box.SIMPLE_HEAD,
        padding=(0, 1, 0, 0),
    )
    for heading in ("#", "max_graphs", "min_calls", "floor"):
        table.add_column(heading, justify="right")
    budgets = any(r.setting.pool_budget_bytes for r in advice.results)
    if budgets:
        table.add_column("budget", justify="right")
    if recording.profiling:
        table.add_column("skip prof.")
    for heading in ("hit rate", "graphs", "pool"):
        table.add_column(heading, justify="right")
    free_known = bool(recording.free_bytes)
    if free_known:
        table.add_column("least free", justify="right")
    timed = advice.objective == "time"
    source = safe_markup("/".join(sorted(set(recording.time_source.values()))))
    table.add_column(f"saved ({source})" if timed else "hits", justify="right")
    table.add_column("")
    shown = list(advice.results[:top])
    if advice.logged is not None and advice.logged not in shown:
        shown.append(advice.logged)
    for result in shown:
        setting = result.setting
        rank = next((str(i + 1) for i, r in enumerate(advice.results) if r.setting == setting), "—")
        marks = []
        if advice.best is not None and setting == advice.best.setting:
            marks.append("[bold green]recommended[/]")
        if advice.logged is not None and setting == advice.logged.setting:
            marks.append("logged")
        if advice.memory_budget is not None and result.pool_bytes > advice.memory_budget:
            marks.append("[yellow]over budget[/]")
        if result.exhausts_memory:
            marks.append("[red]out of memory[/]")
        cells = [rank, str(setting.max_graphs), str(setting.min_capture_calls)]
        cells.append(format_bytes(setting.min_free_bytes))
        if budgets:
            budget = setting.pool_budget_bytes
            cells.append(format_bytes(budget) if budget else "none")
        if recording.profiling:
            cells.append("yes" if setting.skip_profiling else "no")
        pool = format_bytes(result.pool_bytes) + ("*" if result.estimated_sizes else "")
        cells += [f"{result.hit_rate * 100:.1f} %", str(result.graphs), pool]
        if free_known:
            cells.append(format_bytes(result.min_free_bytes))
        cells.append(format_seconds(result.saved_s) if timed else str(result.hits))
        cells.append(", ".join(marks))
        table.add_row(*cells)
    return table


def _outlook(recording: Any, advice: Any, join: Any) -> tuple[Any, ...]:
    """Each request kind's TTFT under the recommended setting (empty without requests)."""
    from omnitrace.advise import replay
    from omnitrace.advise.outlook import outlook

    views = join.requests()
    if advice.best is None or not views:
        return ()
    return outlook(views, recording, replay(recording, advice.best.setting).captured)


def _outlook_table(kinds: Any) -> Table:
    """End to end: per request kind, TTFT as logged and under the recommended setting."""
    from rich import box
    from rich.table import Table

    from omnitrace._display import safe_markup
    from omnitrace.advise import format_seconds

    table = Table(
        title="end to end: each request kind's TTFT, logged and predicted under the "
        "recommended setting",
        box=box.SIMPLE,
    )
    columns = ("kind", "requests", "TTFT p50", "p99", "encoders p50")
    for column in (*columns, "predicted p50", "predicted p99", "change p50", "calls changed"):
        table.add_column(column, justify="left" if column == "kind" else "right")
    for k in kinds:
        change = k.change_p50_s
        if change is None:
            text = "unknown"
        else:
            share = f" ({100 * change / k.ttft_p50_s:+.1f} %)" if k.ttft_p50_s > 0 else ""
            text = f"{change * 1e3:+.1f} ms{share}"
        table.add_row(
            safe_markup(k.kind),
            str(k.requests),
            format_seconds(k.ttft_p50_s),
            format_seconds(k.ttft_p99_s),
            format_seconds(k.encoders_p50_s),
            format_seconds(k.predicted_p50_s),
            format_seconds(k.predicted_p99_s),
            text,
            f"{k.changed}/{k.calls}",
        )
    return table


def _cmd_advise(args: argparse.Namespace) -> int:
    from omnitrace.advise import Recording, advice_json, advise, default_grid
    from omnitrace.eventlog.chunks import LogReadError, ReadProgress, read_logs, total_bytes
    from omnitrace.requests import RequestJoin

    # The request events, joined with their encoder steps' calls in the same pass.
    join = RequestJoin(calls=True)

    def records(chunks: Any) -> Any:
        add = join.add
        for _, chunk in chunks:
            for record in chunk:
                add(record.item, record.pid)
                yield record

    with ReadProgress(total_bytes(args.paths), enabled=not args.json) as progress:
        chunks = read_logs(args.paths, progress=progress.advance)
        try:
            recording = Recording.from_records(records(chunks), free_bytes=args.free_bytes)
        except LogReadError as exc:
            return command_error("advise", str(exc), exc.status)
        if not recording.costs:
            names = ", ".join(str(p) for p in args.paths)
            # Why not (cpu, disabled, ...), with counts: what to change before advising.
            why = recording.why_ineligible()
            reason = f": every call was ineligible ({why})" if why else ""
            return command_error(
                "advise", f"{names}: no encoder call could use a graph{reason}", status=1
            )
        grid = default_grid(
            recording,
            max_graphs=args.max_graphs,
            min_capture_calls=args.min_capture_calls,
            min_free_bytes=args.min_free_bytes,
            pool_budget_bytes=args.pool_budget,
        )
        step = progress.phase("replaying settings", len(grid))
        advice = advise(recording, grid, memory_budget=args.memory_budget, progress=step)
    from omnitrace.advise.spread import per_worker, spread_json, spread_line, spread_table

    # The one setting for every rank, replayed rank by rank: how far apart they are.
    spread = None if advice.best is None else per_worker(recording, advice.best.setting)
    kinds = _outlook(recording, advice, join)
    if args.json:
        from omnitrace.advise.outlook import outlook_json

        by_worker = None if spread is None else spread_json(spread)
        _print_json(
            {**advice_json(advice), "per_worker": by_worker, "requests": outlook_json(kinds)}
        )
        return 0 if advice.best is not None else 1
    if advice.best is None:
        # Nothing to recommend: one line saying why and what to change, not a table of
        # settings none of which can be used.
        return command_error("advise", f"no recommendation: {advice.why()}", status=1)
    from omnitrace._display import safe_markup

    console = _stdout_console()
    workers = recording.workers
    # Adapter names and the notes quoting them come from the logs: escaped, never markup.
    adapters = safe_markup(", ".join(recording.adapters))
    console.print(
        f"replayed {recording.call_count} encoder calls of {workers} worker"
        f"{'s' if workers > 1 else ''} ({adapters}) under {len(grid)} settings"
    )
    for note in advice.notes:
        console.print(f"  · {safe_markup(note)}", soft_wrap=True)
    console.print(_advise_table(advice, args.top))
    if any(r.estimated_sizes for r in advice.results[: args.top]):
        console.print("  * pool memory includes estimated capture sizes")
    if spread is not None and len(spread) > 1:
        console.print(spread_table(spread, timed=advice.objective == "time"))
        console.print(f"  {spread_line(spread)}")
    if kinds:
        console.print(_outlook_table(kinds))
    console.print("recommended:")
    overrides = safe_markup(json.dumps(advice.overrides))
    console.print(f"  --hf-overrides '{overrides}'", soft_wrap=True)
    console.print(f"why: {safe_markup(advice.why())}", soft_wrap=True)
    return 0


def add_advise_parser(commands: Any) -> None:
    """Add ``advise`` to the command line's subcommands."""
    advise = opt.log_command(
        commands,
        "advise",
        help="replay event logs under other graph settings and recommend the best",
        description=(
            "Replay the encoder calls of recorded JSONL logs (several workers' logs at once) "
            "through the adapter's admission policy for a grid of max_graphs, "
            "min_capture_calls, memory floors and pool budgets; report per setting the hit "
            "rate, graphs, pool memory and estimated time saved, then the recommended "
            "--hf-overrides JSON and why."
        ),
    )
    advise.add_argument(
        "--max-graphs",
        type=opt.int_list(0, MAX_GRAPHS_CAP),
        default=None,
        metavar="N,N,...",
        help="max_graphs values to try (default: 0 to 64 up to the keys seen, and the logged one)",
    )
    advise.add_argument(
        "--min-capture-calls",
        type=opt.int_list(2, 1_000_000),
        default=None,
        metavar="N,N,...",
        help="min_capture_calls values to try (default: 2, 3, 4, 6, 8 and the logged one)",
    )
    advise.add_argument(
        "--min-free-bytes",
        type=opt.size_list,
        default=None,
        metavar="SIZE,...",
        help=(
            "memory floors to try, e.g. 0,512MiB,1GiB (default: the logged one, and a range "
            "when device-free memory is known)"
        ),
    )
    advise.add_argument(
        "--pool-budget",
        type=opt.size_list,
        default=None,
        metavar="SIZE,...",
        help=(
            "pool_budget_bytes values to try, per encoder, e.g. 0,256MiB,1GiB (0: no budget; "
            "default: the logged one); with a budget, raise --max-graphs's values too, the "
            "budget then decides how many shapes fit"
        ),
    )
    advise.add_argument(
        "--free-bytes",
        type=opt.size,
        default=None,
        metavar="SIZE",
        help="device-free memory at each worker's start (default: estimated from deferrals)",
    )
    advise.add_argument(
        "--memory-budget",
        type=opt.size,
        default=None,
        metavar="SIZE",
        help="most pool memory the graphs of one worker may hold, e.g. 2GiB",
    )
    advise.add_argument(
        "--top", type=opt.positive_int, default=10, metavar="N", help="settings to list"
    )
    advise.add_argument("--json", action="store_true", help="print the advice as JSON")
    advise.set_defaults(handler=_cmd_advise)
