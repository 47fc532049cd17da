"""The JSON Lines event-log sink: append every event to a file (``{pid}`` and ``{rank}`` in
its path filled in per worker), rotating it by size."""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import re
import stat
import threading
import time
import weakref
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

try:
    import fcntl
except ImportError:  # not POSIX: no advisory locks, one writer per log
    fcntl = None  # type: ignore[assignment]

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

_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_CLOEXEC = getattr(os, "O_CLOEXEC", 0)


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


class _Abandoned(Exception):
    """The bus's ``close()`` gave up on the batch being written: none of the rest is written."""


#: Longest :meth:`JsonlSink.abandon` waits for a write already inside the kernel to return.
ABANDON_WAIT_S = 0.05


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
            restarted worker continues its log). A log another process is writing is not
            deleted: the sink appends to it and says so.
        rank: the worker's rank, written on every line and into ``{rank}`` (None: from
            ``RANK``, else ``LOCAL_RANK``, else 0). vLLM's workers set neither variable: the
            plugin passes the rank of vLLM's world group.

    Several processes may write one path (a template without ``{pid}`` in a data-parallel
    deployment, a forked worker): each write and each rotation happens under an advisory
    lock (``flock``) of the log's directory, so lines stay whole, no file grows past
    ``max_bytes``, a writer that finds the log rotated by another opens the new file, and
    the ``LogSegment`` counts cover every writer's events. Each process says once that it
    shares the log, naming the ``{pid}`` template that gives it a file of its own.

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
        self._template = os.fspath(path)
        self.path = worker_log_path(path, pid=self.pid, rank=self.rank)
        self.max_bytes = max_bytes
        self.backups = backups
        self.rotations = 0
        self.written = 0
        self.deleted_events = 0
        """Events this sink deleted by rotation (its own and other writers')."""
        self.not_written = 0
        """Events this sink was given but could not write (a full disk, unencodable)."""
        self.shared = False
        """Whether another writer was found writing this log too."""
        self._bus = bus
        self._described: set[str] = set()
        # Serializes this process's writes; the directory lock serializes the processes'.
        self._lock = threading.Lock()
        self._closed = False
        # What abandon() and the writing thread agree on (held for no I/O, so abandon()
        # called by the bus's close() never waits for a disk): the batch inside handle(),
        # how many of its events are written, whether a write is under way.
        self._gate = threading.Condition(threading.Lock())
        self._abandoned = False
        self._batch: Sequence[Event] | None = None
        self._batch_written = 0
        self._writing = False
        self._write_disowned = False
        # Lines that must start the current file before anything else (its LogSegment line
        # after a rotation whose write of it failed), kept until a write of them succeeds.
        self._segment: list[bytes] = []
        self._lost_while_full: int | None = None
        self._header_warned = False
        self._unencodable_warned = False
        self._size = 0
        self._events_before, self._events_deleted = 0, 0
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
        # Event counts of rotated files this sink knows, by the file's identity (device,
        # inode, size, mtime): rotation by another writer shifts the names under it.
        self._known: dict[tuple[int, int, int, int], int] = {}
        self._dir_fd = self._open_directory_lock()
        self._fd: int | None = None
        with self._exclusive():
            others = [old for old in rotated_files(self.path) if _in_use(old)]
            if others:
                self._notice_shared("is being written by another process")
            elif fresh:
                for old in rotated_files(self.path):
                    unlink_regular(old, "event log")
            self._fd = self._open()
        _SINKS.add(self)

    # -- the lock several writers share ----------------------------------------------------

    def _open_directory_lock(self) -> int | None:
        """Open the log's directory for ``flock``, or return None where that cannot lock."""
        if fcntl is None:
            return None
        fd = os.open(self.path.parent, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | _CLOEXEC)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            fcntl.flock(fd, fcntl.LOCK_UN)
        except OSError as exc:
            # NFS locks a directory only for reading: one writer per log there.
            os.close(fd)
            logger.warning(
                "%s: this file system cannot lock the directory (%s): several processes "
                "must not write this log; put {pid} in the path for a file per process",
                self.path,
                exc.strerror or exc,
            )
            return None
        return fd

    @contextlib.contextmanager
    def _exclusive(self) -> Iterator[None]:
        """Hold the directory lock: no other writer of this log appends or rotates meanwhile."""
        fd = self._dir_fd
        if fd is None or fcntl is None:
            yield
            return
        fcntl.flock(fd, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)

    def _notice_shared(self, how: str) -> None:
        if self.shared:
            return
        self.shared = True
        logger.warning(
            "%s %s too: writes and rotations are locked, so no line or event is lost, but "
            "the processes' lines interleave; for a file per process put {pid} in the "
            "path (%s)",
            self.path,
            how,
            _with_pid(self._template),
        )

    # -- files -----------------------------------------------------------------------------

    def _open(self) -> int:
        """Open the file at the path (creating it), under the directory lock."""
        fd = open_regular(self.path, "event log")
        if fcntl is not None:
            # Held while the file is open: a fresh writer leaves a log in use alone.
            with contextlib.suppress(OSError):  # NFS: shared locks need a readable file
                fcntl.flock(fd, fcntl.LOCK_SH)
        size = os.fstat(fd).st_size
        # Events already in the file are unknown until a rotation needs their number.
        self._events_here: int | None = 0 if size == 0 else None
        # Adapter facts go into every file, so a reader of one file alone has them.
        self._described.clear()
        if size:
            # Begun by someone else (an earlier run, another writer): its own first line
            # says what came before it. An empty file is ours to begin (the counts and the
            # pending LogSegment line of a rotation stay).
            header = segment_of(_read(self.path, 0, HEADER_MAX).split(b"\n", 1)[0])
            self._events_before, self._events_deleted = (
                (0, 0) if header is None else (header.events_before, header.events_deleted)
            )
            self._segment = []
            size = _end_torn_line(self.path, fd, size)
        self._size = size
        self._holds_events = size > 0
        return fd

    def _sync(self) -> None:
        """Make the descriptor the file now at the path, at its true size (another writer
        may have rotated the log, appended to it or died in the middle of a line)."""
        fd = self._fd
        if fd is not None:
            mine = os.fstat(fd)
            try:
                there = os.lstat(self.path)
            except FileNotFoundError:
                there = None
            if there is None or (there.st_dev, there.st_ino) != (mine.st_dev, mine.st_ino):
                os.close(fd)
                self._fd = None
            elif mine.st_size != self._size:
                self._notice_shared("is appended to by another process")
                self._events_here = None
                self._holds_events = True
                self._size = _end_torn_line(self.path, fd, mine.st_size)
        if self._fd is None:
            self._fd = self._open()
            if self._size:
                self._notice_shared("was rotated by another process")

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

    # -- writing ---------------------------------------------------------------------------

    def handle(self, events: Sequence[Event]) -> None:
        """Write ``events``: one unbuffered write per file, rotating between lines.

        Raises:
            EventsNotWritten: some events could not be written (a full disk, an event JSON
                cannot carry, the bus's close gave up on them); the rest are, and the sink
                goes on.
        """
        with self._gate:
            abandoned = self._abandoned
            self._batch, self._batch_written = events, 0
        if abandoned:
            raise EventsNotWritten(len(events), "the bus closed before they were written")
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
                with self._exclusive():
                    self._append(lines)
            except _Abandoned:
                raise EventsNotWritten(
                    len(events) - (self.written - written),
                    "the bus closed before they were written",
                ) from None
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

    def abandon(self, events: Sequence[Event]) -> int:
        """Write nothing more, and return how many of ``events`` (the batch the bus handed to
        :meth:`handle`) are already in the file.

        The bus's ``close()`` calls it when it stops waiting for the batch, and counts the
        rest as dropped (``abandoned``): the file then holds exactly the events counted as
        delivered. A write already inside the kernel is waited for up to
        :data:`ABANDON_WAIT_S`; one that takes longer is cut off the file when it returns.
        """
        with self._gate:
            self._abandoned = True
            if events is not self._batch:
                return 0  # handle() has not begun it, and now writes none of it
            deadline = time.monotonic() + ABANDON_WAIT_S
            while self._writing and (left := deadline - time.monotonic()) > 0:
                self._gate.wait(left)
            if self._writing:
                self._write_disowned = True
            return self._batch_written

    def _check_abandoned(self) -> None:
        with self._gate:
            if self._abandoned:
                raise _Abandoned

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
        """Write ``lines``, rotating as needed; under the directory lock."""
        self._check_abandoned()
        self._sync()
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
        if events:
            with self._gate:
                if self._abandoned:
                    raise _Abandoned
                self._writing = True
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
                self._cut(fd, self._size + done, self._size + kept)
            if kept:
                self._wrote(fd, kept, whole - head, described)
            elif events:
                self._wrote(fd, 0, 0, [])
            raise
        self._wrote(fd, len(data), events, described)

    def _wrote(self, fd: int, size: int, events: int, described: list[str]) -> None:
        if events or self._writing:
            with self._gate:
                self._writing = False
                self._gate.notify_all()
                disowned, self._write_disowned = self._write_disowned, False
                if not disowned:
                    self._batch_written += events
            if disowned:
                # abandon() stopped waiting for this write and counted it as not written.
                self._cut(fd, self._size + size, self._size)
                raise _Abandoned
        self._size += size
        if size:
            self._segment = []
        self._described.update(described)
        self.written += events
        if events:
            self._holds_events = True
            if self._events_here is not None:
                self._events_here += events

    def _cut(self, fd: int, end: int, to: int) -> None:
        """Cut the file back from ``end`` (where a write left it) to ``to``: off go a torn
        line, or lines no longer counted, so the file holds exactly the events counted as
        written."""
        if end == to:
            return
        if os.fstat(fd).st_size == end:  # nobody appended since (the directory lock)
            os.ftruncate(fd, to)
        else:
            logger.error(
                "%s: %d bytes written but counted as not written could not be cut off (the "
                "file changed since)",
                self.path,
                end - to,
            )

    # -- rotation ----------------------------------------------------------------------------

    def _present_backups(self) -> dict[int, tuple[Path, os.stat_result]]:
        """The rotated files there are (``path.1`` to ``path.<backups>``), by suffix: one
        directory listing, whatever the number of backups allowed."""
        prefix = self.path.name + "."
        found: dict[int, tuple[Path, os.stat_result]] = {}
        with os.scandir(self.path.parent) as entries:
            for entry in entries:
                suffix = entry.name[len(prefix) :]
                if not entry.name.startswith(prefix) or not (suffix.isascii() and suffix):
                    continue
                if not suffix.isdigit() or suffix != str(int(suffix)):
                    continue
                index = int(suffix)
                if 1 <= index <= self.backups:
                    backup = Path(entry.path)
                    info = entry.stat(follow_symlinks=False)
                    if not stat.S_ISREG(info.st_mode):
                        check_regular(backup, "event log")  # raises, naming the kind
                    found[index] = (backup, info)
        return found

    def _rotate(self) -> None:
        """Start a new file, under the directory lock: shift the rotated files up by one,
        deleting (and counting) the oldest."""
        self._check_abandoned()
        fd = self._fd
        assert fd is not None
        here = self._events_here
        if here is None:
            here = count_events(self.path)
        deleted = 0
        if self.backups:
            present = self._present_backups()
            oldest = present.pop(self.backups, None)
            if oldest is not None:
                known = self._known.pop(_identity(oldest[1]), None)
                deleted = count_events(oldest[0]) if known is None else known
                unlink_regular(oldest[0], "event log")
            for index in sorted(present, reverse=True):
                os.replace(present[index][0], self._backup(index + 1))
            mine = os.fstat(fd)
            os.replace(self.path, self._backup(1))
            # Only files still there: the deleted ones' inodes may come back.
            keep = {_identity(info) for _, info in present.values()}
            self._known = {k: n for k, n in self._known.items() if k in keep}
            self._known[_identity(mine)] = here
        else:
            unlink_regular(self.path, "event log")
            deleted = here
        os.close(fd)
        self._fd = None
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
        # Written at once, so that it is the file's first line whoever appends next; kept
        # for the next write should this one (or the file's creation) fail.
        self._segment = [self._segment_line(self._events_before, self._events_deleted)]
        self._fd = self._open()
        try:
            self._write(list(self._segment), 0, [])
        except OSError as exc:
            if exc.errno not in _NO_SPACE:
                raise
        if self.max_bytes and not self._header_warned:
            header = len(self._segment_line(self._events_before, self._events_deleted))
            header += _length(self._head()[0])
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

    def _backup(self, index: int) -> Path:
        return self.path.with_name(f"{self.path.name}.{index}")

    def close(self) -> None:
        """Close the file (idempotent); every line is already written."""
        with self._lock:
            self._closed = True
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None
            if self._dir_fd is not None:
                os.close(self._dir_fd)
                self._dir_fd = None

    def _after_fork_in_child(self) -> None:
        # A parent thread may have held the locks at fork(); lines written here are the
        # child's own. The directory is opened anew: a lock on the inherited description
        # would be the parent's too, and exclude nothing.
        self._lock = threading.Lock()
        self._gate = threading.Condition(threading.Lock())
        self._writing = False
        self.pid = os.getpid()
        self._encode = LineEncoder(pid=self.pid, rank=self.rank)
        if self._dir_fd is not None:
            os.close(self._dir_fd)
            self._dir_fd = self._open_directory_lock()

    def __repr__(self) -> str:
        return f"<JsonlSink {str(self.path)!r} written={self.written}>"


def _in_use(path: Path) -> bool:
    """Whether another writer holds ``path`` open (its shared lock), probed without waiting."""
    if fcntl is None:
        return False
    try:
        fd = os.open(path, os.O_WRONLY | _NOFOLLOW | os.O_NONBLOCK | _CLOEXEC)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    except OSError:
        return False  # no lock here (NFS without a readable descriptor): cannot tell
    finally:
        os.close(fd)
    return False


def _read(path: Path, offset: int, size: int) -> bytes:
    """Read ``size`` bytes at ``offset`` of ``path`` (the writer's own descriptor is
    write-only)."""
    fd = os.open(path, os.O_RDONLY | _NOFOLLOW | os.O_NONBLOCK | _CLOEXEC)
    try:
        return os.pread(fd, size, offset)
    finally:
        os.close(fd)


def _end_torn_line(path: Path, fd: int, size: int) -> int:
    """End a torn last line of ``path``, open as ``fd`` (its writer died in the middle of
    it), so the next record is not glued onto it (the reader skips the torn line on its
    own); return the new size."""
    if size and _read(path, size - 1, 1) != b"\n":
        write_all(fd, b"\n")
        return size + 1
    return size


def _identity(info: os.stat_result) -> tuple[int, int, int, int]:
    return info.st_dev, info.st_ino, info.st_size, info.st_mtime_ns


def _with_pid(template: str) -> str:
    """``template`` with ``{pid}`` added before its suffix (``events-{rank}-{pid}.jsonl``)."""
    if "{pid}" in template:
        return template
    head, tail = os.path.split(template)
    stem, dot, suffix = tail.partition(".")
    return os.path.join(head, f"{stem}-{{pid}}{dot}{suffix}")


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
