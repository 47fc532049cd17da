"""Read omnitrace's own environment variables."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from omnitrace._validate import check_duration, check_endpoint
from omnitrace.errors import ConfigError

__all__ = [
    "OTLP_BASE_VARIABLE",
    "OTLP_DEFAULT_ENDPOINTS",
    "OTLP_ENDPOINT_VARIABLES",
    "OTLP_SIGNALS",
    "OTLPEndpoint",
    "env_flag",
    "env_seconds",
    "otlp_endpoint",
    "otlp_endpoint_errors",
    "otlp_endpoints",
    "otlp_endpoints_text",
    "otlp_exports_by_variable",
    "otlp_where",
]

#: The OTLP signals omnitrace exports, and the path OTLP/HTTP gives each under a base URL.
OTLP_SIGNALS = {"traces": "v1/traces", "metrics": "v1/metrics"}
#: The variable of the base endpoint of every signal.
OTLP_BASE_VARIABLE = "OTEL_EXPORTER_OTLP_ENDPOINT"
#: The variables an OTLP exporter reads its endpoint from: the base one, then per signal.
OTLP_ENDPOINT_VARIABLES = (
    OTLP_BASE_VARIABLE,
    *(f"OTEL_EXPORTER_OTLP_{signal.upper()}_ENDPOINT" for signal in OTLP_SIGNALS),
)
#: The endpoint of each OTLP protocol when no variable or argument gives one.
OTLP_DEFAULT_ENDPOINTS = {"http/protobuf": "http://localhost:4318", "grpc": "http://localhost:4317"}

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


@dataclass(frozen=True, slots=True)
class OTLPEndpoint:
    """Where one signal is exported: the exporter's URL and what gave it."""

    signal: str
    """``traces`` or ``metrics``."""
    url: str
    """The URL the exporter is given (over http/protobuf, with the signal's path)."""
    source: str | None
    """The variable or option the URL came from; None: the protocol's default."""


def _signal_variable(signal: str) -> str:
    return f"OTEL_EXPORTER_OTLP_{signal.upper()}_ENDPOINT"


def _signal_url(base: str, protocol: str, signal: str) -> str:
    """``base`` as the exporter of ``signal`` takes it: http/protobuf adds the signal's path."""
    if protocol != "http/protobuf":
        return base
    # As the OTLP/HTTP exporters join them: one slash between the base and v1/traces.
    return f"{base if base.endswith('/') else base + '/'}{OTLP_SIGNALS[signal]}"


def otlp_endpoint(
    environ: Mapping[str, str],
    protocol: str,
    signal: str,
    *,
    base: str | None = None,
    base_name: str = "endpoint",
) -> OTLPEndpoint:
    """Return where ``signal`` is exported, by OpenTelemetry's rules for the variables.

    The one lookup of the OTLP endpoints: the SDK wiring, the demo, ``replay`` and
    ``config`` all use it. ``base`` (an argument or option, named ``base_name``), when
    given, is the base of every signal and wins over the variables. Otherwise the signal's
    own variable (``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``, ``..._METRICS_ENDPOINT``) is used
    as given; else ``OTEL_EXPORTER_OTLP_ENDPOINT`` is the base; else the protocol's
    localhost default. Over http/protobuf a base gets the signal's path (``v1/traces``,
    ``v1/metrics``); over gRPC it is the endpoint as it is. Blank variables are unset.

    Raises:
        ConfigError: the endpoint the signal would use is no http(s) URL with a host (one
            line naming the variable or option).
    """
    example = OTLP_DEFAULT_ENDPOINTS.get(protocol, OTLP_DEFAULT_ENDPOINTS["http/protobuf"])
    if base is not None:
        url = check_endpoint(base_name, base, example=example)
        return OTLPEndpoint(signal, _signal_url(url, protocol, signal), base_name)
    name = _signal_variable(signal)
    own = environ.get(name, "").strip()
    if own:
        return OTLPEndpoint(signal, check_endpoint(name, own, example=example), name)
    shared = environ.get(OTLP_BASE_VARIABLE, "").strip()
    if shared:
        url = check_endpoint(OTLP_BASE_VARIABLE, shared, example=example)
        return OTLPEndpoint(signal, _signal_url(url, protocol, signal), OTLP_BASE_VARIABLE)
    return OTLPEndpoint(signal, _signal_url(example, protocol, signal), None)


def otlp_endpoints(
    environ: Mapping[str, str],
    protocol: str,
    *,
    base: str | None = None,
    base_name: str = "endpoint",
) -> dict[str, OTLPEndpoint]:
    """Return :func:`otlp_endpoint` of each signal omnitrace exports.

    Raises:
        ConfigError: the endpoint a signal would use is no http(s) URL with a host.
    """
    return {
        signal: otlp_endpoint(environ, protocol, signal, base=base, base_name=base_name)
        for signal in OTLP_SIGNALS
    }


def otlp_endpoint_errors(environ: Mapping[str, str], protocol: str = "http/protobuf") -> list[str]:
    """Return one line per OTLP endpoint variable that is set and no http(s) URL with a host.

    Every variable is checked, used or not (a signal's own variable hides the base from it),
    so a bad value is said before the run rather than when the exporter first sends.
    """
    example = OTLP_DEFAULT_ENDPOINTS.get(protocol, OTLP_DEFAULT_ENDPOINTS["http/protobuf"])
    errors = []
    for name in OTLP_ENDPOINT_VARIABLES:
        text = environ.get(name, "").strip()
        if text:
            try:
                check_endpoint(name, text, example=example)
            except ConfigError as exc:
                errors.append(str(exc))
    return errors


def otlp_exports_by_variable(environ: Mapping[str, str]) -> bool:
    """Whether an OTLP endpoint variable is set: the base one or a signal's own."""
    return any(environ.get(name, "").strip() for name in OTLP_ENDPOINT_VARIABLES)


def otlp_where(endpoints: Mapping[str, OTLPEndpoint], protocol: str) -> str:
    """Say in a few words where the signals go: the one base they share, else each URL."""
    urls = [endpoint.url for endpoint in endpoints.values()]
    if len(set(urls)) == 1:
        return urls[0]
    paths = {endpoint.url: OTLP_SIGNALS[endpoint.signal] for endpoint in endpoints.values()}
    if protocol == "http/protobuf" and all(url.endswith(path) for url, path in paths.items()):
        bases = {url.removesuffix(path) for url, path in paths.items()}
        if len(bases) == 1:
            return bases.pop().removesuffix("/")
    return otlp_endpoints_text(endpoints)


def otlp_endpoints_text(endpoints: Mapping[str, OTLPEndpoint]) -> str:
    """Name each signal's URL: ``traces to http://h:4318/v1/traces, metrics to ...``."""
    return ", ".join(f"{endpoint.signal} to {endpoint.url}" for endpoint in endpoints.values())


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
