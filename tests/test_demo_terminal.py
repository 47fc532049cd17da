"""SIGTERM during the demo's live view: the terminal is given back and the bus's line kept."""

from __future__ import annotations

import json
import os
import select
import signal
import sys
import time
from pathlib import Path

import pytest

pty = pytest.importorskip("pty")
import fcntl  # noqa: E402  (POSIX only, as pty)
import struct  # noqa: E402
import termios  # noqa: E402

HIDE_CURSOR = b"\x1b[?25l"
SHOW_CURSOR = b"\x1b[?25h"
CLOSED = "EventBus closed on SIGTERM in "


def _demo_on_a_terminal(tmp_path: Path, *extra: str) -> tuple[bytes, int]:
    """Run the demo's live view on a 100x30 pseudo-terminal, SIGTERM it once events flow."""
    events = tmp_path / "events.jsonl"
    argv = [
        sys.executable, "-m", "omnitrace", "demo", "--requests", "0", "--duration", "60",
        "--events-log", str(events), *extra,
    ]  # fmt: skip
    pid, fd = pty.fork()
    if pid == 0:  # pragma: no cover - the child
        os.environ.update(TERM="xterm-256color", COLUMNS="100", LINES="30")
        os.execv(sys.executable, argv)
    fcntl.ioctl(fd, termios.TIOCSWINSZ, struct.pack("HHHH", 30, 100, 0, 0))
    out = b""
    deadline = time.monotonic() + 90
    signalled = False
    while time.monotonic() < deadline:
        if not signalled and events.exists() and events.stat().st_size > 20_000:
            os.kill(pid, signal.SIGTERM)
            signalled = True
        ready, _, _ = select.select([fd], [], [], 0.05)
        if ready:
            try:
                data = os.read(fd, 1 << 16)
            except OSError:
                break
            if not data:
                break
            out += data
    else:  # pragma: no cover - a hang is the failure
        os.kill(pid, signal.SIGKILL)
    _, status = os.waitpid(pid, 0)
    os.close(fd)
    assert signalled, out[-2000:]
    return out, status


def test_sigterm_in_the_live_view_shows_the_cursor_again_and_the_closing_line(
    tmp_path: Path,
) -> None:
    """The cursor the view hid is shown again, and the bus's line is the terminal's last."""
    out, status = _demo_on_a_terminal(tmp_path)
    assert os.WIFSIGNALED(status)
    assert os.WTERMSIG(status) == signal.SIGTERM
    assert out.count(HIDE_CURSOR) >= 1
    # Shown again after the last time it was hidden.
    assert out.rfind(SHOW_CURSOR) > out.rfind(HIDE_CURSOR)
    after_view = out[out.rfind(SHOW_CURSOR) :].decode(errors="replace")
    closing = [line for line in after_view.splitlines() if CLOSED in line]
    assert len(closing) == 1
    assert closing[0].startswith("omnitrace demo: EventBus closed on SIGTERM in ")
    assert "jsonl: delivered " in closing[0]


def test_sigterm_in_the_live_view_writes_the_closing_line_to_the_log_file(
    tmp_path: Path,
) -> None:
    """With --log-file, the bus's closing line is one JSON line of that file, too."""
    log = tmp_path / "demo.log"
    out, status = _demo_on_a_terminal(tmp_path, "--log-file", str(log))
    assert os.WIFSIGNALED(status)
    assert os.WTERMSIG(status) == signal.SIGTERM
    records = [json.loads(line) for line in log.read_text().splitlines()]
    closed = [r for r in records if str(r.get("event", "")).startswith(CLOSED)]
    assert len(closed) == 1
    assert closed[0]["level"] == "warning"
    assert out.rfind(SHOW_CURSOR) > out.rfind(HIDE_CURSOR)
    assert CLOSED.encode() in out[out.rfind(SHOW_CURSOR) :]
