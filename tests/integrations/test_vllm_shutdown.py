"""The workers' buses at vLLM's shutdown: closed first, and the process manager's kill waits.

vLLM's modules are stand-ins here (the engine tier runs the real ones): a ``vllm.v1.utils``
with ``kill_process_tree``, and the engine core and worker classes whose ``shutdown`` vLLM
calls when a model process stops.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import threading
import time
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from omnitrace import EncoderCudaGraph, EncoderGraphConfig
from omnitrace.integrations import vllm_plugin, vllm_shutdown


@pytest.fixture
def rendezvous(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The directory the model processes announce themselves in, named in the environment."""
    directory = tmp_path / "shutdown"
    directory.mkdir()
    monkeypatch.setenv(vllm_shutdown.ENV_SHUTDOWN_DIR, str(directory))
    return directory


@pytest.fixture
def child() -> Iterator[subprocess.Popen[bytes]]:
    """A running process standing in for a model process of the server."""
    process = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        yield process
    finally:
        process.kill()
        process.wait(timeout=10)


def _kill_module(monkeypatch: pytest.MonkeyPatch, killed: list[float]) -> types.ModuleType:
    module = types.ModuleType(vllm_shutdown._KILL_MODULE)

    def kill_process_tree(pid: int) -> None:
        killed.append(time.monotonic())

    module.kill_process_tree = kill_process_tree  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, vllm_shutdown._KILL_MODULE, module)
    return module


def test_the_kill_waits_until_a_model_process_closed_its_bus(
    rendezvous: Path, child: subprocess.Popen[bytes], monkeypatch: pytest.MonkeyPatch
) -> None:
    """vLLM's kill runs once the announced process retired its file, not before."""
    killed: list[float] = []
    module = _kill_module(monkeypatch, killed)
    assert vllm_shutdown.hook_process_manager() is True
    assert vllm_shutdown.announce(child.pid) == rendezvous / str(child.pid)
    retired: list[float] = []

    def close_later() -> None:
        time.sleep(0.3)
        retired.append(time.monotonic())
        vllm_shutdown.retire(child.pid)

    closer = threading.Thread(target=close_later)
    start = time.monotonic()
    closer.start()
    module.kill_process_tree(child.pid)
    closer.join()
    assert len(killed) == 1
    assert killed[0] >= retired[0]
    assert killed[0] - start < vllm_shutdown.KILL_DELAY_S


def test_the_kill_waits_for_no_process_that_exited_nor_for_itself(
    rendezvous: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A file left by a process that is gone (or by the killer) holds nothing back."""
    gone = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        check=True,
        capture_output=True,
        text=True,
    )
    (rendezvous / gone.stdout.strip()).touch()
    (rendezvous / str(os.getpid())).touch()
    killed: list[float] = []
    module = _kill_module(monkeypatch, killed)
    vllm_shutdown.hook_process_manager()
    start = time.monotonic()
    module.kill_process_tree(1)
    assert len(killed) == 1
    assert killed[0] - start < 0.5


def test_a_process_that_never_closes_is_killed_after_the_bound_with_one_warning(
    rendezvous: Path,
    child: subprocess.Popen[bytes],
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The kill is held for KILL_DELAY_S at most, then a warning names the pid it gave up on."""
    monkeypatch.setattr(vllm_shutdown, "KILL_DELAY_S", 0.2)
    killed: list[float] = []
    module = _kill_module(monkeypatch, killed)
    vllm_shutdown.hook_process_manager()
    vllm_shutdown.announce(child.pid)
    start = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="omnitrace"):
        module.kill_process_tree(child.pid)
    assert 0.2 <= killed[0] - start < 1.0
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings == [
        f"omnitrace: workers {child.pid} had not closed their event bus after 0.2 s; vLLM "
        "kills them now, and what they had not written is lost"
    ]


def test_the_kill_of_a_process_outside_the_model_processes_tree_is_not_held(
    rendezvous: Path,
    child: subprocess.Popen[bytes],
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """With ``--api-server-count 2`` vLLM's process manager kills each API server before the
    engine core: those kills reach no model process, so they wait for none and warn of none."""
    monkeypatch.setattr(vllm_shutdown, "KILL_DELAY_S", 1.0)
    killed: list[float] = []
    module = _kill_module(monkeypatch, killed)
    vllm_shutdown.hook_process_manager()
    vllm_shutdown.announce(child.pid)
    api_server = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        start = time.monotonic()
        with caplog.at_level(logging.WARNING, logger="omnitrace"):
            module.kill_process_tree(api_server.pid)
    finally:
        api_server.kill()
        api_server.wait(timeout=10)
    assert len(killed) == 1
    assert killed[0] - start < 0.5
    assert [r for r in caplog.records if r.levelno >= logging.WARNING] == []


def test_the_kill_waits_for_a_model_process_below_the_one_it_kills(
    rendezvous: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A worker is the engine core's child: killing the engine core's tree waits for it."""
    engine_core = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import subprocess, sys, time\n"
            "w = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
            "print(w.pid, flush=True)\n"
            "time.sleep(60)\n",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert engine_core.stdout is not None
    worker = int(engine_core.stdout.readline())
    killed: list[float] = []
    module = _kill_module(monkeypatch, killed)
    vllm_shutdown.hook_process_manager()
    vllm_shutdown.announce(worker)
    retired: list[float] = []

    def close_later() -> None:
        time.sleep(0.3)
        retired.append(time.monotonic())
        vllm_shutdown.retire(worker)

    closer = threading.Thread(target=close_later)
    try:
        closer.start()
        module.kill_process_tree(pid=engine_core.pid)
        closer.join()
    finally:
        os.kill(worker, 9)
        engine_core.kill()
        engine_core.wait(timeout=10)
        engine_core.stdout.close()
    assert len(killed) == 1
    assert killed[0] >= retired[0]


def test_the_first_process_makes_the_directory_its_children_inherit(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Without the variable, hooking the kill makes a directory and names it for children."""
    monkeypatch.delenv(vllm_shutdown.ENV_SHUTDOWN_DIR, raising=False)
    _kill_module(monkeypatch, [])
    assert vllm_shutdown.hook_process_manager() is True
    made = Path(os.environ[vllm_shutdown.ENV_SHUTDOWN_DIR])
    assert made.is_dir()
    assert made.name.startswith("omnitrace-shutdown-")
    made.rmdir()


def test_without_vllms_process_manager_nothing_is_hooked_or_made(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A process that never imported vllm.v1.utils (a worker) holds nothing and makes nothing."""
    monkeypatch.delenv(vllm_shutdown.ENV_SHUTDOWN_DIR, raising=False)
    monkeypatch.delitem(sys.modules, vllm_shutdown._KILL_MODULE, raising=False)
    assert vllm_shutdown.hook_process_manager() is False
    assert vllm_shutdown.ENV_SHUTDOWN_DIR not in os.environ
    assert vllm_shutdown.announce() is None


def _engine_core_module(monkeypatch: pytest.MonkeyPatch, calls: list[str]) -> types.ModuleType:
    module = types.ModuleType("vllm.v1.engine.core")

    class EngineCore:
        def shutdown(self) -> None:
            calls.append("vllm")

    class EngineCoreProc(EngineCore):
        pass

    module.EngineCore = EngineCore  # type: ignore[attr-defined]
    module.EngineCoreProc = EngineCoreProc  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "vllm.v1.engine.core", module)
    monkeypatch.delitem(sys.modules, "vllm.v1.executor.multiproc_executor", raising=False)
    return module


def test_the_engine_core_process_closes_first_and_an_engine_in_process_does_not(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """EngineCoreProc.shutdown runs the close, then vLLM's; EngineCore's own is untouched."""
    calls: list[str] = []
    module = _engine_core_module(monkeypatch, calls)
    hooked = vllm_shutdown.hook_model_process(calls.append)
    assert hooked == ["vllm.v1.engine.core.EngineCoreProc.shutdown"]
    assert vllm_shutdown.hook_model_process(calls.append) == hooked
    module.EngineCoreProc().shutdown()
    assert calls == ["vllm.v1.engine.core.EngineCoreProc.shutdown", "vllm"]
    calls.clear()
    module.EngineCore().shutdown()
    assert calls == ["vllm"]


def test_a_close_that_raises_still_runs_vllms_teardown(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """vLLM's shutdown runs after a failing close, and the failure is logged with its place."""
    calls: list[str] = []
    module = _engine_core_module(monkeypatch, calls)

    def broken(where: str) -> None:
        raise RuntimeError("no")

    vllm_shutdown.hook_model_process(broken)
    with caplog.at_level(logging.ERROR, logger="omnitrace"):
        module.EngineCoreProc().shutdown()
    assert calls == ["vllm"]
    assert [r.getMessage() for r in caplog.records] == [
        "omnitrace: closing the event bus at vllm.v1.engine.core.EngineCoreProc.shutdown failed"
    ]


def test_close_at_shutdown_writes_the_log_and_the_final_summary_then_retires(
    rendezvous: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: Any
) -> None:
    """The plugin's close delivers every event and the final summary, and unblocks the kill."""
    monkeypatch.setattr(vllm_plugin, "_bus", None)
    monkeypatch.setattr(vllm_plugin, "_attached", vllm_plugin.weakref.WeakSet())
    log = tmp_path / "events.jsonl"
    bus = vllm_plugin.worker_bus(
        {"OMNITRACE_EVENTS_LOG": str(log), "OMNITRACE_LOGS": "1", "OMNITRACE_SUMMARY_INTERVAL": "0"}
    )
    graph = EncoderCudaGraph(lambda x: x, name="vision", config=EncoderGraphConfig(), bus=bus)
    vllm_plugin._attached.add(graph)
    for _ in range(3):
        graph(torch.ones(2))
    vllm_shutdown.announce()
    assert (rendezvous / str(os.getpid())).exists()

    assert vllm_plugin.close_at_shutdown("EngineCoreProc.shutdown") is True

    assert bus.closed
    assert not (rendezvous / str(os.getpid())).exists()
    calls = [json.loads(line) for line in log.read_text().splitlines()]
    assert sum(1 for c in calls if c["type"] == "GraphMissed") == 3
    summaries = [
        json.loads(line)
        for line in capsys.readouterr().err.splitlines()
        if '"graph_summary"' in line
    ]
    assert [(s["encoder"], s["calls"], s["final"]) for s in summaries] == [("vision", 3, True)]


def test_an_api_server_s_request_bus_holds_the_kill_of_its_own_process(
    rendezvous: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With ``--api-server-count 2`` the process manager kills each API server, at once under
    ``--shutdown-timeout 0``: the request bus announces its process, so that kill waits until
    the API server wrote its last requests' events and exited."""
    monkeypatch.setattr(vllm_plugin, "_bus", None)
    monkeypatch.setattr(vllm_plugin, "_bus_pid", None)
    monkeypatch.setattr(vllm_plugin, "_announced_pid", None)
    monkeypatch.setenv("OMNITRACE_EVENTS_LOG", str(tmp_path / "events-{rank}.jsonl"))
    bus = vllm_plugin.request_bus()
    try:
        assert vllm_plugin.request_bus() is bus
        assert (rendezvous / str(os.getpid())).exists()
        assert bus.statistics().sinks[0].name == "jsonl"
    finally:
        bus.close()
    assert (tmp_path / "events-api.jsonl").exists()
