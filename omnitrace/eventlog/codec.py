"""The event log format: its versioned schema and the codec of one line, shared by the writer
and every reader (docs/architecture.md, "The event log", says what the version counts)."""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import orjson

from omnitrace.errors import OmnitraceError
from omnitrace.events import EVENT_TYPES, DeviceTimed, Event, MissReason, Phase, event_fields
from omnitrace.signature import InputSpec, Signature, SignatureParseError

__all__ = [
    "HEADER_MAX",
    "INFO_TYPE",
    "SCHEMA_VERSION",
    "SEGMENT_TYPE",
    "AdapterInfo",
    "EventLogError",
    "EventRecord",
    "LineEncoder",
    "LogSegment",
    "decode_record",
    "decode_signature",
    "dumps",
    "encode_event",
    "encode_signature",
    "line_head",
    "segment_of",
]

#: Version written on every line; a reader refuses lines of a newer version.
#: 2: events carry their structured ``signature`` (1: the text ``key`` only).
SCHEMA_VERSION = 2

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
    """Static facts about an adapter as its bus registered them (cap, floor, backend).

    Args:
        adapter: the adapter's name.
        info: the facts, by name.
    """

    adapter: str
    info: Mapping[str, Any]


@dataclass(frozen=True, slots=True)
class LogSegment:
    """The first line of a file started by rotation: what the log held before this file.

    Args:
        events_before: events in the earlier files of the log.
        events_deleted: events rotation had deleted from the log when this file began.
    """

    events_before: int
    """Events in the earlier files of the log, as far as the writer knew."""
    events_deleted: int
    """Events rotation had deleted from the log when this file began (older files past
    ``backups``, or truncation with ``backups=0``)."""


@dataclass(frozen=True, slots=True)
class EventRecord:
    """One line of an event log: the event (or adapter info) and the process that wrote it.

    Args:
        item: the event, or the adapter info.
        pid: the writing process's id.
        rank: the writing worker's rank.
    """

    item: Event | AdapterInfo
    pid: int
    rank: int

    @property
    def source(self) -> tuple[int, int]:
        """``(rank, pid)``: identifies the writing worker."""
        return self.rank, self.pid


def encode_signature(signature: Signature) -> dict[str, Any]:
    """Return the JSON form of a signature (schema version 2).

    Args:
        signature: the signature.

    Returns:
        ``{"inputs": [{"dtype", "shape", "device"} or None, ...], "stream": int | None}``.
    """
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
    """Return the JSON-ready record of ``event`` (schema version :data:`SCHEMA_VERSION`).

    Args:
        event: the event.
        pid: the writing process's id (keyword-only).
        rank: the writing worker's rank (keyword-only).

    Raises:
        KeyError: ``event`` is not an omnitrace event.
    """
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
_TUPLE_TYPES: dict[str, tuple[type, ...]] = {
    "tuple[str, ...]": (str,),
    "tuple[int, ...]": (int,),
}
_ENUM_FIELDS: dict[str, type[MissReason] | type[Phase]] = {"MissReason": MissReason, "Phase": Phase}


def _int_list(value: object) -> bool:
    return isinstance(value, list) and all(
        isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in value
    )


def decode_signature(value: object, *, where: str = "signature") -> Signature:
    """Rebuild a signature from its JSON form (schema version 2).

    Args:
        value: the parsed JSON form.
        where: where it was read, to start error messages with; default "signature".

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
    tuple_of = _TUPLE_TYPES.get(str(field.type))
    if tuple_of is not None:
        # JSON arrays of one scalar type (a batch's request ids) read back as tuples.
        if not isinstance(value, (list, tuple)) or not all(
            isinstance(item, tuple_of) and not isinstance(item, bool) for item in value
        ):
            raise EventLogError(f"{where}: {cls_name}.{name}: expected {field.type}, got {value!r}")
        return tuple(value)
    expected = _JSON_TYPES.get(str(field.type))
    if expected is not None and (isinstance(value, bool) or not isinstance(value, expected)):
        raise EventLogError(f"{where}: {cls_name}.{name}: expected {field.type}, got {value!r}")
    return value


def decode_record(record: Mapping[str, Any], *, where: str = "record") -> EventRecord:
    """Rebuild the typed event (or adapter info) from one parsed log line.

    Reads schema versions 1 and 2.

    Args:
        record: the parsed line.
        where: where it was read (file and line), to start error messages with; default
            "record".

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
        valid = ", ".join(sorted([*_EVENT_CLASSES, INFO_TYPE, SEGMENT_TYPE]))
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


def segment_of(line: bytes) -> LogSegment | None:
    """Decode ``line`` as a segment header; None when it is anything else.

    Args:
        line: one line of a log, as bytes; one that does not parse gives None.
    """
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


def dumps(record: Mapping[str, Any]) -> bytes:
    """Return one compact JSON line (UTF-8, ending in a newline).

    Args:
        record: what to write; orjson's types (events and signatures included).

    Raises:
        TypeError: ``record`` holds something orjson cannot serialise.
    """
    return orjson.dumps(record, option=orjson.OPT_APPEND_NEWLINE)


def line_head(cls: type[Event], *, pid: int, rank: int) -> bytes:
    """How :class:`LineEncoder` starts every line of a ``cls`` event of the writer ``pid``,
    ``rank``: the text up to and including the rank and its comma (the event's own fields
    follow)."""
    return b'{"v":%d,"type":"%s","pid":%d,"rank":%d,' % (
        SCHEMA_VERSION,
        cls.__name__.encode(),
        pid,
        rank,
    )


class LineEncoder:
    """Encode events as log lines of one writer (its pid and rank), at C speed.

    The same line :func:`encode_event` describes, field order aside: orjson serialises the
    frozen event (signature and enums included) in one call, and the per-type head and each
    signature's text form are made once. The writer's thread holds the GIL while it encodes,
    so its cost is taken from the serving thread.

    Args:
        pid: the writing process's id (keyword-only).
        rank: the writing worker's rank (keyword-only).
    """

    __slots__ = ("_heads", "_keys")

    #: Signatures whose text is remembered; a hit reuses its graph's signature object.
    _KEYS_KEPT = 4096

    def __init__(self, *, pid: int, rank: int) -> None:
        self._heads = {cls: line_head(cls, pid=pid, rank=rank) + b'"key":' for cls in EVENT_TYPES}
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
