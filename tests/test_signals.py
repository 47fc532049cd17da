"""SIGTERM as a request to stop (``omnitrace._signals``), shared by follow, receive and the
demo's ranks."""

from __future__ import annotations

import os
import signal
import threading

from omnitrace._signals import sigterm_sets


def test_sigterm_sets_the_event_and_the_previous_handler_comes_back() -> None:
    seen: list[int] = []
    previous = signal.signal(signal.SIGTERM, lambda signum, _frame: seen.append(signum))
    try:
        stop = threading.Event()
        with sigterm_sets(stop):
            os.kill(os.getpid(), signal.SIGTERM)
            assert stop.wait(5)
        assert seen == []
        os.kill(os.getpid(), signal.SIGTERM)
        assert seen == [signal.SIGTERM]
    finally:
        signal.signal(signal.SIGTERM, previous)


def test_disabled_or_off_the_main_thread_nothing_is_changed() -> None:
    before = signal.getsignal(signal.SIGTERM)
    with sigterm_sets(threading.Event(), enabled=False):
        assert signal.getsignal(signal.SIGTERM) is before
    inside: list[object] = []

    def worker() -> None:
        with sigterm_sets(threading.Event()):
            inside.append(signal.getsignal(signal.SIGTERM))

    thread = threading.Thread(target=worker)
    thread.start()
    thread.join()
    assert inside == [before]
