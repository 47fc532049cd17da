"""Capture off the request path: the traffic mix served by two client threads in each capture
mode (:mod:`benchmarks.capture_serving`), a cold and a warm pass on fresh adapters, beside a
reduce-overhead co-tenant; the method is in BENCHMARKS.md, "Method"."""

from __future__ import annotations

import contextlib
import gc
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from benchmarks import capture_goals
from benchmarks.capture_serving import (
    CHECK_EVERY,
    CLIENTS,
    COTENANT_EVERY,
    GRAPHS_PER_CLIENT,
    MODES,
    Client,
    CoTenant,
    Mode,
    PreparingCounter,
    Traffic,
    serve,
)
from benchmarks.common import (
    BenchmarkFailedError,
    Context,
    GcClock,
    encoders,
    free_cuda_memory,
    geometry_fields,
    save_plot,
    simulated_compile,
)
from benchmarks.traffic import AUDIO_MEDIUM, VISION_MEDIUM, make_stream
from omnitrace import EncoderCudaGraph, EventBus
from omnitrace.demo.encoders import AUDIO_TINY, VISION_TINY, AudioEncoder
from omnitrace.graphs.gil import COMPILE_YIELD
from omnitrace.testing import SimulatedGraphBackend

NAME = "capture"
NEEDS_CUDA = True

#: Audio frames of the co-tenant's input: half a second, which the stream never draws.
COTENANT_FRAMES = 50
#: Seconds a mode may take to prepare its graphs after a pass, by scale.
PREPARE_TIMEOUT_S = {"full": 180.0, "quick": 60.0, "tiny": 30.0}
#: What a simulated capture and a simulated warm-up take.
SIMULATED_CAPTURE_S = SIMULATED_WARMUP_S = 0.02
PASSES = ("cold", "warm")


def _backend(ctx: Context, mode: Mode) -> SimulatedGraphBackend | None:
    """The default (torch) backend, or the simulated one."""
    if not ctx.simulate:
        return None
    return SimulatedGraphBackend(capture_delay=SIMULATED_CAPTURE_S, warmup_delay=SIMULATED_WARMUP_S)


def _pass(
    clients: list[Client],
    adapters: dict[str, EncoderCudaGraph],
    traffic: Traffic,
    mode: Mode,
    cotenant: CoTenant,
    simulated: list[Any],
    preparing: PreparingCounter,
) -> dict[str, Any]:
    """Serve one pass; count its graphs, eager calls while preparing and garbage collections
    (which stop every thread)."""
    graphs, counted = sum(a.num_graphs for a in adapters.values()), preparing.count
    clock = GcClock()
    gc.callbacks.append(clock)
    clock.armed = True
    try:
        cotenant_here = cotenant if mode.cotenant else None
        out = serve(
            clients[: mode.clients], adapters, traffic, mode.tolerance, cotenant_here, simulated
        )
    finally:
        clock.armed = False
        gc.callbacks.remove(clock)
    out.update(graphs_before=graphs, preparing_misses=preparing.count - counted, gc=clock.as_dict())
    return out


def _settle(ctx: Context, adapters: dict[str, EncoderCudaGraph]) -> dict[str, Any]:
    """Wait until no graph is being prepared; how long, and what went wrong if anything."""
    timeout = PREPARE_TIMEOUT_S[ctx.scale]
    start = time.perf_counter()
    pending = {n: a.preparing for n, a in adapters.items()}
    prepared = all(a.wait_prepared(timeout) for a in adapters.values())
    terminal = {n: a.stats().failure for n, a in adapters.items() if a.terminal}
    error = ""
    if terminal:
        error = "adapter(s) terminal after a failed capture: " + ", ".join(
            f"{n} ({why})" for n, why in terminal.items()
        )
    elif not prepared:
        error = f"graphs still being prepared {timeout:g} s after the pass: " + ", ".join(
            f"{n} {a.preparing}" for n, a in adapters.items()
        )
    return {
        "pending_at_end": pending,
        "wait_s": time.perf_counter() - start,
        "prepared": prepared,
        "graphs_after": sum(a.num_graphs for a in adapters.values()),
        "ready_after": sum(a.ready for a in adapters.values()),  # captured by the next call
        "terminal": sorted(terminal),
        "error": error,
    }


def run_mode(
    ctx: Context,
    mode: Mode,
    clients: list[Client],
    models: dict[str, torch.nn.Module],
    traffic: Traffic,
    cotenant: CoTenant,
) -> dict[str, Any]:
    """The mode's row: the cold and the warm pass on fresh adapters."""
    free_cuda_memory()
    bus = EventBus()
    preparing = PreparingCounter()
    bus.add_fold(preparing)
    backends = {enc: _backend(ctx, mode) for enc in models}
    adapters = {
        enc: EncoderCudaGraph(model, name=enc, config=mode.config(), bus=bus, backend=backends[enc])
        for enc, model in models.items()
    }
    simulated = [b for b in backends.values() if b is not None]
    row: dict[str, Any] = {
        "mode": mode.name,
        "title": mode.title,
        "clients": mode.clients,
        "max_graphs": mode.config().max_graphs,
        "tolerance": mode.tolerance,
    }
    calls_before = cotenant.counts()
    yielded = COMPILE_YIELD.statistics()
    start = time.perf_counter()
    errors: list[dict[str, str]] = []
    try:
        for name in PASSES:
            if errors:
                break
            row[name] = one = _pass(
                clients, adapters, traffic, mode, cotenant, simulated, preparing
            )
            errors += one["errors"]
            # No preparation may carry over into the next pass or mode: wait, untimed.
            one["settle"] = settle = _settle(ctx, adapters)
            if settle["error"] and not errors:
                errors.append({"client": "capture", "error": settle["error"], "traceback": ""})
        row["errors"] = errors
        stats = {name: a.stats() for name, a in adapters.items()}
        folded = bus.adapter_stats()
        calls, wrong = cotenant.counts()
        row.update(
            {
                "graphs": sum(s.num_graphs for s in stats.values()),
                "graphs_by_encoder": {n: s.num_graphs for n, s in stats.items()},
                "capture_seconds": [g.duration_s for s in stats.values() for g in s.graphs],
                "capture_failures": sum(s.capture_failures for s in stats.values()),
                "stats": {n: s.as_dict() for n, s in stats.items()},
                "stats_agree_with_bus": all(
                    folded[n].as_dict() == s.as_dict() for n, s in stats.items() if n in folded
                ),
                "cotenant": mode.cotenant,
                "cotenant_calls": calls - calls_before[0],
                "cotenant_wrong": wrong - calls_before[1],
                "duration_s": time.perf_counter() - start,
            }
        )
        now = COMPILE_YIELD.statistics()  # what compiles gave up to eager calls
        row["compile_pauses"] = {
            "pauses": now.pauses - yielded.pauses,
            "paused_s": now.paused_s - yielded.paused_s,
            "cut_short": now.cut_short - yielded.cut_short,
        }
    finally:
        bus.close()
    return row


def _describe(row: dict[str, Any]) -> str:
    parts = [f"  {row['mode']}:"]
    for name in ("cold", "warm"):
        p = row.get(name)
        if p and p["latency_us"]:
            lat = p["latency_us"]
            parts.append(
                f"{name} p50 {lat['p50']:,.0f} / p99 {lat['p99']:,.0f} / max {lat['max']:,.0f} us, "
                f"hit rate {p['hit_rate'] * 100:.1f} %;"
            )
    pauses = row.get("compile_pauses")
    if pauses and pauses["pauses"]:
        parts.append(
            f"compiles paused {pauses['pauses']} times ({pauses['paused_s'] * 1e3:,.0f} ms, "
            f"{pauses['cut_short']} cut short) for eager calls;"
        )
    parts.append(
        f"{row.get('graphs', 0)} graphs, wrong outputs "
        f"{sum(row[p]['wrong'] for p in ('cold', 'warm') if p in row)}, "
        f"errors {len(row['errors'])}"
    )
    return " ".join(parts)


def _traffic(ctx: Context, models: dict[str, torch.nn.Module], hidden: int) -> Traffic:
    seed = 20260415
    divs = {"token_div": 16, "frame_div": 10} if ctx.simulate else {}
    stream = make_stream(ctx.pick(1000, 400, 40), seed, **divs)
    gen = torch.Generator(device="cpu").manual_seed(seed)
    inputs: dict[tuple[str, tuple[int, ...]], torch.Tensor] = {}
    for req in stream:
        key = (req.encoder, req.shape)
        if key not in inputs:
            shape = req.shape + ((hidden,) if req.encoder == "vision" else ())
            inputs[key] = torch.randn(shape, generator=gen).to(ctx.device, ctx.dtype)
    refs: dict[tuple[str, tuple[int, ...]], torch.Tensor] = {}
    with torch.no_grad():
        # Every shape once eagerly first, so one-time costs (kernel selection) land on no mode.
        for key, x in inputs.items():
            models[key[0]](x)
        for i, req in enumerate(stream):
            key = (req.encoder, req.shape)
            if i % CHECK_EVERY == 0 and key not in refs:
                refs[key] = models[req.encoder](inputs[key])
    ctx.device_sync()
    return Traffic(stream, inputs, refs)


@contextlib.contextmanager
def _recompile_limit(limit: int) -> Iterator[None]:
    """Let every exact shape compile: past dynamo's limit a shape would run uncompiled."""
    config = torch._dynamo.config
    name = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"
    with config.patch(name, limit):
        yield


def run(ctx: Context) -> dict[str, Any]:
    """Serve the traffic in every mode; a mode that raised or could not prepare its graphs
    fails the benchmark once every mode ran."""
    device, dtype = ctx.device, ctx.dtype
    on_cuda = device.type == "cuda"
    geoms = {"vision": VISION_MEDIUM, "audio": AUDIO_MEDIUM}
    if ctx.simulate:
        geoms = {"vision": VISION_TINY, "audio": AUDIO_TINY}
    models = encoders(ctx, geoms)
    with torch.device(device):
        cotenant_model = AudioEncoder(geoms["audio"]).to(dtype).eval()
    traffic = _traffic(ctx, models, geoms["vision"].hidden)
    distinct = len(traffic.inputs)
    ctx.log(
        f"  stream: {len(traffic.stream)} requests, {distinct} distinct shapes, "
        f"{CLIENTS} client threads, {len(traffic.refs)} shapes checked against eager"
    )
    clients = [Client(i, on_cuda) for i in range(CLIENTS)]
    for client in clients:
        client.start()
    rows: list[dict[str, Any]] = []
    cotenant_info: dict[str, Any] = {}
    try:
        with simulated_compile(ctx), _recompile_limit(8 * GRAPHS_PER_CLIENT * CLIENTS):
            x = torch.randn(1, 80, COTENANT_FRAMES, device=device, dtype=dtype)
            cotenant = CoTenant(cotenant_model, x, on_cuda)
            start = time.perf_counter()
            for _ in range(3):  # compiled and recorded on this thread, which calls it later
                cotenant.call()
            cotenant_info = {
                "model": "AudioEncoder, medium" if not ctx.simulate else "AudioEncoder, tiny",
                "input": [1, 80, COTENANT_FRAMES],
                "setup_s": time.perf_counter() - start,
                "every": COTENANT_EVERY,
            }
            ctx.log(f"  co-tenant compiled and recorded in {cotenant_info['setup_s']:.1f} s")
            for mode in MODES:
                if mode.compile and ctx.scale == "quick":
                    rows.append({"mode": mode.name, "title": mode.title, "skipped": "--quick"})
                    rows[-1]["errors"] = []
                    ctx.log(f"  {mode.name}: skipped (--quick: torch.compile runs in full runs)")
                    continue
                if mode.compile:
                    torch._dynamo.reset()  # each compiled mode compiles for itself
                rows.append(run_mode(ctx, mode, clients, models, traffic, cotenant))
                ctx.log(_describe(rows[-1]))
                for error in rows[-1]["errors"]:
                    ctx.log(f"    FAILED ({error['client']}): {error['error']}")
                    if error["traceback"]:
                        ctx.log(error["traceback"].rstrip())
            calls, wrong = cotenant.counts()
            cotenant_info.update(calls=calls, wrong=wrong, max_rel_err=cotenant.max_rel_err)
    finally:
        for client in clients:
            client.stop()
        torch._dynamo.reset()  # nothing of this suite counts against the next one's limit
        free_cuda_memory()
    stream = {"requests": len(traffic.stream), "distinct_shapes": distinct}
    result = {
        "stream": {**stream, "checked_every": CHECK_EVERY},
        "clients": CLIENTS,
        "encoders": "tiny (simulated)" if ctx.simulate else "medium",
        "graphs_per_client": GRAPHS_PER_CLIENT,
        "geometries": {k: geometry_fields(g) for k, g in geoms.items()},
        "dtype": str(dtype).removeprefix("torch."),
        "timing": "per request: adapter call until the client's own stream finished it "
        "(stream.synchronize()), perf_counter",
        "cotenant": cotenant_info,
        "rows": rows,
        "targets": capture_goals.targets(rows, cotenant_info, MODES),
        "figures": capture_goals.figures(rows),
        "simulated": ctx.simulate,
    }
    failed = [f"{r['mode']}: {e['error']}" for r in rows for e in r["errors"]]
    if failed:
        raise BenchmarkFailedError(
            f"{len(failed)} failure(s) while serving: " + "; ".join(failed)[:1000], result
        )
    return result


def plot(result: dict[str, Any], out_dir: Path, plt: Any) -> list[Path]:
    """Draw p50, p99 and max request latency per mode, cold and warm pass."""
    rows = [r for r in result["rows"] if "cold" in r]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
    width = 0.25
    for ax, name in zip(axes, ("cold", "warm"), strict=True):
        for j, stat in enumerate(("p50", "p99", "max")):
            xs, ys = [], []
            for i, row in enumerate(rows):
                lat = (row.get(name) or {}).get("latency_us")
                if lat:
                    xs.append(i + (j - 1) * width)
                    ys.append(lat[stat] / 1000)
            ax.bar(xs, ys, width, label=stat)
        ax.set_xticks(range(len(rows)))
        ax.set_xticklabels([r["title"] for r in rows], fontsize=7, rotation=10)
        ax.set_title(f"{name} pass")
        ax.set_yscale("log")
        ax.legend(fontsize=8)
    axes[0].set_ylabel("request latency, ms")
    fig.suptitle(f"Traffic mix, {result['clients']} client threads, by capture mode")
    return [save_plot(plt, fig, out_dir / "capture.png")]
