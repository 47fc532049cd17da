"""Cost of observability: end-to-end encoder throughput with no sinks against all sinks on.

Three arms replay the same call sequence (two hot keys per encoder, plus a few one-off
audio lengths that run eagerly, so sinks see misses as well as hits), rounds interleaved
and their order rotated:

* ``no_bus``: adapters without a bus (only their own stats);
* ``bus_no_sinks``: adapters on a bus with only its stats fold;
* ``all_sinks``: the same with every sink that can be built here attached (OpenTelemetry
  with in-memory exporters, structlog JSON logs, the rich live view, the JSONL log).

Sinks are imported lazily; one that cannot be imported or built is skipped and the reason
recorded (the GPU machine may lack opentelemetry or structlog).
"""

from __future__ import annotations

import contextlib
import io
import os
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from benchmarks.common import Context, free_cuda_memory, target
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

NAME = "observability"
NEEDS_CUDA = True

#: Throughput loss allowed with every sink on.
LOSS_TARGET = 0.01

#: structlog level for the log sink: the library's default. At "debug" every hit is a line.
LOG_LEVEL = "info"


class _Null(io.TextIOBase):
    """A text stream that drops everything (sink output must not reach the terminal)."""

    def write(self, s: str) -> int:
        return len(s)

    def writable(self) -> bool:
        return True


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    null = _Null()
    with contextlib.redirect_stdout(null), contextlib.redirect_stderr(null):
        yield


class _SinkSet:
    """Every sink that can be built here, attached to one bus.

    ``report`` says, per sink, whether it is on or why it was skipped. ``active()`` wraps a
    timed window in what must run only while it is on (the live view's refresh thread).
    """

    def __init__(self, bus: EventBus, workdir: Path) -> None:
        self.bus = bus
        self.report: dict[str, dict[str, Any]] = {}
        self.spans_exported: Callable[[], int] | None = None
        self._closers: list[Callable[[], Any]] = []
        self._live: Callable[[], Any] | None = None
        builders: dict[str, Callable[[], str]] = {
            "otel": self._otel,
            "logs": self._logs,
            "live": self._live_view,
            "jsonl": lambda: self._jsonl(workdir / "events.jsonl"),
        }
        for name, build in builders.items():
            try:
                with _quiet():
                    detail = build()
            except Exception as exc:  # ImportError on a machine without the library, too
                self.report[name] = {
                    "status": "skipped",
                    "reason": f"{type(exc).__name__}: {exc}"[:300],
                }
            else:
                self.report[name] = {"status": "on", "reason": "", "detail": detail}

    def _otel(self) -> str:
        from opentelemetry.sdk.metrics import MeterProvider
        from opentelemetry.sdk.metrics.export import (
            ConsoleMetricExporter,
            PeriodicExportingMetricReader,
        )
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
        from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

        from omnitrace.sinks.otel import OTelSink

        spans = InMemorySpanExporter()
        tracer_provider = TracerProvider()
        tracer_provider.add_span_processor(BatchSpanProcessor(spans))
        # Collect and serialise every metric once a second, as a busy scraper would.
        reader = PeriodicExportingMetricReader(
            ConsoleMetricExporter(out=_Null()), export_interval_millis=1000
        )
        meter_provider = MeterProvider(metric_readers=[reader])
        sink = OTelSink(self.bus, tracer_provider=tracer_provider, meter_provider=meter_provider)
        self._add(sink)
        self._closers += [tracer_provider.shutdown, meter_provider.shutdown]
        self.spans_exported = lambda: len(spans.get_finished_spans())
        return "OTelSink: BatchSpanProcessor(in-memory exporter), metrics collected every 1 s"

    def _logs(self) -> str:
        import structlog

        from omnitrace.sinks.logs import LogSink, configure_logging

        configure_logging(level=LOG_LEVEL, json=True, stream=_Null())
        self._add(LogSink())
        self._closers.append(structlog.reset_defaults)
        return f"LogSink: structlog JSON lines at level {LOG_LEVEL} to a null stream"

    def _live_view(self) -> str:
        from rich.console import Console

        from omnitrace.sinks.live import BusBoard, LiveView

        before = len(self.bus.statistics().sinks)
        board = BusBoard(self.bus)
        if len(self.bus.statistics().sinks) == before:
            self._add(board)
        console = Console(file=_Null(), width=120, force_terminal=True)
        self._live = lambda: LiveView(board, console=console)
        return "BusBoard + LiveView rendering at its fixed rate to a null console"

    def _jsonl(self, path: Path) -> str:
        from omnitrace.sinks.jsonl import JsonlSink

        sink = JsonlSink(path, bus=self.bus)
        self._add(sink)
        self.jsonl_path = path
        return f"JsonlSink({path.name})"

    def _add(self, sink: Any) -> None:
        self.bus.add_sink(sink)

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        """Run the block with the live view drawing (when it is on) and output silenced."""
        with _quiet():
            if self._live is None:
                yield
                return
            with self._live():
                yield

    def close(self) -> None:
        with _quiet():
            for closer in self._closers:
                with contextlib.suppress(Exception):
                    closer()


def run(ctx: Context) -> dict[str, Any]:
    """Measure calls/s of each arm over interleaved rounds; return the medians."""
    device = ctx.device
    on_cuda = device.type == "cuda"
    dtype = torch.bfloat16 if on_cuda else torch.float32
    sync: Callable[[], None] = torch.cuda.synchronize if on_cuda else (lambda: None)
    rounds = ctx.pick(8, 4, 2)
    per_round = ctx.pick(200, 80, 10)
    if ctx.simulate:
        geoms = {"vision": VISION_TINY, "audio": AUDIO_TINY}
        vision_tokens, chunk_frames = (64, 32), (100, 200)
    else:
        geoms = {"vision": VISION_FULL, "audio": AUDIO_FULL}
        vision_tokens, chunk_frames = (256, 64), (100, 200)
    with torch.device(device):
        models = {
            "vision": VisionEncoder(geoms["vision"]).to(dtype).eval(),
            "audio": AudioEncoder(geoms["audio"]).to(dtype).eval(),
        }
    hot = [
        (
            "vision",
            torch.randn(1, vision_tokens[0], geoms["vision"].hidden, device=device, dtype=dtype),
        ),
        ("audio", torch.randn(1, 80, chunk_frames[0], device=device, dtype=dtype)),
        (
            "vision",
            torch.randn(1, vision_tokens[1], geoms["vision"].hidden, device=device, dtype=dtype),
        ),
        ("audio", torch.randn(1, 80, chunk_frames[1], device=device, dtype=dtype)),
    ]
    hot_shapes = [[enc, list(x.shape)] for enc, x in hot]
    # One call in 50 is a one-off audio length: a warm-up miss in every arm.
    one_off_every = 50
    config = EncoderGraphConfig(min_free_bytes=0)

    workdir = Path(tempfile.mkdtemp(prefix="omnitrace-bench-"))
    arms: dict[str, dict[str, Any]] = {}
    all_bus = EventBus(queue_size=100_000)
    buses: dict[str, EventBus | None] = {
        "no_bus": None,
        "bus_no_sinks": EventBus(queue_size=100_000),
        "all_sinks": all_bus,
    }
    labels = {
        "no_bus": "adapters without a bus",
        "bus_no_sinks": "bus, stats fold only",
        "all_sinks": "bus, all available sinks",
    }
    sinks = _SinkSet(all_bus, workdir)
    for name, s in sinks.report.items():
        ctx.log(f"  sink {name}: {s['status']}{' (' + s['reason'] + ')' if s['reason'] else ''}")
    adapters: dict[str, dict[str, EncoderCudaGraph]] = {}
    for arm, bus in buses.items():
        adapters[arm] = {
            enc: EncoderCudaGraph(
                models[enc],
                name=enc if arm != "no_bus" else f"{enc}-nobus",
                config=config,
                bus=bus,
                backend=SimulatedGraphBackend() if ctx.simulate else None,
            )
            for enc in ("vision", "audio")
        }
    frames_next = [301]

    def one_off() -> torch.Tensor:
        frames_next[0] += 2
        return torch.randn(1, 80, frames_next[0], device=device, dtype=dtype)

    with torch.no_grad():
        # Warm up (captures happen here, so sinks see them) before anything is timed.
        for arm, arm_adapters in adapters.items():
            with sinks.active() if arm == "all_sinks" else contextlib.nullcontext():
                for enc, x in hot:
                    for _ in range(config.min_capture_calls + 3):
                        arm_adapters[enc](x)
        sync()
        samples: dict[str, list[float]] = {arm: [] for arm in buses}
        flush_s = dict.fromkeys(buses, 0.0)
        flushed = True
        order = list(buses)
        perf = time.perf_counter
        for r in range(rounds):
            extras = [one_off() for _ in range(per_round // one_off_every + 1)]
            for arm in order[r % 3 :] + order[: r % 3]:
                arm_adapters = adapters[arm]
                window = sinks.active() if arm == "all_sinks" else contextlib.nullcontext()
                with window:
                    sync()
                    start = perf()
                    for i in range(per_round):
                        if i % one_off_every == one_off_every - 1:
                            arm_adapters["audio"](extras[i // one_off_every])
                        else:
                            enc, x = hot[i % len(hot)]
                            arm_adapters[enc](x)
                        sync()
                    samples[arm].append(per_round / (perf() - start))
                bus = buses[arm]
                if bus is not None:
                    # Sinks keep up on their own threads; draining here, untimed, keeps one
                    # round's backlog out of the next arm's window.
                    flush_start = perf()
                    flushed &= bus.flush(timeout=30.0)
                    flush_s[arm] += perf() - flush_start
    for arm, bus in buses.items():
        stats = None if bus is None else bus.statistics()
        arms[arm] = {
            "label": labels[arm],
            "calls_per_s": statistics.median(samples[arm]),
            "rounds_calls_per_s": samples[arm],
            "flushed": flushed,
            "untimed_flush_s": flush_s[arm],
            "emitted": None if stats is None else stats.emitted,
            "dropped": None if stats is None else stats.dropped,
            "sinks": []
            if stats is None
            else [
                {
                    "name": s.name,
                    "delivered": s.delivered,
                    "dropped": s.dropped,
                    "disabled": s.disabled,
                    "error": s.error,
                }
                for s in stats.sinks
            ],
            "adapter_stats": {enc: a.get_cumulative_stats() for enc, a in adapters[arm].items()},
        }
    with _quiet():
        for bus in buses.values():
            if bus is not None:
                bus.close()
    sinks.close()
    spans = sinks.spans_exported() if sinks.spans_exported is not None else None
    del adapters, models, hot
    free_cuda_memory()

    base = arms["bus_no_sinks"]["calls_per_s"]
    loss = 1 - arms["all_sinks"]["calls_per_s"] / base
    loss_vs_none = 1 - arms["all_sinks"]["calls_per_s"] / arms["no_bus"]["calls_per_s"]
    on = [n for n, s in sinks.report.items() if s["status"] == "on"]
    ctx.log(
        f"  calls/s: no bus {arms['no_bus']['calls_per_s']:,.0f}, bus {base:,.0f}, "
        f"all sinks {arms['all_sinks']['calls_per_s']:,.0f} ({loss * 100:+.2f} % loss; sinks on: "
        f"{', '.join(on) or 'none'})"
    )
    return {
        "encoders": {
            enc: f"hidden={g.hidden} layers={g.layers} heads={g.heads} mlp={g.mlp}"
            for enc, g in geoms.items()
        },
        "hot_inputs": hot_shapes,
        "rounds": rounds,
        "calls_per_round": per_round,
        "one_off_every": one_off_every,
        "sinks": sinks.report,
        "arms": arms,
        "spans_exported": spans,
        "jsonl_bytes": _size(workdir / "events.jsonl"),
        "loss_vs_bus_no_sinks": loss,
        "loss_vs_no_bus": loss_vs_none,
        "targets": [
            target(
                "throughput loss with all sinks on",
                loss * 100 if on else None,
                "<",
                LOSS_TARGET * 100,
                "%",
                note=f"vs a bus with no sinks; sinks on: {', '.join(on) or 'none'}",
            )
        ],
        "simulated": ctx.simulate,
    }


def _size(path: Path) -> int | None:
    try:
        return os.path.getsize(path)
    except OSError:
        return None


def plot(result: dict[str, Any], out_dir: Path, plt: Any) -> list[Path]:
    """Draw calls/s per arm, each round as a dot and the median as a bar."""
    arms = result["arms"]
    fig, ax = plt.subplots(figsize=(6.5, 4))
    names = list(arms)
    ax.bar(range(len(names)), [arms[n]["calls_per_s"] for n in names], color="tab:blue", alpha=0.6)
    for i, n in enumerate(names):
        ys = arms[n]["rounds_calls_per_s"]
        ax.scatter([i] * len(ys), ys, color="black", s=8)
    ax.set_xticks(range(len(names)))
    ax.set_xticklabels([arms[n]["label"] for n in names], fontsize=8)
    ax.set_ylabel("calls/s (median of rounds)")
    ax.set_title("Encoder throughput with observability")
    fig.tight_layout()
    path = out_dir / "observability.png"
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return [path]
