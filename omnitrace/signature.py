"""Input signatures: what a graph is keyed by, as plain data without torch, with a text form
for people."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

__all__ = ["InputSpec", "Signature", "SignatureParseError"]


class SignatureParseError(ValueError):
    """A text is not a signature's text form."""


@dataclass(frozen=True, slots=True)
class InputSpec:
    """One tensor input: its dtype (``"bfloat16"``), shape and device (``"cuda:0"``)."""

    dtype: str
    shape: tuple[int, ...]
    device: str

    @property
    def text(self) -> str:
        return f"{self.dtype}[{','.join(map(str, self.shape))}]"

    @property
    def numel(self) -> int:
        count = 1
        for size in self.shape:
            count *= size
        return count


@dataclass(frozen=True, slots=True)
class Signature:
    """The inputs of one call (``None`` for an absent one) and its replay stream, if known.

    Folds key dictionaries by signatures on every event, so the hash is computed once, on
    first use, and kept (hashing the nested tuples costs more than the rest of a fold's
    update). It is left out of comparisons, copies and pickles: string hashes differ from
    one process to the next.
    """

    inputs: tuple[InputSpec | None, ...]
    stream: int | None = None
    _hash: int | None = field(default=None, init=False, repr=False, compare=False)

    def __hash__(self) -> int:
        cached = self._hash
        if cached is None:
            cached = hash((self.inputs, self.stream))
            object.__setattr__(self, "_hash", cached)
        return cached

    def __reduce__(self) -> tuple[Any, ...]:
        return (Signature, (self.inputs, self.stream))

    def covers(self, other: Signature) -> bool:
        """Whether this signature's inputs match ``other``'s (count, dtypes, ranks, devices,
        absent inputs and stream) but for dimensions at least as large in every place.

        Args:
            other: the signature to compare with.
        """
        if self.stream != other.stream or len(self.inputs) != len(other.inputs):
            return False
        for big, small in zip(self.inputs, other.inputs, strict=True):
            if big is None or small is None:
                if big is not small:
                    return False
                continue
            alike = big.dtype == small.dtype and big.device == small.device
            if not alike or len(big.shape) != len(small.shape):
                return False
            if any(b < s for b, s in zip(big.shape, small.shape, strict=True)):
                return False
        return True

    @property
    def device(self) -> str | None:
        """The device of the inputs when they share one, else None (no tensor, or mixed)."""
        devices = {spec.device for spec in self.inputs if spec is not None}
        return devices.pop() if len(devices) == 1 else None

    @property
    def dtypes(self) -> tuple[str, ...]:
        """The distinct dtypes of the tensor inputs, in input order."""
        seen: dict[str, None] = {}
        for spec in self.inputs:
            if spec is not None:
                seen.setdefault(spec.dtype)
        return tuple(seen)

    @property
    def inputs_text(self) -> str:
        """The inputs alone in the human form: ``bfloat16[1,1024,1152], None``."""
        return ", ".join("None" if spec is None else spec.text for spec in self.inputs)

    @property
    def text(self) -> str:
        """The human form: ``bfloat16[1,1024,1152], None @cuda:0 s=94``."""
        text = self.inputs_text
        device = self.device
        if device:  # an empty device: parsed from a text that named none
            text += f" @{device}"
        if self.stream is not None:
            text += f" s={self.stream}"
        return text

    def __str__(self) -> str:
        return self.text

    @classmethod
    def parse(cls, text: str) -> Signature:
        """Read a signature back from its text form (event logs of schema version 1).

        The text form names one device for all inputs and none when they were mixed, so
        inputs of a mixed-device signature come back with the device ``""``.

        Raises:
            SignatureParseError: ``text`` is not in the text form.
        """
        match = _TEXT.fullmatch(text)
        if match is None:
            raise SignatureParseError(f"not a signature: {text[:200]!r}")
        device = match["device"] or ""
        inputs: list[InputSpec | None] = []
        for part in match["inputs"].split(", ") if match["inputs"] else ():
            if part == "None":
                inputs.append(None)
                continue
            spec = _INPUT.fullmatch(part)
            if spec is None:
                raise SignatureParseError(f"not a signature input: {part[:200]!r}")
            shape = tuple(int(n) for n in spec["shape"].split(",")) if spec["shape"] else ()
            inputs.append(InputSpec(spec["dtype"], shape, device))
        stream = int(match["stream"]) if match["stream"] is not None else None
        return cls(tuple(inputs), stream)


_INPUT = re.compile(r"(?P<dtype>\w+)\[(?P<shape>[0-9]+(?:,[0-9]+)*)?\]")
_TEXT = re.compile(
    r"(?P<inputs>(?:None|\w+\[[0-9,]*\])(?:, (?:None|\w+\[[0-9,]*\]))*)?"
    r"(?: @(?P<device>[\w:.\-]+))?(?: s=(?P<stream>-?[0-9]+))?"
)
