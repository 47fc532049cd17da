"""The adapter on a real CUDA device through vLLM's EncoderCudaGraphManager.

Needs CUDA and an importable vLLM (on a machine without network: its wheel with --no-deps
plus the pure-Python packages listed in docs/vllm.md). Skips cleanly otherwise.
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch

from omnitrace import EncoderCudaGraph, EncoderGraphConfig, EventBus, GraphCaptured, derive_stats
from omnitrace.demo.encoders import AudioEncoder, EncoderGeometry, VisionEncoder
from omnitrace.testing import capture_events

pytestmark = [pytest.mark.gpu, pytest.mark.vllm]

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)
os.environ.setdefault("VLLM_TARGET_DEVICE", "cuda")
pytest.importorskip("vllm.v1.worker.encoder_cudagraph", reason="needs vLLM")

from omnitrace.graphs.backends.vllm import VllmGraphBackend  # noqa: E402

SMALL = EncoderGeometry(hidden=256, layers=4, heads=4, mlp=1024)
CFG = EncoderGraphConfig(min_free_bytes=0)


def _vllm_config() -> Any:
    from vllm.config import VllmConfig

    return VllmConfig()


def test_vision_replays_match_eager_exactly(bus: EventBus) -> None:
    """Vision outputs served by vLLM's manager are bitwise equal to eager outputs."""
    torch.manual_seed(0)
    model = VisionEncoder(SMALL).cuda().eval()
    backend = VllmGraphBackend(_vllm_config())
    graph = EncoderCudaGraph(model, name="vision", config=CFG, bus=bus, backend=backend)
    with torch.no_grad():
        for tokens in (64, 64, 64, 128, 128, 128):
            x = torch.randn(1, tokens, SMALL.hidden, device="cuda")
            assert torch.equal(graph(x, None), model(x, None))
    stats = graph.get_cumulative_stats()
    assert (stats["graph_hits"], stats["num_graphs"]) == (4, 2)


def test_audio_replays_match_eager_exactly() -> None:
    """Audio outputs (bf16) served by vLLM's manager equal eager outputs bitwise."""
    torch.manual_seed(0)
    model = AudioEncoder(SMALL).cuda().to(torch.bfloat16).eval()
    graph = EncoderCudaGraph(
        model, name="audio", config=CFG, backend=VllmGraphBackend(_vllm_config())
    )
    mel = torch.randn(1, 80, 100, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        outs = [graph(mel) for _ in range(4)]
        expected = model(mel)
    assert all(torch.equal(out, expected) for out in outs)


def test_outputs_are_clones_that_survive_later_replays() -> None:
    """An output kept from one replay is not overwritten by the next replay."""
    torch.manual_seed(0)
    model = VisionEncoder(SMALL).cuda().eval()
    graph = EncoderCudaGraph(
        model, name="vision", config=CFG, backend=VllmGraphBackend(_vllm_config())
    )
    a = torch.randn(1, 64, SMALL.hidden, device="cuda")
    b = torch.randn(1, 64, SMALL.hidden, device="cuda")
    with torch.no_grad():
        graph(a, None)
        kept = graph(a, None)
        graph(b, None)
        assert torch.equal(kept, model(a, None))


def test_merged_manager_stats_equal_adapter_stats_and_event_fold(bus: EventBus) -> None:
    """vLLM's counters merged with pre-manager rejections equal the adapter's stats and events."""
    torch.manual_seed(0)
    model = VisionEncoder(SMALL).cuda().eval()
    backend = VllmGraphBackend(_vllm_config())
    config = EncoderGraphConfig(min_free_bytes=0, max_graphs=2)
    graph = EncoderCudaGraph(model, name="vision", config=config, bus=bus, backend=backend)
    with capture_events(bus) as events, torch.no_grad():
        for tokens in (32, 32, 32, 64, 64, 96, 96, 96, 32, 64):
            graph(torch.randn(1, tokens, SMALL.hidden, device="cuda"), None)
        with torch.enable_grad():
            # Grad mode: ineligible, decided before any manager (and valid for the model).
            graph(torch.randn(1, 32, SMALL.hidden, device="cuda"), None)
    stats = graph.get_cumulative_stats()
    assert stats["capacity_misses"] == 3
    assert stats["ineligible_misses"] == 1
    assert backend.manager_stats().graph_hits == stats["graph_hits"]
    assert backend.merged_stats(stats) == stats
    assert derive_stats(events)["vision"] == stats


def test_shared_pool_reaches_every_manager_and_reserves_less(bus: EventBus) -> None:
    """With shared pools all captures report one pool id and reserve no more than separate pools."""
    reserved = {}
    for share in (True, False):
        torch.manual_seed(0)
        torch.cuda.empty_cache()
        model = VisionEncoder(SMALL).cuda().eval()
        config = EncoderGraphConfig(min_free_bytes=0, share_pools=share)
        graph = EncoderCudaGraph(
            model,
            name=f"vision-{share}",
            config=config,
            bus=bus,
            backend=VllmGraphBackend(_vllm_config()),
        )
        with capture_events(bus) as events, torch.no_grad():
            for tokens in (64, 64, 128, 128, 192, 192, 256, 256):
                graph(torch.randn(1, tokens, SMALL.hidden, device="cuda"), None)
        captured = [e for e in events if isinstance(e, GraphCaptured)]
        assert len(captured) == 4
        pools = {e.pool_id for e in captured}
        assert len(pools) == (1 if share else 4)
        reserved[share] = sum(e.bytes_reserved for e in captured)
        del graph
    assert reserved[True] <= reserved[False]


def test_background_capture_in_vllm_prepares_on_a_thread_and_replays_exactly(
    bus: EventBus,
) -> None:
    """With a vLLM config and background capture, the adapter gets the torch backend
    (thread-local captures), prepares each shape on its thread while the calls run eagerly,
    and then serves bitwise-equal replays, where vLLM's manager would have refused."""
    from omnitrace.graphs.backends.torch import TorchGraphBackend
    from omnitrace.integrations.base import Adapters

    torch.manual_seed(0)
    model = VisionEncoder(SMALL).cuda().eval()
    adapters = Adapters(CFG.replace(background_capture=True), bus=bus, vllm_config=_vllm_config())
    graph = adapters.make(model, name="vision")
    assert isinstance(graph.backend, TorchGraphBackend)
    x = torch.randn(1, 64, SMALL.hidden, device="cuda")
    with torch.no_grad(), capture_events(bus) as events:
        expected = model(x, None)
        for _ in range(3):  # warm-up, admission (handed to the thread), maybe still preparing
            assert torch.equal(graph(x, None), expected)
        assert graph.wait_prepared(60)
        outs = [graph(x, None) for _ in range(3)]
    assert all(torch.equal(out, expected) for out in outs)
    assert graph.num_graphs == 1
    kinds = [type(e).__name__ for e in events]
    assert kinds.count("GraphCaptured") == 1
    # The capturing call is a hit too, and may come before the loop's end if the thread is
    # quick: every call after the capture, and at least the last three, were replays.
    stats = graph.get_cumulative_stats()
    assert stats["graph_hits"] == kinds.count("GraphReplayed") >= 3
    assert stats["graph_hits"] + kinds.count("GraphMissed") == 6
    assert graph.close(10)


def test_prepared_shapes_compile_before_serving_and_later_shapes_capture_plain() -> None:
    """Through vLLM's manager with compile on: a shape prepared before serving is compiled
    and served by its graph from its first call; after ``stop_compiling`` a shape first seen
    while serving is captured from the eager forward (bitwise eager's result).

    In a process of its own: on the H200, the MiniCPM-o module tests run after it in the same
    process saw their captures invalidated (``cudaErrorStreamCaptureInvalidated``), and run
    before it they passed; that interaction is not understood yet, and a child keeps the
    other tests independent of it. Its failure fails this test.
    """
    import subprocess
    import sys
    from pathlib import Path

    child = Path(__file__).with_name("vllm_compile_prepare.py")
    done = subprocess.run(
        [sys.executable, str(child)], capture_output=True, text=True, timeout=600, check=False
    )
    print(done.stdout[-2000:])
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    assert "prepared compiled graph: max rel err" in done.stdout


class _LazilyCompiled(torch.nn.Module):
    """A projection, then an activation torch.compile builds on its first call, with dynamic
    shapes, as vLLM's custom ops compile their native forwards."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(SMALL.hidden, SMALL.hidden)
        self.act = torch.compile(lambda t: torch.nn.functional.gelu(t) * 1.5, dynamic=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.proj(x))


def test_code_compiled_inside_the_forward_recompiles_before_vllms_capture_not_in_it() -> None:
    """vLLM's manager captures in inference mode. Code torch.compile built inside the forward
    guards on inference tensors: the first call in that mode recompiles, and Inductor's
    autotuning synchronises the device, which is fatal inside a capture. The eager calls ran
    under no_grad; the capture still succeeds, because the forward ran once in the manager's
    mode before it, and its replays equal the eager forward."""
    torch.manual_seed(0)
    model = _LazilyCompiled().cuda().eval()
    backend = VllmGraphBackend(_vllm_config())
    graph = EncoderCudaGraph(model, name="vision", config=CFG, backend=backend)
    try:
        with torch.no_grad():
            for tokens in (48, 48, 48, 80, 80, 80):
                x = torch.randn(1, tokens, SMALL.hidden, device="cuda")
                assert torch.equal(graph(x), model(x))
    finally:
        torch._dynamo.reset()
    stats = graph.get_cumulative_stats()
    assert (stats["graph_hits"], stats["num_graphs"]) == (4, 2)


@pytest.mark.parametrize("backend_name", ["vllm", "torch"])
def test_a_capture_keeps_the_allocators_caches_and_measures_its_pool(
    bus: EventBus, backend_name: str
) -> None:
    """A capture on the request path frees none of the device or pinned-host memory the
    allocators hold cached (an engine's next steps would allocate it afresh), and its
    bytes_reserved is what its fresh pool took from the device."""
    from omnitrace.graphs.backends.torch import TorchGraphBackend

    torch.manual_seed(0)
    model = VisionEncoder(SMALL).cuda().eval()
    backend = VllmGraphBackend(_vllm_config()) if backend_name == "vllm" else TorchGraphBackend()
    graph = EncoderCudaGraph(model, name="vision", config=CFG, bus=bus, backend=backend)
    x = torch.randn(1, 128, SMALL.hidden, device="cuda")
    with torch.no_grad():
        graph(x, None)
        # 256 MiB of device memory and 64 MiB of pinned host memory, freed to the caches.
        del_me = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
        pinned = torch.empty(64 << 20, dtype=torch.uint8, pin_memory=True)
        del del_me, pinned
        torch.cuda.synchronize()
        reserved = torch.cuda.memory_reserved()
        host_frees = torch.cuda.host_memory_stats()["num_host_free"]
        with capture_events(bus) as events:
            out = graph(x, None)
        torch.cuda.synchronize()
        assert torch.equal(out, model(x, None))
    (captured,) = [e for e in events if isinstance(e, GraphCaptured)]
    grown = torch.cuda.memory_reserved() - reserved
    print(f"\n{backend_name}: pool {captured.bytes_reserved} B, reserved grew {grown} B")
    assert grown >= 0
    assert 0 < captured.bytes_reserved <= grown
    assert torch.cuda.host_memory_stats()["num_host_free"] == host_frees
