"""What every command's parser shares: the help formatter, the argument types (each a
one-line error naming the value) and the positional logs of the commands that read them."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from omnitrace.config import ConfigError

__all__ = [
    "HelpFormatter",
    "bounded",
    "count",
    "int_list",
    "int_range",
    "layers",
    "log_command",
    "mib",
    "model_size",
    "nonnegative_float",
    "port",
    "positive_float",
    "positive_int",
    "seed",
    "size",
    "size_list",
]


class HelpFormatter(argparse.HelpFormatter):
    """Append each option's default to its help, unless the help already says it."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        default = action.default
        if (
            default is None
            or default is False
            or default is argparse.SUPPRESS
            or "(default" in text
            or not action.option_strings
        ):
            return text
        return f"{text} (default: %(default)s)"


_N = TypeVar("_N", int, float)


def bounded(
    convert: Callable[[str], _N], label: str, accept: Callable[[_N], bool]
) -> Callable[[str], _N]:
    """Return an argparse type that converts with ``convert`` and checks ``accept``."""

    def parse(text: str) -> _N:
        shown = repr(text) if len(text) <= 40 else f"{text[:20]!r}... ({len(text)} characters)"
        try:
            value = convert(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {label}, got {shown}") from None
        if not accept(value):
            raise argparse.ArgumentTypeError(f"expected {label}, got {shown}")
        return value

    return parse


def int_range(low: int, high: int, label: str) -> Callable[[str], int]:
    return bounded(int, f"{label} from {low} to {high}", lambda v: low <= v <= high)


positive_int = bounded(int, "a positive integer", lambda v: v >= 1)
positive_float = bounded(float, "a positive number", lambda v: v > 0)
nonnegative_float = bounded(float, "a nonnegative number", lambda v: v >= 0)
port = bounded(int, "a port in [0, 65535]", lambda v: 0 <= v <= 65535)
# Bounds say what the numbers mean: counts within what a run can reach, model sizes a CPU
# can hold, simulated MiB whose byte count fits the int64 of exported metrics.
count = int_range(0, 10**12, "an integer")
model_size = int_range(1, 16384, "an integer")
layers = int_range(1, 256, "an integer")
mib = int_range(0, (1 << 43) - 1, "a number of MiB")
seed = int_range(0, (1 << 63) - 1, "an integer")


def int_list(low: int, high: int) -> Callable[[str], list[int]]:
    """Return an argparse type for comma-separated integers from ``low`` to ``high``."""
    one = int_range(low, high, "integers")

    def parse(text: str) -> list[int]:
        return [one(part.strip()) for part in text.split(",")]

    return parse


def size(text: str) -> int:
    from omnitrace.advise import parse_size

    try:
        return parse_size(text)
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def size_list(text: str) -> list[int]:
    return [size(part) for part in text.split(",")]


def log_command(
    commands: argparse._SubParsersAction[argparse.ArgumentParser],
    name: str,
    *,
    help: str,
    description: str,
) -> argparse.ArgumentParser:
    """Add a command that reads JSONL event logs, given as its positional arguments."""
    command = commands.add_parser(
        name, help=help, description=description, formatter_class=HelpFormatter
    )
    command.add_argument(
        "paths",
        nargs="+",
        type=Path,
        metavar="EVENTS.jsonl",
        help="event logs (--events-log of the demo, OMNITRACE_EVENTS_LOG of the vLLM plugin; "
        "a worker's log per rank); a quoted pattern such as 'events-*.jsonl' is expanded "
        "here, and the rotated files of a log (.1, .2, ...) are read with it",
    )
    return command
