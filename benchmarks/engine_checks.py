"""The engine benchmark's readings and checks: what the workers' event logs say, and the
targets and figures of each model's results against eager."""

from __future__ import annotations

import functools
import itertools
import json
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.common import figure, target
from benchmarks.engine_serving import AGAIN, BACKGROUND, MODELS, RequestKind, request_kinds

GOAL = "end_to_end"
INSIDE = "engine_ttft_p50_ms"  # vLLM's own TTFT, from the renderer on
Kinds = str | Callable[[RequestKind], bool]  # a modality's name, or a test of the kind


def _test(kinds: Kinds) -> Callable[[RequestKind], bool]:
    return kinds if callable(kinds) else (lambda kind: kind.modality == kinds)


def _one_piece(kind: RequestKind) -> bool:  # images in one 448-px slice: MiniCPM-o's overview
    return kind.modality == "image" and all(w <= 448 and h <= 448 for w, h in kind.images)


#: The c1 TTFT p50 goals against eager encoders: (the kinds, what they are called, the bar in
#: %, whether every kind must meet it rather than the kinds' median).
C1_GOALS: dict[str, tuple[tuple[Kinds, str, float, bool], ...]] = {
    "qwen2_5_omni": (("image", "image", -30.0, False), ("audio", "audio", -30.0, False)),
    "minicpmo": (
        (_one_piece, "single-piece image", -20.0, False),
        ("image", "every image kind's", -10.0, True),
        ("audio", "audio", -25.0, False),
    ),
}


# -- what the event log says -------------------------------------------------------------------


def event_figures(paths: Sequence[Path], skip: dict[Path, int] | None = None) -> dict[str, Any]:
    """Graphs, pool bytes, encoder device time and hit counts from the workers' event logs
    (each after its first ``skip`` lines, if given): in all, per adapter (misses by reason)
    and per worker (graphs and pool bytes a device)."""
    figures: dict[str, Any] = {"graphs": 0, "pool_bytes": 0, "hits": 0, "misses": 0}
    device: dict[str, float] = {}
    adapters: dict[str, dict[str, Any]] = {}
    workers: dict[str, dict[str, int]] = {}
    for path in paths:
        worker = workers.setdefault(path.stem, {"graphs": 0, "pool_bytes": 0})
        _fold_log(path, figures, device, adapters, worker, (skip or {}).get(path, 0))
    figures["encoder_device_s"] = device if paths else None
    figures["workers"] = workers
    figures["adapters"] = {
        name: a for name, a in adapters.items() if a["graphs"] or a["hits"] or a["misses"]
    }
    return figures


def _fold_log(
    path: Path,
    figures: dict[str, Any],
    device: dict[str, float],
    adapters: dict[str, dict[str, Any]],
    worker: dict[str, int],
    skip: int = 0,
) -> None:
    for event in _events(path, skip):
        kind = event.get("type")
        mine = adapters.setdefault(
            str(event.get("adapter")), {"graphs": 0, "hits": 0, "misses": {}, "miss_details": {}}
        )
        if kind == "GraphCaptured":
            pool = int(event["bytes_reserved"]) + int(event["static_bytes"])
            for counts in (figures, mine, worker):
                counts["graphs"] += 1
            figures["pool_bytes"] += pool
            worker["pool_bytes"] += pool
        elif kind == "GraphReplayed":
            figures["hits"] += 1
            mine["hits"] += 1
        elif kind == "GraphMissed":
            figures["misses"] += 1
            reason = str(event.get("reason"))
            mine["misses"][reason] = mine["misses"].get(reason, 0) + 1
            # The finer cause: a capacity miss of the graph count or of the pool budget.
            finer = f"{reason}/{event['detail']}" if event.get("detail") else reason
            mine["miss_details"][finer] = mine["miss_details"].get(finer, 0) + 1
        elif kind == "DeviceTimed":
            name = event["adapter"]
            device[name] = device.get(name, 0.0) + float(event["device_s"])


def _events(path: Path, skip: int) -> Iterator[dict[str, Any]]:
    """The events of one log after its first ``skip`` lines."""
    with path.open(encoding="utf-8") as lines:
        yield from map(json.loads, itertools.islice(lines, skip, None))


def line_counts(paths: Sequence[Path]) -> dict[Path, int]:
    counts = {}
    for path in paths:
        with path.open("rb") as lines:
            counts[path] = sum(1 for _ in lines)
    return counts


def hits_since(paths: Sequence[Path], skip: dict[Path, int]) -> dict[str, Any]:
    """The encoder calls in each log after its first ``skip`` lines (the measured passes,
    once the warm-up captured what it would): calls, hits and the hit rate, in all and per
    encoder, with the misses by reason and by reason and detail (``capacity/budget``)."""
    encoders: dict[str, dict[str, Any]] = {}
    for name, adapter in event_figures(paths, skip)["adapters"].items():
        if calls := adapter["hits"] + sum(adapter["misses"].values()):
            hits, misses = adapter["hits"], adapter["misses"]
            encoders[name] = dict(calls=calls, hits=hits, misses=misses, hit_rate=hits / calls)
            encoders[name]["miss_details"] = adapter["miss_details"]
    calls = sum(e["calls"] for e in encoders.values())
    hits = sum(e["hits"] for e in encoders.values())
    return dict(calls=calls, hits=hits, hit_rate=hits / calls if calls else None, encoders=encoders)


def slowest_calls(paths: Sequence[Path], skip: dict[Path, int], count: int = 8) -> list[Any]:
    """The ``count`` longest encoder calls in the logs after their first ``skip`` lines, the
    longest first: each replay, eager miss or capture with its host seconds (``duration_s``),
    adapter, signature, phase and miss reason. Where a kind's encoder phase is long, these
    say which calls made it so."""
    calls = [
        {key: event.get(key) for key in _CALL_FIELDS}
        for path in paths
        for event in _events(path, skip.get(path, 0))
        if event.get("type") in _CALLS and event.get("duration_s") is not None
    ]
    return sorted(calls, key=lambda call: -float(call["duration_s"]))[:count]


_CALLS = ("GraphReplayed", "GraphMissed", "GraphCaptured")
_CALL_FIELDS = ("type", "adapter", "duration_s", "reason", "phase", "signature")


def device_s_since(paths: Sequence[Path], skip: dict[Path, int]) -> float | None:
    """Encoder device seconds in each log's events after its first ``skip`` lines: the most
    of any worker (tensor-parallel ranks run their encoders side by side); None when there
    are none: device timing needs CUDA events, so a CPU run has no figure."""
    per_worker: list[list[float]] = []
    for path in paths:
        events = _events(path, skip.get(path, 0))
        per_worker.append([float(e["device_s"]) for e in events if e.get("type") == "DeviceTimed"])
    return max((sum(timed) for timed in per_worker if timed), default=None)


# -- the targets and figures -------------------------------------------------------------------


def _median_change(
    entry: dict[str, Any],
    model_kind: str,
    scale: str,
    config: str,
    modality: Kinds,
    field: str = "ttft_p50_ms",
) -> float | None:
    """Relative change of the median over ``modality``'s kinds (a modality's name, or a test
    of the kind) of their ``field`` (TTFT p50, or vLLM's own) at concurrency 1."""
    configs = entry["configurations"]
    if config not in configs or "eager" not in configs:
        return None
    kinds, chosen = {k.name: k for k in request_kinds(scale, model_kind)}, _test(modality)

    def p50(name: str) -> float | None:
        c1 = [r for r in configs[name]["rows"].values() if r["concurrency"] == 1]
        rows = [r.get(field) for r in c1 if chosen(kinds[r["kind"]])]
        if not rows or any(v is None for v in rows):
            return None
        return float(np.median(rows))

    new = p50(config)
    base = _baseline(configs, config, p50)
    return None if base is None or new is None or base <= 0 else (new - base) / base


def _baseline(
    configs: dict[str, Any], config: str, read: Callable[[str], float | None]
) -> float | None:
    """Eager's figure for ``config`` to be compared with: with the baseline served again last
    (A/B/A), the mean of the two eager servers, so a drift across the run hits both sides
    alike; else the first eager server's. The drift itself compares the two eager servers."""
    first = read("eager")
    if config == AGAIN or AGAIN not in configs:
        return first
    last = read(AGAIN)
    return None if first is None or last is None else (first + last) / 2


def _percent(change: float | None) -> float | None:
    return None if change is None else 100 * change


def cold_passes_note(entry: dict[str, Any]) -> str:
    """A configuration's cold passes (:func:`benchmarks.engine._cold_passes`) in words."""
    said = []
    for key, cold in sorted((entry.get("cold_passes") or {}).items(), key=lambda i: int(i[0][1:])):
        rate = (cold.get("hits") or {}).get("hit_rate")
        hits = "" if rate is None else f", encoder calls served by a graph {100 * rate:.1f} %"
        p50, p99 = cold["ttft_p50_ms"], cold["ttft_p99_ms"]
        said.append(f"{key} TTFT p50 {p50:.0f} ms, p99 {p99:.0f} ms{hits}")
    return "cold passes (the first at each concurrency above one, in the warm-up): " + (
        "; ".join(said) or "none"
    )


def _p99(configs: dict[str, Any], name: str, concurrency: int) -> float:
    """The median over request kinds of ``name``'s TTFT p99 at ``concurrency``."""
    rows = configs[name]["rows"].values()
    return float(np.median([r["ttft_p99_ms"] for r in rows if r["concurrency"] == concurrency]))


def check_model(result: dict[str, Any], model_kind: str, entry: dict[str, Any]) -> None:
    """Add the targets and figures of one model's ``entry`` to ``result``."""
    configs = entry["configurations"]
    label = MODELS[model_kind]
    scale = "full" if result["sizes"] == "released" else "quick"
    targets, figures, drifts = result["targets"], result["figures"], []
    _c1_checks(targets, entry, model_kind, scale)
    for modality in ("image", "audio"):
        # vLLM's own TTFT leaves out the transfer before its renderer: reported beside.
        inside = _median_change(entry, model_kind, scale, "omnitrace", modality, INSIDE)
        name = f"{label}: {modality} TTFT p50 inside vLLM (renderer to first token) at "
        note = "from vLLM's histograms around each request (benchmarks/engine_phases.py)"
        name += "concurrency 1, omnitrace vs eager encoders"
        figures.append(figure(name, _percent(inside), "%", goal=GOAL, note=note))
        # A/B/A: the baseline served again last; a large drift makes every change suspect.
        drift = _median_change(entry, model_kind, scale, AGAIN, modality)
        name = f"{label}: {modality} TTFT p50 at concurrency 1, eager served again last vs "
        name += "eager first (the machine's drift across the run)"
        drifts.append(figure(name, _percent(drift), "%", goal=GOAL))
    if "omnitrace" in configs and "eager" in configs:
        eager_kv = configs["eager"]["kv_cache_tokens"]
        graph_kv = configs["omnitrace"]["kv_cache_tokens"]
        change = None if not eager_kv or graph_kv is None else (graph_kv - eager_kv) / eager_kv
        name = f"{label}: KV cache with omnitrace's graphs, change against eager"
        note = f"pool bytes recorded: {configs['omnitrace']['pool_bytes']}"
        figures.append(figure(name, _percent(change), "%", goal=GOAL, note=note))
    figures += drifts
    _load_checks(result, label, configs)
    _prepared_checks(result, label, configs)
    for name, why in entry["not_applicable"].items():
        figures.append(figure(f"{label}: {name} not applicable", None, "", goal=GOAL, note=why))


def _c1_checks(targets: list[Any], entry: dict[str, Any], model_kind: str, scale: str) -> None:
    """The model's c1 TTFT p50 goals against eager (``C1_GOALS``), each noting its kinds'
    own changes, the least first."""
    label = MODELS[model_kind]
    for kinds, what, bar, every in C1_GOALS[model_kind]:
        chosen = [k for k in request_kinds(scale, model_kind) if _test(kinds)(k)]
        each = {
            k.name: _median_change(entry, model_kind, scale, "omnitrace", k.__eq__) for k in chosen
        }
        known = sorted((v, n) for n, v in each.items() if v is not None)[::-1]
        note = ", ".join(
            [f"{n} {100 * v:+.1f} %" for v, n in known]
            + [f"{n} no figure" for n, v in each.items() if v is None]
        )
        change = _median_change(entry, model_kind, scale, "omnitrace", kinds)
        if every:
            change = known[0][0] if known and len(known) == len(each) else None
        name = f"{label}: {what} TTFT p50 at concurrency 1, omnitrace vs eager encoders"
        targets.append(target(name, _percent(change), "<=", bar, "%", goal=GOAL, note=note))


def _load_checks(result: dict[str, Any], label: str, configs: dict[str, Any]) -> None:
    """At the highest concurrency: requests/s and TTFT p99 against eager's (the A/B/A mean
    where eager was served again last); and the hit rate of the measured passes with the
    defaults."""
    if "omnitrace" not in configs or "eager" not in configs:
        return
    top = max(int(key[1:]) for key in configs["eager"]["requests_per_s"])

    def rate_of(name: str) -> float:
        return float(configs[name]["requests_per_s"][f"c{top}"])

    p99 = functools.partial(_p99, configs, concurrency=top)

    rate = rate_of("omnitrace") / (_baseline(configs, "omnitrace", rate_of) or rate_of("eager"))
    name = f"{label}: requests/s at concurrency {top}, omnitrace over eager encoders"
    result["targets"].append(target(name, rate, ">=", 1.3, "x", goal=GOAL))
    base = _baseline(configs, "omnitrace", p99) or p99("eager")
    name = f"{label}: TTFT p99 at concurrency {top} (median over kinds), omnitrace vs eager"
    change = (p99("omnitrace") - base) / base
    result["targets"].append(target(name, 100 * change, "<", 0.0, "%", goal=GOAL))
    graphed = configs["omnitrace"]
    warm = graphed.get("after_warmup") or {}
    misses = "; ".join(f"{e} {w['misses']}" for e, w in sorted(warm.get("encoders", {}).items()))
    name = f"{label}: encoder calls served by a graph after the warm-up, omnitrace defaults"
    note = f"pool bytes {graphed.get('pool_bytes')}; misses by reason: {misses}; "
    note += cold_passes_note(graphed)
    rate = _percent(warm.get("hit_rate"))
    result["targets"].append(target(name, rate, ">=", 95.0, "%", goal=GOAL, note=note))


def eager_agreement(
    mine: dict[str, Any], eager: dict[str, Any], overrides: dict[str, Any]
) -> dict[str, Any]:
    """How a configuration's completions (tokens by ``c{N}/{i}``) agree with eager's: one at a
    time parity is required (the batches match); batched ones are counted (batches depend on
    timing), and solo ones too where a call's items are served one by one (rounded apart)."""
    solo = [mine.get(k) == tokens for k, tokens in eager.items() if k.startswith("c1/")]
    batched = [mine.get(k) == tokens for k, tokens in eager.items() if not k.startswith("c1/")]
    fields = {"batched_equal_eager": sum(batched), "batched_requests": len(batched)}
    if overrides.get("encoder_cuda_graph_split_items"):
        return {**fields, "solo_equal_eager": sum(solo), "solo_requests": len(solo)}
    return {**fields, "parity_with_eager": all(solo)}


def _prepared_checks(result: dict[str, Any], label: str, configs: dict[str, Any]) -> None:
    """Servers that prepared the defaults' recorded shapes before serving: every encoder call
    from the first request on served by a graph. Compile at start-up, and capture off the
    calling thread, costing no request its p99 at any concurrency above one."""
    for name in ("omnitrace-restarted", "omnitrace+compile"):
        if name in configs:
            row = configs[name]
            calls = row["hits"] + row["misses"]
            title = f"{label}: encoder calls served by a graph from the first request, {name}"
            note = f"graphs {row['graphs']}, pool bytes {row['pool_bytes']}"
            rate = 100 * row["hits"] / calls if calls else None
            result["targets"].append(target(title, rate, ">=", 95.0, "%", goal=GOAL, note=note))
    against = ("omnitrace+compile", BACKGROUND) if "omnitrace" in configs else ()
    for other in [c for c in against if c in configs]:
        for key in sorted(configs["omnitrace"]["requests_per_s"], key=lambda k: int(k[1:]))[1:]:
            base = _p99(configs, "omnitrace", int(key[1:]))
            change = 100 * (_p99(configs, other, int(key[1:])) - base) / base
            name = f"{label}: TTFT p99 at concurrency {key[1:]} (median over kinds), {other}"
            checks = [(name, change)]
            cold = [(configs[c].get("cold_passes") or {}).get(key) for c in ("omnitrace", other)]
            if all(cold):
                change = 100 * (cold[1]["ttft_p99_ms"] / cold[0]["ttft_p99_ms"] - 1)
                name = f"{label}: TTFT p99 of the cold pass at concurrency {key[1:]}, {other}"
                checks.append((name, change))
            for name, change in checks:
                vs = f"{name} vs omnitrace"
                result["targets"].append(target(vs, change, "<=", 0.0, "%", goal=GOAL))
