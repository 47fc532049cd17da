"""The exact-shape encoder graph adapter.

One call reads: check eligibility (``eligibility.py``), look the key up, replay; or admit
(``admission.py``) and capture, or run eagerly. Every decision is an event, folded into the
adapter's own stats and put on the bus. Opt-in variants, all off by default:

* ``compile``: the captured forward is ``torch.compile(forward)`` (inductor's fused kernels);
  eager misses still run the plain forward.
* ``background_capture``: the call that admits a key hands a copy of its inputs to this
  adapter's preparation thread and runs eagerly; the thread warms up (and compiles) on a side
  stream, never capturing, and marks the key ready. The next call of the key captures it on
  its own thread, without the warm-up (eager forward) or with one quick compiled call
  (compiled forward), and is served by the graph. Until then calls of that key are
  ``warmup`` misses with detail ``preparing``. The stream capture itself stays on the
  calling thread because it cannot run beside other threads' CUDA-graph recordings or
  device synchronisations (``cudaErrorStreamCaptureUnsupported`` in whichever thread hits
  it). A failed background preparation makes the adapter terminal like a failed capture;
  the next call raises, chained to the original error.
* ``device_timing``: CUDA events around eager and replayed calls, resolved off the call path
  (``timing.py``) into DeviceTimed events.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import queue
import re
import threading
import time
import weakref
from collections.abc import Callable, Hashable, Iterator
from typing import Any, NamedTuple

import torch

from omnitrace._validate import check_name
from omnitrace.bus import EventBus
from omnitrace.config import ConfigError, EncoderGraphConfig, EncoderGraphFailedError
from omnitrace.events import (
    CaptureFailed,
    Event,
    GraphCaptured,
    MemoryDeferred,
    MissReason,
    Phase,
    missed,
    replayed,
)
from omnitrace.graphs.admission import Admission, Verdict
from omnitrace.graphs.backends.base import (
    CAPTURE_LOCK,
    CapturedGraph,
    CaptureRequest,
    GraphBackend,
    OutputLayout,
    static_copies,
)
from omnitrace.graphs.eligibility import (
    call_key,
    examine,
    ineligible_detail,
    signature_of,
    state_detail,
)
from omnitrace.graphs.gil import COMPILE_SWITCH_INTERVAL, COMPILE_YIELD
from omnitrace.graphs.pools import PoolRegistry, PoolSlot
from omnitrace.graphs.timing import DeviceTimer
from omnitrace.signature import Signature
from omnitrace.stats import AdapterStats, StatsFold

__all__ = ["EncoderCudaGraph", "MESSAGE_MAX_CHARS", "failure_message"]

logger = logging.getLogger(__name__)

_INELIGIBLE = MissReason.INELIGIBLE
_WARMUP = MissReason.WARMUP

# A compiling preparation holds the capture lock, so a prepared key's call meanwhile runs
# eagerly. Before it starts compiling, a preparation thread waits up to this long while any
# adapter holds a key that became ready less than this long ago or whose call found the lock
# taken since the last such wait: back-to-back compiles never starve the captures of shapes
# that recur, and a shape that never recurs holds nobody up for long.
_DEFER_S = 1.0
_SERVING = Phase.SERVING
#: Longest capture-failure message put in events, logs and spans.
MESSAGE_MAX_CHARS = 300
# The start of a tensor or array repr, and long bracketed runs of numbers: model values
# that an exception message may carry and that must not reach telemetry.
_TENSOR_START = re.compile(r"\b(?:tensor|array|Parameter containing:\s*tensor)\(")
_PAREN = re.compile(r"[()]")
_NUMBERS = re.compile(r"\[[-+0-9.eE,\s\[\]]{24,}\]")
_mono = time.monotonic_ns
_epoch = time.time_ns
_perf = time.perf_counter


def _strip_values(text: str) -> str:
    """Replace the contents of tensor reprs and long number lists in ``text`` with ``...``."""
    out: list[str] = []
    pos = 0
    while (start := _TENSOR_START.search(text, pos)) is not None:
        out.append(text[pos : start.end()])
        depth, end = 1, len(text)
        for paren in _PAREN.finditer(text, start.end()):
            depth += 1 if paren.group() == "(" else -1
            if depth == 0:
                end = paren.end()
                break
        out.append("...)")
        pos = end
    out.append(text[pos:])
    return _NUMBERS.sub("[...]", "".join(out))


def failure_message(exc: BaseException) -> str:
    """Return the first line of ``exc``'s message, bounded and without tensor values.

    At most :data:`MESSAGE_MAX_CHARS` characters are kept; what is cut (the rest of the
    line and any further lines) is counted as ``... [+N chars]``.
    """
    try:
        text = str(exc)
    except Exception:  # a broken __str__ must not hide the capture failure
        return f"<unprintable {type(exc).__name__}>"
    text = _strip_values(text).strip()
    first = text.split("\n", 1)[0].rstrip()
    kept = first[:MESSAGE_MAX_CHARS]
    cut = len(text) - len(kept)
    return f"{kept} ... [+{cut} chars]" if cut else kept


def _recompile_limit() -> int | None:
    config = getattr(getattr(torch, "_dynamo", None), "config", None)
    for name in ("recompile_limit", "cache_size_limit"):
        value = getattr(config, name, None)
        if isinstance(value, int):
            return value
    return None


# Adapters that started a thread of their own (background preparation, device timing):
# closed at exit within a bound, so no preparation thread is still inside a forward when the
# interpreter tears down.
_THREADED: weakref.WeakSet[EncoderCudaGraph] = weakref.WeakSet()
_EXIT_CLOSE_S = 5.0


def _waiting_ready_keys() -> bool:
    """Whether any adapter holds a ready key that a compile should let be captured first:
    one ready less than ``_DEFER_S`` ago, or one whose call found the lock taken."""
    since = time.monotonic() - _DEFER_S
    for adapter in list(_THREADED):
        if adapter._failure is not None:
            continue
        if adapter._wanted or any(at > since for _, at in list(adapter._ready.values())):
            return True
    return False


def _close_at_exit() -> None:
    deadline = time.monotonic() + _EXIT_CLOSE_S
    for adapter in list(_THREADED):
        adapter.close(max(0.0, deadline - time.monotonic()))


atexit.register(_close_at_exit)


class _Entry:
    """A captured graph and the signature it was captured for."""

    __slots__ = ("graph", "signature")

    def __init__(self, graph: CapturedGraph, signature: Signature) -> None:
        self.graph = graph
        self.signature = signature


class _Due(NamedTuple):
    """A call whose key is due for a graph: what a capture or a preparation starts from."""

    key: Hashable
    inputs: tuple[Any, ...]
    device: torch.device
    stream: int
    signature: Signature


class _Job(NamedTuple):
    """A background preparation: what the preparation thread needs, taken on the call path."""

    key: Hashable
    inputs: list[torch.Tensor | None]
    device: torch.device
    stream: int
    replay_stream: Any
    signature: Signature
    inference: bool


class EncoderCudaGraph:
    """Replay one CUDA graph per exact input signature of an encoder forward.

    ``graph(*tensors)`` returns what ``forward(*tensors)`` returns (cloned out of the graph's
    static buffers on a hit) and reports its decision as events on ``bus``.

    Args:
        forward: the encoder forward; takes positional tensors (or None), returns tensors,
            None, or tuples/lists/dicts of them.
        name: adapter name used in events and stats (``"vision"``, ``"audio"``).
        config: admission and memory settings (defaults: ``EncoderGraphConfig()``).
        bus: where events go; without one they only feed this adapter's own stats.
        backend: graph backend; ``None`` picks vLLM's encoder graph manager when vLLM is
            importable and ``vllm_config`` is given, else the pure-torch CUDA graph backend.
        vllm_config: the engine's ``VllmConfig`` (only used when ``backend`` is None).

    Raises:
        TypeError: ``forward`` is not callable or ``config`` is not an EncoderGraphConfig.
        ConfigError: ``name`` is empty or has a control character or a lone surrogate, or
            ``background_capture`` is asked of a backend that cannot capture while other
            threads run CUDA work (vLLM's manager).
    """

    def __init__(
        self,
        forward: Callable[..., Any],
        *,
        name: str,
        config: EncoderGraphConfig | None = None,
        bus: EventBus | None = None,
        backend: GraphBackend | None = None,
        vllm_config: Any = None,
    ) -> None:
        if not callable(forward):
            raise TypeError(f"forward must be callable, got {type(forward).__name__}")
        check_name("name", name)
        if config is None:
            config = EncoderGraphConfig()
        elif not isinstance(config, EncoderGraphConfig):
            raise TypeError(f"config must be an EncoderGraphConfig, got {type(config).__name__}")
        if bus is not None and not isinstance(bus, EventBus):
            raise TypeError(f"bus must be an EventBus, got {type(bus).__name__}")
        if backend is None:
            from omnitrace.graphs.backends.select import select_backend

            backend = select_backend(vllm_config)
        modes = tuple(getattr(backend, "error_modes", ("global",)))
        if config.background_capture and "thread_local" not in modes:
            raise ConfigError(
                f"encoder_cuda_graph_background_capture: the {backend.name} backend captures in "
                "CUDA's global capture mode only (vLLM's encoder graph manager opens the capture "
                "itself), which other threads' CUDA work would break; use it with the torch "
                "backend, or capture synchronously"
            )
        if config.background_capture and config.compile:
            logger.warning(
                "omnitrace: %r compiles on its preparation thread; while it does, a "
                "torch.compile'd function called on another thread raises (PyTorch's FX "
                "tracing flag is process-wide). Use background compiled capture only where no "
                "other thread calls compiled code.",
                name,
            )
        self._forward = forward
        self.name = name
        self.config = config
        self.backend = backend
        # Thread-local where the backend allows it: other threads' calls (allocations,
        # syncs) during a capture neither fail nor break it.
        self._error_mode = "thread_local" if "thread_local" in modes else "global"
        self._closed = False
        self._bus = bus
        # max_graphs=0 keeps graphs "on": a cache of zero graphs is full, so every eligible
        # call is a capacity miss and the lost coverage shows, as for any full cache.
        self._enabled = config.enabled
        self._admission = Admission(config)
        self._pools = PoolRegistry(backend, share=config.share_pools)
        self._graphs: dict[Hashable, _Entry] = {}
        self._preparing: set[Hashable] = set()
        # Keys whose background preparation finished: the next call captures them. Values:
        # the warm-up's output layout (None: warm up again at capture) and when it was ready.
        self._ready: dict[Hashable, tuple[OutputLayout | None, float]] = {}
        # Ready keys whose call found the capture lock taken by a compiling preparation.
        self._wanted: set[Hashable] = set()
        self._fold = StatsFold()
        self._lock = threading.RLock()
        self._failure: str | None = None
        self._failure_exc: BaseException | None = None
        self._phase = _SERVING
        self._skip_profiling = config.skip_profiling
        self._compiled: Callable[..., Any] | None = None
        self._timers: dict[torch.device, DeviceTimer] | None = {} if config.device_timing else None
        self._jobs: queue.SimpleQueue[_Job | None] | None = None
        self._worker: threading.Thread | None = None
        if bus is not None:
            bus.register_adapter(
                name,
                {
                    "enabled": config.enabled,
                    "max_graphs": config.max_graphs,
                    "min_capture_calls": config.min_capture_calls,
                    "min_free_bytes": config.min_free_bytes,
                    "share_pools": config.share_pools,
                    "compile": config.compile,
                    "background_capture": config.background_capture,
                    "device_timing": config.device_timing,
                    "skip_profiling": config.skip_profiling,
                    "backend": backend.name,
                    "simulated": backend.simulated,
                },
            )

    # -- public introspection -------------------------------------------------------------

    @property
    def forward(self) -> Callable[..., Any]:
        return self._forward

    @property
    def terminal(self) -> bool:
        """Whether a capture failed and the adapter refuses every call."""
        return self._failure is not None

    @property
    def num_graphs(self) -> int:
        return len(self._graphs)

    @property
    def preparing(self) -> int:
        """Keys being warmed up (and compiled) by the background preparation thread."""
        return len(self._preparing)

    @property
    def ready(self) -> int:
        """Keys prepared in the background whose next call captures their graph."""
        return len(self._ready)

    @property
    def bus(self) -> EventBus | None:
        """The bus this adapter's events go to (None: they feed its own stats only).

        For an engine integration that reports facts about the adapter beside its calls (the
        vLLM plugin's ProfilingObserved) on the same bus as its calls.
        """
        return self._bus

    @property
    def phase(self) -> Phase:
        """The engine phase events are tagged with (``serving`` unless told otherwise)."""
        return self._phase

    def set_phase(self, phase: Phase | str) -> None:
        """Tag later events with ``phase``; with ``skip_profiling``, ``profiling`` calls stay
        eager and out of admission.

        Raises:
            ConfigError: ``phase`` is not a Phase or its value.
        """
        try:
            self._phase = Phase(phase)
        except ValueError:
            valid = ", ".join(p.value for p in Phase)
            raise ConfigError(f"phase: expected one of {valid}, got {phase!r}") from None

    def captured_keys(self) -> tuple[str, ...]:
        """Return the text keys of the held graphs, in capture order."""
        with self._lock:
            return tuple(entry.signature.text for entry in self._graphs.values())

    def captured_signatures(self) -> tuple[Signature, ...]:
        """Return the signatures of the held graphs, in capture order."""
        with self._lock:
            return tuple(entry.signature for entry in self._graphs.values())

    def get_cumulative_stats(self) -> dict[str, int | float]:
        """Return hits, misses by reason, hit rate, graph count and capture failures."""
        with self._lock:
            return self._fold.snapshot(self.name).as_dict()

    def stats(self) -> AdapterStats:
        """Return the frozen stats snapshot (more detail than the dict)."""
        with self._lock:
            return self._fold.snapshot(self.name)

    def __repr__(self) -> str:
        state = "terminal" if self._failure else ("enabled" if self._enabled else "disabled")
        return (
            f"<EncoderCudaGraph {self.name!r} {state} graphs={len(self._graphs)}/"
            f"{self.config.max_graphs} backend={self.backend.name}>"
        )

    def record_ineligible(self, detail: str, *inputs: torch.Tensor | None) -> None:
        """Count a call the model ran eagerly before reaching the adapter.

        For model-level fallbacks (training mode, extra outputs requested, stateful
        streaming ...): emits the ``ineligible`` miss the call would have produced, so stats
        and event logs still cover every encoder call. Runs nothing.
        """
        self._emit(
            missed(
                self.name,
                signature_of(inputs),
                _mono(),
                _epoch(),
                _INELIGIBLE,
                detail,
                None,
                self._phase,
            )
        )

    def wait_prepared(self, timeout: float = 60.0) -> bool:
        """Wait until no background preparation is running; True when none is left.

        Prepared keys are then ``ready``: each is captured by its next call.

        For tests, benchmarks and shutdown; the call path never waits.
        """
        deadline = time.monotonic() + timeout
        while self._preparing and self._failure is None:
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.005)
        return not self._preparing

    def close(self, timeout: float = 5.0) -> bool:
        """Stop the adapter's threads; True when nothing was left pending.

        Waits up to ``timeout`` for graphs being prepared in the background and for device
        timings, then stops the capture and timing threads. Graphs already captured keep
        replaying; a shape admitted after close is captured synchronously. Idempotent.
        """
        deadline = time.monotonic() + timeout
        self._closed = True
        prepared = self.wait_prepared(max(0.0, deadline - time.monotonic()))
        jobs = self._jobs
        if jobs is not None:
            jobs.put(None)
        worker = self._worker
        if worker is not None and worker is not threading.current_thread():
            worker.join(max(0.0, deadline - time.monotonic()))
        timed = all(
            timer.close(max(0.0, deadline - time.monotonic()))
            for timer in list((self._timers or {}).values())
        )
        return prepared and timed

    def flush_device_timing(self, timeout: float = 5.0) -> bool:
        """Resolve the device timings recorded so far (waiting up to ``timeout`` for the
        device); True when none is left. The call path never waits for them."""
        timers = list((self._timers or {}).values())
        return all(timer.resolve(timeout) for timer in timers)

    # -- the call path --------------------------------------------------------------------

    def _emit(self, event: Event) -> None:
        with self._lock:
            self._fold.fold(event)
        bus = self._bus
        if bus is not None:
            bus.emit(event)

    def _terminal_error(self) -> EncoderGraphFailedError:
        error = EncoderGraphFailedError(
            f"encoder graph {self.name!r} is unusable: its CUDA graph capture failed "
            f"({self._failure}). Restart the worker, optionally with encoder graphs "
            "disabled (--hf-overrides '{\"encoder_cuda_graph\": false}')."
        )
        # A background capture's exception reached no caller: the first refusal carries it.
        error.__cause__ = self._failure_exc
        return error

    def _timer(self, device: torch.device) -> DeviceTimer:
        timers = self._timers
        assert timers is not None
        timer = timers.get(device)
        if timer is None:
            with self._lock:
                timer = timers.get(device)
                if timer is None:
                    clock = self.backend.device_clock(device)
                    timer = timers[device] = DeviceTimer(clock, self._emit)
                    _THREADED.add(self)
        return timer

    def _eager(
        self,
        inputs: tuple[Any, ...],
        reason: MissReason,
        detail: str,
        signature: Signature,
        device: torch.device | None,
    ) -> Any:
        if self._failure is not None:
            # Another thread's capture failed since this call was admitted: terminal at once.
            raise self._terminal_error()
        phase = self._phase
        timer = None if self._timers is None or device is None else self._timer(device)
        marker = timer.start() if timer is not None else None
        # A compiling preparation pauses while eager calls are in flight (graphs/gil.py).
        token = COMPILE_YIELD.begin()
        start = _perf()
        try:
            return self._forward(*inputs)
        finally:
            # Emitted after the eager run, with its host time; a forward that raised is still
            # a call that missed.
            duration = _perf() - start
            COMPILE_YIELD.end(token)
            if timer is not None:
                timer.stop(marker, self.name, signature, "eager", phase)
            self._emit(
                missed(self.name, signature, _mono(), _epoch(), reason, detail, duration, phase)
            )

    def __call__(self, *inputs: torch.Tensor | None) -> Any:
        if self._failure is not None:
            raise self._terminal_error()
        found = call_key(inputs)
        device, parts = found if found is not None else (None, ())
        if device is not None:
            # A key with a graph was captured from eligible inputs: on a hit only the
            # process state (grad, autocast, capture) remains to check. Graphs are never
            # removed, so an entry read without the lock stays valid.
            entry = self._graphs.get((device, self.backend.stream_id(device), parts))
            if (
                entry is not None
                and (self._skip_profiling is False or self._phase is not Phase.PROFILING)
                and state_detail(device, self.backend) is None
            ):
                return self._replay(entry, inputs, device)
        return self._call_slow(inputs, found)

    def _replay(self, entry: _Entry, inputs: tuple[Any, ...], device: torch.device) -> Any:
        """Serve a hit; raise the terminal error if a capture failed meanwhile."""
        with self._lock:
            if self._failure is not None:
                raise self._terminal_error()
            phase = self._phase
            if self._timers is None:
                start = _perf()
                out = entry.graph.replay(inputs)
                duration = _perf() - start
            else:
                timer = self._timer(device)
                marker = timer.start()
                start = _perf()
                out = entry.graph.replay(inputs)
                duration = _perf() - start
                timer.stop(marker, self.name, entry.signature, "replay", phase)
            event = replayed(self.name, entry.signature, _mono(), _epoch(), duration, phase)
            self._fold.fold(event)
        bus = self._bus
        if bus is not None:
            bus.emit(event)
        return out

    def _call_slow(
        self,
        inputs: tuple[Any, ...],
        found: tuple[torch.device | None, tuple[Any, ...]] | None,
    ) -> Any:
        """Every call that is not a plain hit: check, admit, capture or run eagerly.

        ``found`` is ``call_key(inputs)``, as the fast path computed it.
        """
        call = examine(self.name, inputs)
        detail = ineligible_detail(call, enabled=self._enabled, backend=self.backend)
        if detail is None and self._skip_profiling and self._phase is Phase.PROFILING:
            detail = "profiling"
        if detail is not None:
            # Timed on the device only where the backend has a clock: one graph device.
            device = call.device
            if device is not None and (call.mixed or not self.backend.is_graph_device(device)):
                device = None
            return self._eager(inputs, _INELIGIBLE, detail, signature_of(inputs), device)
        device = call.device
        # An eligible call has tensor inputs, all of them read by examine() already.
        assert found is not None
        assert device is not None
        parts = found[1]
        stream = self.backend.stream_id(device)
        key = (device, stream, parts)
        miss: tuple[MissReason, str, Signature] | None = None
        with self._lock:
            # Checked again under the lock: a capture holds it, so a call that waited for a
            # capture that failed never starts another one, nor eager work.
            if self._failure is not None:
                raise self._terminal_error()
            entry = self._graphs.get(key)
            if entry is None:
                out, miss = self._admit(key, inputs, device, stream)
                if miss is None:
                    return out
        if miss is not None:
            # Eager work runs outside the lock: other threads' hits need not wait for it.
            return self._eager(inputs, *miss, device)
        # Captured by another thread since this call looked: a hit after all.
        assert entry is not None
        return self._replay(entry, inputs, device)

    def _admit(
        self,
        key: Hashable,
        inputs: tuple[Any, ...],
        device: torch.device,
        stream: int,
    ) -> tuple[Any, tuple[MissReason, str, Signature] | None]:
        """Decide for an uncaptured key with the lock held: capture now, or name the miss."""
        signature = signature_of(inputs, stream)
        if key in self._preparing:
            return None, (_WARMUP, "preparing", signature)
        due = _Due(key, inputs, device, stream, signature)
        if key in self._ready:
            # Prepared in the background: captured here, on this call's thread, but never
            # waiting for another capture or a compiling preparation; while one holds the
            # capture lock, the call runs eagerly as "preparing" and a later call captures.
            if not CAPTURE_LOCK.acquire(blocking=False):
                self._wanted.add(key)
                return None, (_WARMUP, "preparing", signature)
            try:
                return self._capture(due), None
            finally:
                self._wanted.discard(key)
                CAPTURE_LOCK.release()
        decision = self._admission.decide(key, lambda: self.backend.device_free_bytes(device))
        verdict = decision.verdict
        if verdict is Verdict.CAPACITY:
            return None, (MissReason.CAPACITY, "cap", signature)
        if verdict is Verdict.WARMUP:
            detail = f"call {decision.calls} of {self.config.min_capture_calls}"
            return None, (_WARMUP, detail, signature)
        if verdict is Verdict.MEMORY:
            free = decision.free_bytes if decision.free_bytes is not None else 0
            self._emit(
                MemoryDeferred(
                    self.name,
                    signature,
                    _mono(),
                    _epoch(),
                    free,
                    self.config.min_free_bytes,
                    str(device),
                    phase=self._phase,
                )
            )
            return None, (MissReason.MEMORY, "floor", signature)
        if self.config.background_capture and not self._closed:
            self._submit(due)
            return None, (_WARMUP, "preparing", signature)
        # The floor's read, when admission made one, is this call's: the capture reuses it.
        return self._capture(due, decision.free_bytes), None

    def _compile_guard(self) -> contextlib.AbstractContextManager[Any]:
        """With compile on, hold torch.compile's own lock around warm-up and capture.

        torch.compile's tracing state is process-wide: a compiled forward called while
        another thread traces or compiles raises ("using FX to symbolically trace a
        dynamo-optimized function"). Holding dynamo's compile lock makes the two wait for
        each other instead.
        """
        if not self.config.compile:
            return contextlib.nullcontext()
        convert_frame = getattr(getattr(torch, "_dynamo", None), "convert_frame", None)
        lock = getattr(convert_frame, "compile_lock", None)
        return lock if lock is not None else contextlib.nullcontext()

    def _capture_forward(self) -> Callable[..., Any]:
        """The forward graphs are captured from: the encoder, or torch.compile of it."""
        if not self.config.compile:
            return self._forward
        if self._compiled is None:
            # Default mode: inductor's fused kernels and no CUDA graphs of its own, since
            # the adapter captures them, one graph per exact shape.
            self._compiled = torch.compile(self._forward, dynamic=False)
            limit = _recompile_limit()
            if limit is not None and self.config.max_graphs > limit:
                logger.warning(
                    "omnitrace: %r may capture %d compiled shapes but torch.compile recompiles "
                    "a forward at most %d times; later shapes are captured from the uncompiled "
                    "kernels (correct, not fused). Raise torch._dynamo.config.recompile_limit "
                    "to compile them all.",
                    self.name,
                    self.config.max_graphs,
                    limit,
                )
        return self._compiled

    def _fail(
        self, exc: BaseException, signature: Signature, device: torch.device, stream: int
    ) -> None:
        # The message goes to logs, spans and event logs: bounded, and without the tensor
        # values a forward's exception may carry. The exception itself propagates untouched.
        message = failure_message(exc)
        self._failure = f"{type(exc).__name__}: {message}"
        self._failure_exc = exc
        self._emit(
            CaptureFailed(
                self.name,
                signature,
                _mono(),
                _epoch(),
                type(exc).__name__,
                message,
                str(device),
                stream,
                phase=self._phase,
            )
        )

    def _install(
        self,
        key: Hashable,
        graph: CapturedGraph,
        signature: Signature,
        slot: PoolSlot,
        device: torch.device,
        stream: int,
        start: tuple[int, int, float],
        free_bytes: int | None,
    ) -> None:
        """Hold ``graph`` for ``key`` and report the capture (lock held)."""
        start_mono, start_epoch, start_perf = start
        index = len(self._graphs)
        self._graphs[key] = _Entry(graph, signature)
        self._emit(
            GraphCaptured(
                self.name,
                signature,
                start_mono,
                start_epoch,
                _perf() - start_perf,
                slot.pool_id,
                str(device),
                stream,
                slot.capture_stream_id,
                int(graph.bytes_reserved),
                int(graph.static_bytes),
                index,
                free_bytes,
                phase=self._phase,
            )
        )

    def _device_free_bytes(self, device: torch.device) -> int | None:
        """Device-free memory for a capture's event; None when the backend cannot tell.

        Only captures call it (rare): a hit never reads device memory.
        """
        try:
            return int(self.backend.device_free_bytes(device))
        except Exception as exc:  # a report must never fail the capture it describes
            logger.debug("omnitrace: %r cannot read free memory of %s: %s", self.name, device, exc)
            return None

    def _capture(self, due: _Due, free_bytes: int | None = None) -> Any:
        key, inputs, device, stream, signature = due
        # A key prepared in the background took its slot at admission and was warmed up.
        ready = self._ready.pop(key, None)
        slot = self._pools.slot_for(device, stream)
        if free_bytes is None:
            # No floor read for this call (floor off, or a prepared key admitted earlier):
            # one read now, outside the capture's timing.
            free_bytes = self._device_free_bytes(device)
        start = (_mono(), _epoch(), _perf())
        try:
            request = CaptureRequest(
                self._capture_forward(),
                inputs,
                device,
                slot.pool,
                slot.capture_stream,
                capture_error_mode=self._error_mode,
                # A prepared key: the device was settled by the preparation, and a call
                # must not stall on a device-wide sync.
                quiet=ready is not None,
                layout=None if ready is None else ready[0],
            )
            with CAPTURE_LOCK, self._compile_guard():
                graph = self.backend.capture(request)
        except BaseException as exc:
            self._fail(exc, signature, device, stream)
            raise
        if ready is None:
            self._admission.captured(key)
        self._install(key, graph, signature, slot, device, stream, start, free_bytes)
        # The capturing call is served by the graph it just captured, and counts as a hit.
        replay_start = _perf()
        out = graph.replay(inputs)
        self._emit(
            replayed(self.name, signature, _mono(), _epoch(), _perf() - replay_start, self._phase)
        )
        return out

    # -- background preparation -------------------------------------------------------------

    def _submit(self, due: _Due) -> None:
        """Reserve the key's slot and hand a copy of the inputs to the preparation thread."""
        key, inputs, device, stream, signature = due
        self._admission.captured(key)  # the slot is taken now: no other key may claim it
        self._preparing.add(key)
        # The caller may reuse its tensors once this call returns: the thread gets copies,
        # made on the caller's stream, laid out as the capture's static inputs will be (so a
        # compiled forward's guards match at capture).
        job = _Job(
            key,
            static_copies(inputs),
            device,
            stream,
            self.backend_stream(device),
            signature,
            torch.is_inference_mode_enabled(),
        )
        if self._jobs is None:
            self._jobs = queue.SimpleQueue()
            self._worker = threading.Thread(
                target=self._capture_loop,
                args=(self._jobs,),
                name=f"omnitrace-prepare-{self.name}",
                daemon=True,
            )
            self._worker.start()
            _THREADED.add(self)
        self._jobs.put(job)

    def backend_stream(self, device: torch.device) -> Any:
        """The current stream object of ``device`` (None on a simulated device)."""
        if device.type != "cuda":
            return None
        return torch.cuda.current_stream(device)

    def _capture_loop(self, jobs: queue.SimpleQueue[_Job | None]) -> None:
        side: dict[torch.device, Any] = {}
        while True:
            job = jobs.get()
            if job is None or self._failure is not None:
                return
            self._prepare(job, side)

    def _prepare(self, job: _Job, side: dict[torch.device, Any]) -> None:
        """Warm up (and compile) on a side stream, then mark the key ready for capture."""
        try:
            with self._preparation_scope(job), self._grad_scope(job):
                if job.device.type == "cuda":
                    with torch.cuda.device(job.device):
                        stream = side.get(job.device)
                        if stream is None:
                            stream = side[job.device] = torch.cuda.Stream(job.device)  # type: ignore[no-untyped-call]
                        # The copies were made on the caller's stream: the side stream waits.
                        stream.wait_stream(job.replay_stream)
                        with torch.cuda.stream(stream):
                            layout = self.backend.warm_up(self._capture_forward(), job.inputs)
                else:
                    layout = self.backend.warm_up(self._capture_forward(), job.inputs)
        except BaseException as exc:
            with self._lock:
                self._preparing.discard(job.key)
                self._fail(exc, job.signature, job.device, job.stream)
            logger.error(
                "omnitrace: background preparation of %s for %r failed: %s; "
                "the adapter is terminal",
                job.signature.text,
                self.name,
                self._failure,
            )
            return
        with self._lock:
            self._preparing.discard(job.key)
            # A compiled forward warms up once more at capture, on the caller's thread: a
            # guard that differs there (a thread-local mode) recompiles outside the capture.
            self._ready[job.key] = (None if self.config.compile else layout, time.monotonic())

    @contextlib.contextmanager
    def _preparation_scope(self, job: _Job) -> Iterator[None]:
        """What a preparation holds while it warms up.

        An eager warm-up holds nothing: its kernels and allocations on a side stream are
        allowed beside a thread-local capture on another thread. A compiled one holds the
        capture lock and torch.compile's own lock: compiling may synchronise the device
        (autotuning), which no capture may overlap. A call whose key is ready then runs
        eagerly rather than wait, and the next compile first gives fresh ready keys a
        moment to be captured (``_DEFER_S``).
        """
        if not self.config.compile:
            yield
            return
        deadline = time.monotonic() + _DEFER_S
        while time.monotonic() < deadline and _waiting_ready_keys():
            time.sleep(0.002)
        for adapter in list(_THREADED):
            adapter._wanted.clear()  # each wait is earned once; a later miss earns another
        with (
            CAPTURE_LOCK,
            self._compile_guard(),
            COMPILE_SWITCH_INTERVAL.short(),
            COMPILE_YIELD.yielding(),
        ):
            # Compiles hold the capture lock one at a time: the difference is this one's.
            began, yielded = time.monotonic(), COMPILE_YIELD.statistics()
            yield
            took, now = time.monotonic() - began, COMPILE_YIELD.statistics()
        logger.debug(
            "omnitrace: %r compiled %s in %.2f s; it paused %d times (%.0f ms) for eager calls",
            self.name,
            job.signature.text,
            took,
            now.pauses - yielded.pauses,
            (now.paused_s - yielded.paused_s) * 1e3,
        )

    @staticmethod
    def _grad_scope(job: _Job) -> contextlib.AbstractContextManager[Any]:
        """The admitting call's autograd mode (calls with grad enabled are never graphed)."""
        return torch.inference_mode() if job.inference else torch.no_grad()
