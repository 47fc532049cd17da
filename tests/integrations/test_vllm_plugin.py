"""The vLLM plugin's environment handling and worker identity (no vLLM needed)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from omnitrace import ConfigError, EncoderCudaGraph, EncoderGraphConfig
from omnitrace.integrations import vllm_plugin
from omnitrace.integrations.worker import worker_identity


def test_worker_identity_reads_rank_then_local_rank() -> None:
    """RANK wins over LOCAL_RANK; the pid is this process's."""
    assert worker_identity({"RANK": "3", "LOCAL_RANK": "1"}) == (os.getpid(), 3)
    assert worker_identity({"LOCAL_RANK": "1"}) == (os.getpid(), 1)


def test_worker_identity_without_rank_is_none() -> None:
    """Without rank variables (and no vLLM world group) the rank is None."""
    assert worker_identity({}) == (os.getpid(), None)


def test_disabled_plugin_does_not_touch_vllm() -> None:
    """OMNITRACE_PLUGIN=0 returns False before importing vLLM's loader."""
    assert vllm_plugin.register({"OMNITRACE_PLUGIN": "0"}) is False


def test_invalid_flag_names_the_variable() -> None:
    """A flag value that is not a boolean word raises ConfigError naming the variable."""
    with pytest.raises(ConfigError, match="OMNITRACE_PLUGIN: expected 1/0"):
        vllm_plugin.register({"OMNITRACE_PLUGIN": "maybe"})


def test_worker_bus_is_one_per_process(monkeypatch: pytest.MonkeyPatch) -> None:
    """worker_bus returns the same bus in one process and a new one after a pid change."""
    monkeypatch.setattr(vllm_plugin, "_bus", None)
    first = vllm_plugin.worker_bus({})
    assert vllm_plugin.worker_bus({}) is first
    monkeypatch.setattr(vllm_plugin, "_bus_pid", -1)
    second = vllm_plugin.worker_bus({})
    assert second is not first
    first.close()
    second.close()


def test_events_log_variable_writes_jsonl_with_pid_and_rank(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """OMNITRACE_EVENTS_LOG attaches a JSONL sink whose lines carry the worker's pid and rank."""
    pytest.importorskip("omnitrace.sinks.jsonl")
    monkeypatch.setattr(vllm_plugin, "_bus", None)
    monkeypatch.setenv("RANK", "2")
    path = tmp_path / "events.jsonl"
    bus = vllm_plugin.worker_bus({"OMNITRACE_EVENTS_LOG": str(path), "RANK": "2"})
    graph = EncoderCudaGraph(lambda x: x, name="vision", config=EncoderGraphConfig(), bus=bus)
    import torch

    graph(torch.ones(2))
    bus.close()
    records = [json.loads(line) for line in path.read_text().splitlines()]
    events = [r for r in records if r.get("type") == "GraphMissed"]
    assert events
    assert {(r["pid"], r["rank"]) for r in events} == {(os.getpid(), 2)}


def test_missing_sink_module_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    """A sink the environment asks for that cannot be imported raises PluginError naming it."""
    import sys

    monkeypatch.setattr(vllm_plugin, "_bus", None)
    monkeypatch.setitem(sys.modules, "omnitrace.sinks.jsonl", None)
    with pytest.raises(vllm_plugin.PluginError, match="OMNITRACE_EVENTS_LOG is set but"):
        vllm_plugin.worker_bus({"OMNITRACE_EVENTS_LOG": "/tmp/x.jsonl"})


def test_select_backend_without_config_logs_why_and_picks_torch(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """select_backend(None) returns the torch backend with one 'omnitrace' log line."""
    import logging

    from omnitrace.graphs.backends.select import select_backend
    from omnitrace.graphs.backends.torch import TorchGraphBackend

    with caplog.at_level(logging.INFO, logger="omnitrace"):
        backend = select_backend(None)
    assert isinstance(backend, TorchGraphBackend)
    lines = [r for r in caplog.records if r.name == "omnitrace.graphs.backends.select"]
    assert len(lines) == 1
    assert "no vllm_config was given" in lines[0].getMessage()


def test_select_backend_without_vllm_logs_why(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With a config but no importable vLLM, the torch backend is chosen and the log says so."""
    import importlib.util
    import logging

    from omnitrace.graphs.backends import select
    from omnitrace.graphs.backends.torch import TorchGraphBackend

    real = importlib.util.find_spec
    monkeypatch.setattr(
        select.importlib.util, "find_spec", lambda n, *a: None if n == "vllm" else real(n, *a)
    )
    with caplog.at_level(logging.INFO, logger="omnitrace"):
        backend = select.select_backend(object())
    assert isinstance(backend, TorchGraphBackend)
    assert [
        r.getMessage() for r in caplog.records if r.name == "omnitrace.graphs.backends.select"
    ] == ["omnitrace: using the torch graph backend (vLLM is not importable)"]
