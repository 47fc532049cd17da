"""One validator per rule: every argument, override and variable check raises a one-line
ConfigError naming the setting, what was expected and what was received."""

from __future__ import annotations

import reprlib
import unicodedata
import urllib.parse

from omnitrace.errors import ConfigError

__all__ = [
    "INT64_MAX",
    "OversizedInt",
    "check_bool",
    "check_duration",
    "check_endpoint",
    "check_int",
    "check_name",
    "check_number",
    "check_text",
    "describe",
    "duration_range",
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


def check_number(
    name: str,
    value: object,
    *,
    positive: bool = True,
    unit: str = "",
    within: tuple[float, float] | None = None,
) -> float:
    """Return ``value`` as a float if it is a finite (positive) int or float, not a bool.

    With ``within=(low, high)`` it must lie in ``[low, high]`` instead of being positive,
    and the message states that range.

    Raises:
        ConfigError: naming ``name``, the accepted values and the value.
    """
    ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    if ok:
        number = float(value)  # type: ignore[arg-type]
        if within is not None:
            ok = within[0] <= number <= within[1]  # False for nan
        else:
            finite = number == number and abs(number) != float("inf")
            ok = finite and (number > 0 if positive else number >= 0)
    if not ok:
        suffix = f" of {unit}" if unit else ""
        if within is not None:
            kind = f"a number{suffix} from {within[0]:g} to {within[1]:g}"
        else:
            kind = f"a {'positive' if positive else 'nonnegative'} number{suffix}"
        raise ConfigError(f"{name}: expected {kind}, got {describe(value)}")
    return float(value)  # type: ignore[arg-type]


def _plain(number: float) -> str:
    """``86400000`` and ``0.1``, not ``8.64e+07`` and ``0.1000``."""
    return str(int(number)) if float(number).is_integer() else repr(float(number))


def duration_range(low: float, high: float, unit: str, zero: str | None = None) -> str:
    """Say which durations are accepted: ``0 (what 0 does) or a number of seconds from...``."""
    span = f"a number of {unit} from {_plain(low)} to {_plain(high)}"
    return span if zero is None else f"0 ({zero}) or {span}"


def check_duration(
    name: str,
    value: object,
    *,
    low: float,
    high: float,
    unit: str = "seconds",
    zero: str | None = None,
    shown: str | None = None,
) -> float:
    """Return ``value`` as a float if it is a number within ``[low, high]`` (not a bool).

    A duration of 1e-300 s is as unusable as a negative one (a loop that never sleeps) and
    one of 1e300 s overflows the timeouts of threads and selectors: every duration has a
    range. ``zero``, when given, says what 0 does, and accepts it.

    Args:
        shown: how the value is quoted in the message (an environment variable's raw
            text); default: :func:`describe`.

    Raises:
        ConfigError: naming ``name``, the range and the value, in one line.
    """
    ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    if ok:
        # Compared before any conversion: float() of a huge int overflows; NaN compares false.
        ok = (zero is not None and value == 0) or low <= value <= high  # type: ignore[operator]
    if not ok:
        got = describe(value) if shown is None else shown
        raise ConfigError(f"{name}: expected {duration_range(low, high, unit, zero)}, got {got}")
    return float(value)  # type: ignore[arg-type]


def check_bool(name: str, value: object) -> bool:
    """Return ``value`` if it is a bool.

    Raises:
        ConfigError: naming ``name`` and the value.
    """
    if not isinstance(value, bool):
        raise ConfigError(f"{name}: expected true or false, got {describe(value)}")
    return value


def check_flag(name: str, value: object) -> bool:
    """Return ``value`` as a bool: a bool, or one of the words ``true``, ``1``, ``yes``,
    ``on``, ``false``, ``0``, ``no``, ``off`` (any case, surrounding blanks ignored), as a
    JSON body or an HTTP argument carries a switch.

    Raises:
        ConfigError: anything else, naming ``name`` and the value.
    """
    if isinstance(value, bool):
        return value
    if isinstance(value, str):
        word = value.strip().lower()
        if word in ("true", "1", "yes", "on"):
            return True
        if word in ("false", "0", "no", "off"):
            return False
    raise ConfigError(f"{name}: expected true or false, got {describe(value)}")


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


def check_endpoint(name: str, value: object, *, example: str = "http://localhost:4318") -> str:
    """Return ``value`` if it is an OTLP endpoint URL: ``http`` or ``https``, a host, and
    a port from 1 to 65535 if any (and no query, fragment or white space).

    An exporter given ``collector:4318`` or ``notaurl`` fails only when it first exports,
    with a message the SDK cuts short; checked here, it is one line before anything runs.

    Raises:
        ConfigError: naming ``name``, what is expected and the value.
    """
    problem = ""
    text = value.strip() if isinstance(value, str) else ""
    if not isinstance(value, str) or not text:
        problem = ""
    elif any(char.isspace() or unicodedata.category(char) == "Cc" for char in text):
        problem = ", which has white space or a control character in it"
    else:
        try:
            parts = urllib.parse.urlsplit(text)
        except ValueError:  # an unclosed or stray bracket: "Invalid IPv6 URL"
            parts = None
        try:
            port = 0 if parts is None else parts.port
        except ValueError:  # not a number, or past 65535
            port = 0
        if parts is None:
            problem = ", whose host is not a valid [IPv6] address"
        elif "://" not in text or parts.scheme.lower() not in ("http", "https"):
            problem = ", which does not start with http:// or https://"
        elif not parts.hostname:
            problem = ", which has no host"
        elif port == 0:
            problem = ", whose port is not a number from 1 to 65535"
        elif parts.query or parts.fragment or "?" in text or "#" in text:
            problem = ", which has a query or a fragment"
        else:
            return text
    shown = describe(value) if not isinstance(value, str) else _short.repr(value)
    raise ConfigError(
        f"{name}: expected a URL such as {example} (http:// or https://, a host, and a port "
        f"from 1 to 65535 if any), got {shown}{problem}"
    )
