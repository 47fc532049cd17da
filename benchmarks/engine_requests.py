"""Where ``vllm serve`` requests' time goes, from omnitrace's own per-request events.

One ``vllm serve`` with omnitrace's defaults (request timing on) serves the engine
benchmark's traffic (:mod:`benchmarks.engine_serving`'s kinds, streamed OpenAI chat requests)
one at a time and eight at a time; every request is found again in the API server's event log by its
id, and its ``RequestTimed`` joined with the encoder steps that served it gives its phases
(:mod:`omnitrace.requests`). At concurrency 1 each request is also split by vLLM's own
histograms around it (:mod:`benchmarks.engine_phases`), so the two methods can be read side
by side: the client's TTFT against the event's, and the engine's part (queue and prefill)
against the event's queue, encoders, prefill and output. A second server with request timing
off (``OMNITRACE_REQUESTS=0``) serves the same concurrency-8 passes: the feature's cost in
requests per second.

    OMNITRACE_BENCH_ENGINE_MODELS=minicpmo python -m benchmarks.engine_requests --out DIR

On a CPU it runs the tiny checkpoints (the plumbing; the numbers mean nothing).
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks import engine, engine_phases, engine_serving
from benchmarks.common import Context


def _serve(
    ctx: Context,
    config: engine_serving.Configuration,
    model: Path,
    work: Path,
    kinds: Sequence[engine_serving.RequestKind],
    *,
    per_kind: int,
    c8_rounds: int,
    solo: bool,
    minicpmo: bool,
) -> dict[str, Any]:
    started = time.perf_counter()
    with engine_serving.serving(
        config, model, work, ctx, max_num_seqs=8, trust_remote_code=minicpmo
    ) as server:
        ready_s = time.perf_counter() - started
        for warm in range(2):
            engine_serving.run_pass(
                server,
                engine_serving.schedule(kinds, 1, warm),
                seed=100 + warm,
                concurrency=1,
                tokens=1,
            )
        out: dict[str, Any] = {"ready_s": ready_s}
        passes = []
        if solo:
            passes.append(
                engine_serving.run_pass(
                    server,
                    engine_serving.schedule(kinds, per_kind, 7),
                    seed=201,
                    concurrency=1,
                    tokens=4,
                )
            )
        rates = []
        for r in range(c8_rounds):
            batch = engine_serving.run_pass(
                server,
                engine_serving.schedule(kinds, per_kind, 11 + r),
                seed=300 + r,
                concurrency=8,
                tokens=4,
            )
            passes.append(batch)
            rates.append(len(batch.completions) / batch.wall_s)
        out["c8_requests_per_s"] = rates
        # The processes' buses drain every 50 ms: let the last requests' events reach the
        # logs before the server is stopped.
        time.sleep(1.0)
    # After the server stopped: every process flushed its event log.
    logs = server.events
    out["logs"] = [p.name for p in logs]
    views = engine_phases.event_views(logs)
    out["request_events"] = len(views)
    out["problems"] = []
    timed = config.plugin and config.env.get("OMNITRACE_REQUESTS") != "0"
    for p in passes if timed else ():
        table, problems = engine_phases.phase_table(p.completions, views)
        out[f"c{p.concurrency}"] = table
        out["problems"] += [f"c{p.concurrency} {x}" for x in problems]
    return out


def run(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    cuda = torch.cuda.is_available()
    scale = "full" if cuda else "tiny"
    out = Path(args.out).resolve()
    ctx = Context(scale=scale, out_dir=out, cuda=cuda)
    result: dict[str, Any] = {"device": torch.cuda.get_device_name(0) if cuda else "cpu"}
    for model_kind in engine.models():
        work = out / "engine-requests" / model_kind
        model = engine._checkpoint(model_kind, work / "checkpoint", scale)
        names = set(args.kinds.split(",")) if args.kinds else None
        kinds = [
            k
            for k in engine_serving.request_kinds(scale, model_kind)
            if names is None or k.name in names
        ]
        base = next(c for c in engine_serving.configurations(model_kind) if c.name == "omnitrace")
        on = engine_serving.Configuration("requests-on", dict(base.overrides))
        off = engine_serving.Configuration(
            "requests-off", dict(base.overrides), env={"OMNITRACE_REQUESTS": "0"}
        )
        entry: dict[str, Any] = {"kinds": [k.name for k in kinds], "per_kind": args.per_kind}
        result[model_kind] = entry

        serve = functools.partial(
            _serve,
            ctx,
            model=model,
            work=work,
            kinds=kinds,
            per_kind=args.per_kind,
            c8_rounds=args.c8_rounds,
            minicpmo=model_kind == "minicpmo",
        )
        ctx.log(f"{model_kind}: {on.name}")
        entry["on"] = serve(on, solo=True)
        # Written after each server, so a run cut short keeps what it measured.
        (out / "engine-requests.json").write_text(json.dumps(result, indent=1))
        if args.cost:
            ctx.log(f"{model_kind}: {off.name}")
            entry["off"] = serve(off, solo=False)
            on_rate = statistics.median(entry["on"]["c8_requests_per_s"])
            off_rate = statistics.median(entry["off"]["c8_requests_per_s"])
            entry["cost_c8_pct"] = 100.0 * (off_rate - on_rate) / off_rate
        (out / "engine-requests.json").write_text(json.dumps(result, indent=1))
    return result


def table(result: dict[str, Any]) -> str:
    from omnitrace.requests import PHASES

    lines = []
    for model_kind, entry in result.items():
        if model_kind == "device":
            continue
        on = entry["on"]
        lines.append(
            f"\n{model_kind} on {result['device']}: {entry['per_kind']} requests a kind per "
            f"pass, server ready in {on['ready_s']:.0f} s, {on['request_events']} request events"
        )
        for c in ("c1", "c8"):
            if c not in on:
                continue
            lines += [
                "",
                f"| {c} kind | client TTFT p50 | event TTFT p50 | "
                + " | ".join(PHASES)
                + " | engine part: histograms / events |",
                "|---|---|---|" + "---|" * (len(PHASES) + 1),
            ]
            for kind, r in on[c].items():
                cells = " | ".join(f"{r['phases_mean_ms'][p]:.1f}" for p in PHASES)
                part = r.get("engine_part_ms")
                both = " / ".join(f"{v:.1f}" for v in part.values()) if part else "n/a"
                lines.append(
                    f"| {kind} | {r['client_ttft_p50_ms']:.1f} | {r['event_ttft_p50_ms']:.1f} "
                    f"| {cells} | {both} |"
                )
        rates = ", ".join(f"{x:.2f}" for x in on["c8_requests_per_s"])
        lines.append(f"\nc8 requests/s, request timing on: {rates}")
        if "off" in entry:
            rates = ", ".join(f"{x:.2f}" for x in entry["off"]["c8_requests_per_s"])
            lines.append(f"c8 requests/s, request timing off: {rates}")
            lines.append(f"cost (median of the passes): {entry['cost_c8_pct']:+.2f} %")
        for problem in on["problems"]:
            lines.append(f"PROBLEM: {problem}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.engine_requests", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--out", required=True)
    parser.add_argument("--per-kind", type=int, default=8)
    parser.add_argument("--c8-rounds", type=int, default=2)
    parser.add_argument("--kinds", default="", help="comma-separated kind names (default all)")
    parser.add_argument("--no-cost", dest="cost", action="store_false")
    args = parser.parse_args(argv)
    result = run(args)
    text = table(result)
    print(text)
    (Path(args.out) / "engine-requests.md").write_text(text + "\n")
    bad = [m for m, e in result.items() if m != "device" and e["on"]["problems"]]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
