"""The OpenTelemetry SDK's wiring under its former name: see :mod:`omnitrace.sinks.otel.sdk`."""

from __future__ import annotations

from omnitrace.sinks.otel.sdk import OTelSetup, SdkSink, configure_sdk, sdk_sink

__all__ = ["OTelSetup", "SdkSink", "configure_sdk", "sdk_sink"]
