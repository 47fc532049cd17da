"""``omnitrace demo``: MiniCPM-o-shaped encoders under graph adapters, with every sink."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import IO

from omnitrace.cli.export import (
    _endpoint_errors,
    _export_reported_by_the_cli,
    _exports_by_variable,
)
from omnitrace.cli.output import _error, _say, _stdout_console
from omnitrace.cli.tables import stats_table
from omnitrace.config import ConfigError, EncoderGraphConfig

__all__ = ["_cmd_demo"]


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
            args.hf_overrides,
            enforce_eager=args.enforce_eager,
            warn=lambda message: _say(f"warning: --hf-overrides: {message}"),
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

        return _error("demo", describe_os_error(exc), status=1)
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
