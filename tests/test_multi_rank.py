"""Several workers' logs at once: top, replay and advise over the ranks of one job."""

from __future__ import annotations

import dataclasses
import json
import re
import socket
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import structlog

from omnitrace import derive_stats
from omnitrace.cli import main
from omnitrace.config import DEFAULT_MAX_GRAPHS
from omnitrace.otlp_receiver import OTLPReceiver, attributes
from omnitrace.sinks.jsonl import read_events

#: Two ranks, each with its own traffic (its own seed) and its own pid.
RANKS = ((0, 4100, 0), (1, 4101, 1))


@pytest.fixture(autouse=True)
def _clean_environment(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    for name in (
        "OTEL_EXPORTER_OTLP_ENDPOINT",
        "OTEL_SERVICE_NAME",
        "OTEL_RESOURCE_ATTRIBUTES",
        "RANK",
        "LOCAL_RANK",
    ):
        monkeypatch.delenv(name, raising=False)
    yield
    structlog.reset_defaults()


def _as_worker(source: Path, target: Path, rank: int, pid: int) -> Path:
    """Rewrite a log as worker ``(rank, pid)`` wrote it (every line names its writer)."""
    lines = []
    for line in source.read_text().splitlines():
        record = json.loads(line)
        record.update(rank=rank, pid=pid)
        lines.append(json.dumps(record))
    target.write_text("\n".join(lines) + "\n")
    return target


@pytest.fixture(scope="module")
def rank_logs(tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    """The logs of two ranks, ``events-0.jsonl`` and ``events-1.jsonl``, of different traffic."""
    directory = tmp_path_factory.mktemp("ranks")
    logs = []
    try:
        for rank, pid, seed in RANKS:
            demo = directory / f"demo-{rank}.jsonl"
            argv = ["demo", "--no-tui", "--cpu", "--requests", "80", "--seed", str(seed)]
            assert main([*argv, "--events-log", str(demo)]) == 0
            logs.append(_as_worker(demo, directory / f"events-{rank}.jsonl", rank, pid))
            demo.unlink()
    finally:
        structlog.reset_defaults()
    return logs


def _stats(log: Path) -> dict[str, dict[str, int | float]]:
    return derive_stats(read_events(log))


def test_top_json_on_a_quoted_pattern_shows_every_rank_and_their_total(
    rank_logs: list[Path], capsys: pytest.CaptureFixture[str]
) -> None:
    """`top --json 'events-*.jsonl'` (no shell expanded it) reads both ranks' logs; the total
    of each encoder is the sum of the ranks', with the lowest and highest hit rate."""
    pattern = rank_logs[0].parent / "events-*.jsonl"
    assert main(["top", "--json", str(pattern)]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["logs"] == [str(log) for log in rank_logs]
    assert {(e["rank"], e["pid"]) for e in data["encoders"]} == {(0, 4100), (1, 4101)}
    per_rank = [_stats(log) for log in rank_logs]
    total = data["total"]
    assert total["workers"] == [{"rank": 0, "pid": 4100}, {"rank": 1, "pid": 4101}]
    for row in total["encoders"]:
        name = row["encoder"]
        for key in ("graph_hits", "graph_misses", "num_graphs", "capacity_misses"):
            assert row[key] == sum(stats[name][key] for stats in per_rank), (name, key)
        rates = [stats[name]["hit_rate"] for stats in per_rank]
        assert (row["hit_rate_low"], row["hit_rate_high"]) == (min(rates), max(rates))
        assert row["hit_rate"] == row["graph_hits"] / row["calls"]
        assert (row["workers"], row["max_graphs_per_worker"]) == (2, DEFAULT_MAX_GRAPHS)
    assert total["calls"] == sum(row["calls"] for row in total["encoders"])


def test_top_shows_the_ranks_side_by_side_and_the_total_row(
    rank_logs: list[Path], capsys: pytest.CaptureFixture[str]
) -> None:
    """The frame has a panel per rank and the total of both under them."""
    assert main(["top", *map(str, rank_logs)]) == 0
    out = capsys.readouterr().out
    assert "vision · rank 0 · pid 4100" in out
    assert "vision · rank 1 · pid 4101" in out
    assert out.index("rank 1 · pid 4101") < out.index("total · 2 workers")


def test_top_follow_of_a_pattern_picks_up_a_rank_that_starts_late(
    rank_logs: list[Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A follow of 'events-*.jsonl' started with one rank's log also follows the log a
    second rank creates a second later, and its final frame holds both and their total."""
    first = tmp_path / "events-0.jsonl"
    first.write_bytes(rank_logs[0].read_bytes())

    def late_rank() -> None:
        time.sleep(1.0)
        (tmp_path / "events-1.jsonl").write_bytes(rank_logs[1].read_bytes())

    writer = threading.Thread(target=late_rank)
    writer.start()
    try:
        code = main(["top", "--follow", "--duration", "3.5", str(tmp_path / "events-*.jsonl")])
    finally:
        writer.join()
    out, err = capsys.readouterr()
    assert code == 0, err
    assert f"following {tmp_path / 'events-1.jsonl'} too" in err
    assert "rank 1 · pid 4101" in out
    assert "total · 2 workers" in out


def test_replay_json_of_a_quoted_pattern_replays_every_rank(
    rank_logs: list[Path], capsys: pytest.CaptureFixture[str]
) -> None:
    """`replay --json 'events-*.jsonl'` reads both logs: each rank's encoders apart."""
    assert main(["replay", "--json", str(rank_logs[0].parent / "events-*.jsonl")]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["logs"] == [str(log) for log in rank_logs]
    assert set(data["encoders"]) == {
        f"{name}@rank{rank}.pid{pid}" for rank, pid, _ in RANKS for name in ("vision", "audio")
    }


def _resource_hits(receiver: OTLPReceiver) -> dict[tuple[Any, Any, str], int]:
    """The latest graph-hit count per (rank, pid) resource and encoder."""
    hits: dict[tuple[Any, Any, str], int] = {}
    for request in receiver.metrics_requests:
        for rm in request.resource_metrics:
            resource = attributes(rm.resource.attributes)
            for scope in rm.scope_metrics:
                for metric in scope.metrics:
                    if metric.name != "omnitrace.encoder.graph.hits":
                        continue
                    for point in metric.sum.data_points:
                        encoder = attributes(point.attributes)["omnitrace.encoder"]
                        key = (resource.get("omnitrace.worker.rank"), resource["process.pid"])
                        hits[(*key, encoder)] = point.as_int
    return hits


def test_replay_exports_each_rank_under_its_own_resource(
    rank_logs: list[Path], capsys: pytest.CaptureFixture[str]
) -> None:
    """Replayed into OTLP, every span and metric of a rank carries its rank and pid as
    resource attributes, and the encoder keeps its own name: one dashboard shows both ranks
    and sums them by the resource."""
    with OTLPReceiver() as receiver:
        code = main(["replay", *map(str, rank_logs), "--otlp-endpoint", receiver.endpoint])
        err = capsys.readouterr().err
        assert code == 0, err
        hits = _resource_hits(receiver)
        expected = {
            (rank, pid, name): stats["graph_hits"]
            for (rank, pid, _), log in zip(RANKS, rank_logs, strict=True)
            for name, stats in _stats(log).items()
        }
        assert hits == expected
        captures: dict[tuple[Any, Any], int] = {}
        for rs in receiver.resource_spans():
            resource = attributes(rs.resource.attributes)
            assert resource["service.name"] == "omnitrace-replay"
            for scope in rs.scope_spans:
                for span in scope.spans:
                    if span.name == "omnitrace.graph.capture":
                        key = (resource["omnitrace.worker.rank"], resource["process.pid"])
                        captures[key] = captures.get(key, 0) + 1
                        assert "@" not in attributes(span.attributes)["omnitrace.encoder"]
        instances = {
            attributes(rs.resource.attributes)["omnitrace.worker.rank"]: attributes(
                rs.resource.attributes
            )["service.instance.id"]
            for rs in receiver.resource_spans()
        }
        # A collector makes service.instance.id Prometheus's `instance`: one per rank.
        assert len(set(instances.values())) == len(instances) == 2
        assert captures == {
            (rank, pid): sum(s["num_graphs"] for s in _stats(log).values())
            for (rank, pid, _), log in zip(RANKS, rank_logs, strict=True)
        }


def test_otel_resource_attributes_still_override_the_replayed_identity(
    rank_logs: list[Path], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """OTEL_RESOURCE_ATTRIBUTES beats the writer's rank and pid read from the log (the
    exporter a worker starts beside itself passes its identity that way)."""
    monkeypatch.setenv("OTEL_RESOURCE_ATTRIBUTES", "omnitrace.worker.rank=7,team=encoders")
    with OTLPReceiver() as receiver:
        assert main(["replay", str(rank_logs[1]), "--otlp-endpoint", receiver.endpoint]) == 0
        resources = [attributes(rs.resource.attributes) for rs in receiver.resource_spans()]
    assert resources
    for resource in resources:
        assert (resource["omnitrace.worker.rank"], resource["team"]) == ("7", "encoders")
        assert resource["process.pid"] == 4101


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def test_replay_follow_serves_each_ranks_series_on_one_scrape_endpoint(
    rank_logs: list[Path], capsys: pytest.CaptureFixture[str]
) -> None:
    """One /metrics for two followed ranks: each series labelled with its rank and pid, so
    the two ranks' counters of an encoder never collide."""
    port = _free_port()
    expected = {
        (str(rank), str(pid)): _stats(log)["vision"]["graph_hits"]
        for (rank, pid, _), log in zip(RANKS, rank_logs, strict=True)
    }
    series = re.compile(r"^omnitrace_encoder_graph_hits_total\{(.*)\} ([0-9.]+)$", re.MULTILINE)
    label = re.compile(r'(\w+)="([^"]*)"')

    def vision_hits(text: str) -> dict[tuple[str, str], float]:
        found = {}
        for match in series.finditer(text):
            labels = dict(label.findall(match[1]))
            if labels["omnitrace_encoder"] == "vision":
                key = (labels["omnitrace_worker_rank"], labels["process_pid"])
                found[key] = float(match[2])
        return found

    scraped: dict[tuple[str, str], float] = {}
    done = threading.Event()

    def scrape() -> None:
        while not done.is_set():
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=1) as r:
                    text = r.read().decode()
            except OSError:
                text = ""
            found = vision_hits(text)
            if found == expected:
                scraped.update(found)
                return
            time.sleep(0.1)

    scraper = threading.Thread(target=scrape)
    scraper.start()
    try:
        argv = ["replay", "--follow", "--duration", "4", "--prometheus-port", str(port)]
        code = main([*argv, *map(str, rank_logs)])
    finally:
        done.set()
        scraper.join()
    assert code == 0, capsys.readouterr().err
    assert scraped == expected


def test_advise_over_two_ranks_recommends_one_setting_and_shows_the_spread(
    rank_logs: list[Path], capsys: pytest.CaptureFixture[str]
) -> None:
    """One recommendation for both ranks, then each rank under it and the spread line."""
    assert main(["advise", *map(str, rank_logs)]) == 0
    out = capsys.readouterr().out
    assert "encoder calls of 2 workers" in out
    assert out.count("recommended:") == 1
    assert out.index("per worker, under the recommended setting") < out.index("recommended:")
    assert re.search(r"spread over 2 workers: hit rate [\d.]+ to [\d.]+ %", out), out


def test_advise_json_per_worker_rows_add_up_to_the_recommended_setting(
    rank_logs: list[Path], capsys: pytest.CaptureFixture[str]
) -> None:
    """Each rank replayed alone under the best setting: their calls, hits and graphs sum to
    the best's, and its pool memory is the largest rank's (the budget is per worker)."""
    assert main(["advise", "--json", *map(str, rank_logs)]) == 0
    data = json.loads(capsys.readouterr().out)
    best, spread = data["best"], data["per_worker"]
    rows = spread["workers"]
    assert [(row["rank"], row["pid"]) for row in rows] == [(0, 4100), (1, 4101)]
    for key in ("calls", "hits", "graphs"):
        assert sum(row[key] for row in rows) == best[key], key
    assert max(row["pool_bytes"] for row in rows) == best["pool_bytes"]
    rates = [row["hit_rate"] for row in rows]
    assert (spread["hit_rate_low"], spread["hit_rate_high"]) == (min(rates), max(rates))
    assert rates[0] != rates[1]  # the two ranks' traffic differs


def test_the_spread_replays_each_worker_without_an_object_per_call(
    rank_logs: list[Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The per-worker replay is the grid's (the recording's arrays), equal to the reference
    replay: at ten million calls an object per call is hundreds of megabytes."""
    from omnitrace.advise import Recording, advise, replay
    from omnitrace.advise import recording as advise_record
    from omnitrace.advise.spread import per_worker
    from omnitrace.eventlog import read_records

    recording = Recording.from_records(r for path in rank_logs for r in read_records(path))
    best = advise(recording).best
    assert best is not None
    reference = [
        replay(
            dataclasses.replace(
                recording,
                sequences={worker: recording.sequences[worker]},
                free_bytes={k: v for k, v in recording.free_bytes.items() if k[0] == worker},
            ),
            best.setting,
        )
        for worker in sorted(recording.sequences)
    ]

    def no_objects(self: object) -> None:
        raise AssertionError("the spread made an object per call")

    monkeypatch.setattr(advise_record.CallSequence, "calls", no_objects)
    rows = per_worker(recording, best.setting)
    assert [row.result for row in rows] == reference
