"""LogQL queries against the lines the log sink really writes."""

from __future__ import annotations

import io
import json
from collections.abc import Iterator
from typing import Any

import pytest
import structlog

from omnitrace.events import CaptureFailed
from omnitrace.sinks.logs import LogSink, configure_logging
from omnitrace.sinks.names import LOG_EVENTS
from omnitrace.testing import sig

from ._support import committed_queries, load_generator, logql_facts

LOGQL = [q for q in committed_queries() if q.language == "logql"]


@pytest.fixture
def captured_failure_line() -> Iterator[dict[str, Any]]:
    stream = io.StringIO()
    configure_logging(level="debug", json=True, stream=stream)
    try:
        event = CaptureFailed(
            adapter="vision",
            signature=sig("float32[1,256,1152] @cuda:0 s=0"),
            monotonic_ns=1,
            epoch_ns=2,
            error_type="RuntimeError",
            message="CUDA error: operation not permitted when stream is capturing",
            device="cuda:0",
            stream=0,
        )
        LogSink().handle([event])
        (line,) = stream.getvalue().splitlines()
        yield json.loads(line)
    finally:
        structlog.reset_defaults()


def test_capture_failed_line_carries_the_alerted_fields(
    captured_failure_line: dict[str, Any],
) -> None:
    """A real capture_failed line has the event, level and every field the log alert groups by."""
    assert captured_failure_line["event"] == "capture_failed"
    assert captured_failure_line["level"] == LOG_EVENTS["capture_failed"]
    for query in LOGQL:
        facts = logql_facts(query.expr)
        selected = {label: value for label, _op, value in facts.stream_matchers}
        if selected.get("event") != "capture_failed":
            continue
        for field in facts.grouping | {f for f, _op, _v in facts.field_filters}:
            assert field in captured_failure_line, (query.where, field)


def test_declared_log_fields_are_written(captured_failure_line: dict[str, Any]) -> None:
    """Every field the generator lets queries use is a key of a real capture_failed line."""
    assert set(load_generator().LOG_FIELDS) <= set(captured_failure_line)
