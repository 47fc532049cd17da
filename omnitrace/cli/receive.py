"""``omnitrace receive``: a loopback OTLP receiver that says what arrives."""

from __future__ import annotations

import argparse
import sys
import threading

from omnitrace.cli.follow import _sigterm_stops
from omnitrace.cli.output import _error, _say

__all__ = ["_cmd_receive"]


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
