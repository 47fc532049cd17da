"""EventBus: folds, bounded sink queues, failure isolation and lifecycle."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Sequence
from pathlib import Path

import pytest

from omnitrace import ConfigError, EventBus, GraphMissed, GraphReplayed, MissReason
from omnitrace.events import Event
from omnitrace.testing import capture_events, sig


def key(i: int) -> str:
    """A distinct signature text per index (negative indices too)."""
    return f"float32[{i}]" if i >= 0 else f"int64[{-i}]"


def replayed(i: int, adapter: str = "vision") -> GraphReplayed:
    return GraphReplayed(adapter, sig(key(i)), i, i, 0.0)


class ListSink:
    """Records every batch it receives."""

    def __init__(self, name: str = "list") -> None:
        self.name = name
        self.events: list[Event] = []
        self.closed = 0

    def handle(self, events: Sequence[Event]) -> None:
        self.events.extend(events)

    def close(self) -> None:
        self.closed += 1


class BlockingSink(ListSink):
    """Blocks inside handle() until released."""

    def __init__(self) -> None:
        super().__init__("blocking")
        self.release = threading.Event()
        self.entered = threading.Event()

    def handle(self, events: Sequence[Event]) -> None:
        self.entered.set()
        self.release.wait(10)
        super().handle(events)


class RaisingSink(ListSink):
    """Raises on its first batch."""

    def handle(self, events: Sequence[Event]) -> None:
        raise ValueError("sink is broken")


def test_folds_see_every_event_in_order() -> None:
    """A synchronous fold receives each emitted event, in order, before emit returns."""
    with EventBus() as bus, capture_events(bus) as seen:
        for i in range(5):
            bus.emit(replayed(i))
            assert seen[-1].key == key(i)
    assert [e.key for e in seen] == [key(i) for i in range(5)]


def test_bus_keeps_the_stats_fold() -> None:
    """The bus folds events into per-adapter stats."""
    with EventBus() as bus:
        bus.emit(replayed(0))
        bus.emit(GraphMissed("audio", sig("float32[1]"), 0, 0, MissReason.CAPACITY, "cap"))
        stats = bus.adapter_stats()
    assert stats["vision"].graph_hits == 1
    assert stats["audio"].capacity_misses == 1
    assert bus.statistics().emitted == 2


def test_sink_receives_all_events_in_order_after_flush() -> None:
    """flush() returns True once the sink has every event, in emission order."""
    sink = ListSink()
    bus = EventBus(sinks=[sink], drain_interval=5)
    for i in range(1000):
        bus.emit(replayed(i))
    assert bus.flush(timeout=5)
    assert [e.key for e in sink.events] == [key(i) for i in range(1000)]
    stats = bus.statistics().sinks[0]
    assert (stats.delivered, stats.dropped, stats.queued) == (1000, 0, 0)
    bus.close()
    assert sink.closed == 1


def test_full_queue_drops_and_counts_without_blocking(caplog: pytest.LogCaptureFixture) -> None:
    """A stuck sink loses events past its queue bound; emit never waits for it."""
    sink = BlockingSink()
    bus = EventBus(sinks=[sink], queue_size=10, drain_interval=0.01)
    bus.emit(replayed(-1))
    assert sink.entered.wait(5)  # the sink is now stuck inside handle()
    start = time.perf_counter()
    for i in range(500):
        bus.emit(replayed(i))
    elapsed = time.perf_counter() - start
    stats = bus.statistics().sinks[0]
    assert stats.dropped == 490
    assert stats.queued == 11  # ten queued plus the batch stuck in handle()
    assert elapsed < 2.0  # a blocked emit would have waited on release (10 s)
    with caplog.at_level(logging.WARNING, logger="omnitrace.bus"):
        sink.release.set()
        assert bus.flush(timeout=5)
        time.sleep(0.05)
    bus.close()
    assert len(sink.events) == 11
    assert any("dropped 490 events" in r.getMessage() for r in caplog.records)
    assert bus.statistics().dropped == 490


def test_raising_sink_is_disabled_and_reported_once(caplog: pytest.LogCaptureFixture) -> None:
    """A sink that raises is disabled, logged once, and other sinks keep receiving."""
    bad, good = RaisingSink("bad"), ListSink("good")
    with caplog.at_level(logging.ERROR, logger="omnitrace.bus"):
        bus = EventBus(sinks=[bad, good])
        for i in range(3):
            bus.emit(replayed(i))
        assert bus.flush(5)
        for i in range(3, 6):
            bus.emit(replayed(i))
        assert bus.flush(5)
        bus.close()
    assert len(good.events) == 6
    stats = {s.name: s for s in bus.statistics().sinks}
    assert stats["bad"].disabled
    assert stats["bad"].error == "ValueError: sink is broken"
    assert stats["bad"].dropped == 6
    assert not stats["good"].disabled
    reports = [r for r in caplog.records if "sink bad raised" in r.getMessage()]
    assert len(reports) == 1


@pytest.mark.parametrize(
    "error",
    [SystemExit(3), KeyboardInterrupt("stop"), asyncio.CancelledError("own")],
    ids=["SystemExit", "KeyboardInterrupt", "CancelledError"],
)
def test_async_sink_raising_a_base_exception_is_disabled_and_the_others_keep_going(
    error: BaseException, caplog: pytest.LogCaptureFixture
) -> None:
    """An async sink raising SystemExit, KeyboardInterrupt or its own CancelledError is
    disabled and reported once; the loop survives and healthy plain and async sinks get
    every event."""
    received: list[Event] = []

    class Bad:
        name = "bad"

        async def handle(self, events: Sequence[Event]) -> None:
            raise error

    class GoodAsync:
        name = "good-async"

        async def handle(self, events: Sequence[Event]) -> None:
            received.extend(events)

    good = ListSink("good")
    with caplog.at_level(logging.ERROR, logger="omnitrace.bus"):
        bus = EventBus(sinks=[Bad(), good, GoodAsync()], queue_size=100_000)
        bus.emit(replayed(-1))
        assert bus.flush(5)
        for i in range(30_000):
            bus.emit(replayed(i))
        assert bus.flush(10)
        bus.close()
    assert len(good.events) == len(received) == 30_001
    stats = {s.name: s for s in bus.statistics().sinks}
    assert stats["bad"].disabled
    assert stats["bad"].error == f"{type(error).__name__}: {error}"
    assert stats["bad"].dropped_by == {"sink_error": 30_001}
    assert stats["good"].delivered == stats["good-async"].delivered == 30_001
    _assert_accounted(bus)
    reports = [r for r in caplog.records if "sink bad raised" in r.getMessage()]
    assert [r.getMessage() for r in reports] == [
        f"sink bad raised {type(error).__name__}: {error} and is disabled; "
        "its events are dropped from now on"
    ]


def test_raising_fold_is_removed_and_never_reaches_the_caller(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """emit() swallows a fold's exception, removes that fold and keeps the stats fold."""
    calls = []

    def bad_fold(event: Event) -> None:
        calls.append(event)
        raise KeyError("fold bug")

    with caplog.at_level(logging.ERROR, logger="omnitrace.bus"):
        bus = EventBus()
        bus.add_fold(bad_fold)
        bus.emit(replayed(0))
        bus.emit(replayed(1))
        deadline = time.monotonic() + 5
        while not caplog.records and time.monotonic() < deadline:
            time.sleep(0.01)
    assert len(calls) == 1
    assert bus.statistics().disabled_folds == 1
    assert bus.adapter_stats()["vision"].graph_hits == 2
    assert any("fold" in r.getMessage() for r in caplog.records)
    bus.close()


FOLD_CALLS_THE_BUS_SCRIPT = """
    import json, logging, sys, time
    from omnitrace import EventBus, GraphReplayed
    from omnitrace.signature import Signature

    def event(i):
        return GraphReplayed("v", Signature.parse("float32[1]"), i, i, 0.0)

    records = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())
    logging.getLogger("omnitrace.bus").addHandler(handler)
    calls = {
        "emit": lambda bus: bus.emit(event(99)),
        "statistics": lambda bus: bus.statistics(),
        "flush": lambda bus: bus.flush(1),
        "remove_fold": lambda bus: bus.remove_fold(print),
    }
    bus = EventBus()
    name = sys.argv[1]
    seen = []

    def fold(e):
        seen.append(repr(bus))  # never locks from inside a fold
        calls[name](bus)

    bus.add_fold(fold)
    bus.emit(event(0))
    bus.emit(event(1))
    deadline = time.monotonic() + 5
    while not records and time.monotonic() < deadline:
        time.sleep(0.01)
    stats = bus.statistics()
    bus.close(1)
    print(json.dumps({
        "seen": seen,
        "emitted": stats.emitted,
        "disabled_folds": stats.disabled_folds,
        "hits": bus.adapter_stats()["v"].graph_hits,
        "records": records,
    }))
"""


@pytest.mark.parametrize("call", ["emit", "statistics", "flush", "remove_fold"])
def test_fold_calling_the_bus_gets_an_error_instead_of_a_deadlock(
    tmp_path: Path, call: str
) -> None:
    """A fold that calls emit(), statistics(), flush() or remove_fold() on its bus gets a
    RuntimeError naming the call (and is disabled, reported once) instead of deadlocking
    emit(); the caller of emit() sees nothing and the stats keep counting."""
    result = _run_script(tmp_path, FOLD_CALLS_THE_BUS_SCRIPT, deadline=30, args=[call])
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["seen"] == ["<EventBus idle sinks=0 emitted=0>"]
    assert (report["emitted"], report["disabled_folds"], report["hits"]) == (2, 1, 2)
    (record,) = report["records"]
    assert re.fullmatch(
        r"event fold <function fold at 0x[0-9a-f]+> raised RuntimeError: "
        + re.escape(
            f"EventBus.{call}() called from inside a fold: folds run under the bus lock and "
            "must not call back into the bus (read it after emit() returns, or from a sink); "
            "it is disabled"
        ),
        record,
    ), record


def test_emit_rejects_non_events_without_raising() -> None:
    """Objects that are not events are counted as rejected and ignored."""
    with EventBus() as bus:
        bus.emit("not an event")  # type: ignore[arg-type]
        bus.emit(None)  # type: ignore[arg-type]
        assert bus.statistics().rejected == 2
        assert bus.statistics().emitted == 0


def test_emit_after_close_is_counted_not_raised() -> None:
    """After close() events still reach the folds and are counted as after-close."""
    sink = ListSink()
    bus = EventBus(sinks=[sink])
    bus.close()
    bus.emit(replayed(0))
    stats = bus.statistics()
    assert stats.emitted_after_close == 1
    assert bus.adapter_stats()["vision"].graph_hits == 1
    assert sink.events == []


def test_start_flush_close_are_idempotent() -> None:
    """Calling the lifecycle methods twice is harmless."""
    sink = ListSink()
    bus = EventBus()
    bus.start()
    bus.start()
    bus.add_sink(sink)
    bus.emit(replayed(0))
    assert bus.flush(5)
    assert bus.flush(5)
    bus.close()
    bus.close()
    assert sink.closed == 1
    assert len(sink.events) == 1


def test_close_delivers_what_is_queued() -> None:
    """close() flushes before it stops: nothing queued is lost."""
    sink = ListSink()
    bus = EventBus(sinks=[sink], drain_interval=30)
    for i in range(100):
        bus.emit(replayed(i))
    bus.close()
    assert len(sink.events) == 100
    assert bus.statistics().dropped == 0


def test_emit_is_thread_safe() -> None:
    """Concurrent emitters lose nothing: folds and sinks see every event."""
    sink = ListSink()
    bus = EventBus(sinks=[sink], queue_size=100_000)

    def worker(t: int) -> None:
        for i in range(2000):
            bus.emit(replayed(i, adapter=f"a{t}"))

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    bus.close()
    assert len(sink.events) == 8000
    assert {n: s.graph_hits for n, s in bus.adapter_stats().items()} == {
        f"a{t}": 2000 for t in range(4)
    }


async def test_runs_on_the_host_loop_when_started_inside_one() -> None:
    """Started inside a running loop, the bus drains there; aflush and aclose work."""
    received: list[Event] = []

    class AsyncSink:
        name = "async"

        async def handle(self, events: Sequence[Event]) -> None:
            await asyncio.sleep(0)
            received.extend(events)

    bus = EventBus(drain_interval=1)
    bus.add_sink(AsyncSink())
    for i in range(10):
        bus.emit(replayed(i))
    assert await bus.aflush(5)
    assert len(received) == 10
    with pytest.raises(RuntimeError, match=r"use 'await bus.aflush\(\)'"):
        bus.flush()
    await bus.aclose()
    assert bus.closed


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"queue_size": 0}, "queue_size: expected an integer from 1 to 10000000, got 0"),
        ({"queue_size": True}, "queue_size: expected an integer from 1 to 10000000, got True"),
        (
            {"queue_size": 10**8},
            "queue_size: expected an integer from 1 to 10000000, got 100000000",
        ),
        (
            {"drain_interval": 0},
            r"drain_interval: expected a number of seconds from 0.001 to 60, got 0 \(int\)",
        ),
        (
            {"drain_interval": 1e-9},
            r"drain_interval: expected a number of seconds from 0.001 to 60, got 1e-09",
        ),
        (
            {"drain_interval": float("nan")},
            r"drain_interval: expected a number of seconds from 0.001 to 60, got nan",
        ),
        (
            {"drain_interval": "1"},
            r"drain_interval: expected a number of seconds from 0.001 to 60, got '1'",
        ),
        ({"coverage_keys": 0}, r"coverage_keys: expected an integer from 1 to"),
    ],
)
def test_bad_bus_settings_raise_config_error(kwargs: dict[str, object], message: str) -> None:
    """Queue size, drain interval and coverage keys outside their range raise ConfigError."""
    with pytest.raises(ConfigError, match=f"^{message}"):
        EventBus(**kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize("value", [float("nan"), float("inf"), -1, 3601, "1", None, True])
def test_bad_timeouts_raise_config_error_before_anything_changes(value: object) -> None:
    """A flush, close or close_on_signal timeout outside 0 to 3600 s raises ConfigError and
    leaves the bus open, its sinks working and the signal handler untouched."""
    message = r"^timeout: expected a number of seconds from 0 to 3600, got "
    sink = ListSink()
    bus = EventBus(sinks=[sink])
    before = signal.getsignal(signal.SIGUSR1)
    try:
        calls = (bus.flush, bus.close, lambda t: bus.close_on_signal(signal.SIGUSR1, timeout=t))
        for call in calls:
            with pytest.raises(ConfigError, match=message):
                call(value)  # type: ignore[operator]
        with pytest.raises(ConfigError, match=message):
            asyncio.run(bus.aflush(value))  # type: ignore[arg-type]
        with pytest.raises(ConfigError, match=message):
            asyncio.run(bus.aclose(value))  # type: ignore[arg-type]
        with pytest.raises(ConfigError, match=r"^queue_size: expected an integer from 1 to"):
            bus.add_sink(ListSink("other"), queue_size=0)
        assert not bus.closed
        assert signal.getsignal(signal.SIGUSR1) is before
        bus.emit(replayed(0))
        assert bus.flush(5)
        assert len(sink.events) == 1
    finally:
        bus.close()
    _assert_accounted(bus)


def test_add_sink_rejects_objects_without_handle() -> None:
    """A sink must have handle(events)."""
    with EventBus() as bus, pytest.raises(TypeError, match="has no handle"):
        bus.add_sink(object())  # type: ignore[arg-type]


def test_add_sink_to_closed_bus_raises() -> None:
    """A closed bus takes no new sinks."""
    bus = EventBus()
    bus.close()
    with pytest.raises(RuntimeError, match="closed EventBus"):
        bus.add_sink(ListSink())


# -- bounded waits and accounting -----------------------------------------------------------


def _run_script(
    tmp_path: Path, source: str, *, deadline: float, args: Sequence[str] = ()
) -> subprocess.CompletedProcess[str]:
    """Run ``source`` in a fresh interpreter; a run past ``deadline`` seconds fails the test."""
    script = tmp_path / "script.py"
    script.write_text(textwrap.dedent(source))
    try:
        return subprocess.run(
            [sys.executable, str(script), *args],
            capture_output=True,
            text=True,
            timeout=deadline,
            check=False,
        )
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"the script hung past its {deadline} s deadline; stderr: {exc.stderr!r}")


def _assert_accounted(bus: EventBus) -> None:
    stats = bus.statistics()
    for sink in stats.sinks:
        assert sink.delivered + sink.dropped == sink.offered, sink
        assert sink.dropped == sum(sink.dropped_by.values()), sink
        assert sink.queued == 0, sink


STUCK_SINK_SCRIPT = """
    import json, sys, threading, time
    from omnitrace import EventBus, GraphReplayed
    from omnitrace.signature import Signature

    class Stuck:
        name = "stuck"
        def handle(self, events):
            threading.Event().wait()  # never returns

    bus = EventBus(sinks=[Stuck()])
    for i in range(1000):
        bus.emit(GraphReplayed("v", Signature.parse(f"float32[{i}]"), i, i, 0.0))
    time.sleep(0.2)
    if sys.argv[1] == "close":
        start = time.monotonic()
        bus.close(timeout=1.0)
        (sink,) = bus.statistics().sinks
        print(json.dumps({
            "close_s": time.monotonic() - start,
            "emitted": bus.statistics().emitted,
            "delivered": sink.delivered,
            "dropped": sink.dropped,
            "queued": sink.queued,
            "dropped_by": sink.dropped_by,
        }))
    print(json.dumps({"end": time.monotonic()}), flush=True)
"""


def test_stuck_sink_close_is_bounded_counted_and_the_process_exits(tmp_path: Path) -> None:
    """close(1) with a sink stuck in handle returns in about 1 s, counts every event, and the
    interpreter then exits at once (the sink's thread is a daemon)."""
    result = _run_script(tmp_path, STUCK_SINK_SCRIPT, deadline=30, args=["close"])
    exited = time.monotonic()
    assert result.returncode == 0, result.stderr
    report, end = (json.loads(line) for line in result.stdout.splitlines())
    assert report["close_s"] < 1.0 + 0.25 + 0.5
    assert report["emitted"] == report["delivered"] + report["dropped"] == 1000
    assert report["queued"] == 0
    assert report["dropped_by"] == {"abandoned": 1000}
    assert exited - end["end"] < 5.0
    assert "omnitrace-sink-stuck did not return from handle()" in result.stderr
    assert "Task was destroyed" not in result.stderr


def test_stuck_sink_never_keeps_the_interpreter_alive_at_exit(tmp_path: Path) -> None:
    """Without a close, the exit handler's bounded close lets the process end within seconds."""
    result = _run_script(tmp_path, STUCK_SINK_SCRIPT, deadline=30, args=["exit"])
    exited = time.monotonic()
    assert result.returncode == 0, result.stderr
    end = json.loads(result.stdout.splitlines()[-1])["end"]
    assert exited - end < 2.0 + 0.25 + 3.0  # the exit close's bound, plus interpreter teardown
    assert "EventBus closed with undelivered events, counted as dropped: stuck 1000" in (
        result.stderr
    )


def test_close_counts_the_batch_it_abandons_and_leaves_nothing_queued() -> None:
    """A batch still inside handle() at close's deadline is dropped as 'abandoned', the
    events queued behind it as 'not_flushed'; that count is final: should the sink finish
    the batch later, no counter moves. delivered + dropped == offered throughout."""
    sink = BlockingSink()
    bus = EventBus(sinks=[sink], drain_interval=0.01)
    try:
        bus.emit(replayed(-1))
        assert sink.entered.wait(5)
        for i in range(50):
            bus.emit(replayed(i))
        start = time.monotonic()
        bus.close(timeout=0.2)
        assert time.monotonic() - start < 0.2 + 0.25 + 0.5
        (stats,) = bus.statistics().sinks
        assert stats.dropped_by == {"abandoned": 1, "not_flushed": 50}
        assert (stats.delivered, stats.queued, stats.offered) == (0, 0, 51)
        _assert_accounted(bus)
    finally:
        sink.release.set()
    deadline = time.monotonic() + 5
    while not sink.events and time.monotonic() < deadline:
        time.sleep(0.001)
    time.sleep(0.05)
    (stats,) = bus.statistics().sinks
    assert (stats.delivered, stats.dropped_by) == (0, {"abandoned": 1, "not_flushed": 50})
    _assert_accounted(bus)


class AbandoningSink(BlockingSink):
    """Writes half of its batch, then blocks until released; abandon() says how much it
    wrote and makes it write nothing more."""

    def __init__(self) -> None:
        super().__init__()
        self.written: list[Event] = []
        self.abandoned: list[int] = []
        self.finished = threading.Event()
        self._stop = False

    def handle(self, events: Sequence[Event]) -> None:
        self.written.extend(events[: len(events) // 2])
        self.entered.set()
        self.release.wait(10)
        if not self._stop:
            self.written.extend(events[len(events) // 2 :])
        self.finished.set()

    def abandon(self, events: Sequence[Event]) -> int:
        self._stop = True
        self.abandoned.append(len(events))
        return len(events) // 2


def test_close_counts_what_an_abandoning_sink_wrote_as_delivered_and_nothing_moves_after() -> None:
    """A sink with abandon() is told which batch close() gives up on: the events it says it
    wrote count as delivered, the rest as abandoned, and once close() returns neither the
    counters nor what the sink holds change, however the stuck handle() ends."""
    sink = AbandoningSink()
    bus = EventBus(sinks=[sink], drain_interval=0.01, queue_size=1000)
    try:
        for i in range(100):
            bus.emit(replayed(i))
        assert sink.entered.wait(5)
        bus.close(timeout=0.2)
        (stats,) = bus.statistics().sinks
        assert sink.abandoned == [100]
        assert (stats.delivered, stats.dropped_by) == (50, {"abandoned": 50})
        _assert_accounted(bus)
    finally:
        sink.release.set()
    assert sink.finished.wait(5)
    time.sleep(0.05)  # the sink thread reports the batch it finished
    (after,) = bus.statistics().sinks
    assert after == stats
    assert len(sink.written) == after.delivered == 50


def test_a_close_racing_another_returns_with_the_final_accounting() -> None:
    """A close() from a second thread while the first one waits for a stuck sink returns
    within its own bound with every event accounted for, none still queued."""
    sink = BlockingSink()
    bus = EventBus(sinks=[sink], drain_interval=0.01)
    first = threading.Thread(target=bus.close, kwargs={"timeout": 1.0})
    try:
        bus.emit(replayed(-1))
        assert sink.entered.wait(5)
        for i in range(99):
            bus.emit(replayed(i))
        first.start()
        deadline = time.monotonic() + 5
        while not bus.closed and time.monotonic() < deadline:
            time.sleep(0.001)
        assert bus.closed  # the first close now waits for the stuck sink
        start = time.monotonic()
        bus.close(timeout=0.1)
        took = time.monotonic() - start
        (stats,) = bus.statistics().sinks
        assert took < 0.1 + 0.1 + 0.5
        assert (stats.delivered, stats.queued, stats.offered) == (0, 0, 100)
        assert stats.dropped_by == {"abandoned": 1, "not_flushed": 99}
        _assert_accounted(bus)
    finally:
        sink.release.set()
        first.join(5)
    assert not first.is_alive()


SIGTERM_IN_CLOSE_SCRIPT = """
    import logging, os, signal, threading, time
    from omnitrace import EventBus, GraphReplayed
    from omnitrace.signature import Signature

    logging.basicConfig(level=logging.WARNING, format="%(message)s")

    class Stuck:
        name = "stuck"
        def handle(self, events):
            threading.Event().wait()

    class Trigger:
        # Sends SIGTERM while the host's close() waits for the stuck sink.
        name = "trigger"
        def handle(self, events):
            pass
        def close(self):
            os.kill(os.getpid(), signal.SIGTERM)

    bus = EventBus(sinks=[Stuck(), Trigger()])
    bus.close_on_signal(signal.SIGTERM, timeout=0.5)
    for i in range(100):
        bus.emit(GraphReplayed("v", Signature.parse("float32[1]"), i, i, 0.0))
    time.sleep(0.2)
    bus.close(timeout=0.5)
    print("close returned", flush=True)
"""


def test_sigterm_inside_close_reports_every_lost_event(tmp_path: Path) -> None:
    """SIGTERM while the host is inside close() with a stuck sink: the report line counts
    the stuck sink's 100 events as lost (abandoned), and the process dies of SIGTERM."""
    result = _run_script(tmp_path, SIGTERM_IN_CLOSE_SCRIPT, deadline=30)
    assert result.returncode == -signal.SIGTERM, result.stderr
    match = re.search(r"EventBus closed on SIGTERM in ([\d.]+) s; (.*)", result.stderr)
    assert match is not None, result.stderr
    assert match.group(2) == (
        "100 events emitted; stuck: delivered 0, lost 100 (abandoned 100); "
        "trigger: delivered 100, lost 0"
    )
    assert float(match.group(1)) < 0.5 + 0.25 + 0.5


MANY_STUCK_BUSES_SCRIPT = """
    import json, sys, threading, time
    from omnitrace import EventBus, GraphReplayed
    from omnitrace.signature import Signature

    class Stuck:
        name = "stuck"
        def handle(self, events):
            threading.Event().wait()

    class Counting:
        name = "counting"
        def __init__(self):
            self.n = 0
        def handle(self, events):
            time.sleep(0.05)
            self.n += len(events)
        def close(self):
            with open(sys.argv[1], "w") as f:
                f.write(str(self.n))

    buses = [EventBus(sinks=[Stuck()]) for _ in range(10)]
    buses.insert(5, EventBus(sinks=[Counting()], drain_interval=0.01))
    for bus in buses:
        for i in range(100):
            bus.emit(GraphReplayed("v", Signature.parse("float32[1]"), i, i, 0.0))
    print(json.dumps({"end": time.monotonic()}), flush=True)
"""


def test_exit_with_many_stuck_buses_takes_one_bound(tmp_path: Path) -> None:
    """Ten buses with stuck sinks close side by side at exit: the process exits within one
    exit bound (not ten), each bus reports its loss, and a healthy bus among them still
    delivers everything and closes its sink."""
    marker = tmp_path / "delivered"
    result = _run_script(tmp_path, MANY_STUCK_BUSES_SCRIPT, deadline=60, args=[str(marker)])
    exited = time.monotonic()
    assert result.returncode == 0, result.stderr
    end = json.loads(result.stdout)["end"]
    assert exited - end < 2.0 + 0.25 + 2.0  # one exit bound, plus interpreter start-up slack
    losses = "EventBus closed with undelivered events, counted as dropped: stuck 100"
    assert result.stderr.count(losses) == 10, result.stderr
    assert marker.read_text() == "100"


def test_every_event_is_accounted_for_with_a_slow_sink_under_load() -> None:
    """A slow sink, a small queue and a short close: delivered + dropped == emitted, by reason."""

    class Slow(ListSink):
        def handle(self, events: Sequence[Event]) -> None:
            time.sleep(0.002)
            super().handle(events)

    slow, fast = Slow("slow"), ListSink("fast")
    bus = EventBus(sinks=[slow, fast], queue_size=500, drain_interval=0.001)

    def worker(t: int) -> None:
        for i in range(20_000):
            bus.emit(replayed(i, adapter=f"a{t}"))

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    bus.close(timeout=0.05)
    _assert_accounted(bus)
    stats = {s.name: s for s in bus.statistics().sinks}
    assert all(s.offered == 80_000 for s in stats.values())
    assert stats["slow"].delivered == len(slow.events)
    assert stats["fast"].delivered == len(fast.events)
    assert set(stats["slow"].dropped_by) <= {"queue_full", "not_flushed", "abandoned"}


def test_events_emitted_after_close_count_as_dropped_for_each_sink() -> None:
    """After close, each sink counts the events it will never see as 'after_close'."""
    sink = ListSink()
    bus = EventBus(sinks=[sink])
    bus.emit(replayed(0))
    bus.close()
    bus.emit(replayed(1))
    bus.emit(replayed(2))
    (stats,) = bus.statistics().sinks
    assert (stats.delivered, stats.dropped_by, stats.offered) == (1, {"after_close": 2}, 3)
    _assert_accounted(bus)


def test_flush_waits_only_for_events_emitted_before_it() -> None:
    """A busy emitter on another thread cannot keep flush() from returning True."""
    sink = ListSink()
    bus = EventBus(sinks=[sink], drain_interval=0.01)
    stop = threading.Event()

    def emitter() -> None:
        i = 0
        while not stop.is_set():
            bus.emit(replayed(i))
            i += 1

    thread = threading.Thread(target=emitter)
    thread.start()
    try:
        time.sleep(0.05)
        assert bus.flush(timeout=5)
    finally:
        stop.set()
        thread.join()
        bus.close()
    _assert_accounted(bus)


@pytest.mark.parametrize("kind", ["plain", "async"])
def test_bus_on_a_host_loop_keeps_delivering_after_the_loop_ends(kind: str) -> None:
    """When asyncio.run() ends the host loop the bus started on, it moves to a thread of its
    own: nothing queued is lost and no pending task is destroyed."""
    received: list[Event] = []

    class Plain:
        name = "plain"

        def handle(self, events: Sequence[Event]) -> None:
            received.extend(events)

    class Async:
        name = "async"

        async def handle(self, events: Sequence[Event]) -> None:
            await asyncio.sleep(0)
            received.extend(events)

    async def serve() -> EventBus:
        bus = EventBus(drain_interval=1)
        bus.add_sink(Plain() if kind == "plain" else Async())
        for i in range(1010):
            bus.emit(replayed(i))
        return bus

    bus = asyncio.run(serve())
    try:
        assert bus.flush(timeout=5)
        assert len(received) == 1010
    finally:
        bus.close()
    (stats,) = bus.statistics().sinks
    assert (stats.delivered, stats.dropped, stats.queued) == (1010, 0, 0)


# -- fork -----------------------------------------------------------------------------------

FORK_LOCK_HELD_SCRIPT = """
    import os, sys, threading, time
    from omnitrace import EventBus, GraphReplayed
    from omnitrace.signature import Signature
    from omnitrace.sinks.jsonl import JsonlSink, read_events

    log = sys.argv[1]
    class ListSink:
        name = "list"
        def __init__(self):
            self.events = []
        def handle(self, events):
            self.events.extend(events)

    inherited = ListSink()
    bus = EventBus(sinks=[inherited])
    jsonl = JsonlSink(log)
    bus.add_sink(jsonl)
    for i in range(100):
        bus.emit(GraphReplayed("parent", Signature.parse("float32[1]"), i, i, 0.0))
    bus.flush(5)
    held, release = threading.Event(), threading.Event()

    def hold():
        # Another thread holds the bus lock and the sink's lock at the fork.
        with bus._lock, jsonl._lock:
            held.set()
            release.wait()

    threading.Thread(target=hold, daemon=True).start()
    held.wait()
    pid = os.fork()
    if pid == 0:
        start = time.monotonic()
        # deadlocked before:
        bus.emit(GraphReplayed("child", Signature.parse("float32[1]"), 0, 0, 0.0))
        assert bus.flush(2), "inherited bus did not deliver"
        assert inherited.events[-1].adapter == "child"
        own_sink = ListSink()
        own = EventBus(sinks=[own_sink])
        own.emit(GraphReplayed("own", Signature.parse("float32[1]"), 0, 0, 0.0))
        own.close(2)
        assert [e.adapter for e in own_sink.events] == ["own"]
        bus.close(2)
        for s in bus.statistics().sinks:
            assert s.delivered + s.dropped == s.offered and s.queued == 0, s
        assert time.monotonic() - start < 3.0, time.monotonic() - start
        sys.exit(0)
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            release.set()
            code = os.waitstatus_to_exitcode(status)
            print("child exit code", code)
            sys.exit(code)
        time.sleep(0.01)
    os.kill(pid, 9)
    print("child hung")
    sys.exit(5)
"""


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_forked_child_emits_flushes_and_closes_with_the_lock_held_at_fork(
    tmp_path: Path,
) -> None:
    """fork() while another thread holds the bus and sink locks: the child's emit, flush
    and close work, every event is accounted for, and it writes the log with its own pid."""
    log = tmp_path / "events.jsonl"
    result = _run_script(tmp_path, FORK_LOCK_HELD_SCRIPT, deadline=40, args=[str(log)])
    assert result.returncode == 0, result.stdout + result.stderr
    from omnitrace.sinks.jsonl import read_records

    records = list(read_records(log))
    child = [r for r in records if r.item.adapter == "child"]  # type: ignore[union-attr]
    assert len(child) == 1
    assert child[0].pid != records[0].pid


FORK_MANY_SCRIPT = """
    import atexit, os, sys, threading, time
    from omnitrace import EventBus, GraphReplayed
    from omnitrace.signature import Signature

    N = int(sys.argv[1])
    class Counting:
        name = "count"
        def __init__(self):
            self.n = 0
        def handle(self, events):
            self.n += len(events)

    bus = EventBus(sinks=[Counting()], queue_size=1000)
    stop = threading.Event()

    def hammer():
        i = 0
        while not stop.is_set():
            bus.emit(GraphReplayed("v", Signature.parse("float32[1]"), i, i, 0.0))
            i += 1

    threading.Thread(target=hammer, daemon=True).start()
    time.sleep(0.05)
    children = {}
    for n in range(N):
        pid = os.fork()
        if pid == 0:
            try:
                bus.emit(GraphReplayed("child", Signature.parse("float32[1]"), 0, 0, 0.0))
                own = EventBus(sinks=[Counting()])
                own.emit(GraphReplayed("own", Signature.parse("float32[1]"), 0, 0, 0.0))
                assert own.flush(2)
                own.close(2)
                start = time.monotonic()
                atexit._run_exitfuncs()  # what sys.exit runs: the parent's bus handler too
                took = time.monotonic() - start
                (s,) = bus.statistics().sinks
                ok = took < 1.0 and s.delivered + s.dropped == s.offered and s.queued == 0
                os._exit(0 if ok else 3)
            except BaseException:
                os._exit(4)
        children[pid] = time.monotonic()
    hung = failed = 0
    deadline = time.monotonic() + 30
    while children and time.monotonic() < deadline:
        for pid in list(children):
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                del children[pid]
                failed += os.waitstatus_to_exitcode(status) != 0
        time.sleep(0.01)
    for pid in children:
        os.kill(pid, 9)
        hung += 1
    stop.set()
    print(f"hung {hung} failed {failed} of {N}")
"""


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_children_forked_from_a_busy_bus_never_hang(tmp_path: Path) -> None:
    """Of 20 children forked while a thread emits nonstop, none hangs, each accounts for
    every event, and the parent's exit handler adds under a second to a child's exit."""
    result = _run_script(tmp_path, FORK_MANY_SCRIPT, deadline=60, args=["20"])
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "hung 0 failed 0 of 20"


# -- signals --------------------------------------------------------------------------------

SIGTERM_SCRIPT = """
    import logging, os, signal, sys, time
    from omnitrace import EventBus, GraphReplayed
    from omnitrace.signature import Signature
    from omnitrace.sinks.jsonl import JsonlSink

    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    if sys.argv[2] == "chain":
        def host_handler(signum, frame):
            print("host handler ran", flush=True)
            os._exit(3)
        signal.signal(signal.SIGTERM, host_handler)
    bus = EventBus(queue_size=100_000)
    bus.add_sink(JsonlSink(sys.argv[1], fresh=True))
    bus.close_on_signal(signal.SIGTERM, timeout=2.0)
    print("ready", flush=True)
    i = 0
    while True:
        bus.emit(GraphReplayed("v", Signature.parse("float32[1]"), i, i, 0.0))
        i += 1
"""


def _terminate_busy_writer(tmp_path: Path, mode: str) -> tuple[int, str, str, Path]:
    log = tmp_path / "events.jsonl"
    script = tmp_path / "writer.py"
    script.write_text(textwrap.dedent(SIGTERM_SCRIPT))
    proc = subprocess.Popen(
        [sys.executable, str(script), str(log), mode],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline() == "ready\n"
        deadline = time.monotonic() + 20
        while (not log.exists() or log.stat().st_size < 100_000) and time.monotonic() < deadline:
            time.sleep(0.01)
        proc.send_signal(signal.SIGTERM)
        sent = time.monotonic()
        out, err = proc.communicate(timeout=15)
        took = time.monotonic() - sent
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        pytest.fail("the writer did not end within 15 s of SIGTERM")
    assert took < 2.0 + 0.25 + 3.0
    return proc.returncode, out, err, log


def _loss_report(err: str, log: Path) -> tuple[int, int, int]:
    """Check the SIGTERM report line against the log; return emitted, delivered, lost."""
    match = re.search(
        r"EventBus closed on SIGTERM in [\d.]+ s; (\d+) events emitted; "
        r"jsonl: delivered (\d+), lost (\d+)(?: \((.*)\))?",
        err,
    )
    assert match is not None, err
    emitted, delivered, lost = map(int, match.groups()[:3])
    reasons = dict(item.rsplit(" ", 1) for item in (match.group(4) or "").split(", ") if item)
    assert delivered + lost == emitted
    assert sum(map(int, reasons.values())) == lost
    assert set(reasons) <= {"queue_full", "not_flushed", "abandoned", "after_close"}
    # A batch abandoned at the deadline may still have been written before the process died.
    lines = len(log.read_bytes().splitlines())
    assert delivered <= lines <= delivered + int(reasons.get("abandoned", 0))
    return emitted, delivered, lost


def test_sigterm_flushes_within_a_bound_and_reports_what_was_lost(tmp_path: Path) -> None:
    """SIGTERM to a busy writer: the bus closes within its bound, one line reports emitted,
    delivered and lost events, the log holds exactly the delivered ones, and the process
    then dies of SIGTERM as it would have."""
    code, _, err, log = _terminate_busy_writer(tmp_path, "default")
    assert code == -signal.SIGTERM
    _, delivered, _ = _loss_report(err, log)
    assert delivered > 0


def test_sigterm_handler_chains_the_hosts_own_handler(tmp_path: Path) -> None:
    """A handler the host installed first still runs, after the bus has been closed."""
    code, out, err, log = _terminate_busy_writer(tmp_path, "chain")
    assert (code, out) == (3, "host handler ran\n")
    _loss_report(err, log)


def test_close_on_signal_leaves_an_ignored_signal_alone() -> None:
    """A signal the host ignores stays ignored, and the restore function is a no-op."""
    previous = signal.signal(signal.SIGUSR1, signal.SIG_IGN)
    try:
        with EventBus() as bus:
            restore = bus.close_on_signal(signal.SIGUSR1)
            assert signal.getsignal(signal.SIGUSR1) is signal.SIG_IGN
            restore()
    finally:
        signal.signal(signal.SIGUSR1, previous)


def test_close_on_signal_restore_puts_the_previous_handler_back() -> None:
    """restore() reinstalls what was there before."""
    with EventBus() as bus:
        before = signal.getsignal(signal.SIGUSR2)
        restore = bus.close_on_signal(signal.SIGUSR2)
        assert signal.getsignal(signal.SIGUSR2) is not before
        restore()
        assert signal.getsignal(signal.SIGUSR2) is before


def test_the_drop_warning_names_each_reason_not_only_queue_capacity(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Events a sink could not write are reported as write_failed, not as a full queue."""
    from omnitrace.bus import EventsNotWritten

    class FullDisk(ListSink):
        def handle(self, events: Sequence[Event]) -> None:
            raise EventsNotWritten(len(events), "No space left on device")

    bus = EventBus()
    bus.add_sink(FullDisk("disk"))
    with caplog.at_level(logging.WARNING, logger="omnitrace"):
        bus.emit(replayed(1))
        assert bus.flush()
        bus.emit(replayed(2))  # the next batch taken reports the drops so far
        assert bus.flush()
    bus.close()
    (line,) = [r.getMessage() for r in caplog.records if "dropped" in r.getMessage()]
    assert line.startswith("sink disk dropped 1 events (1 dropped in all: write_failed 1;")
