"""Cost of observability: encoder calls/s with each sink (:mod:`benchmarks.observability_sinks`),
the production set, and every sink, against a bus with only its stats fold, in paired rounds;
the method is in BENCHMARKS.md, "Method"."""

from __future__ import annotations

import contextlib
import gc
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from benchmarks.common import (
    Context,
    GcClock,
    encoders,
    figure,
    free_cuda_memory,
    geometries,
    quantile,
    rotated,
    save_plot,
    sink_rows,
    target,
)
from benchmarks.observability_sinks import PRODUCTION_SINKS, SinkSet, quiet
from benchmarks.table import Table, columns, pct
from omnitrace import EncoderCudaGraph, EncoderGraphConfig, EventBus
from omnitrace.testing import SimulatedGraphBackend

NAME = "observability"
NEEDS_CUDA = True

#: Throughput loss allowed with the production sinks on, against this arm.
LOSS_TARGET = 0.01
BASELINE = "bus_no_sinks"
#: The production sinks with OpenTelemetry relayed from the event log by another process.
RELAYED_SINKS = ("logs", "jsonl", "relay")
_LOSS_NOTE = "median of per-round ratios vs a bus with no sinks"

#: arm -> (label, sinks on its bus; None: no bus at all).
ARMS: dict[str, tuple[str, tuple[str, ...] | None]] = {
    "no_bus": ("adapters without a bus", None),
    "bus_no_sinks": ("bus, stats fold only", ()),
    "otel": ("bus + OTel", ("otel",)),
    "logs": ("bus + structlog logs", ("logs",)),
    "jsonl": ("bus + JSONL event log", ("jsonl",)),
    "live": ("bus + live view in process", ("live",)),
    "production": ("bus + OTel, logs, JSONL, all in process", PRODUCTION_SINKS),
    "production_relayed": (
        "bus + logs, JSONL; OTel relayed from the log by another process (production set)",
        RELAYED_SINKS,
    ),
    "all_sinks": ("bus + every sink, live view in process", ("otel", "logs", "jsonl", "live")),
}

#: One call in this many is a capacity miss (a fixed audio length served eagerly); two graphs
#: an encoder hold the hot keys.
MISS_EVERY = 12


def paired_loss(baseline: Sequence[float], arm: Sequence[float]) -> dict[str, float | int]:
    """The loss of ``arm`` against ``baseline`` from rates of the same rounds: ``1 -
    median(arm[r] / baseline[r])``, its quartiles, and over the total time of all rounds."""
    if len(baseline) != len(arm) or not arm:
        raise ValueError("paired_loss() needs the same, non-zero number of rounds in both")
    ratios = sorted(a / b for a, b in zip(arm, baseline, strict=True))
    total_arm = len(arm) / sum(1.0 / a for a in arm)
    total_base = len(baseline) / sum(1.0 / b for b in baseline)
    return {
        "rounds": len(ratios),
        "loss": 1.0 - statistics.median(ratios),
        "loss_p25": 1.0 - quantile(ratios, 0.75),
        "loss_p75": 1.0 - quantile(ratios, 0.25),
        "loss_total": 1.0 - total_arm / total_base,
    }


def run(ctx: Context) -> dict[str, Any]:
    """Measure calls/s of every arm over interleaved rounds; return paired losses."""
    device, dtype, sync = ctx.device, ctx.dtype, ctx.device_sync
    arm_names = list(ARMS)
    rounds = len(arm_names) * ctx.pick(20, 2, 1)
    per_round = ctx.pick(48, 48, 12)
    geoms, vision_tokens = geometries(ctx.simulate), (64, 32) if ctx.simulate else (256, 64)
    chunk_frames, cold_frames = (100, 200), (150, 250, 300)
    models = encoders(ctx)
    gen = torch.Generator(device="cpu").manual_seed(0)

    def tensor(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(device=device, dtype=dtype)

    hidden = geoms["vision"].hidden
    hot = [
        ("vision", tensor(1, vision_tokens[0], hidden)),
        ("audio", tensor(1, 80, chunk_frames[0])),
        ("vision", tensor(1, vision_tokens[1], hidden)),
        ("audio", tensor(1, 80, chunk_frames[1])),
    ]
    cold = [("audio", tensor(1, 80, frames)) for frames in cold_frames]
    hot_shapes = [[enc, list(x.shape)] for enc, x in hot]
    # Every window's call sequence, the same in every arm and round.
    sequence = [
        cold[(i // MISS_EVERY) % len(cold)] if i % MISS_EVERY == MISS_EVERY - 1 else hot[i % 4]
        for i in range(per_round)
    ]
    config = EncoderGraphConfig(min_free_bytes=0, max_graphs=2)

    workdir = Path(tempfile.mkdtemp(prefix="omnitrace-bench-"))
    buses: dict[str, EventBus | None] = {}
    sinks: dict[str, SinkSet] = {}
    adapters: dict[str, dict[str, EncoderCudaGraph]] = {}
    for arm, (_, names) in ARMS.items():
        buses[arm] = bus = None if names is None else EventBus(queue_size=100_000)
        if bus is not None and names:
            sinks[arm] = SinkSet(bus, names, workdir, arm)
            for name, s in sinks[arm].report.items():
                if s["status"] != "on":
                    ctx.log(f"  {arm}: sink {name} skipped ({s['reason']})")
        backend = SimulatedGraphBackend if ctx.simulate else lambda: None
        adapters[arm] = {
            enc: EncoderCudaGraph(model, name=enc, config=config, bus=bus, backend=backend())
            for enc, model in models.items()
        }

    def window(arm: str) -> contextlib.AbstractContextManager[None]:
        return sinks[arm].active() if arm in sinks else contextlib.nullcontext()

    def play(arm: str) -> None:
        arm_adapters = adapters[arm]
        for enc, x in sequence:
            arm_adapters[enc](x)
            sync()

    samples: dict[str, list[float]] = {arm: [] for arm in arm_names}
    flush_s = dict.fromkeys(arm_names, 0.0)
    gc_clocks = {arm: GcClock() for arm in arm_names}
    flushed = True
    perf = time.perf_counter
    with torch.no_grad():
        # Captures happen here, so sinks see them; then every shape is warm in every arm.
        for arm, arm_adapters in adapters.items():
            with window(arm):
                for enc, x in hot:
                    for _ in range(config.min_capture_calls + 2):
                        arm_adapters[enc](x)
                for enc, x in cold:
                    for _ in range(3):
                        arm_adapters[enc](x)
                sync()
                play(arm)
            if (bus := buses[arm]) is not None:
                flushed &= bus.flush(timeout=30.0)
            graphs = {enc: a.num_graphs for enc, a in arm_adapters.items()}
            if graphs != {"vision": 2, "audio": 2}:
                raise RuntimeError(f"{arm}: expected two graphs per encoder, got {graphs}")
        gc.collect()
        gc.freeze()
        try:
            for r in range(rounds):
                for arm in rotated(arm_names, r):
                    gc.collect()
                    clock = gc_clocks[arm]
                    gc.callbacks.append(clock)
                    try:
                        with window(arm):
                            sync()
                            clock.armed = True
                            start = perf()
                            play(arm)
                            elapsed = perf() - start
                            clock.armed = False
                    finally:
                        gc.callbacks.remove(clock)
                    samples[arm].append(per_round / elapsed)
                    bus = buses[arm]
                    if bus is not None:  # untimed: no backlog reaches the next arm's window
                        flush_start = perf()
                        flushed &= bus.flush(timeout=30.0)
                        flush_s[arm] += perf() - flush_start
        finally:
            gc.unfreeze()

    # The relays first: each must have relayed its arm's whole log, and exit 0.
    relays = {arm: sink_set.finish_relay() for arm, sink_set in sinks.items()}
    arms: dict[str, dict[str, Any]] = {}
    for arm, (label, names) in ARMS.items():
        bus = buses[arm]
        stats = None if bus is None else bus.statistics()
        sink_set = sinks.get(arm)
        exported = getattr(sink_set, "spans_exported", None)
        arms[arm] = {
            "label": label,
            "sinks_requested": list(names or ()),
            "sinks_on": [] if sink_set is None else sink_set.on,
            "calls_per_s": statistics.median(samples[arm]),
            "rounds_calls_per_s": samples[arm],
            "vs_baseline": paired_loss(samples[BASELINE], samples[arm]),
            "vs_no_bus": paired_loss(samples["no_bus"], samples[arm]),
            "gc_collections_in_windows": gc_clocks[arm].collections,
            "gc_s_in_windows": gc_clocks[arm].seconds,
            "metric_collections": getattr(getattr(sink_set, "collector", None), "runs", None),
            "untimed_flush_s": flush_s[arm],
            "emitted": None if stats is None else stats.emitted,
            "dropped": None if stats is None else stats.dropped,
            "sinks": [] if stats is None else sink_rows(stats.sinks),
            "adapter_stats": {enc: a.get_cumulative_stats() for enc, a in adapters[arm].items()},
            "spans_exported": exported() if exported else None,
            "jsonl_bytes": _size(getattr(sink_set, "jsonl_path", None)),
            "relay": relays.get(arm),
        }
        relay, emitted = relays.get(arm), arms[arm]["emitted"]
        if relay is not None and relay["relayed_events"] != emitted:
            relayed = relay["relayed_events"]
            raise RuntimeError(f"{arm}: the relay relayed {relayed} events of {emitted}")
    with quiet():
        for bus in buses.values():
            if bus is not None:
                bus.close()
    for sink_set in sinks.values():
        sink_set.close()
    adapters.clear()
    sequence.clear()
    del models, hot, cold
    free_cuda_memory()

    loss = arms["all_sinks"]["vs_baseline"]["loss"]
    production = arms["production"]["vs_baseline"]["loss"]
    relayed = arms["production_relayed"]["vs_baseline"]["loss"]
    production_on = arms["production"]["sinks_on"]
    relayed_on = arms["production_relayed"]["sinks_on"]
    ctx.log(
        f"  calls/s (median of rounds): no bus {arms['no_bus']['calls_per_s']:,.0f}, "
        f"bus {arms[BASELINE]['calls_per_s']:,.0f}; loss vs bus (median of paired rounds): "
        + ", ".join(f"{a} {arms[a]['vs_baseline']['loss'] * 100:+.2f} %" for a in arm_names[2:])
        + f" (sinks on: {', '.join(arms['all_sinks']['sinks_on']) or 'none'})"
    )
    # Every arm made the same calls: the same hits and misses per encoder.
    counts = {
        arm: tuple((s["graph_hits"], s["graph_misses"]) for s in a["adapter_stats"].values())
        for arm, a in arms.items()
    }
    name = (
        "throughput loss with the production sinks (OTel relayed from the event log by another "
        "process; logs and JSONL in process)"
    )
    value = relayed * 100 if set(relayed_on) == set(RELAYED_SINKS) else None
    note = (
        f"{_LOSS_NOTE}; sinks on: {', '.join(relayed_on) or 'none'}; the relay relayed every "
        f"event ({arms['production_relayed']['relay']})"
    )
    targets = [target(name, value, "<", LOSS_TARGET * 100, "%", note=note, goal="observability")]
    name = "throughput loss with OTel, logs and JSONL all in the serving process"
    value = production * 100 if set(production_on) == set(PRODUCTION_SINKS) else None
    note = (
        f"{_LOSS_NOTE}; sinks on: {', '.join(production_on) or 'none'}; every sink, the live "
        f"view in process too: {loss * 100:+.2f} %"
    )
    figures = [figure(name, value, "%", goal="observability", note=note)]
    return {
        "encoders": {
            enc: f"hidden={g.hidden} layers={g.layers} heads={g.heads} mlp={g.mlp}"
            for enc, g in geoms.items()
        },
        "hot_inputs": hot_shapes,
        "capacity_miss_inputs": [["audio", [1, 80, f]] for f in cold_frames],
        "max_graphs": config.max_graphs,
        "miss_every": MISS_EVERY,
        "rounds": rounds,
        "calls_per_round": per_round,
        "arm_order": "round r starts at arm r mod n",
        "baseline": BASELINE,
        "loss_statistic": "1 - median over rounds of (arm calls/s / baseline calls/s, same round)",
        "sinks": dict(sinks["all_sinks"].report) if "all_sinks" in sinks else {},
        "arms": arms,
        "same_counts_in_every_arm": len(set(counts.values())) == 1,
        "flushed": flushed,
        "loss_vs_bus_no_sinks": loss,
        "loss_vs_no_bus": arms["all_sinks"]["vs_no_bus"]["loss"],
        "production_loss_vs_bus_no_sinks": production,
        "production_relayed_loss_vs_bus_no_sinks": relayed,
        "targets": targets,
        "figures": figures,
        "simulated": ctx.simulate,
    }


def _size(path: Path | None) -> int | None:
    return path.stat().st_size if path is not None and path.exists() else None


def plot(result: dict[str, Any], out_dir: Path, plt: Any) -> list[Path]:
    """Draw each arm's per-round ratio to the baseline; the median as a bar."""
    arms = result["arms"]
    base = arms[result.get("baseline", BASELINE)]["rounds_calls_per_s"]
    names = list(arms)
    fig, ax = plt.subplots(figsize=(9, 4.5))
    medians = [(1 - arms[n]["vs_baseline"]["loss"]) * 100 for n in names]
    ax.bar(range(len(names)), medians, color="tab:blue", alpha=0.6)
    lows = [min(medians)]
    for i, n in enumerate(names):
        ys = [a / b * 100 for a, b in zip(arms[n]["rounds_calls_per_s"], base, strict=True)]
        ax.scatter([i] * len(ys), ys, color="black", s=6)
        lows += ys
    ax.axhline(100 - LOSS_TARGET * 100, color="tab:red", linewidth=0.8, linestyle="--")
    ax.set_xticks(range(len(names)))
    ax.set_xticklabels([arms[n]["label"] for n in names], fontsize=7, rotation=25, ha="right")
    ax.set_ylabel("calls/s, % of the bus without sinks (same round)")
    ax.set_ylim(max(0.0, min(lows) - 2), max(105.0, max(medians) + 2))
    ax.set_title("Encoder throughput with observability (bars: median of paired rounds)")
    return [save_plot(plt, fig, out_dir / "observability.png")]


def tables(result: dict[str, Any]) -> list[Table]:
    def loss(key: str) -> Callable[[dict[str, Any]], str]:
        return lambda arm: pct((arm.get("vs_baseline") or {}).get(key))

    def count(key: str) -> Callable[[dict[str, Any]], str]:
        return lambda arm: "-" if arm.get(key) is None else str(arm[key])

    t = columns(
        "End-to-end throughput with sinks",
        [
            ("configuration", lambda arm: arm["label"]),
            ("sinks on", lambda arm: ", ".join(arm.get("sinks_on") or []) or "-"),
            ("calls/s (median)", lambda arm: f"{arm['calls_per_s']:,.1f}"),
            ("loss vs bus, median of paired rounds", loss("loss")),
            ("p25 / p75", lambda arm: f"{loss('loss_p25')(arm)} / {loss('loss_p75')(arm)}"),
            ("loss, total time", loss("loss_total")),
            ("events", count("emitted")),
            ("dropped", count("dropped")),
        ],
        result["arms"].values(),
    )
    sinks = ", ".join(
        f"{name}: {'on' if s['status'] == 'on' else 'skipped (' + s['reason'] + ')'}"
        for name, s in result["sinks"].items()
    )
    t.note = (
        f"Loss: 1 - median over {result.get('rounds', 'n/a')} rounds of the arm's calls/s "
        "over the bus-without-sinks arm's in the same round (positive: slower); arms "
        "interleaved with a rotating start, the same call sequence in every arm and round. "
        f"Sinks: {sinks}."
    )
    return [t]
