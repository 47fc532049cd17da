"""The fast path of the event-log decoder: the writer's own version-2 lines, checked cheaply,
with the same result as the reference decoder (docs/architecture.md, "The event log")."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any, TypeAlias

import orjson

from omnitrace.eventlog.codec import EventRecord, decode_signature
from omnitrace.events import (
    EVENT_TYPES,
    DeviceTimed,
    Event,
    MissReason,
    Phase,
    event_fields,
    fast_constructor,
)
from omnitrace.signature import Signature

__all__ = ["FastDecoder"]

#: Field checks by the field's annotation: ``("str",)`` means ``type(value) is str``.
_STRICT: dict[str, tuple[type, ...]] = {
    "str": (str,),
    "int": (int,),
    "int | None": (int, type(None)),
    # An integer time is taken by the reference decoder as it is (an int), a null one as
    # NaN: both are left to it.
    "float": (float,),
    "float | None": (float, type(None)),
}
_ENUMS: dict[str, dict[str, Any]] = {
    "MissReason": {member.value: member for member in MissReason},
    "Phase": {member.value: member for member in Phase},
}
_MISSING = object()
_DEVICE_TIMED_KINDS = frozenset({"replay", "eager"})
#: Distinct signatures remembered (a log has one per graph key, a few hundred at most).
SIGNATURES_KEPT = 8192
#: Distinct line heads remembered (one per writer, type and signature).
HEADS_KEPT = 8192


#: ``decode(fields, adapter, signature, pid, rank)``: the record, or None when not taken.
_Decode: TypeAlias = Callable[[dict[str, Any], str, Signature, int, int], EventRecord | None]


def _compile(cls: type[Event], *, exact: bool = False) -> _Decode:
    """Build the decoder of ``cls``'s own fields: one straight-line check per field.

    The source is made from the class's own field names and annotations only; the
    function returns None at the first value it does not take. With ``exact``, the fields
    must be these and no others (a missing field with a default is declined too).
    """
    every = event_fields(cls)
    # Every event starts with its adapter and signature, checked by the caller.
    assert [f.name for f in every[:2]] == ["adapter", "signature"]
    namespace: dict[str, Any] = {
        "_make": fast_constructor(cls),
        "_record": fast_constructor(EventRecord),
        "_M": _MISSING,
        "_KINDS": _DEVICE_TIMED_KINDS,
    }
    # As many keys as fields, each one found: these fields and no others.
    body = [f"    if len(record) != {len(every) - 2}:\n        return None"] if exact else []
    names: list[str] = []
    for field in every[2:]:
        name = field.name
        annotation = str(field.type)
        names.append(name)
        body.append(f"    {name} = record.get({name!r}, _M)")
        indent = "    "
        if exact:
            if annotation not in _ENUMS and annotation not in _STRICT:
                body.append(f"    if {name} is _M:\n        return None")
            # Otherwise a missing value (_M) fails the check below.
        elif field.default is not dataclasses.MISSING:
            namespace[f"_D_{name}"] = field.default
            body.append(f"    if {name} is _M:\n        {name} = _D_{name}")
            body.append("    else:")
            indent = "        "
        if annotation in _ENUMS:
            namespace[f"_E_{name}"] = _ENUMS[annotation]
            body.append(
                f"{indent}{name} = _E_{name}.get({name}) if type({name}) is str else None\n"
                f"{indent}if {name} is None:\n{indent}    return None"
            )
        elif annotation in _STRICT:
            types = _STRICT[annotation]
            test = " and ".join(
                f"{name} is not None" if t is type(None) else f"type({name}) is not {t.__name__}"
                for t in types
            )
            body.append(f"{indent}if {test}:\n{indent}    return None")
        elif field.default is dataclasses.MISSING and not exact:
            body.append(f"{indent}if {name} is _M:\n{indent}    return None")
        if indent == "        " and body[-1] == "    else:":
            body.pop()
    if cls is DeviceTimed:
        # Folds tell replayed from eager device time by this field: nothing else is taken.
        body.append("    if kind not in _KINDS:\n        return None")
    arguments = ", ".join(["adapter", "signature", *names])
    source = (
        "def decode(record, adapter, signature, pid, rank):\n"
        + "\n".join(body)
        + f"\n    return _record(_make({arguments}), pid, rank)\n"
    )
    exec(source, namespace)
    decode: _Decode = namespace["decode"]
    return decode


#: Where a writer's line passes from what repeats from one line to the next (type, writer,
#: key, adapter, signature) to what each call changes: its times, then its own fields.
_TAIL = b',"monotonic_ns":'
#: The fields a line's tail holds, by type: the event's fields after adapter and signature.
_TAIL_FIELDS = {cls.__name__: [f.name for f in event_fields(cls)[2:]] for cls in EVENT_TYPES}
#: A checked head: the tail's decoder, then adapter, signature, pid and rank.
_Head: TypeAlias = tuple[_Decode, str, Signature, int, int]


class FastDecoder:
    """Decode well-formed version-2 event lines into records; None for anything else."""

    __slots__ = ("_heads", "_signatures", "_tails", "_types")

    def __init__(self) -> None:
        self._signatures: dict[bytes, Signature] = {}
        self._heads: dict[bytes, _Head | None] = {}
        self._types = {cls.__name__: _compile(cls) for cls in EVENT_TYPES}
        self._tails = {cls.__name__: _compile(cls, exact=True) for cls in EVENT_TYPES}

    def __call__(self, record: dict[str, Any]) -> EventRecord | None:
        """Return the record of a parsed line, or None to use the reference decoder."""
        writer = self._writer(record)
        if writer is None:
            return None
        kind, adapter, signature, pid, rank = writer
        return self._types[kind](record, adapter, signature, pid, rank)

    def lines(self, lines: Sequence[bytes]) -> tuple[list[EventRecord | None], int]:
        """Return the records of unparsed lines, None for each line not taken, and how many
        were not taken (parse those whole, and give them to this decoder or the reference).

        A line's head (up to ``"monotonic_ns"``) is parsed and checked once per distinct
        text; its tail is parsed on its own and must hold its type's remaining fields and
        nothing else, so head and tail together read as the whole line would.
        """
        records: list[EventRecord | None] = []
        append = records.append
        heads = self._heads
        find = bytes.find
        loads = orjson.loads
        declined = 0
        head: Any  # a _Head, None (not taken) or _MISSING (not seen yet)
        for raw in lines:
            cut = find(raw, _TAIL)
            head = heads.get(raw[:cut], _MISSING) if cut >= 0 else None
            if head is _MISSING:
                head = self._head(raw[:cut])
            record = None
            if head is not None:
                decode, adapter, signature, pid, rank = head
                try:
                    tail = loads(b"{" + raw[cut + 1 :])
                except (ValueError, RecursionError):
                    tail = None  # not JSON after all: parsed whole, it is skipped as unreadable
                if tail is not None:
                    record = decode(tail, adapter, signature, pid, rank)
            if record is None:
                declined += 1
            append(record)
        return records, declined

    def _writer(self, record: dict[str, Any]) -> tuple[str, str, Signature, int, int] | None:
        """The type, adapter, signature, pid and rank of a line, or None if not taken."""
        if record.get("v") != 2 or type(record.get("v")) is not int:
            return None
        kind = record.get("type")
        if type(kind) is not str or kind not in self._types:
            return None
        pid = record.get("pid", 0)
        rank = record.get("rank", 0)
        if type(pid) is not int or type(rank) is not int:
            return None
        signature = self._signature(record.get("signature", _MISSING))
        if signature is None:
            return None
        adapter = record.get("adapter")
        if type(adapter) is not str:
            return None
        return kind, adapter, signature, pid, rank

    def _head(self, text: bytes) -> _Head | None:
        """Check a line's head (its text up to the tail), and remember the answer."""
        head: _Head | None = None
        try:
            parsed = orjson.loads(text + b"}")
        except (ValueError, RecursionError):
            parsed = None  # cut inside a value, or not JSON: the line is parsed whole
        writer = self._writer(parsed) if type(parsed) is dict else None
        # A tail field in the head too would be a key the line holds twice: not taken.
        if writer is not None and not any(f in parsed for f in _TAIL_FIELDS[writer[0]]):
            kind, adapter, signature, pid, rank = writer
            head = (self._tails[kind], adapter, signature, pid, rank)
        if len(self._heads) >= HEADS_KEPT:
            self._heads.clear()
        self._heads[text] = head
        return head

    def _signature(self, value: object) -> Signature | None:
        if type(value) is not dict:
            return None
        # The JSON text tells apart what equality would not (1 and true, 1 and 1.0).
        text = orjson.dumps(value)
        signature = self._signatures.get(text)
        if signature is None:
            try:
                signature = decode_signature(value)
            except ValueError:
                return None
            if len(self._signatures) >= SIGNATURES_KEPT:
                self._signatures.clear()
            self._signatures[text] = signature
        return signature
