"""Encoder latency: every method of every shape in one process, interleaved, medians per call.

For MiniCPM-o 4.5's encoders at full size (SigLIP so400m vision at 1024 and 256 tokens,
Whisper-medium audio at a 1-second chunk and a 30-second clip), batch 1 (the shapes the
performance goals name; ``--batch4`` adds batch 4), bf16 under ``torch.no_grad()``, the
methods ("arms", :data:`ARMS`, in this order):

* ``eager``: the module itself;
* ``bare``: a ``torch.cuda.CUDAGraph`` (:class:`benchmarks.common.BareGraph`) called as
  copy_ + replay + clone, the floor any graph wrapper is measured against;
* ``replay_only``: the same graph's ``replay()`` alone;
* ``adapter``: :class:`omnitrace.EncoderCudaGraph` with its default (torch) backend and no
  bus, hit path;
* ``adapter_bus``: the adapter on an :class:`omnitrace.EventBus` without sinks, so every hit
  feeds the folds the bus keeps (the stats fold, and any other the bus grows): their cost;
* ``adapter_timed``: the adapter with ``device_timing`` (CUDA events around every call,
  resolved off the call path; flushed, untimed, after each of its rounds): its cost;
* ``adapter_vllm``: the adapter on ``VllmGraphBackend(VllmConfig())`` (vLLM's encoder graph
  manager), when ``vllm.v1.worker.encoder_cudagraph`` can be imported;
* ``adapter_sinks``: the adapter on an :class:`omnitrace.EventBus` with the production sinks
  (OTel, structlog logs, JSONL event log), built as :mod:`benchmarks.observability` builds them;
* ``compile``: ``torch.compile(mode="reduce-overhead", dynamic=False)``;
* ``adapter_compiled``: the adapter with the ``compile`` switch
  (``EncoderGraphConfig(compile=True)``), which captures ``torch.compile(forward)`` in
  default mode per exact shape, so its graph replays inductor's fused kernels.

One process, no isolation. Every shape and every arm runs in the runner's own process, so the
graphs of both backends, reduce-overhead's CUDA-graph trees and the compiled modules live side
by side, as they do in a server. An exception while an arm is built is printed with its
traceback, recorded in its row, and fails the benchmark (and the run's exit status) once every
shape ran; an exception while timing fails it at once; a fatal signal ends the whole run, with
faulthandler's traceback. An arm that cannot run here (vLLM or a sink not importable, no CUDA,
``--quick``, a compile past the time budget) is recorded as skipped with its reason.
``latency.json`` is rewritten (status ``partial``) after every shape.

Timing. Every call is timed from an idle device until the device finished it (synchronize,
``perf_counter``); the host time from call to return is recorded as well. Arms are interleaved
round by round, and round ``r`` starts at arm ``r mod n``, so no arm always runs right after
the same other one. Timed adapter calls are checked to be hits with ``get_cumulative_stats()``
and outputs are checked against eager.

Compiles. Each compiling arm starts only when what is left of the run's time budget covers its
estimated compile time plus the shapes still to run. Shapes run in priority order (batch 1:
the 1-second audio chunk and vision at 256 tokens first, the shapes the performance goals
compare); rows are stored in display order. Dynamo's caches are reset after every shape, so each
shape compiles from scratch, as in a fresh process, and none reaches the recompile limit.

Adding an arm is one function decorated with :func:`arm`: it gets the shape's :class:`Point`
and returns a :class:`Timed` (or raises :class:`Skip`); its ratios to the arms named in ``vs``
are computed, and ``benchmarks.report`` shows it as a column.

Simulated (``--simulate``): tiny encoders on CPU; adapters use the simulated backend, the bare
graph is its steps on CPU (copy in, forward, copy out, clone), and the compiling arms use
``torch.compile(backend="eager")`` (:func:`benchmarks.common.simulated_compile`). The
plumbing runs; the numbers mean nothing.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import gc
import importlib
import importlib.metadata
import importlib.util
import os
import shutil
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from benchmarks.common import (
    BareGraph,
    BenchmarkFailedError,
    Context,
    figure,
    free_cuda_memory,
    geometry_fields,
    rotated,
    save_plot,
    simulated_compile,
    sink_rows,
    summarize,
    target,
    write_partial,
)
from omnitrace import EncoderCudaGraph, EncoderGraphConfig, EventBus
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

#: The adapter's hit path must stay within this of bare copy-replay-clone (both backends).
ADAPTER_VS_BARE_TARGET = 0.01
#: ... and within this much host time per call (microseconds).
HOST_OVER_BARE_TARGET_US = 3.0
#: The production sinks may add this much to the adapter's latency.
SINKS_VS_ADAPTER_TARGET = 0.01
#: A graph replays the eager kernels, so outputs should agree almost exactly; compiled
#: kernels fuse differently (other reduction orders, bf16 intermediates kept in registers)
#: and are held to a looser tolerance: max |out - eager| / max |eager|.
GRAPH_TOLERANCE = 1e-2
COMPILE_TOLERANCE = 1e-1
#: Seconds the device timings of one round may take to resolve after it.
TIMING_FLUSH_S = 10.0
#: Guesses (seconds) used until this run measured one: a compile (the first in a process
#: also pays for inductor's start-up), and one shape without its compiles.
FIRST_COMPILE_GUESS_S = {"cuda": 60.0, "simulated": 10.0}
FIRST_SHAPE_GUESS_S = {"cuda": 20.0, "simulated": 2.0}
#: A measured compile time, scaled by this, is the estimate of the next one of that arm.
COMPILE_MARGIN = 1.25

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


# -- arms --------------------------------------------------------------------------------


class Skip(Exception):
    """An arm cannot run here; ``reason`` (a few words) and ``detail`` go into its row."""

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(reason)
        self.reason = reason
        self.detail = detail


@dataclass
class Timed:
    """An arm built for one shape: the call to time and what goes with it.

    Args:
        call: one call of the method; returns its output (checked against eager once).
        adapter: the adapter whose hits the timed calls must be.
        window: a context entered around each of the arm's rounds (sink threads that must
            run only while the arm is timed).
        settle: run, untimed, after each of the arm's rounds (drain the sinks' queues, so
            their backlog never lands in another arm's round).
        info: extra fields for the arm's entry in the row (compile time).
        report: returns fields added to the arm's entry once its rounds are timed.
    """

    call: Callable[[], Any]
    adapter: EncoderCudaGraph | None = None
    window: Callable[[], contextlib.AbstractContextManager[Any]] | None = None
    settle: Callable[[], None] | None = None
    info: dict[str, Any] = field(default_factory=dict)
    report: Callable[[], dict[str, Any]] | None = None


@dataclass(frozen=True)
class Arm:
    """A method timed at every shape (see :func:`arm`)."""

    name: str
    title: str
    build: Callable[[Point], Timed]
    vs: tuple[str, ...]
    tolerance: float | None
    compiles: bool


#: Every arm, in the order they are built at each shape (compiling arms last, so the
#: adapters' graphs already exist when reduce-overhead records its own).
ARMS: list[Arm] = []


def arm(
    name: str,
    title: str,
    *,
    vs: Sequence[str] = (),
    tolerance: float | None = GRAPH_TOLERANCE,
    compiles: bool = False,
) -> Callable[[Callable[[Point], Timed]], Callable[[Point], Timed]]:
    """Register a builder as an arm.

    Args:
        name: key of the arm in the results.
        title: column title in the report.
        vs: arms this one is compared with (median latency ratio and host time difference).
        tolerance: largest relative error of its output against eager; None: not checked.
        compiles: the arm compiles, so it runs only when the time budget allows.
    """

    def register(build: Callable[[Point], Timed]) -> Callable[[Point], Timed]:
        ARMS.append(Arm(name, title, build, tuple(vs), tolerance, compiles))
        return build

    return register


@arm("eager", "eager")
def _eager(p: Point) -> Timed:
    return Timed(lambda: p.model(p.x))


@arm("bare", "bare graph", vs=("replay_only",))
def _bare(p: Point) -> Timed:
    graph = BareGraph(p.model, p.x) if p.run.on_cuda else _CpuBare(p.model, p.x)
    p.built["bare"] = graph
    return Timed(lambda: graph(p.x))


@arm("replay_only", "replay only", tolerance=None)
def _replay_only(p: Point) -> Timed:
    graph = p.built.get("bare")
    if graph is None:
        raise Skip("no bare graph", "the bare arm did not build")
    return Timed(graph.replay_only)


@arm("adapter", "adapter, torch", vs=("bare", "compile"))
def _adapter(p: Point) -> Timed:
    adapter = p.captured_adapter("adapter")
    return Timed(lambda: adapter(p.x), adapter=adapter)


@arm("adapter_bus", "adapter + bus", vs=("bare", "adapter"))
def _adapter_bus(p: Point) -> Timed:
    bus = EventBus()
    p.closers.append(bus.close)
    adapter = p.captured_adapter("bus", bus=bus)
    return Timed(lambda: adapter(p.x), adapter=adapter)


@arm("adapter_timed", "adapter + device timing", vs=("bare", "adapter"))
def _adapter_timed(p: Point) -> Timed:
    config = dataclasses.replace(p.run.config, device_timing=True)
    adapter = p.captured_adapter("timed", config=config)
    flushes: list[bool] = []

    def settle() -> None:
        # Untimed: resolving is the timer thread's job; waiting here only keeps one round's
        # timings from resolving during another arm's round.
        flushes.append(adapter.flush_device_timing(TIMING_FLUSH_S))

    settle()
    return Timed(
        lambda: adapter(p.x),
        adapter=adapter,
        settle=settle,
        report=lambda: {
            "timing_flushes": len(flushes),
            "timings_resolved": all(flushes),
        },
    )


@arm("adapter_vllm", "adapter, vLLM", vs=("bare", "adapter"))
def _adapter_vllm(p: Point) -> Timed:
    from omnitrace.graphs.backends.vllm import VllmGraphBackend

    backend = VllmGraphBackend(p.run.vllm_config())
    adapter = p.captured_adapter("vllm", backend=backend)
    return Timed(lambda: adapter(p.x), adapter=adapter)


@arm("adapter_sinks", "adapter + sinks", vs=("adapter",))
def _adapter_sinks(p: Point) -> Timed:
    sinks = p.run.sinks()
    adapter = p.captured_adapter("sinks", bus=sinks.bus)
    return Timed(lambda: adapter(p.x), adapter=adapter, window=sinks.active, settle=p.run.flush)


@arm("compile", "reduce-overhead", vs=("bare",), tolerance=COMPILE_TOLERANCE, compiles=True)
def _reduce_overhead(p: Point) -> Timed:
    start = time.perf_counter()
    fn = p.run.compile(p.model, mode="reduce-overhead")
    on_cuda = p.run.on_cuda

    def call() -> Any:
        if on_cuda:
            # A new inference step: CUDA-graph trees may reuse the previous call's outputs.
            torch.compiler.cudagraph_mark_step_begin()  # type: ignore[no-untyped-call]
        return fn(p.x)

    call()
    p.sync()
    compile_s = time.perf_counter() - start
    # CUDA-graph trees record on a later call; keep that out of the timed loop.
    for _ in range(3):
        call()
    p.sync()
    warm_s = time.perf_counter() - start - compile_s
    return Timed(call, info={"compile_s": compile_s, "warm_s": warm_s})


@arm(
    "adapter_compiled",
    "adapter over torch.compile",
    vs=("bare", "compile"),
    tolerance=COMPILE_TOLERANCE,
    compiles=True,
)
def _adapter_compiled(p: Point) -> Timed:
    start = time.perf_counter()
    config = dataclasses.replace(p.run.config, compile=True)
    # A module object of its own, so its compiled code never shares dynamo's cache entry
    # with the reduce-overhead module. The adapter compiles at its capture, so the time to
    # a captured graph is the compile time.
    adapter = p.captured_adapter("compiled", forward=copy.deepcopy(p.model), config=config)
    return Timed(
        lambda: adapter(p.x),
        adapter=adapter,
        info={"compile_s": time.perf_counter() - start},
    )


class _CpuBare:
    """The bare graph's steps on CPU (simulated runs): copy in, forward, copy out, clone."""

    def __init__(self, forward: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> None:
        self.forward = forward
        self.static_in = x.clone()
        self.static_out = forward(self.static_in).clone()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        self.static_in.copy_(x)
        self.static_out.copy_(self.forward(self.static_in))
        return self.static_out.clone()

    def replay_only(self) -> None:
        self.static_out.copy_(self.forward(self.static_in))


# -- the run -----------------------------------------------------------------------------


@dataclass(frozen=True)
class Shape:
    """One configuration: encoder, input size, batch; ``order`` is its display position."""

    encoder: str
    what: str
    size: int
    batch: int
    order: int

    @property
    def label(self) -> str:
        return f"{self.encoder} {self.what}"


def shapes(ctx: Context) -> list[Shape]:
    """Return the shapes to time in the order they run: batch 1 first, priority shapes first."""
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


def _geometries(simulate: bool) -> dict[str, Any]:
    if simulate:
        return {"vision": VISION_TINY, "audio": AUDIO_TINY}
    return {"vision": VISION_FULL, "audio": AUDIO_FULL}


def _input_shape(encoder: str, size: int, batch: int, hidden: int) -> tuple[int, ...]:
    return (batch, size, hidden) if encoder == "vision" else (batch, 80, size)  # mel x frames


def _input(
    encoder: str, size: int, batch: int, hidden: int, device: torch.device, dtype: torch.dtype
) -> torch.Tensor:
    gen = torch.Generator(device="cpu").manual_seed(size * 31 + batch)
    x = torch.randn(*_input_shape(encoder, size, batch, hidden), generator=gen)
    return x.to(device=device, dtype=dtype)


def _max_rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    ref32 = ref.float()
    scale = float(ref32.abs().max())
    return float((out.float() - ref32).abs().max()) / max(scale, 1e-12)


class Run:
    """What every shape of one run shares: device, settings, vLLM, the production sinks.

    vLLM is imported once, before the first shape, so every shape is measured in the same
    process state (importing vLLM patches ``torch.cuda.set_stream`` process-wide).
    """

    def __init__(self, ctx: Context) -> None:
        self.ctx = ctx
        self.simulate = ctx.simulate
        self.on_cuda = ctx.device.type == "cuda"
        self.device = ctx.device
        self.dtype = ctx.dtype
        self.config = EncoderGraphConfig(min_free_bytes=0)
        self.workdir = Path(tempfile.mkdtemp(prefix="omnitrace-latency-"))
        self.flushed = True
        self.vllm: dict[str, Any] = {}
        self.sink_report: dict[str, Any] = {}
        self._vllm_config: Any = None
        self._vllm_skip: Skip | None = None
        self._sinks: Any = None
        self._sinks_skip: Skip | None = None
        self._sinks_error: str | None = None

    def sync(self) -> None:
        if self.on_cuda:
            torch.cuda.synchronize()

    # -- vLLM ------------------------------------------------------------------------

    def load_vllm(self) -> None:
        """Import vLLM's encoder graph module when it can be used; record what happened."""
        if importlib.util.find_spec("vllm") is None:
            self._vllm_skip = Skip("vLLM not importable", "no module named 'vllm'")
        elif not self.on_cuda:
            self._vllm_skip = Skip("needs CUDA", "vLLM's graph manager captures CUDA graphs")
        else:
            os.environ.setdefault("VLLM_TARGET_DEVICE", "cuda")
            start = time.perf_counter()
            try:
                importlib.import_module("vllm.v1.worker.encoder_cudagraph")
            except Exception as exc:  # a broken install fails in many ways; all mean "cannot"
                self._vllm_skip = Skip("vLLM not importable", f"{type(exc).__name__}: {exc}")
            self.vllm["import_s"] = time.perf_counter() - start
        if self._vllm_skip is not None:
            self.vllm.update(
                status="skipped", reason=self._vllm_skip.reason, detail=self._vllm_skip.detail
            )
            return
        self.vllm.update(status="on", version=importlib.metadata.version("vllm"))

    def vllm_config(self) -> Any:
        """Return the run's ``VllmConfig()``, made on first use; raise Skip without vLLM."""
        if self._vllm_skip is not None:
            raise self._vllm_skip
        if self._vllm_config is None:
            from vllm.config import VllmConfig

            self._vllm_config = VllmConfig()
        return self._vllm_config

    # -- sinks -----------------------------------------------------------------------

    def _load_sinks(self) -> None:
        """Build the production sinks on one bus; record which could not be built and why."""
        from benchmarks.observability import PRODUCTION_SINKS, SinkSet

        bus = EventBus(queue_size=100_000)
        sinks = SinkSet(bus, PRODUCTION_SINKS, self.workdir, "latency")
        self.sink_report = {"requested": list(PRODUCTION_SINKS), "sinks": sinks.report}
        self.ctx.log(
            "    production sinks: "
            + ", ".join(f"{n} {s['status']}" for n, s in sinks.report.items())
        )
        off = {n: s for n, s in sinks.report.items() if s["status"] != "on"}
        if not off:
            self._sinks = sinks
            return
        sinks.close()
        bus.close()
        reasons = "; ".join(f"{n}: {s['reason']}" for n, s in off.items())
        if all(s.get("not_importable") for s in off.values()):
            self._sinks_skip = Skip("sink not importable", reasons)
        else:
            self._sinks_error = f"a production sink could not be built: {reasons}"

    def sinks(self) -> Any:
        """Return the production sink set (a ``SinkSet``), built on first use.

        Raises:
            Skip: a sink's library cannot be imported.
            RuntimeError: a sink could not be built for another reason.
        """
        if not self.sink_report:
            self._load_sinks()
        if self._sinks_skip is not None:
            raise self._sinks_skip
        if self._sinks_error is not None:
            raise RuntimeError(self._sinks_error)
        return self._sinks

    def flush(self) -> None:
        if self._sinks is not None:
            self.flushed &= self._sinks.bus.flush(timeout=30.0)

    def sink_statistics(self) -> dict[str, Any]:
        """Return what the sinks' bus counted: events emitted and dropped, per sink."""
        if self._sinks is None:
            return {**self.sink_report, "status": "skipped" if self.sink_report else "unused"}
        self.flush()
        stats = self._sinks.bus.statistics()
        return {
            **self.sink_report,
            "status": "on",
            "flushed": self.flushed,
            "emitted": stats.emitted,
            "dropped": stats.dropped,
            "per_sink": sink_rows(stats.sinks),
        }

    # -- compiling -------------------------------------------------------------------

    def compile(self, model: torch.nn.Module, *, mode: str | None) -> Callable[..., Any]:
        """Return ``torch.compile(model)`` for one exact shape (``backend="eager"`` on CPU)."""
        if not self.on_cuda:
            return torch.compile(model, backend="eager", dynamic=False)
        return torch.compile(model, mode=mode, dynamic=False)

    def close(self) -> None:
        if self._sinks is not None:
            self._sinks.close()
            self._sinks.bus.close()
            self._sinks = None
        shutil.rmtree(self.workdir, ignore_errors=True)


@dataclass
class Point:
    """One shape, as every arm's builder gets it: model, input, eager output, the run."""

    shape: Shape
    model: torch.nn.Module
    x: torch.Tensor
    ref: torch.Tensor
    run: Run
    built: dict[str, Any] = field(default_factory=dict)
    """Objects an arm leaves for later ones (the bare graph, for ``replay_only``)."""
    closers: list[Callable[[], Any]] = field(default_factory=list)
    """Called once the shape is measured (an arm's own bus)."""

    def sync(self) -> None:
        self.run.sync()

    def captured_adapter(
        self,
        name: str,
        *,
        backend: Any = None,
        bus: EventBus | None = None,
        forward: Callable[..., Any] | None = None,
        config: EncoderGraphConfig | None = None,
    ) -> EncoderCudaGraph:
        """Return an adapter of the model (or ``forward``), warmed until it captured ``x``.

        Raises:
            RuntimeError: the adapter did not capture exactly one graph.
        """
        config = self.run.config if config is None else config
        adapter = EncoderCudaGraph(
            self.model if forward is None else forward,
            name=f"{self.shape.encoder}-{self.shape.size}-b{self.shape.batch}-{name}",
            config=config,
            bus=bus,
            backend=SimulatedGraphBackend() if self.run.simulate else backend,
        )
        for _ in range(config.min_capture_calls):
            adapter(self.x)
        self.sync()
        if adapter.num_graphs != 1:
            raise RuntimeError(
                f"{name}: the adapter did not capture {self.shape.label} batch "
                f"{self.shape.batch}: {adapter.get_cumulative_stats()}"
            )
        return adapter


class Budget:
    """Decide whether a compiling arm may start, from what is left of the run's time."""

    def __init__(self, ctx: Context, shapes_total: int) -> None:
        kind = "simulated" if ctx.simulate else "cuda"
        self.ctx = ctx
        self.first_compile_s = FIRST_COMPILE_GUESS_S[kind]
        self.first_shape_s = FIRST_SHAPE_GUESS_S[kind]
        self.compile_s: dict[str, float] = {}
        self.shape_s: list[float] = []
        self.shapes_left = shapes_total

    def check(self, arm_name: str) -> None:
        """Raise Skip when this arm's compile would not leave time for the shapes after it."""
        if self.ctx.scale == "quick":
            raise Skip("--quick", "torch.compile runs in full runs only")
        estimate = self.compile_s.get(
            arm_name, max(self.compile_s.values(), default=self.first_compile_s)
        )
        # This shape's timing and every shape after it, each without compiles.
        reserve = (max(self.shape_s) if self.shape_s else self.first_shape_s) * self.shapes_left
        room = self.ctx.remaining() - reserve
        if room < estimate:
            raise Skip(
                "time budget",
                f"{max(room, 0.0):.0f} s left for compiling, a compile takes about "
                f"{estimate:.0f} s",
            )

    def compiled(self, arm_name: str, seconds: float) -> None:
        self.compile_s[arm_name] = seconds * COMPILE_MARGIN

    def shape_done(self, seconds_without_compiles: float) -> None:
        self.shape_s.append(seconds_without_compiles)
        self.shapes_left -= 1


def time_rounds(
    arms: dict[str, Timed],
    *,
    rounds: int,
    per_round: int,
    sync: Callable[[], None],
) -> dict[str, dict[str, list[float]]]:
    """Time ``rounds`` rounds of ``per_round`` calls of every arm; return host and latency.

    Round ``r`` runs the arms starting at ``r mod n`` (:func:`rotated`), so with ``rounds`` a
    multiple of ``n`` every arm runs in every position equally often. Each call starts on
    an idle device; ``host`` ends when the call returns, ``latency`` when the device is done.
    """
    perf = time.perf_counter
    samples: dict[str, dict[str, list[float]]] = {
        name: {"host": [], "latency": []} for name in arms
    }
    for r in range(rounds):
        for name in rotated(list(arms), r):
            timed = arms[name]
            host, latency = samples[name]["host"], samples[name]["latency"]
            with timed.window() if timed.window is not None else contextlib.nullcontext():
                for _ in range(per_round):
                    sync()
                    start = perf()
                    timed.call()
                    returned = perf()
                    sync()
                    done = perf()
                    host.append(returned - start)
                    latency.append(done - start)
            if timed.settle is not None:
                timed.settle()
    return samples


def _warm(arms: dict[str, Timed], calls: int, sync: Callable[[], None]) -> None:
    for timed in arms.values():
        with timed.window() if timed.window is not None else contextlib.nullcontext():
            for _ in range(calls):
                timed.call()
            sync()
        if timed.settle is not None:
            timed.settle()


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
        point.sync()
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
        err = _max_rel_err(out, point.ref)
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
    """Build every arm for ``shape``, time them interleaved; return the shape's row.

    Raises:
        Exception: whatever a timed call raised (the benchmark fails at once).
    """
    geometry = _geometries(run.simulate)[shape.encoder]
    start = time.perf_counter()
    cls = VisionEncoder if shape.encoder == "vision" else AudioEncoder
    with torch.device(run.device):
        model = cls(geometry).to(run.dtype).eval()
    x = _input(shape.encoder, shape.size, shape.batch, geometry.hidden, run.device, run.dtype)
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
    row["timings"] = timings
    row["rounds"] = rounds
    row.update(compare(row["methods"]))
    row["outputs_match"] = all(
        e.get("within_tolerance", True) for e in row["methods"].values() if "error" not in e
    )
    return row


def _measure_arms(
    point: Point,
    budget: Budget,
    settings: dict[str, int],
    row: dict[str, Any],
    start: float,
) -> tuple[dict[str, float], int]:
    """Build the arms into ``row``, time them; return phase timings and the rounds run."""
    run = point.run
    timings: dict[str, float] = {"build_s": time.perf_counter() - start}
    arms: dict[str, Timed] = {}
    for spec in ARMS:
        timed = _build(spec, point, budget, row, run.ctx.log)
        if timed is not None:
            arms[spec.name] = timed
    timings["arms_s"] = time.perf_counter() - start - timings["build_s"]

    phase = time.perf_counter()
    rounds = settings["cycles"] * len(arms)
    _warm(arms, settings["warmup"], run.sync)
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
    """Return each arm's ratios to the arms it names in ``vs``, and its speed-up over eager.

    ``ratios["a_over_b"]`` is median latency of a over b, minus one; ``host_over_us`` the
    difference of median host times per call in microseconds.
    """

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
    """Time every arm at every shape in this process; return rows, targets, settings.

    Raises:
        BenchmarkFailedError: an arm failed to build at some shape (the result is attached).
    """
    settings = {
        "warmup": ctx.pick(10, 5, 2),
        "per_round": ctx.pick(12, 10, 3),
        "cycles": ctx.pick(2, 1, 1),
    }
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
            "arms": [
                {
                    "name": a.name,
                    "title": a.title,
                    "vs": list(a.vs),
                    "tolerance": a.tolerance,
                    "compiles": a.compiles,
                }
                for a in ARMS
            ],
            "shape_order": [f"{s.label} batch {s.batch}" for s in order],
            "geometries": {k: geometry_fields(g) for k, g in _geometries(ctx.simulate).items()},
            "vllm": state.vllm,
            "sinks": sinks,
            "rows": sorted(rows, key=lambda r: r["order"]),
            "targets": _targets(rows, sinks),
            "figures": _figures(rows),
            "simulated": ctx.simulate,
        }

    try:
        state.load_vllm()
        ctx.log(_describe_vllm(state.vllm))
        with torch.no_grad(), simulated_compile(ctx):
            for i, shape in enumerate(order):
                hidden = _geometries(ctx.simulate)[shape.encoder].hidden
                dims = _input_shape(shape.encoder, shape.size, shape.batch, hidden)
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
                # A compile that failed may have left dynamo state behind as well.
                _release(compiled=any("skipped" not in e for e in compiling))
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


def _release(*, compiled: bool) -> None:
    """Drop the shape's objects; reset dynamo after compiles, as a fresh process would be."""
    gc.collect()
    if compiled:
        torch._dynamo.reset()
    free_cuda_memory()


def _describe_vllm(vllm: dict[str, Any]) -> str:
    if vllm.get("status") == "on":
        return f"  vLLM {vllm['version']}: imported in {vllm.get('import_s', 0.0):.1f} s"
    return f"  vLLM arm skipped: {vllm['reason']} ({vllm['detail']})"


def _describe_row(row: dict[str, Any]) -> str:
    med = {n: m["latency_us"]["median"] for n, m in row["methods"].items() if "latency_us" in m}
    parts = [f"{n} {v:,.0f}" for n, v in med.items()]
    ratios = [
        f"{k.replace('_over_', '/')} {v * 100:+.2f} %"
        for k, v in row["ratios"].items()
        if v is not None
    ]
    host = [
        f"{k.replace('_over_', '-')} {v:+.1f}"
        for k, v in row["host_over_us"].items()
        if v is not None and k.endswith("_over_bare")
    ]
    lines = [f"    median us: {', '.join(parts)}"]
    if ratios:
        lines.append(f"    ratios: {', '.join(ratios)}")
    if host:
        lines.append(f"    host us over bare: {', '.join(host)}")
    return "\n".join(lines)


def _skip_note(rows: list[dict[str, Any]], name: str) -> str:
    entries = [r["methods"].get(name) for r in rows]
    reasons = sorted(
        {
            "not an arm of this run" if e is None else e.get("skipped") or e.get("error", "")
            for e in entries
            if e is None or "latency_us" not in e
        }
        - {""}
    )
    return f"; not measured: {', '.join(reasons)}" if reasons else ""


def _worst(
    rows: list[dict[str, Any]],
    table: str,
    key: str,
    *,
    scale: float = 1.0,
    encoder: str | None = None,
) -> tuple[float | None, str]:
    picked = [r for r in rows if encoder is None or r["encoder"] == encoder]
    values = [r[table][key] for r in picked if r[table].get(key) is not None]
    note = f"measured at {len(values)} of {len(picked)} shapes"
    return (max(values) * scale if values else None), note


def _targets(rows: list[dict[str, Any]], sinks: dict[str, Any]) -> list[dict[str, Any]]:
    def ratio(
        name: str,
        key: str,
        op: str,
        limit: float,
        encoder: str | None = None,
        goal: str = "",
    ) -> dict[str, Any]:
        value, note = _worst(rows, "ratios", key, scale=100.0, encoder=encoder)
        arm_name = key.split("_over_")[0]
        return target(
            name, value, op, limit, "%", note=note + _skip_note(rows, arm_name), goal=goal
        )

    def host(name: str, key: str) -> dict[str, Any]:
        value, note = _worst(rows, "host_over_us", key)
        arm_name = key.split("_over_")[0]
        return target(
            name,
            value,
            "<=",
            HOST_OVER_BARE_TARGET_US,
            "us",
            note="median host time per call, difference; " + note + _skip_note(rows, arm_name),
            goal="hit_path",
        )

    adapter_entries = [
        e for r in rows for e in r["methods"].values() if e.get("timed_calls") is not None
    ]
    lost_events = None
    if sinks.get("status") == "on":
        lost_events = float(
            sinks["dropped"]
            + sum(s["dropped"] + bool(s["error"] or s["disabled"]) for s in sinks["per_sink"])
            + (not sinks["flushed"])
        )
    mismatched = [
        (r["label"], r["batch"], name)
        for r in rows
        for name, e in r["methods"].items()
        if e.get("within_tolerance") is False
    ]
    compiled = [
        (r["label"], r["batch"], r["methods"]["adapter_compiled"]["max_rel_err"])
        for r in rows
        if (r["methods"].get("adapter_compiled") or {}).get("max_rel_err") is not None
    ]
    worst_compiled = max(compiled, key=lambda c: c[2], default=None)
    timed = [e for r in rows if "timings_resolved" in (e := r["methods"].get("adapter_timed", {}))]
    return [
        ratio(
            "adapter (torch) vs bare copy-replay-clone, worst shape",
            "adapter_over_bare",
            "<=",
            ADAPTER_VS_BARE_TARGET * 100,
            goal="hit_path",
        ),
        host("adapter (torch) host time over bare, worst shape", "adapter_over_bare"),
        ratio(
            "adapter (vLLM) vs bare copy-replay-clone, worst shape",
            "adapter_vllm_over_bare",
            "<=",
            ADAPTER_VS_BARE_TARGET * 100,
            goal="hit_path",
        ),
        host("adapter (vLLM) host time over bare, worst shape", "adapter_vllm_over_bare"),
        ratio(
            "adapter with a bus (its folds) vs bare copy-replay-clone, worst shape",
            "adapter_bus_over_bare",
            "<=",
            ADAPTER_VS_BARE_TARGET * 100,
            goal="hit_path",
        ),
        host(
            "adapter with a bus (its folds) host time over bare, worst shape",
            "adapter_bus_over_bare",
        ),
        ratio(
            "adapter with production sinks vs adapter, worst shape",
            "adapter_sinks_over_adapter",
            "<=",
            SINKS_VS_ADAPTER_TARGET * 100,
            goal="observability",
        ),
        ratio(
            "adapter vs torch.compile reduce-overhead, worst shape",
            "adapter_over_compile",
            "<",
            0.0,
        ),
        ratio(
            "compiled adapter vs bare, worst audio shape",
            "adapter_compiled_over_bare",
            "<",
            0.0,
            encoder="audio",
            goal="compiled",
        ),
        ratio(
            "compiled adapter vs reduce-overhead, worst audio shape",
            "adapter_compiled_over_compile",
            "<",
            0.0,
            encoder="audio",
            goal="compiled",
        ),
        target(
            "compiled adapter output vs eager, max relative error, worst shape",
            None if worst_compiled is None else worst_compiled[2],
            "<=",
            COMPILE_TOLERANCE,
            "",
            note="max |out - eager| / max |eager| at the first call; "
            + (
                "not measured" + _skip_note(rows, "adapter_compiled")
                if worst_compiled is None
                else f"worst at {worst_compiled[0]} batch {worst_compiled[1]}, "
                f"measured at {len(compiled)} of {len(rows)} shapes"
            ),
            goal="compiled",
        ),
        target(
            "outputs match eager (bf16 tolerance), arms failing",
            float(len(mismatched)),
            "<=",
            0.0,
            "arms",
            note="; ".join(f"{label} batch {batch}: {name}" for label, batch, name in mismatched),
        ),
        target(
            "timed adapter calls that were not hits",
            float(sum(e["timed_calls"] - e["hits"] for e in adapter_entries)),
            "<=",
            0.0,
            "calls",
            note=f"every adapter arm at every shape ({len(adapter_entries)} timed)",
        ),
        target(
            "events the production sinks dropped or failed on",
            lost_events,
            "<=",
            0.0,
            "events",
            note="bus and per-sink drops, sinks disabled by an error, a flush that timed out"
            + ("" if lost_events is not None else f"; sinks {sinks.get('status')}"),
        ),
        target(
            "device timings left unresolved after a round",
            float(sum(not e["timings_resolved"] for e in timed)) if timed else None,
            "<=",
            0.0,
            "shapes",
            note=f"flush_device_timing({TIMING_FLUSH_S:g} s) after every round of the timed "
            f"adapter; measured at {len(timed)} of {len(rows)} shapes",
            goal="coverage_costs",
        ),
    ]


def _figures(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Return the hit-path costs of the bus's folds and of device timing, worst shape."""
    out = []
    for arm_name, what in (
        ("adapter_bus", "the bus's folds (adapter + bus - adapter)"),
        ("adapter_timed", "device timing (adapter + device timing - adapter)"),
    ):
        key = f"{arm_name}_over_adapter"
        host_us, host_note = _worst(rows, "host_over_us", key)
        pct, pct_note = _worst(rows, "ratios", key, scale=100.0)
        skipped = _skip_note(rows, arm_name)
        out += [
            figure(
                f"hit-path cost of {what}: host time, worst shape",
                host_us,
                "us",
                goal="coverage_costs",
                note="median host time per call, difference; " + host_note + skipped,
            ),
            figure(
                f"hit-path cost of {what}: latency, worst shape",
                pct,
                "%",
                goal="coverage_costs",
                note="median latency per call, ratio; " + pct_note + skipped,
            ),
        ]
    return out


#: Plot colours, by arm; an arm without one gets matplotlib's next colour.
COLORS = {
    "eager": "tab:gray",
    "bare": "tab:orange",
    "replay_only": "tab:olive",
    "adapter": "tab:blue",
    "adapter_bus": "tab:brown",
    "adapter_timed": "tab:pink",
    "adapter_vllm": "tab:cyan",
    "adapter_sinks": "tab:purple",
    "compile": "tab:green",
    "adapter_compiled": "tab:red",
}


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
            ax.bar(
                xs,
                ys,
                width,
                yerr=[lo, hi],
                label=titles[name],
                color=COLORS.get(name),
                capsize=2,
            )
    ax.set_xticks(range(len(rows)))
    ax.set_xticklabels([f"{r['label']}\nB={r['batch']}" for r in rows], fontsize=8)
    ax.set_ylabel("latency per call, us (median, p10-p90)")
    ax.set_title(f"Encoder latency ({result['dtype']}, one process)")
    ax.legend(fontsize=7, ncol=2)
    return [save_plot(plt, fig, out_dir / "latency.png")]
