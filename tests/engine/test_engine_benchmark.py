"""The end-to-end benchmark (``benchmarks/engine.py``) runs through, at toy sizes on a CPU.

Numbers from a CPU mean nothing; what this proves is that every part of the benchmark works
against a real ``vllm serve``, so it cannot rot between GPU runs.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (the engine CI tier installs it)")

from engine.support import CUDA, ENGINE_TIMEOUT_S

pytestmark = pytest.mark.engine

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(3 * ENGINE_TIMEOUT_S + 60)
def test_the_engine_benchmark_serves_every_kind_and_compares_with_eager(tmp_path: Path) -> None:
    """Two engines per model serve the traffic mix; completions match eager's; figures recorded."""
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
        assert set(model["configurations"]) == {"eager", "omnitrace"}, model_kind
        for name, entry in model["configurations"].items():
            where = f"{model_kind}/{name}"
            assert {row["kind"] for row in entry["rows"].values()} == set(model["kinds"]), where
            assert {row["concurrency"] for row in entry["rows"].values()} == {1, 2}, where
            assert entry["kv_cache_tokens"] > 0, where
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
        assert model["configurations"]["omnitrace"]["parity_with_eager"] is True, model_kind
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
    assert {t["name"] for t in result["targets"]} == {
        f"{label}: {modality} TTFT p50 at concurrency 1, omnitrace vs eager encoders"
        for label in ("Qwen2.5-Omni-7B thinker", "MiniCPM-o 4.5")
        for modality in ("image", "audio")
    }
