"""Run MiniCPM-o-shaped encoders under graph adapters, with every sink attached: on the real
graph backend in bf16 on a CUDA machine, else on the CPU under the simulated backend."""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from omnitrace._signals import signals_set
from omnitrace.bus import EventBus
from omnitrace.config import EncoderGraphConfig
from omnitrace.demo.encoders import MEL_BINS, AudioEncoder, EncoderGeometry, VisionEncoder
from omnitrace.demo.terminal import SigtermExit
from omnitrace.demo.traffic import Request, TrafficMix
from omnitrace.events import NO_SIGNATURE, EncoderBatchRan, Phase, RequestTimed
from omnitrace.graphs.adapter import EncoderCudaGraph
from omnitrace.graphs.backends.base import GraphBackend
from omnitrace.sinks.jsonl import JsonlSink
from omnitrace.sinks.live import BusBoard, LiveView
from omnitrace.sinks.logs import LogSink
from omnitrace.sinks.registry import build_sinks
from omnitrace.testing import SimulatedGraphBackend

__all__ = ["DemoOptions", "DemoResult", "run_demo"]

MiB = 1 << 20
# Sinks of omnitrace.sinks.registry the demo wires from its own options (the event log from
# events_log, OpenTelemetry from the OTLP endpoint variables and prometheus_port, in process;
# `omnitrace replay --follow` on its --events-log relays it from outside).
_OWN_SINKS = frozenset({"jsonl", "otlp", "otlp-relay", "logs"})
#: The status line saying the run's event log was (re)created, before the path: from then on
#: the file holds this run's events (``omnitrace demo --ranks`` follows it from then).
LOG_STARTED = "writing the event log to "
#: Share of the run after which the burst of new shapes starts.
BURST_AT = 0.85
#: The dummy inputs of a profiling run: a batch of ten full 1024-token image slices (nine
#: slices and the thumbnail of one maximum-size image), and a 30-second clip.
PROFILING_SLICES = 10
PROFILING_AUDIO_FRAMES = 3000


@dataclass(frozen=True, slots=True)
class DemoOptions:
    """What ``omnitrace demo`` runs (see ``omnitrace demo --help``)."""

    config: EncoderGraphConfig = field(default_factory=EncoderGraphConfig)
    requests: int = 400
    duration_s: float | None = None
    seed: int = 0
    hidden: int = 64
    heads: int = 4
    vision_layers: int = 2
    audio_layers: int = 2
    events_log: Path = Path("omnitrace-events.jsonl")
    tui: bool = False
    rate: float | None = None
    """Requests per second (None: as fast as the encoders go)."""
    log_sample_every: int = 1
    sim_free_mib: int = 1624
    sim_graph_mib: int = 96
    fail_capture: str | None = None
    """Simulated only: make this encoder's captures fail, to see the failure path."""
    force_cpu: bool = False
    prometheus_port: int | None = None
    """Serve ``/metrics`` for a Prometheus scrape on 127.0.0.1 at this port (0: a free one)."""
    profiling_runs: int = 0
    """Start-up profiling runs before the traffic, as vLLM's ``profile_run``: the encoders
    called with maximum-size dummy inputs in the ``profiling`` phase."""
    log_file: Path | None = None
    """The file structlog writes to (``--log-file``; None: standard error): the bus's own
    lines (its close on SIGTERM) go there too."""


@dataclass(frozen=True, slots=True)
class DemoResult:
    """The final numbers of a demo run."""

    encoders: dict[str, dict[str, int | float]]
    max_graphs: dict[str, int]
    requests: int
    streaming_eager_calls: int
    calls_after_failure: int
    elapsed_s: float
    emitted: int
    dropped: int
    backend: str
    device: str
    dtype: str
    events_log: str
    otlp_endpoint: str | None
    """Where the OTLP export went, in a few words (see ``otlp_endpoints``); None: no export."""
    interrupted: bool = False
    otlp_error: str | None = None
    """What failed in the OTLP export (one line), or None when it all went through."""
    otlp_endpoints: dict[str, str] = field(default_factory=dict)
    """Each exported signal's endpoint (``traces``, ``metrics``), as the exporters got it."""

    def to_json(self) -> dict[str, Any]:
        """Return the summary as plain JSON data."""
        return {
            "encoders": {
                name: {**stats, "calls": int(stats["graph_hits"] + stats["graph_misses"])}
                for name, stats in self.encoders.items()
            },
            "max_graphs": self.max_graphs,
            "requests": self.requests,
            "streaming_eager_calls": self.streaming_eager_calls,
            "calls_after_failure": self.calls_after_failure,
            "elapsed_s": self.elapsed_s,
            "bus": {"emitted": self.emitted, "dropped": self.dropped},
            "backend": self.backend,
            "device": self.device,
            "dtype": self.dtype,
            "events_log": self.events_log,
            "otlp_endpoint": self.otlp_endpoint,
            "otlp_endpoints": self.otlp_endpoints,
            "otlp_error": self.otlp_error,
            "interrupted": self.interrupted,
        }


def _geometry(hidden: int, heads: int, layers: int) -> EncoderGeometry:
    return EncoderGeometry(hidden=hidden, layers=layers, heads=heads, mlp=4 * hidden)


class _Export:
    """The OTLP export of a run, when an OTLP endpoint variable asks for one."""

    def __init__(self) -> None:
        self.endpoint: str | None = None
        self.endpoints: dict[str, str] = {}
        self.setup: Any = None
        self.error: str | None = None
        self.prometheus_port: int | None = None

    def status(self) -> list[str]:
        """The live view's line about the export (none without an endpoint)."""
        if self.setup is None:
            return []
        error = self.setup.export_error
        return [f"otlp  {self.endpoint} · " + ("exporting" if error is None else error)]


@contextlib.contextmanager
def _otlp_export(
    bus: EventBus, say: Callable[[str], None], prometheus_port: int | None = None
) -> Iterator[_Export]:
    """Attach the OTel sink when an OTLP endpoint variable is set (the base one or a
    signal's own) or a Prometheus port is asked for; shut the SDK down after."""
    from omnitrace._env import otlp_endpoints_text, otlp_exports_by_variable

    export = _Export()
    otlp = otlp_exports_by_variable(os.environ)
    if not otlp and prometheus_port is None:
        yield export
        return
    # Imported here: the OTel SDK and exporters are only needed when exporting.
    from prometheus_client import CollectorRegistry

    from omnitrace.sinks.otel import sdk_sink

    sink, setup = sdk_sink(
        bus,
        default_service_name="omnitrace-demo",
        otlp=otlp,
        prometheus=prometheus_port is not None,
        prometheus_port=prometheus_port,
        # A registry of its own: a second demo in one process must not collide in the global one.
        prometheus_registry=CollectorRegistry(),
    )
    if otlp:
        export.setup = setup
        export.endpoint = setup.endpoint
        export.endpoints = {signal: e.url for signal, e in setup.endpoints.items()}
        say(f"exporting over OTLP ({setup.protocol}): {otlp_endpoints_text(setup.endpoints)}")
    if setup.prometheus_port is not None:
        export.prometheus_port = setup.prometheus_port
        say(f"serving Prometheus metrics on http://127.0.0.1:{setup.prometheus_port}/metrics")
    try:
        bus.add_sink(sink)
        yield export
    finally:
        # The bus is closed first (inside the block), so every span has been handed over.
        if not setup.shutdown():
            export.error = setup.export_error


class _Progress:
    """Requests done of the total and the time elapsed, for the live view."""

    def __init__(self, total: int, duration_s: float | None) -> None:
        self.total = total
        self.duration_s = duration_s
        self.done = 0
        self.start = time.monotonic()
        self.end: float | None = None
        """When the traffic ended: the elapsed time the summary reports stays on the view."""

    def advance(self) -> None:
        self.done += 1

    def lines(self) -> list[str]:
        elapsed = (time.monotonic() if self.end is None else self.end) - self.start
        of = f" / {self.total}" if self.total else ""
        limit = f" of {self.duration_s:g} s" if self.duration_s is not None else ""
        return [f"requests {self.done}{of} · elapsed {elapsed:.1f} s{limit}"]


class _Encoders:
    """The two models, their adapters and the inputs the traffic asks for."""

    def __init__(
        self,
        options: DemoOptions,
        bus: EventBus,
        device: torch.device,
        dtype: torch.dtype,
        backends: dict[str, GraphBackend | None],
    ) -> None:
        torch.manual_seed(options.seed)
        self.hidden = options.hidden
        self.device = device
        self.dtype = dtype
        vision_geometry = _geometry(options.hidden, options.heads, options.vision_layers)
        audio_geometry = _geometry(options.hidden, options.heads, options.audio_layers)
        self.vision_model = VisionEncoder(vision_geometry).to(device, dtype).eval()
        self.audio_model = AudioEncoder(audio_geometry).to(device, dtype).eval()

        def adapter(model: torch.nn.Module, name: str) -> EncoderCudaGraph:
            return EncoderCudaGraph(
                model, name=name, config=options.config, bus=bus, backend=backends[name]
            )

        self.vision = adapter(self.vision_model, "vision")
        self.audio = adapter(self.audio_model, "audio")
        self._bus = bus
        self.timed = 0
        self.streaming_calls = 0
        self.after_failure = 0
        self._generator = torch.Generator(device="cpu").manual_seed(options.seed)

    def footer(self) -> list[str]:
        """Extra lines for the live view: the calls that bypass the adapters."""
        lines = [f"streaming audio  {self.streaming_calls} eager calls (stateful, never graphed)"]
        if self.after_failure:
            lines.append(f"after capture failure  {self.after_failure} calls served eagerly")
        return lines

    def close(self, timeout: float = 5.0) -> None:
        """Stop both adapters' threads, so no device timing arrives after the bus closes.

        Args:
            timeout: seconds each adapter may wait for its pending timings; default 5.0.
        """
        for adapter in (self.vision, self.audio):
            adapter.close(timeout)

    def _randn(self, *shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=self._generator).to(self.device, self.dtype)

    def profile(self) -> None:
        """Call both encoders with maximum-size dummy inputs, as vLLM's start-up profiling
        run does, with the adapters in the profiling phase."""
        adapters = (self.vision, self.audio)
        for adapter in adapters:
            adapter.set_phase(Phase.PROFILING)
        try:
            self.serve(Request("vision", PROFILING_SLICES, 1024))
            self.serve(Request("audio", 1, PROFILING_AUDIO_FRAMES))
        finally:
            for adapter in adapters:
                adapter.set_phase(Phase.SERVING)

    def serve_timed(self, request: Request) -> Any:
        """Run one request as :meth:`serve` does, timed as the vLLM plugin times a served
        request: a ``RequestTimed`` from its arrival to its output and an ``EncoderBatchRan``
        for its encoder step (a demo request is its encoder call), so ``omnitrace top``'s
        TTFT table, the request spans and the request-phase metric have the demo's data."""
        if request.kind == "streaming":
            return self.serve(request)
        self.timed += 1
        rid = f"demo-{self.timed}"
        arrival = time.monotonic_ns()
        out = self.serve(request)
        done, epoch = time.monotonic_ns(), time.time_ns()
        vision = request.kind == "vision"
        self._bus.emit(
            EncoderBatchRan(
                "",
                NO_SIGNATURE,
                done,
                epoch,
                arrival,
                (rid,),
                (request.batch * request.length,),
                (("image",) if vision else ("audio",)),
            )
        )
        self._bus.emit(
            RequestTimed(
                "",
                NO_SIGNATURE,
                done,
                epoch,
                rid,
                rid,
                arrival,
                None,
                arrival,
                arrival,
                arrival,
                arrival,
                done,
                (done - arrival) / 1e9,
                1 if vision else 0,
                request.batch * 448 * 448 if vision else 0,
                0 if vision else 1,
                0.0 if vision else request.batch * request.length / 100,
                "",
                "",
            )
        )
        return out

    def serve(self, request: Request) -> Any:
        """Run one request and return the encoder output."""
        if request.kind == "streaming":
            # MiniCPM-o's streaming audio path is stateful (KV-cached across chunks): it calls
            # the encoder directly and never goes through the graph adapter.
            self.streaming_calls += 1
            return self.audio_model(self._randn(request.batch, MEL_BINS, request.length))
        model: torch.nn.Module
        if request.kind == "audio":
            adapter, model = self.audio, self.audio_model
            inputs: tuple[torch.Tensor | None, ...] = (
                self._randn(request.batch, MEL_BINS, request.length),
            )
        else:
            adapter, model = self.vision, self.vision_model
            hidden = self._randn(request.batch, request.length, self.hidden)
            mask = None
            if request.masked:
                # The second slice is padded: its last quarter of keys is masked out.
                mask = torch.ones(
                    request.batch, 1, request.length, request.length, dtype=torch.bool
                )
                mask[1:, :, :, (3 * request.length) // 4 :] = False
                mask = mask.to(self.device)
            inputs = (hidden, mask)
        if adapter.terminal:
            # A real worker would now restart (optionally with graphs disabled); the demo
            # keeps serving eagerly outside the adapter and counts these calls.
            self.after_failure += 1
            return model(*inputs)
        try:
            return adapter(*inputs)
        except Exception:
            # The capture failure itself propagates out of the capturing call (the fatal
            # contract); the demo records it and carries on without graphs for this encoder.
            if not adapter.terminal:
                raise
            self.after_failure += 1
            return model(*inputs)


def _drive(
    options: DemoOptions,
    encoders: _Encoders,
    advance: Callable[[], None],
    start: float,
    ctrl_c: threading.Event,
) -> tuple[int, bool]:
    """Send the traffic; return how many requests were served and whether Ctrl-C stopped it
    (``ctrl_c`` set, checked between two requests)."""
    mix = TrafficMix(options.seed)
    total = options.requests or None
    duration = options.duration_s
    served = 0
    try:
        for _ in range(options.profiling_runs):
            encoders.profile()
        while total is None or served < total:
            if ctrl_c.is_set():
                return served, True
            elapsed = time.monotonic() - start
            if duration is not None and elapsed >= duration:
                break
            burst = (total is not None and served >= BURST_AT * total) or (
                duration is not None and elapsed >= BURST_AT * duration
            )
            encoders.serve_timed(mix.next(burst=burst))
            served += 1
            advance()
            if options.rate:
                delay = start + served / options.rate - time.monotonic()
                if delay > 0 and ctrl_c.wait(delay):
                    return served, True
            if encoders.device.type == "cuda" and served % 64 == 0:
                # Bound the queued GPU work, so the pace and the view follow real progress.
                torch.cuda.synchronize()
    except KeyboardInterrupt:
        # Where the handler is not in place (off the main thread), Ctrl-C arrives as this
        # exception; it too ends the traffic early, and the run still closes and reports.
        return served, True
    return served, ctrl_c.is_set()


def _pick_device(options: DemoOptions) -> tuple[torch.device, torch.dtype, bool]:
    if torch.cuda.is_available() and not options.force_cpu:
        return torch.device("cuda"), torch.bfloat16, False
    return torch.device("cpu"), torch.float32, True


def run_demo(
    options: DemoOptions,
    *,
    console: Console,
    say: Callable[[str], None],
) -> DemoResult:
    """Run the demo traffic through both encoder adapters and return the final stats.

    Args:
        options: sizes, traffic, config and outputs.
        console: where the live view or the progress bar draws.
        say: prints one status line (device choice, where outputs go).
    """
    device, dtype, simulated = _pick_device(options)
    backends: dict[str, GraphBackend | None]
    if simulated:
        # Short enough for one line of an 80-column terminal; docs/operations.md says more.
        say("no CUDA device: simulated graph backend on the CPU (no speed-up)")
        shared = SimulatedGraphBackend(
            free_bytes=options.sim_free_mib * MiB, graph_bytes=options.sim_graph_mib * MiB
        )
        backends = {"vision": shared, "audio": shared}
        if options.fail_capture is not None:
            backends[options.fail_capture] = SimulatedGraphBackend(fail_on_capture=True)
        backend_name = "simulated"
    else:
        backends = {"vision": None, "audio": None}
        backend_name = "torch"

    with _cpu_threads(1 if simulated else None):
        return _run(options, console, say, device, dtype, backends, backend_name)


@contextlib.contextmanager
def _cpu_threads(threads: int | None) -> Iterator[None]:
    """Run with ``threads`` intra-op threads, restoring the previous count afterwards."""
    if threads is None:
        yield
        return
    previous = torch.get_num_threads()
    # The demo's CPU matrices are tiny: extra intra-op threads cost more in spinning and
    # handoff than they save, and on a small shared machine they slow the run several-fold.
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def _run(
    options: DemoOptions,
    console: Console,
    say: Callable[[str], None],
    device: torch.device,
    dtype: torch.dtype,
    backends: dict[str, GraphBackend | None],
    backend_name: str,
) -> DemoResult:
    bus = EventBus()
    jsonl: JsonlSink | None = None
    try:
        with _signals(bus, options) as (sigterm, ctrl_c):
            bus.add_sink(LogSink(sample_every=options.log_sample_every, bus=bus))
            # Sinks the environment asks for, as in the vLLM plugin, beyond the event log and
            # the OpenTelemetry export, which come from the demo's own options.
            for sink in build_sinks(bus, os.environ, exclude=_OWN_SINKS):
                bus.add_sink(sink)
            # Adapters emit only when called, so the sinks below still see every event.
            encoders = _Encoders(options, bus, device, dtype, backends)
            progress = _Progress(options.requests, options.duration_s)
            with _otlp_export(bus, say, options.prometheus_port) as export:
                # A fresh log per run, so the log holds exactly this run's events; created only
                # once every setting has been read (the sinks above, OTEL_*), so a start that
                # fails on one leaves the previous run's log as it was.
                jsonl = JsonlSink(options.events_log, bus=bus, fresh=True)
                say(f"{LOG_STARTED}{jsonl.path.resolve()}")
                bus.add_sink(jsonl)
                board = BusBoard(
                    bus,
                    title=f"omnitrace demo · {backend_name} backend on {device.type}",
                    footer=lambda: [*encoders.footer(), *export.status()],
                    progress=progress.lines,
                )
                start = progress.start = time.monotonic()
                with (
                    _progress(options, console, board, progress, sigterm) as advance,
                    torch.no_grad(),
                ):
                    served, interrupted = _drive(options, encoders, advance, start, ctrl_c)
                    progress.end = time.monotonic()
                    elapsed = progress.end - start
                    # Closed while the view still holds stderr: the log lines the close writes
                    # (the final graph_summary per encoder) go where the view's lines go, not
                    # across the terminal after it, and the final frame shows the closed bus.
                    # The adapters first: a device timing resolved on a timer's thread while
                    # the bus closes would be counted as dropped.
                    encoders.close()
                    bus.close()
            statistics = bus.statistics()
    finally:
        if jsonl is not None:
            jsonl.close()
    return DemoResult(
        encoders={
            "vision": encoders.vision.get_cumulative_stats(),
            "audio": encoders.audio.get_cumulative_stats(),
        },
        max_graphs={"vision": options.config.max_graphs, "audio": options.config.max_graphs},
        requests=served,
        streaming_eager_calls=encoders.streaming_calls,
        calls_after_failure=encoders.after_failure,
        elapsed_s=elapsed,
        emitted=statistics.emitted,
        dropped=statistics.dropped,
        backend=backend_name,
        device=str(device),
        dtype=str(dtype).removeprefix("torch."),
        events_log=str(jsonl.path),
        otlp_endpoint=export.endpoint,
        interrupted=interrupted,
        otlp_error=export.error,
        otlp_endpoints=export.endpoints,
    )


@contextlib.contextmanager
def _signals(bus: EventBus, options: DemoOptions) -> Iterator[tuple[SigtermExit, threading.Event]]:
    """Handle SIGTERM and Ctrl-C for the run; yield the SIGTERM handler and the event Ctrl-C
    sets. At the end, ``bus`` is closed before the handlers are restored."""
    # Beneath the bus's handler: after the close, it takes the live view down (the cursor
    # shown again) and writes the bus's line on the terminal before the process ends.
    sigterm = SigtermExit(log_file=options.log_file is not None).__enter__()
    # SIGTERM (a supervisor stopping the demo) would otherwise lose the queued events
    # unrecorded: close the bus within a bound, log the loss, then terminate as asked.
    restore_sigterm = (
        bus.close_on_signal(signal.SIGTERM)
        if threading.current_thread() is threading.main_thread()
        else None
    )
    # Ctrl-C sets an event the traffic loop checks between two requests: never raised
    # inside an adapter, the bus or a sink, and one more during the close does not cut it.
    ctrl_c = threading.Event()
    sigint = signals_set(ctrl_c, signal.SIGINT)
    sigint.__enter__()
    try:
        yield sigterm, ctrl_c
    finally:
        bus.close()
        # Restored only once the bus is closed: a SIGTERM during the close still counts.
        if restore_sigterm is not None:
            restore_sigterm()
        sigint.__exit__(None, None, None)
        sigterm.__exit__(None, None, None)


@contextlib.contextmanager
def _progress(
    options: DemoOptions,
    console: Console,
    board: BusBoard,
    progress: _Progress,
    sigterm: SigtermExit,
) -> Iterator[Callable[[], None]]:
    """Show the live view, or a progress bar on a terminal, and yield a per-request tick."""
    if options.tui:
        with LiveView(board, console=console, log_hint="; --log-file PATH keeps them") as view:
            sigterm.view = view
            try:
                yield progress.advance
            finally:
                sigterm.view = None
        return
    if not console.is_terminal:
        yield progress.advance
        return
    bar = Progress(
        TextColumn("demo traffic"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=console,
        transient=True,
    )
    with bar:
        task = bar.add_task("requests", total=options.requests or None)

        def advance() -> None:
            progress.advance()
            bar.advance(task)

        yield advance
