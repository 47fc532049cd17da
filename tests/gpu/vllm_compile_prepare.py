"""The child process of test_vllm_backend.py's compile-and-prepare test: a shape prepared
before serving through vLLM's manager with compile on, then a plain capture after
``stop_compiling``. Exits non-zero (a failed assertion) when anything differs."""

from __future__ import annotations

import os

os.environ.setdefault("VLLM_TARGET_DEVICE", "cuda")

import torch

from omnitrace import EncoderCudaGraph, EncoderGraphConfig, EventBus
from omnitrace.demo.encoders import AudioEncoder, EncoderGeometry
from omnitrace.graphs.backends.vllm import VllmGraphBackend
from omnitrace.signature import Signature
from omnitrace.testing import capture_events

SMALL = EncoderGeometry(hidden=256, layers=4, heads=4, mlp=1024)
#: tests/gpu/test_adapter_options_cuda.py's COMPILED_TOL.
COMPILED_TOL = 6e-2


def main() -> None:
    from vllm.config import VllmConfig

    torch.manual_seed(0)
    model = AudioEncoder(SMALL).to("cuda", torch.bfloat16).eval()
    bus = EventBus()
    config = EncoderGraphConfig(min_free_bytes=0, compile=True)
    graph = EncoderCudaGraph(model, name="audio", config=config, bus=bus, vllm_config=VllmConfig())
    assert isinstance(graph.backend, VllmGraphBackend)
    recorded = Signature.parse("bfloat16[1,80,100] @cuda:0 s=7")
    mel = torch.randn(1, 80, 100, device="cuda", dtype=torch.bfloat16)
    other = torch.randn(1, 80, 60, device="cuda", dtype=torch.bfloat16)
    with torch.inference_mode(), capture_events(bus) as events:
        assert graph.prepare(recorded, torch.device("cuda")) == "captured"
        assert graph.prepare(recorded, torch.device("cuda")) == "held"
        graph.stop_compiling()
        prepared = graph(mel)
        reference = model(mel)
        plain = [graph(other) for _ in range(3)]
        eager = model(other)
    kinds = [type(e).__name__ for e in events]
    assert kinds == [
        "GraphCaptured",  # prepared: compiled and captured, no call counted
        "GraphReplayed",  # its first call
        "GraphMissed",  # the new shape's warm-up
        "GraphCaptured",
        "GraphReplayed",
        "GraphReplayed",
    ], kinds
    scale = reference.float().abs().max()
    error = float((prepared.float() - reference.float()).abs().max() / scale)
    print(f"prepared compiled graph: max rel err vs eager {error:.2e}")
    assert error <= COMPILED_TOL, error
    assert all(torch.equal(out, eager) for out in plain)
    assert graph.num_graphs == 2
    bus.close()


if __name__ == "__main__":
    main()
