"""What the engine benchmark serves: the configurations and models compared, the seeded
traffic of request kinds, one ``vllm serve`` and the passes its OpenAI clients send."""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import os
import re
import signal
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks import engine_phases, served_pairs
from benchmarks.common import Context, output_lines
from benchmarks.paired import (
    SAMPLING_RATE,
    graph_settings,
    mm_processor_kwargs,
    random_clip,
    random_image,
)
from omnitrace.testing_checkpoints.serving import data_url, free_port, png, serve_command, wav

#: The models compared, in the order they are served, and their names in the report.
MODELS = {"qwen2_5_omni": "Qwen2.5-Omni-7B thinker", "minicpmo": "MiniCPM-o 4.5"}


@dataclass(frozen=True)
class Configuration:
    """One engine of the comparison: its omnitrace overrides and vLLM options."""

    name: str
    overrides: dict[str, Any]
    compilation: dict[str, Any] | None = None
    plugin: bool = True
    #: After its passes, serve eager and graphed requests in pairs, switching the graphs
    #: through ``/collective_rpc`` (:mod:`benchmarks.served_pairs`).
    paired: bool = False
    #: An earlier configuration of the run whose workers' event logs this server prepares
    #: its graphs from before serving (``encoder_cuda_graph_prepare_from``): a restart.
    prepare_from: str | None = None

    def hf_overrides(self, work: Path) -> dict[str, Any]:
        """The ``--hf-overrides`` of this server, its run's files being in ``work``."""
        if self.prepare_from is None:
            return self.overrides
        logs = work / self.prepare_from / "events-[0-9]*.jsonl"  # the workers', not the API's
        return {**self.overrides, "encoder_cuda_graph_prepare_from": str(logs)}


#: The repeated baseline's configuration name.
AGAIN = "eager-again"
#: The configuration that keeps four graphs an encoder, no pool budget (the former default).
COUNTED = "omnitrace-4"
BACKGROUND = "omnitrace-background"


def configurations(model_kind: str) -> list[Configuration]:
    """The configurations compared, eager first (the baseline every other is read against)."""
    graphs: dict[str, Any] = {"encoder_cuda_graph_device_timing": True}
    if model_kind == "qwen2_5_omni":
        graphs["encoder_cuda_graph_audio_attention"] = "masked"
    every = [
        Configuration("eager", {**graphs, "encoder_cuda_graph": False}),
        Configuration("omnitrace", dict(graphs), paired=True),
        # Compiled at start-up only, for the shapes the defaults' server captured.
        Configuration(
            "omnitrace+compile",
            {**graphs, "encoder_cuda_graph_compile": True},
            prepare_from="omnitrace",
        ),
        # The defaults' server restarted: its graphs captured before the first request.
        Configuration("omnitrace-restarted", dict(graphs), prepare_from="omnitrace"),
        Configuration(COUNTED, {**graphs, "encoder_cuda_graph_max_graphs": 4}),
        # Calls of several images or clips served one item at a time.
        Configuration("omnitrace-split", {**graphs, "encoder_cuda_graph_split_items": True}),
        # A new shape warmed up and captured off the calling thread while its calls run eagerly.
        Configuration(BACKGROUND, {**graphs, "encoder_cuda_graph_background_capture": True}),
        Configuration(
            "vllm-encoder-graphs", {}, compilation={"cudagraph_mm_encoder": True}, plugin=False
        ),
        # The baseline once more at the end (A/B/A): how far the machine drifted meanwhile.
        Configuration(AGAIN, {**graphs, "encoder_cuda_graph": False}),
    ]
    if not (extra := graph_overrides()):
        return every
    return [replace(c, overrides={**c.overrides, **extra}) if _graphs(c) else c for c in every]


def _graphs(config: Configuration) -> bool:
    """Whether ``config`` runs omnitrace's graphs (not eager, not vLLM's own)."""
    return config.plugin and config.overrides.get("encoder_cuda_graph", True) is not False


def graph_overrides() -> dict[str, Any]:
    """``OMNITRACE_BENCH_ENGINE_GRAPH_OVERRIDES``: a JSON object of ``encoder_cuda_graph_*``
    settings every configuration that runs omnitrace's graphs gets on top of its own (the
    eager ones do not), e.g. ``{"encoder_cuda_graph_pool_budget_bytes": 4294967296}``;
    default none.

    Raises:
        ValueError: the value is not a JSON object of ``encoder_cuda_graph_*`` keys.
    """
    name = "OMNITRACE_BENCH_ENGINE_GRAPH_OVERRIDES"
    return graph_settings(name, os.environ.get(name, ""))


# -- traffic -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class RequestKind:
    """A kind of request: its images (width, height) and clips (seconds)."""

    name: str
    images: tuple[tuple[int, int], ...] = ()
    clips: tuple[float, ...] = ()

    @property
    def modality(self) -> str:
        return "mixed" if self.images and self.clips else ("image" if self.images else "audio")


def request_kinds(scale: str, model_kind: str = "qwen2_5_omni") -> list[RequestKind]:
    """The traffic mix's kinds; smaller images and clips on the CPU scales. MiniCPM-o's images
    are sized by their slices of 448 px: one (the overview only), 2, 4, 6 and 9 slices beside
    the overview."""
    if scale != "full":
        return [
            RequestKind("image-224", images=((224, 224),)),
            RequestKind("audio-1s", clips=(1.0,)),
            RequestKind("image+audio", images=((224, 168),), clips=(0.5,)),
        ]
    if model_kind == "minicpmo":
        sizes = ((448, 448), (896, 448), (896, 896), (1344, 896), (1344, 1344))
    else:
        sizes = ((448, 448), (896, 672), (1344, 1008))
    return [
        *(RequestKind(_image_name(w, h), images=((w, h),)) for w, h in sizes),
        RequestKind("images-2x448", images=((448, 448), (672, 448))),
        *(RequestKind(f"audio-{s:g}s", clips=(s,)) for s in (1.0, 5.0, 10.0, 30.0)),
        RequestKind("image+audio", images=((448, 448),), clips=(5.0,)),
    ]


def _image_name(width: int, height: int) -> str:
    return f"image-{width}" if width == height == 448 else f"image-{width}x{height}"


def messages(kind: RequestKind, seed: int) -> list[dict[str, Any]]:
    """One user message of ``kind`` with content from ``seed`` (same sizes, new content)."""
    content: list[dict[str, Any]] = []
    for i, (width, height) in enumerate(kind.images):
        url = data_url("image/png", png(random_image(seed * 16 + i, width, height)))
        content.append({"type": "image_url", "image_url": {"url": url}})
    for i, seconds in enumerate(kind.clips):
        url = data_url("audio/wav", wav(random_clip(seed * 16 + 8 + i, seconds), SAMPLING_RATE))
        content.append({"type": "audio_url", "audio_url": {"url": url}})
    content.append({"type": "text", "text": "Describe it in one sentence."})
    return [{"role": "user", "content": content}]


def schedule(kinds: Sequence[RequestKind], per_kind: int, seed: int) -> list[RequestKind]:
    """``per_kind`` requests of each kind in a seeded order."""
    order = [kind for kind in kinds for _ in range(per_kind)]
    rng = np.random.default_rng(seed)
    return [order[i] for i in rng.permutation(len(order))]


# -- one server --------------------------------------------------------------------------------


@dataclass
class Server:
    """A ``vllm serve`` child on loopback for one configuration."""

    config: Configuration
    process: subprocess.Popen[bytes]
    port: int
    output: Path
    out: Path
    """The server's directory: its log and each process's event log."""

    @property
    def events(self) -> list[Path]:
        """Each process's event log (one a tensor-parallel rank, one an API server), by name."""
        return sorted(self.out.glob("events-*.jsonl"))

    def text(self) -> str:
        return self.output.read_text(errors="replace")

    def tail(self, lines: int = 40) -> str:
        return "\n".join(self.text().splitlines()[-lines:])

    def kv_cache_tokens(self) -> int | None:
        """The KV cache size vLLM logged, in tokens."""
        found = re.findall(r"KV cache size: ([\d,]+) tokens", self.text())
        return int(found[-1].replace(",", "")) if found else None

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGINT)
            try:
                self.process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=30)


def openai_client(port: int) -> tuple[Any, str]:
    """An OpenAI client of the server on loopback ``port``, and the model it serves."""
    import openai

    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", timeout=600)
    return client, client.models.list().data[0].id


def tensor_parallel_size() -> int:
    """``OMNITRACE_BENCH_ENGINE_TP``: the engines' tensor-parallel size (default 1)."""
    return whole_number("OMNITRACE_BENCH_ENGINE_TP", default=1, most=8)


def whole_number(name: str, *, default: int, most: int) -> int:
    """The environment variable ``name``: a whole number 1 to ``most`` (``default`` if unset).

    Raises:
        ValueError: the value is anything else.
    """
    raw = os.environ.get(name, "").strip() or str(default)
    if not (raw.isascii() and raw.isdigit()) or not 1 <= int(raw) <= most:
        raise ValueError(f"{name}: expected a whole number 1 to {most}, got {raw!r}")
    return int(raw)


def api_server_count() -> int:
    """``OMNITRACE_BENCH_ENGINE_API_SERVERS``: each ``vllm serve``'s ``--api-server-count``.

    Raises:
        ValueError: the value is not a whole number from 1 to 16.
    """
    return whole_number("OMNITRACE_BENCH_ENGINE_API_SERVERS", default=1, most=16)


def lm_graph_tokens() -> int | None:
    """``OMNITRACE_BENCH_ENGINE_LM_GRAPH_TOKENS``: on CUDA, vLLM's ``max_cudagraph_capture_size``
    (default 512, vLLM's own on an H200 with its default ``--max-num-seqs``; ``vllm``: twice
    the run's ``--max-num-seqs``, 64, so longer prompts prefill without the graphs).

    Raises:
        ValueError: the value is neither ``vllm`` nor a whole number 1 to 8192.
    """
    if os.environ.get("OMNITRACE_BENCH_ENGINE_LM_GRAPH_TOKENS", "").strip() == "vllm":
        return None
    return whole_number("OMNITRACE_BENCH_ENGINE_LM_GRAPH_TOKENS", default=512, most=8192)


def _environment(config: Configuration, out: Path, cuda: bool, tp: int) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMNITRACE_", "OTEL_"))}
    env.update(HF_HUB_OFFLINE="1", VLLM_NO_USAGE_STATS="1", PYTHONUNBUFFERED="1")
    env["OMNITRACE_PLUGIN"] = "1" if config.plugin else "0"
    if config.plugin:
        # One log per worker: each rank of a tensor-parallel engine writes its own.
        env["OMNITRACE_EVENTS_LOG"] = str(out / "events-{rank}-{pid}.jsonl")
    if config.paired:
        env.update(served_pairs.EXTENSION_ENV)
    if cuda:
        env.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
    else:
        # A CPU engine otherwise takes most of the machine's memory for its KV cache.
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        if tp > 1:
            # vLLM's CPU workers cannot bind their threads on a small machine: share the cores.
            cores = sorted(os.sched_getaffinity(0))
            share = max(1, len(cores) // tp)
            ranks = [cores[r * share : (r + 1) * share] or cores[-1:] for r in range(tp)]
            binds = "|".join(",".join(str(c) for c in mine) for mine in ranks)
            env.setdefault("VLLM_CPU_OMP_THREADS_BIND", binds)
    return env


@contextlib.contextmanager
def serving(
    config: Configuration,
    model: Path,
    work: Path,
    ctx: Context,
    *,
    max_num_seqs: int,
    trust_remote_code: bool = False,
    tp: int = 1,
    api_servers: int = 1,
) -> Iterator[Server]:
    """Start ``vllm serve`` for ``config`` (with ``api_servers`` API server processes) and
    stop it after the block, whatever happens."""
    out = work / config.name
    out.mkdir(parents=True, exist_ok=True)
    for stale in out.glob("events-*.jsonl"):
        stale.unlink()
    port = free_port()
    extra: list[str] = []
    compilation = dict(config.compilation or {})
    if ctx.cuda and (tokens := lm_graph_tokens()) is not None:
        compilation["max_cudagraph_capture_size"] = tokens
    if compilation:
        extra += ["--compilation-config", json.dumps(compilation)]
    extra += ["--trust-remote-code"] if trust_remote_code else []
    extra += ["--tensor-parallel-size", str(tp)] if tp > 1 else []
    extra += ["--api-server-count", str(api_servers)] if api_servers > 1 else []
    if (processor := mm_processor_kwargs()) is not None:
        extra += ["--mm-processor-kwargs", json.dumps(processor)]
    extra += served_pairs.EXTENSION_ARGS if config.paired else ()
    command = serve_command(
        model,
        port,
        max_model_len=ctx.pick(8192, 4096, 4096),
        max_num_seqs=max_num_seqs,
        hf_overrides=config.hf_overrides(work),
        extra=extra,
    )
    output = out / "serve.log"
    with output.open("wb") as sink:
        env = _environment(config, out, ctx.cuda, tp)
        process = subprocess.Popen(command, env=env, cwd=out, stdout=sink, stderr=subprocess.STDOUT)
    server = Server(config, process, port, output, out)
    try:
        _wait_ready(server, timeout=ctx.pick(900.0, 600.0, 600.0))
        yield server
    finally:
        server.stop()


def gpu_processes(
    query: Sequence[str] = (
        "nvidia-smi",
        "--query-compute-apps=pid,used_memory",
        "--format=csv,noheader,nounits",
    ),
) -> list[dict[str, Any]] | None:
    """The processes holding memory on the GPUs, as ``nvidia-smi`` lists them: each one's
    pid, MiB and whether it is this process (the harness, which should hold none: see
    :func:`benchmarks.common.cuda_probe`); None where ``nvidia-smi`` cannot tell.

    Args:
        query: the command that lists them, a ``pid, MiB`` line each.
    """
    lines = output_lines(*query, timeout=30)
    if lines is None:
        return None
    found: list[dict[str, Any]] = []
    for line in lines:
        fields = [f.strip() for f in line.split(",")]
        if len(fields) != 2 or not fields[0].isdigit() or not fields[1].isdigit():
            continue
        pid = int(fields[0])
        found.append({"pid": pid, "used_mib": int(fields[1]), "harness": pid == os.getpid()})
    return found


def _wait_ready(server: Server, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.process.poll() is not None:
            raise RuntimeError(
                f"vllm serve ({server.config.name}) exited with {server.process.returncode} "
                f"before serving:\n{server.tail()}"
            )
        health = f"http://127.0.0.1:{server.port}/health"
        try:
            with urllib.request.urlopen(health, timeout=2) as response:
                if response.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        time.sleep(1)
    raise RuntimeError(
        f"vllm serve ({server.config.name}) did not answer within {timeout:.0f} s:\n{server.tail()}"
    )


@dataclass
class Completion:
    """One streamed request: its kind, TTFT, total time and token ids."""

    kind: str
    ttft_s: float
    total_s: float
    tokens: list[int]
    #: Where the TTFT went (seconds, :data:`benchmarks.engine_phases.PHASES`): measured one
    #: request at a time, None otherwise.
    phases: dict[str, float] | None = None
    #: The id the server gave the request (its chunks' ``id``).
    request_id: str = ""


def _token_ids(choice: Any) -> list[int]:
    """The token ids a streamed chunk's choice carries (vLLM's ``return_token_ids``)."""
    found = getattr(choice, "token_ids", None)
    if found is None and choice.model_extra:
        found = choice.model_extra.get("token_ids")
    return list(found or ())


def one_request(
    client: Any,
    model: str,
    kind: RequestKind,
    seed: int,
    max_tokens: int,
    prompt: list[dict[str, Any]] | None = None,
) -> Completion:
    # The media are made (or given, made) before the clock: a user's TTFT begins when the
    # request is sent, not while its PNG is encoded (a third of a second at 1344x1344).
    prompt = messages(kind, seed) if prompt is None else prompt
    start = time.perf_counter()
    first: float | None = None
    tokens: list[int] = []
    stream = client.chat.completions.create(
        model=model,
        messages=prompt,
        max_tokens=max_tokens,
        temperature=0.0,
        stream=True,
        # Random weights often pick ids the tokenizer has no text for: the first chunk that
        # carries a token id marks the first token, whatever its text.
        extra_body={"return_token_ids": True},
    )
    request_id = ""
    for chunk in stream:
        request_id = request_id or str(getattr(chunk, "id", "") or "")
        if not chunk.choices:
            continue
        ids = _token_ids(chunk.choices[0])
        if ids and first is None:
            first = time.perf_counter()
        tokens += ids
    end = time.perf_counter()
    if first is None:
        raise RuntimeError(f"a {kind.name} request streamed no token")
    return Completion(kind.name, first - start, end - start, tokens, request_id=request_id)


@dataclass
class Pass:
    """The requests of one measured pass at one concurrency."""

    concurrency: int
    wall_s: float
    completions: list[Completion] = field(default_factory=list)
    rates: list[float] = field(default_factory=list)  # requests/s of each run it holds


def repeated(runs: Sequence[Pass]) -> Pass:
    """``runs`` of one concurrency as one pass: their requests together, each run's rate."""
    completions = [c for run in runs for c in run.completions]
    rates = [len(run.completions) / run.wall_s for run in runs]
    return Pass(runs[0].concurrency, sum(r.wall_s for r in runs), completions, rates)


def run_pass(
    server: Server, traffic: Sequence[RequestKind], *, seed: int, concurrency: int, tokens: int
) -> Pass:
    """Send ``traffic`` with ``concurrency`` requests in flight; every request must succeed."""
    client, model = openai_client(server.port)
    if concurrency == 1:
        return _run_alone(server, client, model, traffic, seed=seed, tokens=tokens)
    # Every request's media first: made in the clients' threads they would count in the
    # pass's wall time and take the CPU from the threads reading their streams.
    prompts = [messages(kind, seed * 1000 + i) for i, kind in enumerate(traffic)]
    start = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(concurrency) as pool:
        futures = [
            pool.submit(one_request, client, model, kind, seed * 1000 + i, tokens, prompt)
            for i, (kind, prompt) in enumerate(zip(traffic, prompts, strict=True))
        ]
        completions = [f.result() for f in futures]
    return Pass(concurrency, time.perf_counter() - start, completions)


def _run_alone(
    server: Server,
    client: Any,
    model: str,
    traffic: Sequence[RequestKind],
    *,
    seed: int,
    tokens: int,
) -> Pass:
    """One request at a time, each between two scrapes of the engine's metrics (where its
    TTFT went); the pass's wall time is the requests' own, without the scrapes."""
    completions = []
    wall_s = 0.0
    for i, kind in enumerate(traffic):
        before = engine_phases.scrape(server.port)
        completion = one_request(client, model, kind, seed * 1000 + i, tokens)
        wall_s += completion.total_s
        after = engine_phases.settled(server.port, before)
        completion.phases = engine_phases.split(
            completion.ttft_s, engine_phases.one_request(before, after)
        )
        completions.append(completion)
    return Pass(1, wall_s, completions)
