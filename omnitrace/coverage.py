"""Per-signature coverage: which input shapes each encoder saw, and how each was served.

Like :mod:`omnitrace.stats`, a pure fold over the event stream: for every adapter and input
signature it counts calls, hits and misses by reason, whether the signature holds a graph
and what its capture took, and the time of its eager and replayed calls (host time from the
call events, device time from :class:`~omnitrace.events.DeviceTimed` when device timing is
on; the two are kept apart), each split by :class:`~omnitrace.events.Phase`.

Memory is bounded whatever the traffic: per adapter, the table holds at most ``limit``
signatures (default :data:`DEFAULT_COVERAGE_KEYS`). When a new signature arrives at a full
table, the tracked signature with the fewest calls (the least recently called among equals)
is folded into the ``other`` bucket and the newcomer takes its row. Captured signatures are
never folded away: a table whose rows are all captured puts newcomers straight into
``other``, and a capture always gets a row, so an encoder holding more graphs than ``limit``
has one row per graph and no more. A row counts its signature's calls since it last entered
the table (earlier calls are in ``other``), and totals stay exact: the tracked rows plus
``other`` add up to every call. :func:`derive_coverage` folds a list of events into what the
bus's live fold (``EventBus.coverage()``) shows.

Beside the calls, each adapter's coverage keeps what the engine's start-up profiling runs
reported of it (:class:`~omnitrace.events.ProfilingObserved`, no call of its own):
:class:`ProfilingRuns`, a few counters whatever the number of runs.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from omnitrace import events as ev
from omnitrace._validate import check_int
from omnitrace.events import Event, MissReason, Phase
from omnitrace.signature import Signature
from omnitrace.stats import HitRate, StatsFold

__all__ = [
    "DEFAULT_COVERAGE_KEYS",
    "GRAPHABLE_REASONS",
    "MAX_COVERAGE_KEYS",
    "AdapterCoverage",
    "CallCounts",
    "CoverageFold",
    "EagerLoss",
    "KeyCoverage",
    "ProfilingRuns",
    "Timing",
    "derive_coverage",
]

#: Signatures tracked per adapter unless told otherwise.
DEFAULT_COVERAGE_KEYS = 32
#: Most signatures a table may track: every fold update may scan the table once.
MAX_COVERAGE_KEYS = 4096
#: Miss reasons a graph could have served (ineligible calls can never use one).
GRAPHABLE_REASONS: tuple[MissReason, ...] = (
    MissReason.WARMUP,
    MissReason.CAPACITY,
    MissReason.MEMORY,
)

_REASONS = tuple(MissReason)
_PHASES = tuple(Phase)
_SERVING = Phase.SERVING


@dataclass(frozen=True, slots=True)
class Timing:
    """The sum and count of measured call times, in seconds."""

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
    """

    hits: int = 0
    miss_counts: tuple[int, ...] = (0,) * len(_REASONS)
    """Misses per :class:`MissReason`, in the enum's order (see :attr:`misses`)."""
    captures: int = 0
    eager: Timing = _NO_TIME
    replay: Timing = _NO_TIME
    eager_device: Timing = _NO_TIME
    replay_device: Timing = _NO_TIME

    @property
    def misses(self) -> Mapping[MissReason, int]:
        """Misses by reason."""
        return MappingProxyType(dict(zip(_REASONS, self.miss_counts, strict=True)))

    @property
    def graph_misses(self) -> int:
        return sum(self.miss_counts)

    @property
    def graphable_misses(self) -> int:
        """Misses a graph could have served (warm-up, capacity, memory)."""
        misses = self.misses
        return sum(misses[reason] for reason in GRAPHABLE_REASONS)

    @property
    def calls(self) -> int:
        return self.hits + self.graph_misses

    def eager_time(self, source: str) -> Timing:
        """Return the eager calls' ``"host"`` or ``"device"`` timing."""
        return self.eager_device if source == "device" else self.eager

    def replay_time(self, source: str) -> Timing:
        """Return the replayed calls' ``"host"`` or ``"device"`` timing."""
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


_NO_CALLS = CallCounts()


def _sum(counts: Iterable[CallCounts]) -> CallCounts:
    total = _NO_CALLS
    for item in counts:
        total = total + item
    return total


@dataclass(frozen=True, slots=True)
class KeyCoverage:
    """One tracked signature of an adapter, or its ``other`` bucket (``signature`` None)."""

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
        """Return the counts of ``phase``."""
        return self.by_phase[_PHASES.index(phase)]

    @property
    def total(self) -> CallCounts:
        """The counts of every phase together."""
        return _sum(self.by_phase)

    @property
    def calls(self) -> int:
        return self.total.calls

    @property
    def hits(self) -> int:
        return self.total.hits

    @property
    def graph_misses(self) -> int:
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
    """What the engine's profiling runs reported of one adapter (ProfilingObserved events)."""

    runs: int = 0
    """Profiling runs observed."""
    encoder_calls: int = 0
    """Calls of this encoder those runs made, in all."""
    without_calls: int = 0
    """Runs that did not call this encoder: its graphs' memory was not profiled by them."""
    runner: str = ""
    """The profiling method of the latest run (empty before any)."""


_NO_RUNS = ProfilingRuns()


@dataclass(frozen=True, slots=True)
class AdapterCoverage:
    """A frozen snapshot of one adapter's per-signature coverage."""

    adapter: str
    keys: tuple[KeyCoverage, ...]
    """The tracked signatures, most calls first (first seen first among equals)."""
    other: KeyCoverage
    """Calls of signatures not tracked (``signature`` None)."""
    limit: int
    """Signatures tracked at most, beside captured ones beyond it."""
    evictions: int = 0
    """Rows folded into ``other`` so far (one signature may count more than once)."""
    profiling_runs: ProfilingRuns = _NO_RUNS
    """What the engine's start-up profiling runs reported of this encoder."""

    @property
    def total(self) -> CallCounts:
        """Every call of the adapter: the tracked rows plus ``other``, exactly."""
        return _sum(row.total for row in (*self.keys, self.other))

    def in_phase(self, phase: Phase) -> CallCounts:
        """Every call of the adapter in ``phase``."""
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
        """Return the row of ``signature``, or None when it is not tracked."""
        for row in self.keys:
            if row.signature == signature:
                return row
        return None

    def top_missed(self, count: int = 5) -> tuple[KeyCoverage, ...]:
        """Return up to ``count`` rows with the most misses (``other`` included), most first."""
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
        profiling run was observed, so a run that called no encoder shows too.
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


# -- the fold --------------------------------------------------------------------------------


class _Counts:
    """Mutable counts of one row in one phase."""

    __slots__ = (
        "captures",
        "eager_dn",
        "eager_ds",
        "eager_n",
        "eager_s",
        "hits",
        "misses",
        "replay_dn",
        "replay_ds",
        "replay_s",
    )

    def __init__(self) -> None:
        self.hits = 0
        self.misses = dict.fromkeys(_REASONS, 0)
        self.captures = 0
        # Every hit is a replay with its host time: the hits count the replay times.
        self.eager_n = self.eager_dn = self.replay_dn = 0
        self.eager_s = self.replay_s = self.eager_ds = self.replay_ds = 0.0

    def add(self, other: _Counts) -> None:
        self.hits += other.hits
        for reason, count in other.misses.items():
            self.misses[reason] += count
        self.captures += other.captures
        self.eager_n += other.eager_n
        self.eager_s += other.eager_s
        self.replay_s += other.replay_s
        self.eager_dn += other.eager_dn
        self.eager_ds += other.eager_ds
        self.replay_dn += other.replay_dn
        self.replay_ds += other.replay_ds

    def freeze(self) -> CallCounts:
        return CallCounts(
            self.hits,
            tuple(self.misses[reason] for reason in _REASONS),
            self.captures,
            Timing(self.eager_n, self.eager_s),
            Timing(self.hits, self.replay_s),
            Timing(self.eager_dn, self.eager_ds),
            Timing(self.replay_dn, self.replay_ds),
        )


class _Row:
    """Mutable coverage of one signature (or the other bucket)."""

    __slots__ = (
        "calls",
        "capture_bytes",
        "capture_phase",
        "captured",
        "phases",
        "serving",
        "signature",
    )

    def __init__(self, signature: Signature | None) -> None:
        self.signature = signature
        # The serving counts have a slot of their own: a hit then costs no enum hash.
        self.serving = _Counts()
        self.phases: dict[Phase, _Counts] = {_SERVING: self.serving}
        self.calls = 0
        self.captured = False
        self.capture_bytes = 0
        self.capture_phase: Phase | None = None

    def counts(self, phase: Phase) -> _Counts:
        if phase is _SERVING:
            return self.serving
        counts = self.phases.get(phase)
        if counts is None:
            counts = self.phases[phase] = _Counts()
        return counts

    def freeze(self) -> KeyCoverage:
        phases = self.phases
        return KeyCoverage(
            self.signature,
            tuple(phases[p].freeze() if p in phases else _NO_CALLS for p in _PHASES),
            self.captured,
            self.capture_bytes,
            self.capture_phase,
        )


class _Table:
    """One adapter's rows, bounded, and its other bucket."""

    __slots__ = ("evictions", "limit", "other", "profiling_runs", "rows", "tally")

    def __init__(self, limit: int, tally: Any = None) -> None:
        self.limit = limit
        self.tally = tally
        """The adapter's stats accumulator, when the fold also keeps the stats."""
        self.rows: dict[Signature, _Row] = {}
        self.other = _Row(None)
        self.evictions = 0
        self.profiling_runs = _NO_RUNS

    def _evict(self) -> bool:
        """Fold the uncaptured row with the fewest calls (the earliest tracked among equals)
        into other; False if every row is captured."""
        victim: _Row | None = None
        for row in self.rows.values():
            if not row.captured and (victim is None or row.calls < victim.calls):
                victim = row
        if victim is None:
            return False
        other = self.other
        for phase, counts in victim.phases.items():
            other.counts(phase).add(counts)
        other.calls += victim.calls
        del self.rows[victim.signature]  # type: ignore[arg-type]
        self.evictions += 1
        return True

    def call_row(self, signature: Signature) -> _Row:
        """The row a call of an untracked ``signature`` counts in: a new one, or other."""
        if len(self.rows) >= self.limit and not self._evict():
            return self.other
        row = self.rows[signature] = _Row(signature)
        return row

    def capture_row(self, signature: Signature) -> _Row:
        """The row of a captured ``signature``: a capture always gets one."""
        row = self.rows.get(signature)
        if row is None:
            if len(self.rows) >= self.limit:
                self._evict()
            row = self.rows[signature] = _Row(signature)
        return row

    def freeze(self, adapter: str) -> AdapterCoverage:
        rows = sorted(self.rows.values(), key=lambda row: -row.calls)
        return AdapterCoverage(
            adapter,
            tuple(row.freeze() for row in rows),
            self.other.freeze(),
            self.limit,
            self.evictions,
            self.profiling_runs,
        )


class CoverageFold:
    """Fold events into per-adapter, per-signature coverage; ``fold(event)`` is the update.

    Not thread-safe on its own: the bus calls it under its lock.

    Args:
        limit: signatures tracked per adapter (captured ones beyond it keep their rows).
        stats: also apply every event to this stats fold. The bus keeps both folds this
            way: a hit then costs one fold call and one adapter lookup, not two.

    Raises:
        ConfigError: ``limit`` is not an integer from 1 to :data:`MAX_COVERAGE_KEYS`.
    """

    __slots__ = ("_limit", "_stats", "_tables")

    def __init__(
        self, limit: int = DEFAULT_COVERAGE_KEYS, *, stats: StatsFold | None = None
    ) -> None:
        self._limit = check_int(
            "coverage_keys",
            limit,
            minimum=1,
            maximum=MAX_COVERAGE_KEYS,
            meaning=f"an integer from 1 to {MAX_COVERAGE_KEYS}",
        )
        self._stats = stats
        self._tables: dict[str, _Table] = {}

    @property
    def limit(self) -> int:
        return self._limit

    def __call__(self, event: Event) -> None:
        self.fold(event)

    def _table(self, adapter: str) -> _Table:
        stats = self._stats
        table = self._tables[adapter] = _Table(
            self._limit, None if stats is None else stats.count_hit(adapter)
        )
        return table

    def fold(self, event: Event) -> None:
        """Apply one event (and, with ``stats``, apply it to the stats too).

        Raises:
            TypeError: ``event`` is not an omnitrace event.
        """
        table = self._tables.get(event.adapter)
        if table is None:
            table = self._table(event.adapter)
        # Hits first: they are nearly every event of a serving encoder.
        if type(event) is ev.GraphReplayed:
            tally = table.tally
            if tally is not None:
                # What StatsFold.fold does for a hit, without a second call.
                tally.hits += 1
                tally.last_epoch_ns = event.epoch_ns
            row = table.rows.get(event.signature)
            if row is None:
                row = table.call_row(event.signature)
            row.calls += 1
            phase = event.phase
            counts = row.serving if phase is _SERVING else row.counts(phase)
            counts.hits += 1
            counts.replay_s += event.duration_s
            return
        if self._stats is not None:
            self._stats.fold(event)
        if isinstance(event, ev.GraphMissed):
            row = table.rows.get(event.signature)
            if row is None:
                row = table.call_row(event.signature)
            row.calls += 1
            counts = row.counts(event.phase)
            counts.misses[event.reason] += 1
            duration = event.duration_s
            if duration is not None:
                counts.eager_n += 1
                counts.eager_s += duration
        elif isinstance(event, ev.DeviceTimed):
            # A measurement of a call already counted: it never takes a row of its own.
            counts = table.rows.get(event.signature, table.other).counts(event.phase)
            # The adapter times two kinds of call, and the event log refuses any other.
            if event.kind == "replay":
                counts.replay_dn += 1
                counts.replay_ds += event.device_s
            else:
                counts.eager_dn += 1
                counts.eager_ds += event.device_s
        elif isinstance(event, ev.GraphCaptured):
            row = table.capture_row(event.signature)
            row.captured = True
            row.capture_bytes += event.bytes_reserved + event.static_bytes
            row.capture_phase = event.phase
            row.counts(event.phase).captures += 1
        elif isinstance(event, ev.ProfilingObserved):
            # A fact about a start-up run, not a call: it takes no row. Runs are rare (one
            # or two per worker), so a frozen counter is rebuilt per run.
            runs = table.profiling_runs
            table.profiling_runs = ProfilingRuns(
                runs.runs + 1,
                runs.encoder_calls + event.encoder_calls,
                runs.without_calls + (event.encoder_calls == 0),
                event.runner,
            )
        elif not isinstance(event, (ev.MemoryDeferred, ev.CaptureFailed)):
            raise TypeError(f"not an omnitrace event: {type(event).__name__}")

    def extend(self, events: Iterable[Event]) -> None:
        """Apply events in order."""
        for event in events:
            self.fold(event)

    def adapters(self) -> tuple[str, ...]:
        """Names of the adapters seen so far, in first-seen order."""
        return tuple(self._tables)

    def snapshot(self, adapter: str) -> AdapterCoverage:
        """Return the frozen coverage of ``adapter`` (empty if it has emitted nothing)."""
        table = self._tables.get(adapter)
        return (table or _Table(self._limit)).freeze(adapter)

    def snapshots(self) -> dict[str, AdapterCoverage]:
        """Return the frozen coverage of every adapter seen."""
        return {name: table.freeze(name) for name, table in self._tables.items()}


def derive_coverage(
    events: Iterable[Event], *, limit: int = DEFAULT_COVERAGE_KEYS
) -> dict[str, AdapterCoverage]:
    """Fold ``events`` and return ``{adapter name: AdapterCoverage}``.

    Equals what a bus with the same ``coverage_keys`` shows in ``EventBus.coverage()``
    after emitting the same events.

    Raises:
        ConfigError: ``limit`` is out of range.
    """
    fold = CoverageFold(limit)
    fold.extend(events)
    return fold.snapshots()
