"""``omnitrace demo --ranks N``: one demo process per rank, their logs in one view."""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import structlog
import torch
from rich.console import Console

from omnitrace import derive_stats
from omnitrace.cli import main
from omnitrace.demo.ranks import _forward, _locked, _Rank, rank_log_path, run_ranks
from omnitrace.sinks.jsonl import read_records

REQUESTS = "60"


@pytest.fixture(autouse=True)
def _clean_environment(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    for name in ("OTEL_EXPORTER_OTLP_ENDPOINT", "RANK", "LOCAL_RANK", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    yield
    structlog.reset_defaults()


def test_a_log_path_without_rank_or_pid_gets_the_rank_before_its_suffix() -> None:
    """Ranks never share a file: {rank} is added unless the path names {rank} or {pid}."""
    assert rank_log_path(Path("logs/events.jsonl")) == Path("logs/events-{rank}.jsonl")
    assert rank_log_path(Path("events-{pid}.jsonl")) == Path("events-{pid}.jsonl")
    assert rank_log_path(Path("e-{rank}-{pid}.jsonl")) == Path("e-{rank}-{pid}.jsonl")


class _SlowStderr(io.StringIO):
    """A standard error whose every write lets the other threads run first."""

    def write(self, text: str) -> int:
        time.sleep(0.0002)
        return super().write(text)


def test_two_ranks_lines_reach_standard_error_whole(monkeypatch: pytest.MonkeyPatch) -> None:
    """Two forwarders writing at once never join lines: each line is one JSON object with
    its rank, and each rank's lines keep their order."""
    stderr = _SlowStderr()
    monkeypatch.setattr(sys, "stderr", stderr)
    count = 200
    threads = []
    for rank in (0, 1):
        lines = "".join(
            json.dumps({"event": "graph_captured", "n": n}) + "\n" for n in range(count)
        )
        process: Any = None
        started = _Rank(rank, process, Path(f"e-{rank}.jsonl"), Path(f"s-{rank}.json"))
        threads.append(threading.Thread(target=_forward, args=(started, io.StringIO(lines))))
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    records = [json.loads(line) for line in stderr.getvalue().splitlines()]
    assert len(records) == 2 * count
    for rank in (0, 1):
        assert [r["n"] for r in records if r["rank"] == rank] == list(range(count))


def test_the_launcher_s_own_lines_do_not_split_a_rank_s_line(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A status line printed while a forwarder writes (text and newline apart, as print()
    does) lands between the rank's lines, never inside one."""
    stderr = _SlowStderr()
    monkeypatch.setattr(sys, "stderr", stderr)

    def print_like(text: str) -> None:
        sys.stderr.write(text)
        sys.stderr.write("\n")

    say = _locked(print_like)
    count = 200
    lines = "".join(json.dumps({"event": "graph_captured", "n": n}) + "\n" for n in range(count))
    process: Any = None
    started = _Rank(0, process, Path("e-0.jsonl"), Path("s-0.json"))
    forwarder = threading.Thread(target=_forward, args=(started, io.StringIO(lines)))
    forwarder.start()
    for n in range(count):
        say(f"rank 1: status {n}")
    forwarder.join()
    out = stderr.getvalue().splitlines()
    assert [line for line in out if line.startswith("rank 1: ")] == [
        f"rank 1: status {n}" for n in range(count)
    ]
    records = [json.loads(line) for line in out if not line.startswith("rank 1: ")]
    assert [r["n"] for r in records] == list(range(count))


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """One `demo --ranks 2` run on the simulated backend, its output and its files."""
    directory = tmp_path_factory.mktemp("demo-ranks")
    summary = directory / "summary.json"
    argv = [
        sys.executable,
        "-m",
        "omnitrace",
        "demo",
        "--ranks",
        "2",
        "--cpu",
        "--no-tui",
        "--requests",
        REQUESTS,
        "--hf-overrides",
        '{"encoder_cuda_graph_max_graphs": 3}',
        "--events-log",
        str(directory / "events.jsonl"),
        "--json-summary",
        str(summary),
    ]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK")}
    done = subprocess.run(argv, capture_output=True, text=True, timeout=300, env=env)
    return {
        "code": done.returncode,
        "out": done.stdout,
        "err": done.stderr,
        "logs": sorted(directory.glob("events-*.jsonl")),
        "summary": json.loads(summary.read_text()) if summary.exists() else None,
        "dir": directory,
    }


def test_each_rank_is_a_process_of_its_own_writing_its_own_log(two_ranks: dict[str, Any]) -> None:
    """Two logs, events-0 and events-1, each written by one process whose every line names
    its rank; both ran the options given (the graph cap 3)."""
    assert two_ranks["code"] == 0, two_ranks["err"]
    logs = two_ranks["logs"]
    assert [log.name for log in logs] == ["events-0.jsonl", "events-1.jsonl"]
    sources = [{record.source for record in read_records(log)} for log in logs]
    assert [len(s) for s in sources] == [1, 1]
    (zero,), (one,) = sources
    assert (zero[0], one[0]) == (0, 1)
    assert zero[1] != one[1] != os.getpid()
    for log in logs:
        caps = {r.item.info["max_graphs"] for r in read_records(log) if hasattr(r.item, "info")}
        assert caps == {3}


def test_each_rank_sends_its_own_traffic_and_the_summary_sums_them(
    two_ranks: dict[str, Any],
) -> None:
    """Rank r runs seed + r: the ranks' stats differ, each equals its log's fold, and the
    summary's total is their sum."""
    summary = two_ranks["summary"]
    assert [s["requests"] for s in summary["ranks"]] == [int(REQUESTS)] * 2
    per_rank = [
        derive_stats(r.item for r in read_records(log) if not hasattr(r.item, "info"))
        for log in two_ranks["logs"]
    ]
    assert per_rank[0] != per_rank[1]
    for stats, rank in zip(per_rank, summary["ranks"], strict=True):
        assert {name: {k: s[k] for k in stats[name]} for name, s in rank["encoders"].items()} == (
            stats
        )
    for row in summary["total"]["encoders"]:
        name = row["encoder"]
        assert row["graph_hits"] == sum(stats[name]["graph_hits"] for stats in per_rank)
        assert row["num_graphs"] == sum(stats[name]["num_graphs"] for stats in per_rank)


def test_the_final_frame_shows_both_ranks_and_their_total(two_ranks: dict[str, Any]) -> None:
    """stdout: a column per rank, the total under them; stderr: each rank's lines with its
    rank, and how to look at the logs again."""
    out, err = two_ranks["out"], two_ranks["err"]
    assert "vision · rank 0 · pid" in out
    assert "vision · rank 1 · pid" in out
    assert "total · 2 workers" in out
    assert "omnitrace: starting 2 ranks on the simulated backend" in err
    assert "omnitrace: rank 1: writing the event log to" in err
    pattern = two_ranks["dir"] / "events-*.jsonl"
    assert f"omnitrace: see them again: omnitrace top '{pattern}'" in err
    captured = [json.loads(line) for line in err.splitlines() if '"graph_captured"' in line]
    assert {line["rank"] for line in captured} == {0, 1}


def test_a_rank_that_fails_fails_the_run(tmp_path: Path) -> None:
    """--fail-capture makes each rank's capture fail: the launcher exits 1, as one demo."""
    argv = ["demo", "--ranks", "2", "--cpu", "--no-tui", "--requests", "30"]
    code = main([*argv, "--fail-capture", "audio", "--events-log", str(tmp_path / "e.jsonl")])
    assert code == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["e-0.jsonl", "e-1.jsonl"]


@pytest.mark.skipif(not hasattr(signal, "SIGINT"), reason="needs POSIX signals")
def test_ctrl_c_sent_to_the_launcher_alone_stops_every_rank(tmp_path: Path) -> None:
    """SIGINT to the launcher only (not its process group) is passed on: every rank stops,
    closes its log, and the launcher exits 130 with the final frame."""
    argv = [sys.executable, "-m", "omnitrace", "demo", "--ranks", "2", "--cpu", "--no-tui"]
    argv += ["--requests", "0", "--duration", "120", "--rate", "20"]
    argv += ["--events-log", str(tmp_path / "events.jsonl")]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK")}
    launcher = subprocess.Popen(
        argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
    )
    logs = [tmp_path / "events-0.jsonl", tmp_path / "events-1.jsonl"]
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and not all(
        log.exists() and log.stat().st_size > 2000 for log in logs
    ):
        time.sleep(0.2)
    launcher.send_signal(signal.SIGINT)
    out, err = launcher.communicate(timeout=60)
    assert launcher.returncode == 130, err
    assert "omnitrace: rank 0: interrupted after" in err
    assert "omnitrace: rank 1: interrupted after" in err
    assert "total · 2 workers" in out
    for log in logs:
        finals = [r for r in read_records(log) if hasattr(r.item, "info")]
        assert finals  # each log was written and closed by its rank


def test_more_ranks_than_cuda_devices_is_a_one_line_error(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Two ranks on one CUDA device would share it: refused in one line, naming --cpu."""
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert main(["demo", "--ranks", "2", "--no-tui"]) == 2
    assert capsys.readouterr().err == (
        "omnitrace demo: error: --ranks 2 needs 2 CUDA devices, one per rank (found 1); add "
        "--cpu to run the ranks on the simulated backend\n"
    )


#: A stand-in rank: writes its environment where the launcher asks for its summary.
_FAKE_RANK = (
    "import json, os, sys; "
    "path = sys.argv[sys.argv.index('--json-summary') + 1]; "
    "json.dump({'requests': 0, 'env': dict(os.environ), 'argv': sys.argv}, open(path, 'w'))"
)


def test_each_rank_gets_a_cuda_device_of_its_own_and_a_launchers_variables(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """With two visible CUDA devices (5 and 7), rank r gets the r-th as its only device,
    RANK, LOCAL_RANK and WORLD_SIZE, the seed plus r, and the port plus r."""
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "5,7")
    result = run_ranks(
        ["--requests", "9"],
        ranks=2,
        events_log=tmp_path / "events-{rank}.jsonl",
        seed=40,
        tui=False,
        console=Console(file=io.StringIO()),
        say=lambda line: None,
        prometheus_port=9400,
        command=(sys.executable, "-c", _FAKE_RANK),
    )
    assert not isinstance(result, str)
    assert result.returncodes == [0, 0]
    assert result.devices == ["5", "7"]
    for rank, summary in enumerate(result.summaries):
        assert summary is not None
        env, args = summary["env"], summary["argv"]
        assert (env["CUDA_VISIBLE_DEVICES"], env["RANK"], env["LOCAL_RANK"]) == (
            ("5", "7")[rank],
            str(rank),
            str(rank),
        )
        assert env["WORLD_SIZE"] == "2"
        assert args[args.index("--seed") + 1] == str(40 + rank)
        assert args[args.index("--prometheus-port") + 1] == str(9400 + rank)
        assert args[args.index("--requests") + 1] == "9"
