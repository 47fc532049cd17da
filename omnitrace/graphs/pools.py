"""Graph memory pools and capture streams, per adapter, device and replay stream (or one per
graph when sharing is off)."""

from __future__ import annotations

import itertools
import threading
from dataclasses import dataclass
from typing import Any

import torch

from omnitrace.graphs.backends.base import GraphBackend

__all__ = ["PoolRegistry", "PoolSlot"]

# Process-wide, so a pool id names one pool whatever adapter reports it.
_pool_ids = itertools.count(1)
_pool_ids_lock = threading.Lock()


def _next_pool_id() -> int:
    with _pool_ids_lock:
        return next(_pool_ids)


@dataclass(frozen=True, slots=True)
class PoolSlot:
    """A pool handle and the capture stream that captures into it."""

    pool_id: int
    pool: Any
    capture_stream: Any
    capture_stream_id: int


class PoolRegistry:
    """Hand out pool slots for one adapter."""

    __slots__ = ("_backend", "_share", "_slots")

    def __init__(self, backend: GraphBackend, *, share: bool) -> None:
        self._backend = backend
        self._share = share
        self._slots: dict[tuple[torch.device, int], PoolSlot] = {}

    def slot_for(self, device: torch.device, replay_stream: int) -> PoolSlot:
        """Return the slot a new capture on ``device`` for ``replay_stream`` must use."""
        if self._share:
            slot = self._slots.get((device, replay_stream))
            if slot is not None:
                return slot
        stream, stream_id = self._backend.new_capture_stream(device)
        slot = PoolSlot(_next_pool_id(), self._backend.new_pool(device), stream, stream_id)
        if self._share:
            self._slots[(device, replay_stream)] = slot
        return slot

    def shared_slots(self) -> dict[tuple[torch.device, int], PoolSlot]:
        """Return the shared slots created so far (empty with sharing off)."""
        return dict(self._slots)
