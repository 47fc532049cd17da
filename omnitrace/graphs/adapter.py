"""The exact-shape encoder graph adapter: key a call, replay its graph, or admit and capture
it, or run it eagerly, with every decision an event (docs/architecture.md, "One encoder
call", walks through it)."""

from __future__ import annotations

import atexit
import logging
import threading
import time
import weakref
from collections.abc import Callable, Hashable
from typing import Any

import torch

from omnitrace._validate import check_name
from omnitrace.bus import EventBus
from omnitrace.config import ConfigError, EncoderGraphConfig, EncoderGraphFailedError
from omnitrace.events import (
    CaptureFailed,
    Event,
    MemoryDeferred,
    MissReason,
    Phase,
    missed,
    replayed,
)
from omnitrace.graphs.admission import Admission, Verdict
from omnitrace.graphs.backends.base import CAPTURE_LOCK, GraphBackend
from omnitrace.graphs.capture import Capturer, Due, Entry
from omnitrace.graphs.compiling import compile_forward
from omnitrace.graphs.eligibility import (
    call_key,
    examine,
    ineligible_detail,
    signature_of,
    state_detail,
)
from omnitrace.graphs.failures import MESSAGE_MAX_CHARS, failure_message, terminal_error
from omnitrace.graphs.gil import COMPILE_YIELD
from omnitrace.graphs.hooks import AdapterHooks
from omnitrace.graphs.preparation import Preparation, check_backend
from omnitrace.graphs.timing import DeviceTimer, DeviceTimers
from omnitrace.signature import Signature
from omnitrace.stats import AdapterStats, StatsFold

__all__ = ["EncoderCudaGraph", "MESSAGE_MAX_CHARS", "failure_message", "items_fact"]

logger = logging.getLogger(__name__)

_INELIGIBLE = MissReason.INELIGIBLE
_WARMUP = MissReason.WARMUP

_SERVING = Phase.SERVING
_mono = time.monotonic_ns
_epoch = time.time_ns
_perf = time.perf_counter


# Adapters that started a thread of their own (background preparation, device timing):
# closed at exit within a bound, so no preparation thread is still inside a forward when the
# interpreter tears down.
_THREADED: weakref.WeakSet[EncoderCudaGraph] = weakref.WeakSet()
_EXIT_CLOSE_S = 5.0


def items_fact(split: bool) -> str:
    """The ``items`` fact an adapter registers on its bus: how its calls' items (the images
    or clips of a step) are served, ``"split"`` (one call each) or ``"batched"``.

    Args:
        split: whether the adapter serves a call's items one call each.
    """
    return "split" if split else "batched"


def _close_at_exit() -> None:
    deadline = time.monotonic() + _EXIT_CLOSE_S
    for adapter in list(_THREADED):
        adapter.close(max(0.0, deadline - time.monotonic()))


atexit.register(_close_at_exit)


def _checked(
    forward: Callable[..., Any],
    name: str,
    config: EncoderGraphConfig | None,
    bus: EventBus | None,
    backend: GraphBackend | None,
    vllm_config: Any,
) -> tuple[EncoderGraphConfig, GraphBackend, tuple[str, ...]]:
    """Check an adapter's arguments; return its config (the default for None), its backend
    (selected for None) and the backend's error modes."""
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

        backend = select_backend(
            vllm_config, background_capture=config.background_capture, compile=config.compile
        )
    modes = tuple(getattr(backend, "error_modes", ("global",)))
    if config.background_capture:
        check_backend(backend.name, modes)
    if config.background_capture and config.compile:
        logger.warning(
            "omnitrace: %r compiles on its preparation thread; while it does, a "
            "torch.compile'd function called on another thread raises (PyTorch's FX "
            "tracing flag is process-wide). Use background compiled capture only where no "
            "other thread calls compiled code.",
            name,
        )
    return config, backend, modes


def _registered_settings(config: EncoderGraphConfig, backend: GraphBackend) -> dict[str, Any]:
    """The settings an adapter registers on its bus."""
    return {
        "enabled": config.enabled,
        "max_graphs": config.max_graphs,
        "min_capture_calls": config.min_capture_calls,
        "min_free_bytes": config.min_free_bytes,
        "pool_budget_bytes": config.pool_budget_bytes,
        "share_pools": config.share_pools,
        "expandable_pools": config.expandable_pools,
        "compile": config.compile,
        "background_capture": config.background_capture,
        "device_timing": config.device_timing,
        "skip_profiling": config.skip_profiling,
        "backend": backend.name,
        "simulated": backend.simulated,
    }


class EncoderCudaGraph:
    """Replay one CUDA graph per exact input signature of an encoder forward.

    ``graph(*tensors)`` returns what ``forward(*tensors)`` returns (cloned out of the graph's
    static buffers on a hit) and reports its decision as events on ``bus``.

    Args:
        forward: the encoder forward; takes positional tensors (or None), returns tensors,
            None, or tuples/lists/dicts of them.
        name: adapter name used in events and stats (``"vision"``, ``"audio"``);
            keyword-only, like every argument after ``forward``.
        config: admission and memory settings; default None (``EncoderGraphConfig()``).
        bus: where events go; default None: they only feed this adapter's own stats.
        backend: graph backend; default None picks vLLM's encoder graph manager when vLLM
            is importable and ``vllm_config`` is given and ``background_capture`` is off,
            else the pure-torch CUDA graph backend.
        vllm_config: the engine's ``VllmConfig`` (only used when ``backend`` is None);
            default None.

    Raises:
        TypeError: ``forward`` is not callable or ``config`` is not an EncoderGraphConfig.
        ConfigError: ``name`` is empty or has a control character or a lone surrogate, or
            ``background_capture`` is asked of a ``backend`` given here that cannot capture
            while other threads run CUDA work (vLLM's manager).
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
        config, backend, modes = _checked(forward, name, config, bus, backend, vllm_config)
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
        self._fold = StatsFold()
        self._lock = threading.RLock()
        # The parts below reach the adapter through a weak proxy: holding it strongly would
        # make every adapter a reference cycle, whose graphs only the cyclic collector frees.
        owner = weakref.proxy(self)
        hooks = AdapterHooks(
            name,
            self._lock,
            lambda event: owner._emit(event),
            lambda: owner._phase,
            lambda *failure: owner._fail(*failure),
            lambda: owner._failure is not None,
        )
        self._capturer = Capturer(
            hooks,
            backend,
            config,
            error_mode=self._error_mode,
            forward=lambda: owner._capture_forward(),
        )
        # The capturer's table, read by the call path without a lookup through it.
        self._graphs = self._capturer.graphs
        self._failure: str | None = None
        self._failure_exc: BaseException | None = None
        self._phase = _SERVING
        self._skip_profiling = config.skip_profiling
        self._paused = False
        self._split_items = config.split_items
        self._compiled: Callable[..., Any] | None = None
        # Set once serving starts inside an engine whose compiled ops forbid a compile beside
        # them (vLLM): later shapes are captured from the eager forward.
        self._compile_stopped = False
        # Keys captured by prepare() not yet called: an integration checks each first call.
        self._prepared: set[Hashable] = set()
        #: Called with the device before :meth:`prepare` captures: an integration readies
        #: what its forward reads and a first call would have set up (MiniCPM-o's
        #: positional table). None: nothing to ready.
        self.prepare_hook: Callable[[torch.device], None] | None = None
        self._timers = (
            DeviceTimers(lambda device: owner._new_timer(device), self._lock)
            if config.device_timing
            else None
        )
        # Its thread starts with the first key admitted under background_capture.
        self._prep = Preparation(
            hooks,
            compiled=config.compile,
            warm_up=lambda inputs: owner.backend.warm_up(owner._capture_forward(), inputs),
        )
        if bus is not None:
            bus.register_adapter(name, _registered_settings(config, backend))

    # -- public introspection -------------------------------------------------------------

    @property
    def forward(self) -> Callable[..., Any]:
        """The encoder forward the adapter wraps (what misses run)."""
        return self._forward

    @property
    def terminal(self) -> bool:
        """Whether a capture failed and the adapter refuses every call."""
        return self._failure is not None

    @property
    def num_graphs(self) -> int:
        """Graphs the adapter holds."""
        return len(self._graphs)

    @property
    def preparing(self) -> int:
        """Keys being warmed up (and compiled) by the background preparation thread."""
        return len(self._prep.preparing)

    @property
    def ready(self) -> int:
        """Keys prepared in the background whose next call captures their graph."""
        return len(self._prep.ready)

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

    @property
    def graphs_paused(self) -> bool:
        """Whether graphs are paused (:meth:`pause_graphs`)."""
        return self._paused

    def pause_graphs(self, paused: bool = True) -> None:
        """Serve every call eagerly while ``paused`` (``ineligible`` misses, detail
        ``paused``), keeping the graphs, the admission history and the pools; ``False``
        resumes replaying. For side-by-side measurements in one engine: eager and graphed
        calls of the same traffic alternate under the same conditions.

        Args:
            paused: True to pause graphs, False to resume; default True.

        Raises:
            ConfigError: ``paused`` is not a bool.
        """
        if not isinstance(paused, bool):
            raise ConfigError(f"paused: expected a bool, got {paused!r}")
        self._paused = paused

    @property
    def split_items(self) -> bool:
        """Whether an integration whose calls carry several items (a step's images or clips)
        serves them one call each: ``encoder_cuda_graph_split_items``, or
        :meth:`set_split_items` since. Plain encoders ignore it."""
        return self._split_items

    def set_split_items(self, split: bool) -> None:
        """Serve a call's items one call each (``True``) or as one batch (``False``) from the
        next call on, where the integration splits items; the adapter's registered
        ``items`` fact follows. For side-by-side measurements in one engine, as
        :meth:`pause_graphs`.

        Args:
            split: True to split, False to batch.

        Raises:
            ConfigError: ``split`` is not a bool.
        """
        if not isinstance(split, bool):
            raise ConfigError(f"split: expected a bool, got {split!r}")
        self._split_items = split
        bus = self._bus
        info = None if bus is None else bus.adapters().get(self.name)
        if bus is not None and info is not None and "items" in info:
            bus.register_adapter(self.name, {**info, "items": items_fact(split)})

    def set_phase(self, phase: Phase | str) -> None:
        """Tag later events with ``phase``; with ``skip_profiling``, ``profiling`` calls stay
        eager and out of admission.

        Args:
            phase: a :class:`Phase` or its value (``"serving"``, ``"profiling"``).

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

    def prepare(self, signature: Signature, device: torch.device) -> str:
        """Capture the graph of ``signature``'s dtypes and shapes on ``device`` now.

        For start-up, before serving (``encoder_cuda_graph_prepare_from``): the key is
        admitted as if an earlier run's calls had warmed it up, under the same cap, budget
        and memory floor, and captured (compiled first with ``compile``) from zero-filled
        inputs on the current stream. A graph replays whatever values its inputs hold, so
        it serves every later call of these shapes as one captured from a call would. The
        capture is reported (in the adapter's phase) but no call is counted.

        Args:
            signature: the recorded key; its device and stream are not used.
            device: the device to capture on.

        Returns:
            ``"captured"``; ``"held"`` when a graph of the key exists; else why not, as
            the miss a call would have been: ``"ineligible: DETAIL"``, ``"capacity: cap"``,
            ``"capacity: budget"``, ``"memory: floor"`` or ``"memory: need"``.

        Raises:
            ValueError: a dtype of ``signature`` that torch does not have.
            EncoderGraphFailedError: the adapter is terminal already.
            Exception: the capture's own error; the adapter is then terminal, as after a
                failed capture while serving.
        """
        from omnitrace.graphs.startup import zero_inputs

        inputs = zero_inputs(signature, device)
        call = examine(self.name, inputs)
        detail = ineligible_detail(call, enabled=self._enabled, backend=self.backend)
        if detail is None and self._paused:
            detail = "paused"
        if detail is not None:
            return f"ineligible: {detail}"
        found = call_key(inputs)
        assert found is not None
        assert call.device is not None
        where = call.device
        stream = self.backend.stream_id(where)
        key = (where, stream, found[1])
        with self._lock:
            if self._failure is not None:
                raise self._terminal_error()
            if key in self._graphs:
                return "held"
            here = signature_of(inputs, stream)
            decision = self._admission.decide(
                key,
                lambda: self.backend.device_free_bytes(where),
                recorded=True,
                reused=lambda: self._capturer.pool_holds_larger(here),
            )
            if decision.verdict in (Verdict.CAPACITY, Verdict.MEMORY):
                return f"{decision.verdict.value}: {decision.detail}"
            if self.prepare_hook is not None:
                self.prepare_hook(where)
            due = Due(key, inputs, where, stream, here)
            # A failed capture makes the adapter terminal; its error propagates untouched.
            graph = self._capturer.capture(
                due, None, prepared=False, free_bytes=decision.free_bytes
            )
            self._admission.took(graph.bytes_reserved + graph.static_bytes)
            self._admission.captured(key)
            self._prepared.add(key)
        return "captured"

    @property
    def unchecked_prepared(self) -> bool:
        """Whether a graph :meth:`prepare` captured has not been called yet."""
        return bool(self._prepared)

    def first_prepared_call(self, *inputs: torch.Tensor | None) -> bool:
        """True once for the first call of a key :meth:`prepare` captured, False otherwise.

        For an integration that checks each new graph's first result against the model's
        own method: a prepared graph's first call is the first with real inputs.

        Args:
            *inputs: the call's inputs, as passed to the adapter.

        Returns:
            True when these inputs' key was prepared and had no call yet (it has one now).
        """
        if not self._prepared:
            return False
        found = call_key(inputs)
        if found is None or found[0] is None:
            return False
        key = (found[0], self.backend.stream_id(found[0]), found[1])
        with self._lock:
            if key not in self._prepared:
                return False
            self._prepared.discard(key)
            return True

    def stop_compiling(self) -> None:
        """Capture later shapes from the eager forward; compiled graphs keep replaying.

        For an engine whose own compiled code forbids a compile beside it, so that a
        shape first seen while serving never waits for a compile: the vLLM plugin calls it
        once the shapes of ``prepare_from`` are prepared. No effect without ``compile``.
        """
        self._compile_stopped = True

    def record_ineligible(self, detail: str, *inputs: torch.Tensor | None) -> None:
        """Count a call the model ran eagerly before reaching the adapter.

        For model-level fallbacks (training mode, extra outputs requested, stateful
        streaming ...): emits the ``ineligible`` miss the call would have produced, so stats
        and event logs still cover every encoder call. Runs nothing.

        Args:
            detail: the miss's detail (``training``, ``streaming`` ...).
            *inputs: the call's inputs, for the miss's signature.
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

        Args:
            timeout: seconds to wait at most; default 60.0.

        Returns:
            True when no preparation is left running, False if ``timeout`` passed first.
        """
        return self._prep.wait(timeout)

    def close(self, timeout: float = 5.0) -> bool:
        """Stop the adapter's threads; True when nothing was left pending.

        Waits up to ``timeout`` for graphs being prepared in the background and for device
        timings, then stops the capture and timing threads. Graphs already captured keep
        replaying; a shape admitted after close is captured synchronously. Idempotent.

        Args:
            timeout: seconds to wait at most, in all; default 5.0.

        Returns:
            True when every preparation finished and every device timing was resolved.
        """
        deadline = time.monotonic() + timeout
        self._closed = True
        prepared = self.wait_prepared(max(0.0, deadline - time.monotonic()))
        self._prep.stop(max(0.0, deadline - time.monotonic()))
        timed = self._timers is None or self._timers.close(deadline)
        return prepared and timed

    def flush_device_timing(self, timeout: float = 5.0) -> bool:
        """Resolve the device timings recorded so far; the call path never waits for them.

        Args:
            timeout: seconds to wait for the device at most; default 5.0.

        Returns:
            True when none is left unresolved (always, without ``device_timing``).
        """
        return self._timers is None or self._timers.resolve(timeout)

    # -- the call path --------------------------------------------------------------------

    def _emit(self, event: Event) -> None:
        with self._lock:
            self._fold.fold(event)
        bus = self._bus
        if bus is not None:
            bus.emit(event)

    def _terminal_error(self) -> EncoderGraphFailedError:
        return terminal_error(self.name, self._failure, self._failure_exc)

    def _new_timer(self, device: torch.device) -> DeviceTimer:
        """The device timer of ``device`` (lock held); the adapter closes its thread."""
        _THREADED.add(self)
        return DeviceTimer(self.backend.device_clock(device), self._emit)

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
        timer = None if self._timers is None or device is None else self._timers.timer(device)
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
                and self._paused is False
                and (self._skip_profiling is False or self._phase is not Phase.PROFILING)
                and state_detail(device, self.backend) is None
            ):
                return self._replay(entry, inputs, device)
        return self._call_slow(inputs, found)

    def _replay(self, entry: Entry, inputs: tuple[Any, ...], device: torch.device) -> Any:
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
                timer = self._timers.timer(device)
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
        if detail is None and self._paused:
            detail = "paused"
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
            if miss[0] is MissReason.CAPACITY or miss[1] == "preparing":
                return self._eager(inputs, *miss, device)
            return self._eager_measured(inputs, miss, device, key)
        # Captured by another thread since this call looked: a hit after all.
        assert entry is not None
        return self._replay(entry, inputs, device)

    def _eager_measured(
        self,
        inputs: tuple[Any, ...],
        miss: tuple[MissReason, str, Signature],
        device: torch.device,
        key: Hashable,
    ) -> Any:
        """An eager call of a key admission remembers; under a pool budget, what it
        allocated at its peak goes to admission, which defers a capture that device-free
        memory could not hold. The peak read is the allocator's since it last rose: when
        this call did not raise it, the figure is an upper bound."""
        read = getattr(self.backend, "device_allocated_bytes", None)
        if read is None or not self._admission.measures_need:
            return self._eager(inputs, *miss, device)
        before, _ = read(device)
        out = self._eager(inputs, *miss, device)
        _, peak = read(device)
        with self._lock:
            self._admission.took_eagerly(key, peak - before)
        return out

    def _admit(
        self,
        key: Hashable,
        inputs: tuple[Any, ...],
        device: torch.device,
        stream: int,
    ) -> tuple[Any, tuple[MissReason, str, Signature] | None]:
        """Decide for an uncaptured key with the lock held: capture now, or name the miss."""
        signature = signature_of(inputs, stream)
        prep = self._prep
        if key in prep.preparing:
            return None, (_WARMUP, "preparing", signature)
        due = Due(key, inputs, device, stream, signature)
        if key in prep.ready:
            # Prepared in the background: captured here, on this call's thread, but never
            # waiting for another capture or a compiling preparation; while one holds the
            # capture lock, the call runs eagerly as "preparing" and a later call captures.
            if not CAPTURE_LOCK.acquire(blocking=False):
                prep.wanted.add(key)
                return None, (_WARMUP, "preparing", signature)
            try:
                return self._capture(due), None
            finally:
                prep.wanted.discard(key)
                CAPTURE_LOCK.release()
        decision = self._admission.decide(
            key,
            lambda: self.backend.device_free_bytes(device),
            reused=lambda: self._capturer.pool_holds_larger(signature),
        )
        verdict = decision.verdict
        if verdict is Verdict.CAPACITY:
            return None, (MissReason.CAPACITY, decision.detail, signature)
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
                    self._cached_bytes(device),
                    decision.need,
                    phase=self._phase,
                )
            )
            return None, (MissReason.MEMORY, decision.detail, signature)
        if self.config.background_capture and not self._closed:
            self._submit(due)
            return None, (_WARMUP, "preparing", signature)
        # The floor's read, when admission made one, is this call's: the capture reuses it.
        return self._capture(due, decision.free_bytes), None

    def _cached_bytes(self, device: torch.device) -> int | None:
        """The allocator's cached bytes on ``device``, for a deferral; None from a backend
        that does not answer the question (it is not part of the backend protocol)."""
        question = getattr(self.backend, "device_cached_bytes", None)
        return None if question is None else int(question(device))

    def _capture_forward(self) -> Callable[..., Any]:
        """The forward graphs are captured from: the encoder, or torch.compile of it."""
        if not self.config.compile or self._compile_stopped:
            return self._forward
        if self._compiled is None:
            self._compiled = compile_forward(
                self._forward, name=self.name, max_graphs=self.config.max_graphs
            )
        return self._compiled

    def _fail(
        self, exc: BaseException, signature: Signature, device: torch.device, stream: int
    ) -> str:
        """Go terminal and report the failure; return it as text (type and message)."""
        # The message goes to logs, spans and event logs: bounded, and without the tensor
        # values a forward's exception may carry. The exception itself propagates untouched.
        message = failure_message(exc)
        self._failure = failure = f"{type(exc).__name__}: {message}"
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
        return failure

    def _capture(self, due: Due, free_bytes: int | None = None) -> Any:
        # A key prepared in the background took its slot at admission and was warmed up.
        ready = self._prep.ready.pop(due.key, None)
        layout = None if ready is None else ready[0]
        graph = self._capturer.capture(
            due, layout, prepared=ready is not None, free_bytes=free_bytes
        )
        self._admission.took(graph.bytes_reserved + graph.static_bytes)
        if ready is None:
            self._admission.captured(due.key)
        # The capturing call is served by the graph it just captured, and counts as a hit.
        replay_start = _perf()
        out = graph.replay(due.inputs)
        self._emit(
            replayed(
                self.name, due.signature, _mono(), _epoch(), _perf() - replay_start, self._phase
            )
        )
        return out

    # -- background preparation -------------------------------------------------------------

    def _submit(self, due: Due) -> None:
        """Reserve the key's slot and hand a copy of the inputs to the preparation thread."""
        self._admission.captured(due.key)  # the slot is taken now: no other key may claim it
        self._prep.submit(due, self.backend_stream(due.device), owner=self)
        _THREADED.add(self)

    def backend_stream(self, device: torch.device) -> Any:
        """Return the current stream object of ``device`` (None on a simulated device).

        Args:
            device: the device; any but a ``cuda`` one gives None.
        """
        if device.type != "cuda":
            return None
        return torch.cuda.current_stream(device)
