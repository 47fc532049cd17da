"""The SDK's settings read from OpenTelemetry's variables: the resource (omnitrace's defaults
under ``OTEL_*``, those under explicit arguments) and the export intervals."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from omnitrace._env import env_seconds
from omnitrace._worker import env_rank
from omnitrace.sinks.names import ATTR

__all__ = ["INTERVAL_RANGE_S", "TIMEOUT_RANGE_S", "env_millis", "sdk_resource"]


def sdk_resource(
    service_name: str | None,
    default_service_name: str,
    extra: Mapping[str, str | int | float | bool] | None,
    defaults_of_source: Mapping[str, str | int | float | bool] | None = None,
) -> Any:
    """Build the SDK resource: explicit arguments, else OTel's variables, else defaults.

    ``OTEL_SERVICE_NAME`` and ``OTEL_RESOURCE_ATTRIBUTES`` (read by the SDK's own detector)
    override omnitrace's defaults (service name, pid, worker ranks) and are overridden by
    ``service_name`` and ``resource_attributes`` when those are given.
    """
    from opentelemetry.sdk.resources import OTELResourceDetector, Resource

    defaults: dict[str, str | int | float | bool] = {
        ATTR.SERVICE_NAME: default_service_name,
        ATTR.PROCESS_PID: os.getpid(),
    }
    # torchrun and most launchers export these; they tell the workers of one job apart.
    for variable, key in (("RANK", ATTR.RANK), ("LOCAL_RANK", ATTR.LOCAL_RANK)):
        rank = env_rank(variable)
        if rank is not None:
            defaults[key] = rank
    # The process the telemetry describes, when it is not this one (a replayed worker).
    defaults.update(defaults_of_source or {})
    from_env = OTELResourceDetector().detect().attributes
    attributes = {key: value for key, value in defaults.items() if key not in from_env}
    if service_name is not None:
        attributes[ATTR.SERVICE_NAME] = service_name
    if extra:
        attributes.update(extra)
    # Resource.create merges the same variables again, under these attributes.
    return Resource.create(attributes)


#: Export intervals and delays, in seconds: from 10 ms (shorter only spins the SDK's export
#: thread) to a day. The SDK takes any positive number, but past threading.TIMEOUT_MAX
#: (about 292 years) its thread's wait raises OverflowError, far from where it was set.
INTERVAL_RANGE_S = (0.01, 86_400.0)
#: The deadline of one export, retries included: 10 ms to 10 minutes.
TIMEOUT_RANGE_S = (0.01, 600.0)


def env_millis(name: str) -> float | None:
    """Return the seconds in the millisecond variable ``name``; None when it is unset.

    Raises:
        ConfigError: the value is no number of milliseconds in :data:`INTERVAL_RANGE_S`.
    """
    if not os.environ.get(name, "").strip():
        return None
    low, high = INTERVAL_RANGE_S
    millis = env_seconds(
        os.environ, name, 0.0, low=low * 1000, high=high * 1000, unit="milliseconds"
    )
    return millis / 1000
