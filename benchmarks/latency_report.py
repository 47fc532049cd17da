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


def tables(result: dict[str, Any]) -> list[Table]:
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
            shown = [pct(mine / r - 1) if r else "n/a" for r in refs]
            cells.append(f"{mine:,.0f} ({' / '.join(shown)})" if shown else f"{mine:,.0f}")
        eager, adapter = _median(m.get("eager")), _median(m.get("adapter"))
        cells.append(times(eager / adapter) if eager and adapter else "n/a")
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
                *(us((m.get(a["name"]) or {}).get("compile_s"), 1) for a in compiling),
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
