"""EventBus: folds, bounded sink queues, failure isolation and lifecycle."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Sequence

import pytest

from omnitrace import ConfigError, EventBus, GraphMissed, GraphReplayed, MissReason
from omnitrace.events import Event
from omnitrace.testing import capture_events


def replayed(i: int, adapter: str = "vision") -> GraphReplayed:
    return GraphReplayed(adapter, f"k{i}", i, i, 0.0)


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
            assert seen[-1].key == f"k{i}"
    assert [e.key for e in seen] == [f"k{i}" for i in range(5)]


def test_bus_keeps_the_stats_fold() -> None:
    """The bus folds events into per-adapter stats."""
    with EventBus() as bus:
        bus.emit(replayed(0))
        bus.emit(GraphMissed("audio", "k", 0, 0, MissReason.CAPACITY, "cap"))
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
    assert [e.key for e in sink.events] == [f"k{i}" for i in range(1000)]
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
        ({"queue_size": 0}, "queue_size: expected a positive integer, got 0"),
        ({"queue_size": True}, "queue_size: expected a positive integer, got True"),
        ({"drain_interval": 0}, r"drain_interval: expected seconds in \(0, 60\], got 0"),
        ({"drain_interval": "1"}, r"drain_interval: expected seconds in \(0, 60\], got '1'"),
    ],
)
def test_bad_bus_settings_raise_config_error(kwargs: dict[str, object], message: str) -> None:
    """Queue size and drain interval are validated up front."""
    with pytest.raises(ConfigError, match=message):
        EventBus(**kwargs)  # type: ignore[arg-type]


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
