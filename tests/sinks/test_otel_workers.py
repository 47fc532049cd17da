"""Replayed logs exported with one OpenTelemetry resource per writer."""

from __future__ import annotations

import socket

import pytest

from omnitrace.config import ConfigError
from omnitrace.events import GraphReplayed
from omnitrace.otlp_receiver import OTLPReceiver, attributes
from omnitrace.sinks.jsonl import EventRecord
from omnitrace.sinks.otel.workers import WorkerExport
from omnitrace.testing import sig

KEY = sig("float32[1,256,64]")


@pytest.fixture(autouse=True)
def _no_otel_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_RESOURCE_ATTRIBUTES", "OTEL_SERVICE_NAME"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.delenv("RANK", raising=False)


def test_checking_the_settings_exports_nothing() -> None:
    """Built and shut down before any record, it sent no request: the settings check that
    runs when it is built never reaches the endpoint."""
    with OTLPReceiver() as receiver:
        export = WorkerExport(endpoint=receiver.endpoint)
        assert export.endpoint == receiver.endpoint
        assert export.shutdown()
        assert receiver.trace_requests == receiver.metrics_requests == []


def test_a_bad_variable_fails_when_it_is_built(monkeypatch: pytest.MonkeyPatch) -> None:
    """A bad OTEL_* variable is a ConfigError before a single log line is read."""
    monkeypatch.setenv("OTEL_METRIC_EXPORT_INTERVAL", "soon")
    with pytest.raises(ConfigError, match=r"^OTEL_METRIC_EXPORT_INTERVAL: "):
        WorkerExport(endpoint="http://127.0.0.1:9")


def test_a_taken_scrape_port_fails_when_it_is_built() -> None:
    """The scrape endpoint starts when it is built: a taken port is an OSError then."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        with pytest.raises(OSError, match="in use"):
            WorkerExport(otlp=False, prometheus_port=taken.getsockname()[1])


def test_each_writer_gets_its_own_resource_and_bus() -> None:
    """Records of two writers reach two resources, named by the writers' rank and pid."""
    with OTLPReceiver() as receiver:
        export = WorkerExport(endpoint=receiver.endpoint)
        for rank, pid, hits in ((0, 10, 3), (1, 11, 5)):
            for t in range(hits):
                export(EventRecord(GraphReplayed("vision", KEY, t, t, 0.001), pid, rank), "")
        assert export.shutdown()
        assert [(w.rank, w.pid) for w in export.writers()] == [(0, 10), (1, 11)]
        assert export.dropped == 0
        seen = {}
        for request in receiver.metrics_requests:
            for rm in request.resource_metrics:
                resource = attributes(rm.resource.attributes)
                for scope in rm.scope_metrics:
                    for metric in scope.metrics:
                        if metric.name == "omnitrace.encoder.graph.hits":
                            (point,) = metric.sum.data_points
                            key = (resource["omnitrace.worker.rank"], resource["process.pid"])
                            seen[key] = point.as_int
    assert seen == {(0, 10): 3, (1, 11): 5}
