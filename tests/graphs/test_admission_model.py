"""Property tests: the adapter's admission decisions match a plain reference model."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from omnitrace import (
    EncoderCudaGraph,
    EncoderGraphConfig,
    EventBus,
    GraphCaptured,
    GraphMissed,
    GraphReplayed,
    MemoryDeferred,
    derive_stats,
)
from omnitrace.testing import SimulatedGraphBackend, capture_events


@dataclass
class Reference:
    """The rules of the design note, written as directly as possible."""

    max_graphs: int
    min_calls: int
    floor: int
    graph_bytes: int
    free: int
    budget: int = 0
    pool: int = 0  # what the captured graphs took: pool growth plus static buffers
    graphs: list[tuple[int, int]] = field(default_factory=list)
    history: list[list[object]] = field(default_factory=list)  # [key, calls], oldest first
    # With a budget: per remembered key, the least its eager calls took (the test's forward
    # takes as many bytes as its input has rows).
    need: dict[tuple[int, int], int] = field(default_factory=dict)

    def _eager(self, key: tuple[int, int], verdict: list[str]) -> list[str]:
        if self.budget > 0 and key[0] > 0:
            self.need[key] = min(self.need.get(key, key[0]), key[0])
        return verdict

    def call(self, key: tuple[int, int]) -> list[str]:
        if key in self.graphs:
            return ["hit"]
        if len(self.graphs) >= self.max_graphs:
            return ["miss:capacity"]  # max_graphs=0 too: a cache of zero graphs is full
        if self.budget > 0 and self.pool >= self.budget:
            return ["miss:capacity"]
        calls = 1
        for entry in self.history:
            if entry[0] == key:
                calls = int(entry[1]) + 1  # type: ignore[call-overload]
                self.history.remove(entry)
                break
        self.history.append([key, calls])
        if len(self.history) > 4 * self.max_graphs:
            self.need.pop(self.history.pop(0)[0], None)  # type: ignore[arg-type]
        if calls < self.min_calls:
            return self._eager(key, ["miss:warmup"])
        if self.floor > 0 and self.free < self.floor:
            return self._eager(key, ["deferred", "miss:memory"])
        need = self.need.get(key)
        # A graph of as many rows or more on the same replay stream shares the pool, whose
        # memory holds this capture: the need does not defer it.
        reused = any(g[1] == key[1] and g[0] >= key[0] for g in self.graphs)
        if need is not None and need + need // 8 > self.free and not reused:
            return self._eager(key, ["deferred", "miss:memory"])
        self.history = [e for e in self.history if e[0] != key]
        self.need.pop(key, None)
        self.graphs.append(key)
        self.free = max(0, self.free - self.graph_bytes)
        # The static input and output: (rows, 2) float32 each.
        self.pool += self.graph_bytes + 2 * key[0] * 2 * 4
        return ["captured", "hit"]


def observed(events: list[object]) -> list[str]:
    out = []
    for e in events:
        if isinstance(e, GraphMissed):
            out.append(f"miss:{e.reason.value}")
        elif isinstance(e, GraphReplayed):
            out.append("hit")
        elif isinstance(e, GraphCaptured):
            out.append("captured")
        elif isinstance(e, MemoryDeferred):
            out.append("deferred")
    return out


operation = st.one_of(
    st.tuples(st.just("call"), st.integers(1, 9), st.integers(0, 1)),
    st.tuples(st.just("free"), st.integers(0, 12), st.just(0)),
)


@settings(max_examples=400, deadline=None)
@given(
    max_graphs=st.integers(0, 5),
    min_calls=st.integers(2, 5),
    floor=st.sampled_from([0, 4, 8]),
    graph_bytes=st.integers(0, 3),
    free=st.integers(0, 12),
    budget=st.sampled_from([0, 0, 20, 60, 150]),
    ops=st.lists(operation, max_size=100),
)
def test_adapter_matches_reference_model(
    max_graphs: int,
    min_calls: int,
    floor: int,
    graph_bytes: int,
    free: int,
    budget: int,
    ops: list[tuple[str, int, int]],
) -> None:
    """Every call's events, and the final stats, agree with the reference model; with a
    budget, a key whose eager calls took more than free memory holds is deferred too."""
    config = EncoderGraphConfig(
        max_graphs=max_graphs,
        min_capture_calls=min_calls,
        min_free_bytes=floor,
        pool_budget_bytes=budget,
    )
    backend = SimulatedGraphBackend(free_bytes=free, graph_bytes=graph_bytes)
    reference = Reference(max_graphs, min_calls, floor, graph_bytes, free, budget)
    bus = EventBus()

    def forward(x: torch.Tensor) -> torch.Tensor:
        # What an eager call took at its peak, as the allocator would report it.
        backend.peak_bytes = backend.allocated_bytes + x.shape[0]
        return x * 2

    graph = EncoderCudaGraph(forward, name="m", config=config, bus=bus, backend=backend)
    try:
        with torch.no_grad(), capture_events(bus) as events:
            for kind, a, b in ops:
                if kind == "free":
                    backend.free_bytes = a
                    reference.free = a
                    continue
                start = len(events)
                with backend.stream(b):
                    x = torch.full((a, 2), float(a))
                    out = graph(x)
                torch.testing.assert_close(out, x * 2, rtol=0, atol=0)
                assert observed(events[start:]) == reference.call((a, b))
                assert backend.free_bytes == reference.free
        stats = graph.get_cumulative_stats()
        assert stats["num_graphs"] == len(reference.graphs)
        assert derive_stats(events).get("m", stats) == stats
    finally:
        bus.close()
