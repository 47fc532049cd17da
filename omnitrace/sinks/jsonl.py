"""The JSON Lines event-log sink: append every event to a file (``{pid}`` and ``{rank}`` in
its path filled in per worker), rotating it by size.

The format (schema, codec) and the reader live in :mod:`omnitrace.eventlog`; their names
are re-exported here. Every line names the writing process (``pid``) and its worker rank
(``RANK`` or ``LOCAL_RANK``, else 0), so the logs of several workers can be merged and still
told apart. Each batch the bus delivers is written with one unbuffered ``write()`` (per file), so
another process (``omnitrace top --follow``) sees whole lines as they happen. The file is
rotated before a line would grow it past ``max_bytes``, its header lines included (a batch is
split across files, so a file exceeds ``max_bytes`` only when a single line is longer than
that): ``events.jsonl`` becomes ``events.jsonl.1`` and so on, up to ``backups`` old files;
the oldest is deleted. A full disk is counted and logged, and writing resumes once space is
freed.

Besides events, the writer records what the bus knows about each adapter (its graph cap
and memory floor) as ``AdapterInfo`` lines, and starts every file it opens by rotation with
a ``LogSegment`` line counting the events before it and how many rotation deleted.

Only regular files are written, rotated or deleted: a path that is a device, a named pipe,
a directory or a symbolic link is refused with a :class:`~omnitrace.config.ConfigError`.
"""

from __future__ import annotations

import errno
import logging
import os
import re
import threading
import weakref
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

from omnitrace._files import check_regular, open_regular, unlink_regular, write_all
from omnitrace._validate import INT64_MAX, check_int, describe
from omnitrace._worker import worker_rank
from omnitrace.bus import EventsNotWritten
from omnitrace.config import ConfigError
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
    "check_log_path",
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


_PLACEHOLDER = re.compile(r"\{(pid|rank)\}")

#: errno values of a full file system or quota: a write fails now and works again once
#: space is freed, so the sink counts the events it could not write and goes on, instead
#: of giving up (which loses every later event).
_NO_SPACE = frozenset({errno.ENOSPC, errno.EDQUOT})


def check_log_path(path: str | os.PathLike[str], label: str = "path") -> str:
    """Return the log path template ``path`` if its only braces are ``{pid}`` and ``{rank}``.

    The template is filled in by substitution, never by ``str.format``: a path from the
    environment must not index, format or look up attributes.

    Raises:
        ConfigError: another brace is in ``path`` (the message names ``label``).
    """
    text = os.fspath(path)
    rest = _PLACEHOLDER.sub("", text)
    if "{" in rest or "}" in rest:
        raise ConfigError(
            f"{label}: expected a path whose only braces are {{pid}} and {{rank}}, "
            f"got {describe(text)}"
        )
    return text


def worker_log_path(
    path: str | os.PathLike[str], *, pid: int, rank: int, label: str = "path"
) -> Path:
    """Return the file a worker writes for the log ``path``: ``{pid}`` and ``{rank}`` filled
    in (the JSONL sink's path, and the one the OTLP relay follows).

    Raises:
        ConfigError: ``path`` has braces other than ``{pid}`` and ``{rank}`` (the message
            names ``label``).
    """
    values = {"pid": str(pid), "rank": str(rank)}
    return Path(_PLACEHOLDER.sub(lambda m: values[m[1]], check_log_path(path, label)))


class JsonlSink:
    """Append every event to a JSON Lines file, rotating it at ``max_bytes``.

    Args:
        path: the log file; ``{pid}`` and ``{rank}`` in it are replaced, so each worker of a
            multi-process server can write a file of its own (no other brace is allowed).
        max_bytes: rotate before a line would grow the file past this size (0: never); at
            least the size of a file's own header lines (its ``LogSegment`` line and an
            ``AdapterInfo`` line per adapter the bus has registered).
        backups: rotated files to keep (``path.1`` is the newest); 0 truncates instead.
            Events in files rotation deletes are counted (``deleted_events``, a warning,
            and the ``LogSegment`` line that starts the next file).
        bus: when given, the adapters it registered (graph cap, memory floor) are written
            as ``AdapterInfo`` lines, so a reader of the log can show them too.
        fresh: delete an existing log and its rotated files first (default: append, so a
            restarted worker continues its log).
        rank: the worker's rank, written on every line and into ``{rank}`` (None: from
            ``RANK``, else ``LOCAL_RANK``, else 0). vLLM's workers set neither variable: the
            plugin passes the rank of vLLM's world group.

    A full file system (``ENOSPC``, ``EDQUOT``) does not stop the sink: the events it could
    not write are counted (``not_written``; the bus counts them as dropped,
    ``write_failed``), the start and the end of the outage are logged, and writing resumes
    once space is freed. A partly written batch is cut back to its last whole line, so the
    file holds exactly the events counted as written. An event JSON cannot carry (a lone
    surrogate, an integer past 64 bits) is counted the same way.

    Raises:
        ConfigError: ``max_bytes`` or ``backups`` is negative, ``max_bytes`` cannot hold a
            file's header lines, the path has a brace other than ``{pid}`` and ``{rank}``,
            the rank variable is bad, or the path or one of its rotated files exists and is
            not a regular file.
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
        rank: int | None = None,
    ) -> None:
        check_int("max_bytes", max_bytes)
        check_int("backups", backups)
        self.pid = os.getpid()
        self.rank = worker_rank() if rank is None else check_int("rank", rank)
        self._encode = LineEncoder(pid=self.pid, rank=self.rank)
        self.path = worker_log_path(path, pid=self.pid, rank=self.rank)
        self.max_bytes = max_bytes
        self.backups = backups
        self.rotations = 0
        self.written = 0
        self.deleted_events = 0
        """Events this sink deleted by rotation."""
        self.not_written = 0
        """Events this sink was given but could not write (a full disk, unencodable)."""
        self._bus = bus
        self._described: set[str] = set()
        self._lock = threading.Lock()
        self._closed = False
        # Lines that must start the current file before anything else (its LogSegment line
        # after a rotation), kept until a write of them succeeds.
        self._segment: list[bytes] = []
        self._lost_while_full: int | None = None
        self._header_warned = False
        self._unencodable_warned = False
        if max_bytes:
            # The header lines of a file must fit in it, or no file would (the counts of a
            # LogSegment line are taken at their widest).
            header = len(self._segment_line(INT64_MAX, INT64_MAX)) + _length(self._head()[0])
            if max_bytes < header:
                raise ConfigError(
                    f"max_bytes: expected 0 (never rotate) or at least {header}, the bytes of "
                    f"a file's own header lines, got {max_bytes}"
                )
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

    def _segment_line(self, events_before: int, events_deleted: int) -> bytes:
        return dumps(
            {
                "v": SCHEMA_VERSION,
                "type": SEGMENT_TYPE,
                "pid": self.pid,
                "rank": self.rank,
                "events_before": events_before,
                "events_deleted": events_deleted,
            }
        )

    def _head(self) -> tuple[list[bytes], list[str]]:
        """The lines the current file still needs before the next events (its pending
        LogSegment line, AdapterInfo lines of adapters it does not describe yet), and the
        adapters those describe."""
        lines = list(self._segment)
        names: list[str] = []
        if self._bus is None:
            return lines, names
        for adapter, info in self._bus.adapters().items():
            if adapter in self._described:
                continue
            record = {
                "v": SCHEMA_VERSION,
                "type": INFO_TYPE,
                "pid": self.pid,
                "rank": self.rank,
                "adapter": adapter,
                "info": dict(info),
            }
            try:
                lines.append(dumps(record))
            except TypeError as exc:
                # Not JSON (a name the adapter would refuse, registered by other code): left
                # out, so the events stay readable.
                self._described.add(adapter)
                logger.warning("%s: adapter info of %a not written: %s", self.path, adapter, exc)
                continue
            names.append(adapter)
        return lines, names

    def handle(self, events: Sequence[Event]) -> None:
        """Write ``events``: one unbuffered write per file, rotating between lines.

        Raises:
            EventsNotWritten: some events could not be written (a full disk, an event JSON
                cannot carry); the rest are, and the sink goes on.
        """
        encode = self._encode
        unencodable = 0
        try:
            lines = [encode(event) for event in events]
        except TypeError:  # orjson.JSONEncodeError: a lone surrogate, an int past 64 bits
            lines, unencodable = self._encode_each(events)
        with self._lock:
            if self._closed:
                raise RuntimeError(f"JsonlSink({str(self.path)!r}) is closed")
            written = self.written
            try:
                self._append(lines)
            except OSError as exc:
                if exc.errno not in _NO_SPACE:
                    raise
                lost = len(lines) - (self.written - written)
                self._disk_full(exc, lost)
                raise EventsNotWritten(lost + unencodable, exc.strerror or str(exc)) from None
            if self._lost_while_full is not None:
                logger.warning(
                    "%s: writing again; %d events were not written while the disk was full",
                    self.path,
                    self._lost_while_full,
                )
                self._lost_while_full = None
        if unencodable:
            raise EventsNotWritten(unencodable, "not encodable as JSON")

    def _encode_each(self, events: Sequence[Event]) -> tuple[list[bytes], int]:
        """Encode one event at a time, leaving out (and counting) the ones JSON cannot carry."""
        lines: list[bytes] = []
        bad = 0
        for event in events:
            try:
                lines.append(self._encode(event))
            except TypeError as exc:
                bad += 1
                if not self._unencodable_warned:
                    self._unencodable_warned = True
                    logger.warning(
                        "%s: a %s event of adapter %a is not written, JSON cannot carry it "
                        "(%s); such events are counted as not written",
                        self.path,
                        type(event).__name__,
                        event.adapter,
                        exc,
                    )
        with self._lock:
            self.not_written += bad
        return lines, bad

    def _disk_full(self, exc: OSError, lost: int) -> None:
        self.not_written += lost
        if self._lost_while_full is None:
            self._lost_while_full = 0
            logger.warning(
                "%s: %s; events are counted as not written until space is freed",
                self.path,
                exc.strerror or exc,
            )
        self._lost_while_full += lost

    def _append(self, lines: list[bytes]) -> None:
        if self._fd is None:
            # A rotation renamed the old file but could not create the new one.
            self._fd = open_regular(self.path, "event log")
        chunk, names = self._head()
        size = self._size + _length(chunk)
        if self.max_bytes and size > self.max_bytes and self._holds_events:
            # The info lines of adapters registered since do not fit: they start a new file.
            self._rotate()
            chunk, names = self._head()
            size = self._size + _length(chunk)
        count = 0
        for line in lines:
            # A line that does not fit starts a new file, unless the file holds no
            # event yet (a line longer than max_bytes gets a file of its own).
            full = self.max_bytes and size + len(line) > self.max_bytes
            if full and (count or self._holds_events):
                self._write(chunk, count, names)
                self._rotate()
                chunk, names = self._head()
                size = self._size + _length(chunk)
                count = 0
            chunk.append(line)
            size += len(line)
            count += 1
        self._write(chunk, count, names)

    def _write(self, lines: list[bytes], events: int, described: list[str]) -> None:
        if not lines:
            return
        fd = self._fd
        assert fd is not None
        data = memoryview(b"".join(lines))
        done = 0
        try:
            while done < len(data):
                done += os.write(fd, data[done:])
        except OSError:
            # A full disk took part of the chunk: keep its whole lines (once the head lines
            # are all in), cut off the torn rest, and count what stayed as written.
            head = len(lines) - events
            kept = data[:done].tobytes().rfind(b"\n") + 1 if done else 0
            whole = data[:kept].tobytes().count(b"\n")
            if whole < head:
                kept, whole = 0, 0
            if done > kept:
                self._take_back(fd, done - kept)
            if kept:
                self._wrote(kept, whole - head, described)
            raise
        self._wrote(len(data), events, described)

    def _wrote(self, size: int, events: int, described: list[str]) -> None:
        self._size += size
        self._segment = []
        self._described.update(described)
        self.written += events
        if events:
            self._holds_events = True
            if self._events_here is not None:
                self._events_here += events

    def _take_back(self, fd: int, torn: int) -> None:
        """Cut off the last ``torn`` bytes a failed write left, so no torn line stays behind
        and the file holds exactly the events counted as written."""
        end = os.lseek(fd, 0, os.SEEK_CUR)  # O_APPEND: just after what this write added
        if os.fstat(fd).st_size == end:  # nobody appended since
            os.ftruncate(fd, end - torn)

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
        self._size = 0
        self._holds_events = False
        self._events_here = 0
        # Written with the file's first lines (and kept until a write succeeds); adapter
        # facts go into every file, so a reader of the newest file alone has them.
        self._segment = [self._segment_line(self._events_before, self._events_deleted)]
        self._described.clear()
        if self.max_bytes and not self._header_warned:
            header = _length(self._head()[0])
            if header > self.max_bytes:
                # Only adapters registered after the sink was built get here (it checked
                # the ones before): their info lines alone outgrow a file.
                self._header_warned = True
                logger.warning(
                    "%s: the header lines of a file (%d bytes, with the adapters registered "
                    "since the sink was built) exceed max_bytes=%d; files will be larger",
                    self.path,
                    header,
                    self.max_bytes,
                )
        self._fd = open_regular(self.path, "event log")

    def _backup(self, index: int) -> Path:
        return self.path.with_name(f"{self.path.name}.{index}")

    def close(self) -> None:
        """Close the file (idempotent); every line is already written."""
        with self._lock:
            self._closed = True
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


def _length(lines: list[bytes]) -> int:
    return sum(len(line) for line in lines)


_SINKS: weakref.WeakSet[JsonlSink] = weakref.WeakSet()


def _after_fork_in_child() -> None:
    for sink in list(_SINKS):
        sink._after_fork_in_child()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def _build_sink(request: SinkRequest) -> JsonlSink:
    # Checked here too, so a bad brace names the variable it came from.
    check_log_path(request.value, SINK_ENV)
    # The rank the plugin found (RANK, LOCAL_RANK, else vLLM's world group: vLLM's own
    # workers set no rank variable), so each rank's file and lines name it.
    return JsonlSink(request.value, bus=request.bus, rank=request.rank)


SINK_ENV = "OMNITRACE_EVENTS_LOG"


#: This sink's entry in the table of omnitrace.sinks.registry, which reads it from here (its
#: description is the first paragraph of this module's docstring).
SINK = SinkDeclaration(name="jsonl", env="OMNITRACE_EVENTS_LOG", order=10, build=_build_sink)
