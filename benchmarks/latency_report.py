"""The latency benchmark's tables in ``BENCHMARKS.md``, rendered by :mod:`benchmarks.report`."""

from __future__ import annotations

from typing import Any

from benchmarks.table import Table, pct, times, us

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
    """Why an arm has no number ("skipped (...)", "ERROR"), or None when it has one."""
    if entry and "error" in entry:
        return "ERROR"
    if entry and "skipped" in entry:
        return f"skipped ({entry['skipped']})"
    return None if entry and "latency_us" in entry else "n/a"


def _header(arm: dict[str, Any], names: set[str]) -> str:
    refs = [v for v in arm["vs"] if v in names]
    return f"{arm['title']} (vs {' / '.join(refs)})" if refs else arm["title"]


def tables(result: dict[str, Any]) -> list[Table]:
    arms = result.get("arms") or _LEGACY_ARMS
    main_arms = [a for a in arms if a["name"] not in _DETAIL_ONLY]
    main_names = {a["name"] for a in main_arms}
    rows = result["rows"]
    t = Table(
        f"Encoder latency per call, median us ({result.get('dtype', 'bf16')})",
        ["encoder", "input", *(_header(a, main_names) for a in main_arms), "adapter speed-up"],
    )
    host = Table(
        "Host time per call, median us (call to return, device idle before)",
        ["encoder", "input", *(_header(a, {a["name"] for a in arms}) for a in arms)],
    )
    spread = Table(
        "Latency spread, p10 / p90 us", ["encoder", "input", *(a["title"] for a in arms)]
    )
    for row in rows:
        m = row["methods"]
        cells = [row["label"], row["input"]]
        for a in main_arms:
            mine = _median(m.get(a["name"]))
            why = _cell(m.get(a["name"]))
            if why is not None or mine is None:
                cells.append(why or "n/a")
                continue
            shown = [pct(mine / r - 1) if r else "n/a" for r in _refs(m, a, main_names)]
            cells.append(f"{mine:,.0f} ({' / '.join(shown)})" if shown else f"{mine:,.0f}")
        eager, adapter = _median(m.get("eager")), _median(m.get("adapter"))
        t.rows.append([*cells, times(eager / adapter) if eager and adapter else "n/a"])
        cells = [row["label"], row["input"]]
        for a in arms:
            mine = _median(m.get(a["name"]), "host_us")
            if mine is None:
                cells.append(_cell(m.get(a["name"])) or "n/a")
                continue
            refs = _refs(m, a, None, "host_us")
            shown = ["n/a" if r is None else f"{mine - r:+.1f}" for r in refs]
            cells.append(f"{mine:,.1f} ({' / '.join(shown)})" if shown else f"{mine:,.1f}")
        host.rows.append(cells)
        spreads = [(m.get(a["name"]) or {}).get("latency_us") for a in arms]
        cells = [f"{s['p10']:,.0f} / {s['p90']:,.0f}" if s else "n/a" for s in spreads]
        spread.rows.append([row["label"], row["input"], *cells])
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
    host.note = "In parentheses: difference to the methods in the header's parentheses, us."
    # Results of the earlier, one-process-per-shape version recorded no host times.
    has_host = any("host_us" in e for r in rows for e in r["methods"].values())
    return [t, host, spread, _checks(rows, arms)] if has_host else [t, spread, _checks(rows, arms)]


def _refs(
    methods: dict[str, Any], arm: dict[str, Any], names: set[str] | None, key: str = "latency_us"
) -> list[float | None]:
    return [_median(methods.get(v), key) for v in arm["vs"] if names is None or v in names]


def _checks(rows: list[dict[str, Any]], arms: list[dict[str, Any]]) -> Table:
    checked = [a for a in arms if a.get("tolerance", 1.0) is not None]
    compiling = [a for a in arms if a.get("compiles")]
    errors = [f"rel err {a['name']}" for a in checked]
    headers = ["encoder", "input", *errors, *(f"compile s {a['name']}" for a in compiling)]
    checks = Table("Correctness, compile time and hits", [*headers, "adapter hits / timed calls"])
    for row in rows:
        m = row["methods"]
        hits = [e for e in m.values() if e.get("timed_calls") is not None]
        counted = (
            f"{sum(e['hits'] for e in hits)}/{sum(e['timed_calls'] for e in hits)}"
            if hits
            else f"{row.get('adapter_hits', 'n/a')}/{row.get('adapter_timed_calls', 'n/a')}"
        )
        errors = [_err(m.get(a["name"])) for a in checked]
        compile_s = [us((m.get(a["name"]) or {}).get("compile_s"), 1) for a in compiling]
        checks.rows.append([row["label"], row["input"], *errors, *compile_s, counted])
    checks.note = "Relative error: max |out - eager| / max |eager| at the arm's first call."
    return checks


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
    parts = [
        f"{title} skipped at {'every shape' if len(where) == len(rows) else ', '.join(where)} "
        f"({why})"
        for (title, why), where in skipped.items()
    ]
    notes = " Skipped: " + "; ".join(parts) + "." if parts else ""
    return notes + (" FAILED: " + "; ".join(failed) + "." if failed else "")


def _err(entry: dict[str, Any] | None) -> str:
    if not entry or entry.get("max_rel_err") is None:
        return "n/a"
    mark = "" if entry.get("within_tolerance", True) else " (over tolerance)"
    return f"{entry['max_rel_err']:.1e}{mark}"
