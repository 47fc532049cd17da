"""The ``omnitrace`` command: ``demo``, ``top`` and ``replay``.

``omnitrace demo`` runs MiniCPM-o-shaped encoders under graph adapters with every sink
attached; ``omnitrace top`` shows (or follows) the event log a serving process writes;
``omnitrace replay`` feeds a recorded log into the live view or into OTLP.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import IO, Any, TypeVar

from rich.console import Console
from rich.table import Table

from omnitrace.config import ConfigError, EncoderGraphConfig, OmnitraceError

__all__ = ["main", "stats_table"]

PROG = "omnitrace"


class _UsageError(Exception):
    """A bad option value found after parsing: printed as one line, exit code 2."""


_N = TypeVar("_N", int, float)


def _bounded(
    convert: Callable[[str], _N], label: str, accept: Callable[[_N], bool]
) -> Callable[[str], _N]:
    """Return an argparse type that converts with ``convert`` and checks ``accept``."""

    def parse(text: str) -> _N:
        try:
            value = convert(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {label}, got {text!r}") from None
        if not accept(value):
            raise argparse.ArgumentTypeError(f"expected {label}, got {text!r}")
        return value

    return parse


_positive_int = _bounded(int, "a positive integer", lambda v: v >= 1)
_nonnegative_int = _bounded(int, "a nonnegative integer", lambda v: v >= 0)
_positive_float = _bounded(float, "a positive number", lambda v: v > 0)


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG,
        description="Observable exact-shape CUDA graphs for multimodal encoders.",
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    demo = commands.add_parser(
        "demo",
        help="run MiniCPM-o-shaped encoders under graph adapters with live observability",
        description=(
            "Run MiniCPM-o-shaped vision and audio encoders under encoder graph adapters, on "
            "a seeded MiniCPM-o-like traffic mix, with the live view, the JSONL event log, "
            "JSON logs and (when OTEL_EXPORTER_OTLP_ENDPOINT is set) OTLP export."
        ),
    )
    traffic = demo.add_argument_group("traffic")
    traffic.add_argument(
        "--requests",
        type=_nonnegative_int,
        default=400,
        help="encoder requests to send (0: no limit, stop with --duration); default 400",
    )
    traffic.add_argument(
        "--duration",
        type=_positive_float,
        default=None,
        metavar="SECONDS",
        help="stop after this many seconds even if requests remain",
    )
    traffic.add_argument("--seed", type=int, default=0, help="traffic and weight seed")
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
    sizes = demo.add_argument_group("model sizes (defaults are tiny, for a CPU)")
    sizes.add_argument("--hidden", type=_positive_int, default=64, help="hidden size (64)")
    sizes.add_argument("--heads", type=_positive_int, default=4, help="attention heads (4)")
    sizes.add_argument("--vision-layers", type=_positive_int, default=2, help="vision layers (2)")
    sizes.add_argument("--audio-layers", type=_positive_int, default=2, help="audio layers (2)")
    sizes.add_argument(
        "--cpu", action="store_true", help="run on the CPU (simulated graphs) even with CUDA"
    )
    sim = demo.add_argument_group("simulated device (CPU only)")
    sim.add_argument(
        "--sim-free-mib",
        type=_nonnegative_int,
        default=1624,
        help="simulated free device memory at start, MiB (1624: the floor bites late)",
    )
    sim.add_argument(
        "--sim-graph-mib",
        type=_nonnegative_int,
        default=96,
        help="simulated memory each capture takes, MiB (96)",
    )
    sim.add_argument(
        "--fail-capture",
        choices=("vision", "audio"),
        default=None,
        help="make this encoder's first capture fail, to see the failure path",
    )
    out = demo.add_argument_group("outputs")
    out.add_argument("--no-tui", action="store_true", help="no live view (also off without a TTY)")
    out.add_argument(
        "--events-log",
        type=Path,
        default=Path("omnitrace-events.jsonl"),
        metavar="PATH",
        help="JSONL event log to write (default: ./omnitrace-events.jsonl)",
    )
    out.add_argument(
        "--log-file",
        type=Path,
        default=None,
        metavar="PATH",
        help="write the JSON log lines here instead of stderr",
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
        "--json-summary",
        type=Path,
        default=None,
        metavar="PATH",
        help="also write the final stats as JSON",
    )

    top = commands.add_parser(
        "top",
        help="show the stats of an event log, or follow one a serving process writes",
        description=(
            "Show per-encoder graph stats from JSONL event logs (several worker processes "
            "side by side). With --follow, keep reading as the writers append."
        ),
    )
    top.add_argument("paths", nargs="+", type=Path, metavar="EVENTS.jsonl")
    top.add_argument("--follow", "-f", action="store_true", help="follow the logs as they grow")
    top.add_argument(
        "--duration",
        type=_positive_float,
        default=None,
        metavar="SECONDS",
        help="with --follow: stop after this many seconds (default: until Ctrl-C)",
    )
    top.add_argument("--no-tui", action="store_true", help="print one final frame only")

    replay = commands.add_parser(
        "replay",
        help="replay a recorded event log into the live view or into OTLP",
        description=(
            "Feed the events of a recorded JSONL log through a fresh bus, into the live view "
            "(--tui) and/or OTLP (--otlp-endpoint, or OTEL_EXPORTER_OTLP_ENDPOINT)."
        ),
    )
    replay.add_argument("path", type=Path, metavar="EVENTS.jsonl")
    replay.add_argument("--otlp-endpoint", default=None, metavar="URL", help="OTLP base endpoint")
    replay.add_argument("--tui", action="store_true", help="show the live view while replaying")
    replay.add_argument(
        "--speed",
        type=float,
        default=None,
        metavar="X",
        help="replay at X times the recorded pace (0: at once; default 1 with --tui, else 0)",
    )
    return parser


# -- output helpers -------------------------------------------------------------------------


def stats_table(
    encoders: Mapping[str, Mapping[str, int | float]],
    *,
    max_graphs: Mapping[str, int] | None = None,
    title: str = "encoder graph stats",
) -> Table:
    """Return the final stats table: one row per encoder (calls, hits, misses by reason...)."""
    table = Table(title=title, title_justify="left")
    for column in ("encoder", "calls", "hits", "hit rate", "warmup", "capacity", "memory"):
        table.add_column(column, justify="left" if column == "encoder" else "right")
    table.add_column("ineligible", justify="right")
    table.add_column("graphs", justify="right")
    table.add_column("capture failures", justify="right")
    for name, stats in encoders.items():
        calls = int(stats["graph_hits"] + stats["graph_misses"])
        cap = (max_graphs or {}).get(name)
        failures = int(stats["capture_failures"])
        table.add_row(
            name,
            str(calls),
            str(stats["graph_hits"]),
            f"{stats['hit_rate'] * 100:.1f} %",
            str(stats["warmup_misses"]),
            str(stats["capacity_misses"]),
            str(stats["memory_misses"]),
            str(stats["ineligible_misses"]),
            f"{stats['num_graphs']}/{cap}" if cap is not None else str(stats["num_graphs"]),
            f"[bold red]{failures}[/]" if failures else "0",
        )
    return table


def _stdout_console() -> Console:
    console = Console(file=sys.stdout, highlight=False)
    if not console.is_terminal:
        # Piped or captured output has no width; 80 columns would squash the stats table.
        console = Console(file=sys.stdout, highlight=False, width=140)
    return console


def _say(message: str) -> None:
    # Status lines go to stderr, so stdout carries only the results.
    print(f"{PROG}: {message}", file=sys.stderr, flush=True)


def _error(command: str, message: str) -> int:
    print(f"{PROG} {command}: error: {message}", file=sys.stderr, flush=True)
    return 2


@contextlib.contextmanager
def _logging(args: argparse.Namespace) -> Iterator[None]:
    """Configure structlog for the run; close the log file and restore defaults after."""
    import structlog

    from omnitrace.sinks.logs import configure_logging

    stream: IO[str] | None = None
    if args.log_file is not None:
        args.log_file.parent.mkdir(parents=True, exist_ok=True)
        stream = open(args.log_file, "a", encoding="utf-8")  # noqa: SIM115 -- closed below
    try:
        configure_logging(level=args.log_level, json=True, stream=stream)
        yield
    finally:
        if stream is not None:
            # Later log calls in this process must not reach a closed file.
            structlog.reset_defaults()
            stream.close()


# -- demo -----------------------------------------------------------------------------------


def _cmd_demo(args: argparse.Namespace) -> int:
    from omnitrace.demo.run import DemoOptions, run_demo

    try:
        config = EncoderGraphConfig.from_hf_overrides(
            args.hf_overrides, enforce_eager=args.enforce_eager
        )
    except ConfigError as exc:
        return _error("demo", f"--hf-overrides: {exc}")
    if args.requests == 0 and args.duration is None:
        return _error("demo", "--requests 0 (no limit) needs --duration")
    console = _stdout_console()
    tui = not args.no_tui and console.is_terminal
    rate = args.rate if args.rate is not None else (60.0 if tui else None)
    options = DemoOptions(
        config=config,
        requests=args.requests,
        duration_s=args.duration,
        seed=args.seed,
        hidden=args.hidden,
        heads=args.heads,
        vision_layers=args.vision_layers,
        audio_layers=args.audio_layers,
        events_log=args.events_log,
        tui=tui,
        rate=rate,
        log_sample_every=args.log_sample_every,
        sim_free_mib=args.sim_free_mib,
        sim_graph_mib=args.sim_graph_mib,
        fail_capture=args.fail_capture,
        force_cpu=args.cpu,
    )
    if args.hidden % args.heads:
        return _error(
            "demo", f"--hidden ({args.hidden}) must be a multiple of --heads ({args.heads})"
        )
    with _logging(args):
        result = run_demo(options, console=console, say=_say)
    if result.interrupted:
        _say(f"interrupted after {result.requests} requests")
    console.print(stats_table(result.encoders, max_graphs=result.max_graphs))
    console.print(
        f"requests {result.requests} in {result.elapsed_s:.1f} s · "
        f"streaming audio {result.streaming_eager_calls} eager calls (never graphed) · "
        f"bus events {result.emitted}, dropped {result.dropped}"
    )
    if result.calls_after_failure:
        console.print(
            f"[bold red]capture failed[/]: {result.calls_after_failure} calls served eagerly "
            "afterwards (a real worker must restart)"
        )
    _say(f"event log: {Path(result.events_log).resolve()}")
    if args.json_summary is not None:
        args.json_summary.parent.mkdir(parents=True, exist_ok=True)
        args.json_summary.write_text(json.dumps(result.to_json(), indent=2) + "\n")
        _say(f"summary: {args.json_summary.resolve()}")
    return 130 if result.interrupted else 0


# -- top ------------------------------------------------------------------------------------


def _cmd_top(args: argparse.Namespace) -> int:
    from omnitrace.sinks.jsonl import EventLogError, EventLogFollower, read_records
    from omnitrace.sinks.live import LiveView, RecordBoard, render

    names = ", ".join(str(p) for p in args.paths)
    console = _stdout_console()
    if not args.follow:
        board = RecordBoard(title=f"omnitrace top · {names}")
        try:
            for path in args.paths:
                board.add(read_records(path))
        except (FileNotFoundError, EventLogError) as exc:
            return _error("top", str(exc))
        console.print(render(board.snapshot()))
        return 0

    board = RecordBoard(title=f"omnitrace top · following {names}")
    followers = [EventLogFollower(path) for path in args.paths]
    deadline = None if args.duration is None else time.monotonic() + args.duration
    tui = not args.no_tui and console.is_terminal
    try:
        with LiveView(board, console=console) if tui else contextlib.nullcontext():
            while deadline is None or time.monotonic() < deadline:
                for follower in followers:
                    board.add(follower.poll())
                time.sleep(0.1)
            for follower in followers:
                board.add(follower.poll())
    except KeyboardInterrupt:
        pass  # Ctrl-C is how a follow ends.
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
    from omnitrace.bus import EventBus
    from omnitrace.sinks.jsonl import AdapterInfo, EventLogError, read_records
    from omnitrace.sinks.live import BusBoard, LiveView

    try:
        records = list(read_records(args.path))
    except (FileNotFoundError, EventLogError) as exc:
        return _error("replay", str(exc))
    sources = {record.source for record in records}

    def adapter_name(adapter: str, source: tuple[int, int]) -> str:
        # Several workers' logs merged: keep their adapters apart in one bus.
        return adapter if len(sources) == 1 else f"{adapter}@rank{source[0]}.pid{source[1]}"

    endpoint = args.otlp_endpoint or os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT") or None
    console = _stdout_console()
    speed = args.speed if args.speed is not None else (1.0 if args.tui else 0.0)
    if speed < 0:
        return _error("replay", f"--speed: expected a nonnegative number, got {speed}")
    bus = EventBus()
    setup: Any = None
    replayed = 0
    try:
        if endpoint is not None:
            from omnitrace.sinks.otel import OTelSink, configure_sdk

            setup = configure_sdk(service_name="omnitrace-replay", endpoint=endpoint)
            bus.add_sink(
                OTelSink(
                    bus,
                    tracer_provider=setup.tracer_provider,
                    meter_provider=setup.meter_provider,
                )
            )
            _say(f"replaying into OTLP at {endpoint}")
        board = BusBoard(bus, title=f"omnitrace replay · {args.path}")
        view = LiveView(board, console=console) if args.tui else contextlib.nullcontext()
        previous_ns: int | None = None
        with view:
            for record in records:
                item = record.item
                if isinstance(item, AdapterInfo):
                    bus.register_adapter(adapter_name(item.adapter, record.source), item.info)
                    continue
                if speed and previous_ns is not None:
                    # Recorded gaps, sped up, and capped so an idle hour does not stall.
                    time.sleep(min(max(item.epoch_ns - previous_ns, 0) / 1e9 / speed, 2.0))
                previous_ns = item.epoch_ns
                if len(sources) > 1:
                    item = dataclasses.replace(
                        item, adapter=adapter_name(item.adapter, record.source)
                    )
                bus.emit(item)
                replayed += 1
            bus.flush()
        encoders = {name: stats.as_dict() for name, stats in bus.adapter_stats().items()}
        caps = {
            name: info["max_graphs"]
            for name, info in bus.adapters().items()
            if isinstance(info.get("max_graphs"), int)
        }
    except KeyboardInterrupt:
        _say("interrupted")
        return 130
    finally:
        bus.close()
        if setup is not None:
            setup.shutdown()
    console.print(stats_table(encoders, max_graphs=caps, title=f"replayed {replayed} events"))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``omnitrace`` command line; return the exit status."""
    parser = _build_parser()
    args = parser.parse_args(argv)
    handlers = {"demo": _cmd_demo, "top": _cmd_top, "replay": _cmd_replay}
    try:
        return handlers[args.command](args)
    except OmnitraceError as exc:
        return _error(args.command, str(exc))


if __name__ == "__main__":
    sys.exit(main())
