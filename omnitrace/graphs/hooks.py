"""What an adapter lends the parts that work for it (its name, lock, event path and state), so
the capture and the preparation report through it without importing it."""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass

import torch

from omnitrace.events import Event, Phase
from omnitrace.signature import Signature

__all__ = ["AdapterHooks"]


@dataclass(frozen=True, slots=True)
class AdapterHooks:
    """One adapter's name, lock and callbacks, for the parts that work for it."""

    name: str
    """The adapter's name, for events, thread names and log lines."""
    lock: threading.RLock
    """The adapter's lock, held while a capture or a preparation's outcome is recorded."""
    emit: Callable[[Event], None]
    """The adapter's event path: its stats fold, then the bus."""
    phase: Callable[[], Phase]
    """The engine phase events are tagged with, read when an event is made."""
    fail: Callable[[BaseException, Signature, torch.device, int], str]
    """The capture-failure contract: emit ``CaptureFailed`` and make the adapter terminal;
    returns the failure as text."""
    failed: Callable[[], bool]
    """Whether the adapter is terminal."""
