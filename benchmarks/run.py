"""Run the omnitrace benchmarks of the suites named (``python -m benchmarks.run --help``), in
this one process; write ``<out>/<name>.json``, ``summary.json`` and PNG plots; print a summary."""

from __future__ import annotations

import argparse
import contextlib
import faulthandler
import importlib
import shlex
import sys
import time
import traceback
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

from benchmarks.common import (
    BenchmarkFailedError,
    Context,
    cuda_status,
    environment,
    free_cuda_memory,
    write_json,
)
from benchmarks.report import text_summary
from benchmarks.suites import SUITES

#: Wall-clock budget of a whole run, by scale; the latency benchmark bounds torch.compile
#: by what is left of it (a compile that starts in time may end up to one compile past it).
TIME_BUDGET_S = {"full": 450.0, "quick": 120.0, "tiny": 60.0}


def _parse(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.run",
        description="Run omnitrace benchmarks; write JSON results and PNG plots.",
    )
    parser.add_argument(
        "--suite", default="all", help=f"comma-separated suites: {', '.join(SUITES)} (default: all)"
    )
    parser.add_argument("--quick", action="store_true", help="fewer shapes and iterations")
    parser.add_argument(
        "--out", type=Path, default=Path("bench-results"), help="output folder (bench-results)"
    )
    budget = (
        "seconds the whole run may take; torch.compile is skipped past it "
        "(default: 450, or 120 with --quick)"
    )
    parser.add_argument("--time-budget", type=float, help=budget)
    batch4 = "time the latency shapes at batch 4 too (about 1 to 2 minutes more)"
    parser.add_argument("--batch4", action="store_true", help=batch4)
    parser.add_argument("--no-plots", action="store_true", help="write JSON only")
    # For the test suite and for checking the plumbing without a GPU: numbers meaningless.
    parser.add_argument("--tiny", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--simulate", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(list(argv))
    names: list[str] = []
    for suite in (s.strip() for s in args.suite.split(",")):
        if suite not in SUITES:
            parser.error(f"--suite: unknown suite {suite!r} (valid: {', '.join(SUITES)})")
        names += [n for n in SUITES[suite] if n not in names]
    args.benchmarks = names
    args.cpu_only = args.suite.strip() == "cpu"
    return args


def _module(name: str) -> ModuleType:
    return importlib.import_module(f"benchmarks.{name}")


def _plots(module: ModuleType, result: dict[str, Any], out_dir: Path, ctx: Context) -> list[str]:
    plot = getattr(module, "plot", None)
    if plot is None:
        return []
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        ctx.log(f"  plots skipped: matplotlib is not installed ({module.NAME})")
        return []
    try:
        return [str(p) for p in plot(result, out_dir, plt)]
    except Exception as exc:
        ctx.log(f"  plot of {module.NAME} failed: {type(exc).__name__}: {exc}")
        return []


def run_benchmarks(
    names: Sequence[str],
    ctx: Context,
    *,
    command: str,
    plots: bool = True,
    time_budget: float | None = None,
) -> dict[str, dict[str, Any]]:
    """Run ``names`` in order; write one JSON file each and ``summary.json``; return them."""
    env = {**environment(command), "scale": ctx.scale, "simulated": ctx.simulate}
    ctx.environment = env
    budget = TIME_BUDGET_S[ctx.scale] if time_budget is None else time_budget
    ctx.deadline = time.monotonic() + budget
    # Plots are drawn before a benchmark's JSON is written: the folder must exist by then.
    ctx.out_dir.mkdir(parents=True, exist_ok=True)
    outputs: dict[str, dict[str, Any]] = {}
    for name in names:
        module = _module(name)
        ctx.log(f"== {name}")
        start = time.perf_counter()
        payload: dict[str, Any] = {"benchmark": name, "environment": env, "status": "ok"}
        payload.update(error=None, result=None)
        try:
            payload["result"] = module.run(ctx)
        except Exception as exc:
            payload["status"] = "error"
            payload["error"] = f"{type(exc).__name__}: {exc}"
            payload["traceback"] = traceback.format_exc()
            # Keep what was measured: the result a benchmark attached to its failure, or the
            # last partial result it wrote.
            payload["result"] = (
                exc.result if isinstance(exc, BenchmarkFailedError) else ctx.partials.get(name)
            )
            ctx.log(f"  FAILED: {payload['error']}")
            ctx.log(payload["traceback"])
        payload["duration_s"] = time.perf_counter() - start
        free_cuda_memory()
        if plots and payload["result"] is not None:
            payload["plots"] = _plots(module, payload["result"], ctx.out_dir, ctx)
        write_json(ctx.out_dir / f"{name}.json", payload)
        outputs[name] = payload
        ctx.log(f"  done in {payload['duration_s']:.1f} s -> {ctx.out_dir / (name + '.json')}")
    summary: dict[str, Any] = {"environment": env, "benchmarks": {}}
    for name, p in outputs.items():
        brief = {key: p[key] for key in ("status", "error", "duration_s")}
        summary["benchmarks"][name] = {**brief, "targets": (p["result"] or {}).get("targets", [])}
    write_json(ctx.out_dir / "summary.json", summary)
    return outputs


def _enable_faulthandler() -> None:
    """Dump every thread's traceback on a fatal signal (unless stderr has no descriptor)."""
    if not faulthandler.is_enabled():
        with contextlib.suppress(AttributeError, ValueError, OSError):
            faulthandler.enable()


def main(argv: Sequence[str] | None = None) -> int:
    """Parse the command line, check the device, run, print the summary; return the exit code."""
    argv = sys.argv[1:] if argv is None else list(argv)
    args = _parse(argv)
    _enable_faulthandler()
    scale = "tiny" if args.tiny else ("quick" if args.quick else "full")
    # Only --suite cpu runs overhead without its CUDA part; named on its own, it needs CUDA.
    cuda_overhead = () if args.cpu_only else ("overhead",)
    needs_cuda = [n for n in args.benchmarks if _module(n).NEEDS_CUDA or n in cuda_overhead]
    cuda_ok, cuda_info = cuda_status() if not args.cpu_only else (False, "not used by --suite cpu")
    if needs_cuda and not cuda_ok and not args.simulate:
        print(
            f"error: suite(s) {', '.join(needs_cuda)} need a CUDA device, "
            f"and there is none usable here: {cuda_info}.\n"
            "Run 'python -m benchmarks.run --suite cpu' on this machine, or the full suite "
            "on a CUDA machine.",
            file=sys.stderr,
        )
        return 2
    if args.simulate:
        # Tiny CPU forwards only lose from intra-op threads on a shared, busy CI machine.
        import torch

        torch.set_num_threads(1)
    ctx = Context(
        scale=scale, out_dir=args.out, cuda=cuda_ok, simulate=args.simulate, batch4=args.batch4
    )
    device = cuda_info if cuda_ok else "CPU"
    if args.simulate:
        device = "simulated on CPU (numbers meaningless)"
    ctx.log(f"omnitrace benchmarks: {', '.join(args.benchmarks)} [{scale}] on {device}")
    command = shlex.join(["python", "-m", "benchmarks.run", *argv])
    plots, budget = not args.no_plots, args.time_budget
    outputs = run_benchmarks(args.benchmarks, ctx, command=command, plots=plots, time_budget=budget)
    print(text_summary(outputs), flush=True)
    return 1 if any(p["status"] != "ok" for p in outputs.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
