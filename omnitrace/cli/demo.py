"""``omnitrace demo``: MiniCPM-o-shaped encoders under graph adapters, with every sink."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

import omnitrace.cli.options as opt
from omnitrace.cli.export import (
    _endpoint_errors,
    _export_reported_by_the_cli,
    _exports_by_variable,
)
from omnitrace.cli.output import _say, _stdout_console, command_error
from omnitrace.cli.tables import stats_table
from omnitrace.config import ConfigError, EncoderGraphConfig

if TYPE_CHECKING:
    from rich.console import Console

    from omnitrace.demo.run import DemoResult

__all__ = ["add_demo_parser", "_cmd_demo"]


def _cmd_demo(args: argparse.Namespace) -> int:
    from dataclasses import fields

    from omnitrace.demo.run import DemoOptions, run_demo

    config = _checked_config(args)
    if not isinstance(config, EncoderGraphConfig):
        return config
    if args.ranks > 1:  # checked above once, rather than once by each rank
        from omnitrace.demo.ranks import run_command

        outcome = run_command(args, console=_stdout_console(), say=_say)
        return command_error("demo", outcome) if isinstance(outcome, str) else outcome
    console = _stdout_console()
    tui = not args.no_tui and console.is_terminal
    rate = args.rate if args.rate is not None else (60.0 if tui else None)
    # These fields are worked out above or named otherwise; each other one is an option's value.
    given = dict(config=config, duration_s=args.duration, tui=tui, rate=rate, force_cpu=args.cpu)
    options = DemoOptions(
        **{
            f.name: given[f.name] if f.name in given else getattr(args, f.name)
            for f in fields(DemoOptions)
        }
    )
    # Checked before the run, so a bad path or endpoint does not cost the run's results.
    _check_demo_outputs(args)
    if _exports_by_variable():
        refused = _endpoint_errors("demo")
        if refused is not None:
            return refused
    try:
        with _logging(args), _export_reported_by_the_cli():
            result = run_demo(options, console=console, say=_say)
    except OSError as exc:
        # A port in use, an unwritable log: one line naming it, not a traceback (nor
        # Python's "[Errno 22] ..." wording).
        from omnitrace._paths import describe_os_error

        return command_error("demo", describe_os_error(exc), status=1)
    return _report(args, result, console)


def _checked_config(args: argparse.Namespace) -> EncoderGraphConfig | int:
    """The graph settings of ``--hf-overrides``, once the options are checked; or the exit
    status of the one-line error said instead."""
    if args.hf_overrides is not None and not args.hf_overrides.strip():
        # Given but blank is most often an unset shell variable: running with the defaults
        # would hide that the settings meant for this run never arrived.
        return command_error(
            "demo",
            "--hf-overrides: expected a JSON object, e.g. "
            "'{\"encoder_cuda_graph_max_graphs\": 8}', got "
            f"{args.hf_overrides!r} (leave the option out for the defaults)",
        )
    try:
        config = EncoderGraphConfig.from_hf_overrides(
            args.hf_overrides,
            enforce_eager=args.enforce_eager,
            warn=lambda message: _say(f"warning: --hf-overrides: {message}"),
        )
    except ConfigError as exc:
        return command_error("demo", f"--hf-overrides: {exc}")
    if args.requests == 0 and args.duration is None:
        return command_error("demo", "--requests 0 (no limit) needs --duration")
    if args.hidden % args.heads:
        return command_error(
            "demo", f"--hidden ({args.hidden}) must be a multiple of --heads ({args.heads})"
        )
    return config


def _report(args: argparse.Namespace, result: DemoResult, console: Console) -> int:
    """Print what the demo did (and write ``--json-summary``); return the exit status."""
    if result.interrupted:
        _say(f"interrupted after {result.requests} requests")
    console.print(
        stats_table(result.encoders, max_graphs=result.max_graphs, compact=console.width < 120)
    )
    facts = (
        f"requests {result.requests} in {result.elapsed_s:.1f} s",
        f"streaming audio {result.streaming_eager_calls} eager calls (never graphed)",
        f"bus events {result.emitted}, dropped {result.dropped}",
    )
    # One line where it fits, else one fact a line (never a line wrapped mid-phrase).
    line = " · ".join(facts)
    console.print(line if len(line) <= console.width else "\n".join(facts))
    terminal = [name for name, s in result.encoders.items() if s["capture_failures"]]
    if terminal:
        console.print(
            f"[bold red]capture failed[/]: {', '.join(terminal)} is terminal; "
            f"{result.calls_after_failure} calls were served eagerly afterwards "
            "(a real worker must restart)"
        )
    _say(f"event log: {Path(result.events_log).resolve()}")
    if result.otlp_error is not None:
        # Exporting is a side output of the demo: said in one line, not a failed run.
        _say(result.otlp_error)
    if args.json_summary is not None:
        from omnitrace._paths import write_atomically

        text = json.dumps(result.to_json(), indent=2) + "\n"
        write_atomically(args.json_summary, text.encode(), "--json-summary")
        _say(f"summary: {args.json_summary.resolve()}")
    if result.interrupted:
        return 130
    return 1 if terminal else 0


def _check_demo_outputs(args: argparse.Namespace) -> None:
    """Refuse, before the run, an output path the demo could not use."""
    from omnitrace._paths import check_output
    from omnitrace._worker import worker_rank
    from omnitrace.sinks.jsonl import worker_log_path

    events_log = worker_log_path(
        args.events_log, pid=os.getpid(), rank=worker_rank(), label="--events-log"
    )
    check_output(events_log, "--events-log")
    if args.log_file is not None:
        check_output(args.log_file, "--log-file", append=True)
    if args.json_summary is not None:
        check_output(args.json_summary, "--json-summary")


@contextlib.contextmanager
def _logging(args: argparse.Namespace) -> Iterator[None]:
    """Configure structlog for the run; close the log file and restore defaults after."""
    import structlog

    from omnitrace._files import open_regular
    from omnitrace.sinks.logs import configure_logging

    stream: IO[str] | None = None
    if args.log_file is not None:
        args.log_file.parent.mkdir(parents=True, exist_ok=True)
        # Never through a link, never a device or a pipe: a ConfigError names what it is.
        stream = os.fdopen(open_regular(args.log_file, "--log-file"), "a", encoding="utf-8")
    try:
        configure_logging(level=args.log_level, json=True, stream=stream)
        yield
    finally:
        if stream is not None:
            # Later log calls in this process must not reach a closed file.
            structlog.reset_defaults()
            stream.close()


def add_demo_parser(commands: Any) -> None:
    """Add ``demo`` to the command line's subcommands."""
    demo = commands.add_parser(
        "demo",
        help="run MiniCPM-o-shaped encoders under graph adapters with live observability",
        description=(
            "Run MiniCPM-o-shaped vision and audio encoders under encoder graph adapters, on "
            "a seeded MiniCPM-o-like traffic mix, with the live view, the JSONL event log, "
            "JSON logs and (when OTEL_EXPORTER_OTLP_ENDPOINT is set) OTLP export."
        ),
        formatter_class=opt.HelpFormatter,
    )
    _traffic_options(demo)
    _graph_options(demo)
    _size_options(demo)
    _simulated_options(demo)
    _output_options(demo)
    # The ranks of `demo --ranks` run the demo with the options it was given.
    demo.set_defaults(demo_parser=demo, handler=_cmd_demo)


def _traffic_options(demo: argparse.ArgumentParser) -> None:
    """The traffic: how many requests, for how long, how fast, over how many ranks."""
    traffic = demo.add_argument_group("traffic")
    traffic.add_argument(
        "--requests",
        type=opt.count,
        default=400,
        metavar="N",
        help="encoder requests to send (0: no limit, stop with --duration)",
    )
    traffic.add_argument(
        "--duration",
        type=opt.positive_float,
        default=None,
        metavar="SECONDS",
        help="stop after this many seconds even if requests remain",
    )
    traffic.add_argument("--seed", type=opt.seed, default=0, help="traffic and weight seed")
    traffic.add_argument(
        "--ranks",
        type=opt.int_range(1, 16, "a number of ranks"),
        default=1,
        metavar="N",
        help=(
            "run N demo processes, one per rank as a tensor-parallel engine's workers (RANK "
            "set, seed plus rank, a CUDA device each or the simulated backend), each writing "
            "its own --events-log ({rank} added when the path names neither {rank} nor "
            "{pid}); the live view follows them all"
        ),
    )
    traffic.add_argument(
        "--rate",
        type=opt.positive_float,
        default=None,
        metavar="RPS",
        help="requests per second (default: 60 with the live view, unpaced without)",
    )


def _graph_options(demo: argparse.ArgumentParser) -> None:
    """The encoder graph settings, as vLLM takes them."""
    graphs = demo.add_argument_group("encoder graphs")
    graphs.add_argument(
        "--hf-overrides",
        default=None,
        metavar="JSON",
        help=(
            "encoder graph settings as vLLM takes them, "
            "e.g. '{\"encoder_cuda_graph_max_graphs\": 8}'"
        ),
    )
    graphs.add_argument(
        "--enforce-eager", action="store_true", help="disable encoder graphs (as vLLM's flag)"
    )
    graphs.add_argument(
        "--profiling-runs",
        type=opt.int_range(0, 100, "an integer"),
        default=0,
        metavar="N",
        help=(
            "start-up profiling runs before the traffic, as vLLM's: maximum-size dummy calls "
            "in the profiling phase (see encoder_cuda_graph_skip_profiling)"
        ),
    )


def _size_options(demo: argparse.ArgumentParser) -> None:
    """The demo encoders' sizes."""
    sizes = demo.add_argument_group("model sizes (defaults are tiny, for a CPU)")
    sizes.add_argument("--hidden", type=opt.model_size, default=64, help="hidden size")
    sizes.add_argument("--heads", type=opt.layers, default=4, help="attention heads")
    sizes.add_argument(
        "--vision-layers", type=opt.layers, default=2, metavar="N", help="vision layers"
    )
    sizes.add_argument(
        "--audio-layers", type=opt.layers, default=2, metavar="N", help="audio layers"
    )
    sizes.add_argument(
        "--cpu", action="store_true", help="run on the CPU (simulated graphs) even with CUDA"
    )


def _simulated_options(demo: argparse.ArgumentParser) -> None:
    """The simulated device of a CPU run."""
    sim = demo.add_argument_group(
        "simulated device (CPU only)",
        "on the CPU, graphs and device memory are simulated: a replay runs the forward again, "
        "and each capture takes its memory from a simulated free amount",
    )
    sim.add_argument(
        "--sim-free-mib",
        type=opt.mib,
        default=1624,
        metavar="MIB",
        help="simulated free device memory at start, MiB (so the 1 GiB floor bites late)",
    )
    sim.add_argument(
        "--sim-graph-mib",
        type=opt.mib,
        default=96,
        metavar="MIB",
        help="simulated memory each capture takes, MiB",
    )
    sim.add_argument(
        "--fail-capture",
        choices=("vision", "audio"),
        default=None,
        help="make this encoder's first capture fail, to see the failure path (exit status 1)",
    )


def _output_options(demo: argparse.ArgumentParser) -> None:
    """Where the run's outputs go."""
    out = demo.add_argument_group("outputs")
    out.add_argument("--no-tui", action="store_true", help="no live view (also off without a TTY)")
    out.add_argument(
        "--events-log",
        type=Path,
        default=Path("omnitrace-events.jsonl"),
        metavar="PATH",
        help="JSONL event log to write, replaced at each run",
    )
    out.add_argument(
        "--log-file",
        type=Path,
        default=None,
        metavar="PATH",
        help=(
            "append the JSON log lines here (default: stderr; with the live view, its last "
            "lines show in the view and all of them go to stderr when it closes)"
        ),
    )
    out.add_argument(
        "--log-level",
        default="info",
        choices=("debug", "info", "warning", "error"),
        help="lowest log level written (debug adds every replay and miss)",
    )
    out.add_argument(
        "--log-sample-every",
        type=opt.positive_int,
        default=1,
        metavar="N",
        help="log one in N replays and misses per encoder (debug level)",
    )
    out.add_argument(
        "--prometheus-port",
        type=opt.port,
        default=None,
        metavar="PORT",
        help="serve the metrics for a Prometheus scrape on 127.0.0.1:PORT (0: a free port)",
    )
    out.add_argument(
        "--json-summary",
        type=Path,
        default=None,
        metavar="PATH",
        help="also write the final stats as JSON",
    )
