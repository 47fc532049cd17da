"""vLLM general plugin: encoder graphs and telemetry for omni models in ``vllm serve``, with a
bus per worker, sinks from the environment and the start-up profiling run tagged
(docs/vllm.md says what it hooks and why)."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib
import logging
import os
import sys
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from omnitrace._env import env_flag
from omnitrace.bus import EventBus
from omnitrace.config import OmnitraceError
from omnitrace.events import Phase, profiling_observed
from omnitrace.integrations import vllm_shutdown, vllm_startup
from omnitrace.integrations.vllm_logging import show_plugin_logs
from omnitrace.integrations.worker import worker_identity
from omnitrace.sinks.registry import SINKS, SinkUnavailableError, build_sinks

if TYPE_CHECKING:
    from omnitrace.graphs.adapter import EncoderCudaGraph

__all__ = [
    "ENV_EVENTS_LOG",
    "ENV_OTLP",
    "ENV_PLUGIN",
    "LM_GRAPH_TOKENS",
    "PluginError",
    "api_log_path",
    "language_model_graph_notice",
    "items_split",
    "pause_graphs",
    "profiling_phase",
    "register",
    "request_bus",
    "split_items",
    "time_requests",
    "worker_bus",
]

logger = logging.getLogger(__name__)

ENV_PLUGIN = "OMNITRACE_PLUGIN"
# The sinks' variables are defined by their table; these names are kept for importers.
_SINK_ENV = {spec.name: spec.env for spec in SINKS}
ENV_EVENTS_LOG = _SINK_ENV["jsonl"]
ENV_OTLP = _SINK_ENV["otlp"]

_LOADER_MODULE = "vllm.model_executor.model_loader.base_loader"
#: Where vLLM's start-up profiling runs live: the V1 model runner (0.26 and 0.33; picked with
#: VLLM_USE_V2_MODEL_RUNNER=0) and the V2 one (0.26's default). The CPU runners inherit them.
_RUNNER_MODULE = "vllm.v1.worker.gpu_model_runner"
_RUNNER_V2_MODULE = "vllm.v1.worker.gpu.model_runner"
_RUNNER_MODULES = (_RUNNER_MODULE, _RUNNER_V2_MODULE)
_RUNNER_CLASS = "GPUModelRunner"
_PROFILE_METHOD = "profile_run"
_PATCHED = "_omnitrace_patched"

_lock = threading.Lock()
_bus: EventBus | None = None
_bus_pid: int | None = None
#: The adapters attached in this process, put in the profiling phase around profile_run.
_attached: weakref.WeakSet[EncoderCudaGraph] = weakref.WeakSet()
_profiling_missing_reported = False
#: The pid that logged a profiling run without encoder calls: once per worker process, and a
#: forked child that profiles again says so again.
_no_encoder_reported_pid: int | None = None
#: The pid whose bus is announced to the process manager's kill (once a process: a model
#: process, or an API server).
_announced_pid: int | None = None


class PluginError(OmnitraceError, RuntimeError):
    """The plugin's environment asks for something that cannot be set up."""


def _build_sinks(bus: EventBus, environ: Mapping[str, str]) -> list[Any]:
    _, rank = worker_identity(environ)
    try:
        return build_sinks(bus, environ, rank=rank)
    except SinkUnavailableError as exc:
        raise PluginError(str(exc)) from exc


def worker_bus(environ: Mapping[str, str] | None = None) -> EventBus:
    """Return this process's bus, creating it (with its sinks) on first use.

    Raises:
        PluginError: a sink the environment asks for cannot be imported.
        ConfigError: an ``OMNITRACE_*`` variable has an invalid value.
    """
    global _bus, _bus_pid
    env = os.environ if environ is None else environ
    pid = os.getpid()
    with _lock:
        if _bus is not None and _bus_pid == pid:
            return _bus
        # A forked child must not drain its parent's queues or write through its sinks.
        bus = EventBus()
        for sink in _build_sinks(bus, env):
            bus.add_sink(sink)
        _bus, _bus_pid = bus, pid
        return bus


def api_log_path(template: str) -> str:
    """Return the event log path of vLLM's API server for the workers' path ``template``.

    The API server writes the requests' events beside the workers' logs, never into one of
    them: ``{rank}`` becomes ``api`` (``events-{rank}.jsonl`` → ``events-api.jsonl``); a path
    with ``{pid}`` differs by pid already; any other path gains ``.api`` before its suffix
    (``events.jsonl`` → ``events.api.jsonl``).
    """
    if "{rank}" in template:
        return template.replace("{rank}", "api")
    if "{pid}" in template:
        return template
    path = Path(template)
    return str(path.with_name(f"{path.stem}.api{path.suffix}"))


def request_bus() -> EventBus:
    """Return the bus request events go to: this process's bus where it has one (a worker,
    or an engine in one process), else one whose event log is :func:`api_log_path`'s."""
    with _lock:
        if _bus is not None and _bus_pid == os.getpid():
            return _bus
    env = dict(os.environ)
    template = env.get(ENV_EVENTS_LOG)
    if template:
        env[ENV_EVENTS_LOG] = api_log_path(template)
    bus = worker_bus(env)
    # With --api-server-count N each API server is a child of vLLM's process manager, which
    # kills it at once at shutdown (--shutdown-timeout 0): that kill waits for this bus too.
    _announce()
    return bus


#: vLLM's largest language-model CUDA graph on a GPU with its default ``--max-num-seqs``.
LM_GRAPH_TOKENS = 512


def language_model_graph_notice(vllm_config: Any) -> str | None:
    """The warning for an engine whose language model replays CUDA graphs only for steps
    shorter than a prompt with an image or a few seconds of audio, else None.

    vLLM captures them up to ``compilation_config.max_cudagraph_capture_size`` tokens, by
    default twice ``--max-num-seqs`` (at most 512): a small ``--max-num-seqs`` leaves a
    multimodal prompt's prefill outside them (docs/operations.md, "Why is my TTFT high?").
    """
    if getattr(getattr(vllm_config, "model_config", None), "enforce_eager", True):
        return None
    compilation = getattr(vllm_config, "compilation_config", None)
    mode = getattr(compilation, "cudagraph_mode", None)
    size = getattr(compilation, "max_cudagraph_capture_size", None)
    if getattr(mode, "name", "NONE") == "NONE" or type(size) is not int or size >= LM_GRAPH_TOKENS:
        return None
    return (
        f"omnitrace: vLLM replays the language model's CUDA graphs for steps of at most "
        f"{size} tokens (max_cudagraph_capture_size: twice --max-num-seqs unless set); a "
        "prompt with an image or a few seconds of audio is longer, and its prefill runs "
        "without them (on an H200, a 7B model's 14 ms prefill took 30-40 ms). "
        f"""--compilation-config '{{"max_cudagraph_capture_size": {LM_GRAPH_TOKENS}}}' """
        "captures them up to that many tokens"
    )


def _after_load(model: Any, vllm_config: Any) -> None:
    # Imported here: the integrations load torch and the graph adapter, which register()
    # (run in every vLLM process) does not need.
    from omnitrace.integrations.base import attached_summary
    from omnitrace.integrations.registry import IntegrationLoadError, find_integration

    try:
        integration = find_integration(model)
    except IntegrationLoadError as exc:
        raise PluginError(f"{exc} (set {ENV_PLUGIN}=0 to run without the plugin)") from exc
    if integration is None:
        logger.debug("omnitrace: no model integration detects %s", type(model).__name__)
        return
    try:
        result = integration.instrument(model, vllm_config, bus=worker_bus())
    except OmnitraceError as exc:
        # vLLM buries a worker's exception in a traceback per process it passes through;
        # this line says what to fix in one place, then the worker stops as before.
        logger.error(
            "omnitrace: %s; the worker stops (fix --hf-overrides, or set %s=0 to run "
            "without omnitrace)",
            exc,
            ENV_PLUGIN,
        )
        raise
    adapters = _adapters_of(result)
    _attached.update(adapters)
    _hook_profiling()
    _hook_warm_up(adapters)
    _hook_shutdown()
    if _requests_on():
        from omnitrace.integrations.vllm_requests import hook_worker

        hook_worker(worker_bus)
    from omnitrace.integrations.vllm_notices import audio_processor_notice

    for notice in (
        language_model_graph_notice(vllm_config),
        audio_processor_notice(vllm_config, integration.name),
    ):
        if notice is not None:
            logger.warning("%s", notice)
    pid, rank = worker_identity()
    logger.info(
        "omnitrace: encoder graphs attached (%s, model=%s, pid=%d, rank=%s)",
        attached_summary(result),
        integration.name,
        pid,
        rank,
    )


def _hook_warm_up(adapters: list[EncoderCudaGraph]) -> None:
    """Prepare recorded shapes (and stop compiling) after vLLM's warm-up, before serving."""
    if vllm_startup.hook_warm_up(lambda: list(_attached)):
        return
    needs = [a.name for a in adapters if a.config.prepare_from or a.config.compile]
    if needs:
        logger.warning(
            "omnitrace: vLLM's worker warm-up (%s) is not there; %s prepare no recorded "
            "shape, and compile while serving",
            vllm_startup.WARM_UP_METHOD,
            ", ".join(map(repr, needs)),
        )


def _hook_shutdown() -> None:
    """Close this model process's adapters and bus when vLLM shuts the process down, and
    have the process manager's kill wait for it (:mod:`omnitrace.integrations.vllm_shutdown`)."""
    vllm_shutdown.hook_model_process(close_at_shutdown)
    _announce()


def _announce() -> None:
    """Have the process manager's kill of this process wait for its bus (once a process)."""
    global _announced_pid
    pid = os.getpid()
    with _lock:
        if _announced_pid == pid:
            return
        _announced_pid = pid
    vllm_shutdown.announce(pid)


def close_at_shutdown(where: str = "exit", timeout: float = vllm_shutdown.CLOSE_S) -> bool:
    """Close the adapters attached in this process, then its bus, within ``timeout`` seconds.

    Run first by vLLM's shutdown of a model process (``where`` names the method): the
    adapters' pending device timings and the final ``graph_summary`` lines reach the sinks,
    and the event log is written, before vLLM tears the engine down or kills it. Idempotent;
    never raises into vLLM.

    Returns:
        Whether everything was delivered in time (what was not is counted and logged).
    """
    start = time.monotonic()
    deadline = start + timeout
    done = True
    try:
        for adapter in list(_attached):
            # Half of what is left at most: the bus needs the rest.
            done &= adapter.close(max(0.0, deadline - time.monotonic()) / 2)
        with _lock:
            bus = _bus if _bus_pid == os.getpid() else None
        if bus is not None and not bus.closed:
            bus.close(max(deadline - time.monotonic(), 0.05))
            stats = bus.statistics()
            lost = sum(sink.dropped for sink in stats.sinks)
            done &= lost == 0
            logger.info(
                "omnitrace: event bus closed at %s in %.2f s (%d events, %d not delivered)",
                where,
                time.monotonic() - start,
                stats.emitted,
                lost,
            )
    except Exception as exc:
        logger.warning(
            "omnitrace: closing the event bus at %s failed: %s: %s",
            where,
            type(exc).__name__,
            exc,
        )
        done = False
    finally:
        vllm_shutdown.retire()
    return done


def _wrap_load_model(load_model: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(load_model)
    def load_model_with_graphs(self: Any, vllm_config: Any, *args: Any, **kwargs: Any) -> Any:
        model = load_model(self, vllm_config, *args, **kwargs)
        _after_load(model, vllm_config)
        return model

    setattr(load_model_with_graphs, _PATCHED, True)
    return load_model_with_graphs


def _adapters_of(result: Any) -> list[EncoderCudaGraph]:
    """The adapters an integration's ``instrument`` result names (its adapter fields)."""
    from omnitrace.graphs.adapter import EncoderCudaGraph

    if not dataclasses.is_dataclass(result):
        return []
    values = (getattr(result, field.name) for field in dataclasses.fields(result))
    return [value for value in values if isinstance(value, EncoderCudaGraph)]


@contextlib.contextmanager
def profiling_phase(adapters: Iterable[EncoderCudaGraph]) -> Iterator[None]:
    """Put ``adapters`` in the profiling phase inside the block, then restore their phases.

    For a serving engine's start-up profiling run (the plugin wraps vLLM's with it): the
    adapters' events carry ``phase: profiling``, and adapters configured with
    ``skip_profiling`` keep those calls eager and out of admission. Phases are restored even
    when the block raises.
    """
    with vllm_startup.in_phase(adapters, Phase.PROFILING):
        yield


def _calls(adapter: EncoderCudaGraph) -> int:
    """The calls ``adapter`` has counted so far (hits and misses, from its own stats)."""
    return adapter.stats().calls


def _observe_profiling(runner: str, counted: Mapping[EncoderCudaGraph, int]) -> None:
    """Report a finished profiling run: how many calls it made of each adapter.

    ``counted`` holds each adapter's calls when the run started. One ProfilingObserved per
    adapter goes to that adapter's bus; a run that called no encoder is logged once per
    process. Never raises: a report must not fail vLLM's start-up.
    """
    global _no_encoder_reported_pid
    made: dict[EncoderCudaGraph, int] = {}
    for adapter, before in counted.items():
        try:
            made[adapter] = _calls(adapter) - before
            bus = adapter.bus
            if bus is not None:
                # emit() never blocks and never raises; this runs after the run, off any
                # encoder call.
                bus.emit(profiling_observed(adapter.name, runner, made[adapter]))
        except Exception as exc:
            logger.warning(
                "omnitrace: cannot report the profiling run of %r: %s: %s",
                getattr(adapter, "name", adapter),
                type(exc).__name__,
                exc,
            )
    if not counted or any(made.values()) or len(made) < len(counted):
        return
    pid = os.getpid()
    with _lock:
        if _no_encoder_reported_pid == pid:
            return
        _no_encoder_reported_pid = pid
    logger.info(
        "omnitrace: vLLM's profiling run (%s) called no encoder; encoder graphs are first "
        "captured while serving, after the KV cache took its memory (each capture's free "
        "device memory is on its GraphCaptured event)",
        runner,
    )


def _wrap_profile_run(profile_run: Callable[..., Any], owner: type) -> Callable[..., Any]:
    # The method's own name, not the instance's class: a CPU runner that inherits it runs
    # this profiling run, and the name says which of vLLM's runners it is.
    runner = f"{owner.__module__}.{owner.__qualname__}.{_PROFILE_METHOD}"

    @functools.wraps(profile_run)
    def profile_run_in_profiling_phase(self: Any, *args: Any, **kwargs: Any) -> Any:
        # The adapters attached when the run starts: a worker attaches its model's at load,
        # before vLLM profiles. Their call counts are read once here and once after the run,
        # never on an encoder call.
        adapters = list(_attached)
        counted = {adapter: _calls(adapter) for adapter in adapters}
        with profiling_phase(adapters):
            result = profile_run(self, *args, **kwargs)
        # vLLM captures its own graphs next, in CUDA's global mode, where a device timer's
        # query from its thread would break the capture: none is left pending by then.
        for adapter in adapters:
            adapter.flush_device_timing()
        # Only a run that finished is reported: one that raised fails vLLM's start-up.
        _observe_profiling(runner, counted)
        return result

    setattr(profile_run_in_profiling_phase, _PATCHED, True)
    return profile_run_in_profiling_phase


def _hook_profiling() -> bool:
    """Wrap the start-up profiling run of each of vLLM's model runners, once per process.

    Called after a model load, when the runner loading the model is already imported. Only
    runner modules vLLM imported itself are wrapped: the runner that loads a model imports
    its module first, and importing the other (V1's alone is over 6000 lines, with its own
    imports) would cost start-up time and load code this worker never runs. A runner module
    imported later is wrapped at the next model load. Where no runner is there, or one has
    no ``profile_run``, the plugin logs it once and goes on.

    Returns:
        Whether at least one profiling run is wrapped.
    """
    global _profiling_missing_reported
    wrapped = False
    missing: list[str] = []
    for name in _RUNNER_MODULES:
        module = sys.modules.get(name)
        if module is None:
            continue
        runner = getattr(module, _RUNNER_CLASS, None)
        with _lock:
            # Under the lock: two threads loading models wrap each method once between them.
            method = getattr(runner, _PROFILE_METHOD, None)
            if not isinstance(runner, type) or not callable(method):
                missing.append(f"{name}.{_RUNNER_CLASS}.{_PROFILE_METHOD}")
                continue
            if not getattr(method, _PATCHED, False):
                setattr(runner, _PROFILE_METHOD, _wrap_profile_run(method, runner))
        wrapped = True
    if not wrapped and not _profiling_missing_reported:
        _profiling_missing_reported = True
        logger.warning(
            "omnitrace: vLLM's profiling run is not there (%s); encoder calls it makes are "
            "tagged as serving",
            ", ".join(f"no {m}" for m in missing)
            if missing
            else "neither model runner module is imported: " + ", ".join(_RUNNER_MODULES),
        )
    return wrapped


def register(environ: Mapping[str, str] | None = None) -> bool:
    """Hook omnitrace into vLLM's model loading (the ``vllm.general_plugins`` entry point).

    Safe to call any number of times in any process, as vLLM does.

    Returns:
        Whether the loader is hooked (False when ``OMNITRACE_PLUGIN=0``).

    Raises:
        ConfigError: an ``OMNITRACE_*`` variable has an invalid value.
        PluginError: vLLM's model loader is not where this plugin expects it.
    """
    env = os.environ if environ is None else environ
    show_plugin_logs(env)
    if not env_flag(env, ENV_PLUGIN, True):
        logger.info("omnitrace: vLLM plugin disabled by %s", ENV_PLUGIN)
        return False
    try:
        loader_module = importlib.import_module(_LOADER_MODULE)
        loader = loader_module.BaseModelLoader
    except (ImportError, AttributeError) as exc:
        raise PluginError(
            f"omnitrace's vLLM plugin cannot find {_LOADER_MODULE}.BaseModelLoader ({exc}); "
            f"this vLLM is not supported by the plugin (set {ENV_PLUGIN}=0 to run without it)"
        ) from exc
    with _lock:
        if not getattr(loader.load_model, _PATCHED, False):
            loader.load_model = _wrap_load_model(loader.load_model)
    # Where vLLM's process manager runs (the API server): its kill waits for the workers.
    vllm_shutdown.hook_process_manager()
    if _requests_on(env):
        from omnitrace.integrations.vllm_requests import hook_api_server

        hook_api_server(request_bus)
    return True


def pause_graphs(worker: Any = None, paused: bool = True) -> int:
    """Pause (or, with ``paused=False``, resume) the graphs of every adapter attached in this
    process; return how many adapters that was.

    Made for ``llm.collective_rpc(pause_graphs, args=(True,))``, which calls it in each worker
    with the worker first (unused): a benchmark alternates eager and graphed requests of the
    same kind in one engine, so that drift hits both alike. Paused calls are ``ineligible``
    misses, detail ``paused``; graphs, history and pools are kept.
    """
    return _each(lambda adapter: adapter.pause_graphs(paused))


def _each(change: Callable[[EncoderCudaGraph], None]) -> int:
    """Apply ``change`` to every adapter attached in this process; return how many."""
    adapters = list(_attached)
    for adapter in adapters:
        change(adapter)
    return len(adapters)


def graphs_paused(worker: Any = None) -> dict[str, bool]:
    """Whether each adapter attached in this process has its graphs paused, by name (the
    worker first and unused, as :func:`pause_graphs` takes it)."""
    return {adapter.name: adapter.graphs_paused for adapter in list(_attached)}


def split_items(worker: Any = None, split: bool = True) -> int:
    """Serve a call's items one call each (or, with ``split=False``, as one batch) in every
    adapter attached in this process whose integration splits items; return how many
    adapters were set (all attached, as :func:`pause_graphs`).

    Made for ``llm.collective_rpc(split_items, args=(True,))``: a benchmark alternates passes
    with ``encoder_cuda_graph_split_items`` off and on in one engine (the worker first, unused).
    """
    return _each(lambda adapter: adapter.set_split_items(split))


def items_split(worker: Any = None) -> dict[str, bool]:
    """Whether each adapter attached in this process splits a call's items, by name (the
    worker first and unused, as :func:`split_items` takes it)."""
    return {adapter.name: adapter.split_items for adapter in list(_attached)}


def time_requests(worker: Any = None, enabled: bool = True) -> bool:
    """Switch this process's per-request timing off or on; return whether it was on.

    Made for ``llm.collective_rpc(time_requests, args=(False,))`` (the workers' encoder-step
    hooks) beside a call in the process that holds ``vllm.LLM`` (its request hooks): a
    benchmark alternates timed and untimed batches in one engine to measure what timing
    costs. The hooks stay installed (``OMNITRACE_REQUESTS=0`` is the start-up switch that
    leaves them out).
    """
    from omnitrace.integrations.vllm_requests import set_request_timing

    return set_request_timing(enabled)


def _requests_on(environ: Mapping[str, str] | None = None) -> bool:
    """Whether per-request timing is on (``OMNITRACE_REQUESTS``, default on)."""
    from omnitrace.integrations.vllm_requests import ENV_REQUESTS

    return env_flag(os.environ if environ is None else environ, ENV_REQUESTS, True)
