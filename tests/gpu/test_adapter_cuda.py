"""The adapter on a real CUDA device with the pure-torch backend."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from collections.abc import Iterator

import pytest
import torch

from omnitrace import (
    CaptureFailed,
    EncoderCudaGraph,
    EncoderGraphConfig,
    EventBus,
    GraphCaptured,
    GraphMissed,
    GraphReplayed,
    MemoryDeferred,
    MissReason,
    derive_stats,
)
from omnitrace.demo.encoders import AudioEncoder, EncoderGeometry, VisionEncoder
from omnitrace.testing import capture_events

pytestmark = pytest.mark.gpu

CFG = EncoderGraphConfig(min_free_bytes=0)
SMALL = EncoderGeometry(hidden=256, layers=4, heads=4, mlp=1024)


@pytest.fixture(autouse=True)
def _inference() -> Iterator[None]:
    with torch.no_grad():
        yield
    torch.cuda.synchronize()


def vision(dtype: torch.dtype = torch.bfloat16) -> VisionEncoder:
    torch.manual_seed(0)
    return VisionEncoder(SMALL).to("cuda", dtype).eval()


class _DropsAGraphInCapture(torch.nn.Module):
    """A forward that, while a stream captures it, leaves a captured CUDA graph unreachable
    in a reference cycle: Python's cyclic collector frees it whenever a collection runs."""

    def __init__(self, inner: torch.nn.Module, doomed: torch.cuda.CUDAGraph) -> None:
        super().__init__()
        self.inner = inner
        self.doomed = [doomed]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.doomed and torch.cuda.is_current_stream_capturing():
            cycle: list[object] = [self.doomed.pop()]
            cycle.append(cycle)
            del cycle
            self.allocated = [[] for _ in range(8)]  # allocations a collection may follow
        return self.inner(x)


def test_a_graph_the_garbage_collector_frees_during_a_capture_does_not_break_it(
    bus: EventBus,
) -> None:
    """Destroying a CUDA graph while a stream captures invalidates the capture
    (``cudaErrorStreamCaptureInvalidated``). A collection that falls inside the capture
    (here one is due at every allocation) must not free the unreachable graph there."""
    import gc

    doomed = torch.cuda.CUDAGraph()
    counter = torch.zeros(4, device="cuda")
    with torch.cuda.graph(doomed):
        counter.add_(1)
    model = _DropsAGraphInCapture(vision(), doomed)
    del doomed
    graph = EncoderCudaGraph(model, name="vision", config=CFG, bus=bus)
    y = torch.randn(1, 96, 256, device="cuda", dtype=torch.bfloat16)
    graph(y)
    thresholds = gc.get_threshold()
    gc.set_threshold(1)
    try:
        with capture_events(bus) as events:
            out = graph(y)
    finally:
        gc.set_threshold(*thresholds)
    assert model.doomed == [], "the forward never ran in a capture"
    assert [type(e).__name__ for e in events] == ["GraphCaptured", "GraphReplayed"]
    torch.testing.assert_close(out, model.inner(y), rtol=1.6e-2, atol=1e-2)


def test_outputs_match_eager_and_capture_happens_on_the_second_call(bus: EventBus) -> None:
    """Replayed bf16 outputs equal eager ones; the second call captures."""
    model = vision()
    graph = EncoderCudaGraph(model, name="vision", config=CFG, bus=bus)
    x = torch.randn(1, 256, 256, device="cuda", dtype=torch.bfloat16)
    with capture_events(bus) as events:
        outs = [graph(x) for _ in range(3)]
    kinds = [type(e).__name__ for e in events]
    assert kinds == ["GraphMissed", "GraphCaptured", "GraphReplayed", "GraphReplayed"]
    reference = model(x)
    for out in outs:
        torch.testing.assert_close(out, reference, rtol=1.6e-2, atol=1e-2)
    captured = events[1]
    assert isinstance(captured, GraphCaptured)
    assert captured.device == "cuda:0"
    assert captured.stream == torch.cuda.current_stream().cuda_stream
    assert captured.static_bytes == 2 * x.nbytes
    print(
        f"\ncapture took {captured.duration_s * 1e3:.1f} ms, pool grew {captured.bytes_reserved} B"
    )


def test_vision_mask_and_audio_encoder_match_eager(bus: EventBus) -> None:
    """The optional mask input and the Whisper-like audio encoder replay correctly."""
    model = vision()
    graph = EncoderCudaGraph(model, name="vision", config=CFG, bus=bus)
    x = torch.randn(2, 64, 256, device="cuda", dtype=torch.bfloat16)
    mask = torch.rand(2, 1, 64, 64, device="cuda") > 0.2
    mask[..., 0] = True
    for _ in range(3):
        out = graph(x, mask)
    torch.testing.assert_close(out, model(x, mask), rtol=1.6e-2, atol=1e-2)
    torch.manual_seed(1)
    audio_model = AudioEncoder(SMALL).to("cuda", torch.bfloat16).eval()
    audio = EncoderCudaGraph(audio_model, name="audio", config=CFG, bus=bus)
    mel = torch.randn(1, 80, 100, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        out = audio(mel)
    assert out.shape == (1, 50, 256)
    torch.testing.assert_close(out, audio_model(mel), rtol=1.6e-2, atol=1e-2)
    assert graph.get_cumulative_stats()["graph_hits"] == 2
    assert audio.get_cumulative_stats()["graph_hits"] == 2


def test_cap_of_four_without_eviction(bus: EventBus) -> None:
    """Four shapes are captured; a fifth stays eager from its first call on."""
    model = vision()
    graph = EncoderCudaGraph(model, name="vision", config=CFG.replace(max_graphs=4), bus=bus)
    inputs = [
        torch.randn(1, n, 256, device="cuda", dtype=torch.bfloat16) for n in (16, 32, 48, 64, 80)
    ]
    for x in inputs[:4]:
        graph(x)
        graph(x)
    with capture_events(bus) as events:
        for _ in range(3):
            graph(inputs[4])
        for x in inputs[:4]:
            torch.testing.assert_close(graph(x), model(x), rtol=1.6e-2, atol=1e-2)
    misses = [e for e in events if isinstance(e, GraphMissed)]
    assert [m.reason for m in misses] == [MissReason.CAPACITY] * 3
    assert sum(isinstance(e, GraphReplayed) for e in events) == 4
    assert graph.num_graphs == 4


def test_retained_outputs_survive_later_replays(bus: EventBus) -> None:
    """Outputs a caller keeps are unchanged after replays with other inputs."""
    model = vision()
    graph = EncoderCudaGraph(model, name="vision", config=CFG, bus=bus)
    xs = [torch.randn(1, 128, 256, device="cuda", dtype=torch.bfloat16) for _ in range(4)]
    graph(xs[0])
    kept = [graph(x) for x in xs]  # capture, then three hits into the same static buffers
    expected = [model(x) for x in xs]
    for out, ref in zip(kept, expected, strict=True):
        torch.testing.assert_close(out, ref, rtol=1.6e-2, atol=1e-2)
    assert len({k.data_ptr() for k in kept}) == 4


def _capture_four(share: bool) -> tuple[set[int], int]:
    model = vision()
    bus = EventBus()
    graph = EncoderCudaGraph(model, name="vision", config=CFG.replace(share_pools=share), bus=bus)
    xs = [
        torch.randn(1, n, 256, device="cuda", dtype=torch.bfloat16) for n in (256, 512, 768, 1024)
    ]
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    before = torch.cuda.memory_reserved()
    with capture_events(bus) as events:
        for x in xs:
            graph(x)
            graph(x)
    torch.cuda.synchronize()
    used = torch.cuda.memory_reserved() - before
    pools = {e.pool_id for e in events if isinstance(e, GraphCaptured)}
    del graph
    bus.close()
    return pools, used


def test_shared_pool_vs_separate_pools() -> None:
    """Sharing puts all captures in one pool and reserves less than a pool per graph."""
    shared_pools, shared_bytes = _capture_four(True)
    torch.cuda.empty_cache()
    separate_pools, separate_bytes = _capture_four(False)
    print(
        f"\nfour graphs: shared pool {shared_bytes / 2**20:.1f} MiB, "
        f"separate pools {separate_bytes / 2**20:.1f} MiB"
    )
    assert len(shared_pools) == 1
    assert len(separate_pools) == 4
    assert shared_bytes < separate_bytes


def test_replay_streams_are_isolated(bus: EventBus) -> None:
    """The same shape on another stream is another key, pool and capture stream."""
    model = vision()
    graph = EncoderCudaGraph(model, name="vision", config=CFG, bus=bus)
    x = torch.randn(1, 64, 256, device="cuda", dtype=torch.bfloat16)
    side = torch.cuda.Stream()
    with capture_events(bus) as events:
        graph(x)
        graph(x)
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            graph(x)
            out = graph(x)
        torch.cuda.current_stream().wait_stream(side)
    captures = [e for e in events if isinstance(e, GraphCaptured)]
    assert [c.stream for c in captures] == [
        torch.cuda.current_stream().cuda_stream,
        side.cuda_stream,
    ]
    assert captures[0].pool_id != captures[1].pool_id
    assert captures[0].capture_stream != captures[1].capture_stream
    torch.testing.assert_close(out, model(x), rtol=1.6e-2, atol=1e-2)


def test_real_memory_floor_defers_capture(bus: EventBus) -> None:
    """A floor above the device's free memory turns captures into memory misses."""
    model = vision()
    huge = 10 * torch.cuda.get_device_properties(0).total_memory
    graph = EncoderCudaGraph(model, name="vision", config=CFG.replace(min_free_bytes=huge), bus=bus)
    x = torch.randn(1, 64, 256, device="cuda", dtype=torch.bfloat16)
    with capture_events(bus) as events:
        graph(x)
        # 256 MiB freed to the allocator's cache: reserved, with no tensor in it.
        del_me = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
        del del_me
        for _ in range(3):
            out = graph(x)
    deferrals = [e for e in events if isinstance(e, MemoryDeferred)]
    assert len(deferrals) == 3
    _, total = torch.cuda.mem_get_info()
    assert 0 < deferrals[0].free_bytes <= total
    assert deferrals[0].floor_bytes == huge
    cached = deferrals[0].cached_bytes
    assert cached is not None
    assert 256 << 20 <= cached <= torch.cuda.memory_reserved()
    assert graph.get_cumulative_stats()["memory_misses"] == 3
    assert graph.num_graphs == 0
    torch.testing.assert_close(out, model(x), rtol=0, atol=0)


def test_grad_autocast_and_enforce_eager_stay_eager(bus: EventBus) -> None:
    """Grad mode, autocast and an enforce_eager config never capture on CUDA."""
    model = vision(torch.float32)
    graph = EncoderCudaGraph(model, name="vision", config=CFG, bus=bus)
    x = torch.randn(1, 32, 256, device="cuda")
    with torch.enable_grad():
        graph(x)
        graph(x)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        graph(x)
        graph(x)
    eager_cfg = EncoderGraphConfig.from_hf_overrides(
        {"encoder_cuda_graph": True}, enforce_eager=True
    )
    eager = EncoderCudaGraph(model, name="eager", config=eager_cfg, bus=bus)
    eager(x)
    eager(x)
    assert graph.get_cumulative_stats()["ineligible_misses"] == 4
    assert graph.num_graphs == 0
    assert eager.num_graphs == 0
    details = [s.as_dict() for s in bus.adapter_stats().values()]
    assert all(d["num_graphs"] == 0 for d in details)


CAPTURE_FAILURE_SCRIPT = textwrap.dedent(
    """
    import json, torch
    from omnitrace import EncoderCudaGraph, EncoderGraphConfig, EncoderGraphFailedError, EventBus
    from omnitrace.testing import capture_events

    calls = []
    def forward(x):
        calls.append(1)
        y = x * 2
        if y.sum().item() > -1e30:  # a host sync: not allowed while capturing
            y = y + 1
        return y

    bus = EventBus()
    config = EncoderGraphConfig(min_free_bytes=0)
    graph = EncoderCudaGraph(forward, name="vision", config=config, bus=bus)
    x = torch.ones(4, device="cuda")
    result = {}
    with torch.no_grad(), capture_events(bus) as events:
        graph(x)
        try:
            graph(x)
        except Exception as exc:
            result["first"] = [type(exc).__module__ + "." + type(exc).__name__, str(exc)[:200]]
        before = len(calls)
        try:
            graph(x)
        except EncoderGraphFailedError as exc:
            result["later"] = str(exc)
        result["ran_after_failure"] = len(calls) - before
    result["events"] = [type(e).__name__ for e in events]
    result["stats"] = graph.get_cumulative_stats()
    bus.close()
    print("RESULT " + json.dumps(result))
    """
)


def test_real_capture_failure_makes_the_adapter_terminal() -> None:
    """A host sync inside capture propagates torch's error; later calls raise without running."""
    proc = subprocess.run(
        [sys.executable, "-c", CAPTURE_FAILURE_SCRIPT],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert lines, proc.stdout + proc.stderr
    import json

    result = json.loads(lines[0][len("RESULT ") :])
    print("\n" + json.dumps(result, indent=1))
    assert result["first"][0] != "omnitrace.config.EncoderGraphFailedError"
    assert "captur" in result["first"][1].lower()
    assert "Restart the worker" in result["later"]
    assert result["ran_after_failure"] == 0
    assert result["events"] == ["GraphMissed", "CaptureFailed"]
    assert result["stats"]["capture_failures"] == 1


#: The start of the two scripts below: a two-layer forward and its weights, on the device.
_TWO_LAYER_PRELUDE = textwrap.dedent(
    """
    import json, sys, torch
    from omnitrace import EncoderCudaGraph, EncoderGraphConfig, EventBus
    from omnitrace.testing import capture_events

    torch.manual_seed(0)
    w1 = torch.randn(256, 8192, device="cuda", dtype=torch.bfloat16) / 16
    w2 = torch.randn(8192, 256, device="cuda", dtype=torch.bfloat16) / 90

    def forward(x):
        # Two transients of 16 MiB a row of x (x @ w1 and its gelu), the output small.
        return torch.nn.functional.gelu(x @ w1) @ w2
    """
)

#: Their end: the events, the needs of memory deferrals, failed captures and the stats
#: into ``result``, printed as one RESULT line.
_EVENTS_EPILOGUE = textwrap.dedent(
    """
    result["events"] = [
        [type(e).__name__, e.reason.value, e.detail] if hasattr(e, "reason") else
        [type(e).__name__, None, None]
        for e in events
    ]
    result["need"] = [e.need_bytes for e in events if type(e).__name__ == "MemoryDeferred"]
    result["failed"] = [e.error_type for e in events if type(e).__name__ == "CaptureFailed"]
    result["stats"] = graph.get_cumulative_stats()
    bus.close()
    print("RESULT " + json.dumps(result))
    """
)


#: An eager call whose transient the allocator's cache serves, then a capture of its shape
#: while device-free memory is short of that transient: argv[1] is "defaults" (omnitrace's
#: defaults, with their pool budget) or "count" (an explicit max_graphs alone: the floor
#: only). Each runs in its own process: a failed capture may leave the context unusable.
CACHE_SERVED_SCRIPT = (
    _TWO_LAYER_PRELUDE
    + textwrap.dedent(
        """
    GiB = 1 << 30  # a transient of 4 GiB at 256 rows

    config = EncoderGraphConfig() if sys.argv[1] == "defaults" else EncoderGraphConfig(max_graphs=4)
    bus = EventBus()
    graph = EncoderCudaGraph(forward, name="vision", config=config, bus=bus)
    x = torch.randn(256, 1024, 256, device="cuda", dtype=torch.bfloat16)
    result = {"budget": config.pool_budget_bytes, "floor": config.min_free_bytes}
    with torch.no_grad(), capture_events(bus) as events:
        expected = forward(x)
        torch.cuda.synchronize()
        first = graph(x)
        torch.cuda.synchronize()
        # Leave 2 GiB free, above the 1 GiB floor and short of the transient, which the
        # allocator still holds cached.
        free = torch.cuda.mem_get_info()[0]
        filler = torch.empty(free - 2 * GiB, dtype=torch.uint8, device="cuda")
        result["free_before"] = torch.cuda.mem_get_info()[0]
        result["cached"] = torch.cuda.memory_reserved() - torch.cuda.memory_allocated()
        outs = []
        try:
            outs.append(graph(x))
            outs.append(graph(x))
        except Exception as exc:
            result["error"] = type(exc).__name__
        if "error" not in result:
            del filler
            torch.cuda.empty_cache()
            outs.append(graph(x))  # room now: captured
            outs.append(graph(x))  # and replayed
            result["match"] = all(torch.equal(o, expected) for o in [first] + outs[:2])
            result["close"] = all(
                torch.allclose(o.float(), expected.float(), rtol=2e-2, atol=2e-2) for o in outs
            )
    """
    )
    + _EVENTS_EPILOGUE
)


def _run_script(script: str, arg: str) -> dict[str, object]:
    proc = subprocess.run(
        [sys.executable, "-c", script, arg],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert lines, proc.stdout + proc.stderr[-4000:]
    import json

    result: dict[str, object] = json.loads(lines[0][len("RESULT ") :])
    print("\n" + arg + " " + json.dumps(result))
    return result


def _cache_served(config: str) -> dict[str, object]:
    return _run_script(CACHE_SERVED_SCRIPT, config)


def test_a_capture_that_the_allocators_cache_alone_could_hold_waits() -> None:
    """With the defaults, a shape whose eager call the allocator's cache served is not
    captured while device-free memory is short of what that call took (a capture cannot use
    the cache, and an allocation failing in it is fatal): it runs eagerly as a ``memory``
    miss (detail ``need``) and is captured once there is room. With an explicit graph count
    alone, the same capture fails, as the floor does not predict it."""
    defaults = _cache_served("defaults")
    assert defaults["failed"] == []
    assert "error" not in defaults
    free, cached = defaults["free_before"], defaults["cached"]
    assert isinstance(free, int)
    assert isinstance(cached, int)
    assert 1 << 30 < free < 3 << 30
    assert cached >= 4 << 30
    events = defaults["events"]
    assert isinstance(events, list)
    assert events[:3] == [
        ["GraphMissed", "warmup", "call 1 of 2"],
        ["MemoryDeferred", None, None],
        ["GraphMissed", "memory", "need"],
    ]
    assert ["GraphCaptured", None, None] in events
    need = defaults["need"]
    assert isinstance(need, list)
    assert len(need) == 2
    assert min(need) >= 4 << 30
    assert defaults["match"] is True
    assert defaults["close"] is True
    stats = defaults["stats"]
    assert isinstance(stats, dict)
    assert (stats["memory_misses"], stats["num_graphs"], stats["capture_failures"]) == (2, 1, 0)

    count = _cache_served("count")
    assert count["budget"] == 0
    assert count["failed"] == ["OutOfMemoryError"]
    assert count["error"] == "OutOfMemoryError"


#: A shape captured while device-free memory is short of its eager need, where the pool
#: already holds a graph of larger inputs: argv[1] is "shared" (the default shared pools,
#: whose freed capture memory the smaller capture reuses) or "unshared" (its own pool, so
#: the need defers it). Each runs in its own process.
POOL_REUSE_SCRIPT = (
    _TWO_LAYER_PRELUDE
    + textwrap.dedent(
        """
    MiB = 1 << 20  # transients of about 1 GiB at 32 rows, 512 MiB at 16

    config = EncoderGraphConfig(min_free_bytes=256 * MiB, share_pools=sys.argv[1] == "shared")
    bus = EventBus()
    graph = EncoderCudaGraph(forward, name="vision", config=config, bus=bus)
    large = torch.randn(32, 1024, 256, device="cuda", dtype=torch.bfloat16)
    small = torch.randn(16, 1024, 256, device="cuda", dtype=torch.bfloat16)
    result = {}
    with torch.no_grad(), capture_events(bus) as events:
        graph(large)
        graph(large)  # captured, with room to spare
        expected = forward(small)
        outs = [graph(small)]  # warm-up: its eager need is recorded
        torch.cuda.synchronize()
        # Leave 384 MiB free: above the floor, short of the small shape's need.
        free = torch.cuda.mem_get_info()[0]
        filler = torch.empty(free - 384 * MiB, dtype=torch.uint8, device="cuda")
        result["free_before"] = torch.cuda.mem_get_info()[0]
        try:
            outs.append(graph(small))
            outs.append(graph(small))
        except Exception as exc:
            result["error"] = type(exc).__name__
        torch.cuda.synchronize()
        del filler
        result["close"] = all(
            torch.allclose(o.float(), expected.float(), rtol=2e-2, atol=2e-2) for o in outs
        )
    result["grew"] = [e.bytes_reserved for e in events if type(e).__name__ == "GraphCaptured"]
    """
    )
    + _EVENTS_EPILOGUE
)


def test_a_smaller_shape_captured_into_a_pool_holding_a_larger_one_is_not_held_back() -> None:
    """With shared pools, a shape whose eager need exceeds device-free memory is captured
    all the same where the pool holds a graph of larger inputs: it reuses that capture's
    freed memory, grows the pool by little and replays its shape's result. In its own pool
    the same shape waits as a ``memory`` miss (detail ``need``) and nothing fails."""
    shared = _run_script(POOL_REUSE_SCRIPT, "shared")
    MiB = 1 << 20
    free = shared["free_before"]
    assert isinstance(free, int)
    assert 256 * MiB < free < 512 * MiB
    assert "error" not in shared
    assert shared["failed"] == []
    assert shared["need"] == []
    grew = shared["grew"]
    assert isinstance(grew, list)
    assert len(grew) == 2
    assert grew[0] >= 512 * MiB  # the larger graph's capture took its transients
    assert grew[1] <= 64 * MiB  # the smaller one's came from what that capture freed
    assert shared["close"] is True
    stats = shared["stats"]
    assert isinstance(stats, dict)
    assert (stats["num_graphs"], stats["memory_misses"], stats["capture_failures"]) == (2, 0, 0)

    unshared = _run_script(POOL_REUSE_SCRIPT, "unshared")
    assert "error" not in unshared
    assert unshared["failed"] == []
    assert ["GraphMissed", "memory", "need"] in unshared["events"]  # type: ignore[operator]
    need = unshared["need"]
    assert isinstance(need, list)
    assert need
    assert min(need) >= 512 * MiB
    assert unshared["close"] is True
    stats = unshared["stats"]
    assert isinstance(stats, dict)
    assert (stats["num_graphs"], stats["memory_misses"], stats["capture_failures"]) == (1, 2, 0)


EXPANDABLE_SCRIPT = textwrap.dedent(
    """
    import json, sys, torch
    from omnitrace import EncoderCudaGraph, EncoderGraphConfig, EventBus
    from omnitrace.testing import capture_events

    torch.manual_seed(0)
    w1 = torch.randn(1024, 4096, device="cuda", dtype=torch.bfloat16) / 32
    w2 = torch.randn(4096, 1024, device="cuda", dtype=torch.bfloat16) / 64

    def forward(x):
        h = torch.nn.functional.gelu(x @ w1) * 2 + 1
        return torch.softmax(h.float(), -1).to(x.dtype) @ w2 + x

    config = EncoderGraphConfig(min_free_bytes=0, expandable_pools=sys.argv[1] == "on")
    bus = EventBus()
    graph = EncoderCudaGraph(forward, name="vision", config=config, bus=bus)
    rows = [1024, 2048, 4096, 8192, 16384]  # each shape larger than the one before
    with torch.no_grad(), capture_events(bus) as events:
        for n in rows:
            x = torch.randn(n, 1024, device="cuda", dtype=torch.bfloat16)
            graph(x)  # warm-up
            graph(x)  # captured
        # Every graph again, after all the captures, against the eager forward.
        match = []
        for n in reversed(rows):
            x = torch.randn(n, 1024, device="cuda", dtype=torch.bfloat16)
            match.append(torch.equal(graph(x), forward(x)))
    result = {
        "grew": [e.bytes_reserved for e in events if type(e).__name__ == "GraphCaptured"],
        "pools": sorted({e.pool_id for e in events if type(e).__name__ == "GraphCaptured"}),
        "match": match,
        "stats": graph.get_cumulative_stats(),
    }
    bus.close()
    print("RESULT " + json.dumps(result))
    """
)


def test_expandable_pools_let_a_larger_capture_reuse_a_smaller_ones_memory() -> None:
    """Shapes captured smallest first into one shared pool: with fixed segments each larger
    capture finds no block big enough among those the smaller ones freed and the pool grows
    by its whole size; with ``expandable_pools`` it reuses part of what they freed (on an
    H100: 0.86 GiB in all against 1.06 GiB, the largest 400 MiB against 512 MiB), and every
    graph still replays its shape's result."""
    off = _run_script(EXPANDABLE_SCRIPT, "off")
    on = _run_script(EXPANDABLE_SCRIPT, "on")
    for result in (off, on):
        assert result["match"] == [True] * 5
        assert len(result["pools"]) == 1  # type: ignore[arg-type]
        stats = result["stats"]
        assert isinstance(stats, dict)
        assert (stats["num_graphs"], stats["capture_failures"]) == (5, 0)
    grew_off, grew_on = off["grew"], on["grew"]
    assert isinstance(grew_off, list)
    assert isinstance(grew_on, list)
    # Fixed segments: each capture grows the pool by about its own size, doubling each time.
    assert sum(grew_off) > 1.6 * grew_off[-1] > 0
    assert grew_on[-1] < 0.9 * grew_off[-1]
    assert sum(grew_on) < 0.9 * sum(grew_off)


def test_stats_fold_matches_derived_stats_on_cuda(bus: EventBus) -> None:
    """On the device too, the adapter's stats are exactly derive_stats of its events."""
    model = vision()
    graph = EncoderCudaGraph(model, name="vision", config=CFG.replace(max_graphs=2), bus=bus)
    with capture_events(bus) as events:
        for n in (16, 16, 32, 32, 16, 48, 48, 32):
            graph(torch.randn(1, n, 256, device="cuda", dtype=torch.bfloat16))
    assert derive_stats(events)["vision"] == graph.get_cumulative_stats()
    assert any(isinstance(e, CaptureFailed) for e in events) is False
