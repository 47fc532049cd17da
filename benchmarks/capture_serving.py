"""The capture benchmark's modes, its client threads, the co-tenant called beside them, and
one timed pass over the stream."""

from __future__ import annotations

import contextlib
import functools
import itertools
import threading
import time
import traceback
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch

from benchmarks.common import max_rel_err, quantile
from benchmarks.traffic import Request
from omnitrace import EncoderCudaGraph, EncoderGraphConfig, Event, GraphMissed

CLIENTS = 2
#: Graphs per encoder and client: the default four, for each client's replay stream.
GRAPHS_PER_CLIENT = 4
#: Every fifth request is checked against eager; the main thread calls the co-tenant once per
#: five requests served, looking whether it is due every half millisecond.
CHECK_EVERY = COTENANT_EVERY = 5
COTENANT_POLL_S = 0.0005
#: Graphs replay the eager kernels; compiled graphs run inductor's fused kernels.
GRAPH_TOLERANCE = 1e-2
COMPILE_TOLERANCE = 1e-1
#: Characters of an exception message kept in the result.
ERROR_CHARS = 500


@dataclass(frozen=True)
class Mode:
    """One way of capturing: the config switches, the output tolerance they allow, whether the
    co-tenant is called beside the clients, whether graphs capture at all."""

    name: str
    title: str
    background: bool
    compile: bool
    tolerance: float
    clients: int = CLIENTS
    cotenant: bool = True
    graphs: bool = True

    def config(self) -> EncoderGraphConfig:
        return EncoderGraphConfig(
            enabled=self.graphs,
            max_graphs=GRAPHS_PER_CLIENT * self.clients,
            background_capture=self.background,
            compile=self.compile,
        )


MODES = (
    Mode(
        "sync_one_client",
        "synchronous capture, one client (reference)",
        False,
        False,
        GRAPH_TOLERANCE,
        clients=1,
    ),
    Mode("sync", "synchronous capture (default)", False, False, GRAPH_TOLERANCE),
    Mode("background", "background capture", True, False, GRAPH_TOLERANCE),
    # The compiled mode and its references run without the co-tenant: PyTorch's FX-tracing
    # flag is process-wide, so a compiled call on another thread during a compile raises.
    Mode(
        "eager",
        "no graphs, every request eager (reference)",
        False,
        False,
        GRAPH_TOLERANCE,
        cotenant=False,
        graphs=False,
    ),
    Mode(
        "background_compiled",
        "background compiled capture",
        True,
        True,
        COMPILE_TOLERANCE,
        cotenant=False,
    ),
    # Last: the compile caches the mode before left can only shorten the waits it is read by.
    Mode(
        "sync_compiled",
        "synchronous compiled capture (reference)",
        False,
        True,
        COMPILE_TOLERANCE,
        cotenant=False,
    ),
)


def tail(samples_s: list[float]) -> dict[str, float | int]:
    """Count, p50, p90, p99, max and mean of ``samples_s``, in microseconds."""
    ordered = sorted(s * 1e6 for s in samples_s)
    if not ordered:
        raise ValueError("tail() needs at least one sample")
    return {
        "n": len(ordered),
        "p50": quantile(ordered, 0.50),
        "p90": quantile(ordered, 0.90),
        "p99": quantile(ordered, 0.99),
        "max": ordered[-1],
        "mean": sum(ordered) / len(ordered),
    }


class Client:
    """A thread with a CUDA stream of its own running the jobs it is given, in order, for the
    whole benchmark (per-thread state is set up once)."""

    def __init__(self, index: int, on_cuda: bool) -> None:
        self.index = index
        self.stream: Any = torch.cuda.Stream() if on_cuda else None  # type: ignore[no-untyped-call]
        self._thread = ThreadPoolExecutor(1, thread_name_prefix=f"bench-client-{index}")

    def start(self) -> None:
        self._thread.submit(int).result()

    def submit(self, job: Callable[[], Any]) -> Future[Any]:
        return self._thread.submit(self._run, job)

    def stop(self) -> None:
        self._thread.shutdown()

    def sync(self) -> None:
        if self.stream is not None:
            self.stream.synchronize()

    def _run(self, job: Callable[[], Any]) -> Any:
        # Grad mode is per thread: the adapter serves no_grad calls only.
        with torch.no_grad(), torch.cuda.stream(self.stream):
            return job()


class CoTenant:
    """A reduce-overhead compiled encoder at a shape of its own, checked on every call."""

    def __init__(self, model: torch.nn.Module, x: torch.Tensor, on_cuda: bool) -> None:
        self.x = x
        with torch.no_grad():
            self.ref = model(x)
        self.on_cuda = on_cuda
        self.fn = torch.compile(model, mode="reduce-overhead", dynamic=False)
        self.calls = 0
        self.wrong = 0
        self.max_rel_err = 0.0
        self.lock = threading.Lock()

    def call(self) -> None:
        with torch.no_grad():
            self._call()

    def _call(self) -> None:
        if self.on_cuda:
            # A new inference step: CUDA-graph trees may reuse the previous call's outputs.
            torch.compiler.cudagraph_mark_step_begin()  # type: ignore[no-untyped-call]
        out = self.fn(self.x)
        err = max_rel_err(out, self.ref)
        with self.lock:
            self.calls += 1
            self.max_rel_err = max(self.max_rel_err, err)
            if err > COMPILE_TOLERANCE:
                self.wrong += 1

    def counts(self) -> tuple[int, int]:
        with self.lock:
            return self.calls, self.wrong


class PreparingCounter:
    """A bus fold counting the eager calls made while a graph was being prepared."""

    def __init__(self) -> None:
        self.count = 0

    def __call__(self, event: Event) -> None:
        if type(event) is GraphMissed and event.detail == "preparing":
            self.count += 1


@dataclass
class Traffic:
    """The stream, its inputs, the checked requests' eager outputs."""

    stream: list[Request]
    inputs: dict[tuple[str, tuple[int, ...]], torch.Tensor]
    refs: dict[tuple[str, tuple[int, ...]], torch.Tensor]


def serve(
    clients: list[Client],
    adapters: dict[str, EncoderCudaGraph],
    traffic: Traffic,
    tolerance: float,
    cotenant: CoTenant | None,
    backends: list[Any],
) -> dict[str, Any]:
    """Serve the stream once with every client; return latencies, checks and errors."""
    n = len(traffic.stream)
    latency: list[float | None] = [None] * n
    counter = itertools.count()
    stop = threading.Event()
    lock = threading.Lock()
    wrong: list[int] = []
    checked = [0]
    worst = [0.0]
    errors: list[dict[str, str]] = []
    served_total = [0]  # pacing of the co-tenant only: an unlocked, approximate count
    perf = time.perf_counter

    def failed(client: str, exc: Exception) -> None:
        stop.set()
        error = f"{type(exc).__name__}: {exc}"[:ERROR_CHARS]
        with lock:
            errors.append({"client": client, "error": error, "traceback": traceback.format_exc()})

    def client_loop(client: Client) -> None:
        served = 0
        with contextlib.ExitStack() as stack:
            for backend in backends:
                # The simulated backend's replay stream, as a CUDA client's own stream.
                stack.enter_context(backend.stream(client.index + 1))
            try:
                while not stop.is_set():
                    i = next(counter)
                    if i >= n:
                        return
                    req = traffic.stream[i]
                    key = (req.encoder, req.shape)
                    x = traffic.inputs[key]
                    start = perf()
                    out = adapters[req.encoder](x)
                    client.sync()
                    latency[i] = perf() - start
                    if i % CHECK_EVERY == 0:
                        err = max_rel_err(out, traffic.refs[key])
                        with lock:
                            checked[0] += 1
                            worst[0] = max(worst[0], err)
                            if err > tolerance:
                                wrong.append(i)
                    served += 1
                    served_total[0] += 1
            except Exception as exc:
                failed(str(client.index), exc)

    before = {name: a.get_cumulative_stats() for name, a in adapters.items()}
    start = perf()
    futures = [c.submit(functools.partial(client_loop, c)) for c in clients]
    # The co-tenant runs here, on the thread that owns its CUDA-graph trees.
    made = 0
    while not all(f.done() for f in futures):
        if cotenant is None or served_total[0] // COTENANT_EVERY <= made:
            time.sleep(COTENANT_POLL_S)
            continue
        made += 1
        try:
            cotenant.call()
        except Exception as exc:
            failed("co-tenant", exc)
            break
    for future in futures:
        future.result()
    wall = perf() - start
    after = {name: a.get_cumulative_stats() for name, a in adapters.items()}
    served = [s for s in latency if s is not None]
    hits = sum(int(after[k]["graph_hits"] - before[k]["graph_hits"]) for k in adapters)
    misses = sum(int(after[k]["graph_misses"] - before[k]["graph_misses"]) for k in adapters)
    by_encoder = {}
    for enc in adapters:
        pairs = zip(traffic.stream, latency, strict=True)
        if mine := [s for r, s in pairs if r.encoder == enc and s is not None]:
            by_encoder[enc] = tail(mine)
    return {
        "requests": len(served),
        "wall_s": wall,
        "latency_us": tail(served) if served else None,
        "latency_by_encoder_us": by_encoder,
        "hits": hits,
        "misses": misses,
        "hit_rate": hits / (hits + misses) if hits + misses else 0.0,
        "checked": checked[0],
        "wrong": len(wrong),
        "wrong_requests": wrong[:50],
        "max_rel_err": worst[0],
        "errors": errors,
    }
