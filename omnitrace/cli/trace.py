"""``omnitrace trace``: one request's way to its first token, as a tree, from the event logs."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import omnitrace.cli.options as opt
from omnitrace.cli.output import _print_json, command_error

__all__ = ["_cmd_trace", "add_trace_parser"]


def add_trace_parser(commands: Any) -> None:
    """Add ``trace`` to the command line's subcommands."""
    command = commands.add_parser(
        "trace",
        help="one request's phases and encoder calls, as a tree",
        description=(
            "Print where one request's time went up to its first token: its phases (HTTP, "
            "renderer, processor, queue, encoders, prefill, output) and every encoder call "
            "that served it, joined across the logs of vLLM's processes by the request id. "
            "Give the logs of every process (the API server's and the workers'), e.g. "
            "'events-*.jsonl'. Needs the vLLM plugin's request timing (on unless "
            "OMNITRACE_REQUESTS=0). See docs/operations.md, 'Why is my TTFT high?'."
        ),
        formatter_class=opt.HelpFormatter,
    )
    command.add_argument(
        "request_id",
        metavar="REQUEST_ID",
        help="the request id clients see (chatcmpl-...) or the engine's id of it",
    )
    command.add_argument(
        "paths",
        nargs="+",
        type=Path,
        metavar="EVENTS.jsonl",
        help="event logs (OMNITRACE_EVENTS_LOG) of every vLLM process; patterns are expanded",
    )
    command.add_argument("--json", action="store_true", help="print the request as JSON")
    command.set_defaults(handler=_cmd_trace)


def _ms(seconds: float | None) -> str:
    return "n/a" if seconds is None else f"{seconds * 1e3:.1f} ms"


def _lines(view: Any) -> list[str]:
    from omnitrace._display import safe
    from omnitrace.requests import PHASES

    data = view.as_dict()
    head = (
        f"request {safe(data['request_id'])} (engine id {safe(data['engine_request_id'])}) · "
        f"{data['kind']}"
    )
    if data["image_pixels"]:
        head += f" · {data['image_pixels']:,} px"
    if data["audio_s"]:
        head += f" · {data['audio_s']:.2f} s audio"
    head += f" · TTFT {_ms(data['ttft_s'])}"
    if data["trace_id"]:
        head += f" · trace {safe(data['trace_id'])}"
    lines = [head]
    shown = [p for p in PHASES if data["phases"][p] > 0 or p in ("encoders", "prefill")]
    for i, phase in enumerate(shown):
        last = i == len(shown) - 1
        share = data["phases"][phase] / data["ttft_s"] if data["ttft_s"] > 0 else 0.0
        lines.append(
            f"{'└─' if last else '├─'} {phase:<10} {_ms(data['phases'][phase]):>10}  {share:6.1%}"
        )
        if phase != "encoders":
            continue
        stem = "   " if last else "│  "
        steps = data["encoder_steps"]
        for j, step in enumerate(steps):
            end = j == len(steps) - 1
            lines.append(
                f"{stem}{'└─' if end else '├─'} step at +{_ms(step['start_offset_s'])}: "
                f"{_ms(step['duration_s'])}, {step['modalities']}, {step['requests']} "
                f"request(s), own share {step['share']:.0%}, pid {step['pid']}"
            )
            inner = stem + ("   " if end else "│  ")
            calls = step["calls"]
            for k, call in enumerate(calls):
                lines.append(
                    f"{inner}{'└─' if k == len(calls) - 1 else '├─'} {safe(call['encoder'])} "
                    f"{call['outcome']} {_ms(call['host_s'])} host · {safe(call['key'])}"
                )
        if not steps:
            lines.append(f"{stem}└─ no encoder step (text only, or items cached)")
    return lines


def _cmd_trace(args: argparse.Namespace) -> int:
    from omnitrace.eventlog.chunks import LogReadError, read_logs
    from omnitrace.requests import RequestJoin

    join = RequestJoin(calls=True, only={args.request_id})
    try:
        for _, chunk in read_logs(args.paths):
            for record in chunk:
                join.add(record.item, record.pid)
    except LogReadError as exc:
        return command_error("trace", str(exc), exc.status)
    views = join.requests()
    if not views:
        return command_error(
            "trace",
            f"no request {args.request_id!r} in {', '.join(str(p) for p in args.paths)} "
            "(give the API server's log too; request timing needs the vLLM plugin)",
            1,
        )
    if args.json:
        _print_json([view.as_dict() for view in views])
        return 0
    for view in views:
        print("\n".join(_lines(view)))
    return 0
