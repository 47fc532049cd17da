"""Event logs read back: whole finished logs a chunk at a time, in memory that does not grow
with the log, and logs still written."""

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
from omnitrace.eventlog.codec import (
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
from omnitrace.eventlog.fast import FastDecoder
from omnitrace.events import Event

__all__ = [
    "HEADER_MAX",
    "INFO_TYPE",
    "MAX_LINE",
    "POLL_BYTES",
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
    """Count the complete event lines of a log file written by this module.

    Args:
        path: one file of the log (rotated files are not counted).

    Returns:
        Its complete lines less its ``AdapterInfo`` and ``LogSegment`` lines.

    Raises:
        OSError: the file cannot be opened or read.
    """
    with path.open("rb") as file:
        return _count_event_lines(file.read)


def _count_event_lines(read: Callable[[int], bytes]) -> int:
    """Count the complete lines ``read(n)`` returns until it returns none, less the lines
    that are no event (``AdapterInfo``, ``LogSegment``)."""
    # The writer's compact JSON puts the type right after the version; a quote inside a
    # string value is escaped, so these markers only match record types.
    markers = [b'"type":"' + name.encode() + b'"' for name in (INFO_TYPE, SEGMENT_TYPE)]
    cutter = _Lines()
    markers_seen = 0
    # By whole lines, a chunk at a time: no marker is cut in two, and the memory is a
    # chunk's (and at most MAX_LINE of a line) whatever the file's size.
    while block := read(READ_CHUNK):
        data, _ = cutter.feed(block)
        markers_seen += sum(data.count(m) for m in markers)
        cutter.too_long.clear()  # a line too long to be the writer's still counts as one
    return cutter.line - markers_seen


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

    Args:
        path: the log (its rotated files are looked at too).

    Returns:
        The events missing before the oldest file and those rotation deleted in all, as a
        :class:`LogSegment`; None when nothing is missing (or no file has a header).
    """
    files = [f for f in rotated_files(Path(os.fspath(path))) if f.exists()]
    oldest = _first_header(files[0]) if files else None
    if oldest is None or oldest.events_before <= 0:
        return None
    newest = _first_header(files[-1])
    deleted = newest.events_deleted if newest is not None else oldest.events_deleted
    return LogSegment(oldest.events_before, deleted)


_FAST = FastDecoder()


#: How each kind of skipped line is reported (see :func:`_parse_lines`).
_SKIP_REASONS = {
    "torn": "skipping a torn last line",
    "json": "skipping an unreadable line (not JSON)",
}


def _skipped(path: Path, line_no: int, kind: str) -> None:
    if kind == "long":
        logger.warning(
            "%s:%d: skipping an unreadable line (longer than %d bytes)", path, line_no, MAX_LINE
        )
    else:
        logger.warning("%s:%d: %s", path, line_no, _SKIP_REASONS[kind])


def _parse_lines(
    data: bytes,
    path: Path,
    first_line: int,
    *,
    final: bool,
    skipped: list[tuple[int, str]] | None = None,
    bad: list[EventLogError] | None = None,
) -> tuple[list[EventRecord], int]:
    """Decode the complete lines of ``data``; return the records and bytes consumed.

    A trailing piece without a newline is a batch still being written: it is left
    unconsumed, unless ``final`` (a finished file), where it is a torn line and skipped.
    A line that is not JSON is skipped as unreadable. Skipped lines are logged, or, with
    ``skipped``, appended to it as ``(line number, torn)`` instead. A line that is no
    record this reader knows raises :class:`EventLogError`, or, with ``bad``, is appended
    to it as one and skipped. Skipped lines are ``(line number, kind)``, the kind one of
    ``"torn"``, ``"json"`` (not JSON) and ``"long"`` (longer than :data:`MAX_LINE`, see
    :class:`_Lines`).
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
            _skipped(path, torn, "torn")
        else:
            skipped.append((torn, "torn"))
        consumed = len(data)
    return records, consumed


def _declined(
    taken: list[EventRecord | None],
    lines: list[bytes],
    path: Path,
    first_line: int,
    skipped: list[tuple[int, str]] | None,
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
                _skipped(path, line_no, "json")
            else:
                skipped.append((line_no, "json"))
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
                raise EventLogError(
                    f"{path}:{line_no}: expected a JSON object, {_got(raw, parsed)}"
                )
            if parsed.get("type") == SEGMENT_TYPE:
                continue  # describes the file, not an event: see log_gap()
            append(decode_record(parsed, where=f"{path}:{line_no}"))
        except EventLogError as exc:
            if bad is None:
                raise
            bad.append(exc)
    return records


def rotated_files(path: Path) -> list[Path]:
    """Return ``path``'s rotated files, oldest first, then ``path`` itself.

    Args:
        path: the log; its rotated files are ``path.N`` for any number N.

    Returns:
        The files; ``path`` is last even when it does not exist.
    """
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
#: The longest line a reader takes, in bytes. The writer's lines are a few hundred bytes
#: (an ``AdapterInfo`` line a few thousand); a longer line is no line it wrote, and is
#: skipped as unreadable, by its line number, without being held whole.
MAX_LINE = 1 << 20


class _Lines:
    """Cut the blocks read from a file into runs of whole lines, in time linear in the bytes.

    Only the unfinished last line is held back (at most :data:`MAX_LINE` bytes of it): a
    line that grows past that is dropped as it is read, up to its newline, and its number
    is appended to :attr:`too_long`. :attr:`line` counts the lines handed out or dropped.
    """

    __slots__ = ("_pending", "_skipping", "line", "too_long")

    def __init__(self) -> None:
        self._pending = bytearray()
        self._skipping = False
        self.line = 0
        self.too_long: list[int] = []

    @property
    def held(self) -> int:
        """Bytes of the unfinished last line held back (none while one is dropped)."""
        return len(self._pending)

    @property
    def open_line(self) -> bool:
        """Whether an unfinished line was read (held back or being dropped)."""
        return self._skipping or bool(self._pending)

    def reset(self) -> None:
        self._pending.clear()
        self._skipping = False
        self.line = 0

    def _drop(self) -> None:
        self._pending.clear()
        self._skipping = True
        self.too_long.append(self.line + 1)

    def feed(self, block: bytes) -> tuple[bytes, int]:
        """Return the whole lines that ``block`` (at most :data:`MAX_LINE` bytes) completes,
        each with its newline (``b""`` for none), and the number of the line before the
        first of them."""
        start = 0
        if self._skipping:
            end = block.find(b"\n")
            if end < 0:
                return b"", self.line
            self._skipping = False
            self.line += 1  # the long line, already reported
            start = end + 1
        cut = block.rfind(b"\n") + 1
        if cut <= start:
            self._pending += memoryview(block)[start:]
            if len(self._pending) > MAX_LINE:
                self._drop()
            return b"", self.line
        if self._pending:
            first = block.find(b"\n", start) + 1
            if len(self._pending) + first - start > MAX_LINE + 1:
                self._pending.clear()
                self.too_long.append(self.line + 1)
                self.line += 1
                data = block[first:cut]
            else:
                self._pending += memoryview(block)[start:cut]
                data = bytes(self._pending)
        else:
            data = block[start:cut] if start or cut < len(block) else block
        self._pending = bytearray(memoryview(block)[cut:])
        if len(self._pending) > MAX_LINE:
            self._drop()
        first_line = self.line
        self.line += data.count(b"\n")
        return data, first_line

    def rest(self) -> bytes:
        """The unfinished last line held back (at a file's end: a torn line), taken out."""
        rest = bytes(self._pending)
        self._pending.clear()
        return rest


def log_bytes(path: str | os.PathLike[str], *, include_rotated: bool = True) -> int:
    """Return the bytes :func:`read_records` reads for ``path`` (for a progress display).

    Args:
        path: the log; files that cannot be read count nothing.
        include_rotated: count its rotated files too; default True.
    """
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

    Args:
        path: the log.
        include_rotated: read its rotated files first; default True.
        progress: called with the bytes of each chunk read; default None.

    Raises:
        FileNotFoundError: ``path`` does not exist.
        EventLogError: ``path`` (or a rotated file) is not a regular file (a directory, a
            named pipe, a device), a file with no event record at all (not an event log),
            or has a line of a newer schema version or an unknown type (raised when the
            reading reaches it: the records before it have been yielded).
    """
    for chunk in read_chunks(path, include_rotated=include_rotated, progress=progress):
        yield from chunk


#: What a JSON value that is no object is, in a message.
_JSON_KINDS = {list: "an array", str: "a string", int: "a number", float: "a number"}


def _got(raw: bytes, parsed: object) -> str:
    """Say what a line that is JSON but no object holds: its kind and (the start of) its text."""
    text = raw.strip().decode("utf-8", "replace")
    shown = repr(text) if len(text) <= 60 else f"{text[:60]!r}... ({len(text)} characters)"
    return f"got {_JSON_KINDS.get(type(parsed), 'a literal')}: {shown}"


def read_chunks(
    path: str | os.PathLike[str],
    *,
    include_rotated: bool = True,
    progress: Callable[[int], None] | None = None,
) -> Iterator[list[EventRecord]]:
    """Yield the records of :func:`read_records` a chunk's worth at a time.

    Args:
        path: the log.
        include_rotated: read its rotated files first; default True.
        progress: called with the bytes of each chunk read; default None.

    Raises:
        FileNotFoundError: ``path`` does not exist.
        EventLogError: as for :func:`read_records`.
    """
    base = Path(os.fspath(path))
    if not base.exists():
        raise FileNotFoundError(f"no event log at {base}")
    files = rotated_files(base) if include_rotated else [base]
    for file in files:
        yield from _file_chunks(file, progress)


def _file_chunks(file: Path, progress: Callable[[int], None] | None) -> Iterator[list[EventRecord]]:
    with _open_log(file) as handle:
        cutter = _Lines()
        # Lines skipped before the file's first record: a file with none is no event log.
        held: list[tuple[int, str]] = []
        found = False
        unreadable = 0
        while True:
            block = handle.read(READ_CHUNK)
            if block:
                data, first = cutter.feed(block)
            else:  # the file's end: what is left is a torn last line
                first = cutter.line
                data = cutter.rest()
            skipped: list[tuple[int, str]] = [(n, "long") for n in cutter.too_long]
            cutter.too_long.clear()
            records: list[EventRecord] = []
            if data:
                records, _ = _parse_lines(data, file, first, final=not block, skipped=skipped)
            skipped.sort()
            if progress is not None and block:
                progress(len(block))
            if not found:
                held += skipped
                skipped = held if records else []
            for line_no, kind in skipped:
                unreadable += kind != "torn"
                if kind == "torn" or unreadable <= UNREADABLE_SHOWN:
                    _skipped(file, line_no, kind)
            if records:
                found = True
                yield records
            if not block:
                break
    if held and not found:
        line_no, kind = held[0]
        what = f"longer than {MAX_LINE} bytes" if kind == "long" else "not JSON"
        raise EventLogError(
            f"{file}: not an omnitrace event log (no line is an event record; "
            f"line {line_no} is {what})"
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

    Args:
        path: the log.
        include_rotated: read its rotated files first; default True.

    Raises:
        FileNotFoundError: ``path`` does not exist.
        EventLogError: as for :func:`read_records`.
    """
    for record in read_records(path, include_rotated=include_rotated):
        item = record.item
        if not isinstance(item, AdapterInfo):
            yield item


#: Bytes one poll of a follower reads at most, whatever the log holds, so a poll's memory
#: and time stay bounded; a follower further behind reads the rest in the next polls
#: (:attr:`EventLogFollower.behind`).
POLL_BYTES = 4 << 20
#: Times one poll looks again at a log's files when the writer rotated while it looked
#: (then the next poll looks again).
_SCAN_TRIES = 5


class _Held:
    """One file of a followed log, held open: while held, its identity cannot be reused."""

    __slots__ = ("before", "file", "ident", "joined", "lines", "non_events")

    def __init__(self, file: IO[bytes], joined: int = 0) -> None:
        self.file = file
        status = os.fstat(file.fileno())
        self.ident = (status.st_dev, status.st_ino)
        self.lines = _Lines()
        self.joined = joined
        """The byte the reading started at."""
        self.before: int | None = None
        """Events before this file (its ``LogSegment`` line); None until its first line."""
        self.non_events = 0
        """Lines read that are no event (``AdapterInfo``, ``LogSegment``)."""


class EventLogFollower:
    """Read a log that another process is still writing, like ``tail -F``.

    ``poll()`` returns the records completed since the last poll, never blocks, holds back
    a half-written last line until its newline arrives, and follows the writer across
    rotations. Every file is identified by the descriptor it is read through, held open
    until the file is read to its end, so a file renamed, deleted or replaced meanwhile is
    never mistaken for another (a file system reuses the number of a deleted file, never of
    one held open): after a rotation the follower finishes the renamed file, reads the files
    rotated after it (several rotations between two polls), oldest first, then the new one.
    Each record from the first file it opens on comes once; the events rotation deleted
    before the follower opened their file are counted from the files' ``LogSegment`` lines
    (:attr:`lost_to_rotation`) and warned about. A log truncated in place starts over at
    its top, also when it grew past the old position before the poll. A path that is not a
    regular file (a named pipe, a device) makes ``poll()`` raise :class:`EventLogError`
    instead of blocking.

    One poll reads at most ``poll_bytes`` (:data:`POLL_BYTES`): its memory is bounded
    however large the log is, and :attr:`behind` says whether it left bytes to read.

    Args:
        path: the log.
        from_start: read what the first file already holds (True, the default), or join
            it at its end.
        start_offset: join the first file at this byte instead (a writer's size when the
            follow was started for it); the top when the file is shorter by then. Default
            None.
        skip_bad_lines: skip (and count in :attr:`bad_lines`) a line that is no record this
            reader knows, instead of raising; default False.
        poll_bytes: the bytes one poll reads at most; default :data:`POLL_BYTES` (4 MiB).
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        from_start: bool = True,
        start_offset: int | None = None,
        skip_bad_lines: bool = False,
        poll_bytes: int = POLL_BYTES,
    ) -> None:
        self.path = Path(os.fspath(path))
        self.bad_lines = 0
        """Lines skipped because they are no record this reader knows (``skip_bad_lines``)."""
        self.lost_to_rotation = 0
        """Events rotation deleted before this follower could read them (each gap warned)."""
        self.behind = False
        """Whether the last poll stopped at ``poll_bytes`` with more to read."""
        self._bad: list[EventLogError] | None = [] if skip_bad_lines else None
        # The files still to read, oldest first; the last is the newest found (the live one).
        self._files: list[_Held] = []
        # Events before the next file, as the finished ones say (None: unknown).
        self._expect: int | None = None
        # Whether the file finished last was not found among the backups any more.
        self._passed = False
        self._from_start = from_start
        self._start_offset = start_offset
        self._poll_bytes = max(1, poll_bytes)

    def _try_open(self) -> bool:
        try:
            file = _open_log(self.path)  # kept open between polls
        except FileNotFoundError:
            return False
        joined = 0
        size = os.fstat(file.fileno()).st_size
        if self._start_offset is not None:
            if self._start_offset <= size:
                joined = self._start_offset
            self._start_offset = None
            self._from_start = True
        elif not self._from_start:
            joined = size
            self._from_start = True  # only the first file is joined at its end
        file.seek(joined)
        self._files.append(_Held(file, joined))
        return True

    def poll(self) -> list[EventRecord]:
        """Return the records written since the last call (possibly none), reading at most
        ``poll_bytes``; an empty list while the log does not exist.

        Raises:
            EventLogError: the path is not a regular file, or (without ``skip_bad_lines``)
                a line is no record this reader knows.
        """
        if not self._files and not self._try_open():
            return []
        out: list[EventRecord] = []
        budget = self._poll_bytes
        try:
            while True:
                held = self._files[0]
                last = len(self._files) == 1
                if last and self._replaced_in_place(held):
                    self._restart(held)
                budget = self._read(held, budget, out, final=not last)
                if budget <= 0:
                    break
                if not last:
                    self._finish()
                elif not self._rotated(held):
                    break
        finally:
            self._count_bad()
        self.behind = budget <= 0
        return out

    def _read(self, held: _Held, budget: int, out: list[EventRecord], *, final: bool) -> int:
        """Read ``held`` up to its end or ``budget`` bytes; return the budget left (0: not at
        its end yet). At the end of a finished file (``final``) its torn last line is skipped."""
        read = held.file.read
        lines = held.lines
        while True:
            if budget <= 0:
                return 0
            block = read(min(READ_CHUNK, budget))
            if not block:
                break
            budget -= len(block)
            data, first = lines.feed(block)
            for line_no in lines.too_long:
                _skipped(self.path, line_no, "long")
            lines.too_long.clear()
            if data:
                out += self._parse(held, data, first, final=False)
        if final:
            first = lines.line
            rest = lines.rest()
            if rest:
                out += self._parse(held, rest, first, final=True)
        return budget

    def _parse(self, held: _Held, data: bytes, first: int, *, final: bool) -> list[EventRecord]:
        if held.before is None:
            segment = None
            if first == 0 and held.joined == 0:  # the file's first line
                end = data.find(b"\n")
                head = data[:end] if end >= 0 else data
                if b'"' + SEGMENT_TYPE.encode() + b'"' in head:
                    segment = segment_of(head)
            held.before = 0 if segment is None else segment.events_before
            held.non_events += segment is not None
            self._check_gap(segment)
        records, _ = _parse_lines(data, self.path, first, final=final, bad=self._bad)
        held.non_events += sum(type(record.item) is AdapterInfo for record in records)
        self._count_bad()
        return records

    def _check_gap(self, segment: LogSegment | None) -> None:
        """Count the events deleted between the file finished last and the one begun."""
        expect, passed = self._expect, self._passed
        self._expect, self._passed = None, False
        if segment is None or expect is None:
            if passed:
                logger.warning(
                    "%s: the log rotated past its backups since it was last read; the files "
                    "deleted in between are not read (their events cannot be counted: the "
                    "files have no LogSegment line)",
                    self.path,
                )
            return
        gap = segment.events_before - expect
        if gap > 0:  # (fewer: the log started over)
            self.lost_to_rotation += gap
            logger.warning(
                "%s: rotation deleted %d events before they were read (%d in all): the "
                "follower fell behind the writer by more than the log's backups",
                self.path,
                gap,
                self.lost_to_rotation,
            )

    def _finish(self) -> None:
        """Close the oldest file, read to its end; note how many events come before the next."""
        held = self._files.pop(0)
        try:
            if held.joined and not self._passed:
                # The files after it were all found: none deleted, nothing to count (and
                # no need to count the lines before the byte it was joined at).
                self._expect = None
            elif held.joined:
                self._expect = _events_before_joined(held)
            elif held.before is None:
                return  # nothing read from it: the next file has what it would have had
            else:
                self._expect = held.before
            if self._expect is not None:
                self._expect += held.lines.line - held.non_events
        finally:
            held.file.close()

    def _rotated(self, held: _Held) -> bool:
        """Whether the path moved on from ``held`` (the newer files are now queued) or it was
        truncated in place (read it again from its top)."""
        try:
            current = os.stat(self.path)
        except FileNotFoundError:
            return False  # mid-rotation: the new file appears on a later poll
        if (current.st_dev, current.st_ino) == held.ident:
            if current.st_size < held.file.tell():
                # Truncated in place (backups=0): start over at the top.
                self._restart(held)
                return True
            return False
        newer = self._scan(held)
        self._files += newer
        return bool(newer)

    def _scan(self, held: _Held) -> list[_Held]:
        """Open the files newer than ``held``, oldest first, the path's current file last.

        The path is opened first, then ``path.1``, ``path.2`` … until ``held`` is met: a file
        only ever moves to a higher suffix, so a file present throughout is met on the way
        (a file met twice is one identity). The order of the suffixes is the files' age as
        long as the path kept its file throughout (then at most one rotation moved files
        up, each by one); when the writer rotated meanwhile, the files are looked at again,
        and after :data:`_SCAN_TRIES` looks none is taken (the next poll looks again; the
        file held stays open, so nothing is mistaken, and what rotation deletes meanwhile
        is counted).
        """
        found: list[_Held] = []
        for _ in range(_SCAN_TRIES):
            for old in found:
                old.file.close()
            found = []
            try:
                found.append(_Held(_open_log(self.path)))
            except FileNotFoundError:
                return []  # mid-rotation: looked at again on a later poll
            idents = {held.ident, found[0].ident}
            reached = False
            suffixes = [int(f.name.rpartition(".")[2]) for f in rotated_files(self.path)[:-1]]
            highest = max(suffixes, default=0) + 2
            index = 1
            try:
                while index <= highest:
                    try:
                        file = _open_log(self.path.with_name(f"{self.path.name}.{index}"))
                    except FileNotFoundError:
                        index += 1
                        continue
                    index += 1
                    status = os.fstat(file.fileno())
                    ident = (status.st_dev, status.st_ino)
                    if ident == held.ident:
                        file.close()
                        reached = True
                        break
                    if ident in idents:
                        file.close()
                        continue
                    idents.add(ident)
                    found.append(_Held(file))
            except BaseException:
                for old in found:
                    old.file.close()
                raise
            try:
                now = os.stat(self.path)
                steady = (now.st_dev, now.st_ino) == found[0].ident
            except FileNotFoundError:
                steady = False
            if steady:
                self._passed = not reached
                return found[::-1]
        for old in found:
            old.file.close()
        return []

    def _replaced_in_place(self, held: _Held) -> bool:
        """Whether the open file was truncated since the last read (and maybe grew again)."""
        fd = held.file.fileno()
        position = held.file.tell()
        if os.fstat(fd).st_size < position:
            return True
        if held.lines.open_line and not held.lines.held:
            return False  # in a line too long to hold: its end is not known
        end = position - held.lines.held  # just after the last complete line
        if end <= 0:
            return False
        # The byte before the next line was a newline; rewritten content moves it.
        return os.pread(fd, 1, end - 1) != b"\n"

    def _restart(self, held: _Held) -> None:
        held.file.seek(0)
        held.lines.reset()
        held.joined = 0
        held.before = None
        held.non_events = 0
        self._expect, self._passed = None, False  # the log started over

    def _count_bad(self) -> None:
        if self._bad:
            for error in self._bad:
                logger.warning("skipping a line: %s", error)
            self.bad_lines += len(self._bad)
            self._bad.clear()

    def close(self) -> None:
        """Close the files being followed (idempotent); say how much was left unread."""
        if self.behind:
            self.behind = False
            unread = 0
            for held in self._files:
                with contextlib.suppress(OSError):
                    unread += os.fstat(held.file.fileno()).st_size - held.file.tell()
            if unread > 0:
                logger.warning(
                    "%s: stopped following with %d bytes of the log not read yet",
                    self.path,
                    unread,
                )
        for held in self._files:
            held.file.close()
        self._files = []

    def __enter__(self) -> EventLogFollower:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _events_before_joined(held: _Held) -> int:
    """For a file joined past its top: the events before the byte it was joined at (those
    of the files before it, as its ``LogSegment`` line says, and its own)."""
    fd = held.file.fileno()
    segment = segment_of(os.pread(fd, HEADER_MAX, 0).split(b"\n", 1)[0])
    offset = 0

    def read(size: int) -> bytes:
        nonlocal offset
        block = os.pread(fd, min(size, held.joined - offset), offset)
        offset += len(block)
        return block

    # A file without the line is a log's first: the writer counts none before it either.
    return (0 if segment is None else segment.events_before) + _count_event_lines(read)


def follow(
    path: str | os.PathLike[str],
    *,
    poll_interval: float = 0.1,
    stop: Callable[[], bool] | None = None,
    from_start: bool = True,
) -> Iterator[Event]:
    """Yield the events of a log as another process writes them, until ``stop()`` is true.

    Without ``stop`` it follows forever (end it by closing the generator).

    Args:
        path: the log.
        poll_interval: seconds between polls once caught up; default 0.1.
        stop: checked after each poll; once true, a last poll's events are yielded and
            the generator ends. Default None (never).
        from_start: yield what the log already holds (True, the default), or only what is
            written from now on.

    Raises:
        EventLogError: as :meth:`EventLogFollower.poll` raises it.
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
            if not follower.behind:
                time.sleep(poll_interval)
