"""Read omnitrace's own environment variables."""

from __future__ import annotations

from collections.abc import Mapping

from omnitrace.errors import ConfigError

__all__ = ["env_flag"]

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
