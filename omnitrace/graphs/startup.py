"""Graphs prepared before serving for the shapes an earlier run's event logs show captured
(``encoder_cuda_graph_prepare_from``)."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from omnitrace.eventlog import read_events
from omnitrace.eventlog.patterns import expand, is_pattern
from omnitrace.events import GraphCaptured, GraphReplayed
from omnitrace.signature import Signature

if TYPE_CHECKING:
    from omnitrace.graphs.adapter import EncoderCudaGraph

__all__ = ["capture_order", "prepare_adapters", "recorded_signatures", "zero_inputs"]

logger = logging.getLogger(__name__)
#: The start-up's clock (a test steps it).
_clock = time.perf_counter

_Shapes = tuple[tuple[str, tuple[int, ...]] | None, ...]


def _shapes(signature: Signature) -> _Shapes:
    """What a recorded key is across processes: dtypes and shapes (devices and streams are
    this process's own)."""
    return tuple(None if spec is None else (spec.dtype, spec.shape) for spec in signature.inputs)


def recorded_signatures(pattern: str) -> tuple[dict[str, list[Signature]], list[Path]]:
    """Read the event logs ``pattern`` names (a path or a glob pattern; rotated files too).

    Returns:
        Per adapter name, the signatures its graphs were captured for there, the most
        replayed first (then in the order first captured), each once whatever the device
        or stream; and the logs read. A log that cannot be read is skipped with a warning
        naming it; a pattern that matches nothing gives nothing, with one line.
    """
    ranked, _, read = _recorded(pattern)
    return ranked, read


#: Per adapter name and recorded shapes, the most memory one capture of them took in the
#: logs (allocator growth plus static buffers, the budget's measure).
_Costs = dict[str, dict[_Shapes, int]]


def _recorded(pattern: str) -> tuple[dict[str, list[Signature]], _Costs, list[Path]]:
    """:func:`recorded_signatures`, with what each recorded capture took."""
    paths = [path for path in expand([Path(pattern)]) if not is_pattern(path)]
    captured: dict[str, dict[_Shapes, Signature]] = {}
    costs: _Costs = {}
    hits: dict[tuple[str, _Shapes], int] = {}
    read: list[Path] = []
    for path in paths:
        # A log that fails part way gives none of its shapes, as its warning says: what it
        # gave before the failure is counted apart until it is read to the end.
        mine: dict[str, dict[_Shapes, Signature]] = {}
        took: _Costs = {}
        replays: dict[tuple[str, _Shapes], int] = {}
        try:
            for event in read_events(path):
                if isinstance(event, GraphCaptured):
                    shapes = _shapes(event.signature)
                    mine.setdefault(event.adapter, {}).setdefault(shapes, event.signature)
                    size = max(0, event.bytes_reserved) + max(0, event.static_bytes)
                    sizes = took.setdefault(event.adapter, {})
                    sizes[shapes] = max(sizes.get(shapes, 0), size)
                elif isinstance(event, GraphReplayed):
                    key = (event.adapter, _shapes(event.signature))
                    replays[key] = replays.get(key, 0) + 1
        except (OSError, ValueError) as exc:  # EventLogError is a ValueError
            logger.warning(
                "omnitrace: encoder_cuda_graph_prepare_from: cannot read %s (%s: %s); its "
                "shapes are not prepared",
                path,
                type(exc).__name__,
                exc,
            )
            continue
        read.append(path)
        for adapter, found in mine.items():
            for shapes, signature in found.items():
                captured.setdefault(adapter, {}).setdefault(shapes, signature)
        for adapter, sizes in took.items():
            kept = costs.setdefault(adapter, {})
            for shapes, size in sizes.items():
                kept[shapes] = max(kept.get(shapes, 0), size)
        for key, count in replays.items():
            hits[key] = hits.get(key, 0) + count
    if not read:
        logger.warning(
            "omnitrace: encoder_cuda_graph_prepare_from: no event log at %r; no graph is "
            "prepared before serving",
            pattern,
        )
    ranked = {}
    for adapter, found in captured.items():
        order = list(found)
        order.sort(key=lambda shapes: -hits.get((adapter, shapes), 0))  # stable: capture order
        ranked[adapter] = [found[shapes] for shapes in order]
    return ranked, costs, read


def zero_inputs(signature: Signature, device: torch.device) -> tuple[torch.Tensor | None, ...]:
    """Zero-filled inputs of ``signature``'s dtypes and shapes on ``device``.

    A graph replays whatever values its inputs hold, so one captured from zeros serves every
    call of its shapes as one captured from a call would; zeros are valid indices too.

    Raises:
        ValueError: a dtype torch does not have.
    """
    unknown = _unknown_dtype(signature)
    if unknown is not None:
        raise ValueError(f"not a torch dtype: {unknown!r}")
    return tuple(
        None
        if spec is None
        else torch.zeros(spec.shape, dtype=getattr(torch, spec.dtype), device=device)
        for spec in signature.inputs
    )


def _torch_dtype(name: str) -> torch.dtype | None:
    """Torch's dtype of that name, or None where torch has none."""
    found = getattr(torch, name, None)
    return found if isinstance(found, torch.dtype) else None


def _unknown_dtype(signature: Signature) -> str | None:
    """The first dtype of ``signature`` that torch does not have, or None."""
    for spec in signature.inputs:
        if spec is not None and _torch_dtype(spec.dtype) is None:
            return spec.dtype
    return None


def prepare_adapters(
    adapters: Sequence[EncoderCudaGraph], device: torch.device, *, seconds: float | None = None
) -> dict[str, dict[str, int]]:
    """Capture, for each adapter with ``prepare_from``, the shapes recorded for its name,
    in :func:`capture_order` (the largest first, where the budget allows).

    The adapters take turns, a shape each, so each gets its most replayed shapes first when
    time runs out. Stops an adapter at its first capacity or memory refusal (later shapes
    cannot fit either). Logs a line per shape and one per adapter. Run it before serving, in
    the engine's phase and grad mode (the vLLM plugin does so inside
    ``torch.inference_mode``).

    Args:
        adapters: the adapters; those without ``prepare_from`` are left alone.
        device: the device to capture on.
        seconds: how long the preparation may take, None for no limit. A shape is not
            started when it would end past that, at the pace of the adapter's last capture
            (any adapter's longest, before its first); the shapes left are counted
            ``left: time`` and captured as while serving, when first seen.

    Returns:
        Per adapter name, the outcomes counted (``captured``, ``held``, ``capacity: cap``,
        ``left: time`` ...).

    Raises:
        EncoderGraphFailedError: a capture failed (the adapter is terminal, as it would be
            for a failed capture while serving).
    """
    read: dict[str, tuple[dict[str, list[Signature]], _Costs]] = {}
    plans: list[_Plan] = []
    for adapter in adapters:
        pattern = adapter.config.prepare_from
        if not pattern:
            continue
        if pattern not in read:
            read[pattern] = _recorded(pattern)[:2]
        ranked, costs = read[pattern]
        order = capture_order(
            ranked.get(adapter.name, ()),
            costs.get(adapter.name, {}),
            slots=adapter.config.max_graphs - adapter.num_graphs,
            budget=adapter.config.pool_budget_bytes,
        )
        plans.append(_Plan(adapter, order))
    _take_turns(plans, device, None if seconds is None else _clock() + seconds)
    for plan in plans:
        _log_prepared(plan)
    return {plan.adapter.name: plan.counts for plan in plans}


def capture_order(
    signatures: Iterable[Signature], costs: Mapping[_Shapes, int], *, slots: int, budget: int
) -> list[Signature]:
    """The order in which to capture recorded ``signatures`` (given the most replayed first).

    The most replayed shapes that fit ``slots`` graphs come first, the largest inputs first
    among them: graphs captured into one shared pool reuse the memory an earlier capture
    freed, so a smaller graph captured after a larger one fits in blocks the larger left,
    where a larger graph captured after smaller ones grows the pool beyond them. Then the
    shapes past the cap. Where the captures the logs recorded for those shapes do not fit
    ``budget`` together, the given order stands instead: a capture's memory is known only
    after it, and a large graph captured first could take the budget that the smaller, more
    replayed ones would have used.

    Args:
        signatures: the recorded shapes, the most replayed first.
        costs: per recorded shapes (:func:`_shapes`), the memory one capture of them took
            in the logs (allocator growth plus static buffers); a shape without one costs 0.
        slots: graphs the adapter may still take (``max_graphs`` less those it holds).
        budget: the pool budget in bytes; 0 or less: none.

    Returns:
        The same signatures, reordered.
    """
    given = list(signatures)
    chosen = given[: max(0, slots)]
    if budget > 0 and sum(costs.get(_shapes(s), 0) for s in chosen) > budget:
        return given
    # Stable: shapes of equal size keep the replay order.
    return sorted(chosen, key=_input_bytes, reverse=True) + given[len(chosen) :]


def _input_bytes(signature: Signature) -> int:
    """Bytes of ``signature``'s inputs (0 for a dtype torch does not have)."""
    total = 0
    for spec in signature.inputs:
        dtype = None if spec is None else _torch_dtype(spec.dtype)
        if spec is not None and dtype is not None:
            total += spec.numel * dtype.itemsize
    return total


class _Plan:
    """One adapter's preparation: the shapes still to capture, what each gave, how long."""

    def __init__(self, adapter: EncoderCudaGraph, order: Sequence[Signature]) -> None:
        self.adapter = adapter
        self.todo = list(order)
        self.total = len(self.todo)
        self.counts: dict[str, int] = {}
        self.took: list[float] = []  # per shape tried
        self.captures: list[float] = []  # per shape captured: the pace (the rest take ~0)

    def count(self, outcome: str, number: int = 1) -> None:
        self.counts[outcome] = self.counts.get(outcome, 0) + number

    def pace(self) -> float | None:
        """Seconds a capture took on average here, None before the first."""
        return sum(self.captures) / len(self.captures) if self.captures else None


def _take_turns(plans: Sequence[_Plan], device: torch.device, deadline: float | None) -> None:
    """Prepare ``plans`` a shape each in turn, until done or ``deadline`` (``_clock``)."""
    while any(plan.todo for plan in plans):
        for plan in plans:
            if not plan.todo:
                continue
            if deadline is not None and _clock() + _next_takes(plan, plans) > deadline:
                _out_of_time(plans)
                return
            _prepare_next(plan, plans, device)


def _next_takes(plan: _Plan, plans: Sequence[_Plan]) -> float:
    """How long ``plan``'s next shape should take: its last capture's time, else the longest
    capture of any adapter, else 0."""
    if plan.captures:
        return plan.captures[-1]
    return max((took for other in plans for took in other.captures), default=0.0)


def _prepare_next(plan: _Plan, plans: Sequence[_Plan], device: torch.device) -> None:
    """Capture ``plan``'s next shape and log it; a capacity or memory refusal ends the plan."""
    signature = plan.todo.pop(0)
    began = _clock()
    # Checked here rather than caught around prepare(): an error of the capture itself
    # (a ValueError too, possibly) must stop the start, not be counted as a shape.
    unknown = _unknown_dtype(signature)
    if unknown is None:
        outcome = plan.adapter.prepare(signature, device)
    else:
        outcome = f"unusable: not a torch dtype: {unknown!r}"
    plan.count(outcome)
    took = _clock() - began
    plan.took.append(took)
    if outcome == "captured":
        plan.captures.append(took)
    stop = outcome.startswith(("capacity", "memory"))
    if stop:
        plan.todo.clear()
    # A compiled capture takes seconds: a line per shape shows the start-up's progress,
    # and how long the shapes still to come should take at the pace so far.
    logger.info(
        "omnitrace: %r shape %d of %d (%s): %s in %.1f s%s",
        plan.adapter.name,
        len(plan.took),
        plan.total,
        signature.inputs_text,
        outcome,
        took,
        "" if stop else _left(plans),
    )


def _eta_s(plans: Sequence[_Plan]) -> float:
    """How long the shapes still to come should take, each adapter's at its mean pace (one
    that has none yet at the others')."""
    paces = [pace for plan in plans if (pace := plan.pace()) is not None]
    fallback = sum(paces) / len(paces) if paces else 0.0
    return sum(len(plan.todo) * (plan.pace() or fallback) for plan in plans if plan.todo)


def _duration(seconds: int) -> str:
    """``"2 min 05 s"``, or ``"45 s"`` under a minute."""
    if seconds < 60:
        return f"{seconds} s"
    return f"{seconds // 60} min {seconds % 60:02d} s"


def _left(plans: Sequence[_Plan]) -> str:
    """``"; about 2 min 05 s left"`` (:func:`_eta_s`); empty when under a second is left
    (plain captures)."""
    seconds = round(_eta_s(plans))
    return "" if seconds < 1 else f"; about {_duration(seconds)} left"


def _out_of_time(plans: Sequence[_Plan]) -> None:
    """Count every shape still to come ``left: time`` and say so in one warning line."""
    left = {plan.adapter.name: len(plan.todo) for plan in plans if plan.todo}
    more = round(_eta_s(plans))
    for plan in plans:
        if plan.todo:
            plan.count("left: time", len(plan.todo))
            plan.todo.clear()
    logger.warning(
        "omnitrace: out of start-up time to prepare recorded shapes (%s left, about %s "
        "more at the pace so far); they are captured as while serving, when first seen",
        ", ".join(f"{name} {count}" for name, count in left.items()),
        _duration(more),
    )


def _log_prepared(plan: _Plan) -> None:
    logger.info(
        "omnitrace: %r prepared %d of %d recorded shapes before serving in %.1f s (%s)",
        plan.adapter.name,
        plan.counts.get("captured", 0),
        plan.total,
        sum(plan.took),
        ", ".join(f"{name} {count}" for name, count in sorted(plan.counts.items())) or "none",
    )
