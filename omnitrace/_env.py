"""Read omnitrace's own environment variables."""

from __future__ import annotations

from collections.abc import Mapping

from omnitrace._validate import check_duration, check_endpoint
from omnitrace.errors import ConfigError

__all__ = ["OTLP_ENDPOINT_VARIABLES", "env_endpoints", "env_flag", "env_seconds"]

#: The variables an OTLP exporter reads its endpoint from: the base one, then per signal.
OTLP_ENDPOINT_VARIABLES = (
    "OTEL_EXPORTER_OTLP_ENDPOINT",
    "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
    "OTEL_EXPORTER_OTLP_METRICS_ENDPOINT",
)

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


def env_endpoints(
    environ: Mapping[str, str], *, example: str = "http://localhost:4318"
) -> dict[str, str]:
    """Return the OTLP endpoint variables that are set, each checked to be an http(s) URL.

    Raises:
        ConfigError: a set variable is not an http:// or https:// URL with a host (and a
            port from 1 to 65535, if any); one line naming it.
    """
    found = {}
    for name in OTLP_ENDPOINT_VARIABLES:
        text = environ.get(name, "").strip()
        if text:
            found[name] = check_endpoint(name, text, example=example)
    return found


def env_seconds(
    environ: Mapping[str, str],
    name: str,
    default: float,
    *,
    low: float,
    high: float,
    zero: str | None = None,
    unit: str = "seconds",
) -> float:
    """Return the variable ``name`` as a number (of ``unit``) within ``[low, high]``.

    Unset or blank: ``default``. ``zero``, when given, says what 0 does, and accepts it.

    Raises:
        ConfigError: the value is no number in that range; one line naming the variable, the
            range and the value.
    """
    raw = environ.get(name)
    if raw is None or not raw.strip():
        return default
    try:
        value: float | None = float(raw.strip())
    except ValueError:
        value = None
    return check_duration(name, value, low=low, high=high, unit=unit, zero=zero, shown=_quote(raw))


def _quote(raw: str) -> str:
    """Quote a variable's text in a message: repr-escaped, and at most 40 characters of it."""
    return repr(raw) if len(raw) <= 40 else f"{raw[:40]!r}... ({len(raw)} characters)"
