"""What SIGTERM leaves on the demo's terminal: the live view taken down, the bus's last line
(docs/architecture.md, "The demo", says why a handler beneath the bus's is needed)."""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
import threading
from types import FrameType
from typing import Any

import structlog

from omnitrace._display import safe

__all__ = ["SigtermExit"]

#: The logger whose lines the bus writes on a signal (omnitrace.bus._process).
_BUS_LOGGER = "omnitrace.bus"


class _BusLines(logging.Handler):
    """Write the bus's log records to standard error (as Python's last-resort handler does),
    to the log file as structlog lines when there is one, and keep their text."""

    def __init__(self, log_file: bool) -> None:
        super().__init__(level=logging.WARNING)
        self.lines: list[str] = []
        self._log_file = log_file
        self._lock_lines = threading.Lock()

    def emit(self, record: logging.LogRecord) -> None:
        try:
            text = record.getMessage()
            with self._lock_lines:
                self.lines.append(text)
            sys.stderr.write(f"{text}\n")
            if self._log_file:
                # The message is the event: a log reader sees the words the terminal shows.
                structlog.get_logger(record.name).log(record.levelno, text)
        except Exception:
            self.handleError(record)

    def taken(self) -> list[str]:
        with self._lock_lines:
            lines, self.lines = self.lines, []
        return lines


class SigtermExit:
    """The SIGTERM handler beneath ``EventBus.close_on_signal`` for one demo run.

    Use as a context manager around the run, entered before ``close_on_signal`` is called
    (so that this is the handler it hands the signal to); set :attr:`view` while the live view
    is up. Outside the main thread it only passes the bus's lines on (Python takes signal
    handlers in the main thread only).

    Args:
        log_file: whether the demo's structlog lines go to a file (``--log-file``).
    """

    def __init__(self, *, log_file: bool = False) -> None:
        self.view: Any = None
        """The live view to take down (a context manager), or None."""
        self._lines = _BusLines(log_file)
        self._previous: Any = None
        self._installed = False

    def __enter__(self) -> SigtermExit:
        logging.getLogger(_BUS_LOGGER).addHandler(self._lines)
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGTERM, self._handle)
            self._installed = True
        return self

    def __exit__(self, *exc: object) -> None:
        logging.getLogger(_BUS_LOGGER).removeHandler(self._lines)
        if self._installed and signal.getsignal(signal.SIGTERM) is self._handle:
            previous = self._previous if self._previous is not None else signal.SIG_DFL
            signal.signal(signal.SIGTERM, previous)
        self._installed = False

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        view, self.view = self.view, None
        if view is not None:
            # A view that cannot be taken down cleanly must not keep the process alive.
            with contextlib.suppress(Exception):
                view.__exit__(None, None, None)
            stream = sys.stderr
            # The view's log tail went to the terminal as a count only: the bus's lines are
            # what the operator who stopped the run needs, so they are written out in full.
            if _isatty(stream):
                with contextlib.suppress(Exception):
                    for line in self._lines.taken():
                        stream.write(f"omnitrace demo: {safe(line)}\n")
                    stream.flush()
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)


def _isatty(stream: Any) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):
        return False
