"""The relay from event logs into a bus: nothing dropped, writers kept apart, logs followed."""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from omnitrace import EventBus, GraphReplayed, derive_stats
from omnitrace.eventlog import AdapterInfo, EventRecord, LineEncoder, read_records
from omnitrace.events import Event
from omnitrace.relay import LogRelay, feed, qualified_name
from omnitrace.sinks.jsonl import JsonlSink
from omnitrace.testing import captured, sig


class SlowSink:
    """Keeps every event, and takes its time over each batch."""

    name = "slow"

    def __init__(self) -> None:
        self.events: list[Event] = []

    def handle(self, events: Sequence[Event]) -> None:
        time.sleep(0.002)
        self.events.extend(events)


def events(adapter: str, n: int, start: int = 0) -> list[Event]:
    """``n`` hits of two signatures, after one capture of each."""
    out: list[Event] = [
        captured(adapter, f"float32[1,{k}] @cpu s=0", epoch_ns=start, graph_index=k - 1)
        for k in (1, 2)
    ]
    out += [
        GraphReplayed(adapter, sig(f"float32[1,{1 + i % 2}] @cpu s=0"), start + i, start + i, 1e-4)
        for i in range(n)
    ]
    return out


def write(path: Path, items: Sequence[Event], rank: str, monkeypatch: pytest.MonkeyPatch) -> None:
    with monkeypatch.context() as env:
        env.setenv("RANK", rank)
        sink = JsonlSink(path)
    try:
        sink.handle(items)
    finally:
        sink.close()


def relayed(paths: Sequence[Path], **options: Any) -> tuple[EventBus, LogRelay]:
    """Relay the whole of ``paths`` into a fresh bus, then close it; return both."""
    bus = EventBus()
    relay = LogRelay(bus, paths, **options)
    try:
        relay.finish()
    finally:
        bus.close()
    return bus, relay


def test_feed_delivers_a_log_far_longer_than_the_bus_queue_without_a_drop() -> None:
    """5,000 recorded events through a 64-event queue to a slow sink: all of them, in order."""
    recorded = events("vision", 5_000)
    records = [EventRecord(item, pid=7, rank=0) for item in recorded]
    sink = SlowSink()
    bus = EventBus(queue_size=64, sinks=[sink])
    try:
        assert feed(bus, records) == len(recorded)
    finally:
        bus.close()
    assert bus.statistics().dropped == 0
    assert sink.events == recorded
    assert bus.adapter_stats()["vision"].as_dict() == derive_stats(recorded)["vision"]


def test_feed_names_each_writers_adapters_apart_only_when_there_are_several() -> None:
    one = [EventRecord(item, pid=7, rank=0) for item in events("audio", 10)]
    two = one + [EventRecord(item, pid=8, rank=1) for item in events("audio", 4)]
    alone, shared = EventBus(), EventBus()
    try:
        feed(alone, one)
        feed(shared, two)
    finally:
        alone.close()
        shared.close()
    assert set(alone.adapter_stats()) == {"audio"}
    assert set(shared.adapter_stats()) == {"audio@rank0.pid7", "audio@rank1.pid8"}
    assert shared.adapter_stats()["audio@rank1.pid8"].graph_hits == 4


def test_feed_paces_before_every_event() -> None:
    seen: list[int] = []
    bus = EventBus()
    try:
        feed(bus, [EventRecord(e, 1, 0) for e in events("a", 3)], pace=lambda e: seen.append(1))
    finally:
        bus.close()
    assert len(seen) == 5


@pytest.mark.parametrize("chunk", [0, -1, True, 2.5])
def test_a_bad_chunk_is_refused(chunk: object) -> None:
    bus = EventBus()
    try:
        with pytest.raises(ValueError, match="chunk"):
            feed(bus, [], chunk=chunk)  # type: ignore[arg-type]
    finally:
        bus.close()


def test_relay_follows_a_growing_log_and_keeps_a_second_writer_apart(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The first writer keeps its names; a second writer of the same log is qualified."""
    path = tmp_path / "events.jsonl"
    bus = EventBus()
    relay = LogRelay(bus, [path])
    try:
        assert relay.poll() == 0  # no log yet: waited for, not an error
        first = events("vision", 30)
        write(path, first[:10], "0", monkeypatch)
        assert relay.poll() == 10
        write(path, first[10:], "0", monkeypatch)
        second = events("vision", 5, start=100)
        write(path, second, "1", monkeypatch)
        assert relay.poll() == len(first) - 10 + len(second)
        assert relay.finish()
    finally:
        bus.close()
    (source0, source1) = relay.sources
    stats = {name: s.as_dict() for name, s in bus.adapter_stats().items()}
    assert stats == {
        "vision": derive_stats(first)["vision"],
        qualified_name("vision", source1): derive_stats(second)["vision"],
    }
    assert source0[0] == 0
    assert source1[0] == 1
    assert relay.events == len(first) + len(second)
    assert bus.statistics().dropped == 0


def test_relay_of_several_logs_names_every_writer(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    paths = [tmp_path / "rank0.jsonl", tmp_path / "rank1.jsonl"]
    for rank, path in enumerate(paths):
        write(path, events("audio", 3 + rank), str(rank), monkeypatch)
    bus, _ = relayed(paths)
    hits = {
        name.split("@")[1].split(".")[0]: s.graph_hits for name, s in bus.adapter_stats().items()
    }
    assert hits == {"rank0": 3, "rank1": 4}


def test_relay_from_the_end_skips_what_the_log_already_held(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "events.jsonl"
    write(path, events("vision", 20), "0", monkeypatch)
    bus = EventBus()
    relay = LogRelay(bus, [path], from_start=False)
    try:
        assert relay.poll() == 0
        later = events("vision", 6, start=50)[2:]  # hits only
        write(path, later, "0", monkeypatch)
        assert relay.poll() == len(later)
    finally:
        relay.close()
        bus.close()
    assert bus.adapter_stats()["vision"].graph_hits == len(later)


def test_a_relay_needs_a_log() -> None:
    bus = EventBus()
    try:
        with pytest.raises(ValueError, match="at least one log"):
            LogRelay(bus, [])
    finally:
        bus.close()


def test_several_rotations_between_two_polls_lose_nothing(tmp_path: Path) -> None:
    """The files rotated after the one being read are read too, in order."""
    path = tmp_path / "events.jsonl"
    sink = JsonlSink(path, max_bytes=20_000, backups=10)
    bus = EventBus()
    relay = LogRelay(bus, [path])
    recorded = events("vision", 600)
    try:
        sink.handle(recorded[:50])
        assert relay.poll() == 50
        sink.handle(recorded[50:])
        assert sink.rotations >= 3
        assert sink.deleted_events == 0
        relay.finish()
    finally:
        sink.close()
        bus.close()
    assert relay.events == len(recorded)
    assert bus.adapter_stats()["vision"].as_dict() == derive_stats(recorded)["vision"]


def test_rotations_past_the_backups_relay_every_file_left(tmp_path: Path) -> None:
    """The file being read was rotated out and deleted: it is finished from its open handle,
    then every rotated file left is relayed, oldest first."""
    path = tmp_path / "events.jsonl"
    sink = JsonlSink(path, max_bytes=20_000, backups=2)
    seen = SlowSink()
    bus = EventBus(sinks=[seen])
    relay = LogRelay(bus, [path])
    first = events("vision", 48)
    try:
        sink.handle(first)
        relay.poll()
        sink.handle(events("vision", 600, start=100))
        assert sink.deleted_events > 0
        relay.finish()
    finally:
        sink.close()
        bus.close()
    on_disk = [r.item for r in read_records(path) if not isinstance(r.item, AdapterInfo)]
    assert seen.events[: len(first)] == first
    assert seen.events[-len(on_disk) :] == on_disk
    assert len(seen.events) < sink.written  # rotation deleted files the relay never had open


def test_a_log_truncated_and_grown_again_before_a_poll_is_read_from_its_top(
    tmp_path: Path,
) -> None:
    path = tmp_path / "events.jsonl"
    first, second = events("vision", 20), events("audio", 60, start=100)
    with open(path, "wb") as log:
        for item in first:
            log.write(encode_line(item))
    bus = EventBus()
    relay = LogRelay(bus, [path])
    try:
        assert relay.poll() == len(first)
        with open(path, "wb") as log:  # truncated in place, then longer than before
            for item in second:
                log.write(encode_line(item))
        assert relay.poll() == len(second)
    finally:
        relay.close()
        bus.close()
    assert bus.adapter_stats()["audio"].graph_hits == 60


def test_a_relay_can_join_its_log_at_a_writers_offset(tmp_path: Path) -> None:
    """A worker restarted on its old log relays only its own run (the size it started at)."""
    path = tmp_path / "events.jsonl"
    old = events("vision", 30)
    with open(path, "wb") as log:
        for item in old:
            log.write(encode_line(item))
    offset = path.stat().st_size
    new = events("vision", 7, start=100)[2:]
    with open(path, "ab") as log:
        for item in new:
            log.write(encode_line(item))
    bus, relay = relayed([path], offsets=[offset])
    assert relay.events == len(new)
    assert set(bus.adapter_stats()) == {"vision"}


def encode_line(item: Event) -> bytes:
    return LineEncoder(pid=7, rank=0)(item)


def test_writers_of_two_logs_with_the_same_rank_and_pid_stay_apart(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Hosts or containers reuse pids: the second log's writer is told apart by its log."""
    paths = [tmp_path / "host-a.jsonl", tmp_path / "host-b.jsonl"]
    write(paths[0], events("vision", 5), "0", monkeypatch)
    write(paths[1], events("vision", 9), "0", monkeypatch)
    bus, _ = relayed(paths)
    name = qualified_name("vision", (0, os.getpid()))
    hits = {n: s.graph_hits for n, s in bus.adapter_stats().items()}
    assert hits == {name: 5, f"{name}.log2": 9}
