"""A seeded, MiniCPM-o-shaped request mix for the demo: recurring and one-off image slices and
audio clips, a few streaming calls, and a burst of new shapes that runs into the graphs' limits."""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Literal

__all__ = ["Request", "TrafficMix"]

Kind = Literal["vision", "audio", "streaming"]

#: Patch grids (rows, cols) of slices that recur: a full 448x448 slice, two other aspect
#: ratios MiniCPM-o's slicing produces, and the 16x16 thumbnail.
RECURRING_GRIDS: tuple[tuple[int, int], ...] = ((32, 32), (28, 36), (16, 16), (24, 40))
FRAMES_PER_SECOND = 100
#: Audio clip lengths in mel frames: 1 s chunks, then 3 s and 10 s clips.
RECURRING_FRAMES: tuple[int, ...] = tuple(s * FRAMES_PER_SECOND for s in (1, 3, 10))


@dataclass(frozen=True, slots=True)
class Request:
    """One encoder call of the demo."""

    kind: Kind
    """Which encoder the call goes to (vision slices, audio clips, streaming chunks)."""
    batch: int
    """Slices or clips in the call."""
    length: int
    """Tokens per vision slice, or mel frames of an audio clip."""
    masked: bool = False
    """Whether a vision batch carries a padding mask."""

    @property
    def label(self) -> str:
        if self.kind == "vision":
            return f"vision {self.batch}x{self.length} tokens" + (" masked" if self.masked else "")
        seconds = self.length / FRAMES_PER_SECOND
        return f"{self.kind} {self.batch}x{seconds:g}s"


class TrafficMix:
    """Draw requests from a seeded MiniCPM-o-like mix.

    Args:
        seed: the random seed (same seed, same traffic).
        streaming_share: fraction of audio requests that are streaming (stateful) calls.
    """

    def __init__(self, seed: int = 0, *, streaming_share: float = 0.08) -> None:
        self._rng = random.Random(seed)
        self._streaming_share = streaming_share
        self._burst: list[Request] = []

    def next(self, *, burst: bool = False) -> Request:
        """Return the next request; ``burst`` switches to the late burst of new shapes."""
        rng = self._rng
        # During the burst, ordinary traffic continues alongside the new shapes.
        if burst and rng.random() < 0.6:
            return self._next_burst()
        if rng.random() < 0.55:
            return self._vision()
        return self._audio()

    def _vision(self) -> Request:
        rng = self._rng
        roll = rng.random()
        if roll < 0.8:
            # Recurring grids, weighted towards full slices as in document-heavy traffic.
            rows, cols = rng.choices(RECURRING_GRIDS, weights=(6, 3, 4, 1))[0]
            return Request("vision", 1, rows * cols)
        if roll < 0.88:
            # Two slices of an image batched together with a padding mask.
            return Request("vision", 2, 32 * 32, masked=True)
        # A one-off grid, from an unusual aspect ratio.
        return Request("vision", 1, rng.randint(6, 31) * rng.randint(6, 31))

    def _audio(self) -> Request:
        rng = self._rng
        if rng.random() < self._streaming_share:
            return Request("streaming", 1, FRAMES_PER_SECOND)
        roll = rng.random()
        if roll < 0.85:
            frames = rng.choices(RECURRING_FRAMES, weights=(8, 2, 1))[0]
            return Request("audio", 1, frames)
        # A one-off clip length (the tail of an utterance).
        return Request("audio", 1, 2 * rng.randint(60, 700))

    def _next_burst(self) -> Request:
        if not self._burst:
            rng = self._rng
            # Several new shapes at once (a new client, a new image size), each seen twice
            # in a row so warm-up alone would not stop their capture: the cap does.
            fresh = [
                Request("vision", 1, rng.randint(33, 40) * rng.randint(20, 28)),
                Request("audio", 1, 2 * rng.randint(710, 1400)),
            ]
            self._burst = [r for r in fresh for _ in range(3)]
            self._burst.reverse()
        return self._burst.pop()
