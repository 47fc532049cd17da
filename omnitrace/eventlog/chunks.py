"""Read recorded event logs for ``omnitrace top``, ``replay`` and ``advise``: a chunk at a
time, with a progress bar on a terminal, and one line of error (:class:`LogReadError`)."""

from __future__ import annotations

import heapq
import os
import re
import sys
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from types import TracebackType
from typing import IO, Any

import orjson

from omnitrace._files import open_regular_for_reading
from omnitrace.eventlog.codec import line_head
from omnitrace.eventlog.reader import (
    READ_CHUNK,
    AdapterInfo,
    EventLogError,
    EventRecord,
    _Lines,
    decode_record,
    log_bytes,
    read_chunks,
    rotated_files,
)
from omnitrace.events import EVENT_TYPES

__all__ = [
    "LogReadError",
    "ReadProgress",
    "merged_records",
    "read_logs",
    "total_bytes",
    "writers",
]


class LogReadError(Exception):
    """The logs cannot be read; ``str(error)`` is the command's line, ``status`` its exit."""

    def __init__(self, message: str, status: int = 2) -> None:
        super().__init__(message)
        self.status = status


class ReadProgress:
    """A progress bar on stderr while logs are read, when stderr is a terminal.

    ``advance(n)`` counts ``n`` bytes read; :meth:`phase` starts a later phase of
    ``total`` steps. Without a terminal (or with ``enabled=False``) every call does nothing.
    ``description`` names the first phase (``"reading"``; a pass before the reading names
    its own).
    """

    def __init__(
        self,
        total_bytes: int,
        *,
        enabled: bool,
        stream: IO[str] | None = None,
        description: str = "reading",
    ) -> None:
        self._progress: Any = None
        self._task: Any = None
        if not enabled:
            return
        from rich.console import Console

        console = Console(file=stream if stream is not None else sys.stderr)
        if not console.is_terminal:
            return
        from rich.progress import (
            BarColumn,
            Progress,
            TaskProgressColumn,
            TextColumn,
            TimeElapsedColumn,
            TimeRemainingColumn,
        )

        self._progress = Progress(
            TextColumn("{task.description}"),
            BarColumn(),
            TaskProgressColumn(),
            TimeElapsedColumn(),
            TimeRemainingColumn(),
            console=console,
            transient=True,
        )
        self._task = self._progress.add_task(description, total=total_bytes)

    @property
    def shown(self) -> bool:
        """Whether a bar is on the terminal."""
        return self._progress is not None

    def __enter__(self) -> ReadProgress:
        if self._progress is not None:
            self._progress.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        if self._progress is not None:
            self._progress.stop()
            self._progress = None

    def advance(self, count: int) -> None:
        """Count ``count`` bytes (or steps of the current phase) done."""
        if self._progress is not None:
            self._progress.advance(self._task, count)

    def until_done(self, records: Iterable[EventRecord]) -> Iterator[EventRecord]:
        """Yield ``records``; once they are all read, take the bar off the terminal (so
        what the command prints next is not drawn over)."""
        try:
            yield from records
        finally:
            self.__exit__(None, None, None)

    def phase(self, description: str, total: int) -> Callable[[int], None]:
        """Start a phase of ``total`` steps (the reading's bar ends); return its ``advance``."""
        if self._progress is not None:
            self._progress.update(self._task, visible=False)
            self._task = self._progress.add_task(description, total=total)
        return self.advance


def _failure(path: Path, exc: Exception) -> LogReadError:
    if isinstance(exc, (FileNotFoundError, EventLogError)):
        return LogReadError(str(exc))
    strerror = exc.strerror if isinstance(exc, OSError) else None
    return LogReadError(f"{path}: {strerror or exc}")


def _chunks(path: Path, progress: Callable[[int], None] | None) -> Iterator[list[EventRecord]]:
    try:
        yield from read_chunks(path, progress=progress)
    except (FileNotFoundError, EventLogError) as exc:
        raise _failure(path, exc) from None
    except OSError as exc:
        raise _failure(path, exc) from None


def total_bytes(paths: Sequence[Path]) -> int:
    """Bytes the logs hold, rotated files included (for the progress bar)."""
    return sum(log_bytes(path) for path in paths)


def read_logs(
    paths: Sequence[Path], *, progress: Callable[[int], None] | None = None
) -> Iterator[tuple[int, list[EventRecord]]]:
    """Yield ``(log index, records)`` chunks of each log in turn, oldest records first.

    Raises:
        LogReadError: a path cannot be read or holds a line no reader knows (status 2),
            or no log holds any record (status 1).
    """
    found = False
    for index, path in enumerate(paths):
        for chunk in _chunks(path, progress):
            found = True
            yield index, chunk
    if not found:
        names = ", ".join(str(p) for p in paths)
        raise LogReadError(f"{names}: no events in the event log", status=1)


# -- several logs in time order ---------------------------------------------------------------

#: How the writer starts every line: version, type, pid, rank (see LineEncoder).
_HEAD = re.compile(rb'\{"v":2,"type":"(\w+)","pid":(\d+),"rank":(\d+),')


def writers(
    paths: Sequence[Path], *, progress: Callable[[int], None] | None = None
) -> tuple[set[tuple[int, int]], list[EventRecord]]:
    """Return the writers (``(rank, pid)``) of the logs' records, and their adapter facts.

    A quick pass before a replay, which must know whether several workers wrote the logs
    before it names the first adapter. Lines in the writer's own form are told by their
    first bytes; a line of a writer not seen yet, an ``AdapterInfo`` line and any line in
    another form are decoded whole, so a writer counts only once it wrote a line that
    reads as a record. A line no reader knows is left for the replay to report.
    ``progress(n)``, if given, is called with the bytes of each chunk scanned (as many in
    all as :func:`total_bytes` counts, for files that can be read).
    """
    sources: set[tuple[int, int]] = set()
    infos: list[EventRecord] = []
    for path in paths:
        for file in rotated_files(path):
            if file.exists():
                _scan_file(file, sources, infos, progress)
    return sources, infos


def _scan_file(
    file: Path,
    sources: set[tuple[int, int]],
    infos: list[EventRecord],
    progress: Callable[[int], None] | None,
) -> None:
    try:
        fd, kind = open_regular_for_reading(file)
    except OSError:
        return  # the replay's reading reports it
    if kind is not None:
        return  # not a regular file: the replay's reading refuses it, without blocking
    # Whole lines only, in time linear in the bytes: a last line without a newline is torn,
    # and a line past MAX_LINE no record (both left for the replay to report).
    cutter = _Lines()
    known = _prefixes(sources)
    with os.fdopen(fd, "rb") as handle:
        while block := handle.read(READ_CHUNK):
            if progress is not None:
                progress(len(block))
            data, _ = cutter.feed(block)
            cutter.too_long.clear()
            lines = data.split(b"\n")
            lines.pop()  # after the last newline: nothing
            for line in lines:
                if line.startswith(known):
                    # An event of a writer already found: decoded, it would add nothing.
                    continue
                head = _HEAD.match(line)
                if head is not None and head[1] != b"AdapterInfo":
                    source = (int(head[3]), int(head[2]))
                    if source in sources:
                        continue
                record = _decoded(line)
                if record is None:
                    continue
                if record.source not in sources:
                    sources.add(record.source)
                    known = _prefixes(sources)
                if isinstance(record.item, AdapterInfo):
                    infos.append(record)


#: Writers up to which the scan tells their lines by their first bytes alone.
_PREFIXED_WRITERS = 16


def _prefixes(sources: set[tuple[int, int]]) -> tuple[bytes, ...]:
    """How the writer starts an event line of each of ``sources`` (none past a few writers:
    each head is then read by _HEAD)."""
    if len(sources) > _PREFIXED_WRITERS:
        return ()
    return tuple(
        line_head(cls, pid=pid, rank=rank) for rank, pid in sorted(sources) for cls in EVENT_TYPES
    )


def _decoded(line: bytes) -> EventRecord | None:
    try:
        parsed = orjson.loads(line)
        if not isinstance(parsed, dict) or parsed.get("type") == "LogSegment":
            return None
        return decode_record(parsed)
    except (ValueError, RecursionError):  # EventLogError is a ValueError
        return None


def merged_records(
    paths: Sequence[Path],
    infos: Iterable[EventRecord],
    *,
    progress: Callable[[int], None] | None = None,
) -> Iterator[EventRecord]:
    """Yield ``infos``, then the events of every log merged in time order (each log's own
    order kept), reading each log a chunk at a time.

    Raises:
        LogReadError: as :func:`read_logs`.
    """
    yield from infos
    streams = [_events(path, progress) for path in paths]
    if len(streams) == 1:
        yield from streams[0]
    else:
        yield from heapq.merge(*streams, key=lambda r: r.item.epoch_ns)  # type: ignore[union-attr]


def _events(path: Path, progress: Callable[[int], None] | None) -> Iterator[EventRecord]:
    for chunk in _chunks(path, progress):
        for record in chunk:
            if not isinstance(record.item, AdapterInfo):
                yield record
