"""The end-to-end benchmark (``benchmarks/engine.py``) runs through, at toy sizes on a CPU.

Numbers from a CPU mean nothing; what this proves is that every part of the benchmark works
against a real ``vllm serve``, so it cannot rot between GPU runs.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (the engine CI tier installs it)")

from engine.support import CUDA, ENGINE_TIMEOUT_S
from omnitrace.eventlog import AdapterInfo, read_records

pytestmark = pytest.mark.engine

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(3 * ENGINE_TIMEOUT_S + 60)
def test_the_engine_benchmark_serves_every_kind_and_compares_with_eager(tmp_path: Path) -> None:
    """Per model, the offline pairs, then three engines (eager, graphs, eager again) serve the
    traffic mix; completions match eager's; phases from the events; figures recorded."""
    # Only the benchmarks package from the checkout: omnitrace must come from the install.
    path = tmp_path / "path"
    path.mkdir()
    (path / "benchmarks").symlink_to(ROOT / "benchmarks")
    env = {**os.environ, "PYTHONPATH": str(path)}
    out = tmp_path / "out"
    done = subprocess.run(
        [
            sys.executable,
            "-P",
            "-m",
            "benchmarks.run",
            "--suite",
            "engine",
            "--tiny",
            "--no-plots",
            "--out",
            str(out),
        ],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=3 * ENGINE_TIMEOUT_S,
        check=False,
    )
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    payload = json.loads((out / "engine.json").read_text())
    assert payload["status"] == "ok"
    result = payload["result"]
    assert set(result["models"]) == {"qwen2_5_omni", "minicpmo"}
    for model_kind, model in result["models"].items():
        assert set(model["configurations"]) == {"eager", "omnitrace", "eager-again"}, model_kind
        # Offline in the same invocation: eager and graphed requests paired in one engine.
        offline = model["offline_paired"]
        assert offline["problems"] == [], (model_kind, offline["problems"])
        assert all(row["pairs"] == 1 for row in offline["kinds"].values()), model_kind
        for name in ("omnitrace", "eager-again"):
            # The request events give every kind's phases at every concurrency.
            entry = model["configurations"][name]
            assert entry["event_problems"] == [], (model_kind, name, entry["event_problems"])
            assert set(entry["event_phases"]) == {"c1", "c2"}, (model_kind, name)
            for rows in entry["event_phases"].values():
                assert set(rows) == set(model["kinds"]), (model_kind, name)
                assert all(r["phases_mean_ms"]["encoders"] > 0 for r in rows.values())
                # The client starts its clock before the server sees the request.
                for kind, r in rows.items():
                    assert r["event_ttft_p50_ms"] <= r["client_ttft_p50_ms"], (name, kind, r)
            # One request at a time, vLLM's histograms and the events give the engine's part
            # alike: the same span of vLLM's timestamps, the events' through their join.
            for kind, r in entry["event_phases"]["c1"].items():
                histograms, events = r["engine_part_ms"].values()
                assert abs(histograms - events) <= 0.02 * histograms, (name, kind, r)
            # Every measured call counted after the warm-up; on a CPU none is a hit.
            after = entry["after_warmup"]
            assert after["calls"] > 0, (model_kind, name)
            assert after["calls"] == sum(e["calls"] for e in after["encoders"].values())
            if not CUDA:
                assert after["hits"] == 0, (model_kind, name, after)
        for name, entry in model["configurations"].items():
            where = f"{model_kind}/{name}"
            assert {row["kind"] for row in entry["rows"].values()} == set(model["kinds"]), where
            assert {row["concurrency"] for row in entry["rows"].values()} == {1, 2}, where
            assert entry["kv_cache_tokens"] > 0, where
            # Above c1 the rate is the median of repeated runs, each with new media.
            repeats = entry["requests_per_s_repeats"]
            assert [len(repeats[c]) for c in ("c1", "c2")] == [1, 2], where
            assert entry["requests_per_s"]["c2"] == statistics.median(repeats["c2"]), where
            # The warm-up's first pass at c2, its cold pass; with the plugin, its encoder calls.
            (cold,) = entry["cold_passes"].values()
            assert 0 < cold["ttft_p50_ms"] <= cold["ttft_p99_ms"], where
            assert cold["requests_per_s"] > 0, where
            assert cold["hits"]["calls"] > 0, where
            if not CUDA:
                assert cold["hits"]["hits"] == 0, where
            assert all(row["ttft_p50_ms"] > 0 for row in entry["rows"].values()), where
            # One request at a time, the engine's histograms split each kind's TTFT.
            for row in entry["rows"].values():
                phases = row.get("phases_mean_ms")
                if row["concurrency"] != 1:
                    assert phases is None, (where, row)
                    continue
                assert phases is not None, (where, row["kind"])
                assert phases["prefill"] > 0, (where, phases)
                assert phases["rendering"] > 0, (where, phases)
                assert phases["queue"] >= 0, (where, phases)
        # The graphed server also served each kind in pairs, its graphs switched through
        # /collective_rpc before each request; every paired request has its event.
        pairs = model["configurations"]["omnitrace"]["served_pairs"]
        assert set(pairs["kinds"]) == set(model["kinds"]), model_kind
        assert all(row["pairs"] == 1 for row in pairs["kinds"].values()), model_kind
        assert pairs["without_event"] == 0, (model_kind, pairs)
        for half, calls in pairs["encoder_calls"].items():
            assert sum(calls.values()) >= len(model["kinds"]), (model_kind, half, calls)
            if not CUDA:
                assert set(calls) == {"miss ineligible/cpu"}, (model_kind, half, calls)
            elif half == "eager":
                assert set(calls) == {"miss ineligible/paused"}, (model_kind, calls)
        # Request timing off and on in the same server, in rounds of a batch each way.
        cost = pairs["timing_cost"]
        assert cost["rounds"] == 1, (model_kind, cost)
        assert len(cost["off_rps"]) == len(cost["on_rps"]) == 1, (model_kind, cost)
        assert min(cost["off_rps"] + cost["on_rps"]) > 0, (model_kind, cost)
        # A call's items batched and split, switched through /collective_rpc the same way.
        split = pairs["split_cost"]
        assert split["rounds"] == 1, (model_kind, split)
        assert min(split["off_rps"] + split["on_rps"]) > 0, (model_kind, split)
        for half in ("off_ttft_ms", "on_ttft_ms"):
            assert 0 < split[half]["p50"] <= split[half]["p99"], (model_kind, split)
        assert "served_pairs" not in model["configurations"]["eager"], model_kind
        assert model["configurations"]["omnitrace"]["parity_with_eager"] is True, model_kind
        assert model["configurations"]["eager-again"]["parity_with_eager"] is True, model_kind
        graphs = model["configurations"]["omnitrace"]["graphs"]
        # On a CPU every encoder call is eager; on CUDA the repeated shapes are captured.
        assert graphs > 0 if CUDA else graphs == 0, (model_kind, graphs)
        assert model["configurations"]["eager"]["graphs"] == 0, model_kind
        for name, entry in model["configurations"].items():
            # Per adapter: both encoders, and their counts add up to the totals.
            adapters = entry["adapters"]
            assert set(adapters) == {"vision", "audio"}, (model_kind, name, adapters)
            assert sum(a["hits"] for a in adapters.values()) == entry["hits"]
            assert sum(sum(a["misses"].values()) for a in adapters.values()) == entry["misses"]
        # Device timing needs CUDA events: a CPU run has no encoder share to report.
        shares = {e["encoder_share_of_ttft_c1"] for e in model["configurations"].values()}
        assert all(s > 0 for s in shares) if CUDA else shares == {None}, (model_kind, shares)
        # Neither model class implements vLLM's encoder graph protocol in 0.26.
        assert model["vllm_encoder_graphs"]["supported"] is False, model_kind
        assert "SupportsEncoderCudaGraph" in model["vllm_encoder_graphs"]["reason"]
    inside = {f["name"]: f["value"] for f in result["figures"] if "inside vLLM" in f["name"]}
    assert len(inside) == 4, inside
    assert all(isinstance(v, float) for v in inside.values()), inside
    labels = ("Qwen2.5-Omni-7B thinker", "MiniCPM-o 4.5")
    # Each model's own c1 goals (the bars: BENCHMARKS.md, "Targets").
    c1 = {
        labels[0]: ("image", "audio"),
        labels[1]: ("single-piece image", "every image kind's", "audio"),
    }
    assert {t["name"] for t in result["targets"]} == {
        *(
            f"{label}: {what} TTFT p50 at concurrency 1, omnitrace vs eager encoders"
            for label, whats in c1.items()
            for what in whats
        ),
        *(
            f"{label}: requests/s at concurrency 2, omnitrace over eager encoders"
            for label in labels
        ),
        *(
            f"{label}: TTFT p99 at concurrency 2 (median over kinds), omnitrace vs eager"
            for label in labels
        ),
        *(
            f"{label}: encoder calls served by a graph after the warm-up, omnitrace defaults"
            for label in labels
        ),
    }
    drift = [f for f in result["figures"] if "eager served again last" in f["name"]]
    assert len(drift) == 4, drift
    assert all(isinstance(f["value"], float) for f in drift), drift


def _run_benchmark(tmp_path: Path, module: str, *args: str, **env: str) -> None:
    """Run ``python -m benchmarks.<module> ARGS`` with only the checkout's benchmarks package
    on the path (omnitrace comes from the install); it must succeed."""
    path = tmp_path / "path"
    path.mkdir()
    (path / "benchmarks").symlink_to(ROOT / "benchmarks")
    done = subprocess.run(
        [sys.executable, "-P", "-m", f"benchmarks.{module}", *args],
        env={**os.environ, "PYTHONPATH": str(path), **env},
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=ENGINE_TIMEOUT_S,
        check=False,
    )
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]


@pytest.mark.timeout(ENGINE_TIMEOUT_S + 60)
def test_the_paired_benchmark_finds_every_request_in_its_events(tmp_path: Path) -> None:
    """Eager and graphed requests alternate in one engine; each is found again in the event
    logs by its id, with the encoder calls that served it, and the halves are reported."""
    out = tmp_path / "out"
    _run_benchmark(
        tmp_path,
        "paired",
        "--model",
        "minicpmo",
        "--pairs",
        "2",
        "--warmup",
        "2",
        "--cost-rounds",
        "2",
        "--out",
        str(out),
    )
    result = json.loads((out / "paired-minicpmo.json").read_text())
    assert result["problems"] == []
    assert set(result["kinds"]) == {"image 448x448", "image 896x896", "audio 1 s", "audio 10 s"}
    # Warm-up (2 rounds and one paused request a kind) and 2 pairs a kind, all timed; of the
    # cost rounds' batches of 8, only those with timing switched on.
    assert result["request_events"] == 4 * (2 + 1 + 2 * 2) + 2 * 8
    cost = result["timing_cost"]
    assert (cost["rounds"], cost["batch"]) == (2, 8)
    assert cost["off_rps_p50"] > 0
    assert cost["on_rps_p50"] > 0
    for kind, row in result["kinds"].items():
        assert row["pairs"] == 2, kind
        for half in ("eager", "graphed"):
            calls = row[f"{half}_encoder_calls"]
            assert sum(calls.values()) >= 2, (kind, half, calls)
            phases = row[f"{half}_phases_ms"]
            assert phases["processor"] > 0, (kind, half, phases)
            assert phases["encoders"] > 0, (kind, half, phases)
        # On a CPU both halves run eagerly; on CUDA the paused half misses and the other hits.
        if CUDA:
            assert set(row["eager_encoder_calls"]) == {"miss ineligible/paused"}, row
            assert set(row["graphed_encoder_calls"]) == {"hit"}, row
    assert "paired diff median" in (out / "paired-minicpmo.md").read_text()


_BUDGET = {"encoder_cuda_graph_pool_budget_bytes": 3 << 30}


@pytest.mark.timeout(ENGINE_TIMEOUT_S + 60)
def test_the_headroom_benchmark_joins_each_burst_with_its_encoder_calls(tmp_path: Path) -> None:
    """An engine warmed up, then bursts of requests of two large images: each burst served and
    found again in the worker's events by time, with the vision calls that served it."""
    out = tmp_path / "out"
    _run_benchmark(
        tmp_path,
        "headroom",
        *("--configs", "omnitrace", "--bursts", "1,2", "--repeats", "2", "--warmup", "2"),
        *("--out", str(out), "--overrides", json.dumps(_BUDGET), "--images", "2"),
    )
    result = json.loads((out / "headroom-minicpmo.json").read_text())
    assert list(result["configs"]) == ["omnitrace"]
    assert result["overrides"] == _BUDGET
    engine = result["configs"]["omnitrace"]
    # The override reached the engine's adapters: each logged the budget it runs with.
    infos = [
        record.item.info
        for log in engine["logs"]
        for record in read_records(out / "omnitrace" / log)
        if isinstance(record.item, AdapterInfo)
    ]
    assert {info["pool_budget_bytes"] for info in infos} == {3 << 30}, infos
    assert [(row["requests"], row["repeat"]) for row in engine["bursts"]] == [
        (1, 0),
        (1, 1),
        (2, 0),
        (2, 1),
    ]
    assert all(row["ok"] for row in engine["bursts"]), engine["bursts"]
    assert engine["oom"] is None
    assert all(isinstance(v, int) and v > 0 for v in engine["scheduler"].values()), engine
    for row in engine["bursts"]:
        vision = row["vision"]
        # A request's two images are one call of their 1344x1344 slices (one overview and
        # nine each).
        assert vision["calls"] >= 1, row
        assert vision["largest"] >= 20, row
        if not CUDA:
            assert set(vision["outcomes"]) == {"eager ineligible"}, row
    assert "the largest burst served 2" in (out / "headroom-minicpmo.md").read_text()
