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


def test_the_engine_benchmark_serves_every_kind_and_compares_with_eager(tmp_path: Path) -> None:
    """Two engines serve the traffic mix; completions match eager's; figures are recorded."""
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
    assert set(result["configurations"]) == {"eager", "omnitrace"}
    for name, entry in result["configurations"].items():
        assert {row["kind"] for row in entry["rows"].values()} == set(result["kinds"]), name
        assert {row["concurrency"] for row in entry["rows"].values()} == {1, 2}, name
        assert entry["kv_cache_tokens"] > 0, name
        assert all(row["ttft_p50_ms"] > 0 for row in entry["rows"].values()), name
    assert result["configurations"]["omnitrace"]["parity_with_eager"] is True
    graphs = result["configurations"]["omnitrace"]["graphs"]
    # On a CPU every encoder call is eager; on CUDA the repeated shapes are captured.
    assert graphs > 0 if CUDA else graphs == 0, graphs
    assert result["configurations"]["eager"]["graphs"] == 0
    # Device timing needs CUDA events: a CPU run has no encoder share to report.
    shares = {e["encoder_share_of_ttft_c1"] for e in result["configurations"].values()}
    assert all(s > 0 for s in shares) if CUDA else shares == {None}, shares
    assert result["vllm_encoder_graphs"]["supported"] is False
    assert "SupportsEncoderCudaGraph" in result["vllm_encoder_graphs"]["reason"]
    assert {t["name"] for t in result["targets"]} == {
        "image TTFT p50 at concurrency 1, omnitrace vs eager encoders",
        "audio TTFT p50 at concurrency 1, omnitrace vs eager encoders",
    }
