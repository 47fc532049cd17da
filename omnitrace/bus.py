"""The in-process event bus between the graph adapters and every consumer.

``emit()`` runs on the encoder's hot path, so it only does bounded, non-blocking work under
one short lock: it feeds the synchronous folds (the stats, which must see every event in
order and never drop one) and appends the event to one bounded pending queue, whatever the
number of sinks. On an asyncio loop (the host's, or the bus's own thread when the host has
none) a pump moves pending events into one bounded queue per sink and wakes each sink's
drainer; a sink whose queue is full loses the event and the loss is counted, and a sink
that raises is disabled and reported once. Nothing a consumer does can raise into, or block, the
caller of ``emit()``.
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import contextlib
import inspect
import logging
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from omnitrace.config import ConfigError
from omnitrace.events import EVENT_TYPES, Event
from omnitrace.stats import AdapterStats, StatsFold

__all__ = [
    "BusStatistics",
    "EventBus",
    "Fold",
    "Sink",
    "SinkStatistics",
]

logger = logging.getLogger("omnitrace.bus")

Fold = Callable[[Event], None]

_EVENT_TYPES = frozenset(EVENT_TYPES)
_DROP_REPORT_INTERVAL_S = 10.0


@runtime_checkable
class Sink(Protocol):
    """An asynchronous consumer of events.

    ``handle`` receives events in emission order, in batches. It may be a plain method (it
    then runs on a worker thread of its own, so a slow sink never stalls the others) or a
    coroutine function (awaited on the bus loop). An optional ``close()`` is called once
    when the bus closes; an optional ``name`` names the sink in statistics and logs.
    """

    def handle(self, events: Sequence[Event]) -> Any: ...


@dataclass(frozen=True, slots=True)
class SinkStatistics:
    """Delivery counters of one sink."""

    name: str
    capacity: int
    queued: int
    peak_queued: int
    delivered: int
    dropped: int
    """Events lost because the sink's queue was full (or it was disabled)."""
    disabled: bool
    error: str | None


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


class _Channel:
    """One sink's bounded queue and counters; mutated under the bus lock."""

    __slots__ = (
        "capacity",
        "delivered",
        "disabled",
        "dropped",
        "dropped_reported",
        "error",
        "executor",
        "in_flight",
        "is_async",
        "last_drop_report",
        "name",
        "peak",
        "queue",
        "sink",
        "wakeup",
    )

    def __init__(self, sink: Sink, name: str, capacity: int) -> None:
        self.sink = sink
        self.name = name
        self.capacity = capacity
        self.queue: deque[Event] = deque()
        self.delivered = 0
        self.dropped = 0
        self.dropped_reported = 0
        self.last_drop_report = 0.0
        self.peak = 0
        self.in_flight = 0
        self.disabled = False
        self.error: str | None = None
        self.is_async = inspect.iscoroutinefunction(sink.handle)
        self.executor: concurrent.futures.ThreadPoolExecutor | None = None
        self.wakeup: asyncio.Event | None = None

    def statistics(self, pending: int) -> SinkStatistics:
        return SinkStatistics(
            name=self.name,
            capacity=self.capacity,
            queued=len(self.queue) + self.in_flight + (0 if self.disabled else pending),
            peak_queued=self.peak,
            delivered=self.delivered,
            dropped=self.dropped,
            disabled=self.disabled,
            error=self.error,
        )


def _sink_name(sink: object) -> str:
    name = getattr(sink, "name", None)
    return name if isinstance(name, str) and name else type(sink).__name__


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
        self._pump_wakeup: asyncio.Event | None = None
        self._adapters: dict[str, Mapping[str, Any]] = {}
        self._emitted = 0
        self._rejected = 0
        self._after_close = 0
        self._disabled_folds = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._tasks: dict[_Channel, asyncio.Task[None]] = {}
        self._started = False
        self._closed = False
        self._atexit_ref = _register_atexit(self)
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
                return
            if self._channels:
                if len(self._pending) < self._queue_size:
                    self._pending.append(event)
                else:
                    # Degraded path only: the pump is behind, every sink loses this event.
                    for channel in self._channels:
                        channel.dropped += 1

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
            return BusStatistics(
                emitted=self._emitted,
                rejected=self._rejected,
                emitted_after_close=self._after_close,
                disabled_folds=self._disabled_folds,
                sinks=tuple(c.statistics(len(self._pending)) for c in self._channels),
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
            self._channels = (*self._channels, channel)
        if not self._started:
            self.start()
        else:
            loop = self._loop
            assert loop is not None
            loop.call_soon_threadsafe(self._spawn, channel)

    def start(self, loop: asyncio.AbstractEventLoop | None = None) -> None:
        """Start draining sink queues (idempotent).

        Uses ``loop`` if given, else the running loop of the calling thread, else a loop on a
        daemon thread of the bus's own.
        """
        with self._lock:
            if self._started or self._closed:
                return
            self._started = True
        if loop is None:
            try:
                loop = asyncio.get_running_loop()
            except RuntimeError:
                loop = None
        if loop is None:
            loop = asyncio.new_event_loop()
            ready = threading.Event()

            def run() -> None:
                asyncio.set_event_loop(loop)
                loop.call_soon(ready.set)
                loop.run_forever()

            self._thread = threading.Thread(target=run, name="omnitrace-bus", daemon=True)
            self._thread.start()
            ready.wait()
        self._loop = loop
        for channel in self._channels:
            loop.call_soon_threadsafe(self._spawn, channel)

    def _spawn(self, channel: _Channel) -> None:
        if channel in self._tasks or self._loop is None:
            return
        channel.wakeup = asyncio.Event()
        if not channel.is_async:
            channel.executor = concurrent.futures.ThreadPoolExecutor(
                max_workers=1, thread_name_prefix=f"omnitrace-sink-{channel.name}"
            )
        self._tasks[channel] = self._loop.create_task(self._drain_forever(channel))
        if self._pump_task is None:
            self._pump_wakeup = asyncio.Event()
            self._pump_task = self._loop.create_task(self._pump_forever())

    async def _pump_forever(self) -> None:
        wakeup = self._pump_wakeup
        assert wakeup is not None
        while True:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(wakeup.wait(), self._interval)
            wakeup.clear()
            self._distribute()

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
                    channel.dropped += len(batch)
                    continue
                queue = channel.queue
                room = channel.capacity - len(queue)
                if room < len(batch):
                    channel.dropped += len(batch) - max(room, 0)
                    queue.extend(batch[: max(room, 0)])
                else:
                    queue.extend(batch)
                channel.peak = max(channel.peak, len(queue))
                woken.append(channel)
        for channel in woken:
            if channel.wakeup is not None:
                channel.wakeup.set()

    async def _drain_forever(self, channel: _Channel) -> None:
        wakeup = channel.wakeup
        assert wakeup is not None
        while True:
            await wakeup.wait()
            wakeup.clear()
            await self._drain_once(channel)

    async def _drain_once(self, channel: _Channel) -> None:
        with self._lock:
            if channel.disabled or not channel.queue:
                batch: list[Event] = []
            else:
                batch = list(channel.queue)
                channel.queue.clear()
                channel.in_flight = len(batch)
            dropped = channel.dropped - channel.dropped_reported
        if dropped and time.monotonic() - channel.last_drop_report >= _DROP_REPORT_INTERVAL_S:
            channel.dropped_reported += dropped
            channel.last_drop_report = time.monotonic()
            logger.warning(
                "sink %s dropped %d events (queue capacity %d, %d dropped in all)",
                channel.name,
                dropped,
                channel.capacity,
                channel.dropped,
            )
        if not batch:
            return
        try:
            if channel.is_async:
                await channel.sink.handle(batch)
            else:
                loop = asyncio.get_running_loop()
                try:
                    future = loop.run_in_executor(channel.executor, channel.sink.handle, batch)
                except RuntimeError:
                    # At interpreter exit the executors shut down before the bus's atexit
                    # flush runs: deliver on this thread rather than lose the batch.
                    channel.sink.handle(batch)
                else:
                    await future
        except Exception as exc:
            self._disable_sink(channel, exc, len(batch))
            return
        with self._lock:
            channel.delivered += len(batch)
            channel.in_flight = 0

    def _disable_sink(self, channel: _Channel, exc: BaseException, lost: int) -> None:
        with self._lock:
            channel.disabled = True
            channel.error = f"{type(exc).__name__}: {exc}"
            channel.dropped += lost + len(channel.queue)
            channel.queue.clear()
            channel.in_flight = 0
        logger.error(
            "sink %s raised %s and is disabled; its events are dropped from now on",
            channel.name,
            channel.error,
            exc_info=(type(exc), exc, exc.__traceback__),
        )
        _close_quietly(channel)

    async def aflush(self, timeout: float = 5.0) -> bool:
        """Deliver every queued event now; return False if ``timeout`` passed first."""
        deadline = time.monotonic() + timeout
        while True:
            self._distribute()
            pending = False
            for channel in self._channels:
                with self._lock:
                    busy = not channel.disabled and (channel.queue or channel.in_flight)
                if busy:
                    pending = True
                    if channel.wakeup is not None:
                        channel.wakeup.set()
            if not pending:
                return True
            if time.monotonic() >= deadline:
                return False
            await asyncio.sleep(0.001)

    def flush(self, timeout: float = 5.0) -> bool:
        """Block until every queued event reached its sink; False if ``timeout`` passed.

        Raises:
            RuntimeError: called on the thread that runs the bus loop (use ``aflush``).
        """
        loop = self._loop
        if loop is None or not self._started:
            with self._lock:
                return not self._pending and not any(c.queue for c in self._channels)
        self._check_not_loop_thread("flush", "aflush")
        if loop.is_closed():
            return False
        future = asyncio.run_coroutine_threadsafe(self.aflush(timeout), loop)
        try:
            return future.result(timeout + 1.0)
        except (concurrent.futures.TimeoutError, concurrent.futures.CancelledError):
            return False

    def _check_not_loop_thread(self, name: str, alternative: str) -> None:
        loop = self._loop
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if loop is not None and running is loop:
            raise RuntimeError(
                f"EventBus.{name}() would block the loop that drains the bus; "
                f"use 'await bus.{alternative}()' there"
            )

    async def aclose(self, timeout: float = 5.0) -> None:
        """Flush, close every sink and stop draining (idempotent)."""
        if self._closed:
            return
        await self.aflush(timeout)
        self._mark_closed()
        tasks = [*self._tasks.values()]
        if self._pump_task is not None:
            tasks.append(self._pump_task)
        for task in tasks:
            task.cancel()
        # Wait for the cancellations, or a loop closed right after would destroy pending tasks.
        await asyncio.gather(*tasks, return_exceptions=True)
        for channel in list(self._tasks):
            if channel.executor is not None:
                await asyncio.get_running_loop().run_in_executor(
                    channel.executor, _close_quietly, channel
                )
            else:
                _close_quietly(channel)
        self._tasks.clear()
        self._pump_task = None

    def close(self, timeout: float = 5.0) -> None:
        """Flush, close every sink and stop the bus thread (idempotent).

        Events emitted afterwards still reach the folds and are counted in
        ``emitted_after_close``.
        """
        if self._closed:
            return
        loop = self._loop
        if loop is None or loop.is_closed():
            self._mark_closed()
            for channel in self._channels:
                _close_quietly(channel)
            return
        self._check_not_loop_thread("close", "aclose")
        future = asyncio.run_coroutine_threadsafe(self.aclose(timeout), loop)
        try:
            future.result(timeout + 5.0)
        except (concurrent.futures.TimeoutError, concurrent.futures.CancelledError):
            logger.error(
                "EventBus.close() timed out after %.1fs; undelivered events are lost", timeout
            )
            self._mark_closed()
        if self._thread is not None:
            loop.call_soon_threadsafe(loop.stop)
            self._thread.join(timeout)
            if not self._thread.is_alive():
                loop.close()
        for channel in self._channels:
            if channel.executor is not None:
                channel.executor.shutdown(wait=False)

    def _mark_closed(self) -> None:
        with self._lock:
            self._closed = True
            lost = 0
            for channel in self._channels:
                if not channel.disabled:
                    channel.dropped += len(self._pending)
            lost += len(self._pending)
            self._pending.clear()
            for channel in self._channels:
                lost += len(channel.queue)
                channel.dropped += len(channel.queue)
                channel.queue.clear()
        if lost:
            logger.warning("EventBus closed with %d undelivered events (counted as dropped)", lost)
        atexit.unregister(self._atexit_ref)

    def __enter__(self) -> EventBus:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else ("running" if self._started else "idle")
        return f"<EventBus {state} sinks={len(self._channels)} emitted={self._emitted}>"


def _close_quietly(channel: _Channel) -> None:
    close = getattr(channel.sink, "close", None)
    if close is None:
        return
    try:
        close()
    except Exception:
        logger.exception("sink %s raised while closing", channel.name)


def _register_atexit(bus: EventBus) -> Callable[[], None]:
    # A weak reference: registering must not keep every bus alive until exit.
    ref = weakref.ref(bus)

    def close_at_exit() -> None:
        live = ref()
        if live is not None and not live.closed:
            with contextlib.suppress(RuntimeError):  # the loop thread itself is exiting
                live.close(timeout=2.0)

    atexit.register(close_at_exit)
    return close_at_exit
