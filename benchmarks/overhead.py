"""Host-side overhead of the event bus (``emit``, fold and bus throughput) and of the adapter's
hit path (simulated split; on CUDA, against a bare copy-replay-clone); ``--suite cpu`` runs
all but the CUDA part."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from benchmarks.common import BareGraph, Context, max_rel_err, save_plot, summarize, target
from benchmarks.latency import time_rounds
from benchmarks.latency_arms import Timed
from omnitrace import (
    EncoderCudaGraph,
    EncoderGraphConfig,
    Event,
    EventBus,
    GraphMissed,
    GraphReplayed,
    MissReason,
    StatsFold,
)
from omnitrace.coverage import DEFAULT_COVERAGE_KEYS, CoverageFold
from omnitrace.demo.encoders import VISION_TINY, VisionEncoder
from omnitrace.graphs.backends.base import CaptureRequest
from omnitrace.signature import Signature
from omnitrace.testing import SimulatedGraphBackend

NAME = "overhead"
NEEDS_CUDA = False

EMIT_TARGET_US = 1.0
HIT_PATH_TARGET_US = 15.0


class NoOpSink:
    """A sink that only counts what it receives (on the bus's worker thread)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.received = 0

    def handle(self, events: Sequence[Event]) -> None:
        self.received += len(events)


class AsyncNoOpSink(NoOpSink):
    """The same as a coroutine sink (on the bus loop)."""

    async def handle(self, events: Sequence[Event]) -> None:
        self.received += len(events)


class CountingFold:
    def __init__(self) -> None:
        self.count = 0

    def __call__(self, event: Event) -> None:
        self.count += 1


def event_mix(n: int) -> list[Event]:
    """``n`` events as from two encoders' adapters: hits sharing their graph's signature
    object, and one call in twenty a warm-up miss with a signature of its own."""
    events: list[Event] = []
    mono, epoch = time.monotonic_ns(), time.time_ns()
    graphs = {
        name: Signature.parse(f"bfloat16[1,1024,1152], None @cuda:0 s={stream}")
        for stream, name in enumerate(("vision", "audio"))
    }
    for i in range(n):
        adapter = "vision" if i % 2 == 0 else "audio"
        if i % 20 == 19:
            key = Signature.parse("bfloat16[1,80,312] @cuda:0 s=0")
            miss = (MissReason.WARMUP, "call 1 of 2", 0.004)
            events.append(GraphMissed(adapter, key, mono + i, epoch + i, *miss))
        else:
            events.append(GraphReplayed(adapter, graphs[adapter], mono + i, epoch + i, 2e-5))
    return events


def _expected_counts(events: Sequence[Event]) -> dict[str, dict[str, int]]:
    out: dict[str, dict[str, int]] = {}
    for ev in events:
        slot = out.setdefault(ev.adapter, {"graph_hits": 0, "graph_misses": 0})
        slot["graph_hits" if isinstance(ev, GraphReplayed) else "graph_misses"] += 1
    return out


def _counts(snapshots: dict[str, Any]) -> dict[str, dict[str, int]]:
    return {
        name: {"graph_hits": s.graph_hits, "graph_misses": s.graph_misses}
        for name, s in snapshots.items()
    }


def _rounds(
    variants: dict[str, Callable[[], object]], per_round: int, rounds: int
) -> tuple[dict[str, dict[str, float | int]], dict[str, dict[str, float | int]]]:
    """Summaries over ``rounds`` of the mean cost of ``per_round`` back-to-back calls of each
    variant (a loop keeps the timer's cost out of sub-microsecond figures), by the wall clock
    and by the thread's CPU time (which leaves out waits for the GIL)."""
    wall: dict[str, list[float]] = {name: [] for name in variants}
    cpu: dict[str, list[float]] = {name: [] for name in variants}
    perf, thread = time.perf_counter_ns, time.thread_time_ns
    for _ in range(rounds):
        for name, fn in variants.items():
            start, start_cpu = perf(), thread()
            for _ in range(per_round):
                fn()
            cpu_ns, wall_ns = thread() - start_cpu, perf() - start
            wall[name].append(wall_ns / per_round / 1e9)
            cpu[name].append(cpu_ns / per_round / 1e9)
    return {n: summarize(s) for n, s in wall.items()}, {n: summarize(s) for n, s in cpu.items()}


def _cycle(fn: Callable[[Event], object], events: Sequence[Event]) -> Callable[[], object]:
    """A call of ``fn`` on the next of the 64 ``events``, round and round."""
    it = iter(range(1 << 62))
    return lambda: fn(events[next(it) & 63])


def bench_emit(ctx: Context) -> dict[str, Any]:
    per_round = ctx.pick(20_000, 5_000, 500)
    rounds = ctx.pick(15, 7, 3)
    events = event_mix(64)
    rows: list[dict[str, Any]] = []
    for kind in ("sinks", "folds"):
        for count in (0, 1, 4):
            if kind == "folds" and count == 0:
                continue  # the same configuration as sinks=0
            # The queues hold every event emitted, so nothing drops however slow the drain.
            bus = EventBus(queue_size=per_round * rounds + 1)
            sinks = [NoOpSink(f"noop{i}") for i in range(count)] if kind == "sinks" else []
            folds = [CountingFold() for _ in range(count)] if kind == "folds" else []
            for sink in sinks:
                bus.add_sink(sink)
            for fold in folds:
                bus.add_fold(fold)
            wall, cpu_time = _rounds({"emit": _cycle(bus.emit, events)}, per_round, rounds)
            stats, cpu = wall["emit"], cpu_time["emit"]
            flushed = bus.flush(timeout=30.0)
            bus_stats = bus.statistics()
            bus.close()
            rows.append(
                {
                    "subscribers": kind if count else "none",
                    "count": count,
                    "per_emit_us": stats,
                    "per_emit_cpu_us": cpu,
                    "emitted": bus_stats.emitted,
                    "expected": per_round * rounds,
                    "dropped": bus_stats.dropped,
                    "flushed": flushed,
                    "delivered": [s.received for s in sinks],
                    "folded": [f.count for f in folds],
                }
            )
            ctx.log(
                f"  emit, {count} {kind if count else 'subscribers'}: "
                f"{stats['median'] * 1000:.0f} ns/emit, {cpu['median'] * 1000:.0f} ns of the "
                f"thread's CPU time (medians of {rounds} rounds)"
            )
    # The loop alone, to subtract; the bus's own fold alone, its share of every emit.
    fold = CoverageFold(DEFAULT_COVERAGE_KEYS, stats=StatsFold()).fold
    variants = {"loop": _cycle(lambda e: e, events), "fold": _cycle(fold, events)}
    alone = _rounds(variants, per_round, rounds)[0]
    return {
        "rows": rows,
        "loop_overhead_us": alone["loop"],
        "bus_fold_us": alone["fold"],
        "per_round": per_round,
        "rounds": rounds,
    }


def bench_fold(ctx: Context) -> dict[str, Any]:
    n = ctx.pick(500_000, 100_000, 5_000)
    events = event_mix(n)
    fold = StatsFold()
    start = time.perf_counter()
    fold.extend(events)
    elapsed = time.perf_counter() - start
    folded, expected = _counts(fold.snapshots()), _expected_counts(events)
    ctx.log(f"  stats fold: {n / elapsed / 1e6:.2f} M events/s")
    return dict(
        events=n, seconds=elapsed, events_per_s=n / elapsed, folded=folded, expected=expected
    )


def bench_throughput(ctx: Context) -> dict[str, Any]:
    n = ctx.pick(400_000, 100_000, 5_000)
    events = event_mix(n)
    expected = _expected_counts(events)
    rows: list[dict[str, Any]] = []
    configs: list[tuple[str, int]] = [("fold only", 0), ("sync sinks", 1), ("sync sinks", 4)]
    configs += [("async sinks", 1), ("async sinks", 4)]
    for label, count in configs:
        bus = EventBus(queue_size=n + 1)
        sinks: list[NoOpSink | AsyncNoOpSink] = []
        for i in range(count):
            sink = AsyncNoOpSink(f"async{i}") if label == "async sinks" else NoOpSink(f"noop{i}")
            sinks.append(sink)
            bus.add_sink(sink)
        emit = bus.emit
        start = time.perf_counter()
        for ev in events:
            emit(ev)
        emitted_at = time.perf_counter()
        flushed = bus.flush(timeout=60.0)
        done = time.perf_counter()
        stats, folded = bus.statistics(), _counts(bus.adapter_stats())
        bus.close()
        rows.append(
            {
                "config": label if count else "fold only",
                "sinks": count,
                "events": n,
                "emit_seconds": emitted_at - start,
                "total_seconds": done - start,
                "events_per_s": n / (done - start),
                "emit_events_per_s": n / (emitted_at - start),
                "flushed": flushed,
                "emitted": stats.emitted,
                "dropped": stats.dropped,
                "delivered": [s.delivered for s in stats.sinks],
                "received": [s.received for s in sinks],
                "peak_queued": [s.peak_queued for s in stats.sinks],
                "folded": folded,
                "expected": expected,
            }
        )
        ctx.log(
            f"  bus, {rows[-1]['config']} x{count}: {n / (done - start) / 1e6:.2f} M events/s "
            f"end to end, dropped {stats.dropped}"
        )
    return {"rows": rows}


def _identity(x: torch.Tensor) -> torch.Tensor:
    return x


def bench_hit_path(ctx: Context) -> dict[str, Any]:
    per_round = ctx.pick(5_000, 2_000, 200)
    rounds = ctx.pick(15, 7, 3)
    x = torch.randn(1, 16, 64)
    config = EncoderGraphConfig(min_free_bytes=0)
    request = CaptureRequest(_identity, (x,), torch.device("cpu"), None, None)
    graph = SimulatedGraphBackend().capture(request)

    names = ("no_bus", "bus", "bus_sink")
    with torch.no_grad():
        buses, adapters = _adapters(
            _identity, x, names, config, per_round * rounds, backend=SimulatedGraphBackend
        )
        before = {name: a.get_cumulative_stats() for name, a in adapters.items()}
        mono, epoch = time.monotonic_ns, time.time_ns
        variants: dict[str, Callable[[], object]] = {
            "forward": lambda: _identity(x),
            "copy_clone": lambda: graph.replay((x,)),
            "event": lambda: GraphReplayed("a", "k", mono(), epoch(), 1e-6),
            **{f"adapter_{name}": (lambda a=a: a(x)) for name, a in adapters.items()},
        }
        timings = _rounds(variants, per_round, rounds)[0]
    counted = _counted(adapters, before, *buses)

    med = {name: s["median"] for name, s in timings.items()}
    split = {
        "admission_key": med["adapter_no_bus"] - med["copy_clone"],
        "copy_clone": med["copy_clone"] - med["forward"],
        "emit": med["adapter_bus"] - med["adapter_no_bus"],
        "emit_with_sink": med["adapter_bus_sink"] - med["adapter_no_bus"],
        "forward": med["forward"],
        "total": med["adapter_bus"],
        "total_with_sink": med["adapter_bus_sink"],
    }
    ctx.log(
        "  hit path (simulated, no device): "
        f"total {split['total']:.2f} us = admission/key {split['admission_key']:.2f} "
        f"+ copy/clone {split['copy_clone']:.2f} + emit {split['emit']:.2f} us"
    )
    return {
        "input_shape": list(x.shape),
        "timings_us": timings,
        "split_us": split,
        "timed_calls": per_round * rounds,
        **counted,
        "note": "simulated backend: replay re-runs an identity forward on CPU; no device work",
    }


def _adapters(
    forward: Callable[[torch.Tensor], torch.Tensor],
    x: torch.Tensor,
    names: Sequence[str],
    config: EncoderGraphConfig,
    calls: int,
    *,
    backend: Callable[[], Any] = lambda: None,
    prefix: str = "",
) -> tuple[tuple[EventBus, EventBus, NoOpSink], dict[str, EncoderCudaGraph]]:
    """Three adapters of ``forward`` (keyed ``names``, named ``prefix`` a, b, c), each captured
    for ``x``: without a bus, with a bus (its folds only), with a bus and a no-op sink whose
    queue holds ``calls`` events; also the two buses and the sink (for :func:`_counted`)."""
    bus, sink_bus, sink = EventBus(), EventBus(queue_size=calls + 16), NoOpSink("noop")
    sink_bus.add_sink(sink)
    adapters = {}
    for letter, name, b in zip("abc", names, (None, bus, sink_bus), strict=True):
        adapter = EncoderCudaGraph(
            forward, name=prefix + letter, config=config, bus=b, backend=backend()
        )
        for _ in range(config.min_capture_calls):
            adapter(x)
        adapters[name] = adapter
    return (bus, sink_bus, sink), adapters


def _counted(
    adapters: dict[str, EncoderCudaGraph],
    before: dict[str, dict[str, Any]],
    bus: EventBus,
    sink_bus: EventBus,
    sink: NoOpSink,
) -> dict[str, Any]:
    """Each adapter's hits and misses since ``before``, what ``sink_bus`` dropped and what its
    ``sink`` received; closes the buses."""
    after = {name: a.get_cumulative_stats() for name, a in adapters.items()}
    sink_bus.flush(timeout=30.0)
    dropped = sink_bus.statistics().dropped
    bus.close()
    sink_bus.close()
    counts = {
        kind: {n: after[n][f"graph_{kind}"] - before[n][f"graph_{kind}"] for n in after}
        for kind in ("hits", "misses")
    }
    return {**counts, "dropped": dropped, "delivered": sink.received}


def bench_cuda_hit_vs_bare(ctx: Context) -> dict[str, Any]:
    per_round = ctx.pick(400, 100, 20)
    rounds = ctx.pick(10, 5, 2)
    dtype = torch.bfloat16
    with torch.device("cuda"):
        model = VisionEncoder(VISION_TINY).to(dtype).eval()
    x = torch.randn(1, 16, VISION_TINY.hidden, device="cuda", dtype=dtype)
    config = EncoderGraphConfig(min_free_bytes=0)
    names = ("adapter_no_bus", "adapter_bus", "adapter_bus_sink")
    with torch.no_grad():
        ref = model(x)
        bare = BareGraph(model, x)
        buses, adapters = _adapters(model, x, names, config, per_round * rounds, prefix="tiny-")
        errors = {
            "bare": max_rel_err(bare(x), ref),
            **{name: max_rel_err(a(x), ref) for name, a in adapters.items()},
        }
        variants: dict[str, Callable[[], object]] = {
            "replay_only": bare.replay_only,
            "bare": lambda bare=bare: bare(x),
            **{name: (lambda a=a: a(x)) for name, a in adapters.items()},
        }
        for fn in variants.values():
            for _ in range(20):
                fn()
        torch.cuda.synchronize()
        before = {name: a.get_cumulative_stats() for name, a in adapters.items()}
        arms = {name: Timed(fn) for name, fn in variants.items()}
        samples = time_rounds(arms, rounds=rounds, per_round=per_round, sync=torch.cuda.synchronize)
        timings = {
            name: {"host_us": summarize(s["host"]), "latency_us": summarize(s["latency"])}
            for name, s in samples.items()
        }
    counted = _counted(adapters, before, *buses)
    bare_med = {key: timings["bare"][key]["median"] for key in ("host_us", "latency_us")}
    over = {n: {k: timings[n][k]["median"] - bare_med[k] for k in bare_med} for n in adapters}
    ctx.log(
        f"  CUDA tiny encoder: bare {bare_med['host_us']:.1f} us host, adapter+bus "
        f"{timings['adapter_bus']['host_us']['median']:.1f} us host "
        f"(+{over['adapter_bus']['host_us']:.1f} us)"
    )
    del adapters, bare
    return {
        "encoder": "VisionEncoder(VISION_TINY)",
        "input_shape": list(x.shape),
        "dtype": "bfloat16",
        "timings": timings,
        "over_bare": over,
        "timed_calls": per_round * rounds,
        **counted,
        "max_rel_err": errors,
    }


def run(ctx: Context) -> dict[str, Any]:
    """Run the CPU parts, then the CUDA part when a GPU is present."""
    result: dict[str, Any] = {}
    for key, what, bench in (
        ("emit", "EventBus.emit() cost", bench_emit),
        ("fold", "stats fold throughput", bench_fold),
        ("throughput", "bus throughput", bench_throughput),
        ("hit_path", "adapter hit path on the simulated backend", bench_hit_path),
    ):
        ctx.log(f"overhead: {what}")
        result[key] = bench(ctx)
    if ctx.cuda and not ctx.simulate:
        ctx.log("overhead: CUDA adapter hit vs bare copy-replay-clone (tiny encoder)")
        result["cuda"] = bench_cuda_hit_vs_bare(ctx)
    else:
        result["cuda"] = {"skipped": "no CUDA device (CPU parts only)"}

    with_sinks = [r for r in result["emit"]["rows"] if r["subscribers"] == "sinks"]
    worst_emit = max(r["per_emit_cpu_us"]["median"] for r in with_sinks)
    worst_wall = max(r["per_emit_us"]["median"] for r in with_sinks)
    name = "emit() with sinks attached, the calling thread's CPU time"
    note = (
        "median per emit, worst of 1 and 4 no-op sinks, loop included; by the wall "
        f"clock {worst_wall:.2f} us, which adds the time the thread waited while the "
        "sink threads held the GIL"
    )
    targets = [target(name, worst_emit, "<=", EMIT_TARGET_US, "us", note=note)]
    cuda = result["cuda"]
    hit_over = None if "skipped" in cuda else cuda["over_bare"]["adapter_bus"]["host_us"]
    name = "hit-path host overhead over bare copy-replay-clone"
    note = "CUDA tiny encoder, adapter with a bus, median host time per call"
    targets.append(target(name, hit_over, "<=", HIT_PATH_TARGET_US, "us", note=note))
    result["targets"] = targets
    return result


def plot(result: dict[str, Any], out_dir: Path, plt: Any) -> list[Path]:
    """Draw emit cost by subscribers and the hit-path split."""
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    rows = result["emit"]["rows"]
    labels = [f"{r['count']} {r['subscribers']}" if r["count"] else "none" for r in rows]
    ax1.bar(labels, [r["per_emit_us"]["median"] * 1000 for r in rows], color="tab:blue")
    ax1.axhline(EMIT_TARGET_US * 1000, color="tab:red", linestyle="--", label="target 1 us")
    ax1.set_ylabel("ns per emit (median)")
    ax1.set_title("EventBus.emit() cost")
    ax1.legend()
    split = result["hit_path"]["split_us"]
    parts = ["admission_key", "copy_clone", "emit"]
    ax2.bar(parts, [split[p] for p in parts], color="tab:green")
    ax2.set_ylabel("us per call (median)")
    ax2.set_title("Hit path split (simulated backend)")
    return [save_plot(plt, fig, out_dir / "overhead.png")]
