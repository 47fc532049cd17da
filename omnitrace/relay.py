"""Feed event logs into a bus, a recorded log at once or one its writer still appends, in
chunks that wait for the sinks, so nothing is dropped."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence

from omnitrace._validate import check_int
from omnitrace.bus import EventBus
from omnitrace.eventlog import AdapterInfo, EventLogFollower, EventRecord
from omnitrace.events import Event

__all__ = ["CHUNK", "LogRelay", "Tap", "feed", "qualified_name"]

#: Events emitted between two waits for the sinks (well below the bus's default queue).
CHUNK = 1_000

#: Seconds one wait for the sinks may take before the relay goes on (what a sink still
#: could not take is then counted as dropped by the bus, never lost without a count).
DRAIN_TIMEOUT_S = 30.0


#: Seconds each later wait may take once one timed out.
STUCK_DRAIN_TIMEOUT_S = 0.5


#: Also given every record relayed, with its writer's suffix (see :func:`qualified_name`;
#: empty for a writer that keeps its names): the per-writer OpenTelemetry export.
Tap = Callable[[EventRecord, str], None]


def qualified_name(adapter: str, source: tuple[int, int]) -> str:
    """Return ``adapter@rankR.pidP``: one writer's adapter among several writers'."""
    return adapter + _suffix(source)


def _suffix(source: tuple[int, int]) -> str:
    rank, pid = source
    return f"@rank{rank}.pid{pid}"


class _Emitter:
    """Emit records into a bus under their (possibly qualified) adapter names, in chunks."""

    def __init__(
        self,
        bus: EventBus,
        chunk: int,
        pace: Callable[[Event], None] | None = None,
        tap: Tap | None = None,
    ) -> None:
        self.bus = bus
        self.tap = tap
        # Half the bus's queue at most, so a chunk always fits beside what the pump holds.
        self.chunk = min(check_int("chunk", chunk, minimum=1), max(1, bus.queue_size // 2))
        self.pace = pace
        self.events = 0
        self.drained = True
        self._since_drain = 0

    def emit(self, records: Iterable[EventRecord], suffix_of: Mapping[tuple[int, int], str]) -> int:
        """Emit ``records``; each writer's adapters get ``suffix_of[source]`` appended."""
        emitted = 0
        for record in records:
            item = record.item
            suffix = suffix_of[record.source]
            if isinstance(item, AdapterInfo):
                if self.tap is not None:
                    self.tap(record, suffix)
                self.bus.register_adapter(item.adapter + suffix, item.info)
                continue
            if self.pace is not None:
                self.pace(item)
            if self.tap is not None:
                self.tap(record, suffix)
            if suffix:
                item = dataclasses.replace(item, adapter=item.adapter + suffix)
            self.bus.emit(item)
            emitted += 1
            self._since_drain += 1
            if self._since_drain >= self.chunk:
                self.drain()
        self.events += emitted
        return emitted

    def drain(self) -> None:
        self._since_drain = 0
        # After one wait timed out, a sink is stuck or far behind: the rest goes on without
        # long waits (what its queue cannot take is counted as dropped by the bus).
        timeout = DRAIN_TIMEOUT_S if self.drained else STUCK_DRAIN_TIMEOUT_S
        self.drained &= self.bus.flush(timeout=timeout)


class _Suffixes(dict[tuple[int, int], str]):
    """Each writer's suffix, looked up as it is first met."""

    def __init__(self, several: bool) -> None:
        super().__init__()
        self._several = several

    def __missing__(self, source: tuple[int, int]) -> str:
        suffix = self[source] = _suffix(source) if self._several else ""
        return suffix


def feed(
    bus: EventBus,
    records: Iterable[EventRecord],
    *,
    pace: Callable[[Event], None] | None = None,
    chunk: int = CHUNK,
    tap: Tap | None = None,
    sources: Collection[tuple[int, int]] | None = None,
) -> int:
    """Emit recorded ``records`` into ``bus`` in their order; return the events emitted.

    With records of more than one writer, every adapter is named after its writer
    (:func:`qualified_name`), so each worker's stats stay apart. Waits for the sinks after
    every ``chunk`` events and at the end; ``pace(event)``, if given, runs before each
    event is emitted (to replay at the recorded pace); ``tap(record, suffix)``, if given, is
    handed every record too. ``sources``, the writers of the records when known beforehand,
    lets ``records`` be read once as they stream (a log read a chunk at a time); without it
    ``records`` must be a sequence.
    """
    if sources is None:
        if not isinstance(records, Sequence):
            raise TypeError("feed: records must be a sequence unless sources are given")
        sources = {record.source for record in records}
    emitter = _Emitter(bus, chunk, pace, tap)
    several = len(sources) > 1
    emitter.emit(records, _Suffixes(several))
    emitter.drain()
    return emitter.events


class LogRelay:
    """Relay event logs that other processes are still writing into a bus, like ``tail -F``.

    ``poll()`` emits the records appended since the last poll and never blocks on a writer
    (it may wait for the bus's sinks, see the module). The first writer seen keeps its
    adapter names when one log is followed; any other writer's adapters (and every
    writer's, when several logs are followed) are named :func:`qualified_name`, so two
    workers' stats never merge; a writer whose rank and pid a writer of another log has
    already (pids reused across hosts or containers) also gets ``.logN``, N counting the
    logs from 1.

    Args:
        bus: the bus to emit into (its folds and sinks see every relayed event).
        paths: the logs to follow; a log that does not exist yet is waited for.
        from_start: relay what the logs already hold first (True), or only what is appended
            after the relay started.
        offsets: per log, the byte to join it at (None: as ``from_start`` says); a writer
            that starts the relay passes its log's size, so an older run's lines stay out.
        chunk: events between two waits for the sinks.
        tap: also handed every record relayed, with its writer's suffix.
    """

    def __init__(
        self,
        bus: EventBus,
        paths: Sequence[str | os.PathLike[str]],
        *,
        from_start: bool = True,
        offsets: Sequence[int | None] | None = None,
        chunk: int = CHUNK,
        tap: Tap | None = None,
    ) -> None:
        if not paths:
            raise ValueError("LogRelay needs at least one log to follow")
        if offsets is None:
            offsets = [None] * len(paths)
        if len(offsets) != len(paths):
            raise ValueError(f"LogRelay: {len(offsets)} offsets for {len(paths)} logs")
        self._followers = [
            EventLogFollower(path, from_start=from_start, start_offset=offset, skip_bad_lines=True)
            for path, offset in zip(paths, offsets, strict=True)
        ]
        self._emitter = _Emitter(bus, chunk, tap=tap)
        self._several = len(paths) > 1
        self._suffixes: dict[tuple[int, tuple[int, int]], str] = {}

    @property
    def events(self) -> int:
        """Events relayed so far."""
        return self._emitter.events

    @property
    def sources(self) -> list[tuple[int, int]]:
        """``(rank, pid)`` of every writer seen so far, in the order they were seen."""
        return list(dict.fromkeys(source for _, source in self._suffixes))

    @property
    def bad_lines(self) -> int:
        """Lines of the logs skipped (and logged) because they are no record this reader
        knows: a newer schema, an unknown type. A relay goes on past them."""
        return sum(follower.bad_lines for follower in self._followers)

    @property
    def drained(self) -> bool:
        """False once a wait for the sinks timed out (the bus counted what it dropped)."""
        return self._emitter.drained

    def add(self, path: str | os.PathLike[str]) -> None:
        """Follow one more log from its start (a rank that started after the relay)."""
        self._followers.append(EventLogFollower(path, skip_bad_lines=True))
        self._several = True

    def poll(self) -> int:
        """Emit what the logs gained since the last poll; return the number of events."""
        emitted = 0
        for index, follower in enumerate(self._followers):
            records = follower.poll()
            names: dict[tuple[int, int], str] = {}
            for source in {record.source for record in records}:
                names[source] = self._name(index, source)
            emitted += self._emitter.emit(records, names)
        return emitted

    def _name(self, log: int, source: tuple[int, int]) -> str:
        """The suffix of a writer's adapter names, fixed when the writer is first seen."""
        key = (log, source)
        suffix = self._suffixes.get(key)
        if suffix is None:
            if not self._several and not self._suffixes:
                suffix = ""  # the first writer of the one log keeps its names
            else:
                suffix = _suffix(source)
                if suffix in self._suffixes.values():
                    # The same rank and pid in another log (pids reused across hosts or
                    # containers): told apart by the log.
                    suffix += f".log{log + 1}"
            self._suffixes[key] = suffix
        return suffix

    def finish(self) -> bool:
        """Relay what is left, wait for the sinks, and close the logs; True if all drained."""
        try:
            self.poll()
            self._emitter.drain()
        finally:
            self.close()
        return self._emitter.drained

    def close(self) -> None:
        """Close the followed files (idempotent)."""
        for follower in self._followers:
            follower.close()
