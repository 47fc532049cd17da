"""End to end through ``vllm serve``: per model, after the offline pairs (:mod:`benchmarks.paired`),
one server per configuration (:func:`benchmarks.engine_serving.configurations`), each sent the
same seeded traffic; BENCHMARKS.md, "End to end", has what it measures and its variables."""

from __future__ import annotations

import functools
import importlib
import json
import os
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from statistics import median
from typing import Any

from benchmarks import engine_checks, engine_phases, engine_serving, served_pairs
from benchmarks.common import BenchmarkFailedError, Context, save_plot, summarize, write_partial
from benchmarks.engine_serving import AGAIN, MODELS, Configuration, Pass, RequestKind, Server
from benchmarks.paired import mm_processor_kwargs, write_checkpoint

NAME = "engine"
#: Runs on a CPU at toy sizes (the engine CI tier); full scale needs CUDA (checked in run()).
NEEDS_CUDA = False


#: Published end-to-end anchors the results are read beside.
ANCHORS = (
    "sglang-omni Qwen3-Omni encoder graphs: TTFT -37.8 % at concurrency 1, -53.7 % at 32 "
    "(its PR #1628)",
    "vLLM encoder graphs, Qwen3-VL: mean latency -11.8 % to -44.4 % (vLLM #35963); Step3-VL "
    "slower with them on (vLLM #41714)",
)


#: vLLM 0.26's model class of each checkpoint kind, checked for its encoder graph protocol.
VLLM_MODEL_CLASSES = {
    "qwen2_5_omni": (
        "vllm.model_executor.models.qwen2_5_omni_thinker",
        "Qwen2_5OmniThinkerForConditionalGeneration",
    ),
    "minicpmo": ("vllm.model_executor.models.minicpmo", "MiniCPMO4_5"),
}


def _model_supports_vllm_encoder_graphs(model_kind: str) -> tuple[bool, str]:
    """Whether vLLM's model class for ``model_kind`` implements its encoder graph protocol."""
    module, cls = VLLM_MODEL_CLASSES[model_kind]
    try:
        found = getattr(importlib.import_module(module), cls)
    except Exception as exc:
        return False, f"{module}.{cls} cannot be imported here ({type(exc).__name__}: {exc})"
    if callable(getattr(found, "encoder_cudagraph_forward", None)):
        return True, ""
    return False, f"{cls} does not implement SupportsEncoderCudaGraph in this vLLM"


def _p99(samples: Sequence[float]) -> float:
    """The nearest-rank 99th percentile of ``samples`` (of a few dozen, their maximum)."""
    ordered = sorted(samples)
    return ordered[round(0.99 * (len(ordered) - 1))]


def _kind_rows(passes: Sequence[Pass]) -> dict[str, dict[str, Any]]:
    rows: dict[str, dict[str, Any]] = {}
    for p in passes:
        by_kind: dict[str, list[float]] = {}
        for c in p.completions:
            by_kind.setdefault(c.kind, []).append(c.ttft_s)
        for kind, samples in by_kind.items():
            stats = summarize(samples, scale=1e3)
            row = rows[f"c{p.concurrency}/{kind}"] = {"concurrency": p.concurrency, "kind": kind}
            row.update(n=stats["n"], ttft_p50_ms=stats["median"], ttft_p99_ms=_p99(samples) * 1e3)
            if p.concurrency == 1:
                mine = [c.phases for c in p.completions if c.kind == kind]
                row["phases_mean_ms"] = engine_phases.mean_phases_ms(mine)
                row["engine_ttft_p50_ms"] = engine_phases.engine_ttft_p50_ms(mine)
    return rows


def _chosen(variable: str, known: Sequence[str]) -> list[str]:
    """The comma-separated names ``variable`` holds, each one of ``known``; all when unset."""
    raw = os.environ.get(variable, "").strip()
    if not raw:
        return list(known)
    names = [name.strip() for name in raw.split(",") if name.strip()]
    if not names or any(name not in known for name in names):
        raise ValueError(
            f"{variable}: expected a comma-separated list of {', '.join(known)}, got {raw!r}"
        )
    return names


def models() -> list[str]:
    """The model kinds this run serves (``OMNITRACE_BENCH_ENGINE_MODELS``; all by default)."""
    return _chosen("OMNITRACE_BENCH_ENGINE_MODELS", list(MODELS))


def chosen_configurations(model_kind: str) -> list[Configuration]:
    """The configurations this run serves (``OMNITRACE_BENCH_ENGINE_CONFIGS``; all by default),
    in :func:`engine_serving.configurations`' order whatever order the variable names them in:
    eager first, the eager baseline again last, a server that prepares from the defaults'
    logs after the defaults' server."""
    every = engine_serving.configurations(model_kind)
    names = _chosen("OMNITRACE_BENCH_ENGINE_CONFIGS", [c.name for c in every])
    return [c for c in every if c.name in names]


def run(ctx: Context) -> dict[str, Any]:
    """Serve the traffic through each model's configurations back to back; compare with eager."""
    if ctx.scale == "full" and not ctx.cuda:
        raise RuntimeError("the engine benchmark at full scale needs a CUDA device")
    tp = engine_serving.tensor_parallel_size()
    api_servers = engine_serving.api_server_count()
    for model_kind in models():
        chosen_configurations(model_kind)  # a misspelt name fails before any server starts
    offline_enabled()
    cost_rounds()
    processor, graph_tokens = mm_processor_kwargs(), engine_serving.lm_graph_tokens()
    if ctx.cuda and tp > 1:
        import torch

        if (found := torch.cuda.device_count()) < tp:
            need = f"OMNITRACE_BENCH_ENGINE_TP={tp} needs {tp} CUDA devices"
            raise RuntimeError(f"{need}, this machine has {found}")
    result: dict[str, Any] = {
        "sizes": "released" if ctx.scale == "full" else "tiny",
        "tensor_parallel_size": tp,
        "api_server_count": api_servers,
        "mm_processor_kwargs": processor,
        "graph_overrides": engine_serving.graph_overrides() or None,
        "lm_graph_tokens": graph_tokens if ctx.cuda else None,
        "anchors": list(ANCHORS),
        "models": {},
        "targets": [],
        "figures": [],
    }
    for model_kind in models():
        ctx.log(f"  {MODELS[model_kind]}")
        result["models"][model_kind] = entry = _run_model(ctx, model_kind, result, tp, api_servers)
        engine_checks.check_model(result, model_kind, entry)
        write_partial(ctx, NAME, result)
    for model_kind, entry in result["models"].items():
        for name, config in entry["configurations"].items():
            if config.get("parity_with_eager") is False:
                raise BenchmarkFailedError(
                    f"{MODELS[model_kind]}: {name}'s completions differ from eager's", result
                )
    return result


def _run_model(
    ctx: Context, model_kind: str, result: dict[str, Any], tp: int, api_servers: int = 1
) -> dict[str, Any]:
    # Absolute: each server runs in its own directory.
    name = model_kind if tp == 1 else f"{model_kind}-tp{tp}"
    work = (ctx.out_dir / "engine-work" / name).resolve()
    model = work / "checkpoint"  # the released sizes at full scale, written once
    if not model.exists():
        write_checkpoint(model_kind, model, released=ctx.scale == "full")
    kinds = engine_serving.request_kinds(ctx.scale, model_kind)
    per_kind = ctx.pick(8, 2, 1)
    tokens = ctx.pick(8, 4, 2)
    concurrencies = ctx.pick((1, 8, 32), (1, 4), (1, 2))
    chosen = chosen_configurations(model_kind)
    if ctx.scale != "full":
        # On a CPU nothing graphs: eager, graphs and eager again check the plumbing.
        chosen = [c for c in chosen if c.name in ("eager", "omnitrace", AGAIN)]
    supported, why_not = _model_supports_vllm_encoder_graphs(model_kind)
    entry: dict[str, Any] = {
        "name": MODELS[model_kind],
        "kinds": [k.name for k in kinds],
        "per_kind": per_kind,
        "max_tokens": tokens,
        "vllm_encoder_graphs": {"supported": supported, "reason": why_not},
        "configurations": {},
        "not_applicable": {},
    }
    if offline_enabled():
        ctx.log("  offline: graphs off and on inside one vllm.LLM engine (benchmarks.paired)")
        entry["offline_paired"] = _offline(ctx, model_kind, work)
    texts: dict[str, dict[str, list[int]]] = {}
    for config in chosen:
        if config.compilation is not None and not supported:
            entry["not_applicable"][config.name] = why_not
            ctx.log(f"  {config.name}: not applicable ({why_not})")
            continue
        ctx.log(f"  {config.name}: starting vllm serve")
        started = time.perf_counter()
        with engine_serving.serving(
            config,
            model,
            work,
            ctx,
            max_num_seqs=max(concurrencies),
            trust_remote_code=model_kind == "minicpmo",
            tp=tp,
            api_servers=api_servers,
        ) as server:
            ready_s = time.perf_counter() - started
            # What holds the device beside the server: its memory is the graphs' headroom.
            on_gpu = engine_serving.gpu_processes() if ctx.cuda else None
            harness = sum(p["used_mib"] for p in on_gpu or () if p["harness"])
            if harness:
                ctx.log(f"  {config.name}: this process holds {harness} MiB of GPU memory")
            # Warm-up: every shape min_capture_calls times, so the graphs are in place; then
            # the batch shapes each concurrency above one forms (its cold pass, kept apart).
            send = functools.partial(engine_serving.run_pass, server)
            for warm in range(2):
                warmup = engine_serving.schedule(kinds, 1, warm)
                send(warmup, seed=100 + warm, concurrency=1, tokens=1)
            traffic = engine_serving.schedule(kinds, per_kind, 7)
            cold = _cold_passes(server, send, traffic, concurrencies[1:], tokens)
            warmed = engine_checks.line_counts(server.events)
            passes = []
            device_s_c1: float | None = None
            for concurrency in concurrencies:
                skip = engine_checks.line_counts(server.events)
                # Above c1 a pass lasts seconds and its rate swings: the median of repeats,
                # each with new media (a repeat would hit vLLM's processor cache).
                repeats = 1 if concurrency == 1 else ctx.pick(3, 2, 2)
                seeds = [200 + concurrency + 1000 * r for r in range(repeats)]
                runs = [
                    send(traffic, seed=s, concurrency=concurrency, tokens=tokens) for s in seeds
                ]
                passes.append(engine_serving.repeated(runs))
                if concurrency == 1 and config.plugin:
                    device_s_c1 = engine_checks.device_s_since(server.events, skip)
            # Hits after the warm-up count the measured passes only, not the pairs.
            figures = engine_checks.event_figures(server.events)
            plugin = config.plugin
            after_warmup = engine_checks.hits_since(server.events, warmed) if plugin else None
            slowest = engine_checks.slowest_calls(server.events, warmed) if plugin else None
            pairs = _served_pairs(ctx, server, kinds, api_servers) if config.paired else None
            ttft_c1 = sum(c.ttft_s for c in passes[0].completions)
            share = None if device_s_c1 is None or ttft_c1 <= 0 else device_s_c1 / ttft_c1
            row = {
                "ready_s": ready_s,
                "gpu_processes_at_ready": on_gpu,
                "cold_passes": cold,
                "kv_cache_tokens": server.kv_cache_tokens(),
                "rows": _kind_rows(passes),
                "requests_per_s": {f"c{p.concurrency}": median(p.rates) for p in passes},
                "requests_per_s_repeats": {f"c{p.concurrency}": p.rates for p in passes},
                "encoder_share_of_ttft_c1": share,
                # The measured passes' encoder calls: what the graphs served once warm.
                "after_warmup": after_warmup,
                "slowest_calls_after_warmup": slowest,
                **{k: v for k, v in figures.items() if k != "encoder_device_s"},
            }
            mine = {
                f"c{p.concurrency}/{i}": c.tokens
                for p in passes
                for i, c in enumerate(p.completions)
            }
            texts[config.name] = mine
            if "eager" in texts and config.name != "eager":
                row.update(engine_checks.eager_agreement(mine, texts["eager"], config.overrides))
        if config.plugin:
            # After the server stopped, every process has flushed its log: each request's
            # phases from its own events, per kind and concurrency.
            views = engine_phases.event_views(server.events)
            row.update(event_phases={}, event_problems=[])
            for p in passes:
                table, problems = engine_phases.phase_table(p.completions, views)
                row["event_phases"][f"c{p.concurrency}"] = table
                row["event_problems"] += [f"c{p.concurrency} {x}" for x in problems]
            if pairs is not None:
                row["served_pairs"] = _pair_outcomes(pairs, views)
        entry["configurations"][config.name] = row
        write_partial(ctx, NAME, {**result, "models": {**result["models"], model_kind: entry}})
        ctx.log(f"  {config.name}: served in {time.perf_counter() - started:.0f} s")
    return entry


def _cold_passes(
    server: Server, send: Any, traffic: list[RequestKind], concurrencies: Sequence[int], tokens: int
) -> dict[str, Any]:
    """The traffic twice at each of ``concurrencies`` before the measured passes, so the batch
    shapes it forms are seen ``min_capture_calls`` times: the first (cold) pass's TTFT p50 and
    p99, requests/s and, with the plugin, its encoder hits, by ``c{N}``."""
    cold: dict[str, Any] = {}
    settle_s = 0.5  # the workers' event logs catch up (their buses drain every 50 ms)
    for concurrency in concurrencies:
        time.sleep(settle_s)
        skip = engine_checks.line_counts(server.events)
        first = send(traffic, seed=500 + concurrency, concurrency=concurrency, tokens=tokens)
        time.sleep(settle_s)
        hits = engine_checks.hits_since(server.events, skip) if server.config.plugin else None
        send(traffic, seed=1500 + concurrency, concurrency=concurrency, tokens=tokens)
        ttft = [1e3 * c.ttft_s for c in first.completions]
        rate = len(ttft) / first.wall_s
        cold[f"c{concurrency}"] = dict(
            ttft_p50_ms=median(ttft), ttft_p99_ms=_p99(ttft), requests_per_s=rate, hits=hits
        )
    time.sleep(settle_s)
    return cold


def timing_cost_skipped(api_servers: int) -> str | None:
    """Why request timing's cost is not measured with ``api_servers`` API servers, or None."""
    if api_servers <= 1:
        return None
    why = "POST /omnitrace/request_timing switches the one API server that takes the connection"
    return f"{api_servers} API servers: {why}, so the others would keep timing their requests"


def _served_pairs(
    ctx: Context, server: Server, kinds: Sequence[RequestKind], api_servers: int = 1
) -> dict[str, Any]:
    """Eager and graphed requests of each kind in pairs, one at a time, in this server; then,
    in rounds of batches: request timing off and on (not with several API servers:
    :func:`timing_cost_skipped`), and a call's items as one batch and one call each."""
    client, model = engine_serving.openai_client(server.port)
    ctx.log(f"  {server.config.name}: graphs off and on in pairs (served_pairs)")
    base_url = f"http://127.0.0.1:{server.port}"
    pairs = served_pairs.run(
        base_url,
        kinds,
        lambda kind, seed: engine_serving.one_request(client, model, kind, seed, 1),
        pairs=ctx.pick(8, 2, 1),
        seed=300_000,
    )
    in_rounds = functools.partial(
        served_pairs.batch_rounds,
        kinds,
        lambda kind, seed: engine_serving.one_request(client, model, kind, seed, 4),
        rounds=ctx.pick(cost_rounds(), 2, 1),
        warmup=ctx.pick(2, 0, 0),
    )
    pairs["timing_cost_skipped"] = skipped = timing_cost_skipped(api_servers)
    pairs["timing_cost"] = None
    if skipped is None:
        ctx.log(f"  {server.config.name}: request timing off and on in rounds (served_pairs)")
        timing = functools.partial(served_pairs.time_requests, base_url)
        pairs["timing_cost"] = in_rounds(timing, seed=400_000, after=True)
    else:
        ctx.log(f"  {server.config.name}: request timing's cost not measured ({skipped})")
    ctx.log(f"  {server.config.name}: items batched and split in rounds (served_pairs)")
    split = functools.partial(served_pairs.switch, base_url, names=served_pairs.SPLIT)
    pairs["split_cost"] = in_rounds(split, seed=500_000, after=False)
    return pairs


def _pair_outcomes(pairs: dict[str, Any], views: dict[str, Any]) -> dict[str, Any]:
    """The pairs' summaries and, per half, the outcomes of the encoder calls that served its
    requests (from the request events): every paused call must be ``miss ineligible/paused``
    where graphs capture at all."""
    outcomes: dict[str, dict[str, int]] = {"eager": {}, "graphed": {}}
    missing = 0
    for sent in pairs["requests"]:
        view = views.get(sent["request_id"])
        if view is None:
            missing += 1
            continue
        half = outcomes["eager" if sent["paused"] else "graphed"]
        for step in view.steps:
            for call in step.calls:
                half[call["outcome"]] = half.get(call["outcome"], 0) + 1
    cost = {k: pairs.get(k) for k in ("timing_cost", "timing_cost_skipped", "split_cost")}
    return {"kinds": pairs["kinds"], "encoder_calls": outcomes, "without_event": missing, **cost}


def cost_rounds() -> int:
    """Counted rounds of request timing's cost and of the split at full scale
    (``OMNITRACE_BENCH_ENGINE_COST_ROUNDS``, 16 by default; about 2 s a round at concurrency 8
    on the H200). A 1 % bar needs a 95 % interval under 1 %: about 60 rounds at a ±4 % spread.

    Raises:
        ValueError: the value is not a whole number from 1 to 1000.
    """
    return engine_serving.whole_number("OMNITRACE_BENCH_ENGINE_COST_ROUNDS", default=16, most=1000)


def offline_enabled() -> bool:
    """Whether the offline paired run comes first (``OMNITRACE_BENCH_ENGINE_OFFLINE``, 0 or 1)."""
    raw = os.environ.get("OMNITRACE_BENCH_ENGINE_OFFLINE", "1").strip()
    if raw not in ("0", "1"):
        raise ValueError(f"OMNITRACE_BENCH_ENGINE_OFFLINE: expected 0 or 1, got {raw!r}")
    return raw == "1"


def _offline(ctx: Context, model_kind: str, work: Path) -> dict[str, Any]:
    """Run :mod:`benchmarks.paired` on this model in a child (its memory given back before the
    servers start) and return its result; its failure fails the benchmark."""
    out = work / "offline"
    argv = [
        *(sys.executable, "-m", "benchmarks.paired", "--model", model_kind),
        *("--size", "released" if ctx.scale == "full" else "tiny", "--out", str(out)),
        *("--pairs", str(ctx.pick(12, 2, 1)), "--warmup", str(ctx.pick(3, 2, 2))),
        *("--cost-rounds", "0", "--lm-graph-tokens", str(engine_serving.lm_graph_tokens() or 0)),
    ]
    if model_kind == "qwen2_5_omni":
        # Its audio tower graphs only through the masked attention, as configured above.
        argv += ["--overrides", json.dumps({"encoder_cuda_graph_audio_attention": "masked"})]
    done = subprocess.run(argv, capture_output=True, text=True, check=False)
    path = out / f"paired-{model_kind}.json"
    if done.returncode != 0 or not path.exists():
        raise RuntimeError(
            f"{MODELS[model_kind]}: the offline paired run failed (exit {done.returncode}):\n"
            f"{done.stdout[-3000:]}{done.stderr[-3000:]}"
        )
    return dict(json.loads(path.read_text()))


def plot(result: dict[str, Any], out_dir: Path, plt: Any) -> list[Path]:
    """TTFT p50 per request kind at concurrency 1, one bar per configuration, a panel a model."""
    served = [(k, e) for k, e in result["models"].items() if e["configurations"]]
    if not served:
        return []
    widest = max(len(e["kinds"]) for _, e in served)
    fig, axes = plt.subplots(
        len(served), 1, figsize=(max(6.0, 1.1 * widest), 4.0 * len(served)), squeeze=False
    )
    for ax, (model_kind, entry) in zip(axes[:, 0], served, strict=True):
        configs = entry["configurations"]
        kinds = entry["kinds"]
        width = 0.8 / len(configs)
        for i, (name, row) in enumerate(configs.items()):
            values = [row["rows"].get(f"c1/{kind}", {}).get("ttft_p50_ms", 0.0) for kind in kinds]
            ax.bar([k + i * width for k in range(len(kinds))], values, width, label=name)
        ax.set_xticks([k + 0.4 - width / 2 for k in range(len(kinds))])
        ax.set_xticklabels(kinds, rotation=30, ha="right")
        ax.set_ylabel("TTFT p50 (ms), concurrency 1")
        ax.set_title(f"vllm serve, {MODELS[model_kind]} ({result['sizes']} sizes), dummy weights")
        ax.legend()
    return [save_plot(plt, fig, out_dir / "engine_ttft.png")]
