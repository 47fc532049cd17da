"""Encoder latency: every method ("arm", :mod:`benchmarks.latency_arms`) at every shape of
MiniCPM-o 4.5's encoders, in one process, interleaved round by round; the method and the
compile budget are in BENCHMARKS.md, "Method"."""

from __future__ import annotations

import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from benchmarks import latency_goals
from benchmarks.common import (
    BenchmarkFailedError,
    Context,
    free_cuda_memory,
    geometries,
    geometry_fields,
    max_rel_err,
    rotated,
    save_plot,
    simulated_compile,
    summarize,
    write_partial,
)
from benchmarks.latency_arms import ARMS, Arm, Point, Run, Shape, Skip, Timed
from omnitrace.demo.encoders import AudioEncoder, VisionEncoder

NAME = "latency"
NEEDS_CUDA = True

#: Seconds of a compile (the first pays for inductor's start-up) and of a shape without its
#: compiles, until this run measured one; a measured compile, times the margin, estimates the next.
FIRST_COMPILE_GUESS_S = {"cuda": 60.0, "simulated": 10.0}
FIRST_SHAPE_GUESS_S = {"cuda": 20.0, "simulated": 2.0}
COMPILE_MARGIN = 1.25
#: An arm's fields as the results list them.
_ARM_FIELDS = ("name", "title", "vs", "tolerance", "compiles")

#: (encoder, what, size) in display order.
FULL_POINTS = (
    ("vision", "1024 tokens", 1024),
    ("vision", "256 tokens", 256),
    ("audio", "1 s chunk", 100),
    ("audio", "30 s clip", 3000),
)
SIMULATED_POINTS = (("vision", "1024 tokens", 64), ("audio", "1 s chunk", 100))
#: Shapes run (and compiled) first within a batch size: the ones the goals compare.
PRIORITY = ("audio 1 s chunk", "vision 256 tokens")


def shapes(ctx: Context) -> list[Shape]:
    """The shapes in the order they run: batch 1 first, priority shapes first."""
    batches = (1, 4) if ctx.batch4 and ctx.scale == "full" else (1,)
    points: tuple[tuple[str, str, int], ...] = SIMULATED_POINTS if ctx.simulate else FULL_POINTS
    if ctx.scale == "tiny":
        points = points[:1] + tuple(p for p in points if p[0] == "audio")[:1]
    out: list[Shape] = []
    for b, batch in enumerate(batches):
        group = [
            Shape(enc, what, size, batch, b * len(points) + i)
            for i, (enc, what, size) in enumerate(points)
        ]
        group.sort(key=lambda s: PRIORITY.index(s.label) if s.label in PRIORITY else len(PRIORITY))
        out += group
    return out


def _input_shape(shape: Shape, hidden: int) -> tuple[int, ...]:
    batch, size = shape.batch, shape.size
    return (batch, size, hidden) if shape.encoder == "vision" else (batch, 80, size)  # mel x frames


class Budget:
    """Whether a compiling arm may start, from what is left of the run's time."""

    def __init__(self, ctx: Context, shapes_total: int) -> None:
        kind = "simulated" if ctx.simulate else "cuda"
        self.ctx = ctx
        self.first_compile_s = FIRST_COMPILE_GUESS_S[kind]
        self.first_shape_s = FIRST_SHAPE_GUESS_S[kind]
        self.compile_s: dict[str, float] = {}
        self.shape_s: list[float] = []
        self.shapes_left = shapes_total

    def check(self, arm_name: str) -> None:
        """Raise Skip when this arm's compile would leave no time for the shapes after it."""
        if self.ctx.scale == "quick":
            raise Skip("--quick", "torch.compile runs in full runs only")
        guess = max(self.compile_s.values(), default=self.first_compile_s)
        estimate = self.compile_s.get(arm_name, guess)
        # This shape's timing and every shape after it, each without compiles.
        reserve = (max(self.shape_s) if self.shape_s else self.first_shape_s) * self.shapes_left
        room = self.ctx.remaining() - reserve
        if room < estimate:
            left = f"{max(room, 0.0):.0f} s left for compiling"
            raise Skip("time budget", f"{left}, a compile takes about {estimate:.0f} s")

    def compiled(self, arm_name: str, seconds: float) -> None:
        self.compile_s[arm_name] = seconds * COMPILE_MARGIN

    def shape_done(self, seconds_without_compiles: float) -> None:
        self.shape_s.append(seconds_without_compiles)
        self.shapes_left -= 1


def time_rounds(
    arms: dict[str, Timed], *, rounds: int, per_round: int, sync: Callable[[], None]
) -> dict[str, dict[str, list[float]]]:
    """``rounds`` rounds of ``per_round`` calls of every arm, round ``r`` from arm ``r mod n``,
    each call from an idle device: ``host`` until it returns, ``latency`` until the device
    is done."""
    perf = time.perf_counter
    samples = {name: {"host": [], "latency": []} for name in arms}
    for r in range(rounds):
        for name in rotated(list(arms), r):
            timed = arms[name]
            host, latency = samples[name]["host"], samples[name]["latency"]
            with timed.window():
                for _ in range(per_round):
                    sync()
                    start = perf()
                    timed.call()
                    returned = perf()
                    sync()
                    done = perf()
                    host.append(returned - start)
                    latency.append(done - start)
            timed.settle()
    return samples


def _build(
    spec: Arm, point: Point, budget: Budget, row: dict[str, Any], log: Callable[[str], None]
) -> Timed | None:
    """Build one arm and check its output; record it (skipped, failed, built) in ``row``."""
    entry: dict[str, Any] = row["methods"][spec.name]
    start = time.perf_counter()
    try:
        if spec.compiles:
            budget.check(spec.name)
        timed = spec.build(point)
        out = timed.call()
        point.run.sync()
    except Skip as skip:
        entry.update(skipped=skip.reason, detail=skip.detail)
        log(f"    {spec.name}: skipped ({skip.reason}{': ' + skip.detail if skip.detail else ''})")
        return None
    except Exception as exc:
        entry.update(error=f"{type(exc).__name__}: {exc}"[:500], traceback=traceback.format_exc())
        row["errors"].append(f"{spec.name}: {entry['error']}")
        log(f"    {spec.name}: FAILED: {entry['error']}")
        log(entry["traceback"].rstrip())
        return None
    entry["build_s"] = time.perf_counter() - start
    entry.update(timed.info)
    if spec.tolerance is not None and isinstance(out, torch.Tensor):
        err = max_rel_err(out, point.ref)
        entry.update(
            max_rel_err=err, tolerance=spec.tolerance, within_tolerance=err <= spec.tolerance
        )
    if spec.compiles and "compile_s" in timed.info:
        budget.compiled(spec.name, float(timed.info["compile_s"]))
        log(f"    {spec.name}: compiled in {timed.info['compile_s']:.1f} s")
    return timed


def measure_shape(
    run: Run, shape: Shape, budget: Budget, settings: dict[str, int]
) -> dict[str, Any]:
    """Build every arm for ``shape`` and time them; a timed call's exception propagates."""
    geometry = geometries(run.simulate)[shape.encoder]
    start = time.perf_counter()
    cls = VisionEncoder if shape.encoder == "vision" else AudioEncoder
    with torch.device(run.device):
        model = cls(geometry).to(run.dtype).eval()
    gen = torch.Generator(device="cpu").manual_seed(shape.size * 31 + shape.batch)
    x = torch.randn(*_input_shape(shape, geometry.hidden), generator=gen).to(run.device, run.dtype)
    row: dict[str, Any] = {
        "label": shape.label,
        "encoder": shape.encoder,
        "size": shape.size,
        "batch": shape.batch,
        "order": shape.order,
        "input": f"({', '.join(map(str, x.shape))})",
        "methods": {a.name: {} for a in ARMS},
        "errors": [],
    }
    ref = model(x)
    run.sync()
    row["output_shape"] = list(ref.shape)
    point = Point(shape, model, x, ref, run)
    try:
        timings, rounds = _measure_arms(point, budget, settings, row, start)
    finally:
        for close in point.closers:
            close()
    timings["total_s"] = time.perf_counter() - start
    row.update(timings=timings, rounds=rounds, **compare(row["methods"]))
    row["outputs_match"] = all(
        e.get("within_tolerance", True) for e in row["methods"].values() if "error" not in e
    )
    return row


def _measure_arms(
    point: Point, budget: Budget, settings: dict[str, int], row: dict[str, Any], start: float
) -> tuple[dict[str, float], int]:
    """Build the arms into ``row``, time them; return phase timings and the rounds run."""
    run = point.run
    timings: dict[str, float] = {"build_s": time.perf_counter() - start}
    arms: dict[str, Timed] = {}
    for spec in ARMS:
        if (timed := _build(spec, point, budget, row, run.ctx.log)) is not None:
            arms[spec.name] = timed
    timings["arms_s"] = time.perf_counter() - start - timings["build_s"]

    phase = time.perf_counter()
    rounds = settings["cycles"] * len(arms)
    for timed in arms.values():
        with timed.window():
            for _ in range(settings["warmup"]):
                timed.call()
            run.sync()
        timed.settle()
    before = {n: t.adapter.get_cumulative_stats() for n, t in arms.items() if t.adapter}
    samples = time_rounds(arms, rounds=rounds, per_round=settings["per_round"], sync=run.sync)
    for name, timed in arms.items():
        entry = row["methods"][name]
        entry["latency_us"] = summarize(samples[name]["latency"])
        entry["host_us"] = summarize(samples[name]["host"])
        if timed.adapter is not None:
            after = timed.adapter.get_cumulative_stats()
            entry["timed_calls"] = rounds * settings["per_round"]
            entry["hits"] = int(after["graph_hits"] - before[name]["graph_hits"])
            entry["misses"] = int(after["graph_misses"] - before[name]["graph_misses"])
            entry["num_graphs"] = int(after["num_graphs"])
        if timed.report is not None:
            entry.update(timed.report())
    timings["timing_s"] = time.perf_counter() - phase
    return timings, rounds


def compare(methods: dict[str, dict[str, Any]]) -> dict[str, dict[str, float | None]]:
    """Each arm's median latency over each arm it names in ``vs``, minus one (``ratios``),
    the difference of median host times in us (``host_over_us``), and the speed-up over eager."""

    def median(name: str, key: str) -> float | None:
        s = methods.get(name, {}).get(key)
        return None if s is None else float(s["median"])

    ratios: dict[str, float | None] = {}
    host: dict[str, float | None] = {}
    speedup: dict[str, float | None] = {}
    eager = median("eager", "latency_us")
    for spec in ARMS:
        mine, mine_host = median(spec.name, "latency_us"), median(spec.name, "host_us")
        if spec.name != "eager":
            speedup[spec.name] = eager / mine if eager and mine else None
        for other in spec.vs:
            theirs, theirs_host = median(other, "latency_us"), median(other, "host_us")
            key = f"{spec.name}_over_{other}"
            ratios[key] = mine / theirs - 1 if mine and theirs else None
            host[key] = (
                None if mine_host is None or theirs_host is None else mine_host - theirs_host
            )
    return {"ratios": ratios, "host_over_us": host, "speedup_vs_eager": speedup}


def run(ctx: Context) -> dict[str, Any]:
    """Time every arm at every shape; an arm that failed to build fails the benchmark."""
    settings = dict(
        warmup=ctx.pick(10, 5, 2), per_round=ctx.pick(12, 10, 3), cycles=ctx.pick(2, 1, 1)
    )
    order = shapes(ctx)
    budget = Budget(ctx, len(order))
    rows: list[dict[str, Any]] = []
    state = Run(ctx)

    def result() -> dict[str, Any]:
        sinks = state.sink_statistics()
        return {
            "dtype": str(state.dtype).removeprefix("torch."),
            "grad_mode": "no_grad",
            "timing": "synchronize before and after each call; perf_counter; host time: "
            "call to return",
            "process": "every shape and arm in the runner's process, no isolation",
            "method_order": "round r starts at arm r mod n",
            **settings,
            "rounds": "cycles x number of arms built",
            "arms": [{f: getattr(a, f) for f in _ARM_FIELDS} | {"vs": list(a.vs)} for a in ARMS],
            "shape_order": [f"{s.label} batch {s.batch}" for s in order],
            "geometries": {k: geometry_fields(g) for k, g in geometries(ctx.simulate).items()},
            "vllm": state.vllm,
            "sinks": sinks,
            "rows": sorted(rows, key=lambda r: r["order"]),
            "targets": latency_goals.targets(rows, sinks),
            "figures": latency_goals.figures(rows),
            "simulated": ctx.simulate,
        }

    try:
        state.load_vllm()
        ctx.log(_describe_vllm(state.vllm))
        with torch.no_grad(), simulated_compile(ctx):
            for i, shape in enumerate(order):
                dims = _input_shape(shape, geometries(ctx.simulate)[shape.encoder].hidden)
                ctx.log(
                    f"  [{i + 1}/{len(order)}] {shape.label}, batch {shape.batch}, "
                    f"input ({', '.join(map(str, dims))}), {ctx.remaining():.0f} s of budget left"
                )
                row = measure_shape(state, shape, budget, settings)
                rows.append(row)
                compiling = [row["methods"][a.name] for a in ARMS if a.compiles]
                compile_s = sum(float(e.get("build_s", 0.0)) for e in compiling)
                budget.shape_done(row["timings"]["total_s"] - compile_s)
                ctx.log(_describe_row(row))
                # Reset dynamo after any compile, failed ones too, as a fresh process would be.
                if any("skipped" not in e for e in compiling):
                    torch._dynamo.reset()
                free_cuda_memory()
                write_partial(ctx, NAME, result())
        final = result()
    finally:
        state.close()
    failures = [f"{r['label']} batch {r['batch']}: {e}" for r in final["rows"] for e in r["errors"]]
    if failures:
        raise BenchmarkFailedError(
            f"{len(failures)} arm build(s) failed: " + "; ".join(failures)[:1000], final
        )
    return final


def _describe_vllm(vllm: dict[str, Any]) -> str:
    if vllm.get("status") == "on":
        return f"  vLLM {vllm['version']}: imported in {vllm.get('import_s', 0.0):.1f} s"
    return f"  vLLM arm skipped: {vllm['reason']} ({vllm['detail']})"


def _describe_row(row: dict[str, Any]) -> str:
    med = {n: m["latency_us"]["median"] for n, m in row["methods"].items() if "latency_us" in m}
    ratios = {k.replace("_over_", "/"): v for k, v in row["ratios"].items() if v is not None}
    return f"    median us: {', '.join(f'{n} {v:,.0f}' for n, v in med.items())}\n" + (
        f"    ratios: {', '.join(f'{k} {v * 100:+.2f} %' for k, v in ratios.items())}"
    )


def plot(result: dict[str, Any], out_dir: Path, plt: Any) -> list[Path]:
    """Draw median latency per arm for every shape, p10-p90 as error bars."""
    rows = result["rows"]
    names = [a["name"] for a in result["arms"]]
    titles = {a["name"]: a["title"] for a in result["arms"]}
    width = 0.8 / max(len(names), 1)
    fig, ax = plt.subplots(figsize=(max(8, 2.2 * len(rows)), 4.5))
    for i, name in enumerate(names):
        xs, ys, lo, hi = [], [], [], []
        for j, row in enumerate(rows):
            s = row["methods"].get(name, {}).get("latency_us")
            if s is None:
                continue
            xs.append(j + (i - (len(names) - 1) / 2) * width)
            ys.append(s["median"])
            lo.append(s["median"] - s["p10"])
            hi.append(s["p90"] - s["median"])
        if xs:
            ax.bar(xs, ys, width, yerr=[lo, hi], label=titles[name], capsize=2)
    ax.set_xticks(range(len(rows)))
    ax.set_xticklabels([f"{r['label']}\nB={r['batch']}" for r in rows], fontsize=8)
    ax.set_ylabel("latency per call, us (median, p10-p90)")
    ax.set_title(f"Encoder latency ({result['dtype']}, one process)")
    ax.legend(fontsize=7, ncol=2)
    return [save_plot(plt, fig, out_dir / "latency.png")]
