"""``omnitrace receive``: a loopback OTLP receiver that says what arrives."""

from __future__ import annotations

import argparse
import math
import signal
import sys
import threading
from collections.abc import Callable
from typing import Any

import omnitrace.cli.options as opt
from omnitrace._signals import signals_set
from omnitrace.cli.output import _say, command_error

__all__ = ["HOST_HELP", "add_limit_options", "add_receive_parser", "_cmd_receive"]

#: What ``--host`` says in ``--help``: what listening beyond loopback exposes.
HOST_HELP = (
    "the address to listen on. The default, loopback, takes exports from this machine only; "
    "--host 0.0.0.0 (or ::) takes them from anyone who can reach the port, unauthenticated "
    "and unencrypted, and prints the span, metric and log names they send: use it only on a "
    "network you trust, and keep the limits below"
)


def _size(text: str) -> int:
    from omnitrace.advise import parse_size
    from omnitrace.errors import ConfigError

    try:
        size = parse_size(text)
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    if size < 1:
        raise argparse.ArgumentTypeError(f"expected a size of at least 1 byte, got {text!r}")
    return size


def _seconds(text: str) -> float:
    try:
        seconds = float(text)
    except ValueError:
        seconds = math.nan
    if not 0 < seconds <= 86400:
        shown = text if len(text) <= 40 else text[:40] + "..."
        raise argparse.ArgumentTypeError(
            f"expected a number of seconds above 0, at most 86400, got {shown!r}"
        )
    return seconds


def _count(high: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = 0
        if not 1 <= value <= high:
            shown = text if len(text) <= 40 else text[:40] + "..."
            raise argparse.ArgumentTypeError(f"expected an integer from 1 to {high}, got {shown!r}")
        return value

    return parse


def add_limit_options(receive: argparse.ArgumentParser) -> None:
    """Add the options that bound what one request and the connections may cost.

    Their defaults are :data:`~omnitrace.otlp_receiver.DEFAULT_LIMITS` and
    :data:`~omnitrace.receive.DEFAULT_MAX_NAMES`, written out: building the parser imports
    neither (nor the protobufs they need), so ``--help`` answers at once. The sizes'
    defaults are numbers, not text, so that the size parser (and what it imports) is
    loaded only for a size given on the command line.
    """
    limits = receive.add_argument_group(
        "limits",
        "What a sender may cost: a body past a size limit is answered 413 without being kept "
        "or inflated further; a connection past --max-connections is answered 503; a slow or "
        "silent one is closed; a bad Content-Length is answered 400. Each refusal is printed "
        "and counted in the summary.",
    )
    limits.add_argument(
        "--max-body",
        type=_size,
        default=16 << 20,
        metavar="SIZE",
        help="the largest request body, as sent (gRPC: the largest message), e.g. 4MiB "
        "(default: 16MiB)",
    )
    limits.add_argument(
        "--max-decompressed",
        type=_size,
        default=64 << 20,
        metavar="SIZE",
        help="the largest body once a gzip or deflate body is inflated (a step at a time) "
        "(default: 64MiB)",
    )
    limits.add_argument(
        "--header-timeout",
        type=_seconds,
        default=10.0,
        metavar="SECONDS",
        help="seconds from a request's first byte to the end of its headers",
    )
    limits.add_argument(
        "--idle-timeout",
        type=_seconds,
        default=30.0,
        metavar="SECONDS",
        help="seconds a connection may stay silent, before or within a request",
    )
    limits.add_argument(
        "--max-connections",
        type=_count(10_000),
        default=32,
        metavar="N",
        help="HTTP connections served at once (one thread and at most one body each; gRPC: "
        "calls at once)",
    )
    limits.add_argument(
        "--max-names",
        type=_count(10_000_000),
        default=1000,
        metavar="N",
        help="distinct names per signal counted by name (and services listed); later ones "
        "are counted together",
    )


def _cmd_receive(args: argparse.Namespace) -> int:
    from omnitrace.errors import ConfigError
    from omnitrace.otlp_receiver import ReceiverLimits
    from omnitrace.receive import DEFAULT_PORTS, receive

    port = DEFAULT_PORTS[args.protocol] if args.port is None else args.port
    try:
        limits = ReceiverLimits(
            max_body_bytes=args.max_body,
            max_decompressed_bytes=args.max_decompressed,
            header_timeout_s=args.header_timeout,
            idle_timeout_s=args.idle_timeout,
            max_connections=args.max_connections,
        )
    except ConfigError as exc:
        return command_error("receive", str(exc), 2)
    stop = threading.Event()
    try:
        # Ctrl-C sets stop as SIGTERM does: the receiver ends at its next look at stop,
        # not wherever KeyboardInterrupt happens to land.
        with signals_set(stop, signal.SIGTERM, signal.SIGINT):
            tally = receive(
                protocol=args.protocol,
                host=args.host,
                port=port,
                as_json=args.json,
                duration_s=args.duration,
                stop=stop,
                out=sys.stdout,
                say=_say,
                limits=limits,
                max_names=args.max_names,
            )
    except OSError as exc:  # the port is taken, or the address is not this machine's
        return command_error(
            "receive", f"cannot listen on {args.host}:{port}: {exc.strerror or exc}", 1
        )
    if tally.empty and tally.refused:
        return command_error(
            "receive", "nothing was taken: every request was refused (see above)", 1
        )
    if tally.empty:
        return command_error("receive", "nothing arrived: no exporter sent here", status=1)
    return 0


def add_receive_parser(commands: Any) -> None:
    """Add ``receive`` to the command line's subcommands."""
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
        formatter_class=opt.HelpFormatter,
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
        help=HOST_HELP,
    )
    receive.add_argument(
        "--port",
        type=opt.port,
        default=None,
        metavar="PORT",
        help="the port to listen on (default: 4318 for http/protobuf, 4317 for grpc, the "
        "exporters' defaults; 0: a free one, printed)",
    )
    receive.add_argument(
        "--duration",
        type=opt.positive_float,
        default=None,
        metavar="SECONDS",
        help="stop after this many seconds (default: until Ctrl-C or SIGTERM)",
    )
    receive.add_argument(
        "--json", action="store_true", help="print a JSON line per request, and the summary"
    )
    add_limit_options(receive)
    receive.set_defaults(handler=_cmd_receive)
