"""The loopback OTLP receiver under its former name: see :mod:`omnitrace.otlp_receiver`."""

from __future__ import annotations

from omnitrace.otlp_receiver import DEFAULT_LIMITS, OTLPReceiver, ReceiverLimits, attributes, value

__all__ = ["DEFAULT_LIMITS", "OTLPReceiver", "ReceiverLimits", "attributes", "value"]
