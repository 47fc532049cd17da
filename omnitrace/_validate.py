"""One validator per rule: every argument, override and variable check raises ConfigError.

Messages name the setting, what was expected and what was received, in one short line
whatever the value's size: ``max_bytes: expected a nonnegative integer, got -1 (int)``.
"""

from __future__ import annotations

import reprlib
import unicodedata

from omnitrace.errors import ConfigError

__all__ = [
    "INT64_MAX",
    "OversizedInt",
    "check_bool",
    "check_int",
    "check_name",
    "check_number",
    "check_text",
    "describe",
]

#: Largest value of a signed 64-bit integer: every count and byte size omnitrace exports.
INT64_MAX = (1 << 63) - 1

_short = reprlib.Repr()
_short.maxstring = 60
_short.maxother = 60


class OversizedInt:
    """A JSON integer too long to convert (or to mean anything here), kept as its digits."""

    __slots__ = ("digits",)

    def __init__(self, text: str) -> None:
        self.digits = len(text.lstrip("-"))


def describe(value: object) -> str:
    """Show ``value`` and its type in one short line, whatever its size or depth."""
    if isinstance(value, OversizedInt):
        return f"a {value.digits}-digit integer"
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 128:
        # repr() of a huge int is slow, and refused past about 4,300 digits.
        return f"an integer of {value.bit_length()} bits (int)"
    return f"{_short.repr(value)} ({type(value).__name__})"


def check_int(
    name: str,
    value: object,
    *,
    minimum: int = 0,
    maximum: int = INT64_MAX,
    meaning: str | None = None,
) -> int:
    """Return ``value`` if it is an int (not a bool) within ``[minimum, maximum]``.

    Floats such as ``4.0`` and strings such as ``"4"`` are refused: in a JSON override or a
    keyword argument they are typos waiting to happen.

    Raises:
        ConfigError: naming ``name``, ``meaning`` (default: the range) and the value.
    """
    if isinstance(value, bool) or not isinstance(value, int) or not minimum <= value <= maximum:
        if meaning is None:
            if minimum == 0 and maximum == INT64_MAX:
                meaning = "a nonnegative integer"
            elif minimum == 1 and maximum == INT64_MAX:
                meaning = "a positive integer"
            elif maximum == INT64_MAX:
                meaning = f"an integer of at least {minimum}"
            else:
                meaning = f"an integer from {minimum} to {maximum}"
        raise ConfigError(f"{name}: expected {meaning}, got {describe(value)}")
    return value


def check_number(name: str, value: object, *, positive: bool = True, unit: str = "") -> float:
    """Return ``value`` as a float if it is a finite (positive) int or float, not a bool.

    Raises:
        ConfigError: naming ``name`` and the value.
    """
    ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    if ok:
        number = float(value)  # type: ignore[arg-type]
        finite = number == number and abs(number) != float("inf")
        ok = finite and (number > 0 if positive else number >= 0)
    if not ok:
        kind = "a positive number" if positive else "a nonnegative number"
        suffix = f" of {unit}" if unit else ""
        raise ConfigError(f"{name}: expected {kind}{suffix}, got {describe(value)}")
    return float(value)  # type: ignore[arg-type]


def check_bool(name: str, value: object) -> bool:
    """Return ``value`` if it is a bool.

    Raises:
        ConfigError: naming ``name`` and the value.
    """
    if not isinstance(value, bool):
        raise ConfigError(f"{name}: expected true or false, got {describe(value)}")
    return value


def check_text(name: str, value: object) -> str:
    """Return ``value`` if it is a string with more than white space in it.

    Raises:
        ConfigError: naming ``name`` and the value.
    """
    if not isinstance(value, str) or not value.strip():
        raise ConfigError(f"{name}: expected a non-empty string, got {describe(value)}")
    return value


def check_name(name: str, value: object) -> str:
    """Return ``value`` if it is a non-empty string every sink can carry as a name.

    A lone surrogate cannot be encoded as UTF-8 (so no JSON line can hold it) and a control
    character breaks log lines and terminals: names with either are refused.

    Raises:
        ConfigError: naming ``name`` and the value.
    """
    text = check_text(name, value)
    # Cc: C0 and C1 controls and DEL; Cs: surrogates, which are lone in a str.
    if any(unicodedata.category(char) in ("Cc", "Cs") for char in text):
        raise ConfigError(
            f"{name}: expected no control characters or lone surrogates (the event log "
            f"cannot carry them), got {describe(value)}"
        )
    return text
