"""Encoder latency: eager, adapter, bare graph, torch.compile, one process per configuration.

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

Each configuration (shape x batch) runs in a child process of its own
(``python -X faulthandler -m benchmarks.latency_point``, see that module): it builds its
encoder, compiles its own module for exactly one input shape, times, and writes its row.
A crash, a fatal signal or a hang of one configuration is recorded in its row (exit code,
signal name, the last lines of its stderr, with faulthandler's traceback) and the other
configurations still run. Each child gets a timeout derived from the run's time budget.
Rows are written to ``<out>/latency.json`` (status ``partial``) after every configuration,
so a run killed midway keeps what it measured.

Every call is timed from an idle device until the device finished it (synchronize +
perf_counter); methods are interleaved round by round, and round ``r`` starts at method
``r mod n``, so no method always runs right after the same other one.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from benchmarks.common import Context, rotated, target, time_per_call, write_partial
from omnitrace.demo.encoders import AUDIO_FULL, AUDIO_TINY, VISION_FULL, VISION_TINY

NAME = "latency"
NEEDS_CUDA = True

#: The adapter must stay within this of bare copy-replay-clone.
ADAPTER_VS_BARE_TARGET = 0.02
#: A graph replays the eager kernels, so outputs should agree almost exactly; compiled
#: kernels fuse differently and are held to a looser bf16 tolerance.
GRAPH_TOLERANCE = 1e-2
COMPILE_TOLERANCE = 1e-1
#: Guess of one torch.compile in a fresh process before any was measured (seconds).
FIRST_COMPILE_GUESS_S = 60.0
#: Hard cap on one compile, whatever the budget says.
MAX_COMPILE_S = 240.0
#: Guess of a child's time without its compile (start, imports, build, timing), until one
#: was measured.
FIRST_CHILD_GUESS_S = 25.0
#: A child never gets less than this before it is stopped (slow imports, a cold cache).
MIN_CHILD_TIMEOUT_S = 60.0
#: Lines of a child's stderr kept in the results.
STDERR_TAIL_LINES = 40
#: Seconds a timed-out child gets to dump its threads' tracebacks before it is killed.
DUMP_GRACE_S = 3.0
#: Test hook: ``"INDEX:KIND[:STAGE]"`` makes configuration INDEX fail on purpose, KIND one
#: of segv, abort, exit, hang, raise (see ``benchmarks.latency_point``).
FAULT_ENV = "OMNITRACE_BENCH_LATENCY_FAULT"

ROOT = Path(__file__).resolve().parents[1]


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


def _max_rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    ref32 = ref.float()
    scale = float(ref32.abs().max())
    return float((out.float() - ref32).abs().max()) / max(scale, 1e-12)


class _Compiled:
    """A torch.compile'd module (one per child process, compiled for one input shape)."""

    def __init__(self, model: torch.nn.Module, name: str) -> None:
        self.name = name
        self.fn = torch.compile(model, mode="reduce-overhead", dynamic=False)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        # Marks a new inference step so CUDA graph trees may reuse the previous outputs.
        torch.compiler.cudagraph_mark_step_begin()
        return self.fn(x)  # type: ignore[no-any-return]


def _geometries(simulate: bool) -> dict[str, Any]:
    if simulate:
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


def _input_shape(encoder: str, size: int, batch: int, hidden: int) -> tuple[int, ...]:
    return (batch, size, hidden) if encoder == "vision" else (batch, 80, size)  # mel x frames


def _input(
    encoder: str, size: int, batch: int, hidden: int, device: torch.device, dtype: torch.dtype
) -> torch.Tensor:
    gen = torch.Generator(device="cpu").manual_seed(size * 31 + batch)
    x = torch.randn(*_input_shape(encoder, size, batch, hidden), generator=gen)
    return x.to(device=device, dtype=dtype)


def time_rounds(
    methods: dict[str, Callable[[], object]],
    *,
    warmup: int,
    rounds: int,
    per_round: int,
    sync: Callable[[], None],
) -> dict[str, list[float]]:
    """Warm every method up, then time ``rounds`` rounds of ``per_round`` calls each.

    Round ``r`` runs the methods starting at ``r mod n`` (:func:`rotated`), so with
    ``rounds`` a multiple of ``n`` every method runs in every position equally often.
    """
    for fn in methods.values():
        for _ in range(warmup):
            fn()
    sync()
    samples: dict[str, list[float]] = {name: [] for name in methods}
    for r in range(rounds):
        for name in rotated(list(methods), r):
            samples[name] += time_per_call(methods[name], per_round, sync=sync)
    return samples


# -- the parent: one child process per configuration ------------------------------------


def _injected_faults() -> dict[int, dict[str, str]]:
    raw = os.environ.get(FAULT_ENV, "").strip()
    faults: dict[int, dict[str, str]] = {}
    for item in filter(None, (part.strip() for part in raw.split(","))):
        index, kind, *stage = item.split(":")
        faults[int(index)] = {"kind": kind, "stage": stage[0] if stage else "timing"}
    return faults


def _signal_name(returncode: int | None) -> str | None:
    if returncode is None or returncode >= 0:
        return None
    try:
        return signal.Signals(-returncode).name
    except ValueError:
        return f"signal {-returncode}"


def run_child(
    spec: dict[str, Any],
    work_dir: Path,
    *,
    timeout_s: float,
    log: Callable[[str], None],
) -> dict[str, Any]:
    """Run one configuration in ``python -X faulthandler -m benchmarks.latency_point``.

    Returns ``{"child": {...}, "record": {...} | None}``: how the child ended (status
    ``ok``, ``failed``, ``crashed`` or ``timeout``, exit code, signal name, last stage it
    reached, the tail of its stderr) and the last record it wrote (its row so far).
    A child still running after ``timeout_s`` gets SIGUSR1 (faulthandler dumps every
    thread's traceback to its stderr), then SIGKILL.
    """
    work_dir.mkdir(parents=True, exist_ok=True)
    index = spec["index"]
    record_path = work_dir / f"point-{index}.json"
    log_path = work_dir / f"point-{index}.log"
    record_path.unlink(missing_ok=True)
    cmd = [
        sys.executable,
        "-X",
        "faulthandler",
        "-m",
        "benchmarks.latency_point",
        "--json",
        json.dumps(spec),
        "--out",
        str(record_path),
    ]
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    env["PYTHONUNBUFFERED"] = "1"
    env.pop(FAULT_ENV, None)
    tail: deque[str] = deque(maxlen=STDERR_TAIL_LINES)
    write_lock = threading.Lock()
    start = time.perf_counter()
    timed_out = False
    with (
        open(log_path, "w", encoding="utf-8") as log_file,
        subprocess.Popen(
            cmd,
            cwd=ROOT,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            encoding="utf-8",
            errors="replace",
            bufsize=1,
        ) as proc,
    ):

        def pump(stream: Any, is_err: bool) -> None:
            for line in stream:
                text = line.rstrip("\n")
                with write_lock:
                    log_file.write(("[stderr] " if is_err else "") + text + "\n")
                if is_err:
                    tail.append(text)
                else:
                    log(f"    {text}")

        readers = [
            threading.Thread(target=pump, args=(proc.stdout, False), daemon=True),
            threading.Thread(target=pump, args=(proc.stderr, True), daemon=True),
        ]
        for reader in readers:
            reader.start()
        try:
            returncode = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            timed_out = True
            if hasattr(signal, "SIGUSR1"):
                with contextlib.suppress(OSError):
                    proc.send_signal(signal.SIGUSR1)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(timeout=DUMP_GRACE_S)
            if proc.poll() is None:
                proc.kill()
            returncode = proc.wait()
        for reader in readers:
            reader.join(timeout=10.0)
    duration = time.perf_counter() - start
    record: dict[str, Any] | None = None
    with contextlib.suppress(OSError, ValueError):
        record = json.loads(record_path.read_text(encoding="utf-8"))
    finished = record is not None and record.get("stage") == "done"
    if timed_out:
        status = "timeout"
    elif returncode < 0:
        status = "crashed"
    elif returncode != 0 or not finished:
        status = "failed"
    else:
        status = "ok"
    child = {
        "status": status,
        "exit_code": returncode,
        "signal": _signal_name(returncode),
        "stage": None if record is None else record.get("stage"),
        "error": None if record is None else record.get("error"),
        "duration_s": duration,
        "timeout_s": timeout_s,
        "timings": None if record is None else record.get("timings"),
        "stderr_tail": list(tail),
        "log": str(log_path),
    }
    return {"child": child, "record": record}


def _describe_end(child: dict[str, Any]) -> str:
    status = child["status"]
    if status == "timeout":
        how = f"timed out after {child['timeout_s']:.0f} s"
    elif status == "crashed":
        how = f"crashed ({child['signal']})"
    elif child["exit_code"] != 0:
        how = f"exited with status {child['exit_code']}"
    else:
        how = "exited without a result"
    where = f" during {child['stage']}" if child.get("stage") not in (None, "done") else ""
    error = f": {child['error']}" if child.get("error") else ""
    return f"{how}{where}{error}"


def _empty_row(shape: dict[str, Any], hidden: int) -> dict[str, Any]:
    dims = _input_shape(shape["encoder"], shape["size"], shape["batch"], hidden)
    return {
        "label": f"{shape['encoder']} {shape['what']}",
        "encoder": shape["encoder"],
        "size": shape["size"],
        "batch": shape["batch"],
        "input": f"({', '.join(map(str, dims))})",
        "methods": {},
        "adapter_timed_calls": 0,
        "adapter_hits": 0,
        "adapter_misses": 0,
        "outputs_match": None,
    }


def _row_from(
    shape: dict[str, Any], hidden: int, outcome: dict[str, Any], spec: dict[str, Any]
) -> dict[str, Any]:
    """Assemble the row of one configuration from what its child wrote and how it ended."""
    child, record = outcome["child"], outcome["record"]
    row = dict(record["row"]) if record and record.get("row") else _empty_row(shape, hidden)
    row["child"] = child
    if child["status"] == "ok":
        row["failure"] = None
        return row
    row["failure"] = _describe_end(child)
    methods = row.setdefault("methods", {})
    comp = methods.get("compile")
    if spec.get("compile") and (comp is None or "latency_us" not in comp):
        comp = dict(comp or {})
        comp.pop("pending", None)
        comp["error"] = f"error: the process {row['failure']}"
        methods["compile"] = comp
    return row


def _child_timeout(base_s: float, compile_limit_s: float | None) -> float:
    extra = 0.0 if compile_limit_s is None else compile_limit_s + 30.0
    return max(MIN_CHILD_TIMEOUT_S, 2.0 * base_s + extra)


def run(ctx: Context) -> dict[str, Any]:
    """Time every configuration, each in a child process; return rows, targets, settings."""
    on_cuda = ctx.device.type == "cuda"
    dtype = "float32" if ctx.simulate else "bfloat16"
    warmup = ctx.pick(10, 5, 2)
    per_round = ctx.pick(12, 10, 3)
    cycles = ctx.pick(2, 1, 1)
    use_compile = on_cuda and ctx.scale == "full"
    compile_skip = (
        "skipped: needs CUDA"
        if not on_cuda
        else ("skipped: --quick" if ctx.scale != "full" else None)
    )
    geoms = _geometries(ctx.simulate)
    shapes = _shapes(ctx)
    work_dir = ctx.out_dir / "latency-points"
    faults = _injected_faults()
    rows: list[dict[str, Any]] = []
    compile_log: list[dict[str, Any]] = []
    base_seconds: list[float] = []
    compile_seconds: list[float] = []

    def result() -> dict[str, Any]:
        return {
            "dtype": dtype,
            "grad_mode": "no_grad",
            "timing": "synchronize before and after each call; perf_counter",
            "isolation": "one child process per configuration: "
            "python -X faulthandler -m benchmarks.latency_point",
            "method_order": "round r starts at method r mod n",
            "warmup": warmup,
            "per_round": per_round,
            "rounds": f"{cycles} x number of methods",
            "geometries": {k: vars_of(g) for k, g in geoms.items()},
            "rows": rows,
            "compile_log": compile_log,
            "targets": _targets(rows),
            "simulated": ctx.simulate,
        }

    for index, shape in enumerate(shapes):
        encoder = shape["encoder"]
        label = f"{encoder} {shape['what']}"
        base_est = max(base_seconds) if base_seconds else FIRST_CHILD_GUESS_S
        # Keep time for the configurations after this one, each without a compile.
        available = ctx.remaining() - base_est * (len(shapes) - index - 1)
        spec: dict[str, Any] = {
            "index": index,
            **shape,
            "simulate": ctx.simulate,
            "scale": ctx.scale,
            "warmup": warmup,
            "per_round": per_round,
            "cycles": cycles,
            "compile": False,
            "compile_skip": compile_skip,
            "compile_limit_s": None,
        }
        if use_compile:
            room = available - base_est
            estimate = max(compile_seconds) if compile_seconds else FIRST_COMPILE_GUESS_S
            if room >= estimate:
                spec["compile"] = True
                spec["compile_skip"] = None
                spec["compile_limit_s"] = min(MAX_COMPILE_S, room)
            else:
                spec["compile_skip"] = (
                    f"skipped: time budget ({max(room, 0):.0f} s left for compiling, "
                    f"a compile takes about {estimate:.0f} s)"
                )
        if index in faults:
            spec["fault"] = faults[index]
        timeout = _child_timeout(base_est, spec["compile_limit_s"])
        dims = _input_shape(encoder, shape["size"], shape["batch"], geoms[encoder].hidden)
        ctx.log(
            f"  {label}, batch {shape['batch']}, input ({', '.join(map(str, dims))}): "
            f"child process, timeout {timeout:.0f} s"
            + ("" if spec["compile"] else f", compile {spec['compile_skip']}")
        )
        outcome = run_child(spec, work_dir, timeout_s=timeout, log=ctx.log)
        row = _row_from(shape, geoms[encoder].hidden, outcome, spec)
        rows.append(row)
        child = outcome["child"]
        comp = row["methods"].get("compile") or {}
        compile_s = comp.get("compile_s")
        if "compile_s" in comp and "error" not in comp:
            compile_seconds.append(float(compile_s))
        entry: dict[str, Any] = {"encoder": encoder, "batch": shape["batch"], "input": row["input"]}
        for key in ("compile_s", "skipped", "error"):
            if key in comp:
                entry[key] = comp[key]
        compile_log.append(entry)
        if child["status"] == "ok":
            base_seconds.append(child["duration_s"] - float(compile_s or 0.0))
        else:
            ctx.log(f"    FAILED: the child {row['failure']}")
            for line in child["stderr_tail"][-15:]:
                ctx.log(f"      | {line}")
        med = {n: m["latency_us"]["median"] for n, m in row["methods"].items() if "latency_us" in m}
        if med:
            ctx.log("    " + ", ".join(f"{n} {v:,.0f} us" for n, v in med.items()))
        write_partial(ctx, NAME, result())
    return result()


def vars_of(geometry: Any) -> dict[str, int]:
    return {f: getattr(geometry, f) for f in ("hidden", "layers", "heads", "mlp")}


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
    failed = [r for r in rows if r.get("failure")]
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
            float(sum(1 for r in rows if r.get("outputs_match") is False)),
            "<=",
            0.0,
            "shapes",
        ),
        target(
            "timed adapter calls that were not hits",
            float(sum(r.get("adapter_timed_calls", 0) - r.get("adapter_hits", 0) for r in rows)),
            "<=",
            0.0,
            "calls",
        ),
        target(
            "configurations whose process crashed, hung or failed",
            float(len(failed)),
            "<=",
            0.0,
            "configs",
            note="; ".join(f"{r['label']} batch {r['batch']}: {r['failure']}" for r in failed)[
                :500
            ],
        ),
    ]


def plot(result: dict[str, Any], out_dir: Path, plt: Any) -> list[Path]:
    """Draw median latency per method for every configuration, p10-p90 as error bars."""
    rows = result["rows"]
    names = ["eager", "adapter", "bare", "replay_only", "compile", "adapter_compiled"]
    colors = ["tab:gray", "tab:blue", "tab:orange", "tab:olive", "tab:green", "tab:purple"]
    width = 0.13
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
