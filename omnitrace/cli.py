"""The ``omnitrace`` command: ``demo``, ``top``, ``replay``, ``advise`` and ``receive``.

``omnitrace demo`` runs MiniCPM-o-shaped encoders under graph adapters with every sink
attached; ``omnitrace top`` shows (or follows) the event log a serving process writes;
``omnitrace replay`` feeds a recorded log into the live view or into OTLP; ``omnitrace
advise`` replays recorded traffic under other graph settings and recommends one;
``omnitrace receive`` listens for OTLP exports and says what arrives.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import math
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, TypeVar

from omnitrace._version import __version__
from omnitrace.config import MAX_GRAPHS_CAP, ConfigError, EncoderGraphConfig, OmnitraceError

# Only what --help, --version and argument errors need is imported up front: rich, the
# sinks and torch load inside the commands that use them, so the CLI answers at once.
if TYPE_CHECKING:
    from rich.console import Console
    from rich.table import Table

    from omnitrace.eventlog import EventRecord
    from omnitrace.events import Event

__all__ = ["main", "stats_table"]

PROG = "omnitrace"

#: Seconds between two reads of a followed log (``top --follow``, ``replay --follow``).
FOLLOW_POLL_S = 0.1


class _HelpFormatter(argparse.HelpFormatter):
    """Append each option's default to its help, unless the help already says it."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        default = action.default
        if (
            default is None
            or default is False
            or default is argparse.SUPPRESS
            or "(default" in text
            or not action.option_strings
        ):
            return text
        return f"{text} (default: %(default)s)"


class _UsageError(Exception):
    """A bad option value found after parsing: printed as one line, exit code 2."""


_N = TypeVar("_N", int, float)


def _bounded(
    convert: Callable[[str], _N], label: str, accept: Callable[[_N], bool]
) -> Callable[[str], _N]:
    """Return an argparse type that converts with ``convert`` and checks ``accept``."""

    def parse(text: str) -> _N:
        shown = repr(text) if len(text) <= 40 else f"{text[:20]!r}... ({len(text)} characters)"
        try:
            value = convert(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {label}, got {shown}") from None
        if not accept(value):
            raise argparse.ArgumentTypeError(f"expected {label}, got {shown}")
        return value

    return parse


def _int_range(low: int, high: int, label: str) -> Callable[[str], int]:
    return _bounded(int, f"{label} from {low} to {high}", lambda v: low <= v <= high)


_positive_int = _bounded(int, "a positive integer", lambda v: v >= 1)
_positive_float = _bounded(float, "a positive number", lambda v: v > 0)
_nonnegative_float = _bounded(float, "a nonnegative number", lambda v: v >= 0)
_port = _bounded(int, "a port in [0, 65535]", lambda v: 0 <= v <= 65535)
# Bounds say what the numbers mean: counts within what a run can reach, model sizes a CPU
# can hold, simulated MiB whose byte count fits the int64 of exported metrics.
_count = _int_range(0, 10**12, "an integer")
_model_size = _int_range(1, 16384, "an integer")
_layers = _int_range(1, 256, "an integer")
_mib = _int_range(0, (1 << 43) - 1, "a number of MiB")
_seed = _int_range(0, (1 << 63) - 1, "an integer")


def _int_list(low: int, high: int) -> Callable[[str], list[int]]:
    """Return an argparse type for comma-separated integers from ``low`` to ``high``."""
    one = _int_range(low, high, "integers")

    def parse(text: str) -> list[int]:
        return [one(part.strip()) for part in text.split(",")]

    return parse


def _size(text: str) -> int:
    from omnitrace.advise import parse_size

    try:
        return parse_size(text)
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _size_list(text: str) -> list[int]:
    return [_size(part) for part in text.split(",")]


def _log_command(
    commands: argparse._SubParsersAction[argparse.ArgumentParser],
    name: str,
    *,
    help: str,
    description: str,
) -> argparse.ArgumentParser:
    """Add a command that reads JSONL event logs, given as its positional arguments."""
    command = commands.add_parser(
        name, help=help, description=description, formatter_class=_HelpFormatter
    )
    command.add_argument("paths", nargs="+", type=Path, metavar="EVENTS.jsonl")
    return command


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG,
        description="Observable exact-shape CUDA graphs for multimodal encoders.",
        formatter_class=_HelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    demo = commands.add_parser(
        "demo",
        help="run MiniCPM-o-shaped encoders under graph adapters with live observability",
        description=(
            "Run MiniCPM-o-shaped vision and audio encoders under encoder graph adapters, on "
            "a seeded MiniCPM-o-like traffic mix, with the live view, the JSONL event log, "
            "JSON logs and (when OTEL_EXPORTER_OTLP_ENDPOINT is set) OTLP export."
        ),
        formatter_class=_HelpFormatter,
    )
    traffic = demo.add_argument_group("traffic")
    traffic.add_argument(
        "--requests",
        type=_count,
        default=400,
        metavar="N",
        help="encoder requests to send (0: no limit, stop with --duration)",
    )
    traffic.add_argument(
        "--duration",
        type=_positive_float,
        default=None,
        metavar="SECONDS",
        help="stop after this many seconds even if requests remain",
    )
    traffic.add_argument("--seed", type=_seed, default=0, help="traffic and weight seed")
    traffic.add_argument(
        "--ranks",
        type=_int_range(1, 16, "a number of ranks"),
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
        type=_positive_float,
        default=None,
        metavar="RPS",
        help="requests per second (default: 60 with the live view, unpaced without)",
    )
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
        type=_int_range(0, 100, "an integer"),
        default=0,
        metavar="N",
        help=(
            "start-up profiling runs before the traffic, as vLLM's: maximum-size dummy calls "
            "in the profiling phase (see encoder_cuda_graph_skip_profiling)"
        ),
    )
    sizes = demo.add_argument_group("model sizes (defaults are tiny, for a CPU)")
    sizes.add_argument("--hidden", type=_model_size, default=64, help="hidden size")
    sizes.add_argument("--heads", type=_layers, default=4, help="attention heads")
    sizes.add_argument(
        "--vision-layers", type=_layers, default=2, metavar="N", help="vision layers"
    )
    sizes.add_argument("--audio-layers", type=_layers, default=2, metavar="N", help="audio layers")
    sizes.add_argument(
        "--cpu", action="store_true", help="run on the CPU (simulated graphs) even with CUDA"
    )
    sim = demo.add_argument_group(
        "simulated device (CPU only)",
        "on the CPU, graphs and device memory are simulated: a replay runs the forward again, "
        "and each capture takes its memory from a simulated free amount",
    )
    sim.add_argument(
        "--sim-free-mib",
        type=_mib,
        default=1624,
        metavar="MIB",
        help="simulated free device memory at start, MiB (so the 1 GiB floor bites late)",
    )
    sim.add_argument(
        "--sim-graph-mib",
        type=_mib,
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
        type=_positive_int,
        default=1,
        metavar="N",
        help="log one in N replays and misses per encoder (debug level)",
    )
    out.add_argument(
        "--prometheus-port",
        type=_port,
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

    # The ranks of `demo --ranks` run the demo with the options it was given.
    demo.set_defaults(demo_parser=demo)

    top = _log_command(
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
        type=_positive_float,
        default=None,
        metavar="SECONDS",
        help="with --follow: stop after this many seconds (default: until q, Ctrl-C or SIGTERM)",
    )
    top.add_argument("--no-tui", action="store_true", help="print one final frame only")
    top.add_argument(
        "--json", action="store_true", help="print the stats as JSON instead (not with --follow)"
    )

    replay = _log_command(
        commands,
        "replay",
        help="replay event logs into the live view, OTLP or Prometheus (--follow: live)",
        description=(
            "Feed the events of recorded JSONL logs (several workers' logs are merged in "
            "time order) through a fresh bus, into the live view (--tui) and/or OTLP "
            "(--otlp-endpoint, or OTEL_EXPORTER_OTLP_ENDPOINT). With --follow, keep relaying "
            "what the serving processes append, until q, Ctrl-C or SIGTERM: the exporter "
            "then runs beside the server instead of inside it, and can also serve "
            "Prometheus (--prometheus-port). A failed export, or an event that did not "
            "reach a sink, makes the exit status 1."
        ),
    )
    replay.add_argument(
        "--otlp-endpoint",
        default=None,
        metavar="URL",
        help="OTLP base endpoint (default: OTEL_EXPORTER_OTLP_ENDPOINT; unset: no export)",
    )
    replay.add_argument("--tui", action="store_true", help="show the live view while replaying")
    replay.add_argument(
        "--speed",
        type=_nonnegative_float,
        default=None,
        metavar="X",
        help="replay at X times the recorded pace (0: at once; default: 1 with --tui, else 0)",
    )
    replay.add_argument(
        "--json", action="store_true", help="print the replayed stats as JSON instead of a table"
    )
    replay.add_argument(
        "--follow",
        "-f",
        action="store_true",
        help="keep relaying the logs as their writers append to them",
    )
    replay.add_argument(
        "--duration",
        type=_positive_float,
        default=None,
        metavar="SECONDS",
        help="with --follow: stop after this many seconds (default: until q, Ctrl-C or SIGTERM)",
    )
    replay.add_argument(
        "--otlp",
        action="store_true",
        help="export over OTLP where OpenTelemetry's variables say (per-signal endpoints "
        "too), else to the protocol's localhost port, without naming an endpoint",
    )
    replay.add_argument(
        "--from-offset",
        type=_int_range(0, 2**62, "a byte offset"),
        default=None,
        metavar="BYTES",
        help="with --follow and one log: join it at this byte (a server that starts the "
        "follow passes its log's size, so an earlier run's lines are not exported again)",
    )
    replay.add_argument(
        "--until-exit",
        type=_int_range(1, 2**31 - 1, "a process id"),
        default=None,
        metavar="PID",
        help="with --follow: stop, and export what is left, once process PID has exited",
    )
    replay.add_argument(
        "--until-stdin-closes",
        action="store_true",
        help="with --follow: stop, and export what is left, once standard input closes (for "
        "a parent that runs the follow as its child: its exit closes the pipe)",
    )
    replay.add_argument(
        "--prometheus-port",
        type=_int_range(0, 65535, "a port"),
        default=None,
        metavar="PORT",
        help="with --follow: serve /metrics for Prometheus on this port (0: a free one)",
    )
    replay.add_argument(
        "--prometheus-host",
        default="127.0.0.1",
        metavar="ADDRESS",
        help="the address the /metrics endpoint binds",
    )
    advise = _log_command(
        commands,
        "advise",
        help="replay event logs under other graph settings and recommend the best",
        description=(
            "Replay the encoder calls of recorded JSONL logs (several workers' logs at once) "
            "through the adapter's admission policy for a grid of max_graphs, "
            "min_capture_calls and memory floors; report per setting the hit rate, graphs, "
            "pool memory and estimated time saved, then the recommended --hf-overrides JSON "
            "and why."
        ),
    )
    advise.add_argument(
        "--max-graphs",
        type=_int_list(0, MAX_GRAPHS_CAP),
        default=None,
        metavar="N,N,...",
        help="max_graphs values to try (default: 0 to 64 up to the keys seen, and the logged one)",
    )
    advise.add_argument(
        "--min-capture-calls",
        type=_int_list(2, 1_000_000),
        default=None,
        metavar="N,N,...",
        help="min_capture_calls values to try (default: 2, 3, 4, 6, 8 and the logged one)",
    )
    advise.add_argument(
        "--min-free-bytes",
        type=_size_list,
        default=None,
        metavar="SIZE,...",
        help=(
            "memory floors to try, e.g. 0,512MiB,1GiB (default: the logged one, and a range "
            "when device-free memory is known)"
        ),
    )
    advise.add_argument(
        "--free-bytes",
        type=_size,
        default=None,
        metavar="SIZE",
        help="device-free memory at each worker's start (default: estimated from deferrals)",
    )
    advise.add_argument(
        "--memory-budget",
        type=_size,
        default=None,
        metavar="SIZE",
        help="most pool memory the graphs of one worker may hold, e.g. 2GiB",
    )
    advise.add_argument(
        "--top", type=_positive_int, default=10, metavar="N", help="settings to list"
    )
    advise.add_argument("--json", action="store_true", help="print the advice as JSON")

    receive = commands.add_parser(
        "receive",
        help="listen for OTLP exports on loopback and print what arrives (no collector needed)",
        description=(
            "Listen for OTLP exports (spans, metrics, logs) and print one line per export "
            "request: the signal, the sending service, how many spans, metrics or log "
            "records and their names. Point an exporter here to check its settings without "
            "a collector. Ctrl-C, SIGTERM or --duration stops it with a summary; the exit "
            "status is 1 when nothing arrived."
        ),
        formatter_class=_HelpFormatter,
    )
    receive.add_argument(
        "--protocol",
        choices=("http/protobuf", "grpc"),
        default="http/protobuf",
        help="the OTLP protocol to accept (grpc needs the grpc extra)",
    )
    receive.add_argument(
        "--host",
        default="127.0.0.1",
        metavar="ADDRESS",
        help="the address to listen on (keep loopback unless the exporter is elsewhere)",
    )
    receive.add_argument(
        "--port",
        type=_port,
        default=None,
        metavar="PORT",
        help="the port to listen on (default: 4318 for http/protobuf, 4317 for grpc, the "
        "exporters' defaults; 0: a free one, printed)",
    )
    receive.add_argument(
        "--duration",
        type=_positive_float,
        default=None,
        metavar="SECONDS",
        help="stop after this many seconds (default: until Ctrl-C or SIGTERM)",
    )
    receive.add_argument(
        "--json", action="store_true", help="print a JSON line per request, and the summary"
    )
    return parser


# -- output helpers -------------------------------------------------------------------------


def _columns() -> tuple[tuple[str, str], ...]:
    """(wide, compact) headings of the stats table: one miss column per MissReason."""
    from omnitrace.events import MissReason

    return (
        ("encoder", "encoder"),
        ("calls", "calls"),
        ("hits", "hits"),
        ("hit rate", "rate"),
        *((reason.value, reason.short) for reason in MissReason.display_order()),
        ("graphs", "graphs"),
        ("capture failures", "fail"),
        ("state", "state"),
    )


def stats_table(
    encoders: Mapping[str, Mapping[str, int | float]],
    *,
    max_graphs: Mapping[str, int] | None = None,
    title: str = "encoder graph stats",
    compact: bool = False,
) -> Table:
    """Return the final stats table: one row per encoder (calls, hits, misses by reason...).

    ``compact`` uses short headers and no vertical rules, to fit an 80-column terminal.
    """
    from rich import box
    from rich.table import Table
    from rich.text import Text

    from omnitrace._display import safe

    table = Table(
        title=title,
        title_justify="left",
        box=box.SIMPLE_HEAD if compact else box.HEAVY_HEAD,
        show_edge=not compact,
        pad_edge=not compact,
        # Compact: one space of padding plus the rule's blank column between cells.
        padding=(0, 1, 0, 0) if compact else (0, 1),
    )
    from omnitrace.events import MissReason

    columns = _columns()
    for index, (wide, short) in enumerate(columns):
        table.add_column(
            short if compact else wide,
            justify="left" if index in (0, len(columns) - 1) else "right",
        )
    for name, stats in encoders.items():
        calls = int(stats["graph_hits"] + stats["graph_misses"])
        cap = (max_graphs or {}).get(name)
        failures = int(stats["capture_failures"])
        table.add_row(
            # Text: a str cell is parsed as rich markup, and the name comes from a log.
            Text(safe(name)),
            str(calls),
            str(stats["graph_hits"]),
            f"{stats['hit_rate'] * 100:.1f} %",
            *(str(stats[reason.stats_key]) for reason in MissReason.display_order()),
            f"{stats['num_graphs']}/{cap}" if cap is not None else str(stats["num_graphs"]),
            f"[bold red]{failures}[/]" if failures else "0",
            # A capture failure is fatal for the adapter: it never captures again.
            "[bold red]terminal[/]" if failures else "ok",
        )
    return table


def _stdout_console() -> Console:
    from rich.console import Console

    console = Console(file=sys.stdout, highlight=False)
    if not console.is_terminal:
        # Piped or captured output has no width; 80 columns would squash the stats table.
        console = Console(file=sys.stdout, highlight=False, width=140)
    return console


def _say(message: str) -> None:
    from omnitrace._display import safe

    # Status lines go to stderr, so stdout carries only the results. They quote paths and
    # log text: control characters are shown escaped, never sent to the terminal.
    print(f"{PROG}: {safe(message)}", file=sys.stderr, flush=True)


def _error(command: str, message: str, status: int = 2) -> int:
    from omnitrace._display import safe

    print(f"{PROG} {command}: error: {safe(message)}", file=sys.stderr, flush=True)
    return status


def _print_json(data: Any) -> None:
    # JSON has no NaN or Infinity (json.dumps would print them anyway): they print as null.
    print(json.dumps(_finite(data), indent=2, allow_nan=False))


def _finite(data: Any) -> Any:
    """``data`` with every NaN and infinite float replaced by None."""
    if isinstance(data, float):
        return data if math.isfinite(data) else None
    if isinstance(data, dict):
        return {key: _finite(value) for key, value in data.items()}
    if isinstance(data, (list, tuple)):
        return [_finite(value) for value in data]
    return data


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


@contextlib.contextmanager
def _export_reported_by_the_cli() -> Iterator[None]:
    """Keep the OTel SDK wiring's outage warning quiet: the command reports the export itself."""
    otel_logger = logging.getLogger("omnitrace.sinks.otel_sdk")
    saved = otel_logger.propagate
    quiet = logging.NullHandler()
    otel_logger.addHandler(quiet)
    otel_logger.propagate = False
    try:
        yield
    finally:
        otel_logger.removeHandler(quiet)
        otel_logger.propagate = saved


def _encoder_json(stats: Mapping[str, Any], max_graphs: int | None) -> dict[str, Any]:
    calls = int(stats["graph_hits"] + stats["graph_misses"])
    return {**stats, "calls": calls, "max_graphs": max_graphs}


# -- demo -----------------------------------------------------------------------------------


def _cmd_demo(args: argparse.Namespace) -> int:
    from dataclasses import fields

    from omnitrace.demo.run import DemoOptions, run_demo

    if args.hf_overrides is not None and not args.hf_overrides.strip():
        # Given but blank is most often an unset shell variable: running with the defaults
        # would hide that the settings meant for this run never arrived.
        return _error(
            "demo",
            "--hf-overrides: expected a JSON object, e.g. "
            "'{\"encoder_cuda_graph_max_graphs\": 8}', got "
            f"{args.hf_overrides!r} (leave the option out for the defaults)",
        )
    try:
        config = EncoderGraphConfig.from_hf_overrides(
            args.hf_overrides, enforce_eager=args.enforce_eager
        )
    except ConfigError as exc:
        return _error("demo", f"--hf-overrides: {exc}")
    if args.requests == 0 and args.duration is None:
        return _error("demo", "--requests 0 (no limit) needs --duration")
    if args.hidden % args.heads:
        return _error(
            "demo", f"--hidden ({args.hidden}) must be a multiple of --heads ({args.heads})"
        )
    if args.ranks > 1:  # checked above once, rather than once by each rank
        from omnitrace.demo.ranks import run_command

        outcome = run_command(args, console=_stdout_console(), say=_say)
        return _error("demo", outcome) if isinstance(outcome, str) else outcome
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
    try:
        with _logging(args), _export_reported_by_the_cli():
            result = run_demo(options, console=console, say=_say)
    except OSError as exc:
        # A port in use, an unwritable log: one line naming it, not a traceback.
        return _error("demo", str(exc), status=1)
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
    """Refuse, before the run, an output path or OTLP endpoint the demo could not use."""
    from omnitrace._env import env_endpoints
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
    if _exports_by_variable():
        env_endpoints(os.environ)


def _exports_by_variable() -> bool:
    """Whether OTEL_EXPORTER_OTLP_ENDPOINT turns the OTLP export on (demo, replay)."""
    return bool(os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT", "").strip())


# -- top ------------------------------------------------------------------------------------


def _keys_off(seconds: float) -> str:
    time.sleep(seconds)
    return ""


@contextlib.contextmanager
def _keys() -> Iterator[Callable[[float], str]]:
    """Yield ``wait(seconds)``, which returns the keys typed meanwhile ("" without a TTY)."""
    try:
        import select
        import termios
        import tty
    except ImportError:  # not a POSIX terminal: Ctrl-C only
        posix = False
    else:
        posix = True
    if not posix or not sys.stdin.isatty():
        yield _keys_off
        return
    fd = sys.stdin.fileno()
    saved = termios.tcgetattr(fd)
    # Keys arrive one at a time and unechoed; Ctrl-C still raises KeyboardInterrupt.
    tty.setcbreak(fd)

    def wait(seconds: float) -> str:
        ready, _, _ = select.select([fd], [], [], seconds)
        return os.read(fd, 64).decode(errors="replace") if ready else ""

    try:
        yield wait
    finally:
        termios.tcsetattr(fd, termios.TCSADRAIN, saved)


def _top_json(board: Any, paths: Sequence[Path]) -> dict[str, Any]:
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
        "encoders": [_top_encoder_json(e) for e in snapshot.encoders],
        # Every worker's encoders summed (the view's total row, with several workers).
        "total": totals_json(totals(workers), cap),
    }


def _top_encoder_json(encoder: Any) -> dict[str, Any]:
    """One worker's encoder in ``top --json``: what its panel in the view shows."""
    stats, coverage = encoder.stats, encoder.coverage
    entry = {
        "encoder": stats.adapter,
        "rank": encoder.rank,
        "pid": encoder.pid,
        "backend": encoder.backend,
        **_encoder_json(stats.as_dict(), encoder.max_graphs),
        # What the first graph had to fit in (None: not read, or no graph yet).
        "first_capture_free_bytes": stats.graphs[0].free_bytes if stats.graphs else None,
        **(coverage.summary() if coverage is not None else {}),
    }
    if encoder.backend == "simulated" and "lost_s" in entry:
        # A simulated replay runs the forward again, so no time is lost to a miss: the view
        # says "lost n/a (simulated)", and the JSON says null.
        entry["lost_s"] = None
    return entry


def _followable(command: str, paths: Sequence[Path]) -> int | None:
    """Refuse what is not a regular file (return the exit status); say which logs are
    waited for."""
    import stat

    from omnitrace._files import kind_of
    from omnitrace._paths import check_readable

    for path in paths:
        try:
            mode = os.stat(path).st_mode
        except FileNotFoundError:
            if any(char in path.name for char in "*?["):
                # A shell passes a pattern that matches no file as it is: waiting for a file
                # literally named with a '*' would wait forever.
                return _error(
                    command,
                    f"{path}: no file matches this pattern (a pattern that matches nothing "
                    "reaches omnitrace unexpanded; name the log, which may not exist yet)",
                )
            _say(f"waiting for {path} to appear")
            continue
        if not stat.S_ISREG(mode):
            # A named pipe would block the follow in open(), past q, Ctrl-C and SIGTERM.
            return _error(command, f"{path}: is {kind_of(mode)}, not an event log")
        check_readable(path)
    return None


def _cmd_top(args: argparse.Namespace) -> int:
    from omnitrace.eventlog import EventLogError, EventLogFollower
    from omnitrace.logset import LogSet
    from omnitrace.sinks.live import LiveView, RecordBoard, render

    names = ", ".join(str(p) for p in args.paths)
    if not args.follow:
        from omnitrace.logread import LogReadError, ReadProgress, read_logs, total_bytes

        board = RecordBoard(title=f"omnitrace top · {names}")
        try:
            with ReadProgress(total_bytes(args.paths), enabled=not args.json) as progress:
                for _, chunk in read_logs(args.paths, progress=progress.advance):
                    board.add(chunk)
        except LogReadError as exc:
            return _error("top", str(exc), exc.status)
        if args.json:
            _print_json(_top_json(board, args.paths))
        else:
            _stdout_console().print(render(board.snapshot()))
        return 0
    if args.json:
        return _error("top", "--json prints one snapshot; it cannot be combined with --follow")
    refused = _followable("top", args.paths)
    if refused is not None:
        return refused

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


# -- replay ---------------------------------------------------------------------------------


def _cmd_replay(args: argparse.Namespace) -> int:
    # Endpoints are checked before any log is read.
    if args.otlp_endpoint is not None:
        from omnitrace._validate import check_endpoint

        args.otlp_endpoint = check_endpoint("--otlp-endpoint", args.otlp_endpoint)
    elif args.otlp or _exports_by_variable():
        from omnitrace._env import env_endpoints

        env_endpoints(os.environ)
    if args.follow:
        if args.speed is not None:
            return _error("replay", "--speed paces a recorded log; --follow relays as written")
        refused = _followable("replay", args.paths) or _stoppable(args)
        return _replay(args, None) if refused is None else refused
    for option in (
        "prometheus_port",
        "duration",
        "until_exit",
        "until_stdin_closes",
        "from_offset",
    ):
        value = getattr(args, option)
        if value is not None and value is not False:
            flag = "--" + option.replace("_", "-")
            return _error("replay", f"{flag} needs --follow (a recorded log replays at once)")
    from omnitrace.eventlog import log_gap
    from omnitrace.logread import LogReadError, read_logs, writers

    for path in args.paths:
        if not path.exists():
            return _error("replay", f"no event log at {path}")
    # Whether several workers wrote the logs decides the adapters' names before the first
    # event: a quick pass finds the writers (and the adapter facts, registered first).
    sources, infos = writers(args.paths)
    if not sources:
        try:  # nothing reads as a record: reading says why (a bad line, or no events)
            for _ in read_logs(args.paths):
                pass
        except LogReadError as exc:
            return _error("replay", str(exc), exc.status)
    for path in args.paths:
        gap = log_gap(path)
        if gap is not None:
            _say(
                f"warning: the start of {path} is missing: {gap.events_before} earlier events "
                f"are not in the log ({gap.events_deleted} deleted by rotation); the replayed "
                "stats do not include them"
            )
    return _replay(args, _Recorded(infos, sources))


def _stoppable(args: argparse.Namespace) -> int | None:
    """Refuse a follow that would stop at once for no reason (exit status 2)."""
    if args.from_offset is not None and len(args.paths) != 1:
        return _error("replay", "--from-offset joins one log; give exactly one")
    if args.until_exit is not None and _exited(args.until_exit, os.getppid()):
        # Not refused: a server that died before its exporter started still gets its log
        # exported.
        _say(
            f"warning: process {args.until_exit} is not running: relaying what the logs "
            "hold, then stopping"
        )
    if args.until_stdin_closes:
        import stat

        try:
            mode = os.fstat(sys.stdin.fileno()).st_mode
            piped = stat.S_ISFIFO(mode) or stat.S_ISSOCK(mode) or sys.stdin.isatty()
        except (AttributeError, OSError, ValueError):
            piped = False
        if not piped:
            return _error(
                "replay",
                "--until-stdin-closes: standard input is not a pipe (closed, /dev/null or "
                "a file), so the follow would stop at once",
            )
    return None


@contextlib.contextmanager
def _sigterm_stops(stop: threading.Event, follow: bool = True) -> Iterator[None]:
    """While a follow runs, make SIGTERM set ``stop`` instead of killing the process.

    A follow is stopped with SIGTERM by supervisors and sidecar runners: it ends as Ctrl-C
    does (the final frame or table still prints), and one that arrives during the final
    read or export does not cut it short. Off the main thread no handler can be set.
    """
    if not follow or threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, lambda *_: stop.set())
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


class _Recorded:
    """Recorded logs to replay: their adapter facts and writers, found before reading."""

    def __init__(self, infos: Sequence[EventRecord], sources: set[tuple[int, int]]) -> None:
        self.infos = infos
        self.sources = sources


def _replay(args: argparse.Namespace, records: _Recorded | None) -> int:
    """Feed recorded logs (None: follow ``args.paths``) through a bus with sinks."""
    stop = threading.Event()
    with _sigterm_stops(stop, follow=records is None):
        return _replay_into_sinks(args, records, stop)


def _replay_into_sinks(
    args: argparse.Namespace, records: _Recorded | None, stop: threading.Event
) -> int:
    from omnitrace.bus import EventBus
    from omnitrace.eventlog import EventLogError
    from omnitrace.logread import LogReadError, ReadProgress, merged_records, total_bytes
    from omnitrace.logset import LogSet
    from omnitrace.relay import LogRelay, feed
    from omnitrace.sinks.live import BusBoard, LiveView
    from omnitrace.sinks.registry import build_sinks

    follow = records is None
    endpoint = args.otlp_endpoint or os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT") or None
    console = _stdout_console()
    speed = args.speed if args.speed is not None else (1.0 if args.tui else 0.0)
    names = ", ".join(str(p) for p in args.paths)
    if not 0 <= speed < float("inf"):
        return _error("replay", f"--speed: expected a nonnegative number, got {speed}")
    bus = EventBus()
    setup: Any = None
    replayed = 0
    exported = True
    drained = True
    interrupted = False
    bad_lines = 0
    # A recorded replay reports a failed export once, at the end; a follow runs for long,
    # so the SDK wiring's outage warnings are printed as they happen.
    quiet = contextlib.nullcontext() if follow else _export_reported_by_the_cli()
    with quiet:
        try:
            prometheus = args.prometheus_port is not None
            otlp = endpoint is not None or args.otlp
            if otlp or prometheus:
                # Each worker of the logs exports under a resource of its own (its rank, its
                # pid), fed by the relay's tap rather than by this bus.
                from omnitrace.sinks.otel_workers import WorkerExport

                try:
                    setup = WorkerExport(
                        default_service_name="omnitrace-replay",
                        endpoint=endpoint,
                        otlp=otlp,
                        prometheus_port=args.prometheus_port,
                        prometheus_host=args.prometheus_host,
                    )
                except OSError as exc:  # the scrape port is taken, or the address is bad
                    where = f"{args.prometheus_host}:{args.prometheus_port}"
                    return _error("replay", f"cannot serve /metrics on {where}: {exc}", status=1)
                except (ValueError, ImportError) as exc:  # an OTEL_* variable, a missing extra
                    return _error("replay", str(exc))
                if otlp:
                    where = endpoint or setup.endpoint
                    _say(f"{'relaying' if follow else 'replaying'} into OTLP at {where}")
                if setup.prometheus_port is not None:
                    _say(
                        f"serving Prometheus metrics at "
                        f"http://{args.prometheus_host}:{setup.prometheus_port}/metrics"
                    )
            # Sinks the environment asks for, as in the vLLM plugin; never the event log
            # (it could be the log being replayed) nor a second OpenTelemetry export.
            extras = build_sinks(bus, os.environ, exclude=("jsonl", "otlp", "otlp-relay"))
            for extra in extras:
                bus.add_sink(extra)
            if follow and setup is None and not extras and not args.tui:
                return _error(
                    "replay",
                    "--follow has nowhere to send the events: give --otlp-endpoint (or set "
                    "OTEL_EXPORTER_OTLP_ENDPOINT), --otlp, --prometheus-port or --tui",
                )
            title = f"omnitrace replay · {'following ' if follow else ''}{names}"
            board = BusBoard(bus, title=title)
            view = LiveView(board, console=console) if args.tui else contextlib.nullcontext()
            with view:
                if records is None:
                    offsets = [args.from_offset] * len(args.paths)
                    relay = LogRelay(bus, args.paths, offsets=offsets, tap=setup)
                    logset = LogSet(args.patterns)

                    def poll() -> None:
                        for path in logset.new_paths():  # a rank that started late
                            _say(f"following {path} too")
                            relay.add(path)
                        relay.poll()

                    try:
                        _follow(
                            poll,
                            args.duration,
                            stop,
                            keys=args.tui,
                            until_exit=args.until_exit,
                            stdin_stops=args.until_stdin_closes,
                        )
                    finally:
                        drained = relay.finish()
                        replayed = relay.events
                        bad_lines = relay.bad_lines
                else:
                    # The live view has the terminal while it runs: no progress bar then.
                    shown = not (args.json or args.tui)
                    with ReadProgress(total_bytes(args.paths), enabled=shown) as progress:
                        stream = merged_records(
                            args.paths, records.infos, progress=progress.advance
                        )
                        replayed = feed(
                            bus,
                            progress.until_done(stream),
                            pace=_pacer(speed),
                            sources=records.sources,
                            tap=setup,
                        )
        except KeyboardInterrupt:
            interrupted = True
        except EventLogError as exc:
            return _error("replay", str(exc))
        except LogReadError as exc:
            return _error("replay", str(exc), exc.status)
        finally:
            bus.close()
            dropped = bus.statistics().dropped
            if setup is not None:
                exported = setup.shutdown()
                dropped += setup.dropped
    # The stats are the bus's folds of what was read: printed however the run ended (a failed
    # export, Ctrl-C), since they do not depend on the sinks, and the failure line follows.
    _print_replayed(args, bus, replayed, endpoint, console)
    if interrupted:
        _say(f"interrupted after {replayed} events")
        return 130
    if not exported:
        # Exporting was what this run was for: a failed export fails the command.
        return _error("replay", f"{setup.export_error}; {replayed} events read", status=1)
    if dropped:
        return _error(
            "replay", f"{dropped} of {replayed} events did not reach every sink", status=1
        )
    if bad_lines:
        lines = "1 line of the logs is" if bad_lines == 1 else f"{bad_lines} lines of the logs are"
        message = f"{lines} no record this version reads (skipped)"
        return _error("replay", f"{message}; {replayed} events relayed", status=1)
    if not drained:
        message = f"a sink did not keep up: not all of {replayed} events were delivered in time"
        return _error("replay", message, status=1)
    return 0


def _print_replayed(
    args: argparse.Namespace, bus: Any, replayed: int, endpoint: str | None, console: Console
) -> None:
    """Print the stats of the replayed events: the table, or with ``--json`` the JSON."""
    encoders = {name: stats.as_dict() for name, stats in bus.adapter_stats().items()}
    caps = {
        name: info["max_graphs"]
        for name, info in bus.adapters().items()
        if isinstance(info.get("max_graphs"), int)
    }
    if args.json:
        _print_json(
            {
                "logs": [str(p) for p in args.paths],
                "events": replayed,
                "otlp_endpoint": endpoint,
                "encoders": {
                    name: _encoder_json(stats, caps.get(name)) for name, stats in encoders.items()
                },
            }
        )
    else:
        console.print(
            stats_table(
                encoders,
                max_graphs=caps,
                title=f"replayed {replayed} events",
                compact=console.width < 120,
            )
        )


def _exited(pid: int, parent: int) -> bool:
    """Whether process ``pid`` is gone (for our parent: whether we were handed to another)."""
    if pid == parent and os.getppid() != parent:
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False  # it exists, under another user
    try:  # Linux: an exited process its parent has not reaped yet is a zombie
        with open(f"/proc/{pid}/stat", "rb") as stat:
            return stat.read().rsplit(b")", 1)[-1].split()[0] == b"Z"
    except (OSError, IndexError):
        return False


def _closed(stream: IO[str] | None) -> bool:
    """Whether the pipe behind ``stream`` reached its end (without blocking)."""
    import select

    if stream is None:
        return True  # no standard input at all
    try:
        fd = stream.fileno()
        if not select.select([fd], [], [], 0)[0]:
            return False
        return os.read(fd, 4096) == b""
    except (OSError, ValueError):
        return True  # no standard input at all


def _pacer(speed: float) -> Callable[[Event], None] | None:
    """Return a hook that sleeps the recorded gaps, sped up ``speed`` times (0: no pacing)."""
    if not speed:
        return None
    previous: list[int] = []

    def pace(event: Event) -> None:
        if previous:
            # Recorded gaps, sped up, and capped so an idle hour does not stall.
            time.sleep(min(max(event.epoch_ns - previous[0], 0) / 1e9 / speed, 2.0))
            previous[0] = event.epoch_ns
        else:
            previous.append(event.epoch_ns)

    return pace


def _follow(
    poll: Callable[[], object],
    duration: float | None,
    stop: threading.Event,
    *,
    keys: bool,
    until_exit: int | None = None,
    stdin_stops: bool = False,
) -> None:
    """Call ``poll`` every FOLLOW_POLL_S until ``duration`` passed, q is typed (``keys``),
    Ctrl-C, ``stop`` is set (SIGTERM), process ``until_exit`` ended or (``stdin_stops``)
    standard input closed."""
    deadline = None if duration is None else time.monotonic() + duration
    parent = os.getppid()
    try:
        with _keys() if keys else contextlib.nullcontext(_keys_off) as wait:
            while not stop.is_set() and (deadline is None or time.monotonic() < deadline):
                poll()
                if "q" in wait(FOLLOW_POLL_S).lower():
                    break
                if until_exit is not None and _exited(until_exit, parent):
                    break
                if stdin_stops and _closed(sys.stdin):
                    break
    except KeyboardInterrupt:
        pass  # Ctrl-C is one way a follow ends.


# -- advise ---------------------------------------------------------------------------------


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


def _cmd_advise(args: argparse.Namespace) -> int:
    from omnitrace.advise import Recording, advice_json, advise, default_grid
    from omnitrace.logread import LogReadError, ReadProgress, read_logs, total_bytes

    with ReadProgress(total_bytes(args.paths), enabled=not args.json) as progress:
        chunks = read_logs(args.paths, progress=progress.advance)
        try:
            recording = Recording.from_records(
                (record for _, chunk in chunks for record in chunk), free_bytes=args.free_bytes
            )
        except LogReadError as exc:
            return _error("advise", str(exc), exc.status)
        if not recording.costs:
            names = ", ".join(str(p) for p in args.paths)
            return _error("advise", f"{names}: no encoder call could use a graph", status=1)
        grid = default_grid(
            recording,
            max_graphs=args.max_graphs,
            min_capture_calls=args.min_capture_calls,
            min_free_bytes=args.min_free_bytes,
        )
        step = progress.phase("replaying settings", len(grid))
        advice = advise(recording, grid, memory_budget=args.memory_budget, progress=step)
    from omnitrace.spread import per_worker, spread_json, spread_line, spread_table

    # The one setting for every rank, replayed rank by rank: how far apart they are.
    spread = None if advice.best is None else per_worker(recording, advice.best.setting)
    if args.json:
        by_worker = None if spread is None else spread_json(spread)
        _print_json({**advice_json(advice), "per_worker": by_worker})
        return 0 if advice.best is not None else 1
    if advice.best is None:
        # Nothing to recommend: one line saying why and what to change, not a table of
        # settings none of which can be used.
        return _error("advise", f"no recommendation: {advice.why()}", status=1)
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
    console.print("recommended:")
    overrides = safe_markup(json.dumps(advice.overrides))
    console.print(f"  --hf-overrides '{overrides}'", soft_wrap=True)
    console.print(f"why: {safe_markup(advice.why())}", soft_wrap=True)
    return 0


# -- receive --------------------------------------------------------------------------------


def _cmd_receive(args: argparse.Namespace) -> int:
    from omnitrace.receive import DEFAULT_PORTS, receive

    port = DEFAULT_PORTS[args.protocol] if args.port is None else args.port
    stop = threading.Event()
    try:
        with _sigterm_stops(stop):
            tally = receive(
                protocol=args.protocol,
                host=args.host,
                port=port,
                as_json=args.json,
                duration_s=args.duration,
                stop=stop,
                out=sys.stdout,
                say=_say,
            )
    except OSError as exc:  # the port is taken, or the address is not this machine's
        return _error("receive", f"cannot listen on {args.host}:{port}: {exc.strerror or exc}", 1)
    if tally.empty:
        return _error("receive", "nothing arrived: no exporter sent here", status=1)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``omnitrace`` command line; return the exit status."""
    parser = _build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "paths", None) is not None:
        from omnitrace.logset import expand

        # Patterns a shell did not expand ('events-*.jsonl', quoted): the logs they match.
        args.patterns, args.paths = args.paths, expand(args.paths)
    handlers = {
        "demo": _cmd_demo,
        "top": _cmd_top,
        "replay": _cmd_replay,
        "advise": _cmd_advise,
        "receive": _cmd_receive,
    }
    try:
        return int(handlers[args.command](args))
    except OmnitraceError as exc:  # a bad value or path: one line, not a traceback
        return _error(args.command, str(exc))
    except OSError as exc:  # a file that cannot be opened: "PATH: REASON", as the checks say
        from omnitrace._paths import describe_os_error

        return _error(args.command, describe_os_error(exc))


if __name__ == "__main__":
    sys.exit(main())
