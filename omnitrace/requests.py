"""Where each request's time went: its phases from arrival to first token, joined from the
request and encoder-step events of vLLM's processes."""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from omnitrace import events as ev

__all__ = [
    "PHASES",
    "PHASE_HELP",
    "RequestJoin",
    "RequestView",
    "kind_of",
    "phases_of",
    "phases_panel",
    "quantile",
]

#: The phases of a request, in order; they add up to its TTFT.
PHASES = ("http", "render", "processor", "to_engine", "queue", "encoders", "prefill", "output")

PHASE_HELP: Mapping[str, str] = {
    "http": "arrival to vLLM's renderer: the request body and its parsing",
    "render": "vLLM's renderer: chat template, media fetch and decode, tokenising",
    "processor": "the model's multimodal processor (and any wait for its executor)",
    "to_engine": "processor end to the engine core's queue",
    "queue": "waiting in the scheduler's queue",
    "encoders": "encoder steps that encoded this request's items",
    "prefill": "first schedule to first token, less the encoders: the language model",
    "output": "first token in the engine core to the first token seen by the server",
}

# Each phase starts at one timestamp of RequestTimed; a phase whose start was not observed
# is folded into the phase before it, so the phases still add up to the TTFT.
_STARTS = (
    ("http", "arrival_ns"),
    ("render", "render_ns"),
    ("processor", "processor_ns"),
    ("to_engine", "processed_ns"),
    ("queue", "queued_ns"),
    ("prefill", "scheduled_ns"),
    ("output", "first_token_ns"),
)


def kind_of(event: ev.RequestTimed) -> str:
    """Return the request's kind as tables show it: ``image``, ``2 images``,
    ``audio``, ``image+audio``, ``text``."""
    parts = []
    for count, name in ((event.images, "image"), (event.audios, "audio")):
        if count == 1:
            parts.append(name)
        elif count > 1:
            parts.append(f"{count} {name}s")
    return "+".join(parts) or "text"


def phases_of(event: ev.RequestTimed, encoder_s: float = 0.0) -> dict[str, float]:
    """Return the seconds of each of :data:`PHASES` for one request.

    Args:
        event: the request's timestamps.
        encoder_s: seconds of encoder steps that served it, carved out of ``prefill`` (at
            most all of it); where the request has no scheduled time (vLLM's request stats
            off, as in ``vllm.LLM`` by default), out of the phases before it too.

    Returns:
        Every phase of :data:`PHASES`, each at least 0; they add up to ``event.ttft_s``
        (within float rounding) when its timestamps are in order.
    """
    end = event.monotonic_ns
    points = [(name, getattr(event, attr)) for name, attr in _STARTS]
    known = [(name, ns) for name, ns in points if ns is not None]
    out = dict.fromkeys(PHASES, 0.0)
    for (name, start), (_, stop) in zip(known, [*known[1:], ("", end)], strict=True):
        out[name] += max(0, stop - start) / 1e9
    # The encoder steps ran after the request was scheduled: out of prefill. Where the
    # scheduler's timestamps are missing (vLLM's request stats off), prefill's time sits in
    # the phases before it, and the steps are taken out of those, latest first.
    left = max(encoder_s, 0.0)
    before = ("prefill",) if event.scheduled_ns is not None else ("prefill", "queue", "to_engine")
    for name in before:
        taken = min(left, out[name])
        out[name] -= taken
        out["encoders"] += taken
        left -= taken
    return out


@dataclass(slots=True)
class _Step:
    """One EncoderBatchRan of one process, and the calls that fell inside it."""

    pid: int
    start_ns: int
    end_ns: int
    request_ids: tuple[str, ...]
    request_tokens: tuple[int, ...]
    modalities: tuple[str, ...]
    calls: list[dict[str, Any]] = field(default_factory=list)

    def share(self, request_id: str) -> float:
        """The fraction of this step's tokens that are ``request_id``'s."""
        total = sum(self.request_tokens)
        if request_id not in self.request_ids:
            return 0.0
        own = self.request_tokens[self.request_ids.index(request_id)]
        return own / total if total > 0 else 1.0 / len(self.request_ids)


@dataclass(frozen=True, slots=True)
class RequestView:
    """One request's phases and what served it, as ``top`` and ``trace`` show them."""

    event: ev.RequestTimed
    kind: str
    phases: Mapping[str, float]
    encoder_share_s: float
    steps: tuple[_Step, ...]

    @property
    def ttft_s(self) -> float:
        """Arrival to first token, in seconds."""
        return self.event.ttft_s

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready form (``trace --json``)."""
        e = self.event
        return {
            "request_id": e.request_id,
            "engine_request_id": e.engine_request_id,
            "kind": self.kind,
            "images": e.images,
            "image_pixels": e.image_pixels,
            "audios": e.audios,
            "audio_s": e.audio_s,
            "ttft_s": e.ttft_s,
            "phases": dict(self.phases),
            "encoder_share_s": self.encoder_share_s,
            "trace_id": e.trace_id or None,
            "encoder_steps": [
                {
                    "pid": s.pid,
                    "start_offset_s": (s.start_ns - e.arrival_ns) / 1e9,
                    "duration_s": (s.end_ns - s.start_ns) / 1e9,
                    "requests": len(s.request_ids),
                    "share": s.share(e.engine_request_id),
                    "modalities": s.modalities[s.request_ids.index(e.engine_request_id)],
                    "calls": list(s.calls),
                }
                for s in self.steps
            ],
        }


def _call_of(event: object) -> dict[str, Any] | None:
    if isinstance(event, ev.GraphReplayed):
        return {
            "encoder": event.adapter,
            "key": event.key,
            "outcome": "hit",
            "host_s": event.duration_s,
            "device_s": None,
        }
    if isinstance(event, ev.GraphMissed):
        return {
            "encoder": event.adapter,
            "key": event.key,
            "outcome": f"miss {event.reason.value}/{event.detail}",
            "host_s": event.duration_s,
            "device_s": None,
        }
    return None


#: Most calls linked to one encoder step (a step makes one call per encoder and item group).
_CALLS_PER_STEP = 1024
#: Encoder steps kept per kept request and process (a request's items take a few steps).
_STEPS_PER_REQUEST = 4


class RequestJoin:
    """Join RequestTimed and EncoderBatchRan events, from any number of processes' logs.

    Feed ``(event, pid)`` pairs in any order across processes (in order within one); then
    :meth:`requests` returns each request's :class:`RequestView`. With ``calls=True`` the
    encoder calls inside each step are kept (for ``trace``); otherwise only the steps.

    Args:
        calls: keep the calls of each step.
        keep: most requests kept (the newest); older ones are dropped and counted.
        only: keep just the requests with these ids (the client's id, or the engine's, which
            is the client's with a ``-`` suffix); None keeps every request.
    """

    def __init__(
        self, *, calls: bool = False, keep: int = 100_000, only: Iterable[str] | None = None
    ) -> None:
        self._calls = calls
        self._only = None if only is None else frozenset(only)
        # vLLM's engine id of a request is the client's id with a suffix (``-1a2b3c4d``).
        self._prefixes = None if only is None else tuple(f"{rid}-" for rid in self._only or ())
        self._requests: deque[ev.RequestTimed] = deque(maxlen=keep)
        self.dropped = 0
        self._keep = keep
        self._steps: dict[int, deque[_Step]] = {}
        # A step's event comes after its calls (the worker emits it when the step ends), so
        # each process's latest calls wait here for the step they belong to.
        self._recent: dict[int, deque[tuple[int, dict[str, Any]]]] = {}

    def _wanted(self, ids: Iterable[str]) -> bool:
        only = self._only
        if only is None:
            return True
        prefixes = self._prefixes or ()
        return any(rid in only or rid.startswith(prefixes) for rid in ids)

    def add(self, event: object, pid: int) -> None:
        """Take one event written by process ``pid``."""
        if isinstance(event, ev.RequestTimed):
            if not self._wanted((event.request_id, event.engine_request_id)):
                return
            if len(self._requests) == self._requests.maxlen:
                self.dropped += 1
            self._requests.append(event)
        elif isinstance(event, ev.EncoderBatchRan):
            recent = self._recent.pop(pid, None)
            if not self._wanted(event.request_ids):
                return
            step = _Step(
                pid,
                event.start_ns,
                event.monotonic_ns,
                event.request_ids,
                event.request_tokens,
                event.modalities,
            )
            if recent:
                step.calls = [call for at, call in recent if at >= event.start_ns]
            steps = self._steps.get(pid)
            if steps is None:
                # Bounded with the requests: a long follow keeps the steps of its window.
                steps = self._steps[pid] = deque(maxlen=_STEPS_PER_REQUEST * self._keep)
            steps.append(step)
        elif self._calls and isinstance(event, (ev.GraphReplayed, ev.GraphMissed)):
            call = _call_of(event)
            if call is not None:
                recent = self._recent.get(pid)
                if recent is None:
                    recent = self._recent[pid] = deque(maxlen=_CALLS_PER_STEP)
                recent.append((event.monotonic_ns, call))

    def requests(self) -> list[RequestView]:
        """Every request taken so far (the newest ``keep``), in the order they were seen."""
        by_request: dict[str, list[_Step]] = {}
        for steps in self._steps.values():
            for step in steps:
                for rid in step.request_ids:
                    by_request.setdefault(rid, []).append(step)
        views = []
        for event in self._requests:
            mine = sorted(by_request.get(event.engine_request_id, ()), key=lambda s: s.start_ns)
            lo = event.scheduled_ns if event.scheduled_ns is not None else event.arrival_ns
            hi = event.first_token_ns if event.first_token_ns is not None else event.monotonic_ns
            encoder_s = share_s = 0.0
            for step in mine:
                wall = max(0, min(step.end_ns, hi) - max(step.start_ns, lo)) / 1e9
                encoder_s += wall
                share_s += wall * step.share(event.engine_request_id)
            views.append(
                RequestView(
                    event, kind_of(event), phases_of(event, encoder_s), share_s, tuple(mine)
                )
            )
        return views


def quantile(values: Sequence[float], q: float) -> float:
    """The nearest-rank ``q`` quantile of ``values`` (NaN when there are none)."""
    ordered = sorted(values)
    if not ordered:
        return math.nan
    index = min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))
    return ordered[index]


def phases_panel(views: Sequence[RequestView], *, window: int = 1000) -> dict[str, Any]:
    """The "where TTFT goes" panel: per request kind, p50 and p99 of each phase and of
    the TTFT over the last ``window`` requests, and the encoders' ceiling.

    Returns:
        ``{"window": n, "kinds": [{"kind", "requests", "ttft_p50_s", "ttft_p99_s",
        "phases": {phase: {"p50_s", "p99_s", "mean_s"}}, "encoder_share": f,
        "graphs_save_at_most_s": s}]}``; ``encoder_share`` is the encoders' mean over the
        TTFT's mean, and ``graphs_save_at_most_s`` the encoders' mean (graphs cannot take
        more than the encoder steps off a request).
    """
    recent = list(views)[-window:]
    kinds: dict[str, list[RequestView]] = {}
    for view in recent:
        kinds.setdefault(view.kind, []).append(view)
    out = []
    for kind, group in sorted(kinds.items(), key=lambda item: (-len(item[1]), item[0])):
        ttfts = [v.ttft_s for v in group]
        phases = {}
        for phase in PHASES:
            values = [v.phases[phase] for v in group]
            phases[phase] = {
                "p50_s": quantile(values, 0.5),
                "p99_s": quantile(values, 0.99),
                "mean_s": sum(values) / len(values),
            }
        mean_ttft = sum(ttfts) / len(ttfts)
        encoders = phases["encoders"]["mean_s"]
        out.append(
            {
                "kind": kind,
                "requests": len(group),
                "ttft_p50_s": quantile(ttfts, 0.5),
                "ttft_p99_s": quantile(ttfts, 0.99),
                "phases": phases,
                "encoder_share": encoders / mean_ttft if mean_ttft > 0 else 0.0,
                "graphs_save_at_most_s": encoders,
            }
        )
    return {"window": len(recent), "kinds": out}
