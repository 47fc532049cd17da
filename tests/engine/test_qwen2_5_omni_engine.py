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
from omnitrace.otlp_receiver import OTLPReceiver, attributes

pytestmark = pytest.mark.engine

#: Each adapter and the tower whose outputs stand for its calls in engine_run.py's report.
ENCODERS = {"vision": "visual", "audio": "audio_tower"}
OVERRIDES: dict[str, Any] = {
    "encoder_cuda_graph_min_free_bytes": 0,
    "encoder_cuda_graph_max_graphs": 8,
    # Without flash_attn (no wheel for the GPU machine's torch) the audio tower graphs only
    # through omnitrace's masked attention; the baseline uses the same route, so outputs
    # still compare bit for bit.
    "encoder_cuda_graph_audio_attention": "masked",
}


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
                **runner_env(runner),
            ),
            overrides=OVERRIDES,
        )
        yield Served(run, only_log(out, run), receiver)


@pytest.fixture(scope="module")
def baseline(checkpoint: Path, engine_dir: Path, runner: str) -> dict[str, Any]:
    """The same engine without omnitrace's graphs: the plugin off on a CPU, graphs off on CUDA."""
    if CUDA:
        env = engine_environment(**runner_env(runner))
        overrides = {**OVERRIDES, "encoder_cuda_graph": False}
    else:
        env = engine_environment(OMNITRACE_PLUGIN="0")
        overrides = OVERRIDES
    return run_engine(checkpoint, engine_dir / f"off-{runner}", env=env, overrides=overrides).ok()


def test_the_plugin_attaches_both_encoders_and_logs_one_line(served: Served) -> None:
    """The worker logs one "encoder graphs attached" line naming both towers and the model."""
    check_attached_line(served, "vision=True, audio=True", "qwen2_5_omni")


def test_every_tower_call_is_one_call_event_with_pid_and_rank(served: Served) -> None:
    """Each serving call the hooks saw is one event in the log, tagged with the worker."""
    check_call_events(served, ENCODERS)


def test_the_profiling_run_is_tagged_or_reported(served: Served, runner: str) -> None:
    """V1-style runners tag their dummy encoder calls; a runner that profiles none says so."""
    check_profiling(served, runner, ENCODERS)


def test_top_json_on_the_log_equals_the_adapters_stats(served: Served) -> None:
    """``omnitrace top --json`` folds the engine's log into exactly the adapters' stats."""
    check_top_json(served, ENCODERS)


def test_graphs_serve_on_cuda_and_calls_stay_eager_on_a_cpu(served: Served) -> None:
    """CUDA: both encoders capture and replay; CPU: every call is an ineligible ``cpu`` miss."""
    check_graphs_or_eager(served, ENCODERS)


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
    check_parity(served.result, baseline)


@pytest.fixture(scope="module")
def split(checkpoint: Path, engine_dir: Path, runner: str) -> Served:
    """The plugin's engine with encoder_cuda_graph_split_items: one call per image or clip."""
    out = engine_dir / f"split-{runner}"
    log = out / "events-{rank}-{pid}.jsonl"
    run = run_engine(
        checkpoint,
        out,
        env=engine_environment(OMNITRACE_EVENTS_LOG=str(log), **runner_env(runner)),
        overrides={**OVERRIDES, "encoder_cuda_graph_split_items": True},
    )
    return Served(run, only_log(out, run))


def _images(event: dict[str, Any]) -> int:
    """The images of a vision call: its cu_seqlens (the seventh input) holds one more entry."""
    return int(event["signature"]["inputs"][6]["shape"][0]) - 1


def test_split_items_calls_the_towers_once_per_item_with_the_same_tokens(
    split: Served, served: Served, baseline: dict[str, Any]
) -> None:
    """Every serving vision call holds one image where, whole, the batched prompts' calls
    hold several; the clips of a call go one by one too; the greedy tokens are the
    baseline's, the log-probabilities within float32 rounding (an item alone may round
    otherwise than in a batch)."""
    whole = calls(served.events, "vision", "serving")
    alone = calls(split.events, "vision", "serving")
    # The logs say how each tower served a call's items, for advise to read.
    for run, items in ((served, "batched"), (split, "split")):
        facts = adapter_facts(run.events)
        assert {facts[name]["items"] for name in ("vision", "audio")} == {items}
    assert max(_images(e) for e in whole) > 1
    assert alone
    assert {_images(e) for e in alone} == {1}
    assert sum(_images(e) for e in alone) == sum(_images(e) for e in whole)
    audio = [len(calls(r.events, "audio", "serving")) for r in (served, split)]
    assert audio[1] > audio[0], audio
    result = split.result
    assert result["tokens"] == baseline["tokens"]
    assert result["chat_tokens"] == baseline["chat_tokens"]
    got, want = _flat(result["logprobs"]), _flat(baseline["logprobs"])
    got += result["chat_logprobs"]
    want += baseline["chat_logprobs"]
    assert len(got) == len(want)
    assert all(abs(g - w) <= 1e-3 for g, w in zip(got, want, strict=True))


def _flat(nested: list[Any]) -> list[float]:
    """The numbers of nested lists, in order."""
    return [x for item in nested for x in (_flat(item) if isinstance(item, list) else [item])]


def test_the_worker_names_the_audio_processor_setting_once(served: Served) -> None:
    """The checkpoint's processor pads clips to 300 s, as the released model's does, and the
    engine runs without --mm-processor-kwargs: one start-up warning names the setting."""
    lines = [line for line in served.run.output.splitlines() if "pads every audio clip" in line]
    assert len(lines) == 1, served.run.tail()
    assert "4800000 samples (300 s at 16000 Hz)" in lines[0]
    assert """--mm-processor-kwargs '{"audio_kwargs": {"max_length": 480000}}'""" in lines[0]
