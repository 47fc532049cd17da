"""The benchmarks and the suites that name them: what the runner runs and the report reads.
One table both use, so neither imports the other for it (``benchmarks.run`` prints
``benchmarks.report``'s summary)."""

from __future__ import annotations

__all__ = ["BENCHMARKS", "SUITES"]

#: Benchmarks in the order ``all`` runs them: memory first, while the device is clean; latency
#: late, because its compiles are bounded by what is left of the time budget.
BENCHMARKS = ("overhead", "memory", "latency", "observability")
SUITES: dict[str, tuple[str, ...]] = {
    "all": BENCHMARKS,
    # The event-log tools at 100k, 1M and 10M events (the 10M log alone is 3.4 GB).
    "cpu": ("overhead", "eventlog"),
    **{name: (name,) for name in BENCHMARKS},
    "eventlog": ("eventlog",),
    # End to end through vllm serve, one engine per configuration: a suite of its own (it
    # needs vLLM, and a full run takes tens of minutes); --quick runs it on a CPU.
    "engine": ("engine",),
}
