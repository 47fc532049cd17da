"""The paired benchmark's arithmetic: each pair's difference, its spread, who won."""

from __future__ import annotations

import argparse
import json
import sys
import types
from pathlib import Path
from typing import Any

import pytest

from benchmarks.paired import KINDS, cost_summary, paired_summary, request


def test_the_paired_differences_are_taken_within_each_pair() -> None:
    """The median of the pairs' differences, not the difference of the medians."""
    eager = [0.100, 0.200, 0.300, 0.400]
    graphed = [0.090, 0.210, 0.250, 0.395]
    row = paired_summary(eager, graphed)
    assert row["pairs"] == 4
    # Differences: -10, +10, -50, -5 ms.
    assert row["diff_median_ms"] == pytest.approx(-7.5)
    assert row["diff_q25_ms"] == pytest.approx(-20.0)
    assert row["diff_q75_ms"] == pytest.approx(-1.25)
    assert row["graphed_faster"] == 3
    # Per cent of each pair's eager request: -10, +5, -16.7, -1.25.
    assert row["diff_median_pct"] == pytest.approx((-10.0 + -1.25) / 2)
    assert row["eager_p50_ms"] == pytest.approx(250.0)
    assert row["graphed_p50_ms"] == pytest.approx(230.0)


@pytest.mark.parametrize(("eager", "graphed"), [([], []), ([0.1], [0.1, 0.2])])
def test_halves_that_are_not_pairs_are_refused(eager: list[float], graphed: list[float]) -> None:
    with pytest.raises(ValueError, match="expected pairs"):
        paired_summary(eager, graphed)


def test_timing_cost_is_the_median_of_each_rounds_change() -> None:
    """Each round's on/off ratio, then their median: drift between rounds cancels."""
    off = [10.0, 20.0, 40.0]
    on = [9.9, 20.4, 39.2]  # -1 %, +2 %, -2 %
    cost = cost_summary(off, on)
    assert cost["rounds"] == 3
    assert cost["change_median_pct"] == pytest.approx(-1.0)
    assert cost["off_rps_p50"] == 20.0
    assert cost["on_rps_p50"] == pytest.approx(20.4)
    # Mean of (-1, +2, -2) and its interval: 1.96 * stdev / sqrt(3).
    assert cost["change_mean_pct"] == pytest.approx(-1.0 / 3)
    assert cost["change_ci95_pct"] == pytest.approx(1.96 * (13 / 3) ** 0.5 / 3**0.5)
    assert cost_summary([10.0], [10.1])["change_ci95_pct"] is None
    with pytest.raises(ValueError, match="expected rounds"):
        cost_summary([1.0], [])


@pytest.mark.parametrize("model", ["minicpmo", "qwen2_5_omni"])
def test_every_clip_is_new_content_of_its_length(model: str) -> None:
    """vLLM caches encoder outputs by content: two seeds never give the same clip, and the
    prompt holds the model's own placeholder once. (The images, which need Pillow, are
    checked in the engine tier's run of the benchmark.)"""
    for kind, (modality, seconds) in KINDS.items():
        if modality != "audio":
            continue
        one, two = request(model, kind, 1), request(model, kind, 2)
        (samples, rate), (other, _) = (
            one["multi_modal_data"]["audio"],
            two["multi_modal_data"]["audio"],
        )
        assert samples.shape == other.shape == (int(seconds * rate),), kind
        assert (samples != other).any(), kind
        placeholder = "(<audio>./</audio>)" if model == "minicpmo" else "<|AUDIO|>"
        assert one["prompt"].count(placeholder) == 1, kind


@pytest.mark.parametrize("tokens", ["-1", "8193"])
def test_a_language_model_graph_size_out_of_range_is_refused(
    tokens: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Refused in one line before any engine starts (0 leaves vLLM's own size)."""
    from benchmarks import paired

    with pytest.raises(SystemExit) as exited:
        paired.main(["--out", str(tmp_path), "--lm-graph-tokens", tokens])
    assert exited.value.code == 2
    assert "--lm-graph-tokens 0 to 8192" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("options", [None, {"audio_kwargs": {"max_length": 480000}}])
def test_the_offline_engine_gets_the_runs_processor_options(
    options: dict[str, Any] | None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``OMNITRACE_BENCH_ENGINE_MM_PROCESSOR_KWARGS`` reaches ``vllm.LLM`` as it reaches every
    ``vllm serve``, so the offline pairs and the servers process media alike."""
    from benchmarks import paired

    class Started(Exception):
        pass

    seen: dict[str, Any] = {}

    def llm(**kwargs: Any) -> None:
        seen.update(kwargs)
        raise Started

    vllm = types.ModuleType("vllm")
    vllm.LLM, vllm.SamplingParams = llm, object  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "vllm", vllm)
    monkeypatch.setattr(paired, "write_checkpoint", lambda *args, **kwargs: tmp_path)
    # run() sets these for its engine; set here, they are restored after the test.
    for name in ("OMNITRACE_EVENTS_LOG", "VLLM_ALLOW_INSECURE_SERIALIZATION"):
        monkeypatch.setenv(name, "")
    for name in ("VLLM_NO_USAGE_STATS", "VLLM_WORKER_MULTIPROC_METHOD", "VLLM_CPU_KVCACHE_SPACE"):
        monkeypatch.setenv(name, "1" if name != "VLLM_WORKER_MULTIPROC_METHOD" else "spawn")
    if options is None:
        monkeypatch.delenv("OMNITRACE_BENCH_ENGINE_MM_PROCESSOR_KWARGS", raising=False)
    else:
        monkeypatch.setenv("OMNITRACE_BENCH_ENGINE_MM_PROCESSOR_KWARGS", json.dumps(options))
    args = argparse.Namespace(
        model="qwen2_5_omni", size="tiny", out=str(tmp_path / "out"), overrides="{}"
    )
    args.lm_graph_tokens = 512
    with pytest.raises(Started):
        paired.run(args)
    assert seen["mm_processor_kwargs"] == options
    assert seen["hf_overrides"] == {}
