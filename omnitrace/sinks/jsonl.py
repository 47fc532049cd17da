"""An append-only JSON Lines event log, and the reader that rebuilds typed events from it.

One event per line, with a versioned schema::

    {"v": 1, "type": "GraphCaptured", "pid": 4242, "rank": 0, "adapter": "vision", ...}

Every line names the writing process (``pid``) and its worker rank (``RANK`` or
``LOCAL_RANK``, else 0), so the logs of several workers can be merged and still told
apart. Each batch the bus delivers is written with one unbuffered ``write()`` (per file), so
another process (``omnitrace top --follow``) sees whole lines as they happen. The file is
rotated before a line would grow it past ``max_bytes`` (a batch is split across files, so a
file exceeds ``max_bytes`` only when a single line is longer than that): ``events.jsonl``
becomes ``events.jsonl.1`` and so on, up to ``backups`` old files; the oldest is deleted.

Besides events, the writer records what the bus knows about each adapter (its graph cap
and memory floor) as ``"type": "AdapterInfo"`` lines; :func:`read_events` skips those,
:func:`read_records` yields them. A file started by rotation begins with a
``"type": "LogSegment"`` line counting the events of the log before it and how many of
those rotation deleted; :func:`log_gap` reads it, so a reader can say that the start of a
log is missing and how much of it.

Only regular files are written, rotated or deleted: a path that is a device, a named pipe,
a directory or a symbolic link is refused with a :class:`~omnitrace.config.ConfigError`.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import threading
import time
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, Protocol

from omnitrace._files import check_regular, open_regular, unlink_regular, write_all
from omnitrace.config import ConfigError, OmnitraceError
from omnitrace.events import EVENT_TYPES, Event, MissReason

__all__ = [
    "SCHEMA_VERSION",
    "AdapterInfo",
    "EventLogError",
    "EventLogFollower",
    "EventRecord",
    "JsonlSink",
    "LogSegment",
    "decode_record",
    "encode_event",
    "follow",
    "log_gap",
    "read_events",
    "read_records",
    "worker_rank",
]

#: Version written on every line; a reader refuses lines of a newer version.
SCHEMA_VERSION = 1

logger = logging.getLogger("omnitrace.jsonl")

_EVENT_CLASSES: dict[str, type[Event]] = {cls.__name__: cls for cls in EVENT_TYPES}
_EVENT_FIELDS: dict[str, tuple[dataclasses.Field[Any], ...]] = {
    cls.__name__: dataclasses.fields(cls) for cls in EVENT_TYPES
}
_INFO_TYPE = "AdapterInfo"
_SEGMENT_TYPE = "LogSegment"
#: Longest first line :func:`log_gap` reads (a segment header is about 120 bytes).
_HEADER_MAX = 4096


class EventLogError(OmnitraceError, ValueError):
    """An event log line cannot be read (newer schema, unknown type, missing field)."""


class _AdapterSource(Protocol):
    """What the sink needs from an EventBus: the registered adapter facts."""

    def adapters(self) -> Mapping[str, Mapping[str, Any]]: ...


@dataclass(frozen=True, slots=True)
class AdapterInfo:
    """Static facts about an adapter as its bus registered them (cap, floor, backend)."""

    adapter: str
    info: Mapping[str, Any]


@dataclass(frozen=True, slots=True)
class LogSegment:
    """The first line of a file started by rotation: what the log held before this file."""

    events_before: int
    """Events in the earlier files of the log, as far as the writer knew."""
    events_deleted: int
    """Events rotation had deleted from the log when this file began (older files past
    ``backups``, or truncation with ``backups=0``)."""


@dataclass(frozen=True, slots=True)
class EventRecord:
    """One line of an event log: the event (or adapter info) and the process that wrote it."""

    item: Event | AdapterInfo
    pid: int
    rank: int

    @property
    def source(self) -> tuple[int, int]:
        """``(rank, pid)``: identifies the writing worker."""
        return self.rank, self.pid


def worker_rank(environ: Mapping[str, str] | None = None) -> int:
    """Return the worker rank from ``RANK`` or ``LOCAL_RANK`` (0 when neither is set).

    Raises:
        ConfigError: the variable is set but is not a nonnegative integer.
    """
    env = os.environ if environ is None else environ
    for name in ("RANK", "LOCAL_RANK"):
        raw = env.get(name)
        if raw is None or raw == "":
            continue
        try:
            rank = int(raw)
        except ValueError:
            rank = -1
        if rank < 0:
            raise ConfigError(f"{name}: expected a nonnegative integer, got {raw!r}")
        return rank
    return 0


def encode_event(event: Event, *, pid: int, rank: int) -> dict[str, Any]:
    """Return the JSON-ready record of ``event`` (schema version :data:`SCHEMA_VERSION`)."""
    record: dict[str, Any] = {
        "v": SCHEMA_VERSION,
        "type": type(event).__name__,
        "pid": pid,
        "rank": rank,
    }
    for field in _EVENT_FIELDS[type(event).__name__]:
        value = getattr(event, field.name)
        record[field.name] = value.value if isinstance(value, MissReason) else value
    return record


_JSON_TYPES: dict[str, tuple[type, ...]] = {"str": (str,), "int": (int,), "float": (int, float)}


def _decode_field(cls_name: str, field: dataclasses.Field[Any], value: object, where: str) -> Any:
    # MissReason is the only non-JSON type in an event; it is written as its value.
    if field.name == "reason":
        try:
            return MissReason(value)
        except ValueError:
            valid = ", ".join(r.value for r in MissReason)
            raise EventLogError(
                f"{where}: {cls_name}.reason: expected one of {valid}, got {value!r}"
            ) from None
    expected = _JSON_TYPES.get(str(field.type))
    if expected is not None and (isinstance(value, bool) or not isinstance(value, expected)):
        raise EventLogError(
            f"{where}: {cls_name}.{field.name}: expected {field.type}, got {value!r}"
        )
    return value


def decode_record(record: Mapping[str, Any], *, where: str = "record") -> EventRecord:
    """Rebuild the typed event (or adapter info) from one parsed log line.

    Raises:
        EventLogError: the line has a newer schema version, an unknown type or a missing
            field; the message says where and what.
    """
    version = record.get("v")
    if isinstance(version, bool) or not isinstance(version, int):
        raise EventLogError(f"{where}: expected an integer schema version 'v', got {version!r}")
    if version > SCHEMA_VERSION:
        raise EventLogError(
            f"{where}: event log schema version {version} is newer than this omnitrace reads "
            f"(version {SCHEMA_VERSION}); upgrade omnitrace to read this log"
        )
    if version < 1:
        raise EventLogError(f"{where}: unknown event log schema version {version}")
    type_name = record.get("type")
    pid = record.get("pid", 0)
    rank = record.get("rank", 0)
    if not isinstance(pid, int) or not isinstance(rank, int):
        raise EventLogError(f"{where}: expected integer 'pid' and 'rank', got {pid!r}, {rank!r}")
    if type_name == _INFO_TYPE:
        adapter = record.get("adapter")
        info = record.get("info")
        if not isinstance(adapter, str) or not isinstance(info, dict):
            raise EventLogError(f"{where}: AdapterInfo needs 'adapter' (str) and 'info' (object)")
        return EventRecord(AdapterInfo(adapter, info), pid, rank)
    cls = _EVENT_CLASSES.get(type_name) if isinstance(type_name, str) else None
    if cls is None:
        valid = ", ".join(sorted([*_EVENT_CLASSES, _INFO_TYPE]))
        raise EventLogError(f"{where}: unknown record type {type_name!r} (valid: {valid})")
    kwargs: dict[str, Any] = {}
    for field in _EVENT_FIELDS[cls.__name__]:
        if field.name not in record:
            raise EventLogError(f"{where}: {cls.__name__} is missing field {field.name!r}")
        kwargs[field.name] = _decode_field(cls.__name__, field, record[field.name], where)
    return EventRecord(cls(**kwargs), pid, rank)


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
        for label, value in (("max_bytes", max_bytes), ("backups", backups)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ConfigError(f"{label}: expected a nonnegative integer, got {value!r}")
        self.pid = os.getpid()
        self.rank = worker_rank()
        self.path = Path(os.fspath(path).format(pid=self.pid, rank=self.rank))
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
        for existing in _rotated_files(self.path):
            check_regular(existing, "event log")
        if fresh:
            for old in _rotated_files(self.path):
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
                header = _segment_of(probe.readline(_HEADER_MAX))
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
                "type": _INFO_TYPE,
                "pid": self.pid,
                "rank": self.rank,
                "adapter": adapter,
                "info": dict(info),
            }
            lines.append(_dumps(record))
        return lines

    def handle(self, events: Sequence[Event]) -> None:
        """Write ``events``: one unbuffered write per file, rotating between lines."""
        pid, rank = self.pid, self.rank
        lines = [_dumps(encode_event(event, pid=pid, rank=rank)) for event in events]
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
            here = _count_events(self.path)
        deleted = 0
        os.close(self._fd)
        self._fd = None
        if self.backups:
            oldest = self._backup(self.backups)
            if check_regular(oldest, "event log"):
                known = self._backup_events.get(self.backups)
                deleted = _count_events(oldest) if known is None else known
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
            "type": _SEGMENT_TYPE,
            "pid": self.pid,
            "rank": self.rank,
            "events_before": self._events_before,
            "events_deleted": self._events_deleted,
        }
        # Adapter facts go into every file, so a reader of the newest file alone has them.
        self._described.clear()
        self._write([_dumps(header), *self._info_lines()], 0)

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

    def __repr__(self) -> str:
        return f"<JsonlSink {str(self.path)!r} written={self.written}>"


_SINKS: weakref.WeakSet[JsonlSink] = weakref.WeakSet()


def _after_fork_in_child() -> None:
    for sink in list(_SINKS):
        sink._after_fork_in_child()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def _count_events(path: Path) -> int:
    """Count the complete event lines of a log file written by this module."""
    data = path.read_bytes()
    lines = data.count(b"\n")
    # The writer's compact JSON puts the type right after the version; a quote inside a
    # string value is escaped, so these markers only match record types.
    return (
        lines
        - data.count(b'"type":"' + _INFO_TYPE.encode() + b'"')
        - data.count(b'"type":"' + _SEGMENT_TYPE.encode() + b'"')
    )


def _segment_of(line: bytes) -> LogSegment | None:
    """Decode ``line`` as a segment header; None when it is anything else."""
    try:
        record = json.loads(line)
    except (ValueError, RecursionError):
        return None
    if not isinstance(record, dict) or record.get("type") != _SEGMENT_TYPE:
        return None
    before, deleted = record.get("events_before"), record.get("events_deleted")
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in (before, deleted)):
        return None
    return LogSegment(int(before), int(deleted))  # type: ignore[arg-type]


def _first_header(file: Path) -> LogSegment | None:
    try:
        with open(file, "rb") as probe:
            return _segment_of(probe.readline(_HEADER_MAX))
    except FileNotFoundError:
        return None


def log_gap(path: str | os.PathLike[str]) -> LogSegment | None:
    """Return what is missing from the start of a log, or None when it starts at its start.

    The oldest surviving file's header says how many events came before it (all missing);
    the newest file's header says how many events rotation deleted in all. Stats derived
    from such a log do not cover the missing events.
    """
    files = [f for f in _rotated_files(Path(os.fspath(path))) if f.exists()]
    oldest = _first_header(files[0]) if files else None
    if oldest is None or oldest.events_before <= 0:
        return None
    newest = _first_header(files[-1])
    deleted = newest.events_deleted if newest is not None else oldest.events_deleted
    return LogSegment(oldest.events_before, deleted)


def _dumps(record: Mapping[str, Any]) -> bytes:
    return json.dumps(record, separators=(",", ":"), ensure_ascii=False).encode() + b"\n"


def _parse_lines(
    data: bytes,
    path: Path,
    first_line: int,
    *,
    final: bool,
    torn: list[int] | None = None,
) -> tuple[list[EventRecord], int]:
    """Decode the complete lines of ``data``; return the records and bytes consumed.

    A trailing piece without a newline is a batch still being written: it is left
    unconsumed, unless ``final`` (a finished file), where it is a torn line and skipped.
    Skipped lines are logged, or, with ``torn``, their numbers are appended to it instead.
    """
    records: list[EventRecord] = []
    consumed = 0
    line_no = first_line
    while consumed < len(data):
        end = data.find(b"\n", consumed)
        if end < 0:
            if final:
                if torn is None:
                    logger.warning("%s:%d: skipping a torn last line", path, line_no + 1)
                else:
                    torn.append(line_no + 1)
                consumed = len(data)
            break
        raw = data[consumed:end]
        consumed = end + 1
        line_no += 1
        if not raw.strip():
            continue
        try:
            parsed = json.loads(raw)
        except (ValueError, RecursionError):
            # A writer that crashed mid-write leaves one torn line; the next writer starts
            # on a fresh line, so this loses that one record only.
            if torn is None:
                logger.warning("%s:%d: skipping a torn line", path, line_no)
            else:
                torn.append(line_no)
            continue
        if not isinstance(parsed, dict):
            raise EventLogError(f"{path}:{line_no}: expected a JSON object, got {raw[:60]!r}")
        if parsed.get("type") == _SEGMENT_TYPE:
            continue  # describes the file, not an event: see log_gap()
        records.append(decode_record(parsed, where=f"{path}:{line_no}"))
    return records, consumed


def _rotated_files(path: Path) -> list[Path]:
    """Return ``path``'s rotated files, oldest first, then ``path`` itself."""
    backups: list[tuple[int, Path]] = []
    for candidate in path.parent.glob(f"{path.name}.*"):
        suffix = candidate.name[len(path.name) + 1 :]
        if suffix.isdigit():
            backups.append((int(suffix), candidate))
    return [p for _, p in sorted(backups, reverse=True)] + [path]


def read_records(
    path: str | os.PathLike[str], *, include_rotated: bool = True
) -> Iterator[EventRecord]:
    """Yield every record of a finished log, oldest first.

    With ``include_rotated``, the rotated files (``path.N`` … ``path.1``) are read before
    ``path``. A torn last line is skipped.

    Raises:
        FileNotFoundError: ``path`` does not exist.
        EventLogError: ``path`` is a directory, a file with no event record at all (not an
            event log), or has a line of a newer schema version or an unknown type.
    """
    base = Path(os.fspath(path))
    if base.is_dir():
        raise EventLogError(f"{base}: is a directory, not an event log")
    if not base.exists():
        raise FileNotFoundError(f"no event log at {base}")
    files = _rotated_files(base) if include_rotated else [base]
    for file in files:
        data = file.read_bytes()
        torn: list[int] = []
        records, _ = _parse_lines(data, file, 0, final=True, torn=torn)
        if torn and not records:
            raise EventLogError(
                f"{file}: not an omnitrace event log (no line is an event record; "
                f"line {torn[0]} is not JSON)"
            )
        for line_no in torn:
            logger.warning("%s:%d: skipping a torn line", file, line_no)
        yield from records


def read_events(path: str | os.PathLike[str], *, include_rotated: bool = True) -> Iterator[Event]:
    """Yield the typed events of a finished log, oldest first (adapter info is skipped).

    ``derive_stats(read_events(path))`` gives the stats the writing process had, as long as
    no rotated file was deleted.
    """
    for record in read_records(path, include_rotated=include_rotated):
        item = record.item
        if not isinstance(item, AdapterInfo):
            yield item


class EventLogFollower:
    """Read a log that another process is still writing, like ``tail -F``.

    ``poll()`` returns the records completed since the last poll, never blocks, holds back
    a half-written last line until its newline arrives, and follows the writer across a
    rotation (it finishes the renamed file, then opens the new one).
    """

    def __init__(self, path: str | os.PathLike[str], *, from_start: bool = True) -> None:
        self.path = Path(os.fspath(path))
        self._file: IO[bytes] | None = None
        self._inode: int | None = None
        self._pending = b""
        self._line = 0
        self._from_start = from_start

    def _try_open(self) -> bool:
        try:
            file = open(self.path, "rb")  # noqa: SIM115 -- kept open between polls
        except FileNotFoundError:
            return False
        if not self._from_start:
            file.seek(0, os.SEEK_END)
            self._from_start = True  # only the first file is joined at its end
        self._file = file
        self._inode = os.fstat(file.fileno()).st_ino
        self._pending = b""
        self._line = 0
        return True

    def poll(self) -> list[EventRecord]:
        """Return the records written since the last call (possibly none)."""
        if self._file is None and not self._try_open():
            return []
        out = self._drain()
        try:
            current = os.stat(self.path)
        except FileNotFoundError:
            return out  # mid-rotation: the new file appears on a later poll
        assert self._file is not None
        if current.st_ino != self._inode:
            out.extend(self._drain(final=True))
            self._file.close()
            self._file = None
            if self._try_open():
                out.extend(self._drain())
        elif current.st_size < self._file.tell():
            # Truncated in place (backups=0): start over at the top.
            self._file.seek(0)
            self._pending = b""
            self._line = 0
            out.extend(self._drain())
        return out

    def _drain(self, *, final: bool = False) -> list[EventRecord]:
        assert self._file is not None
        data = self._pending + self._file.read()
        records, consumed = _parse_lines(data, self.path, self._line, final=final)
        self._line += data.count(b"\n", 0, consumed)
        self._pending = data[consumed:]
        return records

    def close(self) -> None:
        """Close the file being followed (idempotent)."""
        if self._file is not None:
            self._file.close()
            self._file = None

    def __enter__(self) -> EventLogFollower:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def follow(
    path: str | os.PathLike[str],
    *,
    poll_interval: float = 0.1,
    stop: Callable[[], bool] | None = None,
    from_start: bool = True,
) -> Iterator[Event]:
    """Yield the events of a log as another process writes them, until ``stop()`` is true.

    Without ``stop`` it follows forever (end it by closing the generator).
    """
    with EventLogFollower(path, from_start=from_start) as follower:
        while True:
            for record in follower.poll():
                if not isinstance(record.item, AdapterInfo):
                    yield record.item
            if stop is not None and stop():
                for record in follower.poll():
                    if not isinstance(record.item, AdapterInfo):
                        yield record.item
                return
            time.sleep(poll_interval)
