"""The live view in the terminal: rich's ``Live`` drawing a board's snapshot four times a
second, whatever the event rate, and the log lines kept while it is up."""

from __future__ import annotations

import dataclasses
import io
import sys
import threading
from collections import deque
from typing import Any

from rich.console import Console, RenderableType
from rich.live import Live

from omnitrace.sinks.live.layout import Drawn, failed_frame, render
from omnitrace.sinks.live.model import Board

__all__ = ["REFRESH_PER_SECOND", "LiveView"]

REFRESH_PER_SECOND = 4.0


class LogTail(io.TextIOBase):
    """A text stream that keeps what is written to it while the live view is up.

    The view shows its last lines in place, and :meth:`lines` hands everything back
    afterwards, so log lines never print across the view and none is lost (beyond
    ``keep`` lines, the oldest are dropped and counted in :attr:`dropped`).
    """

    def __init__(self, keep: int = 10_000) -> None:
        super().__init__()
        self._lock = threading.Lock()
        self._lines: deque[str] = deque(maxlen=keep)
        self._partial = ""
        self.dropped = 0

    def writable(self) -> bool:
        return True

    def write(self, text: str) -> int:
        with self._lock:
            pieces = (self._partial + text).split("\n")
            self._partial = pieces.pop()
            for piece in pieces:
                if len(self._lines) == self._lines.maxlen:
                    self.dropped += 1
                self._lines.append(piece)
        return len(text)

    def recent(self, count: int) -> tuple[str, ...]:
        """Return the last ``count`` complete lines."""
        with self._lock:
            return tuple(self._lines)[-count:] if count else ()

    def lines(self) -> list[str]:
        """Return every line kept, the unfinished last one included."""
        with self._lock:
            return [*self._lines, *([self._partial] if self._partial else [])]


class LiveView:
    """Show ``render(board.snapshot())`` in the terminal, refreshed at a fixed rate.

    Use as a context manager around the work; leaving the block draws a final frame and
    restores the terminal (also on Ctrl-C). While the view is up, whatever is written to
    ``sys.stderr`` (log lines, warnings) goes into a :class:`LogTail`: the frame shows its
    last lines. When the view closes, they are written to stderr if it is redirected (a file,
    a pipe); on the view's own terminal one line says how many there were instead, so the
    final frame is not scrolled away.

    Args:
        board: what to show.
        console: where to draw (a terminal); default None (a new rich ``Console``).
        refresh_per_second: frames per second, whatever the event rate; default
            :data:`REFRESH_PER_SECOND` (4.0).
        log_hint: appended to that line (e.g. which option keeps the lines in a file);
            default "".
    """

    def __init__(
        self,
        board: Board,
        *,
        console: Console | None = None,
        refresh_per_second: float = REFRESH_PER_SECOND,
        log_hint: str = "",
    ) -> None:
        self._board = board
        self._log_hint = log_hint
        self._console = console if console is not None else Console()
        self.log = LogTail()
        self._stderr: Any = None
        self._stdout: Any = None
        self._live = Live(
            console=self._console,
            refresh_per_second=refresh_per_second,
            get_renderable=self._frame,
            # Stray prints to stdout go above the view; stderr is taken over in __enter__.
            redirect_stderr=False,
            redirect_stdout=True,
        )

    def _frame(self) -> RenderableType:
        # Called from rich's refresh thread: nothing a board or a text holds may end it.
        try:
            snapshot = dataclasses.replace(self._board.snapshot(), log=self.log.recent(3))
            return Drawn(render(snapshot, height=self._console.height))
        except Exception as exc:
            return failed_frame(exc)

    def __enter__(self) -> LiveView:
        self._stderr = sys.stderr
        self._stdout = sys.stdout
        sys.stderr = self.log
        try:
            self._live.start(refresh=True)
        except BaseException:
            sys.stderr = self._stderr
            sys.stdout = self._stdout
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            try:
                self._live.refresh()
            finally:
                # Stopping also puts back the sys.stdout Live redirected, so it runs whatever
                # the last refresh did.
                self._live.stop()
        finally:
            # And should stop itself fail, the streams are put back all the same.
            sys.stderr = self._stderr
            sys.stdout = self._stdout
            self._hand_back_logs()

    def _hand_back_logs(self) -> None:
        lines = self.log.lines()
        if not lines:
            return
        stream = self._stderr
        if _isatty(stream):
            count = len(lines) + self.log.dropped
            hint = self._log_hint
            stream.write(f"omnitrace: {count} log lines were shown in the live view{hint}\n")
        else:
            if self.log.dropped:
                lines.insert(0, f"({self.log.dropped} earlier log lines were dropped)")
            stream.write("\n".join(lines) + "\n")
        stream.flush()


def _isatty(stream: Any) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):
        return False
