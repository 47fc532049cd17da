"""``omnitrace receive``: a real exporter (the demo, replay) sends to it on loopback."""

from __future__ import annotations

import json
import os
import select
import signal
import socket
import subprocess
import sys
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest
import structlog
from opentelemetry.proto.collector.logs.v1.logs_service_pb2 import ExportLogsServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue
from opentelemetry.proto.logs.v1.logs_pb2 import LogRecord, ResourceLogs, ScopeLogs
from opentelemetry.proto.resource.v1.resource_pb2 import Resource

from omnitrace.cli import main
from omnitrace.receive import describe_request
from omnitrace.sinks.jsonl import read_events

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(autouse=True)
def _clean(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    for name in ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_PROTOCOL", "OTEL_SERVICE_NAME"):
        monkeypatch.delenv(name, raising=False)
    yield
    structlog.reset_defaults()


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


class Receiver:
    """``omnitrace receive ARGV`` as a child process, started and stopped by the test."""

    def __init__(self, *argv: str) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "omnitrace", "receive", *argv],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
        )
        self.first_line = self._line_of_stderr(timeout=30.0)

    def _line_of_stderr(self, timeout: float) -> str:
        assert self.proc.stderr is not None
        ready, _, _ = select.select([self.proc.stderr], [], [], timeout)
        assert ready, "omnitrace receive said nothing"
        return self.proc.stderr.readline()

    def stop(self, how: int = signal.SIGTERM) -> tuple[int, str, str]:
        self.proc.send_signal(how)
        try:
            out, err = self.proc.communicate(timeout=20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.communicate()
            pytest.fail("omnitrace receive did not stop within 20 s")
        return self.proc.returncode, out, self.first_line + err


def test_the_demo_exporting_to_receive_is_reported_request_by_request(tmp_path: Path) -> None:
    """The demo exports to `omnitrace receive --json` on a port the test picked: each
    request is a JSON line naming the service, spans by name as the event log has them
    (a capture span per GraphCaptured, a deferral per MemoryDeferred), the metrics; on
    SIGTERM it ends with the summary of it all, exit 0."""
    port = _free_port()
    receiver = Receiver("--port", str(port), "--json")
    assert f"listening for OTLP (http/protobuf) on http://127.0.0.1:{port}" in receiver.first_line
    log = tmp_path / "events.jsonl"
    env = {**os.environ, "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{port}"}
    argv = ["demo", "--no-tui", "--cpu", "--requests", "80", "--events-log", str(log)]
    demo = subprocess.run(
        [sys.executable, "-m", "omnitrace", *argv, "--log-file", str(tmp_path / "demo.log")],
        env={**env, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert demo.returncode == 0, demo.stderr
    code, out, err = receiver.stop(signal.SIGTERM)
    assert code == 0, err
    lines = [json.loads(line) for line in out.splitlines()]
    *requests, last = lines
    assert {r["signal"] for r in requests} == {"traces", "metrics"}
    assert all(r["services"] == ["omnitrace-demo"] for r in requests)
    kinds = Counter(type(e).__name__ for e in read_events(log))
    spans: Counter[str] = Counter()
    for r in requests:
        if r["signal"] == "traces":
            spans.update(r["names"])
    assert spans == {
        "omnitrace.graph.capture": kinds["GraphCaptured"],
        "omnitrace.graph.memory_deferral": kinds["MemoryDeferred"],
        # The demo times each request as the vLLM plugin does: a span per request, and one
        # phase span (prefill, which holds its encoder call, as in vLLM) inside it.
        "omnitrace.request": kinds["RequestTimed"],
        "omnitrace.request.phase": kinds["RequestTimed"],
    }
    metric_names = {n for r in requests if r["signal"] == "metrics" for n in r["names"]}
    assert {"omnitrace.encoder.graph.hits", "omnitrace.encoder.graph.misses"} <= metric_names
    summary = last["summary"]
    assert summary["spans"] == sum(spans.values())
    assert summary["names"]["traces"] == dict(spans)
    assert summary["requests"]["traces"] == sum(r["signal"] == "traces" for r in requests)
    assert summary["points"] == sum(r.get("points", 0) for r in requests) > 0


def test_replay_over_grpc_into_receive_prints_lines_and_a_summary_on_ctrl_c(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A recorded log replayed over gRPC to `omnitrace receive --protocol grpc`: one line
    per request, and on Ctrl-C (SIGINT) the summary with every span name and count."""
    pytest.importorskip("grpc", reason="the grpc extra (dev installs it)")
    log = tmp_path / "events.jsonl"
    code = main(["demo", "--no-tui", "--cpu", "--requests", "60", "--events-log", str(log)])
    assert code == 0
    capsys.readouterr()
    port = _free_port()
    receiver = Receiver("--protocol", "grpc", "--port", str(port))
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc")
        code = main(["replay", str(log), "--otlp-endpoint", f"http://127.0.0.1:{port}"])
    assert code == 0, capsys.readouterr().err
    # The export returned once the receiver had accepted it; what it still has to print,
    # it prints before its summary.
    status, out, err = receiver.stop(signal.SIGINT)
    assert status == 0, err
    kinds = Counter(type(e).__name__ for e in read_events(log))
    lines = out.splitlines()
    assert any(line.startswith("traces  from omnitrace-replay: ") for line in lines), out
    assert any(line.startswith("metrics from omnitrace-replay: ") for line in lines), out
    summary = next(i for i, line in enumerate(lines) if line.startswith("received in "))
    assert "from omnitrace-replay; traces: " in lines[summary]
    spans = {
        "omnitrace.graph.capture": kinds["GraphCaptured"],
        "omnitrace.graph.memory_deferral": kinds["MemoryDeferred"],
        "omnitrace.request": kinds["RequestTimed"],
        "omnitrace.request.phase": kinds["RequestTimed"],
    }
    listed = ", ".join(f"{name} {count}" for name, count in sorted(spans.items()) if count)
    assert lines[summary + 1] == f"  spans: {listed}"


def test_a_receiver_that_got_nothing_says_so_with_exit_1() -> None:
    """With no exporter, --duration ends the run: the summary counts zero requests, and one
    line says nothing arrived (exit 1), so a script checking its settings sees it."""
    proc = subprocess.run(
        [sys.executable, "-m", "omnitrace", "receive", "--port", "0", "--duration", "0.5"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert proc.returncode == 1
    assert proc.stdout.startswith("received in ")
    assert "traces: 0 requests; metrics: 0 requests; logs: 0 requests" in proc.stdout
    assert proc.stderr.splitlines()[-1] == (
        "omnitrace receive: error: nothing arrived: no exporter sent here"
    )


def test_a_port_in_use_is_one_line_with_exit_1(capsys: pytest.CaptureFixture[str]) -> None:
    """A port another process listens on is one line naming the address, exit 1."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        code = main(["receive", "--port", str(port), "--duration", "1"])
    err = capsys.readouterr().err
    assert code == 1
    assert err.splitlines() == [
        f"omnitrace receive: error: cannot listen on 127.0.0.1:{port}: Address already in use"
    ]


def test_log_records_are_named_by_event_name_else_body() -> None:
    """A logs request is counted per record and named by its event name, else its body,
    with control characters in a name shown escaped."""

    def record(body: str, event_name: str = "") -> LogRecord:
        made = LogRecord(body=AnyValue(string_value=body))
        if event_name and hasattr(made, "event_name"):
            made.event_name = event_name
        return made

    service = KeyValue(key="service.name", value=AnyValue(string_value="svc"))
    request = ExportLogsServiceRequest(
        resource_logs=[
            ResourceLogs(
                resource=Resource(attributes=[service]),
                scope_logs=[
                    ScopeLogs(log_records=[record("capture_failed"), record("a\x1b[31mb")])
                ],
            )
        ]
    )
    received = describe_request("logs", request)
    assert received.items == 2
    assert received.services == ("svc",)
    assert received.line() == "logs    from svc: 2 log records: capture_failed, a\\x1b[31mb"
