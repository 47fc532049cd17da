"""The in-process event bus between the graph adapters and every consumer.

``emit()`` runs on the encoder's hot path, so it only does bounded, non-blocking work under
one short lock: it feeds the synchronous folds (the stats, which must see every event in
order and never drop one) and appends the event to one bounded pending queue, whatever the
number of sinks. A pump on an asyncio loop (the host's, or the bus's own daemon thread when
the host has none) moves pending events into one bounded queue per sink and wakes the sink: a
plain ``handle`` runs on a daemon thread of that sink's own, a coroutine ``handle`` on the
loop. A sink whose queue is full loses the event and the loss is counted; a sink that raises
is disabled and reported once. Nothing a consumer does can raise into, or block, the caller
of ``emit()``.

Every wait is bounded and every event is accounted for:

* ``flush()`` and ``close()`` return within their timeout (``close()`` then gives the sinks a
  short grace to close). What ``close()`` could not deliver is counted as dropped with a
  reason (:data:`DROP_REASONS`), so once the bus is closed, for every sink,
  ``delivered + dropped == offered``, and ``offered == emitted`` for a sink attached before
  the first event. Sink threads are daemons and the exit handler's close is bounded, so a
  sink stuck in ``handle`` never keeps the process alive.
* If the host's loop ends while the bus runs on it (``asyncio.run`` returning), the bus moves
  to a thread of its own and keeps delivering.
* In a forked child the bus gets a new lock, the parent's loop and sink threads are known to
  be gone, and the events the parent had not delivered at the fork are counted as dropped
  (``forked``) in the child's copy (the parent still delivers them). The child's bus starts
  threads of its own when it is flushed, closed or given a sink; at exit, a child that never
  emitted on it leaves the parent's sinks alone and exits at once.
* :meth:`EventBus.close_on_signal` closes the bus within a bound when the process is told to
  stop (``SIGTERM``), logs how many events were not delivered, then lets the previous handler
  (or the default action) run.
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import contextlib
import inspect
import logging
import os
import signal
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any, Protocol, runtime_checkable

from omnitrace.config import ConfigError
from omnitrace.events import EVENT_TYPES, Event
from omnitrace.stats import AdapterStats, StatsFold

__all__ = [
    "DROP_REASONS",
    "BusStatistics",
    "EventBus",
    "Fold",
    "Sink",
    "SinkStatistics",
]

logger = logging.getLogger(__name__)

Fold = Callable[[Event], None]

#: Why a sink lost events (the keys of :attr:`SinkStatistics.dropped_by`):
#: ``queue_full`` the pending queue or the sink's queue was full;
#: ``sink_error`` the sink raised and was disabled (its failing batch and every later event);
#: ``not_flushed`` still queued when ``close()`` reached its deadline;
#: ``abandoned`` inside the sink's ``handle`` when ``close()`` gave up waiting for it;
#: ``after_close`` emitted after ``close()``;
#: ``forked`` undelivered in the parent at a ``fork()`` (the child's copy is discarded).
DROP_REASONS = ("queue_full", "sink_error", "not_flushed", "abandoned", "after_close", "forked")

_EVENT_TYPES = frozenset(EVENT_TYPES)
_DROP_REPORT_INTERVAL_S = 10.0
#: Longest a flush or close sleeps between two checks.
_POLL_S = 0.001
#: What ``close()`` adds to its timeout, at most, for the sinks' own ``close()``.
_CLOSE_GRACE_S = 0.25
#: The bound of the close run by the exit handler.
_EXIT_TIMEOUT_S = 2.0
#: How often a signal handler tries again for a moment when the bus lock is not free.
_SIGNAL_RETRIES = 100
_LOGGING_DIR = str(Path(logging.__file__).parent)


@runtime_checkable
class Sink(Protocol):
    """An asynchronous consumer of events.

    ``handle`` receives events in emission order, in batches. It may be a plain method (it
    then runs on a daemon thread of its own, so a slow sink never stalls the others) or a
    coroutine function (awaited on the bus loop). An optional ``close()`` is called once
    when the bus closes (on the sink's thread for a plain sink); an optional ``name`` names
    the sink in statistics and logs.
    """

    def handle(self, events: Sequence[Event]) -> Any: ...


@dataclass(frozen=True, slots=True)
class SinkStatistics:
    """Delivery counters of one sink.

    Once the bus is closed, ``delivered + dropped == offered`` and ``queued == 0``.
    """

    name: str
    capacity: int
    queued: int
    """Events waiting for the sink or inside its ``handle`` right now."""
    peak_queued: int
    delivered: int
    dropped: int
    """Events the sink lost, whatever the reason (see ``dropped_by``)."""
    disabled: bool
    error: str | None
    offered: int = 0
    """Events emitted while the sink was attached (all of them for a sink attached first)."""
    dropped_by: Mapping[str, int] = field(default_factory=dict, hash=False)
    """``dropped`` by reason, one of :data:`DROP_REASONS` (reasons with no loss are absent)."""


@dataclass(frozen=True, slots=True)
class BusStatistics:
    """A frozen snapshot of the bus counters."""

    emitted: int
    rejected: int
    """Objects passed to ``emit()`` that were not omnitrace events (ignored)."""
    emitted_after_close: int
    """Events emitted after ``close()``: folded, but no longer delivered to sinks."""
    disabled_folds: int
    sinks: tuple[SinkStatistics, ...]

    @property
    def dropped(self) -> int:
        return sum(s.dropped for s in self.sinks)


class _SinkThread:
    """The daemon thread that runs one plain sink's ``handle`` and, at the end, its ``close``."""

    __slots__ = ("done", "stop", "thread", "wake")

    def __init__(self, target: Callable[[_SinkThread], None], name: str) -> None:
        self.wake = threading.Event()
        self.done = threading.Event()
        self.stop = False
        # A daemon: a sink stuck in handle() must never keep the interpreter from exiting.
        self.thread = threading.Thread(
            target=target, args=(self,), name=f"omnitrace-sink-{name}", daemon=True
        )


class _Channel:
    """One sink's bounded queue and counters; mutated under the bus lock."""

    __slots__ = (
        "abandoned",
        "abandoned_seq",
        "base",
        "capacity",
        "delivered",
        "disabled",
        "dropped_reported",
        "drops",
        "error",
        "in_flight",
        "is_async",
        "last_drop_report",
        "name",
        "peak",
        "queue",
        "seq",
        "sink",
        "sink_closed",
        "task",
        "wakeup",
        "worker",
    )

    def __init__(self, sink: Sink, name: str, capacity: int) -> None:
        self.sink = sink
        self.name = name
        self.capacity = capacity
        self.queue: deque[Event] = deque()
        self.base = 0
        self.delivered = 0
        self.drops: dict[str, int] = {}
        self.dropped_reported = 0
        self.last_drop_report = 0.0
        self.peak = 0
        self.in_flight = 0
        self.seq = 0
        # The batch close() gave up on, in case the sink still finishes it.
        self.abandoned_seq = -1
        self.abandoned = 0
        self.disabled = False
        self.sink_closed = False
        self.error: str | None = None
        self.is_async = inspect.iscoroutinefunction(sink.handle)
        self.worker: _SinkThread | None = None
        self.task: asyncio.Task[None] | None = None
        self.wakeup: asyncio.Event | None = None

    @property
    def dropped(self) -> int:
        return sum(self.drops.values())

    def drop(self, reason: str, count: int) -> None:
        if count > 0:
            self.drops[reason] = self.drops.get(reason, 0) + count

    def statistics(self, pending: int, emitted: int) -> SinkStatistics:
        return SinkStatistics(
            name=self.name,
            capacity=self.capacity,
            queued=len(self.queue) + self.in_flight + (0 if self.disabled else pending),
            peak_queued=self.peak,
            delivered=self.delivered,
            dropped=self.dropped,
            disabled=self.disabled,
            error=self.error,
            offered=emitted - self.base,
            dropped_by=dict(self.drops),
        )


def _sink_name(sink: object) -> str:
    name = getattr(sink, "name", None)
    return name if isinstance(name, str) and name else type(sink).__name__


def _running_loop() -> asyncio.AbstractEventLoop | None:
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None


class EventBus:
    """Deliver adapter events to synchronous folds and bounded asynchronous sinks.

    Args:
        sinks: sinks to attach now (the bus then starts at once).
        queue_size: capacity of the pending queue and of each sink's queue; events past it
            are dropped and counted.
        drain_interval: seconds between drains of the sink queues (events wait at most this
            long before a sink sees them; ``flush()`` drains at once).

    Raises:
        ConfigError: ``queue_size`` or ``drain_interval`` is out of range.
    """

    def __init__(
        self,
        *,
        sinks: Iterable[Sink] = (),
        queue_size: int = 10_000,
        drain_interval: float = 0.05,
    ) -> None:
        if isinstance(queue_size, bool) or not isinstance(queue_size, int) or queue_size < 1:
            raise ConfigError(f"queue_size: expected a positive integer, got {queue_size!r}")
        if (
            isinstance(drain_interval, bool)
            or not isinstance(drain_interval, (int, float))
            or not 0 < drain_interval <= 60
        ):
            raise ConfigError(
                f"drain_interval: expected seconds in (0, 60], got {drain_interval!r}"
            )
        self._queue_size = queue_size
        self._interval = float(drain_interval)
        self._lock = threading.Lock()
        self._stats = StatsFold()
        self._folds: tuple[Fold, ...] = (self._stats.fold,)
        self._channels: tuple[_Channel, ...] = ()
        self._pending: deque[Event] = deque()
        self._pump_task: asyncio.Task[None] | None = None
        self._adapters: dict[str, Mapping[str, Any]] = {}
        self._emitted = 0
        self._rejected = 0
        self._after_close = 0
        self._disabled_folds = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._started = False
        self._closed = False
        # Set in a forked child whose inherited bus has no threads until it is used.
        self._dormant = False
        self._emitted_at_fork = 0
        self._atexit_ref = _register_atexit(self)
        _BUSES.add(self)
        for sink in sinks:
            self.add_sink(sink)

    # -- hot path -------------------------------------------------------------------------

    def emit(self, event: Event) -> None:
        """Publish ``event``: fold it synchronously and queue it for every sink.

        Never blocks on a consumer and never raises: a full queue, a closed bus, a failing
        fold or a non-event argument is counted instead.
        """
        if type(event) not in _EVENT_TYPES:
            with self._lock:
                self._rejected += 1
            return
        with self._lock:
            self._emitted += 1
            for fold in self._folds:
                try:
                    fold(event)
                except Exception as exc:  # a fold never reaches model code
                    self._disable_fold_locked(fold, exc)
            if self._closed:
                self._after_close += 1
                for channel in self._channels:
                    channel.drop("after_close", 1)
                return
            if self._channels:
                if len(self._pending) < self._queue_size:
                    self._pending.append(event)
                else:
                    # Degraded path only: the pump is behind, every sink loses this event.
                    for channel in self._channels:
                        channel.drop("queue_full", 1)

    # -- folds ----------------------------------------------------------------------------

    def add_fold(self, fold: Fold) -> None:
        """Call ``fold(event)`` synchronously, in order, for every later event.

        A fold runs on the hot path under the bus lock: keep it tiny. One that raises is
        removed and reported once.
        """
        if not callable(fold):
            raise TypeError(f"fold must be callable, got {type(fold).__name__}")
        with self._lock:
            self._folds = (*self._folds, fold)

    def remove_fold(self, fold: Fold) -> None:
        """Stop calling ``fold`` (no error if it is not attached)."""
        with self._lock:
            self._folds = tuple(f for f in self._folds if f != fold)

    def _disable_fold_locked(self, fold: Fold, exc: Exception) -> None:
        self._folds = tuple(f for f in self._folds if f != fold)
        self._disabled_folds += 1
        # Reporting is deferred to a thread of its own: the hot path never does I/O.
        threading.Thread(
            target=logger.error,
            args=("event fold %r raised %s: %s; it is disabled", fold, type(exc).__name__, exc),
            daemon=True,
        ).start()

    # -- stats and metadata ---------------------------------------------------------------

    def adapter_stats(self) -> dict[str, AdapterStats]:
        """Return the stats fold of every adapter that emitted on this bus."""
        with self._lock:
            return self._stats.snapshots()

    def register_adapter(self, name: str, info: Mapping[str, Any]) -> None:
        """Record static facts about an adapter (its cap, floor ...) for consumers."""
        with self._lock:
            self._adapters[name] = dict(info)

    def adapters(self) -> dict[str, Mapping[str, Any]]:
        """Return what ``register_adapter`` recorded, by adapter name."""
        with self._lock:
            return dict(self._adapters)

    def statistics(self) -> BusStatistics:
        """Return a frozen snapshot of the emission and delivery counters."""
        with self._lock:
            pending = len(self._pending)
            return BusStatistics(
                emitted=self._emitted,
                rejected=self._rejected,
                emitted_after_close=self._after_close,
                disabled_folds=self._disabled_folds,
                sinks=tuple(c.statistics(pending, self._emitted) for c in self._channels),
            )

    @property
    def closed(self) -> bool:
        return self._closed

    # -- sinks and the loop ---------------------------------------------------------------

    def add_sink(self, sink: Sink, *, queue_size: int | None = None) -> None:
        """Attach ``sink``; it sees events emitted from now on. Starts the bus if needed.

        Raises:
            TypeError: ``sink`` has no ``handle`` method.
            RuntimeError: the bus is closed.
        """
        if not callable(getattr(sink, "handle", None)):
            raise TypeError(f"sink {_sink_name(sink)} has no handle(events) method")
        capacity = self._queue_size if queue_size is None else queue_size
        if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 1:
            raise ConfigError(f"queue_size: expected a positive integer, got {capacity!r}")
        channel = _Channel(sink, _sink_name(sink), capacity)
        with self._lock:
            if self._closed:
                raise RuntimeError("cannot add a sink to a closed EventBus")
            # Events still pending go to every sink attached when they are distributed.
            channel.base = self._emitted - len(self._pending)
            self._channels = (*self._channels, channel)
            started = self._started
        if not started:
            self.start()
        elif self._revive():
            self._spawn(channel)

    def start(self, loop: asyncio.AbstractEventLoop | None = None) -> None:
        """Start draining sink queues (idempotent).

        Uses ``loop`` if given, else the running loop of the calling thread, else a loop on a
        daemon thread of the bus's own.
        """
        self._dormant = False
        self._start(loop)

    def _start(self, loop: asyncio.AbstractEventLoop | None = None, *, own: bool = False) -> None:
        with self._lock:
            if self._started or self._closed:
                return
        if loop is None and not own:
            loop = _running_loop()
        thread = None
        if loop is None:
            loop = asyncio.new_event_loop()
            thread = threading.Thread(
                target=_run_loop, args=(loop,), name="omnitrace-bus", daemon=True
            )
        with self._lock:
            if self._started or self._closed:
                if thread is not None:
                    loop.close()
                return
            # Loop and started flag change together: add_sink() spawns on the loop it sees.
            self._started, self._loop, self._thread = True, loop, thread
            channels = self._channels
        if thread is not None:
            try:
                thread.start()
            except RuntimeError:
                with self._lock:
                    self._started, self._loop, self._thread = False, None, None
                loop.close()
                raise
        for channel in channels:
            self._spawn(channel)

    def _spawn(self, channel: _Channel) -> None:
        """Start what drains ``channel`` (a thread, or a task on the loop) and the pump."""
        loop = self._loop
        if loop is None:
            return
        if channel.is_async:
            loop.call_soon_threadsafe(self._spawn_task, channel)
        else:
            worker = None
            with self._lock:
                if channel.worker is None and not channel.disabled:
                    worker = channel.worker = _SinkThread(
                        lambda w: self._run_sink_thread(channel, w), channel.name
                    )
            if worker is not None:
                worker.thread.start()
        loop.call_soon_threadsafe(self._spawn_pump)

    def _spawn_task(self, channel: _Channel) -> None:
        loop = self._loop
        if channel.task is not None or loop is None or self._closed:
            return
        channel.wakeup = asyncio.Event()
        channel.task = loop.create_task(self._drain_task(channel, channel.wakeup))

    def _spawn_pump(self) -> None:
        loop = self._loop
        if self._pump_task is None and loop is not None and not self._closed:
            self._pump_task = loop.create_task(self._pump())

    def _revive(self) -> bool:
        """Make sure something drains the sinks; return whether it does.

        A forked child's inherited bus starts threads of its own here, and a bus whose host
        loop has closed moves to a thread of its own.
        """
        if self._closed:
            return False
        try:
            if self._dormant:
                self.start()
            else:
                loop = self._loop
                if loop is not None and self._thread is None and loop.is_closed():
                    self._hand_over()
        except RuntimeError as exc:  # no new threads at interpreter shutdown
            logger.error("EventBus cannot start its threads: %s", exc)
            return False
        return self._started

    def _hand_over(self) -> None:
        """Move the pump and the async sinks from the host's (ending) loop to our own thread."""
        with self._lock:
            if self._closed or not self._started:
                return
            self._started = False
            self._pump_task = None
            for channel in self._channels:
                channel.task = None
                channel.wakeup = None
        logger.debug("the host's event loop ended; EventBus continues on a thread of its own")
        self._start(own=True)

    async def _pump(self) -> None:
        try:
            while True:
                await asyncio.sleep(self._interval)
                self._distribute()
        except asyncio.CancelledError:
            if not self._closed and self._thread is None:
                # Only the host can cancel us here: its loop is ending (asyncio.run cancels
                # every task before it closes the loop). Keep delivering from our own thread.
                self._hand_over()
            raise

    def _distribute(self) -> None:
        """Move pending events into the sink queues and wake the sinks that got some."""
        with self._lock:
            if not self._pending:
                return
            batch = list(self._pending)
            self._pending.clear()
            woken = []
            for channel in self._channels:
                if channel.disabled:
                    channel.drop("sink_error", len(batch))
                    continue
                queue = channel.queue
                room = max(channel.capacity - len(queue), 0)
                if room < len(batch):
                    channel.drop("queue_full", len(batch) - room)
                    queue.extend(batch[:room])
                else:
                    queue.extend(batch)
                channel.peak = max(channel.peak, len(queue))
                woken.append(channel)
        for channel in woken:
            self._wake(channel)

    def _wake(self, channel: _Channel) -> None:
        worker = channel.worker
        if worker is not None:
            worker.wake.set()
            return
        wakeup, loop = channel.wakeup, self._loop
        if wakeup is None or loop is None:
            return
        try:
            if _running_loop() is loop:
                wakeup.set()
            else:
                loop.call_soon_threadsafe(wakeup.set)
        except RuntimeError:
            pass  # the host loop is closed: the next flush() or close() hands the bus over

    # -- delivery -------------------------------------------------------------------------

    def _take(self, channel: _Channel) -> tuple[list[Event], int] | None:
        """Take the sink's whole queue as the batch in flight; None when there is nothing."""
        with self._lock:
            # One batch in flight per sink: after a hand-over the old loop's task may still
            # be finishing its batch.
            if channel.disabled or channel.in_flight or not channel.queue:
                return None
            batch = list(channel.queue)
            channel.queue.clear()
            channel.seq += 1
            channel.in_flight = len(batch)
            seq = channel.seq
            unreported = channel.dropped - channel.dropped_reported
            total = channel.dropped
        if unreported and time.monotonic() - channel.last_drop_report >= _DROP_REPORT_INTERVAL_S:
            channel.dropped_reported += unreported
            channel.last_drop_report = time.monotonic()
            logger.warning(
                "sink %s dropped %d events (queue capacity %d, %d dropped in all)",
                channel.name,
                unreported,
                channel.capacity,
                total,
            )
        return batch, seq

    def _delivered(self, channel: _Channel, seq: int) -> None:
        with self._lock:
            if channel.seq == seq and channel.in_flight:
                channel.delivered += channel.in_flight
                channel.in_flight = 0
            elif channel.abandoned_seq == seq:
                # close() gave up on this batch and counted it dropped, then the sink did
                # finish it after all: it moves to delivered (the sum does not change).
                channel.drops["abandoned"] -= channel.abandoned
                if not channel.drops["abandoned"]:
                    del channel.drops["abandoned"]
                channel.delivered += channel.abandoned
                channel.abandoned_seq, channel.abandoned = -1, 0

    def _abandon(self, channel: _Channel, seq: int) -> None:
        with self._lock:
            if channel.seq == seq and channel.in_flight:
                channel.drop("abandoned", channel.in_flight)
                channel.in_flight = 0
        self._wake(channel)  # a task on another loop may be waiting to take the next batch

    def _run_sink_thread(self, channel: _Channel, worker: _SinkThread) -> None:
        try:
            while True:
                worker.wake.wait()
                worker.wake.clear()
                while (taken := self._take(channel)) is not None:
                    batch, seq = taken
                    try:
                        channel.sink.handle(batch)
                    except BaseException as exc:  # a sink never ends its thread unreported
                        self._disable_sink(channel, exc, seq)
                        break
                    self._delivered(channel, seq)
                if worker.stop:
                    self._close_sink(channel)
                    return
        finally:
            worker.done.set()

    async def _drain_task(self, channel: _Channel, wakeup: asyncio.Event) -> None:
        while True:
            await wakeup.wait()
            wakeup.clear()
            while (taken := self._take(channel)) is not None:
                batch, seq = taken
                try:
                    await channel.sink.handle(batch)
                except asyncio.CancelledError:
                    self._abandon(channel, seq)
                    raise
                except Exception as exc:
                    self._disable_sink(channel, exc, seq)
                    return
                self._delivered(channel, seq)

    def _disable_sink(self, channel: _Channel, exc: BaseException, seq: int) -> None:
        with self._lock:
            if channel.disabled:
                return
            channel.disabled = True
            channel.error = f"{type(exc).__name__}: {exc}"
            lost = len(channel.queue) + (channel.in_flight if channel.seq == seq else 0)
            channel.drop("sink_error", lost)
            channel.queue.clear()
            channel.in_flight = 0
        logger.error(
            "sink %s raised %s and is disabled; its events are dropped from now on",
            channel.name,
            channel.error,
            exc_info=(type(exc), exc, exc.__traceback__),
        )
        self._close_sink(channel)

    def _close_sink(self, channel: _Channel) -> None:
        with self._lock:
            if channel.sink_closed:
                return
            channel.sink_closed = True
        close = getattr(channel.sink, "close", None)
        if close is None:
            return
        try:
            close()
        except Exception:
            logger.exception("sink %s raised while closing", channel.name)

    # -- flush and close ------------------------------------------------------------------

    def _flush_step(self, target: int) -> bool:
        """Distribute and wake; return whether a sink still lacks events emitted before
        ``target`` (the emitted count when the flush began)."""
        self._distribute()
        with self._lock:
            busy = [
                c
                for c in self._channels
                if not c.disabled and c.delivered + c.dropped < target - c.base
            ]
            queued = [c for c in busy if c.queue]
        for channel in queued:
            self._wake(channel)
        return bool(busy)

    async def aflush(self, timeout: float = 5.0) -> bool:
        """Deliver every event emitted so far; return False if ``timeout`` passed first."""
        deadline = time.monotonic() + timeout
        self._revive()
        with self._lock:
            target = self._emitted
        while self._flush_step(target):
            if time.monotonic() >= deadline:
                return False
            await asyncio.sleep(_POLL_S)
        return True

    def flush(self, timeout: float = 5.0) -> bool:
        """Block until every event emitted so far reached its sink; False if ``timeout`` passed.

        Events emitted meanwhile by other threads are not waited for, so a busy emitter
        cannot keep a flush from finishing.

        Raises:
            RuntimeError: called on the thread that runs the bus loop (use ``aflush``).
        """
        self._check_not_loop_thread("flush", "aflush")
        deadline = time.monotonic() + timeout
        self._revive()
        with self._lock:
            target = self._emitted
        while self._flush_step(target):
            if time.monotonic() >= deadline:
                return False
            time.sleep(_POLL_S)
        return True

    def _check_not_loop_thread(self, name: str, alternative: str) -> None:
        loop = self._loop
        if loop is not None and _running_loop() is loop:
            raise RuntimeError(
                f"EventBus.{name}() would block the loop that drains the bus; "
                f"use 'await bus.{alternative}()' there"
            )

    async def aclose(self, timeout: float = 5.0) -> None:
        """Flush for at most ``timeout`` seconds, close every sink and stop draining.

        Idempotent. What could not be delivered in time is counted as dropped.
        """
        if self._closed:
            return
        deadline = time.monotonic() + timeout
        running = self._revive()
        with self._lock:
            target = self._emitted
        while running and self._flush_step(target) and time.monotonic() < deadline:
            await asyncio.sleep(_POLL_S)
        if not self._mark_closed():
            return
        grace = max(deadline, time.monotonic()) + min(timeout, _CLOSE_GRACE_S)
        workers = self._stop_workers()
        loop = self._loop
        if loop is not None and loop is _running_loop():
            await self._stop_tasks()
        elif loop is not None and loop.is_running():
            future = asyncio.run_coroutine_threadsafe(self._stop_tasks(), loop)
            with contextlib.suppress(asyncio.TimeoutError, concurrent.futures.CancelledError):
                await asyncio.wait_for(
                    asyncio.wrap_future(future), max(grace - time.monotonic(), 0)
                )
        if self._thread is not None and loop is not None:
            # The loop thread finishes its tasks and closes its loop by itself.
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(loop.stop)
        while any(not w.done.is_set() for w in workers) and time.monotonic() < grace:
            await asyncio.sleep(_POLL_S * 5)
        self._finish(workers, timeout)

    def close(self, timeout: float = 5.0) -> None:
        """Flush for at most ``timeout`` seconds, close every sink and stop the bus thread.

        Idempotent. Returns within ``timeout`` plus a short grace for the sinks' own
        ``close()``, whatever a sink does; what could not be delivered in time is counted
        as dropped (``not_flushed``, or ``abandoned`` for a batch stuck in ``handle``) and
        logged. Events emitted afterwards still reach the folds and are counted in
        ``emitted_after_close``.
        """
        if self._closed:
            return
        self._check_not_loop_thread("close", "aclose")
        deadline = time.monotonic() + timeout
        running = self._revive()
        with self._lock:
            target = self._emitted
        while running and self._flush_step(target) and time.monotonic() < deadline:
            time.sleep(_POLL_S)
        if not self._mark_closed():
            return
        grace = max(deadline, time.monotonic()) + min(timeout, _CLOSE_GRACE_S)
        workers = self._stop_workers()
        loop, thread = self._loop, self._thread
        if loop is not None and not loop.is_closed() and (thread is not None or loop.is_running()):
            try:
                future = asyncio.run_coroutine_threadsafe(self._stop_tasks(), loop)
                future.result(max(grace - time.monotonic(), 0))
            except (
                RuntimeError,
                concurrent.futures.TimeoutError,
                concurrent.futures.CancelledError,
            ):
                pass  # the loop is stuck or gone: _finish() counts what is left
            if thread is not None:
                with contextlib.suppress(RuntimeError):
                    loop.call_soon_threadsafe(loop.stop)
                thread.join(max(grace - time.monotonic(), 0))
        for worker in workers:
            worker.done.wait(max(grace - time.monotonic(), 0))
        self._finish(workers, timeout)

    def _mark_closed(self) -> bool:
        """Stop accepting events for the sinks; count what is still queued as not flushed."""
        with self._lock:
            if self._closed:
                return False
            self._closed = True
            pending = len(self._pending)
            self._pending.clear()
            for channel in self._channels:
                channel.drop("sink_error" if channel.disabled else "not_flushed", pending)
                channel.drop("not_flushed", len(channel.queue))
                channel.queue.clear()
        atexit.unregister(self._atexit_ref)
        return True

    def _stop_workers(self) -> list[_SinkThread]:
        """Tell every sink thread to close its sink once its current batch is done."""
        workers = [c.worker for c in self._channels if c.worker is not None]
        for worker in workers:
            worker.stop = True
            worker.wake.set()
        return workers

    async def _stop_tasks(self) -> None:
        """On the bus loop: cancel the pump and the async sinks' tasks, then close those sinks."""
        tasks = [c.task for c in self._channels if c.task is not None]
        if self._pump_task is not None:
            tasks.append(self._pump_task)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._pump_task = None
        for channel in self._channels:
            channel.task = None
            if channel.is_async:
                self._close_sink(channel)

    def _finish(self, workers: list[_SinkThread], timeout: float) -> None:
        """Count batches still inside a sink as abandoned and report what was lost."""
        with self._lock:
            for channel in self._channels:
                if channel.in_flight:
                    channel.drop("abandoned", channel.in_flight)
                    channel.abandoned_seq, channel.abandoned = channel.seq, channel.in_flight
                    channel.in_flight = 0
                channel.seq += 1
            losses = {
                c.name: n
                for c in self._channels
                if (n := c.drops.get("not_flushed", 0) + c.drops.get("abandoned", 0))
            }
        for worker in workers:
            if not worker.done.is_set():
                logger.error(
                    "%s did not return from handle() within %.1f s of close(); its daemon "
                    "thread is left behind and does not delay exit",
                    worker.thread.name,
                    timeout,
                )
        if losses:
            logger.warning(
                "EventBus closed with undelivered events, counted as dropped: %s",
                ", ".join(f"{name} {n}" for name, n in losses.items()),
            )

    def _forget(self) -> None:
        """Close an inherited, unused bus without touching the parent's sinks."""
        if self._mark_closed():
            self._finish([], 0.0)

    # -- signals --------------------------------------------------------------------------

    def close_on_signal(
        self, signum: int = signal.SIGTERM, *, timeout: float = _EXIT_TIMEOUT_S
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

        Returns:
            A function that puts the previous handler back (if ours is still installed).

        Raises:
            ValueError: called from a thread other than the main thread.
        """
        previous = signal.getsignal(signum)
        if previous is signal.SIG_IGN:
            return lambda: None
        phase = [0]  # 0 armed, 1 closing, 2 closed
        retries = [0]

        def chain(frame: FrameType | None) -> None:
            if callable(previous):
                previous(signum, frame)
                return
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)

        def close_and_report(resend: bool) -> None:
            self._close_for_signal(signum, timeout)
            phase[0] = 2
            if resend:
                os.kill(os.getpid(), signum)

        def handler(received: int, frame: FrameType | None) -> None:
            if phase[0]:
                chain(frame)
                return
            # The close runs on a helper thread while this (the main) thread waits in here,
            # so the main thread emits nothing more meanwhile. But the signal may have
            # interrupted it holding the bus lock or a logging lock the close needs: then
            # try again a moment later, at another point of its code.
            busy = not self._lock_is_free() or _interrupted_inside(frame, _LOGGING_DIR)
            if busy and retries[0] < _SIGNAL_RETRIES:
                retries[0] += 1
                threading.Timer(0.001, os.kill, (os.getpid(), signum)).start()
                return
            phase[0] = 1
            # Still busy: do not wait; the closer re-sends the signal when it is done.
            closer = threading.Thread(
                target=close_and_report, args=(busy,), name="omnitrace-bus-signal", daemon=True
            )
            closer.start()
            if busy:
                return
            closer.join(timeout + _CLOSE_GRACE_S + 1.0)
            chain(frame)

        signal.signal(signum, handler)

        def restore() -> None:
            if signal.getsignal(signum) is handler:
                signal.signal(signum, previous if previous is not None else signal.SIG_DFL)

        return restore

    def _lock_is_free(self) -> bool:
        """Whether nobody, this thread included, holds the bus lock right now."""
        if not self._lock.acquire(blocking=False):
            return False
        self._lock.release()
        return True

    def _close_for_signal(self, signum: int, timeout: float) -> None:
        start = time.monotonic()
        try:
            self.close(timeout)
        except Exception:
            logger.exception("EventBus.close() on %s failed", signal.Signals(signum).name)
            return
        stats = self.statistics()
        parts = []
        for sink in stats.sinks:
            reasons = ", ".join(f"{k} {v}" for k, v in sorted(sink.dropped_by.items()))
            parts.append(
                f"{sink.name}: delivered {sink.delivered}, lost {sink.dropped}"
                + (f" ({reasons})" if reasons else "")
            )
        logger.warning(
            "EventBus closed on %s in %.2f s; %d events emitted; %s",
            signal.Signals(signum).name,
            time.monotonic() - start,
            stats.emitted,
            "; ".join(parts) or "no sinks",
        )

    # -- fork -----------------------------------------------------------------------------

    def _after_fork_in_child(self) -> None:
        # Another thread may have held the lock at fork(): it never releases it here.
        self._lock = threading.Lock()
        self._emitted_at_fork = self._emitted
        if self._closed or not self._started:
            return
        self._pending.clear()
        for channel in self._channels:
            # The parent delivers what it had not yet; the child's copy is discarded and
            # counted. Reckoned from the counters rather than the queues: a thread of the
            # parent may have been moving a batch between them, lock held, at the fork.
            undelivered = self._emitted - channel.base - channel.delivered - channel.dropped
            channel.drop("forked", undelivered)
            channel.queue.clear()
            channel.in_flight = 0
            channel.seq += 1
            channel.worker = None
            channel.task = None
            channel.wakeup = None
        if self._loop is not None:
            # The parent's loop (its thread is gone here): never closed or collected in the
            # child, where it still looks like it is running.
            _ORPHANED_LOOPS.append(self._loop)
        self._loop = None
        self._thread = None
        self._pump_task = None
        self._started = False
        self._dormant = True

    def __enter__(self) -> EventBus:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else ("running" if self._started else "idle")
        return f"<EventBus {state} sinks={len(self._channels)} emitted={self._emitted}>"


def _run_loop(loop: asyncio.AbstractEventLoop) -> None:
    """Run the bus's own loop until stopped, then finish its tasks and close it."""
    asyncio.set_event_loop(loop)
    try:
        loop.run_forever()
    finally:
        try:
            tasks = asyncio.all_tasks(loop)
            for task in tasks:
                task.cancel()
            if tasks:
                loop.run_until_complete(asyncio.gather(*tasks, return_exceptions=True))
            loop.run_until_complete(loop.shutdown_asyncgens())
        finally:
            loop.close()


def _interrupted_inside(frame: FrameType | None, directory: str) -> bool:
    """Whether ``frame`` or a caller of it runs code from ``directory``."""
    while frame is not None:
        if frame.f_code.co_filename.startswith(directory):
            return True
        frame = frame.f_back
    return False


_BUSES: weakref.WeakSet[EventBus] = weakref.WeakSet()
_ORPHANED_LOOPS: list[asyncio.AbstractEventLoop] = []


def _after_fork_in_child() -> None:
    for bus in list(_BUSES):
        bus._after_fork_in_child()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def _register_atexit(bus: EventBus) -> Callable[[], None]:
    # A weak reference: registering must not keep every bus alive until exit.
    ref = weakref.ref(bus)

    def close_at_exit() -> None:
        live = ref()
        if live is None or live.closed:
            return
        if live._dormant and live._emitted == live._emitted_at_fork:
            # A forked child that never used its parent's bus: leave the parent's sinks
            # alone and add nothing to this process's exit.
            live._forget()
            return
        with contextlib.suppress(RuntimeError):  # the loop thread itself is exiting
            live.close(timeout=_EXIT_TIMEOUT_S)

    atexit.register(close_at_exit)
    return close_at_exit
