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
``receive.py``, ``trace.py``, ``config.py``, ``completion.py``), the parser (``parser.py``),
what the commands print (``output.py``, the stats table in ``tables.py``), the follow plumbing
(``follow.py``: polling, keys, SIGTERM, stop conditions) and the export settings
(``export.py``). ``main`` is the console entry point (``omnitrace.cli:main``).
"""

from __future__ import annotations

from collections.abc import Sequence

from omnitrace.cli.advise import _cmd_advise
from omnitrace.cli.completion import _cmd_completion
from omnitrace.cli.config import _cmd_config
from omnitrace.cli.demo import _cmd_demo
from omnitrace.cli.output import _error
from omnitrace.cli.parser import _build_parser
from omnitrace.cli.receive import _cmd_receive
from omnitrace.cli.replay import _cmd_replay
from omnitrace.cli.tables import stats_table
from omnitrace.cli.top import _cmd_top
from omnitrace.cli.trace import _cmd_trace
from omnitrace.config import OmnitraceError

__all__ = ["main", "stats_table"]


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``omnitrace`` command line; return the exit status."""
    parser = _build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "paths", None) is not None:
        from omnitrace.eventlog.patterns import expand

        # Patterns a shell did not expand ('events-*.jsonl', quoted): the logs they match.
        args.patterns, args.paths = args.paths, expand(args.paths)
    if args.command == "completion":
        return _cmd_completion(args, parser)
    handlers = {
        "demo": _cmd_demo,
        "top": _cmd_top,
        "replay": _cmd_replay,
        "advise": _cmd_advise,
        "receive": _cmd_receive,
        "trace": _cmd_trace,
        "config": _cmd_config,
    }
    try:
        return int(handlers[args.command](args))
    except OmnitraceError as exc:  # a bad value or path: one line, not a traceback
        return _error(args.command, str(exc))
    except OSError as exc:  # a file that cannot be opened: "PATH: REASON", as the checks say
        from omnitrace._paths import describe_os_error

        return _error(args.command, describe_os_error(exc))
