"""Probe: does a CUDA graph own the cuBLAS workspace its GEMMs use?

cuBLAS gives every (handle, stream) pair a workspace on the first GEMM on that stream,
allocated through PyTorch's caching allocator. This probe captures a graph of a small
Whisper-like encoder in two ways and inspects where that workspace lives:

* ``warm-capture-stream``: warm up on the capture stream, then capture on it (what omnitrace
  0.1's torch backend did, and what vLLM's encoder manager does with the current stream);
* ``warm-replay-stream``: warm up on the replay stream, capture on a stream that has never
  run eager work (what the backends do now).

For each it reports the live blocks the capture left in the default pool and in the graph's
pool, then frees every cuBLAS workspace the way ``torch.compile``'s CUDA-graph trees do
(``torch._C._cuda_clearCublasWorkspaces(); torch.cuda.empty_cache()``), fills the freed
memory with sentinel tensors, replays, and reports whether the replay still matches eager and
whether any sentinel changed. Each case runs in a child process, because an illegal memory
access poisons the CUDA context; a child that dies is reported with its error.

Usage (GPU): python3 -m benchmarks.probes.workspace [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from typing import Any

CASES = ("warm-capture-stream", "warm-replay-stream")


def _live_blocks(pool_filter: Any) -> list[int]:
    import torch

    sizes = []
    for segment in torch.cuda.memory_snapshot():
        if not pool_filter(tuple(segment.get("segment_pool_id", (0, 0)))):
            continue
        sizes.extend(b["size"] for b in segment["blocks"] if b["state"] == "active_allocated")
    return sorted(sizes)


def run_case(case: str) -> dict[str, Any]:
    """Capture one graph the way ``case`` says and check it after workspaces are freed."""
    import torch
    import torch.nn as nn

    torch.manual_seed(0)
    layers = []
    for _ in range(4):
        layers += [nn.Linear(1024, 4096), nn.GELU(approximate="tanh"), nn.Linear(4096, 1024)]
    enc = nn.Sequential(*layers).cuda().to(torch.bfloat16).eval()
    x = torch.randn(1, 50, 1024, device="cuda", dtype=torch.bfloat16)
    replay_stream = torch.cuda.current_stream()
    capture_stream = torch.cuda.Stream()
    pool = torch.cuda.graph_pool_handle()
    with torch.inference_mode():
        ref = enc(x)
        torch.cuda.synchronize()
        default_before = _live_blocks(lambda p: p == (0, 0))
        static_x = x.clone()
        if case == "warm-capture-stream":
            capture_stream.wait_stream(replay_stream)
            with torch.cuda.stream(capture_stream):
                enc(static_x)
            replay_stream.wait_stream(capture_stream)
        else:
            enc(static_x)
        static_y = torch.empty_like(ref)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool, stream=capture_stream):
            static_y.copy_(enc(static_x))
        torch.cuda.synchronize()
        default_after = _live_blocks(lambda p: p == (0, 0))
        graph_pool_live = _live_blocks(lambda p: p != (0, 0))
        new_default = list(default_after)
        for size in [*default_before, static_x.nbytes, static_y.nbytes]:
            if size in new_default:
                new_default.remove(size)
        rounded = [s for s in new_default if s >= 1 << 20]

        torch._C._cuda_clearCublasWorkspaces()
        torch.cuda.empty_cache()
        sentinels = [torch.full((8 << 20,), 7.0, device="cuda") for _ in range(64)]
        torch.cuda.synchronize()
        err = 0.0
        for _ in range(10):
            static_x.copy_(x)
            graph.replay()
            err = max(err, (static_y.float() - ref.float()).abs().max().item())
        torch.cuda.synchronize()
        intact = all(bool((t == 7.0).all()) for t in sentinels)
    return {
        "case": case,
        "live_default_pool_blocks_left_by_warmup_and_capture_MiB": [
            round(s / 2**20, 2) for s in rounded
        ],
        "live_graph_pool_blocks_MiB": [round(s / 2**20, 2) for s in graph_pool_live],
        "max_abs_err_after_workspaces_freed": err,
        "sentinels_intact": intact,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="write the results to this file")
    parser.add_argument("--case", choices=CASES, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.case:
        print("RESULT " + json.dumps(run_case(args.case)))
        return 0
    results = []
    for case in CASES:
        proc = subprocess.run(
            [sys.executable, __file__, "--case", case],
            capture_output=True,
            text=True,
            timeout=300,
            check=False,
        )
        lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
        if proc.returncode != 0 or not lines:
            error = (proc.stderr.strip().splitlines() or ["(no output)"])[-1]
            result = {"case": case, "crashed": True, "exit": proc.returncode, "error": error}
        else:
            result = json.loads(lines[-1][len("RESULT ") :])
        print(json.dumps(result))
        results.append(result)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as fh:
            json.dump(results, fh, indent=1)
    # The probe documents behaviour; its exit status says whether the fixed discipline holds.
    fixed = results[-1]
    ok = not fixed.get("crashed") and fixed.get("sentinels_intact") is True
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
