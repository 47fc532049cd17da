"""Render benchmark JSON results as markdown tables, and refresh ``BENCHMARKS.md`` with them.

Usage::

    python -m benchmarks.report bench-results                      # print the markdown
    python -m benchmarks.report bench-results --write BENCHMARKS.md  # replace its tables

``--write`` replaces what lies between ``<!-- BEGIN bench:X -->`` and ``<!-- END bench:X -->``
for every section X it has results for (``environment``, ``goals``, ``targets``, and one per
benchmark), and leaves the rest of the file, prose included, as it is. Results written by
earlier versions of the benchmarks (no goal tags, other arms) render too.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from benchmarks import served_pairs
from benchmarks.suites import BENCHMARKS, SUITES
from benchmarks.table import Table

__all__ = ["GOALS", "Table", "markdown_sections", "text_summary", "update_document"]

MiB = 1 << 20

#: The performance goals, in the order the goals table lists them: key -> what it asks. A
#: target or figure belongs to one when its ``goal`` field names the key.
GOALS: dict[str, str] = {
    "hit_path": "Hit path within 3 us of host time and 1 % of the bare copy-replay-clone at "
    "every shape, torch and vLLM backends (and with the bus's folds on)",
    "compiled": "Compiled graphs (opt-in switch): faster than the bare graph and than "
    "reduce-overhead on audio; outputs within the documented tolerance of eager",
    "background": "No request waits for compilation or capture (opt-in background capture): "
    "lower p99 on the traffic mix, no wrong output, no crash beside another graph user",
    "observability": "Observability under 1 % of throughput with the production sinks "
    "(OTel, logs, JSONL)",
    "coverage_costs": "Hit-path cost of the bus's folds (stats and per-signature coverage) and "
    "of CUDA-event device timing, measured",
}
#: Goals of benchmarks outside the ``all`` suite, by goal: the benchmark and the text. The
#: goals table lists one only when that benchmark's results are among those it renders.
OWN_SUITE_GOALS: dict[str, tuple[str, str]] = {
    "eventlog_scale": (
        "eventlog",
        "Event-log tools at production scale: peak memory flat in the log's size (at most "
        "300 MB at 10M events); at 1M events top within 10 s, replay within 20 s, advise "
        "(default grid) within 60 s; all three complete at 10M",
    ),
    "end_to_end": (
        "engine",
        "vllm serve end to end: image and audio TTFT p50 at concurrency 1 at least 30 % below "
        "eager encoders; ahead of vLLM's own encoder graphs where both apply; KV cache no "
        "smaller than without graphs by more than the pools' bytes",
    ),
}


def _us(value: float | None, digits: int = 1) -> str:
    return "n/a" if value is None else f"{value:,.{digits}f}"


def _ns(value_us: float | None) -> str:
    return "n/a" if value_us is None else f"{value_us * 1000:,.0f}"


def _x(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.2f}x"


def _pct(value: float | None) -> str:
    return "n/a" if value is None else f"{value * 100:+.2f} %"


def _mib(value: float | None) -> str:
    return "n/a" if value is None else f"{value / MiB:,.1f}"


def _met(met: bool | None) -> str:
    return {True: "met", False: "MISSED", None: "not measured"}[met]


# -- per benchmark -----------------------------------------------------------------------


def _overhead(result: dict[str, Any]) -> list[Table]:
    tables: list[Table] = []
    emit = Table(
        "EventBus.emit() cost",
        ["subscribers", "median ns/emit", "p10", "p90", "thread CPU ns/emit", "dropped"],
    )
    for row in result["emit"]["rows"]:
        label = (
            "the bus's fold only"
            if not row["count"]
            else f"{row['count']} no-op {row['subscribers']}"
        )
        s = row["per_emit_us"]
        cpu = row.get("per_emit_cpu_us")
        emit.rows.append(
            [
                label,
                _ns(s["median"]),
                _ns(s["p10"]),
                _ns(s["p90"]),
                _ns(cpu["median"]) if cpu else "n/a",
                str(row["dropped"]),
            ]
        )
    emit.note = (
        "The bus's own fold (per-signature coverage, which applies each event to the stats) "
        "runs in every row"
        + (
            f"; called directly it costs {_ns(result['emit']['bus_fold_us']['median'])} ns"
            if "bus_fold_us" in result["emit"]
            else ""
        )
        + ". Python loop cost "
        f"{_ns(result['emit']['loop_overhead_us']['median'])} ns/iteration is included. "
        "Wall time per emit adds the time the emitting thread waited while the sink threads "
        "held the GIL; the thread's CPU time does not."
    )
    tables.append(emit)

    thr = Table(
        "Bus throughput",
        ["path", "events", "M events/s (end to end)", "M events/s (emit side)", "dropped"],
    )
    fold = result["fold"]
    thr.rows.append(
        [
            "StatsFold.fold alone",
            f"{fold['events']:,}",
            f"{fold['events_per_s'] / 1e6:.2f}",
            "",
            "0",
        ]
    )
    for row in result["throughput"]["rows"]:
        label = (
            "emit, the bus's fold only"
            if not row["sinks"]
            else f"emit + flush, {row['sinks']} {row['config']}"
        )
        thr.rows.append(
            [
                label,
                f"{row['events']:,}",
                f"{row['events_per_s'] / 1e6:.2f}",
                f"{row['emit_events_per_s'] / 1e6:.2f}",
                str(row["dropped"]),
            ]
        )
    tables.append(thr)

    hp = result["hit_path"]["split_us"]
    split = Table(
        "Adapter hit path, host time per call (simulated backend, no device work)",
        ["part", "median us"],
        [
            ["admission, key building, event, own stats", _us(hp["admission_key"], 2)],
            ["copy-in, output copy, clone", _us(hp["copy_clone"], 2)],
            ["emit (bus with stats fold)", _us(hp["emit"], 2)],
            ["emit (bus with one no-op sink)", _us(hp["emit_with_sink"], 2)],
            ["total (with bus)", _us(hp["total"], 2)],
        ],
        "Differences of medians of interleaved rounds; a part can be slightly negative "
        "at noise level.",
    )
    tables.append(split)

    cuda = result.get("cuda", {})
    if "skipped" in cuda:
        tables.append(Table("Adapter hit vs bare graph on CUDA", ["skipped"], [[cuda["skipped"]]]))
    else:
        t = Table(
            f"Adapter hit vs bare copy-replay-clone on CUDA ({cuda['encoder']}, "
            f"input {tuple(cuda['input_shape'])})",
            ["path", "host us/call", "over bare", "latency us/call", "over bare"],
        )
        bare = cuda["timings"]["bare"]
        for name, tm in cuda["timings"].items():
            over_h = tm["host_us"]["median"] - bare["host_us"]["median"]
            over_l = tm["latency_us"]["median"] - bare["latency_us"]["median"]
            t.rows.append(
                [
                    name,
                    _us(tm["host_us"]["median"]),
                    _us(over_h),
                    _us(tm["latency_us"]["median"]),
                    _us(over_l),
                ]
            )
        t.note = (
            "Host: from call to return (device idle before). Latency: until the device finished."
        )
        tables.append(t)
    return tables


#: Arms of latency results written before the results listed them (one process per shape).
_LEGACY_ARMS: list[dict[str, Any]] = [
    {"name": "eager", "title": "eager", "vs": []},
    {"name": "bare", "title": "bare graph", "vs": ["replay_only"]},
    {"name": "replay_only", "title": "replay only", "vs": []},
    {"name": "adapter", "title": "adapter, torch", "vs": ["bare", "compile"]},
    {"name": "compile", "title": "reduce-overhead", "vs": ["bare"]},
    {"name": "adapter_compiled", "title": "adapter over torch.compile", "vs": ["bare", "compile"]},
]
#: Arms shown in the detail tables only (host time, spread), not in the main one.
_DETAIL_ONLY = ("replay_only",)


def _median(entry: dict[str, Any] | None, key: str = "latency_us") -> float | None:
    s = (entry or {}).get(key)
    return None if s is None else float(s["median"])


def _cell(entry: dict[str, Any] | None) -> str | None:
    """Return why an arm has no number ("skipped (...)", "ERROR"), or None when it has one."""
    if not entry:
        return "n/a"
    if "error" in entry:
        return "ERROR"
    if "skipped" in entry:
        return f"skipped ({entry['skipped']})"
    if "latency_us" not in entry:
        return "n/a"
    return None


def _latency(result: dict[str, Any]) -> list[Table]:
    arms = result.get("arms") or _LEGACY_ARMS
    titles = {a["name"]: a["title"] for a in arms}
    main_arms = [a for a in arms if a["name"] not in _DETAIL_ONLY]
    main_names = {a["name"] for a in main_arms}
    rows = result["rows"]

    def header(a: dict[str, Any], names: set[str]) -> str:
        # Arms are referred to by their short result names, so headers stay narrow.
        refs = [v for v in a["vs"] if v in names]
        return f"{a['title']} (vs {' / '.join(refs)})" if refs else a["title"]

    t = Table(
        f"Encoder latency per call, median us ({result.get('dtype', 'bf16')})",
        ["encoder", "input", *(header(a, main_names) for a in main_arms), "adapter speed-up"],
    )
    for row in rows:
        m = row["methods"]
        cells = [row["label"], row["input"]]
        for a in main_arms:
            why = _cell(m.get(a["name"]))
            mine = _median(m.get(a["name"]))
            if why is not None or mine is None:
                cells.append(why or "n/a")
                continue
            refs = [_median(m.get(v)) for v in a["vs"] if v in main_names]
            shown = [_pct(mine / r - 1) if r else "n/a" for r in refs]
            cells.append(f"{mine:,.0f} ({' / '.join(shown)})" if shown else f"{mine:,.0f}")
        eager, adapter = _median(m.get("eager")), _median(m.get("adapter"))
        cells.append(_x(eager / adapter) if eager and adapter else "n/a")
        t.rows.append(cells)
    process = (
        "All shapes and methods ran in one process"
        if "process" in result
        else "Each configuration ran in a process of its own (results of an earlier version)"
    )
    t.note = (
        f"{process}, interleaved round by round. Per call: device idle before, timed until the "
        "device finished; percentages are median against median of the methods named in the "
        "header's parentheses, in that order (negative: faster): "
        + ", ".join(f"{a['name']} = {a['title']}" for a in arms if a["name"] != a["title"])
        + ". 'bare graph' is copy_ + replay + "
        "clone of a torch.cuda.CUDAGraph; 'adapter over torch.compile' wraps "
        "torch.compile(model) in default mode, so its graph captures inductor's fused kernels."
        + _latency_notes(rows, arms)
    )
    host = Table(
        "Host time per call, median us (call to return, device idle before)",
        ["encoder", "input", *(header(a, set(titles)) for a in arms)],
    )
    for row in rows:
        m = row["methods"]
        cells = [row["label"], row["input"]]
        for a in arms:
            mine = _median(m.get(a["name"]), "host_us")
            if mine is None:
                cells.append(_cell(m.get(a["name"])) or "n/a")
                continue
            refs = [_median(m.get(v), "host_us") for v in a["vs"]]
            shown = ["n/a" if r is None else f"{mine - r:+.1f}" for r in refs]
            cells.append(f"{mine:,.1f} ({' / '.join(shown)})" if shown else f"{mine:,.1f}")
        host.rows.append(cells)
    host.note = "In parentheses: difference to the methods in the header's parentheses, us."
    # Results of the earlier, one-process-per-shape version recorded no host times.
    has_host = any("host_us" in e for r in rows for e in r["methods"].values())
    spread = Table(
        "Latency spread, p10 / p90 us",
        ["encoder", "input", *(a["title"] for a in arms)],
    )
    for row in rows:
        cells = [row["label"], row["input"]]
        for a in arms:
            s = (row["methods"].get(a["name"]) or {}).get("latency_us")
            cells.append(f"{s['p10']:,.0f} / {s['p90']:,.0f}" if s else "n/a")
        spread.rows.append(cells)
    checked = [a for a in arms if a.get("tolerance", 1.0) is not None]
    compiling = [a for a in arms if a.get("compiles")]
    checks = Table(
        "Correctness, compile time and hits",
        [
            "encoder",
            "input",
            *(f"rel err {a['name']}" for a in checked),
            *(f"compile s {a['name']}" for a in compiling),
            "adapter hits / timed calls",
        ],
    )
    for row in rows:
        m = row["methods"]
        hits = [e for e in m.values() if e.get("timed_calls") is not None]
        checks.rows.append(
            [
                row["label"],
                row["input"],
                *(_err(m.get(a["name"])) for a in checked),
                *(_us((m.get(a["name"]) or {}).get("compile_s"), 1) for a in compiling),
                f"{sum(e['hits'] for e in hits)}/{sum(e['timed_calls'] for e in hits)}"
                if hits
                else f"{row.get('adapter_hits', 'n/a')}/{row.get('adapter_timed_calls', 'n/a')}",
            ]
        )
    checks.note = "Relative error: max |out - eager| / max |eager| at the arm's first call."
    return [t, host, spread, checks] if has_host else [t, spread, checks]


def _latency_notes(rows: list[dict[str, Any]], arms: list[dict[str, Any]]) -> str:
    skipped: dict[tuple[str, str], list[str]] = {}
    failed: list[str] = []
    for row in rows:
        shape = f"{row['label']} batch {row['batch']}"
        for a in arms:
            entry = row["methods"].get(a["name"]) or {}
            if "error" in entry:
                failed.append(f"{shape}, {a['title']}: {entry['error']}")
            elif "skipped" in entry:
                why = entry["skipped"] + (f": {entry['detail']}" if entry.get("detail") else "")
                skipped.setdefault((a["title"], why), []).append(shape)
        if row.get("failure"):
            failed.append(f"{shape}: {row['failure']}")
    parts = []
    for (title, why), where in skipped.items():
        at = "every shape" if len(where) == len(rows) else ", ".join(where)
        parts.append(f"{title} skipped at {at} ({why})")
    notes = " Skipped: " + "; ".join(parts) + "." if parts else ""
    if failed:
        notes += " FAILED: " + "; ".join(failed) + "."
    return notes


def _err(entry: dict[str, Any] | None) -> str:
    if not entry or entry.get("max_rel_err") is None:
        return "n/a"
    mark = "" if entry.get("within_tolerance", True) else " (over tolerance)"
    return f"{entry['max_rel_err']:.1e}{mark}"


def _traffic(result: dict[str, Any]) -> list[Table]:
    t = Table(
        "Traffic replay: admission settings",
        [
            "max_graphs",
            "min_capture_calls",
            "hit rate",
            "mean latency us",
            "vs eager",
            "captures",
            "graph MiB (events)",
            "reserved delta MiB",
            "misses w/c/m",
        ],
    )
    for row in result["rows"]:
        t.rows.append(
            [
                str(row["max_graphs"]),
                str(row["min_capture_calls"]) if row["max_graphs"] else "-",
                f"{row['hit_rate'] * 100:.1f} %",
                _us(row["mean_latency_us"], 0),
                _pct(row.get("vs_eager")),
                str(row["captures"]),
                _mib(row["graph_bytes"]),
                _mib(row.get("reserved_delta_bytes")),
                f"{row['warmup_misses']}/{row['capacity_misses']}/{row['memory_misses']}",
            ]
        )
    stream = result["stream"]
    t.note = (
        f"{stream['requests']} requests ({stream['vision_requests']} image, "
        f"{stream['audio_requests']} audio), {stream['distinct_keys']} distinct shapes, "
        f"seed {stream['seed']}. Graph MiB: bytes_reserved + static_bytes of GraphCaptured events."
    )
    return [t]


def _gc(clock: dict[str, Any] | None) -> str:
    """``collections (oldest generation) / longest ms`` of a timed window, if recorded."""
    if clock is None:
        return "n/a"
    return (
        f"{clock['collections']} ({clock['oldest_generation']}) / {clock['longest_s'] * 1e3:,.1f}"
    )


def _capture(result: dict[str, Any]) -> list[Table]:
    t = Table(
        f"Traffic mix by capture mode, {result['clients']} client threads, request latency us",
        [
            "mode",
            "clients",
            "pass",
            "requests",
            "p50",
            "p99",
            "max",
            "GC: collections (gen 2) / longest ms",
            "hit rate",
            "graphs",
            "eager while preparing",
            "wait for graphs s",
            "wrong / checked",
            "max rel err",
            "errors",
        ],
    )
    for row in result["rows"]:
        if "skipped" in row:
            t.rows.append([row["title"], "", f"skipped ({row['skipped']})", *([""] * 12)])
            continue
        for name in ("cold", "warm"):
            one = row.get(name)
            if one is None:
                continue
            lat = one.get("latency_us") or {}
            settle = one.get("settle") or {}
            t.rows.append(
                [
                    row["title"],
                    str(row.get("clients", result["clients"])),
                    name,
                    str(one["requests"]),
                    _us(lat.get("p50"), 0),
                    _us(lat.get("p99"), 0),
                    _us(lat.get("max"), 0),
                    _gc(one.get("gc")),
                    f"{one['hit_rate'] * 100:.1f} %",
                    f"{one['graphs_before']} -> {settle.get('graphs_after', 'n/a')}"
                    + (f" (+{settle['ready_after']} ready)" if settle.get("ready_after") else ""),
                    str(one["preparing_misses"]),
                    _us(settle.get("wait_s"), 2),
                    f"{one['wrong']} / {one['checked']}",
                    f"{one['max_rel_err']:.1e}",
                    str(len(one["errors"])),
                ]
            )
        if row["errors"]:
            t.rows.append(
                [
                    row["title"],
                    str(row.get("clients", result["clients"])),
                    "FAILED",
                    *([""] * 11),
                    "; ".join(e["error"] for e in row["errors"]),
                ]
            )
    co = result.get("cotenant") or {}
    stream = result["stream"]
    t.note = (
        f"{stream['requests']} requests per pass ({stream['distinct_shapes']} distinct shapes), "
        f"{result.get('encoders', 'medium')} encoders, {result['dtype']}, "
        f"{_graphs_allowed(result)}; fresh adapters per mode. Latency: "
        f"{result['timing']}. Cold: the first pass, shapes admitted and captured while "
        "requests run; warm: the same stream again (shapes seen once in the cold pass may be "
        "admitted now). GC: the interpreter's garbage collections during the pass (they stop "
        "every thread), those of the oldest generation, and the longest. "
        "Graphs: held before the pass -> after it and the untimed wait for "
        "graphs still being prepared (+N ready: prepared, captured by the key's next call). Every "
        f"{stream['checked_every']}th request is checked against eager. Co-tenant: "
        f"{co.get('model', 'n/a')} under torch.compile(mode='reduce-overhead'), input "
        f"{tuple(co.get('input', ()))}, called once per {co.get('every', 'n/a')} requests "
        f"served: {co.get('calls', 'n/a')} calls, {co.get('wrong', 'n/a')} beyond "
        "tolerance" + _without_cotenant(result) + "."
    )
    return [t]


def _without_cotenant(result: dict[str, Any]) -> str:
    """Name the modes served without the co-tenant (rows record ``cotenant: false``)."""
    titles = [r["title"] for r in result["rows"] if r.get("cotenant") is False]
    if not titles:
        return ""
    return (
        "; not called in " + ", ".join(titles) + " (PyTorch's FX-tracing flag is process-wide: "
        "a compiled call on another thread during a compile raises; the compiled mode's "
        "references run as it does)"
    )


def _graphs_allowed(result: dict[str, Any]) -> str:
    if "graphs_per_client" in result:
        return f"up to {result['graphs_per_client']} graphs per encoder and client stream"
    return f"up to {result.get('max_graphs', 'n/a')} graphs per encoder"


def _memory(result: dict[str, Any]) -> list[Table]:
    t = Table(
        f"Device memory held by N graphs ({result['encoder']})",
        [
            "graphs",
            "shared pools MiB",
            "separate pools MiB",
            "saved",
            "capture peak shared",
            "capture peak separate",
        ],
    )
    by = {(r["graphs"], r["share_pools"]): r for r in result["rows"]}
    for n in sorted({r["graphs"] for r in result["rows"]}):
        shared, separate = by.get((n, True)), by.get((n, False))
        held_s = shared["held_bytes"] if shared else None
        held_p = separate["held_bytes"] if separate else None
        t.rows.append(
            [
                str(n),
                _mib(held_s),
                _mib(held_p),
                _x(held_p / held_s) if held_s and held_p else "n/a",
                _mib(shared["peak_bytes"]) if shared else "n/a",
                _mib(separate["peak_bytes"]) if separate else "n/a",
            ]
        )
    t.note = (
        "Held: torch.cuda.memory_reserved() growth after capture and empty_cache(), static "
        "buffers included. Peak: max_memory_reserved() growth during the captures."
    )
    tables = [t]
    floor = result.get("floor")
    if floor:
        f = Table(
            "min_free_bytes under tight memory",
            [
                "floor",
                "floor GiB",
                "free GiB at admission",
                "memory misses",
                "deferrals",
                "graphs",
                "hits",
            ],
        )
        for row in floor["rows"]:
            f.rows.append(
                [
                    row["label"],
                    f"{row['floor_bytes'] / (1 << 30):.2f}",
                    "n/a" if row["free_bytes"] is None else f"{row['free_bytes'] / (1 << 30):.2f}",
                    str(row["memory_misses"]),
                    str(row["memory_deferrals"]),
                    str(row["num_graphs"]),
                    str(row["graph_hits"]),
                ]
            )
        f.note = floor.get("note", "")
        tables.append(f)
    return tables


def _observability(result: dict[str, Any]) -> list[Table]:
    t = Table(
        "End-to-end throughput with sinks",
        [
            "configuration",
            "sinks on",
            "calls/s (median)",
            "loss vs bus, median of paired rounds",
            "p25 / p75",
            "loss, total time",
            "events",
            "dropped",
        ],
    )
    for arm in result["arms"].values():
        paired = arm.get("vs_baseline") or {}
        t.rows.append(
            [
                arm["label"],
                ", ".join(arm.get("sinks_on") or []) or "-",
                f"{arm['calls_per_s']:,.1f}",
                _pct(paired.get("loss")),
                f"{_pct(paired.get('loss_p25'))} / {_pct(paired.get('loss_p75'))}",
                _pct(paired.get("loss_total")),
                "-" if arm.get("emitted") is None else str(arm["emitted"]),
                "-" if arm.get("dropped") is None else str(arm["dropped"]),
            ]
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


def _ms(value: float | None) -> str:
    return "n/a" if value is None else f"{value:,.0f}"


def _engine(result: dict[str, Any]) -> list[Table]:
    tables: list[Table] = []
    for model in result.get("models", {}).values():
        configs: dict[str, Any] = model["configurations"]
        if not configs:
            continue
        concurrencies = sorted(
            {row["concurrency"] for c in configs.values() for row in c["rows"].values()}
        )
        ttft = Table(
            f"{model['name']} ({result['sizes']} sizes"
            + (
                f", tensor-parallel over {result['tensor_parallel_size']}"
                if result.get("tensor_parallel_size", 1) > 1
                else ""
            )
            + "): TTFT p50 / p99 (ms) by request kind",
            ["request kind"] + [f"{name}, c{c}" for c in concurrencies for name in configs],
        )
        for kind in model["kinds"]:
            cells = [kind]
            for c in concurrencies:
                for entry in configs.values():
                    row = entry["rows"].get(f"c{c}/{kind}")
                    cells.append(
                        "n/a"
                        if row is None
                        else f"{_ms(row['ttft_p50_ms'])} / {_ms(row['ttft_p99_ms'])}"
                    )
            ttft.rows.append(cells)
        ttft.note = (
            f"{model['per_kind']} requests of each kind per pass, {model['max_tokens']} output "
            "tokens, greedy; "
            + " and ".join(f"c{c}" for c in concurrencies)
            + ": requests in flight. p99 of so few samples is their maximum."
        )
        engines = Table(
            f"{model['name']}: engines",
            [
                "configuration",
                "ready (s)",
                *(f"requests/s c{c}" for c in concurrencies),
                "encoder share of TTFT, c1",
                "graphs",
                "hits / misses",
                "hits after warm-up",
                "pool MiB",
                "KV cache tokens",
                "tokens equal eager's: c1, batched",
            ],
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
                    _mib(entry["pool_bytes"]),
                    "n/a" if entry["kv_cache_tokens"] is None else f"{entry['kv_cache_tokens']:,}",
                    "baseline"
                    if "parity_with_eager" not in entry
                    else f"{'yes' if entry['parity_with_eager'] else 'NO'}, "
                    f"{entry.get('batched_equal_eager', 'n/a')} of "
                    f"{entry.get('batched_requests', 'n/a')}",
                ]
            )
        missing = "; ".join(f"{k}: {v}" for k, v in model.get("not_applicable", {}).items())
        notes = ["Not applicable: " + missing + "."] if missing else []
        for name, entry in configs.items():
            per_adapter = [
                f"{adapter} {a['graphs']} graphs, {a['hits']} hits, misses "
                + (", ".join(f"{r} {n}" for r, n in sorted(a["misses"].items())) or "none")
                for adapter, a in sorted((entry.get("adapters") or {}).items())
            ]
            if per_adapter and entry["graphs"]:
                notes.append(f"{name}: " + "; ".join(per_adapter) + ".")
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
                phases = row["phases_mean_ms"]
                table.rows.append(
                    [
                        kind,
                        name,
                        concurrency,
                        _ms(row["event_ttft_p50_ms"]),
                        *(_ms(phases[p]) for p in PHASES),
                    ]
                )
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
    from benchmarks.paired import diff_text

    paired = model.get("offline_paired")
    if not paired:
        return []
    table = Table(
        f"{model['name']}: offline, graphs off and on inside one engine (ms)",
        [
            "request kind",
            "eager p50",
            "graphed p50",
            "paired diff median (IQR)",
            "median %",
            "graphed faster",
        ],
    )
    for kind, r in paired["kinds"].items():
        table.rows.append(
            [
                kind,
                _ms(r["eager_p50_ms"]),
                _ms(r["graphed_p50_ms"]),
                diff_text(r),
                f"{r['diff_median_pct']:+.1f} %",
                f"{r['graphed_faster']}/{r['pairs']}",
            ]
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
    from benchmarks.engine_phases import PHASES

    table = Table(
        f"{model['name']}: where the TTFT goes, c1 (mean ms)",
        ["request kind", "configuration", "TTFT", *PHASES],
    )
    measured = False
    for kind in model["kinds"]:
        for name, entry in configs.items():
            phases = (entry["rows"].get(f"c1/{kind}") or {}).get("phases_mean_ms")
            if phases is None:
                # A request the histograms did not count alone: shown, not left out.
                table.rows.append([kind, name, *["n/a"] * (1 + len(PHASES))])
                continue
            measured = True
            total = sum(phases[p] for p in PHASES)
            table.rows.append([kind, name, _ms(total), *(_ms(phases[p]) for p in PHASES)])
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


def _eventlog(result: dict[str, Any]) -> list[Table]:
    from benchmarks.eventlog import tables

    rendered: list[Table] = tables(result)
    return rendered


RENDERERS: dict[str, Callable[[dict[str, Any]], list[Table]]] = {
    "engine": _engine,
    "eventlog": _eventlog,
    "overhead": _overhead,
    "latency": _latency,
    "traffic": _traffic,
    "capture": _capture,
    "memory": _memory,
    "observability": _observability,
}


# -- formatting --------------------------------------------------------------------------


def _markdown(table: Table) -> str:
    lines = [f"**{table.title}**", ""]
    lines.append("| " + " | ".join(table.headers) + " |")
    lines.append("|" + "|".join("---" for _ in table.headers) + "|")
    lines += ["| " + " | ".join(row) + " |" for row in table.rows]
    if table.note:
        lines += ["", table.note]
    return "\n".join(lines)


def _text(table: Table) -> str:
    widths = [len(h) for h in table.headers]
    for row in table.rows:
        widths = [max(w, len(c)) for w, c in zip(widths, row, strict=True)]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    lines = [table.title, fmt.format(*table.headers), fmt.format(*("-" * w for w in widths))]
    lines += [fmt.format(*row) for row in table.rows]
    return "\n".join(lines)


def _targets_table(outputs: dict[str, dict[str, Any]]) -> Table:
    t = Table("Targets", ["benchmark", "target", "measured", "limit", "status"])
    for name, payload in outputs.items():
        status = payload.get("status")
        if status not in _RENDERED:
            t.rows.append([name, "(benchmark failed)", payload.get("error") or "", "", "ERROR"])
        suffix = {"partial": " (partial run)", "ok": ""}.get(str(status), " (failed run)")
        for tg in (payload.get("result") or {}).get("targets", []):
            value = tg["value"]
            shown = "n/a" if value is None else f"{value:,.3g} {tg['unit']}"
            t.rows.append(
                [
                    name,
                    tg["name"] + suffix,
                    shown,
                    f"{tg['op']} {tg['limit']:g} {tg['unit']}",
                    _met(tg["met"]),
                ]
            )
    return t


def _goals_table(outputs: dict[str, dict[str, Any]]) -> Table:
    """List every goal with the checks and figures that belong to it, and their verdicts."""
    t = Table("Goals", ["goal", "check", "measured", "bar", "verdict"])
    goals = dict(GOALS)
    goals.update({goal: text for goal, (name, text) in OWN_SUITE_GOALS.items() if name in outputs})
    entries: dict[str, list[tuple[str, dict[str, Any], bool]]] = {g: [] for g in goals}
    for payload in outputs.values():
        suffix = {"partial": " (partial run)", "ok": ""}.get(
            str(payload.get("status")), " (failed run)"
        )
        result = payload.get("result") or {}
        for item in result.get("targets", []):
            if item.get("goal") in entries:
                entries[item["goal"]].append((suffix, item, True))
        for item in result.get("figures", []):
            if item.get("goal") in entries:
                entries[item["goal"]].append((suffix, item, False))
    for goal, text in goals.items():
        if not entries[goal]:
            t.rows.append([text, "(no check in these results)", "", "", "not measured"])
            continue
        for i, (suffix, item, is_target) in enumerate(entries[goal]):
            value = item["value"]
            unit = f" {item['unit']}" if item["unit"] else ""
            shown = "n/a" if value is None else f"{value:,.3g}{unit}"
            t.rows.append(
                [
                    text if i == 0 else "",
                    item["name"] + suffix,
                    shown,
                    f"{item['op']} {item['limit']:g}{unit}" if is_target else "-",
                    _met(item["met"])
                    if is_target
                    else ("reported" if value is not None else "not measured"),
                ]
            )
    t.note = (
        "Each check's note in the benchmark's JSON says how it was measured and where it "
        "was not. 'reported': a cost the goal asks to measure, with no bar of its own."
    )
    return t


def _environment(outputs: dict[str, dict[str, Any]]) -> str:
    env = next(iter(outputs.values()))["environment"]
    gpu = env.get("gpu") or "none"
    parts = [
        f"- Date (UTC): {env.get('date_utc')}",
        f"- Command: `{env.get('command')}`",
        f"- GPU: {gpu} (driver {env.get('driver') or 'n/a'}), torch {env.get('torch')} "
        f"(CUDA {env.get('torch_cuda') or 'n/a'}), Python {env.get('python')}",
        f"- omnitrace {env.get('omnitrace')} at {env.get('git_commit') or 'unknown commit'}; "
        f"scale {env.get('scale')}",
    ]
    runs: dict[tuple[Any, ...], list[str]] = {}
    for name, payload in outputs.items():
        e = payload.get("environment") or {}
        runs.setdefault((e.get("date_utc"), e.get("command"), e.get("git_commit")), []).append(name)
    if len(runs) > 1:
        # Results gathered from several runs: say which run measured what.
        parts[3] = f"- omnitrace {env.get('omnitrace')}; scale {env.get('scale')}"
        parts[:2] = ["- Runs (the results below combine them):"] + [
            f"  - {date}: `{command}` at {commit or 'unknown commit'}: {', '.join(names)}"
            for (date, command, commit), names in runs.items()
        ]
    if env.get("simulated"):
        parts.append("- SIMULATED on CPU: the numbers check the plumbing and mean nothing.")
    return "\n".join(parts)


def load(out_dir: Path) -> dict[str, dict[str, Any]]:
    """Read every ``<benchmark>.json`` in ``out_dir``, in the runner's order."""
    outputs: dict[str, dict[str, Any]] = {}
    # The ``all`` suite's first, then those of suites of their own (eventlog, engine).
    names = dict.fromkeys([*BENCHMARKS, *(n for suite in SUITES.values() for n in suite)])
    for name in names:
        path = out_dir / f"{name}.json"
        if path.exists():
            outputs[name] = json.loads(path.read_text(encoding="utf-8"))
    return outputs


#: Statuses of a benchmark that did not fail: finished, or cut short by a killed run. A
#: failed benchmark's result (what it measured before or around the failure) is rendered
#: too, under a banner that says it failed.
_RENDERED = ("ok", "partial")


def _tables_for(name: str, payload: dict[str, Any]) -> list[Table]:
    if payload.get("result") is None:
        return []
    return RENDERERS[name](payload["result"])


def markdown_sections(outputs: dict[str, dict[str, Any]], image_dir: str = "") -> dict[str, str]:
    """Return ``{section: markdown}`` for ``environment``, ``targets`` and each benchmark.

    ``image_dir`` is the folder of the plots as the document's links must name it.
    """
    if not outputs:
        return {}
    sections = {
        "environment": _environment(outputs),
        "goals": _markdown(_goals_table(outputs)),
        "targets": _markdown(_targets_table(outputs)),
    }
    for name, payload in outputs.items():
        failed = payload.get("status") not in _RENDERED
        if failed and payload.get("result") is None:
            sections[name] = f"Failed: `{payload.get('error')}` (see `{name}.json`)."
            continue
        body = "\n\n".join(_markdown(t) for t in _tables_for(name, payload))
        if failed:
            body = (
                f"_Failed: `{payload.get('error')}` (see `{name}.json`); what it measured "
                f"follows._\n\n{body}"
            )
        if payload.get("status") == "partial":
            body = f"_Partial: the run stopped before {name} finished._\n\n{body}"
        plots = payload.get("plots") or []
        if plots:
            prefix = f"{image_dir.rstrip('/')}/" if image_dir else ""
            body += "\n\n" + "\n".join(f"![{name}]({prefix}{Path(p).name})" for p in plots)
        sections[name] = body
    return sections


def text_summary(outputs: dict[str, dict[str, Any]]) -> str:
    """Return the compact plain-text summary the runner prints at the end."""
    blocks = []
    for name, payload in outputs.items():
        status = payload.get("status")
        line = f"{name}: {status} in {payload.get('duration_s', 0):.1f} s"
        if payload.get("error"):
            line += f": {payload['error']}"
        blocks.append(line)
    lines = ["", "== summary", *blocks, ""]
    for name in ("latency", "capture"):
        tables = _tables_for(name, outputs[name]) if name in outputs else []
        if tables:
            lines += [_text(tables[0]), ""]
    lines += [_text(_goals_table(outputs)), "", _text(_targets_table(outputs))]
    return "\n".join(lines)


_SECTION = re.compile(
    r"(<!-- BEGIN bench:(?P<name>[a-z_]+) -->\n)(?P<body>.*?)(<!-- END bench:(?P=name) -->)",
    re.DOTALL,
)


def update_document(text: str, sections: dict[str, str]) -> str:
    """Replace the marked sections of ``text`` that ``sections`` has content for."""

    def replace(match: re.Match[str]) -> str:
        name = match.group("name")
        if name not in sections:
            return match.group(0)
        return f"{match.group(1)}{sections[name].rstrip()}\n{match.group(4)}"

    return _SECTION.sub(replace, text)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.report",
        description="Render benchmark JSON results as markdown tables.",
    )
    parser.add_argument("results", type=Path, help="folder written by benchmarks.run --out")
    parser.add_argument("--write", type=Path, help="update the marked sections of this file")
    parser.add_argument(
        "--only",
        help="comma-separated sections to render or write (default: all it has results for), "
        "e.g. eventlog: a CPU run beside the GPU machine's tables",
    )
    args = parser.parse_args(argv)
    outputs = load(args.results)
    if not outputs:
        print(f"error: no benchmark results (*.json) in {args.results}", file=sys.stderr)
        return 2
    image_dir = ""
    if args.write is not None:
        # Links in the document are relative to the document's own folder.
        image_dir = os.path.relpath(args.results.resolve(), args.write.resolve().parent)
    sections = markdown_sections(outputs, image_dir)
    if args.only:
        wanted = [name.strip() for name in args.only.split(",") if name.strip()]
        sections = {name: body for name, body in sections.items() if name in wanted}
    if args.write is None:
        for name, body in sections.items():
            print(f"## {name}\n\n{body}\n")
        return 0
    text = args.write.read_text(encoding="utf-8")
    updated = update_document(text, sections)
    args.write.write_text(updated, encoding="utf-8")
    print(f"updated {', '.join(sections)} in {args.write}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
