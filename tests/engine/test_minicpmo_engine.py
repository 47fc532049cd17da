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
``encoder_cuda_graph: false``; all of them passed on an H200 with vLLM 0.26.0 on both runners.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (the engine CI tier installs it)")

from engine.support import (
    CUDA,
    Served,
    adapter_facts,
    calls,
    check_attached_line,
    check_call_events,
    check_graphs_or_eager,
    check_parity,
    check_profiling,
    check_top_json,
    engine_environment,
    only_log,
    run_engine,
    runner_env,
)
from omnitrace.testing_checkpoints.minicpmo_remote.image_processing_minicpmo import (
    MiniCPMOImageProcessor,
)

pytestmark = pytest.mark.engine

#: Each adapter and the digests that stand for its calls in engine_run.py's report.
ENCODERS = {"vision": "get_vision_hidden_states", "audio": "get_audio_hidden_states"}
OVERRIDES: dict[str, Any] = {
    "encoder_cuda_graph_min_free_bytes": 0,
    # Vision batches and padded audio batches come in many shapes; keep them all.
    "encoder_cuda_graph_max_graphs": 32,
}
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


def _first_shape(event: dict[str, Any]) -> list[int]:
    """The shape of a call's first input: ``(B, L, D)`` vision, ``(B, mels, frames)`` audio."""
    shape: list[int] = event["signature"]["inputs"][0]["shape"]
    return shape


def _plugin_engine(checkpoint: Path, out: Path, runner: str, overrides: dict[str, Any]) -> Served:
    """An engine with the plugin on, ``overrides`` its ``--hf-overrides``, and its event log."""
    run = run_engine(
        checkpoint,
        out,
        env=engine_environment(
            OMNITRACE_EVENTS_LOG=str(out / "events-{rank}-{pid}.jsonl"), **runner_env(runner)
        ),
        overrides=overrides,
        args=_args(),
    )
    return Served(run, only_log(out, run))


@pytest.fixture(scope="module")
def served(minicpmo_checkpoint: Path, engine_dir: Path, runner: str) -> Served:
    """An engine with the plugin on and its event log."""
    return _plugin_engine(
        minicpmo_checkpoint, engine_dir / f"minicpmo-on-{runner}", runner, OVERRIDES
    )


@pytest.fixture(scope="module")
def baseline(minicpmo_checkpoint: Path, engine_dir: Path, runner: str) -> dict[str, Any]:
    """The same engine without omnitrace's graphs: the plugin off on a CPU, graphs off on CUDA."""
    if CUDA:
        env = engine_environment(**runner_env(runner))
        overrides = {**OVERRIDES, "encoder_cuda_graph": False}
    else:
        env = engine_environment(OMNITRACE_PLUGIN="0")
        overrides = OVERRIDES
    out = engine_dir / f"minicpmo-off-{runner}"
    return run_engine(minicpmo_checkpoint, out, env=env, overrides=overrides, args=_args()).ok()


def test_the_plugin_attaches_both_encoders_and_logs_one_line(served: Served) -> None:
    """The worker logs one "encoder graphs attached" line naming both encoders and minicpmo."""
    check_attached_line(
        served, "vision=True, audio=True, audio_method=get_audio_hidden_states", "minicpmo"
    )


def test_every_encoder_call_is_one_call_event_with_pid_and_rank(served: Served) -> None:
    """Each serving call the digests saw is one event in the log, tagged with the worker."""
    check_call_events(served, ENCODERS)


def test_every_slice_of_every_image_reaches_the_vision_encoder(served: Served) -> None:
    """The vision calls' batches add up to the slices the image processor makes of each image."""
    grids = [MiniCPMOImageProcessor().get_sliced_grid(size) for size in ROUND_IMAGES]
    slices = [1 if grid is None else 1 + grid[0] * grid[1] for grid in grids]
    # A thumbnail alone, a 2x1 grid, a 1x3 grid, a 2x2 grid, a thumbnail alone.
    assert slices == [1, 3, 4, 5, 1]
    expected = REPEAT * sum(slices) + len(CHAT_IMAGES)
    vision = calls(served.events, "vision", "serving")
    # The whole path's first input is the padded pixel batch, (slices, 3, 14, 14 * patches).
    assert {tuple(_first_shape(e)[1:3]) for e in vision} == {(3, 14)}
    assert sum(_first_shape(e)[0] for e in vision) == expected
    # Whole 448x448 slices are 1024 patches; other slices (and so batches) are longer.
    assert len({_first_shape(e)[3] for e in vision}) > 1


def test_clips_from_one_second_to_thirty_reach_the_audio_encoder(served: Served) -> None:
    """Audio calls carry 80-bin mels, one clip per batch row, padded up to the 30 s clip."""
    shapes = [_first_shape(e) for e in calls(served.events, "audio", "serving")]
    assert {shape[1] for shape in shapes} == {80}
    assert sum(shape[0] for shape in shapes) == REPEAT * len(ROUND_CLIPS) + len(CHAT_CLIPS)
    # 100 mel frames a second: the longest batch holds the 30 s clip.
    assert max(shape[2] for shape in shapes) == 3000
    assert min(shape[2] for shape in shapes) <= 250


def test_the_profiling_run_is_tagged_or_reported(served: Served, runner: str) -> None:
    """V1-style runners tag their dummy encoder calls; a runner that profiles none says so."""
    check_profiling(served, runner, ENCODERS)


def test_top_json_on_the_log_equals_the_adapters_stats(served: Served) -> None:
    """``omnitrace top --json`` folds the engine's log into exactly the adapters' stats."""
    check_top_json(served, ENCODERS)


def test_graphs_serve_on_cuda_and_calls_stay_eager_on_a_cpu(served: Served) -> None:
    """CUDA: both encoders capture and replay; CPU: every call is an ineligible ``cpu`` miss."""
    check_graphs_or_eager(served, ENCODERS)


def test_outputs_with_omnitrace_equal_outputs_without(
    served: Served, baseline: dict[str, Any]
) -> None:
    """Every encoder output is bit-for-bit the same, and so are the greedy tokens and logprobs."""
    check_parity(served.result, baseline)


@pytest.fixture(scope="module")
def split(minicpmo_checkpoint: Path, engine_dir: Path, runner: str) -> Served:
    """The plugin's engine with encoder_cuda_graph_split_items: one audio call per clip."""
    out = engine_dir / f"minicpmo-split-{runner}"
    return _plugin_engine(
        minicpmo_checkpoint, out, runner, {**OVERRIDES, "encoder_cuda_graph_split_items": True}
    )


def test_split_items_serves_each_clip_alone_at_its_own_length(
    split: Served, served: Served, baseline: dict[str, Any]
) -> None:
    """Whole, a step's clips share a batch padded to the longest; split, each clip is a call
    of its own at its own length, the vision batches are unchanged, and the greedy tokens are
    the baseline's (a clip alone may round otherwise than in its batch)."""
    whole = [_first_shape(e) for e in calls(served.events, "audio", "serving")]
    alone = [_first_shape(e) for e in calls(split.events, "audio", "serving")]
    # The logs say how the audio adapter served a call's slices, for advise to read.
    assert adapter_facts(served.events)["audio"]["items"] == "batched"
    assert adapter_facts(split.events)["audio"]["items"] == "split"
    assert "items" not in adapter_facts(split.events)["vision"]
    assert max(shape[0] for shape in whole) > 1
    assert {shape[0] for shape in alone} == {1}
    assert len(alone) == sum(shape[0] for shape in whole)
    # 100 mel frames a second: each clip at its own length, none padded up to the 30 s one.
    clips = REPEAT * list(ROUND_CLIPS) + list(CHAT_CLIPS)
    assert sorted(shape[2] for shape in alone) == sorted(round(s * 100) for s in clips)
    assert sum(shape[2] for shape in alone) < sum(shape[0] * shape[2] for shape in whole)
    vision = [
        sorted(_first_shape(e) for e in calls(r.events, "vision", "serving"))
        for r in (served, split)
    ]
    assert vision[0] == vision[1]
    result = split.result
    assert result["tokens"] == baseline["tokens"]
    assert result["chat_tokens"] == baseline["chat_tokens"]
