"""The ``omnitrace`` command: ``main``, its console entry point (``omnitrace.cli:main``), and
a module per command beside it: ``demo``, ``top``, ``replay``, ``advise``, ``receive``,
``trace``, ``config`` and ``completion``."""

from __future__ import annotations

from collections.abc import Sequence

from omnitrace.cli.output import command_error
from omnitrace.cli.parser import build_parser
from omnitrace.cli.tables import stats_table
from omnitrace.config import OmnitraceError

__all__ = ["main", "stats_table"]


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``omnitrace`` command line; return the exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "paths", None) is not None:
        from omnitrace.eventlog.patterns import expand

        # Patterns a shell did not expand ('events-*.jsonl', quoted): the logs they match.
        args.patterns, args.paths = args.paths, expand(args.paths)
    try:
        return int(args.handler(args))
    except OmnitraceError as exc:  # a bad value or path: one line, not a traceback
        return command_error(args.command, str(exc))
    except OSError as exc:  # a file that cannot be opened: "PATH: REASON", as the checks say
        from omnitrace._paths import describe_os_error

        return command_error(args.command, describe_os_error(exc))
