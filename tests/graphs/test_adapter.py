"""EncoderCudaGraph on the simulated backend: every admission rule, event and stat."""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

from omnitrace import (
    CaptureFailed,
    EncoderCudaGraph,
    EncoderGraphConfig,
    EncoderGraphFailedError,
    EventBus,
    GraphCaptured,
    GraphMissed,
    GraphReplayed,
    MemoryDeferred,
    MissReason,
    derive_stats,
)
from omnitrace.graphs.backends.torch import TorchGraphBackend
from omnitrace.signature import InputSpec, Signature
from omnitrace.stats import STATS_KEYS
from omnitrace.testing import SimulatedGraphBackend, capture_events

CFG = EncoderGraphConfig(min_free_bytes=0)


class Counting(torch.nn.Module):
    """A small encoder that counts how often it really runs."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = torch.nn.Linear(8, 8)
        self.calls = 0

    def forward(self, x: torch.Tensor | None, mask: torch.Tensor | None = None) -> torch.Tensor:
        self.calls += 1
        if x is None:
            return torch.zeros(1)
        y = self.lin(x)
        return y if mask is None else y * mask


@pytest.fixture(autouse=True)
def _no_grad() -> Iterator[None]:
    with torch.no_grad():
        yield


def make(
    bus: EventBus,
    config: EncoderGraphConfig = CFG,
    backend: SimulatedGraphBackend | None = None,
    name: str = "vision",
) -> tuple[EncoderCudaGraph, Counting, SimulatedGraphBackend]:
    model = Counting()
    be = backend or SimulatedGraphBackend()
    return EncoderCudaGraph(model, name=name, config=config, bus=bus, backend=be), model, be


def kinds(events: list[Any]) -> list[str]:
    out = []
    for e in events:
        if isinstance(e, GraphMissed):
            out.append(f"miss:{e.reason.value}")
        else:
            out.append(type(e).__name__)
    return out


def test_captures_on_second_call_and_counts_it_as_a_hit(bus: EventBus) -> None:
    """First call is a warm-up miss; the second captures, replays and counts as a hit."""
    graph, model, _ = make(bus)
    x = torch.randn(2, 8)
    with capture_events(bus) as events:
        first, second, third = graph(x), graph(x), graph(x)
    assert kinds(events) == ["miss:warmup", "GraphCaptured", "GraphReplayed", "GraphReplayed"]
    for out in (first, second, third):
        torch.testing.assert_close(out, model.lin(x), rtol=0, atol=0)
    stats = graph.get_cumulative_stats()
    assert tuple(stats) == STATS_KEYS
    assert stats["graph_hits"] == 2
    assert stats["warmup_misses"] == 1
    assert stats["num_graphs"] == 1
    assert stats["hit_rate"] == pytest.approx(2 / 3)


def test_min_capture_calls_three_waits_for_the_third_call(bus: EventBus) -> None:
    """With min_capture_calls=3 the first two calls are warm-up misses."""
    graph, _, _ = make(bus, CFG.replace(min_capture_calls=3))
    x = torch.randn(1, 8)
    with capture_events(bus) as events:
        for _ in range(3):
            graph(x)
    assert kinds(events) == ["miss:warmup", "miss:warmup", "GraphCaptured", "GraphReplayed"]
    details = [e.detail for e in events if isinstance(e, GraphMissed)]
    assert details == ["call 1 of 3", "call 2 of 3"]


def test_returned_outputs_are_clones_that_survive_later_replays(bus: EventBus) -> None:
    """A tensor the caller keeps is not overwritten by the next replay."""
    graph, model, _ = make(bus)
    a, b = torch.randn(2, 8), torch.randn(2, 8)
    graph(a)
    kept = graph(a)  # capturing call
    kept_hit = graph(a)
    graph(b)  # replays into the same static buffers
    torch.testing.assert_close(kept, model.lin(a), rtol=0, atol=0)
    torch.testing.assert_close(kept_hit, model.lin(a), rtol=0, atol=0)
    assert kept.data_ptr() != kept_hit.data_ptr()


def test_cap_holds_four_graphs_without_eviction(bus: EventBus) -> None:
    """With a cap of four, a fifth shape is a capacity miss from its first call; the four
    graphs keep hitting."""
    graph, _, _ = make(bus, CFG.replace(max_graphs=4))
    shapes = [torch.randn(n, 8) for n in range(1, 6)]
    for x in shapes[:4]:
        graph(x)
        graph(x)
    assert graph.num_graphs == 4
    with capture_events(bus) as events:
        for _ in range(3):
            graph(shapes[4])
        for x in shapes[:4]:
            graph(x)
    assert kinds(events) == ["miss:capacity"] * 3 + ["GraphReplayed"] * 4
    assert graph.get_cumulative_stats()["capacity_misses"] == 3
    assert graph.num_graphs == 4


def test_the_default_keeps_thirty_two_graphs_when_they_fit_the_budget(bus: EventBus) -> None:
    """Without a cap or a budget set, 32 shapes get graphs (the simulated ones are small
    against the 2 GiB budget); the 33rd is a capacity miss of the cap, not the budget."""
    graph, _, _ = make(bus)
    shapes = [torch.randn(n, 8) for n in range(1, 34)]
    for x in shapes[:32]:
        graph(x)
        graph(x)
    assert graph.num_graphs == 32
    with capture_events(bus) as events:
        graph(shapes[32])
    assert [e.detail for e in events if isinstance(e, GraphMissed)] == ["cap"]


def test_history_is_bounded_to_four_times_max_graphs(bus: EventBus) -> None:
    """A key pushed out of the history (4 x max_graphs) counts its calls from zero again."""
    graph, _, _ = make(bus, CFG.replace(max_graphs=1, min_capture_calls=2))
    target = torch.randn(1, 8)
    graph(target)  # call 1 of 2
    for n in range(2, 6):  # four other keys fill the history of 4
        graph(torch.randn(n, 8))
    with capture_events(bus) as events:
        graph(target)
    assert kinds(events) == ["miss:warmup"]
    assert events[0].detail == "call 1 of 2"


def test_recently_called_key_stays_in_history(bus: EventBus) -> None:
    """The least recently called key leaves the history first, not the first inserted."""
    graph, _, _ = make(bus, CFG.replace(max_graphs=1, min_capture_calls=3))
    target = torch.randn(1, 8)
    graph(target)
    graph(torch.randn(2, 8))
    graph(torch.randn(3, 8))
    graph(target)  # call 2 of 3, now most recent
    graph(torch.randn(4, 8))
    graph(torch.randn(5, 8))  # evicts the (2, 8) key, not target
    with capture_events(bus) as events:
        graph(target)
    assert kinds(events) == ["GraphCaptured", "GraphReplayed"]


def test_memory_floor_defers_then_admits(bus: EventBus) -> None:
    """Free memory under the floor gives a deferral and a memory miss; a later call captures."""
    backend = SimulatedGraphBackend(free_bytes=100, graph_bytes=10, cached_bytes=300)
    graph, _, _ = make(bus, CFG.replace(min_free_bytes=500), backend)
    x = torch.randn(2, 8)
    with capture_events(bus) as events:
        graph(x)
        graph(x)
        graph(x)
        backend.free_bytes = 1000
        graph(x)
    assert kinds(events) == [
        "miss:warmup",
        "MemoryDeferred",
        "miss:memory",
        "MemoryDeferred",
        "miss:memory",
        "GraphCaptured",
        "GraphReplayed",
    ]
    deferral = events[1]
    assert isinstance(deferral, MemoryDeferred)
    assert (deferral.free_bytes, deferral.floor_bytes) == (100, 500)
    # What the allocator held cached when the floor was read: memory no new pool can use.
    assert deferral.cached_bytes == 300
    assert backend.free_bytes == 990
    stats = graph.get_cumulative_stats()
    assert (stats["memory_misses"], stats["num_graphs"]) == (2, 1)


def test_existing_graphs_replay_under_the_floor(bus: EventBus) -> None:
    """Once captured, a graph replays whatever the free memory is."""
    backend = SimulatedGraphBackend(free_bytes=1000, graph_bytes=0)
    graph, _, _ = make(bus, CFG.replace(min_free_bytes=500), backend)
    x = torch.randn(2, 8)
    graph(x)
    graph(x)
    backend.free_bytes = 0
    with capture_events(bus) as events:
        graph(x)
        graph(torch.randn(3, 8))
        graph(torch.randn(3, 8))
    assert kinds(events) == ["GraphReplayed", "miss:warmup", "MemoryDeferred", "miss:memory"]


def test_zero_floor_never_reads_free_memory(bus: EventBus) -> None:
    """min_free_bytes=0 disables the check: a device with no free memory still captures."""
    backend = SimulatedGraphBackend(free_bytes=0)
    graph, _, _ = make(bus, CFG.replace(min_free_bytes=0), backend)
    x = torch.randn(2, 8)
    graph(x)
    graph(x)
    assert graph.num_graphs == 1


def _ineligible(graph: EncoderCudaGraph, bus: EventBus, call: Callable[[], object]) -> str:
    with capture_events(bus) as events:
        call()
    assert len(events) == 1
    event = events[0]
    assert isinstance(event, GraphMissed)
    assert event.reason is MissReason.INELIGIBLE
    return event.detail


def test_ineligible_calls_run_eagerly_with_a_detail(bus: EventBus) -> None:
    """No tensors, grad, autocast, capturing, sparse layout and mixed devices stay eager."""
    graph, _, backend = make(bus)
    x = torch.randn(2, 8)
    details = []
    details.append(_ineligible(graph, bus, lambda: graph(None)))

    def with_grad() -> object:
        with torch.enable_grad():
            return graph(x)

    details.append(_ineligible(graph, bus, with_grad))

    def with_autocast() -> object:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return graph(x)

    details.append(_ineligible(graph, bus, with_autocast))

    def capturing() -> object:
        with backend.capturing():
            return graph(x)

    details.append(_ineligible(graph, bus, capturing))
    sparse = torch.zeros(2, 8).to_sparse()
    details.append(_ineligible(graph, bus, lambda: graph(x, sparse)))
    mixed = EncoderCudaGraph(lambda a, b: a, name="mixed", config=CFG, bus=bus, backend=backend)
    meta = torch.empty(2, 8, device="meta")
    details.append(_ineligible(mixed, bus, lambda: mixed(x, meta)))
    assert details == ["no_tensors", "grad", "autocast", "capturing", "layout", "mixed_devices"]
    stats = graph.get_cumulative_stats()
    assert stats["ineligible_misses"] == 5
    assert stats["graph_hits"] == 0
    assert graph.num_graphs == 0


def test_cpu_tensors_are_ineligible_on_the_torch_backend(bus: EventBus) -> None:
    """With the real backend a CPU call runs eagerly with detail 'cpu' and the same result."""
    model = Counting()
    graph = EncoderCudaGraph(model, name="audio", config=CFG, bus=bus, backend=TorchGraphBackend())
    x = torch.randn(3, 8)
    with capture_events(bus) as events:
        out = graph(x)
        graph(x)
    assert [e.detail for e in events if isinstance(e, GraphMissed)] == ["cpu", "cpu"]
    torch.testing.assert_close(out, model.lin(x), rtol=0, atol=0)


def test_disabled_adapter_is_ineligible(bus: EventBus) -> None:
    """enabled=False runs every call eagerly as an ineligible 'disabled' miss."""
    graph, model, backend = make(bus, CFG.replace(enabled=False))
    x = torch.randn(2, 8)
    with capture_events(bus) as events:
        graph(x)
        graph(x)
        graph(x)
    assert [(e.reason, e.detail) for e in events] == [  # type: ignore[union-attr]
        (MissReason.INELIGIBLE, "disabled")
    ] * 3
    assert backend.captures == 0
    assert model.calls == 3


def test_zero_max_graphs_counts_every_eligible_call_as_a_capacity_miss(bus: EventBus) -> None:
    """max_graphs=0 is a full cache of zero graphs: eligible calls are capacity misses (the
    lost coverage shows), calls that could never be graphed stay ineligible."""
    graph, model, backend = make(bus, CFG.replace(max_graphs=0))
    x = torch.randn(2, 8)
    with capture_events(bus) as events:
        for _ in range(3):
            graph(x)
        graph(torch.randn(5, 8))
        with torch.enable_grad():
            graph(x)
    assert [(e.reason, e.detail) for e in events] == [  # type: ignore[union-attr]
        *[(MissReason.CAPACITY, "cap")] * 4,
        (MissReason.INELIGIBLE, "grad"),
    ]
    stats = graph.get_cumulative_stats()
    assert (stats["capacity_misses"], stats["ineligible_misses"], stats["num_graphs"]) == (4, 1, 0)
    assert (backend.captures, model.calls) == (0, 5)


def test_enforce_eager_config_never_captures(bus: EventBus) -> None:
    """A config built with enforce_eager=True keeps every call eager."""
    config = EncoderGraphConfig.from_hf_overrides({"encoder_cuda_graph": True}, enforce_eager=True)
    graph, _, backend = make(bus, config)
    for _ in range(4):
        graph(torch.randn(2, 8))
    assert backend.captures == 0
    assert graph.get_cumulative_stats()["ineligible_misses"] == 4


def test_non_tensor_input_is_a_clear_type_error(bus: EventBus) -> None:
    """A positional argument that is neither a tensor nor None raises TypeError naming it."""
    graph, _, _ = make(bus)
    with pytest.raises(TypeError, match="input 1 is a int"):
        graph(torch.randn(2, 8), 3)  # type: ignore[arg-type]


def test_nested_call_during_capture_is_ineligible(bus: EventBus) -> None:
    """An adapter called inside another adapter's capture runs eagerly ('capturing')."""
    backend = SimulatedGraphBackend()
    inner_model = Counting()
    inner = EncoderCudaGraph(inner_model, name="inner", config=CFG, bus=bus, backend=backend)
    outer = EncoderCudaGraph(
        lambda x: inner(x) * 2, name="outer", config=CFG, bus=bus, backend=backend
    )
    x = torch.randn(2, 8)
    with capture_events(bus) as events:
        outer(x)
        outer(x)
    inner_details = [
        e.detail for e in events if isinstance(e, GraphMissed) and e.adapter == "inner"
    ]
    assert "capturing" in inner_details


def test_capture_failure_is_fatal_and_keeps_the_original_exception(bus: EventBus) -> None:
    """The capture's own exception propagates; later calls raise without running anything."""
    boom = RuntimeError("operation not permitted when stream is capturing")
    graph, model, _ = make(bus, backend=SimulatedGraphBackend(fail_on_capture=boom))
    x = torch.randn(2, 8)
    graph(x)
    with capture_events(bus) as events, pytest.raises(RuntimeError) as info:
        graph(x)
    assert info.value is boom
    assert kinds(events) == ["CaptureFailed"]
    failed = events[0]
    assert isinstance(failed, CaptureFailed)
    assert (failed.error_type, failed.message) == ("RuntimeError", str(boom))
    runs_before = model.calls
    for _ in range(2):
        with pytest.raises(EncoderGraphFailedError) as later:
            graph(torch.randn(5, 8))
    message = str(later.value)
    assert "RuntimeError: operation not permitted when stream is capturing" in message
    assert "Restart the worker" in message
    assert '"encoder_cuda_graph": false' in message
    assert model.calls == runs_before
    assert graph.terminal
    assert graph.get_cumulative_stats()["capture_failures"] == 1


class _LateFailingBackend(SimulatedGraphBackend):
    """A simulated device whose captures fail only after ``delay`` seconds."""

    def __init__(self, delay: float) -> None:
        super().__init__(fail_on_capture=RuntimeError("capture failed late"))
        self.delay = delay
        self.attempts: list[int] = []

    def capture(self, *args: Any, **kwargs: Any) -> Any:
        self.attempts.append(threading.get_ident())
        time.sleep(self.delay)
        return super().capture(*args, **kwargs)


def _race_a_late_capture_failure(bus: EventBus, name: str) -> None:
    """Three threads call one shape while its capture fails late; check what each saw."""
    backend = _LateFailingBackend(delay=0.1)
    model = Counting()
    graph = EncoderCudaGraph(model, name=name, config=CFG, bus=bus, backend=backend)
    x = torch.randn(2, 8)
    graph(x)  # warm-up: the next call of this shape captures
    runs_before = model.calls
    barrier = threading.Barrier(3)
    outcomes: list[str] = []

    def call() -> None:
        with torch.no_grad():  # grad mode is per thread
            barrier.wait()
            try:
                graph(x)
                outcomes.append("served")
            except EncoderGraphFailedError:
                outcomes.append("terminal")
            except RuntimeError as exc:
                outcomes.append("capture" if str(exc) == "capture failed late" else repr(exc))

    with capture_events(bus) as events:
        threads = [threading.Thread(target=call) for _ in range(3)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(10)
    assert sorted(outcomes) == ["capture", "terminal", "terminal"], name
    assert len(backend.attempts) == 1, name
    assert kinds(events) == ["CaptureFailed"], name
    assert graph.get_cumulative_stats()["capture_failures"] == 1
    assert model.calls == runs_before + 1  # the capture's own warm-up, nothing eager


def test_concurrent_calls_during_a_failing_capture_see_one_failure(bus: EventBus) -> None:
    """Three threads call one shape while its capture fails late, 20 times over: one capture
    is attempted, one CaptureFailed is emitted, the two other calls raise the terminal
    error, and no call runs eager work once the adapter is terminal."""
    for trial in range(20):
        _race_a_late_capture_failure(bus, f"vision{trial}")


def test_capture_failure_message_is_one_bounded_line_without_tensor_values(
    bus: EventBus,
) -> None:
    """A forward that raises with a tensor in a long message: the event keeps the first line,
    tensor values replaced, the cut counted; the original exception propagates untouched."""
    values = torch.arange(40_000.0).reshape(200, 200) + 0.123
    boom = RuntimeError(f"bad input {values} at layer 3\n" + "trace line\n" * 1000)
    graph, _, _ = make(bus, backend=SimulatedGraphBackend(fail_on_capture=boom))
    x = torch.randn(2, 8)
    graph(x)
    with capture_events(bus) as events, pytest.raises(RuntimeError) as info:
        graph(x)
    assert info.value is boom
    (failed,) = events
    assert isinstance(failed, CaptureFailed)
    assert failed.message == "bad input tensor(...) at layer 3 ... [+11000 chars]"
    with pytest.raises(EncoderGraphFailedError) as later:
        graph(x)
    assert "(RuntimeError: bad input tensor(...) at layer 3 ... [+11000 chars])" in str(later.value)


def test_a_long_single_line_failure_message_is_cut_at_300_characters(bus: EventBus) -> None:
    """A 100,000-character message keeps 300 characters and says how many were cut."""
    boom = ValueError("x" * 100_000)
    graph, _, _ = make(bus, backend=SimulatedGraphBackend(fail_on_capture=boom))
    x = torch.randn(2, 8)
    graph(x)
    with capture_events(bus) as events, pytest.raises(ValueError, match=r"^x{100000}$"):
        graph(x)
    (failed,) = events
    assert failed.message == "x" * 300 + " ... [+99700 chars]"  # type: ignore[union-attr]


def test_unsupported_output_type_fails_capture(bus: EventBus) -> None:
    """An encoder returning a non-tensor leaf cannot be graphed: a TypeError, terminal."""
    graph = EncoderCudaGraph(
        lambda x: (x * 2, 3), name="odd", config=CFG, bus=bus, backend=SimulatedGraphBackend()
    )
    x = torch.randn(2, 8)
    graph(x)
    with pytest.raises(TypeError, match=r"encoder output\[1\] is a int"):
        graph(x)
    assert graph.terminal


def test_tuple_and_dict_outputs_round_trip(bus: EventBus) -> None:
    """Nested tuple/list/dict outputs keep their structure on replay."""
    graph = EncoderCudaGraph(
        lambda x: {"h": x + 1, "pair": (x * 2, None), "l": [x - 1]},
        name="tree",
        config=CFG,
        bus=bus,
        backend=SimulatedGraphBackend(),
    )
    x = torch.randn(2, 3)
    for _ in range(3):
        out = graph(x)
    assert set(out) == {"h", "pair", "l"}
    torch.testing.assert_close(out["h"], x + 1)
    torch.testing.assert_close(out["pair"][0], x * 2)
    assert out["pair"][1] is None
    torch.testing.assert_close(out["l"][0], x - 1)
    assert graph.get_cumulative_stats()["graph_hits"] == 2


def test_optional_none_input_is_part_of_the_key(bus: EventBus) -> None:
    """Calls with and without the optional mask are different keys."""
    graph, model, _ = make(bus)
    x, mask = torch.randn(2, 8), torch.ones(2, 8)
    for _ in range(2):
        graph(x)
        graph(x, mask)
    assert graph.num_graphs == 2
    torch.testing.assert_close(graph(x, mask * 3), model.lin(x) * 3)


def test_dtype_is_part_of_the_key(bus: EventBus) -> None:
    """Same shape, other dtype: another key."""
    graph = EncoderCudaGraph(
        lambda x: x * 2, name="d", config=CFG, bus=bus, backend=SimulatedGraphBackend()
    )
    for dtype in (torch.float32, torch.float64):
        graph(torch.ones(2, dtype=dtype))
        graph(torch.ones(2, dtype=dtype))
    assert graph.num_graphs == 2


def test_shared_pool_per_stream_and_isolation_between_streams(bus: EventBus) -> None:
    """With sharing, one pool per replay stream; another stream or adapter gets its own."""
    backend = SimulatedGraphBackend()
    graph, _, _ = make(bus, backend=backend)
    other, _, _ = make(bus, backend=backend, name="audio")
    with capture_events(bus) as events:
        for n in (1, 2):
            graph(torch.randn(n, 8))
            graph(torch.randn(n, 8))
        with backend.stream(7):
            graph(torch.randn(1, 8))
            graph(torch.randn(1, 8))
        other(torch.randn(1, 8))
        other(torch.randn(1, 8))
    captures = [e for e in events if isinstance(e, GraphCaptured)]
    assert [(c.adapter, c.stream) for c in captures] == [
        ("vision", 0),
        ("vision", 0),
        ("vision", 7),
        ("audio", 0),
    ]
    pools = [c.pool_id for c in captures]
    streams = [c.capture_stream for c in captures]
    assert pools[0] == pools[1]
    assert streams[0] == streams[1]
    assert len({pools[0], pools[2], pools[3]}) == 3
    assert len({streams[0], streams[2], streams[3]}) == 3
    assert graph.num_graphs == 3  # same shape on stream 7 is its own key


def test_share_pools_false_gives_every_graph_its_own_pool(bus: EventBus) -> None:
    """The A/B switch: separate pool and capture stream per graph."""
    backend = SimulatedGraphBackend()
    graph, _, _ = make(bus, CFG.replace(share_pools=False), backend)
    with capture_events(bus) as events:
        for n in (1, 2, 3):
            graph(torch.randn(n, 8))
            graph(torch.randn(n, 8))
    captures = [e for e in events if isinstance(e, GraphCaptured)]
    assert len({c.pool_id for c in captures}) == 3
    assert len({c.capture_stream for c in captures}) == 3
    assert backend.pools_created == 3


def test_stats_are_the_fold_of_the_event_stream(bus: EventBus) -> None:
    """get_cumulative_stats() equals derive_stats() over the recorded events, per adapter."""
    backend = SimulatedGraphBackend(free_bytes=10**9, graph_bytes=45 * 10**7)
    vision, _, _ = make(bus, CFG.replace(max_graphs=2, min_free_bytes=2 * 10**8), backend)
    audio, _, _ = make(bus, CFG.replace(max_graphs=1), backend, name="audio")
    generator = torch.Generator().manual_seed(3)
    with capture_events(bus) as events:
        for _ in range(60):
            n = int(torch.randint(1, 6, (1,), generator=generator))
            vision(torch.randn(n, 8))
            audio(torch.randn(n % 2 + 1, 8))
        with torch.enable_grad():
            vision(torch.randn(1, 8))
    derived = derive_stats(events)
    assert derived["vision"] == vision.get_cumulative_stats()
    assert derived["audio"] == audio.get_cumulative_stats()
    assert {name: s.as_dict() for name, s in bus.adapter_stats().items()} == derived
    total = derived["vision"]["graph_hits"] + derived["vision"]["graph_misses"]
    assert total == 61
    assert derived["vision"]["memory_misses"] > 0


def test_every_call_produces_exactly_one_hit_or_miss(bus: EventBus) -> None:
    """Calls, hits and misses balance across many threads."""
    graph, _, _ = make(bus, CFG.replace(max_graphs=3))
    inputs = [torch.randn(n, 8) for n in range(1, 6)]

    def worker() -> None:
        with torch.no_grad():  # grad mode is per thread
            for i in range(50):
                graph(inputs[i % 5])

    threads = [threading.Thread(target=worker) for _ in range(4)]
    with capture_events(bus) as events:
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    outcomes = [e for e in events if isinstance(e, GraphReplayed | GraphMissed)]
    assert len(outcomes) == 200
    stats = graph.get_cumulative_stats()
    assert stats["graph_hits"] + stats["graph_misses"] == 200
    assert stats["num_graphs"] == 3


def test_adapter_without_bus_still_keeps_stats() -> None:
    """With no bus the adapter's own fold still counts."""
    graph = EncoderCudaGraph(
        lambda x: x + 1, name="solo", config=CFG, backend=SimulatedGraphBackend()
    )
    x = torch.zeros(2)
    for _ in range(3):
        graph(x)
    assert graph.get_cumulative_stats()["graph_hits"] == 2


def test_constructor_validates_its_arguments() -> None:
    """Bad forward, name, config or bus are rejected up front."""
    with pytest.raises(TypeError, match="forward must be callable"):
        EncoderCudaGraph(3, name="x")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="name: expected a non-empty string"):
        EncoderCudaGraph(lambda x: x, name=" ")
    with pytest.raises(TypeError, match="config must be an EncoderGraphConfig"):
        EncoderCudaGraph(lambda x: x, name="x", config={"max_graphs": 2})  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="bus must be an EventBus"):
        EncoderCudaGraph(lambda x: x, name="x", bus=object())  # type: ignore[arg-type]


def test_registers_its_config_on_the_bus(bus: EventBus) -> None:
    """Consumers can read each adapter's cap and floor from the bus."""
    make(bus, CFG.replace(max_graphs=6, min_free_bytes=123))
    info = bus.adapters()["vision"]
    assert (info["max_graphs"], info["min_free_bytes"], info["simulated"]) == (6, 123, True)


def test_events_carry_plain_data_only(bus: EventBus) -> None:
    """Event fields are numbers, strings, enums or signatures of them, never tensors or devices."""
    backend = SimulatedGraphBackend(free_bytes=0)
    graph, _, _ = make(bus, CFG.replace(min_free_bytes=1), backend)
    x = torch.randn(2, 8)
    with capture_events(bus) as events:
        graph(x)
        graph(x)
        backend.free_bytes = 10
        graph(x)
    assert {type(e) for e in events} == {GraphMissed, MemoryDeferred, GraphCaptured, GraphReplayed}
    for event in events:
        for name in (f.name for f in dataclasses.fields(event)):
            value = getattr(event, name)
            if isinstance(value, Signature):
                # The structured signature is plain data too: strings, ints and tuples.
                (spec,) = value.inputs
                assert spec == InputSpec("float32", (2, 8), "cpu")
                assert isinstance(value.stream, int)
                continue
            if value is None and name == "need_bytes":
                continue  # a floor's deferral: no eager need deferred it
            assert isinstance(value, int | float | str), (type(event).__name__, name, type(value))
        assert event.key.startswith("float32[2,8] @cpu s=0")


class _StuckSink:
    """A sink that blocks in handle() until released."""

    name = "stuck"

    def __init__(self) -> None:
        self.release = threading.Event()
        self.entered = threading.Event()

    def handle(self, events: object) -> None:
        self.entered.set()
        self.release.wait(10)


class _BrokenSink:
    """A sink that raises on every batch."""

    name = "broken"

    def handle(self, events: object) -> None:
        raise OSError("disk full")


def test_stuck_and_broken_sinks_never_reach_the_encoder_path() -> None:
    """With a stuck sink, a raising sink and a full queue, calls return correct outputs."""
    stuck, broken = _StuckSink(), _BrokenSink()
    bus = EventBus(queue_size=8, drain_interval=0.01)
    bus.add_sink(stuck)
    bus.add_sink(broken)
    graph, model, _ = make(bus)
    x = torch.randn(2, 8)
    graph(x)
    assert stuck.entered.wait(5)  # the stuck sink now holds its worker thread
    for _ in range(200):
        torch.testing.assert_close(graph(x), model.lin(x), rtol=0, atol=0)
    stats = graph.get_cumulative_stats()
    assert stats["graph_hits"] == 200
    assert bus.adapter_stats()["vision"].as_dict() == stats  # the fold never drops
    stuck.release.set()
    bus.close()
    sinks = {s.name: s for s in bus.statistics().sinks}
    assert sinks["stuck"].dropped > 0
    assert sinks["broken"].disabled
    assert sinks["stuck"].delivered + sinks["stuck"].dropped == bus.statistics().emitted


def test_paused_graphs_serve_eagerly_and_resume_with_their_graphs() -> None:
    """While paused every call is an ineligible miss (detail ``paused``) and no graph is
    captured; resumed, the graph captured before serves again."""
    from omnitrace import ConfigError

    bus = EventBus()
    try:
        graph = EncoderCudaGraph(
            torch.nn.Linear(4, 4),
            name="vision",
            config=EncoderGraphConfig(min_free_bytes=0),
            bus=bus,
            backend=SimulatedGraphBackend(),
        )
        x = torch.ones(1, 4)
        with torch.no_grad(), capture_events(bus) as seen:
            graph(x)
            graph(x)  # captured
            graph.pause_graphs()
            assert graph.graphs_paused
            paused_out = graph(x)
            graph(torch.ones(2, 4))
            graph(torch.ones(2, 4))  # would capture if not paused
            graph.pause_graphs(False)
            resumed_out = graph(x)
        assert torch.equal(paused_out, resumed_out)
        misses = [e for e in seen if isinstance(e, GraphMissed)]
        assert [m.detail for m in misses[1:]] == ["paused"] * 3
        assert isinstance(seen[-1], GraphReplayed)
        assert graph.num_graphs == 1
        with pytest.raises(ConfigError, match="paused: expected a bool, got 1"):
            graph.pause_graphs(1)  # type: ignore[arg-type]
    finally:
        bus.close()


def test_a_pool_budget_stops_admission_once_the_graphs_took_it() -> None:
    """With max_graphs as a high ceiling, the byte budget decides: the graph that takes the
    total past it is the last, later shapes are capacity misses with detail ``budget``, and
    the graphs held keep replaying."""
    bus = EventBus()
    # Each capture takes 100 bytes of pool plus its static (rows, 2) float32 input and output.
    config = EncoderGraphConfig(max_graphs=64, pool_budget_bytes=250, min_free_bytes=0)
    backend = SimulatedGraphBackend(free_bytes=1 << 30, graph_bytes=100)
    graph = EncoderCudaGraph(lambda x: x * 2, name="m", config=config, bus=bus, backend=backend)
    try:
        with torch.no_grad(), capture_events(bus) as events:
            for rows in (1, 2, 3, 4):
                for _ in range(2):
                    graph(torch.ones(rows, 2))
            again = graph(torch.ones(1, 2))
        torch.testing.assert_close(again, torch.full((1, 2), 2.0))
        stats = graph.get_cumulative_stats()
        # 116 + 132 = 248 bytes after two graphs: under 250, so a third (148) is admitted and
        # takes the total to 396; the fourth shape finds the budget spent.
        assert stats["num_graphs"] == 3
        misses = [e for e in events if isinstance(e, GraphMissed) and e.reason.value == "capacity"]
        assert [m.detail for m in misses] == ["budget", "budget"]
        captured = [e for e in events if isinstance(e, GraphCaptured)]
        assert sum(e.bytes_reserved + e.static_bytes for e in captured) == 396
    finally:
        bus.close()


def test_without_a_budget_the_graph_count_alone_caps_the_cache() -> None:
    """pool_budget_bytes 0 (the default) leaves the design note's count rule as it was."""
    bus = EventBus()
    config = EncoderGraphConfig(max_graphs=2, min_free_bytes=0)
    backend = SimulatedGraphBackend(free_bytes=1 << 30, graph_bytes=1 << 40)
    graph = EncoderCudaGraph(lambda x: x * 2, name="m", config=config, bus=bus, backend=backend)
    try:
        with torch.no_grad(), capture_events(bus) as events:
            for rows in (1, 2, 3):
                for _ in range(2):
                    graph(torch.ones(rows, 2))
        assert graph.get_cumulative_stats()["num_graphs"] == 2
        misses = [e for e in events if isinstance(e, GraphMissed) and e.reason.value == "capacity"]
        assert [m.detail for m in misses] == ["cap", "cap"]
    finally:
        bus.close()


def test_the_cyclic_garbage_collector_is_paused_for_a_capture_only(bus: EventBus) -> None:
    """A collection inside a capture could free an unreachable CUDA graph there, which
    invalidates the capture: the collector is off while the backend captures, and on again
    after, also when the capture fails."""
    import gc

    seen: list[bool] = []

    class Recording(SimulatedGraphBackend):
        def capture(self, request: Any) -> Any:
            seen.append(gc.isenabled())
            if len(seen) == 2:
                raise RuntimeError("capture failed")
            return super().capture(request)

    graph, _, _ = make(bus, backend=Recording())
    assert gc.isenabled()
    graph(torch.randn(1, 8))
    graph(torch.randn(1, 8))
    assert seen == [False]
    assert gc.isenabled()
    graph(torch.randn(2, 8))
    with pytest.raises(RuntimeError, match="capture failed"):
        graph(torch.randn(2, 8))
    assert seen == [False, False]
    assert gc.isenabled()


def _needing(backend: SimulatedGraphBackend, nbytes: int) -> Callable[[torch.Tensor], Any]:
    """A forward that takes ``nbytes`` at its peak, as the simulated allocator reports it."""

    def forward(x: torch.Tensor) -> torch.Tensor:
        backend.peak_bytes = max(backend.peak_bytes, backend.allocated_bytes + nbytes)
        return x + 1

    return forward


def _needing_adapter(
    bus: EventBus, backend: SimulatedGraphBackend, nbytes: int, config: EncoderGraphConfig
) -> EncoderCudaGraph:
    """An adapter named ``vision`` whose forward takes ``nbytes`` at its peak."""
    return EncoderCudaGraph(
        _needing(backend, nbytes), name="vision", config=config, bus=bus, backend=backend
    )


def test_a_shape_whose_eager_calls_took_more_than_free_memory_waits(bus: EventBus) -> None:
    """With a pool budget (the default), a capture waits while device-free memory holds less
    than the shape's eager calls took and an eighth more: the capture cannot use the
    allocator's cache that served them, and an allocation failing inside it is fatal."""
    backend = SimulatedGraphBackend(free_bytes=1000)
    backend.allocated_bytes = 5000
    config = EncoderGraphConfig(min_free_bytes=0)
    assert config.pool_budget_bytes > 0
    graph = EncoderCudaGraph(
        _needing(backend, 900), name="vision", config=config, bus=bus, backend=backend
    )
    x = torch.ones(2, 3)
    with capture_events(bus) as events:
        graph(x)  # the warm-up: eager, and it took 900 bytes
        graph(x)  # due, but 900 + 900 // 8 > 1000: deferred
        backend.free_bytes = 1012  # exactly 900 + 112: captured
        out = graph(x)
    torch.testing.assert_close(out, x + 1)
    misses = [(e.reason, e.detail) for e in events if isinstance(e, GraphMissed)]
    assert misses == [(MissReason.WARMUP, "call 1 of 2"), (MissReason.MEMORY, "need")]
    (deferred,) = (e for e in events if isinstance(e, MemoryDeferred))
    assert (deferred.free_bytes, deferred.need_bytes, deferred.floor_bytes) == (1000, 900, 0)
    assert sum(isinstance(e, GraphCaptured) for e in events) == 1
    stats = graph.get_cumulative_stats()
    assert (stats["memory_misses"], stats["num_graphs"]) == (1, 1)


def _under_an_earlier_peak(bus: EventBus) -> tuple[SimulatedGraphBackend, EncoderCudaGraph]:
    """An adapter whose calls take 10 bytes, after an earlier call raised the peak to 3000."""
    backend = SimulatedGraphBackend(free_bytes=1000)
    backend.peak_bytes = 3000
    return backend, _needing_adapter(bus, backend, 10, EncoderGraphConfig(min_free_bytes=0))


def test_an_eager_call_under_an_earlier_peak_counts_that_peak(bus: EventBus) -> None:
    """A call that does not raise the allocator's peak is bounded by it: the bound defers."""
    _, graph = _under_an_earlier_peak(bus)
    x = torch.ones(2, 3)
    with capture_events(bus) as events:
        graph(x)
        graph(x)
    (deferred,) = (e for e in events if isinstance(e, MemoryDeferred))
    assert deferred.need_bytes == 3000


def test_a_later_tighter_bound_replaces_a_looser_one(bus: EventBus) -> None:
    """Every call's figure bounds the same need: the least one decides. A call made with
    more allocated before it reads less under the same earlier peak, and that lets the
    capture go ahead."""
    backend, graph = _under_an_earlier_peak(bus)
    x = torch.ones(2, 3)
    with capture_events(bus) as events:
        graph(x)  # warm-up: reads 3000 - 0
        backend.allocated_bytes = 2500
        graph(x)  # deferred on 3000; reads 3000 - 2500
        graph(x)  # 500 + 62 fits in 1000: captured
    needs = [e.need_bytes for e in events if isinstance(e, MemoryDeferred)]
    assert needs == [3000]
    assert sum(isinstance(e, GraphCaptured) for e in events) == 1
    assert graph.get_cumulative_stats()["num_graphs"] == 1


@pytest.mark.parametrize("setting", ["shared", "unshared", "compile"])
def test_a_shape_no_larger_than_a_graph_in_its_pool_is_not_held_back_by_its_need(
    bus: EventBus, setting: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A graph of inputs at least as large in every dimension, in the pool a capture would
    use, left its capture's transient memory free there: a smaller shape's capture reuses it,
    so its eager need does not defer it. A shape larger in one dimension, of another dtype,
    in a pool of its own (pools not shared), or with compile (a compiled capture may take
    less than an eager one of smaller inputs) still waits for free memory."""
    monkeypatch.setattr(torch, "compile", lambda fn, **kwargs: fn)
    share = setting == "shared"
    backend = SimulatedGraphBackend(free_bytes=2000)
    config = EncoderGraphConfig(
        min_free_bytes=0, share_pools=setting != "unshared", compile=setting == "compile"
    )
    graph = _needing_adapter(bus, backend, 900, config)
    big = torch.ones(3, 3)
    graph(big)
    graph(big)  # 900 + 112 fits in 2000: captured
    assert graph.get_cumulative_stats()["num_graphs"] == 1
    backend.free_bytes = 1000  # from now on, 900 + 112 does not fit
    shapes = {
        "smaller": torch.ones(2, 3),
        "wider": torch.ones(2, 4),
        "half": torch.ones(2, 3, dtype=torch.float16),
    }
    deferred: dict[str, list[int | None]] = {}
    for name, x in shapes.items():
        with capture_events(bus) as events:
            graph(x)
            out = graph(x)
        torch.testing.assert_close(out, x + 1)
        deferred[name] = [e.need_bytes for e in events if isinstance(e, MemoryDeferred)]
    assert deferred == {"smaller": [] if share else [900], "wider": [900], "half": [900]}
    assert graph.get_cumulative_stats()["num_graphs"] == (2 if share else 1)


def test_a_larger_graph_in_the_pool_does_not_lift_the_floor(bus: EventBus) -> None:
    """The floor is the design note's check before every capture: it still defers a shape
    that a held graph's pool memory would hold."""
    backend = SimulatedGraphBackend(free_bytes=2000)
    graph = _needing_adapter(bus, backend, 900, EncoderGraphConfig(min_free_bytes=1500))
    graph(torch.ones(3, 3))
    graph(torch.ones(3, 3))
    backend.free_bytes = 1000
    with capture_events(bus) as events:
        graph(torch.ones(2, 3))
        graph(torch.ones(2, 3))
    misses = [(e.reason, e.detail) for e in events if isinstance(e, GraphMissed)]
    assert misses == [(MissReason.WARMUP, "call 1 of 2"), (MissReason.MEMORY, "floor")]
    assert graph.get_cumulative_stats()["num_graphs"] == 1


def test_an_explicit_graph_count_keeps_the_floor_alone(bus: EventBus) -> None:
    """Without a pool budget (an explicit ``max_graphs`` alone) only the floor defers."""
    backend = SimulatedGraphBackend(free_bytes=1000)
    config = EncoderGraphConfig(max_graphs=4, min_free_bytes=0)
    assert config.pool_budget_bytes == 0
    graph = EncoderCudaGraph(
        _needing(backend, 900_000), name="vision", config=config, bus=bus, backend=backend
    )
    with capture_events(bus) as events:
        graph(torch.ones(2, 3))
        graph(torch.ones(2, 3))
    assert not any(isinstance(e, MemoryDeferred) for e in events)
    assert graph.get_cumulative_stats()["num_graphs"] == 1


def test_a_full_cache_does_not_read_the_allocator(bus: EventBus) -> None:
    """Capacity misses run eagerly without reading the allocator's statistics."""
    backend = SimulatedGraphBackend()
    reads: list[str] = []
    backend.device_allocated_bytes = lambda device: reads.append(str(device)) or (0, 0)  # type: ignore[method-assign]
    graph = EncoderCudaGraph(
        lambda x: x + 1,
        name="vision",
        config=EncoderGraphConfig(max_graphs=0, pool_budget_bytes=1 << 30),
        bus=bus,
        backend=backend,
    )
    graph(torch.ones(2, 3))
    graph(torch.ones(2, 3))
    assert reads == []
    assert graph.get_cumulative_stats()["capacity_misses"] == 2
