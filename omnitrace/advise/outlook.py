"""End to end: what a setting would take off each request kind's time to first token, from
the request events and the key costs of the replay."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from omnitrace.advise.recording import KeyCost, Recording
from omnitrace.requests import RequestView, quantile
from omnitrace.signature import Signature

__all__ = ["KindOutlook", "outlook", "outlook_json"]

# The logged outcomes a setting can change, as RequestJoin spells them.
_HIT = "hit"
_CAPTURABLE = ("miss capacity/", "miss memory/")


@dataclass(frozen=True, slots=True)
class KindOutlook:
    """One request kind's logged and predicted time to first token under a setting."""

    kind: str
    requests: int
    ttft_p50_s: float
    ttft_p99_s: float
    encoders_p50_s: float
    """The ``encoders`` phase's p50 in the log."""
    predicted_p50_s: float | None
    """The TTFT's p50 under the setting (None: a changed call's saving is unknown)."""
    predicted_p99_s: float | None
    calls: int
    """Encoder calls linked to these requests' steps."""
    changed: int
    """Of those, calls whose outcome the setting changes."""

    @property
    def change_p50_s(self) -> float | None:
        """Predicted minus logged TTFT p50 (negative: faster)."""
        if self.predicted_p50_s is None:
            return None
        return self.predicted_p50_s - self.ttft_p50_s


def _by_text(recording: Recording) -> dict[str, dict[str, tuple[Signature, KeyCost]]]:
    return {
        adapter: {key.text: (key, cost) for key, cost in costs.items()}
        for adapter, costs in recording.costs.items()
    }


def _saving(
    view: RequestView,
    costs: Mapping[str, Mapping[str, tuple[Signature, KeyCost]]],
    captured: Mapping[str, frozenset[Signature]],
) -> tuple[float | None, int, int]:
    """The request's predicted saving (None: unknown), its calls and the changed ones."""
    saving = 0.0
    unknown = False
    calls = changed = 0
    for step in view.steps:
        for call in step.calls:
            calls += 1
            adapter = str(call.get("encoder", ""))
            found = costs.get(adapter, {}).get(str(call.get("key", "")))
            if found is None:
                continue  # a key no setting could graph
            key, cost = found
            outcome = str(call.get("outcome", ""))
            will_hit = key in captured.get(adapter, frozenset())
            if outcome == _HIT and not will_hit:
                sign = -1.0
            elif outcome.startswith(_CAPTURABLE) and will_hit:
                sign = 1.0
            else:
                continue
            changed += 1
            if cost.saving_s is None:
                unknown = True
            else:
                saving += sign * cost.saving_s
    if unknown:
        return None, calls, changed
    # Graphs take at most the encoder steps off a request.
    return min(saving, view.phases["encoders"]), calls, changed


def outlook(
    views: Sequence[RequestView],
    recording: Recording,
    captured: Mapping[str, frozenset[Signature]],
) -> tuple[KindOutlook, ...]:
    """Each request kind's TTFT as logged and as predicted with ``captured`` graphed.

    Args:
        views: the joined requests (with their steps' calls: ``RequestJoin(calls=True)``).
        recording: the replay's recording of the same logs (its key costs).
        captured: per encoder, the keys the setting captures (``replay(...).captured``).

    Returns:
        One :class:`KindOutlook` per kind, the most requested first; empty without requests.
    """
    costs = _by_text(recording)
    groups: dict[str, list[RequestView]] = {}
    for view in views:
        groups.setdefault(view.kind, []).append(view)
    out = []
    for kind, group in sorted(groups.items(), key=lambda item: (-len(item[1]), item[0])):
        ttfts = [v.ttft_s for v in group]
        predicted: list[float] | None = []
        calls = changed = 0
        for view in group:
            saving, n, c = _saving(view, costs, captured)
            calls += n
            changed += c
            if saving is None or predicted is None:
                predicted = None
            else:
                predicted.append(view.ttft_s - saving)
        out.append(
            KindOutlook(
                kind=kind,
                requests=len(group),
                ttft_p50_s=quantile(ttfts, 0.5),
                ttft_p99_s=quantile(ttfts, 0.99),
                encoders_p50_s=quantile([v.phases["encoders"] for v in group], 0.5),
                predicted_p50_s=None if predicted is None else quantile(predicted, 0.5),
                predicted_p99_s=None if predicted is None else quantile(predicted, 0.99),
                calls=calls,
                changed=changed,
            )
        )
    return tuple(out)


def outlook_json(kinds: Sequence[KindOutlook]) -> list[dict[str, Any]]:
    """JSON-ready rows of :func:`outlook` (``advise --json``'s ``requests``)."""
    return [
        {
            "kind": k.kind,
            "requests": k.requests,
            "ttft_p50_s": k.ttft_p50_s,
            "ttft_p99_s": k.ttft_p99_s,
            "encoders_p50_s": k.encoders_p50_s,
            "predicted_ttft_p50_s": k.predicted_p50_s,
            "predicted_ttft_p99_s": k.predicted_p99_s,
            "change_p50_s": k.change_p50_s,
            "calls": k.calls,
            "changed_calls": k.changed,
        }
        for k in kinds
    ]
