"""Device time of encoder calls, measured without stalling the call path: marker pairs on the
call's stream, resolved by a daemon thread into ``DeviceTimed`` events."""

from __future__ import annotations

import contextlib
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from typing import Any, Protocol

from omnitrace.events import DeviceTimed, Event, Phase
from omnitrace.signature import Signature

__all__ = ["CAPTURES", "CaptureGate", "DeviceClock", "DeviceTimer", "DeviceTimers", "HostClock"]

_mono = time.monotonic_ns
_epoch = time.time_ns


class CaptureGate:
    """The graph captures under way in this process, and the device queries kept out of them.

    In CUDA's global capture mode (vLLM's manager's; the torch backend captures thread-local)
    a query of an event from another thread while a capture is under way is a prohibited
    call: it fails and invalidates the capture, which then fails on the capturing thread. The device
    timers query only through :meth:`querying`, which says no while a capture runs; a
    capture waits at most for one round of non-blocking queries to end.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._captures = 0

    @contextlib.contextmanager
    def capturing(self) -> Iterator[None]:
        """Count a capture (with its warm-up) as under way inside the block."""
        with self._lock:
            self._captures += 1
        try:
            yield
        finally:
            with self._lock:
                self._captures -= 1

    @contextlib.contextmanager
    def querying(self) -> Iterator[bool]:
        """Yield whether the device may be queried now; no capture starts inside the block."""
        with self._lock:
            yield self._captures == 0

    @property
    def under_way(self) -> int:
        """Captures under way now."""
        return self._captures


#: The process's one gate: every capture of every adapter and backend passes through it.
CAPTURES = CaptureGate()


class DeviceClock(Protocol):
    """Markers on the device's timeline (CUDA events), or a stand-in."""

    def mark(self) -> Any:
        """Record a marker on the current stream, without waiting for anything."""
        ...

    def passed(self, marker: Any) -> bool:
        """Whether the device has reached ``marker`` (never blocks)."""
        ...

    def seconds(self, start: Any, end: Any) -> float:
        """Seconds between two markers the device has passed."""
        ...

    def release(self, marker: Any) -> None:
        """Give a resolved marker back for reuse."""
        ...


class HostClock:
    """Host time as a device clock: for the simulated backend (tests, the CPU demo)."""

    def mark(self) -> float:
        return time.perf_counter()

    def passed(self, marker: Any) -> bool:
        return True

    def seconds(self, start: Any, end: Any) -> float:
        return float(end - start)

    def release(self, marker: Any) -> None:
        pass


class DeviceTimer:
    """Collect marker pairs of calls and resolve them into DeviceTimed events off the call path.

    Args:
        clock: where markers come from.
        emit: called with each DeviceTimed event, on the timer's thread.
        poll_interval: seconds between polls of the pending pairs.
    """

    def __init__(
        self,
        clock: DeviceClock,
        emit: Callable[[Event], None],
        *,
        poll_interval: float = 0.05,
    ) -> None:
        self.clock = clock
        self._emit = emit
        self._poll_interval = poll_interval
        self._pending: deque[tuple[Any, Any, str, Signature, str, Phase]] = deque()
        self._lock = threading.Lock()
        # Held by a resolve from taking pairs until it emitted their events, so a resolve that
        # finds nothing left (a flush) returns only once the events taken are emitted.
        self._resolving = threading.Lock()
        self._thread: threading.Thread | None = None
        self._wake = threading.Event()
        self._closed = False
        self.resolved = 0
        """DeviceTimed events emitted so far."""

    def start(self) -> Any:
        """Record the marker before a call."""
        return self.clock.mark()

    def stop(self, start: Any, adapter: str, signature: Signature, kind: str, phase: Phase) -> None:
        """Record the marker after a call and queue the pair (never blocks)."""
        self._pending.append((start, self.clock.mark(), adapter, signature, kind, phase))
        if self._thread is None:
            self._start_thread()

    @property
    def pending(self) -> int:
        """Pairs recorded but not resolved yet."""
        return len(self._pending)

    def _start_thread(self) -> None:
        with self._lock:
            if self._thread is not None or self._closed:
                return
            self._thread = threading.Thread(
                target=self._run, name="omnitrace-device-timer", daemon=True
            )
            self._thread.start()

    def _run(self) -> None:
        while not self._closed:
            self.resolve()
            self._wake.wait(self._poll_interval)
            self._wake.clear()

    def resolve(self, timeout: float = 0.0) -> bool:
        """Emit an event for every pair the device has passed; True when none is left.

        With ``timeout`` it waits up to that long for the device to pass the rest (tests and
        shutdown use it; the call path never does).
        """
        deadline = time.monotonic() + timeout
        while True:
            with self._resolving:
                left = self._resolve_passed()
            if not left:
                return True
            if time.monotonic() >= deadline:
                return False
            time.sleep(min(0.005, max(0.0, deadline - time.monotonic())))

    def _resolve_passed(self) -> int:
        """Emit the events of the pairs the device has passed; return how many pairs are left."""
        ready: list[DeviceTimed] = []
        with self._lock, CAPTURES.querying() as allowed:
            if not allowed:
                # A capture is under way: the markers are read once it has ended.
                return len(self._pending)
            kept: deque[tuple[Any, Any, str, Signature, str, Phase]] = deque()
            while self._pending:
                item = self._pending.popleft()
                start, end, adapter, signature, kind, phase = item
                if not self.clock.passed(end):
                    kept.append(item)
                    continue
                seconds = self.clock.seconds(start, end)
                self.clock.release(start)
                self.clock.release(end)
                ready.append(
                    DeviceTimed(adapter, signature, _mono(), _epoch(), kind, seconds, phase=phase)
                )
            # Pairs recorded meanwhile were appended behind the ones kept.
            self._pending.extendleft(reversed(kept))
            left = len(self._pending)
            self.resolved += len(ready)
        # Emitted outside the timer's lock: emitting takes the adapter's lock, which the
        # call path holds while it queues pairs.
        for event in ready:
            self._emit(event)
        return left

    def close(self, timeout: float = 1.0) -> bool:
        """Resolve what the device finishes within ``timeout`` and stop the thread."""
        done = self.resolve(timeout)
        self._closed = True
        self._wake.set()
        return done


class DeviceTimers:
    """One adapter's device timers, one per device, each made on first use.

    Args:
        new_timer: makes the timer of a device (its thread is the adapter's to close).
        lock: the adapter's lock, held while a timer is made.
    """

    def __init__(self, new_timer: Callable[[Any], DeviceTimer], lock: threading.RLock) -> None:
        self._new_timer = new_timer
        self._lock = lock
        self._timers: dict[Any, DeviceTimer] = {}

    def timer(self, device: Any) -> DeviceTimer:
        """The timer of ``device``, made on first use."""
        timers = self._timers
        timer = timers.get(device)
        if timer is None:
            with self._lock:
                timer = timers.get(device)
                if timer is None:
                    timer = timers[device] = self._new_timer(device)
        return timer

    def resolve(self, timeout: float) -> bool:
        """Resolve every timer's pairs, each waiting up to ``timeout``; True when none is left."""
        return all(timer.resolve(timeout) for timer in list(self._timers.values()))

    def close(self, deadline: float) -> bool:
        """Close every timer by ``deadline`` (``time.monotonic()``); True when none was left."""
        return all(
            timer.close(max(0.0, deadline - time.monotonic()))
            for timer in list(self._timers.values())
        )
