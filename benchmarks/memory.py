"""Device memory held by N graphs of a small encoder, shared against separate pools (held after
``empty_cache()``, and the capture peak); and ``min_free_bytes`` under memory made tight by a
ballast: a floor above the free memory turns every due capture into a memory miss."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from benchmarks.common import Context, free_cuda_memory, save_plot, target
from benchmarks.table import GiB, MiB, Table, columns, mib, times
from omnitrace import EncoderCudaGraph, EncoderGraphConfig, EventBus
from omnitrace.demo.encoders import EncoderGeometry, VisionEncoder
from omnitrace.testing import SimulatedGraphBackend, capture_events

NAME = "memory"
NEEDS_CUDA = True

SMALL = EncoderGeometry(hidden=256, layers=4, heads=4, mlp=1024)
#: Free memory left beside the ballast in the floor experiment.
TIGHT_FREE_BYTES = 3 * GiB
#: The plot's curves: (row key, what it shows, line style).
_CURVES = (("held_bytes", "held", "-o"), ("peak_bytes", "capture peak", "--x"))


def _reserved(on_cuda: bool) -> int:
    return int(torch.cuda.memory_reserved()) if on_cuda else 0


def run(ctx: Context) -> dict[str, Any]:
    """Measure graph memory by count and pool sharing, then the memory floor."""
    device, dtype, geometry = ctx.device, ctx.dtype, SMALL
    on_cuda = device.type == "cuda"
    with torch.device(device):
        model = VisionEncoder(geometry).to(dtype).eval()
    counts = ctx.pick((1, 2, 4, 8), (1, 4), (1, 2))
    # Shapes step down 16 tokens per graph: a simulated run still needs room for all of them.
    tokens = ctx.pick(1024, 1024, 64) if not ctx.simulate else max(64, 16 * (max(counts) + 1))
    shapes = [(1, tokens - 16 * i, geometry.hidden) for i in range(max(counts))]
    inputs = [torch.randn(s, device=device, dtype=dtype) for s in shapes]
    with torch.no_grad():
        for x in inputs:
            model(x)
    ctx.device_sync()

    rows: list[dict[str, Any]] = []
    for share in (True, False):
        for n in counts:
            rows.append(r := _held(ctx, model, inputs[:n], share, on_cuda))
            ctx.log(
                f"  {n} graph(s), share_pools={share}: held {r['held_bytes'] / MiB:.1f} MiB, "
                f"capture peak {r['peak_bytes'] / MiB:.1f} MiB, {r['pools']} pool(s)"
            )
    floor = _floor(ctx, model, inputs[0], on_cuda)
    del model, inputs
    free_cuda_memory()

    by = {(r["graphs"], r["share_pools"]): r for r in rows}
    n_cmp = 4 if (4, True) in by else max(counts)
    shared, separate = by[(n_cmp, True)], by[(n_cmp, False)]
    ratio = separate["held_bytes"] / shared["held_bytes"] if shared["held_bytes"] > 0 else None
    name = f"separate pools hold more than shared ({n_cmp} graphs), ratio"
    note = "design note: about 142 / 34 MiB = 4.2x on an H200"
    targets = [target(name, ratio, ">", 1.0, "x", note=note)]
    name = "memory floor above free memory defers every due capture (graphs captured)"
    graphs = float(floor["rows"][0]["num_graphs"]) if floor.get("rows") else None
    targets.append(target(name, graphs, "<=", 0.0, "graphs"))
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
    ctx: Context, model: torch.nn.Module, inputs: list[torch.Tensor], share: bool, on_cuda: bool
) -> dict[str, Any]:
    if on_cuda:
        # cuBLAS keeps a workspace per (handle, stream) for the life of the process: cleared,
        # every configuration pays for its own streams.
        torch._C._cuda_clearCublasWorkspaces()
        with torch.no_grad():
            model(inputs[0])  # the replay stream's own workspace is not the graphs' cost
        free_cuda_memory()
        torch.cuda.reset_peak_memory_stats()
    base = _reserved(on_cuda)
    base_alloc = int(torch.cuda.memory_allocated()) if on_cuda else 0
    config = EncoderGraphConfig(max_graphs=8, min_free_bytes=0, share_pools=share)
    name = f"mem-{len(inputs)}-{'shared' if share else 'separate'}"
    backend = SimulatedGraphBackend() if ctx.simulate else None
    adapter = EncoderCudaGraph(model, name=name, config=config, backend=backend)
    with torch.no_grad():
        for x in inputs:
            for _ in range(config.min_capture_calls):
                adapter(x)
    peak = int(torch.cuda.max_memory_reserved()) - base if on_cuda else 0
    free_cuda_memory()
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
            bus, name = EventBus(), f"floor-{'high' if floor_bytes == high else 'low'}"
            config = EncoderGraphConfig(max_graphs=4, min_free_bytes=floor_bytes)
            adapter = EncoderCudaGraph(model, name=name, config=config, bus=bus, backend=backend)
            with capture_events(bus) as events, torch.no_grad():
                for _ in range(calls):
                    adapter(x)
            stats = adapter.stats()
            bus.close()
            free = free_now if stats.last_free_bytes is None else stats.last_free_bytes
            row = {"label": label, "floor_bytes": floor_bytes, "free_bytes": free, "calls": calls}
            for key in ("memory_misses", "memory_deferrals", "warmup_misses", "num_graphs"):
                row[key] = getattr(stats, key)
            row.update(graph_hits=stats.graph_hits, events=[type(e).__name__ for e in events])
            rows.append(row)
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
        for key, what, style in _CURVES:
            values = [p[1][key] / MiB for p in pts]
            ax.plot([p[0] for p in pts], values, style, color=color, label=f"{label}, {what}")
    ax.set(xlabel="graphs captured", ylabel="MiB", title="Device memory of graphs (4-layer, d=256)")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    return [save_plot(plt, fig, out_dir / "memory.png")]


def _gib(value: float | None) -> str:
    return "n/a" if value is None else f"{value / GiB:.2f}"


def tables(result: dict[str, Any]) -> list[Table]:
    by = {(r["graphs"], r["share_pools"]): r for r in result["rows"]}

    def held(n: int, share: bool, key: str = "held_bytes") -> float | None:
        return by[(n, share)][key] if (n, share) in by else None

    def saved(n: int) -> str:
        shared, separate = held(n, True), held(n, False)
        return times(separate / shared) if shared and separate else "n/a"

    t = columns(
        f"Device memory held by N graphs ({result['encoder']})",
        [
            ("graphs", str),
            ("shared pools MiB", lambda n: mib(held(n, True))),
            ("separate pools MiB", lambda n: mib(held(n, False))),
            ("saved", saved),
            ("capture peak shared", lambda n: mib(held(n, True, "peak_bytes"))),
            ("capture peak separate", lambda n: mib(held(n, False, "peak_bytes"))),
        ],
        sorted({r["graphs"] for r in result["rows"]}),
    )
    t.note = (
        "Held: torch.cuda.memory_reserved() growth after capture and empty_cache(), static "
        "buffers included. Peak: max_memory_reserved() growth during the captures."
    )
    floor = result.get("floor")
    if not floor:
        return [t]
    f = columns(
        "min_free_bytes under tight memory",
        [
            ("floor", lambda r: r["label"]),
            ("floor GiB", lambda r: _gib(r["floor_bytes"])),
            ("free GiB at admission", lambda r: _gib(r["free_bytes"])),
            ("memory misses", lambda r: str(r["memory_misses"])),
            ("deferrals", lambda r: str(r["memory_deferrals"])),
            ("graphs", lambda r: str(r["num_graphs"])),
            ("hits", lambda r: str(r["graph_hits"])),
        ],
        floor["rows"],
    )
    f.note = floor.get("note", "")
    return [t, f]
