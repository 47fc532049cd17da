"""``vllm serve`` with omnitrace, driven by an OpenAI client, and engines that must not start.

The server listens on 127.0.0.1 on a free port, started and stopped by the test; requests
come from the ``openai`` package, as a user's client sends them, with an image and an audio
clip as data URLs. ``omnitrace top --follow`` reads the worker's event log while it serves.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (the engine CI tier installs it)")

from engine.engine_run import chat_messages
from engine.support import Server, engine_environment, run_engine, serve_checkpoint

pytestmark = pytest.mark.engine

OVERRIDES: dict[str, Any] = {
    "encoder_cuda_graph": True,
    "encoder_cuda_graph_max_graphs": 8,
    "encoder_cuda_graph_min_capture_calls": 2,
    "encoder_cuda_graph_min_free_bytes": 0,
    "encoder_cuda_graph_share_pools": True,
}
#: The pinned ConfigError text for ``encoder_cuda_graph_max_graphs: -1``.
MAX_GRAPHS_ERROR = (
    "encoder_cuda_graph_max_graphs: expected an integer from 0 to 1024 (0 keeps no graph), "
    "got -1 (int)"
)


@pytest.fixture(scope="module")
def server(checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """``vllm serve`` on the tiny checkpoint with omnitrace's event log, ready for requests."""
    out = tmp_path_factory.mktemp("serve")
    with serve_checkpoint(checkpoint, out, hf_overrides=OVERRIDES) as served:
        yield served


def _chat(server: Server, seed_offset: int) -> Any:
    import openai

    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", timeout=300)
    return client.chat.completions.create(
        model=client.models.list().data[0].id,
        messages=chat_messages(seed_offset),
        max_tokens=4,
        temperature=0.0,
    )


def test_openai_chat_with_an_image_and_a_clip_runs_both_encoders(server: Server) -> None:
    """Two chat requests are answered; the worker's log shows both encoders serving them."""
    top = subprocess.Popen(
        [sys.executable, "-m", "omnitrace", "top", "--follow", "--no-tui", str(server.log)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        for offset in (0, 10):
            reply = _chat(server, offset)
            assert reply.choices[0].finish_reason in ("length", "stop")
            assert reply.usage is not None
            assert reply.usage.completion_tokens > 0
        deadline = time.monotonic() + 30
        serving: dict[str, int] = {}
        while time.monotonic() < deadline:
            events = [json.loads(line) for line in server.log.read_text().splitlines()]
            serving = {}
            for event in events:
                if (
                    event["type"] in ("GraphMissed", "GraphReplayed")
                    and event.get("phase", "serving") == "serving"
                ):
                    serving[event["adapter"]] = serving.get(event["adapter"], 0) + 1
            if serving.get("vision", 0) >= 2 and serving.get("audio", 0) >= 2:
                break
            time.sleep(0.5)
        assert serving.get("vision", 0) >= 2, serving
        assert serving.get("audio", 0) >= 2, serving
        assert {event["rank"] for event in events} == {0}
        assert len({event["pid"] for event in events}) == 1
        assert events[0]["pid"] != server.process.pid, "events came from the API server"
        # Let the follower read the last lines, then stop it as an operator would.
        time.sleep(2)
    finally:
        top.send_signal(signal.SIGINT)
        frame, _ = top.communicate(timeout=60)
    assert top.returncode == 0, frame
    assert "vision" in frame, frame
    assert "audio" in frame, frame
    attached = [line for line in server.text().splitlines() if "encoder graphs attached" in line]
    assert len(attached) == 1, server.tail()
    assert "vision=True, audio=True" in attached[0]
    assert "model=qwen2_5_omni" in attached[0]


def test_a_bad_override_stops_the_engine_with_one_config_error_line(
    checkpoint: Path, tmp_path: Path
) -> None:
    """An invalid ``encoder_cuda_graph_*`` value fails the engine start with omnitrace's line."""
    run = run_engine(
        checkpoint,
        tmp_path,
        env=engine_environment(),
        overrides={"encoder_cuda_graph_max_graphs": -1},
    )
    assert run.returncode != 0, run.tail()
    assert run.result is None
    lines = [line for line in run.output.splitlines() if "omnitrace: " in line]
    errors = [line for line in lines if MAX_GRAPHS_ERROR in line]
    assert len(errors) == 1, run.tail()
    assert "ERROR" in errors[0]
    assert "OMNITRACE_PLUGIN=0" in errors[0]
    # The original exception still propagates and stops the engine.
    raised = [
        line
        for line in run.output.splitlines()
        if line.rstrip().endswith(f"ConfigError: {MAX_GRAPHS_ERROR}")
    ]
    assert raised, run.tail(20)


def test_omnitrace_plugin_0_leaves_the_engine_untouched(checkpoint: Path, tmp_path: Path) -> None:
    """With ``OMNITRACE_PLUGIN=0`` even an invalid override is ignored and nothing attaches."""
    log = tmp_path / "events.jsonl"
    result = run_engine(
        checkpoint,
        tmp_path,
        env=engine_environment(OMNITRACE_PLUGIN="0", OMNITRACE_EVENTS_LOG=str(log)),
        overrides={"encoder_cuda_graph_max_graphs": -1},
        args=("--repeat", "1"),
    ).ok()
    assert result["adapters"] == {}
    assert result["outputs"]["visual"]
    assert result["outputs"]["audio_tower"]
    assert not log.exists()
