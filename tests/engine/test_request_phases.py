"""Per-request phases inside ``vllm serve``: arrival to first token, joined across processes.

The server runs with the event log template ``events-{rank}.jsonl``: the worker writes
``events-0.jsonl`` (encoder calls and steps), the API server ``events-api.jsonl`` (one
``RequestTimed`` per request). Requests come from the ``openai`` client, streamed, so the
test measures the client's own time to first token. Every test runs against both tiny
checkpoints, Qwen2.5-Omni and MiniCPM-o 4.5 (remote code, its whole vision path graphed).
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (the engine CI tier installs it)")

from engine.engine_run import chat_messages
from engine.support import Server, serve_checkpoint, top_json
from engine.test_qwen2_5_omni_serve import OVERRIDES
from omnitrace.eventlog import read_records
from omnitrace.otlp_receiver import OTLPReceiver
from omnitrace.requests import PHASES, RequestJoin, phases_panel

pytestmark = pytest.mark.engine

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_ID = "00f067aa0ba902b7"


@pytest.fixture(scope="module")
def receiver() -> Iterator[OTLPReceiver]:
    """A loopback OTLP/gRPC receiver for vLLM's traces and omnitrace's spans."""
    with OTLPReceiver("grpc") as running:
        yield running


#: The models served, and the checkpoint fixture of each.
MODELS = {"qwen2_5_omni": "checkpoint", "minicpmo": "minicpmo_checkpoint"}


def _trace_id(server: Server, base: str) -> str:
    """``base`` made the server's own: the receiver outlives each model's server."""
    return f"{list(MODELS).index(server.model):02x}" + base[2:]


@pytest.fixture(scope="module", params=list(MODELS))
def server(
    request: pytest.FixtureRequest,
    tmp_path_factory: pytest.TempPathFactory,
    receiver: OTLPReceiver,
) -> Iterator[Server]:
    """``vllm serve`` on a tiny checkpoint, engine in its own process, with vLLM's tracing
    and omnitrace's OTLP sink both sending to ``receiver``."""
    model: str = request.param
    checkpoint: Path = request.getfixturevalue(MODELS[model])
    out = tmp_path_factory.mktemp(f"phases-{model}")
    endpoint = f"http://127.0.0.1:{receiver.port}"
    with serve_checkpoint(
        checkpoint,
        out,
        hf_overrides=OVERRIDES,
        extra=(
            "--otlp-traces-endpoint",
            endpoint,
            *(("--trust-remote-code",) if model == "minicpmo" else ()),
        ),
        model=model,
        OMNITRACE_OTLP="1",
        OTEL_EXPORTER_OTLP_ENDPOINT=endpoint,
        OTEL_EXPORTER_OTLP_PROTOCOL="grpc",
        OTEL_BSP_SCHEDULE_DELAY="200",
        OTEL_SERVICE_NAME="omnitrace-phases",
    ) as served:
        yield served


def _stream(server: Server, seed_offset: int, headers: dict[str, str] | None = None) -> Any:
    """Send one streamed chat request; return (response id, client TTFT in s)."""
    import openai

    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", timeout=300)
    model = client.models.list().data[0].id
    messages = chat_messages(seed_offset)
    start = time.perf_counter()
    stream = client.chat.completions.create(
        model=model,
        messages=messages,
        max_tokens=2,
        temperature=0.0,
        stream=True,
        extra_headers=headers or {},
    )
    ttft = None
    rid = None
    for chunk in stream:
        rid = chunk.id
        if ttft is None and chunk.choices and chunk.choices[0].delta.content:
            ttft = time.perf_counter() - start
    assert ttft is not None
    assert rid is not None
    return rid, ttft


def _records(out: Path) -> list[Any]:
    records = []
    for path in sorted(out.glob("events-*.jsonl")):
        records.extend(read_records(path))
    return records


def _covered(view: Any) -> bool:
    """Whether the worker's steps in ``view`` encode every modality the request carries."""
    engine_id = view.event.engine_request_id
    wanted = {"image"} if view.event.images else set()
    if view.event.audios:
        wanted.add("audio")
    seen: set[str] = set()
    for step in view.steps:
        for rid, modalities in zip(step.request_ids, step.modalities, strict=True):
            if rid == engine_id:
                seen.update(modalities.split("+"))
    return wanted <= seen


def _join(out: Path, *, calls: bool = False, wait_for: set[str] = frozenset()) -> RequestJoin:
    """Join the logs once every id in ``wait_for`` is there and every request's encoder steps
    are too (at most 30 s): the API server and the worker write their logs independently, so
    a request's RequestTimed can be read before the worker's bus has written its steps."""
    deadline = time.monotonic() + 30
    while True:
        join = RequestJoin(calls=calls)
        for record in _records(out):
            join.add(record.item, record.pid)
        views = join.requests()
        seen = {v.event.request_id for v in views}
        if (wait_for <= seen and all(map(_covered, views))) or time.monotonic() > deadline:
            return join
        time.sleep(0.5)


def test_a_request_s_phases_add_up_to_the_client_s_ttft_and_join_its_trace(
    server: Server,
) -> None:
    """One streamed request with a traceparent: one RequestTimed in the API server's log,
    in the client's trace, whose phases add up to its TTFT, with its encoder steps from the
    worker's log. Its TTFT and two more requests' lie inside the client's, the closest within
    5 % or 10 ms."""
    _stream(server, 20)  # warm-up: the first request of a server pays for start-up work
    trace_id = _trace_id(server, TRACE_ID)
    rid, client_ttft = _stream(server, 0, {"traceparent": f"00-{trace_id}-{PARENT_ID}-01"})
    clients = dict([(rid, client_ttft), _stream(server, 60), _stream(server, 61)])
    out = server.log.parent
    assert (out / "events-api.jsonl").exists(), sorted(p.name for p in out.iterdir())
    joined = _join(out, wait_for=set(clients)).requests()
    views = [v for v in joined if v.event.request_id == rid]
    every = {v.event.request_id: v for v in joined}
    assert len(views) == 1, [v.event.request_id for v in _join(out).requests()]
    view = views[0]
    event = view.event
    assert (event.trace_id, event.parent_span_id) == (trace_id, PARENT_ID)
    assert event.images == 1
    assert event.audios == 1
    assert event.image_pixels == 252 * 252
    assert event.audio_s == pytest.approx(1.5, rel=0.01)
    for name in ("render_ns", "processor_ns", "processed_ns", "queued_ns", "scheduled_ns"):
        assert getattr(event, name) is not None, name
    assert sum(view.phases.values()) == pytest.approx(event.ttft_s, rel=1e-6)
    assert set(view.phases) == set(PHASES)
    # The server's span lies inside the client's; what is left is the client building and
    # sending the request and reading the chunk: 3-5 ms on a quiet two-core machine, over 10
    # when a busy one runs a process late, so the closest of the three requests is compared.
    gaps = [(clients[r] - every[r].event.ttft_s, clients[r]) for r in clients]
    assert all(gap >= 0 for gap, _ in gaps), gaps
    assert any(gap <= max(0.05 * client, 0.010) for gap, client in gaps), gaps
    assert view.phases["encoders"] > 0, view.phases
    assert view.steps
    assert all(event.engine_request_id in s.request_ids for s in view.steps)


def test_vllm_s_request_span_and_omnitrace_s_phase_spans_share_the_client_s_trace(
    server: Server, receiver: OTLPReceiver
) -> None:
    """With ``--otlp-traces-endpoint`` and a client ``traceparent``, vLLM's ``llm_request``
    span and omnitrace's request and phase spans arrive in the client's trace."""
    trace = _trace_id(server, "0af7651916cd43dd8448eb211c80319c")
    rid, _ = _stream(server, 50, {"traceparent": f"00-{trace}-b7ad6b7169203331-01"})
    wanted = bytes.fromhex(trace)

    def names(r: OTLPReceiver) -> set[str]:
        return {span.name for span in r.spans() if span.trace_id == wanted}

    receiver.wait_for(
        lambda r: {"llm_request", "omnitrace.request", "omnitrace.request.phase"} <= names(r),
        timeout=60,
    )
    assert {"llm_request", "omnitrace.request", "omnitrace.request.phase"} <= names(receiver), (
        names(receiver),
        server.tail(),
    )
    (request,) = [s for s in receiver.spans("omnitrace.request") if s.trace_id == wanted]
    ids = {kv.key: kv.value.string_value for kv in request.attributes}
    assert ids["gen_ai.request.id"] == rid


def test_concurrent_requests_get_their_own_encoder_steps(server: Server) -> None:
    """Three requests in flight at once: each one's RequestTimed joins encoder steps that
    name it, with calls of both encoders, as each does alone."""
    results: list[Any] = []
    threads = [
        threading.Thread(target=lambda s=s: results.append(_stream(server, 30 + s)))
        for s in range(3)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=300)
    assert len(results) == 3
    ids = {rid for rid, _ in results}
    join = _join(server.log.parent, calls=True, wait_for=ids)
    views = {v.event.request_id: v for v in join.requests() if v.event.request_id in ids}
    assert set(views) == ids
    for view in views.values():
        encoders = {c["encoder"] for s in view.steps for c in s.calls}
        assert encoders == {"vision", "audio"}, (view.event.request_id, encoders)
        assert 0 < view.encoder_share_s <= view.phases["encoders"] + 1e-9


def test_top_json_and_trace_show_the_requests(server: Server) -> None:
    """``top --json``'s requests panel equals the fold of the logs' events, and ``omnitrace
    trace`` prints one request's tree with its encoder calls."""
    rid, _ = _stream(server, 40)
    out = server.log.parent
    join = _join(out, wait_for={rid})
    logs = [str(p) for p in sorted(out.glob("events-*.jsonl"))]
    panel = top_json(*logs)["requests"]
    expected = json.loads(json.dumps(phases_panel(join.requests())))
    # The log may have grown between the two reads only if a request was in flight: none is.
    assert panel == expected
    assert any(kind["kind"] == "image+audio" for kind in panel["kinds"])
    trace = subprocess.run(
        [sys.executable, "-m", "omnitrace", "trace", rid, *logs],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert trace.returncode == 0, trace.stderr
    assert trace.stdout.startswith(f"request {rid} "), trace.stdout
    for phase in ("render", "processor", "encoders", "prefill"):
        assert phase in trace.stdout, trace.stdout
    assert "vision" in trace.stdout, trace.stdout
    assert "audio" in trace.stdout, trace.stdout
