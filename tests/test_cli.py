"""The ``omnitrace`` command line: demo, top and replay, run for real."""

from __future__ import annotations

import fcntl
import http.server
import importlib.util
import json
import os
import pty
import re
import select
import signal
import socket
import struct
import subprocess
import sys
import termios
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import structlog

import omnitrace
from omnitrace import derive_coverage, derive_stats
from omnitrace.cli import main
from omnitrace.config import DEFAULT_MAX_GRAPHS
from omnitrace.demo.run import BURST_AT
from omnitrace.demo.traffic import TrafficMix
from omnitrace.events import GraphCaptured, GraphMissed, GraphReplayed, MissReason, Phase
from omnitrace.otlp_receiver import OTLPReceiver, attributes
from omnitrace.sinks.jsonl import JsonlSink, read_events
from omnitrace.testing import sig

ROOT = Path(__file__).resolve().parent.parent
HAS_OTEL_SINK = importlib.util.find_spec("omnitrace.sinks.otel") is not None
REQUESTS = 100


@pytest.fixture(autouse=True)
def _clean_logging(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    for name in ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_SERVICE_NAME", "OTEL_RESOURCE_ATTRIBUTES"):
        monkeypatch.delenv(name, raising=False)
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


def _stats_of(
    replayed: dict[str, dict[str, Any]], encoders: dict[str, dict[str, Any]]
) -> dict[str, dict[str, Any]]:
    """The fields of the demo summary's ``encoders`` (and ``max_graphs``) in ``replayed``."""
    return {
        name: {key: entry[key] for key in (*encoders[name], "max_graphs")}
        for name, entry in replayed.items()
    }


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


def _stats_rows(out: str) -> dict[str, dict[str, str]]:
    """The stats table's rows by encoder, each cell by its column's heading (so a column
    added for a new miss reason moves nothing the tests read)."""
    lines = out.splitlines()
    header = next(line for line in lines if line.startswith("┃ encoder "))
    headings = [cell.strip() for cell in header.strip("┃").split("┃")]
    rows = {}
    for line in lines:
        if line.startswith("│ "):
            cells = [cell.strip() for cell in line.strip("│").split("│")]
            rows[cells[0]] = dict(zip(headings, cells, strict=True))
    return rows


def test_demo_prints_the_stats_table_and_says_where_the_log_went(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """stdout has one table row per encoder with its numbers; stderr names the log path."""
    code, summary, log = _demo(tmp_path)
    out, err = capsys.readouterr()
    assert code == 0
    rows = _stats_rows(out)
    for name in ("vision", "audio"):
        s = summary["encoders"][name]
        cells = rows[name]
        assert [cells["calls"], cells["hits"], cells["hit rate"]] == [
            str(s["calls"]),
            str(s["graph_hits"]),
            f"{s['hit_rate'] * 100:.1f} %",
        ]
        assert cells["graphs"] == f"{s['num_graphs']}/{DEFAULT_MAX_GRAPHS}"
    assert f"streaming audio {summary['streaming_eager_calls']} eager calls" in out
    assert "no CUDA device" in err or "simulated" in err
    assert f"event log: {log.resolve()}" in err


def test_demo_profiling_runs_come_first_in_the_profiling_phase(tmp_path: Path) -> None:
    """--profiling-runs 2 calls both encoders twice with maximum-size dummies before the
    traffic, in the profiling phase: the event log says so, each encoder captures its dummy
    shape then, and serving never replays it."""
    code, summary, log = _demo(tmp_path, "--profiling-runs", "2")
    assert code == 0
    events = list(read_events(log))
    assert _without_calls(summary["encoders"]) == derive_stats(events)
    profiling = [e for e in events if e.phase is Phase.PROFILING]
    first_serving = next(i for i, e in enumerate(events) if e.phase is Phase.SERVING)
    assert all(e.phase is Phase.PROFILING for e in events[:first_serving])
    assert len(profiling) == first_serving
    for name, coverage in derive_coverage(events).items():
        calls = coverage.in_phase(Phase.PROFILING)
        assert (calls.calls, calls.captures) == (2, 1)
        (dummy,) = [r for r in coverage.captured if r.capture_phase is Phase.PROFILING]
        assert dummy.in_phase(Phase.SERVING).calls == 0, name
    shapes = {e.adapter: e.signature.inputs[0].shape for e in profiling}  # type: ignore[union-attr]
    assert shapes == {"vision": (10, 1024, 64), "audio": (1, 80, 3000)}


def test_demo_one_profiling_run_captures_nothing_and_a_second_takes_a_slot(
    tmp_path: Path,
) -> None:
    """One profiling run, as vLLM makes per worker start, is a single warm-up miss per
    encoder and captures nothing; serving hits as without profiling. A second run captures
    the dummy shape, which takes a slot serving never replays: no more hits than with one."""
    _, plain, _ = _demo(tmp_path, name="plain")
    code, one, log = _demo(tmp_path, "--profiling-runs", "1", name="one")
    assert code == 0
    _, two, _ = _demo(tmp_path, "--profiling-runs", "2", name="two")
    for name, coverage in derive_coverage(read_events(log)).items():
        calls = coverage.in_phase(Phase.PROFILING)
        assert (calls.calls, calls.captures) == (1, 0), name
    for name, stats in plain["encoders"].items():
        assert one["encoders"][name]["graph_hits"] == stats["graph_hits"], name
        assert two["encoders"][name]["graph_hits"] <= one["encoders"][name]["graph_hits"], name


def test_demo_profiling_runs_with_skip_profiling_stay_out_of_admission(tmp_path: Path) -> None:
    """With encoder_cuda_graph_skip_profiling the profiling calls are ineligible misses
    (detail profiling) and serving runs exactly as without profiling."""
    skip = '{"encoder_cuda_graph_skip_profiling": true}'
    code, summary, log = _demo(
        tmp_path, "--profiling-runs", "2", "--hf-overrides", skip, name="skip"
    )
    assert code == 0
    _, plain, _ = _demo(tmp_path, name="plain")
    events = list(read_events(log))
    profiling = [e for e in events if e.phase is Phase.PROFILING]
    assert {(type(e).__name__, e.detail) for e in profiling} == {("GraphMissed", "profiling")}  # type: ignore[union-attr]
    assert len(profiling) == 4
    for name, stats in summary["encoders"].items():
        assert stats["graph_hits"] == plain["encoders"][name]["graph_hits"]
        assert stats["num_graphs"] == plain["encoders"][name]["num_graphs"]
        assert stats["ineligible_misses"] == plain["encoders"][name]["ineligible_misses"] + 2


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


def test_injected_capture_failure_is_logged_counted_and_fails_the_run(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """--fail-capture: exit 1, one capture failure, an error log line, 'terminal' in the table."""
    log_file = tmp_path / "logs" / "omnitrace.log"
    code, summary, log = _demo(tmp_path, "--fail-capture", "vision", "--log-file", str(log_file))
    out = capsys.readouterr().out
    assert code == 1
    rows = _stats_rows(out)
    assert [rows["vision"]["capture failures"], rows["vision"]["state"]] == ["1", "terminal"]
    assert [rows["audio"]["capture failures"], rows["audio"]["state"]] == ["0", "ok"]
    assert "capture failed: vision is terminal;" in out
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
    vision = summary["encoders"]["vision"]
    assert f"graphs   {vision['num_graphs']} / {DEFAULT_MAX_GRAPHS}" in out


def test_top_follow_sees_events_written_by_another_writer(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`top --follow` picks up lines appended while it runs, per worker rank."""
    recorded_events = list(read_events(_demo(tmp_path)[2]))
    capsys.readouterr()
    path = tmp_path / "live.jsonl"
    path.touch()
    # One writer at a time sets RANK: two interleaved contexts would restore each other's
    # value, and leave RANK set for the tests after this one.
    rank_env = threading.Lock()

    def write(rank: str) -> None:
        time.sleep(0.3)
        with rank_env, pytest.MonkeyPatch.context() as env:
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
    rows = _stats_rows(out)
    for name in ("vision", "audio"):
        s = summary["encoders"][name]
        cells = rows[name]
        assert [cells["calls"], cells["hits"]] == [str(s["calls"]), str(s["graph_hits"])]
        assert cells["capture failures"] == str(s["capture_failures"])


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


# -- replay --follow: the exporter beside the server ---------------------------------------


def _write_slowly(path: Path, log: Path, delay: float = 0.3) -> None:
    """Append the lines of ``log`` to ``path`` as its writer did: in batches, over time."""
    time.sleep(delay)
    lines = log.read_bytes().splitlines(keepends=True)
    with path.open("ab") as out:
        for start in range(0, len(lines), 25):
            out.write(b"".join(lines[start : start + 25]))
            out.flush()
            time.sleep(0.01)


def _hits(receiver: OTLPReceiver) -> dict[str, int]:
    """The latest cumulative graph-hit counts the receiver got, by encoder."""
    metric = receiver.latest_metric("omnitrace.encoder.graph.hits")
    if metric is None:
        return {}
    return {
        attributes(point.attributes)["omnitrace.encoder"]: point.as_int
        for point in metric.sum.data_points
    }


def test_replay_follow_relays_what_a_writer_appends_into_otlp(
    recorded: tuple[dict[str, Any], Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A follow started before the log exists exports every appended event, then exits 0."""
    summary, log = recorded
    events = list(read_events(log))
    path = tmp_path / "live.jsonl"
    writer = threading.Thread(target=_write_slowly, args=(path, log))
    with OTLPReceiver() as receiver:
        writer.start()
        try:
            follow = ["replay", "--follow", "--duration", "2.5", "--json", str(path)]
            code = main([*follow, "--otlp-endpoint", receiver.endpoint])
        finally:
            writer.join()
        out, err = capsys.readouterr()
        assert code == 0, err
        assert f"waiting for {path} to appear" in err
        data = json.loads(out)
        assert data["events"] == len(events)
        assert _stats_of(data["encoders"], summary["encoders"]) == {
            name: {**s, "max_graphs": DEFAULT_MAX_GRAPHS} for name, s in summary["encoders"].items()
        }
        # The final export at the end of the follow carries the whole run.
        captures = sum(s["num_graphs"] for s in summary["encoders"].values())
        assert len(receiver.spans("omnitrace.graph.capture")) == captures
        assert _hits(receiver) == {name: s["graph_hits"] for name, s in summary["encoders"].items()}


def test_replay_follow_serves_prometheus_while_it_follows(
    recorded: tuple[dict[str, Any], Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """--prometheus-port serves the relayed counters while the follow runs."""
    import urllib.request

    summary, log = recorded
    path = tmp_path / "live.jsonl"
    _write_slowly(path, log, delay=0)
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    scraped: list[str] = []
    hits = summary["encoders"]["vision"]["graph_hits"]
    line = re.compile(
        r'^omnitrace_encoder_graph_hits_total\{omnitrace_encoder="vision"[^}]*\} '
        + re.escape(str(float(hits)))
        + "$",
        re.MULTILINE,
    )

    following = threading.Event()

    def scrape() -> None:
        # Until the follow ends: a slow machine may take a while to start serving.
        while not following.is_set():
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=1) as r:
                    text = r.read().decode()
            except OSError:
                text = ""
            if line.search(text):
                scraped.append(text)
                return
            time.sleep(0.1)

    scraper = threading.Thread(target=scrape)
    scraper.start()
    try:
        code = main(
            ["replay", "--follow", "--duration", "3.5", "--prometheus-port", str(port), str(path)]
        )
    finally:
        following.set()
        scraper.join()
    err = capsys.readouterr().err
    assert code == 0, err
    assert f"serving Prometheus metrics at http://127.0.0.1:{port}/metrics" in err
    assert scraped, f"no scrape of {port} matched {line.pattern!r}"


@pytest.mark.skipif(not hasattr(signal, "SIGTERM"), reason="needs POSIX signals")
def test_replay_follow_ends_on_sigterm_with_a_final_export(
    recorded: tuple[dict[str, Any], Path], tmp_path: Path
) -> None:
    """A sidecar told to stop (SIGTERM) exports what it relayed and exits 0."""
    summary, log = recorded
    path = tmp_path / "live.jsonl"
    _write_slowly(path, log, delay=0)
    with OTLPReceiver() as receiver:
        process = subprocess.Popen(
            [
                *(sys.executable, "-m", "omnitrace", "replay", "--follow", str(path)),
                "--otlp-endpoint",
                receiver.endpoint,
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env={**os.environ, "OTEL_METRIC_EXPORT_INTERVAL": "600000"},
        )
        try:
            assert process.stderr is not None
            assert "relaying into OTLP" in process.stderr.readline()
            time.sleep(1.5)  # a few polls: the whole log is relayed
            process.send_signal(signal.SIGTERM)
            out, err = process.communicate(timeout=30)
        finally:
            if process.poll() is None:
                process.kill()
                process.wait()
        assert process.returncode == 0, err
        assert f"replayed {len(list(read_events(log)))} events" in out
        # Metrics are exported only at shutdown here (the interval is ten minutes).
        assert _hits(receiver) == {name: s["graph_hits"] for name, s in summary["encoders"].items()}


@pytest.mark.skipif(not hasattr(signal, "SIGINT"), reason="needs POSIX signals")
def test_replay_follow_stopped_by_sigint_with_a_failed_export_prints_the_stats(
    recorded: tuple[dict[str, Any], Path], tmp_path: Path
) -> None:
    """`replay --follow` into a refused endpoint, ended by Ctrl-C (SIGINT): the stats table
    of what it relayed, then one line saying the export failed, exit 1."""
    _, log = recorded
    path = tmp_path / "live.jsonl"
    _write_slowly(path, log, delay=0)
    events = len(list(read_events(log)))
    endpoint = "http://127.0.0.1:1"  # port 1: refused
    process = subprocess.Popen(
        [
            *(sys.executable, "-m", "omnitrace", "replay", "--follow", str(path)),
            *("--otlp-endpoint", endpoint),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "OTEL_METRIC_EXPORT_INTERVAL": "600000"},
    )
    try:
        assert process.stderr is not None
        assert process.stderr.readline() == (
            f"omnitrace: relaying into OTLP (http/protobuf): traces to {endpoint}/v1/traces, "
            f"metrics to {endpoint}/v1/metrics\n"
        )
        time.sleep(1.5)  # a few polls: the whole log is relayed
        process.send_signal(signal.SIGINT)
        out, err = process.communicate(timeout=30)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    assert process.returncode == 1, err
    assert out.startswith(f"replayed {events} events")
    assert err.splitlines()[-1].startswith(
        f"omnitrace replay: error: OTLP export to {endpoint} (http/protobuf) failed: "
    )
    assert err.splitlines()[-1].endswith(f"; {events} events read")


def test_replay_follow_until_exit_ends_when_the_writer_is_gone_even_unreaped(
    recorded: tuple[dict[str, Any], Path], capsys: pytest.CaptureFixture[str]
) -> None:
    """--until-exit PID ends the follow once PID exited, also while it is still a zombie."""
    _, log = recorded
    writer = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(0.5)"])
    try:
        start = time.monotonic()
        follow = ["replay", "--follow", "--json", "--duration", "30", "--prometheus-port", "0"]
        # Nobody reaps the writer until the follow ended: it is a zombie meanwhile.
        code = main([*follow, "--until-exit", str(writer.pid), str(log)])
        took = time.monotonic() - start
    finally:
        writer.kill()
        writer.wait()
    assert code == 0, capsys.readouterr().err
    assert took < 15
    assert json.loads(capsys.readouterr().out)["events"] == len(list(read_events(log)))


def _follow_process(log: Path, *extra: str, stdin: Any) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "omnitrace", "replay", "--follow", "--json", str(log), *extra],
        stdin=stdin,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def test_replay_follow_until_stdin_closes_exports_when_its_parent_closes_the_pipe(
    recorded: tuple[dict[str, Any], Path],
) -> None:
    _, log = recorded
    follow = _follow_process(
        log, "--until-stdin-closes", "--prometheus-port", "0", stdin=subprocess.PIPE
    )
    try:
        assert follow.stderr is not None
        assert "serving Prometheus" in follow.stderr.readline()
        time.sleep(0.5)
        assert follow.poll() is None  # an open pipe keeps it following
        out, err = follow.communicate(timeout=30)  # closes its standard input
    finally:
        if follow.poll() is None:
            follow.kill()
            follow.wait()
    assert follow.returncode == 0, err
    assert json.loads(out)["events"] == len(list(read_events(log)))


@pytest.mark.parametrize("stdin", ["devnull", "closed"])
def test_replay_follow_until_stdin_closes_refuses_a_stdin_that_is_no_pipe(
    stdin: str, recorded: tuple[dict[str, Any], Path]
) -> None:
    """/dev/null, or no standard input at all, would end the follow at once: exit 2."""
    _, log = recorded
    argv = [sys.executable, "-m", "omnitrace", "replay", "--follow", str(log)]
    argv += ["--until-stdin-closes", "--prometheus-port", "0"]
    if stdin == "devnull":
        done = subprocess.run(argv, stdin=subprocess.DEVNULL, capture_output=True, text=True)
    else:
        command = " ".join(f"'{a}'" for a in argv) + " 0<&-"
        done = subprocess.run(["sh", "-c", command], capture_output=True, text=True)
    assert done.returncode == 2, done.stderr
    assert done.stderr.startswith("omnitrace replay: error: --until-stdin-closes: standard input")
    assert "Traceback" not in done.stderr


def test_replay_follow_until_exit_of_a_process_already_gone_relays_the_log_once(
    recorded: tuple[dict[str, Any], Path], capsys: pytest.CaptureFixture[str]
) -> None:
    _, log = recorded
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    follow = ["replay", "--follow", "--json", "--prometheus-port", "0", "--duration", "30"]
    code = main([*follow, "--until-exit", str(gone.pid), str(log)])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert f"warning: process {gone.pid} is not running" in err
    assert json.loads(out)["events"] == len(list(read_events(log)))


def test_replay_follow_goes_on_past_a_line_of_a_newer_schema_and_says_so(
    recorded: tuple[dict[str, Any], Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The records around it are relayed; the line is logged, and the exit status is 1."""
    _, log = recorded
    lines = log.read_bytes().splitlines(keepends=True)
    middle = len(lines) // 2
    newer = json.dumps({"v": 99, "type": "GraphReplayed", "pid": 1, "rank": 0}).encode()
    path = tmp_path / "mixed.jsonl"
    path.write_bytes(b"".join([*lines[:middle], newer + b"\n", *lines[middle:]]))
    follow = ["replay", "--follow", "--duration", "0.5", "--prometheus-port", "0"]
    code = main([*follow, str(path)])
    err = capsys.readouterr().err
    events = len(list(read_events(log)))
    assert code == 1
    assert f"1 line of the logs is no record this version reads (skipped); {events} events" in err


def test_replay_follow_on_a_taken_port_is_a_one_line_error(
    recorded: tuple[dict[str, Any], Path], capsys: pytest.CaptureFixture[str]
) -> None:
    _, log = recorded
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        code = main(["replay", "--follow", "--prometheus-port", str(port), str(log)])
    err = capsys.readouterr().err
    assert code == 1
    assert err.startswith(f"omnitrace replay: error: cannot serve /metrics on 127.0.0.1:{port}: ")
    assert err.count("\n") == 1


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (["--follow", "--speed", "2"], "--speed paces a recorded log; --follow relays as written"),
        (["--prometheus-port", "0"], "--prometheus-port needs --follow"),
        (["--duration", "1"], "--duration needs --follow"),
        (["--until-exit", "1"], "--until-exit needs --follow"),
        (["--until-stdin-closes"], "--until-stdin-closes needs --follow"),
        (["--from-offset", "5"], "--from-offset needs --follow"),
        (["--follow"], "--follow has nowhere to send the events"),
    ],
)
def test_replay_follow_usage_errors_are_one_line(
    options: list[str],
    message: str,
    recorded: tuple[dict[str, Any], Path],
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    _, log = recorded
    monkeypatch.delenv("OTEL_EXPORTER_OTLP_ENDPOINT", raising=False)
    for name in ("OMNITRACE_LOGS", "OMNITRACE_EVENTS_LOG", "OMNITRACE_OTLP"):
        monkeypatch.delenv(name, raising=False)
    assert main(["replay", *options, str(log)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("omnitrace replay: error: ")
    assert message in err
    assert err.count("\n") == 1


# -- first-run conveniences ------------------------------------------------------------------


def test_version_flag_prints_the_package_version(capsys: pytest.CaptureFixture[str]) -> None:
    """`omnitrace --version` prints the program name and omnitrace.__version__, exit 0."""
    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out == f"omnitrace {omnitrace.__version__}\n"


@pytest.mark.parametrize(
    ("command", "expected"),
    [
        ("demo", ["(default: 400)", "(default: omnitrace-events.jsonl)", "(default: info)"]),
        ("demo", ["(default: 1624)", "(default: 96)", "(default: 64)", "(default: 0)"]),
        ("top", ["(default: until q, Ctrl-C or SIGTERM)"]),
        ("replay", ["(default: OTEL_EXPORTER_OTLP_ENDPOINT; unset: no export)"]),
    ],
)
def test_help_shows_each_options_default(
    capsys: pytest.CaptureFixture[str], command: str, expected: list[str]
) -> None:
    """Every option with a default says it in --help."""
    with pytest.raises(SystemExit):
        main([command, "--help"])
    text = " ".join(capsys.readouterr().out.split())
    for default in expected:
        assert default in text


def test_top_json_prints_the_stats_of_each_worker(
    recorded: tuple[dict[str, Any], Path], capsys: pytest.CaptureFixture[str]
) -> None:
    """`top --json LOG` prints per-encoder stats equal to derive_stats, with cap and worker."""
    _, log = recorded
    assert main(["top", "--json", str(log)]) == 0
    data = json.loads(capsys.readouterr().out)
    derived = derive_stats(read_events(log))
    assert data["events"] == len(list(read_events(log)))
    assert {e["encoder"] for e in data["encoders"]} == set(derived)
    for entry in data["encoders"]:
        stats = {k: entry[k] for k in derived[entry["encoder"]]}
        assert stats == derived[entry["encoder"]]
        assert entry["calls"] == stats["graph_hits"] + stats["graph_misses"]
        assert (entry["max_graphs"], entry["rank"]) == (DEFAULT_MAX_GRAPHS, 0)


def test_top_json_lists_each_encoders_top_missed_signatures_and_eager_time(
    recorded: tuple[dict[str, Any], Path], capsys: pytest.CaptureFixture[str]
) -> None:
    """`top --json` adds the coverage summary: top missed keys, eager time, time source."""
    _, log = recorded
    assert main(["top", "--json", str(log)]) == 0
    data = json.loads(capsys.readouterr().out)
    coverage = derive_coverage(read_events(log))
    for entry in data["encoders"]:
        mine = coverage[entry["encoder"]].summary()
        del mine["lost_s"]  # null on the simulated backend: see the test below
        assert {k: entry[k] for k in mine} == json.loads(json.dumps(mine))
        assert sum(row["misses"] for row in entry["top_missed"]) <= entry["graph_misses"]
    assert any(entry["top_missed"] for entry in data["encoders"])


def test_top_json_names_the_backend_and_has_no_lost_time_on_the_simulated_one(
    recorded: tuple[dict[str, Any], Path], capsys: pytest.CaptureFixture[str]
) -> None:
    """`top --json` gives each encoder's backend, and lost_s null where the view says
    "lost n/a (simulated)"; the eager time is still given."""
    _, log = recorded
    assert main(["top", "--json", str(log)]) == 0
    data = json.loads(capsys.readouterr().out)
    assert [(e["backend"], e["lost_s"]) for e in data["encoders"]] == [("simulated", None)] * 2
    assert all(e["eager_s"] > 0 for e in data["encoders"])
    assert main(["top", str(log)]) == 0
    assert capsys.readouterr().out.count("lost n/a (simulated)") == 2


def test_top_json_with_follow_is_a_usage_error(
    recorded: tuple[dict[str, Any], Path], capsys: pytest.CaptureFixture[str]
) -> None:
    """--json prints one snapshot, so it is refused with --follow in one line, exit 2."""
    _, log = recorded
    assert main(["top", "--follow", "--json", str(log)]) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line == (
        "omnitrace top: error: --json prints one snapshot; it cannot be combined with --follow"
    )


def test_replay_json_prints_the_replayed_stats(
    recorded: tuple[dict[str, Any], Path], capsys: pytest.CaptureFixture[str]
) -> None:
    """`replay --json LOG` prints the event count and each encoder's stats as JSON."""
    summary, log = recorded
    assert main(["replay", "--json", str(log)]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["events"] == len(list(read_events(log)))
    assert data["otlp_endpoint"] is None
    # Beside these, each encoder has the fields of a graph_summary line (test_outputs_agree).
    assert _stats_of(data["encoders"], summary["encoders"]) == {
        name: {**summary["encoders"][name], "max_graphs": DEFAULT_MAX_GRAPHS}
        for name in summary["encoders"]
    }


def test_replay_merges_several_workers_logs(
    recorded: tuple[dict[str, Any], Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Two logs written by two ranks replay side by side: one adapter per worker and encoder."""
    _, log = recorded
    events = list(read_events(log))
    paths = []
    for rank in ("0", "1"):
        path = tmp_path / f"rank{rank}.jsonl"
        with pytest.MonkeyPatch.context() as env:
            env.setenv("RANK", rank)
            sink = JsonlSink(path)
        sink.handle(events if rank == "0" else events[: len(events) // 2])
        sink.close()
        paths.append(str(path))
    assert main(["replay", "--json", *paths]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["events"] == len(events) + len(events) // 2
    ranks = {name.split("@")[1].split(".")[0] for name in data["encoders"]}
    assert ranks == {"rank0", "rank1"}
    full = derive_stats(events)["vision"]
    (rank0_vision,) = [v for n, v in data["encoders"].items() if n.startswith("vision@rank0.")]
    assert {k: rank0_vision[k] for k in full} == full


# -- bad paths ---------------------------------------------------------------------------------


@pytest.mark.parametrize("command", ["top", "replay"])
def test_a_directory_is_a_one_line_error(
    command: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`top DIR` / `replay DIR`: one line naming the path, exit 2, no traceback."""
    assert main([command, str(tmp_path)]) == 2
    out, err = capsys.readouterr()
    assert err == f"omnitrace {command}: error: {tmp_path}: is a directory, not an event log\n"
    assert out == ""


@pytest.mark.parametrize("command", ["top", "replay"])
def test_a_plain_text_file_is_not_an_event_log(
    command: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A text file is refused in one line naming it and its first line, exit 2."""
    path = tmp_path / "notes.txt"
    path.write_text("hello\nworld\n")
    assert main([command, str(path)]) == 2
    err = capsys.readouterr().err
    assert err == (
        f"omnitrace {command}: error: {path}: not an omnitrace event log "
        "(no line is an event record; line 1 is not JSON)\n"
    )


@pytest.mark.parametrize("command", ["top", "replay"])
def test_an_empty_log_did_nothing_useful_and_says_so(
    command: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """An empty file replays nothing: one line, exit 1."""
    path = tmp_path / "empty.jsonl"
    path.touch()
    assert main([command, str(path)]) == 1
    assert capsys.readouterr().err == (
        f"omnitrace {command}: error: {path}: no events in the event log\n"
    )


def test_top_follow_of_a_missing_log_says_it_is_waiting(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`top --follow missing.jsonl` says it waits for the file, then follows it (exit 0)."""
    path = tmp_path / "later.jsonl"
    assert main(["top", "--follow", "--no-tui", "--duration", "0.3", str(path)]) == 0
    out, err = capsys.readouterr()
    assert err == f"omnitrace: waiting for {path} to appear\n"
    assert "no encoder events yet" in out


@pytest.mark.skipif(not hasattr(signal, "SIGTERM"), reason="needs POSIX signals")
def test_top_follow_ends_on_sigterm_with_the_final_frame(
    recorded: tuple[dict[str, Any], Path], tmp_path: Path
) -> None:
    """`top --follow` stopped by SIGTERM prints the final frame and exits 0, as Ctrl-C does."""
    summary, log = recorded
    path = tmp_path / "live.jsonl"
    process = subprocess.Popen(
        [sys.executable, "-m", "omnitrace", "top", "--follow", "--no-tui", str(path)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert process.stderr is not None
        assert process.stderr.readline() == f"omnitrace: waiting for {path} to appear\n"
        path.write_bytes(log.read_bytes())
        time.sleep(1.0)  # several polls: the whole log is read
        process.send_signal(signal.SIGTERM)
        out, err = process.communicate(timeout=30)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    assert process.returncode == 0, err
    vision = summary["encoders"]["vision"]
    assert f"hits {vision['graph_hits']} / calls {vision['calls']}" in out


@pytest.mark.parametrize("command", ["top", "replay"])
def test_follow_of_a_pattern_that_matched_nothing_is_an_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], command: str
) -> None:
    """`--follow 'events-*.jsonl'` that the shell left unexpanded (no match) is one line and
    exit 2, instead of waiting for a file named with a '*'."""
    pattern = tmp_path / "events-*.jsonl"
    extra = ["--prometheus-port", "0"] if command == "replay" else []
    assert main([command, "--follow", "--duration", "5", *extra, str(pattern)]) == 2
    assert capsys.readouterr().err == (
        f"omnitrace {command}: error: {pattern}: no file matches this pattern (a pattern that "
        "matches nothing reaches omnitrace unexpanded; name the log, which may not exist yet)\n"
    )


def test_top_follow_of_a_directory_is_an_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`top --follow DIR` fails at once with one line instead of waiting."""
    assert main(["top", "--follow", str(tmp_path)]) == 2
    assert capsys.readouterr().err == (
        f"omnitrace top: error: {tmp_path}: is a directory, not an event log\n"
    )


# -- OpenTelemetry's variables and a dead endpoint ---------------------------------------------


def _service_names(receiver: OTLPReceiver) -> set[str]:
    return {attributes(rs.resource.attributes)["service.name"] for rs in receiver.resource_spans()}


def test_demo_and_replay_export_under_otel_service_name(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, recorded: tuple[dict[str, Any], Path]
) -> None:
    """OTEL_SERVICE_NAME replaces the demo's and replay's default service names."""
    _, log = recorded
    with OTLPReceiver() as receiver:
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", receiver.endpoint)
        assert main(["replay", str(log)]) == 0
        assert _service_names(receiver) == {"omnitrace-replay"}
        receiver.clear()
        monkeypatch.setenv("OTEL_SERVICE_NAME", "myservice")
        assert _demo(tmp_path)[0] == 0
        assert main(["replay", str(log)]) == 0
        assert _service_names(receiver) == {"myservice"}


_GRPC_EXPORTERS = (
    "opentelemetry.exporter.otlp.proto.grpc.metric_exporter",
    "opentelemetry.exporter.otlp.proto.grpc.trace_exporter",
)
_NO_GRPC = (
    "protocol 'grpc' needs the OTLP gRPC exporter: pip install "
    "'opentelemetry-exporter-otlp-proto-grpc>=1.25' (omnitrace's grpc extra)"
)


@pytest.mark.parametrize("command", ["demo", "replay"])
def test_grpc_without_the_grpc_extra_is_one_line_with_exit_2(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    command: str,
) -> None:
    """OTEL_EXPORTER_OTLP_PROTOCOL=grpc without the gRPC exporter installed is the same one
    line from demo and replay, exit 2, and the demo's previous event log is kept."""
    for module in _GRPC_EXPORTERS:
        monkeypatch.setitem(sys.modules, module, None)  # None in sys.modules: not importable
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc")
    log = _log_of(
        tmp_path / "e.jsonl", [GraphReplayed("audio", sig("float32[1,80,100]"), 1, 1, 0.001)]
    )
    before = log.read_bytes()
    if command == "demo":
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:1")
        argv = ["demo", "--no-tui", "--cpu", "--requests", "5", "--events-log", str(log)]
    else:
        argv = ["replay", str(log), "--otlp-endpoint", "http://127.0.0.1:1"]
    code = main(argv)
    # The demo says first that it runs on the simulated backend; then the one error line.
    err = capsys.readouterr().err
    assert (code, err.splitlines()[-1]) == (2, f"omnitrace {command}: error: {_NO_GRPC}")
    assert "Traceback" not in err
    assert log.read_bytes() == before


@pytest.mark.parametrize("command", ["demo", "replay"])
def test_http_json_is_refused_naming_the_protocols_the_exporters_support(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    command: str,
) -> None:
    """OTEL_EXPORTER_OTLP_PROTOCOL=http/json is one line naming the variable and the two
    protocols the OTel Python exporters support, exit 2."""
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "http/json")
    log = _log_of(
        tmp_path / "e.jsonl", [GraphReplayed("audio", sig("float32[1,80,100]"), 1, 1, 0.001)]
    )
    if command == "demo":
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:1")
        argv = ["demo", "--no-tui", "--cpu", "--requests", "5", "--events-log", str(log)]
    else:
        argv = ["replay", str(log), "--otlp-endpoint", "http://127.0.0.1:1"]
    assert main(argv) == 2
    assert capsys.readouterr().err.splitlines()[-1] == (
        f"omnitrace {command}: error: OTEL_EXPORTER_OTLP_PROTOCOL: expected one of "
        "http/protobuf, grpc (the OTLP protocols the OpenTelemetry Python exporters support), "
        "got 'http/json'"
    )


def _silent_port() -> socket.socket:
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(64)
    return server


def test_replay_into_a_dead_endpoint_fails_in_one_line_within_a_second(
    recorded: tuple[dict[str, Any], Path], capfd: pytest.CaptureFixture[str]
) -> None:
    """A refused or silent endpoint: the stats table still prints, then exit 1 with one stderr
    line naming the endpoint, at most 1 s extra."""
    _, log = recorded
    with OTLPReceiver() as receiver:
        start = time.monotonic()
        assert main(["replay", str(log), "--otlp-endpoint", receiver.endpoint]) == 0
        healthy = time.monotonic() - start
    capfd.readouterr()
    events = len(list(read_events(log)))
    with _silent_port() as silent:
        refused = socket.socket()
        refused.bind(("127.0.0.1", 0))
        refused_endpoint = f"http://127.0.0.1:{refused.getsockname()[1]}"
        refused.close()
        silent_endpoint = f"http://127.0.0.1:{silent.getsockname()[1]}"
        for endpoint, cause in (
            (refused_endpoint, "Connection refused"),
            (silent_endpoint, "no answer within 0.8 s"),
        ):
            start = time.monotonic()
            assert main(["replay", str(log), "--otlp-endpoint", endpoint]) == 1
            elapsed = time.monotonic() - start
            out, err = capfd.readouterr()
            assert out.startswith(f"replayed {events} events")
            said, failed = err.splitlines()
            assert said == (
                f"omnitrace: replaying into OTLP (http/protobuf): traces to {endpoint}/v1/traces, "
                f"metrics to {endpoint}/v1/metrics"
            )
            assert failed.startswith(
                f"omnitrace replay: error: OTLP export to {endpoint} (http/protobuf) failed: "
            )
            assert cause in failed
            assert failed.endswith(f"; {events} events read")
            assert elapsed - healthy <= 1.0, (endpoint, elapsed, healthy)


def test_demo_with_a_dead_endpoint_says_so_once_and_succeeds(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    """The demo's purpose is not the export: exit 0, one line about the failed export."""
    with _silent_port() as silent:
        endpoint = f"http://127.0.0.1:{silent.getsockname()[1]}"
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", endpoint)
        code, summary, _ = _demo(tmp_path)
    err = capfd.readouterr().err
    assert code == 0
    lines = [line for line in err.splitlines() if endpoint in line]
    assert lines[0] == (
        f"omnitrace: exporting over OTLP (http/protobuf): traces to {endpoint}/v1/traces, "
        f"metrics to {endpoint}/v1/metrics"
    )
    assert len(lines) == 2
    assert lines[1].startswith(f"omnitrace: OTLP export to {endpoint} (http/protobuf) failed:")
    assert summary["otlp_error"] == lines[1].removeprefix("omnitrace: ")
    assert "Transient error" not in err


# -- the live view on a real terminal ----------------------------------------------------------


def test_q_quits_top_follow_on_a_terminal(recorded: tuple[dict[str, Any], Path]) -> None:
    """On an 80x24 terminal `top --follow` draws the view and ends at once on q, exit 0."""
    _, log = recorded
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 80, 0, 0))
    proc = subprocess.Popen(
        [sys.executable, "-m", "omnitrace", "top", "--follow", str(log)],
        stdin=slave,
        stdout=slave,
        stderr=slave,
        env={**os.environ, "TERM": "xterm-256color"},
        close_fds=True,
    )
    os.close(slave)
    screen = bytearray()

    def read_until(marker: bytes, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while marker not in screen and time.monotonic() < deadline:
            ready, _, _ = select.select([master], [], [], 0.1)
            if ready:
                try:
                    screen.extend(os.read(master, 65536))
                except OSError:  # the child closed the terminal
                    break
        return marker in screen

    try:
        assert read_until(b"q or Ctrl-C quits", 15.0), screen.decode(errors="replace")
        # The 80-column view labels the hit rate row "hits" (compact panels).
        assert read_until(b"hits ", 5.0), screen.decode(errors="replace")
        os.write(master, b"q")
        start = time.monotonic()
        assert proc.wait(timeout=5) == 0
        assert time.monotonic() - start < 2.0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        os.close(master)


def _on_a_terminal(argv: list[str], cwd: Path, timeout: float = 60.0) -> tuple[int, str]:
    """Run ``omnitrace ARGV`` on an 80x24 pseudo-terminal; return its exit status and what
    it wrote there, escape sequences removed."""
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 80, 0, 0))
    proc = subprocess.Popen(
        [sys.executable, "-m", "omnitrace", *argv],
        stdin=slave,
        stdout=slave,
        stderr=slave,
        cwd=cwd,
        env={**os.environ, "TERM": "xterm-256color", "PYTHONPATH": str(ROOT)},
        close_fds=True,
    )
    os.close(slave)
    screen = bytearray()
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([master], [], [], 0.1)
            if ready:
                try:
                    chunk = os.read(master, 65536)
                except OSError:  # the child closed the terminal
                    break
                if not chunk:
                    break
                screen.extend(chunk)
            elif proc.poll() is not None:
                break
        code = proc.wait(timeout=10)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        os.close(master)
    escapes = r"\x1b\[[0-9;?]*[A-Za-z]|\x1b[()][A-Z0-9]|\r"
    return code, re.sub(escapes, "", screen.decode(errors="replace"))


def test_demo_view_on_a_terminal_ends_with_the_summary_not_log_lines(tmp_path: Path) -> None:
    """After the live view closes, the terminal shows the line counting the log lines the
    view kept, then the stats table: no JSON log line (the final graph_summary ones
    included) is printed across it, and the count includes those final lines."""
    code, screen = _on_a_terminal(
        ["demo", "--cpu", "--requests", "60", "--rate", "200", "--events-log", "e.jsonl"],
        cwd=tmp_path,
    )
    assert code == 0, screen
    marker = re.search(r"omnitrace: (\d+) log lines were shown in the live view", screen)
    assert marker is not None, screen
    after = screen[marker.end() :]
    assert "encoder graph stats" in after
    assert '{"' not in after, after
    assert "graph_summary" not in after
    # The log lines are the captures, the deferrals and one final summary per encoder.
    records = [json.loads(line) for line in (tmp_path / "e.jsonl").read_text().splitlines()]
    logged = sum(r["type"] in ("GraphCaptured", "MemoryDeferred") for r in records) + 2
    assert int(marker.group(1)) == logged
    # Every line after the view fits the terminal (but the one with the long tmp path).
    assert all(len(line) <= 80 for line in after.splitlines() if str(tmp_path) not in line)


# -- bad input: one line, no traceback, nothing harmed --------------------------------------


@pytest.mark.parametrize("text", ["", "  "])
def test_blank_hf_overrides_is_a_one_line_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], text: str
) -> None:
    """`--hf-overrides ''` (an unset shell variable, most often) is refused in one line with
    exit 2, not run silently with the defaults."""
    log = str(tmp_path / "e.jsonl")
    code = main(["demo", "--no-tui", "--cpu", "--events-log", log, "--hf-overrides", text])
    assert code == 2
    assert capsys.readouterr().err == (
        "omnitrace demo: error: --hf-overrides: expected a JSON object, e.g. "
        f"'{{\"encoder_cuda_graph_max_graphs\": 8}}', got {text!r} (leave the option out for "
        "the defaults)\n"
    )
    assert not (tmp_path / "e.jsonl").exists()


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            '{"encoder_cuda_graph_max_graphs": ' + "9" * 5000 + "}",
            "encoder_cuda_graph_max_graphs: expected an integer from 0 to 1024 (0 keeps no "
            "graph), got a 5000-digit integer",
        ),
        (
            '{"encoder_cuda_graph_max_graphs": 9223372036854775808}',
            "encoder_cuda_graph_max_graphs: expected an integer from 0 to 1024 (0 keeps no "
            "graph), got 9223372036854775808 (int)",
        ),
        (
            "[" * 100_000,
            "hf_overrides: expected a JSON object, got JSON nested too deeply to parse",
        ),
    ],
    ids=["5000-digits", "2**63", "deep"],
)
def test_hf_overrides_python_cannot_convert_is_a_one_line_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], overrides: str, message: str
) -> None:
    """Values that overflowed or crashed the parser exit 2 with one line and run nothing."""
    code, _, log = _demo(tmp_path, "--hf-overrides", overrides)
    _, err = capsys.readouterr()
    assert code == 2
    assert err.strip().splitlines() == [f"omnitrace demo: error: --hf-overrides: {message}"]
    assert not log.exists()


def _main_with_deadline(argv: list[str], deadline: float = 10) -> int:
    """Run main() on a thread; fail if it blocks (opening a named pipe could)."""
    codes: list[int] = []
    thread = threading.Thread(target=lambda: codes.append(main(argv)), daemon=True)
    thread.start()
    thread.join(deadline)
    assert codes, f"omnitrace {argv[0]} blocked"
    return codes[0]


@pytest.mark.parametrize("option", ["--events-log", "--log-file", "--json-summary"])
@pytest.mark.parametrize("kind", ["symbolic link", "named pipe", "directory"])
def test_demo_refuses_output_paths_that_are_not_regular_files(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], option: str, kind: str
) -> None:
    """An output path that is a link, a pipe or a directory is a one-line error (exit 2)
    before anything runs, and the thing at the path is left as it was."""
    path = tmp_path / "out"
    target = tmp_path / "precious.txt"
    target.write_text("keep me\n")
    described = {"symbolic link": "a symbolic link", "named pipe": "a named pipe"}.get(
        kind, "a directory"
    )
    if kind == "symbolic link":
        path.symlink_to(target)
    elif kind == "named pipe":
        os.mkfifo(path)
    else:
        path.mkdir()
    before = os.lstat(path)
    argv = ["demo", "--no-tui", "--cpu", "--requests", "5"]
    argv += ["--events-log", str(tmp_path / "events.jsonl")] if option != "--events-log" else []
    code = _main_with_deadline([*argv, option, str(path)])
    _, err = capsys.readouterr()
    expected = (
        f"omnitrace demo: error: {option}: {path} is {described}, not a regular file; "
        "omnitrace only writes, rotates and deletes regular files"
    )
    assert code == 2
    assert err.strip().splitlines()[-1] == expected
    assert "Traceback" not in err
    after = os.lstat(path)
    assert (after.st_mode, after.st_ino) == (before.st_mode, before.st_ino)
    assert target.read_text() == "keep me\n"


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--sim-free-mib", str(1 << 43)], "expected a number of MiB from 0 to 8796093022207"),
        (["--seed", str(1 << 64)], "expected an integer from 0 to 9223372036854775807"),
        (["--hidden", "1000000"], "expected an integer from 1 to 16384"),
        (["--requests", "9" * 5000], "expected an integer from 0 to 1000000000000, got '9999"),
        (["--profiling-runs", "101"], "--profiling-runs: expected an integer from 0 to 100"),
    ],
    ids=["sim-free-mib", "seed", "hidden", "requests", "profiling-runs"],
)
def test_demo_numbers_are_bounded_to_what_they_mean(
    capsys: pytest.CaptureFixture[str], argv: list[str], message: str
) -> None:
    """Numbers past what they can mean are a short usage error, not a crash or an overflow."""
    with pytest.raises(SystemExit) as exit_info:
        main(["demo", "--no-tui", "--cpu", *argv])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2
    assert message in err
    assert len(err.strip().splitlines()[-1]) < 200


def test_replay_warns_when_the_start_of_the_log_was_rotated_away(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Replaying a log whose oldest files rotation deleted says how many events are missing."""
    from omnitrace import GraphReplayed

    path = tmp_path / "events.jsonl"
    sink = JsonlSink(path, max_bytes=4096, backups=1)
    try:
        for i in range(0, 1000, 50):
            sink.handle(
                [GraphReplayed("audio", sig("float32[1]"), j, j, 0.0) for j in range(i, i + 50)]
            )
    finally:
        sink.close()
    assert main(["replay", str(path)]) == 0
    out, err = capsys.readouterr()
    survivors = len(list(read_events(path)))
    missing = 1000 - survivors
    assert f"replayed {survivors} events" in out
    assert (
        f"omnitrace: warning: the start of {path} is missing: {missing} earlier events are "
        f"not in the log ({missing} deleted by rotation); the replayed stats do not include "
        "them"
    ) in err.splitlines()


def test_replay_of_a_complete_log_gives_no_warning(
    recorded: tuple[dict[str, Any], Path], capsys: pytest.CaptureFixture[str]
) -> None:
    """A log that kept its start replays without a warning."""
    _, log = recorded
    assert main(["replay", str(log)]) == 0
    assert "warning" not in capsys.readouterr().err


def test_demo_on_sigterm_closes_its_bus_and_reports_the_loss(tmp_path: Path) -> None:
    """SIGTERM to a running demo: its bus closes within a bound, one line reports delivered
    and lost events per sink, the event log holds what was delivered, and the process ends
    by SIGTERM."""
    log = tmp_path / "events.jsonl"
    argv = ["demo", "--no-tui", "--cpu", "--requests", "0", "--duration", "120"]
    argv += ["--events-log", str(log), "--log-file", str(tmp_path / "demo.log")]
    proc = subprocess.Popen(
        [sys.executable, "-m", "omnitrace", *argv],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 60
        while (not log.exists() or log.stat().st_size < 50_000) and time.monotonic() < deadline:
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=20)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        pytest.fail("the demo did not end within 20 s of SIGTERM")
    assert proc.returncode == -signal.SIGTERM
    match = re.search(
        r"EventBus closed on SIGTERM in [\d.]+ s; (\d+) events emitted; .*"
        r"jsonl: delivered (\d+), lost (\d+)",
        err,
    )
    assert match is not None, err
    emitted, delivered, lost = map(int, match.groups())
    assert delivered + lost == emitted
    assert len(list(read_events(log))) >= delivered > 0


# -- text from a log is data ----------------------------------------------------------------

#: Adapter names a crafted log can carry: an unbalanced closing tag (a MarkupError once),
#: markup that styled the output, and an ESC colour sequence with a BEL.
HOSTILE_NAMES = ("vision[/]", "[bold red]x", "a\x1b[31mb\x07")


def _hostile_log(path: Path, name: str) -> Path:
    """Write a log whose adapter name, miss detail and failure message are all ``name``."""
    from omnitrace import CaptureFailed, GraphCaptured, GraphMissed, GraphReplayed, MemoryDeferred
    from omnitrace.events import MissReason

    t0 = 1_700_000_000_000_000_000
    hot, cold = sig("float32[1,64,16], None @cpu s=0"), sig("float32[1,128,16], None @cpu s=0")
    events = [
        GraphMissed(name, hot, 0, t0, MissReason.WARMUP, name, 0.01),
        GraphCaptured(name, hot, 1, t0 + 1, 0.1, 1, "cpu", 0, 5, 64 << 20, 1024, 0),
        GraphReplayed(name, hot, 2, t0 + 2, 0.002),
        GraphReplayed(name, hot, 3, t0 + 3, 0.002),
        GraphMissed(name, cold, 4, t0 + 4, MissReason.WARMUP, name, 0.01),
        MemoryDeferred(name, cold, 5, t0 + 5, 10, 20, "cpu"),
        CaptureFailed(name, cold, 6, t0 + 6, "RuntimeError", f"boom {name}", "cpu", 0),
    ]
    sink = JsonlSink(path)
    sink.handle(events)
    sink.close()
    return path


@pytest.mark.parametrize("command", ["top", "replay", "advise"])
@pytest.mark.parametrize("name", HOSTILE_NAMES)
def test_names_from_a_log_are_printed_literally_without_controls(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], command: str, name: str
) -> None:
    """top, replay and advise print an adapter name from the log as its literal text (no
    MarkupError, no style from it) with control characters escaped: no ESC or BEL is output."""
    log = _hostile_log(tmp_path / "events.jsonl", name)
    assert main([command, str(log)]) == 0
    captured = capsys.readouterr()
    out = captured.out + captured.err
    assert name.replace("\x1b", "\\x1b").replace("\x07", "\\x07") in captured.out
    assert "\x1b" not in out
    assert "\x07" not in out


# -- what the writer writes, the readers read ------------------------------------------------


def _log_of(path: Path, events: list[Any]) -> Path:
    sink = JsonlSink(path)
    try:
        sink.handle(events)
    finally:
        sink.close()
    return path


def test_top_json_prints_null_for_an_infinite_number(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Eager times that sum past a float's range print as null: the output stays JSON."""
    key = sig("float32[1,80,100]")
    log = _log_of(
        tmp_path / "events.jsonl",
        [GraphMissed("audio", key, i, i, MissReason.CAPACITY, "cap", 1e308) for i in range(3)],
    )
    assert main(["top", "--json", str(log)]) == 0
    out = capsys.readouterr().out
    assert "Infinity" not in out
    encoder = json.loads(out)["encoders"][0]
    assert encoder["eager_s"] is None


def test_advise_on_a_shape_of_400_dimensions_does_not_overflow(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A logged key with more elements than a float holds gets a finite size estimate."""
    small, wide = sig("float32[1,80,100]"), sig("float32[" + ",".join(["7"] * 400) + "]")
    events: list[Any] = [
        GraphMissed("audio", small, 1, 1, MissReason.WARMUP, "call 1 of 2", 0.01),
        GraphCaptured("audio", small, 2, 2, 0.2, 1, "cpu", 0, 1, 4096, 512, 0),
        *(GraphReplayed("audio", small, 3 + i, 3 + i, 0.001) for i in range(5)),
        *(GraphMissed("audio", wide, 10 + i, 10 + i, MissReason.WARMUP, "call 1 of 2", 0.01)
          for i in range(3)),
    ]  # fmt: skip
    log = _log_of(tmp_path / "events.jsonl", events)
    code = main(["advise", "--json", str(log)])
    captured = capsys.readouterr()
    assert "OverflowError" not in captured.err
    assert code in (0, 1), captured.err
    assert json.loads(captured.out)["results"]


@pytest.mark.parametrize(
    ("variable", "value", "error"),
    [
        ("OTEL_EXPORTER_OTLP_PROTOCOL", "bogus", "OTEL_EXPORTER_OTLP_PROTOCOL: expected one of"),
        ("OTEL_METRIC_EXPORT_INTERVAL", "abc", "OTEL_METRIC_EXPORT_INTERVAL: expected"),
        ("OMNITRACE_SUMMARY_INTERVAL", "abc", "OMNITRACE_SUMMARY_INTERVAL: expected"),
    ],
)
def test_a_failed_start_keeps_the_previous_event_log(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    variable: str,
    value: str,
    error: str,
) -> None:
    """A setting refused at start is a one-line error before any file is touched: the last
    run's event log is kept byte for byte."""
    log = tmp_path / "keep.jsonl"
    kept = _log_of(log, [GraphReplayed("audio", sig("float32[1,80,100]"), 1, 1, 0.001)])
    before = kept.read_bytes()
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:9")
    monkeypatch.setenv(variable, value)
    code = main(["demo", "--no-tui", "--cpu", "--requests", "5", "--events-log", str(log)])
    err = capsys.readouterr().err
    assert code == 2
    assert err.splitlines()[-1].startswith(f"omnitrace demo: error: {error}")
    assert log.read_bytes() == before
