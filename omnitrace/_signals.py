"""SIGTERM as a request to stop: the long-running commands end as Ctrl-C ends them."""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator

__all__ = ["signals_set", "sigterm_sets", "stops_set"]


@contextlib.contextmanager
def signals_set(stop: threading.Event, *signums: int, enabled: bool = True) -> Iterator[None]:
    """While the block runs, each of ``signums`` sets ``stop`` instead of its default action.

    The previous handlers are restored after the block. Off the main thread no handler can
    be set, and nothing is changed; nor when ``enabled`` is false.
    """
    if not enabled or threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {signum: signal.signal(signum, lambda *_: stop.set()) for signum in signums}
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


@contextlib.contextmanager
def sigterm_sets(stop: threading.Event, *, enabled: bool = True) -> Iterator[None]:
    """While the block runs, SIGTERM sets ``stop`` instead of killing the process.

    Supervisors and sidecar runners stop a process with SIGTERM: the command then finishes as
    after Ctrl-C (its final frame or table still prints, its children are stopped), and one
    that arrives during that ending does not cut it short. See :func:`signals_set`.
    """
    with signals_set(stop, signal.SIGTERM, enabled=enabled):
        yield


@contextlib.contextmanager
def stops_set(stop: threading.Event, *, enabled: bool = True) -> Iterator[None]:
    """While the block runs, SIGTERM and Ctrl-C (SIGINT) both set ``stop``.

    For loops that check ``stop`` between two steps: Ctrl-C then ends the loop there, never
    as a ``KeyboardInterrupt`` raised inside a read, a bus's lock or a child's wait, which
    can leave a lock held and the ending hung. One more Ctrl-C during the ending (bounded
    by its own timeouts) does not cut it short. See :func:`signals_set`.
    """
    with signals_set(stop, signal.SIGTERM, signal.SIGINT, enabled=enabled):
        yield
