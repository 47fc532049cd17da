"""The capture benchmark's goals: the targets its modes are held to, the figures it reports."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from benchmarks.capture_serving import CHECK_EVERY, Mode
from benchmarks.common import figure, quantile, target


def _cold_p99(row: dict[str, Any]) -> float | None:
    lat = (row.get("cold") or {}).get("latency_us")
    return None if lat is None else float(lat["p99"])


def _median_capture_s(row: dict[str, Any]) -> float | None:
    """Median ``GraphCaptured`` duration: the time a capturing call spent capturing."""
    seconds = sorted(row.get("capture_seconds") or [])
    return float(quantile(seconds, 0.5)) if seconds else None


def _change(
    rows: list[dict[str, Any]],
    mode: str,
    versus: str,
    read: Callable[[dict[str, Any]], float | None] = _cold_p99,
) -> float | None:
    """``read(row)`` of ``mode`` against ``versus``'s in percent (default: the cold-pass p99),
    if both ran without errors and ``read`` has a figure for each."""
    by = {r["mode"]: r for r in rows if not r["errors"]}
    mine = read(by[mode]) if mode in by else None
    theirs = read(by[versus]) if versus in by else None
    return mine / theirs * 100 - 100 if mine is not None and theirs else None


def figures(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each background mode's cold-pass p99 against one client's synchronous capture, and the
    compiled one's against serving with no graphs."""
    eager = figure(
        "background compiled capture: cold-pass p99 vs no graphs, every request eager (reference)",
        _change(rows, "background_compiled", "eager"),
        "%",
        goal="background",
        note="two clients each; while shapes compile their requests run eagerly, so this "
        "is what the compile adds to eager serving",
    )
    return [eager] + [
        figure(
            f"{title}: cold-pass p99 vs synchronous capture with one client (reference)",
            _change(rows, mode, "sync_one_client"),
            "%",
            goal="background",
            note="the background mode serves with two clients, the reference with one",
        )
        for mode, title in _BACKGROUND
    ]


_BACKGROUND = (
    ("background", "background capture"),
    ("background_compiled", "background compiled capture"),
)


def targets(
    rows: list[dict[str, Any]], cotenant: dict[str, Any], modes: Sequence[Mode]
) -> list[dict[str, Any]]:
    """The targets of the rows of ``modes``, the modes this run served."""
    cuts = [(mode, title, "sync", "synchronous capture", "") for mode, title in _BACKGROUND]
    cuts.append(
        (
            "background_compiled",
            "background compiled capture",
            "sync_compiled",
            "synchronous compiled capture",
            "both compile every shape they capture; synchronously, the admitting request waits "
            "for its shape's compile",
        )
    )
    out = []
    for mode, title, reference, reference_title, note in cuts:
        value = _change(rows, mode, reference)
        note = note or "p99 request latency of the cold pass, where shapes are captured"
        out.append(
            target(
                f"{title}: cold-pass p99 vs {reference_title}",
                value,
                "<",
                0.0,
                "%",
                note=note + ("" if value is not None else "; a mode failed or did not run"),
                goal="background",
            )
        )
    passes = [r[p] for r in rows for p in ("cold", "warm") if p in r]
    complete = len(rows) == len(modes)
    waited = _change(rows, "background", "sync", _median_capture_s)
    return [
        *out,
        target(
            "background capture: median time a call spends capturing vs synchronous capture",
            waited,
            "<",
            0.0,
            "%",
            note="GraphCaptured durations, both passes: a synchronous capture warms up, "
            "settles the device and captures; a prepared key's call only captures"
            + ("" if waited is not None else "; a mode failed or captured nothing"),
            goal="background",
        ),
        target(
            "requests whose output is beyond tolerance of eager, every mode",
            float(sum(p["wrong"] for p in passes)) if complete else None,
            "<=",
            0.0,
            "requests",
            note=f"{sum(p['checked'] for p in passes)} checked (every {CHECK_EVERY}th request "
            "of every pass)",
            goal="background",
        ),
        target(
            "exceptions and failed preparations, every mode",
            float(sum(len(r["errors"]) for r in rows)) if complete else None,
            "<=",
            0.0,
            "errors",
            note="in client threads and preparation threads; a failed mode stops at once",
            goal="background",
        ),
        target(
            "co-tenant (reduce-overhead) outputs beyond tolerance",
            float(cotenant["wrong"]) if "wrong" in cotenant else None,
            "<=",
            0.0,
            "calls",
            note=f"{cotenant.get('calls', 0)} calls, every one checked",
            goal="background",
        ),
    ]
