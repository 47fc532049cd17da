"""The latency benchmark's goals: the targets its rows are held to, the costs it reports."""

from __future__ import annotations

from typing import Any

from benchmarks.common import figure, target
from benchmarks.latency_arms import COMPILE_TOLERANCE, TIMING_FLUSH_S

#: The adapter's hit path must stay within this of bare copy-replay-clone (both backends).
ADAPTER_VS_BARE_TARGET = 0.01
#: ... and within this much host time per call (microseconds).
HOST_OVER_BARE_TARGET_US = 3.0
#: The production sinks may add this much to the adapter's latency.
SINKS_VS_ADAPTER_TARGET = 0.01


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
    rows: list[dict[str, Any]],
    table: str,
    key: str,
    *,
    scale: float = 1.0,
    encoder: str | None = None,
) -> tuple[float | None, str]:
    picked = [r for r in rows if encoder is None or r["encoder"] == encoder]
    values = [r[table][key] for r in picked if r[table].get(key) is not None]
    note = f"measured at {len(values)} of {len(picked)} shapes"
    return (max(values) * scale if values else None), note


def targets(rows: list[dict[str, Any]], sinks: dict[str, Any]) -> list[dict[str, Any]]:
    def ratio(
        name: str,
        key: str,
        op: str,
        limit: float,
        encoder: str | None = None,
        goal: str = "",
    ) -> dict[str, Any]:
        value, note = _worst(rows, "ratios", key, scale=100.0, encoder=encoder)
        arm_name = key.split("_over_")[0]
        return target(
            name, value, op, limit, "%", note=note + _skip_note(rows, arm_name), goal=goal
        )

    def host(name: str, key: str) -> dict[str, Any]:
        value, note = _worst(rows, "host_over_us", key)
        arm_name = key.split("_over_")[0]
        return target(
            name,
            value,
            "<=",
            HOST_OVER_BARE_TARGET_US,
            "us",
            note="median host time per call, difference; " + note + _skip_note(rows, arm_name),
            goal="hit_path",
        )

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
        (r["label"], r["batch"], name)
        for r in rows
        for name, e in r["methods"].items()
        if e.get("within_tolerance") is False
    ]
    compiled = [
        (r["label"], r["batch"], r["methods"]["adapter_compiled"]["max_rel_err"])
        for r in rows
        if (r["methods"].get("adapter_compiled") or {}).get("max_rel_err") is not None
    ]
    worst_compiled = max(compiled, key=lambda c: c[2], default=None)
    timed = [e for r in rows if "timings_resolved" in (e := r["methods"].get("adapter_timed", {}))]
    return [
        ratio(
            "adapter (torch) vs bare copy-replay-clone, worst shape",
            "adapter_over_bare",
            "<=",
            ADAPTER_VS_BARE_TARGET * 100,
            goal="hit_path",
        ),
        host("adapter (torch) host time over bare, worst shape", "adapter_over_bare"),
        ratio(
            "adapter (vLLM) vs bare copy-replay-clone, worst shape",
            "adapter_vllm_over_bare",
            "<=",
            ADAPTER_VS_BARE_TARGET * 100,
            goal="hit_path",
        ),
        host("adapter (vLLM) host time over bare, worst shape", "adapter_vllm_over_bare"),
        ratio(
            "adapter with a bus (its folds) vs bare copy-replay-clone, worst shape",
            "adapter_bus_over_bare",
            "<=",
            ADAPTER_VS_BARE_TARGET * 100,
            goal="hit_path",
        ),
        host(
            "adapter with a bus (its folds) host time over bare, worst shape",
            "adapter_bus_over_bare",
        ),
        ratio(
            "adapter with production sinks vs adapter, worst shape",
            "adapter_sinks_over_adapter",
            "<=",
            SINKS_VS_ADAPTER_TARGET * 100,
            goal="observability",
        ),
        ratio(
            "adapter vs torch.compile reduce-overhead, worst shape",
            "adapter_over_compile",
            "<",
            0.0,
        ),
        ratio(
            "compiled adapter vs bare, worst audio shape",
            "adapter_compiled_over_bare",
            "<",
            0.0,
            encoder="audio",
            goal="compiled",
        ),
        ratio(
            "compiled adapter vs reduce-overhead, worst audio shape",
            "adapter_compiled_over_compile",
            "<",
            0.0,
            encoder="audio",
            goal="compiled",
        ),
        target(
            "compiled adapter output vs eager, max relative error, worst shape",
            None if worst_compiled is None else worst_compiled[2],
            "<=",
            COMPILE_TOLERANCE,
            "",
            note="max |out - eager| / max |eager| at the first call; "
            + (
                "not measured" + _skip_note(rows, "adapter_compiled")
                if worst_compiled is None
                else f"worst at {worst_compiled[0]} batch {worst_compiled[1]}, "
                f"measured at {len(compiled)} of {len(rows)} shapes"
            ),
            goal="compiled",
        ),
        target(
            "outputs match eager (bf16 tolerance), arms failing",
            float(len(mismatched)),
            "<=",
            0.0,
            "arms",
            note="; ".join(f"{label} batch {batch}: {name}" for label, batch, name in mismatched),
        ),
        target(
            "timed adapter calls that were not hits",
            float(sum(e["timed_calls"] - e["hits"] for e in adapter_entries)),
            "<=",
            0.0,
            "calls",
            note=f"every adapter arm at every shape ({len(adapter_entries)} timed)",
        ),
        target(
            "events the production sinks dropped or failed on",
            lost_events,
            "<=",
            0.0,
            "events",
            note="bus and per-sink drops, sinks disabled by an error, a flush that timed out"
            + ("" if lost_events is not None else f"; sinks {sinks.get('status')}"),
        ),
        target(
            "device timings left unresolved after a round",
            float(sum(not e["timings_resolved"] for e in timed)) if timed else None,
            "<=",
            0.0,
            "shapes",
            note=f"flush_device_timing({TIMING_FLUSH_S:g} s) after every round of the timed "
            f"adapter; measured at {len(timed)} of {len(rows)} shapes",
            goal="coverage_costs",
        ),
    ]


def figures(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Return the hit-path costs of the bus's folds and of device timing, worst shape."""
    out = []
    for arm_name, what in (
        ("adapter_bus", "the bus's folds (adapter + bus - adapter)"),
        ("adapter_timed", "device timing (adapter + device timing - adapter)"),
    ):
        key = f"{arm_name}_over_adapter"
        host_us, host_note = _worst(rows, "host_over_us", key)
        pct, pct_note = _worst(rows, "ratios", key, scale=100.0)
        skipped = _skip_note(rows, arm_name)
        out += [
            figure(
                f"hit-path cost of {what}: host time, worst shape",
                host_us,
                "us",
                goal="coverage_costs",
                note="median host time per call, difference; " + host_note + skipped,
            ),
            figure(
                f"hit-path cost of {what}: latency, worst shape",
                pct,
                "%",
                goal="coverage_costs",
                note="median latency per call, ratio; " + pct_note + skipped,
            ),
        ]
    return out
