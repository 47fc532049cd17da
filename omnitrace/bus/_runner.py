"""The loop runner: where the bus runs (the host's asyncio loop or a thread of its own), and
what carries each batch into its sink."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import threading
import time
from collections.abc import Callable
from typing import NamedTuple

from omnitrace.bus._channels import SinkChannel, SinkChannels
from omnitrace.bus._types import EventsNotWritten

__all__ = ["CLOSE_GRACE_S", "POLL_S", "LoopRunner", "SinkThread", "StopRequest"]

logger = logging.getLogger(__name__)

#: Longest a flush or close sleeps between two checks.
POLL_S = 0.001
#: What ``close()`` adds to its timeout, at most, for the sinks' own ``close()``.
CLOSE_GRACE_S = 0.25

# Loops of a parent process, inherited by a forked child where their threads are gone: kept
# so that they are never closed or collected in the child, where they still look running.
_ORPHANED_LOOPS: list[asyncio.AbstractEventLoop] = []


def running_loop() -> asyncio.AbstractEventLoop | None:
    """Return the calling thread's running loop, if any."""
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None


class SinkThread:
    """The daemon thread that runs one plain sink's ``handle`` and, at the end, its ``close``."""

    __slots__ = ("done", "stop", "thread", "wake")

    def __init__(self, target: Callable[[SinkThread], None], name: str) -> None:
        self.wake = threading.Event()
        self.done = threading.Event()
        self.stop = False
        # A daemon: a sink stuck in handle() must never keep the interpreter from exiting.
        self.thread = threading.Thread(
            target=target, args=(self,), name=f"omnitrace-sink-{name}", daemon=True
        )


class StopRequest(NamedTuple):
    """What :meth:`LoopRunner.begin_stop` set stopping, for :meth:`LoopRunner.end_stop`."""

    workers: list[SinkThread]
    loop: asyncio.AbstractEventLoop | None
    thread: threading.Thread | None
    future: concurrent.futures.Future[None] | None


class LoopRunner:
    """Run the pump and the sinks of one bus on a loop and on sink threads.

    Args:
        lock: the bus lock (replaced in a forked child).
        channels: the channels it drains.
        interval: seconds between two runs of the pump.
    """

    __slots__ = (
        "channels",
        "dormant",
        "interval",
        "lock",
        "loop",
        "pump_task",
        "started",
        "tasks",
        "thread",
        "wakeups",
        "workers",
    )

    def __init__(self, lock: threading.Lock, channels: SinkChannels, interval: float) -> None:
        self.lock = lock
        self.channels = channels
        self.interval = interval
        self.loop: asyncio.AbstractEventLoop | None = None
        self.thread: threading.Thread | None = None
        self.started = False
        # Set in a forked child whose inherited bus has no threads until it is used.
        self.dormant = False
        self.pump_task: asyncio.Task[None] | None = None
        # What drains each channel: a thread for a plain sink, a task (and the event that
        # wakes it) for a coroutine sink.
        self.workers: dict[SinkChannel, SinkThread] = {}
        self.tasks: dict[SinkChannel, asyncio.Task[None]] = {}
        self.wakeups: dict[SinkChannel, asyncio.Event] = {}

    # -- starting -------------------------------------------------------------------------

    def start(self, loop: asyncio.AbstractEventLoop | None = None) -> None:
        """Start draining on ``loop``, the caller's running loop or a thread of our own."""
        self.dormant = False
        self._start(loop)

    def _start(self, loop: asyncio.AbstractEventLoop | None = None, *, own: bool = False) -> None:
        with self.lock:
            if self.started or self.channels.closed:
                return
        if loop is None and not own:
            loop = running_loop()
        thread = None
        if loop is None:
            loop = asyncio.new_event_loop()
            thread = threading.Thread(
                target=_run_loop, args=(loop,), name="omnitrace-bus", daemon=True
            )
        with self.lock:
            if self.started or self.channels.closed:
                if thread is not None:
                    loop.close()
                return
            # Loop and started flag change together: add_sink() spawns on the loop it sees.
            self.started, self.loop, self.thread = True, loop, thread
            channels = self.channels.channels
        if thread is not None:
            try:
                thread.start()
            except RuntimeError:
                with self.lock:
                    self.started, self.loop, self.thread = False, None, None
                loop.close()
                raise
        for channel in channels:
            self.spawn(channel)

    def spawn(self, channel: SinkChannel) -> None:
        """Start what drains ``channel`` (a thread, or a task on the loop) and the pump."""
        loop = self.loop
        if loop is None:
            return
        if channel.is_async:
            loop.call_soon_threadsafe(self._spawn_task, channel)
        else:
            worker = None
            with self.lock:
                if channel not in self.workers and not channel.disabled:
                    worker = self.workers[channel] = SinkThread(
                        lambda w: self._run_sink_thread(channel, w), channel.name
                    )
            if worker is not None:
                worker.thread.start()
        loop.call_soon_threadsafe(self._spawn_pump)

    def _spawn_task(self, channel: SinkChannel) -> None:
        loop = self.loop
        if channel in self.tasks or loop is None or self.channels.closed:
            return
        wakeup = self.wakeups[channel] = asyncio.Event()
        self.tasks[channel] = loop.create_task(self._drain_task(channel, wakeup))

    def _spawn_pump(self) -> None:
        loop = self.loop
        if self.pump_task is None and loop is not None and not self.channels.closed:
            self.pump_task = loop.create_task(self._pump())

    def revive(self) -> bool:
        """Make sure something drains the sinks; return whether it does.

        A forked child's inherited bus starts threads of its own here, and a bus whose host
        loop has closed moves to a thread of its own.
        """
        if self.channels.closed:
            return False
        try:
            if self.dormant:
                self.start()
            else:
                loop = self.loop
                if loop is not None and self.thread is None and loop.is_closed():
                    self._hand_over()
        except RuntimeError as exc:  # no new threads at interpreter shutdown
            logger.error("EventBus cannot start its threads: %s", exc)
            return False
        return self.started

    def _hand_over(self) -> None:
        """Move the pump and the async sinks from the host's (ending) loop to our own thread."""
        with self.lock:
            if self.channels.closed or not self.started:
                return
            self.started = False
            self.pump_task = None
            self.tasks.clear()
            self.wakeups.clear()
        logger.debug("the host's event loop ended; EventBus continues on a thread of its own")
        self._start(own=True)

    # -- moving events --------------------------------------------------------------------

    async def _pump(self) -> None:
        try:
            while True:
                await asyncio.sleep(self.interval)
                self._distribute()
        except asyncio.CancelledError:
            if not self.channels.closed and self.thread is None:
                # Only the host can cancel us here: its loop is ending (asyncio.run cancels
                # every task before it closes the loop). Keep delivering from our own thread.
                self._hand_over()
            raise

    def _distribute(self) -> None:
        for channel in self.channels.distribute():
            self.wake(channel)

    def wake(self, channel: SinkChannel) -> None:
        """Tell what drains ``channel`` that it has events."""
        worker = self.workers.get(channel)
        if worker is not None:
            worker.wake.set()
            return
        wakeup, loop = self.wakeups.get(channel), self.loop
        if wakeup is None or loop is None:
            return
        try:
            if running_loop() is loop:
                wakeup.set()
            else:
                loop.call_soon_threadsafe(wakeup.set)
        except RuntimeError:
            pass  # the host loop is closed: the next flush() or close() hands the bus over

    def flush_step(self, target: int) -> bool:
        """Distribute and wake; return whether a sink still lacks events emitted before
        ``target`` (the emitted count when the flush began)."""
        self._distribute()
        busy, queued = self.channels.behind(target)
        for channel in queued:
            self.wake(channel)
        return busy

    def _run_sink_thread(self, channel: SinkChannel, worker: SinkThread) -> None:
        channels = self.channels
        try:
            while True:
                worker.wake.wait()
                worker.wake.clear()
                while (taken := channels.take(channel)) is not None:
                    batch, seq = taken
                    try:
                        channel.sink.handle(batch)
                    except EventsNotWritten as exc:  # a partial loss: the sink stays attached
                        channels.delivered(channel, seq, exc.count)
                        continue
                    except BaseException as exc:  # a sink never ends its thread unreported
                        channels.disable(channel, exc, seq)
                        break
                    channels.delivered(channel, seq)
                if worker.stop:
                    channels.close_sink(channel)
                    return
        finally:
            worker.done.set()

    async def _drain_task(self, channel: SinkChannel, wakeup: asyncio.Event) -> None:
        channels = self.channels
        while True:
            await wakeup.wait()
            wakeup.clear()
            while (taken := channels.take(channel)) is not None:
                batch, seq = taken
                try:
                    await channel.sink.handle(batch)
                except asyncio.CancelledError as exc:
                    if not _cancelled_from_outside():
                        # The sink raised it itself: a sink error like any other.
                        channels.disable(channel, exc, seq)
                        return
                    channels.abandon(channel, seq)
                    # A task on another loop may be waiting to take the next batch.
                    self.wake(channel)
                    raise
                except EventsNotWritten as exc:  # a partial loss: the sink stays attached
                    channels.delivered(channel, seq, exc.count)
                    continue
                except BaseException as exc:
                    # SystemExit or KeyboardInterrupt out of a task would end the loop, and
                    # with it the pump and every other sink: a sink never takes it down.
                    channels.disable(channel, exc, seq)
                    return
                channels.delivered(channel, seq)

    # -- stopping -------------------------------------------------------------------------

    def check_not_loop_thread(self, name: str, alternative: str) -> None:
        """Refuse a blocking ``name()`` on the thread that runs the bus loop.

        Raises:
            RuntimeError: called on the bus loop's thread.
        """
        loop = self.loop
        if loop is not None and running_loop() is loop:
            raise RuntimeError(
                f"EventBus.{name}() would block the loop that drains the bus; "
                f"use 'await bus.{alternative}()' there"
            )

    def _stop_workers(self) -> list[SinkThread]:
        """Tell every sink thread to close its sink once its current batch is done."""
        workers = list(self.workers.values())
        for worker in workers:
            worker.stop = True
            worker.wake.set()
        return workers

    async def _stop_tasks(self) -> None:
        """On the bus loop: cancel the pump and the async sinks' tasks, then close those sinks."""
        tasks = list(self.tasks.values())
        if self.pump_task is not None:
            tasks.append(self.pump_task)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self.pump_task = None
        self.tasks.clear()
        for channel in self.channels.channels:
            if channel.is_async:
                self.channels.close_sink(channel)

    def begin_stop(self) -> StopRequest:
        """Tell the pump, the sink tasks and the sink threads to stop; wait for nothing.

        Several buses closing together (at exit) all begin before any is waited for, so
        their sinks close side by side within one bound.
        """
        workers = self._stop_workers()
        loop, thread = self.loop, self.thread
        future: concurrent.futures.Future[None] | None = None
        if loop is not None and not loop.is_closed() and (thread is not None or loop.is_running()):
            with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
                future = asyncio.run_coroutine_threadsafe(self._stop_tasks(), loop)
        return StopRequest(workers, loop, thread, future)

    @staticmethod
    def end_stop(request: StopRequest, grace: float) -> list[SinkThread]:
        """Wait until ``grace`` (a monotonic deadline) at most for what ``request`` stops;
        stop our loop. Return the sink threads, finished or not."""
        loop, thread = request.loop, request.thread
        if request.future is not None:
            # The loop stuck or gone: the close counts what is left.
            with contextlib.suppress(
                RuntimeError, concurrent.futures.TimeoutError, concurrent.futures.CancelledError
            ):
                request.future.result(max(grace - time.monotonic(), 0))
        if loop is not None and thread is not None:
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(loop.stop)
            thread.join(max(grace - time.monotonic(), 0))
        for worker in request.workers:
            worker.done.wait(max(grace - time.monotonic(), 0))
        return request.workers

    async def astop(self, grace: float) -> list[SinkThread]:
        """Like :meth:`stop`, awaited on a loop (the bus's or another)."""
        workers = self._stop_workers()
        loop = self.loop
        if loop is not None and loop is running_loop():
            await self._stop_tasks()
        elif loop is not None and loop.is_running():
            future = asyncio.run_coroutine_threadsafe(self._stop_tasks(), loop)
            with contextlib.suppress(asyncio.TimeoutError, concurrent.futures.CancelledError):
                await asyncio.wait_for(
                    asyncio.wrap_future(future), max(grace - time.monotonic(), 0)
                )
        if self.thread is not None and loop is not None:
            # The loop thread finishes its tasks and closes its loop by itself.
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(loop.stop)
        while any(not w.done.is_set() for w in workers) and time.monotonic() < grace:
            await asyncio.sleep(POLL_S * 5)
        return workers

    @staticmethod
    def report_stuck(workers: list[SinkThread], timeout: float) -> None:
        """Log each sink thread still inside ``handle()`` after the close."""
        for worker in workers:
            if not worker.done.is_set():
                logger.error(
                    "%s did not return from handle() within %.1f s of close(); its daemon "
                    "thread is left behind and does not delay exit",
                    worker.thread.name,
                    timeout,
                )

    def forget_parent(self) -> None:
        """In a forked child: drop the parent's loop and threads, which are gone here."""
        self.workers.clear()
        self.tasks.clear()
        self.wakeups.clear()
        if self.loop is not None:
            _ORPHANED_LOOPS.append(self.loop)
        self.loop = None
        self.thread = None
        self.pump_task = None
        self.started = False
        self.dormant = True


def _cancelled_from_outside() -> bool:
    """Whether the running task was cancelled (by the bus or the ending host loop), as
    opposed to its sink raising ``CancelledError`` of its own accord."""
    task = asyncio.current_task()
    cancelling = getattr(task, "cancelling", None)
    # Python 3.10 cannot tell the two apart: take it as a cancellation, which keeps the
    # hand-over from an ending host loop working.
    return cancelling is None or cancelling() > 0


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
