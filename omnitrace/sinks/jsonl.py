"""The JSON Lines event-log sink: append every event to a file (``{pid}`` and ``{rank}`` in
its path filled in per worker), rotating it by size.

The format (schema, codec) and the reader live in :mod:`omnitrace.eventlog`; their names
are re-exported here. Every line names the writing process (``pid``) and its worker rank
(``RANK`` or ``LOCAL_RANK``, else 0), so the logs of several workers can be merged and still
told apart. Each batch the bus delivers is written with one unbuffered ``write()`` (per file), so
another process (``omnitrace top --follow``) sees whole lines as they happen. The file is
rotated before a line would grow it past ``max_bytes`` (a batch is split across files, so a
file exceeds ``max_bytes`` only when a single line is longer than that): ``events.jsonl``
becomes ``events.jsonl.1`` and so on, up to ``backups`` old files; the oldest is deleted.

Besides events, the writer records what the bus knows about each adapter (its graph cap
and memory floor) as ``AdapterInfo`` lines, and starts every file it opens by rotation with
a ``LogSegment`` line counting the events before it and how many rotation deleted.

Only regular files are written, rotated or deleted: a path that is a device, a named pipe,
a directory or a symbolic link is refused with a :class:`~omnitrace.config.ConfigError`.
"""

from __future__ import annotations

import logging
import os
import threading
import weakref
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

from omnitrace._files import check_regular, open_regular, unlink_regular, write_all
from omnitrace._validate import check_int
from omnitrace._worker import worker_rank
from omnitrace.eventlog import (
    HEADER_MAX,
    INFO_TYPE,
    SCHEMA_VERSION,
    SEGMENT_TYPE,
    AdapterInfo,
    EventLogError,
    EventLogFollower,
    EventRecord,
    LineEncoder,
    LogSegment,
    count_events,
    decode_record,
    dumps,
    encode_event,
    follow,
    log_gap,
    read_events,
    read_records,
    rotated_files,
    segment_of,
)
from omnitrace.events import Event
from omnitrace.sinks.registry import SinkDeclaration, SinkRequest

__all__ = [
    "JsonlSink",
    "worker_log_path",
    "worker_rank",
    # Re-exported from omnitrace.eventlog, where the format and the reader live.
    "SCHEMA_VERSION",
    "AdapterInfo",
    "EventLogError",
    "EventLogFollower",
    "EventRecord",
    "LogSegment",
    "decode_record",
    "encode_event",
    "follow",
    "log_gap",
    "read_events",
    "read_records",
]

logger = logging.getLogger(__name__)


class _AdapterSource(Protocol):
    """What the sink needs from an EventBus: the registered adapter facts."""

    def adapters(self) -> Mapping[str, Mapping[str, Any]]: ...


def worker_log_path(path: str | os.PathLike[str], *, pid: int, rank: int) -> Path:
    """Return the file a worker writes for the log ``path``: ``{pid}`` and ``{rank}`` filled
    in (the JSONL sink's path, and the one the OTLP relay follows)."""
    return Path(os.fspath(path).format(pid=pid, rank=rank))


class JsonlSink:
    """Append every event to a JSON Lines file, rotating it at ``max_bytes``.

    Args:
        path: the log file; ``{pid}`` and ``{rank}`` in it are replaced, so each worker of a
            multi-process server can write a file of its own.
        max_bytes: rotate before a line would grow the file past this size (0: never).
        backups: rotated files to keep (``path.1`` is the newest); 0 truncates instead.
            Events in files rotation deletes are counted (``deleted_events``, a warning,
            and the ``LogSegment`` line that starts the next file).
        bus: when given, the adapters it registered (graph cap, memory floor) are written
            as ``AdapterInfo`` lines, so a reader of the log can show them too.
        fresh: delete an existing log and its rotated files first (default: append, so a
            restarted worker continues its log).

    Raises:
        ConfigError: ``max_bytes`` or ``backups`` is negative, the rank variable is bad, or
            the path or one of its rotated files exists and is not a regular file.
    """

    name = "jsonl"

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        max_bytes: int = 64 << 20,
        backups: int = 3,
        bus: _AdapterSource | None = None,
        fresh: bool = False,
    ) -> None:
        check_int("max_bytes", max_bytes)
        check_int("backups", backups)
        self.pid = os.getpid()
        self.rank = worker_rank()
        self._encode = LineEncoder(pid=self.pid, rank=self.rank)
        self.path = worker_log_path(path, pid=self.pid, rank=self.rank)
        self.max_bytes = max_bytes
        self.backups = backups
        self.rotations = 0
        self.written = 0
        self.deleted_events = 0
        """Events this sink deleted by rotation."""
        self._bus = bus
        self._described: set[str] = set()
        self._lock = threading.Lock()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        # Refuse before anything is touched: a later rotation would replace these.
        for existing in rotated_files(self.path):
            check_regular(existing, "event log")
        if fresh:
            for old in rotated_files(self.path):
                unlink_regular(old, "event log")
        # Known event counts of the rotated files, by suffix (unknown ones are counted
        # when rotation deletes them).
        self._backup_events: dict[int, int] = {}
        self._fd: int | None = self._open()
        _SINKS.add(self)

    def _open(self) -> int:
        fd = open_regular(self.path, "event log")
        size = os.fstat(fd).st_size
        self._events_before, self._events_deleted = 0, 0
        # Events already in the file are unknown until a rotation needs their number.
        self._events_here: int | None = 0 if size == 0 else None
        if size:
            with open(self.path, "rb") as probe:
                header = segment_of(probe.readline(HEADER_MAX))
                probe.seek(size - 1)
                torn = probe.read(1) != b"\n"
            if header is not None:
                self._events_before = header.events_before
                self._events_deleted = header.events_deleted
            if torn:
                # A writer that died mid-line left a torn line: end it, so our first record
                # does not get glued onto it (the reader skips the torn line on its own).
                write_all(fd, b"\n")
                size += 1
        self._size = size
        self._holds_events = size > 0
        return fd

    def _info_lines(self) -> list[bytes]:
        if self._bus is None:
            return []
        lines = []
        for adapter, info in self._bus.adapters().items():
            if adapter in self._described:
                continue
            self._described.add(adapter)
            record = {
                "v": SCHEMA_VERSION,
                "type": INFO_TYPE,
                "pid": self.pid,
                "rank": self.rank,
                "adapter": adapter,
                "info": dict(info),
            }
            lines.append(dumps(record))
        return lines

    def handle(self, events: Sequence[Event]) -> None:
        """Write ``events``: one unbuffered write per file, rotating between lines."""
        encode = self._encode
        lines = [encode(event) for event in events]
        with self._lock:
            if self._fd is None:
                raise RuntimeError(f"JsonlSink({str(self.path)!r}) is closed")
            chunk = self._info_lines()
            size = self._size + sum(len(line) for line in chunk)
            count = 0
            for line in lines:
                # A line that does not fit starts a new file, unless the file holds no
                # event yet (a line longer than max_bytes gets a file of its own).
                full = self.max_bytes and size + len(line) > self.max_bytes
                if full and (count or self._holds_events):
                    self._write(chunk, count)
                    self._rotate()
                    chunk, size, count = [], self._size, 0
                chunk.append(line)
                size += len(line)
                count += 1
            self._write(chunk, count)

    def _write(self, lines: list[bytes], events: int) -> None:
        if not lines:
            return
        assert self._fd is not None
        data = b"".join(lines)
        write_all(self._fd, data)
        self._size += len(data)
        self.written += events
        if events:
            self._holds_events = True
            if self._events_here is not None:
                self._events_here += events

    def _rotate(self) -> None:
        assert self._fd is not None
        here = self._events_here
        if here is None:
            here = count_events(self.path)
        deleted = 0
        os.close(self._fd)
        self._fd = None
        if self.backups:
            oldest = self._backup(self.backups)
            if check_regular(oldest, "event log"):
                known = self._backup_events.get(self.backups)
                deleted = count_events(oldest) if known is None else known
            for index in range(self.backups - 1, 0, -1):
                older = self._backup(index)
                if check_regular(older, "event log"):
                    check_regular(self._backup(index + 1), "event log")
                    os.replace(older, self._backup(index + 1))
                    known = self._backup_events.pop(index, None)
                    if known is not None:
                        self._backup_events[index + 1] = known
            check_regular(self._backup(1), "event log")
            if check_regular(self.path, "event log"):
                os.replace(self.path, self._backup(1))
            self._backup_events[1] = here
        else:
            unlink_regular(self.path, "event log")
            deleted = here
        self.rotations += 1
        self._events_before += here
        self._events_deleted += deleted
        if deleted:
            self.deleted_events += deleted
            logger.warning(
                "%s: rotation deleted %d events (backups=%d); %d deleted from this log in all",
                self.path,
                deleted,
                self.backups,
                self._events_deleted,
            )
        self._fd = open_regular(self.path, "event log")
        self._size = 0
        self._holds_events = False
        self._events_here = 0
        header = {
            "v": SCHEMA_VERSION,
            "type": SEGMENT_TYPE,
            "pid": self.pid,
            "rank": self.rank,
            "events_before": self._events_before,
            "events_deleted": self._events_deleted,
        }
        # Adapter facts go into every file, so a reader of the newest file alone has them.
        self._described.clear()
        self._write([dumps(header), *self._info_lines()], 0)

    def _backup(self, index: int) -> Path:
        return self.path.with_name(f"{self.path.name}.{index}")

    def close(self) -> None:
        """Close the file (idempotent); every line is already written."""
        with self._lock:
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None

    def _after_fork_in_child(self) -> None:
        # A parent thread may have held the lock at fork(); lines written here are the
        # child's own.
        self._lock = threading.Lock()
        self.pid = os.getpid()
        self._encode = LineEncoder(pid=self.pid, rank=self.rank)

    def __repr__(self) -> str:
        return f"<JsonlSink {str(self.path)!r} written={self.written}>"


_SINKS: weakref.WeakSet[JsonlSink] = weakref.WeakSet()


def _after_fork_in_child() -> None:
    for sink in list(_SINKS):
        sink._after_fork_in_child()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def _build_sink(request: SinkRequest) -> JsonlSink:
    # The sink finds the worker's rank in the environment itself.
    return JsonlSink(request.value, bus=request.bus)


#: This sink's entry in the table of omnitrace.sinks.registry, which reads it from here (its
#: description is the first paragraph of this module's docstring).
SINK = SinkDeclaration(name="jsonl", env="OMNITRACE_EVENTS_LOG", order=10, build=_build_sink)
