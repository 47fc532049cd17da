"""Shared plumbing of the benchmarks: run context, statistics, targets, JSON, plots.

A benchmark module has ``NAME``, ``NEEDS_CUDA``, ``run(ctx) -> dict`` and maybe ``plot``."""

from __future__ import annotations

import contextlib
import datetime as _dt
import functools
import gc
import json
import math
import operator
import os
import platform
import shlex
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import torch

from omnitrace.demo import encoders as demo

T = TypeVar("T")

#: Run sizes: ``full`` for the real report, ``quick`` for a short look, ``tiny`` for CI.
SCALES = ("full", "quick", "tiny")


class GcClock:
    """A ``gc.callbacks`` entry counting collections and their time while ``armed``."""

    def __init__(self) -> None:
        self.armed = False
        self.collections = 0
        self.seconds = 0.0
        self._start = 0.0

    def __call__(self, phase: str, info: dict[str, Any]) -> None:
        if not self.armed:
            return
        if phase == "start":
            self._start = time.perf_counter()
        else:
            self.collections += 1
            self.seconds += time.perf_counter() - self._start


class BenchmarkFailedError(RuntimeError):
    """Part of a benchmark failed; ``result`` holds what it measured, which the runner keeps."""

    def __init__(self, message: str, result: dict[str, Any]) -> None:
        super().__init__(message)
        self.result = result


@dataclass
class Context:
    """What a benchmark needs to know about this run: its scale (:data:`SCALES`), where results
    go, whether CUDA is usable, whether the CUDA benchmarks run ``simulate``d on CPU (the
    simulated backend, tiny encoders: plumbing only, every number meaningless) and whether the
    latency shapes run at batch 4 too (full scale only)."""

    scale: str = "full"
    out_dir: Path = field(default_factory=lambda: Path("bench-results"))
    cuda: bool = False
    simulate: bool = False
    batch4: bool = False
    log: Callable[[str], None] = field(default=lambda msg: print(msg, flush=True))
    #: ``time.monotonic()`` by which the run should be done, and its environment (both set by
    #: the runner); the last result each benchmark wrote with :func:`write_partial`.
    deadline: float = math.inf
    environment: dict[str, Any] | None = None
    partials: dict[str, dict[str, Any]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.scale not in SCALES:
            raise ValueError(f"scale: expected one of {', '.join(SCALES)}, got {self.scale!r}")

    def pick(self, full: T, quick: T, tiny: T) -> T:
        return {"full": full, "quick": quick, "tiny": tiny}[self.scale]

    def remaining(self) -> float:
        return self.deadline - time.monotonic()

    @property
    def device(self) -> torch.device:
        return torch.device("cuda") if self.cuda and not self.simulate else torch.device("cpu")

    @property
    def dtype(self) -> torch.dtype:
        return torch.bfloat16 if self.device.type == "cuda" else torch.float32

    @property
    def device_sync(self) -> Callable[[], None]:
        """``torch.cuda.synchronize`` on a CUDA device, else a no-op (bare, for timed loops)."""
        return torch.cuda.synchronize if self.device.type == "cuda" else no_op


def no_op() -> None:
    pass


#: The CUDA smoke test, run in a child process (see :func:`cuda_probe`).
_PROBE = """
import json, torch
x = torch.ones(4, device="cuda")
torch.cuda.synchronize()
assert float(x.sum()) == 4.0, "a CUDA smoke test computed a wrong result"
props = torch.cuda.get_device_properties(0)
print(json.dumps({"name": props.name, "total_memory": int(props.total_memory),
                  "count": torch.cuda.device_count()}))
"""


@functools.cache
def cuda_probe() -> dict[str, Any] | str:
    """The CUDA device's name, memory and count, from a smoke test in a child process; or
    why CUDA is not usable here.

    In a child, because a CUDA context holds device memory (0.6 GiB on an H100) for as long
    as its process lives: made here, it would sit beside every server the engine suite
    starts, and take from the memory those servers' encoder graphs are captured in. A suite
    that computes on the device in this process makes its own context when it runs.
    """
    if not torch.cuda.is_available():
        build = torch.version.cuda or "none (CPU-only build)"
        return f"torch.cuda.is_available() is False (torch {torch.__version__}, CUDA {build})"
    try:
        done = subprocess.run(
            [sys.executable, "-c", _PROBE], capture_output=True, text=True, timeout=300
        )
    except (OSError, subprocess.SubprocessError) as exc:
        return f"a CUDA smoke test could not run: {type(exc).__name__}: {exc}"
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines:
        errors = done.stderr.strip().splitlines()
        last = errors[-1] if errors else f"exit status {done.returncode}"
        return f"a CUDA smoke test failed: {last}"
    found: dict[str, Any] = json.loads(lines[-1])
    return found


def cuda_status() -> tuple[bool, str]:
    """Return whether CUDA is usable here, and why not if it is not (the device's name if
    it is); this process makes no CUDA context for it (:func:`cuda_probe`)."""
    found = cuda_probe()
    if isinstance(found, str):
        return False, found
    return True, str(found["name"])


def output_lines(*command: str, timeout: float = 10.0) -> list[str] | None:
    """The lines ``command`` prints (run in this directory), or None when it fails or
    cannot run within ``timeout`` seconds."""
    here = Path(__file__).resolve().parent
    try:
        done = subprocess.run(
            command, capture_output=True, text=True, timeout=timeout, check=False, cwd=here
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip().splitlines() if done.returncode == 0 else None


def _first_line(*command: str) -> str | None:
    """The first line ``command`` prints, or None when it fails."""
    lines = output_lines(*command)
    return lines[0].strip() if lines else None


def environment(command: str | None = None) -> dict[str, Any]:
    """Describe the machine, the software and the command line of this run."""
    import omnitrace

    env: dict[str, Any] = {
        "date_utc": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "command": shlex.join(sys.argv) if command is None else command,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "omnitrace": omnitrace.__version__,
        "git_commit": _first_line("git", "rev-parse", "HEAD"),
        "gpu": None,
        "gpu_memory_bytes": None,
        "driver": None,
    }
    if isinstance(found := cuda_probe(), dict):
        env.update(gpu=found["name"], gpu_memory_bytes=found["total_memory"])
        env["gpu_count"] = found["count"]
        query = ("--query-gpu=driver_version", "--format=csv,noheader")
        env["driver"] = _first_line("nvidia-smi", *query)
    return env


# -- statistics --------------------------------------------------------------------------


def quantile(values: Iterable[float], q: float) -> float:
    """The ``q`` quantile of ``values``, linear between ranks as numpy's default."""
    ordered = sorted(values)
    pos = q * (len(ordered) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def summarize(samples_s: Iterable[float], *, scale: float = 1e6) -> dict[str, float | int]:
    """Count, median, p10, p90, mean and min of ``samples_s`` times ``scale`` (default: us)."""
    ordered = sorted(float(s) * scale for s in samples_s)
    if not ordered:
        raise ValueError("summarize() needs at least one sample")
    return {
        "n": len(ordered),
        "median": statistics.median(ordered),
        "p10": quantile(ordered, 0.10),
        "p90": quantile(ordered, 0.90),
        "mean": statistics.fmean(ordered),
        "min": ordered[0],
    }


def rotated(names: Sequence[T], round_index: int) -> list[T]:
    """``names`` from ``round_index mod len(names)`` on, wrapping: every method of a timing
    round takes every position equally often, and none always runs after the same other."""
    items = list(names)
    k = round_index % len(items) if items else 0
    return items[k:] + items[:k]


_OPS = {"<=": operator.le, ">=": operator.ge, "<": operator.lt, ">": operator.gt}


def target(
    name: str,
    value: float | None,
    op: str,
    limit: float,
    unit: str,
    *,
    note: str = "",
    goal: str = "",
) -> dict[str, Any]:
    """A target check (``met`` None when ``value`` was not measured); ``goal`` is a key of
    ``benchmarks.report.GOALS``, whose table lists the check."""
    if op not in _OPS:
        raise ValueError(f"op: expected one of <=, >=, <, >, got {op!r}")
    met = None if value is None or not math.isfinite(value) else _OPS[op](value, limit)
    return dict(
        name=name, value=value, op=op, limit=limit, unit=unit, met=met, note=note, goal=goal
    )


def figure(
    name: str, value: float | None, unit: str, *, goal: str, note: str = ""
) -> dict[str, Any]:
    """A measured figure with no bar of its own (a cost to report, not to pass)."""
    measured = value is not None and math.isfinite(value)
    return dict(name=name, value=value if measured else None, unit=unit, goal=goal, note=note)


def geometry_fields(geometry: Any) -> dict[str, int]:
    """An encoder geometry's sizes, as results record them."""
    return {f: getattr(geometry, f) for f in ("hidden", "layers", "heads", "mlp")}


def geometries(simulate: bool) -> dict[str, demo.EncoderGeometry]:
    """MiniCPM-o 4.5's vision and audio encoder sizes; the demo's tiny ones when ``simulate``."""
    if simulate:
        return {"vision": demo.VISION_TINY, "audio": demo.AUDIO_TINY}
    return {"vision": demo.VISION_FULL, "audio": demo.AUDIO_FULL}


def encoders(ctx: Context) -> dict[str, torch.nn.Module]:
    """The demo's vision and audio encoders of :func:`geometries`, on the run's device and dtype."""
    sizes = geometries(ctx.simulate)
    with torch.device(ctx.device):
        vision = demo.VisionEncoder(sizes["vision"]).to(ctx.dtype).eval()
        return {"vision": vision, "audio": demo.AudioEncoder(sizes["audio"]).to(ctx.dtype).eval()}


def save_plot(plt: Any, fig: Any, path: Path) -> Path:
    """Write ``fig`` to ``path`` as a PNG and close it; return ``path``."""
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def sink_rows(sinks: Iterable[Any]) -> list[dict[str, Any]]:
    """Each sink's delivery counters from ``EventBus.statistics().sinks``, as JSON rows."""
    fields = ("name", "delivered", "dropped", "disabled", "error")
    return [{f: getattr(s, f) for f in fields} for s in sinks]


def free_cuda_memory() -> None:
    """Drop garbage and cached device blocks, so memory deltas start from a floor."""
    gc.collect()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def max_rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """``max |out - ref| / max |ref|``, in float32."""
    ref32 = ref.float()
    scale = float(ref32.abs().max())
    return float((out.float() - ref32).abs().max()) / max(scale, 1e-12)


@contextlib.contextmanager
def simulated_compile(ctx: Context) -> Iterator[None]:
    """In a simulated run, make ``torch.compile`` default to ``backend="eager"`` (inductor
    would build C++ kernels for minutes on a CPU, for numbers that mean nothing)."""
    if not ctx.simulate:
        yield
        return
    original = torch.compile

    @functools.wraps(original)
    def eager_compile(*args: Any, **kwargs: Any) -> Any:
        kwargs.setdefault("backend", "eager")
        kwargs.pop("mode", None)  # modes are inductor options; the eager backend takes none
        return original(*args, **kwargs)

    torch.compile = eager_compile
    try:
        yield
    finally:
        torch.compile = original


def _clean(obj: Any) -> Any:
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {str(k): _clean(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_clean(v) for v in obj]
    if isinstance(obj, (str, int, bool)) or obj is None:
        return obj
    if isinstance(obj, torch.dtype):
        return str(obj).removeprefix("torch.")
    return str(obj)


def write_json(path: Path, payload: dict[str, Any]) -> Path:
    """Write ``payload`` as strict JSON (non-finite floats become null), atomically."""
    path.parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps(_clean(payload), indent=2, allow_nan=False)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text + "\n", encoding="utf-8")
    os.replace(tmp, path)
    return path


def write_partial(ctx: Context, name: str, result: dict[str, Any]) -> Path:
    """Write what benchmark ``name`` measured so far as ``<out>/<name>.json``, status partial
    (a killed run keeps it; one that raises keeps it with status ``error``)."""
    ctx.partials[name] = result
    payload = dict(benchmark=name, environment=ctx.environment or {}, status="partial", error=None)
    return write_json(ctx.out_dir / f"{name}.json", {**payload, "result": result})


class BareGraph:
    """``forward`` captured as PyTorch documents (warm-up on a side stream); a call copies
    the input in, replays and clones the output."""

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
