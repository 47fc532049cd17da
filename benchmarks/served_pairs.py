"""Graphs off and on inside one ``vllm serve``: paired requests of each kind, switched through
vLLM's ``/collective_rpc`` and omnitrace's worker extension, so the machine's drift hits both
halves of every pair (docs/vllm.md, "Switching graphs off and on in a running server")."""

from __future__ import annotations

import concurrent.futures
import time
from collections.abc import Callable, Sequence
from typing import Any

from benchmarks.common import quantile
from benchmarks.paired import COST_BATCH, cost_summary, cost_text, paired_summary, pairs_table
from benchmarks.table import Table

#: What the server's command line and environment need for the switch.
EXTENSION_ARGS = (
    "--worker-extension-cls",
    "omnitrace.integrations.vllm_worker_controls.WorkerControls",
)
EXTENSION_ENV = {"VLLM_SERVER_DEV_MODE": "1"}


class SwitchError(RuntimeError):
    """The server did not switch its graphs as asked."""


def rpc(base_url: str, method: str, *args: Any) -> list[Any]:
    """Call ``method`` of every worker through ``POST /collective_rpc``; one result a worker.

    Raises:
        SwitchError: the server answered anything but 200 with results.
    """
    import httpx

    response = httpx.post(
        f"{base_url}/collective_rpc", json={"method": method, "args": list(args)}, timeout=120
    )
    if response.status_code != 200:
        raise SwitchError(f"{method}: HTTP {response.status_code}: {response.text[:300]}")
    results = response.json().get("results")
    if not isinstance(results, list) or not results:
        raise SwitchError(f"{method}: no results in {response.text[:300]}")
    return results


#: :func:`switch`'s worker methods (to set, to read back) and state: graphs paused or not;
#: a call's items split (one call each) or not.
PAUSE = ("omnitrace_pause_graphs", "omnitrace_graphs_paused", "paused")
SPLIT = ("omnitrace_split_items", "omnitrace_items_split", "split")


def switch(base_url: str, value: bool, names: Sequence[str] = PAUSE) -> None:
    """Set every worker's graphs to ``value`` (:data:`PAUSE` or :data:`SPLIT`, ``names``),
    then read the state back from each adapter.

    Raises:
        SwitchError: a worker has no adapter, or one of them is not in the state asked for.
    """
    method, read, what = names
    rpc(base_url, method, value)
    states = rpc(base_url, read)
    if any(not isinstance(s, dict) or not s for s in states):
        raise SwitchError(f"a worker has no encoder adapter: {states}")
    if any(v is not value for s in states for v in s.values()):
        raise SwitchError(f"asked for {what}={value}, the workers say {states}")


def run(
    base_url: str, kinds: Sequence[Any], ask: Callable[[Any, int], Any], *, pairs: int, seed: int
) -> dict[str, Any]:
    """``pairs`` pairs of each kind, one request at a time: eager (paused) and graphed back to
    back, the order alternating from pair to pair and kind to kind. ``ask(kind, seed)`` sends
    one request and returns its completion (``ttft_s``, ``request_id``).

    Returns:
        per kind, :func:`benchmarks.paired.paired_summary` of the TTFTs; ``requests``: each
        request's kind, whether it was paused and its id, in the order sent.
    """
    times: dict[str, dict[bool, list[float]]] = {k.name: {True: [], False: []} for k in kinds}
    sent: list[dict[str, Any]] = []
    try:
        for round_ in range(pairs):
            for index, kind in enumerate(kinds):
                order = (True, False) if (round_ + index) % 2 == 0 else (False, True)
                for paused in order:
                    switch(base_url, paused)
                    done = ask(kind, seed + len(sent))
                    times[kind.name][paused].append(done.ttft_s)
                    sent.append(dict(kind=kind.name, paused=paused, request_id=done.request_id))
    finally:
        rpc(base_url, "omnitrace_pause_graphs", False)
    kinds = {name: paired_summary(halves[True], halves[False]) for name, halves in times.items()}
    return {"kinds": kinds, "requests": sent}


def time_requests(base_url: str, enabled: bool) -> None:
    """Switch request timing in the API server (omnitrace's route) and in every worker.

    Raises:
        SwitchError: either refused.
    """
    import httpx

    from omnitrace.integrations.vllm_requests import TIMING_ROUTE

    response = httpx.post(f"{base_url}{TIMING_ROUTE}", json={"enabled": enabled}, timeout=120)
    if response.status_code != 200 or response.json().get("enabled") is not enabled:
        raise SwitchError(f"{TIMING_ROUTE}: HTTP {response.status_code}: {response.text[:300]}")
    rpc(base_url, "omnitrace_time_requests", enabled)


def batch_rounds(
    kinds: Sequence[Any],
    ask: Callable[[Any, int], Any],
    switch: Callable[[bool], None],
    *,
    rounds: int,
    seed: int,
    after: bool,
    batch: int = COST_BATCH,
    warmup: int = 2,
) -> dict[str, Any]:
    """Each round a batch of ``batch`` requests in flight with ``switch(False)`` and one with
    ``switch(True)``, the order alternating; requests/s of each batch. ``switch(after)`` is
    left in force, whatever happens.

    Both batches of a round carry the same kinds (new content each), so a round's change
    compares like with like; the kinds move on from round to round. ``warmup`` rounds run
    first and are not counted: their batches capture the batched shapes.

    Returns:
        :func:`benchmarks.paired.cost_summary` of the rounds, with each batch's rate and
        each half's TTFT p50 and p99 (``off_ttft_ms``, ``on_ttft_ms``).
    """
    rates: dict[bool, list[float]] = {False: [], True: []}
    ttfts: dict[bool, list[float]] = {False: [], True: []}
    sent = 0
    try:
        for round_ in range(-warmup, rounds):
            chosen = [kinds[(round_ * batch + i) % len(kinds)] for i in range(batch)]
            for on in (False, True) if round_ % 2 == 0 else (True, False):
                switch(on)
                start = time.perf_counter()
                with concurrent.futures.ThreadPoolExecutor(batch) as pool:
                    done = [
                        pool.submit(ask, kind, seed + sent + i) for i, kind in enumerate(chosen)
                    ]
                    finished = [future.result() for future in done]
                if round_ >= 0:
                    rates[on].append(batch / (time.perf_counter() - start))
                    ttfts[on] += [completion.ttft_s * 1e3 for completion in finished]
                sent += batch
    finally:
        switch(after)
    summary = cost_summary(rates[False], rates[True])
    for on, half in ((False, "off"), (True, "on")):
        ordered = sorted(ttfts[on])
        summary[f"{half}_ttft_ms"] = {"p50": quantile(ordered, 0.5), "p99": quantile(ordered, 0.99)}
    return {**summary, "batch": batch, "off_rps": rates[False], "on_rps": rates[True]}


def tables(model: dict[str, Any]) -> list[Table]:
    """The served pairs of a model's configurations, as the engine report shows them."""
    found = []
    for name, config in model.get("configurations", {}).items():
        pairs = config.get("served_pairs")
        if not pairs:
            continue
        table = pairs_table(
            f"{model['name']}: {name}, graphs off and on inside one vllm serve (TTFT, ms)",
            pairs["kinds"],
        )
        eager, graphed = (
            ", ".join(f"{k} {v}" for k, v in sorted(pairs["encoder_calls"][half].items())) or "none"
            for half in ("eager", "graphed")
        )
        missing = pairs["without_event"]
        table.note = (
            "After the measured passes, one request at a time, the graphs switched through "
            f"/collective_rpc before each. Encoder calls of the eager halves: {eager}; of the "
            f"graphed halves: {graphed}"
            + (f"; {missing} requests without an event" if missing else "")
            + "."
        )
        if cost := pairs.get("timing_cost"):
            table.note += f" {cost_text(cost)}, in the same server."
        elif pairs.get("timing_cost_skipped"):
            table.note += f" Request timing's cost not measured: {pairs['timing_cost_skipped']}."
        if split := pairs.get("split_cost"):
            table.note += f" {cost_text(split, 'One call per item', ('batched', 'split'))}."
        found.append(table)
    return found
