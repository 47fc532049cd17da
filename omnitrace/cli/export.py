"""The commands' OpenTelemetry export: whether the environment turns it on, who reports it."""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator

__all__ = ["_export_reported_by_the_cli", "_exports_by_variable"]


def _exports_by_variable() -> bool:
    """Whether OTEL_EXPORTER_OTLP_ENDPOINT turns the OTLP export on (demo, replay)."""
    return bool(os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT", "").strip())


@contextlib.contextmanager
def _export_reported_by_the_cli() -> Iterator[None]:
    """Keep the OTel SDK wiring's outage warning quiet: the command reports the export itself."""
    otel_logger = logging.getLogger("omnitrace.sinks.otel_sdk")
    saved = otel_logger.propagate
    quiet = logging.NullHandler()
    otel_logger.addHandler(quiet)
    otel_logger.propagate = False
    try:
        yield
    finally:
        otel_logger.removeHandler(quiet)
        otel_logger.propagate = saved
