"""The ``omnitrace`` command: ``demo``, ``top``, ``replay``, ``advise``, ``receive``,
``trace``, ``config`` and ``completion``.

``omnitrace demo`` runs MiniCPM-o-shaped encoders under graph adapters with every sink
attached; ``omnitrace top`` shows (or follows) the event log a serving process writes;
``omnitrace replay`` feeds a recorded log into the live view or into OTLP; ``omnitrace
advise`` replays recorded traffic under other graph settings and recommends one;
``omnitrace receive`` listens for OTLP exports and says what arrives; ``omnitrace trace``
shows one request's phases; ``omnitrace config`` prints every setting in force and where it
came from; ``omnitrace completion`` prints a bash or zsh completion script.

The package holds a module per command (``demo.py``, ``top.py``, ``replay.py``, ``advise.py``,
``receive.py``, ``trace.py``, ``config.py``, ``completion.py``), each with its own options
(``add_<command>_parser``, which sets the command's handler) beside its work; the parser
that gathers them (``parser.py``) and what they share (``options.py``: the help formatter and
the argument types); what the commands print (``output.py``, the stats table in
``tables.py``), the follow plumbing (``follow.py``: polling, keys, SIGTERM and Ctrl-C, stop
conditions) and the export settings (``export.py``). ``main`` is the console entry point
(``omnitrace.cli:main``).
"""

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
