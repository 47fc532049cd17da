"""``vllm serve`` stopped by a signal to its API server still writes what omnitrace owes.

vLLM's default ``--shutdown-timeout 0`` sends the engine core SIGTERM and SIGKILLs it at
once; the plugin closes the worker's bus first in the engine core's shutdown and holds that
kill until the close is done. After one served request with an image, SIGINT (Ctrl-C) or
SIGTERM (a supervisor) to the API server alone must leave the final ``graph_summary`` lines
in the server's output and every encoder call in the event log.
"""

from __future__ import annotations

import json
import signal
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (the engine CI tier installs it)")

from engine.engine_run import image
from engine.support import serve_checkpoint, top_json
from omnitrace.testing_checkpoints.serving import data_url, png

pytestmark = pytest.mark.engine


def _summaries(output: str) -> list[dict[str, Any]]:
    """The ``graph_summary`` lines of the server's output (after vLLM's process prefix)."""
    found = []
    for line in output.splitlines():
        start = line.find("{")
        if '"graph_summary"' in line and start >= 0:
            found.append(json.loads(line[start:]))
    return found


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_signal_to_the_api_server_leaves_the_final_summary_and_every_call(
    checkpoint: Path, tmp_path: Path, signum: signal.Signals
) -> None:
    """One request with an image, then a signal to the server: each called encoder has one
    final summary line, and ``top --json`` on the log counts the calls those lines count."""
    import openai

    with serve_checkpoint(
        checkpoint,
        tmp_path,
        hf_overrides={},
        OMNITRACE_LOGS="1",
        OMNITRACE_SUMMARY_INTERVAL="0",
    ) as server:
        client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", timeout=300)
        picture = data_url("image/png", png(image(3, 252, 252)))
        reply = client.chat.completions.create(
            model=client.models.list().data[0].id,
            messages=[
                {
                    "role": "user",
                    "content": [
                        {"type": "image_url", "image_url": {"url": picture}},
                        {"type": "text", "text": "Describe it."},
                    ],
                }
            ],
            max_tokens=4,
            temperature=0.0,
        )
        assert reply.choices[0].finish_reason in ("length", "stop")
        # At once: the request's last events are still on their way to the log.
        server.process.send_signal(signum)
        assert server.process.wait(timeout=120) == 0, server.tail()

    text = server.text()
    summaries = _summaries(text)
    final = {s["encoder"]: s for s in summaries if s["final"] is True}
    assert "vision" in final, server.tail()
    assert len([s for s in summaries if s["final"]]) == len(final), summaries
    assert "had not closed their event bus" not in text, server.tail()
    rows = {row["encoder"]: row for row in top_json(server.log)["encoders"]}
    assert set(rows) == set(final)
    for encoder, summary in final.items():
        row = rows[encoder]
        assert row["graph_hits"] + row["graph_misses"] == summary["calls"], encoder
    serving = [
        json.loads(line)
        for line in server.log.read_text().splitlines()
        if '"GraphMissed"' in line or '"GraphReplayed"' in line
    ]
    assert any(
        e["adapter"] == "vision" and e.get("phase", "serving") == "serving" for e in serving
    ), serving
