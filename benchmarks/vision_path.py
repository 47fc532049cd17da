"""MiniCPM-o's vision call three ways in one process: eager, the tower graphed, the whole path.

vLLM's own modules at MiniCPM-o 4.5's released sizes (random bf16 weights): the SigLIP tower
``Idefics2VisionTransformer`` (27 layers, hidden 1152) and ``Resampler4_5`` (64 queries,
4096 wide), called through vLLM's ``MiniCPMV4_5.get_vision_hidden_states`` on the slices
MiniCPM-o's processor makes of the benchmark's images. Three models with the same weights:

* ``eager``: vLLM's method, no graph;
* ``tower``: omnitrace's SigLIP-stack adapter on ``vpm.encoder`` (what served MiniCPM-o
  before the whole path);
* ``path``: the whole-path adapter (:mod:`omnitrace.integrations.minicpmo_vision`).

Rounds alternate the three, so a slow phase of the machine hits them alike. Reported per
image kind: wall time per call with the device synchronised (p50, p99), device time from
CUDA events (p50), and host time to return (p50), plus the saving of each graph against
eager and of the whole path against the tower. Every call's output is checked against
eager's, bit for bit.

    python -m benchmarks.vision_path --out bench-results/vision_path

Needs CUDA and vLLM (``vllm.model_executor.models.minicpmv``).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import socket
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
from torch import nn

from benchmarks.common import quantile

PATCH = 14
SCALE = 448
MAX_SLICES = 9
#: The engine benchmark's image kinds: (width, height).
KINDS: dict[str, tuple[int, int]] = {
    "image 448x448": (448, 448),
    "image 896x896": (896, 896),
    "image 1344x896": (1344, 896),
}
MODES = ("eager", "tower", "path")


def _fit(width: float, height: float) -> tuple[int, int]:
    """Resize to about SCALE x SCALE keeping the aspect ratio, in whole patches (rows, cols)."""
    ratio = width / height
    h = SCALE / math.sqrt(ratio)
    w = h * ratio
    return max(1, round(h / PATCH)), max(1, round(w / PATCH))


def _grid(width: int, height: int) -> tuple[int, int]:
    """The slice grid (cols, rows) whose aspect ratio is closest to the image's."""
    multiple = min(math.ceil(width * height / SCALE**2), MAX_SLICES)
    log_ratio = math.log(width / height)
    candidates = [
        (cols, n // cols)
        for n in (multiple - 1, multiple, multiple + 1)
        if 1 < n <= MAX_SLICES
        for cols in range(1, n + 1)
        if n % cols == 0
    ]
    return min(candidates, key=lambda g: abs(log_ratio - math.log(g[0] / g[1])))


def slice_sizes(width: int, height: int) -> list[tuple[int, int]]:
    """Target sizes (patch rows, patch cols) of an image's overview and its slices."""
    sizes = [_fit(width, height)]
    if width * height > SCALE * SCALE:
        cols, rows = _grid(width, height)
        sizes += [_fit(width / cols, height / rows)] * (cols * rows)
    return sizes


def vision_batch(
    images: list[tuple[int, int]], device: torch.device, dtype: torch.dtype, seed: int
) -> dict[str, Any]:
    """vLLM's pixel inputs for ``images`` (width, height): flattened slices and tgt_sizes."""
    g = torch.Generator().manual_seed(seed)
    pixels, sizes = [], []
    for width, height in images:
        for rows, cols in slice_sizes(width, height):
            pixels.append(torch.randn(3, PATCH, rows * cols * PATCH, generator=g))
            sizes.append((rows, cols))
    return {
        "type": "pixel_values",
        "pixel_values": [p.to(device, dtype) for p in pixels],
        "tgt_sizes": torch.tensor(sizes, dtype=torch.int32, device=device),
    }


@contextmanager
def vllm_context() -> Iterator[Any]:
    """vLLM's config context and a one-process model-parallel group, as its loader has.

    Yields:
        The ``VllmConfig`` in force.
    """
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.distributed import parallel_state

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    config = VllmConfig()
    with set_current_vllm_config(config):
        parallel_state.init_distributed_environment(
            world_size=1,
            rank=0,
            local_rank=0,
            distributed_init_method=f"tcp://127.0.0.1:{port}",
            backend="gloo",
        )
        parallel_state.initialize_model_parallel(1, 1)
        try:
            yield config
        finally:
            parallel_state.destroy_model_parallel()
            parallel_state.destroy_distributed_environment()


def build(device: torch.device, dtype: torch.dtype, layers: int) -> nn.Module:
    """vLLM's MiniCPM-o 4.5 vision modules on a host object, with seeded random weights."""
    from transformers.models.idefics2.configuration_idefics2 import Idefics2VisionConfig
    from vllm.model_executor.models.idefics2_vision_model import Idefics2VisionTransformer
    from vllm.model_executor.models.minicpmv import MiniCPMV4_5, Resampler4_5
    from vllm.utils.torch_utils import set_default_torch_dtype

    class Host(nn.Module):
        get_vision_hidden_states = MiniCPMV4_5.get_vision_hidden_states

        def __init__(self) -> None:
            super().__init__()
            vision = Idefics2VisionConfig(
                hidden_size=1152,
                intermediate_size=4304,
                num_hidden_layers=layers,
                num_attention_heads=16,
                image_size=980,
                patch_size=PATCH,
            )
            self.vpm = Idefics2VisionTransformer(
                vision, apply_encoder_attention_mask=True, prefix="vpm"
            )
            self.resampler = Resampler4_5(
                num_queries=64, embed_dim=4096, num_heads=32, kv_dim=1152, prefix="resampler"
            )
            self.config = SimpleNamespace(
                encoder_cuda_graph_max_graphs=16, encoder_cuda_graph_min_free_bytes=0
            )

    torch.manual_seed(0)
    with set_default_torch_dtype(dtype), device:
        host = Host()
    with torch.no_grad():
        for parameter in host.parameters():
            parameter.normal_(0.0, 0.02)
    # The resampler's positional table stays on the CPU, as in vLLM's engine (0.26 moves it
    # inside the compiled language model's forward).
    return host.eval()


def _instrumented(device: torch.device, dtype: torch.dtype, layers: int, mode: str) -> Any:
    """A model of ``mode``, and the callable that serves one vision call of it."""
    from omnitrace.integrations import minicpmo, minicpmo_vision

    model = build(device, dtype, layers)
    if mode == "eager":
        return model.get_vision_hidden_states
    original = minicpmo_vision.supports_path
    if mode == "tower":
        minicpmo_vision.supports_path = lambda m: "tower only"  # type: ignore[assignment]
    try:
        result = minicpmo.instrument(model, bus=None)
    finally:
        minicpmo_vision.supports_path = original  # type: ignore[assignment]
    assert (result.vision_path is not None) == (mode == "path"), result
    return model.get_vision_hidden_states


def _time(call: Callable[[], Any], device: torch.device) -> tuple[float, float, float, Any]:
    """Wall (synchronised), device (CUDA events) and host-return seconds of one call."""
    start_event = torch.cuda.Event(enable_timing=True)
    end_event = torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize(device)
    start_event.record()
    start = time.perf_counter()
    out = call()
    returned = time.perf_counter()
    end_event.record()
    torch.cuda.synchronize(device)
    wall = time.perf_counter() - start
    return wall, start_event.elapsed_time(end_event) / 1e3, returned - start, out


def measure(rounds: int, per_round: int, layers: int) -> dict[str, Any]:
    """Every kind, the three modes alternating per round; times in milliseconds."""
    device, dtype = torch.device("cuda"), torch.bfloat16
    calls = {mode: _instrumented(device, dtype, layers, mode) for mode in MODES}
    result: dict[str, Any] = {"layers": layers, "rounds": rounds, "per_round": per_round}
    kinds: dict[str, Any] = {}
    with torch.no_grad():
        for kind, size in KINDS.items():
            data = vision_batch([size], device, dtype, seed=0)
            want = calls["eager"](data)
            for mode in MODES:  # warm-up miss, capture, a first replay
                for _ in range(3):
                    got = calls[mode](data)
                    if not torch.equal(got, want):
                        raise AssertionError(f"{kind}: {mode} differs from eager")
            samples: dict[str, dict[str, list[float]]] = {
                m: {"wall": [], "device": [], "host": []} for m in MODES
            }
            for r in range(rounds):
                order = MODES[r % 3 :] + MODES[: r % 3]
                for mode in order:
                    for _ in range(per_round):
                        wall, dev, host, out = _time(lambda m=mode, d=data: calls[m](d), device)
                        if not torch.equal(out, want):
                            raise AssertionError(f"{kind}: {mode} differs from eager")
                        samples[mode]["wall"].append(wall * 1e3)
                        samples[mode]["device"].append(dev * 1e3)
                        samples[mode]["host"].append(host * 1e3)
            row: dict[str, Any] = {"slices": len(data["pixel_values"])}
            for mode in MODES:
                s = samples[mode]
                row[mode] = {
                    "wall_p50": statistics.median(s["wall"]),
                    "wall_p99": quantile(sorted(s["wall"]), 0.99),
                    "device_p50": statistics.median(s["device"]),
                    "host_p50": statistics.median(s["host"]),
                    "n": len(s["wall"]),
                }
            kinds[kind] = row
    result["kinds"] = kinds
    return result


def table(result: dict[str, Any]) -> str:
    """The markdown table of :func:`measure`'s result."""
    lines = [
        "| kind | slices | eager wall p50 / p99 | tower graph | whole path | path vs eager | "
        "path vs tower | device p50 eager / tower / path | host p50 eager / tower / path |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for kind, row in result["kinds"].items():
        e, t, p = row["eager"], row["tower"], row["path"]
        lines.append(
            f"| {kind} | {row['slices']} | {e['wall_p50']:.2f} / {e['wall_p99']:.2f} ms | "
            f"{t['wall_p50']:.2f} / {t['wall_p99']:.2f} | {p['wall_p50']:.2f} / "
            f"{p['wall_p99']:.2f} | {100 * (p['wall_p50'] / e['wall_p50'] - 1):+.1f} % | "
            f"{p['wall_p50'] - t['wall_p50']:+.2f} ms | {e['device_p50']:.2f} / "
            f"{t['device_p50']:.2f} / {p['device_p50']:.2f} | {e['host_p50']:.2f} / "
            f"{t['host_p50']:.2f} / {p['host_p50']:.2f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.vision_path", description=__doc__)
    parser.add_argument("--rounds", type=int, default=6, help="alternations (default 6)")
    parser.add_argument("--per-round", type=int, default=10, help="calls a round (default 10)")
    parser.add_argument("--layers", type=int, default=27, help="SigLIP layers (default 27)")
    parser.add_argument("--out", type=Path, default=Path("bench-results/vision_path"))
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("benchmarks.vision_path: needs a CUDA device", file=sys.stderr)
        return 2
    os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
    with vllm_context():
        result = measure(args.rounds, args.per_round, args.layers)
    result["device"] = torch.cuda.get_device_name()
    result["torch"] = torch.__version__
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "vision_path.json").write_text(json.dumps(result, indent=2) + "\n")
    print(table(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
