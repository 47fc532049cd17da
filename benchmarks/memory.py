"""Device memory held by captured graphs, shared against separate pools, and the free floor.

* ``rows``: N graphs (1, 2, 4, 8) of a 4-layer d=256 encoder, ``share_pools`` on and off:
  memory held after the captures (``memory_reserved()`` growth once ``empty_cache()`` has
  returned what is free), the peak while capturing (``max_memory_reserved()``), and what
  the GraphCaptured events report. The design note expects about 34 MiB shared against
  142 MiB separate for four graphs on an H200.
* ``floor``: with device memory made tight by a ballast allocation, a floor above the free
  memory turns every due capture into a memory miss; a floor below it lets the key capture.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from benchmarks.common import Context, GiB, MiB, free_cuda_memory, save_plot, target
from benchmarks.table import Table, mib, times
from omnitrace import EncoderCudaGraph, EncoderGraphConfig, EventBus
from omnitrace.demo.encoders import EncoderGeometry, VisionEncoder
from omnitrace.testing import SimulatedGraphBackend, capture_events

NAME = "memory"
NEEDS_CUDA = True

SMALL = EncoderGeometry(hidden=256, layers=4, heads=4, mlp=1024)
#: Free memory left beside the ballast in the floor experiment.
TIGHT_FREE_BYTES = 3 * GiB


def _clear_cublas_workspaces() -> None:
    # cuBLAS keeps one workspace per (handle, stream) for the life of the process; clearing
    # them before each measurement makes every configuration pay for its own streams.
    clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
    if clear is not None:
        clear()


def _reserved(on_cuda: bool) -> int:
    return int(torch.cuda.memory_reserved()) if on_cuda else 0


def run(ctx: Context) -> dict[str, Any]:
    """Measure graph memory by count and pool sharing, then the memory floor."""
    device = ctx.device
    on_cuda = device.type == "cuda"
    dtype = ctx.dtype
    geometry = SMALL
    with torch.device(device):
        model = VisionEncoder(geometry).to(dtype).eval()
    counts = ctx.pick((1, 2, 4, 8), (1, 4), (1, 2))
    # Shapes step down 16 tokens per graph: a simulated run still needs room for all of them.
    tokens = ctx.pick(1024, 1024, 64) if not ctx.simulate else max(64, 16 * (max(counts) + 1))
    shapes = [(1, tokens - 16 * i, geometry.hidden) for i in range(max(counts))]
    inputs = [torch.randn(s, device=device, dtype=dtype) for s in shapes]
    sync = ctx.device_sync
    with torch.no_grad():
        for x in inputs:
            model(x)
    sync()

    rows: list[dict[str, Any]] = []
    for share in (True, False):
        for n in counts:
            rows.append(_held(ctx, model, inputs[:n], share, on_cuda))
            r = rows[-1]
            ctx.log(
                f"  {n} graph(s), share_pools={share}: held {r['held_bytes'] / MiB:.1f} MiB, "
                f"capture peak {r['peak_bytes'] / MiB:.1f} MiB, "
                f"{r['pools']} pool(s)"
            )
    floor = _floor(ctx, model, inputs[0], on_cuda)
    del model, inputs
    free_cuda_memory()

    by = {(r["graphs"], r["share_pools"]): r for r in rows}
    n_cmp = 4 if (4, True) in by else max(counts)
    shared, separate = by[(n_cmp, True)], by[(n_cmp, False)]
    ratio = separate["held_bytes"] / shared["held_bytes"] if shared["held_bytes"] > 0 else None
    targets = [
        target(
            f"separate pools hold more than shared ({n_cmp} graphs), ratio",
            ratio,
            ">",
            1.0,
            "x",
            note="design note: about 142 / 34 MiB = 4.2x on an H200",
        ),
        target(
            "memory floor above free memory defers every due capture (graphs captured)",
            float(floor["rows"][0]["num_graphs"]) if floor.get("rows") else None,
            "<=",
            0.0,
            "graphs",
        ),
    ]
    return {
        "encoder": f"VisionEncoder(hidden={geometry.hidden}, layers={geometry.layers}), "
        f"{str(dtype).removeprefix('torch.')}, inputs (1, {tokens}-16i, {geometry.hidden})",
        "shapes": [list(s) for s in shapes],
        "rows": rows,
        "floor": floor,
        "targets": targets,
        "simulated": ctx.simulate,
    }


def _held(
    ctx: Context,
    model: torch.nn.Module,
    inputs: list[torch.Tensor],
    share: bool,
    on_cuda: bool,
) -> dict[str, Any]:
    if on_cuda:
        _clear_cublas_workspaces()
        with torch.no_grad():
            model(inputs[0])  # the replay stream's own workspace is not the graphs' cost
        free_cuda_memory()
        torch.cuda.reset_peak_memory_stats()
    base = _reserved(on_cuda)
    base_alloc = int(torch.cuda.memory_allocated()) if on_cuda else 0
    config = EncoderGraphConfig(max_graphs=8, min_free_bytes=0, share_pools=share)
    adapter = EncoderCudaGraph(
        model,
        name=f"mem-{len(inputs)}-{'shared' if share else 'separate'}",
        config=config,
        backend=SimulatedGraphBackend() if ctx.simulate else None,
    )
    with torch.no_grad():
        for x in inputs:
            for _ in range(config.min_capture_calls):
                adapter(x)
    if on_cuda:
        torch.cuda.synchronize()
        peak = int(torch.cuda.max_memory_reserved()) - base
        free_cuda_memory()
    else:
        peak = 0
    held = _reserved(on_cuda) - base
    allocated = (int(torch.cuda.memory_allocated()) - base_alloc) if on_cuda else 0
    stats = adapter.stats()
    row = {
        "graphs": len(inputs),
        "share_pools": share,
        "captured": stats.num_graphs,
        "held_bytes": held,
        "allocated_bytes": allocated,
        "peak_bytes": peak,
        "event_pool_bytes": sum(g.bytes_reserved for g in stats.graphs),
        "event_static_bytes": sum(g.static_bytes for g in stats.graphs),
        "pools": len({g.pool_id for g in stats.graphs}),
        "capture_streams": len({g.stream for g in stats.graphs}),
        "capture_seconds": [g.duration_s for g in stats.graphs],
    }
    del adapter, stats
    free_cuda_memory()
    row["left_after_release_bytes"] = _reserved(on_cuda) - base
    return row


def _floor(ctx: Context, model: torch.nn.Module, x: torch.Tensor, on_cuda: bool) -> dict[str, Any]:
    """Make memory tight, then run one key under a high floor and under a low floor."""
    calls = 6
    ballast: torch.Tensor | None = None
    note = ""
    if on_cuda:
        free_cuda_memory()
        free = int(torch.cuda.mem_get_info()[0])
        if free > TIGHT_FREE_BYTES + GiB:
            try:
                ballast = torch.empty(free - TIGHT_FREE_BYTES, dtype=torch.uint8, device="cuda")
                note = f"ballast of {ballast.numel() / GiB:.1f} GiB left about 3 GiB free"
            except torch.cuda.OutOfMemoryError:
                note = "ballast allocation failed; floors set around the free memory instead"
        free_now = int(torch.cuda.mem_get_info()[0])
    else:
        free_now = 2 * GiB
        note = "simulated backend reporting 2 GiB free"
    high = free_now + GiB
    low = max(0, free_now - 2 * GiB) if free_now > 2 * GiB else free_now // 2
    rows = []
    try:
        for label, floor_bytes in (("above free memory", high), ("below free memory", low)):
            backend = SimulatedGraphBackend(free_bytes=free_now) if ctx.simulate else None
            bus = EventBus()
            adapter = EncoderCudaGraph(
                model,
                name=f"floor-{'high' if floor_bytes == high else 'low'}",
                config=EncoderGraphConfig(max_graphs=4, min_free_bytes=floor_bytes),
                bus=bus,
                backend=backend,
            )
            with capture_events(bus) as events, torch.no_grad():
                for _ in range(calls):
                    adapter(x)
            stats = adapter.stats()
            bus.close()
            rows.append(
                {
                    "label": label,
                    "floor_bytes": floor_bytes,
                    "free_bytes": stats.last_free_bytes
                    if stats.last_free_bytes is not None
                    else free_now,
                    "calls": calls,
                    "memory_misses": stats.memory_misses,
                    "memory_deferrals": stats.memory_deferrals,
                    "warmup_misses": stats.warmup_misses,
                    "num_graphs": stats.num_graphs,
                    "graph_hits": stats.graph_hits,
                    "events": [type(e).__name__ for e in events],
                }
            )
            ctx.log(
                f"  floor {label} ({floor_bytes / GiB:.2f} GiB, free {free_now / GiB:.2f} GiB): "
                f"{stats.memory_misses} memory misses, {stats.num_graphs} graph(s), "
                f"{stats.graph_hits} hits"
            )
            del adapter
    finally:
        del ballast
        free_cuda_memory()
    return {"rows": rows, "note": note, "free_bytes_at_start": free_now}


def plot(result: dict[str, Any], out_dir: Path, plt: Any) -> list[Path]:
    """Draw memory held against graph count, shared and separate pools."""
    rows = result["rows"]
    fig, ax = plt.subplots(figsize=(6.5, 4))
    for share, color in ((True, "tab:blue"), (False, "tab:orange")):
        pts = sorted((r["graphs"], r) for r in rows if r["share_pools"] is share)
        label = "shared pools" if share else "separate pools"
        ax.plot(
            [p[0] for p in pts],
            [p[1]["held_bytes"] / MiB for p in pts],
            marker="o",
            color=color,
            label=f"{label}, held",
        )
        ax.plot(
            [p[0] for p in pts],
            [p[1]["peak_bytes"] / MiB for p in pts],
            marker="x",
            linestyle="--",
            color=color,
            label=f"{label}, capture peak",
        )
    ax.set_xlabel("graphs captured")
    ax.set_ylabel("MiB")
    ax.set_title("Device memory of graphs (4-layer, d=256)")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    return [save_plot(plt, fig, out_dir / "memory.png")]


# -- tables for BENCHMARKS.md -----------------------------------------------------------


def tables(result: dict[str, Any]) -> list[Table]:
    t = Table(
        f"Device memory held by N graphs ({result['encoder']})",
        [
            "graphs",
            "shared pools MiB",
            "separate pools MiB",
            "saved",
            "capture peak shared",
            "capture peak separate",
        ],
    )
    by = {(r["graphs"], r["share_pools"]): r for r in result["rows"]}
    for n in sorted({r["graphs"] for r in result["rows"]}):
        shared, separate = by.get((n, True)), by.get((n, False))
        held_s = shared["held_bytes"] if shared else None
        held_p = separate["held_bytes"] if separate else None
        t.rows.append(
            [
                str(n),
                mib(held_s),
                mib(held_p),
                times(held_p / held_s) if held_s and held_p else "n/a",
                mib(shared["peak_bytes"]) if shared else "n/a",
                mib(separate["peak_bytes"]) if separate else "n/a",
            ]
        )
    t.note = (
        "Held: torch.cuda.memory_reserved() growth after capture and empty_cache(), static "
        "buffers included. Peak: max_memory_reserved() growth during the captures."
    )
    tables = [t]
    floor = result.get("floor")
    if floor:
        f = Table(
            "min_free_bytes under tight memory",
            [
                "floor",
                "floor GiB",
                "free GiB at admission",
                "memory misses",
                "deferrals",
                "graphs",
                "hits",
            ],
        )
        for row in floor["rows"]:
            f.rows.append(
                [
                    row["label"],
                    f"{row['floor_bytes'] / (1 << 30):.2f}",
                    "n/a" if row["free_bytes"] is None else f"{row['free_bytes'] / (1 << 30):.2f}",
                    str(row["memory_misses"]),
                    str(row["memory_deferrals"]),
                    str(row["num_graphs"]),
                    str(row["graph_hits"]),
                ]
            )
        f.note = floor.get("note", "")
        tables.append(f)
    return tables
