"""The event bus itself: ``emit()`` into the folds and the pending queue, the pump into the
sinks' channels, ``flush()``, ``close()`` and the statistics (see docs/architecture.md,
"The event bus")."""

from __future__ import annotations

import asyncio
import logging
import signal
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from omnitrace._validate import check_int, check_number
from omnitrace.bus._channels import SinkChannels, sink_name
from omnitrace.bus._folds import FoldRegistry
from omnitrace.bus._process import (
    EXIT_TIMEOUT_S,
    install_close_on_signal,
    register_atexit,
    track_forks,
    unregister_atexit,
)
from omnitrace.bus._runner import CLOSE_GRACE_S, POLL_S, LoopRunner, SinkThread, StopRequest
from omnitrace.bus._types import (
    DROP_REASONS,
    BusStatistics,
    EventsNotWritten,
    Fold,
    Sink,
    SinkStatistics,
)
from omnitrace.coverage import DEFAULT_COVERAGE_KEYS, AdapterCoverage
from omnitrace.events import EVENT_TYPES, Event
from omnitrace.stats import AdapterStats

__all__ = [
    "DRAIN_INTERVAL_RANGE_S",
    "DROP_REASONS",
    "MAX_QUEUE_SIZE",
    "TIMEOUT_RANGE_S",
    "BusStatistics",
    "EventBus",
    "EventsNotWritten",
    "Fold",
    "Sink",
    "SinkStatistics",
]

logger = logging.getLogger(__name__)

_EVENT_TYPES = frozenset(EVENT_TYPES)

#: Largest queue a bus or a sink may have (events, each a few hundred bytes).
MAX_QUEUE_SIZE = 10_000_000
#: Accepted ``drain_interval``, seconds: under a millisecond the idle pump would spin a core.
DRAIN_INTERVAL_RANGE_S = (0.001, 60.0)
#: Accepted ``timeout`` of ``flush``, ``close`` and ``close_on_signal``, seconds.
TIMEOUT_RANGE_S = (0.0, 3600.0)


def _check_queue_size(value: object) -> int:
    return check_int(
        "queue_size",
        value,
        minimum=1,
        maximum=MAX_QUEUE_SIZE,
        meaning=f"an integer from 1 to {MAX_QUEUE_SIZE}",
    )


def _check_timeout(value: object) -> float:
    return check_number("timeout", value, unit="seconds", within=TIMEOUT_RANGE_S)


class EventBus:
    """Deliver adapter events to synchronous folds and bounded asynchronous sinks.

    The bus itself holds the lock, the adapters' registered facts and the count of objects
    ``emit()`` rejected; it composes the folds (:mod:`omnitrace.bus._folds`), the sink channels
    (:mod:`omnitrace.bus._channels`), the loop runner (:mod:`omnitrace.bus._runner`) and the
    process hooks (:mod:`omnitrace.bus._process`).

    Args:
        sinks: sinks to attach now (the bus then starts at once); default none.
        queue_size: capacity of the pending queue and of each sink's queue; events past it
            are dropped and counted. Default 10,000.
        drain_interval: seconds between drains of the sink queues (events wait at most this
            long before a sink sees them; ``flush()`` drains at once). Default 0.05.
        coverage_keys: input signatures the coverage fold tracks per adapter (the rest are
            counted together; see :mod:`omnitrace.coverage`). Default
            :data:`~omnitrace.coverage.DEFAULT_COVERAGE_KEYS` (32).

    Raises:
        ConfigError: ``queue_size`` (1 to :data:`MAX_QUEUE_SIZE`), ``drain_interval``
            (:data:`DRAIN_INTERVAL_RANGE_S`) or ``coverage_keys`` is out of range.
    """

    def __init__(
        self,
        *,
        sinks: Iterable[Sink] = (),
        queue_size: int = 10_000,
        drain_interval: float = 0.05,
        coverage_keys: int = DEFAULT_COVERAGE_KEYS,
    ) -> None:
        queue_size = _check_queue_size(queue_size)
        interval = check_number(
            "drain_interval", drain_interval, unit="seconds", within=DRAIN_INTERVAL_RANGE_S
        )
        folds = FoldRegistry(coverage_keys)  # validates coverage_keys
        self._queue_size = queue_size
        self._lock = threading.Lock()
        self._folds = folds
        self._channels = SinkChannels(self._lock, queue_size)
        self._runner = LoopRunner(self._lock, self._channels, interval)
        self._adapters: dict[str, Mapping[str, Any]] = {}
        self._rejected = 0
        # The thread running the added folds right now, if any (they hold the lock).
        self._fold_thread: int | None = None
        self._emitted_at_fork = 0
        # Set once the final accounting is done, by whichever close() got there.
        self._accounted = threading.Event()
        self._loss_reported = False
        register_atexit(self)
        track_forks(self)
        for sink in sinks:
            self.add_sink(sink)

    # -- hot path -------------------------------------------------------------------------

    def emit(self, event: Event) -> None:
        """Publish ``event``: fold it synchronously and queue it for every sink.

        Never blocks on a consumer and never raises: a full queue, a closed bus, a failing
        fold or a non-event argument is counted instead. Only a fold calling it (on the
        thread that runs the folds) gets a RuntimeError, instead of a deadlock.

        Args:
            event: the event; anything else is counted as rejected and ignored.

        Raises:
            RuntimeError: called from a fold.
        """
        lock = self._lock
        # Uncontended, this costs what ``with lock`` does; only a taken lock asks whether
        # it is this very thread, inside a fold, that holds it.
        if not lock.acquire(False):
            self._acquire_outside_fold(lock, "emit")
        try:
            if type(event) not in _EVENT_TYPES:
                self._rejected += 1
                return
            folds = self._folds
            if folds.added:
                # Only folds added with add_fold() can call back into the bus.
                self._fold_thread = threading.get_ident()
            for fold in folds.folds:
                try:
                    fold(event)
                except Exception as exc:  # a fold never reaches model code
                    folds.disable(fold, exc)
            # The channels' fast path, inlined: a method call here would cost emit() a tenth.
            channels = self._channels
            channels.emitted += 1
            if channels.accepting:
                if len(channels.pending) < channels.queue_size:
                    channels.pending.append(event)
                else:
                    channels.refuse_locked()
            elif channels.closed:
                channels.refuse_locked()
        finally:
            self._fold_thread = None
            lock.release()

    def _acquire_outside_fold(self, lock: threading.Lock, name: str) -> None:
        """Wait for the taken bus ``lock``, unless this thread holds it, running a fold.

        Raises:
            RuntimeError: called by a fold (the lock is not re-entrant: it would never come).
        """
        self._refuse_in_fold(name)
        lock.acquire()

    def _refuse_in_fold(self, name: str) -> None:
        """Refuse a call into the bus from a fold, which runs with the bus lock held.

        Raises:
            RuntimeError: the calling thread is running a fold.
        """
        if self._fold_thread == threading.get_ident():
            raise RuntimeError(
                f"EventBus.{name}() called from inside a fold: folds run under the bus lock "
                "and must not call back into the bus (read it after emit() returns, or "
                "from a sink)"
            )

    # -- folds ----------------------------------------------------------------------------

    def add_fold(self, fold: Fold) -> None:
        """Call ``fold(event)`` synchronously, in order, for every later event.

        A fold runs on the hot path under the bus lock: keep it tiny, and never call the
        bus from it (such a call raises RuntimeError rather than deadlock). One that raises
        is removed and reported once.

        Args:
            fold: called with each event.

        Raises:
            TypeError: ``fold`` is not callable.
            RuntimeError: called from a fold.
        """
        self._refuse_in_fold("add_fold")
        with self._lock:
            self._folds.add(fold)

    def remove_fold(self, fold: Fold) -> None:
        """Stop calling ``fold`` (no error if it is not attached).

        Args:
            fold: a fold added with :meth:`add_fold`.

        Raises:
            RuntimeError: called from a fold.
        """
        self._refuse_in_fold("remove_fold")
        with self._lock:
            self._folds.remove(fold)

    # -- stats and metadata ---------------------------------------------------------------

    def adapter_stats(self) -> dict[str, AdapterStats]:
        """Return the stats fold of every adapter that emitted on this bus.

        Raises:
            RuntimeError: called from a fold.
        """
        self._refuse_in_fold("adapter_stats")
        with self._lock:
            return self._folds.stats.snapshots()

    def coverage(self) -> dict[str, AdapterCoverage]:
        """Return the per-signature coverage of every adapter that emitted on this bus.

        Raises:
            RuntimeError: called from a fold.
        """
        self._refuse_in_fold("coverage")
        with self._lock:
            return self._folds.coverage.snapshots()

    @property
    def queue_size(self) -> int:
        """Capacity of the pending queue and of each sink's queue."""
        return self._queue_size

    def register_adapter(self, name: str, info: Mapping[str, Any]) -> None:
        """Record static facts about an adapter (its cap, floor ...) for consumers.

        Args:
            name: the adapter's name.
            info: the facts; a copy replaces what was recorded for ``name`` before.

        Raises:
            RuntimeError: called from a fold.
        """
        self._refuse_in_fold("register_adapter")
        with self._lock:
            self._adapters[name] = dict(info)

    def adapters(self) -> dict[str, Mapping[str, Any]]:
        """Return what ``register_adapter`` recorded, by adapter name.

        Raises:
            RuntimeError: called from a fold.
        """
        self._refuse_in_fold("adapters")
        with self._lock:
            return dict(self._adapters)

    def statistics(self) -> BusStatistics:
        """Return a frozen snapshot of the emission and delivery counters.

        Raises:
            RuntimeError: called from a fold.
        """
        self._refuse_in_fold("statistics")
        with self._lock:
            channels = self._channels
            return BusStatistics(
                emitted=channels.emitted,
                rejected=self._rejected,
                emitted_after_close=channels.after_close,
                disabled_folds=self._folds.disabled,
                sinks=channels.statistics_locked(),
            )

    @property
    def closed(self) -> bool:
        """Whether ``close()`` (or ``aclose()``) has closed the bus."""
        return self._channels.closed

    # -- sinks and the loop ---------------------------------------------------------------

    def add_sink(self, sink: Sink, *, queue_size: int | None = None) -> None:
        """Attach ``sink``; it sees events emitted from now on. Starts the bus if needed.

        Args:
            sink: the sink (see :class:`Sink`).
            queue_size: capacity of its queue; default None (the bus's ``queue_size``).

        Raises:
            TypeError: ``sink`` has no ``handle`` method.
            ConfigError: ``queue_size`` is not an integer from 1 to :data:`MAX_QUEUE_SIZE`.
            RuntimeError: the bus is closed, or called from a fold.
        """
        self._refuse_in_fold("add_sink")
        if not callable(getattr(sink, "handle", None)):
            raise TypeError(f"sink {sink_name(sink)} has no handle(events) method")
        capacity = self._queue_size if queue_size is None else _check_queue_size(queue_size)
        with self._lock:
            channel = self._channels.attach_locked(sink, capacity)
            started = self._runner.started
        if not started:
            self.start()
        elif self._runner.revive():
            self._runner.spawn(channel)

    def start(self, loop: asyncio.AbstractEventLoop | None = None) -> None:
        """Start draining sink queues (idempotent).

        Uses ``loop`` if given, else the running loop of the calling thread, else a loop on a
        daemon thread of the bus's own.

        Args:
            loop: the asyncio loop to drain on; default None (see above).

        Raises:
            RuntimeError: called from a fold, or the bus's own thread could not start.
        """
        self._refuse_in_fold("start")
        self._runner.start(loop)

    # -- flush and close ------------------------------------------------------------------

    async def aflush(self, timeout: float = 5.0) -> bool:
        """Deliver every event emitted so far; return False if ``timeout`` passed first.

        Args:
            timeout: seconds to wait at most; default 5.0.

        Returns:
            True once everything emitted before the call was delivered, else False.

        Raises:
            ConfigError: ``timeout`` is not a number of seconds in :data:`TIMEOUT_RANGE_S`.
            RuntimeError: called from a fold.
        """
        self._refuse_in_fold("aflush")
        timeout = _check_timeout(timeout)
        deadline, target, _ = self._begin_flush(timeout)
        while (busy := self._runner.flush_step(target)) and time.monotonic() < deadline:
            await asyncio.sleep(POLL_S)
        return not busy

    def flush(self, timeout: float = 5.0) -> bool:
        """Block until every event emitted so far reached its sink; False if ``timeout`` passed.

        Events emitted meanwhile by other threads are not waited for, so a busy emitter
        cannot keep a flush from finishing.

        Args:
            timeout: seconds to wait at most; default 5.0.

        Returns:
            True once everything emitted before the call was delivered, else False.

        Raises:
            ConfigError: ``timeout`` is not a number of seconds in :data:`TIMEOUT_RANGE_S`.
            RuntimeError: called on the thread that runs the bus loop (use ``aflush``), or
                from a fold.
        """
        self._refuse_in_fold("flush")
        timeout = _check_timeout(timeout)
        self._runner.check_not_loop_thread("flush", "aflush")
        deadline, target, _ = self._begin_flush(timeout)
        while (busy := self._runner.flush_step(target)) and time.monotonic() < deadline:
            time.sleep(POLL_S)
        return not busy

    async def aclose(self, timeout: float = 5.0) -> None:
        """Flush for at most ``timeout`` seconds, close every sink and stop draining.

        Idempotent, and like :meth:`close` it returns with the final accounting, whichever
        call closes the bus. What could not be delivered in time is counted as dropped.

        Args:
            timeout: seconds to flush at most; default 5.0.

        Raises:
            ConfigError: ``timeout`` is not a number of seconds in :data:`TIMEOUT_RANGE_S`.
            RuntimeError: called from a fold.
        """
        self._refuse_in_fold("aclose")
        timeout = _check_timeout(timeout)
        if self._accounted.is_set():
            return
        deadline, target, running = self._begin_flush(timeout)
        while running and self._runner.flush_step(target) and time.monotonic() < deadline:
            await asyncio.sleep(POLL_S)
        grace = max(deadline, time.monotonic()) + min(timeout, CLOSE_GRACE_S)
        if self._mark_closed():
            self._finish(await self._runner.astop(grace), timeout)
            return
        # Another call is closing the bus: wait for its accounting, within our own bound.
        while not self._accounted.is_set() and time.monotonic() < grace:
            await asyncio.sleep(POLL_S)
        self._settle(grace)

    def close(self, timeout: float = 5.0) -> None:
        """Flush for at most ``timeout`` seconds, close every sink and stop the bus thread.

        Idempotent. Returns within ``timeout`` plus a short grace for the sinks' own
        ``close()``, whatever a sink does, and with the final accounting, whichever call
        (of this or another thread) closes the bus: what could not be delivered in time is
        counted as dropped (``not_flushed``, or ``abandoned`` for a batch stuck in
        ``handle``) and logged. That accounting is final: a stuck sink that finishes later
        moves no counter, and a sink with ``abandon()`` (the JSONL sink) writes none of what
        was counted abandoned. Events emitted afterwards still reach the folds and are
        counted in ``emitted_after_close``.

        Args:
            timeout: seconds to flush at most; default 5.0.

        Raises:
            ConfigError: ``timeout`` is not a number of seconds in :data:`TIMEOUT_RANGE_S`
                (checked before anything changes).
            RuntimeError: called on the thread that runs the bus loop (use ``aclose``), or
                from a fold.
        """
        self._refuse_in_fold("close")
        timeout = _check_timeout(timeout)
        if self._accounted.is_set():
            return
        self._runner.check_not_loop_thread("close", "aclose")
        _close_together([self], timeout)

    @classmethod
    def _close_all_at_exit(cls, buses: list[EventBus], timeout: float) -> None:
        """Close ``buses`` side by side within ``timeout`` (plus the grace), for the exit."""
        closing = []
        for bus in buses:
            if bus._accounted.is_set():
                continue
            if bus._runner.dormant and bus._emitted() == bus._emitted_at_fork:
                # A forked child that never used its parent's bus: leave the parent's sinks
                # alone and add nothing to this process's exit.
                if bus._mark_closed():
                    bus._finish([], 0.0)
                continue
            try:
                bus._runner.check_not_loop_thread("close", "aclose")
            except RuntimeError:
                continue  # the loop thread itself is exiting
            closing.append(bus)
        _close_together(closing, timeout)

    def _begin_flush(self, timeout: float) -> tuple[float, int, bool]:
        """Make sure something drains the sinks; return the flush's deadline, the emitted
        count it waits for, and whether anything drains at all."""
        deadline = time.monotonic() + timeout
        running = self._runner.revive()
        return deadline, self._emitted(), running

    def _emitted(self) -> int:
        with self._lock:
            return self._channels.emitted

    def _mark_closed(self) -> bool:
        """Stop accepting events for the sinks; count what is still queued as not flushed.

        Returns:
            False if the bus was closed already (the caller then only waits for the
            accounting, see :meth:`_settle`).
        """
        if not self._channels.close():
            return False
        unregister_atexit(self)
        return True

    def _finish(self, workers: list[SinkThread], timeout: float) -> None:
        """Count batches still inside a sink as abandoned and report what was lost."""
        self._runner.report_stuck(workers, timeout)
        self._account()

    def _account(self) -> None:
        """Count batches still inside a sink as abandoned; log the losses, once."""
        losses = self._channels.abandon_in_flight()
        with self._lock:
            first, self._loss_reported = not self._loss_reported, True
        if first and losses:
            logger.warning(
                "EventBus closed with undelivered events, counted as dropped: %s",
                ", ".join(f"{name} {n}" for name, n in losses.items()),
            )
        self._accounted.set()

    def _settle(self, grace: float) -> None:
        """For a close that found the bus closing: wait for the closer's accounting until
        ``grace`` (a monotonic deadline), then do it here if it has not come.

        The closer may be stuck waiting for a sink, or be the very thread a signal handler
        interrupted: this call's own bound holds all the same.
        """
        if not self._accounted.wait(max(grace - time.monotonic(), 0)):
            self._account()

    # -- the process: signals, exit and fork ----------------------------------------------

    def close_on_signal(
        self, signum: int = signal.SIGTERM, *, timeout: float = EXIT_TIMEOUT_S
    ) -> Callable[[], None]:
        """Close the bus within ``timeout`` when ``signum`` arrives, then chain the old handler.

        The default action of ``SIGTERM`` kills the process without running exit handlers,
        so queued events would vanish unrecorded. The installed handler closes the bus on a
        helper thread (bounded by ``timeout`` plus the close grace), logs one line with what
        every sink delivered and lost, then runs the handler that was installed before (or,
        for the default action, restores it and re-sends the signal). A second signal while
        closing skips the wait. While the bus closes, the main thread waits in the handler
        (it emits nothing more), unless it was interrupted holding a lock the close needs.
        Call it from the main thread (Python installs signal
        handlers there only); a signal the host ignores is left alone.

        Args:
            signum: the signal; default ``signal.SIGTERM``.
            timeout: seconds the close may take; default 2.0.

        Returns:
            A function that puts the previous handler back (if ours is still installed).

        Raises:
            ConfigError: ``timeout`` is not a number of seconds in :data:`TIMEOUT_RANGE_S`.
            ValueError: called from a thread other than the main thread.
            RuntimeError: called from a fold.
        """
        self._refuse_in_fold("close_on_signal")
        return install_close_on_signal(self, signum, _check_timeout(timeout))

    def _after_fork_in_child(self) -> None:
        # Another thread may have held the lock at fork(): it never releases it here.
        self._lock = self._channels.lock = self._runner.lock = threading.Lock()
        self._fold_thread = None
        # Its lock too may have been held at fork(), by a thread waiting for the close.
        accounted, self._accounted = self._accounted, threading.Event()
        if accounted.is_set():
            self._accounted.set()
        self._emitted_at_fork = self._channels.emitted
        if self.closed or not self._runner.started:
            return
        self._channels.forget_parent()
        self._runner.forget_parent()

    def __enter__(self) -> EventBus:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self.closed else ("running" if self._runner.started else "idle")
        # A fold holds the lock: read the count without it rather than deadlock.
        inside = self._fold_thread == threading.get_ident()
        emitted = self._channels.emitted if inside else self._emitted()
        return f"<EventBus {state} sinks={len(self._channels.channels)} emitted={emitted}>"


def _close_together(buses: list[EventBus], timeout: float) -> None:
    """Close ``buses`` side by side: flush all within ``timeout``, then stop all within the
    grace, so that many buses take no longer than one. Each returns with final accounting.
    """
    deadline = time.monotonic() + timeout
    flushing = [(bus, bus._emitted()) for bus in buses if bus._runner.revive()]
    while flushing:
        flushing = [(bus, target) for bus, target in flushing if bus._runner.flush_step(target)]
        if not flushing or time.monotonic() >= deadline:
            break
        time.sleep(POLL_S)
    grace = max(deadline, time.monotonic()) + min(timeout, CLOSE_GRACE_S)
    stopping: list[tuple[EventBus, StopRequest]] = []
    joining: list[EventBus] = []
    for bus in buses:
        if bus._mark_closed():
            stopping.append((bus, bus._runner.begin_stop()))
        else:
            joining.append(bus)  # another call is closing it
    for bus, request in stopping:
        bus._finish(LoopRunner.end_stop(request, grace), timeout)
    for bus in joining:
        bus._settle(grace)
