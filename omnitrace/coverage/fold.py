"""Per-signature coverage as a pure fold over the events: per adapter and input signature,
its calls, hits, misses, capture and time, in a table of bounded size (docs/architecture.md,
"Coverage")."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from omnitrace import events as ev
from omnitrace._validate import check_int
from omnitrace.coverage.snapshot import (
    NO_CALLS,
    NO_RUNS,
    PHASES,
    REASONS,
    AdapterCoverage,
    CallCounts,
    KeyCoverage,
    ProfilingRuns,
    Timing,
)
from omnitrace.events import Event, MissReason, Phase
from omnitrace.misses import MissCause, merge
from omnitrace.signature import Signature
from omnitrace.stats import StatsFold

__all__ = ["DEFAULT_COVERAGE_KEYS", "MAX_COVERAGE_KEYS", "CoverageFold", "derive_coverage"]

#: Signatures tracked per adapter unless told otherwise.
DEFAULT_COVERAGE_KEYS = 32
#: Most signatures a table may track: every fold update may scan the table once.
MAX_COVERAGE_KEYS = 4096

_SERVING = Phase.SERVING


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
        self.misses = dict.fromkeys(REASONS, 0)
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
            tuple(self.misses[reason] for reason in REASONS),
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
            tuple(phases[p].freeze() if p in phases else NO_CALLS for p in PHASES),
            self.captured,
            self.capture_bytes,
            self.capture_phase,
        )


class _Table:
    """One adapter's rows, bounded, and its other bucket."""

    __slots__ = ("details", "evictions", "limit", "other", "profiling_runs", "rows", "tally")

    def __init__(self, limit: int, tally: Any = None) -> None:
        self.limit = limit
        self.tally = tally
        """The adapter's stats accumulator, when the fold also keeps the stats."""
        self.rows: dict[Signature, _Row] = {}
        self.other = _Row(None)
        self.evictions = 0
        self.profiling_runs = NO_RUNS
        # Misses by (reason, detail), kept whole: details are few (the adapters' own words).
        self.details: dict[tuple[MissReason, str], int] = {}

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
            merge([[MissCause(r, d, n) for (r, d), n in self.details.items()]]),
        )


class CoverageFold:
    """Fold events into per-adapter, per-signature coverage; ``fold(event)`` is the update.

    Not thread-safe on its own: the bus calls it under its lock.

    Args:
        limit: signatures tracked per adapter (captured ones beyond it keep their rows);
            default :data:`DEFAULT_COVERAGE_KEYS` (32).
        stats: also apply every event to this stats fold; default None (none). The bus
            keeps both folds this way: a hit then costs one fold call and one adapter
            lookup, not two.

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
        """Signatures tracked per adapter."""
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

        Args:
            event: the event; request events (empty adapter) open no adapter's table.

        Raises:
            TypeError: ``event`` is not an omnitrace event.
        """
        table = self._tables.get(event.adapter)
        if table is None:
            if type(event) in ev.REQUEST_EVENT_TYPES:
                # About requests, not an adapter (their adapter is empty): no table.
                return
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
            detail = (event.reason, event.detail)
            table.details[detail] = table.details.get(detail, 0) + 1
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
        elif not isinstance(event, (ev.MemoryDeferred, ev.CaptureFailed, *ev.REQUEST_EVENT_TYPES)):
            raise TypeError(f"not an omnitrace event: {type(event).__name__}")

    def extend(self, events: Iterable[Event]) -> None:
        """Apply events in order.

        Args:
            events: the events, each applied as :meth:`fold` does.

        Raises:
            TypeError: one of them is not an omnitrace event.
        """
        for event in events:
            self.fold(event)

    def adapters(self) -> tuple[str, ...]:
        """Names of the adapters seen so far, in first-seen order."""
        return tuple(self._tables)

    def snapshot(self, adapter: str) -> AdapterCoverage:
        """Return the frozen coverage of ``adapter`` (empty if it has emitted nothing).

        Args:
            adapter: the adapter's name.
        """
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

    Args:
        events: the events, in order.
        limit: signatures tracked per adapter; default :data:`DEFAULT_COVERAGE_KEYS` (32).

    Raises:
        TypeError: one of them is not an omnitrace event.
        ConfigError: ``limit`` is out of range.
    """
    fold = CoverageFold(limit)
    fold.extend(events)
    return fold.snapshots()
