"""The end-to-end benchmark's tables in ``BENCHMARKS.md``, rendered by :mod:`benchmarks.report`."""

from __future__ import annotations

import json
from typing import Any

from benchmarks import engine_checks, served_pairs
from benchmarks.engine_phases import PHASES as HISTOGRAM_PHASES
from benchmarks.paired import pairs_table
from benchmarks.table import Table, mib, ms


def _agreement(e: dict[str, Any]) -> str:
    """Completions like eager's: solo (parity, or a count where items are split), batched."""
    if "batched_requests" not in e:
        return "baseline"
    solo = e.get("parity_with_eager")
    first = f"{e['solo_equal_eager']} of {e['solo_requests']}" if solo is None else "NO"
    return f"{'yes' if solo else first}, {e['batched_equal_eager']} of {e['batched_requests']}"


def tables(result: dict[str, Any]) -> list[Table]:
    tables: list[Table] = []
    setup = [f"{result['sizes']} sizes"]
    if (tp := result.get("tensor_parallel_size", 1)) > 1:
        setup.append(f"tensor-parallel over {tp}")
    if (api_servers := result.get("api_server_count", 1)) > 1:
        setup.append(f"{api_servers} API servers")
    if result.get("lm_graph_tokens"):
        setup.append(f"language model's CUDA graphs to {result['lm_graph_tokens']} tokens")
    if result.get("mm_processor_kwargs"):
        setup.append(f"--mm-processor-kwargs {json.dumps(result['mm_processor_kwargs'])}")
    if result.get("graph_overrides"):
        setup.append(f"omnitrace's graphs with {json.dumps(result['graph_overrides'])}")
    for model in result.get("models", {}).values():
        configs: dict[str, Any] = model["configurations"]
        if not configs:
            continue
        concurrencies = sorted(
            {row["concurrency"] for c in configs.values() for row in c["rows"].values()}
        )
        ttft = Table(
            f"{model['name']} ({', '.join(setup)}): TTFT p50 / p99 (ms) by request kind",
            ["request kind"] + [f"{name}, c{c}" for c in concurrencies for name in configs],
        )
        for kind in model["kinds"]:
            found = [e["rows"].get(f"c{c}/{kind}") for c in concurrencies for e in configs.values()]
            cells = [
                f"{ms(r['ttft_p50_ms'])} / {ms(r['ttft_p99_ms'])}" if r else "n/a" for r in found
            ]
            ttft.rows.append([kind, *cells])
        flight = " and ".join(f"c{c}" for c in concurrencies)
        ttft.note = (
            f"{model['per_kind']} requests of each kind per pass, {model['max_tokens']} output "
            f"tokens, greedy; {flight}: requests in flight. p99 of so few samples is their maximum."
        )
        rates = [f"requests/s c{c}" for c in concurrencies]
        counts = ["graphs", "hits / misses", "hits after warm-up", "pool MiB", "KV cache tokens"]
        headers = ["configuration", "ready (s)", *rates, "encoder share of TTFT, c1", *counts]
        engines = Table(
            f"{model['name']}: engines", [*headers, "tokens equal eager's: c1, batched"]
        )
        for name, entry in configs.items():
            share = entry.get("encoder_share_of_ttft_c1")
            engines.rows.append(
                [
                    name,
                    f"{entry['ready_s']:.0f}",
                    *(f"{entry['requests_per_s'].get(f'c{c}', 0.0):.2f}" for c in concurrencies),
                    "n/a" if share is None else f"{100 * share:.1f} %",
                    str(entry["graphs"]),
                    f"{entry['hits']} / {entry['misses']}",
                    _hit_rate(entry.get("after_warmup")),
                    mib(entry["pool_bytes"]),
                    "n/a" if entry["kv_cache_tokens"] is None else f"{entry['kv_cache_tokens']:,}",
                    _agreement(entry),
                ]
            )
        missing = "; ".join(f"{k}: {v}" for k, v in model.get("not_applicable", {}).items())
        notes = ["Not applicable: " + missing + "."] if missing else []
        for name, entry in configs.items():
            per_adapter = [
                f"{adapter} {a['graphs']} graphs, {a['hits']} hits, misses "
                + (", ".join(f"{r} {n}" for r, n in sorted(_misses(a).items())) or "none")
                for adapter, a in sorted((entry.get("adapters") or {}).items())
            ]
            if per_adapter and entry["graphs"]:
                notes.append(f"{name}: " + "; ".join(per_adapter) + ".")
            notes.append(f"{name}: {engine_checks.cold_passes_note(entry)}.")
        engines.note = " ".join(notes)
        tables += [ttft, engines, *_engine_phases(model, configs)]
        tables += [*_event_phases(model, configs), *_offline(model), *served_pairs.tables(model)]
    return tables


def _hit_rate(after: dict[str, Any] | None) -> str:
    if not after or after.get("hit_rate") is None:
        return "n/a"
    return f"{100 * after['hit_rate']:.1f} % of {after['calls']}"


def _event_phases(model: dict[str, Any], configs: dict[str, Any]) -> list[Table]:
    """Each kind's phases at every concurrency, from omnitrace's per-request events."""
    from omnitrace.requests import PHASES

    table = Table(
        f"{model['name']}: where the TTFT goes, from the request events (mean ms)",
        ["request kind", "configuration", "concurrency", "event TTFT p50", *PHASES],
    )
    for name, entry in configs.items():
        for concurrency, rows in (entry.get("event_phases") or {}).items():
            for kind, row in rows.items():
                phases = [ms(row["phases_mean_ms"][p]) for p in PHASES]
                table.rows.append([kind, name, concurrency, ms(row["event_ttft_p50_ms"]), *phases])
    if not table.rows:
        return []
    problems = [f"{n}: {p}" for n, e in configs.items() for p in e.get("event_problems", [])]
    table.note = (
        "Each request's RequestTimed joined with the encoder steps that served it "
        "(omnitrace.requests), read after the server stopped."
        + (" Not found: " + "; ".join(problems) + "." if problems else "")
    )
    return [table]


def _offline(model: dict[str, Any]) -> list[Table]:
    """The offline pairs: graphs off and on inside one vllm.LLM engine, same kinds."""
    paired = model.get("offline_paired")
    if not paired:
        return []
    table = pairs_table(
        f"{model['name']}: offline, graphs off and on inside one engine (ms)", paired["kinds"]
    )
    table.note = (
        f"benchmarks.paired in the same invocation, before the servers: {paired['pairs']} "
        f"pairs a kind after {paired['warmup']} warm-up rounds, one token a request, eager and "
        "graphed alternating inside one engine."
        + (" PROBLEMS: " + "; ".join(paired["problems"]) if paired.get("problems") else "")
    )
    return [table]


def _engine_phases(model: dict[str, Any], configs: dict[str, Any]) -> list[Table]:
    """Where each kind's TTFT went at concurrency 1, when the run measured it."""
    table = Table(
        f"{model['name']}: where the TTFT goes, c1 (mean ms)",
        ["request kind", "configuration", "TTFT", *HISTOGRAM_PHASES],
    )
    measured = False
    for kind in model["kinds"]:
        for name, entry in configs.items():
            phases = (entry["rows"].get(f"c1/{kind}") or {}).get("phases_mean_ms")
            if phases is None:
                # A request the histograms did not count alone: shown, not left out.
                table.rows.append([kind, name, *["n/a"] * (1 + len(HISTOGRAM_PHASES))])
                continue
            measured = True
            total = sum(phases[p] for p in HISTOGRAM_PHASES)
            table.rows.append([kind, name, ms(total), *(ms(phases[p]) for p in HISTOGRAM_PHASES)])
    if not measured:
        return []
    table.note = (
        "From vLLM's own histograms read around each request, one request at a time: "
        "rendering is from the request's arrival at vLLM's renderer (chat template, decoding "
        "the media, the model's processor) to the first token, less queue and prefill, so it "
        "also holds the hand-offs between the server and the engine core; queue is the "
        "scheduler's wait; prefill is from the first schedule to the first token (the encoders "
        "and the language model's prefill); outside is the rest of the client's TTFT (HTTP and "
        "request handling). Means, so the phases add up to the mean TTFT."
    )
    return [table]


def _misses(adapter: dict[str, Any]) -> dict[str, int]:
    """An adapter's misses by reason and detail (``capacity/budget``), or by reason alone in
    results written before details were counted."""
    return dict(adapter.get("miss_details") or adapter["misses"])
