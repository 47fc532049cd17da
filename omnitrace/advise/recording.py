"""Recorded encoder traffic for ``omnitrace advise``: each worker's calls as compact arrays, and
each key's costs summed exactly as a list of every value would sum them."""

from __future__ import annotations

import bisect
import math
from array import array
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt

from omnitrace import events as ev
from omnitrace._validate import INT64_MAX
from omnitrace.config import HF_OVERRIDE_KEYS, EncoderGraphConfig
from omnitrace.eventlog import AdapterInfo, EventRecord
from omnitrace.events import MissReason, Phase
from omnitrace.signature import Signature

__all__ = ["CallSequence", "KeyCost", "Recording", "Setting", "Worker"]

Worker = tuple[int, int]
"""``(rank, pid)`` of the process that wrote a log line."""

_Inputs = tuple[Any, ...]
"""A signature's inputs (:attr:`Signature.inputs`): what an eager time is kept by."""

_KEYS = {name: key for key, name in HF_OVERRIDE_KEYS.items()}

#: Flags of a call in :attr:`CallSequence.flags`.
ELIGIBLE = 1
"""Could reach admission (under settings that do not skip profiling)."""
PROFILING = 2
"""Ran in the profiling phase (a call kept out of admission as profiling too)."""


@dataclass(frozen=True, slots=True)
class Setting:
    """One point of the grid: the admission settings every encoder runs with.

    Each field is the :class:`~omnitrace.config.EncoderGraphConfig` option of the same name
    (documented there, set by its ``encoder_cuda_graph_*`` key); the other options keep
    their defaults.

    Args:
        max_graphs: graphs each encoder may keep.
        min_capture_calls: calls of a key before it is captured.
        min_free_bytes: the device-free memory floor, in bytes.
        skip_profiling: keep profiling calls out of admission; default False.
        pool_budget_bytes: each encoder's pool budget, in bytes; default 0 (none).
    """

    max_graphs: int
    min_capture_calls: int
    min_free_bytes: int
    skip_profiling: bool = False
    pool_budget_bytes: int = 0

    def config(self) -> EncoderGraphConfig:
        """Return the config this setting stands for (other fields at their defaults).

        Raises:
            ConfigError: a field is out of the range the config accepts.
        """
        return EncoderGraphConfig(**asdict(self))

    def overrides(self, *, profiling: bool = True, budget: bool = False) -> dict[str, int | bool]:
        """Return the ``--hf-overrides`` keys of this setting.

        Args:
            profiling: include ``skip_profiling`` (the grid varied it); default True.
            budget: include ``pool_budget_bytes`` even when it is 0 (the grid or the logged
                run had one, so no budget must be said); default False. A budget that is
                set is always included.

        Returns:
            A new dict from ``encoder_cuda_graph_*`` key to value.
        """
        values = asdict(self)
        if not profiling:
            del values["skip_profiling"]
        if not (budget or self.pool_budget_bytes):
            del values["pool_budget_bytes"]
        return {_KEYS[name]: value for name, value in values.items()}


@dataclass(frozen=True, slots=True)
class KeyCost:
    """What one key of one encoder costs: its call times and its capture size.

    Args:
        eager_s: mean eager time of one call; None when unknown.
        replay_s: mean replay time of one call; None when unknown.
        capture_bytes: bytes its capture takes.
        estimated_time: a time is estimated from the encoder's ratio; default False.
        estimated_bytes: ``capture_bytes`` is estimated; default False.
        first_calls_only: ``eager_s`` comes only from the first call of the key in each
            worker (one-off start-up costs included) and no other key of the encoder tells
            how much of it was one-off; default False.
    """

    eager_s: float | None
    """Mean eager time of one call (None: not measured and not estimable)."""
    replay_s: float | None
    capture_bytes: int
    estimated_time: bool = False
    """``eager_s`` or ``replay_s`` comes from the encoder's replay-to-eager ratio."""
    estimated_bytes: bool = False
    """``capture_bytes`` comes from the encoder's recorded bytes per input element."""
    first_calls_only: bool = False
    """``eager_s`` is the mean of first calls only, uncorrected: an upper bound."""

    @property
    def saving_s(self) -> float | None:
        """What a hit saves over an eager run (never below zero); None when unknown."""
        if self.eager_s is None or self.replay_s is None:
            return None
        return max(0.0, self.eager_s - self.replay_s)


@dataclass(frozen=True, slots=True)
class _Call:
    adapter: str
    key: Signature
    device: str | None
    eligible: bool
    """Could reach admission (under settings that do not skip profiling)."""
    profiling: bool


@dataclass(frozen=True, slots=True)
class CallSequence:
    """One worker's encoder calls in the order written, as arrays.

    ``keys[ids[i]]`` is call ``i``'s adapter, key (the signature admission sees) and
    device; ``flags[i]`` has :data:`ELIGIBLE` and :data:`PROFILING` bits.
    """

    keys: tuple[tuple[str, Signature, str | None], ...]
    ids: npt.NDArray[np.int32]
    flags: npt.NDArray[np.uint8]

    def __len__(self) -> int:
        return len(self.ids)

    def calls(self) -> tuple[_Call, ...]:
        """Every call as an object (for inspection and the reference replay)."""
        calls = []
        for key_id, flag in zip(self.ids.tolist(), self.flags.tolist(), strict=True):
            adapter, key, device = self.keys[key_id]
            calls.append(_Call(adapter, key, device, bool(flag & ELIGIBLE), bool(flag & PROFILING)))
        return tuple(calls)


@dataclass(frozen=True, slots=True)
class Recording:
    """What the replay needs from event logs: calls per worker, costs per key, settings.

    Built by :meth:`from_records`.

    Args:
        sequences, costs, logged, free_bytes, free_source, time_source, simulated,
            profiling: as on the attributes below, positional, in that order.
        ineligible: per encoder, its ineligible calls by detail; default an empty dict.
    """

    sequences: Mapping[Worker, CallSequence]
    """Each worker's calls, in the order written."""
    costs: Mapping[str, Mapping[Signature, KeyCost]]
    """Per encoder, per eligible key."""
    logged: Mapping[str, Setting]
    """The settings each encoder ran with, as the log's adapter facts said."""
    free_bytes: Mapping[tuple[Worker, str], int]
    """Device-free memory at a worker's start, per device (empty: floor not simulated)."""
    free_source: str
    """``"given"``, ``"estimated"`` (from memory deferrals) or ``"unknown"``."""
    time_source: Mapping[str, str]
    """Per encoder: ``"device"`` or ``"host"``."""
    simulated: bool
    """Some encoder ran on the simulated backend (replays there run the forward again)."""
    profiling: bool
    """The log holds calls of the profiling phase."""
    ineligible: Mapping[str, Mapping[str, int]] = field(default_factory=dict)
    """Per encoder: its calls no graph could serve (ineligible, profiling skips aside), by
    detail (``cpu``, ``disabled``, ...)."""
    items: Mapping[str, str] = field(default_factory=dict)
    """Per encoder whose calls can carry several images or clips, how it served them:
    ``"batched"`` (one call, one key) or ``"split"`` (one call per item), from its adapter
    facts (``encoder_cuda_graph_split_items``)."""
    segments: Mapping[str, str] = field(default_factory=dict)
    """Per encoder whose adapter facts say, the segments its captures were recorded in:
    ``"expandable"`` or ``"fixed"`` (``encoder_cuda_graph_expandable_pools``). The replay
    takes the recorded capture sizes as they are, so they stand for that setting only."""
    serving_captures: tuple[float, ...] = ()
    """The host seconds of each capture logged while serving: each held up the call that
    made it (captures at start-up, before serving, are not among them)."""
    free_changes: Mapping[tuple[Worker, str], tuple[tuple[int, int], ...]] = field(
        default_factory=dict
    )
    """Per worker and device where free memory was estimated: how the estimate moved over the
    run, as ``(call, bytes)`` steps, each from the worker's ``call``-th call (0-based) on,
    added to ``free_bytes``. Each is a reading (at a capture or a deferral) plus the pools
    logged before it, so memory the engine itself took or gave back meanwhile, such as its
    caching allocator's, counts from where it was read."""
    deferral_cached: Mapping[tuple[Worker, str], int] = field(default_factory=dict)
    """Per worker and device, the most its caching allocator held without tensors at a
    memory deferral (``MemoryDeferred.cached_bytes``; absent where no deferral read it)."""
    need_misses: Mapping[str, int] = field(default_factory=dict)
    """Per encoder, its calls the log shows as ``memory`` misses of detail ``need``: a
    capture deferred because device-free memory could not hold what the key's eager calls
    took."""
    needs: Mapping[str, Mapping[Signature, int]] = field(default_factory=dict)
    """Per encoder, per key whose capture the log deferred for its need, the least need
    read (``MemoryDeferred.need_bytes``). The replay applies the need check to these keys
    only: the log records a key's need only where it deferred."""
    unprofiled_runner: str | None = None
    """The engine's start-up profiling run (``ProfilingObserved.runner``) where every one
    the log saw called no encoder: the engine sized its memory without the encoders'
    activations. None where one called an encoder, or none was logged."""

    def seldom_calls(self, min_calls: int) -> int:
        """Eligible calls, all workers, of keys their worker called fewer than ``min_calls``
        times: calls no setting with that ``min_capture_calls`` serves from a graph.

        Args:
            min_calls: the ``min_capture_calls`` of the setting.
        """
        total = 0
        for sequence in self.sequences.values():
            ids = sequence.ids[(sequence.flags & ELIGIBLE) != 0]
            counts = np.bincount(ids, minlength=len(sequence.keys))
            total += int(counts[(counts > 0) & (counts < min_calls)].sum())
        return total

    def why_ineligible(self) -> str:
        """Why calls could use no graph, per encoder with counts: ``vision: cpu 51``.

        Empty when the recording has no ineligible call. Details are text from the logs:
        escape them before they are shown.
        """
        parts = []
        for adapter, details in self.ineligible.items():
            ranked = sorted(details.items(), key=lambda item: (-item[1], item[0]))
            parts.append(f"{adapter}: " + ", ".join(f"{d} {n}" for d, n in ranked))
        return "; ".join(parts)

    def free_at(self, worker: Worker, device: str, call: int) -> int | None:
        """Device-free memory estimated before any capture at ``worker``'s ``call``-th call
        on ``device`` (None: unknown).

        Args:
            worker: the worker.
            device: the device, as the call names it.
            call: the call's place among the worker's calls, from 0.
        """
        start = self.free_bytes.get((worker, device))
        steps = self.free_changes.get((worker, device))
        if start is None or not steps:
            return start
        found = bisect.bisect_right(steps, call, key=lambda step: step[0])
        return start + (steps[found - 1][1] if found else 0)

    @property
    def calls(self) -> dict[Worker, tuple[_Call, ...]]:
        """Each worker's calls as objects (an object per call: for inspection and tests)."""
        return {worker: sequence.calls() for worker, sequence in self.sequences.items()}

    @property
    def workers(self) -> int:
        """Workers whose calls were recorded."""
        return len(self.sequences)

    @property
    def adapters(self) -> tuple[str, ...]:
        """Names of the encoders called, in first-seen order (worker by worker)."""
        seen: dict[str, None] = {}
        for sequence in self.sequences.values():
            for key_id in first_seen(sequence.ids):
                seen.setdefault(sequence.keys[key_id][0])
        return tuple(seen)

    @property
    def call_count(self) -> int:
        """Calls recorded, all workers together."""
        return sum(len(sequence) for sequence in self.sequences.values())

    @property
    def time_known(self) -> bool:
        """Whether every eligible key has an estimated saving (and replays are real)."""
        if self.simulated:
            return False
        return all(
            cost.saving_s is not None for costs in self.costs.values() for cost in costs.values()
        )

    @property
    def estimated_sizes(self) -> int:
        """Keys whose capture size is estimated."""
        return sum(cost.estimated_bytes for costs in self.costs.values() for cost in costs.values())

    @classmethod
    def from_records(
        cls, records: Iterable[EventRecord], *, free_bytes: int | None = None
    ) -> Recording:
        """Read the calls, key costs and logged settings out of event-log records.

        Args:
            records: the records of one or more logs, each worker's in the order written;
                read once, as they come.
            free_bytes: device-free memory at each worker's start, when known; default
                None: where the log has memory deferrals, it is estimated from the free
                memory read at captures and deferrals, as it moved over the run.

        Returns:
            The recording.
        """
        builder = _Builder()
        add = builder.add
        for record in records:
            add(record)
        return builder.build(free_bytes)


def _estimated_free(
    readings: Mapping[tuple[Worker, str], list[tuple[int, int]]],
    deferred: Iterable[tuple[Worker, str]],
) -> tuple[dict[tuple[Worker, str], int], dict[tuple[Worker, str], tuple[tuple[int, int], ...]]]:
    """Free memory at the start of each place in ``deferred``, and its changes, from the
    readings: the first call's, then each later call's from that call on (the last of a
    call's readings stands). Every deferred place has readings: a deferral is one."""
    free: dict[tuple[Worker, str], int] = {}
    changes: dict[tuple[Worker, str], tuple[tuple[int, int], ...]] = {}
    for place in deferred:
        steps = dict(readings[place])  # by call: the last reading before it stands
        base = next(iter(steps.values()))
        free[place] = base
        moved: list[tuple[int, int]] = []
        for call, start in steps.items():
            if not moved or start - base != moved[-1][1]:  # a step where the estimate moved
                moved.append((call, start - base))
        if any(delta for _, delta in moved):
            changes[place] = tuple(moved)
    return free, changes


_SKIPPED = 4
"""A flag while recording: kept out of admission as profiling (its key gets a stream)."""


def _append(store: dict[tuple[str, Any], Any], ident: tuple[str, Any], value: Any) -> None:
    """Append a time, in 8 bytes while every value of the key is a float; a key with an
    integer time keeps its values as objects, so their sum is the reference's exactly."""
    values = store.get(ident)
    if values is None:
        values = store[ident] = array("d")
    if type(value) is float and type(values) is array:
        values.append(value)
    elif type(values) is array:
        store[ident] = [*values, value]
    else:
        values.append(value)


class _Worker:
    """One worker's calls while recording: raw key ids and flags."""

    __slots__ = ("flags", "ids", "index")

    def __init__(self) -> None:
        self.index: dict[tuple[str, Signature], int] = {}
        self.ids = array("i")
        self.flags = bytearray()


class _Builder:
    """Accumulate records into a :class:`Recording`."""

    def __init__(self) -> None:
        self.workers: dict[Worker, _Worker] = {}
        self.infos: dict[str, Mapping[str, Any]] = {}
        # Eager times by encoder and inputs, in host and in device time (_EagerStore).
        self.eager_host = _EagerStore()
        self.eager_device = _EagerStore()
        self.replay: dict[tuple[str, Signature], Any] = {}
        self.replay_dev: dict[tuple[str, Signature], Any] = {}
        self.sizes: dict[tuple[str, Signature], list[int]] = {}
        self.device_timed: set[str] = set()
        self.skipped_profiling: set[str] = set()
        self.streams: dict[tuple[str, str | None], dict[int, int]] = {}
        # Per worker and device: bytes captured so far, the places that deferred a capture,
        # and free memory + those bytes at every reading (captures' and deferrals'), with
        # the worker's calls so far.
        self.captured_bytes: dict[tuple[Worker, str], int] = {}
        self.deferred: dict[tuple[Worker, str], None] = {}  # in the order they deferred
        self.readings: dict[tuple[Worker, str], list[tuple[int, int]]] = {}
        self.deferral_cached: dict[tuple[Worker, str], int] = {}
        # Profiling runs that called no encoder, and whether any run called one.
        self.unprofiled: set[str] = set()
        self.profiled = False
        self.profiling = False
        self.ineligible: dict[str, dict[str, int]] = {}
        self.need_misses: dict[str, int] = {}
        self.needs: dict[str, dict[Signature, int]] = {}
        self.serving_captures: list[float] = []

    def add(self, record: EventRecord) -> None:
        item = record.item
        kind = type(item)
        if kind is ev.GraphReplayed or kind is ev.GraphMissed:
            self._call(record)
            return
        if kind is AdapterInfo:
            self.infos[item.adapter] = item.info  # type: ignore[union-attr]
            return
        worker = record.source
        ident = (item.adapter, item.signature)  # type: ignore[union-attr]
        if isinstance(item, ev.DeviceTimed):
            if item.adapter not in self.device_timed:
                self.device_timed.add(item.adapter)
                # Its keys' costs are device times from now on: the host times would never
                # be read, and they are as many as the calls.
                self.eager_host.drop(item.adapter)
                for stale in [key for key in self.replay if key[0] == item.adapter]:
                    del self.replay[stale]
            if item.kind == "replay":
                _append(self.replay_dev, ident, item.device_s)
            else:
                self.eager_device.add(worker, item.adapter, item.signature.inputs, item.device_s)
        elif isinstance(item, ev.GraphCaptured):
            if item.phase is Phase.SERVING and math.isfinite(item.duration_s):
                self.serving_captures.append(item.duration_s)
            size = item.bytes_reserved + item.static_bytes
            self.sizes.setdefault(ident, []).append(size)
            place = (worker, item.device)
            if item.free_bytes is not None:  # read before the capture, as a deferral's is
                self._reading(worker, place, item.free_bytes)
            self.captured_bytes[place] = self.captured_bytes.get(place, 0) + size
        elif isinstance(item, ev.ProfilingObserved):
            if item.encoder_calls:
                self.profiled = True
            else:
                self.unprofiled.add(item.runner)
        elif isinstance(item, ev.MemoryDeferred):
            place = (worker, item.device)
            self._reading(worker, place, item.free_bytes)
            self.deferred.setdefault(place)
            if item.cached_bytes is not None:
                most = max(self.deferral_cached.get(place, 0), item.cached_bytes)
                self.deferral_cached[place] = most
            if item.need_bytes is not None:
                needs = self.needs.setdefault(item.adapter, {})
                least = needs.get(item.signature, item.need_bytes)
                needs[item.signature] = min(least, item.need_bytes)

    def _reading(self, worker: Worker, place: tuple[Worker, str], free: int) -> None:
        """Record free memory read on ``place`` before the worker's next call, as the start
        it implies (the reading plus the pools logged before it)."""
        start = free + self.captured_bytes.get(place, 0)
        calls = self.workers.get(worker)
        self.readings.setdefault(place, []).append((0 if calls is None else len(calls.ids), start))

    def _call(self, record: EventRecord) -> None:
        item = record.item
        assert isinstance(item, (ev.GraphReplayed, ev.GraphMissed))
        adapter = item.adapter
        signature = item.signature
        ident = (adapter, signature)
        profiling = item.phase is Phase.PROFILING
        if profiling:
            self.profiling = True
        host = adapter not in self.device_timed
        if type(item) is ev.GraphReplayed:
            eligible, skipped = True, False
            if host:
                _append(self.replay, ident, item.duration_s)
        else:
            assert isinstance(item, ev.GraphMissed)
            skipped = item.reason is MissReason.INELIGIBLE and item.detail == "profiling"
            eligible = item.reason is not MissReason.INELIGIBLE or skipped
            if skipped:
                self.skipped_profiling.add(adapter)
            elif item.reason is MissReason.MEMORY and item.detail == "need":
                self.need_misses[adapter] = self.need_misses.get(adapter, 0) + 1
            elif not eligible:
                details = self.ineligible.get(adapter)
                if details is None:
                    details = self.ineligible[adapter] = {}
                details[item.detail] = details.get(item.detail, 0) + 1
            if item.duration_s is not None and host:
                self.eager_host.add(record.source, adapter, signature.inputs, item.duration_s)
        if eligible and signature.stream is not None:
            counts = self.streams.get((adapter, signature.device))
            if counts is None:
                counts = self.streams[(adapter, signature.device)] = {}
            counts[signature.stream] = counts.get(signature.stream, 0) + 1
        worker = self.workers.get(record.source)
        if worker is None:
            worker = self.workers[record.source] = _Worker()
        key_id = worker.index.get(ident)
        if key_id is None:
            key_id = worker.index[ident] = len(worker.index)
        worker.ids.append(key_id)
        # A call skipped as profiling ran in the profiling phase.
        worker.flags.append(
            (ELIGIBLE if eligible else 0)
            | (PROFILING if profiling or skipped else 0)
            | (_SKIPPED if skipped else 0)
        )

    def _key(self, adapter: str, signature: Signature, skipped: bool) -> Signature:
        """The key of a call: a call kept out of admission has no stream, so it gets the
        stream the encoder's eligible calls on its device used most."""
        if not skipped or signature.stream is not None:
            return signature
        counts = self.streams.get((adapter, signature.device))
        if not counts:
            return signature
        stream = max(counts, key=lambda s: counts[s])
        return Signature(signature.inputs, stream)

    def _sequence(self, raw: _Worker) -> CallSequence:
        """The worker's calls with their admission keys (see :meth:`_key`)."""
        # Views of what was recorded, not copies: the arrays are as long as the log.
        flags = np.frombuffer(raw.flags, dtype=np.uint8)
        ids = np.frombuffer(raw.ids, dtype=np.intc)
        table: dict[tuple[str, Signature], int] = {}
        plain = np.empty(len(raw.index), dtype=np.int32)
        skipped = np.empty(len(raw.index), dtype=np.int32)
        for (adapter, signature), raw_id in raw.index.items():
            for target, kept in ((plain, False), (skipped, True)):
                key = self._key(adapter, signature, kept)
                target[raw_id] = table.setdefault((adapter, key), len(table))
        mapped = plain[ids]
        kept_out = np.flatnonzero(flags & _SKIPPED)
        mapped[kept_out] = skipped[ids[kept_out]]
        keys = tuple((adapter, key, key.device) for adapter, key in table)
        return CallSequence(keys, mapped, (flags & (ELIGIBLE | PROFILING)).astype(np.uint8))

    def build(self, free_bytes: int | None) -> Recording:
        sequences = {}
        for worker in list(self.workers):
            # Each worker's raw arrays go as soon as its sequence is made.
            sequences[worker] = self._sequence(self.workers.pop(worker))
        keys: dict[str, dict[Signature, None]] = {}
        for sequence in sequences.values():
            # The eligible keys in the order their first calls came.
            for key_id in first_seen(sequence.ids, (sequence.flags & ELIGIBLE) != 0):
                adapter, key, _ = sequence.keys[key_id]
                keys.setdefault(adapter, {})[key] = None
        time_source = {
            adapter: ("device" if adapter in self.device_timed else "host") for adapter in keys
        }
        costs = {
            adapter: self._costs(adapter, tuple(adapter_keys), time_source[adapter])
            for adapter, adapter_keys in keys.items()
        }
        changes: dict[tuple[Worker, str], tuple[tuple[int, int], ...]] = {}
        if free_bytes is not None:
            free = {
                (worker, device): free_bytes
                for worker, sequence in sequences.items()
                for device in _devices(sequence)
            }
            free_source = "given"
        elif self.deferred:
            # The floor bit: where it did, and as the memory read moved over the run.
            free, changes = _estimated_free(self.readings, self.deferred)
            free_source = "estimated"
        else:
            free, free_source = {}, "unknown"
        return Recording(
            sequences=sequences,
            costs=costs,
            logged={adapter: self._logged(adapter) for adapter in keys},
            free_bytes=free,
            free_changes=changes,
            free_source=free_source,
            time_source=time_source,
            simulated=any(bool(info.get("simulated")) for info in self.infos.values()),
            profiling=self.profiling or bool(self.skipped_profiling),
            ineligible=self.ineligible,
            items={
                adapter: value
                for adapter, info in self.infos.items()
                if (value := info.get("items")) in ("batched", "split")
            },
            segments={
                adapter: "expandable" if value else "fixed"
                for adapter, info in self.infos.items()
                if isinstance(value := info.get("expandable_pools"), bool)
            },
            serving_captures=tuple(self.serving_captures),
            need_misses=self.need_misses,
            needs=self.needs,
            deferral_cached=self.deferral_cached,
            unprofiled_runner=(
                None if self.profiled or not self.unprofiled else min(self.unprofiled)
            ),
        )

    def _logged(self, adapter: str) -> Setting:
        info = self.infos.get(adapter, {})
        default = EncoderGraphConfig()
        # A log without the cap or the budget is older than the budget, when the defaults
        # were four graphs and none.
        legacy = EncoderGraphConfig(max_graphs=4)

        def number(name: str, fallback: int) -> int:
            value = info.get(name)
            return value if isinstance(value, int) and not isinstance(value, bool) else fallback

        return Setting(
            number("max_graphs", legacy.max_graphs),
            number("min_capture_calls", default.min_capture_calls),
            number("min_free_bytes", default.min_free_bytes),
            bool(info.get("skip_profiling", adapter in self.skipped_profiling)),
            number("pool_budget_bytes", legacy.pool_budget_bytes),
        )

    def _eager_times(self, adapter: str, keys: Sequence[Signature], device: bool) -> _EagerTimes:
        """Each key's eager time: the mean of its later calls; with none, of its first calls,
        scaled by what the encoder's keys with both say of a first call (their median of
        later mean over first mean, at most 1)."""
        store = self.eager_device if device else self.eager_host
        later = {key: _mean(store.later.get((adapter, key.inputs))) for key in keys}
        first = {key: _mean(store.first.get((adapter, key.inputs))) for key in keys}
        if not any(t is not None for t in (*later.values(), *first.values())):
            # The encoder's first calls are all it ran eagerly: they are what is known.
            first = {key: _mean(store.cold.get((adapter, key.inputs))) for key in keys}
        scales = sorted(
            min(1.0, w / f)
            for key in keys
            if (w := later[key]) is not None and (f := first[key]) is not None and f > 0
        )
        scale = scales[len(scales) // 2] if scales else None
        times = _EagerTimes({}, set(), set(), {key for key in keys if later[key] is not None})
        for key in keys:
            w, f = later[key], first[key]
            if w is not None:
                times.eager[key] = w
            elif f is not None and scale is not None:
                times.eager[key] = f * scale
                times.scaled.add(key)
            else:
                times.eager[key] = f
                if f is not None:
                    times.uncorrected.add(key)
        return times

    def _costs(
        self, adapter: str, keys: Sequence[Signature], source: str
    ) -> dict[Signature, KeyCost]:
        replay_times = self.replay_dev if source == "device" else self.replay
        times = self._eager_times(adapter, keys, source == "device")
        eager, mean = times.eager, _mean
        replay = {key: mean(replay_times.get((adapter, key))) for key in keys}
        # The replay-to-eager ratio of keys with both, weighted by their replays: from keys
        # whose eager time is measured after their first call when any of them replayed.
        both = [key for key in keys if eager[key] is not None and replay_times.get((adapter, key))]
        measured = [key for key in both if key in times.measured] or both
        replay_total = eager_equiv = 0.0
        for key in measured:
            e, replays = eager[key], replay_times[(adapter, key)]
            assert e is not None
            replay_total += sum(replays)
            eager_equiv += len(replays) * e
        ratio = replay_total / eager_equiv if eager_equiv > 0 else None
        # Bytes per input element of the keys captured, for the keys never captured.
        size = {key: self.sizes.get((adapter, key)) for key in keys}
        recorded = [(sum(s) / len(s), _numel(key)) for key, s in size.items() if s]
        if not recorded:
            # No capture of this encoder: another encoder's rate beats nothing.
            recorded = [(sum(s) / len(s), _numel(key)) for (_, key), s in self.sizes.items()]
        elements = sum(n for _, n in recorded)
        per_element = sum(b for b, _ in recorded) / elements if elements else 0.0
        known = [e for e in eager.values() if e is not None]
        typical = sum(known) / len(known) if known else None
        costs: dict[Signature, KeyCost] = {}
        for key in keys:
            e, r = eager[key], replay[key]
            estimated_time = key in times.scaled
            if e is None and r is None and typical is not None:
                # Neither time measured (a device timing never resolved): the encoder's
                # typical eager time stands in.
                e, estimated_time = typical, True
            if ratio is not None and ratio > 0:
                if r is None and e is not None:
                    r, estimated_time = e * ratio, True
                elif e is None and r is not None:
                    e, estimated_time = r / ratio, True
            sizes = size[key]
            if sizes:
                capture_bytes, estimated_bytes = round(sum(sizes) / len(sizes)), False
            else:
                capture_bytes, estimated_bytes = round(per_element * _numel(key)), True
            costs[key] = KeyCost(
                e, r, capture_bytes, estimated_time, estimated_bytes, key in times.uncorrected
            )
        return costs


class _EagerStore:
    """One time source's eager times by encoder and inputs, whatever the stream: an
    ineligible call (graphs paused, say) runs the same forward as a miss of its key.

    A worker's first eager call of a key carries one-off costs (the device's kernels loaded
    on first launch, allocator growth): 1.5-5x a later call of the same key on an H200. Its
    first eager call of an encoder pays most of them (0.19-1.97 s there, where other keys'
    first calls took 20-220 ms). So each call goes to one of three stores: ``cold`` (the
    worker's first of the encoder), ``first`` (its first of the key) and ``later``.
    """

    __slots__ = ("_encoders", "_keys", "cold", "first", "later")

    def __init__(self) -> None:
        self.cold: dict[tuple[str, _Inputs], Any] = {}
        self.first: dict[tuple[str, _Inputs], Any] = {}
        self.later: dict[tuple[str, _Inputs], Any] = {}
        self._keys: set[tuple[Worker, str, _Inputs]] = set()
        self._encoders: set[tuple[Worker, str]] = set()

    def add(self, worker: Worker, adapter: str, inputs: _Inputs, value: Any) -> None:
        """Record one eager time of ``adapter``'s call with ``inputs`` in ``worker``."""
        if (worker, adapter, inputs) in self._keys:
            store = self.later
        else:
            self._keys.add((worker, adapter, inputs))
            store = self.first if (worker, adapter) in self._encoders else self.cold
            self._encoders.add((worker, adapter))
        _append(store, (adapter, inputs), value)

    def drop(self, adapter: str) -> None:
        """Forget ``adapter``'s times (its costs are read from the other source now)."""
        for store in (self.cold, self.first, self.later):
            for stale in [key for key in store if key[0] == adapter]:
                del store[stale]


@dataclass(frozen=True, slots=True)
class _EagerTimes:
    """An encoder's eager time per key (None: no eager call), and how each was had."""

    eager: dict[Signature, float | None]
    scaled: set[Signature]
    """Keys whose time is their first calls' scaled by the encoder's other keys."""
    uncorrected: set[Signature]
    """Keys whose time is their first calls', with nothing to scale it by."""
    measured: set[Signature]
    """Keys with eager calls after their first."""


def _mean(values: Sequence[float] | None) -> float | None:
    return sum(values) / len(values) if values else None


def _numel(signature: Signature) -> int:
    # Capped at the largest byte count omnitrace exports: a logged shape of hundreds of
    # dimensions has more elements than a float holds, and no device holds that many.
    return min(sum(spec.numel for spec in signature.inputs if spec is not None), INT64_MAX)


def first_seen(ids: npt.NDArray[np.int32], mask: npt.NDArray[np.bool_] | None = None) -> list[int]:
    """The distinct ids (where ``mask``), in the order of their first occurrence.

    A block at a time: sorting a log-long array would take several times its memory.
    """
    seen: dict[int, None] = {}
    for begin in range(0, len(ids), 1 << 16):
        block = ids[begin : begin + (1 << 16)]
        if mask is not None:
            block = block[mask[begin : begin + (1 << 16)]]
        found, first = np.unique(block, return_index=True)
        for key_id in found[np.argsort(first, kind="stable")].tolist():
            seen.setdefault(key_id)
    return list(seen)


def _devices(sequence: CallSequence) -> list[str]:
    """The devices of a worker's calls, in the order they first came."""
    seen: dict[str, None] = {}
    for key_id in first_seen(sequence.ids):
        device = sequence.keys[key_id][2]
        if device:
            seen.setdefault(device)
    return list(seen)
