"""Sharing the GIL between a compiling preparation and the calls that serve requests: a short
switch interval, and a compile that steps aside while an eager call is in flight
(docs/architecture.md, "The graph adapter", says why)."""

from __future__ import annotations

import contextlib
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from types import FrameType
from typing import Any

from omnitrace._validate import check_number

__all__ = [
    "COMPILE_SWITCH_INTERVAL",
    "COMPILE_YIELD",
    "CompileYield",
    "SwitchInterval",
    "YieldStatistics",
]


_MONITORING: Any = getattr(sys, "monitoring", None)
_DISABLE: Any = None if _MONITORING is None else _MONITORING.DISABLE
#: sys.monitoring tool ids a compile may take: the ones Python leaves unnamed (0, 1, 2 and 5
#: are the debugger's, coverage's, the profiler's and the optimizer's).
_TOOL_IDS = (3, 4)


class SwitchInterval:
    """Shorten the interpreter's GIL switch interval while any compiling preparation runs.

    Compiling is Python-heavy (dynamo, AOTAutograd, inductor) and holds the GIL for whole
    switch intervals (5 ms by default). A serving thread that drops the GIL many times per
    call (each kernel launch, each device wait) then waits for it again each time, and its
    calls stall behind the compile (the convoy effect). A short interval hands the GIL back
    to the serving threads within it, at the cost of a slower compile. The interval is a
    process-wide setting: it is restored once the last compiling preparation ends, unless
    someone else changed it meanwhile.
    """

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self._lock = threading.Lock()
        self._depth = 0
        self._saved: float | None = None

    @contextlib.contextmanager
    def short(self) -> Iterator[None]:
        with self._lock:
            if self._depth == 0:
                current = sys.getswitchinterval()
                self._saved = current if current > self.seconds else None
                if self._saved is not None:
                    sys.setswitchinterval(self.seconds)
            self._depth += 1
        try:
            yield
        finally:
            with self._lock:
                self._depth -= 1
                saved = self._saved
                if self._depth == 0 and saved is not None:
                    self._saved = None
                    # Another setting made meanwhile is the host's: leave it.
                    if abs(sys.getswitchinterval() - self.seconds) < 1e-9:
                        sys.setswitchinterval(saved)


@dataclass(frozen=True, slots=True)
class YieldStatistics:
    """What the compiling threads gave up to eager calls, since the process started."""

    pauses: int
    """Times a compiling thread paused for eager calls in flight."""
    paused_s: float
    """Seconds the compiling threads spent paused."""
    cut_short: int
    """Pauses that reached ``max_pause_s`` with an eager call still in flight."""


class CompileYield:
    """Let a compiling thread pause while eager encoder calls are in flight.

    A pause can fall while the compile holds a Python lock (a logging handler's, say); an
    eager call that needs the same lock then waits for the pause to reach ``max_pause_s``
    and for the slice that follows, no longer.

    Args:
        max_pause_s: the longest pause; the compile then runs for ``slice_s`` whatever comes.
        slice_s: how long the compile runs after a pause cut short.
        step_s: how often a paused thread looks whether the eager calls ended.
        use_monitoring: look through ``sys.monitoring`` where the interpreter has it.

    Raises:
        ConfigError: a time is not a positive number.
    """

    def __init__(
        self, max_pause_s: float, slice_s: float, step_s: float, *, use_monitoring: bool = True
    ) -> None:
        self.max_pause_s = check_number("max_pause_s", max_pause_s, unit="seconds")
        self.slice_s = check_number("slice_s", slice_s, unit="seconds")
        self.step_s = check_number("step_s", step_s, unit="seconds")
        # Tokens of the eager calls in flight: set.add and set.discard are atomic under the
        # GIL, so the serving threads mark their calls without a lock.
        self._in_flight: set[object] = set()
        self._lock = threading.Lock()
        self._pauses = 0
        self._paused_s = 0.0
        self._cut_short = 0
        self._use_monitoring = use_monitoring
        # Compiling threads (by ident) and until when each runs without pausing.
        self._run_until: dict[int, float] = {}
        self._watched: set[int] = set()
        self._tool: int | None = None

    @property
    def in_flight(self) -> int:
        """Eager calls marked in flight now."""
        return len(self._in_flight)

    def begin(self) -> object:
        """Mark an eager encoder call in flight (any thread); pass the token to :meth:`end`."""
        token = object()
        self._in_flight.add(token)
        return token

    def end(self, token: object) -> None:
        """Mark the eager call of ``token`` ended."""
        self._in_flight.discard(token)

    @contextlib.contextmanager
    def yielding(self) -> Iterator[None]:
        """Run the block with this thread pausing for eager calls (a compile's thread).

        The thread looks at every start of a Python function in the block, and pauses there:
        never inside a C function, so no C-level lock is held while paused. Where the
        interpreter has ``sys.monitoring`` (3.12 on) and a tool id is free, it looks through
        a ``PY_START`` callback: other threads' code locations are switched off at their
        first start, and the compile pays one callback per Python call. Elsewhere, a profile
        function on this thread alone (restored after), which also runs at returns and C
        calls, and costs a compile more.
        """
        ident = threading.get_ident()
        self._run_until[ident] = 0.0
        previous = sys.getprofile()
        watched = False
        try:
            watched = self._watch(ident)
            if not watched:
                in_flight, pause_at = self._in_flight, self._pause_at

                def profile(frame: FrameType, event: str, arg: Any) -> None:
                    if in_flight:
                        pause_at(ident)

                sys.setprofile(profile)
            yield
        finally:
            if watched:
                self._unwatch(ident)
            else:
                sys.setprofile(previous)
            del self._run_until[ident]

    @property
    def mechanism(self) -> str:
        """How compiling threads look for eager calls first: ``"monitoring"`` or
        ``"profile"`` (with no free tool id, ``"monitoring"`` falls back to the profile
        function)."""
        return "monitoring" if self._use_monitoring and _MONITORING is not None else "profile"

    def _pause_at(self, ident: int) -> None:
        """Pause compiling thread ``ident``, which saw eager calls in flight, unless its
        slice runs (the callers look at ``_in_flight`` first: they run at every call)."""
        if time.monotonic() >= self._run_until[ident]:
            self._run_until[ident] = self._pause()

    def _on_start(self, code: Any, offset: int) -> Any:
        """The ``PY_START`` callback, in every thread while a compile is watched."""
        ident = threading.get_ident()
        if ident not in self._run_until:
            return _DISABLE  # not a compiling thread: this location stays quiet for us
        if self._in_flight:
            self._pause_at(ident)
        return None

    def _watch(self, ident: int) -> bool:
        """Start the ``PY_START`` callback for compiling thread ``ident``; False where this
        interpreter cannot (no ``sys.monitoring``, or no free tool id)."""
        monitoring = _MONITORING
        if monitoring is None or not self._use_monitoring:
            return False
        with self._lock:
            if self._tool is None:
                for tool in _TOOL_IDS:
                    if monitoring.get_tool(tool) is None:
                        monitoring.use_tool_id(tool, "omnitrace")
                        monitoring.register_callback(
                            tool, monitoring.events.PY_START, self._on_start
                        )
                        monitoring.set_events(tool, monitoring.events.PY_START)
                        self._tool = tool
                        break
                else:
                    return False
            self._watched.add(ident)
        return True

    def _unwatch(self, ident: int) -> None:
        """Stop watching ``ident``; the last one gives the tool id back."""
        monitoring = _MONITORING
        assert monitoring is not None
        with self._lock:
            self._watched.discard(ident)
            tool = self._tool
            if self._watched or tool is None:
                return
            self._tool = None
            monitoring.set_events(tool, 0)
            monitoring.register_callback(tool, monitoring.events.PY_START, None)
            monitoring.free_tool_id(tool)

    def _pause(self) -> float:
        """Sleep while eager calls are in flight; return until when the compile runs on."""
        in_flight = self._in_flight
        start = time.monotonic()
        deadline = start + self.max_pause_s
        now = start
        while in_flight and now < deadline:
            time.sleep(self.step_s)
            now = time.monotonic()
        cut_short = bool(in_flight)
        with self._lock:
            self._pauses += 1
            self._paused_s += now - start
            self._cut_short += cut_short
        return now + self.slice_s if cut_short else 0.0

    def statistics(self) -> YieldStatistics:
        """Return the totals since the process started."""
        with self._lock:
            return YieldStatistics(self._pauses, self._paused_s, self._cut_short)


#: The GIL switch interval while a background compile runs (see SwitchInterval).
COMPILE_SWITCH_INTERVAL = SwitchInterval(0.0001)

#: Compiling preparations pause for eager calls up to 20 ms, then run 2 ms at least: under
#: eager calls with no gap, a compile keeps at least a tenth of the time.
COMPILE_YIELD = CompileYield(max_pause_s=0.02, slice_s=0.002, step_s=0.0001)
