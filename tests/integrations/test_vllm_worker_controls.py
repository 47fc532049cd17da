"""The worker extension that reaches omnitrace's run-time switches through collective_rpc."""

from __future__ import annotations

import importlib
import weakref
from typing import cast

import pytest
import torch

from omnitrace import EncoderCudaGraph
from omnitrace._validate import check_flag
from omnitrace.errors import ConfigError
from omnitrace.integrations import vllm_plugin, vllm_worker_controls
from omnitrace.integrations.vllm_worker_controls import QUALNAME, WorkerControls
from omnitrace.testing import SimulatedGraphBackend


@pytest.mark.parametrize(
    ("value", "expected"),
    [(True, True), (False, False), ("true", True), (" Off ", False), ("1", True), ("no", False)],
)
def test_flag_reads_json_booleans_and_words(value: object, expected: bool) -> None:
    assert check_flag("paused", value) is expected


@pytest.mark.parametrize("value", [1, 0, None, "maybe", "", [True]])
def test_flag_refuses_anything_else_by_name(value: object) -> None:
    with pytest.raises(ConfigError, match=r"^paused: expected true or false, got "):
        check_flag("paused", value)


def test_the_qualified_name_resolves_to_the_class() -> None:
    module, _, name = QUALNAME.rpartition(".")
    assert getattr(importlib.import_module(module), name) is WorkerControls
    assert module == vllm_worker_controls.__name__


def test_mixed_into_a_worker_as_vllm_does_it_pauses_and_resumes_every_adapter(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """vLLM adds the extension to the worker class's bases; a call by name then pauses the
    graphs of the adapters attached in that process, and a paused call is a miss."""

    class WorkerBase:
        pass

    class Worker(WorkerBase):
        pass

    Worker.__bases__ = (*Worker.__bases__, WorkerControls)
    graphs = [
        EncoderCudaGraph(lambda x: x * 2, name=name, backend=SimulatedGraphBackend())
        for name in ("vision", "audio")
    ]
    monkeypatch.setattr(vllm_plugin, "_attached", weakref.WeakSet(graphs))
    worker = cast(WorkerControls, Worker())
    method = worker.omnitrace_pause_graphs
    assert isinstance(worker, Worker)

    assert method("true") == 2
    assert worker.omnitrace_graphs_paused() == {"vision": True, "audio": True}
    x = torch.ones(3)
    for _ in range(3):
        assert torch.equal(graphs[0](x), x * 2)
    stats = graphs[0].get_cumulative_stats()
    assert stats["graph_hits"] == 0
    assert stats["ineligible_misses"] == 3
    assert method(False) == 2
    assert worker.omnitrace_graphs_paused() == {"vision": False, "audio": False}
    with pytest.raises(ValueError, match="paused: expected true or false"):
        method("pause")
    assert not any(g.graphs_paused for g in graphs)


def test_request_timing_switch_by_name_returns_the_previous_state() -> None:
    from omnitrace.integrations.vllm_requests import set_request_timing

    worker = WorkerControls()
    before = set_request_timing(True)
    try:
        assert worker.omnitrace_time_requests("false") is True
        assert worker.omnitrace_time_requests(True) is False
    finally:
        set_request_timing(before)


def test_split_items_by_name_switches_how_a_tower_serves_a_calls_items(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A Qwen2.5-Omni stand-in's towers, attached batched: switched to split by name, a call
    of three clips is three adapter calls and the registered ``items`` fact says split;
    switched back, one call; a word that is not a flag is refused by name."""
    from integrations.qwen_standins import audio_batch, build
    from omnitrace import EventBus
    from omnitrace.integrations.qwen2_5_omni import instrument

    bus = EventBus()
    try:
        model = build(encoder_cuda_graph_min_free_bytes=0)
        result = instrument(model, bus=bus, backend=SimulatedGraphBackend())
        graphs = [result.vision, result.audio]
        monkeypatch.setattr(vllm_plugin, "_attached", weakref.WeakSet(graphs))
        worker = WorkerControls()
        data = audio_batch([23, 7, 10])
        audio = result.audio
        assert audio is not None

        def calls() -> int:
            stats = audio.get_cumulative_stats()
            return int(stats["graph_hits"] + stats["graph_misses"])

        assert worker.omnitrace_items_split() == {"vision": False, "audio": False}
        assert worker.omnitrace_split_items("true") == 2
        assert worker.omnitrace_items_split() == {"vision": True, "audio": True}
        assert bus.adapters()["audio"]["items"] == "split"
        with torch.no_grad():
            before = calls()
            model._process_audio_input(data)
            assert calls() - before == 3
            assert worker.omnitrace_split_items(False) == 2
            before = calls()
            model._process_audio_input(data)
            assert calls() - before == 1
        assert bus.adapters()["audio"]["items"] == "batched"
        with pytest.raises(ValueError, match="split: expected true or false"):
            worker.omnitrace_split_items("both")
    finally:
        bus.close()


def test_an_adapter_refuses_a_split_that_is_not_a_bool() -> None:
    graph = EncoderCudaGraph(lambda x: x * 2, name="vision", backend=SimulatedGraphBackend())
    assert graph.split_items is False
    with pytest.raises(ConfigError, match=r"^split: expected a bool, got 1$"):
        graph.set_split_items(1)  # type: ignore[arg-type]
    graph.set_split_items(True)
    assert graph.split_items is True
