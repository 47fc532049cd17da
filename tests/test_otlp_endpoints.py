"""OTLP endpoints per signal: one lookup, OpenTelemetry's rules, checked before the run."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from omnitrace._env import otlp_endpoints, otlp_where
from omnitrace.cli import main
from omnitrace.cli.config import settings
from omnitrace.errors import ConfigError
from omnitrace.otlp_receiver import OTLPReceiver
from omnitrace.sinks.otel.sdk import configure_sdk

BASE = "OTEL_EXPORTER_OTLP_ENDPOINT"
TRACES = "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"
METRICS = "OTEL_EXPORTER_OTLP_METRICS_ENDPOINT"
PROTOCOL = "OTEL_EXPORTER_OTLP_PROTOCOL"
#: What the endpoint check expects, as it says it.
EXPECTED = (
    "expected a URL such as http://localhost:4318 (http:// or https://, a host, and a port "
    "from 1 to 65535 if any), got"
)
NOT_HTTP = "which does not start with http:// or https://"


@pytest.fixture(autouse=True)
def _clean(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each test sets the OpenTelemetry variables it is about, and no others."""
    for name in list(os.environ):
        if name.startswith(("OMNITRACE_", "OTEL_")):
            monkeypatch.delenv(name)


def _demo(tmp_path: Path, *extra: str) -> tuple[int, dict[str, Any]]:
    summary = tmp_path / "run.json"
    code = main(
        [
            "demo",
            "--no-tui",
            "--cpu",
            "--requests",
            "12",
            "--events-log",
            str(tmp_path / "run.jsonl"),
            "--json-summary",
            str(summary),
            *extra,
        ]
    )
    return code, json.loads(summary.read_text()) if summary.exists() else {}


ENVIRONMENTS = [
    {},
    {BASE: "http://collector:4318"},
    {BASE: "http://collector:4318/otlp/", TRACES: "http://tempo:4318/custom"},
    {TRACES: "http://tempo:4318/v1/traces", METRICS: "http://mimir:9090/otlp/v1/metrics"},
    {PROTOCOL: "grpc", BASE: "http://collector:4317"},
    {PROTOCOL: "grpc", METRICS: "https://mimir:4317"},
]


@pytest.mark.parametrize("environ", ENVIRONMENTS, ids=range(len(ENVIRONMENTS)))
def test_the_sdk_exports_where_config_says(
    environ: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The exporters the SDK wiring builds get the very URLs ``omnitrace config`` shows."""
    for name, value in environ.items():
        monkeypatch.setenv(name, value)
    shown = {row["name"]: row for row in settings(os.environ)["settings"]}
    setup = configure_sdk(export_interval_s=60.0)
    try:
        used = {signal: endpoint.url for signal, endpoint in setup.endpoints.items()}
        assert used == {
            "traces": shown["traces endpoint"]["value"],
            "metrics": shown["metrics endpoint"]["value"],
        }
        sources = {signal: endpoint.source for signal, endpoint in setup.endpoints.items()}
        assert sources == {
            "traces": shown["traces endpoint"]["variable"],
            "metrics": shown["metrics endpoint"]["variable"],
        }
    finally:
        setup.shutdown()


def test_a_signal_variable_is_used_as_given_and_the_base_gets_the_path() -> None:
    """Over http/protobuf the traces variable is the URL itself; metrics get the base's
    v1/metrics; an explicit base wins over both variables."""
    environ = {BASE: "http://collector:4318/", TRACES: "http://tempo:4318/custom"}
    found = otlp_endpoints(environ, "http/protobuf")
    assert (found["traces"].url, found["traces"].source) == ("http://tempo:4318/custom", TRACES)
    assert (found["metrics"].url, found["metrics"].source) == (
        "http://collector:4318/v1/metrics",
        BASE,
    )
    given = otlp_endpoints(environ, "http/protobuf", base="http://h:1", base_name="--otlp-endpoint")
    assert {e.url for e in given.values()} == {"http://h:1/v1/traces", "http://h:1/v1/metrics"}
    assert {e.source for e in given.values()} == {"--otlp-endpoint"}


def test_where_names_the_shared_base_or_each_url() -> None:
    """One base shared by both signals is said once; apart, each signal's URL is named."""
    shared = otlp_endpoints({BASE: "http://collector:4318"}, "http/protobuf")
    assert otlp_where(shared, "http/protobuf") == "http://collector:4318"
    apart = otlp_endpoints({TRACES: "http://a:1/t", METRICS: "http://b:2/m"}, "http/protobuf")
    assert otlp_where(apart, "http/protobuf") == "traces to http://a:1/t, metrics to http://b:2/m"
    grpc = otlp_endpoints({BASE: "http://collector:4317"}, "grpc")
    assert otlp_where(grpc, "grpc") == "http://collector:4317"


def test_a_bad_base_hidden_by_both_signal_variables_is_still_refused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Every endpoint variable is checked, also the base one no signal uses."""
    monkeypatch.setenv(BASE, "collector:4318")
    monkeypatch.setenv(TRACES, "http://tempo:4318/v1/traces")
    monkeypatch.setenv(METRICS, "http://mimir:4318/v1/metrics")
    message = f"{BASE}: {EXPECTED} 'collector:4318', {NOT_HTTP}"
    with pytest.raises(ConfigError) as raised:
        configure_sdk()
    assert str(raised.value) == message
    assert settings(os.environ)["errors"] == [message]


def test_the_demo_refuses_bad_signal_endpoints_before_the_run_one_line_each(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    """``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT=ftp://x`` and a bad metrics endpoint: exit 2, one
    line naming each variable, and no run (no event log written)."""
    monkeypatch.setenv(TRACES, "ftp://x")
    monkeypatch.setenv(METRICS, "mimir:9090")
    code, summary = _demo(tmp_path)
    err = capfd.readouterr().err
    assert code == 2
    assert summary == {}
    assert not (tmp_path / "run.jsonl").exists()
    assert err.splitlines() == [
        f"omnitrace demo: error: {TRACES}: {EXPECTED} 'ftp://x', {NOT_HTTP}",
        f"omnitrace demo: error: {METRICS}: {EXPECTED} 'mimir:9090', {NOT_HTTP}",
    ]


def test_the_replay_refuses_a_bad_signal_endpoint_before_reading(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    """``replay --otlp`` with a bad traces variable fails in one line, before the log."""
    monkeypatch.setenv(TRACES, "ftp://x")
    assert main(["replay", "--otlp", str(tmp_path / "absent.jsonl")]) == 2
    assert (
        capfd.readouterr().err
        == f"omnitrace replay: error: {TRACES}: {EXPECTED} 'ftp://x', {NOT_HTTP}\n"
    )


def test_the_demo_exports_to_signal_endpoints_alone_and_names_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    """With only the traces and metrics variables set (two receivers), the demo exports each
    signal to its own, says both URLs and reports them in its summary."""
    with OTLPReceiver() as traces, OTLPReceiver() as metrics:
        traces_url = f"{traces.endpoint}/v1/traces"
        metrics_url = f"{metrics.endpoint}/v1/metrics"
        monkeypatch.setenv(TRACES, traces_url)
        monkeypatch.setenv(METRICS, metrics_url)
        code, summary = _demo(tmp_path)
        err = capfd.readouterr().err
        assert code == 0
        assert traces.spans()
        assert not traces.metrics_requests
        assert metrics.metrics()
        assert not metrics.trace_requests
    assert (
        f"omnitrace: exporting over OTLP (http/protobuf): traces to {traces_url}, "
        f"metrics to {metrics_url}"
    ) in err.splitlines()
    assert summary["otlp_endpoints"] == {"traces": traces_url, "metrics": metrics_url}
    assert summary["otlp_endpoint"] == f"traces to {traces_url}, metrics to {metrics_url}"
    assert summary["otlp_error"] is None


def test_replay_says_the_signal_endpoints_it_delivers_to(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    """``replay --otlp`` under the signal variables names them, not localhost:4318, and its
    JSON carries them."""
    code, _ = _demo(tmp_path)
    assert code == 0
    capfd.readouterr()
    with OTLPReceiver() as receiver:
        traces_url = f"{receiver.endpoint}/v1/traces"
        metrics_url = f"{receiver.endpoint}/v1/metrics"
        monkeypatch.setenv(TRACES, traces_url)
        monkeypatch.setenv(METRICS, metrics_url)
        assert main(["replay", "--otlp", "--json", str(tmp_path / "run.jsonl")]) == 0
        out, err = capfd.readouterr()
        assert receiver.spans()
    assert err.splitlines() == [
        f"omnitrace: replaying into OTLP (http/protobuf): traces to {traces_url}, "
        f"metrics to {metrics_url}"
    ]
    data = json.loads(out)
    assert data["otlp_endpoints"] == {"traces": traces_url, "metrics": metrics_url}
    assert data["otlp_endpoint"] == receiver.endpoint
