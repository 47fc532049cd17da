"""``vllm serve --api-server-count 2``: two API servers in front of one engine, with omnitrace.

Each API server renders, processes and times the requests the kernel hands it; with the log
template ``events-{rank}.jsonl`` both write ``events-api.jsonl``, one file shared through the
JSONL sink's lock (``{pid}`` in the template gives each its own). One server start: a client
connection to each API server (omnitrace's timing route answers the pid of the process that
took it), requests through both, the route switched in one of them only, then SIGINT. The
engine behind them is given recorded shapes to prepare: it prepares them within the time the
API servers wait for it (``VLLM_ENGINE_READY_TIMEOUT_S``), which its worker reads from vLLM.
"""

from __future__ import annotations

import json
import threading
from collections import Counter
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (the engine CI tier installs it)")

from engine.engine_run import chat_messages
from engine.support import Server, read_events, serve_checkpoint
from omnitrace.eventlog import read_records
from omnitrace.events import GraphCaptured
from omnitrace.integrations.vllm_requests import TIMING_ROUTE
from omnitrace.requests import RequestJoin
from omnitrace.signature import Signature
from omnitrace.sinks.jsonl import JsonlSink

pytestmark = pytest.mark.engine

API_SERVERS = 2
#: The phases' timestamps the API server stamps on every request it serves.
STAMPS = ("render_ns", "processor_ns", "processed_ns", "queued_ns", "scheduled_ns")
#: How long the API servers wait for the engine here (vLLM's default is 600 s).
READY_TIMEOUT_S = 900


class ApiServer:
    """One keep-alive connection, and so one API server: every request of it goes there."""

    def __init__(self, server: Server, stack: ExitStack) -> None:
        import httpx
        import openai

        self.http = stack.enter_context(
            httpx.Client(
                base_url=server.base_url, timeout=300, limits=httpx.Limits(max_connections=1)
            )
        )
        self.pid = self.timing(True)["pid"]
        self.openai = openai.OpenAI(
            base_url=f"{server.base_url}/v1", api_key="unused", http_client=self.http
        )

    def timing(self, enabled: bool) -> dict[str, Any]:
        """Switch this API server's request timing; its answer."""
        response = self.http.post(TIMING_ROUTE, json={"enabled": enabled})
        assert response.status_code == 200, response.text
        answer: dict[str, Any] = response.json()
        return answer

    def ask(self, seed: int) -> dict[str, Any]:
        """One chat request with an image and a clip: its id, prompt and generated token ids."""
        model = self.openai.models.list().data[0].id
        reply = self.openai.chat.completions.create(
            model=model,
            messages=chat_messages(seed),
            max_tokens=2,
            temperature=0.0,
            extra_body={"return_token_ids": True},
        )
        choice = reply.choices[0]
        assert choice.finish_reason in ("length", "stop"), choice
        extra = reply.model_extra or {}
        tokens = (choice.model_extra or {}).get("token_ids")
        assert tokens, choice
        assert len(tokens) <= 2, choice
        assert extra.get("prompt_token_ids"), sorted(extra)
        return {
            "id": reply.id,
            "pid": self.pid,
            "prompt": extra["prompt_token_ids"],
            "tokens": tokens,
        }


def _one_per_api_server(server: Server, stack: ExitStack) -> list[ApiServer]:
    """A connection to each API server: new connections until each has one (the kernel
    spreads them at random; 32 tries miss one of two with odds of 2**-31)."""
    found: dict[int, ApiServer] = {}
    for _ in range(32):
        with ExitStack() as attempt:
            connection = ApiServer(server, attempt)
            if connection.pid not in found:
                found[connection.pid] = connection
                stack.enter_context(attempt.pop_all())
        if len(found) == API_SERVERS:
            break
    assert len(found) == API_SERVERS, found
    return list(found.values())


@pytest.fixture
def served(checkpoint: Path, tmp_path: Path) -> Iterator[Server]:
    """Two API servers, prefix caching off (the same prompt computes the same way each
    time), dev mode on (the timing route), idle connections kept for 5 minutes. The shapes
    to prepare are recorded for an encoder this model lacks: the preparation starts and
    captures nothing, on any device."""
    recorded = tmp_path / "recorded.jsonl"
    sink = JsonlSink(recorded)
    capture = ("elsewhere", Signature.parse("float32[2,8]"), 1, 1, 0.0, 1, "cpu", 0, 0, 0, 0, 0)
    sink.handle([GraphCaptured(*capture)])
    sink.close()
    with serve_checkpoint(
        checkpoint,
        tmp_path,
        hf_overrides={"encoder_cuda_graph_prepare_from": str(recorded)},
        extra=("--api-server-count", str(API_SERVERS), "--no-enable-prefix-caching"),
        VLLM_SERVER_DEV_MODE="1",
        VLLM_HTTP_TIMEOUT_KEEP_ALIVE="300",
        VLLM_ENGINE_READY_TIMEOUT_S=str(READY_TIMEOUT_S),
    ) as server:
        yield server


def test_two_api_servers_time_every_request_into_one_shared_log(served: Server) -> None:
    """Every request either API server serves has one RequestTimed, with its phases, from
    the process that served it, in the one ``events-api.jsonl`` both write whole lines to;
    the same prompt gets the same prompt and tokens from either; the timing route switches
    the API server that answers it and no other; SIGINT stops it all without a held kill."""
    out = served.log.parent
    with ExitStack() as stack:
        first, second = api = _one_per_api_server(served, stack)
        assert served.process.pid not in {a.pid for a in api}, "the API servers are children"

        # The same prompt through each, one at a time: the same prompt ids and tokens.
        same = [a.ask(0) for a in api]
        assert same[0]["prompt"] == same[1]["prompt"]
        assert same[0]["tokens"] == same[1]["tokens"], same

        # Three new prompts through each, both API servers at once.
        concurrent: list[dict[str, Any]] = []

        def send(connection: ApiServer, seeds: range) -> None:
            concurrent.extend(connection.ask(seed) for seed in seeds)

        threads = [
            threading.Thread(target=send, args=(a, range(10 + 10 * i, 13 + 10 * i)))
            for i, a in enumerate(api)
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=300)
        assert len(concurrent) == 3 * API_SERVERS

        # The route reaches the API server that takes the connection, and that one alone.
        assert first.timing(False) == {"enabled": False, "was": True, "pid": first.pid}
        untimed = first.ask(40)
        timed_elsewhere = second.ask(41)
        assert first.timing(True) == {"enabled": True, "was": False, "pid": first.pid}
        assert second.timing(True) == {"enabled": True, "was": True, "pid": second.pid}

        assert served.stop() == 0, served.tail()
    text = served.text()
    assert "had not closed their event bus" not in text, served.tail()

    assert sorted(p.name for p in out.glob("events-*.jsonl")) == [
        "events-0.jsonl",
        "events-api.jsonl",
    ]
    api_log = out / "events-api.jsonl"
    raw = api_log.read_bytes()
    assert raw.endswith(b"\n")
    lines = raw.decode().splitlines()
    records = [json.loads(line) for line in lines]  # a torn line would not parse
    timed = [r for r in records if r["type"] == "RequestTimed"]
    sent = [*same, *concurrent, timed_elsewhere]
    counts = Counter(r["request_id"] for r in timed)
    assert counts == Counter(s["id"] for s in sent), (counts, [s["id"] for s in sent])
    assert untimed["id"] not in counts
    served_by = {s["id"]: s["pid"] for s in sent}
    for record in timed:
        assert record["pid"] == served_by[record["request_id"]], record
        for stamp in STAMPS:
            assert record[stamp] is not None, (stamp, record)
        assert record["ttft_s"] > 0
        assert (record["images"], record["audios"]) == (1, 1), record
    assert {r["pid"] for r in timed} == {a.pid for a in api}
    # The sink says the log is shared, and how to give each process a file of its own.
    shared = [line for line in text.splitlines() if "put {pid} in the path" in line]
    assert shared, served.tail()
    assert all("events-api-{pid}.jsonl" in line for line in shared), shared

    # Each request's encoder steps, from the worker's log, join its event.
    join = RequestJoin()
    for path in (api_log, out / "events-0.jsonl"):
        for record in read_records(path):
            join.add(record.item, record.pid)
    views = {v.event.request_id: v for v in join.requests()}
    for request in concurrent:
        view = views[request["id"]]
        assert view.steps, request
        assert all(view.event.engine_request_id in s.request_ids for s in view.steps)
    worker = read_events(out / "events-0.jsonl")
    assert len({e["pid"] for e in worker}) == 1

    # The worker read how many API servers wait for it, and for how long.
    waiting = "s left before vLLM's API servers stop waiting for the engine "
    (line,) = [line for line in text.splitlines() if waiting in line]
    assert line.endswith(f"(VLLM_ENGINE_READY_TIMEOUT_S={READY_TIMEOUT_S} s)"), line
    left = float(line.split("preparing recorded shapes in the ", 1)[1].split(" s left", 1)[0])
    assert 0 < left < READY_TIMEOUT_S - 30, line
    assert "'vision' prepared 0 of 0 recorded shapes before serving" in text, served.tail()
