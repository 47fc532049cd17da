"""End to end: ``omnitrace demo`` exports over OTLP exactly the metrics the dashboards query."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import subprocess
import sys
from dataclasses import dataclass

import pytest

from omnitrace.sinks.names import LOG_EVENTS, METRICS, SPANS

from ._support import (
    PROMETHEUS_BUILTIN_LABELS,
    committed_queries,
    prom_label,
    promql_facts,
    series_keys,
)

REQUESTS = 40
# What the ``omnitrace`` console script does, so the test needs no script on PATH.
RUN_CLI = "import sys\nfrom omnitrace.cli import main\nsys.argv[0] = 'omnitrace'\nsys.exit(main())"
PROMQL = [q for q in committed_queries() if q.language == "promql"]


@dataclass(frozen=True)
class DemoRun:
    """What one demo run exported and logged."""

    metric_attributes: dict[str, set[str]]
    """OTel metric name -> attribute keys seen on its data points."""
    span_names: set[str]
    service_names: set[str]
    log_lines: list[dict[str, object]]


def _point_attribute_keys(metric: object) -> set[str]:
    data = getattr(metric, metric.WhichOneof("data"))  # type: ignore[attr-defined]
    return {kv.key for point in data.data_points for kv in point.attributes}


@pytest.fixture(scope="module")
def demo_run(tmp_path_factory: pytest.TempPathFactory) -> DemoRun:
    from omnitrace.otlp_receiver import OTLPReceiver

    workdir = tmp_path_factory.mktemp("demo")
    log_file = workdir / "logs" / "omnitrace.log"
    log_file.parent.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    with OTLPReceiver("http/protobuf") as receiver:
        env["OTEL_EXPORTER_OTLP_ENDPOINT"] = receiver.endpoint
        env["OTEL_EXPORTER_OTLP_PROTOCOL"] = "http/protobuf"
        result = subprocess.run(
            [
                sys.executable,
                "-c",
                RUN_CLI,
                "demo",
                "--no-tui",
                "--requests",
                str(REQUESTS),
                "--log-file",
                str(log_file),
                # Device timing on: the device-time histograms are exported too.
                "--hf-overrides",
                '{"encoder_cuda_graph_device_timing": true}',
            ],
            cwd=workdir,
            env=env,
            capture_output=True,
            text=True,
            timeout=240,
            check=False,
        )
        assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
        # The demo flushes its providers before it exits; allow the last request to land.
        assert receiver.wait_for(lambda r: r.metrics_requests and r.trace_requests, 10.0)
        metric_attributes: dict[str, set[str]] = {}
        for metric in receiver.metrics():
            keys = metric_attributes.setdefault(metric.name, set())
            keys |= _point_attribute_keys(metric)
        resources = [rm.resource for r in receiver.metrics_requests for rm in r.resource_metrics]
        resources += [rs.resource for rs in receiver.resource_spans()]
        services = {
            kv.value.string_value
            for resource in resources
            for kv in resource.attributes
            if kv.key == "service.name"
        }
        spans = {span.name for span in receiver.spans()}
    lines = [json.loads(line) for line in log_file.read_text(encoding="utf-8").splitlines()]
    return DemoRun(metric_attributes, spans, services, lines)


def _dashboard_metric_keys() -> set[str]:
    keys = series_keys()
    return {keys[series] for q in PROMQL for series in promql_facts(q.expr).metrics}


def test_demo_exports_exactly_the_metrics_the_dashboards_query(demo_run: DemoRun) -> None:
    """The OTel metric names the demo exports, translated by names.py, are the queried ones."""
    by_otel = {metric.otel: key for key, metric in METRICS.items()}
    unknown = set(demo_run.metric_attributes) - set(by_otel)
    assert unknown == set(), f"exported but missing from names.METRICS: {unknown}"
    exported = {by_otel[name] for name in demo_run.metric_attributes}
    assert exported == _dashboard_metric_keys()


def test_queried_labels_are_exported_attributes(demo_run: DemoRun) -> None:
    """Every label a query groups or filters by is an attribute key the demo's points carry."""
    exported_labels: dict[str, set[str]] = {}
    for metric in METRICS.values():
        keys = demo_run.metric_attributes.get(metric.otel, set())
        exported_labels[metric.prometheus] = {prom_label(k) for k in keys}
    for query in PROMQL:
        facts = promql_facts(query.expr)
        available = set(PROMETHEUS_BUILTIN_LABELS)
        for series in facts.metrics:
            available |= exported_labels[METRICS[series_keys()[series]].prometheus]
        assert facts.labels <= available, (query.where, facts.labels - available)


def test_demo_resource_and_spans_match_the_stack(demo_run: DemoRun) -> None:
    """The demo reports as one omnitrace service (Prometheus job, Jaeger service), known spans."""
    (service,) = demo_run.service_names
    assert re.fullmatch(r"omnitrace(-[a-z]+)?", service), service
    spans = {v for k, v in vars(SPANS).items() if k.isupper()}
    assert demo_run.span_names
    assert demo_run.span_names <= spans


def test_demo_log_file_is_what_alloy_and_loki_expect(demo_run: DemoRun) -> None:
    """Each line of --log-file is JSON with a names.LOG_EVENTS event at its level and an encoder."""
    assert demo_run.log_lines
    for line in demo_run.log_lines:
        assert line["event"] in LOG_EVENTS
        assert line["level"] == LOG_EVENTS[str(line["event"])]
        assert "encoder" in line
        assert "timestamp" in line


def test_dashboard_metric_mapping_covers_renames(monkeypatch: pytest.MonkeyPatch) -> None:
    """A dashboard series missing from names.py breaks the mapping instead of passing silently."""
    metric = METRICS["graphs"]
    monkeypatch.setitem(
        METRICS, "graphs", dataclasses.replace(metric, prometheus="omnitrace_renamed")
    )
    with pytest.raises(KeyError, match=metric.prometheus):
        _dashboard_metric_keys()
