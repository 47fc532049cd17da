"""Where a request's time to first token goes, read from the engine's own metrics.

vLLM's server keeps three histograms per request that split the time to first token:

- ``vllm:time_to_first_token_seconds``: from the request's arrival, which vLLM stamps when
  its renderer starts on the prompt (the chat template, decoding the media, the model's
  processor), to the first token;
- ``vllm:request_queue_time_seconds``: waiting in the engine's scheduler;
- ``vllm:request_prefill_time_seconds``: from the first schedule to the first token (the
  encoders and the language model's prefill).

With one request in flight the change of each histogram's sum between two scrapes of
``/metrics`` is that request's figure, so the client's TTFT splits into *outside* (HTTP and
request handling before the renderer; the client's TTFT minus the engine's), *rendering*
(the engine's TTFT minus queue and prefill), *queue* and *prefill*.
"""

from __future__ import annotations

import math
import statistics
import time
import urllib.error
import urllib.request
from collections.abc import Iterable, Mapping, Sequence

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
    rendering = engine["engine_ttft"] - engine["queue"] - engine["prefill"]
    return {
        "outside": client_ttft_s - engine["engine_ttft"],
        "rendering": rendering,
        "queue": engine["queue"],
        "prefill": engine["prefill"],
    }


def mean_phases_ms(samples: Iterable[Mapping[str, float] | None]) -> dict[str, float] | None:
    """The mean of each phase over ``samples`` in milliseconds (means add up to the mean
    TTFT, which medians would not); None when any sample lacks figures."""
    present = _every(samples)
    if present is None:
        return None
    return {p: 1e3 * math.fsum(s[p] for s in present) / len(present) for p in PHASES}


def engine_ttft_p50_ms(samples: Iterable[Mapping[str, float] | None]) -> float | None:
    """The median of vLLM's own TTFT (rendering, queue and prefill: from the request's arrival
    at the renderer) over ``samples`` in milliseconds; None when any sample lacks figures."""
    present = _every(samples)
    if present is None:
        return None
    return 1e3 * statistics.median(s["rendering"] + s["queue"] + s["prefill"] for s in present)


def _every(
    samples: Iterable[Mapping[str, float] | None],
) -> Sequence[Mapping[str, float]] | None:
    """``samples`` when there are some and each has its figures, else None."""
    taken = list(samples)
    if not taken or any(s is None for s in taken):
        return None
    return [s for s in taken if s is not None]
