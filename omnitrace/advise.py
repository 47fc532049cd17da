"""Replay recorded encoder traffic through the admission policy under other settings.

``omnitrace advise LOG...`` reads event logs, rebuilds each worker's sequence of encoder
calls with their keys (the input signature with its replay stream), and replays it through
:class:`~omnitrace.graphs.admission.Admission`, the policy the adapter itself runs, once per
setting of a grid of ``max_graphs``, ``min_capture_calls`` and ``min_free_bytes`` (and
``skip_profiling`` when the log holds profiling calls). For each setting it reports the hit
rate, the graphs held, their pool memory and the time the graphs would have saved, and it
recommends the best one as ``--hf-overrides`` JSON.

What the replay takes from the log, and what it estimates:

* Calls: every ``GraphReplayed`` and ``GraphMissed``, in the order each worker wrote them.
  Calls that could never use a graph (``ineligible``: CPU, grad, streaming ...) stay misses
  under every setting; calls the logged run kept out of admission because it skipped
  profiling (detail ``profiling``) reach admission in settings that do not skip it. Captures
  are replayed as synchronous: a background capture's ``preparing`` calls count as calls of
  their key. One setting applies to every encoder, as ``--hf-overrides`` does.
* Capture sizes: a key's ``bytes_reserved + static_bytes`` from its ``GraphCaptured``
  events. A key the log never captured gets the encoder's recorded bytes per input element
  times its own input elements (an estimate, and the output says how many).
* The memory floor: device-free memory at a worker's start minus the sizes of the graphs
  captured so far. The start is given (``free_bytes``) or estimated from the log's memory
  deferrals (free memory then plus what had been captured before); without either the floor
  is not simulated and only the logged floor is tried.
* Time saved: per hit that did not capture, the key's mean eager time minus its mean replay
  time, in device time where the encoder's events carry any (``DeviceTimed``), else host
  time. A key never replayed (or never run eagerly) gets the encoder's replay-to-eager ratio
  of the keys that have both. A capturing call saves nothing (it runs the warm-up and the
  capture). When no saving can be estimated, or the log comes from the simulated backend
  (whose replays run the forward again), settings are ranked by calls graphed instead.

The best setting has the largest saving (or the most hits) among those that graph a call
(``max_graphs`` 0 is never recommended: that is graphs off), whose pool memory fits the
budget and whose captures fit in device-free memory where it is known; ties go to fewer
graphs, then less pool memory, a lower ``max_graphs``, a higher floor, a higher
``min_capture_calls`` and skipping profiling: the cheapest and most conservative of equals.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from omnitrace import events as ev
from omnitrace._units import format_bytes
from omnitrace._validate import INT64_MAX
from omnitrace.config import HF_OVERRIDE_KEYS, MAX_GRAPHS_CAP, ConfigError, EncoderGraphConfig
from omnitrace.eventlog import AdapterInfo, EventRecord
from omnitrace.events import MissReason, Phase
from omnitrace.graphs.admission import Admission, Verdict
from omnitrace.signature import Signature
from omnitrace.stats import HitRate

__all__ = [
    "Advice",
    "EncoderOutcome",
    "KeyCost",
    "Recording",
    "Result",
    "Setting",
    "advise",
    "advice_json",
    "default_grid",
    "format_seconds",
    "parse_size",
    "replay",
]

MiB = 1 << 20
GiB = 1 << 30

#: ``max_graphs`` values tried by default (with the logged one, up to the keys seen).
MAX_GRAPHS_GRID: tuple[int, ...] = (0, 1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)
#: ``min_capture_calls`` values tried by default (with the logged one).
MIN_CALLS_GRID: tuple[int, ...] = (2, 3, 4, 6, 8)
#: Floors tried by default when device-free memory is known (with the logged one).
FLOOR_GRID: tuple[int, ...] = (0, 256 * MiB, 512 * MiB, GiB, 2 * GiB, 4 * GiB)

Worker = tuple[int, int]
"""``(rank, pid)`` of the process that wrote a log line."""

_KEYS = {name: key for key, name in HF_OVERRIDE_KEYS.items()}


@dataclass(frozen=True, slots=True)
class Setting:
    """One point of the grid: the admission settings every encoder runs with.

    Each field is the :class:`~omnitrace.config.EncoderGraphConfig` option of the same name
    (documented there, set by its ``encoder_cuda_graph_*`` key); the other options keep
    their defaults.
    """

    max_graphs: int
    min_capture_calls: int
    min_free_bytes: int
    skip_profiling: bool = False

    def config(self) -> EncoderGraphConfig:
        """Return the config this setting stands for (other fields at their defaults)."""
        return EncoderGraphConfig(**asdict(self))

    def overrides(self, *, profiling: bool = True) -> dict[str, int | bool]:
        """Return the ``--hf-overrides`` keys of this setting (``skip_profiling`` only when
        ``profiling``, i.e. when the grid varied it)."""
        values = asdict(self)
        if not profiling:
            del values["skip_profiling"]
        return {_KEYS[name]: value for name, value in values.items()}


@dataclass(frozen=True, slots=True)
class KeyCost:
    """What one key of one encoder costs: its call times and its capture size."""

    eager_s: float | None
    """Mean eager time of one call (None: not measured and not estimable)."""
    replay_s: float | None
    capture_bytes: int
    estimated_time: bool = False
    """``eager_s`` or ``replay_s`` comes from the encoder's replay-to-eager ratio."""
    estimated_bytes: bool = False
    """``capture_bytes`` comes from the encoder's recorded bytes per input element."""

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
class Recording:
    """What the replay needs from event logs: calls per worker, costs per key, settings."""

    calls: Mapping[Worker, tuple[_Call, ...]]
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

    @property
    def adapters(self) -> tuple[str, ...]:
        seen: dict[str, None] = {}
        for calls in self.calls.values():
            for call in calls:
                seen.setdefault(call.adapter)
        return tuple(seen)

    @property
    def call_count(self) -> int:
        return sum(len(calls) for calls in self.calls.values())

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
            records: the records of one or more logs, each worker's in the order written.
            free_bytes: device-free memory at each worker's start, when known (else it is
                estimated from memory deferrals, if the log has any).
        """
        builder = _Builder()
        for record in records:
            builder.add(record)
        return builder.build(free_bytes)


class _Builder:
    """Accumulate records into a :class:`Recording`."""

    def __init__(self) -> None:
        self.calls: dict[Worker, list[tuple[str, Signature, bool, bool, bool]]] = {}
        self.infos: dict[str, Mapping[str, Any]] = {}
        self.eager: dict[tuple[str, Signature], list[float]] = {}
        self.replay: dict[tuple[str, Signature], list[float]] = {}
        self.eager_dev: dict[tuple[str, Signature], list[float]] = {}
        self.replay_dev: dict[tuple[str, Signature], list[float]] = {}
        self.sizes: dict[tuple[str, Signature], list[int]] = {}
        self.device_timed: set[str] = set()
        self.skipped_profiling: set[str] = set()
        self.streams: dict[tuple[str, str | None], dict[int, int]] = {}
        # Per worker and device: bytes captured so far, and free memory + that at deferrals.
        self.captured_bytes: dict[tuple[Worker, str], int] = {}
        self.deferral_starts: dict[tuple[Worker, str], list[int]] = {}
        self.profiling = False

    def add(self, record: EventRecord) -> None:
        item = record.item
        if isinstance(item, AdapterInfo):
            self.infos[item.adapter] = item.info
            return
        worker = record.source
        adapter = item.adapter
        signature = item.signature
        ident = (adapter, signature)
        if isinstance(item, (ev.GraphReplayed, ev.GraphMissed)):
            profiling = item.phase is Phase.PROFILING
            self.profiling = self.profiling or profiling
            if isinstance(item, ev.GraphReplayed):
                eligible, skipped = True, False
                self.replay.setdefault(ident, []).append(item.duration_s)
            else:
                skipped = item.reason is MissReason.INELIGIBLE and item.detail == "profiling"
                eligible = item.reason is not MissReason.INELIGIBLE or skipped
                if skipped:
                    self.skipped_profiling.add(adapter)
                if eligible and item.duration_s is not None:
                    self.eager.setdefault(ident, []).append(item.duration_s)
            if eligible and signature.stream is not None:
                counts = self.streams.setdefault((adapter, signature.device), {})
                counts[signature.stream] = counts.get(signature.stream, 0) + 1
            self.calls.setdefault(worker, []).append(
                (adapter, signature, eligible, profiling, skipped)
            )
        elif isinstance(item, ev.DeviceTimed):
            self.device_timed.add(adapter)
            target = self.replay_dev if item.kind == "replay" else self.eager_dev
            target.setdefault(ident, []).append(item.device_s)
        elif isinstance(item, ev.GraphCaptured):
            size = item.bytes_reserved + item.static_bytes
            self.sizes.setdefault(ident, []).append(size)
            place = (worker, item.device)
            self.captured_bytes[place] = self.captured_bytes.get(place, 0) + size
        elif isinstance(item, ev.MemoryDeferred):
            place = (worker, item.device)
            start = item.free_bytes + self.captured_bytes.get(place, 0)
            self.deferral_starts.setdefault(place, []).append(start)

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

    def build(self, free_bytes: int | None) -> Recording:
        calls: dict[Worker, tuple[_Call, ...]] = {}
        keys: dict[str, dict[Signature, None]] = {}
        for worker, raw in self.calls.items():
            out = []
            for adapter, signature, eligible, profiling, skipped in raw:
                key = self._key(adapter, signature, skipped)
                # A call skipped as profiling ran in the profiling phase.
                out.append(_Call(adapter, key, key.device, eligible, profiling or skipped))
                if eligible:
                    keys.setdefault(adapter, {})[key] = None
            calls[worker] = tuple(out)
        time_source = {
            adapter: ("device" if adapter in self.device_timed else "host") for adapter in keys
        }
        costs = {
            adapter: self._costs(adapter, tuple(adapter_keys), time_source[adapter])
            for adapter, adapter_keys in keys.items()
        }
        if free_bytes is not None:
            free = {
                (worker, call.device): free_bytes
                for worker, worker_calls in calls.items()
                for call in worker_calls
                if call.device
            }
            free_source = "given"
        elif self.deferral_starts:
            # The lowest start any deferral implies: the floor bites at least where it did.
            free = {place: min(starts) for place, starts in self.deferral_starts.items()}
            free_source = "estimated"
        else:
            free, free_source = {}, "unknown"
        return Recording(
            calls=calls,
            costs=costs,
            logged={adapter: self._logged(adapter) for adapter in keys},
            free_bytes=free,
            free_source=free_source,
            time_source=time_source,
            simulated=any(bool(info.get("simulated")) for info in self.infos.values()),
            profiling=self.profiling or bool(self.skipped_profiling),
        )

    def _logged(self, adapter: str) -> Setting:
        info = self.infos.get(adapter, {})
        default = EncoderGraphConfig()

        def number(name: str, fallback: int) -> int:
            value = info.get(name)
            return value if isinstance(value, int) and not isinstance(value, bool) else fallback

        return Setting(
            number("max_graphs", default.max_graphs),
            number("min_capture_calls", default.min_capture_calls),
            number("min_free_bytes", default.min_free_bytes),
            bool(info.get("skip_profiling", adapter in self.skipped_profiling)),
        )

    def _costs(
        self, adapter: str, keys: Sequence[Signature], source: str
    ) -> dict[Signature, KeyCost]:
        eager_times = self.eager_dev if source == "device" else self.eager
        replay_times = self.replay_dev if source == "device" else self.replay

        def mean(values: list[float] | None) -> float | None:
            return sum(values) / len(values) if values else None

        eager = {key: mean(eager_times.get((adapter, key))) for key in keys}
        replay = {key: mean(replay_times.get((adapter, key))) for key in keys}
        # The replay-to-eager ratio of keys with both, weighted by their replays.
        replay_total = eager_equiv = 0.0
        for key in keys:
            e, times = eager[key], replay_times.get((adapter, key))
            if e is not None and times:
                replay_total += sum(times)
                eager_equiv += len(times) * e
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
            estimated_time = False
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
            costs[key] = KeyCost(e, r, capture_bytes, estimated_time, estimated_bytes)
        return costs


def _numel(signature: Signature) -> int:
    # Capped at the largest byte count omnitrace exports: a logged shape of hundreds of
    # dimensions has more elements than a float holds, and no device holds that many.
    return min(sum(spec.numel for spec in signature.inputs if spec is not None), INT64_MAX)


# -- the replay ------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class EncoderOutcome(HitRate):
    """One encoder's calls under one setting (all workers together)."""

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
    """What one setting would have done with the recorded traffic."""

    setting: Setting
    encoders: tuple[EncoderOutcome, ...]
    pool_bytes: int
    """The most graph memory any one worker's device would hold."""
    min_free_bytes: int | None = None
    """The least device-free memory left after a capture, on any worker's device (None:
    free memory unknown); below zero the device would have run out of memory."""

    @property
    def exhausts_memory(self) -> bool:
        """Whether a capture would not have fit in the device-free memory."""
        return self.min_free_bytes is not None and self.min_free_bytes < 0

    @property
    def calls(self) -> int:
        return sum(e.calls for e in self.encoders)

    @property
    def hits(self) -> int:
        return sum(e.hits for e in self.encoders)

    @property
    def graphs(self) -> int:
        """Graphs captured, all encoders and workers."""
        return sum(e.captures for e in self.encoders)

    @property
    def saved_s(self) -> float | None:
        saved = [e.saved_s for e in self.encoders]
        return None if any(s is None for s in saved) else sum(s or 0.0 for s in saved)

    @property
    def estimated_sizes(self) -> int:
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
    """Replay the recorded calls under ``setting`` and return what it would have done."""
    config = setting.config()
    floor = setting.min_free_bytes
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
        for call in calls:
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
            start = recording.free_bytes.get((worker, call.device or ""))
            # Unknown free memory never bites: the floor itself is what admission reads.
            free_now = floor if start is None else start - used.get(call.device, 0)
            decision = state.admission.decide(call.key, read_free)
            verdict = decision.verdict
            if verdict is Verdict.CAPTURE:
                state.admission.captured(call.key)
                captured[call.key] = 1
                state.hits += 1
                size = recording.costs[call.adapter][call.key].capture_bytes
                used[call.device] = used.get(call.device, 0) + size
                if start is not None:
                    left = start - used[call.device]
                    lowest = left if lowest is None else min(lowest, left)
            else:
                state.misses[_VERDICT_REASON[verdict]] += 1
        worker_bytes.append(sum(used.values()) if used else 0)
        for name, state in states.items():
            per_adapter.setdefault(name, []).append(state)
    encoders = tuple(
        _outcome(name, states, recording.costs.get(name, {}), recording.time_known)
        for name, states in per_adapter.items()
    )
    return Result(setting, encoders, max(worker_bytes, default=0), lowest)


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


# -- the grid and the advice -----------------------------------------------------------------


def default_grid(
    recording: Recording,
    *,
    max_graphs: Sequence[int] | None = None,
    min_capture_calls: Sequence[int] | None = None,
    min_free_bytes: Sequence[int] | None = None,
) -> list[Setting]:
    """Return the settings to try: the given values, else the defaults with the logged ones.

    ``max_graphs`` stops at the number of distinct keys of the busiest encoder (more would
    hold nothing more); floors other than the logged one are tried only when device-free
    memory is known; ``skip_profiling`` both ways only when the log has profiling calls.

    Raises:
        ConfigError: a given value is out of the range the config accepts.
    """
    logged = list(recording.logged.values())
    keys = max((len(costs) for costs in recording.costs.values()), default=0)
    if max_graphs is None:
        cap = min(max(keys, *(s.max_graphs for s in logged), 0), MAX_GRAPHS_CAP)
        max_graphs = [n for n in MAX_GRAPHS_GRID if n <= cap]
        max_graphs += [s.max_graphs for s in logged]
        if keys <= MAX_GRAPHS_CAP:
            max_graphs.append(keys)
    if min_capture_calls is None:
        min_capture_calls = [*MIN_CALLS_GRID, *(s.min_capture_calls for s in logged)]
    if min_free_bytes is None:
        min_free_bytes = [s.min_free_bytes for s in logged] or [EncoderGraphConfig().min_free_bytes]
        if recording.free_bytes:
            min_free_bytes = [*FLOOR_GRID, *min_free_bytes]
    skips = (
        (False, True)
        if recording.profiling
        else tuple({s.skip_profiling for s in logged} or {False})
    )
    grid = [
        Setting(g, c, f, s)
        for g, c, f, s in itertools.product(
            sorted(set(max_graphs)),
            sorted(set(min_capture_calls)),
            sorted(set(min_free_bytes)),
            sorted(skips),
        )
    ]
    for setting in grid:
        setting.config()  # a ConfigError names the key and the value
    return grid


@dataclass(frozen=True, slots=True)
class Advice:
    """The replayed grid, ranked, and the setting it recommends."""

    results: tuple[Result, ...]
    """Every setting, best first; settings over the memory budget, or whose captures would
    not fit in device-free memory, after the others."""
    best: Result | None
    """None when no setting that graphs a call fits the budget and device-free memory."""
    logged: Result | None
    """The setting the log ran with, when every encoder ran the same one."""
    objective: str
    """``"time"`` (estimated time saved) or ``"hits"`` (calls graphed)."""
    recording: Recording
    memory_budget: int | None = None
    ties: int = 0
    """Other settings as good as the best by the objective (they hold more, or are less
    conservative)."""
    notes: tuple[str, ...] = field(default=())

    @property
    def overrides(self) -> dict[str, int | bool] | None:
        """The recommended ``--hf-overrides`` keys."""
        if self.best is None:
            return None
        return self.best.setting.overrides(profiling=self.recording.profiling)

    def why(self) -> str:
        """Say in a sentence or two why the best setting is recommended."""
        best, logged = self.best, self.logged
        if best is None:
            return self._why_none()
        parts = []
        if self.objective == "time":
            source = "/".join(sorted(set(self.recording.time_source.values())))
            parts.append(
                f"it saves the most estimated {source} time over the recorded traffic, "
                f"{format_seconds(best.saved_s)}"
            )
        else:
            parts.append(
                f"it graphs the most calls of the recorded traffic, {best.hits} of {best.calls}"
            )
        parts.append(f"(hit rate {best.hit_rate * 100:.1f} %)")
        text = " ".join(parts)
        text += f", with {_graphs(best.graphs)} holding {format_bytes(best.pool_bytes)}"
        if self.memory_budget is not None:
            text += f", within the budget of {format_bytes(self.memory_budget)}"
        if best.min_free_bytes is not None:
            text += f", leaving at least {format_bytes(best.min_free_bytes)} free"
        if logged is not None and best.setting.min_free_bytes < logged.setting.min_free_bytes:
            text += (
                f" (it lowers the memory floor from "
                f"{format_bytes(logged.setting.min_free_bytes)}: less headroom for activations)"
            )
        if logged is not None:
            if logged.setting == best.setting:
                text += "; it is the setting the log ran with"
            else:
                measure = (
                    f"saved {format_seconds(logged.saved_s)}"
                    if self.objective == "time"
                    else f"graphed {logged.hits} calls"
                )
                text += (
                    f"; the logged setting {measure} "
                    f"(hit rate {logged.hit_rate * 100:.1f} %) with {_graphs(logged.graphs)}"
                )
        if self.ties:
            text += (
                f"; {self.ties} other setting{'s' if self.ties > 1 else ''} do as well with "
                "more graphs, more memory, a higher cap or a lower floor"
            )
        return text + "."

    def _why_none(self) -> str:
        """Say in one line why no setting is recommended, and what would change that."""
        graphing = [r for r in self.results if r.hits > 0]
        if not graphing:
            cause = (
                "max_graphs is 0 in every one"
                if all(r.setting.max_graphs == 0 for r in self.results)
                else "no key recurs often enough to be captured and replayed"
            )
            return (
                f"no setting of the grid graphs any of the {self.recording.call_count} "
                f"recorded calls ({cause})"
            )
        in_memory = [r for r in graphing if not r.exhausts_memory]
        if not in_memory:
            return (
                "every setting of the grid that graphs a call runs out of device-free memory; "
                "try a higher floor (--min-free-bytes) or fewer graphs (--max-graphs)"
            )
        smallest = min(in_memory, key=lambda r: (r.pool_bytes, -r.hits))
        budget = format_bytes(self.memory_budget)
        return (
            f"no setting of the grid that graphs a call fits the budget of {budget}: the "
            f"smallest holds {format_bytes(smallest.pool_bytes)} "
            f"(max_graphs {smallest.setting.max_graphs}, {_graphs(smallest.graphs)}); raise "
            "--memory-budget"
        )


def _graphs(count: int) -> str:
    return f"{count} graph" if count == 1 else f"{count} graphs"


def _score(result: Result, objective: str) -> float:
    if objective == "time":
        return result.saved_s or 0.0
    return float(result.hits)


def _rank(result: Result, objective: str) -> tuple[float | int, ...]:
    setting = result.setting
    return (
        -_score(result, objective),
        result.graphs,
        result.pool_bytes,
        setting.max_graphs,
        -setting.min_free_bytes,
        -setting.min_capture_calls,
        -int(setting.skip_profiling),
    )


def advise(
    recording: Recording,
    grid: Sequence[Setting] | None = None,
    *,
    memory_budget: int | None = None,
    progress: Callable[[int], None] | None = None,
) -> Advice:
    """Replay ``recording`` for every setting of ``grid`` and rank them.

    Args:
        recording: the traffic, from :meth:`Recording.from_records`.
        grid: the settings to try (default: :func:`default_grid`).
        memory_budget: most pool memory one worker's graphs may hold, in bytes.
        progress: called with 1 as each setting has been replayed.
    """
    if grid is None:
        grid = default_grid(recording)
    objective = "time" if recording.time_known else "hits"
    results = []
    for setting in grid:
        results.append(replay(recording, setting))
        if progress is not None:
            progress(1)

    def fits(result: Result) -> bool:
        # A setting that graphs no call is graphs turned off, not a graph setting: it would
        # "fit" any budget and win every search where nothing else fits.
        if result.exhausts_memory or result.hits == 0:
            return False
        return memory_budget is None or result.pool_bytes <= memory_budget

    ranked = sorted(results, key=lambda r: (not fits(r), *_rank(r, objective)))
    best = ranked[0] if ranked and fits(ranked[0]) else None
    ties = 0
    if best is not None:
        top = _score(best, objective)
        ties = sum(1 for r in ranked[1:] if fits(r) and _score(r, objective) == top)
    return Advice(
        results=tuple(ranked),
        best=best,
        logged=_logged_result(recording, results),
        objective=objective,
        recording=recording,
        memory_budget=memory_budget,
        ties=ties,
        notes=_notes(recording),
    )


def _logged_result(recording: Recording, results: Sequence[Result]) -> Result | None:
    """The result of the setting the log ran with, when every encoder ran the same one."""
    settings = {s for s in recording.logged.values()}
    if len(settings) != 1:
        return None
    (setting,) = settings
    logged = next((r for r in results if r.setting == setting), None)
    return replay(recording, setting) if logged is None else logged


def _notes(recording: Recording) -> tuple[str, ...]:
    notes = []
    for adapter, source in recording.time_source.items():
        costs = recording.costs.get(adapter, {})
        estimated = sum(cost.estimated_time for cost in costs.values())
        unknown = sum(cost.saving_s is None for cost in costs.values())
        line = f"{adapter}: {source} time"
        if estimated:
            line += f", {estimated} of {len(costs)} keys' times estimated from the others' ratio"
        if unknown:
            line += f", {unknown} keys with no time to estimate from"
        notes.append(line)
    if recording.simulated:
        notes.append(
            "simulated backend: its replays run the forward again, so the time saved means "
            "nothing and settings are ranked by calls graphed"
        )
    elif not recording.time_known:
        notes.append("some key's saving cannot be estimated: settings are ranked by calls graphed")
    sizes = sum(len(c) for c in recording.costs.values())
    estimated = recording.estimated_sizes
    notes.append(
        f"capture sizes: {sizes - estimated} keys recorded, {estimated} estimated from the "
        "recorded bytes per input element"
    )
    if recording.free_source == "unknown":
        notes.append(
            "device-free memory unknown (no memory deferral in the log; --free-bytes gives "
            "it): the floor is not simulated and only the logged floor is tried"
        )
    else:
        low = min(recording.free_bytes.values())
        how = "given" if recording.free_source == "given" else "estimated from memory deferrals"
        notes.append(f"device-free memory at start: {format_bytes(low)} ({how})")
    return tuple(notes)


def format_seconds(value: float | None) -> str:
    """Format seconds as ``1.25 s`` or ``12.5 ms``; ``unknown`` for None."""
    if value is None:
        return "unknown"
    if value >= 1:
        return f"{value:.2f} s"
    return f"{value * 1e3:.1f} ms"


def advice_json(advice: Advice) -> dict[str, Any]:
    """Return the advice as plain JSON data (``omnitrace advise --json``)."""

    def result(r: Result) -> dict[str, Any]:
        return {
            "setting": r.setting.overrides(profiling=advice.recording.profiling),
            "calls": r.calls,
            "hits": r.hits,
            "hit_rate": r.hit_rate,
            "graphs": r.graphs,
            "pool_bytes": r.pool_bytes,
            "min_free_bytes": r.min_free_bytes,
            "exhausts_memory": r.exhausts_memory,
            "saved_s": r.saved_s,
            "estimated_sizes": r.estimated_sizes,
            "encoders": {
                e.adapter: {
                    "calls": e.calls,
                    "hits": e.hits,
                    "hit_rate": e.hit_rate,
                    "graphs": e.captures,
                    "misses": {reason.value: n for reason, n in e.misses.items()},
                    "pool_bytes": e.pool_bytes,
                    "saved_s": e.saved_s,
                }
                for e in r.encoders
            },
        }

    recording = advice.recording
    return {
        "objective": advice.objective,
        "time_source": dict(recording.time_source),
        "simulated": recording.simulated,
        "workers": len(recording.calls),
        "calls": recording.call_count,
        "free_bytes": recording.free_source,
        "memory_budget": advice.memory_budget,
        "recommended": advice.overrides,
        "why": advice.why(),
        "notes": list(advice.notes),
        "logged": None if advice.logged is None else result(advice.logged),
        "best": None if advice.best is None else result(advice.best),
        "results": [result(r) for r in advice.results],
    }


def parse_size(text: str) -> int:
    """Read a byte size: ``1073741824``, ``512MiB``, ``1.5GiB``, ``64KiB``, or in decimal
    units ``2GB`` (2 * 10**9 bytes), ``500MB``, ``64kB``.

    Raises:
        ConfigError: ``text`` is not a nonnegative size.
    """
    raw = text.strip()
    # Binary units before decimal ones and bytes last: "2GiB" also ends in "b".
    units = {"kib": 1 << 10, "mib": MiB, "gib": GiB, "tib": 1 << 40}
    units.update({"kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12, "b": 1})
    number, scale = raw, 1
    for suffix, factor in units.items():
        if raw.lower().endswith(suffix):
            number, scale = raw[: -len(suffix)].strip(), factor
            break
    try:
        value = float(number) * scale if scale > 1 else int(number)
    except ValueError:
        value = -1
    if not 0 <= value < 2**63:
        raise ConfigError(
            f"expected a size in bytes (1073741824, 512MiB, 1.5GiB, 2GB), got {text[:40]!r}"
        )
    return int(value)
