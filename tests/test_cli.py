"""The ``omnitrace`` command line: demo, top and replay, run for real."""

from __future__ import annotations

import http.server
import importlib.util
import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import structlog

from omnitrace import derive_stats
from omnitrace.cli import main
from omnitrace.demo.run import BURST_AT
from omnitrace.demo.traffic import TrafficMix
from omnitrace.sinks.jsonl import JsonlSink, read_events

HAS_OTEL_SINK = importlib.util.find_spec("omnitrace.sinks.otel") is not None
REQUESTS = 100


@pytest.fixture(autouse=True)
def _clean_logging(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.delenv("OTEL_EXPORTER_OTLP_ENDPOINT", raising=False)
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    yield
    structlog.reset_defaults()


def _demo(tmp_path: Path, *extra: str, name: str = "run") -> tuple[int, dict[str, Any], Path]:
    log = tmp_path / f"{name}.jsonl"
    summary = tmp_path / f"{name}.json"
    code = main(
        [
            "demo",
            "--no-tui",
            "--cpu",
            "--requests",
            str(REQUESTS),
            "--events-log",
            str(log),
            "--json-summary",
            str(summary),
            *extra,
        ]
    )
    data = json.loads(summary.read_text()) if summary.exists() else {}
    return code, data, log


def _without_calls(encoders: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {name: {k: v for k, v in s.items() if k != "calls"} for name, s in encoders.items()}


@pytest.fixture(scope="module")
def recorded(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], Path]:
    """One demo run shared by the tests that only read its outputs."""
    tmp_path = tmp_path_factory.mktemp("demo")
    try:
        code, summary, log = _demo(tmp_path)
    finally:
        structlog.reset_defaults()
    assert code == 0
    return summary, log


def test_demo_summary_matches_stats_derived_from_its_event_log(
    recorded: tuple[dict[str, Any], Path],
) -> None:
    """The demo's final stats equal derive_stats over the JSONL log it wrote."""
    summary, log = recorded
    assert _without_calls(summary["encoders"]) == derive_stats(read_events(log))
    calls = sum(s["calls"] for s in summary["encoders"].values())
    assert calls + summary["streaming_eager_calls"] == summary["requests"] == REQUESTS
    assert summary["bus"]["dropped"] == 0
    assert summary["backend"] == "simulated"


def test_demo_traffic_exercises_hits_warmup_and_eager_streaming(
    recorded: tuple[dict[str, Any], Path],
) -> None:
    """The default mix yields graph hits, warm-up misses and eager streaming calls."""
    summary, _ = recorded
    vision, audio = summary["encoders"]["vision"], summary["encoders"]["audio"]
    assert min(vision["graph_hits"], audio["graph_hits"]) > 0
    assert min(vision["warmup_misses"], audio["warmup_misses"]) > 0
    assert 0 < vision["num_graphs"] <= summary["max_graphs"]["vision"]
    mix = TrafficMix(0)
    requests = [mix.next(burst=i >= BURST_AT * REQUESTS) for i in range(REQUESTS)]
    streaming = sum(r.kind == "streaming" for r in requests)
    assert summary["streaming_eager_calls"] == streaming > 0


def test_demo_prints_the_stats_table_and_says_where_the_log_went(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """stdout has one table row per encoder with its numbers; stderr names the log path."""
    code, summary, log = _demo(tmp_path)
    out, err = capsys.readouterr()
    assert code == 0
    for name in ("vision", "audio"):
        s = summary["encoders"][name]
        row = next(line for line in out.splitlines() if line.startswith(f"│ {name} "))
        cells = [cell.strip() for cell in row.strip("│").split("│")]
        assert cells[1:4] == [str(s["calls"]), str(s["graph_hits"]), f"{s['hit_rate'] * 100:.1f} %"]
        assert cells[8] == f"{s['num_graphs']}/4"
    assert f"streaming audio {summary['streaming_eager_calls']} eager calls" in out
    assert "no CUDA device" in err or "simulated" in err
    assert f"event log: {log.resolve()}" in err


def test_demo_is_deterministic_for_a_seed(tmp_path: Path) -> None:
    """Two runs with one seed give the same stats; another seed gives other traffic."""
    _, first, _ = _demo(tmp_path, "--seed", "7", name="a")
    _, second, _ = _demo(tmp_path, "--seed", "7", name="b")
    assert first["encoders"] == second["encoders"]
    mix_a = [TrafficMix(7).next() for _ in range(50)]
    mix_b = [TrafficMix(8).next() for _ in range(50)]
    assert mix_a != mix_b


def test_late_burst_hits_the_graph_cap(tmp_path: Path) -> None:
    """With a cap of 2 the burst of new shapes produces capacity misses."""
    code, _, log = _demo(tmp_path, "--hf-overrides", '{"encoder_cuda_graph_max_graphs": 2}')
    assert code == 0
    stats = derive_stats(read_events(log))
    assert stats["vision"]["num_graphs"] == 2
    assert stats["vision"]["capacity_misses"] + stats["audio"]["capacity_misses"] > 0


def test_enforce_eager_makes_every_call_ineligible(tmp_path: Path) -> None:
    """--enforce-eager disables graphs: no hits, every adapter call is an ineligible miss."""
    code, summary, _ = _demo(tmp_path, "--enforce-eager")
    assert code == 0
    for stats in summary["encoders"].values():
        assert stats["graph_hits"] == 0
        assert stats["ineligible_misses"] == stats["calls"] > 0


def test_injected_capture_failure_is_logged_at_error_and_counted(tmp_path: Path) -> None:
    """--fail-capture makes vision terminal: one capture failure, an error log line."""
    log_file = tmp_path / "logs" / "omnitrace.log"
    code, summary, log = _demo(tmp_path, "--fail-capture", "vision", "--log-file", str(log_file))
    assert code == 0
    assert summary["encoders"]["vision"]["capture_failures"] == 1
    assert summary["calls_after_failure"] > 0
    lines = [json.loads(line) for line in log_file.read_text().splitlines()]
    failed = [line for line in lines if line["event"] == "capture_failed"]
    assert [(f["level"], f["encoder"], f["error_type"]) for f in failed] == [
        ("error", "vision", "RuntimeError")
    ]
    assert derive_stats(read_events(log))["vision"]["capture_failures"] == 1


@pytest.mark.parametrize(
    ("overrides", "named"),
    [
        ('{"encoder_cuda_graph_max_graph": 4}', "encoder_cuda_graph_max_graph"),
        ('{"encoder_cuda_graph_min_capture_calls": 1}', "encoder_cuda_graph_min_capture_calls"),
        ("{not json", "hf_overrides"),
    ],
)
def test_bad_hf_overrides_is_a_one_line_error_with_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], overrides: str, named: str
) -> None:
    """A bad --hf-overrides exits 2 with one stderr line naming the key, and runs nothing."""
    code, _, log = _demo(tmp_path, "--hf-overrides", overrides)
    out, err = capsys.readouterr()
    assert code == 2
    (line,) = err.strip().splitlines()
    assert line.startswith(f"omnitrace demo: error: --hf-overrides: {named}")
    assert not log.exists()
    assert out == ""


def test_top_shows_the_stats_of_a_finished_log(
    recorded: tuple[dict[str, Any], Path], capsys: pytest.CaptureFixture[str]
) -> None:
    """`omnitrace top LOG` prints one frame with each encoder's hit rate and cap, and exits."""
    summary, log = recorded
    assert main(["top", str(log)]) == 0
    out = capsys.readouterr().out
    for name in ("vision", "audio"):
        s = summary["encoders"][name]
        assert f"╭─ {name} " in out
        assert f"hits {s['graph_hits']} / calls {s['calls']}" in out
    assert f"graphs   {summary['encoders']['vision']['num_graphs']} / 4" in out


def test_top_follow_sees_events_written_by_another_writer(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`top --follow` picks up lines appended while it runs, per worker rank."""
    recorded_events = list(read_events(_demo(tmp_path)[2]))
    capsys.readouterr()
    path = tmp_path / "live.jsonl"
    path.touch()

    def write(rank: str) -> None:
        time.sleep(0.3)
        with pytest.MonkeyPatch.context() as env:
            env.setenv("RANK", rank)
            sink = JsonlSink(path)
        try:
            for start in range(0, len(recorded_events), 20):
                sink.handle(recorded_events[start : start + 20])
                time.sleep(0.02)
        finally:
            sink.close()

    writers = [threading.Thread(target=write, args=(rank,)) for rank in ("0", "1")]
    for writer in writers:
        writer.start()
    try:
        code = main(["top", "--follow", "--no-tui", "--duration", "2.5", str(path)])
    finally:
        for writer in writers:
            writer.join()
    out = capsys.readouterr().out
    assert code == 0
    expected = derive_stats(recorded_events)["vision"]
    calls = expected["graph_hits"] + expected["graph_misses"]
    assert out.count(f"hits {expected['graph_hits']} / calls {calls}") == 2
    assert "vision · rank 0 · pid" in out
    assert "vision · rank 1 · pid" in out


def test_top_reports_a_missing_log(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A log path that does not exist is a one-line error with exit 2."""
    assert main(["top", str(tmp_path / "nope.jsonl")]) == 2
    assert "omnitrace top: error: no event log at" in capsys.readouterr().err


def test_replay_rebuilds_the_recorded_stats(
    recorded: tuple[dict[str, Any], Path], capsys: pytest.CaptureFixture[str]
) -> None:
    """`omnitrace replay LOG` re-emits every event and prints the recorded stats."""
    summary, log = recorded
    assert main(["replay", str(log)]) == 0
    out = capsys.readouterr().out
    events = len(list(read_events(log)))
    assert f"replayed {events} events" in out
    for name in ("vision", "audio"):
        s = summary["encoders"][name]
        row = next(line for line in out.splitlines() if line.startswith(f"│ {name} "))
        cells = [cell.strip() for cell in row.strip("│").split("│")]
        assert cells[1:3] == [str(s["calls"]), str(s["graph_hits"])]
        assert cells[9] == str(s["capture_failures"])


class _Collector(http.server.ThreadingHTTPServer):
    """A loopback OTLP/HTTP endpoint that accepts everything and remembers the paths."""

    def __init__(self) -> None:
        self.paths: list[str] = []
        super().__init__(("127.0.0.1", 0), _CollectorHandler)

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


class _CollectorHandler(http.server.BaseHTTPRequestHandler):
    server: _Collector

    def do_POST(self) -> None:
        length = int(self.headers.get("Content-Length", "0"))
        self.rfile.read(length)
        self.server.paths.append(self.path)
        self.send_response(200)
        self.send_header("Content-Type", "application/x-protobuf")
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, format: str, *args: Any) -> None:
        pass


@pytest.fixture
def collector() -> Iterator[_Collector]:
    server = _Collector()
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


@pytest.mark.skipif(not HAS_OTEL_SINK, reason="omnitrace.sinks.otel is not in this tree yet")
def test_demo_exports_to_otlp_when_the_endpoint_is_set(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, collector: _Collector
) -> None:
    """With OTEL_EXPORTER_OTLP_ENDPOINT set, the demo posts traces and metrics to it."""
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", collector.endpoint)
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf")
    code, summary, _ = _demo(tmp_path)
    assert code == 0
    assert summary["otlp_endpoint"] == collector.endpoint
    assert {"/v1/traces", "/v1/metrics"} <= set(collector.paths)


@pytest.mark.skipif(not HAS_OTEL_SINK, reason="omnitrace.sinks.otel is not in this tree yet")
def test_replay_into_otlp_posts_the_recorded_captures(
    recorded: tuple[dict[str, Any], Path], collector: _Collector
) -> None:
    """`replay --otlp-endpoint` exports the recorded run's spans and metrics."""
    _, log = recorded
    assert main(["replay", str(log), "--otlp-endpoint", collector.endpoint]) == 0
    assert {"/v1/traces", "/v1/metrics"} <= set(collector.paths)
