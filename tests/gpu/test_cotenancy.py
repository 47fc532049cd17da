"""Encoder graphs beside other CUDA-graph users in one process, on a real device.

A serving process also runs vLLM's language-model graphs and user code compiled with
``torch.compile(mode="reduce-overhead")``, whose CUDA-graph trees free every cuBLAS
workspace around each recording. A graph that touched a workspace it did not own would then
read unmapped memory (an illegal memory access) or, worse, write into whatever tensor the
allocator put there since. Each scenario runs in a child process because an illegal memory
access poisons the CUDA context for every later test; a child that dies fails its test with
its output, it is never skipped.

Every scenario holds ten adapters of one encoder: five sharing pools and five with separate
pools, spread over three replay streams, each with two captured shapes.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import textwrap
from typing import Any

import pytest

pytestmark = pytest.mark.gpu

SCENARIO = textwrap.dedent(
    """
    import json, sys
    import torch
    import torch.nn as nn
    import torch.nn.functional as F
    from omnitrace import EncoderCudaGraph, EncoderGraphConfig, EventBus, GraphCaptured
    from omnitrace.testing import capture_events

    backend_name, scenario = sys.argv[1], sys.argv[2]


    class Block(nn.Module):
        # One Whisper-medium encoder layer: the GEMM shapes that used cuBLAS workspaces.
        def __init__(self, d=1024, h=16, m=4096):
            super().__init__()
            self.h = h
            self.ln1, self.qkv, self.o = nn.LayerNorm(d), nn.Linear(d, 3 * d), nn.Linear(d, d)
            self.ln2, self.fc1, self.fc2 = nn.LayerNorm(d), nn.Linear(d, m), nn.Linear(m, d)

        def forward(self, x):
            b, s, d = x.shape
            qkv = self.qkv(self.ln1(x)).view(b, s, 3, self.h, d // self.h)
            q, k, v = qkv.permute(2, 0, 3, 1, 4)
            a = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, s, d)
            x = x + self.o(a)
            return x + self.fc2(F.gelu(self.fc1(self.ln2(x)), approximate="tanh"))


    def make_backend():
        if backend_name == "torch":
            return None
        from vllm.config import VllmConfig
        from omnitrace.graphs.backends.vllm import VllmGraphBackend
        return VllmGraphBackend(VllmConfig())


    torch.manual_seed(0)
    enc = nn.Sequential(*[Block() for _ in range(4)]).cuda().to(torch.bfloat16).eval()
    shapes = [(1, 50, 1024), (1, 100, 1024)]
    xs = [torch.randn(s, device="cuda", dtype=torch.bfloat16) for s in shapes]
    streams = [torch.cuda.current_stream(), torch.cuda.Stream(), torch.cuda.Stream()]
    adapters = []
    bus = EventBus()
    for share in (True, False):
        config = EncoderGraphConfig(min_free_bytes=0, share_pools=share)
        for i in range(5):
            graph = EncoderCudaGraph(
                enc, name=f"{'shared' if share else 'separate'}-{i}", config=config,
                bus=bus, backend=make_backend(),
            )
            adapters.append((graph, streams[i % len(streams)]))

    result = {"backend": backend_name, "scenario": scenario, "max_err": 0.0, "replays": 0}
    with torch.inference_mode():
        refs = [enc(x) for x in xs]

        def call_all():
            for graph, stream in adapters:
                stream.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(stream):
                    for x, ref in zip(xs, refs):
                        err = (graph(x).float() - ref.float()).abs().max().item()
                        result["max_err"] = max(result["max_err"], err)
                torch.cuda.current_stream().wait_stream(stream)

        with capture_events(bus) as events:
            for _ in range(3):
                call_all()  # warm-up miss, capture, hit for every adapter, stream and shape
        torch.cuda.synchronize()
        result["graphs"] = sum(graph.num_graphs for graph, _ in adapters)
        captured = [e for e in events if isinstance(e, GraphCaptured)]
        for kind in ("shared", "separate"):
            result[f"{kind}_pools"] = len(
                {e.pool_id for e in captured if e.adapter.startswith(kind)}
            )

        if scenario == "reduce_overhead":
            compiled = torch.compile(enc, mode="reduce-overhead", dynamic=False)
            for _ in range(3):
                compiled(xs[0])  # cudagraph-trees warm-up and recording
            torch.cuda.synchronize()
            result["compiled_err"] = 0.0
            for _ in range(10):
                call_all()
                out = compiled(xs[0])
                err = (out.float() - refs[0].float()).abs().max().item()
                result["compiled_err"] = max(result["compiled_err"], err)
        else:
            # What the CUDA-graph trees do around a recording, then fresh allocations that
            # reuse whatever was freed: a graph writing to memory it does not own shows up
            # as changed sentinels.
            torch._C._cuda_clearCublasWorkspaces()
            torch.cuda.empty_cache()
            sentinels = [
                torch.full((8 << 20,), 7.0, device="cuda") for _ in range(64)
            ]  # 64 x 32 MiB
            torch.cuda.synchronize()
            for _ in range(10):
                call_all()
            torch.cuda.synchronize()
            result["sentinels_intact"] = all(bool((t == 7.0).all()) for t in sentinels)
        torch.cuda.synchronize()
        result["replays"] = sum(g.get_cumulative_stats()["graph_hits"] for g, _ in adapters)
    bus.close()
    print("RESULT " + json.dumps(result))
    """
)

_HAS_VLLM = importlib.util.find_spec("vllm") is not None


def _run(backend: str, scenario: str) -> dict[str, Any]:
    proc = subprocess.run(
        [sys.executable, "-c", SCENARIO, backend, scenario],
        capture_output=True,
        text=True,
        timeout=540,
        check=False,
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    report = (
        f"the {backend}/{scenario} child exited with {proc.returncode}:\n"
        f"{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    )
    assert proc.returncode == 0, report
    assert lines, report
    result: dict[str, Any] = json.loads(lines[-1][len("RESULT ") :])
    print("\n" + json.dumps(result))
    return result


BACKENDS = [
    "torch",
    pytest.param(
        "vllm",
        marks=[
            pytest.mark.vllm,
            pytest.mark.skipif(not _HAS_VLLM, reason="vLLM is not installed"),
        ],
    ),
]


@pytest.mark.parametrize("backend", BACKENDS)
def test_ten_adapters_beside_reduce_overhead_replay_like_eager(backend: str) -> None:
    """Ten adapters on three replay streams match eager beside a reduce-overhead model."""
    result = _run(backend, "reduce_overhead")
    assert result["graphs"] == 20
    # Each sharing adapter uses one replay stream: one pool for its two graphs.
    assert (result["shared_pools"], result["separate_pools"]) == (5, 10)
    assert result["replays"] == 10 * 2 * (1 + 1 + 10)
    # bf16 noise at most: a replay runs eager's kernels on the same inputs.
    assert result["max_err"] <= 1e-2
    # Inductor fuses differently, so the compiled model is only held to a loose bound.
    assert result["compiled_err"] < 0.5


@pytest.mark.parametrize("backend", BACKENDS)
def test_graphs_own_their_workspaces_after_they_are_freed_and_reused(backend: str) -> None:
    """With cuBLAS workspaces freed and their memory reused, replays match and write nowhere."""
    result = _run(backend, "cleared_workspaces")
    assert result["graphs"] == 20
    assert (result["shared_pools"], result["separate_pools"]) == (5, 10)
    assert result["sentinels_intact"] is True
    assert result["replays"] == 10 * 2 * (1 + 1 + 10)
    assert result["max_err"] <= 1e-2
