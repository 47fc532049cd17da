"""The ``omnitrace`` command's argument parser: every command's options and their types.

Only what ``--help``, ``--version`` and argument errors need is imported here: rich, the sinks
and torch load inside the commands that use them, so the command line answers at once.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from omnitrace._version import __version__
from omnitrace.cli.output import PROG
from omnitrace.cli.receive import HOST_HELP as RECEIVE_HOST_HELP
from omnitrace.cli.receive import add_limit_options as add_receive_limits
from omnitrace.config import MAX_GRAPHS_CAP, ConfigError

__all__ = ["_build_parser"]


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
    command.add_argument(
        "paths",
        nargs="+",
        type=Path,
        metavar="EVENTS.jsonl",
        help="event logs (--events-log of the demo, OMNITRACE_EVENTS_LOG of the vLLM plugin; "
        "a worker's log per rank); a quoted pattern such as 'events-*.jsonl' is expanded "
        "here, and the rotated files of a log (.1, .2, ...) are read with it",
    )
    return command


_OTEL_VARIABLES = (
    "OTEL_EXPORTER_OTLP_ENDPOINT, OTEL_EXPORTER_OTLP_TRACES_ENDPOINT, "
    "OTEL_EXPORTER_OTLP_METRICS_ENDPOINT (any one turns the OTLP export on), "
    "OTEL_EXPORTER_OTLP_PROTOCOL, OTEL_SERVICE_NAME, OTEL_RESOURCE_ATTRIBUTES, "
    "OTEL_METRIC_EXPORT_INTERVAL, OTEL_BSP_SCHEDULE_DELAY"
)
#: Each command's help ends with the variables it reads (None: none of omnitrace's) and the
#: section of the documentation about it.
HELP_EPILOGS: dict[str, tuple[str | None, str]] = {
    "demo": (
        f"{_OTEL_VARIABLES}; RANK and LOCAL_RANK (the rank in the event log's name)",
        "docs/operations.md, 'Quick start: `omnitrace demo`'",
    ),
    "top": (None, "docs/operations.md, 'Following a serving process: `omnitrace top`'"),
    "replay": (
        f"{_OTEL_VARIABLES}; OMNITRACE_LOGS and OMNITRACE_SUMMARY_INTERVAL (JSON log lines)",
        "docs/operations.md, 'Replaying a recorded run: `omnitrace replay`' and 'Exporting "
        "beside the server: `omnitrace replay --follow`'",
    ),
    "advise": (None, "docs/operations.md, 'Choosing settings: `omnitrace advise`'"),
    "receive": (None, "docs/telemetry.md, 'Checking the exporter settings: `omnitrace receive`'"),
    "trace": (None, "docs/operations.md, 'Why is my TTFT high?'"),
    "config": (
        "every OMNITRACE_* and OTEL_* variable it lists",
        "docs/operations.md, 'What is in force: `omnitrace config`'",
    ),
    "completion": (None, "docs/operations.md, 'Shell completion'"),
}


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
        type=_int_range(0, (1 << 31) - 1, "a rank"),
        default=None,
        metavar="N",
        help="show only this worker rank's encoders (repeat for more; default: all)",
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
            "min_capture_calls, memory floors and pool budgets; report per setting the hit "
            "rate, graphs, pool memory and estimated time saved, then the recommended "
            "--hf-overrides JSON and why."
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
        "--pool-budget",
        type=_size_list,
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
        help=RECEIVE_HOST_HELP,
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
    add_receive_limits(receive)
    from omnitrace.cli.trace import add_trace_parser

    add_trace_parser(commands, _HelpFormatter)
    from omnitrace.cli.config import add_config_parser

    add_config_parser(commands, _HelpFormatter)
    from omnitrace.cli.completion import add_completion_parser

    add_completion_parser(commands, _HelpFormatter)
    for name, (environment, docs) in HELP_EPILOGS.items():
        read = environment or "none of omnitrace's variables"
        commands.choices[name].epilog = f"environment: {read}. docs: {docs}."
    return parser
