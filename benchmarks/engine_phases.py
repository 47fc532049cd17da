"""Where a request's time to first token goes: from vLLM's own histograms (TTFT from its renderer's
start, queue and prefill time), whose sums change by exactly one request's figures between two
scrapes of ``/metrics`` with one request in flight; and from omnitrace's per-request events."""

from __future__ import annotations

import math
import statistics
import time
import urllib.error
import urllib.request
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from benchmarks.common import quantile

#: The histograms read, by the phase name they give.
HISTOGRAMS = {
    "engine_ttft": "vllm:time_to_first_token_seconds",
    "queue": "vllm:request_queue_time_seconds",
    "prefill": "vllm:request_prefill_time_seconds",
}
#: The phases a request's TTFT is split into, in the order of the report.
PHASES = ("outside", "rendering", "queue", "prefill")

Scrape = dict[str, tuple[float, float]]


def parse(text: str) -> Scrape:
    """``{histogram: (sum, count)}`` of :data:`HISTOGRAMS` in a Prometheus text page, summed
    over label sets (one engine, so one set each in practice)."""
    found: Scrape = {}
    wanted = {
        f"{name}_{part}": (name, part) for name in HISTOGRAMS.values() for part in ("sum", "count")
    }
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        head, _, value = line.rpartition(" ")
        metric = head.split("{", 1)[0]
        if metric not in wanted:
            continue
        try:
            number = float(value)
        except ValueError:
            continue
        name, part = wanted[metric]
        total, count = found.get(name, (0.0, 0.0))
        found[name] = (total + number, count) if part == "sum" else (total, count + number)
    return found


def scrape(port: int, timeout: float = 5.0) -> Scrape:
    """The histograms of the server on loopback ``port``."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=timeout) as page:
        return parse(page.read().decode("utf-8", "replace"))


def one_request(before: Scrape, after: Scrape) -> dict[str, float] | None:
    """The engine's figures (seconds) of the one request between two scrapes, or None when
    the histograms did not each count exactly one more request."""
    figures = {}
    for phase, name in HISTOGRAMS.items():
        if name not in before or name not in after:
            return None
        (sum0, count0), (sum1, count1) = before[name], after[name]
        if count1 - count0 != 1:
            return None
        figures[phase] = sum1 - sum0
    return figures


def settled(port: int, before: Scrape, wait_s: float = 5.0) -> Scrape:
    """Scrape until every histogram has counted the request after ``before`` (the queue and
    prefill times are recorded as it finishes), or ``wait_s`` has passed."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            after = scrape(port)
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            after = {}
        if one_request(before, after) is not None or time.monotonic() >= deadline:
            return after
        time.sleep(0.02)


def split(client_ttft_s: float, engine: Mapping[str, float] | None) -> dict[str, float] | None:
    """A request's TTFT in :data:`PHASES` (seconds), from its client-side TTFT and the
    engine's figures; None without figures."""
    if engine is None:
        return None
    return {
        "outside": client_ttft_s - engine["engine_ttft"],
        "rendering": engine["engine_ttft"] - engine["queue"] - engine["prefill"],
        "queue": engine["queue"],
        "prefill": engine["prefill"],
    }


def mean_phases_ms(samples: Iterable[Mapping[str, float] | None]) -> dict[str, float] | None:
    """The mean of each phase over ``samples`` in milliseconds (means add up to the mean
    TTFT, which medians would not); None when any sample lacks figures."""
    if (present := _every(samples)) is None:
        return None
    return {p: 1e3 * math.fsum(s[p] for s in present) / len(present) for p in PHASES}


def engine_ttft_p50_ms(samples: Iterable[Mapping[str, float] | None]) -> float | None:
    """The median of vLLM's own TTFT (rendering, queue and prefill: from the request's arrival
    at the renderer) over ``samples`` in milliseconds; None when any sample lacks figures."""
    if (present := _every(samples)) is None:
        return None
    return 1e3 * statistics.median(s["rendering"] + s["queue"] + s["prefill"] for s in present)


def _every(samples: Iterable[Mapping[str, float] | None]) -> Sequence[Mapping[str, float]] | None:
    """``samples`` when there are some and each has its figures, else None."""
    taken = list(samples)
    if not taken or any(s is None for s in taken):
        return None
    return [s for s in taken if s is not None]


# -- the same requests from omnitrace's own events -------------------------------------------


def request_views(paths: Sequence[Path]) -> list[Any]:
    """Each request's view (phases from its ``RequestTimed`` joined with its encoder steps)
    from the engine's event logs."""
    from omnitrace.eventlog.chunks import read_logs
    from omnitrace.requests import RequestJoin

    join = RequestJoin(calls=True)
    for _, chunk in read_logs(paths):
        for record in chunk:
            join.add(record.item, record.pid)
    return list(join.requests())


def event_views(paths: Sequence[Path]) -> dict[str, Any]:
    """:func:`request_views` by the client's request id."""
    return {v.event.request_id: v for v in request_views(paths)}


def view_phases_ms(views: Sequence[Any], average: Any = statistics.mean) -> dict[str, float]:
    """The ``average`` of each of the views' phases, in milliseconds."""
    from omnitrace.requests import PHASES

    return {p: average(v.phases[p] for v in views) * 1e3 for p in PHASES}


def phase_table(
    completions: Sequence[Any], views: dict[str, Any]
) -> tuple[dict[str, Any], list[str]]:
    """Per request kind of ``completions`` (a pass's, each with ``request_id``, ``kind``,
    ``ttft_s`` and, at concurrency 1, vLLM's ``phases``): client and event TTFT, the mean
    and p50 of each phase from the events and, where vLLM's histograms split the requests,
    the engine's part by both; and what could not be found (``problems``)."""
    rows: dict[str, Any] = {}
    problems = []
    for kind in sorted({c.kind for c in completions}):
        mine = [c for c in completions if c.kind == kind]
        found = [views[c.request_id] for c in mine if c.request_id in views]
        if len(found) != len(mine):
            problems.append(f"{kind}: {len(mine) - len(found)} of {len(mine)} without an event")
        if not found:
            continue
        row: dict[str, Any] = {
            "requests": len(mine),
            "client_ttft_p50_ms": statistics.median(c.ttft_s for c in mine) * 1e3,
            "client_ttft_p99_ms": quantile((c.ttft_s for c in mine), 0.99) * 1e3,
            "event_ttft_p50_ms": statistics.median(v.ttft_s for v in found) * 1e3,
            "phases_mean_ms": view_phases_ms(found),
            "phases_p50_ms": view_phases_ms(found, statistics.median),
            "encoder_share_mean_ms": statistics.mean(v.encoder_share_s for v in found) * 1e3,
        }
        if (histogram := mean_phases_ms([c.phases for c in mine])) is not None:
            row["histogram_phases_mean_ms"] = histogram
            events = row["phases_mean_ms"]
            row["engine_part_ms"] = {
                "histograms (queue + prefill)": histogram["queue"] + histogram["prefill"],
                # The same span of vLLM's own timestamps (queued to the engine core's first
                # token), read through the events and their join: the output phase (engine
                # core to API server) is outside vLLM's histograms.
                "events (queue + encoders + prefill)": sum(
                    events[p] for p in ("queue", "encoders", "prefill")
                ),
            }
        rows[kind] = row
    return rows, problems
