"""omnitrace inside a real vLLM engine serving a tiny MiniCPM-o 4.5 checkpoint.

The checkpoint comes from :func:`omnitrace.testing_checkpoints.write_minicpmo`: its config
class, image processor and tokenizer are omnitrace's own remote code, loaded with
``trust_remote_code=True``, and vLLM's ``MiniCPMO`` (``MiniCPMO4_5``), its processing and its
vendored ``MiniCPMOProcessor`` run unmodified on it with random weights. omnitrace is loaded
by vLLM through its ``vllm.general_plugins`` entry point and attaches
``omnitrace.integrations.minicpmo``: the vision adapter on ``vpm.encoder``, the audio adapter
through ``get_audio_hidden_states``. The prompts hold images of one to five slices (square,
wide and tall) and clips of 1 s to 30 s.

On a CPU (the engine CI tier) every call runs eagerly (``ineligible``, detail ``cpu``) and
the baseline is the same engine with the plugin off. On a CUDA device the same tests expect
captures and replays on both of vLLM's model runners, against a baseline with
``encoder_cuda_graph: false``; those expectations are written but have only run on a CPU.
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

from engine.support import CUDA, EngineRun, engine_environment, run_engine
from omnitrace.testing_checkpoints.minicpmo_remote.image_processing_minicpmo import (
    MiniCPMOImageProcessor,
)

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
#: Each adapter and the digests that stand for its calls in engine_run.py's report.
ENCODERS = {"vision": "vpm", "audio": "get_audio_hidden_states"}
OVERRIDES: dict[str, Any] = {
    "encoder_cuda_graph_min_free_bytes": 0,
    # Vision batches and padded audio batches come in many shapes; keep them all.
    "encoder_cuda_graph_max_graphs": 32,
}
RUNNERS = ("v2", "v1") if CUDA else ("cpu",)
# A third round on CUDA: a key is captured on its second call and replayed after that.
REPEAT = 3 if CUDA else 2
#: (width, height) of each image engine_run.py sends per round, then the chat's image.
ROUND_IMAGES = ((224, 224), (896, 448), (448, 1344), (1000, 700), (300, 500))
CHAT_IMAGES = ((252, 252),)
#: Seconds of each clip per round, then the chat's clip.
ROUND_CLIPS = (1.0, 30.0, 2.5, 7.0)
CHAT_CLIPS = (1.5,)


def _args() -> tuple[str, ...]:
    return ("--model-kind", "minicpmo", "--repeat", str(REPEAT))


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


def _first_shape(event: dict[str, Any]) -> list[int]:
    """The shape of a call's first input: ``(B, L, D)`` vision, ``(B, mels, frames)`` audio."""
    shape: list[int] = event["signature"]["inputs"][0]["shape"]
    return shape


class Served:
    """One engine with omnitrace on and everything it left behind."""

    def __init__(self, run: EngineRun, log: Path) -> None:
        self.run = run
        self.result = run.ok()
        self.log = log
        self.events = _events(log)


@pytest.fixture(scope="module", params=RUNNERS)
def runner(request: pytest.FixtureRequest) -> str:
    """The model runner the engines of a test use."""
    return str(request.param)


@pytest.fixture(scope="module")
def served(minicpmo_checkpoint: Path, engine_dir: Path, runner: str) -> Served:
    """An engine with the plugin on and its event log."""
    out = engine_dir / f"minicpmo-on-{runner}"
    run = run_engine(
        minicpmo_checkpoint,
        out,
        env=engine_environment(
            OMNITRACE_EVENTS_LOG=str(out / "events-{rank}-{pid}.jsonl"), **_runner_env(runner)
        ),
        overrides=OVERRIDES,
        args=_args(),
    )
    logs = sorted(out.glob("events-*.jsonl"))
    assert len(logs) == 1, f"expected one worker's event log in {out}: {logs}\n{run.tail()}"
    return Served(run, logs[0])


@pytest.fixture(scope="module")
def baseline(minicpmo_checkpoint: Path, engine_dir: Path, runner: str) -> dict[str, Any]:
    """The same engine without omnitrace's graphs: the plugin off on a CPU, graphs off on CUDA."""
    if CUDA:
        env = engine_environment(**_runner_env(runner))
        overrides = {**OVERRIDES, "encoder_cuda_graph": False}
    else:
        env = engine_environment(OMNITRACE_PLUGIN="0")
        overrides = OVERRIDES
    out = engine_dir / f"minicpmo-off-{runner}"
    return run_engine(minicpmo_checkpoint, out, env=env, overrides=overrides, args=_args()).ok()


def test_the_plugin_attaches_both_encoders_and_logs_one_line(served: Served) -> None:
    """The worker logs one "encoder graphs attached" line naming both encoders and minicpmo."""
    lines = [line for line in served.run.output.splitlines() if "encoder graphs attached" in line]
    assert len(lines) == 1, served.run.tail()
    assert "vision=True, audio=True, audio_method=get_audio_hidden_states" in lines[0]
    assert f"model=minicpmo, pid={served.result['pid']}, rank=0" in lines[0]
    assert set(served.result["adapters"]) == {"vision", "audio"}
    assert {a["backend"] for a in served.result["adapters"].values()} == {"VllmGraphBackend"}


def test_every_encoder_call_is_one_call_event_with_pid_and_rank(served: Served) -> None:
    """Each serving call the digests saw is one event in the log, tagged with the worker."""
    for adapter, tower in ENCODERS.items():
        seen = served.result["outputs"][tower]
        assert seen, f"{tower} never ran"
        assert len(_calls(served.events, adapter, "serving")) == len(seen), adapter
    assert {(e["pid"], e["rank"]) for e in served.events} == {(served.result["pid"], 0)}


def test_every_slice_of_every_image_reaches_the_vision_encoder(served: Served) -> None:
    """The vision calls' batches add up to the slices the image processor makes of each image."""
    grids = [MiniCPMOImageProcessor().get_sliced_grid(size) for size in ROUND_IMAGES]
    slices = [1 if grid is None else 1 + grid[0] * grid[1] for grid in grids]
    # A thumbnail alone, a 2x1 grid, a 1x3 grid, a 2x2 grid, a thumbnail alone.
    assert slices == [1, 3, 4, 5, 1]
    expected = REPEAT * sum(slices) + len(CHAT_IMAGES)
    calls = _calls(served.events, "vision", "serving")
    assert sum(_first_shape(e)[0] for e in calls) == expected
    # Whole 448x448 slices are 1024 patches; other slices (and so batches) are longer.
    assert len({_first_shape(e)[1] for e in calls}) > 1


def test_clips_from_one_second_to_thirty_reach_the_audio_encoder(served: Served) -> None:
    """Audio calls carry 80-bin mels, one clip per batch row, padded up to the 30 s clip."""
    calls = _calls(served.events, "audio", "serving")
    shapes = [_first_shape(e) for e in calls]
    assert {shape[1] for shape in shapes} == {80}
    assert sum(shape[0] for shape in shapes) == REPEAT * len(ROUND_CLIPS) + len(CHAT_CLIPS)
    # 100 mel frames a second: the longest batch holds the 30 s clip.
    assert max(shape[2] for shape in shapes) == 3000
    assert min(shape[2] for shape in shapes) <= 250


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
            assert served.result["adapters"][adapter]["captured"], adapter
        else:
            assert stats["graph_hits"] == 0
            assert stats["ineligible_misses"] == stats["graph_misses"] == len(calls)
            assert Counter(e["detail"] for e in calls) == {"cpu": len(calls)}


def test_outputs_with_omnitrace_equal_outputs_without(
    served: Served, baseline: dict[str, Any]
) -> None:
    """Every encoder output is bit-for-bit the same, and so are the greedy tokens and logprobs."""
    on = served.result
    assert on["outputs"] == baseline["outputs"]
    assert on["tokens"] == baseline["tokens"]
    assert on["logprobs"] == baseline["logprobs"]
    assert on["chat_tokens"] == baseline["chat_tokens"]
    assert on["chat_logprobs"] == baseline["chat_logprobs"]
    if not CUDA:
        # The plugin was off: nothing was attached.
        assert baseline["adapters"] == {}
