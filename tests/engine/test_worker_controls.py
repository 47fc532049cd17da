"""Graphs switched off and on in a running ``vllm serve``, by name, through vLLM's
``/collective_rpc`` (``VLLM_SERVER_DEV_MODE=1``) and omnitrace's worker extension."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (the engine CI tier installs it)")

from engine.engine_run import image
from engine.support import serve_checkpoint
from omnitrace.integrations.vllm_requests import TIMING_ROUTE
from omnitrace.integrations.vllm_worker_controls import QUALNAME
from omnitrace.testing_checkpoints.serving import data_url, png

pytestmark = pytest.mark.engine


def test_collective_rpc_pauses_and_resumes_the_graphs_by_name(
    checkpoint: Path, tmp_path: Path
) -> None:
    """Paused, every adapter of the worker says so and the server keeps serving (on a CPU its
    calls are ``ineligible`` misses, detail ``cpu``, either way; the H200 benchmark checks the
    ``paused`` misses); a value that is not a flag is refused with omnitrace's message and
    changes nothing; resumed, none is paused. Switched by name, a prompt's two images go
    to the vision tower one call each, where before they went in one. omnitrace's route
    beside vLLM's switches the API server's request timing, and names it: the request
    served while it is off has no event."""
    import httpx
    import openai

    with serve_checkpoint(
        checkpoint,
        tmp_path,
        hf_overrides={},
        extra=("--worker-extension-cls", QUALNAME),
        VLLM_SERVER_DEV_MODE="1",
    ) as server:
        client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", timeout=300)
        model = client.models.list().data[0].id

        def ask(seed: int, images: int = 1) -> str:
            pictures = [
                {
                    "type": "image_url",
                    "image_url": {"url": data_url("image/png", png(image(seed + i, 252, 252)))},
                }
                for i in range(images)
            ]
            reply = client.chat.completions.create(
                model=model,
                messages=[
                    {
                        "role": "user",
                        "content": [*pictures, {"type": "text", "text": "Describe them."}],
                    }
                ],
                max_tokens=2,
                temperature=0.0,
            )
            assert reply.choices[0].finish_reason in ("length", "stop")
            return str(reply.id)

        def rpc(method: str, *args: Any) -> Any:
            response = httpx.post(
                f"{server.base_url}/collective_rpc",
                json={"method": method, "args": list(args)},
                timeout=60,
            )
            assert response.status_code == 200, response.text
            (result,) = response.json()["results"]  # one worker
            return result

        asked = [ask(1)]
        assert rpc("omnitrace_graphs_paused") == {"vision": False, "audio": False}
        assert rpc("omnitrace_pause_graphs", True) == "2"
        assert rpc("omnitrace_graphs_paused") == {"vision": True, "audio": True}
        asked.append(ask(2))
        refused = httpx.post(
            f"{server.base_url}/collective_rpc",
            json={"method": "omnitrace_pause_graphs", "args": ["perhaps"]},
            timeout=60,
        )
        assert refused.status_code >= 400, refused.text
        assert "paused: expected true or false, got 'perhaps'" in refused.text + server.text()
        assert rpc("omnitrace_graphs_paused") == {"vision": True, "audio": True}
        assert rpc("omnitrace_pause_graphs", "false") == "2"
        assert rpc("omnitrace_graphs_paused") == {"vision": False, "audio": False}
        asked.append(ask(3))

        # Two images in one prompt: one vision call batched; two calls once split by name.
        asked.append(ask(10, images=2))
        assert rpc("omnitrace_items_split") == {"vision": False, "audio": False}
        assert rpc("omnitrace_split_items", True) == "2"
        assert rpc("omnitrace_items_split") == {"vision": True, "audio": True}
        asked.append(ask(20, images=2))
        assert rpc("omnitrace_split_items", False) == "2"

        # The API server's request timing, switched by omnitrace's route beside vLLM's.
        def timing(value: object) -> httpx.Response:
            return httpx.post(
                f"{server.base_url}{TIMING_ROUTE}", json={"enabled": value}, timeout=60
            )

        off = timing(False)
        assert off.status_code == 200, off.text
        # The API server that switched: the one `vllm serve` process here.
        assert off.json() == {"enabled": False, "was": True, "pid": server.process.pid}
        untimed = ask(4)
        bad = timing("maybe")
        assert bad.status_code == 400
        assert bad.json() == {"error": "enabled: expected true or false, got 'maybe' (str)"}
        on = timing("on")
        assert on.json() == {"enabled": True, "was": False, "pid": server.process.pid}
        asked.append(ask(5))
    (api_log,) = tmp_path.glob("events-api*.jsonl")
    timed = [
        json.loads(line)["request_id"]
        for line in api_log.read_text().splitlines()
        if '"RequestTimed"' in line
    ]
    assert sorted(timed) == sorted(asked), (timed, asked)
    assert untimed not in timed
    # The worker's vision calls by the images each held (its cu_seqlens: one more entry).
    held = [
        event["signature"]["inputs"][6]["shape"][0] - 1
        for event in map(json.loads, server.log.read_text().splitlines())
        if event.get("adapter") == "vision"
        and event["type"] in ("GraphMissed", "GraphReplayed")
        and event.get("phase") == "serving"
    ]
    # Three prompts of one image, the batched pair, the split pair, then two of one image.
    assert held == [1, 1, 1, 2, 1, 1, 1, 1], held
