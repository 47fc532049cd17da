"""The shipped alert rules and dashboard queries, evaluated by a real Prometheus server.

Debian's ``prometheus`` package (installed by .ci/tiers/ops.sh) runs on loopback with the
rule files from deploy/otel/ and a scrape job for ``omnitrace demo --prometheus-port``;
everything is checked through Prometheus's HTTP API.
"""

from __future__ import annotations

import json
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from omnitrace.requests import PHASES
from omnitrace.sinks.names import ATTR

from ._support import DASHBOARDS_DIR, DEPLOY_DIR, dashboard_queries, prom_label

ENCODER = prom_label(ATTR.ENCODER)
REQUEST_PHASE = prom_label(ATTR.REQUEST_PHASE)
#: Scrape and rule evaluation interval of the test server, seconds.
INTERVAL = 1.0
#: Grafana's variables as the test fills them in: rate windows span several scrapes.
VARIABLES = {"$__rate_interval": "10s", "$__interval": "1s", "$encoder": ".*"}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _prometheus_binary() -> str:
    path = shutil.which("prometheus")
    if path is None:
        pytest.skip("the prometheus server is not installed (.ci/tiers/ops.sh installs it)")
    return path


def _wait(predicate: Callable[[], Any], timeout: float, what: str) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


class Prometheus:
    """A Prometheus server on loopback, scraping the given jobs, with the shipped rules."""

    def __init__(self, tmp_path: Path, jobs: dict[str, int]) -> None:
        self.port = _free_port()
        config = {
            "global": {
                "scrape_interval": f"{INTERVAL:g}s",
                "evaluation_interval": f"{INTERVAL:g}s",
            },
            "rule_files": [str(p) for p in sorted((DEPLOY_DIR / "prometheus/rules").glob("*.yml"))],
            "scrape_configs": [
                {"job_name": job, "static_configs": [{"targets": [f"127.0.0.1:{port}"]}]}
                for job, port in jobs.items()
            ],
        }
        path = tmp_path / "prometheus.yml"
        path.write_text(yaml.safe_dump(config))
        self.log = (tmp_path / "prometheus.log").open("w")
        self.process = subprocess.Popen(
            [
                _prometheus_binary(),
                f"--config.file={path}",
                f"--storage.tsdb.path={tmp_path / 'data'}",
                f"--web.listen-address=127.0.0.1:{self.port}",
            ],
            stdout=self.log,
            stderr=subprocess.STDOUT,
        )
        _wait(self._ready, 30, "Prometheus to be ready")

    def _ready(self) -> bool:
        assert self.process.poll() is None, "prometheus exited; see prometheus.log"
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/-/ready", timeout=1) as r:
                return bool(r.status == 200)
        except OSError:
            return False

    def api(self, path: str, **params: str) -> Any:
        url = f"http://127.0.0.1:{self.port}/api/v1/{path}"
        if params:
            url += "?" + urllib.parse.urlencode(params)
        with urllib.request.urlopen(url, timeout=5) as response:
            body = json.load(response)
        assert body["status"] == "success", body
        return body["data"]

    def query(self, expr: str) -> list[dict[str, Any]]:
        return list(self.api("query", query=expr)["result"])

    def alerts(self, name: str) -> list[dict[str, Any]]:
        return [a for a in self.api("alerts")["alerts"] if a["labels"]["alertname"] == name]

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self.log.close()


class Demo:
    """``omnitrace demo`` in a child process, serving its metrics on a Prometheus port."""

    def __init__(self, tmp_path: Path, port: int, *extra: str) -> None:
        self.port = port
        self.process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "omnitrace",
                "demo",
                "--no-tui",
                "--cpu",
                "--requests",
                "0",
                "--duration",
                "120",
                "--rate",
                "40",
                "--events-log",
                str(tmp_path / f"events-{port}.jsonl"),
                "--prometheus-port",
                str(port),
                *extra,
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        _wait(self._serving, 60, "the demo's /metrics")

    def _serving(self) -> bool:
        assert self.process.poll() is None, "the demo exited early"
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/metrics", timeout=1) as r:
                return b"omnitrace_encoder_graph_hits_total" in r.read()
        except OSError:
            return False

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGINT)  # the demo's own Ctrl-C path
            try:
                self.process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


@pytest.fixture
def stack(tmp_path: Path) -> Iterator[tuple[Prometheus, dict[str, int]]]:
    _prometheus_binary()
    ports = {"healthy": _free_port(), "failing": _free_port()}
    server = Prometheus(tmp_path, ports)
    try:
        yield server, ports
    finally:
        server.stop()


def _dashboard_queries() -> list[tuple[str, str]]:
    found = []
    for path in sorted(DASHBOARDS_DIR.glob("*.json")):
        for query in dashboard_queries(json.loads(path.read_text())):
            if query.language == "promql" and query.where.startswith("panel"):
                expr = query.expr
                for name, value in VARIABLES.items():
                    expr = expr.replace(name, value)
                found.append((query.where, expr))
    assert len(found) >= 8
    return found


def test_dashboards_and_alerts_work_against_a_real_prometheus(
    tmp_path: Path, stack: tuple[Prometheus, dict[str, int]]
) -> None:
    """Dashboard queries return both encoders; healthy traffic raises no alert; a capture
    failure fires OmnitraceCaptureFailed within two evaluation intervals of its scrape."""
    server, ports = stack
    # Healthy traffic: room for every shape and no memory floor, so no capacity or memory
    # misses; the run is long enough that its late burst of new shapes never starts here.
    healthy = Demo(
        tmp_path,
        ports["healthy"],
        "--sim-free-mib",
        "100000",
        "--hf-overrides",
        # Device timing on, so the device-time panel has data.
        '{"encoder_cuda_graph_max_graphs": 64, "encoder_cuda_graph_device_timing": true}',
    )
    try:
        for where, expr in _dashboard_queries():
            result = _wait(lambda e=expr: server.query(e), 30, f"series for {where}")
            if ENCODER in result[0]["metric"]:
                encoders = {series["metric"][ENCODER] for series in result}
                assert encoders == {"vision", "audio"}, (where, result)
            elif REQUEST_PHASE in result[0]["metric"]:
                # The demo times each request as the vLLM plugin does: its encoder step.
                phases = {series["metric"][REQUEST_PHASE] for series in result}
                assert phases == set(PHASES), (where, result)
            else:
                assert {series["metric"]["omnitrace_sink"] for series in result}, where
        # The rules have been evaluated several times over this data, all healthy.
        time.sleep(4 * INTERVAL)
        rules = {
            rule["name"]: rule for group in server.api("rules")["groups"] for rule in group["rules"]
        }
        assert set(rules) == {
            "OmnitraceCaptureFailed",
            "OmnitraceHitRateLow",
            "OmnitraceCapacityMisses",
            "OmnitraceRequestPhaseDominates",
        }
        for name, rule in rules.items():
            assert rule["health"] == "ok", (name, rule.get("lastError"))
            assert rule["state"] == "inactive", (name, rule["alerts"])
            assert server.query(rule["query"]) == [], name
        # The hit rate those rules read is there and high, so "inactive" is not for lack of data.
        (hit_rate,) = [e for w, e in _dashboard_queries() if w.startswith("panel 'Hit rate")]
        rates = server.query(hit_rate)
        assert {r["metric"][ENCODER] for r in rates} == {"vision", "audio"}
        assert min(float(r["value"][1]) for r in rates) > 0.5
    finally:
        healthy.stop()

    failing = Demo(tmp_path, ports["failing"], "--fail-capture", "vision")
    try:
        failed = f'omnitrace_encoder_graph_capture_failures_total{{{ENCODER}="vision"}} > 0'
        _wait(lambda: server.query(failed), 30, "the scraped capture failure")
        scraped = time.monotonic()
        firing = _wait(
            lambda: [a for a in server.alerts("OmnitraceCaptureFailed") if a["state"] == "firing"],
            10,
            "OmnitraceCaptureFailed to fire",
        )
        assert time.monotonic() - scraped <= 2 * INTERVAL
        assert [a["labels"][ENCODER] for a in firing] == ["vision"]
        assert firing[0]["labels"]["severity"] == "critical"
        assert server.alerts("OmnitraceCapacityMisses") == []
    finally:
        failing.stop()
