"""Per-request timestamps inside vLLM: hooks around vLLM's methods that stamp each request on
its way to the first token, leaving vLLM's outputs and scheduling unchanged (docs/vllm.md,
"Where each request's time goes", lists the hook points)."""

from __future__ import annotations

import contextlib
import contextvars
import functools
import logging
import os
import sys
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from omnitrace import events as ev

__all__ = [
    "ENV_REQUESTS",
    "HOOK_POINTS",
    "hook_api_server",
    "hook_worker",
    "request_timing",
    "set_request_timing",
]

logger = logging.getLogger(__name__)

ENV_REQUESTS = "OMNITRACE_REQUESTS"

_PATCHED = "_omnitrace_requests_patched"
_lock = threading.Lock()
_missing_reported: set[str] = set()
#: Requests between their engine id and their first token, oldest first; bounded, so a
#: request that never reaches a first token (aborted) cannot grow it.
_PENDING_MAX = 65_536
_pending: OrderedDict[str, _Record] = OrderedDict()
_current: contextvars.ContextVar[_Record | None] = contextvars.ContextVar(
    "omnitrace_request", default=None
)

BusGetter = Callable[[], Any]

# Read without the lock on every hooked call: a plain bool, flipped by set_request_timing.
_timing = True


def set_request_timing(enabled: bool) -> bool:
    """Switch this process's request-timing hooks off or on at run time; return the old state.

    Off, a hook calls vLLM's method and nothing else: no new request gets a record, and no
    encoder step is timed (a request already under way keeps its record, and its event may
    lack the steps that ran while off). The hooks stay installed, so switching back on costs
    nothing. A benchmark alternates the two inside one engine to measure what timing costs.
    """
    global _timing
    old, _timing = _timing, bool(enabled)
    return old


def request_timing() -> bool:
    """Whether this process's request-timing hooks are on (see :func:`set_request_timing`)."""
    return _timing


@dataclass(slots=True)
class _Record:
    """What the API server saw of one HTTP request before its first token."""

    arrival_ns: int
    traceparent: str = ""
    render_ns: int | None = None
    processor_ns: int | None = None
    processed_ns: int | None = None
    images: int = 0
    image_pixels: int = 0
    audios: int = 0
    audio_s: float = 0.0
    request_id: str = ""


def _report_missing(where: str) -> None:
    with _lock:
        if where in _missing_reported:
            return
        _missing_reported.add(where)
    logger.warning("omnitrace: request timing leaves out %s: not in this vLLM", where)


def _patch(owner: Any, name: str, make: Callable[[Callable[..., Any]], Callable[..., Any]]) -> bool:
    method = getattr(owner, name, None) if owner is not None else None
    if not callable(method):
        _report_missing(f"{getattr(owner, '__qualname__', owner)}.{name}")
        return False
    with _lock:
        method = getattr(owner, name)
        if not getattr(method, _PATCHED, False):
            wrapper = make(method)
            functools.update_wrapper(wrapper, method)
            setattr(wrapper, _PATCHED, True)
            setattr(owner, name, wrapper)
    return True


def _module(name: str) -> Any:
    try:
        return __import__(name, fromlist=["_"])
    except Exception as exc:  # an import that fails here must not fail vLLM's start
        _report_missing(f"{name} ({type(exc).__name__})")
        return None


def _emit(bus_of: BusGetter, event: ev.Event) -> None:
    try:
        bus_of().emit(event)
    except Exception as exc:  # never into vLLM
        logger.debug("omnitrace: cannot emit %s: %s", type(event).__name__, exc)


# -- the API server --------------------------------------------------------------------------


def _traceparent(scope: Any) -> str:
    for key, value in scope.get("headers") or ():
        if key == b"traceparent":
            try:
                return str(value.decode("latin-1"))[:128]
            except Exception:
                return ""
    return ""


class _ArrivalStamp:
    """ASGI middleware: a record per HTTP request, stamped when its headers arrived."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope.get("type") != "http" or not _timing:
            await self.app(scope, receive, send)
            return
        token = _current.set(_Record(time.monotonic_ns(), _traceparent(scope)))
        try:
            await self.app(scope, receive, send)
        finally:
            _current.reset(token)


def _count_media(record: _Record, prompt: Any) -> None:
    data = prompt.get("multi_modal_data") if isinstance(prompt, dict) else None
    if not isinstance(data, dict):
        return
    images = data.get("image")
    for image in images if isinstance(images, list) else [] if images is None else [images]:
        record.images += 1
        size = getattr(image, "size", None)
        if isinstance(size, tuple) and len(size) == 2:
            record.image_pixels += int(size[0]) * int(size[1])
    audios = data.get("audio")
    for audio in audios if isinstance(audios, list) else [] if audios is None else [audios]:
        record.audios += 1
        if isinstance(audio, tuple) and len(audio) == 2:
            samples, rate = audio
            length = getattr(samples, "shape", (0,))[-1] if hasattr(samples, "shape") else 0
            if rate:
                record.audio_s += float(length) / float(rate)


def _wrap_render(render: Callable[..., Any]) -> Callable[..., Any]:
    async def render_chat_async(*args: Any, **kwargs: Any) -> Any:
        record = _current.get()
        if record is not None and record.render_ns is None:
            record.render_ns = time.monotonic_ns()
        return await render(*args, **kwargs)

    return render_chat_async


def _wrap_process(process: Callable[..., Any]) -> Callable[..., Any]:
    async def process_for_engine_async(self: Any, prompt: Any, *args: Any, **kwargs: Any) -> Any:
        record = _current.get()
        if record is None:
            return await process(self, prompt, *args, **kwargs)
        if record.processor_ns is None:
            record.processor_ns = time.monotonic_ns()
        with contextlib.suppress(Exception):  # counting media never fails a request
            _count_media(record, prompt)
        result = await process(self, prompt, *args, **kwargs)
        record.processed_ns = time.monotonic_ns()
        return result

    return process_for_engine_async


def _await_first_token(engine_id: str, request_id: Any, record: _Record) -> None:
    """Keep ``record`` under vLLM's engine id until the output processor sees its first
    token (the newest :data:`_PENDING_MAX` at most)."""
    record.request_id = str(request_id)
    with _lock:
        _pending[engine_id] = record
        while len(_pending) > _PENDING_MAX:
            _pending.popitem(last=False)


def _wrap_add_request(add_request: Callable[..., Any]) -> Callable[..., Any]:
    async def add_request_timed(self: Any, request_id: Any, *args: Any, **kwargs: Any) -> Any:
        queue = await add_request(self, request_id, *args, **kwargs)
        record = _current.get()
        engine_id = getattr(queue, "request_id", None)
        if record is not None and isinstance(engine_id, str):
            _await_first_token(engine_id, request_id, record)
        return queue

    return add_request_timed


def _count_placeholders(record: _Record, prompt: Any) -> None:
    """Count the media items of a rendered prompt (offline: its placeholders by modality)."""
    places = prompt.get("mm_placeholders") if isinstance(prompt, dict) else None
    if isinstance(places, Mapping):
        record.images += len(places.get("image") or ())
        record.audios += len(places.get("audio") or ())
    else:
        _count_media(record, prompt)


def _wrap_engine_add_request(add_request: Callable[..., Any]) -> Callable[..., Any]:
    """``LLMEngine.add_request`` (``vllm.LLM``, no HTTP server): the request's timing starts
    where it enters the engine, after ``LLM`` rendered it."""

    def add_request_timed(
        self: Any, request_id: Any, prompt: Any, *args: Any, **kwargs: Any
    ) -> Any:
        if not _timing or _current.get() is not None:
            # Timing is off, or an API server's request, whose record is running.
            return add_request(self, request_id, prompt, *args, **kwargs)
        now = time.monotonic_ns()
        record = _Record(now, processor_ns=now)
        with contextlib.suppress(Exception):  # counting media never fails a request
            _count_placeholders(record, prompt)
        engine_id = add_request(self, request_id, prompt, *args, **kwargs)
        record.processed_ns = time.monotonic_ns()
        if isinstance(engine_id, str):
            _await_first_token(engine_id, request_id, record)
        return engine_id

    return add_request_timed


def _engine_ns(value: Any) -> int | None:
    return int(value * 1e9) if isinstance(value, float) and value > 0 else None


def _first_token(req_state: Any, bus_of: BusGetter) -> None:
    seen_ns, epoch_ns = ev.now()
    engine_id = str(getattr(req_state, "request_id", ""))
    with _lock:
        record = _pending.pop(engine_id, None)
    stats = getattr(req_state, "stats", None)
    if record is None:
        # No HTTP request was seen (offline, or another entry point): vLLM's arrival time,
        # a wall-clock time, on this host's monotonic clock.
        arrival = getattr(stats, "arrival_time", 0.0) or time.time()
        record = _Record(seen_ns - int((time.time() - arrival) * 1e9))
        record.request_id = str(getattr(req_state, "external_req_id", None) or engine_id)
    trace_id = span_id = ""
    parts = record.traceparent.split("-")
    if len(parts) == 4 and len(parts[1]) == 32 and len(parts[2]) == 16:
        trace_id, span_id = parts[1], parts[2]
    event = ev.RequestTimed(
        "",
        ev.NO_SIGNATURE,
        seen_ns,
        epoch_ns,
        record.request_id,
        engine_id,
        record.arrival_ns,
        record.render_ns,
        record.processor_ns,
        record.processed_ns,
        _engine_ns(getattr(stats, "queued_ts", None)),
        _engine_ns(getattr(stats, "scheduled_ts", None)),
        _engine_ns(getattr(stats, "first_token_ts", None)),
        (seen_ns - record.arrival_ns) / 1e9,
        record.images,
        record.image_pixels,
        record.audios,
        record.audio_s,
        trace_id,
        span_id,
    )
    _emit(bus_of, event)


def _wrap_update_stats(update: Callable[..., Any], bus_of: BusGetter) -> Callable[..., Any]:
    def update_stats_from_output(self: Any, req_state: Any, *args: Any, **kwargs: Any) -> Any:
        first = _timing and bool(getattr(req_state, "is_prefilling", False))
        result = update(self, req_state, *args, **kwargs)
        if first:
            try:
                _first_token(req_state, bus_of)
            except Exception as exc:  # never into vLLM's output loop
                logger.debug("omnitrace: request timing failed: %s", exc)
        return result

    return update_stats_from_output


#: The route that switches the API server's request timing, where vLLM's development
#: endpoints are on (``VLLM_SERVER_DEV_MODE=1``).
TIMING_ROUTE = "/omnitrace/request_timing"


async def _timing_route(request: Any) -> Any:
    """``POST {"enabled": true|false}``: switch this API server's request timing; answer the
    new and the previous state, and this process's pid. A body that is not such a flag gets
    a 400 and changes nothing.

    With ``vllm serve --api-server-count N`` the kernel hands each connection to one of the
    N API servers: the switch is that one's alone (the ``pid`` says which), and nothing
    passes it on to the others.
    """
    from starlette.responses import JSONResponse

    from omnitrace._validate import check_flag

    try:
        body = await request.json()
        if not isinstance(body, dict):
            raise ValueError(f"enabled: expected a JSON object, got {body!r}")
        enabled = check_flag("enabled", body.get("enabled"))
    except ValueError as exc:
        return JSONResponse({"error": str(exc)}, status_code=400)
    was = set_request_timing(enabled)
    return JSONResponse({"enabled": enabled, "was": was, "pid": os.getpid()})


def _add_timing_route(app: Any) -> None:
    """Add :data:`TIMING_ROUTE` where vLLM adds its own development routes."""
    import vllm.envs

    if vllm.envs.VLLM_SERVER_DEV_MODE:
        app.add_route(TIMING_ROUTE, _timing_route, methods=["POST"])


def _wrap_build_app(build_app: Callable[..., Any]) -> Callable[..., Any]:
    def build_app_with_arrivals(*args: Any, **kwargs: Any) -> Any:
        app = build_app(*args, **kwargs)
        try:
            _add_timing_route(app)
        except Exception as exc:
            _report_missing(f"the request-timing route on the API server ({exc})")
        try:
            if getattr(app, "middleware_stack", None) is None:
                app.add_middleware(_ArrivalStamp)
            else:
                # Starlette builds its middleware stack once; vLLM's build_app may have
                # built it already, and then the stamp goes around the built stack.
                app.middleware_stack = _ArrivalStamp(app.middleware_stack)
        except Exception as exc:
            _report_missing(f"an ASGI middleware on the API server ({exc})")
        return app

    return build_app_with_arrivals


#: The methods the hooks wrap, by module: (class or None for a function, name). Where a
#: release moved one, either place counts (the tests check each release's source has them).
HOOK_POINTS: tuple[tuple[tuple[str, ...], str | None, str], ...] = (
    (
        ("vllm.entrypoints.openai.api_server", "vllm.entrypoints.launchers.app"),
        None,
        "build_app",
    ),
    (("vllm.renderers.base",), "BaseRenderer", "render_chat_async"),
    (("vllm.renderers.base",), "BaseRenderer", "process_for_engine_async"),
    (("vllm.v1.engine.async_llm",), "AsyncLLM", "add_request"),
    (("vllm.v1.engine.llm_engine",), "LLMEngine", "add_request"),
    (("vllm.v1.engine.output_processor",), "OutputProcessor", "_update_stats_from_output"),
    (("vllm.v1.worker.gpu_model_runner",), "GPUModelRunner", "_execute_mm_encoder"),
    (("vllm.v1.worker.gpu.mm.encoder_runner",), "EncoderRunner", "prepare_mm_inputs"),
    (("vllm.v1.worker.gpu.mm.encoder_runner",), "EncoderRunner", "execute_mm_encoder"),
)

_APP_MODULES = (
    "vllm.entrypoints.openai.api_server",
    "vllm.entrypoints.launchers.api_server.entry",
    "vllm.entrypoints.launchers.app",
)


def hook_api_server(bus_of: BusGetter) -> None:
    """Install the API server's request hooks (once; safe in any process).

    Only modules this process already imported are hooked: a worker never imports the API
    server, and importing it there would cost seconds.
    """
    # Where the server calls build_app from: 0.26's api_server module; 0.33's launcher, which
    # imports it from vllm/entrypoints/launchers/app.py.
    servers = [sys.modules.get(name) for name in _APP_MODULES]
    api = next((module for module in servers if module is not None), None)
    for module in servers:
        if module is not None and hasattr(module, "build_app"):
            _patch(module, "build_app", _wrap_build_app)
    if "vllm.v1.engine.output_processor" not in sys.modules and api is None:
        return
    output = _module("vllm.v1.engine.output_processor")
    if output is not None:
        _patch(
            getattr(output, "OutputProcessor", None),
            "_update_stats_from_output",
            lambda m: _wrap_update_stats(m, bus_of),
        )
    llm_engine = sys.modules.get("vllm.v1.engine.llm_engine")
    if llm_engine is not None:
        _patch(getattr(llm_engine, "LLMEngine", None), "add_request", _wrap_engine_add_request)
    if api is None:
        return
    async_llm = _module("vllm.v1.engine.async_llm")
    if async_llm is not None:
        _patch(getattr(async_llm, "AsyncLLM", None), "add_request", _wrap_add_request)
    renderers = _module("vllm.renderers.base")
    if renderers is not None:
        base = getattr(renderers, "BaseRenderer", None)
        _patch(base, "render_chat_async", _wrap_render)
        _patch(base, "process_for_engine_async", _wrap_process)


# -- the worker -------------------------------------------------------------------------------


_Items = tuple[tuple[str, ...], tuple[int, ...], tuple[str, ...]]


def _items(scheduled: Any, features_of: Callable[[str], Any]) -> _Items:
    """(request ids, tokens, modalities) of the items an encoder step encodes."""
    ids: list[str] = []
    tokens: list[int] = []
    modalities: list[str] = []
    for req_id, input_ids in scheduled.items():
        features = features_of(req_id)
        count = 0
        kinds: list[str] = []
        for index in input_ids:
            feature = features[index]
            if getattr(feature, "data", None) is None:
                continue
            position = feature.mm_position
            embeds = getattr(position, "get_num_embeds", None)
            count += int(embeds() if callable(embeds) else getattr(position, "length", 0))
            if feature.modality not in kinds:
                kinds.append(str(feature.modality))
        if kinds:
            ids.append(str(req_id))
            tokens.append(count)
            modalities.append("+".join(kinds))
    return tuple(ids), tuple(tokens), tuple(modalities)


def _step_event(start_ns: int, items: _Items) -> ev.EncoderBatchRan:
    end_ns, epoch_ns = ev.now()
    ids, tokens, modalities = items
    return ev.EncoderBatchRan(
        "", ev.NO_SIGNATURE, end_ns, epoch_ns, start_ns, ids, tokens, modalities
    )


def _wrap_v1_encoder(execute: Callable[..., Any], bus_of: BusGetter) -> Callable[..., Any]:
    def execute_mm_encoder_timed(self: Any, scheduler_output: Any, *args: Any, **kw: Any) -> Any:
        if not _timing:
            return execute(self, scheduler_output, *args, **kw)
        items = None
        try:
            scheduled = scheduler_output.scheduled_encoder_inputs
            if scheduled:
                items = _items(scheduled, lambda rid: self.requests[rid].mm_features)
        except Exception as exc:
            logger.debug("omnitrace: encoder step not timed: %s", exc)
        start = time.monotonic_ns()
        result = execute(self, scheduler_output, *args, **kw)
        if items and items[0]:
            _emit(bus_of, _step_event(start, items))
        return result

    return execute_mm_encoder_timed


def _wrap_v2_prepare(prepare: Callable[..., Any]) -> Callable[..., Any]:
    def prepare_mm_inputs_noted(self: Any, scheduled: Any, *args: Any, **kw: Any) -> Any:
        if not _timing:
            return prepare(self, scheduled, *args, **kw)
        try:
            features = self.encoder_cache.mm_features
            object.__setattr__(self, "_omnitrace_items", _items(scheduled, features.__getitem__))
        except Exception as exc:
            logger.debug("omnitrace: encoder step not timed: %s", exc)
        return prepare(self, scheduled, *args, **kw)

    return prepare_mm_inputs_noted


def _wrap_v2_execute(execute: Callable[..., Any], bus_of: BusGetter) -> Callable[..., Any]:
    def execute_mm_encoder_timed(self: Any, *args: Any, **kw: Any) -> Any:
        items = getattr(self, "_omnitrace_items", None)
        if items is None or not _timing:
            # Nothing noted (timing off): skip the attribute write too.
            return execute(self, *args, **kw)
        object.__setattr__(self, "_omnitrace_items", None)
        start = time.monotonic_ns()
        result = execute(self, *args, **kw)
        if items and items[0]:
            _emit(bus_of, _step_event(start, items))
        return result

    return execute_mm_encoder_timed


def hook_worker(bus_of: BusGetter) -> None:
    """Install the worker's encoder-step hooks in the runner modules this process imported."""
    v1 = sys.modules.get("vllm.v1.worker.gpu_model_runner")
    if v1 is not None:
        _patch(
            getattr(v1, "GPUModelRunner", None),
            "_execute_mm_encoder",
            lambda m: _wrap_v1_encoder(m, bus_of),
        )
    if "vllm.v1.worker.gpu.model_runner" in sys.modules:
        v2 = _module("vllm.v1.worker.gpu.mm.encoder_runner")
        runner = getattr(v2, "EncoderRunner", None)
        if runner is not None:
            _patch(runner, "prepare_mm_inputs", _wrap_v2_prepare)
            _patch(runner, "execute_mm_encoder", lambda m: _wrap_v2_execute(m, bus_of))
