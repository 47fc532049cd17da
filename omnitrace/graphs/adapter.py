"""The exact-shape encoder graph adapter."""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Callable, Hashable
from typing import Any

import torch

from omnitrace.bus import EventBus
from omnitrace.config import ConfigError, EncoderGraphConfig, EncoderGraphFailedError
from omnitrace.events import (
    CaptureFailed,
    Event,
    GraphCaptured,
    GraphMissed,
    GraphReplayed,
    MemoryDeferred,
    MissReason,
)
from omnitrace.graphs.admission import Admission, Verdict
from omnitrace.graphs.backends.base import CapturedGraph, GraphBackend
from omnitrace.graphs.eligibility import examine, ineligible_detail, signature_of
from omnitrace.graphs.pools import PoolRegistry
from omnitrace.signature import Signature
from omnitrace.stats import AdapterStats, StatsFold

__all__ = ["EncoderCudaGraph", "MESSAGE_MAX_CHARS", "failure_message"]

_INELIGIBLE = MissReason.INELIGIBLE
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


class _Entry:
    """A captured graph and the signature it was captured for."""

    __slots__ = ("graph", "signature")

    def __init__(self, graph: CapturedGraph, signature: Signature) -> None:
        self.graph = graph
        self.signature = signature


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
        ConfigError: ``name`` is empty.
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
        if not isinstance(name, str) or not name.strip():
            raise ConfigError(f"name: expected a non-empty string, got {name!r}")
        if config is None:
            config = EncoderGraphConfig()
        elif not isinstance(config, EncoderGraphConfig):
            raise TypeError(f"config must be an EncoderGraphConfig, got {type(config).__name__}")
        if bus is not None and not isinstance(bus, EventBus):
            raise TypeError(f"bus must be an EventBus, got {type(bus).__name__}")
        if backend is None:
            from omnitrace.graphs.backends.select import select_backend

            backend = select_backend(vllm_config)
        self._forward = forward
        self.name = name
        self.config = config
        self.backend = backend
        self._bus = bus
        # max_graphs=0 keeps graphs "on": a cache of zero graphs is full, so every eligible
        # call is a capacity miss and the lost coverage shows, as for any full cache.
        self._enabled = config.enabled
        self._admission = Admission(config)
        self._pools = PoolRegistry(backend, share=config.share_pools)
        self._graphs: dict[Hashable, _Entry] = {}
        self._fold = StatsFold()
        self._lock = threading.RLock()
        self._failure: str | None = None
        if bus is not None:
            bus.register_adapter(
                name,
                {
                    "enabled": config.enabled,
                    "max_graphs": config.max_graphs,
                    "min_capture_calls": config.min_capture_calls,
                    "min_free_bytes": config.min_free_bytes,
                    "share_pools": config.share_pools,
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
            GraphMissed(self.name, signature_of(inputs), _mono(), _epoch(), _INELIGIBLE, detail)
        )

    # -- the call path --------------------------------------------------------------------

    def _emit(self, event: Event) -> None:
        with self._lock:
            self._fold.fold(event)
        bus = self._bus
        if bus is not None:
            bus.emit(event)

    def _terminal_error(self) -> EncoderGraphFailedError:
        return EncoderGraphFailedError(
            f"encoder graph {self.name!r} is unusable: its CUDA graph capture failed "
            f"({self._failure}). Restart the worker, optionally with encoder graphs "
            "disabled (--hf-overrides '{\"encoder_cuda_graph\": false}')."
        )

    def _eager(
        self,
        inputs: tuple[Any, ...],
        reason: MissReason,
        detail: str,
        signature: Signature,
    ) -> Any:
        if self._failure is not None:
            # Another thread's capture failed since this call was admitted: terminal at once.
            raise self._terminal_error()
        self._emit(GraphMissed(self.name, signature, _mono(), _epoch(), reason, detail))
        return self._forward(*inputs)

    def __call__(self, *inputs: torch.Tensor | None) -> Any:
        if self._failure is not None:
            raise self._terminal_error()
        call = examine(self.name, inputs)
        detail = ineligible_detail(call, enabled=self._enabled, backend=self.backend)
        if detail is not None:
            return self._eager(inputs, _INELIGIBLE, detail, signature_of(inputs))
        device = call.device
        assert device is not None  # an eligible call has a tensor input
        stream = self.backend.stream_id(device)
        key = (device, stream, call.specs)
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
            else:
                start = _perf()
                out = entry.graph.replay(inputs)
                event: Event = GraphReplayed(
                    self.name, entry.signature, _mono(), _epoch(), _perf() - start
                )
                self._fold.fold(event)
        if miss is not None:
            # Eager work runs outside the lock: other threads' hits need not wait for it.
            return self._eager(inputs, *miss)
        bus = self._bus
        if bus is not None:
            bus.emit(event)
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
        decision = self._admission.decide(key, lambda: self.backend.device_free_bytes(device))
        verdict = decision.verdict
        if verdict is Verdict.CAPACITY:
            return None, (MissReason.CAPACITY, "cap", signature)
        if verdict is Verdict.WARMUP:
            detail = f"call {decision.calls} of {self.config.min_capture_calls}"
            return None, (MissReason.WARMUP, detail, signature)
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
                )
            )
            return None, (MissReason.MEMORY, "floor", signature)
        return self._capture(key, inputs, device, stream, signature), None

    def _capture(
        self,
        key: Hashable,
        inputs: tuple[Any, ...],
        device: torch.device,
        stream: int,
        signature: Signature,
    ) -> Any:
        slot = self._pools.slot_for(device, stream)
        start_mono, start_epoch, start = _mono(), _epoch(), _perf()
        try:
            graph = self.backend.capture(
                self._forward,
                inputs,
                device=device,
                pool=slot.pool,
                capture_stream=slot.capture_stream,
            )
        except BaseException as exc:
            # The message goes to logs, spans and event logs: bounded, and without the
            # tensor values a forward's exception may carry. The exception itself propagates
            # untouched.
            message = failure_message(exc)
            self._failure = f"{type(exc).__name__}: {message}"
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
                )
            )
            raise
        duration = _perf() - start
        index = len(self._graphs)
        self._graphs[key] = _Entry(graph, signature)
        self._admission.captured(key)
        self._emit(
            GraphCaptured(
                self.name,
                signature,
                start_mono,
                start_epoch,
                duration,
                slot.pool_id,
                str(device),
                stream,
                slot.capture_stream_id,
                int(graph.bytes_reserved),
                int(graph.static_bytes),
                index,
            )
        )
        # The capturing call is served by the graph it just captured, and counts as a hit.
        replay_start = _perf()
        out = graph.replay(inputs)
        self._emit(GraphReplayed(self.name, signature, _mono(), _epoch(), _perf() - replay_start))
        return out
