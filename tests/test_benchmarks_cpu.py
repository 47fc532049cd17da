"""The benchmark suite's CPU subset runs at tiny sizes and writes consistent results.

No timing is asserted: these are benchmarks, not timed tests. What is checked is that the
scripts run, the JSON has its structure, numbers are positive and finite, and counts agree
(nothing dropped, folds saw every event emitted).
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import re
import signal
import subprocess
import sys
import textwrap
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace
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
    with pytest.MonkeyPatch.context() as mp:
        # The event-log benchmark's logs, written for this run only.
        mp.setenv("OMNITRACE_BENCH_EVENTLOG_DIR", str(tmp_path_factory.mktemp("eventlogs")))
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
    assert _positive(emit["bus_fold_us"]["median"])
    for row in emit["rows"]:
        assert all(_positive(row["per_emit_us"][k]) for k in ("median", "p10", "p90", "mean"))
        assert _positive(row["per_emit_cpu_us"]["median"])
        # Every emit runs the bus's fold; the thread's CPU time never exceeds the wall time
        # by more than the clocks' disagreement.
        assert row["per_emit_cpu_us"]["median"] > emit["bus_fold_us"]["median"] / 2
        assert row["per_emit_cpu_us"]["median"] <= row["per_emit_us"]["median"] * 1.2
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
    emit = by_name["emit() with sinks attached, the calling thread's CPU time"]
    rows = result["emit"]["rows"]
    worst = max(r["per_emit_cpu_us"]["median"] for r in rows if r["subscribers"] == "sinks")
    assert emit["value"] == worst
    assert emit["met"] is (worst <= 1.0)
    hit = by_name["hit-path host overhead over bare copy-replay-clone"]
    assert hit["value"] is None
    assert hit["met"] is None


def test_eventlog_runs_every_tool_on_every_log_in_a_child_of_its_own(
    cpu_results: tuple[Path, dict[str, Any]],
) -> None:
    """The event-log benchmark runs top, replay, advise and read_events on each log, each
    exiting 0 with output, and reports each one's time, CPU time and peak memory."""
    out, _ = cpu_results
    payload = json.loads((out / "eventlog.json").read_text(encoding="utf-8"))
    assert payload["status"] == "ok"
    result = payload["result"]
    sizes = [log["events"] for log in result["logs"]]
    assert sizes == [1_000, 4_000]
    assert all(log["bytes"] > 100 * log["events"] for log in result["logs"])
    rows = result["rows"]
    assert sorted((r["tool"], r["events"]) for r in rows) == sorted(
        (tool, size) for tool in ("top", "replay", "advise", "read_events") for size in sizes
    )
    for row in rows:
        assert row["status"] == 0, row["stderr"]
        assert row["stdout_bytes"] > 0
        assert _positive(row["wall_s"])
        assert _positive(row["cpu_s"])
        # The tool's own process image: far below the runner's, which holds torch.
        assert 5 < row["peak_rss_mb"] < 200
    figures = {f["name"] for f in result["figures"]}
    assert "advise peak memory, 4,000 over 1,000 events" in figures
    assert all(f["goal"] == "eventlog_scale" for f in result["figures"])


def test_report_renders_and_updates_marked_sections(
    bench: Any, cpu_results: tuple[Path, dict[str, Any]]
) -> None:
    """The report turns results into markdown and replaces only the marked sections."""
    _, report = bench
    out, _ = cpu_results
    sections = report.markdown_sections(report.load(out))
    assert set(sections) == {"environment", "goals", "targets", "overhead", "eventlog"}
    assert "Event-log tools by log size" in sections["eventlog"]
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


def _env() -> dict[str, str]:
    return {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }


def _cli(*args: str, tmp: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-W", "error", "-m", "benchmarks.run", *args, "--out", str(tmp)],
        cwd=ROOT,
        env=_env(),
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


@pytest.fixture(scope="module")
def simulated(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any]:
    """Run every suite once, simulated on CPU, in a process of its own."""
    out = tmp_path_factory.mktemp("bench-simulated")
    return out, _cli("--suite", "all", "--simulate", "--tiny", "--no-plots", tmp=out)


def _result(out: Path, name: str) -> dict[str, Any]:
    payload = json.loads((out / f"{name}.json").read_text(encoding="utf-8"))
    result: dict[str, Any] = payload["result"]
    return result


def test_every_suite_runs_simulated_on_cpu(simulated: tuple[Path, Any]) -> None:
    """Every benchmark runs end to end on the simulated backend, so the GPU scripts cannot rot."""
    out, done = simulated
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    for name in ("overhead", "memory", "observability", "latency"):
        payload = json.loads((out / f"{name}.json").read_text(encoding="utf-8"))
        assert payload["status"] == "ok", payload.get("traceback")
        assert payload["environment"]["simulated"] is True
    memory = _result(out, "memory")
    high, low = memory["floor"]["rows"]
    assert (high["num_graphs"], low["num_graphs"]) == (0, 1)
    assert high["memory_misses"] == high["calls"] - 1
    obs = _result(out, "observability")
    assert list(obs["arms"]) == [
        "no_bus",
        "bus_no_sinks",
        "otel",
        "logs",
        "jsonl",
        "live",
        "production",
        "production_relayed",
        "all_sinks",
    ]
    relayed = obs["arms"]["production_relayed"]
    assert relayed["sinks_on"] == ["logs", "jsonl", "relay"]
    # The relay process relayed every event of its arm's log and scraped its /metrics.
    assert relayed["relay"]["exit_code"] == 0
    assert relayed["relay"]["relayed_events"] == relayed["emitted"] > 0
    assert relayed["relay"]["scrapes"] >= 1
    assert relayed["relay"]["scrape_failures"] == 0
    (check,) = obs["targets"]
    assert check["value"] is not None
    assert obs["same_counts_in_every_arm"] is True
    assert obs["flushed"] is True
    for arm in obs["arms"].values():
        assert len(arm["rounds_calls_per_s"]) == obs["rounds"]
        assert arm["vs_baseline"]["rounds"] == obs["rounds"]
        assert arm["dropped"] in (None, 0)
    assert obs["arms"]["bus_no_sinks"]["vs_baseline"]["loss"] == 0.0


#: Every latency arm, in the order the benchmark builds and reports them.
LATENCY_ARMS = [
    "eager",
    "bare",
    "replay_only",
    "adapter",
    "adapter_bus",
    "adapter_timed",
    "adapter_vllm",
    "adapter_sinks",
    "compile",
    "adapter_compiled",
]
#: Arms that wrap an adapter, whose timed calls must all be hits.
ADAPTER_ARMS = ["adapter", "adapter_bus", "adapter_timed", "adapter_sinks", "adapter_compiled"]


def test_latency_rows_hold_every_arm_measured_in_one_process(
    simulated: tuple[Path, Any],
) -> None:
    """Each latency row has every arm, timed with hits checked, or skipped with its reason."""
    out, _ = simulated
    latency = _result(out, "latency")
    assert latency["process"].startswith("every shape and arm in the runner's process")
    assert [a["name"] for a in latency["arms"]] == LATENCY_ARMS
    assert not (out / "latency-points").exists()
    # Batch 1 audio runs first (a goal shape), but rows are stored in display order.
    assert latency["shape_order"] == ["audio 1 s chunk batch 1", "vision 1024 tokens batch 1"]
    assert [r["label"] for r in latency["rows"]] == ["vision 1024 tokens", "audio 1 s chunk"]
    vllm_reason = "needs CUDA" if importlib.util.find_spec("vllm") else "vLLM not importable"
    for row in latency["rows"]:
        methods = row["methods"]
        assert list(methods) == LATENCY_ARMS
        assert row["errors"] == []
        assert methods["adapter_vllm"]["skipped"] == vllm_reason
        for name in LATENCY_ARMS:
            if name == "adapter_vllm":
                continue
            entry = methods[name]
            assert _positive(entry["latency_us"]["median"]), name
            assert _positive(entry["host_us"]["median"]), name
            assert entry["host_us"]["n"] == entry["latency_us"]["n"] == row["rounds"] * 3
        for name in ADAPTER_ARMS:
            assert methods[name]["hits"] == methods[name]["timed_calls"] > 0
            assert methods[name]["misses"] == 0
        assert _positive(methods["compile"]["compile_s"])
        assert _positive(methods["adapter_compiled"]["compile_s"])
        assert methods["adapter_compiled"]["within_tolerance"] is True
        timed = methods["adapter_timed"]
        assert timed["timings_resolved"] is True
        # Once after building, once after the warm-up, once after every round.
        assert timed["timing_flushes"] == row["rounds"] + 2
        assert row["outputs_match"] is True
        for key in (
            "adapter_over_bare",
            "adapter_bus_over_adapter",
            "adapter_timed_over_adapter",
            "adapter_sinks_over_adapter",
            "adapter_compiled_over_compile",
        ):
            assert math.isfinite(row["ratios"][key])
            assert math.isfinite(row["host_over_us"][key])
        assert row["ratios"]["adapter_vllm_over_bare"] is None
    sinks = latency["sinks"]
    assert sinks["status"] == "on"
    assert sinks["flushed"] is True
    assert sinks["dropped"] == 0
    assert [s["delivered"] for s in sinks["per_sink"]] == [sinks["emitted"]] * 3


def test_latency_targets_include_the_hit_path_goals(simulated: tuple[Path, Any]) -> None:
    """Latency targets check adapter vs bare (1 %, 3 us host) for both backends, and hits."""
    out, _ = simulated
    by_name = {t["name"]: t for t in _result(out, "latency")["targets"]}
    torch_ratio = by_name["adapter (torch) vs bare copy-replay-clone, worst shape"]
    assert (torch_ratio["op"], torch_ratio["limit"], torch_ratio["unit"]) == ("<=", 1.0, "%")
    assert torch_ratio["met"] in (True, False)
    host = by_name["adapter (torch) host time over bare, worst shape"]
    assert (host["op"], host["limit"], host["unit"]) == ("<=", 3.0, "us")
    vllm = by_name["adapter (vLLM) vs bare copy-replay-clone, worst shape"]
    assert (vllm["value"], vllm["met"]) == (None, None)
    assert "not measured: " in vllm["note"]
    assert by_name["timed adapter calls that were not hits"]["value"] == 0.0
    assert by_name["events the production sinks dropped or failed on"]["value"] == 0.0
    bus = by_name["adapter with a bus (its folds) host time over bare, worst shape"]
    assert (bus["op"], bus["limit"], bus["goal"]) == ("<=", 3.0, "hit_path")
    assert math.isfinite(bus["value"])
    err = by_name["compiled adapter output vs eager, max relative error, worst shape"]
    assert (err["op"], err["limit"], err["goal"], err["met"]) == ("<=", 0.1, "compiled", True)
    assert "measured at 2 of 2 shapes" in err["note"]
    assert by_name["device timings left unresolved after a round"]["value"] == 0.0


def test_latency_figures_report_the_costs_of_the_folds_and_of_device_timing(
    simulated: tuple[Path, Any],
) -> None:
    """The bus's and device timing's hit-path costs are figures, worst shape, host and latency."""
    out, _ = simulated
    latency = _result(out, "latency")
    figures = {f["name"]: f for f in latency["figures"]}
    assert set(figures) == {
        f"hit-path cost of {what}: {kind}, worst shape"
        for what in (
            "the bus's folds (adapter + bus - adapter)",
            "device timing (adapter + device timing - adapter)",
        )
        for kind in ("host time", "latency")
    }
    for item in figures.values():
        assert item["goal"] == "coverage_costs"
        assert math.isfinite(item["value"])
    host = figures[
        "hit-path cost of the bus's folds (adapter + bus - adapter): host time, worst shape"
    ]
    worst = max(r["host_over_us"]["adapter_bus_over_adapter"] for r in latency["rows"])
    assert host["value"] == worst


def test_latency_report_shows_every_arm_with_skip_reasons(
    bench: Any, simulated: tuple[Path, Any]
) -> None:
    """The latency table has a column per arm; a skipped arm's cell says why."""
    _, report = bench
    out, done = simulated
    section = report.markdown_sections(report.load(out))["latency"]
    header = section.splitlines()[2]
    for title in (
        "eager",
        "bare graph",
        "adapter, torch (vs bare / compile)",
        "adapter + bus (vs bare / adapter)",
        "adapter + device timing (vs bare / adapter)",
        "adapter, vLLM (vs bare / adapter)",
        "adapter + sinks (vs adapter)",
        "reduce-overhead (vs bare)",
        "adapter over torch.compile (vs bare / compile)",
    ):
        assert f"| {title} |" in header
    assert "skipped (vLLM not importable)" in section or "skipped (needs CUDA)" in section
    assert "Host time per call" in section
    # The runner prints the same table in its summary.
    assert "adapter over torch.compile (vs bare / compile)" in done.stdout


def test_goals_table_lists_every_goal_with_its_checks_and_figures(
    bench: Any, simulated: tuple[Path, Any]
) -> None:
    """The goals section names every goal once, with its checks, verdicts and reported costs."""
    _, report = bench
    out, done = simulated
    section = report.markdown_sections(report.load(out))["goals"]
    for text in report.GOALS.values():
        assert section.count(f"| {text} |") == 1
    assert "(no check in these results)" not in section
    for check in (
        "adapter (torch) vs bare copy-replay-clone, worst shape",
        "compiled adapter vs reduce-overhead, worst audio shape",
        "throughput loss with the production sinks (OTel relayed from the event log by "
        "another process; logs and JSONL in process)",
        "throughput loss with OTel, logs and JSONL all in the serving process",
        "hit-path cost of device timing (adapter + device timing - adapter): host time, "
        "worst shape",
    ):
        assert f"| {check} |" in section
    assert section.count("| reported |") == 5
    assert "\nGoals\n" in done.stdout


def test_report_renders_results_of_an_earlier_benchmark_version(bench: Any) -> None:
    """Results committed by an earlier version still render; their goals read not measured."""
    _, report = bench
    outputs = report.load(ROOT / "benchmarks" / "results" / "h200-2026-11-29")
    assert set(outputs) == {"overhead", "memory", "observability", "latency"}
    sections = report.markdown_sections(outputs)
    assert "| adapter, torch (vs bare / compile) |" in sections["latency"].splitlines()[2]
    assert sections["goals"].count("(no check in these results)") == len(report.GOALS)
    assert "throughput loss with all sinks on" in sections["targets"]


def test_simulated_compile_defaults_to_the_eager_backend_only_in_simulated_runs() -> None:
    """Inside a simulated run torch.compile gets backend='eager' and no mode; else untouched."""
    from benchmarks.common import Context, simulated_compile

    original = torch.compile
    seen: list[dict[str, Any]] = []

    def spy(*args: Any, **kwargs: Any) -> Any:
        seen.append(kwargs)
        return args[0]

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(torch, "compile", spy)
        with simulated_compile(Context(simulate=False)):
            torch.compile(len, mode="reduce-overhead")
        with simulated_compile(Context(simulate=True)):
            torch.compile(len, mode="reduce-overhead", dynamic=False)
            torch.compile(len, backend="inductor")
        assert torch.compile is spy
    assert torch.compile is original
    assert seen == [
        {"mode": "reduce-overhead"},
        {"dynamic": False, "backend": "eager"},
        {"backend": "inductor"},
    ]


@pytest.fixture
def in_process(
    bench: Any, monkeypatch: pytest.MonkeyPatch
) -> Iterator[Callable[..., tuple[int, Path]]]:
    """Run ``benchmarks.run.main`` here, with the latency arms replaced by ``arms``."""
    from benchmarks import latency

    run, _ = bench
    threads = torch.get_num_threads()

    def go(out: Path, arms: list[Any], *extra: str) -> tuple[int, Path]:
        monkeypatch.setattr(latency, "ARMS", arms)
        argv = ["--suite", "latency", "--simulate", "--tiny", "--no-plots", *extra]
        return run.main([*argv, "--out", str(out)]), out

    yield go
    torch.set_num_threads(threads)


def _arms(*names: str) -> list[Any]:
    from benchmarks import latency

    return [a for a in latency.ARMS if a.name in names]


def _explode(point: Any) -> Any:
    raise RuntimeError("arm exploded on purpose")


def test_an_arm_that_raises_fails_the_run_with_its_traceback(
    in_process: Callable[..., tuple[int, Path]], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """An exception building an arm exits 1, printed and recorded; the other arms still run."""
    from benchmarks.latency_arms import Arm

    arms = [*_arms("eager", "adapter"), Arm("exploding", "exploding", _explode, (), None, False)]
    code, out = in_process(tmp_path, arms)
    assert code == 1
    payload = json.loads((out / "latency.json").read_text(encoding="utf-8"))
    assert payload["status"] == "error"
    assert payload["error"].startswith("BenchmarkFailedError: 2 arm build(s) failed: ")
    assert "exploding: RuntimeError: arm exploded on purpose" in payload["error"]
    for row in payload["result"]["rows"]:
        entry = row["methods"]["exploding"]
        assert entry["error"] == "RuntimeError: arm exploded on purpose"
        assert "in _explode" in entry["traceback"]
        assert _positive(row["methods"]["adapter"]["latency_us"]["median"])
    summary = json.loads((out / "summary.json").read_text(encoding="utf-8"))
    assert summary["benchmarks"]["latency"]["status"] == "error"
    printed = capsys.readouterr().out
    assert "exploding: FAILED: RuntimeError: arm exploded on purpose" in printed
    assert "Traceback (most recent call last)" in printed
    assert "latency: error in " in printed


def test_a_timed_call_that_raises_fails_at_once_keeping_earlier_shapes(
    in_process: Callable[..., tuple[int, Path]], tmp_path: Path
) -> None:
    """An exception while timing stops the benchmark, status error, with the shapes measured."""
    from benchmarks.latency_arms import Arm, Timed

    def flaky(point: Any) -> Any:
        calls = []

        def call() -> Any:
            calls.append(1)
            if point.shape.encoder == "vision" and len(calls) > 1:
                raise RuntimeError("timed call failed on purpose")
            return point.model(point.x)

        return Timed(call)

    code, out = in_process(
        tmp_path, [*_arms("eager"), Arm("flaky", "flaky", flaky, (), None, False)]
    )
    assert code == 1
    payload = json.loads((out / "latency.json").read_text(encoding="utf-8"))
    assert payload["status"] == "error"
    assert payload["error"] == "RuntimeError: timed call failed on purpose"
    assert "in call" in payload["traceback"]
    # The audio shape ran first and was measured; the failing vision shape left no row.
    assert [r["label"] for r in payload["result"]["rows"]] == ["audio 1 s chunk"]


def test_compiles_are_skipped_past_the_time_budget(
    in_process: Callable[..., tuple[int, Path]], tmp_path: Path
) -> None:
    """With no time left, the compiling arms are skipped with the reason; the rest run."""
    code, out = in_process(
        tmp_path, _arms("eager", "adapter", "compile", "adapter_compiled"), "--time-budget", "0"
    )
    assert code == 0
    result = _result(out, "latency")
    for row in result["rows"]:
        for name in ("compile", "adapter_compiled"):
            assert row["methods"][name]["skipped"] == "time budget"
            assert "s left for compiling, a compile takes about" in row["methods"][name]["detail"]
        assert row["methods"]["adapter"]["hits"] == row["methods"]["adapter"]["timed_calls"]


def test_a_fatal_signal_ends_the_run_and_keeps_the_shapes_measured(tmp_path: Path) -> None:
    """A segfault is not contained: the run dies with the signal and faulthandler's traceback."""
    script = textwrap.dedent(
        """
        import faulthandler, sys
        from benchmarks import latency, latency_arms, run

        def crash(point):
            if point.shape.encoder == "vision":
                faulthandler._sigsegv()
            return latency_arms.Timed(lambda: point.model(point.x))

        latency.ARMS[:] = [a for a in latency.ARMS if a.name in ("eager", "adapter")]
        latency_arms.arm("crash", "crash")(crash)
        sys.exit(run.main(sys.argv[1:]))
        """
    )
    argv = ["--suite", "latency", "--simulate", "--tiny", "--no-plots", "--out", str(tmp_path)]
    done = subprocess.run(
        [sys.executable, "-c", script, *argv],
        cwd=ROOT,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert done.returncode == -signal.SIGSEGV, done.stdout[-2000:] + done.stderr[-2000:]
    assert "Fatal Python error: Segmentation fault" in done.stderr
    # faulthandler's dump names the crashing arm and the benchmark frames around it.
    assert ' in crash\n  File "' in done.stderr
    assert 'benchmarks/latency.py", line ' in done.stderr
    payload = json.loads((tmp_path / "latency.json").read_text(encoding="utf-8"))
    assert payload["status"] == "partial"
    assert [r["label"] for r in payload["result"]["rows"]] == ["audio 1 s chunk"]


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


def test_report_environment_names_every_run_of_combined_results(bench: Any) -> None:
    """Results gathered from several runs say which run measured which benchmark."""
    _, report = bench

    def payload(date: str, command: str) -> dict[str, Any]:
        env = {"date_utc": date, "command": command, "git_commit": "abc", "gpu": "G"}
        return {"environment": env, "status": "ok", "error": None, "result": None}

    one = report.markdown_sections({"overhead": payload("d1", "run a")})["environment"]
    assert "Runs" not in one
    assert "- Command: `run a`" in one
    both = report.markdown_sections(
        {
            "overhead": payload("d1", "run a"),
            "memory": payload("d1", "run a"),
            "latency": payload("d2", "run b"),
        }
    )["environment"]
    assert "- Command:" not in both
    assert "  - d1: `run a` at abc: overhead, memory" in both
    assert "  - d2: `run b` at abc: latency" in both


def _rank_log(path: Path, events: list[dict[str, object]]) -> Path:
    path.write_text("".join(json.dumps(e) + "\n" for e in events))
    return path


def test_engine_figures_add_up_the_ranks_logs_and_take_the_slowest_ranks_device_time(
    tmp_path: Path,
) -> None:
    """Each rank's log is counted; per worker and per adapter; device time is the slowest's."""
    from benchmarks import engine_checks

    captured = {"type": "GraphCaptured", "adapter": "vision", "bytes_reserved": 100}
    rank0 = _rank_log(
        tmp_path / "events-0-11.jsonl",
        [
            {**captured, "static_bytes": 10},
            {"type": "GraphReplayed", "adapter": "vision"},
            {"type": "GraphMissed", "adapter": "audio", "reason": "capacity", "detail": "budget"},
            {"type": "DeviceTimed", "adapter": "vision", "device_s": 0.5},
            {"type": "DeviceTimed", "adapter": "vision", "device_s": 0.25},
        ],
    )
    rank1 = _rank_log(
        tmp_path / "events-1-12.jsonl",
        [
            {**captured, "static_bytes": 20},
            {"type": "GraphMissed", "adapter": "audio", "reason": "warmup"},
            {"type": "DeviceTimed", "adapter": "vision", "device_s": 0.5},
        ],
    )
    figures = engine_checks.event_figures([rank0, rank1])
    assert (figures["graphs"], figures["hits"], figures["misses"]) == (2, 1, 2)
    assert figures["pool_bytes"] == 230
    assert figures["workers"] == {
        "events-0-11": {"graphs": 1, "pool_bytes": 110},
        "events-1-12": {"graphs": 1, "pool_bytes": 120},
    }
    assert figures["adapters"]["audio"]["misses"] == {"capacity": 1, "warmup": 1}
    # By reason and detail where the event has one: a capacity miss of the pool budget.
    assert figures["adapters"]["audio"]["miss_details"] == {"capacity/budget": 1, "warmup": 1}
    since = engine_checks.hits_since([rank0, rank1], {})
    assert since["encoders"]["audio"]["miss_details"] == {"capacity/budget": 1, "warmup": 1}
    assert figures["encoder_device_s"] == {"vision": 1.25}
    # The slowest rank after the lines already read: rank 0 has 0.75 s in all, 0.25 s after
    # its first four lines; rank 1 has 0.5 s.
    assert engine_checks.device_s_since([rank0, rank1], {}) == 0.75
    assert engine_checks.device_s_since([rank0, rank1], {rank0: 4}) == 0.5
    assert engine_checks.device_s_since([rank0], {rank0: 5}) is None
    assert engine_checks.line_counts([rank0, rank1]) == {rank0: 5, rank1: 3}


def test_cold_passes_send_each_concurrency_twice_and_count_the_first_ones_calls(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Before the measured passes, the traffic runs twice at each concurrency above one, with
    media of their own; the first run's TTFT and the encoder calls logged during it are kept,
    the second's calls are not counted as the first's."""
    from benchmarks import engine
    from benchmarks.engine_serving import Completion, Pass

    monkeypatch.setattr(engine.time, "sleep", lambda seconds: None)
    log = tmp_path / "events-0-1.jsonl"
    log.write_text(json.dumps({"type": "GraphReplayed", "adapter": "vision"}) + "\n")
    server = SimpleNamespace(events=[log], config=SimpleNamespace(plugin=True))
    sent: list[tuple[int, int]] = []

    def send(traffic: list[str], *, seed: int, concurrency: int, tokens: int) -> Pass:
        sent.append((seed, concurrency))
        first = seed < 1000
        event = {"type": "GraphMissed", "adapter": "vision", "reason": "warmup"}
        if not first:
            event = {"type": "GraphReplayed", "adapter": "audio"}
        with log.open("a") as lines:
            lines.write(json.dumps(event) + "\n")
        ttft = [0.1 * (i + 1) for i in range(len(traffic))]
        done = [Completion(kind, t, t, [1]) for kind, t in zip(traffic, ttft, strict=True)]
        return Pass(concurrency, 2.0, done)

    cold = engine._cold_passes(server, send, ["a", "b", "c"], [8, 32], 4)
    assert sent == [(508, 8), (1508, 8), (532, 32), (1532, 32)]
    assert set(cold) == {"c8", "c32"}
    c8 = cold["c8"]
    assert (c8["ttft_p50_ms"], c8["ttft_p99_ms"]) == (pytest.approx(200.0), pytest.approx(300.0))
    assert c8["requests_per_s"] == pytest.approx(1.5)
    # The first run's one miss, not the replay logged before it nor the second run's.
    assert c8["hits"]["calls"] == 1
    assert c8["hits"]["encoders"]["vision"]["misses"] == {"warmup": 1}
    assert cold["c32"]["hits"]["calls"] == 1
    # The measured seeds (200 + c + 1000 r) are not reused: new media, no processor cache hit.
    assert not {seed for seed, _ in sent} & {200 + c + 1000 * r for c in (8, 32) for r in range(3)}
    server.config.plugin = False
    assert engine._cold_passes(server, send, ["a"], [2], 1)["c2"]["hits"] is None


@pytest.mark.parametrize(("value", "expected"), [("", 1), ("2", 2), (" 4 ", 4)])
def test_engine_tensor_parallel_size_reads_its_variable(
    monkeypatch: pytest.MonkeyPatch, value: str, expected: int
) -> None:
    from benchmarks import engine_serving

    monkeypatch.setenv("OMNITRACE_BENCH_ENGINE_TP", value)
    assert engine_serving.tensor_parallel_size() == expected


@pytest.mark.parametrize("value", ["0", "9", "two", "-1", "1.5"])
def test_engine_tensor_parallel_size_refuses_what_is_not_a_size(
    monkeypatch: pytest.MonkeyPatch, value: str
) -> None:
    from benchmarks import engine_serving

    monkeypatch.setenv("OMNITRACE_BENCH_ENGINE_TP", value)
    with pytest.raises(ValueError, match="OMNITRACE_BENCH_ENGINE_TP: expected a whole number"):
        engine_serving.tensor_parallel_size()


@pytest.mark.parametrize("value", ["qwen", ",", "minicpmo,qwen"])
def test_engine_models_refuses_unknown_names(monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    from benchmarks import engine

    monkeypatch.setenv("OMNITRACE_BENCH_ENGINE_MODELS", value)
    with pytest.raises(ValueError, match="OMNITRACE_BENCH_ENGINE_MODELS"):
        engine.models()


def test_engine_models_reads_a_list(monkeypatch: pytest.MonkeyPatch) -> None:
    from benchmarks import engine

    monkeypatch.setenv("OMNITRACE_BENCH_ENGINE_MODELS", " minicpmo, ")
    assert engine.models() == ["minicpmo"]
    monkeypatch.delenv("OMNITRACE_BENCH_ENGINE_MODELS")
    assert engine.models() == ["qwen2_5_omni", "minicpmo"]


@pytest.mark.parametrize("value", ["eagre", ",", "eager,compile"])
def test_engine_configurations_refuse_unknown_names(
    monkeypatch: pytest.MonkeyPatch, value: str
) -> None:
    from benchmarks import engine

    monkeypatch.setenv("OMNITRACE_BENCH_ENGINE_CONFIGS", value)
    with pytest.raises(ValueError, match="OMNITRACE_BENCH_ENGINE_CONFIGS: expected"):
        engine.chosen_configurations("minicpmo")


def test_engine_configurations_keep_the_tables_order(monkeypatch: pytest.MonkeyPatch) -> None:
    from benchmarks import engine, engine_serving

    monkeypatch.setenv("OMNITRACE_BENCH_ENGINE_CONFIGS", "eager-again, omnitrace-4,eager")
    chosen = engine.chosen_configurations("qwen2_5_omni")
    assert [c.name for c in chosen] == ["eager", "omnitrace-4", "eager-again"]
    counted = chosen[1].overrides
    assert "encoder_cuda_graph_pool_budget_bytes" not in counted
    assert counted["encoder_cuda_graph_max_graphs"] == 4
    # Qwen's audio tower graphs only through the masked attention, in every graphed config.
    assert counted["encoder_cuda_graph_audio_attention"] == "masked"
    monkeypatch.delenv("OMNITRACE_BENCH_ENGINE_CONFIGS")
    assert [c.name for c in engine.chosen_configurations("minicpmo")] == [
        c.name for c in engine_serving.configurations("minicpmo")
    ]


@pytest.mark.parametrize("model_kind", ["qwen2_5_omni", "minicpmo"])
def test_engine_serves_calls_one_item_at_a_time_in_a_configuration_of_its_own(
    model_kind: str,
) -> None:
    """omnitrace-split: the defaults plus encoder_cuda_graph_split_items, before eager-again."""
    from benchmarks import engine_serving

    configs = {c.name: c for c in engine_serving.configurations(model_kind)}
    split, defaults = configs["omnitrace-split"].overrides, configs["omnitrace"].overrides
    assert split == {**defaults, "encoder_cuda_graph_split_items": True}
    assert list(configs).index("omnitrace-split") < list(configs).index("eager-again")


@pytest.mark.parametrize("split", [False, True])
def test_engine_requires_solo_parity_with_eager_except_where_items_are_split(split: bool) -> None:
    """A solo completion unlike eager's breaks parity (the benchmark then fails), unless the
    configuration serves a call's items one by one: then solo ones are counted, as batched
    ones always are."""
    from benchmarks.engine_checks import eager_agreement

    eager = {"c1/0": [1, 2], "c1/1": [3], "c8/0": [4], "c8/1": [5]}
    mine = {"c1/0": [1, 2], "c1/1": [9], "c8/0": [4], "c8/1": [6]}
    overrides = {"encoder_cuda_graph_split_items": True} if split else {}
    got = eager_agreement(mine, eager, overrides)
    assert (got["batched_equal_eager"], got["batched_requests"]) == (1, 2)
    if split:
        assert (got["solo_equal_eager"], got["solo_requests"]) == (1, 2)
        assert "parity_with_eager" not in got
    else:
        assert got["parity_with_eager"] is False
        assert eager_agreement(eager, eager, overrides)["parity_with_eager"] is True


@pytest.mark.parametrize("value", ["0", "-3", "1001", "many", "2.5"])
def test_engine_cost_rounds_refuse_what_is_not_a_count(
    monkeypatch: pytest.MonkeyPatch, value: str
) -> None:
    from benchmarks import engine

    monkeypatch.setenv("OMNITRACE_BENCH_ENGINE_COST_ROUNDS", value)
    with pytest.raises(ValueError, match="OMNITRACE_BENCH_ENGINE_COST_ROUNDS: expected"):
        engine.cost_rounds()


def test_engine_cost_rounds_default_and_set(monkeypatch: pytest.MonkeyPatch) -> None:
    from benchmarks import engine

    monkeypatch.delenv("OMNITRACE_BENCH_ENGINE_COST_ROUNDS", raising=False)
    assert engine.cost_rounds() == 16
    monkeypatch.setenv("OMNITRACE_BENCH_ENGINE_COST_ROUNDS", " 64 ")
    assert engine.cost_rounds() == 64


@pytest.mark.parametrize(("value", "expected"), [("", 1), ("2", 2), (" 16 ", 16)])
def test_engine_api_server_count_reads_its_variable(
    monkeypatch: pytest.MonkeyPatch, value: str, expected: int
) -> None:
    from benchmarks import engine_serving

    monkeypatch.setenv("OMNITRACE_BENCH_ENGINE_API_SERVERS", value)
    assert engine_serving.api_server_count() == expected


@pytest.mark.parametrize("value", ["0", "17", "two", "-1", "1.5", "\u0663"])
def test_engine_api_server_count_refuses_what_is_not_a_count(
    monkeypatch: pytest.MonkeyPatch, value: str
) -> None:
    from benchmarks import engine_serving

    monkeypatch.setenv("OMNITRACE_BENCH_ENGINE_API_SERVERS", value)
    with pytest.raises(
        ValueError,
        match=re.escape(
            f"OMNITRACE_BENCH_ENGINE_API_SERVERS: expected a whole number 1 to 16, got {value!r}"
        ),
    ):
        engine_serving.api_server_count()


def _refused(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, name: str, value: str) -> str:
    """The error of an engine run with ``name`` set to ``value``, raised before any model
    is served."""
    from benchmarks import engine
    from benchmarks.common import Context

    def start(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("a model was served")

    monkeypatch.setattr(engine, "_run_model", start)
    monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match=name) as raised:
        engine.run(Context(scale="tiny", out_dir=tmp_path, log=lambda message: None))
    return str(raised.value)


_MM = "OMNITRACE_BENCH_ENGINE_MM_PROCESSOR_KWARGS"
_LM = "OMNITRACE_BENCH_ENGINE_LM_GRAPH_TOKENS"
_SERVERS = "OMNITRACE_BENCH_ENGINE_API_SERVERS"
_GRAPHS = "OMNITRACE_BENCH_ENGINE_GRAPH_OVERRIDES"


@pytest.mark.parametrize(
    ("name", "value", "expected"),
    [
        (_SERVERS, "many", "expected a whole number 1 to 16"),
        *((_MM, value, "expected a JSON object") for value in ("[1]", "480000", "{audio", '"x"')),
        *((_LM, value, "expected a whole number 1 to 8192") for value in ("0", "8193", "auto")),
        *((_GRAPHS, value, "expected a JSON object") for value in ("[1]", "{pool", "2", "null")),
    ],
)
def test_engine_refuses_a_bad_setting_before_any_server_starts(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, name: str, value: str, expected: str
) -> None:
    message = _refused(monkeypatch, tmp_path, name, value)
    assert message == f"{name}: {expected}, got {value!r}"


@pytest.mark.parametrize(
    ("overrides", "stray"),
    [({"encoder_cuda_graph": False}, "encoder_cuda_graph"), ({"max_graphs": 8}, "max_graphs")],
)
def test_engine_refuses_graph_overrides_that_are_not_omnitrace_s_graph_settings(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, overrides: dict[str, Any], stray: str
) -> None:
    """Only ``encoder_cuda_graph_*`` settings: switching the graphs off, or a key omnitrace
    does not read, would make the graphed configurations something other than their names."""
    message = _refused(monkeypatch, tmp_path, _GRAPHS, json.dumps(overrides))
    assert message == f"{_GRAPHS}: expected encoder_cuda_graph_* keys only, got {stray!r}"


def test_graph_overrides_reach_every_graphed_server_and_no_eager_one(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """``OMNITRACE_BENCH_ENGINE_GRAPH_OVERRIDES`` lands on top of each graphed configuration's
    own settings in its ``--hf-overrides``; eager and vLLM's own encoder graphs keep theirs."""
    from benchmarks import engine_serving
    from benchmarks.common import Context

    budget = {"encoder_cuda_graph_pool_budget_bytes": 4 << 30, "encoder_cuda_graph_max_graphs": 64}
    before = {c.name: c.overrides for c in engine_serving.configurations("minicpmo")}
    monkeypatch.setenv(_GRAPHS, json.dumps(budget))
    started = _serve_commands(monkeypatch)
    ctx = Context(scale="tiny", out_dir=tmp_path, log=lambda message: None)
    configs = engine_serving.configurations("minicpmo")
    for config in configs:
        with engine_serving.serving(config, tmp_path / "model", tmp_path, ctx, max_num_seqs=2):
            pass
    served = {
        c.name: json.loads(command[command.index("--hf-overrides") + 1])
        for c, command in zip(configs, started, strict=True)
    }
    assert served["omnitrace-4"] == {**before["omnitrace-4"], **budget}
    assert served["omnitrace-background"]["encoder_cuda_graph_background_capture"] is True
    for name in ("eager", "eager-again", "vllm-encoder-graphs"):
        assert served[name] == before[name]
    graphed = [n for n in served if n not in ("eager", "eager-again", "vllm-encoder-graphs")]
    assert len(graphed) == 6
    for name in graphed:
        # The restarts also name the logs they prepare from.
        served[name].pop("encoder_cuda_graph_prepare_from", None)
        assert served[name] == {**before[name], **budget}
        assert served[name]["encoder_cuda_graph_pool_budget_bytes"] == 4 << 30


def _serve_commands(monkeypatch: pytest.MonkeyPatch) -> list[list[str]]:
    """The command lines of the ``vllm serve`` processes the benchmark starts from now on
    (none runs: each is ready at once)."""
    from benchmarks import engine_serving

    started: list[list[str]] = []

    class Process:
        def __init__(self, command: list[str], **kwargs: Any) -> None:
            started.append(command)

        def poll(self) -> int:
            return 0

    monkeypatch.setattr(engine_serving.subprocess, "Popen", Process)
    monkeypatch.setattr(engine_serving, "_wait_ready", lambda server, timeout: None)
    return started


@pytest.mark.parametrize("servers", [1, 4])
def test_engine_servers_get_the_api_server_count_on_their_command_line(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, servers: int
) -> None:
    """``--api-server-count N`` on every ``vllm serve`` when N > 1; vLLM's default else."""
    from benchmarks import engine_serving
    from benchmarks.common import Context

    started = _serve_commands(monkeypatch)
    # The processor's options ride along in the four-server case only.
    processor = {"audio_kwargs": {"max_length": 480000}}
    if servers > 1:
        monkeypatch.setenv("OMNITRACE_BENCH_ENGINE_MM_PROCESSOR_KWARGS", json.dumps(processor))
    ctx = Context(scale="tiny", out_dir=tmp_path, log=lambda message: None)
    for config in engine_serving.configurations("minicpmo")[:2]:
        with engine_serving.serving(
            config, tmp_path / "model", tmp_path, ctx, max_num_seqs=2, api_servers=servers
        ):
            pass
    assert len(started) == 2
    for command in started:
        assert command[command.index("serve") + 1] == str(tmp_path / "model")
        if servers == 1:
            assert "--api-server-count" not in command
            assert "--mm-processor-kwargs" not in command
        else:
            at = command.index("--api-server-count")
            assert command[at + 1] == str(servers)
            at = command.index("--mm-processor-kwargs")
            assert json.loads(command[at + 1]) == processor


@pytest.mark.parametrize(
    ("cuda", "value", "expected"),
    [(True, None, 512), (True, "96", 96), (True, "vllm", None), (False, None, None)],
)
def test_engine_servers_get_the_language_model_s_graph_size_on_cuda(
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    cuda: bool,
    value: str | None,
    expected: int | None,
) -> None:
    """On CUDA, ``max_cudagraph_capture_size`` in every server's compilation config (512
    unless set; ``vllm`` leaves it out), merged with the configuration's own options."""
    from benchmarks import engine_serving
    from benchmarks.common import Context

    started = _serve_commands(monkeypatch)
    if value is not None:
        monkeypatch.setenv("OMNITRACE_BENCH_ENGINE_LM_GRAPH_TOKENS", value)
    ctx = Context(scale="tiny", out_dir=tmp_path, cuda=cuda, log=lambda message: None)
    chosen = {c.name: c for c in engine_serving.configurations("qwen2_5_omni")}
    for name in ("eager", "vllm-encoder-graphs"):
        with engine_serving.serving(
            chosen[name], tmp_path / "model", tmp_path, ctx, max_num_seqs=32
        ):
            pass
    found = []
    for command in started:
        at = command.index("--compilation-config") if "--compilation-config" in command else None
        found.append({} if at is None else json.loads(command[at + 1]))
    own = chosen["vllm-encoder-graphs"].compilation or {}
    lm = {} if expected is None else {"max_cudagraph_capture_size": expected}
    assert found == [lm, {**own, **lm}]


def test_engine_served_pairs_measure_the_split_always_and_timing_with_one_api_server(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The pairs and the split rounds run (``/collective_rpc`` reaches every worker); the
    timing switch reaches one API server, so with several its cost is recorded as not
    measured, with the reason, not measured wrong."""
    from benchmarks import engine, served_pairs
    from benchmarks.common import Context
    from benchmarks.paired import cost_summary

    model = SimpleNamespace(data=[SimpleNamespace(id="m")])
    client = SimpleNamespace(models=SimpleNamespace(list=lambda: model))
    monkeypatch.setitem(sys.modules, "openai", SimpleNamespace(OpenAI=lambda **kw: client))
    monkeypatch.setattr(served_pairs, "run", lambda *a, **kw: {"kinds": {}, "requests": []})
    calls = _fake_workers(monkeypatch)
    timed: list[bool] = []
    monkeypatch.setattr(served_pairs, "time_requests", lambda url, on: timed.append(on))

    def cost(kinds: Any, ask: Any, switch: Any, **kwargs: Any) -> dict[str, Any]:
        switch(True)  # through the switch the rounds were given
        ttft = {"off_ttft_ms": {"p50": 90.0, "p99": 120.4}, "on_ttft_ms": {"p50": 80, "p99": 99}}
        return {**cost_summary([10.0], [12.0]), **ttft, **kwargs}

    monkeypatch.setattr(served_pairs, "batch_rounds", cost)
    ctx = Context(scale="tiny", out_dir=tmp_path, log=lambda message: None)
    server = SimpleNamespace(port=1, config=SimpleNamespace(name="omnitrace"))

    pairs = engine._served_pairs(ctx, server, [], 1)
    assert pairs["timing_cost"]["seed"] == 400_000
    assert pairs["timing_cost"]["after"] is True
    assert pairs["split_cost"]["seed"] == 500_000
    assert pairs["split_cost"]["after"] is False
    assert pairs["split_cost"]["rounds"] == 1
    assert timed == [True]
    assert ("omnitrace_split_items", True) in calls
    assert engine.timing_cost_skipped(1) is None
    timed.clear()
    pairs = engine._served_pairs(ctx, server, [], 2)
    assert timed == []
    assert pairs["timing_cost"] is None
    assert pairs["split_cost"]["seed"] == 500_000
    assert pairs["timing_cost_skipped"] == engine.timing_cost_skipped(2)
    assert pairs["timing_cost_skipped"].startswith("2 API servers: POST /omnitrace/request_timing")
    outcome = engine._pair_outcomes(pairs, {})
    assert outcome["timing_cost"] is None
    assert outcome["timing_cost_skipped"] == pairs["timing_cost_skipped"]
    assert outcome["split_cost"] == pairs["split_cost"]
    (table,) = served_pairs.tables(
        {
            "name": "M",
            "configurations": {
                "omnitrace": {
                    "served_pairs": {**outcome, "encoder_calls": {"eager": {}, "graphed": {}}}
                }
            },
        }
    )
    assert (
        f"Request timing's cost not measured: {pairs['timing_cost_skipped']}. One call per item: "
        "1 rounds of a batch of 8 requests each way, alternating: 10.00 requests/s batched, "
        "12.00 split; paired change +20.0 % (IQR +20.0 … +20.0 %); TTFT p50 / p99: 90 / 120 ms "
        "batched, 80 / 99 ms split."
    ) in table.note


def _fake_workers(monkeypatch: pytest.MonkeyPatch, answer: Any = None) -> list[tuple[Any, ...]]:
    """served_pairs.rpc answered by one fake worker with a vision and an audio adapter."""
    from benchmarks import served_pairs

    calls: list[tuple[Any, ...]] = []
    state = {"paused": False, "split": False}
    setters = {"omnitrace_pause_graphs": "paused", "omnitrace_split_items": "split"}
    readers = {"omnitrace_graphs_paused": "paused", "omnitrace_items_split": "split"}

    def rpc(base_url: str, method: str, *args: Any) -> list[Any]:
        calls.append((method, *args))
        if method in setters:
            state[setters[method]] = bool(args[0])
            return [2]
        if answer is not None:
            return list(answer)
        value = state[readers[method]]
        return [{"vision": value, "audio": value}]

    monkeypatch.setattr(served_pairs, "rpc", rpc)
    return calls


def test_served_pairs_alternate_the_halves_and_resume_the_graphs_at_the_end(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from benchmarks import served_pairs

    calls = _fake_workers(monkeypatch)
    kinds = [SimpleNamespace(name="image"), SimpleNamespace(name="audio")]
    order: list[tuple[str, bool]] = []

    def ask(kind: Any, seed: int) -> Any:
        paused = calls[-2][1]  # the pause that preceded this request's state read
        order.append((kind.name, paused))
        return SimpleNamespace(ttft_s=0.100 if paused else 0.080, request_id=f"r{seed}")

    result = served_pairs.run("http://x", kinds, ask, pairs=2, seed=10)
    assert order == [
        ("image", True), ("image", False), ("audio", False), ("audio", True),
        ("image", False), ("image", True), ("audio", True), ("audio", False),
    ]  # fmt: skip
    assert calls[-1] == ("omnitrace_pause_graphs", False)
    row = result["kinds"]["image"]
    assert row["pairs"] == 2
    assert row["diff_median_ms"] == pytest.approx(-20.0)
    assert row["graphed_faster"] == 2
    assert [r["request_id"] for r in result["requests"]] == [f"r{10 + i}" for i in range(8)]
    table = served_pairs.tables(
        {
            "name": "M",
            "configurations": {
                "omnitrace": {
                    "served_pairs": {
                        **result,
                        "encoder_calls": {"eager": {"miss ineligible/paused": 4}, "graphed": {}},
                        "without_event": 1,
                    }
                },
                "eager": {},
            },
        }
    )
    (only,) = table
    assert [r[0] for r in only.rows] == ["image", "audio"]
    assert only.rows[0][1:3] == ["100", "80"]
    assert "eager halves: miss ineligible/paused 4" in only.note
    assert "graphed halves: none" in only.note
    assert "1 requests without an event" in only.note


def test_served_pairs_resume_the_graphs_when_a_request_fails(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from benchmarks import served_pairs

    calls = _fake_workers(monkeypatch)

    def ask(kind: Any, seed: int) -> Any:
        raise RuntimeError("the server died")

    with pytest.raises(RuntimeError, match="the server died"):
        served_pairs.run("http://x", [SimpleNamespace(name="image")], ask, pairs=1, seed=0)
    assert calls[-1] == ("omnitrace_pause_graphs", False)


@pytest.mark.parametrize(
    ("answer", "message"),
    [
        ([{"vision": True, "audio": False}], "asked for paused=True"),
        ([{}], "has no encoder adapter"),
        ([{"vision": True}, {"vision": False}], "asked for paused=True"),
    ],
)
def test_served_pairs_refuse_a_switch_the_workers_did_not_make(
    monkeypatch: pytest.MonkeyPatch, answer: list[Any], message: str
) -> None:
    from benchmarks import served_pairs

    _fake_workers(monkeypatch, answer)
    with pytest.raises(served_pairs.SwitchError, match=message):
        served_pairs.switch("http://x", True)


def test_served_rounds_alternate_batches_and_leave_the_switch_as_asked(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from benchmarks import served_pairs

    switched: list[bool] = []
    seeds: list[int] = []
    asked: list[tuple[bool, str]] = []

    def ask(kind: Any, seed: int) -> Any:
        seeds.append(seed)
        asked.append((switched[-1], kind.name))
        return SimpleNamespace(ttft_s=0.01, request_id=str(seed))

    kinds = [SimpleNamespace(name=n) for n in ("image", "audio", "both")]
    how = dict(rounds=3, seed=50, batch=4, warmup=1, after=True)
    cost = served_pairs.batch_rounds(kinds, ask, switched.append, **how)
    # One warm-up round (round -1: on first), then three counted, the order alternating.
    assert switched == [True, False, False, True, True, False, False, True, True]
    assert sorted(seeds) == list(range(50, 50 + 4 * 2 * 4))
    # Both batches of a round carry the same kinds; the kinds move on between rounds.
    batches = [sorted(k for _, k in asked[i : i + 4]) for i in range(0, len(asked), 4)]
    assert all(batches[i] == batches[i + 1] for i in range(0, len(batches), 2))
    assert batches[0] != batches[2]
    # Each batch ran in the state switched on just before it.
    assert all(len({on for on, _ in asked[i : i + 4]}) == 1 for i in range(0, len(asked), 4))
    assert cost["rounds"] == 3
    assert cost["batch"] == 4
    assert len(cost["off_rps"]) == len(cost["on_rps"]) == 3
    assert min(cost["off_rps"] + cost["on_rps"]) > 0
    # Each half's TTFTs, from the completions of its counted batches.
    assert cost["off_ttft_ms"] == cost["on_ttft_ms"] == {"p50": 10.0, "p99": 10.0}

    def broken(kind: Any, seed: int) -> Any:
        raise RuntimeError("refused")

    for after in (True, False):
        switched.clear()
        with pytest.raises(RuntimeError, match="refused"):
            served_pairs.batch_rounds(
                kinds, broken, switched.append, rounds=1, seed=0, batch=2, warmup=0, after=after
            )
        assert switched == [False, after]


def test_served_split_switch_sets_every_adapter_and_reads_it_back(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from benchmarks import served_pairs

    calls = _fake_workers(monkeypatch)
    served_pairs.switch("http://x", True, names=served_pairs.SPLIT)
    assert calls == [("omnitrace_split_items", True), ("omnitrace_items_split",)]
    served_pairs.switch("http://x", False, names=served_pairs.SPLIT)
    assert calls[-2] == ("omnitrace_split_items", False)
    _fake_workers(monkeypatch, [{"vision": True, "audio": False}])
    with pytest.raises(served_pairs.SwitchError, match="asked for split=True"):
        served_pairs.switch("http://x", True, names=served_pairs.SPLIT)


def test_restarted_and_compiled_servers_prepare_from_the_defaults_servers_worker_logs(
    tmp_path: Path,
) -> None:
    from benchmarks import engine_serving
    from omnitrace.eventlog.patterns import expand

    configs = {c.name: c for c in engine_serving.configurations("minicpmo")}
    names = list(configs)
    for name in ("omnitrace+compile", "omnitrace-restarted"):
        # Served after the defaults' server, whose logs it reads.
        assert names.index(name) > names.index("omnitrace")
        pattern = configs[name].hf_overrides(tmp_path)["encoder_cuda_graph_prepare_from"]
        logs = tmp_path / "omnitrace"
        logs.mkdir(exist_ok=True)
        for log in ("events-0-41.jsonl", "events-api.jsonl", "events-api-7.jsonl"):
            (logs / log).write_text("")
        assert expand([Path(pattern)]) == [logs / "events-0-41.jsonl"]
    assert "encoder_cuda_graph_prepare_from" not in configs["omnitrace"].hf_overrides(tmp_path)
    assert configs["omnitrace"].hf_overrides(tmp_path) == configs["omnitrace"].overrides


def test_a_concurrent_pass_makes_every_request_s_media_before_its_clock_starts(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """At concurrency above 1 the media are made before the pass's clock and the first
    request, so neither the pass's wall time nor the clients' threads encode PNGs."""
    import types

    from benchmarks import engine_serving

    order: list[str] = []

    def messages(kind: Any, seed: int) -> list[dict[str, Any]]:
        order.append("media")
        return [{"role": "user", "content": f"{kind.name} {seed}"}]

    class Completions:
        def create(self, **request: Any) -> list[Any]:
            order.append("sent")
            choice = types.SimpleNamespace(token_ids=[7], model_extra={})
            return [types.SimpleNamespace(id="chatcmpl-1", choices=[choice])]

    client = types.SimpleNamespace(chat=types.SimpleNamespace(completions=Completions()))
    clock = engine_serving.time.perf_counter
    monkeypatch.setattr(engine_serving, "messages", messages)
    monkeypatch.setattr(engine_serving, "openai_client", lambda port: (client, "m"))
    monkeypatch.setattr(
        engine_serving.time, "perf_counter", lambda: order.append("clock") or clock()
    )
    kinds = engine_serving.request_kinds("tiny", "minicpmo")
    done = engine_serving.run_pass(
        types.SimpleNamespace(port=0), kinds, seed=7, concurrency=4, tokens=1
    )
    assert len(done.completions) == len(kinds)
    assert order[: len(kinds) + 1] == ["media"] * len(kinds) + ["clock"]
    assert "media" not in order[len(kinds) :]


def test_repeated_runs_keep_every_request_and_each_run_s_rate() -> None:
    from benchmarks.engine_serving import Completion, Pass, repeated

    def run(wall_s: float, n: int) -> Pass:
        return Pass(8, wall_s, [Completion("image", 0.1, 0.2, [1]) for _ in range(n)])

    merged = repeated([run(2.0, 8), run(4.0, 8), run(1.0, 8)])
    assert (merged.concurrency, merged.wall_s, len(merged.completions)) == (8, 7.0, 24)
    assert merged.rates == [4.0, 2.0, 8.0]


@pytest.mark.skipif(
    torch.cuda.is_available(), reason="checks the probe's failure on a machine without CUDA"
)
def test_the_cuda_probe_runs_in_a_child_and_reports_its_failure(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The smoke test runs in a child process, so the harness holds no CUDA context beside
    the servers it starts; where it fails, the child's last error line is the reason."""
    from benchmarks import common

    made_here: list[Any] = []
    ones = torch.ones

    def spied(*args: Any, **kwargs: Any) -> torch.Tensor:
        made_here.append(kwargs.get("device"))
        return ones(*args, **kwargs)

    common.cuda_probe.cache_clear()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch, "ones", spied)
    try:
        ok, why = common.cuda_status()
    finally:
        common.cuda_probe.cache_clear()
    assert not ok
    assert why.startswith("a CUDA smoke test failed: ")
    # The child's own error line (this machine has no CUDA device), not a made-up one.
    assert "Error" in why.removeprefix("a CUDA smoke test failed: ")
    assert made_here == []
    assert not torch.cuda.is_initialized()


def test_gpu_processes_reads_nvidia_smi_and_marks_this_process(tmp_path: Path) -> None:
    """Each ``pid, MiB`` line becomes an entry, this process's flagged as the harness; lines
    that are not such pairs are skipped; a failing or missing command gives None."""
    from benchmarks import engine_serving

    listing = tmp_path / "listing.txt"
    listing.write_text(f"1234, 70000\n{os.getpid()}, 612\n[N/A], 5\n", encoding="utf-8")
    found = engine_serving.gpu_processes(("cat", str(listing)))
    assert found == [
        {"pid": 1234, "used_mib": 70000, "harness": False},
        {"pid": os.getpid(), "used_mib": 612, "harness": True},
    ]
    assert engine_serving.gpu_processes(("false",)) is None
    assert engine_serving.gpu_processes((str(tmp_path / "no-such-command"),)) is None
