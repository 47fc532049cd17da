"""SIGTERM and Ctrl-C as requests to stop (``omnitrace._signals``), shared by follow,
receive, the demo and its ranks."""

from __future__ import annotations

import os
import signal
import threading
from pathlib import Path

import pytest

from omnitrace._signals import sigterm_sets, stops_set
from omnitrace.eventlog import read_records


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


def test_stops_set_takes_ctrl_c_and_sigterm_and_gives_both_back() -> None:
    before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    for signum in (signal.SIGINT, signal.SIGTERM):
        stop = threading.Event()
        with stops_set(stop):
            os.kill(os.getpid(), signum)  # no KeyboardInterrupt: the event is set instead
            assert stop.wait(5)
    assert {s: signal.getsignal(s) for s in before} == before


def test_ctrl_c_ends_the_demo_between_two_requests(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """SIGINT during an endless demo: the traffic ends, the run closes its log and reports
    (exit 130), and the Ctrl-C handler from before the run is back afterwards."""
    from omnitrace.cli import main

    # Ctrl-C's handler before the run: Python's own, or SIG_IGN where the suite was started
    # in the background by a shell without job control.
    before = signal.getsignal(signal.SIGINT)
    log = tmp_path / "events.jsonl"
    timer = threading.Timer(1.5, os.kill, (os.getpid(), signal.SIGINT))
    timer.start()
    try:
        status = main(
            [
                *("demo", "--cpu", "--no-tui", "--requests", "0", "--duration", "60"),
                *("--rate", "50", "--events-log", str(log)),
            ]
        )
    finally:
        timer.cancel()
    assert status == 130
    err = capsys.readouterr().err
    assert "omnitrace: interrupted after" in err, err
    assert signal.getsignal(signal.SIGINT) is before
    finals = [r for r in read_records(log) if hasattr(r.item, "info")]
    assert finals  # the log was closed by the run
