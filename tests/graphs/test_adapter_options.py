"""The adapter's opt-in behaviours: phases, eager timing, device timing, compiled graphs and
background capture, on the simulated backend."""

from __future__ import annotations

import logging
import sys
import threading
import time
from typing import Any

import pytest
import torch

from omnitrace import (
    CaptureFailed,
    ConfigError,
    EncoderCudaGraph,
    EncoderGraphConfig,
    EncoderGraphFailedError,
    EventBus,
    GraphCaptured,
    GraphMissed,
    GraphReplayed,
    MissReason,
    derive_stats,
)
from omnitrace.events import DeviceTimed, Phase
from omnitrace.graphs.gil import COMPILE_SWITCH_INTERVAL, COMPILE_YIELD
from omnitrace.graphs.timing import CAPTURES, DeviceTimer, HostClock
from omnitrace.testing import SimulatedGraphBackend, capture_events, sig

CFG = EncoderGraphConfig(min_free_bytes=0)


def encoder(x: torch.Tensor) -> torch.Tensor:
    return torch.tanh(x @ x.transpose(-1, -2)) @ x


@pytest.fixture(autouse=True)
def _no_grad() -> Any:
    with torch.no_grad():
        yield


def test_misses_carry_the_eager_calls_host_time_and_follow_the_run(bus: EventBus) -> None:
    """A miss event is emitted after its eager run, with that run's host duration."""
    seen_before_run: list[int] = []

    def slow(x: torch.Tensor) -> torch.Tensor:
        seen_before_run.append(len(events))
        time.sleep(0.02)
        return x + 1

    graph = EncoderCudaGraph(slow, name="v", config=CFG, bus=bus, backend=SimulatedGraphBackend())
    with capture_events(bus) as events:
        graph(torch.ones(2))
    (miss,) = events
    assert isinstance(miss, GraphMissed)
    assert seen_before_run == [0]
    assert miss.duration_s is not None
    assert miss.duration_s >= 0.02


def test_a_forward_that_raises_is_still_a_counted_miss(bus: EventBus) -> None:
    """The exception propagates and the call still counts as an eager miss."""

    def broken(x: torch.Tensor) -> torch.Tensor:
        raise ValueError("bad input")

    graph = EncoderCudaGraph(broken, name="v", config=CFG, bus=bus, backend=SimulatedGraphBackend())
    with capture_events(bus) as events, pytest.raises(ValueError, match="bad input"):
        graph(torch.ones(2))
    assert [type(e) for e in events] == [GraphMissed]
    assert graph.get_cumulative_stats()["warmup_misses"] == 1


def test_events_carry_the_phase_the_adapter_is_in(bus: EventBus) -> None:
    """After set_phase('profiling') events say profiling; serving again after that."""
    graph = EncoderCudaGraph(
        encoder, name="v", config=CFG, bus=bus, backend=SimulatedGraphBackend()
    )
    x = torch.randn(1, 4, 3)
    with capture_events(bus) as events:
        graph.set_phase("profiling")
        graph(x)
        graph.set_phase(Phase.SERVING)
        graph(x)
        graph(x)
    assert [e.phase for e in events] == [
        Phase.PROFILING,
        Phase.SERVING,
        Phase.SERVING,
        Phase.SERVING,
    ]
    with pytest.raises(ConfigError, match=r"^phase: expected one of serving, profiling"):
        graph.set_phase("warming")


def test_skip_profiling_keeps_profiling_calls_out_of_admission(bus: EventBus) -> None:
    """Profiling calls are 'profiling' ineligible misses and take no history or slot."""
    config = CFG.replace(skip_profiling=True, max_graphs=1)
    graph = EncoderCudaGraph(
        encoder, name="v", config=config, bus=bus, backend=SimulatedGraphBackend()
    )
    big, small = torch.randn(1, 8, 3), torch.randn(1, 2, 3)
    graph.set_phase("profiling")
    with capture_events(bus) as events:
        for _ in range(3):
            graph(big)
    assert [(e.reason, e.detail) for e in events if isinstance(e, GraphMissed)] == [
        (MissReason.INELIGIBLE, "profiling")
    ] * 3
    assert graph.num_graphs == 0
    graph.set_phase("serving")
    with capture_events(bus) as events:
        graph(small)
        graph(small)
    # The one slot went to the serving shape; the profiling shape left no history behind.
    assert [type(e) for e in events] == [GraphMissed, GraphCaptured, GraphReplayed]
    assert events[0].reason is MissReason.WARMUP


def test_device_timing_reports_each_call_once_resolved(bus: EventBus) -> None:
    """With device_timing, every eager and replayed call gets a DeviceTimed event later."""
    graph = EncoderCudaGraph(
        encoder,
        name="v",
        config=CFG.replace(device_timing=True),
        bus=bus,
        backend=SimulatedGraphBackend(),
    )
    x = torch.randn(1, 4, 3)
    with capture_events(bus) as events:
        for _ in range(4):
            graph(x)  # miss, capture (no timing of the capture itself), hit, hit
        assert graph.flush_device_timing(5)
    timed = [e for e in events if isinstance(e, DeviceTimed)]
    assert sorted(e.kind for e in timed) == ["eager", "replay", "replay"]
    assert all(e.device_s >= 0 for e in timed)
    assert all(e.key == "float32[1,4,3] @cpu s=0" for e in timed)
    calls = [e for e in events if not isinstance(e, DeviceTimed)]
    assert derive_stats(events) == derive_stats(calls)


def test_without_device_timing_no_timer_is_made(bus: EventBus) -> None:
    """Device timing is off by default: no DeviceTimed event, nothing to flush."""
    graph = EncoderCudaGraph(
        encoder, name="v", config=CFG, bus=bus, backend=SimulatedGraphBackend()
    )
    with capture_events(bus) as events:
        for _ in range(3):
            graph(torch.randn(1, 4, 3))
    assert not any(isinstance(e, DeviceTimed) for e in events)
    assert graph.flush_device_timing(0)


def test_compile_captures_the_compiled_forward_and_misses_stay_eager(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With compile on, captures use torch.compile(forward); eager misses use forward."""
    used: list[str] = []
    compiled_with: list[dict[str, Any]] = []

    def fake_compile(fn: Any, **kwargs: Any) -> Any:
        compiled_with.append(kwargs)

        def compiled(*args: Any) -> Any:
            used.append("compiled")
            return fn(*args)

        return compiled

    def forward(x: torch.Tensor) -> torch.Tensor:
        used.append("eager")
        return x * 2

    monkeypatch.setattr(torch, "compile", fake_compile)
    backend = SimulatedGraphBackend()
    graph = EncoderCudaGraph(forward, name="v", config=CFG.replace(compile=True), backend=backend)
    x = torch.ones(3)
    graph(x)  # warm-up miss: eager
    assert used == ["eager"]
    graph(x)  # capture: the compiled forward (warm-up, capture, replay re-run it)
    graph(x)
    assert compiled_with == [{"dynamic": False}]
    assert used[0] == "eager"
    assert set(used[1:]) == {"compiled", "eager"}  # the compiled fn wraps the eager one
    assert used.count("compiled") >= 3
    assert graph.get_cumulative_stats()["graph_hits"] == 2


def test_compile_compiles_every_admitted_shape_past_dynamos_recompile_limit(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """dynamo stops recompiling a function after recompile_limit shapes (8); an adapter that
    may hold more graphs compiles each shape it captures, and leaves the limit as it was."""
    compiled_shapes: list[tuple[int, ...]] = []

    def backend(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
        compiled_shapes.append(tuple(example_inputs[0].shape))
        return gm.forward

    real_compile = torch.compile
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: real_compile(fn, backend=backend, **kw))
    limit = torch._dynamo.config.recompile_limit
    shapes = limit + 4
    torch._dynamo.reset()
    try:
        graph = EncoderCudaGraph(
            encoder,
            name="v",
            config=CFG.replace(compile=True, max_graphs=shapes),
            backend=SimulatedGraphBackend(),
        )
        for n in range(1, shapes + 1):
            for _ in range(graph.config.min_capture_calls + 1):  # warm-up misses, capture
                x = torch.randn(1, n, 3)
                torch.testing.assert_close(graph(x), encoder(x))
    finally:
        torch._dynamo.reset()
    assert torch._dynamo.config.recompile_limit == limit
    assert graph.get_cumulative_stats()["num_graphs"] == shapes
    assert sorted(set(compiled_shapes)) == [(1, n, 3) for n in range(1, shapes + 1)]


def _on_prepare_thread() -> bool:
    return threading.current_thread().name.startswith("omnitrace-prepare-")


def _background(
    forward: Any, bus: EventBus, backend: SimulatedGraphBackend | None = None, **options: Any
) -> EncoderCudaGraph:
    """An adapter with background capture on the simulated backend."""
    return EncoderCudaGraph(
        forward,
        name="v",
        config=CFG.replace(background_capture=True, **options),
        bus=bus,
        backend=backend if backend is not None else SimulatedGraphBackend(),
    )


def test_background_capture_serves_calls_eagerly_until_the_graph_is_ready(
    bus: EventBus,
) -> None:
    """The admitting call returns at once, later calls miss as 'preparing'; the thread only
    warms up, and the first call after it captures on its own thread and is a hit."""
    backend = SimulatedGraphBackend()
    runs: list[tuple[str, bool]] = []

    def slow_to_prepare(x: torch.Tensor) -> torch.Tensor:
        runs.append((threading.current_thread().name, backend.is_capturing(x.device)))
        if _on_prepare_thread():
            time.sleep(0.3)
        return encoder(x)

    graph = _background(slow_to_prepare, bus, backend)
    x = torch.randn(1, 4, 3)
    expected = encoder(x)
    main = threading.current_thread().name
    with capture_events(bus) as events:
        graph(x)  # warm-up
        start = time.perf_counter()
        assert torch.equal(graph(x), expected)  # admitted: handed to the preparation thread
        assert torch.equal(graph(x), expected)  # still preparing
        assert time.perf_counter() - start < 0.25
        assert (graph.preparing, graph.ready, graph.num_graphs) == (1, 0, 0)
        assert graph.wait_prepared(10)
        assert (graph.preparing, graph.ready, graph.num_graphs) == (0, 1, 0)
        assert torch.equal(graph(x), expected)  # captured on this thread, served by it
        assert (graph.ready, graph.num_graphs) == (0, 1)
    kinds = [(type(e).__name__, getattr(e, "detail", None)) for e in events]
    assert kinds == [
        ("GraphMissed", "call 1 of 2"),
        ("GraphMissed", "preparing"),
        ("GraphMissed", "preparing"),
        ("GraphCaptured", None),
        ("GraphReplayed", None),
    ]
    assert backend.capture_modes == ["thread_local"]
    # Three eager calls, one warm-up on the preparation thread (never capturing), then the
    # capture on the calling thread with no second warm-up, then the simulated replay.
    assert [run for run in runs if run[0] != main] == [("omnitrace-prepare-v", False)]
    assert [run for run in runs if run[0] == main] == [(main, False)] * 3 + [
        (main, True),
        (main, False),
    ]
    assert graph.get_cumulative_stats()["warmup_misses"] == 3
    assert graph.close(5)
    assert derive_stats(events)["v"] == graph.get_cumulative_stats()


def test_background_capture_takes_its_slot_at_admission(bus: EventBus) -> None:
    """A shape being prepared holds a graph slot: another shape meanwhile is a capacity miss."""
    backend = SimulatedGraphBackend(capture_delay=0.2)
    graph = EncoderCudaGraph(
        encoder,
        name="v",
        config=CFG.replace(background_capture=True, max_graphs=1),
        bus=bus,
        backend=backend,
    )
    a, b = torch.randn(1, 4, 3), torch.randn(1, 5, 3)
    with capture_events(bus) as events:
        graph(a)
        graph(a)
        graph(b)
        assert graph.wait_prepared(10)
        graph(b)
        graph(a)  # the prepared key's next call captures it
    assert [e.reason for e in events if isinstance(e, GraphMissed)] == [
        MissReason.WARMUP,
        MissReason.WARMUP,
        MissReason.CAPACITY,
        MissReason.CAPACITY,
    ]
    assert backend.captures == 1
    assert graph.get_cumulative_stats()["graph_hits"] == 1


def test_concurrent_calls_during_background_capture_are_all_correct(bus: EventBus) -> None:
    """Eight threads calling two shapes while graphs are prepared all get eager's result."""
    backend = SimulatedGraphBackend(capture_delay=0.05)
    graph = _background(encoder, bus, backend)
    inputs = [torch.randn(1, n, 3) for n in (4, 6)]
    wrong: list[int] = []

    def worker() -> None:
        with torch.no_grad():
            for i in range(60):
                x = inputs[i % 2]
                if not torch.allclose(graph(x), encoder(x)):
                    wrong.append(i)

    threads = [threading.Thread(target=worker) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert graph.wait_prepared(10)
    assert wrong == []
    stats = graph.get_cumulative_stats()
    assert stats["num_graphs"] == 2
    assert stats["graph_hits"] + stats["graph_misses"] == 8 * 60
    assert backend.captures == 2


def test_a_failed_background_preparation_makes_the_adapter_terminal(bus: EventBus) -> None:
    """One CaptureFailed; the next call raises EncoderGraphFailedError chained to the cause."""
    backend = SimulatedGraphBackend()

    def breaks_when_prepared(x: torch.Tensor) -> torch.Tensor:
        if _on_prepare_thread():
            raise RuntimeError("capture broke")
        return encoder(x)

    graph = _background(breaks_when_prepared, bus, backend)
    x = torch.randn(1, 4, 3)
    with capture_events(bus) as events:
        graph(x)
        graph(x)  # admitted; the preparation thread fails
        deadline = time.monotonic() + 10
        while not graph.terminal and time.monotonic() < deadline:
            time.sleep(0.01)
        with pytest.raises(EncoderGraphFailedError, match="capture broke") as raised:
            graph(x)
    assert isinstance(raised.value.__cause__, RuntimeError)
    assert sum(isinstance(e, CaptureFailed) for e in events) == 1
    assert graph.get_cumulative_stats()["capture_failures"] == 1
    assert backend.captures == 0


def test_a_prepared_keys_failed_capture_raises_to_its_caller_then_is_terminal(
    bus: EventBus,
) -> None:
    """The capture runs on the calling thread: that call sees the original error."""
    backend = SimulatedGraphBackend(fail_on_capture=RuntimeError("capture broke"))
    graph = _background(encoder, bus, backend)
    x = torch.randn(1, 4, 3)
    with capture_events(bus) as events:
        graph(x)
        graph(x)
        assert graph.wait_prepared(10)
        with pytest.raises(RuntimeError, match=r"^capture broke$"):
            graph(x)
        with pytest.raises(EncoderGraphFailedError, match="capture broke"):
            graph(x)
    assert sum(isinstance(e, CaptureFailed) for e in events) == 1
    assert graph.terminal


def test_a_prepared_key_runs_eagerly_while_another_capture_holds_the_lock(
    bus: EventBus,
) -> None:
    """A call never waits for someone else's capture or preparation to capture its own."""
    from omnitrace.graphs.backends.base import CAPTURE_LOCK

    backend = SimulatedGraphBackend()
    graph = _background(encoder, bus, backend)
    x = torch.randn(1, 4, 3)
    graph(x)
    graph(x)
    assert graph.wait_prepared(10)
    held, release = threading.Event(), threading.Event()

    def hold() -> None:
        with CAPTURE_LOCK:
            held.set()
            release.wait(10)

    holder = threading.Thread(target=hold)
    holder.start()
    try:
        assert held.wait(10)
        with capture_events(bus) as events:
            start = time.perf_counter()
            assert torch.equal(graph(x), encoder(x))
            assert time.perf_counter() - start < 1.0
        assert [(type(e), getattr(e, "detail", None)) for e in events] == [
            (GraphMissed, "preparing")
        ]
        assert graph.ready == 1
    finally:
        release.set()
        holder.join(10)
    with capture_events(bus) as events:
        graph(x)
    assert [type(e) for e in events] == [GraphCaptured, GraphReplayed]


def test_background_preparation_runs_in_the_admitting_calls_autograd_mode(
    bus: EventBus,
) -> None:
    """Under inference mode the warm-up is too (a compiled forward's guards then match at
    capture), and the static buffers stay ordinary tensors a later no_grad call can fill."""
    modes: list[tuple[bool, bool]] = []

    def noting(x: torch.Tensor) -> torch.Tensor:
        modes.append((_on_prepare_thread(), torch.is_inference_mode_enabled()))
        return encoder(x)

    graph = _background(noting, bus)
    x = torch.randn(1, 4, 3)
    with torch.inference_mode():
        graph(x)
        graph(x)
        assert graph.wait_prepared(10)
        graph(x)  # captured here, under inference mode
    assert (True, True) in modes
    assert torch.equal(graph(x), encoder(x))  # a no_grad hit copies into the static inputs
    assert graph.get_cumulative_stats()["graph_hits"] == 2


def test_background_capture_refuses_a_backend_without_thread_local_capture() -> None:
    """vLLM's manager captures in the global mode only: background capture is a ConfigError."""

    class VllmLike(SimulatedGraphBackend):
        name = "vllm"
        error_modes = ("global",)

    with pytest.raises(
        ConfigError, match=r"^encoder_cuda_graph_background_capture: the vllm backend captures"
    ):
        EncoderCudaGraph(
            encoder,
            name="v",
            config=CFG.replace(background_capture=True),
            backend=VllmLike(),
        )


def test_synchronous_captures_are_thread_local_where_the_backend_allows() -> None:
    """Other threads may keep running CUDA work during a synchronous capture too."""
    backend = SimulatedGraphBackend()
    graph = EncoderCudaGraph(encoder, name="v", config=CFG, backend=backend)
    x = torch.randn(1, 4, 3)
    graph(x)
    graph(x)
    assert backend.capture_modes == ["thread_local"]

    class GlobalOnly(SimulatedGraphBackend):
        error_modes = ("global",)

    strict = GlobalOnly()
    other = EncoderCudaGraph(encoder, name="w", config=CFG, backend=strict)
    other(x)
    other(x)
    assert strict.capture_modes == ["global"]


def test_close_waits_for_preparations_then_captures_synchronously(bus: EventBus) -> None:
    """close() lets a background preparation finish; its key's next call captures it, and a
    shape admitted afterwards captures inline."""
    backend = SimulatedGraphBackend(capture_delay=0.1)
    graph = EncoderCudaGraph(
        encoder,
        name="closing",
        config=CFG.replace(background_capture=True),
        bus=bus,
        backend=backend,
    )
    a, b = torch.randn(1, 4, 3), torch.randn(1, 5, 3)
    graph(a)
    graph(a)  # handed to the preparation thread
    assert graph.close(5)
    assert (graph.ready, graph.num_graphs) == (1, 0)
    assert not any(t.name == "omnitrace-prepare-closing" for t in threading.enumerate())
    with capture_events(bus) as events:
        graph(a)  # prepared before close: captured now
        graph(b)
        graph(b)  # admitted after close: captured synchronously, served by its graph
    assert [type(e) for e in events] == [
        GraphCaptured,
        GraphReplayed,
        GraphMissed,
        GraphCaptured,
        GraphReplayed,
    ]
    assert graph.close(1)


def test_background_compiled_capture_warns_about_other_compiled_callers(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The one hazard left to the user is said when the adapter is built, not discovered."""
    with caplog.at_level("WARNING", logger="omnitrace.graphs.adapter"):
        EncoderCudaGraph(
            encoder,
            name="v",
            config=CFG.replace(background_capture=True, compile=True),
            backend=SimulatedGraphBackend(),
        )
        EncoderCudaGraph(
            encoder,
            name="w",
            config=CFG.replace(background_capture=True),
            backend=SimulatedGraphBackend(),
        )
    warned = [r.getMessage() for r in caplog.records]
    assert len(warned) == 1
    assert "'v' compiles on its preparation thread" in warned[0]
    assert "FX tracing flag is process-wide" in warned[0]


def test_a_compiling_preparation_first_lets_fresh_ready_keys_be_captured(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A compile holds the capture lock for long: before starting one, a preparation thread
    waits (a bounded while) for another adapter's freshly ready key to be captured."""
    monkeypatch.setattr(torch, "compile", lambda fn, **_: fn)  # compiling is not the point
    config = CFG.replace(background_capture=True, compile=True)
    a = EncoderCudaGraph(encoder, name="a", config=config, backend=SimulatedGraphBackend())
    b = EncoderCudaGraph(encoder, name="b", config=config, backend=SimulatedGraphBackend())
    x = torch.randn(1, 4, 3)
    a(x)
    a(x)
    assert a.wait_prepared(10)
    assert a.ready == 1
    b(x)
    b(x)  # admitted: its preparation waits for a's ready key
    time.sleep(0.2)
    assert (b.preparing, b.ready) == (1, 0)
    a(x)  # a's key is captured; b's preparation may go on
    assert a.num_graphs == 1
    assert b.wait_prepared(10)
    assert b.ready == 1
    assert a.close(5)
    assert b.close(5)


def test_a_compiling_preparation_shortens_the_gil_switch_interval_while_it_runs(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Serving threads get the GIL back within 0.5 ms while a background compile runs; the
    interval is the host's again once no compile runs."""
    seen: list[tuple[str, float]] = []

    def compile_(fn: Any, **_: Any) -> Any:
        def compiled(*args: Any) -> Any:
            seen.append((threading.current_thread().name, sys.getswitchinterval()))
            return fn(*args)

        return compiled

    monkeypatch.setattr(torch, "compile", compile_)
    host = sys.getswitchinterval()
    config = CFG.replace(background_capture=True, compile=True)
    adapter = EncoderCudaGraph(encoder, name="a", config=config, backend=SimulatedGraphBackend())
    try:
        x = torch.randn(1, 4, 3)
        adapter(x)
        adapter(x)
        assert adapter.wait_prepared(10)
    finally:
        assert adapter.close(5)
    preparing = [interval for thread, interval in seen if thread.startswith("omnitrace-prepare")]
    assert preparing
    assert preparing == pytest.approx([COMPILE_SWITCH_INTERVAL.seconds] * len(preparing))
    assert sys.getswitchinterval() == host


def test_a_compiling_preparation_pauses_while_the_adapters_eager_calls_run(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The compile makes no progress during an eager call (one the key's preparation sends
    to the encoder as "preparing"), and goes on once it returned."""
    monkeypatch.setattr(COMPILE_YIELD, "max_pause_s", 30.0)
    compiling = threading.Event()
    release = threading.Event()
    progress = [0]
    during_eager: list[tuple[int, int]] = []

    def compile_(fn: Any, **_: Any) -> Any:
        def step() -> None:  # the compile's Python: a function only the compile calls
            progress[0] += 1
            time.sleep(0)

        def compiled(*args: Any) -> Any:
            compiling.set()
            while not release.is_set():
                step()
            return fn(*args)

        return compiled

    def watched(x: torch.Tensor) -> torch.Tensor:
        if compiling.is_set() and not release.is_set():
            # An eager call while the compile runs: it holds the compile still.
            time.sleep(0.05)
            before = progress[0]
            time.sleep(0.3)
            during_eager.append((COMPILE_YIELD.in_flight, progress[0] - before))
        return encoder(x)

    monkeypatch.setattr(torch, "compile", compile_)
    caplog.set_level(logging.DEBUG, logger="omnitrace.graphs.preparation")
    config = CFG.replace(background_capture=True, compile=True)
    adapter = EncoderCudaGraph(watched, name="a", config=config, backend=SimulatedGraphBackend())
    try:
        x = torch.randn(1, 4, 3)
        adapter(x)
        adapter(x)  # admitted: the preparation thread compiles
        assert compiling.wait(10)
        adapter(x)  # runs eagerly while the key is prepared
        assert COMPILE_YIELD.in_flight == 0
        before = progress[0]
        time.sleep(0.3)
        after_eager = progress[0] - before
        release.set()
        assert adapter.wait_prepared(10)
    finally:
        release.set()
        assert adapter.close(5)
    assert during_eager == [(1, 0)]
    assert after_eager > 0
    # The preparation's log line counts that pause, and only this compile's.
    (line,) = [r.getMessage() for r in caplog.records if "for eager calls" in r.getMessage()]
    assert "it paused 1 times" in line


def test_a_flush_returns_only_once_the_timings_another_resolve_took_are_emitted() -> None:
    """The timer's thread may be emitting what it resolved when a flush finds nothing left:
    the flush waits for those events, so a caller that flushed has seen every one."""
    emitting, release = threading.Event(), threading.Event()
    emitted: list[Any] = []

    def slow_emit(event: Any) -> None:
        emitting.set()
        assert release.wait(10)
        emitted.append(event)

    timer = DeviceTimer(HostClock(), slow_emit, poll_interval=3600)
    timer.stop(timer.start(), "a", sig("float32[1] @cpu s=0"), "eager", Phase.SERVING)
    first = threading.Thread(target=timer.resolve)
    first.start()
    assert emitting.wait(10)  # the first resolve took the pair and is emitting it
    flushed: list[bool] = []
    flush = threading.Thread(target=lambda: flushed.append(timer.resolve(5.0)))
    flush.start()
    flush.join(0.3)
    assert flush.is_alive()  # nothing is pending, but the event is not emitted yet
    release.set()
    first.join(10)
    flush.join(10)
    assert flushed == [True]
    assert len(emitted) == 1
    timer.close()


class _WatchedClock(HostClock):
    """A host clock that records, at each query, how many captures were under way."""

    def __init__(self) -> None:
        self.seen: list[int] = []

    def passed(self, marker: Any) -> bool:
        self.seen.append(CAPTURES.under_way)
        return True


def test_the_device_timer_never_queries_while_a_capture_is_under_way() -> None:
    """CUDA's global capture mode forbids another thread's event query during a capture (it
    breaks the capture): the timer skips its round while one runs and reads the markers after."""
    clock = _WatchedClock()
    emitted: list[Any] = []
    timer = DeviceTimer(clock, emitted.append, poll_interval=3600)
    timer.stop(timer.start(), "a", sig("float32[1] @cpu s=0"), "eager", Phase.SERVING)
    with CAPTURES.capturing():
        assert timer.resolve() is False  # skipped: the pair stays pending
        assert (clock.seen, emitted, timer.pending) == ([], [], 1)
    assert timer.resolve() is True
    assert (clock.seen, len(emitted)) == ([0], 1)
    timer.close()


def test_a_capture_waits_for_a_round_of_queries_in_flight_and_none_starts_inside_it() -> None:
    """A capture that begins while the timer reads its markers starts once that round ends."""
    querying, release = threading.Event(), threading.Event()

    class SlowClock(_WatchedClock):
        def passed(self, marker: Any) -> bool:
            querying.set()
            assert release.wait(10)
            return super().passed(marker)

    clock = SlowClock()
    timer = DeviceTimer(clock, lambda event: None, poll_interval=3600)
    timer.stop(timer.start(), "a", sig("float32[1] @cpu s=0"), "eager", Phase.SERVING)
    reader = threading.Thread(target=timer.resolve)
    reader.start()
    assert querying.wait(10)
    began: list[int] = []

    def capture() -> None:
        with CAPTURES.capturing():
            began.append(len(clock.seen))

    capturer = threading.Thread(target=capture)
    capturer.start()
    capturer.join(0.2)
    assert capturer.is_alive()
    assert not began
    release.set()
    reader.join(10)
    capturer.join(10)
    assert began == [1]
    assert clock.seen == [0]
    timer.close()


def test_every_capture_of_the_adapter_passes_through_the_capture_gate(bus: EventBus) -> None:
    """The adapter's captures count as under way for the gate, so its own device timer (and
    every other adapter's) stays out of them."""
    seen: list[int] = []

    class Watching(SimulatedGraphBackend):
        def capture(self, request: Any) -> Any:
            seen.append(CAPTURES.under_way)
            return super().capture(request)

    graph = EncoderCudaGraph(
        encoder, name="v", config=CFG.replace(device_timing=True), bus=bus, backend=Watching()
    )
    for n in (2, 3):
        for _ in range(3):
            graph(torch.randn(1, n, 3))
    assert graph.flush_device_timing(5)
    assert seen == [1, 1]
    assert CAPTURES.under_way == 0


@pytest.mark.parametrize(
    "name", ["vision\udc80", "a\x1b[31mred", "tab\there", "nl\n", "del\x7f", "c1\x85"]
)
def test_a_name_the_event_log_cannot_carry_is_refused(name: str) -> None:
    """A lone surrogate or a control character in the name is a ConfigError where the
    adapter is built, not a sink that fails on its first event."""
    with pytest.raises(ConfigError) as caught:
        EncoderCudaGraph(lambda x: x, name=name, backend=SimulatedGraphBackend())
    assert str(caught.value) == (
        "name: expected no control characters or lone surrogates (the event log cannot "
        f"carry them), got {name!r} (str)"
    )


@pytest.mark.parametrize("expandable", [False, True])
def test_expandable_pools_reaches_every_capture(bus: EventBus, expandable: bool) -> None:
    """``expandable_pools`` is asked of each capture the backend makes, and registered."""
    backend = SimulatedGraphBackend()
    graph = EncoderCudaGraph(
        lambda x: x * 2,
        name="vision",
        config=EncoderGraphConfig(min_free_bytes=0, expandable_pools=expandable),
        bus=bus,
        backend=backend,
    )
    for rows in (1, 2):
        graph(torch.ones(rows, 3))
        graph(torch.ones(rows, 3))
    assert backend.expandable == [expandable, expandable]
    assert graph.num_graphs == 2


class _Settings:
    """A stand-in for PyTorch's allocator-settings setter: records what it is given."""

    def __init__(self) -> None:
        self.given: list[str] = []

    def __call__(self, text: str) -> None:
        self.given.append(text)


@pytest.fixture
def settings(monkeypatch: pytest.MonkeyPatch) -> _Settings:
    from omnitrace.graphs.backends import torch as torch_backend

    recorder = _Settings()
    monkeypatch.setattr(torch_backend, "_allocator_setter", lambda: recorder)
    monkeypatch.setattr(torch.cuda.memory, "get_allocator_backend", lambda: "native")
    for name in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"):
        monkeypatch.delenv(name, raising=False)
    return recorder


def test_expandable_segments_are_on_for_the_block_alone(settings: _Settings) -> None:
    from omnitrace.graphs.backends.torch import expandable_segments

    with expandable_segments(True):
        assert settings.given == ["expandable_segments:True"]
    assert settings.given == ["expandable_segments:True", "expandable_segments:False"]
    with pytest.raises(RuntimeError, match="capture failed"), expandable_segments(True):
        raise RuntimeError("capture failed")
    assert settings.given[2:] == ["expandable_segments:True", "expandable_segments:False"]


@pytest.mark.parametrize(
    ("variable", "conf"),
    [
        ("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True"),
        ("PYTORCH_ALLOC_CONF", "max_split_size_mb:512, expandable_segments:True"),
    ],
)
def test_expandable_segments_the_process_configured_are_left_alone(
    settings: _Settings, monkeypatch: pytest.MonkeyPatch, variable: str, conf: str
) -> None:
    """Switching them off after the block would undo the operator's own setting."""
    from omnitrace.graphs.backends.torch import expandable_segments

    monkeypatch.setenv(variable, conf)
    with expandable_segments(True):
        pass
    assert settings.given == []


def test_expandable_segments_keep_the_processs_other_settings(
    settings: _Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Some PyTorch versions reset what a settings call leaves out: the operator's other
    settings go with each switch; the backend, fixed at start-up, does not."""
    from omnitrace.graphs.backends.torch import expandable_segments

    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:512, backend:native")
    with expandable_segments(True):
        pass
    assert settings.given == [
        "max_split_size_mb:512,expandable_segments:True",
        "max_split_size_mb:512,expandable_segments:False",
    ]


def test_expandable_segments_change_nothing_when_off_or_on_another_allocator(
    settings: _Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    from omnitrace.graphs.backends.torch import expandable_segments

    with expandable_segments(False):
        pass
    monkeypatch.setattr(torch.cuda.memory, "get_allocator_backend", lambda: "cudaMallocAsync")
    with expandable_segments(True):
        pass

    def cannot_say() -> str:  # a CPU build has no CUDA allocator to ask
        raise AttributeError("module 'torch._C' has no attribute '_cuda_getAllocatorBackend'")

    monkeypatch.setattr(torch.cuda.memory, "get_allocator_backend", cannot_say)
    with expandable_segments(True):
        pass
    assert settings.given == []


def test_an_allocator_that_refuses_the_switch_leaves_the_capture_to_fixed_segments(
    settings: _Settings, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A setter that raises is a logged warning, never a failed capture."""
    from omnitrace.graphs.backends import torch as torch_backend

    def refuse(text: str) -> None:
        settings.given.append(text)
        raise RuntimeError("unrecognized option")

    monkeypatch.setattr(torch_backend, "_allocator_setter", lambda: refuse)
    ran = []
    with caplog.at_level(logging.WARNING), torch_backend.expandable_segments(True):
        ran.append(True)
    assert ran == [True]
    assert settings.given == ["expandable_segments:True"]
    expected = "expandable segments not switched on for a capture: unrecognized option"
    assert expected in caplog.text
