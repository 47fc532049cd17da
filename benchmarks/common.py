"""Shared plumbing for the benchmark scripts: run context, timing, statistics, targets, JSON,
plots.

Every benchmark module exposes ``NAME``, ``NEEDS_CUDA`` and ``run(ctx) -> dict``; it may also
expose ``plot(result, out_dir, plt) -> list[Path]``. The runner (``benchmarks.run``) adds the
environment, writes ``<out>/<NAME>.json`` and draws the plots; ``benchmarks.report`` turns
the JSON files into the markdown tables of ``BENCHMARKS.md``.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import functools
import gc
import json
import math
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

__all__ = [
    "SCALES",
    "BareGraph",
    "BenchmarkFailedError",
    "Context",
    "CudaUnavailableError",
    "GcClock",
    "cuda_status",
    "environment",
    "figure",
    "free_cuda_memory",
    "geometry_fields",
    "max_rel_err",
    "quantile",
    "rotated",
    "save_plot",
    "simulated_compile",
    "summarize",
    "target",
    "time_per_call",
    "write_json",
    "write_partial",
]

T = TypeVar("T")

#: Run sizes: ``full`` for the real report, ``quick`` for a short look, ``tiny`` for CI.
SCALES = ("full", "quick", "tiny")

MiB = 1 << 20
GiB = 1 << 30


class GcClock:
    """Count the interpreter's garbage collections and their time while ``armed`` is set.

    A ``gc.callbacks`` entry: append it around a timed window, remove it after.
    """

    def __init__(self) -> None:
        self.armed = False
        self.collections = 0
        self.oldest = 0
        """Collections of the oldest generation (2), which walk every tracked object."""
        self.seconds = 0.0
        self.longest_s = 0.0
        self._start = 0.0

    def __call__(self, phase: str, info: dict[str, Any]) -> None:
        if not self.armed:
            return
        if phase == "start":
            self._start = time.perf_counter()
            return
        took = time.perf_counter() - self._start
        self.collections += 1
        self.oldest += info.get("generation") == 2
        self.seconds += took
        self.longest_s = max(self.longest_s, took)

    def as_dict(self) -> dict[str, float | int]:
        return {
            "collections": self.collections,
            "oldest_generation": self.oldest,
            "seconds": self.seconds,
            "longest_s": self.longest_s,
        }


class CudaUnavailableError(RuntimeError):
    """A benchmark that measures CUDA was asked to run on a machine without a usable GPU."""


class BenchmarkFailedError(RuntimeError):
    """A benchmark ran to its end but part of it failed; ``result`` holds what it measured.

    The runner records the benchmark as failed (and the run's exit status as non-zero)
    while keeping every number that was measured.
    """

    def __init__(self, message: str, result: dict[str, Any]) -> None:
        super().__init__(message)
        self.result = result


@dataclass
class Context:
    """What a benchmark needs to know about this run.

    Args:
        scale: ``full``, ``quick`` or ``tiny`` (see :data:`SCALES`).
        out_dir: where JSON results and plots go.
        cuda: whether a usable CUDA device is present.
        simulate: run the CUDA benchmarks on CPU with the simulated backend and tiny
            encoders; it checks the plumbing only, and every number it produces is
            meaningless (results say ``"simulated": true``).
        batch4: time the latency shapes at batch 4 as well (full scale only).
    """

    scale: str = "full"
    out_dir: Path = field(default_factory=lambda: Path("bench-results"))
    cuda: bool = False
    simulate: bool = False
    batch4: bool = False
    log: Callable[[str], None] = field(default=lambda msg: print(msg, flush=True))
    deadline: float = math.inf
    """``time.monotonic()`` by which the whole run should be done (the runner sets it)."""
    environment: dict[str, Any] | None = None
    """The run's environment (the runner sets it), for results written before the end."""
    partials: dict[str, dict[str, Any]] = field(default_factory=dict)
    """The last result each benchmark wrote with :func:`write_partial`, by name: what the
    runner keeps when that benchmark raises."""

    def __post_init__(self) -> None:
        if self.scale not in SCALES:
            raise ValueError(f"scale: expected one of {', '.join(SCALES)}, got {self.scale!r}")

    def pick(self, full: T, quick: T, tiny: T) -> T:
        """Return the value for this run's scale."""
        return {"full": full, "quick": quick, "tiny": tiny}[self.scale]

    def remaining(self) -> float:
        """Seconds left before the run's deadline."""
        return self.deadline - time.monotonic()

    @property
    def device(self) -> torch.device:
        return torch.device("cuda") if self.cuda and not self.simulate else torch.device("cpu")

    @property
    def dtype(self) -> torch.dtype:
        """The encoders' dtype: bfloat16 on a CUDA device, float32 on the CPU."""
        return torch.bfloat16 if self.device.type == "cuda" else torch.float32

    def sync(self) -> None:
        """Wait for the device (a no-op on CPU)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize()

    @property
    def device_sync(self) -> Callable[[], None]:
        """``torch.cuda.synchronize`` on a CUDA device, else a no-op: a bare function for
        timed loops, where :meth:`sync`'s check would count in every sample."""
        return torch.cuda.synchronize if self.device.type == "cuda" else _no_sync


def _no_sync() -> None:
    """Nothing to wait for on the CPU."""


def cuda_status() -> tuple[bool, str]:
    """Return whether CUDA is usable here, and why not if it is not."""
    if not torch.cuda.is_available():
        build = torch.version.cuda or "none (CPU-only build)"
        return (
            False,
            f"torch.cuda.is_available() is False (torch {torch.__version__}, CUDA {build})",
        )
    try:
        x = torch.ones(4, device="cuda")
        torch.cuda.synchronize()
        if float(x.sum()) != 4.0:
            return False, "a CUDA smoke test computed a wrong result"
    except Exception as exc:
        return False, f"a CUDA smoke test failed: {type(exc).__name__}: {exc}"
    return True, torch.cuda.get_device_name()


def _git_commit() -> str | None:
    try:
        done = subprocess.run(
            ["git", "rev-parse", "HEAD"],
            capture_output=True,
            text=True,
            timeout=5,
            check=False,
            cwd=Path(__file__).resolve().parent,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip() or None if done.returncode == 0 else None


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
        "git_commit": _git_commit(),
        "gpu": None,
        "gpu_memory_bytes": None,
        "driver": None,
    }
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        env["gpu"] = props.name
        env["gpu_memory_bytes"] = int(props.total_memory)
        env["gpu_count"] = torch.cuda.device_count()
        env["driver"] = _driver_version()
    return env


def _driver_version() -> str | None:
    try:
        done = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=10,
            check=False,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    lines = done.stdout.strip().splitlines()
    return lines[0].strip() if done.returncode == 0 and lines else None


# -- statistics --------------------------------------------------------------------------


def quantile(ordered: Sequence[float], q: float) -> float:
    """The ``q`` quantile of ``ordered`` (sorted), interpolating linearly between ranks."""
    # Linear interpolation between closest ranks, like numpy's default.
    if len(ordered) == 1:
        return ordered[0]
    pos = q * (len(ordered) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def summarize(samples_s: Iterable[float], *, scale: float = 1e6) -> dict[str, float | int]:
    """Return median, p10, p90, mean and min of ``samples_s`` (seconds), times ``scale``.

    The default scale reports microseconds.
    """
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
    """Return ``names`` starting at ``round_index mod len(names)``, wrapping around.

    Timing rounds use it so every method (or arm) takes every position in a round equally
    often, and none always runs right after the same other one.
    """
    items = list(names)
    if not items:
        return items
    k = round_index % len(items)
    return items[k:] + items[:k]


def time_per_call(
    fn: Callable[[], object],
    iters: int,
    *,
    sync: Callable[[], None] | None = None,
) -> list[float]:
    """Time ``iters`` calls of ``fn`` one by one; return seconds per call.

    With ``sync``, the device is idle before each call starts and the call counts until the
    device finished it (the latency a caller waiting for the result sees).
    """
    perf = time.perf_counter
    samples: list[float] = []
    for _ in range(iters):
        if sync is not None:
            sync()
        start = perf()
        fn()
        if sync is not None:
            sync()
        samples.append(perf() - start)
    return samples


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
    """Record a target check; ``met`` is None when ``value`` could not be measured.

    ``goal`` names the performance goal the check belongs to (a key of
    ``benchmarks.report.GOALS``); the report's goals table lists every check that has one.
    """
    if op not in ("<=", ">=", "<", ">"):
        raise ValueError(f"op: expected one of <=, >=, <, >, got {op!r}")
    met: bool | None
    if value is None or not math.isfinite(value):
        met = None
    elif op == "<=":
        met = value <= limit
    elif op == ">=":
        met = value >= limit
    elif op == "<":
        met = value < limit
    else:
        met = value > limit
    return {
        "name": name,
        "value": value,
        "op": op,
        "limit": limit,
        "unit": unit,
        "met": met,
        "note": note,
        "goal": goal,
    }


def figure(
    name: str, value: float | None, unit: str, *, goal: str, note: str = ""
) -> dict[str, Any]:
    """Record a measured figure that has no bar of its own (a cost to report, not to pass)."""
    measured = value is not None and math.isfinite(value)
    return {
        "name": name,
        "value": value if measured else None,
        "unit": unit,
        "goal": goal,
        "note": note,
    }


def geometry_fields(geometry: Any) -> dict[str, int]:
    """An encoder geometry's sizes, as results record them."""
    return {f: getattr(geometry, f) for f in ("hidden", "layers", "heads", "mlp")}


def save_plot(plt: Any, fig: Any, path: Path) -> Path:
    """Lay ``fig`` out, write it to ``path`` as a PNG and close it; return ``path``."""
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


# -- memory ------------------------------------------------------------------------------


def sink_rows(sinks: Iterable[Any]) -> list[dict[str, Any]]:
    """Each sink's delivery counters from ``EventBus.statistics().sinks``, as JSON rows."""
    return [
        {
            "name": s.name,
            "delivered": s.delivered,
            "dropped": s.dropped,
            "disabled": s.disabled,
            "error": s.error,
        }
        for s in sinks
    ]


def free_cuda_memory() -> None:
    """Drop garbage and return cached device blocks so memory deltas start from a floor."""
    gc.collect()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def max_rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """Return ``max |out - ref| / max |ref|``, in float32."""
    ref32 = ref.float()
    scale = float(ref32.abs().max())
    return float((out.float() - ref32).abs().max()) / max(scale, 1e-12)


@contextlib.contextmanager
def simulated_compile(ctx: Context) -> Iterator[None]:
    """In a simulated run, make ``torch.compile`` default to ``backend="eager"``.

    Adapters with the ``compile`` switch call ``torch.compile`` themselves, possibly on their
    preparation thread; on CPU inductor would build C++ kernels for minutes, and the simulated
    numbers mean nothing anyway. Outside simulated runs this does nothing.
    """
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


# -- JSON --------------------------------------------------------------------------------


def _clean(obj: Any) -> Any:
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {str(k): _clean(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_clean(v) for v in obj]
    if isinstance(obj, (str, int, bool)) or obj is None:
        return obj
    if isinstance(obj, Path):
        return str(obj)
    if isinstance(obj, torch.dtype):
        return str(obj).removeprefix("torch.")
    return str(obj)


def write_json(path: Path, payload: dict[str, Any]) -> Path:
    """Write ``payload`` as strict JSON (non-finite floats become null), atomically.

    The text goes to a temporary file beside ``path`` first, so a reader (or a run killed
    mid-write) never sees half a file.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps(_clean(payload), indent=2, allow_nan=False)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text + "\n", encoding="utf-8")
    os.replace(tmp, path)
    return path


def write_partial(ctx: Context, name: str, result: dict[str, Any]) -> Path:
    """Write what benchmark ``name`` measured so far as ``<out>/<name>.json``, status partial.

    The runner overwrites the file with the final result; a run killed before that keeps
    this one (``benchmarks.report`` renders it, marked partial). A benchmark that raises
    keeps it too: the runner writes it back with status ``error``.
    """
    ctx.partials[name] = result
    payload = {
        "benchmark": name,
        "environment": ctx.environment or {},
        "status": "partial",
        "error": None,
        "result": result,
    }
    return write_json(ctx.out_dir / f"{name}.json", payload)


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
