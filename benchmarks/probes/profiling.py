"""Do graphs captured during vLLM's start-up profiling run ever serve a request?

vLLM profiles memory at start-up by calling the encoders with dummy inputs of the maximum
size (``GPUModelRunner.profile_run``: one batch of the most items of the largest feature
size). A graph captured then takes one of the encoder's ``max_graphs`` slots for good. This
measures it on MiniCPM-o-shaped traffic (the demo's seeded mix, ``omnitrace.demo.traffic``):
per scenario, ``rounds`` profiling runs of maximum-size dummy calls (vision: a batch of
``slices`` full 1024-token slices; audio: a 30-second clip) in the ``profiling`` phase, then
``requests`` requests of the mix while serving, through real adapters on the simulated
backend with the default admission settings. It reports, per encoder, the graphs captured
while profiling, how many of them serving ever replayed, the serving hit rate and capacity
misses, and the same run with ``encoder_cuda_graph_skip_profiling``.

CPU only: admission decides by keys, so the forward is a stand-in and no timing is measured.
``python -m benchmarks.probes.profiling`` prints the table; ``--json PATH`` writes the figures.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from benchmarks.common import write_json
from omnitrace import EncoderCudaGraph, EncoderGraphConfig, EventBus, derive_coverage
from omnitrace.demo.encoders import MEL_BINS
from omnitrace.demo.traffic import FRAMES_PER_SECOND, Request, TrafficMix
from omnitrace.events import Event, GraphMissed, MissReason, Phase
from omnitrace.integrations.vllm_plugin import profiling_phase
from omnitrace.testing import SimulatedGraphBackend, capture_events

NAME = "profiling"
#: The demo's hidden size (the shapes, not the model, decide admission).
HIDDEN = 64
#: Tokens of a full 448x448 slice (32x32 patches of 14 pixels).
SLICE_TOKENS = 1024
#: The demo's share of the run after which new shapes arrive in a burst.
BURST_AT = 0.85


@dataclass(frozen=True, slots=True)
class Scenario:
    """One run: profiling rounds before serving, and the settings."""

    rounds: int
    """Profiling runs before serving (vLLM 0.26 and 0.33 make one per worker start)."""
    slices: int
    """Image slices in the dummy vision batch (MiniCPM-o: up to 9 slices and a thumbnail)."""
    skip_profiling: bool
    seed: int
    requests: int


def _inputs(request: Request, cache: dict[Any, tuple[torch.Tensor | None, ...]]) -> Any:
    """Zero tensors of the request's shapes (admission keys on shape, dtype and stream)."""
    key = (request.kind, request.batch, request.length, request.masked)
    inputs = cache.get(key)
    if inputs is None:
        if request.kind == "audio":
            inputs = (torch.zeros(request.batch, MEL_BINS, request.length),)
        else:
            mask = None
            if request.masked:
                mask = torch.ones(
                    request.batch, 1, request.length, request.length, dtype=torch.bool
                )
            inputs = (torch.zeros(request.batch, request.length, HIDDEN), mask)
        cache[key] = inputs
    return inputs


def run_scenario(scenario: Scenario) -> dict[str, Any]:
    """Profile, then serve the seeded mix; return per-encoder figures from the events."""
    config = EncoderGraphConfig(min_free_bytes=0, skip_profiling=scenario.skip_profiling)
    bus = EventBus()
    backend = SimulatedGraphBackend()
    adapters = {
        name: EncoderCudaGraph(
            lambda x, *rest: x * 1, name=name, config=config, bus=bus, backend=backend
        )
        for name in ("vision", "audio")
    }
    cache: dict[Any, tuple[torch.Tensor | None, ...]] = {}
    dummies = {
        "vision": Request("vision", scenario.slices, SLICE_TOKENS),
        "audio": Request("audio", 1, 30 * FRAMES_PER_SECOND),
    }
    mix = TrafficMix(scenario.seed)
    streaming = 0
    try:
        with capture_events(bus) as events, torch.no_grad():
            for _ in range(scenario.rounds):
                with profiling_phase(adapters.values()):
                    for name, dummy in dummies.items():
                        adapters[name](*_inputs(dummy, cache))
            for index in range(scenario.requests):
                request = mix.next(burst=index >= BURST_AT * scenario.requests)
                if request.kind == "streaming":
                    streaming += 1  # stateful: never reaches the adapter
                    continue
                adapters[request.kind](*_inputs(request, cache))
            recorded: list[Event] = list(events)
    finally:
        bus.close()
    coverage = derive_coverage(recorded)
    out: dict[str, Any] = {"streaming_calls": streaming}
    for name in adapters:
        adapter = coverage[name]
        serving = adapter.in_phase(Phase.SERVING)
        profiled = [row for row in adapter.captured if row.capture_phase is Phase.PROFILING]
        out[name] = {
            "profiling_calls": adapter.in_phase(Phase.PROFILING).calls,
            "profiling_captures": len(profiled),
            "profiling_graphs_replayed_in_serving": sum(
                1 for row in profiled if row.in_phase(Phase.SERVING).hits
            ),
            "serving_hits_on_profiling_graphs": sum(
                row.in_phase(Phase.SERVING).hits for row in profiled
            ),
            "graphs": len(adapter.captured),
            "serving_calls": serving.calls,
            "serving_hits": serving.hits,
            "serving_hit_rate": serving.hit_rate,
            "serving_capacity_misses": serving.misses[MissReason.CAPACITY],
            "skipped_profiling_calls": sum(
                1
                for e in recorded
                if isinstance(e, GraphMissed) and e.adapter == name and e.detail == "profiling"
            ),
        }
    return out


def measure(
    *, seeds: Sequence[int], requests: int, rounds: Sequence[int], slices: int
) -> dict[str, Any]:
    """Run every scenario (profiling rounds x skip_profiling x seed) and total them."""
    rows = []
    for count in rounds:
        for skip in (False, True):
            totals: dict[str, dict[str, float]] = {}
            per_seed = []
            for seed in seeds:
                result = run_scenario(Scenario(count, slices, skip, seed, requests))
                per_seed.append({"seed": seed, **result})
                for name in ("vision", "audio"):
                    slot = totals.setdefault(name, {})
                    for key, value in result[name].items():
                        if key != "serving_hit_rate":
                            slot[key] = slot.get(key, 0) + value
            for slot in totals.values():
                slot["serving_hit_rate"] = (
                    slot["serving_hits"] / slot["serving_calls"] if slot["serving_calls"] else 0.0
                )
            rows.append(
                {"rounds": count, "skip_profiling": skip, "totals": totals, "seeds": per_seed}
            )
    return {
        "seeds": list(seeds),
        "requests": requests,
        "slices": slices,
        "settings": EncoderGraphConfig(min_free_bytes=0).to_hf_overrides(),
        "rows": rows,
    }


def table(result: dict[str, Any]) -> str:
    """Render the totals as a fixed-width text table."""
    head = (
        f"{'profiling runs':>14}  {'skip':>4}  {'encoder':<7}  {'prof. calls':>11}  "
        f"{'prof. graphs':>12}  {'ever replayed':>13}  {'serving hit rate':>16}  "
        f"{'capacity misses':>15}"
    )
    lines = [head, "-" * len(head)]
    for row in result["rows"]:
        skip = "yes" if row["skip_profiling"] else "no"
        for name, slot in row["totals"].items():
            lines.append(
                f"{row['rounds']:>14}  {skip:>4}  {name:<7}  "
                f"{slot['profiling_calls']:>11.0f}  {slot['profiling_captures']:>12.0f}  "
                f"{slot['profiling_graphs_replayed_in_serving']:>13.0f}  "
                f"{slot['serving_hit_rate'] * 100:>15.1f}%  "
                f"{slot['serving_capacity_misses']:>15.0f}"
            )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the measurement, print the table, and write JSON if asked; return 0."""
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.probes.profiling", description=__doc__
    )
    parser.add_argument("--seeds", type=int, default=5, help="traffic seeds 0..N-1 (default 5)")
    parser.add_argument("--requests", type=int, default=2000, help="requests per run (2000)")
    parser.add_argument("--slices", type=int, default=10, help="slices of the vision dummy (10)")
    parser.add_argument(
        "--rounds", default="1,2", help="profiling runs before serving, comma-separated (1,2)"
    )
    parser.add_argument("--json", type=Path, default=None, help="also write the figures here")
    args = parser.parse_args(argv)
    rounds = [int(part) for part in args.rounds.split(",")]
    result = measure(
        seeds=range(args.seeds), requests=args.requests, rounds=rounds, slices=args.slices
    )
    print(
        f"{len(result['seeds'])} seeds x {args.requests} requests of the demo's MiniCPM-o mix, "
        f"max_graphs 4, min_capture_calls 2; totals over seeds"
    )
    print(table(result))
    if args.json is not None:
        write_json(args.json, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
