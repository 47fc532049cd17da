"""The bus and its process: what happens to live buses at fork(), at exit and on SIGTERM."""

from __future__ import annotations

import atexit
import logging
import os
import signal
import threading
import time
import weakref
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING

from omnitrace.bus._runner import CLOSE_GRACE_S

if TYPE_CHECKING:
    from omnitrace.bus._bus import EventBus

__all__ = [
    "EXIT_TIMEOUT_S",
    "install_close_on_signal",
    "register_atexit",
    "track_forks",
    "unregister_atexit",
]

logger = logging.getLogger(__name__)

#: The bound of the close run by the exit handler: one for all the buses of the process,
#: which close side by side (plus :data:`~omnitrace.bus._runner.CLOSE_GRACE_S`).
EXIT_TIMEOUT_S = 2.0
#: How often a signal handler tries again for a moment when the bus lock is not free.
_SIGNAL_RETRIES = 100
_LOGGING_DIR = str(Path(logging.__file__).parent)

_BUSES: weakref.WeakSet[EventBus] = weakref.WeakSet()


def track_forks(bus: EventBus) -> None:
    """Have ``bus`` told when this process forks (in the child), for as long as it lives."""
    _BUSES.add(bus)


def _after_fork_in_child() -> None:
    for bus in list(_BUSES):
        bus._after_fork_in_child()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


# The buses still open, which the one exit handler closes together.
_OPEN: weakref.WeakSet[EventBus] = weakref.WeakSet()


def register_atexit(bus: EventBus) -> None:
    """Have ``bus`` closed at exit, with every other open bus, within one bound."""
    # A weak set: registering must not keep every bus alive until exit.
    _OPEN.add(bus)


def unregister_atexit(bus: EventBus) -> None:
    """Leave ``bus``, now closed, out of the exit handler's close."""
    _OPEN.discard(bus)


def _close_at_exit() -> None:
    buses = list(_OPEN)
    if buses:
        # One close for all of them: each closing on its own would add its bound to exit.
        type(buses[0])._close_all_at_exit(buses, EXIT_TIMEOUT_S)


# Registered once, on import (before the adapters' handler, so it runs after it: events an
# adapter emits while it closes still reach the sinks).
atexit.register(_close_at_exit)


def install_close_on_signal(bus: EventBus, signum: int, timeout: float) -> Callable[[], None]:
    """Install the handler of :meth:`EventBus.close_on_signal`; return its restore function.

    Raises:
        ValueError: called from a thread other than the main thread.
    """
    previous = signal.getsignal(signum)
    if previous is signal.SIG_IGN:
        return lambda: None
    phase = [0]  # 0 armed, 1 closing, 2 closed
    retries = [0]

    def chain(frame: FrameType | None) -> None:
        if callable(previous):
            previous(signum, frame)
            return
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)

    def close_and_report(resend: bool) -> None:
        _close_for_signal(bus, signum, timeout)
        phase[0] = 2
        if resend:
            os.kill(os.getpid(), signum)

    def handler(received: int, frame: FrameType | None) -> None:
        if phase[0]:
            chain(frame)
            return
        # The close runs on a helper thread while this (the main) thread waits in here,
        # so the main thread emits nothing more meanwhile. But the signal may have
        # interrupted it holding the bus lock or a logging lock the close needs: then
        # try again a moment later, at another point of its code.
        busy = not _lock_is_free(bus._lock) or _interrupted_inside(frame, _LOGGING_DIR)
        if busy and retries[0] < _SIGNAL_RETRIES:
            retries[0] += 1
            threading.Timer(0.001, os.kill, (os.getpid(), signum)).start()
            return
        phase[0] = 1
        # Still busy: do not wait; the closer re-sends the signal when it is done.
        closer = threading.Thread(
            target=close_and_report, args=(busy,), name="omnitrace-bus-signal", daemon=True
        )
        closer.start()
        if busy:
            return
        closer.join(timeout + CLOSE_GRACE_S + 1.0)
        chain(frame)

    signal.signal(signum, handler)

    def restore() -> None:
        if signal.getsignal(signum) is handler:
            signal.signal(signum, previous if previous is not None else signal.SIG_DFL)

    return restore


def _lock_is_free(lock: threading.Lock) -> bool:
    """Whether nobody, this thread included, holds ``lock`` right now."""
    if not lock.acquire(blocking=False):
        return False
    lock.release()
    return True


def _interrupted_inside(frame: FrameType | None, directory: str) -> bool:
    """Whether ``frame`` or a caller of it runs code from ``directory``."""
    while frame is not None:
        if frame.f_code.co_filename.startswith(directory):
            return True
        frame = frame.f_back
    return False


def _close_for_signal(bus: EventBus, signum: int, timeout: float) -> None:
    start = time.monotonic()
    try:
        bus.close(timeout)
    except Exception:
        logger.exception("EventBus.close() on %s failed", signal.Signals(signum).name)
        return
    stats = bus.statistics()
    parts = []
    for sink in stats.sinks:
        reasons = ", ".join(f"{k} {v}" for k, v in sorted(sink.dropped_by.items()))
        parts.append(
            f"{sink.name}: delivered {sink.delivered}, lost {sink.dropped}"
            + (f" ({reasons})" if reasons else "")
        )
    logger.warning(
        "EventBus closed on %s in %.2f s; %d events emitted; %s",
        signal.Signals(signum).name,
        time.monotonic() - start,
        stats.emitted,
        "; ".join(parts) or "no sinks",
    )
