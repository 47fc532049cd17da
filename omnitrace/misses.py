"""Why calls missed, finer than the reason: the misses of each (reason, detail) per encoder,
as the coverage fold counts them and every output shows them."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from omnitrace.events import MissReason

__all__ = [
    "MissCause",
    "cause_label",
    "causes_json",
    "counts_of",
    "merge",
    "telling",
]

#: The detail each reason carries when it says no more than the reason itself.
_PLAIN = {MissReason.CAPACITY: "cap", MissReason.MEMORY: "floor"}


@dataclass(frozen=True, slots=True)
class MissCause:
    """How many of an encoder's misses had this reason and detail."""

    reason: MissReason
    detail: str
    misses: int


def causes_json(causes: Iterable[MissCause]) -> dict[str, dict[str, int]]:
    """``{reason: {detail: misses}}``, every reason in display order (empty ones too)."""
    out: dict[str, dict[str, int]] = {reason.value: {} for reason in MissReason.display_order()}
    for cause in causes:
        out[cause.reason.value][cause.detail] = cause.misses
    for reason, details in out.items():
        out[reason] = dict(sorted(details.items(), key=lambda item: (-item[1], item[0])))
    return out


def telling(causes: Iterable[MissCause]) -> tuple[MissCause, ...]:
    """The causes an operator acts on: not warm-ups (expected), not a detail that only
    repeats its reason (a capacity miss's ``cap``, a memory miss's ``floor``)."""
    return tuple(
        cause
        for cause in causes
        if cause.reason is not MissReason.WARMUP and _PLAIN.get(cause.reason) != cause.detail
    )


def cause_label(cause: MissCause) -> str:
    """A cause as a row names it: the detail of an ineligible miss (``cpu``), else the
    reason's short name and the detail (``cap other``); escape it before it is shown."""
    if cause.reason is MissReason.INELIGIBLE:
        return cause.detail
    return f"{cause.reason.short} {cause.detail}"


def merge(per_worker: Iterable[Iterable[MissCause]]) -> tuple[MissCause, ...]:
    """Sum the causes of one encoder over several workers, most first."""
    counts: dict[tuple[MissReason, str], int] = {}
    for causes in per_worker:
        for cause in causes:
            key = (cause.reason, cause.detail)
            counts[key] = counts.get(key, 0) + cause.misses
    order = {reason: index for index, reason in enumerate(MissReason.display_order())}
    merged = [MissCause(reason, detail, count) for (reason, detail), count in counts.items()]
    merged.sort(key=lambda cause: (-cause.misses, order[cause.reason], cause.detail))
    return tuple(merged)


def counts_of(details: Mapping[str, int]) -> tuple[MissCause, ...]:
    """Ineligible causes from ``{detail: misses}`` (as advise's recording keeps them)."""
    return merge([[MissCause(MissReason.INELIGIBLE, d, n) for d, n in details.items()]])
