"""OpenTelemetry: the API-only sink, the SDK's wiring with its guarded exporters and ``OTEL_*``
settings, a replay's export per worker and the export beside the worker. This face hands on
the sink's and the SDK's names on first access, so the relay loads no OpenTelemetry."""

from __future__ import annotations

from typing import TYPE_CHECKING

from omnitrace._lazy import lazy_getattr

if TYPE_CHECKING:
    from omnitrace.sinks.otel.sdk import OTelSetup, SdkSink, configure_sdk, sdk_sink
    from omnitrace.sinks.otel.sink import (
        CALL_DURATION_BUCKETS,
        CAPTURE_DURATION_BUCKETS,
        OTLP_PROTOCOLS,
        OTelSink,
        OTLPProtocol,
    )

__all__ = [
    "CALL_DURATION_BUCKETS",
    "CAPTURE_DURATION_BUCKETS",
    "OTLP_PROTOCOLS",
    "OTLPProtocol",
    "OTelSetup",
    "OTelSink",
    "SdkSink",
    "configure_sdk",
    "sdk_sink",
]

_MODULE_OF = {
    "CALL_DURATION_BUCKETS": "omnitrace.sinks.otel.sink",
    "CAPTURE_DURATION_BUCKETS": "omnitrace.sinks.otel.sink",
    "OTLP_PROTOCOLS": "omnitrace.sinks.otel.sink",
    "OTLPProtocol": "omnitrace.sinks.otel.sink",
    "OTelSetup": "omnitrace.sinks.otel.sdk",
    "OTelSink": "omnitrace.sinks.otel.sink",
    "SdkSink": "omnitrace.sinks.otel.sdk",
    "configure_sdk": "omnitrace.sinks.otel.sdk",
    "sdk_sink": "omnitrace.sinks.otel.sdk",
}

__getattr__ = lazy_getattr(__name__, globals(), _MODULE_OF)
