"""Engines run as child processes, for the engine tests.

Each engine runs in a process of its own (``engine_run.py`` for ``vllm.LLM``, ``vllm serve``
for the server), because vLLM reads its plugins and environment once per process. A child
that fails is a test failure with the end of its output, never a skip.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections import Counter
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import pytest
import torch

from omnitrace.testing_checkpoints.serving import free_port, serve_command

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


# -- vllm serve children -----------------------------------------------------------------------


class Server:
    """A ``vllm serve`` child on loopback, its output file and its event log."""

    #: Whether the child leads a process group of its own (see :func:`start_server`).
    new_session: ClassVar[bool] = False

    def __init__(
        self,
        process: subprocess.Popen[bytes],
        port: int,
        output: Path,
        log: Path,
        model: str = "qwen2_5_omni",
    ):
        self.process = process
        self.port = port
        self.output = output
        self.log = log
        self.model = model

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def text(self) -> str:
        return self.output.read_text(errors="replace")

    def tail(self, lines: int = 60) -> str:
        return "\n".join(self.text().splitlines()[-lines:])

    def wait_ready(self, timeout: float) -> None:
        """Wait for ``/health``; fail with the server's output if it dies or never answers."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                pytest.fail(self.exited_message())
            try:
                with urllib.request.urlopen(f"{self.base_url}/health", timeout=2) as response:
                    if response.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            time.sleep(1)
        pytest.fail(self.unready_message(timeout))

    def exited_message(self) -> str:
        """The failure message for a server that exited before it answered ``/health``."""
        return f"vllm serve exited with {self.process.returncode}:\n{self.tail()}"

    def unready_message(self, timeout: float) -> str:
        """The failure message for a server that did not answer ``/health`` in time."""
        return f"vllm serve did not answer /health within {timeout:.0f} s:\n{self.tail()}"

    def stop(self) -> int:
        """Stop the server as an operator would (SIGINT), and return its exit status."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGINT)
            try:
                return self.process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=30)
                pytest.fail(f"vllm serve ignored SIGINT for 60 s:\n{self.tail()}")
        return int(self.process.returncode)


@contextmanager
def start_server(
    command: Sequence[str],
    *,
    port: int,
    cwd: Path,
    env: Mapping[str, str],
    log: Path,
    model: str = "qwen2_5_omni",
    kind: type[Server] = Server,
) -> Iterator[Server]:
    """Run ``command`` (a server on 127.0.0.1:``port``) in ``cwd``, its output in
    ``cwd/serve.log``; yield it once ``/health`` answers, and stop it on the way out.

    ``kind`` is the :class:`Server` (or subclass) that waits for it and stops it; one whose
    ``new_session`` is true starts the command in a session of its own."""
    output = cwd / "serve.log"
    with output.open("wb") as sink:
        process = subprocess.Popen(
            list(command),
            env=dict(env),
            cwd=cwd,
            stdout=sink,
            stderr=subprocess.STDOUT,
            start_new_session=kind.new_session,
        )
    server = kind(process, port, output, log, model)
    try:
        server.wait_ready(ENGINE_TIMEOUT_S)
        yield server
    finally:
        server.stop()


@contextmanager
def serve_checkpoint(
    checkpoint: Path,
    out: Path,
    *,
    hf_overrides: Mapping[str, Any],
    extra: Sequence[str] = (),
    model: str = "qwen2_5_omni",
    **env: str,
) -> Iterator[Server]:
    """``vllm serve`` on ``checkpoint`` in ``out`` on a free port, ready for requests.

    At most 2048 tokens a sequence and 4 sequences, with ``hf_overrides`` and the ``extra``
    arguments; the workers' event logs are ``out/events-{rank}.jsonl`` (``Server.log`` is
    rank 0's), and ``env`` is added to :func:`engine_environment`."""
    port = free_port()
    environment = engine_environment(OMNITRACE_EVENTS_LOG=str(out / "events-{rank}.jsonl"), **env)
    # The server runs its engine in a process of its own, as it does for users.
    environment.pop("VLLM_ENABLE_V1_MULTIPROCESSING")
    command = serve_command(
        checkpoint,
        port,
        max_model_len=2048,
        max_num_seqs=4,
        hf_overrides=hf_overrides,
        extra=extra,
    )
    with start_server(
        command, port=port, cwd=out, env=environment, log=out / "events-0.jsonl", model=model
    ) as server:
        yield server


# -- what the engine tests of every model check ------------------------------------------------

STATS_KEYS = (
    "graph_hits",
    "graph_misses",
    "hit_rate",
    "num_graphs",
    "ineligible_misses",
    "capacity_misses",
    "warmup_misses",
    "memory_misses",
    "capture_failures",
)
#: The runners each device runs: vLLM's CPU runner, or both GPU runners.
RUNNERS = ("v2", "v1") if CUDA else ("cpu",)


def runner_env(runner: str) -> dict[str, str]:
    """The environment that picks ``runner`` (V2 is vLLM 0.26's default on CUDA)."""
    return {"VLLM_USE_V2_MODEL_RUNNER": "0"} if runner == "v1" else {}


def read_events(log: Path) -> list[dict[str, Any]]:
    """Every record of a JSONL event log, as parsed JSON."""
    return [json.loads(line) for line in log.read_text().splitlines() if line.strip()]


def calls(events: list[dict[str, Any]], adapter: str, phase: str) -> list[dict[str, Any]]:
    """The call events (one per encoder call) of ``adapter`` in ``phase``."""
    return [
        e
        for e in events
        if e["type"] in ("GraphReplayed", "GraphMissed")
        and e["adapter"] == adapter
        and e.get("phase", "serving") == phase
    ]


class Served:
    """One engine with omnitrace on and everything it left behind."""

    def __init__(self, run: EngineRun, log: Path, receiver: Any = None) -> None:
        self.run = run
        self.result = run.ok()
        self.log = log
        self.events = read_events(log)
        self.receiver = receiver


def adapter_facts(events: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Each adapter's registered facts, from the ``AdapterInfo`` lines of a worker's log."""
    return {e["adapter"]: e["info"] for e in events if e["type"] == "AdapterInfo"}


def only_log(out: Path, run: EngineRun) -> Path:
    """The one worker's event log an engine wrote in ``out``."""
    logs = sorted(out.glob("events-*.jsonl"))
    assert len(logs) == 1, f"expected one worker's event log in {out}: {logs}\n{run.tail()}"
    return logs[0]


def check_attached_line(served: Served, expected: str, model: str) -> None:
    """One "encoder graphs attached" line with ``expected`` in it, naming model, pid, rank."""
    lines = [line for line in served.run.output.splitlines() if "encoder graphs attached" in line]
    assert len(lines) == 1, served.run.tail()
    assert expected in lines[0]
    assert f"model={model}, pid={served.result['pid']}, rank=0" in lines[0]
    assert set(served.result["adapters"]) == {"vision", "audio"}
    assert {a["backend"] for a in served.result["adapters"].values()} == {"VllmGraphBackend"}


def check_call_events(served: Served, encoders: Mapping[str, str]) -> None:
    """Each serving call the digests saw is one event in the log, tagged with the worker."""
    for adapter, digested in encoders.items():
        seen = served.result["outputs"][digested]
        assert seen, f"{digested} never ran"
        assert len(calls(served.events, adapter, "serving")) == len(seen), adapter
    assert {(e["pid"], e["rank"]) for e in served.events} == {(served.result["pid"], 0)}


def check_profiling(served: Served, runner: str, adapters: Iterable[str]) -> None:
    """V1-style runners tag their dummy encoder calls; a runner that profiles none says so."""
    profiling = [e for e in served.events if e.get("phase") == "profiling"]
    observed = [e for e in served.events if e["type"] == "ProfilingObserved"]
    assert {e["adapter"] for e in observed} == set(adapters), observed
    made = [e for e in profiling if e["type"] in ("GraphReplayed", "GraphMissed")]
    assert sum(e["encoder_calls"] for e in observed) == len(made)
    if runner == "v2":
        assert made == []
        notices = [line for line in served.run.output.splitlines() if "called no encoder" in line]
        assert len(notices) == 1, served.run.tail()
    else:
        assert made, "the profiling run called no encoder"
        first_serving = min(
            i
            for i, e in enumerate(served.events)
            if e.get("phase", "serving") == "serving"
            and e["type"] in ("GraphReplayed", "GraphMissed")
        )
        assert all(served.events.index(e) < first_serving for e in made)


def top_json(*logs: str | Path) -> dict[str, Any]:
    """What ``omnitrace top --json LOGS`` prints, parsed; it must exit 0."""
    shown = subprocess.run(
        [sys.executable, "-m", "omnitrace", "top", "--json", *map(str, logs)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert shown.returncode == 0, shown.stderr
    data: dict[str, Any] = json.loads(shown.stdout)
    return data


def check_top_json(served: Served, adapters: Iterable[str]) -> None:
    """``omnitrace top --json`` folds the engine's log into exactly the adapters' stats."""
    encoders = {row["encoder"]: row for row in top_json(served.log)["encoders"]}
    assert set(encoders) == set(adapters)
    for adapter, row in encoders.items():
        stats = served.result["adapters"][adapter]["stats"]
        assert {key: row[key] for key in STATS_KEYS} == stats, adapter


def check_graphs_or_eager(served: Served, adapters: Iterable[str]) -> None:
    """CUDA: every encoder captures and replays; CPU: every call is an ineligible ``cpu`` miss."""
    for adapter in adapters:
        report = served.result["adapters"][adapter]
        stats = report["stats"]
        made = calls(served.events, adapter, "serving") + calls(served.events, adapter, "profiling")
        if CUDA:
            assert stats["num_graphs"] >= 1, (adapter, stats)
            assert stats["graph_hits"] >= 1, (adapter, stats)
            assert stats["capture_failures"] == 0
            assert report["captured"], adapter
            captured = [
                e for e in served.events if e["type"] == "GraphCaptured" and e["adapter"] == adapter
            ]
            assert all(e["free_bytes"] is not None for e in captured), captured
        else:
            assert stats["graph_hits"] == 0
            assert stats["ineligible_misses"] == stats["graph_misses"] == len(made)
            serving = Counter(e["detail"] for e in calls(served.events, adapter, "serving"))
            assert set(serving) <= {"cpu"}, (adapter, serving)
            # vLLM's profiling run may pass MiniCPM-o slices wider than the resampler's
            # positional table: vLLM's own method runs those (and grows its table).
            profiling = Counter(e["detail"] for e in calls(served.events, adapter, "profiling"))
            assert set(profiling) <= {"cpu", "pos_cache"}, (adapter, profiling)


def check_parity(on: Mapping[str, Any], baseline: Mapping[str, Any]) -> None:
    """Every encoder output bit for bit, and the greedy tokens and logprobs, equal."""
    assert on["outputs"] == baseline["outputs"]
    assert on["tokens"] == baseline["tokens"]
    assert on["logprobs"] == baseline["logprobs"]
    assert on["chat_tokens"] == baseline["chat_tokens"]
    assert on["chat_logprobs"] == baseline["chat_logprobs"]
    if not CUDA:
        # The plugin was off: nothing was attached.
        assert baseline["adapters"] == {}
