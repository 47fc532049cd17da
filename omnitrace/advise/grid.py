"""Replay recorded encoder traffic through the admission policy under a grid of other settings,
rank them and recommend one as ``--hf-overrides`` (docs/operations.md, "Choosing settings",
says what is estimated and how ties go)."""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from omnitrace._units import format_bytes
from omnitrace._validate import INT64_MAX
from omnitrace.advise.recording import KeyCost, Recording, Setting, Worker
from omnitrace.advise.replaying import EncoderOutcome, Result, replay, replay_grid
from omnitrace.config import MAX_GRAPHS_CAP, ConfigError, EncoderGraphConfig
from omnitrace.events import MissReason

__all__ = [
    "Advice",
    "EncoderOutcome",
    "KeyCost",
    "Recording",
    "Result",
    "Setting",
    "Worker",
    "advise",
    "advice_json",
    "default_grid",
    "format_seconds",
    "parse_size",
    "replay",
    "replay_grid",
]

MiB = 1 << 20
GiB = 1 << 30

#: ``max_graphs`` values tried by default (with the logged one, up to the keys seen).
MAX_GRAPHS_GRID: tuple[int, ...] = (0, 1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)
#: ``min_capture_calls`` values tried by default (with the logged one).
MIN_CALLS_GRID: tuple[int, ...] = (2, 3, 4, 6, 8)
#: Floors tried by default when device-free memory is known (with the logged one).
FLOOR_GRID: tuple[int, ...] = (0, 256 * MiB, 512 * MiB, GiB, 2 * GiB, 4 * GiB)
#: The memory note's steps: more device-free memory at start, 256 MiB at a time, to 16 GiB.
MORE_FREE_STEP = 256 * MiB
MORE_FREE_STEPS = 64

# -- the grid and the advice -----------------------------------------------------------------


def default_grid(
    recording: Recording,
    *,
    max_graphs: Sequence[int] | None = None,
    min_capture_calls: Sequence[int] | None = None,
    min_free_bytes: Sequence[int] | None = None,
    pool_budget_bytes: Sequence[int] | None = None,
) -> list[Setting]:
    """Return the settings to try: the given values, else the defaults with the logged ones.

    ``max_graphs`` stops at the number of distinct keys of the busiest encoder (more would
    hold nothing more); floors other than the logged one are tried only when device-free
    memory is known; ``skip_profiling`` both ways only when the log has profiling calls;
    ``pool_budget_bytes`` (per encoder, 0: none) defaults to the logged one.

    Args:
        recording: the traffic, from :meth:`Recording.from_records`.
        max_graphs: the values to try; default None (see above).
        min_capture_calls: the values to try; default None (:data:`MIN_CALLS_GRID` and the
            logged ones).
        min_free_bytes: the values to try; default None (the logged ones, with
            :data:`FLOOR_GRID` when device-free memory is known).
        pool_budget_bytes: the values to try; default None (the logged ones, else 0).

    Returns:
        Every combination of the values, each value sorted and tried once.

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
    if pool_budget_bytes is None:
        pool_budget_bytes = [s.pool_budget_bytes for s in logged] or [0]
    grid = [
        Setting(g, c, f, s, b)
        for g, c, f, s, b in itertools.product(
            sorted(set(max_graphs)),
            sorted(set(min_capture_calls)),
            sorted(set(min_free_bytes)),
            sorted(skips),
            sorted(set(pool_budget_bytes)),
        )
    ]
    for setting in grid:
        setting.config()  # a ConfigError names the key and the value
    return grid


@dataclass(frozen=True, slots=True)
class Advice:
    """The replayed grid, ranked, and the setting it recommends.

    Built by :func:`advise`.

    Args:
        results, best, logged, objective: as on the attributes below.
        recording: the traffic the grid was replayed on.
        memory_budget: most pool memory one worker's graphs may hold; default None.
        ties: other settings as good as the best; default 0.
        notes: lines to show with the advice; default ().
    """

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
    budgeted: bool = field(init=False, default=False)
    """Whether the grid or the logged run has a pool budget: then every setting's overrides
    name ``pool_budget_bytes`` (0: none)."""

    def __post_init__(self) -> None:
        budgeted = any(r.setting.pool_budget_bytes for r in self.results) or any(
            s.pool_budget_bytes for s in self.recording.logged.values()
        )
        object.__setattr__(self, "budgeted", budgeted)

    @property
    def overrides(self) -> dict[str, int | bool] | None:
        """The recommended ``--hf-overrides`` keys."""
        if self.best is None:
            return None
        return self.setting_keys(self.best.setting)

    def setting_keys(self, setting: Setting) -> dict[str, int | bool]:
        """Return the ``--hf-overrides`` keys of ``setting`` as this advice shows each one:
        ``skip_profiling`` where the log has profiling calls, ``pool_budget_bytes`` where
        the grid or the logged run has a budget (:attr:`budgeted`).

        Args:
            setting: one setting of the grid.
        """
        return setting.overrides(profiling=self.recording.profiling, budget=self.budgeted)

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
        if best.setting.pool_budget_bytes:
            budget = format_bytes(best.setting.pool_budget_bytes)
            text += f" (no new shape past a pool budget of {budget} an encoder)"
        if self.memory_budget is not None:
            text += f", within the budget of {format_bytes(self.memory_budget)}"
        if best.min_free_bytes is not None:
            text += f", leaving at least {format_bytes(best.min_free_bytes)} free"
        if logged is not None and best.setting.min_free_bytes < logged.setting.min_free_bytes:
            text += (
                f" (it lowers the memory floor from "
                f"{format_bytes(logged.setting.min_free_bytes)}: less headroom for activations"
            )
            if (runner := self.recording.unprofiled_runner) is not None:
                text += (
                    f", which the engine did not plan for: its profiling run ({runner}) "
                    "called no encoder"
                )
            text += ")"
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
        # A byte budget guards against the traffic to come: the tighter one first, none last.
        setting.pool_budget_bytes or INT64_MAX,
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
        grid: the settings to try; default None (:func:`default_grid`).
        memory_budget: most pool memory one worker's graphs may hold, in bytes; default
            None (no budget).
        progress: called with 1 as each setting has been replayed; default None.

    Returns:
        The ranked results; its ``best`` is None when no setting that graphs a call fits.

    Raises:
        ConfigError: a setting of ``grid`` is out of the range the config accepts.
    """
    if grid is None:
        grid = default_grid(recording)
    objective = "time" if recording.time_known else "hits"
    results = replay_grid(recording, grid, progress=progress)

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
        notes=(
            *_notes(recording),
            *_prepare_note(best, recording),
            *_memory_note(best, recording),
        ),
    )


def _prepare_note(best: Result | None, recording: Recording) -> tuple[str, ...]:
    """The calls no setting can graph (graphs paused, say), which every hit rate counts as
    misses; the best setting's warm-up misses, which starting from these logs' shapes takes
    away; and the calls of shapes too seldom to capture, which serving a call's items one
    by one may."""
    if best is None:
        return ()
    calls = best.setting.min_capture_calls
    seldom = recording.seldom_calls(calls)
    warmup = sum(e.misses.get(MissReason.WARMUP, 0) for e in best.encoders)
    notes = []
    # As logged: a setting that skips profiling makes more (its replay counts those too).
    ineligible = sum(sum(details.values()) for details in recording.ineligible.values())
    if ineligible:
        # The best setting graphs a call, so some calls could use a graph: rest > 0.
        share = f"{100 * best.hits / (best.calls - ineligible):.1f} %"
        notes.append(
            f"ineligible: {ineligible} of {best.calls} calls could use no graph under any "
            f"setting ({recording.why_ineligible()}); the hit rates count them as misses, and "
            f"of the other calls the recommended setting serves {share} from graphs"
        )
    captures = recording.serving_captures
    if warmup:
        held = ""
        if len(captures) == 1:
            took = format_seconds(captures[0])
            held = f"; this run's one capture while serving held up its call {took}"
        elif captures:
            held = (
                f"; this run's {len(captures)} captures while serving held up their calls "
                f"{format_seconds(sum(captures))} in all (the longest "
                f"{format_seconds(max(captures))})"
            )
        notes.append(
            f"warm-up: {warmup} of {best.calls} calls run eagerly before their shape is "
            f"captured{held}; a server restarted with encoder_cuda_graph_prepare_from naming "
            "these logs captures the shapes this run captured before it serves"
        )
    if seldom:
        times = "once" if calls == 2 else f"fewer than {calls} times"
        note = (
            f"seldom shapes: {seldom} of {best.calls} calls are of shapes called {times}, "
            f"which min_capture_calls {calls} never captures"
        )
        batched = [name for name, how in recording.items.items() if how == "batched"]
        if batched:
            note += (
                f"; {', '.join(batched)} served a step's images or clips in one call, and "
                "such mixes seldom recur: encoder_cuda_graph_split_items serves each item on "
                "its own shape's graph"
            )
        notes.append(note)
    return tuple(notes)


def _memory_misses(result: Result) -> int:
    return sum(e.misses.get(MissReason.MEMORY, 0) for e in result.encoders)


def _memory_note(best: Result | None, recording: Recording) -> tuple[str, ...]:
    """The best setting's calls left eager under the memory floor, and how much more
    device-free memory at each worker's start would let that setting capture their shapes
    (the fewest steps of :data:`MORE_FREE_STEP` after which none is left and every capture
    fits): memory only the engine can give, such as vLLM's KV cache."""
    if best is None or recording.free_source == "unknown":
        return ()
    short = _memory_misses(best)
    if not short:
        return ()

    def with_more(steps: int) -> Result | None:
        """The replay with ``steps`` more at each start; None while a miss or more is left."""
        extra = steps * MORE_FREE_STEP
        more = {place: free + extra for place, free in recording.free_bytes.items()}
        result = replay_grid(dataclasses.replace(recording, free_bytes=more), [best.setting])[0]
        return None if _memory_misses(result) or result.exhausts_memory else result

    head = (
        f"memory: {short} of {best.calls} calls run eagerly because the device-free memory "
        f"is under the floor ({format_bytes(best.setting.min_free_bytes)})"
    )
    cached = max(recording.deferral_cached.values(), default=0)
    if cached:
        # What the log's own deferrals saw cached: the engine reuses it, a new pool cannot.
        head += (
            f"; at its deferrals the caching allocator held up to {format_bytes(cached)} "
            "without tensors, which the engine reuses and a new graph pool cannot"
        )
    if recording.unprofiled_runner is not None:
        # Why memory is short inside vLLM: it left no room for the encoders' activations.
        head += (
            f"; the engine's profiling run ({recording.unprofiled_runner}) called no "
            "encoder, so it sized the KV cache without the encoders' activations, which "
            'run in the same memory as the graphs (docs/vllm.md, "A runner that profiles '
            'no encoder")'
        )
    enough = with_more(MORE_FREE_STEPS)
    if enough is None:
        top = format_bytes(MORE_FREE_STEPS * MORE_FREE_STEP)
        return (f"{head}; even {top} more free at the start leaves some of them eager",)
    # The fewest steps that do; the replay's memory model gives more memory no new miss.
    low, high = 0, MORE_FREE_STEPS
    while high - low > 1:
        middle = (low + high) // 2
        result = with_more(middle)
        if result is None:
            low = middle
        else:
            high, enough = middle, result
    return (
        f"{head}; with {format_bytes(high * MORE_FREE_STEP)} more free at each worker's start "
        "(memory the engine holds: for vLLM, a lower --gpu-memory-utilization, which takes "
        f"it from the KV cache) the recommended setting would serve {enough.hits} of its "
        f"{enough.calls} calls from graphs instead of {best.hits}",
    )


def _logged_result(recording: Recording, results: Sequence[Result]) -> Result | None:
    """The result of the setting the log ran with, when every encoder ran the same one."""
    settings = {s for s in recording.logged.values()}
    if len(settings) != 1:
        return None
    (setting,) = settings
    logged = next((r for r in results if r.setting == setting), None)
    return replay_grid(recording, [setting])[0] if logged is None else logged


def _notes(recording: Recording) -> tuple[str, ...]:
    notes = []
    for adapter, source in recording.time_source.items():
        costs = recording.costs.get(adapter, {})
        estimated = sum(cost.estimated_time for cost in costs.values())
        unknown = sum(cost.saving_s is None for cost in costs.values())
        first = sum(cost.first_calls_only for cost in costs.values())
        line = f"{adapter}: {source} time"
        if estimated:
            line += f", {estimated} of {len(costs)} keys' times estimated from the others'"
        if unknown:
            line += f", {unknown} keys with no time to estimate from"
        if first:
            # No key ran eagerly after its first call: nothing tells the one-off part.
            line += (
                f", {first} of {len(costs)} keys' eager times from their first calls only "
                "(one-off start-up costs included: their savings are upper bounds)"
            )
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
        "recorded bytes per input element" + _segments_note(recording.segments)
    )
    if recording.free_source == "unknown":
        notes.append(
            "device-free memory unknown (no memory deferral in the log; --free-bytes gives "
            "it): the floor is not simulated and only the logged floor is tried"
        )
    else:
        low = min(recording.free_bytes.values())
        how = "given" if recording.free_source == "given" else "estimated from memory deferrals"
        if not recording.free_changes:
            notes.append(f"device-free memory at start: {format_bytes(low)} ({how})")
        else:
            moved = [
                recording.free_bytes[place] + delta
                for place, steps in recording.free_changes.items()
                for _, delta in steps
            ]
            notes.append(
                f"device-free memory at start: {format_bytes(low)}, over the run "
                f"{format_bytes(min(moved))} to {format_bytes(max(moved))} besides the graphs' "
                "pools (estimated from the free memory read at captures and memory deferrals, "
                "and replayed as it moved)"
            )
    if recording.need_misses:
        notes.append(_need_note(recording))
    return tuple(notes)


def _need_note(recording: Recording) -> str:
    """The log's ``need`` misses, and which keys the replay applies that check to."""
    need = recording.need_misses
    each = ", ".join(f"{adapter} {n}" for adapter, n in sorted(need.items()))
    keys = sum(len(found) for found in recording.needs.values())
    checked = (
        f"the replay applies that check to the {keys} {'key' if keys == 1 else 'keys'} the "
        "log deferred for it, with the least need read for each, under settings with a pool "
        "budget"
        if keys
        else "no deferral event read a need, so the replay applies that check to no key"
    )
    return (
        f"need: {sum(need.values())} of the log's {recording.call_count} calls ran eagerly "
        "because device-free memory could not hold what their shape's eager calls took "
        f"(memory misses, detail need: {each}); {checked}; a key's need is logged only where "
        "it deferred, so the others' go unchecked"
    )


def _segments_note(segments: Mapping[str, str]) -> str:
    """What the recorded capture sizes stand for, from the segments they were recorded in."""
    fixed = sorted(adapter for adapter, kind in segments.items() if kind == "fixed")
    expandable = sorted(adapter for adapter, kind in segments.items() if kind == "expandable")
    note = ""
    if fixed:
        note += (
            f"; {', '.join(fixed)} captured in fixed segments (expandable_pools off): with "
            "encoder_cuda_graph_expandable_pools on, the default, a larger shape's capture "
            "reuses memory the smaller ones freed, so the pool figures are upper bounds there"
        )
    if expandable:
        note += (
            f"; {', '.join(expandable)} captured in expandable segments: with "
            "encoder_cuda_graph_expandable_pools false the pools would take more"
        )
    return note


def format_seconds(value: float | None) -> str:
    """Format seconds as ``1.25 s`` or ``12.5 ms``; ``unknown`` for None.

    Args:
        value: seconds, or None.
    """
    if value is None:
        return "unknown"
    if value >= 1:
        return f"{value:.2f} s"
    return f"{value * 1e3:.1f} ms"


def advice_json(advice: Advice) -> dict[str, Any]:
    """Return the advice as plain JSON data (``omnitrace advise --json``).

    Args:
        advice: what :func:`advise` returned.
    """

    def result(r: Result) -> dict[str, Any]:
        return {
            "setting": advice.setting_keys(r.setting),
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
        "workers": recording.workers,
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

    Args:
        text: the size; units are case-insensitive, spaces around them allowed.

    Returns:
        The size in bytes (a fraction of a unit rounded down).

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
