"""The sinks a setting can ask for: one table, read by the vLLM plugin and the command line.

Each :class:`SinkSpec` names a sink, the environment variable that asks for it, the module
that implements it (imported only when the sink is asked for, so a missing optional
dependency costs nothing until then) and a factory that builds the sink from the variable's
value. The vLLM plugin attaches every sink its worker's environment asks for;
``omnitrace demo`` and ``omnitrace replay`` attach the ones they do not already wire from
their own options (the event log and OpenTelemetry).

Adding a sink is its module, one entry in :data:`SINKS`, its test and a line of docs::

    SinkSpec(
        name="kafka",
        env="OMNITRACE_KAFKA",
        module="omnitrace.sinks.kafka",
        build=lambda kafka, request: kafka.KafkaSink(request.value, bus=request.bus),
        description="events to this Kafka topic (broker:port/topic)",
    )

Errors: a variable a sink cannot use raises :class:`~omnitrace.config.ConfigError` naming
it; a sink whose module cannot be imported raises :class:`SinkUnavailableError` naming the
variable that asked for it.
"""

from __future__ import annotations

import importlib
import inspect
import os
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from types import ModuleType
from typing import TYPE_CHECKING, Any

from omnitrace._env import env_flag
from omnitrace.config import OmnitraceError

if TYPE_CHECKING:
    from omnitrace.bus import EventBus, Sink

__all__ = [
    "SINKS",
    "SinkRequest",
    "SinkSpec",
    "SinkUnavailableError",
    "build_sink",
    "build_sinks",
    "requested",
]


class SinkUnavailableError(OmnitraceError, RuntimeError):
    """A sink was asked for, but its module cannot be imported."""


@dataclass(frozen=True, slots=True)
class SinkRequest:
    """What a sink factory gets: the bus, the setting's value and who is asking."""

    bus: EventBus
    value: str
    """The variable's value, stripped (``"1"`` for a switch)."""
    environ: Mapping[str, str]
    """The environment of the process the sink runs in (OpenTelemetry reads its own there)."""
    pid: int
    rank: int | None
    """The serving worker's rank, when the caller knows it."""


@dataclass(frozen=True, slots=True)
class SinkSpec:
    """One sink a setting can ask for."""

    name: str
    env: str
    """The environment variable that asks for the sink."""
    module: str
    """The module implementing the sink, imported when the sink is built."""
    build: Callable[[ModuleType, SinkRequest], Sink]
    """Build the sink from the imported module and the request."""
    description: str
    switch: bool = False
    """A 1/0 variable; otherwise any non-empty value asks for the sink and is passed on."""

    def value(self, environ: Mapping[str, str]) -> str | None:
        """Return the setting that asks for this sink, or None when ``environ`` does not.

        Raises:
            ConfigError: a switch variable is not a boolean word (the message names it).
        """
        if self.switch:
            return "1" if env_flag(environ, self.env, False) else None
        return environ.get(self.env, "").strip() or None


def _jsonl(module: ModuleType, request: SinkRequest) -> Sink:
    kwargs: dict[str, Any] = {"bus": request.bus}
    # The worker's rank is passed on to a JsonlSink that takes one; one that does not
    # finds the rank in the environment itself.
    if request.rank is not None and "rank" in inspect.signature(module.JsonlSink).parameters:
        kwargs["rank"] = request.rank
    sink: Sink = module.JsonlSink(request.value, **kwargs)
    return sink


def _otlp(module: ModuleType, request: SinkRequest) -> Sink:
    attributes: dict[str, str | int | float | bool] = {"process.pid": request.pid}
    if request.rank is not None:
        attributes["omnitrace.worker.rank"] = request.rank
    # OTEL_SERVICE_NAME is read from the request's environment (the worker's); the other
    # OTEL_* variables are read by configure_sdk and the SDK. The SDK shuts down at exit.
    sink: Sink = module.sdk_sink(
        request.bus,
        service_name=request.environ.get("OTEL_SERVICE_NAME", "").strip() or None,
        default_service_name="omnitrace",
        resource_attributes=attributes,
    ).sink
    return sink


def _logs(module: ModuleType, request: SinkRequest) -> Sink:
    # A host that configured structlog keeps its own rendering; otherwise JSON lines go to
    # stderr at info level (captures, deferrals, failures and graph_summary lines).
    import structlog

    if not structlog.is_configured():
        module.configure_logging(level="info", json=True)
    sink: Sink = module.LogSink(bus=request.bus, environ=request.environ)
    return sink


#: Every sink a setting can ask for, in the order they are attached.
SINKS: tuple[SinkSpec, ...] = (
    SinkSpec(
        name="jsonl",
        env="OMNITRACE_EVENTS_LOG",
        module="omnitrace.sinks.jsonl",
        build=_jsonl,
        description=(
            "JSONL event log at this path; {pid} and {rank} are filled in per worker "
            "(omnitrace top follows it)"
        ),
    ),
    SinkSpec(
        name="otlp",
        env="OMNITRACE_OTLP",
        module="omnitrace.sinks.otel_sdk",
        build=_otlp,
        switch=True,
        description=(
            "OpenTelemetry spans and metrics, configured by OpenTelemetry's OTEL_* variables "
            "(OTEL_EXPORTER_OTLP_ENDPOINT, OTEL_SERVICE_NAME, ...)"
        ),
    ),
    SinkSpec(
        name="logs",
        env="OMNITRACE_LOGS",
        module="omnitrace.sinks.logs",
        build=_logs,
        switch=True,
        description=(
            "structlog JSON lines of captures, deferrals and failures, and a graph_summary "
            "line per encoder every OMNITRACE_SUMMARY_INTERVAL seconds and at exit"
        ),
    ),
)


def requested(
    environ: Mapping[str, str], *, exclude: Collection[str] = ()
) -> list[tuple[SinkSpec, str]]:
    """Return the sinks ``environ`` asks for, with their settings, in table order.

    Args:
        environ: the environment to read.
        exclude: names of sinks the caller wires itself; their variables are not read.

    Raises:
        ConfigError: a variable has an invalid value (the message names it).
    """
    asked = []
    for spec in SINKS:
        if spec.name in exclude:
            continue
        value = spec.value(environ)
        if value is not None:
            asked.append((spec, value))
    return asked


def build_sink(spec: SinkSpec, request: SinkRequest) -> Sink:
    """Import ``spec``'s module and build its sink for ``request``.

    Raises:
        SinkUnavailableError: the module cannot be imported (the message names the variable).
    """
    try:
        module = importlib.import_module(spec.module)
    except ImportError as exc:
        raise SinkUnavailableError(
            f"{spec.env} is set but {spec.module} cannot be imported ({exc}); install "
            "omnitrace with its telemetry dependencies or unset the variable"
        ) from exc
    return spec.build(module, request)


def build_sinks(
    bus: EventBus,
    environ: Mapping[str, str],
    *,
    rank: int | None = None,
    exclude: Collection[str] = (),
) -> list[Sink]:
    """Build every sink ``environ`` asks for (the caller adds them to ``bus``).

    Args:
        bus: the bus the sinks will serve (some read its adapters and statistics).
        environ: the environment to read.
        rank: the serving worker's rank, when known.
        exclude: names of sinks the caller wires itself.

    Raises:
        ConfigError: a variable has an invalid value (the message names it).
        SinkUnavailableError: an asked-for sink's module cannot be imported.
    """
    pid = os.getpid()
    return [
        build_sink(spec, SinkRequest(bus=bus, value=value, environ=environ, pid=pid, rank=rank))
        for spec, value in requested(environ, exclude=exclude)
    ]
