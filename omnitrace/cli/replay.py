"""``omnitrace replay``: event logs fed through a fresh bus into the live view, OTLP or
Prometheus, recorded (at once or paced) or followed as their writers append."""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import omnitrace.cli.options as opt
from omnitrace.cli.export import (
    _endpoint_errors,
    _export_reported_by_the_cli,
    _exports_by_variable,
)
from omnitrace.cli.follow import (
    _exited,
    _follow,
    _followable,
    _signal_stops,
    _unmatched_patterns,
)
from omnitrace.cli.output import _print_json, _say, _stdout_console, command_error
from omnitrace.cli.tables import stats_table

if TYPE_CHECKING:
    from rich.console import Console

    from omnitrace.eventlog import EventRecord
    from omnitrace.events import Event

__all__ = ["add_replay_parser", "_cmd_replay"]


def _cmd_replay(args: argparse.Namespace) -> int:
    # Endpoints are checked before any log is read.
    if args.otlp_endpoint is not None:
        from omnitrace._validate import check_endpoint

        args.otlp_endpoint = check_endpoint("--otlp-endpoint", args.otlp_endpoint)
    elif args.otlp or _exports_by_variable():
        refused = _endpoint_errors("replay")
        if refused is not None:
            return refused
    if args.follow:
        if args.speed is not None:
            return command_error(
                "replay", "--speed paces a recorded log; --follow relays as written"
            )
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
            return command_error(
                "replay", f"{flag} needs --follow (a recorded log replays at once)"
            )
    from omnitrace.eventlog import log_gap
    from omnitrace.eventlog.chunks import (
        LogReadError,
        ReadProgress,
        read_logs,
        total_bytes,
        writers,
    )

    refused = _unmatched_patterns("replay", args.paths)
    if refused is not None:
        return refused
    for path in args.paths:
        if not path.exists():
            return command_error("replay", f"no event log at {path}")
    # Whether several workers wrote the logs decides the adapters' names before the first
    # event: a quick pass finds the writers (and the adapter facts, registered first). It
    # reads the whole logs too, so it has a bar of its own, on the same terms as the
    # reading's (never with JSON or the live view).
    shown = not (args.json or args.tui)
    with ReadProgress(
        total_bytes(args.paths), enabled=shown, description="finding writers"
    ) as progress:
        sources, infos = writers(args.paths, progress=progress.advance)
    if not sources:
        try:  # nothing reads as a record: reading says why (a bad line, or no events)
            for _ in read_logs(args.paths):
                pass
        except LogReadError as exc:
            return command_error("replay", str(exc), exc.status)
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
        return command_error("replay", "--from-offset joins one log; give exactly one")
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
            return command_error(
                "replay",
                "--until-stdin-closes: standard input is not a pipe (closed, /dev/null or "
                "a file), so the follow would stop at once",
            )
    return None


class _Recorded:
    """Recorded logs to replay: their adapter facts and writers, found before reading."""

    def __init__(self, infos: Sequence[EventRecord], sources: set[tuple[int, int]]) -> None:
        self.infos = infos
        self.sources = sources


def _replay(args: argparse.Namespace, records: _Recorded | None) -> int:
    """Feed recorded logs (None: follow ``args.paths``) through a bus with sinks."""
    stop = threading.Event()
    with _signal_stops(stop, enabled=records is None):
        return _replay_into_sinks(args, records, stop)


class _Refused(Exception):
    """A replay that cannot start: its one error line's text and exit status."""

    def __init__(self, message: str, status: int = 2) -> None:
        super().__init__(message)
        self.status = status


def _worker_export(args: argparse.Namespace, follow: bool) -> Any:
    """The OTLP and Prometheus export of each writer of the logs (None: neither asked for),
    its endpoints said on stderr.

    Raises:
        _Refused: a port that cannot be served, a bad OTEL_* variable, a missing extra.
    """
    prometheus = args.prometheus_port is not None
    otlp = args.otlp_endpoint is not None or args.otlp or _exports_by_variable()
    if not (otlp or prometheus):
        return None
    # Each worker of the logs exports under a resource of its own (its rank, its pid), fed
    # by the relay's tap rather than by the bus.
    from omnitrace.sinks.otel.workers import WorkerExport

    try:
        setup = WorkerExport(
            default_service_name="omnitrace-replay",
            endpoint=args.otlp_endpoint,
            otlp=otlp,
            prometheus_port=args.prometheus_port,
            prometheus_host=args.prometheus_host,
        )
    except OSError as exc:  # the scrape port is taken, or the address is bad
        where = f"{args.prometheus_host}:{args.prometheus_port}"
        raise _Refused(f"cannot serve /metrics on {where}: {exc}", status=1) from None
    except (ValueError, ImportError) as exc:  # an OTEL_* variable, a missing extra
        raise _Refused(str(exc)) from None
    if otlp:
        from omnitrace._env import otlp_endpoints_text

        doing = "relaying" if follow else "replaying"
        _say(f"{doing} into OTLP ({setup.protocol}): {otlp_endpoints_text(setup.endpoints)}")
    if setup.prometheus_port is not None:
        _say(
            f"serving Prometheus metrics at "
            f"http://{args.prometheus_host}:{setup.prometheus_port}/metrics"
        )
    return setup


@dataclass
class _Run:
    """What a replay or a follow did: the events read, whether every sink was drained in
    time, and the lines no record could be read from."""

    replayed: int = 0
    drained: bool = True
    bad_lines: int = 0


def _follow_into(
    args: argparse.Namespace, bus: Any, setup: Any, stop: threading.Event, run: _Run
) -> None:
    """Relay the logs as their writers append, until the follow ends; ``run`` is kept up to
    date however it ends."""
    from omnitrace.eventlog.patterns import LogSet
    from omnitrace.relay import LogRelay

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
        run.drained = relay.finish()
        run.replayed = relay.events
        run.bad_lines = relay.bad_lines


def _replay_recorded(
    args: argparse.Namespace, bus: Any, setup: Any, records: _Recorded, speed: float
) -> int:
    """Feed the recorded logs through ``bus`` at ``speed``; return the events fed."""
    from omnitrace.eventlog.chunks import ReadProgress, merged_records, total_bytes
    from omnitrace.relay import feed

    # The live view has the terminal while it runs: no progress bar then.
    shown = not (args.json or args.tui)
    with ReadProgress(total_bytes(args.paths), enabled=shown) as progress:
        stream = merged_records(args.paths, records.infos, progress=progress.advance)
        replayed: int = feed(
            bus,
            progress.until_done(stream),
            pace=_pacer(speed),
            sources=records.sources,
            tap=setup,
        )
    return replayed


def _replay_into_sinks(
    args: argparse.Namespace, records: _Recorded | None, stop: threading.Event
) -> int:
    from omnitrace.bus import EventBus
    from omnitrace.eventlog import EventLogError
    from omnitrace.eventlog.chunks import LogReadError
    from omnitrace.sinks.live import BusBoard, LiveView
    from omnitrace.sinks.registry import build_sinks

    follow = records is None
    console = _stdout_console()
    speed = args.speed if args.speed is not None else (1.0 if args.tui else 0.0)
    names = ", ".join(str(p) for p in args.paths)
    if not 0 <= speed < float("inf"):
        return command_error("replay", f"--speed: expected a nonnegative number, got {speed}")
    bus = EventBus()
    setup: Any = None
    run = _Run()
    exported = True
    interrupted = False
    # A recorded replay reports a failed export once, at the end; a follow runs for long,
    # so the SDK wiring's outage warnings are printed as they happen.
    quiet = contextlib.nullcontext() if follow else _export_reported_by_the_cli()
    with quiet:
        try:
            setup = _worker_export(args, follow)
            # Sinks the environment asks for, as in the vLLM plugin; never the event log
            # (it could be the log being replayed) nor a second OpenTelemetry export.
            extras = build_sinks(bus, os.environ, exclude=("jsonl", "otlp", "otlp-relay"))
            for extra in extras:
                bus.add_sink(extra)
            if follow and setup is None and not extras and not args.tui:
                raise _Refused(
                    "--follow has nowhere to send the events: give --otlp-endpoint (or set "
                    "OTEL_EXPORTER_OTLP_ENDPOINT or a signal's own endpoint variable), --otlp, "
                    "--prometheus-port or --tui"
                )
            title = f"omnitrace replay · {'following ' if follow else ''}{names}"
            board = BusBoard(bus, title=title)
            view = LiveView(board, console=console) if args.tui else contextlib.nullcontext()
            with view:
                if records is None:
                    _follow_into(args, bus, setup, stop, run)
                else:
                    run.replayed = _replay_recorded(args, bus, setup, records, speed)
        except _Refused as refused:
            return command_error("replay", str(refused), refused.status)
        except KeyboardInterrupt:
            interrupted = True
        except EventLogError as exc:
            return command_error("replay", str(exc))
        except LogReadError as exc:
            return command_error("replay", str(exc), exc.status)
        finally:
            bus.close()
            dropped = bus.statistics().dropped
            if setup is not None:
                exported = setup.shutdown()
                dropped += setup.dropped
    # The stats are the bus's folds of what was read: printed however the run ended (a failed
    # export, Ctrl-C), since they do not depend on the sinks, and the failure line follows.
    _print_replayed(args, bus, run.replayed, setup, console)
    if interrupted:
        _say(f"interrupted after {run.replayed} events")
        return 130
    if not exported:
        # Exporting was what this run was for: a failed export fails the command.
        return command_error(
            "replay", f"{setup.export_error}; {run.replayed} events read", status=1
        )
    return _outcome(run, dropped)


def _outcome(run: _Run, dropped: int) -> int:
    """The exit status of a replay whose export went through: 1, with the line saying why,
    when an event did not reach every sink, a line was unreadable or a sink fell behind."""
    replayed = run.replayed
    if dropped:
        return command_error(
            "replay", f"{dropped} of {replayed} events did not reach every sink", status=1
        )
    if run.bad_lines:
        bad = run.bad_lines
        lines = "1 line of the logs is" if bad == 1 else f"{bad} lines of the logs are"
        message = f"{lines} no record this version reads (skipped)"
        return command_error("replay", f"{message}; {replayed} events relayed", status=1)
    if not run.drained:
        message = f"a sink did not keep up: not all of {replayed} events were delivered in time"
        return command_error("replay", message, status=1)
    return 0


def _print_replayed(
    args: argparse.Namespace, bus: Any, replayed: int, setup: Any, console: Console
) -> None:
    """Print the stats of the replayed events: the table, or with ``--json`` the JSON."""
    from omnitrace.coverage import encoder_summary

    adapter_stats = bus.adapter_stats()
    infos = bus.adapters()
    coverage = bus.coverage()
    # The order of top and the live view: as the adapters were registered (the demo's vision
    # first), not as their first events came.
    order = [name for name in infos if name in adapter_stats]
    order += [name for name in adapter_stats if name not in infos]
    caps = {
        name: info["max_graphs"]
        for name, info in infos.items()
        if isinstance(info.get("max_graphs"), int)
    }
    if args.json:
        _print_json(
            {
                "logs": [str(p) for p in args.paths],
                "events": replayed,
                # Where the OTLP export went: in a few words, and each signal's URL.
                "otlp_endpoint": None if setup is None else setup.endpoint,
                "otlp_endpoints": {}
                if setup is None
                else {signal: e.url for signal, e in setup.endpoints.items()},
                # The fields of the graph_summary lines and of top --json, from one function.
                "encoders": {
                    name: encoder_summary(adapter_stats[name], coverage.get(name), infos.get(name))
                    for name in order
                },
            }
        )
    else:
        encoders = {name: adapter_stats[name].as_dict() for name in order}
        console.print(
            stats_table(
                encoders,
                max_graphs=caps,
                title=f"replayed {replayed} events",
                compact=console.width < 120,
            )
        )


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


def add_replay_parser(commands: Any) -> None:
    """Add ``replay`` to the command line's subcommands."""
    replay = opt.log_command(
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
        type=opt.nonnegative_float,
        default=None,
        metavar="X",
        help="replay at X times the recorded pace (0: at once; default: 1 with --tui, else 0)",
    )
    replay.add_argument(
        "--json", action="store_true", help="print the replayed stats as JSON instead of a table"
    )
    _follow_options(replay)
    replay.set_defaults(handler=_cmd_replay)


def _follow_options(replay: argparse.ArgumentParser) -> None:
    """``replay --follow`` and what ends or joins a follow, and its Prometheus endpoint."""
    replay.add_argument(
        "--follow",
        "-f",
        action="store_true",
        help="keep relaying the logs as their writers append to them",
    )
    replay.add_argument(
        "--duration",
        type=opt.positive_float,
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
        type=opt.int_range(0, 2**62, "a byte offset"),
        default=None,
        metavar="BYTES",
        help="with --follow and one log: join it at this byte (a server that starts the "
        "follow passes its log's size, so an earlier run's lines are not exported again)",
    )
    replay.add_argument(
        "--until-exit",
        type=opt.int_range(1, 2**31 - 1, "a process id"),
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
        type=opt.int_range(0, 65535, "a port"),
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
