"""Per-request phases: the request events, their join across processes, and what shows them."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import orjson
import pytest

from omnitrace import EventBus, derive_stats
from omnitrace import events as ev
from omnitrace.eventlog.codec import EventLogError, LineEncoder, decode_record, encode_event
from omnitrace.integrations import vllm_requests as hooks
from omnitrace.integrations.vllm_plugin import api_log_path
from omnitrace.requests import PHASES, RequestJoin, kind_of, phases_of, phases_panel
from omnitrace.signature import Signature
from omnitrace.sinks.jsonl import JsonlSink
from omnitrace.testing import capture_events

MS = 1_000_000


def request(
    rid: str = "chatcmpl-1",
    *,
    arrival: int = 0,
    points: tuple[int | None, ...] = (2, 3, 20, 22, 25, 60),
    seen: int = 61,
    images: int = 1,
    audios: int = 0,
) -> ev.RequestTimed:
    """A RequestTimed with its points (render .. first token) in ms after ``arrival``."""
    ns = [None if p is None else arrival + p * MS for p in points]
    return ev.RequestTimed(
        "",
        ev.NO_SIGNATURE,
        arrival + seen * MS,
        1,
        rid,
        f"{rid}-e",
        arrival,
        *ns,
        seen * MS / 1e9,
        images,
        images * 448 * 448,
        audios,
        audios * 1.0,
        "",
        "",
    )


def step(ids: tuple[str, ...], tokens: tuple[int, ...], start_ms: int, end_ms: int) -> Any:
    return ev.EncoderBatchRan(
        "",
        ev.NO_SIGNATURE,
        end_ms * MS,
        1,
        start_ms * MS,
        ids,
        tokens,
        tuple("image" for _ in ids),
    )


def test_phases_add_up_to_the_ttft_and_carve_the_encoders_out_of_prefill() -> None:
    """Each phase runs from its timestamp to the next; the encoders come out of prefill."""
    phases = phases_of(request(), encoder_s=0.010)
    assert list(phases) == list(PHASES)
    assert phases["http"] == pytest.approx(0.002)
    assert phases["render"] == pytest.approx(0.001)
    assert phases["processor"] == pytest.approx(0.017)
    assert phases["to_engine"] == pytest.approx(0.002)
    assert phases["queue"] == pytest.approx(0.003)
    assert phases["encoders"] == pytest.approx(0.010)
    assert phases["prefill"] == pytest.approx(0.025)
    assert phases["output"] == pytest.approx(0.001)
    assert sum(phases.values()) == pytest.approx(0.061)


def test_a_point_not_observed_folds_its_time_into_the_phase_before() -> None:
    """Offline (no renderer stamps) the time before the queue is one phase; nothing is lost,
    and the encoders never take more than prefill."""
    event = request(points=(None, None, None, 22, 25, 60))
    phases = phases_of(event, encoder_s=1.0)
    assert phases["http"] == pytest.approx(0.022)
    assert phases["render"] == phases["processor"] == phases["to_engine"] == 0.0
    assert phases["encoders"] == pytest.approx(0.035)
    assert phases["prefill"] == 0.0
    assert sum(phases.values()) == pytest.approx(event.ttft_s)


def test_without_the_schedulers_times_the_encoders_come_out_of_the_engine_phases() -> None:
    """``vllm.LLM`` without request stats: arrival at the engine's add_request (= processor
    start), processed, then nothing until the first token; the encoder steps are taken out
    of that time, and the phases still add up."""
    event = request(points=(None, 0, 4, None, None, None), seen=50)
    phases = phases_of(event, encoder_s=0.030)
    assert phases["processor"] == pytest.approx(0.004)
    assert phases["encoders"] == pytest.approx(0.030)
    assert phases["to_engine"] == pytest.approx(0.016)
    assert sum(phases.values()) == pytest.approx(event.ttft_s)
    # More encoder time than the engine's phases hold (clock skew): never below zero.
    phases = phases_of(event, encoder_s=1.0)
    assert phases["encoders"] == pytest.approx(0.046)
    assert min(phases.values()) >= 0.0
    assert sum(phases.values()) == pytest.approx(event.ttft_s)


def test_request_events_round_trip_through_the_log_codec() -> None:
    """Both request events read back equal from both encoders' lines, tuples included."""
    events = [request(), step(("a-e", "b-e"), (64, 192), 30, 40)]
    for event in events:
        line = LineEncoder(pid=7, rank=0)(event)
        assert decode_record(orjson.loads(line)).item == event
        assert decode_record(encode_event(event, pid=7, rank=0)).item == event


def test_a_request_id_list_of_another_type_is_refused_by_name() -> None:
    """A log line whose request ids are not strings is an error naming the field."""
    record = encode_event(step(("a",), (1,), 0, 1), pid=1, rank=0)
    record["request_ids"] = [1]
    with pytest.raises(EventLogError, match=r"EncoderBatchRan\.request_ids: expected tuple"):
        decode_record(record)


def test_request_events_leave_the_stats_and_coverage_untouched() -> None:
    """Request events are about no adapter: no stats entry, no coverage table."""
    bus = EventBus()
    try:
        with capture_events(bus) as seen:
            bus.emit(request())
            bus.emit(step(("a",), (1,), 0, 1))
        assert len(seen) == 2
        assert bus.coverage() == {}
        assert derive_stats(seen) == {}
    finally:
        bus.close()


def test_a_batched_step_counts_whole_in_each_request_and_shares_by_tokens() -> None:
    """A step of two requests is in both requests' encoders phase; its calls are linked to
    both; each one's share follows its tokens."""
    join = RequestJoin(calls=True)
    # The worker emits a step's calls, then the step; another process's call is not its.
    join.add(ev.GraphReplayed("vision", Signature(()), 25 * MS, 1, 0.001), pid=5)  # before
    join.add(ev.GraphReplayed("vision", Signature(()), 35 * MS, 1, 0.001), pid=5)
    join.add(ev.GraphReplayed("vision", Signature(()), 35 * MS, 1, 0.001), pid=6)
    join.add(step(("a-e", "b-e"), (64, 192), 30, 40), pid=5)
    join.add(request("a"), pid=1)
    join.add(request("b"), pid=1)
    views = {v.event.request_id: v for v in join.requests()}
    for rid, share in (("a", 0.25), ("b", 0.75)):
        view = views[rid]
        assert view.phases["encoders"] == pytest.approx(0.010)
        assert view.encoder_share_s == pytest.approx(0.010 * share)
        assert [len(s.calls) for s in view.steps] == [1]
    data = views["a"].as_dict()
    assert data["encoder_steps"][0]["share"] == 0.25
    assert data["kind"] == "image"


def test_the_join_keeps_the_newest_requests_and_counts_the_rest() -> None:
    """Past ``keep`` requests the oldest give way, counted."""
    join = RequestJoin(keep=2)
    for i in range(5):
        join.add(request(f"r{i}"), pid=1)
    assert [v.event.request_id for v in join.requests()] == ["r3", "r4"]
    assert join.dropped == 3


def test_kinds_name_modalities_and_counts() -> None:
    """A request's kind names its media."""
    assert kind_of(request(images=1)) == "image"
    assert kind_of(request(images=2, audios=1)) == "2 images+audio"
    assert kind_of(request(images=0)) == "text"


def test_the_panel_gives_quantiles_per_kind_and_the_encoders_ceiling() -> None:
    """p50/p99 per phase and kind; the encoders' share of TTFT and what graphs could save."""
    join = RequestJoin()
    for i in range(10):
        rid = f"r{i}"
        join.add(step((f"{rid}-e",), (64,), 30 + 100 * i, 40 + 100 * i), pid=2)
        join.add(request(rid, arrival=100 * i * MS), pid=1)
    join.add(request("t", images=0), pid=1)
    panel = phases_panel(join.requests())
    assert panel["window"] == 11
    image = panel["kinds"][0]
    assert image["kind"] == "image"
    assert image["requests"] == 10
    assert image["phases"]["encoders"]["p50_s"] == pytest.approx(0.010)
    assert image["encoder_share"] == pytest.approx(0.010 / 0.061)
    assert image["graphs_save_at_most_s"] == pytest.approx(0.010)
    assert panel["kinds"][1]["kind"] == "text"


@pytest.mark.parametrize(
    ("template", "expected"),
    [
        ("/logs/events-{rank}.jsonl", "/logs/events-api.jsonl"),
        ("/logs/events-{pid}.jsonl", "/logs/events-{pid}.jsonl"),
        ("/logs/events.jsonl", "/logs/events.api.jsonl"),
    ],
)
def test_the_api_server_writes_its_own_log_beside_the_workers(template: str, expected: str) -> None:
    """The API server never shares a worker's log file."""
    assert api_log_path(template) == expected


def _write_log(path: Path, events: list[Any], rank: int) -> None:
    bus = EventBus()
    bus.add_sink(JsonlSink(path, rank=rank))
    for event in events:
        bus.emit(event)
    bus.close()


def test_top_json_and_trace_read_the_requests_of_several_logs(tmp_path: Path) -> None:
    """``top --json`` holds the panel of the logs' fold; ``trace`` prints one request's tree."""
    api, worker = tmp_path / "events-api.jsonl", tmp_path / "events-0.jsonl"
    _write_log(api, [request("chatcmpl-9")], rank=1)
    _write_log(
        worker,
        [
            ev.GraphMissed("vision", Signature(()), 35 * MS, 1, ev.MissReason.WARMUP, "", 0.004),
            step(("chatcmpl-9-e",), (64,), 30, 40),
        ],
        rank=0,
    )
    top = subprocess.run(
        [sys.executable, "-m", "omnitrace", "top", "--json", str(api), str(worker)],
        capture_output=True,
        text=True,
        check=True,
    )
    join = RequestJoin()
    join.add(request("chatcmpl-9"), 1)
    join.add(step(("chatcmpl-9-e",), (64,), 30, 40), 1)
    assert json.loads(top.stdout)["requests"] == json.loads(
        json.dumps(phases_panel(join.requests()))
    )
    trace = subprocess.run(
        [sys.executable, "-m", "omnitrace", "trace", "chatcmpl-9", str(api), str(worker)],
        capture_output=True,
        text=True,
        check=True,
    )
    lines = trace.stdout.splitlines()
    assert lines[0].startswith("request chatcmpl-9 (engine id chatcmpl-9-e) · image")
    assert any("encoders" in line and "10.0 ms" in line for line in lines), trace.stdout
    assert any("vision miss warmup/" in line and "4.0 ms host" in line for line in lines)
    missing = subprocess.run(
        [sys.executable, "-m", "omnitrace", "trace", "nope", str(api)],
        capture_output=True,
        text=True,
    )
    assert missing.returncode == 1
    assert "omnitrace trace: error: no request 'nope'" in missing.stderr


# -- the vLLM hooks, on stand-ins for vLLM's objects --------------------------------------------


class _Bus:
    def __init__(self) -> None:
        self.events: list[Any] = []

    def emit(self, event: Any) -> None:
        self.events.append(event)


def test_the_api_hooks_stamp_one_request_from_arrival_to_first_token() -> None:
    """Arrival (ASGI), renderer, processor and engine id feed one RequestTimed at the first
    token, with the engine core's timestamps and the traceparent; later tokens add none."""
    bus = _Bus()

    async def render(*args: Any, **kwargs: Any) -> str:
        return "rendered"

    async def process(self: Any, prompt: Any, *args: Any) -> str:
        return "processed"

    async def add_request(self: Any, request_id: str, *args: Any) -> Any:
        return SimpleNamespace(request_id=f"{request_id}-x")

    update = hooks._wrap_update_stats(lambda self, state, *a: None, lambda: bus)

    async def endpoint(scope: Any, receive: Any, send: Any) -> None:
        await hooks._wrap_render(render)()
        image = SimpleNamespace(size=(448, 224))
        clip = (SimpleNamespace(shape=(16000,)), 16000)
        await hooks._wrap_process(process)(
            None, {"multi_modal_data": {"image": [image, image], "audio": clip}}
        )
        await hooks._wrap_add_request(add_request)(None, "chatcmpl-7")

    scope = {"type": "http", "headers": [(b"traceparent", f"00-{'a' * 32}-{'b' * 16}-01".encode())]}
    asyncio.run(hooks._ArrivalStamp(endpoint)(scope, None, None))
    import time

    now = time.monotonic()
    stats = SimpleNamespace(
        arrival_time=0.0,
        queued_ts=now + 0.001,
        scheduled_ts=now + 0.002,
        first_token_ts=now + 0.003,
    )
    time.sleep(0.005)
    state = SimpleNamespace(
        request_id="chatcmpl-7-x", external_req_id="chatcmpl-7", is_prefilling=True, stats=stats
    )
    update(None, state)
    state.is_prefilling = False
    update(None, state)
    assert len(bus.events) == 1
    event = bus.events[0]
    assert (event.request_id, event.engine_request_id) == ("chatcmpl-7", "chatcmpl-7-x")
    assert (event.trace_id, event.parent_span_id) == ("a" * 32, "b" * 16)
    assert (event.images, event.image_pixels, event.audios) == (2, 2 * 448 * 224, 1)
    assert event.audio_s == pytest.approx(1.0)
    order = [
        event.arrival_ns,
        event.render_ns,
        event.processor_ns,
        event.processed_ns,
        event.queued_ns,
        event.scheduled_ns,
        event.first_token_ns,
        event.monotonic_ns,
    ]
    assert order == sorted(order)
    assert event.ttft_s == pytest.approx((event.monotonic_ns - event.arrival_ns) / 1e9)
    assert "chatcmpl-7-x" not in hooks._pending


def test_a_request_seen_only_by_the_engine_takes_vllm_s_arrival_time() -> None:
    """Offline there is no HTTP arrival: vLLM's wall-clock arrival, on the monotonic clock."""
    import time

    bus = _Bus()
    update = hooks._wrap_update_stats(lambda self, state, *a: None, lambda: bus)
    stats = SimpleNamespace(
        arrival_time=time.time() - 0.5, queued_ts=0.0, scheduled_ts=0.0, first_token_ts=0.0
    )
    update(
        None, SimpleNamespace(request_id="0", external_req_id=None, is_prefilling=True, stats=stats)
    )
    (event,) = bus.events
    assert event.request_id == "0"
    assert event.render_ns is None
    assert event.queued_ns is None
    assert event.ttft_s == pytest.approx(0.5, abs=0.05)


def test_the_v1_encoder_step_hook_names_each_request_s_items_and_tokens() -> None:
    """One EncoderBatchRan per step with encoder inputs, cached items left out; none without."""
    bus = _Bus()
    calls: list[Any] = []

    def execute(self: Any, output: Any) -> list[int]:
        calls.append(output)
        return [1]

    def feature(modality: str, embeds: int, data: Any = 1) -> Any:
        return SimpleNamespace(
            modality=modality, data=data, mm_position=SimpleNamespace(get_num_embeds=lambda: embeds)
        )

    runner = SimpleNamespace(
        requests={
            "a": SimpleNamespace(mm_features=[feature("image", 64), feature("audio", 25)]),
            "b": SimpleNamespace(
                mm_features=[feature("image", 64, data=None), feature("image", 9)]
            ),
        }
    )
    wrapped = hooks._wrap_v1_encoder(execute, lambda: bus)
    output = SimpleNamespace(scheduled_encoder_inputs={"a": [0, 1], "b": [0, 1]})
    assert wrapped(runner, output) == [1]
    assert wrapped(runner, SimpleNamespace(scheduled_encoder_inputs={})) == [1]
    (event,) = bus.events
    assert event.request_ids == ("a", "b")
    assert event.request_tokens == (89, 9)
    assert event.modalities == ("image+audio", "image")
    assert event.start_ns <= event.monotonic_ns
    assert len(calls) == 2


def test_vllm_llm_requests_are_timed_from_the_engines_add_request() -> None:
    """``vllm.LLM`` (no HTTP server, request stats off): the request's timing starts in
    ``LLMEngine.add_request``, its media counted from the rendered prompt's placeholders;
    without the hook its TTFT would read zero."""
    import time

    bus = _Bus()

    def add_request(self: Any, request_id: str, prompt: Any, params: Any) -> str:
        time.sleep(0.003)  # the engine's input processing
        return f"{request_id}-e"

    update = hooks._wrap_update_stats(lambda self, state, *a: None, lambda: bus)
    prompt = {"mm_placeholders": {"image": [object(), object()], "audio": [object()]}}
    engine_id = hooks._wrap_engine_add_request(add_request)(None, "3", prompt, None)
    assert engine_id == "3-e"
    time.sleep(0.02)
    update(
        None, SimpleNamespace(request_id="3-e", external_req_id="3", is_prefilling=True, stats=None)
    )
    (event,) = bus.events
    assert (event.request_id, event.engine_request_id) == ("3", "3-e")
    assert (event.images, event.audios) == (2, 1)
    assert event.processor_ns == event.arrival_ns
    assert event.processed_ns is not None
    assert event.processed_ns - event.arrival_ns >= 3_000_000
    assert event.ttft_s >= 0.023
    phases = phases_of(event)
    assert phases["processor"] >= 0.003
    assert sum(phases.values()) == pytest.approx(event.ttft_s)


def test_replay_exports_a_recorded_days_requests_to_otlp(tmp_path: Path) -> None:
    """``omnitrace replay`` of the API server's log sends each request as its span with a
    child per phase, in the client's trace, and the request-phase histogram."""
    from omnitrace.cli import main
    from omnitrace.otlp_receiver import OTLPReceiver
    from omnitrace.sinks.names import ATTR, METRICS, SPANS

    api = tmp_path / "events-api.jsonl"
    epoch = 1_796_000_000 * 10**9  # the events' own wall-clock stamps, as a server's are
    traced = dataclasses.replace(
        request("chatcmpl-5"), epoch_ns=epoch, trace_id="ab" * 16, parent_span_id="cd" * 8
    )
    plain = dataclasses.replace(request("chatcmpl-6", audios=1, images=0), epoch_ns=epoch)
    # A line whose epoch stamp lies before its own arrival is still exported, from time 0.
    odd = request("chatcmpl-7")
    _write_log(api, [traced, plain, odd], rank=1)
    with OTLPReceiver() as receiver:
        assert main(["replay", str(api), "--otlp-endpoint", receiver.endpoint]) == 0
        assert receiver.wait_for(
            lambda r: (
                len(r.spans(SPANS.REQUEST)) == 3
                and r.latest_metric(METRICS["request_phase_duration"].otel) is not None
            )
        )
        spans = receiver.spans(SPANS.REQUEST)
        phases = receiver.spans(SPANS.REQUEST_PHASE)
    ids = {
        next(a.value.string_value for a in s.attributes if a.key == ATTR.REQUEST_ID): s
        for s in spans
    }
    assert set(ids) == {"chatcmpl-5", "chatcmpl-6", "chatcmpl-7"}
    assert ids["chatcmpl-5"].start_time_unix_nano == epoch - 61 * MS
    assert ids["chatcmpl-7"].start_time_unix_nano == 0
    assert ids["chatcmpl-5"].trace_id.hex() == "ab" * 16
    assert ids["chatcmpl-5"].parent_span_id.hex() == "cd" * 8
    # Seven phases took time in each request (all but the encoders, which the API server's
    # log alone does not split out), each a child of its request's span.
    assert len(phases) == 21
    assert {p.parent_span_id for p in phases} == {s.span_id for s in spans}


def _feature() -> Any:
    return SimpleNamespace(
        modality="image", data=1, mm_position=SimpleNamespace(get_num_embeds=lambda: 64)
    )


def test_request_timing_switched_off_at_run_time_calls_vllm_alone() -> None:
    """Off, the hooks make no record and time no step; back on, they time the next request."""
    from omnitrace.integrations.vllm_plugin import time_requests

    bus = _Bus()
    add = hooks._wrap_engine_add_request(lambda self, rid, prompt, params: f"{rid}-e")
    update = hooks._wrap_update_stats(lambda self, state, *a: None, lambda: bus)
    step = hooks._wrap_v1_encoder(lambda self, output: "ran", lambda: bus)
    runner = SimpleNamespace(requests={"a": SimpleNamespace(mm_features=[_feature()])})
    output = SimpleNamespace(scheduled_encoder_inputs={"a": [0]})

    def serve(request_id: str) -> None:
        assert add(None, request_id, {}, None) == f"{request_id}-e"
        assert step(runner, output) == "ran"
        state = SimpleNamespace(
            request_id=f"{request_id}-e", external_req_id=request_id, is_prefilling=True, stats=None
        )
        update(None, state)

    assert hooks.request_timing()
    assert time_requests(None, False) is True
    try:
        assert not hooks.request_timing()
        serve("off")
        assert bus.events == []
        assert "off-e" not in hooks._pending
    finally:
        assert time_requests(None, True) is False
    serve("on")
    assert [type(e).__name__ for e in bus.events] == ["EncoderBatchRan", "RequestTimed"]
    assert bus.events[1].request_id == "on"
