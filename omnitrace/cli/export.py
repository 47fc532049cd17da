"""The commands' OpenTelemetry export: whether the environment turns it on, who reports it."""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator

__all__ = ["_endpoint_errors", "_export_reported_by_the_cli", "_exports_by_variable"]


def _exports_by_variable() -> bool:
    """Whether an OTLP endpoint variable turns the OTLP export on (demo, replay): the base
    ``OTEL_EXPORTER_OTLP_ENDPOINT`` or a signal's own (``..._TRACES_ENDPOINT``,
    ``..._METRICS_ENDPOINT``)."""
    from omnitrace._env import otlp_exports_by_variable

    return otlp_exports_by_variable(os.environ)


def _endpoint_errors(command: str) -> int | None:
    """Say, one line each, every OTLP endpoint variable that is no http(s) URL; exit status 2.

    None when all are good. The protocol's own variable is checked by the SDK wiring.
    """
    from omnitrace._env import OTLP_DEFAULT_ENDPOINTS, otlp_endpoint_errors
    from omnitrace.cli.output import command_error

    protocol = os.environ.get("OTEL_EXPORTER_OTLP_PROTOCOL", "").strip()
    errors = otlp_endpoint_errors(
        os.environ, protocol if protocol in OTLP_DEFAULT_ENDPOINTS else "http/protobuf"
    )
    for line in errors:
        command_error(command, line)
    return 2 if errors else None


@contextlib.contextmanager
def _export_reported_by_the_cli() -> Iterator[None]:
    """Keep the OTel SDK wiring's outage warning quiet: the command reports the export itself."""
    otel_logger = logging.getLogger("omnitrace.sinks.otel.sdk")
    saved = otel_logger.propagate
    quiet = logging.NullHandler()
    otel_logger.addHandler(quiet)
    otel_logger.propagate = False
    try:
        yield
    finally:
        otel_logger.removeHandler(quiet)
        otel_logger.propagate = saved
