"""One latency configuration (encoder shape x batch), in a process of its own.

Usage (``benchmarks.latency`` runs it once per configuration)::

    python -X faulthandler -m benchmarks.latency_point --json SPEC --out RECORD.json

SPEC names the encoder, input size, batch, scale, timing settings and whether to compile
(with its time limit). The process builds that one encoder, checks the adapter captured,
captures the bare graph, and times eager, adapter, bare and replay-only, interleaved with
a rotating start. With a compile, it then compiles its own module for exactly this input
shape (nothing is recompiled for another shape in this process) and times every method
again, compile included; those second numbers are the row's.

RECORD.json is rewritten at every stage (``build``, ``timing``, ``compile``,
``timing_with_compile``, ``done``) with the row measured so far, so when the process dies
the parent knows where, and keeps the numbers measured before.
"""

from __future__ import annotations

import argparse
import copy
import faulthandler
import json
import os
import signal
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from benchmarks.common import BareGraph, summarize, write_json
from benchmarks.latency import (
    COMPILE_TOLERANCE,
    GRAPH_TOLERANCE,
    MAX_COMPILE_S,
    _Compiled,
    _geometries,
    _input,
    _max_rel_err,
    _ratios,
    _time_limit,
    time_rounds,
)
from omnitrace import EncoderCudaGraph, EncoderGraphConfig
from omnitrace.demo.encoders import AudioEncoder, VisionEncoder
from omnitrace.testing import SimulatedGraphBackend


class _Record:
    """The record file: the stage reached, the row so far, timings, and any error."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.started = time.perf_counter()
        self.data: dict[str, Any] = {"stage": "start", "row": None, "error": None, "timings": {}}

    def save(self, stage: str, row: dict[str, Any] | None = None, **fields: Any) -> None:
        self.data["stage"] = stage
        if row is not None:
            self.data["row"] = row
        self.data.update(fields)
        self.data["timings"]["elapsed_s"] = time.perf_counter() - self.started
        write_json(self.path, self.data)
        print(f"[{stage}] {self.data['timings']['elapsed_s']:.1f} s", flush=True)


def _fault(spec: dict[str, Any], stage: str) -> None:
    """Fail on purpose where the spec says (a test hook; real specs have no ``fault``)."""
    fault = spec.get("fault")
    if not fault or fault.get("stage", "timing") != stage:
        return
    kind = fault["kind"]
    print(f"injected fault: {kind} at {stage}", flush=True)
    if kind == "segv":
        faulthandler._sigsegv()
    elif kind == "abort":
        os.abort()
    elif kind == "exit":
        os._exit(3)
    elif kind == "hang":
        time.sleep(3600)
    elif kind == "raise":
        raise RuntimeError("injected failure")
    else:
        raise ValueError(f"unknown fault {kind!r}")


def _fill(
    row: dict[str, Any],
    samples: dict[str, list[float]],
    timed: int,
    hits: int,
    misses: int,
    stats: dict[str, Any],
) -> None:
    for name, s in samples.items():
        row["methods"][name]["latency_us"] = summarize(s)
    row["adapter_timed_calls"] = timed
    row["adapter_hits"] = hits
    row["adapter_misses"] = misses
    row["adapter_stats"] = stats
    row.update(_ratios(row["methods"]))
    ok_graph = all(
        (row["methods"].get(m, {}).get("max_rel_err") or 0.0) <= GRAPH_TOLERANCE
        for m in ("adapter", "bare")
    )
    comp_err = row["methods"].get("compile", {}).get("max_rel_err")
    row["outputs_match"] = ok_graph and (comp_err is None or comp_err <= COMPILE_TOLERANCE)


def measure(spec: dict[str, Any], record: _Record) -> dict[str, Any]:
    """Build, capture, (compile,) time one configuration; return its row."""
    simulate = bool(spec["simulate"])
    if simulate:
        # Tiny CPU forwards only lose from intra-op threads on a shared, busy CI machine.
        torch.set_num_threads(1)
    elif not torch.cuda.is_available():
        raise RuntimeError("CUDA is not available in the benchmark's child process")
    device = torch.device("cpu") if simulate else torch.device("cuda")
    dtype = torch.float32 if simulate else torch.bfloat16
    on_cuda = device.type == "cuda"
    sync: Callable[[], None] = torch.cuda.synchronize if on_cuda else (lambda: None)
    encoder, size, batch = spec["encoder"], int(spec["size"]), int(spec["batch"])
    warmup, per_round, cycles = int(spec["warmup"]), int(spec["per_round"]), int(spec["cycles"])
    geometry = _geometries(simulate)[encoder]
    timings = record.data["timings"]
    record.save("build")
    _fault(spec, "build")
    start = time.perf_counter()
    cls = VisionEncoder if encoder == "vision" else AudioEncoder
    with torch.device(device):
        model = cls(geometry).to(dtype).eval()
    x = _input(encoder, size, batch, geometry.hidden, device, dtype)
    row: dict[str, Any] = {
        "label": f"{encoder} {spec['what']}",
        "encoder": encoder,
        "size": size,
        "batch": batch,
        "input": f"({', '.join(map(str, x.shape))})",
        "methods": {},
    }
    methods: dict[str, Callable[[], object]] = {}
    with torch.no_grad():
        ref = model(x)
        sync()
        timings["build_s"] = time.perf_counter() - start
        row["output_shape"] = list(ref.shape)
        methods["eager"] = lambda: model(x)
        row["methods"]["eager"] = {}

        # The adapter, warmed until it captured this key.
        config = EncoderGraphConfig(min_free_bytes=0)
        backend = SimulatedGraphBackend() if simulate else None
        adapter = EncoderCudaGraph(
            model, name=f"{encoder}-{size}-b{batch}", config=config, backend=backend
        )
        for _ in range(config.min_capture_calls):
            adapter(x)
        sync()
        if adapter.num_graphs != 1:
            stats = adapter.get_cumulative_stats()
            raise RuntimeError(f"adapter did not capture {row['label']} batch {batch}: {stats}")
        row["methods"]["adapter"] = {"max_rel_err": _max_rel_err(adapter(x), ref)}
        methods["adapter"] = lambda: adapter(x)

        if on_cuda:
            bare = BareGraph(model, x)
            row["methods"]["bare"] = {"max_rel_err": _max_rel_err(bare(x), ref)}
            row["methods"]["replay_only"] = {}
            methods["bare"] = lambda: bare(x)
            methods["replay_only"] = bare.replay_only
        else:
            row["methods"]["bare"] = {"skipped": "skipped: needs CUDA"}
            row["methods"]["replay_only"] = {"skipped": "skipped: needs CUDA"}
        compiling = bool(spec.get("compile"))
        row["methods"]["compile"] = (
            {"pending": "compiled after the first timing"}
            if compiling
            else {"skipped": spec.get("compile_skip") or "skipped"}
        )
        timings["setup_s"] = time.perf_counter() - start

        def timed_phase() -> None:
            for fn in methods.values():
                for _ in range(warmup):
                    fn()
            sync()
            before = adapter.get_cumulative_stats()
            samples = time_rounds(
                methods,
                warmup=0,
                rounds=cycles * len(methods),
                per_round=per_round,
                sync=sync,
            )
            after = adapter.get_cumulative_stats()
            _fill(
                row,
                samples,
                timed=cycles * len(methods) * per_round,
                hits=int(after["graph_hits"] - before["graph_hits"]),
                misses=int(after["graph_misses"] - before["graph_misses"]),
                stats=after,
            )

        record.save("timing", row)
        _fault(spec, "timing")
        phase = time.perf_counter()
        timed_phase()
        timings["timing_s"] = time.perf_counter() - phase
        row["timed_with_compile"] = False
        if not compiling:
            return row

        record.save("compile", row)
        _fault(spec, "compile")
        entry, comp = _compile(model, x, ref, sync, spec, warmup)
        row["methods"]["compile"] = entry
        timings["compile_s"] = entry.get("compile_s")
        if comp is None:
            print(f"compile failed: {entry['error']}", flush=True)
            return row
        print(f"compiled in {entry['compile_s']:.1f} s", flush=True)
        methods["compile"] = lambda: comp(x)
        fused_entry, fused = _adapter_over_compiled(model, x, ref, sync, config, row["label"])
        row["methods"]["adapter_compiled"] = fused_entry
        if fused is not None:
            methods["adapter_compiled"] = lambda: fused(x)
        # Keep the first numbers, in case the process dies timing the compiled module.
        row["first_timing_median_us"] = {
            n: m["latency_us"]["median"] for n, m in row["methods"].items() if "latency_us" in m
        }
        record.save("timing_with_compile", row)
        _fault(spec, "timing_with_compile")
        phase = time.perf_counter()
        timed_phase()
        timings["timing_with_compile_s"] = time.perf_counter() - phase
        row["timed_with_compile"] = True
    return row


def _adapter_over_compiled(
    model: torch.nn.Module,
    x: torch.Tensor,
    ref: torch.Tensor,
    sync: Callable[[], None],
    config: EncoderGraphConfig,
    label: str,
) -> tuple[dict[str, Any], EncoderCudaGraph | None]:
    """Wrap ``torch.compile(model)`` (default mode: fused kernels, no CUDA graphs) in the adapter.

    The adapter's graph then captures inductor's fused kernels, which is how a deployment
    gets compile's fusion and the adapter's exact-shape graphs and telemetry together.
    """
    start = time.perf_counter()
    try:
        # A separate module object, so its compiled code never shares dynamo's cache entry
        # with the reduce-overhead module of this process.
        inner = torch.compile(copy.deepcopy(model), dynamic=False)
        fused = EncoderCudaGraph(inner, name=f"{label}-compiled", config=config)
        for _ in range(config.min_capture_calls):
            fused(x)
        sync()
        if fused.num_graphs != 1:
            return {"error": f"error: not captured: {fused.get_cumulative_stats()}"}, None
        entry = {
            "compile_s": time.perf_counter() - start,
            "max_rel_err": _max_rel_err(fused(x), ref),
        }
    except Exception as exc:
        first = str(exc).splitlines()[0] if str(exc) else ""
        traceback.print_exc()
        return {"error": f"error: {type(exc).__name__}: {first}"[:300]}, None
    print(f"adapter over torch.compile captured in {entry['compile_s']:.1f} s", flush=True)
    return entry, fused


def _compile(
    model: torch.nn.Module,
    x: torch.Tensor,
    ref: torch.Tensor,
    sync: Callable[[], None],
    spec: dict[str, Any],
    warmup: int,
) -> tuple[dict[str, Any], _Compiled | None]:
    """Compile ``model`` for ``x``'s shape within the spec's limit; describe the outcome."""
    limit = min(MAX_COMPILE_S, float(spec.get("compile_limit_s") or MAX_COMPILE_S))
    start = time.perf_counter()
    try:
        with _time_limit(limit):
            comp = _Compiled(model, spec["encoder"])
            out = comp(x).clone()
            sync()
            compile_s = time.perf_counter() - start
            # CUDA graph trees record on a later call; keep that out of the timed loop.
            for _ in range(max(3, warmup)):
                comp(x)
            sync()
    except Exception as exc:
        first = str(exc).splitlines()[0] if str(exc) else ""
        error = f"{type(exc).__name__}: {first}"[:300]
        traceback.print_exc()
        return {"error": f"error: {error}", "compile_s": time.perf_counter() - start}, None
    entry = {
        "compile_s": compile_s,
        "warm_s": time.perf_counter() - start - compile_s,
        "max_rel_err": _max_rel_err(out, ref),
    }
    return entry, comp


def main(argv: Sequence[str] | None = None) -> int:
    """Run one configuration; write its record; exit 0 when it finished, 1 on an error."""
    if not faulthandler.is_enabled():
        faulthandler.enable()
    if hasattr(signal, "SIGUSR1"):
        # The parent sends SIGUSR1 to a child past its timeout: dump where every thread is.
        faulthandler.register(signal.SIGUSR1, all_threads=True)
    parser = argparse.ArgumentParser(prog="python -m benchmarks.latency_point")
    parser.add_argument("--json", required=True, help="the configuration, as JSON")
    parser.add_argument("--out", required=True, type=Path, help="the record file to write")
    args = parser.parse_args(argv)
    spec = json.loads(args.json)
    record = _Record(args.out)
    try:
        row = measure(spec, record)
    except Exception as exc:
        traceback.print_exc()
        record.save(record.data["stage"], error=f"{type(exc).__name__}: {exc}"[:500])
        return 1
    record.save("done", row)
    return 0


if __name__ == "__main__":
    sys.exit(main())
