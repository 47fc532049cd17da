"""The latency benchmark's goals: the targets its rows are held to, the costs it reports."""

from __future__ import annotations

from typing import Any

from benchmarks.common import figure, target
from benchmarks.latency_arms import COMPILE_TOLERANCE, TIMING_FLUSH_S

#: The adapter's hit path against bare copy-replay-clone (both backends): latency and host
#: time per call; the production sinks against the adapter alone.
ADAPTER_VS_BARE_TARGET = 0.01
HOST_OVER_BARE_TARGET_US = 3.0
SINKS_VS_ADAPTER_TARGET = 0.01
_HOST_DIFF = "median host time per call, difference"
_ERR_FORMULA = "max |out - eager| / max |eager|"


def _skip_note(rows: list[dict[str, Any]], name: str) -> str:
    entries = [r["methods"].get(name) for r in rows]
    reasons = sorted(
        {
            "not an arm of this run" if e is None else e.get("skipped") or e.get("error", "")
            for e in entries
            if e is None or "latency_us" not in e
        }
        - {""}
    )
    return f"; not measured: {', '.join(reasons)}" if reasons else ""


def _worst(
    rows: list[dict[str, Any]], table: str, key: str, scale: float = 1.0, encoder: str = ""
) -> tuple[float | None, str]:
    picked = [r for r in rows if not encoder or r["encoder"] == encoder]
    values = [r[table][key] for r in picked if r[table].get(key) is not None]
    skipped = _skip_note(rows, key.split("_over_")[0])
    note = f"measured at {len(values)} of {len(picked)} shapes{skipped}"
    return (max(values) * scale if values else None), note


def targets(rows: list[dict[str, Any]], sinks: dict[str, Any]) -> list[dict[str, Any]]:
    """The targets of the latency rows and of the production sinks' bus (``sinks``)."""

    def ratio(name: str, key: str, op: str, limit: float, goal: str = "", encoder: str = "") -> Any:
        value, note = _worst(rows, "ratios", key, 100.0, encoder)
        return target(name, value, op, limit, "%", note=note, goal=goal)

    out = []
    for arm, key in (
        ("adapter (torch)", "adapter_over_bare"),
        ("adapter (vLLM)", "adapter_vllm_over_bare"),
        ("adapter with a bus (its folds)", "adapter_bus_over_bare"),
    ):
        name = f"{arm} vs bare copy-replay-clone, worst shape"
        out.append(ratio(name, key, "<=", ADAPTER_VS_BARE_TARGET * 100, "hit_path"))
        value, note = _worst(rows, "host_over_us", key)
        name, note = f"{arm} host time over bare, worst shape", f"{_HOST_DIFF}; {note}"
        limit = HOST_OVER_BARE_TARGET_US
        out.append(target(name, value, "<=", limit, "us", note=note, goal="hit_path"))
    name = "adapter with production sinks vs adapter, worst shape"
    limit = SINKS_VS_ADAPTER_TARGET * 100
    out.append(ratio(name, "adapter_sinks_over_adapter", "<=", limit, "observability"))
    name = "adapter vs torch.compile reduce-overhead, worst shape"
    out.append(ratio(name, "adapter_over_compile", "<", 0.0))
    for what, arm in (("bare", "bare"), ("reduce-overhead", "compile")):
        key = f"adapter_compiled_over_{arm}"
        name = f"compiled adapter vs {what}, worst audio shape"
        out.append(ratio(name, key, "<", 0.0, "compiled", encoder="audio"))
    return out + _checks(rows, sinks)


def _checks(rows: list[dict[str, Any]], sinks: dict[str, Any]) -> list[dict[str, Any]]:
    """The compiled adapter's error, outputs, hits, the sinks' losses, device timings."""
    adapter_entries = [
        e for r in rows for e in r["methods"].values() if e.get("timed_calls") is not None
    ]
    lost_events = None
    if sinks.get("status") == "on":
        lost_events = float(
            sinks["dropped"]
            + sum(s["dropped"] + bool(s["error"] or s["disabled"]) for s in sinks["per_sink"])
            + (not sinks["flushed"])
        )
    mismatched = [
        f"{r['label']} batch {r['batch']}: {name}"
        for r in rows
        for name, e in r["methods"].items()
        if e.get("within_tolerance") is False
    ]
    compiled = [
        (r["label"], r["batch"], r["methods"]["adapter_compiled"]["max_rel_err"])
        for r in rows
        if (r["methods"].get("adapter_compiled") or {}).get("max_rel_err") is not None
    ]
    worst = max(compiled, key=lambda c: c[2], default=None)
    where = (
        "not measured" + _skip_note(rows, "adapter_compiled")
        if worst is None
        else f"worst at {worst[0]} batch {worst[1]}, measured at {len(compiled)} of {len(rows)} "
        "shapes"
    )
    timed = [e for r in rows if "timings_resolved" in (e := r["methods"].get("adapter_timed", {}))]
    unresolved = float(sum(not e["timings_resolved"] for e in timed)) if timed else None
    missed = float(sum(e["timed_calls"] - e["hits"] for e in adapter_entries))
    name = "compiled adapter output vs eager, max relative error, worst shape"
    err, note = None if worst is None else worst[2], f"{_ERR_FORMULA} at the first call; {where}"
    out = [target(name, err, "<=", COMPILE_TOLERANCE, "", note=note, goal="compiled")]
    name, note = "outputs match eager (bf16 tolerance), arms failing", "; ".join(mismatched)
    out.append(target(name, float(len(mismatched)), "<=", 0.0, "arms", note=note))
    name = "timed adapter calls that were not hits"
    note = f"every adapter arm at every shape ({len(adapter_entries)} timed)"
    out.append(target(name, missed, "<=", 0.0, "calls", note=note))
    name = "events the production sinks dropped or failed on"
    note = "bus and per-sink drops, sinks disabled by an error, a flush that timed out" + (
        "" if lost_events is not None else f"; sinks {sinks.get('status')}"
    )
    out.append(target(name, lost_events, "<=", 0.0, "events", note=note))
    name = "device timings left unresolved after a round"
    note = (
        f"flush_device_timing({TIMING_FLUSH_S:g} s) after every round of the timed "
        f"adapter; measured at {len(timed)} of {len(rows)} shapes"
    )
    out.append(target(name, unresolved, "<=", 0.0, "shapes", note=note, goal="coverage_costs"))
    return out


def figures(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The hit-path costs of the bus's folds and of device timing, worst shape."""
    out = []
    for arm_name, what in (
        ("adapter_bus", "the bus's folds (adapter + bus - adapter)"),
        ("adapter_timed", "device timing (adapter + device timing - adapter)"),
    ):
        key = f"{arm_name}_over_adapter"
        for kind, table, unit, scale, how in (
            ("host time", "host_over_us", "us", 1.0, _HOST_DIFF),
            ("latency", "ratios", "%", 100.0, "median latency per call, ratio"),
        ):
            value, note = _worst(rows, table, key, scale)
            name = f"hit-path cost of {what}: {kind}, worst shape"
            out.append(figure(name, value, unit, goal="coverage_costs", note=f"{how}; {note}"))
    return out
