"""Engines run as child processes, for the engine tests.

Each engine runs in a process of its own (``engine_run.py`` for ``vllm.LLM``, ``vllm serve``
for the server), because vLLM reads its plugins and environment once per process. A child
that fails is a test failure with the end of its output, never a skip.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

HERE = Path(__file__).resolve().parent
ENGINE_RUN = HERE / "engine_run.py"
CUDA = torch.cuda.is_available()
#: How long one engine may take to start and serve the fixed prompts.
ENGINE_TIMEOUT_S = 600


def engine_environment(**extra: str) -> dict[str, str]:
    """The environment of an engine child: offline, small, and without stray omnitrace sinks."""
    env = {
        key: value
        for key, value in os.environ.items()
        if not key.startswith(("OMNITRACE_", "OTEL_", "VLLM_USE_V2_MODEL_RUNNER"))
    }
    env.update(
        HF_HUB_OFFLINE="1",
        VLLM_NO_USAGE_STATS="1",
        VLLM_ENABLE_V1_MULTIPROCESSING="0",
        # A CPU engine otherwise sizes its KV cache to most of the machine's memory, and
        # zeroing it takes longer than the test.
        VLLM_CPU_KVCACHE_SPACE="1",
        PYTHONUNBUFFERED="1",
    )
    if CUDA:
        # flashinfer is not installed there; the CUDA sampler imports it otherwise.
        env["VLLM_USE_FLASHINFER_SAMPLER"] = "0"
    env.update(extra)
    return env


@dataclass
class EngineRun:
    """What one engine child did: its exit status, its output and its JSON report."""

    returncode: int
    output: str
    result: dict[str, Any] | None

    def tail(self, lines: int = 60) -> str:
        """The end of the child's output, for a failure message."""
        return "\n".join(self.output.splitlines()[-lines:])

    def ok(self) -> dict[str, Any]:
        """The report of a child that succeeded; a failure with its output otherwise."""
        if self.returncode != 0 or self.result is None:
            pytest.fail(f"engine exited with {self.returncode}:\n{self.tail()}")
        return self.result


def run_engine(
    model: Path,
    out_dir: Path,
    *,
    env: Mapping[str, str],
    overrides: Mapping[str, Any] | None = None,
    args: tuple[str, ...] = (),
) -> EngineRun:
    """Run ``engine_run.py`` on ``model`` with ``env`` and return what it did."""
    out_dir.mkdir(parents=True, exist_ok=True)
    report = out_dir / "result.json"
    command = [
        sys.executable,
        str(ENGINE_RUN),
        "--model",
        str(model),
        "--out",
        str(report),
        "--overrides",
        json.dumps(dict(overrides or {})),
        *args,
    ]
    completed = subprocess.run(
        command,
        env=dict(env),
        cwd=out_dir,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=ENGINE_TIMEOUT_S,
        check=False,
    )
    (out_dir / "output.log").write_text(completed.stdout)
    result = json.loads(report.read_text()) if report.exists() else None
    return EngineRun(completed.returncode, completed.stdout, result)


def free_port() -> int:
    """A TCP port free on loopback now."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])
