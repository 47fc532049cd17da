"""The event log format: schema, codec and reader, shared by the writer and every reader.

One record per line, JSON, with a versioned schema::

    {"v": 2, "type": "GraphCaptured", "pid": 4242, "rank": 0, "adapter": "vision",
     "signature": {"inputs": [{"dtype": "bfloat16", "shape": [1, 1024, 1152],
                               "device": "cuda:0"}, null], "stream": 94},
     "key": "bfloat16[1,1024,1152], None @cuda:0 s=94", ...}

Every line names the writing process (``pid``) and its worker rank, so the logs of several
workers can be merged and still told apart. Events carry their structured signature; ``key``
repeats its text form for people reading or grepping the file (readers ignore it in version
2). Version 1 logs, which had only the text ``key``, are still read: the signature is parsed
back from the text.

The version counts changes a reader cannot follow (how a signature is written), not
additions: a field added later with a default (``GraphCaptured.free_bytes``) reads as that
default from older lines and is ignored by older readers, and a record type added later
(``ProfilingObserved``) is refused by name by an older reader, whose error says which.

Besides events a log holds ``"type": "AdapterInfo"`` lines (what the bus knew about each
adapter: its graph cap and memory floor), which :func:`read_records` yields and
:func:`read_events` skips, and, at the top of a file started by rotation, a
``"type": "LogSegment"`` line counting the events before it and how many of those rotation
deleted, which :func:`log_gap` reads.

The writer is :class:`omnitrace.sinks.jsonl.JsonlSink`; ``omnitrace top`` and
``omnitrace replay`` only read, through this module, so they never load a sink.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import orjson

from omnitrace._files import open_regular_for_reading
from omnitrace.errors import OmnitraceError
from omnitrace.events import EVENT_TYPES, DeviceTimed, Event, MissReason, Phase, event_fields
from omnitrace.signature import InputSpec, Signature, SignatureParseError

__all__ = [
    "SCHEMA_VERSION",
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
    "log_gap",
    "read_events",
    "read_records",
    "rotated_files",
    "segment_of",
]

#: Version written on every line; a reader refuses lines of a newer version.
#: 2: events carry their structured ``signature`` (1: the text ``key`` only).
SCHEMA_VERSION = 2

logger = logging.getLogger(__name__)

_EVENT_CLASSES: dict[str, type[Event]] = {cls.__name__: cls for cls in EVENT_TYPES}
_EVENT_FIELDS: dict[str, tuple[dataclasses.Field[Any], ...]] = {
    cls.__name__: event_fields(cls) for cls in EVENT_TYPES
}
_DEVICE_TIMED_KINDS = ("replay", "eager")
INFO_TYPE = "AdapterInfo"
SEGMENT_TYPE = "LogSegment"
#: Longest first line :func:`log_gap` reads (a segment header is about 120 bytes).
HEADER_MAX = 4096


class EventLogError(OmnitraceError, ValueError):
    """An event log line cannot be read (newer schema, unknown type, missing field)."""


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


def encode_signature(signature: Signature) -> dict[str, Any]:
    """Return the JSON form of a signature (schema version 2)."""
    return {
        "inputs": [
            None
            if spec is None
            else {"dtype": spec.dtype, "shape": list(spec.shape), "device": spec.device}
            for spec in signature.inputs
        ],
        "stream": signature.stream,
    }


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
        if isinstance(value, Signature):
            record[field.name] = encode_signature(value)
            record["key"] = value.text
        else:
            record[field.name] = value.value if isinstance(value, (MissReason, Phase)) else value
    return record


_JSON_TYPES: dict[str, tuple[type, ...]] = {
    "str": (str,),
    "int": (int,),
    "int | None": (int, type(None)),
    "float": (int, float),
    "float | None": (int, float, type(None)),
}
_ENUM_FIELDS: dict[str, type[MissReason] | type[Phase]] = {"MissReason": MissReason, "Phase": Phase}


def _int_list(value: object) -> bool:
    return isinstance(value, list) and all(
        isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in value
    )


def decode_signature(value: object, *, where: str = "signature") -> Signature:
    """Rebuild a signature from its JSON form (schema version 2).

    Raises:
        EventLogError: ``value`` is not a signature's JSON form.
    """
    inputs_raw = value.get("inputs") if isinstance(value, dict) else None
    stream = value.get("stream") if isinstance(value, dict) else None
    if not isinstance(inputs_raw, list) or not (
        stream is None or (isinstance(stream, int) and not isinstance(stream, bool))
    ):
        raise EventLogError(f"{where}: expected {{inputs: [...], stream: int|null}}, got {value!r}")
    inputs: list[InputSpec | None] = []
    for item in inputs_raw:
        if item is None:
            inputs.append(None)
            continue
        ok = (
            isinstance(item, dict)
            and isinstance(item.get("dtype"), str)
            and isinstance(item.get("device"), str)
            and _int_list(item.get("shape"))
        )
        if not ok:
            raise EventLogError(
                f"{where}: expected an input {{dtype, shape, device}}, got {item!r}"
            )
        inputs.append(InputSpec(item["dtype"], tuple(item["shape"]), item["device"]))
    return Signature(tuple(inputs), stream)


def _decode_field(
    cls_name: str,
    field: dataclasses.Field[Any],
    record: Mapping[str, Any],
    version: int,
    where: str,
) -> Any:
    name = field.name
    if name == "signature":
        if version >= 2:
            if name not in record:
                raise EventLogError(f"{where}: {cls_name} is missing field 'signature'")
            return decode_signature(record[name], where=f"{where}: {cls_name}.signature")
        # Version 1 wrote only the text form.
        if "key" not in record:
            raise EventLogError(f"{where}: {cls_name} is missing field 'key'")
        key = record["key"]
        if not isinstance(key, str):
            raise EventLogError(f"{where}: {cls_name}.key: expected str, got {key!r}")
        try:
            return Signature.parse(key)
        except SignatureParseError as exc:
            raise EventLogError(f"{where}: {cls_name}.key: {exc}") from None
    if name not in record:
        if field.default is not dataclasses.MISSING:
            # Added after the log was written (phase, an eager call's duration).
            return field.default
        raise EventLogError(f"{where}: {cls_name} is missing field {name!r}")
    value = record[name]
    enum_type = _ENUM_FIELDS.get(str(field.type))
    if enum_type is not None:
        # The enums (MissReason, Phase) are the only other non-JSON types in an event.
        try:
            return enum_type(value)
        except ValueError:
            valid = ", ".join(member.value for member in enum_type)
            raise EventLogError(
                f"{where}: {cls_name}.{name}: expected one of {valid}, got {value!r}"
            ) from None
    if value is None and str(field.type) == "float":
        # JSON has no NaN or infinity: the writer (orjson) writes a non-finite float as
        # null, which reads back as NaN.
        return math.nan
    expected = _JSON_TYPES.get(str(field.type))
    if expected is not None and (isinstance(value, bool) or not isinstance(value, expected)):
        raise EventLogError(f"{where}: {cls_name}.{name}: expected {field.type}, got {value!r}")
    return value


def decode_record(record: Mapping[str, Any], *, where: str = "record") -> EventRecord:
    """Rebuild the typed event (or adapter info) from one parsed log line.

    Reads schema versions 1 and 2.

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
    if type_name == INFO_TYPE:
        adapter = record.get("adapter")
        info = record.get("info")
        if not isinstance(adapter, str) or not isinstance(info, dict):
            raise EventLogError(f"{where}: AdapterInfo needs 'adapter' (str) and 'info' (object)")
        return EventRecord(AdapterInfo(adapter, info), pid, rank)
    cls = _EVENT_CLASSES.get(type_name) if isinstance(type_name, str) else None
    if cls is None:
        valid = ", ".join(sorted([*_EVENT_CLASSES, INFO_TYPE]))
        raise EventLogError(f"{where}: unknown record type {type_name!r} (valid: {valid})")
    kwargs = {
        field.name: _decode_field(cls.__name__, field, record, version, where)
        for field in _EVENT_FIELDS[cls.__name__]
    }
    if cls is DeviceTimed and kwargs["kind"] not in _DEVICE_TIMED_KINDS:
        # Folds tell replayed from eager device time by this field: nothing else is one.
        valid = ", ".join(_DEVICE_TIMED_KINDS)
        raise EventLogError(
            f"{where}: DeviceTimed.kind: expected one of {valid}, got {kwargs['kind']!r}"
        )
    return EventRecord(cls(**kwargs), pid, rank)


def count_events(path: Path) -> int:
    """Count the complete event lines of a log file written by this module."""
    data = path.read_bytes()
    lines = data.count(b"\n")
    # The writer's compact JSON puts the type right after the version; a quote inside a
    # string value is escaped, so these markers only match record types.
    return (
        lines
        - data.count(b'"type":"' + INFO_TYPE.encode() + b'"')
        - data.count(b'"type":"' + SEGMENT_TYPE.encode() + b'"')
    )


def segment_of(line: bytes) -> LogSegment | None:
    """Decode ``line`` as a segment header; None when it is anything else."""
    try:
        record = json.loads(line)
    except (ValueError, RecursionError):
        return None
    if not isinstance(record, dict) or record.get("type") != SEGMENT_TYPE:
        return None
    before, deleted = record.get("events_before"), record.get("events_deleted")
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in (before, deleted)):
        return None
    return LogSegment(int(before), int(deleted))  # type: ignore[arg-type]


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


def dumps(record: Mapping[str, Any]) -> bytes:
    """One compact JSON line (UTF-8, ending in a newline)."""
    return orjson.dumps(record, option=orjson.OPT_APPEND_NEWLINE)


class LineEncoder:
    """Encode events as log lines of one writer (its pid and rank), at C speed.

    The same line :func:`encode_event` describes, field order aside: orjson serialises the
    frozen event (signature and enums included) in one call, and the per-type head and each
    signature's text form are made once. The writer's thread holds the GIL while it encodes,
    so its cost is taken from the serving thread.
    """

    __slots__ = ("_heads", "_keys")

    #: Signatures whose text is remembered; a hit reuses its graph's signature object.
    _KEYS_KEPT = 4096

    def __init__(self, *, pid: int, rank: int) -> None:
        self._heads = {
            cls: b'{"v":%d,"type":"%s","pid":%d,"rank":%d,"key":'
            % (SCHEMA_VERSION, cls.__name__.encode(), pid, rank)
            for cls in EVENT_TYPES
        }
        self._keys: dict[int, tuple[Signature, bytes]] = {}

    def __call__(self, event: Event) -> bytes:
        signature = event.signature
        cached = self._keys.get(id(signature))
        if cached is None or cached[0] is not signature:
            if len(self._keys) >= self._KEYS_KEPT:
                self._keys.clear()
            cached = (signature, orjson.dumps(signature.text))
            self._keys[id(signature)] = cached
        body = orjson.dumps(event)
        return b"".join((self._heads[type(event)], cached[1], b",", body[1:], b"\n"))


def _parse_lines(
    data: bytes,
    path: Path,
    first_line: int,
    *,
    final: bool,
    torn: list[int] | None = None,
    bad: list[EventLogError] | None = None,
) -> tuple[list[EventRecord], int]:
    """Decode the complete lines of ``data``; return the records and bytes consumed.

    A trailing piece without a newline is a batch still being written: it is left
    unconsumed, unless ``final`` (a finished file), where it is a torn line and skipped.
    Skipped lines are logged, or, with ``torn``, their numbers are appended to it instead.
    A line that is no record this reader knows raises :class:`EventLogError`, or, with
    ``bad``, is appended to it as one and skipped.
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
            parsed = orjson.loads(raw)
        except (ValueError, RecursionError):
            # A writer that crashed mid-write leaves one torn line; the next writer starts
            # on a fresh line, so this loses that one record only.
            if torn is None:
                logger.warning("%s:%d: skipping a torn line", path, line_no)
            else:
                torn.append(line_no)
            continue
        try:
            if not isinstance(parsed, dict):
                raise EventLogError(f"{path}:{line_no}: expected a JSON object, got {raw[:60]!r}")
            if parsed.get("type") == SEGMENT_TYPE:
                continue  # describes the file, not an event: see log_gap()
            records.append(decode_record(parsed, where=f"{path}:{line_no}"))
        except EventLogError as exc:
            if bad is None:
                raise
            bad.append(exc)
    return records, consumed


def rotated_files(path: Path) -> list[Path]:
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
        EventLogError: ``path`` (or a rotated file) is not a regular file (a directory, a
            named pipe, a device), a file with no event record at all (not an event log),
            or has a line of a newer schema version or an unknown type.
    """
    base = Path(os.fspath(path))
    if not base.exists():
        raise FileNotFoundError(f"no event log at {base}")
    files = rotated_files(base) if include_rotated else [base]
    for file in files:
        data = _read_log(file)
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
