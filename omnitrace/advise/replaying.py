"""What-if replay of recorded traffic through admission: one setting call by call (the
reference), or a whole grid at once from what its settings share (docs/architecture.md,
"advise")."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import numpy as np
import numpy.typing as npt

from omnitrace.advise.recording import (
    ELIGIBLE,
    PROFILING,
    CallSequence,
    KeyCost,
    Recording,
    Setting,
    Worker,
    first_seen,
)
from omnitrace.config import EncoderGraphConfig, needed_free_bytes
from omnitrace.events import MissReason
from omnitrace.graphs.admission import Admission, Verdict
from omnitrace.signature import Signature
from omnitrace.stats import HitRate

__all__ = ["EncoderOutcome", "Result", "replay", "replay_grid"]


@dataclass(frozen=True, slots=True)
class EncoderOutcome(HitRate):
    """One encoder's calls under one setting (all workers together).

    Args:
        adapter: the encoder's name.
        calls, hits, captures: its calls, those a graph served, and its graphs captured.
        misses: its misses by reason.
        pool_bytes, saved_s, estimated_sizes: as on the attributes below.
    """

    adapter: str
    calls: int
    hits: int
    captures: int
    misses: Mapping[MissReason, int]
    pool_bytes: int
    """Sizes of the graphs captured, summed over workers."""
    saved_s: float | None
    """Time the hits saved over eager runs; None when some key's saving is unknown."""
    estimated_sizes: int
    """Graphs captured whose size is an estimate."""


@dataclass(frozen=True, slots=True)
class Result(HitRate):
    """What one setting would have done with the recorded traffic.

    Args:
        setting: the setting replayed.
        encoders: each encoder's outcome.
        pool_bytes: the most graph memory any one worker's device would hold.
        min_free_bytes: the least device-free memory left after a capture; default None
            (unknown).
        captured: per encoder, the keys captured on any worker; default an empty dict.
    """

    setting: Setting
    encoders: tuple[EncoderOutcome, ...]
    pool_bytes: int
    """The most graph memory any one worker's device would hold."""
    min_free_bytes: int | None = None
    """The least device-free memory left after a capture, on any worker's device (None:
    free memory unknown); below zero the device would have run out of memory."""
    captured: Mapping[str, frozenset[Signature]] = field(default_factory=dict, compare=False)
    """Per encoder, the keys this setting captured on any worker (filled by :func:`replay`;
    the grid's vectorised replay leaves it empty; not compared)."""

    @property
    def exhausts_memory(self) -> bool:
        """Whether a capture would not have fit in the device-free memory."""
        return self.min_free_bytes is not None and self.min_free_bytes < 0

    @property
    def calls(self) -> int:
        """Calls of every encoder."""
        return sum(e.calls for e in self.encoders)

    @property
    def hits(self) -> int:
        """Calls a graph would have served, every encoder."""
        return sum(e.hits for e in self.encoders)

    @property
    def graphs(self) -> int:
        """Graphs captured, all encoders and workers."""
        return sum(e.captures for e in self.encoders)

    @property
    def saved_s(self) -> float | None:
        """Time the hits would have saved; None when some encoder's is unknown."""
        saved = [e.saved_s for e in self.encoders]
        return None if any(s is None for s in saved) else sum(s or 0.0 for s in saved)

    @property
    def estimated_sizes(self) -> int:
        """Graphs captured whose size is an estimate, every encoder."""
        return sum(e.estimated_sizes for e in self.encoders)


class _EncoderState:
    __slots__ = ("admission", "captured", "hits", "misses")

    def __init__(self, config: EncoderGraphConfig) -> None:
        self.admission = Admission(config)
        self.captured: dict[Signature, int] = {}
        """Per captured key: its hits (the capturing call included)."""
        self.hits = 0
        self.misses = dict.fromkeys(MissReason, 0)


_VERDICT_REASON = {
    Verdict.CAPACITY: MissReason.CAPACITY,
    Verdict.WARMUP: MissReason.WARMUP,
    Verdict.MEMORY: MissReason.MEMORY,
}


def replay(recording: Recording, setting: Setting) -> Result:
    """Replay the recorded calls under ``setting`` and return what it would have done.

    The reference replay, one call at a time; :func:`replay_grid` gives the same results
    (``captured`` aside) faster.

    Args:
        recording: the traffic.
        setting: the setting to replay it with.

    Raises:
        ConfigError: ``setting`` is out of the range the config accepts.
    """
    config = setting.config()
    floor = setting.min_free_bytes
    reuse = config.share_pools and not config.compile
    per_adapter: dict[str, list[_EncoderState]] = {}
    worker_bytes: list[int] = []
    lowest: int | None = None
    # Admission reads free memory through a callable, only when a capture is due.
    free_now = floor

    def read_free() -> int:
        return free_now

    for worker, calls in recording.calls.items():
        states: dict[str, _EncoderState] = {}
        used: dict[str | None, int] = {}
        for index, call in enumerate(calls):
            state = states.get(call.adapter)
            if state is None:
                state = states[call.adapter] = _EncoderState(config)
            if not call.eligible or (call.profiling and setting.skip_profiling):
                state.misses[MissReason.INELIGIBLE] += 1
                continue
            captured = state.captured
            if call.key in captured:
                captured[call.key] += 1
                state.hits += 1
                continue
            start = recording.free_at(worker, call.device or "", index)
            # Unknown free memory never bites: the floor itself is what admission reads.
            free_now = floor if start is None else start - used.get(call.device, 0)
            decision = state.admission.decide(
                call.key, read_free, reused=partial(_covered, captured, call.key) if reuse else None
            )
            verdict = decision.verdict
            if verdict is Verdict.CAPTURE:
                state.admission.captured(call.key)
                captured[call.key] = 1
                state.hits += 1
                size = recording.costs[call.adapter][call.key].capture_bytes
                state.admission.took(size)
                used[call.device] = used.get(call.device, 0) + size
                if start is not None:
                    left = start - used[call.device]
                    lowest = left if lowest is None else min(lowest, left)
            else:
                state.misses[_VERDICT_REASON[verdict]] += 1
                # The call ran eagerly, and such a call reports what it took: the need the
                # log read for this key, where free memory is known to check it against.
                need = recording.needs.get(call.adapter, {}).get(call.key)
                if verdict is not Verdict.CAPACITY and need is not None and start is not None:
                    state.admission.took_eagerly(call.key, need)
        worker_bytes.append(sum(used.values()) if used else 0)
        for name, state in states.items():
            per_adapter.setdefault(name, []).append(state)
    encoders = tuple(
        _outcome(name, states, recording.costs.get(name, {}), recording.time_known)
        for name, states in per_adapter.items()
    )
    keys = {
        name: frozenset(key for state in states for key in state.captured)
        for name, states in per_adapter.items()
    }
    return Result(setting, encoders, max(worker_bytes, default=0), lowest, keys)


def _covered(captured: Iterable[Signature], key: Signature) -> bool:
    """Whether a captured key's inputs are at least as large as ``key``'s in every
    dimension (``Capturer.pool_holds_larger``: the need does not defer its capture)."""
    return any(held.covers(key) for held in captured)


def _outcome(
    adapter: str,
    states: Sequence[_EncoderState],
    costs: Mapping[Signature, KeyCost],
    time_known: bool,
) -> EncoderOutcome:
    misses = dict.fromkeys(MissReason, 0)
    hits = captures = pool = estimated = 0
    saved: float | None = 0.0
    for state in states:
        hits += state.hits
        for reason, count in state.misses.items():
            misses[reason] += count
        for key, key_hits in state.captured.items():
            cost = costs[key]
            captures += 1
            pool += cost.capture_bytes
            estimated += cost.estimated_bytes
            saving = cost.saving_s
            if saved is not None:
                # The capturing call ran the warm-up and the capture: it saved nothing.
                saved = None if saving is None else saved + (key_hits - 1) * saving
    return EncoderOutcome(
        adapter=adapter,
        calls=hits + sum(misses.values()),
        hits=hits,
        captures=captures,
        misses=misses,
        pool_bytes=pool,
        saved_s=saved if time_known else None,
        estimated_sizes=estimated,
    )


# -- the grid ---------------------------------------------------------------------------------


def replay_grid(
    recording: Recording,
    grid: Sequence[Setting],
    *,
    progress: Callable[[int], None] | None = None,
) -> list[Result]:
    """Return ``[replay(recording, s) for s in grid]``, sharing the work between settings.

    Args:
        recording: the traffic.
        grid: the settings, in the order of the results.
        progress: called with 1 as each setting is done; default None.

    Returns:
        One result per setting, its ``captured`` left empty.

    Raises:
        ConfigError: a setting is out of the range the config accepts.
    """
    time_known = recording.time_known
    # History counts past the highest min_capture_calls all decide alike: kept as one.
    cap = max((setting.min_capture_calls for setting in grid), default=1)
    workers = [
        _WorkerReplay(recording, worker, seq, cap) for worker, seq in recording.sequences.items()
    ]
    results = []
    for setting in grid:
        runs = [worker.run(setting) for worker in workers]
        per_adapter: dict[str, list[_EncoderState]] = {}
        lowest: int | None = None
        for run in runs:
            for name, state in run.states.items():
                per_adapter.setdefault(name, []).append(state)
            if run.lowest is not None:
                lowest = run.lowest if lowest is None else min(lowest, run.lowest)
        encoders = tuple(
            _outcome(name, states, recording.costs.get(name, {}), time_known)
            for name, states in per_adapter.items()
        )
        pool = max((run.pool_bytes for run in runs), default=0)
        results.append(Result(setting, encoders, pool, lowest))
        if progress is not None:
            progress(1)
    return results


@dataclass(frozen=True, slots=True)
class _Run:
    """One worker's replay under one setting."""

    states: Mapping[str, _EncoderState]
    """Per adapter, in the order of the worker's first call of it."""
    pool_bytes: int
    lowest: int | None
    floor_reached: int | None = None
    """The least device-free memory before any capture with known free memory (None: no
    such capture): a floor up to it decides as floor 0 does."""


class _Calls:
    """The calls of one worker that reach admission, with or without the profiling ones."""

    def __init__(self, sequence: CallSequence, skip_profiling: bool) -> None:
        flags = sequence.flags
        eligible = (flags & ELIGIBLE) != 0
        if skip_profiling:
            eligible &= (flags & PROFILING) == 0
        self.ids: npt.NDArray[np.int32] = sequence.ids[eligible]
        self.where = np.flatnonzero(eligible)
        """Each admission call's place among the worker's calls."""
        size = len(sequence.keys)
        self.per_key = np.bincount(self.ids, minlength=size)
        self.ineligible = np.bincount(sequence.ids[~eligible], minlength=size)
        # Each key's calls before every stride-th call: a few million counts at most,
        # however long the log and however many keys.
        self.stride = max(4096, -(-len(self.ids) * size // _RANK_COUNTS))
        starts = range(0, len(self.ids), self.stride)
        self.before = np.zeros((len(starts) + 1, size), dtype=np.int64)
        for row, begin in enumerate(starts, start=1):
            block = self.ids[begin : begin + self.stride]
            self.before[row] = self.before[row - 1] + np.bincount(block, minlength=size)

    def rank(self, key_id: int, position: int) -> int:
        """How many of ``key_id``'s admission calls come before ``position``."""
        row, start = divmod(position, self.stride)
        begin = position - start
        earlier = np.count_nonzero(self.ids[begin:position] == key_id)
        return int(self.before[row, key_id]) + int(earlier)


class _WorkerReplay:
    """Replays of one worker's calls, remembering what settings share."""

    def __init__(
        self, recording: Recording, worker: Worker, sequence: CallSequence, cap: int
    ) -> None:
        self.worker = worker
        self.cap = cap
        self.sequence = sequence
        keys = sequence.keys
        # Adapters in the order of their first call (every call, eligible or not).
        adapters: dict[str, None] = {}
        for key_id in first_seen(sequence.ids):
            adapters.setdefault(keys[key_id][0])
        self.adapters = list(adapters)
        index = {name: i for i, name in enumerate(self.adapters)}
        self.adapter_of = [index[adapter] for adapter, _, _ in keys]
        self.device_of = [device for _, _, device in keys]
        self.start_of = [
            recording.free_bytes.get((worker, device or "")) for device in self.device_of
        ]
        # Where the estimate of free memory moved over the run: per device, its steps.
        self.changes = {
            device: recording.free_changes[(worker, device or "")]
            for device in set(self.device_of)
            if (worker, device or "") in recording.free_changes
        }
        # The most any call's start rises over the first: what _frozen must clear.
        self.peak_of = [
            max((delta for _, delta in self.changes.get(device, ())), default=0)
            for device in self.device_of
        ]
        self._shifts: dict[bool, dict[str | None, npt.NDArray[np.int64]]] = {}
        costs = recording.costs
        self.size_of = [
            costs[adapter][key].capture_bytes if key in costs.get(adapter, {}) else 0
            for adapter, key, _ in keys
        ]
        # The need the log read for a key, where free memory is known to check it against.
        needs = recording.needs
        self.need_of = [
            needs.get(adapter, {}).get(key) if start is not None else None
            for (adapter, key, _), start in zip(keys, self.start_of, strict=True)
        ]
        self.keys_of: list[list[int]] = [[] for _ in self.adapters]
        for key_id, adapter in enumerate(self.adapter_of):
            self.keys_of[adapter].append(key_id)
        self._calls: dict[bool, _Calls] = {}
        self._runs: dict[tuple[Any, ...], _Run] = {}
        self._counts: dict[tuple[bool, int], list[npt.NDArray[np.int64]]] = {}

    def calls(self, skip_profiling: bool) -> _Calls:
        calls = self._calls.get(skip_profiling)
        if calls is None:
            calls = self._calls[skip_profiling] = _Calls(self.sequence, skip_profiling)
        return calls

    def shifts(self, skip_profiling: bool) -> dict[str | None, npt.NDArray[np.int64]]:
        """Per device with changes: each admission call's change of free memory over the
        start (:attr:`Recording.free_changes`), by its place among the admission calls (an
        array, 8 bytes a call: read only where a capture is decided)."""
        shifts = self._shifts.get(skip_profiling)
        if shifts is None:
            where = self.calls(skip_profiling).where
            shifts = self._shifts[skip_profiling] = {}
            for device, steps in self.changes.items():
                at = np.array([call for call, _ in steps], dtype=np.int64)
                delta = np.array([0, *(d for _, d in steps)], dtype=np.int64)
                shifts[device] = delta[np.searchsorted(at, where, side="right")]
        return shifts

    def run(self, setting: Setting) -> _Run:
        g, c, floor, skip, budget = (
            setting.max_graphs,
            setting.min_capture_calls,
            setting.min_free_bytes,
            setting.skip_profiling,
            setting.pool_budget_bytes,
        )
        if g == 0 or floor == 0:
            return self._memo((g, c, 0, skip, budget))
        zero = self._memo((g, c, 0, skip, budget))
        if zero.floor_reached is None or floor <= zero.floor_reached:
            return zero  # no capture of floor 0's run came near this floor
        if self._frozen(floor, skip):
            # No capture: neither the count nor the budget decides anything.
            key = (g, c, "frozen", skip)
            run = self._runs.get(key)
            if run is None:
                run = self._runs[key] = self._without_captures(g, c, skip)
            return run
        return self._memo((g, c, floor, skip, budget))

    def _memo(self, key: tuple[int, int, int, bool, int]) -> _Run:
        run = self._runs.get(key)
        if run is None:
            run = self._runs[key] = self._simulate(*key)
        return run

    def _frozen(self, floor: int, skip: bool) -> bool:
        """Whether every admission call's device starts under ``floor``: no capture, ever."""
        calls = self.calls(skip)
        used = np.flatnonzero(calls.per_key)
        return all(
            (start := self.start_of[key_id]) is not None and start + self.peak_of[key_id] < floor
            for key_id in used.tolist()
        )

    def _states(self, config: EncoderGraphConfig, calls: _Calls) -> dict[str, _EncoderState]:
        states = {name: _EncoderState(config) for name in self.adapters}
        ineligible = calls.ineligible
        for adapter, name in enumerate(self.adapters):
            states[name].misses[MissReason.INELIGIBLE] = int(
                sum(ineligible[k] for k in self.keys_of[adapter])
            )
        return states

    def _simulate(self, g: int, c: int, floor: int, skip: bool, budget: int) -> _Run:
        """Replay the calls that decide something; count the others."""
        config = Setting(g, c, floor, skip, budget).config()
        calls = self.calls(skip)
        states = self._states(config, calls)
        names = self.adapters
        adapter_of, start_of, device_of = self.adapter_of, self.start_of, self.device_of
        size_of = self.size_of
        active = np.ones(len(adapter_of), dtype=bool)
        if g == 0:
            active[:] = False  # every encoder is full from the start
        live = active.tolist()
        # Admission's own bookkeeping (graphs/admission.py), inlined: this loop is the
        # replay's whole cost, and replay() (which calls Admission) is its reference.
        histories: list[OrderedDict[int, int]] = [OrderedDict() for _ in names]
        # With a budget, a key's earlier eager calls reported its need: min_capture_calls
        # is at least 2, so a key due for capture always had one since it was remembered.
        need_of = self.need_of if budget > 0 else None
        graphs = [0] * len(names)
        limit = config.history_size
        captured: list[list[tuple[int, int]]] = [[] for _ in names]
        warm = [0] * len(names)
        memory = [0] * len(names)
        spent = [0] * len(names)  # bytes each encoder's graphs took, against ``budget``
        used: dict[str | None, int] = {}
        lowest: int | None = None
        reached: int | None = None
        every = calls.ids
        shifts = self.shifts(skip)
        for begin in range(0, len(every), _BLOCK):
            # The calls of this block whose key is neither captured nor full, as of its
            # start: a key captured within the block is skipped by ``live``.
            block = every[begin : begin + _BLOCK]
            chosen = np.flatnonzero(active[block])
            for position, key_id in zip(
                (chosen + begin).tolist(), block[chosen].tolist(), strict=True
            ):
                if not live[key_id]:
                    continue
                adapter = adapter_of[key_id]
                history = histories[adapter]
                count = history.pop(key_id, 0) + 1
                history[key_id] = count
                if len(history) > limit:
                    history.popitem(last=False)
                if count < c:
                    warm[adapter] += 1
                    continue
                start = start_of[key_id]
                device = device_of[key_id]
                if start is not None and device in shifts:
                    start += int(shifts[device][position])
                # Unknown free memory never bites: admission reads the floor itself.
                free_now = floor if start is None else start - used.get(device, 0)
                if (floor > 0 and free_now < floor) or (
                    need_of is not None
                    and self._need_defers(need_of[key_id], key_id, free_now, captured[adapter])
                ):
                    memory[adapter] += 1
                    continue
                history.pop(key_id, None)
                graphs[adapter] += 1
                captured[adapter].append((key_id, position))
                live[key_id] = False
                active[key_id] = False
                used[device] = used.get(device, 0) + size_of[key_id]
                spent[adapter] += size_of[key_id]
                if start is not None:
                    reached = free_now if reached is None else min(reached, free_now)
                    left_bytes = start - used[device]
                    lowest = left_bytes if lowest is None else min(lowest, left_bytes)
                if graphs[adapter] >= g or (budget > 0 and spent[adapter] >= budget):
                    for other in self.keys_of[adapter]:
                        live[other] = False
                        active[other] = False
        self._count_outcomes(states, calls, captured, warm, memory)
        pool = sum(used.values()) if used else 0
        return _Run(states, pool, lowest, reached)

    def _need_defers(
        self,
        need: int | None,
        key_id: int,
        free_now: int,
        captured: Sequence[tuple[int, int]],
    ) -> bool:
        """Admission's need check: whether ``key_id``'s need (with an eighth to spare) is
        more than ``free_now``, and no captured key of its encoder, whose pool its capture
        would reuse, is at least as large."""
        if need is None or needed_free_bytes(need) <= free_now:
            return False
        keys = self.sequence.keys
        return not _covered((keys[held][1] for held, _ in captured), keys[key_id][1])

    def _count_outcomes(
        self,
        states: dict[str, _EncoderState],
        calls: _Calls,
        captured: list[list[tuple[int, int]]],
        warm: list[int],
        memory: list[int],
    ) -> None:
        """Count each encoder's hits (the calls of its keys from their capture on), its
        warm-up and memory misses, and the rest as capacity misses, into ``states``."""
        keys = self.sequence.keys
        for adapter, name in enumerate(self.adapters):
            state = states[name]
            hits = 0
            for key_id, position in captured[adapter]:
                key_hits = int(calls.per_key[key_id]) - calls.rank(key_id, position)
                state.captured[keys[key_id][1]] = key_hits
                hits += key_hits
            total = int(sum(calls.per_key[k] for k in self.keys_of[adapter]))
            state.hits = hits
            state.misses[MissReason.WARMUP] = warm[adapter]
            state.misses[MissReason.MEMORY] = memory[adapter]
            state.misses[MissReason.CAPACITY] = total - hits - warm[adapter] - memory[adapter]

    def _without_captures(self, g: int, c: int, skip: bool) -> _Run:
        """Every capture deferred: each call is a warm-up below ``c`` calls in the history,
        else a memory deferral."""
        config = Setting(g, c, 0, skip).config()
        calls = self.calls(skip)
        states = self._states(config, calls)
        counts = self._history_counts(skip, config.history_size)
        for adapter, name in enumerate(self.adapters):
            state = states[name]
            # counts[adapter][n]: calls that were the n-th of their key in the history.
            warm = int(counts[adapter][:c].sum())
            state.misses[MissReason.WARMUP] = warm
            state.misses[MissReason.MEMORY] = int(counts[adapter].sum()) - warm
        return _Run(states, 0, None, None)

    def _history_counts(self, skip: bool, limit: int) -> list[npt.NDArray[np.int64]]:
        """Per adapter, how many admission calls had each count in a history of ``limit``
        keys, with nothing ever captured (shared by every ``min_capture_calls``)."""
        found = self._counts.get((skip, limit))
        if found is not None:
            return found
        calls = self.calls(skip)
        adapter_of = np.asarray(self.adapter_of, dtype=np.int32)
        out = [
            _count_histogram(calls.ids, adapter_of, adapter, limit, self.cap)
            for adapter in range(len(self.adapters))
        ]
        self._counts[(skip, limit)] = out
        return out


#: Counts kept for :meth:`_Calls.rank` (per key, at every stride-th call).
_RANK_COUNTS = 1 << 19

#: Calls whose keys are listed at once by the replay (a key captured within a block is
#: skipped one by one; past a block, no captured key's calls are visited).
_BLOCK = 4096


def _count_histogram(
    every: npt.NDArray[np.int32],
    adapter_of: npt.NDArray[np.int32],
    adapter: int,
    limit: int,
    cap: int,
) -> npt.NDArray[np.int64]:
    """How many of ``adapter``'s calls were the n-th of their key in a least-recently-called
    history of ``limit`` keys (index n; the last index counts every count from ``cap`` on),
    taken a block of calls at a time."""
    histogram = np.zeros(1, dtype=np.int64)
    mine = adapter_of == adapter
    calls = np.bincount(every, minlength=len(adapter_of))
    if not calls[mine].any():
        return histogram
    evicts = np.count_nonzero(calls[mine]) > limit
    seen = np.zeros(len(adapter_of), dtype=np.int64)
    history: OrderedDict[int, int] = OrderedDict()
    held = [0]
    for begin in range(0, len(every), _COUNT_BLOCK):
        block = every[begin : begin + _COUNT_BLOCK]
        block = block[mine[block]]
        if not len(block):
            continue
        counts = _lru_counts(block, limit, history, held) if evicts else _ranks(block, seen)
        found = np.bincount(np.minimum(counts, cap))
        if len(found) > len(histogram):
            histogram = np.concatenate((histogram, np.zeros(len(found) - len(histogram), np.int64)))
        histogram[: len(found)] += found
    return histogram


#: Calls whose history counts are taken at once (bounds the memory to a block's).
_COUNT_BLOCK = 1 << 16


def _ranks(block: npt.NDArray[np.int32], seen: npt.NDArray[np.int64]) -> npt.NDArray[np.int64]:
    """Nothing is ever pushed out of the history: a call's count is its rank among its
    key's calls (``seen``: each key's calls before the block, updated)."""
    order = np.argsort(block, kind="stable")
    ranked = block[order]
    starts = np.flatnonzero(np.r_[True, ranked[1:] != ranked[:-1]])
    group = np.repeat(starts, np.diff(np.r_[starts, len(ranked)]))
    counts = np.empty(len(block), dtype=np.int64)
    counts[order] = np.arange(len(block)) - group + 1 + seen[ranked]
    seen += np.bincount(block, minlength=len(seen))
    return counts


def _lru_counts(
    block: npt.NDArray[np.int32], limit: int, history: OrderedDict[int, int], held: list[int]
) -> npt.NDArray[np.int64]:
    """Admission's history, one call at a time (``history`` and ``held`` carry over)."""
    out: list[int] = []
    pop, oldest, append = history.pop, history.popitem, out.append
    size = held[0]
    for key_id in block.tolist():
        count = pop(key_id, 0) + 1
        history[key_id] = count
        if count == 1:
            size += 1
            if size > limit:
                oldest(last=False)
                size -= 1
        append(count)
    held[0] = size
    return np.asarray(out, dtype=np.int64)
