"""``encoder_cuda_graph_prepare_from`` inside a real vLLM engine (tiny MiniCPM-o 4.5).

A first engine serves the fixed prompts and writes its event log; a second one is given that
log and prepares its shapes after vLLM's warm-up, before it serves. On CUDA the second
engine's calls of those shapes replay from the first, with outputs bit for bit the first
engine's; on a CPU (no graph can be captured) each recorded shape is reported ineligible,
which shows the preparation ran in the worker at the right time all the same.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (the engine CI tier installs it)")

from engine.support import CUDA, Served, check_parity, engine_environment, only_log, run_engine
from omnitrace.eventlog import decode_signature
from omnitrace.events import GraphCaptured
from omnitrace.sinks.jsonl import JsonlSink

pytestmark = pytest.mark.engine

OVERRIDES: dict[str, Any] = {
    "encoder_cuda_graph_min_free_bytes": 0,
    "encoder_cuda_graph_max_graphs": 32,
}
ARGS = ("--model-kind", "minicpmo", "--repeat", "2")


def _shapes(event: dict[str, Any]) -> tuple[Any, ...]:
    return tuple(
        None if spec is None else (spec["dtype"], tuple(spec["shape"]))
        for spec in event["signature"]["inputs"]
    )


def _recorded(first: Served, path: Path) -> Path:
    """The log the second engine prepares from: the first engine's own on CUDA; on a CPU,
    where nothing was captured, one capture per shape the first engine's calls had."""
    if CUDA:
        return first.log
    sink = JsonlSink(path)
    seen = set()
    for event in first.events:
        if event["type"] != "GraphMissed" or (event["adapter"], _shapes(event)) in seen:
            continue
        seen.add((event["adapter"], _shapes(event)))
        signature = decode_signature(event["signature"])
        sink.handle(
            [GraphCaptured(event["adapter"], signature, 1, 1, 0.0, 1, "cpu", 0, 0, 0, 0, 0)]
        )
    sink.close()
    return path


@pytest.fixture(scope="module")
def first(minicpmo_checkpoint: Path, engine_dir: Path) -> Served:
    out = engine_dir / "prepare-first"
    env = engine_environment(OMNITRACE_EVENTS_LOG=str(out / "events-{rank}-{pid}.jsonl"))
    run = run_engine(minicpmo_checkpoint, out, env=env, overrides=OVERRIDES, args=ARGS)
    return Served(run, only_log(out, run))


@pytest.fixture(scope="module")
def second(minicpmo_checkpoint: Path, engine_dir: Path, first: Served) -> Served:
    out = engine_dir / "prepare-second"
    out.mkdir(parents=True, exist_ok=True)
    recorded = _recorded(first, out / "recorded.jsonl")
    env = engine_environment(OMNITRACE_EVENTS_LOG=str(out / "events-{rank}-{pid}.jsonl"))
    overrides = {**OVERRIDES, "encoder_cuda_graph_prepare_from": str(recorded)}
    run = run_engine(minicpmo_checkpoint, out, env=env, overrides=overrides, args=ARGS)
    return Served(run, only_log(out, run))


def _recorded_shapes(first: Served) -> dict[str, set[tuple[Any, ...]]]:
    kind = "GraphCaptured" if CUDA else "GraphMissed"
    found: dict[str, set[tuple[Any, ...]]] = {}
    for event in first.events:
        if event["type"] == kind:
            found.setdefault(event["adapter"], set()).add(_shapes(event))
    return found


def test_each_encoder_prepares_the_recorded_shapes_before_serving(
    first: Served, second: Served
) -> None:
    recorded = _recorded_shapes(first)
    assert set(recorded) == {"vision", "audio"}
    output = second.run.output
    for adapter, shapes in recorded.items():
        outcome = f"captured {len(shapes)}" if CUDA else f"ineligible: cpu {len(shapes)}"
        line = (
            f"omnitrace: {adapter!r} prepared {len(shapes) if CUDA else 0} of {len(shapes)} "
            "recorded shapes before serving"
        )
        assert line in output, second.run.tail()
        assert outcome in output.split(line, 1)[1].splitlines()[0]
    # Prepared after vLLM's warm-up: after its profiling run's calls, before any serving one.
    order = [
        e.get("phase", "serving")
        for e in second.events
        if e["type"] not in ("AdapterInfo", "LogSegment")
    ]
    startup = [i for i, phase in enumerate(order) if phase == "startup"]
    if CUDA:
        assert len(startup) == sum(map(len, recorded.values()))
        assert "profiling" not in order[startup[0] :]
        assert "serving" not in order[: startup[-1]]
    else:
        assert startup == []


@pytest.mark.gpu  # graphs are captured on CUDA only: skipped on a CPU
def test_prepared_shapes_replay_from_their_first_call_with_the_first_engines_outputs(
    first: Served, second: Served
) -> None:
    recorded = _recorded_shapes(first)
    serving = [
        e
        for e in second.events
        if e["type"] in ("GraphCaptured", "GraphReplayed", "GraphMissed")
        and e.get("phase", "serving") == "serving"
    ]
    for event in serving:
        if _shapes(event) not in recorded.get(event["adapter"], set()):
            continue
        # No warm-up call and no capture while serving for a shape prepared at start-up.
        assert event["type"] == "GraphReplayed", event
    assert any(e["type"] == "GraphReplayed" for e in serving)
    # The vision path checked each prepared graph's first result against vLLM's method.
    assert "gave another result" not in second.run.output
    check_parity(second.result, first.result)
