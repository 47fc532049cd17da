"""Background preparation: an adapter's thread that warms up (and compiles) admitted keys, so
that their next call captures without the slow part."""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
import weakref
from collections.abc import Callable, Hashable, Iterator
from typing import Any, NamedTuple

import torch

from omnitrace.config import ConfigError
from omnitrace.graphs.backends.base import CAPTURE_LOCK, OutputLayout, static_copies
from omnitrace.graphs.capture import Due
from omnitrace.graphs.compiling import compile_lock
from omnitrace.graphs.gil import COMPILE_SWITCH_INTERVAL, COMPILE_YIELD
from omnitrace.graphs.hooks import AdapterHooks
from omnitrace.signature import Signature

__all__ = ["Job", "Preparation", "check_backend"]

logger = logging.getLogger(__name__)

# A compiling preparation holds the capture lock, so a prepared key's call meanwhile runs
# eagerly. Before it starts compiling, a preparation thread waits up to this long while any
# adapter holds a key that became ready less than this long ago or whose call found the lock
# taken since the last such wait: back-to-back compiles never starve the captures of shapes
# that recur, and a shape that never recurs holds nobody up for long.
_DEFER_S = 1.0

# Preparations whose thread started: the ones a compile's deferral looks at.
_STARTED: weakref.WeakSet[Preparation] = weakref.WeakSet()


def check_backend(backend_name: str, error_modes: tuple[str, ...]) -> None:
    """Refuse background preparation for a backend that captures in the global mode only.

    Raises:
        ConfigError: ``error_modes`` lacks ``thread_local``.
    """
    if "thread_local" not in error_modes:
        raise ConfigError(
            f"encoder_cuda_graph_background_capture: the {backend_name} backend captures in "
            "CUDA's global capture mode only (vLLM's encoder graph manager opens the capture "
            "itself), which other threads' CUDA work would break; use it with the torch "
            "backend, or capture synchronously"
        )


class Job(NamedTuple):
    """A background preparation: what the preparation thread needs, taken on the call path."""

    key: Hashable
    inputs: list[torch.Tensor | None]
    device: torch.device
    stream: int
    replay_stream: Any
    signature: Signature
    inference: bool


def _waiting_ready_keys() -> bool:
    """Whether any adapter holds a ready key that a compile should let be captured first:
    one ready less than ``_DEFER_S`` ago, or one whose call found the lock taken."""
    since = time.monotonic() - _DEFER_S
    for preparation in list(_STARTED):
        if preparation._hooks.failed():
            continue
        if preparation.wanted or any(at > since for _, at in list(preparation.ready.values())):
            return True
    return False


class Preparation:
    """One adapter's preparation thread, its job queue and the keys it prepared.

    Args:
        hooks: the adapter's name, lock and callbacks (a failed preparation goes to its
            ``fail``, which makes the adapter terminal).
        compiled: whether the forward is compiled (a compiling warm-up holds the capture
            lock and torch.compile's own lock, see :meth:`_scope`).
        warm_up: runs the capture forward once on a job's inputs, returns the output layout.
    """

    def __init__(
        self,
        hooks: AdapterHooks,
        *,
        compiled: bool,
        warm_up: Callable[[list[torch.Tensor | None]], OutputLayout],
    ) -> None:
        self._hooks = hooks
        self._compiled = compiled
        self._warm_up = warm_up
        self.preparing: set[Hashable] = set()
        # Keys whose preparation finished: the next call captures them. Values: the
        # warm-up's output layout (None: warm up again at capture) and when it was ready.
        self.ready: dict[Hashable, tuple[OutputLayout | None, float]] = {}
        # Ready keys whose call found the capture lock taken by a compiling preparation.
        self.wanted: set[Hashable] = set()
        self._jobs: queue.SimpleQueue[Job | None] | None = None
        self._worker: threading.Thread | None = None

    def submit(self, due: Due, replay_stream: Any, *, owner: object) -> None:
        """Prepare ``due``'s key on the thread, started on the first job (adapter lock held).

        ``replay_stream``: the stream the call runs on (None on a simulated device).
        ``owner``: the adapter, which the thread keeps alive until it stops (it calls back
        into it), so the exit-time close still finds it.
        """
        self.preparing.add(due.key)
        # The caller may reuse its tensors once this call returns: the thread gets copies,
        # made on the caller's stream, laid out as the capture's static inputs will be (so a
        # compiled forward's guards match at capture).
        job = Job(
            due.key,
            static_copies(due.inputs),
            due.device,
            due.stream,
            replay_stream,
            due.signature,
            torch.is_inference_mode_enabled(),
        )
        if self._jobs is None:
            self._jobs = queue.SimpleQueue()
            self._worker = threading.Thread(
                target=self._loop,
                args=(self._jobs, owner),
                name=f"omnitrace-prepare-{self._hooks.name}",
                daemon=True,
            )
            self._worker.start()
            _STARTED.add(self)
        self._jobs.put(job)

    def wait(self, timeout: float) -> bool:
        """Wait until no preparation is running; True when none is left."""
        deadline = time.monotonic() + timeout
        while self.preparing and not self._hooks.failed():
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.005)
        return not self.preparing

    def stop(self, timeout: float) -> None:
        """Stop the thread after the jobs already queued, waiting up to ``timeout`` for it."""
        jobs = self._jobs
        if jobs is not None:
            jobs.put(None)
        worker = self._worker
        if worker is not None and worker is not threading.current_thread():
            worker.join(timeout)

    def _loop(self, jobs: queue.SimpleQueue[Job | None], owner: object) -> None:
        side: dict[torch.device, Any] = {}
        while True:
            job = jobs.get()
            if job is None or self._hooks.failed():
                return
            self._prepare(job, side)
            del job  # the input copies go now, not when the next job comes

    def _prepare(self, job: Job, side: dict[torch.device, Any]) -> None:
        """Warm up (and compile), then mark the key ready for capture."""
        try:
            with self._scope(job), _grad_scope(job):
                if job.device.type == "cuda":
                    with torch.cuda.device(job.device), self._stream(job, side):
                        layout = self._warm_up(job.inputs)
                else:
                    layout = self._warm_up(job.inputs)
        except BaseException as exc:
            with self._hooks.lock:
                self.preparing.discard(job.key)
                failure = self._hooks.fail(exc, job.signature, job.device, job.stream)
            logger.error(
                "omnitrace: background preparation of %s for %r failed: %s; "
                "the adapter is terminal",
                job.signature.text,
                self._hooks.name,
                failure,
            )
            return
        with self._hooks.lock:
            self.preparing.discard(job.key)
            # A compiled forward warms up once more at capture, on the caller's thread: a
            # guard that differs there (a thread-local mode) recompiles outside the capture.
            self.ready[job.key] = (None if self._compiled else layout, time.monotonic())

    def _stream(self, job: Job, side: dict[torch.device, Any]) -> Any:
        """The stream a warm-up runs on: the caller's for an eager forward, a side stream
        for a compile.

        The caching allocator keeps a stream's freed blocks for that stream alone. An eager
        warm-up on the caller's stream leaves its activations to the engine's next steps; on
        a stream of its own they would stay reserved for it, out of the engine's reach and
        counted against the free-memory floor (freeing them needs a device-wide
        synchronisation, which no capture in the process may overlap). A compile stays on a
        side stream: Inductor's autotuning times kernels on its current stream, and the
        caller's stream is busy with the engine's work.
        """
        if not self._compiled:
            return torch.cuda.stream(job.replay_stream)
        stream = side.get(job.device)
        if stream is None:
            stream = side[job.device] = torch.cuda.Stream(job.device)  # type: ignore[no-untyped-call]
        # The copies were made on the caller's stream: the side stream waits, and their
        # blocks are kept until the side stream is done with them.
        stream.wait_stream(job.replay_stream)
        for tensor in job.inputs:
            if tensor is not None:
                tensor.record_stream(stream)
        return torch.cuda.stream(stream)

    @contextlib.contextmanager
    def _scope(self, job: Job) -> Iterator[None]:
        """What a preparation holds while it warms up.

        An eager warm-up holds nothing: its kernels and allocations on the caller's stream
        are allowed beside a thread-local capture on another thread (the capture stream
        waited for the caller's stream before its capture began). A compiled one holds the
        capture lock and torch.compile's own lock: compiling may synchronise the device
        (autotuning), which no capture may overlap. A call whose key is ready then runs
        eagerly rather than wait, and the next compile first gives fresh ready keys a
        moment to be captured (``_DEFER_S``).
        """
        if not self._compiled:
            yield
            return
        deadline = time.monotonic() + _DEFER_S
        while time.monotonic() < deadline and _waiting_ready_keys():
            time.sleep(0.002)
        for preparation in list(_STARTED):
            preparation.wanted.clear()  # each wait is earned once; a later miss earns another
        with (
            CAPTURE_LOCK,
            compile_lock(True),
            COMPILE_SWITCH_INTERVAL.short(),
            COMPILE_YIELD.yielding(),
        ):
            # Compiles hold the capture lock one at a time: the difference is this one's.
            began, yielded = time.monotonic(), COMPILE_YIELD.statistics()
            yield
            took, now = time.monotonic() - began, COMPILE_YIELD.statistics()
        logger.debug(
            "omnitrace: %r compiled %s in %.2f s; it paused %d times (%.0f ms) for eager calls",
            self._hooks.name,
            job.signature.text,
            took,
            now.pauses - yielded.pauses,
            (now.paused_s - yielded.paused_s) * 1e3,
        )


def _grad_scope(job: Job) -> contextlib.AbstractContextManager[Any]:
    """The admitting call's autograd mode (calls with grad enabled are never graphed)."""
    return torch.inference_mode() if job.inference else torch.no_grad()
