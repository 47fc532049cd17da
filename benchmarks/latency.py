"""Encoder latency, side by side in one process: eager, adapter, bare graph, torch.compile.

For MiniCPM-o 4.5's encoders at full size (SigLIP so400m vision at 1024 and 256 tokens,
Whisper-medium audio at a 1-second chunk and a 30-second clip), batch 1 and a small batch,
bf16 under ``torch.no_grad()``:

* ``eager``: the module itself;
* ``adapter``: :class:`omnitrace.EncoderCudaGraph` on its hit path (warmed until captured;
  the timed calls are checked to be hits with ``get_cumulative_stats()``);
* ``bare``: a ``torch.cuda.CUDAGraph`` written here, replayed as copy_ + replay + clone;
* ``replay_only``: the same graph's ``replay()`` alone (the floor under both);
* ``compile``: ``torch.compile(mode="reduce-overhead", dynamic=False)``, compile time
  bounded by the run's time budget; a failure or a skip is recorded, not raised.

Every call is timed from an idle device until the device finished it (synchronize +
perf_counter), methods interleaved round by round so drift hits all of them alike.
"""

from __future__ import annotations

import contextlib
import signal
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from benchmarks.common import Context, free_cuda_memory, summarize, target, time_per_call
from omnitrace import EncoderCudaGraph, EncoderGraphConfig
from omnitrace.demo.encoders import (
    AUDIO_FULL,
    AUDIO_TINY,
    VISION_FULL,
    VISION_TINY,
    AudioEncoder,
    VisionEncoder,
)
from omnitrace.testing import SimulatedGraphBackend

NAME = "latency"
NEEDS_CUDA = True

#: The adapter must stay within this of bare copy-replay-clone.
ADAPTER_VS_BARE_TARGET = 0.02
#: A graph replays the eager kernels, so outputs should agree almost exactly; compiled
#: kernels fuse differently and are held to a looser bf16 tolerance.
GRAPH_TOLERANCE = 1e-2
COMPILE_TOLERANCE = 1e-1
#: Guess of one torch.compile before any was measured (seconds).
FIRST_COMPILE_GUESS_S = 90.0
#: Hard cap on one compile, whatever the budget says.
MAX_COMPILE_S = 240.0


class CompileTimeoutError(Exception):
    """torch.compile ran past the time it was given."""


@contextlib.contextmanager
def _time_limit(seconds: float) -> Iterator[None]:
    """Raise CompileTimeoutError in the main thread after ``seconds`` (no-op elsewhere)."""
    if threading.current_thread() is not threading.main_thread() or not hasattr(
        signal, "setitimer"
    ):
        yield
        return

    def expire(signum: int, frame: object) -> None:
        raise CompileTimeoutError(f"torch.compile took longer than {seconds:.0f} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, max(seconds, 1.0))
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


class BareGraph:
    """A ``torch.cuda.CUDAGraph`` around ``forward`` with a static input.

    Captured the way PyTorch documents it: warm-up on a side stream, then capture; a call
    copies the input in, replays and clones the output out.
    """

    def __init__(self, forward: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> None:
        self.static_in = x.clone()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(3):
                forward(self.static_in)
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.static_out = forward(self.static_in)
        torch.cuda.synchronize()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        self.static_in.copy_(x)
        self.graph.replay()
        return self.static_out.clone()

    def replay_only(self) -> None:
        self.graph.replay()


def _max_rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    ref32 = ref.float()
    scale = float(ref32.abs().max())
    return float((out.float() - ref32).abs().max()) / max(scale, 1e-12)


class _Compiled:
    """One torch.compile'd module per encoder, with its compile history and budget."""

    def __init__(self, model: torch.nn.Module, name: str) -> None:
        self.name = name
        self.fn = torch.compile(model, mode="reduce-overhead", dynamic=False)
        self.durations: list[float] = []
        self.broken: str | None = None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        # Marks a new inference step so CUDA graph trees may reuse the previous outputs.
        torch.compiler.cudagraph_mark_step_begin()
        return self.fn(x)  # type: ignore[no-any-return]


def _geometries(ctx: Context) -> dict[str, Any]:
    if ctx.simulate:
        return {"vision": VISION_TINY, "audio": AUDIO_TINY}
    return {"vision": VISION_FULL, "audio": AUDIO_FULL}


def _shapes(ctx: Context) -> list[dict[str, Any]]:
    """Return the configurations to time, batch 1 first (the measured anchors)."""
    batches = ctx.pick((1, 4), (1,), (1,))
    if ctx.simulate:
        points = [("vision", "1024 tokens", 64), ("audio", "1 s chunk", 100)]
    else:
        points = [
            ("vision", "1024 tokens", 1024),
            ("vision", "256 tokens", 256),
            ("audio", "1 s chunk", 100),
            ("audio", "30 s clip", 3000),
        ]
    if ctx.scale == "tiny":
        points = points[:1] + [p for p in points if p[0] == "audio"][:1]
    out = []
    for batch in batches:
        for encoder, what, size in points:
            out.append({"encoder": encoder, "what": what, "size": size, "batch": batch})
    return out


def _input(
    encoder: str, size: int, batch: int, hidden: int, device: torch.device, dtype: torch.dtype
) -> torch.Tensor:
    gen = torch.Generator(device="cpu").manual_seed(size * 31 + batch)
    if encoder == "vision":
        x = torch.randn(batch, size, hidden, generator=gen)
    else:
        x = torch.randn(batch, 80, size, generator=gen)  # mel bins x frames
    return x.to(device=device, dtype=dtype)


def run(ctx: Context) -> dict[str, Any]:
    """Time every configuration; return rows, targets and the settings used."""
    device = ctx.device
    dtype = torch.float32 if ctx.simulate else torch.bfloat16
    on_cuda = device.type == "cuda"
    sync: Callable[[], None] = torch.cuda.synchronize if on_cuda else (lambda: None)
    warmup = ctx.pick(10, 5, 2)
    per_round = ctx.pick(20, 10, 3)
    rounds = ctx.pick(6, 3, 2)
    use_compile = on_cuda and ctx.scale == "full"
    compile_skip = (
        "skipped: needs CUDA"
        if not on_cuda
        else ("skipped: --quick" if ctx.scale != "full" else None)
    )

    geoms = _geometries(ctx)
    models: dict[str, torch.nn.Module] = {}
    with torch.device(device):
        models["vision"] = VisionEncoder(geoms["vision"]).to(dtype).eval()
        models["audio"] = AudioEncoder(geoms["audio"]).to(dtype).eval()
    compiled: dict[str, _Compiled] = {}
    shapes = _shapes(ctx)
    rows: list[dict[str, Any]] = []
    config_seconds: list[float] = []
    compile_log: list[dict[str, Any]] = []

    for index, shape in enumerate(shapes):
        encoder, size, batch = shape["encoder"], shape["size"], shape["batch"]
        model = models[encoder]
        label = f"{encoder} {shape['what']}"
        hidden = geoms[encoder].hidden
        x = _input(encoder, size, batch, hidden, device, dtype)
        in_desc = f"({', '.join(map(str, x.shape))})"
        ctx.log(f"  {label}, batch {batch}, input {in_desc}")
        started = time.perf_counter()
        row: dict[str, Any] = {
            "label": label,
            "encoder": encoder,
            "size": size,
            "batch": batch,
            "input": in_desc,
            "methods": {},
        }
        methods: dict[str, Callable[[], object]] = {}
        with torch.no_grad():
            ref = model(x)
            sync()
            row["output_shape"] = list(ref.shape)
            methods["eager"] = lambda model=model, x=x: model(x)
            row["methods"]["eager"] = {}

            # The adapter, warmed until it captured this key.
            config = EncoderGraphConfig(min_free_bytes=0)
            backend = SimulatedGraphBackend() if ctx.simulate else None
            adapter = EncoderCudaGraph(
                model, name=f"{encoder}-{size}-b{batch}", config=config, backend=backend
            )
            for _ in range(config.min_capture_calls):
                adapter(x)
            sync()
            if adapter.num_graphs != 1:
                stats = adapter.get_cumulative_stats()
                raise RuntimeError(f"adapter did not capture {label} batch {batch}: {stats}")
            row["methods"]["adapter"] = {"max_rel_err": _max_rel_err(adapter(x), ref)}
            methods["adapter"] = lambda adapter=adapter, x=x: adapter(x)

            bare: BareGraph | None = None
            if on_cuda:
                bare = BareGraph(model, x)
                row["methods"]["bare"] = {"max_rel_err": _max_rel_err(bare(x), ref)}
                row["methods"]["replay_only"] = {}
                methods["bare"] = lambda bare=bare, x=x: bare(x)
                methods["replay_only"] = bare.replay_only
            else:
                row["methods"]["bare"] = {"skipped": "skipped: needs CUDA"}
                row["methods"]["replay_only"] = {"skipped": "skipped: needs CUDA"}

            if use_compile:
                entry = _compile_point(
                    ctx,
                    compiled,
                    models,
                    encoder,
                    x,
                    ref,
                    sync,
                    reserve_s=_reserve(config_seconds, len(shapes) - index),
                    warmup=warmup,
                    log=compile_log,
                )
                row["methods"]["compile"] = entry
                if "error" not in entry and "skipped" not in entry:
                    fn = compiled[encoder]
                    methods["compile"] = lambda fn=fn, x=x: fn(x)
            else:
                row["methods"]["compile"] = {"skipped": compile_skip}

            for fn in methods.values():
                for _ in range(warmup):
                    fn()
            sync()
            before = adapter.get_cumulative_stats()
            samples: dict[str, list[float]] = {name: [] for name in methods}
            for _ in range(rounds):
                for name, fn in methods.items():
                    samples[name] += time_per_call(fn, per_round, sync=sync)
            after = adapter.get_cumulative_stats()
        for name, s in samples.items():
            row["methods"][name]["latency_us"] = summarize(s)
        timed = rounds * per_round
        row["adapter_timed_calls"] = timed
        row["adapter_hits"] = int(after["graph_hits"] - before["graph_hits"])
        row["adapter_misses"] = int(after["graph_misses"] - before["graph_misses"])
        row["adapter_stats"] = after
        row.update(_ratios(row["methods"]))
        ok_graph = all(
            (row["methods"][m].get("max_rel_err") or 0.0) <= GRAPH_TOLERANCE
            for m in ("adapter", "bare")
        )
        comp_err = row["methods"]["compile"].get("max_rel_err")
        row["outputs_match"] = ok_graph and (comp_err is None or comp_err <= COMPILE_TOLERANCE)
        rows.append(row)
        med = {n: row["methods"][n]["latency_us"]["median"] for n in samples}
        ctx.log("    " + ", ".join(f"{n} {v:,.0f} us" for n, v in med.items()))
        del methods, adapter, bare, ref, x
        free_cuda_memory()
        compile_s = row["methods"]["compile"].get("compile_s") or 0.0
        config_seconds.append(time.perf_counter() - started - compile_s)

    if compiled and on_cuda:
        with contextlib.suppress(Exception):
            torch._dynamo.reset()
    return {
        "dtype": str(dtype).removeprefix("torch."),
        "grad_mode": "no_grad",
        "timing": "synchronize before and after each call; perf_counter",
        "warmup": warmup,
        "per_round": per_round,
        "rounds": rounds,
        "geometries": {k: vars_of(g) for k, g in geoms.items()},
        "rows": rows,
        "compile_log": compile_log,
        "targets": _targets(rows),
        "simulated": ctx.simulate,
    }


def vars_of(geometry: Any) -> dict[str, int]:
    return {f: getattr(geometry, f) for f in ("hidden", "layers", "heads", "mlp")}


def _reserve(config_seconds: list[float], remaining_configs: int) -> float:
    per_config = max(config_seconds) if config_seconds else 10.0
    return per_config * remaining_configs + 5.0


def _compile_point(
    ctx: Context,
    compiled: dict[str, _Compiled],
    models: dict[str, torch.nn.Module],
    encoder: str,
    x: torch.Tensor,
    ref: torch.Tensor,
    sync: Callable[[], None],
    *,
    reserve_s: float,
    warmup: int,
    log: list[dict[str, Any]],
) -> dict[str, Any]:
    """Compile ``encoder`` for ``x``'s shape if the budget allows; describe the outcome."""
    comp = compiled.get(encoder)
    if comp is not None and comp.broken:
        return {"skipped": f"skipped: an earlier compile of {encoder} failed ({comp.broken})"}
    history = [d for c in compiled.values() for d in c.durations]
    estimate = max(history) if history else FIRST_COMPILE_GUESS_S
    available = ctx.remaining() - reserve_s
    if available < estimate:
        reason = (
            f"skipped: time budget ({available:.0f} s left for compiling, "
            f"a compile takes about {estimate:.0f} s)"
        )
        ctx.log(f"    compile {reason}")
        log.append({"encoder": encoder, "shape": list(x.shape), "skipped": reason})
        return {"skipped": reason}
    if comp is None:
        comp = compiled[encoder] = _Compiled(models[encoder], encoder)
    limit = min(MAX_COMPILE_S, max(available, estimate))
    start = time.perf_counter()
    try:
        with _time_limit(limit):
            out = comp(x).clone()
            sync()
            compile_s = time.perf_counter() - start
            # CUDA graph trees record on a later call; keep that out of the timed loop.
            for _ in range(max(3, warmup)):
                comp(x)
            sync()
    except Exception as exc:
        comp.broken = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:300]
        ctx.log(f"    compile failed: {comp.broken}")
        log.append({"encoder": encoder, "shape": list(x.shape), "error": comp.broken})
        return {"error": f"error: {comp.broken}", "compile_s": time.perf_counter() - start}
    comp.durations.append(compile_s)
    ctx.log(f"    compiled in {compile_s:.1f} s")
    log.append({"encoder": encoder, "shape": list(x.shape), "compile_s": compile_s})
    return {"compile_s": compile_s, "max_rel_err": _max_rel_err(out, ref)}


def _ratios(methods: dict[str, dict[str, Any]]) -> dict[str, float | None]:
    def med(name: str) -> float | None:
        s = methods.get(name, {}).get("latency_us")
        return None if s is None else float(s["median"])

    eager, adapter, bare, comp, replay = (
        med("eager"),
        med("adapter"),
        med("bare"),
        med("compile"),
        med("replay_only"),
    )
    return {
        "speedup_adapter_vs_eager": eager / adapter if eager and adapter else None,
        "speedup_bare_vs_eager": eager / bare if eager and bare else None,
        "speedup_compile_vs_eager": eager / comp if eager and comp else None,
        "adapter_over_bare": adapter / bare - 1 if adapter and bare else None,
        "adapter_over_compile": adapter / comp - 1 if adapter and comp else None,
        "bare_over_replay_only": bare / replay - 1 if bare and replay else None,
    }


def _targets(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    over_bare = [r["adapter_over_bare"] for r in rows if r.get("adapter_over_bare") is not None]
    over_comp = [
        r["adapter_over_compile"] for r in rows if r.get("adapter_over_compile") is not None
    ]
    compiled_rows = sum(1 for r in rows if "latency_us" in r["methods"].get("compile", {}))
    return [
        target(
            "adapter vs bare copy-replay-clone, worst shape",
            max(over_bare) * 100 if over_bare else None,
            "<=",
            ADAPTER_VS_BARE_TARGET * 100,
            "%",
            note="median latency ratio minus one",
        ),
        target(
            "adapter vs torch.compile reduce-overhead, worst shape",
            max(over_comp) * 100 if over_comp else None,
            "<",
            0.0,
            "%",
            note=f"negative: adapter faster; compiled at {compiled_rows} of {len(rows)} shapes",
        ),
        target(
            "outputs match eager (bf16 tolerance), shapes failing",
            float(sum(1 for r in rows if not r["outputs_match"])),
            "<=",
            0.0,
            "shapes",
        ),
        target(
            "timed adapter calls that were not hits",
            float(sum(r["adapter_timed_calls"] - r["adapter_hits"] for r in rows)),
            "<=",
            0.0,
            "calls",
        ),
    ]


def plot(result: dict[str, Any], out_dir: Path, plt: Any) -> list[Path]:
    """Draw median latency per method for every configuration, p10-p90 as error bars."""
    rows = result["rows"]
    names = ["eager", "adapter", "bare", "replay_only", "compile"]
    colors = ["tab:gray", "tab:blue", "tab:orange", "tab:olive", "tab:green"]
    width = 0.16
    fig, ax = plt.subplots(figsize=(max(8, 1.8 * len(rows)), 4.5))
    for i, (name, color) in enumerate(zip(names, colors, strict=True)):
        xs, ys, lo, hi = [], [], [], []
        for j, row in enumerate(rows):
            s = row["methods"].get(name, {}).get("latency_us")
            if s is None:
                continue
            xs.append(j + (i - 2) * width)
            ys.append(s["median"])
            lo.append(s["median"] - s["p10"])
            hi.append(s["p90"] - s["median"])
        if xs:
            ax.bar(xs, ys, width, yerr=[lo, hi], label=name, color=color, capsize=2)
    ax.set_xticks(range(len(rows)))
    ax.set_xticklabels([f"{r['label']}\nB={r['batch']}" for r in rows], fontsize=8)
    ax.set_ylabel("latency per call, us (median, p10-p90)")
    ax.set_title(f"Encoder latency ({result['dtype']})")
    ax.legend(fontsize=8)
    fig.tight_layout()
    path = out_dir / "latency.png"
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return [path]
