"""Profile: where the adapter's hit path spends host time, step by step, on a CUDA device.

The latency benchmark compares whole calls; this splits one hit of the torch backend into its
steps and times each alone (host time per call, no device synchronisation inside the timed
loop, the device drained between loops), beside the bare copy-replay-clone it is held to.
The ``idle device:`` rows time single calls each started on an idle device, as the latency
benchmark does, arms taking turns call by call.

Usage (GPU): python3 -m benchmarks.probes.hitpath_profile [--json PATH]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from benchmarks.common import BareGraph, write_json
from omnitrace import EncoderCudaGraph, EncoderGraphConfig, EventBus
from omnitrace.demo.encoders import AUDIO_FULL, AudioEncoder
from omnitrace.events import Phase, replayed
from omnitrace.graphs.eligibility import call_key, state_detail


def _time(fn: Callable[[], Any], *, calls: int = 200, rounds: int = 15) -> float:
    """Median over rounds of the mean host time per call, in microseconds."""
    samples = []
    for _ in range(rounds):
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        samples.append((time.perf_counter() - start) / calls * 1e6)
        torch.cuda.synchronize()
    return statistics.median(samples)


def _time_idle(arms: dict[str, Callable[[], Any]], *, calls: int = 400) -> dict[str, float]:
    """Median host time per call, in microseconds, each call started on an idle device.

    As the latency benchmark times a call: synchronise, then time one call. Arms take turns
    call by call, so drift of the machine reaches them all alike.
    """
    samples: dict[str, list[float]] = {name: [] for name in arms}
    for _ in range(calls):
        for name, fn in arms.items():
            torch.cuda.synchronize()
            start = time.perf_counter()
            fn()
            samples[name].append((time.perf_counter() - start) * 1e6)
    torch.cuda.synchronize()
    return {name: statistics.median(values) for name, values in samples.items()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="write the figures to this file")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("error: needs a CUDA device", file=sys.stderr)
        return 2
    torch.manual_seed(0)
    model = AudioEncoder(AUDIO_FULL).to("cuda", torch.bfloat16).eval()
    mel = torch.randn(1, 80, 100, device="cuda", dtype=torch.bfloat16)
    results: dict[str, float] = {}
    with torch.no_grad():
        bare = BareGraph(model, mel)
        adapter = EncoderCudaGraph(model, name="a", config=EncoderGraphConfig(min_free_bytes=0))
        bus = EventBus()
        with_bus = EncoderCudaGraph(
            model, name="b", config=EncoderGraphConfig(min_free_bytes=0), bus=bus
        )
        for graph in (adapter, with_bus):
            for _ in range(3):
                graph(mel)
        assert adapter.num_graphs == 1
        (entry,) = adapter._graphs.values()
        device = mel.device
        backend = adapter.backend
        inputs = (mel,)
        signature = entry.signature
        results["bare copy-replay-clone"] = _time(lambda: bare(mel))
        results["graph.replay(inputs) (copy-in, replay, clone)"] = _time(
            lambda: entry.graph.replay(inputs)
        )
        results["adapter call, no bus"] = _time(lambda: adapter(mel))
        results["adapter call, bus (stats + coverage folds)"] = _time(lambda: with_bus(mel))
        results["call_key(inputs)"] = _time(lambda: call_key(inputs), calls=2000)
        results["backend.stream_id(device)"] = _time(lambda: backend.stream_id(device), calls=2000)
        results["state_detail(device, backend)"] = _time(
            lambda: state_detail(device, backend), calls=2000
        )
        results["torch.cuda.is_current_stream_capturing()"] = _time(
            torch.cuda.is_current_stream_capturing, calls=2000
        )
        results["torch.is_autocast_enabled('cuda')"] = _time(
            lambda: torch.is_autocast_enabled("cuda"), calls=2000
        )
        results["replayed(...) event"] = _time(
            lambda: replayed("a", signature, 1, 2, 0.1, Phase.SERVING), calls=2000
        )
        event = replayed("a", signature, 1, 2, 0.1, Phase.SERVING)
        results["bus.emit(event)"] = _time(lambda: bus.emit(event), calls=2000)

        def checks() -> Any:
            # The hit path's steps before the replay: key, lookup, process state.
            found = call_key(inputs)
            assert found is not None
            adapter._graphs.get((found[0], backend.stream_id(found[0]), found[1]))
            return state_detail(device, backend)

        idle = _time_idle(
            {
                "bare copy-replay-clone": lambda: bare(mel),
                "graph.replay(inputs) (copy-in, replay, clone)": lambda: entry.graph.replay(inputs),
                "adapter call, no bus": lambda: adapter(mel),
                "adapter call, bus (stats + coverage folds)": lambda: with_bus(mel),
                "key, lookup and state checks": checks,
                "call_key(inputs)": lambda: call_key(inputs),
                "backend.stream_id(device)": lambda: backend.stream_id(device),
                "state_detail(device, backend)": lambda: state_detail(device, backend),
                "torch.cuda.is_current_stream_capturing()": (
                    torch.cuda.is_current_stream_capturing
                ),
                "torch.is_grad_enabled()": torch.is_grad_enabled,
                "replayed(...) event": lambda: replayed("a", signature, 1, 2, 0.1, Phase.SERVING),
            }
        )
        for name, value in idle.items():
            results[f"idle device: {name}"] = value
        bus.close()
    width = max(map(len, results))
    for name, value in results.items():
        print(f"{name:<{width}}  {value:8.2f} us")
    if args.json:
        write_json(Path(args.json), results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
