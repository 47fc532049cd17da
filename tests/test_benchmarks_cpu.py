"""The benchmark suite's CPU subset runs at tiny sizes and writes consistent results.

No timing is asserted: these are benchmarks, not timed tests. What is checked is that the
scripts run, the JSON has its structure, numbers are positive and finite, and counts agree
(nothing dropped, folds saw every event emitted).
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def bench(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    with pytest.MonkeyPatch.context() as mp:
        mp.syspath_prepend(str(ROOT))
        from benchmarks import report, run

        yield run, report


@pytest.fixture(scope="module")
def cpu_results(
    bench: Any, tmp_path_factory: pytest.TempPathFactory
) -> tuple[Path, dict[str, Any]]:
    run, _ = bench
    out = tmp_path_factory.mktemp("bench-cpu")
    code = run.main(["--suite", "cpu", "--tiny", "--no-plots", "--out", str(out)])
    assert code == 0
    return out, json.loads((out / "overhead.json").read_text(encoding="utf-8"))


def _positive(value: float) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value) and value > 0


def test_cpu_suite_writes_result_and_environment(cpu_results: tuple[Path, dict[str, Any]]) -> None:
    """The CPU suite writes overhead.json and summary.json with the run's environment."""
    out, payload = cpu_results
    assert payload["benchmark"] == "overhead"
    assert payload["status"] == "ok"
    assert payload["error"] is None
    env = payload["environment"]
    assert env["torch"] == torch.__version__
    assert env["date_utc"]
    assert "--suite cpu" in env["command"]
    summary = json.loads((out / "summary.json").read_text(encoding="utf-8"))
    assert summary["benchmarks"]["overhead"]["status"] == "ok"
    assert {t["name"] for t in summary["benchmarks"]["overhead"]["targets"]} == {
        t["name"] for t in payload["result"]["targets"]
    }


def test_emit_cost_is_measured_without_drops(cpu_results: tuple[Path, dict[str, Any]]) -> None:
    """Every emit configuration reports positive costs and delivers or folds every event."""
    emit = cpu_results[1]["result"]["emit"]
    assert [(r["subscribers"], r["count"]) for r in emit["rows"]] == [
        ("none", 0),
        ("sinks", 1),
        ("sinks", 4),
        ("folds", 1),
        ("folds", 4),
    ]
    for row in emit["rows"]:
        assert all(_positive(row["per_emit_us"][k]) for k in ("median", "p10", "p90", "mean"))
        assert row["emitted"] == row["expected"]
        assert row["dropped"] == 0
        assert row["flushed"] is True
        assert row["delivered"] == (
            [row["expected"]] * row["count"] if row["subscribers"] == "sinks" else []
        )
        assert row["folded"] == (
            [row["expected"]] * row["count"] if row["subscribers"] == "folds" else []
        )


def test_fold_counts_equal_events(cpu_results: tuple[Path, dict[str, Any]]) -> None:
    """The stats fold counts exactly the hits and misses of the events it was given."""
    fold = cpu_results[1]["result"]["fold"]
    assert _positive(fold["events_per_s"])
    assert fold["folded"] == fold["expected"]
    total = sum(v["graph_hits"] + v["graph_misses"] for v in fold["folded"].values())
    assert total == fold["events"]


def test_bus_throughput_delivers_every_event(cpu_results: tuple[Path, dict[str, Any]]) -> None:
    """Bus throughput runs deliver every event to every sink and fold them all."""
    rows = cpu_results[1]["result"]["throughput"]["rows"]
    assert [r["sinks"] for r in rows] == [0, 1, 4, 1, 4]
    for row in rows:
        assert _positive(row["events_per_s"])
        assert _positive(row["emit_events_per_s"])
        assert row["flushed"] is True
        assert row["emitted"] == row["events"]
        assert row["dropped"] == 0
        assert row["delivered"] == [row["events"]] * row["sinks"]
        assert row["received"] == [row["events"]] * row["sinks"]
        assert row["folded"] == row["expected"]


def test_simulated_hit_path_split_counts_only_hits(
    cpu_results: tuple[Path, dict[str, Any]],
) -> None:
    """The simulated hit-path benchmark times only hits and reports a finite split."""
    hit = cpu_results[1]["result"]["hit_path"]
    assert set(hit["hits"].values()) == {hit["timed_calls"]}
    assert set(hit["misses"].values()) == {0}
    assert hit["dropped"] == 0
    assert hit["delivered"] >= hit["timed_calls"]
    for value in hit["split_us"].values():
        assert math.isfinite(value)
    assert _positive(hit["split_us"]["total"])
    assert _positive(hit["timings_us"]["adapter_bus"]["median"])


def test_cpu_suite_has_targets_and_skips_cuda_part(
    cpu_results: tuple[Path, dict[str, Any]],
) -> None:
    """The CPU suite checks the emit target and records the CUDA comparison as skipped."""
    result = cpu_results[1]["result"]
    assert "skipped" in result["cuda"]
    by_name = {t["name"]: t for t in result["targets"]}
    emit = by_name["emit() with sinks attached"]
    assert _positive(emit["value"])
    assert emit["met"] in (True, False)
    hit = by_name["hit-path host overhead over bare copy-replay-clone"]
    assert hit["value"] is None
    assert hit["met"] is None


def test_report_renders_and_updates_marked_sections(
    bench: Any, cpu_results: tuple[Path, dict[str, Any]]
) -> None:
    """The report turns results into markdown and replaces only the marked sections."""
    _, report = bench
    out, _ = cpu_results
    sections = report.markdown_sections(report.load(out))
    assert set(sections) == {"environment", "targets", "overhead"}
    assert "EventBus.emit() cost" in sections["overhead"]
    doc = (
        "intro\n<!-- BEGIN bench:overhead -->\nOUTDATED\n<!-- END bench:overhead -->\n"
        "<!-- BEGIN bench:latency -->\nkeep\n<!-- END bench:latency -->\n"
    )
    updated = report.update_document(doc, sections)
    assert "OUTDATED" not in updated
    assert "EventBus.emit() cost" in updated
    assert "keep" in updated
    assert updated.startswith("intro\n")
    assert "summary" in report.text_summary(report.load(out))


def _cli(
    *args: str, tmp: Path, extra_env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
        **(extra_env or {}),
    }
    return subprocess.run(
        [sys.executable, "-W", "error", "-m", "benchmarks.run", *args, "--out", str(tmp)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )


@pytest.mark.skipif(
    torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA"
)
def test_gpu_suites_refuse_to_start_without_cuda(tmp_path: Path) -> None:
    """A CUDA suite on a machine without CUDA exits with status 2 and says what to run."""
    done = _cli("--suite", "latency", tmp=tmp_path)
    assert done.returncode == 2
    assert "need a CUDA device" in done.stderr
    assert "--suite cpu" in done.stderr
    assert not list(tmp_path.iterdir())


def test_every_suite_runs_simulated_on_cpu(tmp_path: Path) -> None:
    """Every benchmark runs end to end on the simulated backend, so the GPU scripts cannot rot."""
    done = _cli("--suite", "all", "--simulate", "--tiny", "--no-plots", tmp=tmp_path)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    for name in ("overhead", "memory", "traffic", "observability", "latency"):
        payload = json.loads((tmp_path / f"{name}.json").read_text(encoding="utf-8"))
        assert payload["status"] == "ok", payload.get("traceback")
        assert payload["environment"]["simulated"] is True
    latency = json.loads((tmp_path / "latency.json").read_text(encoding="utf-8"))["result"]
    for row in latency["rows"]:
        assert row["adapter_hits"] == row["adapter_timed_calls"]
        assert _positive(row["methods"]["adapter"]["latency_us"]["median"])
    traffic = json.loads((tmp_path / "traffic.json").read_text(encoding="utf-8"))["result"]
    for row in traffic["rows"]:
        assert row["calls"] == traffic["stream"]["requests"]
        assert row["stats_agree_with_bus"] is True
        assert row["captures"] <= 2 * row["max_graphs"]
    memory = json.loads((tmp_path / "memory.json").read_text(encoding="utf-8"))["result"]
    high, low = memory["floor"]["rows"]
    assert (high["num_graphs"], low["num_graphs"]) == (0, 1)
    assert high["memory_misses"] == high["calls"] - 1
    for row in latency["rows"]:
        assert row["child"]["status"] == "ok"
        assert row["failure"] is None
    assert len(list((tmp_path / "latency-points").glob("point-*.json"))) == len(latency["rows"])
    obs = json.loads((tmp_path / "observability.json").read_text(encoding="utf-8"))["result"]
    assert list(obs["arms"]) == [
        "no_bus",
        "bus_no_sinks",
        "otel",
        "logs",
        "jsonl",
        "live",
        "production",
        "all_sinks",
    ]
    assert obs["same_counts_in_every_arm"] is True
    assert obs["flushed"] is True
    for arm in obs["arms"].values():
        assert len(arm["rounds_calls_per_s"]) == obs["rounds"]
        assert arm["vs_baseline"]["rounds"] == obs["rounds"]
        assert arm["dropped"] in (None, 0)
    assert obs["arms"]["bus_no_sinks"]["vs_baseline"]["loss"] == 0.0


def test_rotated_puts_every_method_in_every_position() -> None:
    """Over n rounds each method takes every position once, so none always runs after eager."""
    from benchmarks.common import rotated

    names = ["eager", "adapter", "bare", "replay_only", "compile"]
    orders = [rotated(names, r) for r in range(len(names))]
    for position in range(len(names)):
        assert sorted(order[position] for order in orders) == sorted(names)
    # Whatever follows eager in one round opens another round, with nothing before it.
    for name in names[1:]:
        follows_eager = sum(1 for o in orders if o.index(name) == o.index("eager") + 1)
        assert follows_eager < len(orders)
    assert {order[0] for order in orders} == set(names)
    assert rotated(names, 7) == names[2:] + names[:2]


def test_paired_loss_cancels_slow_rounds_shared_by_both_arms() -> None:
    """A slow phase that hits both arms of a round leaves the paired median loss unchanged."""
    from benchmarks.observability import paired_loss

    base = [600.0, 360.0, 600.0, 600.0, 400.0, 600.0, 620.0, 410.0]
    arm = [b * 0.99 for b in base]
    result = paired_loss(base, arm)
    assert result["rounds"] == len(base)
    assert result["loss"] == pytest.approx(0.01)
    assert result["loss_total"] == pytest.approx(0.01)
    assert paired_loss(base, base)["loss"] == 0.0
    with pytest.raises(ValueError, match="same, non-zero number of rounds"):
        paired_loss(base, arm[:-1])


def test_latency_records_a_crashed_configuration_and_runs_the_rest(tmp_path: Path) -> None:
    """A configuration whose process segfaults is recorded with its signal; the next still runs."""
    done = _cli(
        "--suite",
        "latency",
        "--simulate",
        "--tiny",
        "--no-plots",
        tmp=tmp_path,
        extra_env={"OMNITRACE_BENCH_LATENCY_FAULT": "0:segv"},
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    payload = json.loads((tmp_path / "latency.json").read_text(encoding="utf-8"))
    assert payload["status"] == "ok"
    crashed, fine = payload["result"]["rows"]
    assert crashed["child"]["status"] == "crashed"
    assert crashed["child"]["signal"] == "SIGSEGV"
    assert crashed["child"]["stage"] == "timing"
    assert any("Segmentation fault" in line for line in crashed["child"]["stderr_tail"])
    assert "SIGSEGV" in crashed["failure"]
    assert fine["child"]["status"] == "ok"
    assert fine["adapter_hits"] == fine["adapter_timed_calls"] > 0
    by_name = {t["name"]: t for t in payload["result"]["targets"]}
    failed = by_name["configurations whose process crashed, hung or failed"]
    assert (failed["value"], failed["met"]) == (1.0, False)


def test_latency_child_past_its_timeout_is_stopped_with_a_traceback(
    bench: Any, tmp_path: Path
) -> None:
    """A hung configuration is killed at its timeout, with faulthandler's traceback kept."""
    from benchmarks import latency

    spec = {
        "index": 0,
        "encoder": "audio",
        "what": "1 s chunk",
        "size": 100,
        "batch": 1,
        "simulate": True,
        "scale": "tiny",
        "warmup": 1,
        "per_round": 2,
        "cycles": 1,
        "compile": False,
        "compile_skip": "skipped: needs CUDA",
        "compile_limit_s": None,
        "fault": {"kind": "hang", "stage": "timing"},
    }
    lines: list[str] = []
    outcome = latency.run_child(spec, tmp_path, timeout_s=20.0, log=lines.append)
    child = outcome["child"]
    assert child["status"] == "timeout"
    assert child["stage"] == "timing"
    assert any("latency_point.py" in line for line in child["stderr_tail"])
    assert outcome["record"]["row"]["methods"]["adapter"]["max_rel_err"] == 0.0
    assert any("[timing]" in line for line in lines)


def test_report_renders_a_partial_result(bench: Any) -> None:
    """A result left by an interrupted run is rendered and marked partial, not failed."""
    _, report = bench
    payload = {
        "benchmark": "observability",
        "environment": {"torch": torch.__version__},
        "status": "partial",
        "error": None,
        "result": {
            "arms": {},
            "sinks": {},
            "targets": [
                {
                    "name": "t",
                    "value": 1.0,
                    "op": "<",
                    "limit": 2.0,
                    "unit": "%",
                    "met": True,
                    "note": "",
                }
            ],
        },
    }
    sections = report.markdown_sections({"observability": payload})
    assert sections["observability"].startswith("_Partial")
    assert "t (partial run)" in sections["targets"]
