"""Event logs read back: whole finished logs a chunk at a time, and logs still written.

The format (schema, records, the codec of one line) is :mod:`omnitrace.eventlog_codec`;
its names are re-exported here, so readers and the writer import one module. The writer
is :class:`omnitrace.sinks.jsonl.JsonlSink`; ``omnitrace top``, ``replay`` and ``advise``
only read, through this module, so they never load a sink.

A finished log is read a chunk (:data:`READ_CHUNK`) at a time, so a reader's memory does
not grow with the log: :func:`read_records` and :func:`read_events` yield as they read.
Nearly every line is decoded by the fast path (:mod:`omnitrace.eventlog_fast`); any line it
does not take goes through :func:`decode_record`, which converts it or says what is wrong.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO, cast

import orjson

from omnitrace._files import open_regular_for_reading
from omnitrace.eventlog_codec import (
    HEADER_MAX,
    INFO_TYPE,
    SCHEMA_VERSION,
    SEGMENT_TYPE,
    AdapterInfo,
    EventLogError,
    EventRecord,
    LineEncoder,
    LogSegment,
    decode_record,
    decode_signature,
    dumps,
    encode_event,
    encode_signature,
    segment_of,
)
from omnitrace.eventlog_fast import FastDecoder
from omnitrace.events import Event

__all__ = [
    "HEADER_MAX",
    "INFO_TYPE",
    "READ_CHUNK",
    "SCHEMA_VERSION",
    "SEGMENT_TYPE",
    "UNREADABLE_SHOWN",
    "AdapterInfo",
    "EventLogError",
    "EventLogFollower",
    "EventRecord",
    "LineEncoder",
    "LogSegment",
    "count_events",
    "decode_record",
    "decode_signature",
    "dumps",
    "encode_event",
    "encode_signature",
    "follow",
    "log_bytes",
    "log_gap",
    "read_chunks",
    "read_events",
    "read_records",
    "rotated_files",
    "segment_of",
]

logger = logging.getLogger(__name__)


def count_events(path: Path) -> int:
    """Count the complete event lines of a log file written by this module."""
    # The writer's compact JSON puts the type right after the version; a quote inside a
    # string value is escaped, so these markers only match record types.
    markers = [b'"type":"' + name.encode() + b'"' for name in (INFO_TYPE, SEGMENT_TYPE)]
    count = 0
    rest = b""
    with path.open("rb") as file:
        # By whole lines, a chunk at a time: no marker is cut in two, and the memory is a
        # chunk's whatever the file's size.
        while block := file.read(READ_CHUNK):
            data = rest + block
            cut = data.rfind(b"\n") + 1
            rest = data[cut:]
            count += data.count(b"\n", 0, cut) - sum(data.count(m, 0, cut) for m in markers)
    return count


def _open_log(path: Path) -> IO[bytes]:
    """Open an event log file for reading.

    Raises:
        EventLogError: ``path`` is not a regular file (a named pipe would block the reader
            forever, a device never end).
        OSError: it cannot be opened (``FileNotFoundError`` when missing).
    """
    fd, kind = open_regular_for_reading(path)
    if kind is not None:
        raise EventLogError(f"{path}: is {kind}, not an event log")
    return os.fdopen(fd, "rb")


def _read_log(path: Path) -> bytes:
    with _open_log(path) as file:
        return file.read()


def _first_header(file: Path) -> LogSegment | None:
    try:
        with _open_log(file) as probe:
            return segment_of(probe.readline(HEADER_MAX))
    except (FileNotFoundError, EventLogError):
        return None  # no header to read: the readers refuse such a file themselves


def log_gap(path: str | os.PathLike[str]) -> LogSegment | None:
    """Return what is missing from the start of a log, or None when it starts at its start.

    The oldest surviving file's header says how many events came before it (all missing);
    the newest file's header says how many events rotation deleted in all. Stats derived
    from such a log do not cover the missing events.
    """
    files = [f for f in rotated_files(Path(os.fspath(path))) if f.exists()]
    oldest = _first_header(files[0]) if files else None
    if oldest is None or oldest.events_before <= 0:
        return None
    newest = _first_header(files[-1])
    deleted = newest.events_deleted if newest is not None else oldest.events_deleted
    return LogSegment(oldest.events_before, deleted)


_FAST = FastDecoder()


def _skipped(path: Path, line_no: int, torn: bool) -> None:
    if torn:
        logger.warning("%s:%d: skipping a torn last line", path, line_no)
    else:
        logger.warning("%s:%d: skipping an unreadable line (not JSON)", path, line_no)


def _parse_lines(
    data: bytes,
    path: Path,
    first_line: int,
    *,
    final: bool,
    skipped: list[tuple[int, bool]] | None = None,
    bad: list[EventLogError] | None = None,
) -> tuple[list[EventRecord], int]:
    """Decode the complete lines of ``data``; return the records and bytes consumed.

    A trailing piece without a newline is a batch still being written: it is left
    unconsumed, unless ``final`` (a finished file), where it is a torn line and skipped.
    A line that is not JSON is skipped as unreadable. Skipped lines are logged, or, with
    ``skipped``, appended to it as ``(line number, torn)`` instead. A line that is no
    record this reader knows raises :class:`EventLogError`, or, with ``bad``, is appended
    to it as one and skipped.
    """
    lines = data.split(b"\n")
    rest = lines.pop()  # after the last newline: empty, or a line still being written
    consumed = len(data) - len(rest)
    # The writer's own lines, nearly all of them, take the fast path.
    taken, declined = _FAST.lines(lines)
    if declined:
        records = _declined(taken, lines, path, first_line, skipped, bad)
    else:
        records = cast("list[EventRecord]", taken)
    if rest and final:
        torn = first_line + len(lines) + 1
        if skipped is None:
            _skipped(path, torn, True)
        else:
            skipped.append((torn, True))
        consumed = len(data)
    return records, consumed


def _declined(
    taken: list[EventRecord | None],
    lines: list[bytes],
    path: Path,
    first_line: int,
    skipped: list[tuple[int, bool]] | None,
    bad: list[EventLogError] | None,
) -> list[EventRecord]:
    """The records of ``lines``: those the fast path took, and the others parsed whole."""
    records: list[EventRecord] = []
    append = records.append
    fast = _FAST
    for line_no, (record, raw) in enumerate(zip(taken, lines, strict=True), first_line + 1):
        if record is not None:
            append(record)
            continue
        try:
            parsed = orjson.loads(raw)
        except (ValueError, RecursionError):
            if not raw.strip():
                continue
            # A writer that crashed mid-write leaves one torn line; the next writer starts
            # on a fresh line, so this loses that one record only. Any other line that is
            # not JSON (an edit, a stray write) is skipped as unreadable the same way.
            if skipped is None:
                _skipped(path, line_no, False)
            else:
                skipped.append((line_no, False))
            continue
        if type(parsed) is dict:
            # A writer's line in another form (keys in another order, say) may take it
            # parsed.
            decoded = fast(parsed)
            if decoded is not None:
                append(decoded)
                continue
        try:
            if not isinstance(parsed, dict):
                raise EventLogError(f"{path}:{line_no}: expected a JSON object, got {raw[:60]!r}")
            if parsed.get("type") == SEGMENT_TYPE:
                continue  # describes the file, not an event: see log_gap()
            append(decode_record(parsed, where=f"{path}:{line_no}"))
        except EventLogError as exc:
            if bad is None:
                raise
            bad.append(exc)
    return records


def rotated_files(path: Path) -> list[Path]:
    """Return ``path``'s rotated files, oldest first, then ``path`` itself."""
    backups: list[tuple[int, Path]] = []
    for candidate in path.parent.glob(f"{path.name}.*"):
        suffix = candidate.name[len(path.name) + 1 :]
        if suffix.isdigit():
            backups.append((int(suffix), candidate))
    return [p for _, p in sorted(backups, reverse=True)] + [path]


#: Bytes a reader takes from a file at a time: its memory is this, whatever the log's size.
#: Small enough that a chunk's lines and records stay in the processor's cache while they
#: are decoded and folded: ``top`` took about 1.4 times as long with chunks of 4 MiB.
READ_CHUNK = 1 << 16
#: Unreadable lines of a file warned about one by one; the rest are counted in one line.
UNREADABLE_SHOWN = 20


def log_bytes(path: str | os.PathLike[str], *, include_rotated: bool = True) -> int:
    """Return the bytes :func:`read_records` reads for ``path`` (for a progress display)."""
    base = Path(os.fspath(path))
    total = 0
    for file in rotated_files(base) if include_rotated else [base]:
        with contextlib.suppress(OSError):
            total += file.stat().st_size
    return total


def read_records(
    path: str | os.PathLike[str],
    *,
    include_rotated: bool = True,
    progress: Callable[[int], None] | None = None,
) -> Iterator[EventRecord]:
    """Yield every record of a finished log, oldest first, reading it a chunk at a time.

    With ``include_rotated``, the rotated files (``path.N`` … ``path.1``) are read before
    ``path``. A torn last line and lines that are not JSON are skipped, with a warning
    naming each (the unreadable ones past :data:`UNREADABLE_SHOWN` of a file counted in
    one). ``progress(n)``, if given, is called with the bytes of each chunk read.

    Raises:
        FileNotFoundError: ``path`` does not exist.
        EventLogError: ``path`` (or a rotated file) is not a regular file (a directory, a
            named pipe, a device), a file with no event record at all (not an event log),
            or has a line of a newer schema version or an unknown type (raised when the
            reading reaches it: the records before it have been yielded).
    """
    for chunk in read_chunks(path, include_rotated=include_rotated, progress=progress):
        yield from chunk


def read_chunks(
    path: str | os.PathLike[str],
    *,
    include_rotated: bool = True,
    progress: Callable[[int], None] | None = None,
) -> Iterator[list[EventRecord]]:
    """Yield the records of :func:`read_records` a chunk's worth at a time (same errors)."""
    base = Path(os.fspath(path))
    if not base.exists():
        raise FileNotFoundError(f"no event log at {base}")
    files = rotated_files(base) if include_rotated else [base]
    for file in files:
        yield from _file_chunks(file, progress)


def _file_chunks(file: Path, progress: Callable[[int], None] | None) -> Iterator[list[EventRecord]]:
    with _open_log(file) as handle:
        pending = b""
        line = 0
        # Lines skipped before the file's first record: a file with none is no event log.
        held: list[tuple[int, bool]] = []
        found = False
        unreadable = 0
        while True:
            block = handle.read(READ_CHUNK)
            data = pending + block if pending else block
            skipped: list[tuple[int, bool]] = []
            records, consumed = _parse_lines(data, file, line, final=not block, skipped=skipped)
            line += data.count(b"\n", 0, consumed)
            pending = data[consumed:]
            if progress is not None and block:
                progress(len(block))
            if not found:
                held += skipped
                skipped = held if records else []
            for line_no, torn in skipped:
                unreadable += not torn
                if torn or unreadable <= UNREADABLE_SHOWN:
                    _skipped(file, line_no, torn)
            if records:
                found = True
                yield records
            if not block:
                break
    if held and not found:
        raise EventLogError(
            f"{file}: not an omnitrace event log (no line is an event record; "
            f"line {held[0][0]} is not JSON)"
        )
    if unreadable > UNREADABLE_SHOWN:
        logger.warning(
            "%s: %d unreadable lines skipped in all (%d more than shown)",
            file,
            unreadable,
            unreadable - UNREADABLE_SHOWN,
        )


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
    a half-written last line until its newline arrives, and follows the writer across
    rotations: it finishes the renamed file, reads the files rotated after it (several
    rotations between two polls), then opens the new one. A log truncated in place starts
    over at its top, also when it grew past the old position before the poll. A path that
    is not a regular file (a named pipe, a device) makes ``poll()`` raise
    :class:`EventLogError` instead of blocking.

    Args:
        path: the log.
        from_start: read what the first file already holds (True), or join it at its end.
        start_offset: join the first file at this byte instead (a writer's size when the
            follow was started for it); the top when the file is shorter by then.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        from_start: bool = True,
        start_offset: int | None = None,
        skip_bad_lines: bool = False,
    ) -> None:
        self.path = Path(os.fspath(path))
        self.bad_lines = 0
        """Lines skipped because they are no record this reader knows (``skip_bad_lines``)."""
        self._bad: list[EventLogError] | None = [] if skip_bad_lines else None
        self._file: IO[bytes] | None = None
        self._inode: int | None = None
        self._pending = b""
        self._line = 0
        self._from_start = from_start
        self._start_offset = start_offset

    def _try_open(self) -> bool:
        try:
            file = _open_log(self.path)  # kept open between polls
        except FileNotFoundError:
            return False
        if self._start_offset is not None:
            if self._start_offset <= os.fstat(file.fileno()).st_size:
                file.seek(self._start_offset)
            self._start_offset = None
            self._from_start = True
        elif not self._from_start:
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
        assert self._file is not None
        out: list[EventRecord] = []
        if self._replaced_in_place():
            self._restart()
        out.extend(self._drain())
        try:
            current = os.stat(self.path)
        except FileNotFoundError:
            return out  # mid-rotation: the new file appears on a later poll
        if current.st_ino != self._inode:
            out.extend(self._drain(final=True))
            self._file.close()
            self._file = None
            for newer in self._rotated_since(current.st_ino):
                out.extend(_read_whole(newer, self._bad))
                self._count_bad()
            if self._try_open():
                out.extend(self._drain())
        elif current.st_size < self._file.tell():
            # Truncated in place (backups=0): start over at the top.
            self._restart()
            out.extend(self._drain())
        return out

    def _replaced_in_place(self) -> bool:
        """Whether the open file was truncated since the last read (and maybe grew again)."""
        file = self._file
        assert file is not None
        position = file.tell()
        end = position - len(self._pending)  # just after the last complete line
        if os.fstat(file.fileno()).st_size < position:
            return True
        if end <= 0:
            return False
        # The byte before the next line was a newline; rewritten content moves it.
        file.seek(end - 1)
        before = file.read(1)
        file.seek(position)
        return before != b"\n"

    def _restart(self) -> None:
        assert self._file is not None
        self._file.seek(0)
        self._pending = b""
        self._line = 0

    def _rotated_since(self, new_inode: int) -> list[Path]:
        """The rotated files newer than the one just finished, oldest first."""
        newer: list[Path] = []
        for backup in reversed(rotated_files(self.path)[:-1]):  # newest (path.1) first
            try:
                inode = os.stat(backup).st_ino
            except FileNotFoundError:
                continue
            if inode == self._inode:
                return newer[::-1]
            if inode != new_inode:
                newer.append(backup)
        # The finished file was rotated out of the backups: every rotated file left is
        # newer than it, and what rotation deleted in between is gone (the writer counted it).
        logger.warning(
            "%s: the log rotated past its backups since it was last read; the files deleted "
            "in between are not relayed (the writer logs how many events rotation deleted)",
            self.path,
        )
        return newer[::-1]

    def _drain(self, *, final: bool = False) -> list[EventRecord]:
        assert self._file is not None
        data = self._pending + self._file.read()
        records, consumed = _parse_lines(data, self.path, self._line, final=final, bad=self._bad)
        self._line += data.count(b"\n", 0, consumed)
        self._pending = data[consumed:]
        self._count_bad()
        return records

    def _count_bad(self) -> None:
        if self._bad:
            for error in self._bad:
                logger.warning("skipping a line: %s", error)
            self.bad_lines += len(self._bad)
            self._bad.clear()

    def close(self) -> None:
        """Close the file being followed (idempotent)."""
        if self._file is not None:
            self._file.close()
            self._file = None

    def __enter__(self) -> EventLogFollower:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _read_whole(path: Path, bad: list[EventLogError] | None) -> list[EventRecord]:
    """The records of a finished (rotated) file; none if it is gone meanwhile."""
    try:
        data = _read_log(path)
    except FileNotFoundError:
        return []
    return _parse_lines(data, path, 0, final=True, bad=bad)[0]


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
