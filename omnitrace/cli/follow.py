"""Following logs as they grow (``top --follow``, ``replay --follow``) and how a follow stops:
its duration, q, Ctrl-C or SIGTERM, a watched process's exit or standard input's end."""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import IO

from omnitrace._signals import stops_set as _signal_stops
from omnitrace.cli.output import _say, command_error

__all__ = [
    "FOLLOW_POLL_S",
    "_exited",
    "_follow",
    "_followable",
    "_signal_stops",
    "_unmatched_patterns",
]

#: Seconds between two reads of a followed log (``top --follow``, ``replay --follow``).
FOLLOW_POLL_S = 0.1


def _keys_off(seconds: float) -> str:
    time.sleep(seconds)
    return ""


@contextlib.contextmanager
def _keys() -> Iterator[Callable[[float], str]]:
    """Yield ``wait(seconds)``, which returns the keys typed meanwhile ("" without a TTY)."""
    try:
        import select
        import termios
        import tty
    except ImportError:  # not a POSIX terminal: Ctrl-C only
        posix = False
    else:
        posix = True
    if not posix or not sys.stdin.isatty():
        yield _keys_off
        return
    fd = sys.stdin.fileno()
    saved = termios.tcgetattr(fd)
    # Keys arrive one at a time and unechoed; Ctrl-C still raises KeyboardInterrupt.
    tty.setcbreak(fd)

    def wait(seconds: float) -> str:
        ready, _, _ = select.select([fd], [], [], seconds)
        return os.read(fd, 64).decode(errors="replace") if ready else ""

    try:
        yield wait
    finally:
        termios.tcsetattr(fd, termios.TCSADRAIN, saved)


def _followable(command: str, paths: Sequence[Path]) -> int | None:
    """Refuse what is not a regular file (return the exit status); say which logs are
    waited for."""
    import stat

    from omnitrace._files import kind_of
    from omnitrace._paths import check_readable

    for path in paths:
        try:
            mode = os.stat(path).st_mode
        except FileNotFoundError:
            if _is_pattern(path):
                # A shell passes a pattern that matches no file as it is: waiting for a file
                # literally named with a '*' would wait forever.
                return _unmatched(command, path)
            _say(f"waiting for {path} to appear")
            continue
        if not stat.S_ISREG(mode):
            # A named pipe would block the follow in open(), past q, Ctrl-C and SIGTERM.
            return command_error(command, f"{path}: is {kind_of(mode)}, not an event log")
        check_readable(path)
    return None


def _is_pattern(path: Path) -> bool:
    """Whether ``path``'s name is a pattern (``*``, ``?`` or ``[`` in it)."""
    return any(char in path.name for char in "*?[")


def _unmatched(command: str, path: Path) -> int:
    """Say that the pattern ``path`` matches no file (exit status 2)."""
    return command_error(
        command,
        f"{path}: no file matches this pattern (a pattern that matches nothing "
        "reaches omnitrace unexpanded; name the log, which may not exist yet)",
    )


def _unmatched_patterns(command: str, paths: Sequence[Path]) -> int | None:
    """Refuse a recorded log's pattern that matches no file, as a follow does."""
    for path in paths:
        if _is_pattern(path) and not path.exists():
            return _unmatched(command, path)
    return None


def _exited(pid: int, parent: int) -> bool:
    """Whether process ``pid`` is gone (for our parent: whether we were handed to another)."""
    if pid == parent and os.getppid() != parent:
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False  # it exists, under another user
    try:  # Linux: an exited process its parent has not reaped yet is a zombie
        with open(f"/proc/{pid}/stat", "rb") as stat:
            return stat.read().rsplit(b")", 1)[-1].split()[0] == b"Z"
    except (OSError, IndexError):
        return False


def _closed(stream: IO[str] | None) -> bool:
    """Whether the pipe behind ``stream`` reached its end (without blocking)."""
    import select

    if stream is None:
        return True  # no standard input at all
    try:
        fd = stream.fileno()
        if not select.select([fd], [], [], 0)[0]:
            return False
        return os.read(fd, 4096) == b""
    except (OSError, ValueError):
        return True  # no standard input at all


def _follow(
    poll: Callable[[], object],
    duration: float | None,
    stop: threading.Event,
    *,
    keys: bool,
    until_exit: int | None = None,
    stdin_stops: bool = False,
) -> None:
    """Call ``poll`` every FOLLOW_POLL_S until ``duration`` passed, q is typed (``keys``),
    Ctrl-C, ``stop`` is set (SIGTERM), process ``until_exit`` ended or (``stdin_stops``)
    standard input closed."""
    deadline = None if duration is None else time.monotonic() + duration
    parent = os.getppid()
    try:
        with _keys() if keys else contextlib.nullcontext(_keys_off) as wait:
            while not stop.is_set() and (deadline is None or time.monotonic() < deadline):
                poll()
                if "q" in wait(FOLLOW_POLL_S).lower():
                    break
                if until_exit is not None and _exited(until_exit, parent):
                    break
                if stdin_stops and _closed(sys.stdin):
                    break
    except KeyboardInterrupt:
        pass  # Ctrl-C is one way a follow ends.
