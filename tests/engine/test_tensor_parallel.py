"""omnitrace in a real vLLM engine at ``tensor_parallel_size=2``: one worker process per rank.

Each rank is its own worker process, with its own adapters, bus and event log
(``events-{rank}-{pid}.jsonl``). On a CPU (the engine CI tier: vLLM's CPU build runs both
ranks on this machine's cores, one core each) every call of both ranks runs eagerly, and the
tokens equal those of the same engine with the plugin off. On CUDA (two devices; skipped
with fewer) each rank captures and replays on its own device, and the tokens equal those of
the same engine with omnitrace's graphs off, for each way vLLM can run the model's encoders
across the ranks (``mm_encoder_tp_mode``: ``weights``, vLLM's default, shards them;
``data`` runs them whole on each rank on its share of the items, where the model allows it:
vLLM 0.26's Qwen2.5-Omni thinker does not, and falls back to ``weights``).
"""

from __future__ import annotations

import os
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("vllm", reason="vLLM is not installed (the engine CI tier installs it)")

from engine.support import (
    CUDA,
    STATS_KEYS,
    EngineRun,
    calls,
    engine_environment,
    read_events,
    run_engine,
    top_json,
)

pytestmark = pytest.mark.engine

RANKS = 2
ADAPTERS = ("vision", "audio")
OVERRIDES: dict[str, Any] = {
    "encoder_cuda_graph_min_free_bytes": 0,
    "encoder_cuda_graph_max_graphs": 8,
    "encoder_cuda_graph_audio_attention": "masked",
}
TWO_DEVICES = CUDA and torch.cuda.device_count() >= RANKS


def _modes() -> tuple[str, ...]:
    """The encoder modes vLLM offers for the Qwen2.5-Omni thinker: ``weights`` always,
    ``data`` where the model declares it can run its encoders data-parallel."""
    from vllm.model_executor.models.qwen2_5_omni_thinker import (
        Qwen2_5OmniThinkerForConditionalGeneration as Thinker,
    )

    return (
        ("weights", "data") if getattr(Thinker, "supports_encoder_tp_data", False) else ("weights",)
    )


#: CUDA: each mode vLLM offers; a CPU runs vLLM's default only.
MODES = _modes() if CUDA else ("weights",)


def _cpu_binding(ranks: int) -> str:
    """``VLLM_CPU_OMP_THREADS_BIND`` giving each rank its share of the allowed cores.

    vLLM's automatic binding puts each rank on a NUMA node of its own, and a machine with
    one node refuses a second rank ("Not enough allowed NUMA nodes").
    """
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < ranks:
        return "nobind"
    share = len(cpus) // ranks
    return "|".join(",".join(map(str, cpus[i * share : (i + 1) * share])) for i in range(ranks))


class TensorParallel:
    """One TP=2 engine with the plugin on, its baseline, and each rank's event log."""

    def __init__(self, on: EngineRun, baseline: EngineRun, out: Path, mode: str) -> None:
        self.run = on
        self.result = on.ok()
        self.baseline = baseline.ok()
        self.out = out
        self.mode = mode
        self.workers = sorted(self.result["workers"], key=lambda w: w["rank"])
        self.logs = {w["rank"]: out / f"events-{w['rank']}-{w['pid']}.jsonl" for w in self.workers}


@pytest.fixture(scope="module", params=MODES)
def tp(request: pytest.FixtureRequest, checkpoint: Path, engine_dir: Path) -> TensorParallel:
    """The engine with omnitrace on at TP=2, and the same engine without it (CPU: plugin off;
    CUDA: graphs off)."""
    mode = str(request.param)
    if CUDA and not TWO_DEVICES:
        pytest.skip(f"needs {RANKS} CUDA devices, found {torch.cuda.device_count()}")
    extra: dict[str, str] = {} if CUDA else {"VLLM_CPU_OMP_THREADS_BIND": _cpu_binding(RANKS)}
    args = ("--tensor-parallel-size", str(RANKS))
    if CUDA:
        args += ("--mm-encoder-tp-mode", mode)
    out = engine_dir / f"tp{RANKS}-{mode}-on"
    on = run_engine(
        checkpoint,
        out,
        env=engine_environment(
            OMNITRACE_EVENTS_LOG=str(out / "events-{rank}-{pid}.jsonl"), **extra
        ),
        overrides=OVERRIDES,
        args=args,
    )
    if CUDA:
        baseline_env = engine_environment(**extra)
        baseline_overrides = {**OVERRIDES, "encoder_cuda_graph": False}
    else:
        baseline_env = engine_environment(OMNITRACE_PLUGIN="0", **extra)
        baseline_overrides = OVERRIDES
    baseline = run_engine(
        checkpoint,
        engine_dir / f"tp{RANKS}-{mode}-off",
        env=baseline_env,
        overrides=baseline_overrides,
        args=args,
    )
    return TensorParallel(on, baseline, out, mode)


def _gpu(test: Any) -> Any:
    """Mark a CUDA-only test: ``gpu``, and skipped without two devices."""
    test = pytest.mark.gpu(test)
    return pytest.mark.skipif(not TWO_DEVICES, reason=f"needs {RANKS} CUDA devices")(test)


def test_each_rank_writes_its_own_log_and_names_itself_on_every_line(tp: TensorParallel) -> None:
    """Two worker processes, ranks 0 and 1, each with ``events-{rank}-{pid}.jsonl`` whose
    every line carries that rank and pid (vLLM's workers set no RANK: the plugin asks vLLM's
    world group); beside them, the requests' log of the process that ran ``vllm.LLM``."""
    assert [w["rank"] for w in tp.workers] == list(range(RANKS))
    assert len({w["pid"] for w in tp.workers}) == RANKS
    logs = sorted(tp.out.glob("events-*.jsonl"))
    requests = [p for p in logs if p.name.startswith("events-api-")]
    assert len(requests) == 1, logs
    assert sorted(set(logs) - set(requests)) == sorted(tp.logs.values())
    assert {e["type"] for e in read_events(requests[0])} == {"RequestTimed"}
    for worker in tp.workers:
        events = read_events(tp.logs[worker["rank"]])
        assert {(e["rank"], e["pid"]) for e in events} == {(worker["rank"], worker["pid"])}


def test_both_ranks_attach_both_encoders_and_log_their_rank(tp: TensorParallel) -> None:
    """One "encoder graphs attached" line per rank, naming its pid and rank; each rank's
    model holds both adapters on vLLM's backend."""
    lines = [line for line in tp.run.output.splitlines() if "encoder graphs attached" in line]
    assert len(lines) == RANKS, tp.run.tail()
    for worker in tp.workers:
        (line,) = [line for line in lines if f"pid={worker['pid']}," in line]
        assert "vision=True, audio=True" in line
        assert f"model=qwen2_5_omni, pid={worker['pid']}, rank={worker['rank']}" in line
        assert set(worker["adapters"]) == set(ADAPTERS)
        assert {a["backend"] for a in worker["adapters"].values()} == {"VllmGraphBackend"}


def test_every_tower_call_of_each_rank_is_one_call_event_in_its_log(tp: TensorParallel) -> None:
    """The calls each rank's hooks saw are the call events of that rank's log."""
    for worker in tp.workers:
        events = read_events(tp.logs[worker["rank"]])
        for adapter, tower in (("vision", "visual"), ("audio", "audio_tower")):
            seen = worker["outputs"][tower]
            assert seen, (worker["rank"], tower)
            assert len(calls(events, adapter, "serving")) == len(seen), (worker["rank"], adapter)


def test_top_json_over_the_ranks_logs_shows_each_rank_and_their_total(tp: TensorParallel) -> None:
    """``omnitrace top --json 'events-*.jsonl'`` folds each rank's log into exactly its
    adapters' stats, and its total into their sum."""
    data = top_json(tp.out / "events-*.jsonl")
    rows = {(row["rank"], row["encoder"]): row for row in data["encoders"]}
    assert set(rows) == {(w["rank"], a) for w in tp.workers for a in ADAPTERS}
    for worker in tp.workers:
        for adapter in ADAPTERS:
            row = rows[(worker["rank"], adapter)]
            assert {key: row[key] for key in STATS_KEYS} == worker["adapters"][adapter]["stats"]
            assert row["pid"] == worker["pid"]
    total = {row["encoder"]: row for row in data["total"]["encoders"]}
    for adapter in ADAPTERS:
        assert total[adapter]["workers"] == RANKS
        for key in ("graph_hits", "graph_misses", "num_graphs"):
            expected = sum(w["adapters"][adapter]["stats"][key] for w in tp.workers)
            assert total[adapter][key] == expected, (adapter, key)


@pytest.mark.skipif(CUDA, reason="the CPU build's behaviour; CUDA graphs are tested below")
def test_on_a_cpu_every_call_of_both_ranks_is_an_ineligible_cpu_miss(tp: TensorParallel) -> None:
    """No graph on a CPU: every call of each rank is an eager ``cpu`` miss."""
    for worker in tp.workers:
        events = read_events(tp.logs[worker["rank"]])
        for adapter in ADAPTERS:
            stats = worker["adapters"][adapter]["stats"]
            made = calls(events, adapter, "serving") + calls(events, adapter, "profiling")
            assert stats["graph_hits"] == 0
            assert stats["ineligible_misses"] == stats["graph_misses"] == len(made)
            assert Counter(e["detail"] for e in made) == {"cpu": len(made)}


@_gpu
def test_each_rank_captures_and_replays_on_its_own_device(tp: TensorParallel) -> None:
    """Both encoders of each rank capture and replay, every graph on that rank's device."""
    for worker in tp.workers:
        rank = worker["rank"]
        events = read_events(tp.logs[rank])
        for adapter in ADAPTERS:
            stats = worker["adapters"][adapter]["stats"]
            assert stats["num_graphs"] >= 1, (rank, adapter, stats)
            assert stats["graph_hits"] >= 1, (rank, adapter, stats)
            assert stats["capture_failures"] == 0
            captured = [
                e for e in events if e["type"] == "GraphCaptured" and e["adapter"] == adapter
            ]
            assert {e["device"] for e in captured} == {f"cuda:{rank}"}, (rank, adapter)
            assert all(e["free_bytes"] is not None for e in captured)


def test_every_rank_runs_the_encoders_in_the_mode_asked(tp: TensorParallel) -> None:
    """The mode asked (on a CPU vLLM's default, ``weights``) is the one each rank's engine
    runs: vLLM offers ``data`` only where the model declares it, so none falls back here."""
    assert {w["mm_encoder_tp_mode"] for w in tp.workers} == {tp.mode}


def test_tokens_and_tower_outputs_equal_those_without_omnitrace(tp: TensorParallel) -> None:
    """Each rank's tower outputs bit for bit, and the greedy tokens and logprobs, equal the
    baseline's (CPU: the plugin off; CUDA: omnitrace's graphs off)."""
    on, off = tp.result, tp.baseline
    for key in ("tokens", "logprobs", "chat_tokens", "chat_logprobs"):
        assert on[key] == off[key], key
    by_rank = {w["rank"]: w for w in off["workers"]}
    for worker in tp.workers:
        assert worker["outputs"] == by_rank[worker["rank"]]["outputs"], worker["rank"]
    if not CUDA:
        assert all(w["adapters"] == {} for w in off["workers"])
