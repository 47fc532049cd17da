"""The frozen coverage of an adapter (a row per signature, the ``other`` bucket, its
profiling runs) and the questions asked of it: top missed signatures, the encoder summary,
the time eager calls lost."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

from omnitrace.events import MissReason, Phase
from omnitrace.misses import MissCause, causes_json
from omnitrace.signature import Signature
from omnitrace.stats import HitRate

if TYPE_CHECKING:
    from omnitrace.stats import AdapterStats

__all__ = [
    "GRAPHABLE_REASONS",
    "NO_CALLS",
    "NO_RUNS",
    "PHASES",
    "REASONS",
    "AdapterCoverage",
    "CallCounts",
    "EagerLoss",
    "KeyCoverage",
    "ProfilingRuns",
    "Timing",
    "encoder_summary",
]

#: Miss reasons a graph could have served (ineligible calls can never use one).
GRAPHABLE_REASONS: tuple[MissReason, ...] = (
    MissReason.WARMUP,
    MissReason.CAPACITY,
    MissReason.MEMORY,
)
#: The order of :attr:`CallCounts.miss_counts` and of :attr:`KeyCoverage.by_phase`.
REASONS = tuple(MissReason)
PHASES = tuple(Phase)


@dataclass(frozen=True, slots=True)
class Timing:
    """The sum and count of measured call times, in seconds.

    Args:
        count: calls measured; default 0.
        total_s: their times summed, in seconds; default 0.0.
    """

    count: int = 0
    total_s: float = 0.0

    @property
    def mean_s(self) -> float | None:
        """The mean time of one call; None when none was measured."""
        return self.total_s / self.count if self.count else None

    def __add__(self, other: Timing) -> Timing:
        return Timing(self.count + other.count, self.total_s + other.total_s)


_NO_TIME = Timing()


@dataclass(frozen=True, slots=True)
class CallCounts(HitRate):
    """Calls of one signature (or bucket, or adapter) in one phase or in all of them.

    ``eager`` and ``replay`` are host times from the call events (eager calls a model
    recorded without running them have none); ``eager_device`` and ``replay_device`` are
    device times from DeviceTimed events, present only with device timing on.

    Args:
        hits: calls served by a graph; default 0.
        miss_counts: misses per :class:`MissReason`, in the enum's order; default all 0.
        captures: graphs captured; default 0.
        eager, replay, eager_device, replay_device: the host and device timings of the
            eager and replayed calls; each defaults to an empty :class:`Timing`.
    """

    hits: int = 0
    miss_counts: tuple[int, ...] = (0,) * len(REASONS)
    """Misses per :class:`MissReason`, in the enum's order (see :attr:`misses`)."""
    captures: int = 0
    eager: Timing = _NO_TIME
    replay: Timing = _NO_TIME
    eager_device: Timing = _NO_TIME
    replay_device: Timing = _NO_TIME

    @property
    def misses(self) -> Mapping[MissReason, int]:
        """Misses by reason."""
        return MappingProxyType(dict(zip(REASONS, self.miss_counts, strict=True)))

    @property
    def graph_misses(self) -> int:
        """Misses of every reason."""
        return sum(self.miss_counts)

    @property
    def graphable_misses(self) -> int:
        """Misses a graph could have served (warm-up, capacity, memory)."""
        misses = self.misses
        return sum(misses[reason] for reason in GRAPHABLE_REASONS)

    @property
    def calls(self) -> int:
        """Hits and misses."""
        return self.hits + self.graph_misses

    def eager_time(self, source: str) -> Timing:
        """Return the eager calls' ``"host"`` or ``"device"`` timing.

        Args:
            source: ``"device"`` for the device timing; anything else gives the host's.
        """
        return self.eager_device if source == "device" else self.eager

    def replay_time(self, source: str) -> Timing:
        """Return the replayed calls' ``"host"`` or ``"device"`` timing.

        Args:
            source: ``"device"`` for the device timing; anything else gives the host's.
        """
        return self.replay_device if source == "device" else self.replay

    def __add__(self, other: CallCounts) -> CallCounts:
        return CallCounts(
            self.hits + other.hits,
            tuple(a + b for a, b in zip(self.miss_counts, other.miss_counts, strict=True)),
            self.captures + other.captures,
            self.eager + other.eager,
            self.replay + other.replay,
            self.eager_device + other.eager_device,
            self.replay_device + other.replay_device,
        )


NO_CALLS = CallCounts()


def _sum(counts: Iterable[CallCounts]) -> CallCounts:
    total = NO_CALLS
    for item in counts:
        total = total + item
    return total


@dataclass(frozen=True, slots=True)
class KeyCoverage:
    """One tracked signature of an adapter, or its ``other`` bucket (``signature`` None).

    Args:
        signature: the signature; None for the ``other`` bucket.
        by_phase: the counts per :class:`Phase`, in the enum's order.
        captured: whether the adapter holds a graph of it; default False.
        capture_bytes: bytes the capture took; default 0.
        capture_phase: the phase the graph was captured in; default None (none held).
    """

    signature: Signature | None
    by_phase: tuple[CallCounts, ...]
    """The counts per :class:`Phase`, in the enum's order (see :meth:`in_phase`)."""
    captured: bool = False
    capture_bytes: int = 0
    """Bytes the capture took: allocator growth across it plus its static buffers."""
    capture_phase: Phase | None = None
    """The phase the graph was captured in (None if it holds none)."""

    @property
    def key(self) -> str:
        """The signature's text, or ``"other"`` for the bucket."""
        return "other" if self.signature is None else self.signature.text

    def in_phase(self, phase: Phase) -> CallCounts:
        """Return the counts of ``phase``.

        Args:
            phase: the phase.

        Raises:
            ValueError: ``phase`` is not a :class:`Phase`.
        """
        return self.by_phase[PHASES.index(phase)]

    @property
    def total(self) -> CallCounts:
        """The counts of every phase together."""
        return _sum(self.by_phase)

    @property
    def calls(self) -> int:
        """Calls of every phase."""
        return self.total.calls

    @property
    def hits(self) -> int:
        """Hits of every phase."""
        return self.total.hits

    @property
    def graph_misses(self) -> int:
        """Misses of every phase and reason."""
        return self.total.graph_misses

    @property
    def main_reason(self) -> MissReason | None:
        """The reason most of its misses had (ties: display order); None without misses."""
        misses = self.total.misses
        ranked = sorted(MissReason.display_order(), key=lambda r: -misses[r])
        return ranked[0] if misses[ranked[0]] else None


@dataclass(frozen=True, slots=True)
class EagerLoss:
    """What the eager calls a graph could have served cost, and what graphs would save.

    Per signature: its graphable misses times its mean eager time (``eager_s``), and times
    its mean eager time minus its mean replay time (``lost_s``, never below zero per
    signature). A signature never replayed gets the adapter's replay-to-eager ratio of the
    signatures that have both. Times are device times when the adapter's events carry any
    (``source`` ``"device"``), else host times.

    Args:
        misses, timed, eager_s, lost_s, source, estimated: as on the attributes below
            (``eager_s``: seconds the graphable misses took, eagerly).
    """

    misses: int
    """Misses a graph could have served (warm-up, capacity, memory)."""
    timed: int
    """Of those, misses of signatures with a measured eager time (the rest count nowhere)."""
    eager_s: float
    lost_s: float | None
    """None when no replay time is known to estimate from."""
    source: str
    """``"device"`` or ``"host"``."""
    estimated: int
    """Signatures whose replay time is estimated from other signatures' ratio."""


@dataclass(frozen=True, slots=True)
class ProfilingRuns:
    """What the engine's profiling runs reported of one adapter (ProfilingObserved events).

    Args:
        runs: profiling runs observed; default 0.
        encoder_calls: calls of this encoder those runs made; default 0.
        without_calls: runs that did not call this encoder; default 0.
        runner: the profiling method of the latest run; default "".
    """

    runs: int = 0
    """Profiling runs observed."""
    encoder_calls: int = 0
    """Calls of this encoder those runs made, in all."""
    without_calls: int = 0
    """Runs that did not call this encoder: its graphs' memory was not profiled by them."""
    runner: str = ""
    """The profiling method of the latest run (empty before any)."""


NO_RUNS = ProfilingRuns()


@dataclass(frozen=True, slots=True)
class AdapterCoverage:
    """A frozen snapshot of one adapter's per-signature coverage.

    Args:
        adapter: the adapter's name.
        keys: the tracked signatures' rows, most calls first.
        other: the row of the calls of signatures not tracked.
        limit: signatures tracked at most.
        evictions: rows folded into ``other`` so far; default 0.
        profiling_runs: what the profiling runs reported; default none observed.
        miss_details: every miss by reason and detail, most first; default ().
    """

    adapter: str
    keys: tuple[KeyCoverage, ...]
    """The tracked signatures, most calls first (first seen first among equals)."""
    other: KeyCoverage
    """Calls of signatures not tracked (``signature`` None)."""
    limit: int
    """Signatures tracked at most, beside captured ones beyond it."""
    evictions: int = 0
    """Rows folded into ``other`` so far (one signature may count more than once)."""
    profiling_runs: ProfilingRuns = NO_RUNS
    """What the engine's start-up profiling runs reported of this encoder."""
    miss_details: tuple[MissCause, ...] = ()
    """Every miss by reason and detail (``cpu``, ``paused``, ``budget``, ...), most first."""

    @property
    def total(self) -> CallCounts:
        """Every call of the adapter: the tracked rows plus ``other``, exactly."""
        return _sum(row.total for row in (*self.keys, self.other))

    def in_phase(self, phase: Phase) -> CallCounts:
        """Every call of the adapter in ``phase``.

        Args:
            phase: the phase.

        Raises:
            ValueError: ``phase`` is not a :class:`Phase`.
        """
        return _sum(row.in_phase(phase) for row in (*self.keys, self.other))

    @property
    def captured(self) -> tuple[KeyCoverage, ...]:
        """The tracked rows that hold a graph, in :attr:`keys` order."""
        return tuple(row for row in self.keys if row.captured)

    @property
    def pool_bytes(self) -> int:
        """Bytes the captured graphs took (allocator growth plus static buffers)."""
        return sum(row.capture_bytes for row in self.keys)

    def key(self, signature: Signature) -> KeyCoverage | None:
        """Return the row of ``signature``, or None when it is not tracked.

        Args:
            signature: the signature to look up.
        """
        for row in self.keys:
            if row.signature == signature:
                return row
        return None

    def top_missed(self, count: int = 5) -> tuple[KeyCoverage, ...]:
        """Return up to ``count`` rows with the most misses (``other`` included), most first.

        Args:
            count: most rows returned; default 5. Rows without misses are left out.
        """
        rows = [row for row in (*self.keys, self.other) if row.graph_misses]
        rows.sort(key=lambda row: -row.graph_misses)
        return tuple(rows[:count])

    def summary(self, count: int = 5) -> dict[str, Any]:
        """Return the coverage in a few JSON-ready fields (log summaries, ``top --json``).

        ``top_missed``: up to ``count`` rows with the most misses, each with its ``key``,
        ``misses``, the ``reason`` most of them had and their ``share`` of the adapter's
        calls; ``eager_s`` and ``lost_s`` (see :class:`EagerLoss`) in ``time_source`` time;
        and ``profiling`` (``calls``, ``hits``, ``captures`` and ``replayed_in_serving``,
        graphs captured while profiling that serving replayed) when there were any, with
        ``runs``, ``runs_without_calls`` and ``runner`` (see :class:`ProfilingRuns`) when a
        profiling run was observed, so a run that called no encoder shows too; and
        ``miss_details``, ``{reason: {detail: misses}}`` (see :func:`~omnitrace.misses.
        causes_json`).

        Args:
            count: most rows in ``top_missed``; default 5.

        Returns:
            A new dict of those fields.
        """
        calls = self.total.calls or 1
        fields: dict[str, Any] = {
            "top_missed": [
                {
                    "key": row.key,
                    "misses": row.graph_misses,
                    "reason": None if row.main_reason is None else row.main_reason.value,
                    "share": round(row.graph_misses / calls, 4),
                }
                for row in self.top_missed(count)
            ]
        }
        loss = self.eager_loss()
        fields.update(eager_s=loss.eager_s, lost_s=loss.lost_s, time_source=loss.source)
        profiling = self.in_phase(Phase.PROFILING)
        runs = self.profiling_runs
        if profiling.calls or profiling.captures or runs.runs:
            captured = [row for row in self.captured if row.capture_phase is Phase.PROFILING]
            fields["profiling"] = {
                "calls": profiling.calls,
                "hits": profiling.hits,
                "captures": profiling.captures,
                "replayed_in_serving": sum(
                    1 for row in captured if row.in_phase(Phase.SERVING).hits
                ),
            }
            if runs.runs:
                fields["profiling"].update(
                    runs=runs.runs, runs_without_calls=runs.without_calls, runner=runs.runner
                )
        fields["miss_details"] = causes_json(self.miss_details)
        return fields

    @property
    def time_source(self) -> str:
        """``"device"`` when any call of the adapter was timed on the device, else ``"host"``."""
        total = self.total
        return "device" if total.eager_device.count or total.replay_device.count else "host"

    def eager_loss(self) -> EagerLoss:
        """Estimate the time eager calls cost that graphs could have saved (see EagerLoss)."""
        source = self.time_source
        rows = [row.total for row in (*self.keys, self.other)]
        # Replay-to-eager ratio of the rows that have both, weighted by their replays.
        replay_total = eager_equiv = 0.0
        for counts in rows:
            eager = counts.eager_time(source).mean_s
            replays = counts.replay_time(source)
            if eager is not None and replays.count:
                replay_total += replays.total_s
                eager_equiv += replays.count * eager
        ratio = replay_total / eager_equiv if eager_equiv > 0 else None
        misses = timed = estimated = 0
        eager_s = lost_s = 0.0
        known = True
        for counts in rows:
            graphable = counts.graphable_misses
            misses += graphable
            eager = counts.eager_time(source).mean_s
            if not graphable or eager is None:
                continue
            timed += graphable
            eager_s += graphable * eager
            replay = counts.replay_time(source).mean_s
            if replay is None:
                if ratio is None:
                    known = False
                    continue
                replay = eager * ratio
                estimated += 1
            lost_s += graphable * max(0.0, eager - replay)
        return EagerLoss(misses, timed, eager_s, lost_s if known else None, source, estimated)


#: Backends whose "replay" runs the forward again: no time is lost to a miss there, so
#: ``lost_s`` is null rather than a number that means nothing.
_NO_REPLAY_SPEEDUP = frozenset({"simulated"})


def encoder_summary(
    stats: AdapterStats,
    coverage: AdapterCoverage | None,
    info: Mapping[str, Any] | None = None,
    top_missed: int = 5,
) -> dict[str, Any]:
    """Return what every output of a run says of one encoder, from its stats and coverage.

    The one source of the ``graph_summary`` log lines, ``omnitrace top --json`` and
    ``omnitrace replay --json``, so they agree field by field: ``encoder``, the nine stats
    keys, ``calls``, ``max_graphs`` and ``backend`` (from the adapter's registered ``info``;
    None when unknown), ``first_capture_free_bytes`` (the free device memory the first graph
    was captured with; None before any or where unread) and, with the coverage, the fields
    of :meth:`AdapterCoverage.summary`. ``lost_s`` is None on the simulated backend, whose
    replays run the forward again.

    Args:
        stats: the encoder's stats.
        coverage: its coverage; None leaves the coverage fields out.
        info: what the adapter registered on its bus; default None (nothing).
        top_missed: most rows in ``top_missed``; default 5.

    Returns:
        A new dict of those fields.
    """
    info = info or {}
    max_graphs = info.get("max_graphs")
    backend = info.get("backend")
    fields: dict[str, Any] = {
        "encoder": stats.adapter,
        **stats.as_dict(),
        "calls": stats.calls,
        "max_graphs": max_graphs
        if isinstance(max_graphs, int) and not isinstance(max_graphs, bool)
        else None,
        "backend": backend if isinstance(backend, str) else None,
        "first_capture_free_bytes": stats.graphs[0].free_bytes if stats.graphs else None,
    }
    if coverage is not None:
        fields.update(coverage.summary(top_missed))
        if fields["backend"] in _NO_REPLAY_SPEEDUP:
            fields["lost_s"] = None
    return fields
