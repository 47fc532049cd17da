"""The latency benchmark's arms: each one function decorated with :func:`arm`, given the
shape's :class:`Point` (the run's state, model, input, eager output), returning a :class:`Timed`
or raising :class:`Skip`."""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import importlib
import importlib.metadata
import importlib.util
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from benchmarks.common import BareGraph, Context, no_op, sink_rows
from benchmarks.observability_sinks import PRODUCTION_SINKS, SinkSet
from omnitrace import EncoderCudaGraph, EncoderGraphConfig, EventBus
from omnitrace.testing import SimulatedGraphBackend

#: Largest max |out - eager| / max |eager|: graphs replay the eager kernels; compiled kernels
#: fuse and reorder (BENCHMARKS.md, "Method").
GRAPH_TOLERANCE = 1e-2
COMPILE_TOLERANCE = 1e-1
#: Seconds the device timings of one round may take to resolve after it.
TIMING_FLUSH_S = 10.0


class Skip(Exception):
    """An arm cannot run here; ``reason`` (a few words) and ``detail`` go into its row."""

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(reason)
        self.reason = reason
        self.detail = detail


@dataclass
class Timed:
    """An arm built for one shape: ``call`` (its output checked against eager once), the
    ``adapter`` whose hits the timed calls must be, a ``window`` entered around each of its
    rounds, what to ``settle`` untimed after each, extra fields for its entry (``info``), and
    a ``report`` of fields added once its rounds are timed."""

    call: Callable[[], Any]
    adapter: EncoderCudaGraph | None = None
    window: Callable[[], contextlib.AbstractContextManager[Any]] = contextlib.nullcontext
    settle: Callable[[], None] = no_op
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
    """Register a builder as arm ``name`` (``title`` in the report), compared with the arms
    ``vs``, its output held to ``tolerance`` (None: not checked); one that ``compiles`` runs
    only when the time budget allows."""

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
        # Keeps one round's timings from resolving during another arm's round.
        flushes.append(adapter.flush_device_timing(TIMING_FLUSH_S))

    settle()
    return Timed(
        lambda: adapter(p.x),
        adapter=adapter,
        settle=settle,
        report=lambda: {"timing_flushes": len(flushes), "timings_resolved": all(flushes)},
    )


@arm("adapter_vllm", "adapter, vLLM", vs=("bare", "adapter"))
def _adapter_vllm(p: Point) -> Timed:
    from omnitrace.graphs.backends.vllm import VllmGraphBackend

    adapter = p.captured_adapter("vllm", backend=VllmGraphBackend(p.run.vllm_config()))
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
    p.run.sync()
    compile_s = time.perf_counter() - start
    # CUDA-graph trees record on a later call; keep that out of the timed loop.
    for _ in range(3):
        call()
    p.run.sync()
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
        lambda: adapter(p.x), adapter=adapter, info={"compile_s": time.perf_counter() - start}
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


class Run:
    """What every shape of one run shares: device, settings, vLLM (imported once, before the
    first shape: it patches ``torch.cuda.set_stream`` process-wide), the production sinks."""

    def __init__(self, ctx: Context) -> None:
        self.ctx = ctx
        self.simulate = ctx.simulate
        self.on_cuda = ctx.device.type == "cuda"
        self.sync = ctx.device_sync
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
        self._sinks_failure: Exception | None = None

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
        if (skip := self._vllm_skip) is not None:
            self.vllm.update(status="skipped", reason=skip.reason, detail=skip.detail)
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

    def _load_sinks(self) -> None:
        """Build the production sinks on one bus; record which could not be built and why."""
        bus = EventBus(queue_size=100_000)
        sinks = SinkSet(bus, PRODUCTION_SINKS, self.workdir, "latency")
        self.sink_report = {"requested": list(PRODUCTION_SINKS), "sinks": sinks.report}
        states = ", ".join(f"{n} {s['status']}" for n, s in sinks.report.items())
        self.ctx.log(f"    production sinks: {states}")
        off = {n: s for n, s in sinks.report.items() if s["status"] != "on"}
        if not off:
            self._sinks = sinks
            return
        sinks.close()
        bus.close()
        reasons = "; ".join(f"{n}: {s['reason']}" for n, s in off.items())
        if all(s.get("not_importable") for s in off.values()):
            self._sinks_failure = Skip("sink not importable", reasons)
        else:
            self._sinks_failure = RuntimeError(f"a production sink could not be built: {reasons}")

    def sinks(self) -> Any:
        """The production ``SinkSet``, built on first use; Skip when a sink's library cannot be
        imported, RuntimeError when a sink cannot be built for another reason."""
        if not self.sink_report:
            self._load_sinks()
        if self._sinks_failure is not None:
            raise self._sinks_failure
        return self._sinks

    def flush(self) -> None:
        if self._sinks is not None:
            self.flushed &= self._sinks.bus.flush(timeout=30.0)

    def sink_statistics(self) -> dict[str, Any]:
        """What the sinks' bus counted: events emitted and dropped, per sink."""
        if self._sinks is None:
            return {**self.sink_report, "status": "skipped" if self.sink_report else "unused"}
        self.flush()
        stats = self._sinks.bus.statistics()
        counts = dict(emitted=stats.emitted, dropped=stats.dropped, per_sink=sink_rows(stats.sinks))
        return {**self.sink_report, "status": "on", "flushed": self.flushed, **counts}

    def compile(self, model: torch.nn.Module, *, mode: str | None) -> Callable[..., Any]:
        """``torch.compile(model)`` for one exact shape (``backend="eager"`` on CPU)."""
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
    #: Objects an arm leaves for later ones (the bare graph), and what to call once the shape
    #: is measured (an arm's own bus).
    built: dict[str, Any] = field(default_factory=dict)
    closers: list[Callable[[], Any]] = field(default_factory=list)

    def captured_adapter(
        self,
        name: str,
        *,
        backend: Any = None,
        bus: EventBus | None = None,
        forward: Callable[..., Any] | None = None,
        config: EncoderGraphConfig | None = None,
    ) -> EncoderCudaGraph:
        """An adapter of the model (or ``forward``) warmed until it captured ``x``, exactly one
        graph (RuntimeError otherwise)."""
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
        self.run.sync()
        if adapter.num_graphs != 1:
            raise RuntimeError(
                f"{name}: the adapter did not capture {self.shape.label} batch "
                f"{self.shape.batch}: {adapter.get_cumulative_stats()}"
            )
        return adapter
