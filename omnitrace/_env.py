"""Read omnitrace's own environment variables."""

from __future__ import annotations

from collections.abc import Mapping

from omnitrace.errors import ConfigError

__all__ = ["env_flag", "env_seconds"]

_TRUE = frozenset({"1", "true", "yes", "on"})
_FALSE = frozenset({"", "0", "false", "no", "off"})


def env_flag(environ: Mapping[str, str], name: str, default: bool) -> bool:
    """Return the boolean value of the variable ``name``, or ``default`` when it is unset.

    Raises:
        ConfigError: the value is not one of 1/0, true/false, yes/no, on/off (any case).
    """
    raw = environ.get(name)
    if raw is None:
        return default
    value = raw.strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ConfigError(f"{name}: expected 1/0, true/false, yes/no or on/off, got {raw!r}")


def env_seconds(
    environ: Mapping[str, str], name: str, default: float, *, meaning: str = ""
) -> float:
    """Return the variable ``name`` as a nonnegative number of seconds, else ``default``.

    Raises:
        ConfigError: the value is not a finite number from 0 to 10**6 (``meaning`` is added
            to the message, e.g. what 0 does).
    """
    raw = environ.get(name)
    if raw is None or not raw.strip():
        return default
    try:
        value = float(raw.strip())
    except ValueError:
        value = -1.0
    if not 0 <= value <= 1e6:
        hint = f" ({meaning})" if meaning else ""
        raise ConfigError(
            f"{name}: expected a number of seconds from 0 to 1000000{hint}, got {raw[:40]!r}"
        )
    return value
