"""What the commands print: status lines and errors on stderr, with control characters escaped;
results and JSON (NaN and Infinity as null) on stdout."""

from __future__ import annotations

import json
import math
import sys
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rich.console import Console

__all__ = ["PROG", "command_error", "_print_json", "_say", "_stdout_console"]

PROG = "omnitrace"


def _stdout_console() -> Console:
    from rich.console import Console

    console = Console(file=sys.stdout, highlight=False)
    if not console.is_terminal:
        # Piped or captured output has no width; 80 columns would squash the stats table.
        console = Console(file=sys.stdout, highlight=False, width=140)
    return console


def _say(message: str) -> None:
    from omnitrace._display import safe

    # Status lines go to stderr, so stdout carries only the results. They quote paths and
    # log text: control characters are shown escaped, never sent to the terminal.
    print(f"{PROG}: {safe(message)}", file=sys.stderr, flush=True)


def command_error(command: str, message: str, status: int = 2) -> int:
    from omnitrace._display import safe

    print(f"{PROG} {command}: error: {safe(message)}", file=sys.stderr, flush=True)
    return status


def _print_json(data: Any) -> None:
    # JSON has no NaN or Infinity (json.dumps would print them anyway): they print as null.
    print(json.dumps(_finite(data), indent=2, allow_nan=False))


def _finite(data: Any) -> Any:
    """``data`` with every NaN and infinite float replaced by None."""
    if isinstance(data, float):
        return data if math.isfinite(data) else None
    if isinstance(data, dict):
        return {key: _finite(value) for key, value in data.items()}
    if isinstance(data, (list, tuple)):
        return [_finite(value) for value in data]
    return data
