"""Replay a seeded stream of image and audio requests through fresh adapters on medium encoders
under each setting of ``max_graphs`` and ``min_capture_calls``: hit rate, latency, graph memory."""

from __future__ import annotations

import random
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from benchmarks.common import (
    Context,
    encoders,
    free_cuda_memory,
    geometry_fields,
    save_plot,
    summarize,
    target,
)
from benchmarks.table import Table, columns, mib, pct, us
from omnitrace import EncoderCudaGraph, EncoderGraphConfig, EventBus
from omnitrace.demo.encoders import AUDIO_TINY, VISION_TINY, EncoderGeometry
from omnitrace.testing import SimulatedGraphBackend

NAME = "traffic"
NEEDS_CUDA = True

VISION_MEDIUM = EncoderGeometry(hidden=768, layers=6, heads=12, mlp=3072)
AUDIO_MEDIUM = EncoderGeometry(hidden=512, layers=6, heads=8, mlp=2048)

#: Recurring image grids (slices incl. the thumbnail, tokens per slice), most popular first.
RECURRING_IMAGES = [(5, 1024), (1, 1024), (3, 1024), (7, 980), (2, 896), (10, 1024)]
#: Recurring clip lengths in seconds (the 1 s streaming-size chunk is drawn on its own).
RECURRING_CLIPS = [10, 30, 5]


@dataclass(frozen=True, slots=True)
class Request:
    """One encoder call of the stream; ``kind`` is ``recurring`` or ``one-off``."""

    encoder: str
    shape: tuple[int, ...]
    kind: str


def make_stream(n: int, seed: int, *, token_div: int = 1, frame_div: int = 1) -> list[Request]:
    """``n`` requests drawn from a fixed seed (sizes divided for small runs)."""
    rng = random.Random(seed)
    weights = [1.0 / (rank + 1) for rank in range(len(RECURRING_IMAGES))]
    out: list[Request] = []
    for _ in range(n):
        if rng.random() < 0.55:
            if rng.random() < 0.75:
                slices, tokens = rng.choices(RECURRING_IMAGES, weights)[0]
                kind = "recurring"
            else:
                slices = rng.randint(1, 6)
                tokens = 14 * rng.randint(14, 73)  # odd image sizes: 196..1022 tokens
                kind = "one-off"
            out.append(Request("vision", (slices, max(1, tokens // token_div)), kind))
        else:
            draw = rng.random()
            if draw < 0.5:
                seconds, kind = 1.0, "recurring"
            elif draw < 0.8:
                seconds, kind = float(rng.choice(RECURRING_CLIPS)), "recurring"
            else:
                seconds, kind = rng.randint(11, 299) / 10, "one-off"
            frames = max(4, round(seconds * 100) // frame_div)
            out.append(Request("audio", (1, 80, frames - frames % 2), kind))
    return out


def _settings(ctx: Context) -> list[tuple[int, int]]:
    full = [(0, 2)] + [(g, c) for g in (2, 4, 8) for c in (2, 3, 5)]
    return ctx.pick(full, [(0, 2), (4, 2), (4, 5), (8, 2)], [(0, 2), (2, 2)])


def run(ctx: Context) -> dict[str, Any]:
    """Replay the stream once per setting; return one row per setting."""
    device, dtype = ctx.device, ctx.dtype
    on_cuda = device.type == "cuda"
    seed = 20260415
    n = ctx.pick(1000, 300, 40)
    if ctx.simulate:
        stream = make_stream(n, seed, token_div=16, frame_div=10)
        geoms = {"vision": VISION_TINY, "audio": AUDIO_TINY}
    else:
        stream = make_stream(n, seed)
        geoms = {"vision": VISION_MEDIUM, "audio": AUDIO_MEDIUM}
    models = encoders(ctx, geoms)
    inputs: dict[tuple[str, tuple[int, ...]], torch.Tensor] = {}
    for req in stream:
        key = (req.encoder, req.shape)
        if key not in inputs:
            shape = req.shape + ((geoms["vision"].hidden,) if req.encoder == "vision" else ())
            inputs[key] = torch.randn(shape, device=device, dtype=dtype)
    sync = ctx.device_sync

    # Every shape once eagerly first, so one-time costs land on no setting.
    with torch.no_grad():
        for (encoder, _), x in inputs.items():
            models[encoder](x)
    sync()

    counts = Counter(r.encoder for r in stream)
    stream_info = {
        "seed": seed,
        "requests": len(stream),
        "vision_requests": counts["vision"],
        "audio_requests": counts["audio"],
        "one_off_requests": sum(r.kind == "one-off" for r in stream),
        "distinct_keys": len(inputs),
        "top_keys": [
            {"encoder": e, "shape": list(s), "calls": c}
            for (e, s), c in Counter((r.encoder, r.shape) for r in stream).most_common(10)
        ],
    }
    ctx.log(
        f"  stream: {len(stream)} requests, {len(inputs)} distinct shapes, "
        f"{stream_info['one_off_requests']} one-off"
    )

    rows: list[dict[str, Any]] = []
    for max_graphs, min_calls in _settings(ctx):
        rows.append(_replay(ctx, stream, models, inputs, max_graphs, min_calls, sync, on_cuda))
        r = rows[-1]
        ctx.log(
            f"  max_graphs={max_graphs} min_capture_calls={min_calls}: hit rate "
            f"{r['hit_rate'] * 100:.1f} %, mean {r['mean_latency_us']:,.0f} us, "
            f"{r['captures']} captures, {r['graph_bytes'] / (1 << 20):.1f} MiB"
        )
    eager_mean = next((r["mean_latency_us"] for r in rows if r["max_graphs"] == 0), None)
    for r in rows:
        r["vs_eager"] = r["mean_latency_us"] / eager_mean - 1 if eager_mean else None
    del models, inputs
    free_cuda_memory()
    default = next((r for r in rows if r["max_graphs"] == 4 and r["min_capture_calls"] == 2), None)
    return {
        "stream": stream_info,
        "geometries": {k: geometry_fields(g) for k, g in geoms.items()},
        "dtype": str(dtype).removeprefix("torch."),
        "rows": rows,
        "targets": [
            target(
                "default settings (4 graphs, 2 calls) faster than eager on this stream",
                None
                if default is None or default["vs_eager"] is None
                else default["vs_eager"] * 100,
                "<",
                0.0,
                "%",
                note="mean latency change vs max_graphs=0; captures included",
            )
        ],
        "simulated": ctx.simulate,
    }


def _replay(
    ctx: Context,
    stream: list[Request],
    models: dict[str, torch.nn.Module],
    inputs: dict[tuple[str, tuple[int, ...]], torch.Tensor],
    max_graphs: int,
    min_calls: int,
    sync: Any,
    on_cuda: bool,
) -> dict[str, Any]:
    free_cuda_memory()
    reserved_before = torch.cuda.memory_reserved() if on_cuda else 0
    config = EncoderGraphConfig(max_graphs=max_graphs, min_capture_calls=min_calls)
    bus = EventBus()
    adapters = {
        name: EncoderCudaGraph(model, name=name, config=config, bus=bus, backend=_backend(ctx))
        for name, model in models.items()
    }
    latencies: list[float] = []
    by_kind: dict[str, list[float]] = {"recurring": [], "one-off": []}
    perf = time.perf_counter
    with torch.no_grad():
        for req in stream:
            x = inputs[(req.encoder, req.shape)]
            sync()
            start = perf()
            adapters[req.encoder](x)
            sync()
            elapsed = perf() - start
            latencies.append(elapsed)
            by_kind[req.kind].append(elapsed)
    free_cuda_memory()
    reserved_after = torch.cuda.memory_reserved() if on_cuda else 0
    stats = {name: a.stats() for name, a in adapters.items()}
    bus_stats = bus.adapter_stats()
    bus.close()
    hits = sum(s.graph_hits for s in stats.values())
    calls = sum(s.calls for s in stats.values())
    graphs = [g for s in stats.values() for g in s.graphs]
    row = {
        "max_graphs": max_graphs,
        "min_capture_calls": min_calls,
        "calls": calls,
        "hits": hits,
        "hit_rate": hits / calls if calls else 0.0,
        "hit_rate_by_encoder": {name: s.hit_rate for name, s in stats.items()},
        "mean_latency_us": sum(latencies) / len(latencies) * 1e6,
        "latency_us": summarize(latencies),
        "latency_by_kind_us": {k: summarize(v) for k, v in by_kind.items() if v},
        "captures": len(graphs),
        "capture_seconds": sum(g.duration_s for g in graphs),
        "graph_bytes": sum(g.bytes_reserved + g.static_bytes for g in graphs),
        "pool_bytes": sum(g.bytes_reserved for g in graphs),
        "static_bytes": sum(g.static_bytes for g in graphs),
        "reserved_delta_bytes": (reserved_after - reserved_before) if on_cuda else None,
        "warmup_misses": sum(s.warmup_misses for s in stats.values()),
        "capacity_misses": sum(s.capacity_misses for s in stats.values()),
        "memory_misses": sum(s.memory_misses for s in stats.values()),
        "ineligible_misses": sum(s.ineligible_misses for s in stats.values()),
        "stats_agree_with_bus": all(
            bus_stats[name].as_dict() == s.as_dict()
            for name, s in stats.items()
            if name in bus_stats
        ),
        "captured_keys": {name: list(a.captured_keys()) for name, a in adapters.items()},
    }
    del adapters
    return row


def _backend(ctx: Context) -> SimulatedGraphBackend | None:
    return SimulatedGraphBackend() if ctx.simulate else None


def plot(result: dict[str, Any], out_dir: Path, plt: Any) -> list[Path]:
    """Draw hit rate and mean latency against max_graphs, one line per min_capture_calls."""
    rows = result["rows"]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    eager = next((r for r in rows if r["max_graphs"] == 0), None)
    for calls in sorted({r["min_capture_calls"] for r in rows if r["max_graphs"]}):
        pts = sorted(
            (r["max_graphs"], r)
            for r in rows
            if r["max_graphs"] and r["min_capture_calls"] == calls
        )
        if eager is not None:
            pts = [(0, eager), *pts]
        for ax, values in (
            (ax1, [p[1]["hit_rate"] * 100 for p in pts]),
            (ax2, [p[1]["mean_latency_us"] for p in pts]),
        ):
            ax.plot([p[0] for p in pts], values, marker="o", label=f"min_capture_calls={calls}")
    for ax, ylabel, title in (
        (ax1, "hit rate, %", "Graph coverage of the stream"),
        (ax2, "mean latency per request, us", "Mean latency (captures included)"),
    ):
        ax.set(xlabel="max_graphs", ylabel=ylabel, title=title)
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
    return [save_plot(plt, fig, out_dir / "traffic.png")]


def tables(result: dict[str, Any]) -> list[Table]:
    t = columns(
        "Traffic replay: admission settings",
        [
            ("max_graphs", lambda r: str(r["max_graphs"])),
            (
                "min_capture_calls",
                lambda r: str(r["min_capture_calls"]) if r["max_graphs"] else "-",
            ),
            ("hit rate", lambda r: f"{r['hit_rate'] * 100:.1f} %"),
            ("mean latency us", lambda r: us(r["mean_latency_us"], 0)),
            ("vs eager", lambda r: pct(r.get("vs_eager"))),
            ("captures", lambda r: str(r["captures"])),
            ("graph MiB (events)", lambda r: mib(r["graph_bytes"])),
            ("reserved delta MiB", lambda r: mib(r.get("reserved_delta_bytes"))),
            (
                "misses w/c/m",
                lambda r: "/".join(str(r[f"{k}_misses"]) for k in ("warmup", "capacity", "memory")),
            ),
        ],
        result["rows"],
    )
    stream = result["stream"]
    t.note = (
        f"{stream['requests']} requests ({stream['vision_requests']} image, "
        f"{stream['audio_requests']} audio), {stream['distinct_keys']} distinct shapes, "
        f"seed {stream['seed']}. Graph MiB: bytes_reserved + static_bytes of GraphCaptured events."
    )
    return [t]
