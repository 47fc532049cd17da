"""The capture benchmark's table in ``BENCHMARKS.md``, rendered by :mod:`benchmarks.report`."""

from __future__ import annotations

from typing import Any

from benchmarks.table import Table, us

_HEADERS = ["mode", "clients", "pass", "requests", "p50", "p99", "max"]
_HEADERS += ["GC: collections (gen 2) / longest ms", "hit rate", "graphs", "eager while preparing"]
_HEADERS += ["wait for graphs s", "wrong / checked", "max rel err", "errors"]


def _gc(clock: dict[str, Any] | None) -> str:
    """``collections (oldest generation) / longest ms`` of a timed window, if recorded."""
    if clock is None:
        return "n/a"
    return (
        f"{clock['collections']} ({clock['oldest_generation']}) / {clock['longest_s'] * 1e3:,.1f}"
    )


def _pass(name: str, one: dict[str, Any]) -> list[str]:
    lat, settle = one.get("latency_us") or {}, one.get("settle") or {}
    ready = f" (+{settle['ready_after']} ready)" if settle.get("ready_after") else ""
    return [
        name,
        str(one["requests"]),
        *(us(lat.get(stat), 0) for stat in ("p50", "p99", "max")),
        _gc(one.get("gc")),
        f"{one['hit_rate'] * 100:.1f} %",
        f"{one['graphs_before']} -> {settle.get('graphs_after', 'n/a')}{ready}",
        str(one["preparing_misses"]),
        us(settle.get("wait_s"), 2),
        f"{one['wrong']} / {one['checked']}",
        f"{one['max_rel_err']:.1e}",
        str(len(one["errors"])),
    ]


def tables(result: dict[str, Any]) -> list[Table]:
    t = Table(
        f"Traffic mix by capture mode, {result['clients']} client threads, request latency us",
        _HEADERS,
    )
    for row in result["rows"]:
        if "skipped" in row:
            t.rows.append([row["title"], "", f"skipped ({row['skipped']})", *([""] * 12)])
            continue
        clients = str(row.get("clients", result["clients"]))
        for name in ("cold", "warm"):
            if row.get(name) is not None:
                t.rows.append([row["title"], clients, *_pass(name, row[name])])
        if row["errors"]:
            errors = "; ".join(e["error"] for e in row["errors"])
            t.rows.append([row["title"], clients, "FAILED", *([""] * 11), errors])
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
