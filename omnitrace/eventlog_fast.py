"""The fast path of the event-log decoder: the writer's own version-2 lines, checked cheaply.

:func:`omnitrace.eventlog.decode_record` checks every field of every line with the message
it would give, and rebuilds every signature from its JSON form: right for any line, and
most of a reader's time on a log of millions of lines. Nearly every line of a real log is
one the writer wrote, though, and its signatures repeat (one per graph key). This decoder
takes such a line at a fraction of the cost:

* each field's JSON type is checked exactly (``type(value) is int``: no bool, no float for
  an int), and a value the reference decoder would convert (an integer or ``null`` time, a
  schema-1 line, a missing field without default) is not taken: the caller falls back to
  the reference decoder, which converts it or raises its error for it;
* a signature is decoded once per distinct JSON text and the same frozen object is handed
  out again, so readers also share its cached hash;
* the event is built from its fields positionally, as the adapter builds its hits.

What it returns is equal to what the reference decoder returns for the same line; it never
raises for a line's content.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import orjson

from omnitrace.eventlog_codec import EventRecord, decode_signature
from omnitrace.events import (
    EVENT_TYPES,
    DeviceTimed,
    Event,
    MissReason,
    Phase,
    _fast_constructor,
    event_fields,
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


def _compile(cls: type[Event]) -> Callable[[dict[str, Any], str, Signature], Event | None]:
    """Build the decoder of ``cls``'s own fields: one straight-line check per field.

    The source is made from the class's own field names and annotations only; the
    function returns None at the first value it does not take.
    """
    every = event_fields(cls)
    # Every event starts with its adapter and signature, checked by the caller.
    assert [f.name for f in every[:2]] == ["adapter", "signature"]
    namespace: dict[str, Any] = {"_make": _fast_constructor(cls), "_M": _MISSING}
    body: list[str] = []
    names: list[str] = []
    for field in every[2:]:
        name = field.name
        annotation = str(field.type)
        names.append(name)
        body.append(f"    {name} = record.get({name!r}, _M)")
        if field.default is not dataclasses.MISSING:
            namespace[f"_D_{name}"] = field.default
            body.append(f"    if {name} is _M:\n        {name} = _D_{name}")
            body.append("    else:")
            indent = "        "
        else:
            indent = "    "
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
        elif field.default is dataclasses.MISSING:
            body.append(f"{indent}if {name} is _M:\n{indent}    return None")
        if indent == "        " and body[-1] == "    else:":
            body.pop()
    arguments = ", ".join(["adapter", "signature", *names])
    source = (
        "def decode(record, adapter, signature):\n"
        + "\n".join(body)
        + f"\n    return _make({arguments})\n"
    )
    exec(source, namespace)
    decode: Callable[[dict[str, Any], str, Signature], Event | None] = namespace["decode"]
    return decode


class FastDecoder:
    """Decode well-formed version-2 event lines into records; None for anything else."""

    __slots__ = ("_record", "_signatures", "_types")

    def __init__(self) -> None:
        self._signatures: dict[bytes, Signature] = {}
        self._types = {cls.__name__: _compile(cls) for cls in EVENT_TYPES}
        self._record = _fast_constructor(EventRecord)

    def __call__(self, record: dict[str, Any]) -> EventRecord | None:
        """Return the record of a parsed line, or None to use the reference decoder."""
        if record.get("v") != 2 or type(record.get("v")) is not int:
            return None
        kind = record.get("type")
        decoder = self._types.get(kind) if type(kind) is str else None
        if decoder is None:
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
        event = decoder(record, adapter, signature)
        if event is None or (type(event) is DeviceTimed and event.kind not in _DEVICE_TIMED_KINDS):
            return None
        built: EventRecord = self._record(event, pid, rank)
        return built

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
