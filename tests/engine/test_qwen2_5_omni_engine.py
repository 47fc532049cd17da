"""omnitrace inside a real vLLM engine serving a tiny Qwen2.5-Omni checkpoint.

The checkpoint comes from :mod:`omnitrace.testing_checkpoints` (random weights through
``load_format="dummy"``); omnitrace is loaded by vLLM through its ``vllm.general_plugins``
entry point, as in ``vllm serve``. On a CPU (the engine CI tier, vLLM's CPU build) the
adapters attach and every call runs eagerly (``ineligible``, detail ``cpu``); on a CUDA
device the same tests run on both of vLLM's model runners (V2, the default, and V1) with
graphs captured and replayed beside vLLM's own language-model graphs.

What each engine did comes from three independent places that must agree: forward hooks in
the worker (a digest of every tower output), the adapters' statistics, and the JSONL event
log read back by ``omnitrace top --json``.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (the engine CI tier installs it)")

from engine.support import (
    CUDA,
    EngineRun,
    engine_environment,
    run_engine,
)
from omnitrace.testing_otlp import OTLPReceiver, attributes

pytestmark = pytest.mark.engine

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
ENCODERS = {"vision": "visual", "audio": "audio_tower"}
OVERRIDES: dict[str, Any] = {
    "encoder_cuda_graph_min_free_bytes": 0,
    "encoder_cuda_graph_max_graphs": 8,
    # Without flash_attn (no wheel for the GPU machine's torch) the audio tower graphs only
    # through omnitrace's masked attention; the baseline uses the same route, so outputs
    # still compare bit for bit.
    "encoder_cuda_graph_audio_attention": "masked",
}
#: The runners each device runs: vLLM's CPU runner, or both GPU runners.
RUNNERS = ("v2", "v1") if CUDA else ("cpu",)


def _runner_env(runner: str) -> dict[str, str]:
    return {"VLLM_USE_V2_MODEL_RUNNER": "0"} if runner == "v1" else {}


def _events(log: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in log.read_text().splitlines() if line.strip()]


def _calls(events: list[dict[str, Any]], adapter: str, phase: str) -> list[dict[str, Any]]:
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

    def __init__(self, run: EngineRun, log: Path, receiver: OTLPReceiver) -> None:
        self.run = run
        self.result = run.ok()
        self.log = log
        self.events = _events(log)
        self.receiver = receiver


@pytest.fixture(scope="module", params=RUNNERS)
def runner(request: pytest.FixtureRequest) -> str:
    """The model runner the engines of a test use."""
    return str(request.param)


@pytest.fixture(scope="module")
def served(checkpoint: Path, engine_dir: Path, runner: str) -> Any:
    """An engine with the plugin on, its event log and OTLP export to a loopback receiver."""
    out = engine_dir / f"on-{runner}"
    log = out / "events-{rank}-{pid}.jsonl"
    with OTLPReceiver() as receiver:
        run = run_engine(
            checkpoint,
            out,
            env=engine_environment(
                OMNITRACE_EVENTS_LOG=str(log),
                OMNITRACE_OTLP="1",
                OTEL_EXPORTER_OTLP_ENDPOINT=receiver.endpoint,
                OTEL_METRIC_EXPORT_INTERVAL="500",
                OTEL_BSP_SCHEDULE_DELAY="200",
                **_runner_env(runner),
            ),
            overrides=OVERRIDES,
        )
        logs = sorted(out.glob("events-*.jsonl"))
        assert len(logs) == 1, f"expected one worker's event log in {out}: {logs}\n{run.tail()}"
        yield Served(run, logs[0], receiver)


@pytest.fixture(scope="module")
def baseline(checkpoint: Path, engine_dir: Path, runner: str) -> dict[str, Any]:
    """The same engine without omnitrace's graphs: the plugin off on a CPU, graphs off on CUDA."""
    if CUDA:
        env = engine_environment(**_runner_env(runner))
        overrides = {**OVERRIDES, "encoder_cuda_graph": False}
    else:
        env = engine_environment(OMNITRACE_PLUGIN="0")
        overrides = OVERRIDES
    return run_engine(checkpoint, engine_dir / f"off-{runner}", env=env, overrides=overrides).ok()


def test_the_plugin_attaches_both_encoders_and_logs_one_line(served: Served) -> None:
    """The worker logs one "encoder graphs attached" line naming both towers and the model."""
    lines = [line for line in served.run.output.splitlines() if "encoder graphs attached" in line]
    assert len(lines) == 1, served.run.tail()
    assert "vision=True, audio=True" in lines[0]
    assert f"model=qwen2_5_omni, pid={served.result['pid']}, rank=0" in lines[0]
    assert set(served.result["adapters"]) == {"vision", "audio"}
    assert {a["backend"] for a in served.result["adapters"].values()} == {"VllmGraphBackend"}


def test_every_tower_call_is_one_call_event_with_pid_and_rank(served: Served) -> None:
    """Each serving call the hooks saw is one event in the log, tagged with the worker."""
    for adapter, tower in ENCODERS.items():
        seen = served.result["outputs"][tower]
        assert seen, f"the {tower} never ran"
        serving = _calls(served.events, adapter, "serving")
        assert len(serving) == len(seen), (adapter, len(serving), len(seen))
    assert {(e["pid"], e["rank"]) for e in served.events} == {(served.result["pid"], 0)}


def test_the_profiling_run_is_tagged_or_reported(served: Served, runner: str) -> None:
    """V1-style runners tag their dummy encoder calls; a runner that profiles none says so."""
    profiling = [e for e in served.events if e.get("phase") == "profiling"]
    observed = [e for e in served.events if e["type"] == "ProfilingObserved"]
    assert {e["adapter"] for e in observed} == set(ENCODERS), observed
    calls = [e for e in profiling if e["type"] in ("GraphReplayed", "GraphMissed")]
    assert sum(e["encoder_calls"] for e in observed) == len(calls)
    if runner == "v2":
        assert calls == []
        notices = [line for line in served.run.output.splitlines() if "called no encoder" in line]
        assert len(notices) == 1, served.run.tail()
    else:
        assert calls, "the profiling run called no encoder"
        first_serving = min(
            i
            for i, e in enumerate(served.events)
            if e.get("phase", "serving") == "serving"
            and e["type"] in ("GraphReplayed", "GraphMissed")
        )
        assert all(served.events.index(e) < first_serving for e in calls)


def test_top_json_on_the_log_equals_the_adapters_stats(served: Served) -> None:
    """``omnitrace top --json`` folds the engine's log into exactly the adapters' stats."""
    shown = subprocess.run(
        [sys.executable, "-m", "omnitrace", "top", "--json", str(served.log)],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    encoders = {row["encoder"]: row for row in json.loads(shown.stdout)["encoders"]}
    assert set(encoders) == set(ENCODERS)
    for adapter, row in encoders.items():
        stats = served.result["adapters"][adapter]["stats"]
        assert {key: row[key] for key in STATS_KEYS} == stats, adapter


def test_graphs_serve_on_cuda_and_calls_stay_eager_on_a_cpu(served: Served) -> None:
    """CUDA: both encoders capture and replay; CPU: every call is an ineligible ``cpu`` miss."""
    for adapter in ENCODERS:
        stats = served.result["adapters"][adapter]["stats"]
        calls = _calls(served.events, adapter, "serving") + _calls(
            served.events, adapter, "profiling"
        )
        if CUDA:
            assert stats["num_graphs"] >= 1, (adapter, stats)
            assert stats["graph_hits"] >= 1, (adapter, stats)
            assert stats["capture_failures"] == 0
            captured = [e for e in served.events if e["type"] == "GraphCaptured"]
            assert all(e["free_bytes"] is not None for e in captured), captured
        else:
            assert stats["graph_hits"] == 0
            assert stats["ineligible_misses"] == stats["graph_misses"] == len(calls)
            assert Counter(e["detail"] for e in calls) == {"cpu": len(calls)}


def test_telemetry_reaches_the_loopback_receiver_with_the_workers_rank(served: Served) -> None:
    """The worker's OTLP export arrives: call metrics by encoder, the rank as a resource."""
    receiver = served.receiver
    assert receiver.wait_for(lambda r: r.metrics("omnitrace.encoder.calls"), timeout=10)
    resources = [attributes(rs.resource.attributes) for rs in receiver.resource_spans()] + [
        attributes(rm.resource.attributes)
        for request in receiver.metrics_requests
        for rm in request.resource_metrics
    ]
    assert resources
    assert all(r.get("omnitrace.worker.rank") == 0 for r in resources)
    encoders = {
        attributes(point.attributes)["omnitrace.encoder"]
        for metric in receiver.metrics("omnitrace.encoder.calls")
        for point in metric.sum.data_points
    }
    assert encoders == set(ENCODERS)
    # Every runner's profiling run is reported per encoder as an instant span, so spans
    # arrive on a CPU too, where nothing is captured.
    assert receiver.wait_for(lambda r: r.spans("omnitrace.graph.profiling_run"), timeout=10)
    profiled = {
        attributes(s.attributes)["omnitrace.encoder"]
        for s in receiver.spans("omnitrace.graph.profiling_run")
    }
    assert profiled == set(ENCODERS)
    if CUDA:
        spans = receiver.spans("omnitrace.graph.capture")
        assert {attributes(s.attributes)["omnitrace.encoder"] for s in spans} == set(ENCODERS)


def test_outputs_with_omnitrace_equal_outputs_without(
    served: Served, baseline: dict[str, Any]
) -> None:
    """Every tower output is bit-for-bit the same, and so are the greedy tokens and logprobs."""
    on = served.result
    assert on["outputs"] == baseline["outputs"]
    assert on["tokens"] == baseline["tokens"]
    assert on["logprobs"] == baseline["logprobs"]
    assert on["chat_tokens"] == baseline["chat_tokens"]
    assert on["chat_logprobs"] == baseline["chat_logprobs"]
    if not CUDA:
        # The plugin was off: nothing was attached.
        assert baseline["adapters"] == {}
