"""End to end: what omnitrace's encoder graphs are worth to a ``vllm serve`` user's requests.

Two models, Qwen2.5-Omni-7B's thinker and MiniCPM-o 4.5 (Qwen3-8B, SigLIP-400M with 27
layers, Whisper-medium), at their released sizes on CUDA (tiny on a CPU). For each, one
``vllm serve`` per configuration, started back to back in this invocation on the same
checkpoint (written here by :mod:`omnitrace.testing_checkpoints`; dummy weights, so the text is
meaningless and the timing real), each sent the same seeded traffic by OpenAI clients over
loopback, streaming, so the time to the first content chunk is the user's TTFT.
``OMNITRACE_BENCH_ENGINE_MODELS=minicpmo`` (comma-separated kinds) serves only those models;
``OMNITRACE_BENCH_ENGINE_TP=2`` serves each engine tensor-parallel over two devices (each rank
writes its own event log; graphs and pools are counted per rank, the encoders' device time is
the slowest rank's).

============================  ===================================================================
configuration                 what
============================  ===================================================================
``eager``                     omnitrace's adapters attached with ``encoder_cuda_graph: false``:
                              every encoder call eager (the adapter only times it), vLLM's own
                              language-model graphs on
``omnitrace``                 exact-shape graphs, default settings (Qwen2.5-Omni's audio tower
                              through the masked attention, without which it cannot graph);
                              after its passes, each kind in pairs, graphs switched off and
                              on through ``/collective_rpc`` (:mod:`benchmarks.served_pairs`)
``omnitrace+compile``         the same with ``encoder_cuda_graph_compile``
``omnitrace+budget``          the graphs' count set by a pool budget instead of the default
                              four: ``encoder_cuda_graph_pool_budget_bytes`` 2 GiB per encoder
                              with ``encoder_cuda_graph_max_graphs`` 64 as the ceiling
``vllm-encoder-graphs``       vLLM's own encoder graphs (``cudagraph_mm_encoder``), where the
                              model implements vLLM's protocol; recorded as not applicable
                              otherwise
``eager-again``               ``eager`` once more, last (A/B/A): the machine's drift across the
                              run, reported beside every change read against ``eager``
============================  ===================================================================

Before the servers, in the same invocation, each model runs :mod:`benchmarks.paired` in a
child (offline, one ``vllm.LLM`` engine, graphs paused and resumed per request, eager and
graphed requests of each kind alternating), so drift inside the run hits both halves alike;
``OMNITRACE_BENCH_ENGINE_OFFLINE=0`` leaves it out.
``OMNITRACE_BENCH_ENGINE_CONFIGS=eager,omnitrace,eager-again`` (comma-separated names from the
table, served in the table's order) serves only those configurations, for a machine that gives
one command too little time for all of them.

The traffic: single images at several resolutions (MiniCPM-o: 1 to 9 slices), two-image
prompts, audio of 1, 5, 10 and 30 s, and image-plus-audio prompts, in a seeded order; greedy,
short outputs. Each configuration serves a warm-up pass first (the graphs'
``min_capture_calls``), then the measured passes at concurrency 1, 8 and 32, with new pixels
and samples of the same sizes each pass (vLLM caches encoder outputs by content). Reported per
configuration: TTFT p50 and p99 per request kind and concurrency, requests/s, the encoders'
device time as a share of TTFT (``DeviceTimed`` events; concurrency 1), graphs and pool bytes
from the event log, the share of the measured passes' encoder calls a graph served (hits after
the warm-up, misses by reason), the KV cache vLLM chose (its log), whether every completion
equals the eager configuration's, at concurrency 1 where each kind's TTFT went by the
engine's own histograms around each request (:mod:`benchmarks.engine_phases`), and at every
concurrency where it went by omnitrace's per-request events. The goals checked: TTFT p50 at
concurrency 1 per modality, requests/s and TTFT p99 at the highest concurrency against
eager's, and the hit rate after the warm-up.

A server that fails to start, dies or answers an error fails the benchmark with its output;
it is never skipped. On a CPU (``--quick`` or ``--tiny``) everything runs on a tiny model:
the plumbing is checked, the numbers mean nothing, and graphs cannot capture.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import itertools
import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks import engine_phases, served_pairs
from benchmarks.common import (
    BenchmarkFailedError,
    Context,
    figure,
    summarize,
    target,
    write_partial,
)
from omnitrace.testing_checkpoints.serving import data_url, free_port, png, serve_command, wav

NAME = "engine"
#: Runs on a CPU at toy sizes (the engine CI tier); full scale needs CUDA (checked in run()).
NEEDS_CUDA = False

SAMPLING_RATE = 16_000
GOAL = "end_to_end"
#: Published end-to-end anchors the results are read beside.
ANCHORS = (
    "sglang-omni Qwen3-Omni encoder graphs: TTFT -37.8 % at concurrency 1, -53.7 % at 32 "
    "(its PR #1628)",
    "vLLM encoder graphs, Qwen3-VL: mean latency -11.8 % to -44.4 % (vLLM #35963); Step3-VL "
    "slower with them on (vLLM #41714)",
)


@dataclass(frozen=True)
class Configuration:
    """One engine of the comparison: its omnitrace overrides and vLLM options."""

    name: str
    overrides: dict[str, Any]
    compilation: dict[str, Any] | None = None
    plugin: bool = True
    #: Environment variables of the server (``OMNITRACE_REQUESTS``, say).
    env: dict[str, str] = field(default_factory=dict)
    #: After its passes, serve eager and graphed requests in pairs, switching the graphs
    #: through ``/collective_rpc`` (:mod:`benchmarks.served_pairs`).
    paired: bool = False


#: The repeated baseline's configuration name.
AGAIN = "eager-again"
#: The configuration whose graph count a pool budget sets.
BUDGET = "omnitrace+budget"


def configurations(model_kind: str) -> list[Configuration]:
    """The configurations compared, eager first (the baseline every other is read against)."""
    graphs: dict[str, Any] = {"encoder_cuda_graph_device_timing": True}
    if model_kind == "qwen2_5_omni":
        graphs["encoder_cuda_graph_audio_attention"] = "masked"
    return [
        Configuration("eager", {**graphs, "encoder_cuda_graph": False}),
        Configuration("omnitrace", dict(graphs), paired=True),
        Configuration("omnitrace+compile", {**graphs, "encoder_cuda_graph_compile": True}),
        Configuration(
            BUDGET,
            {
                **graphs,
                "encoder_cuda_graph_max_graphs": 64,
                "encoder_cuda_graph_pool_budget_bytes": 2 * 1024**3,
            },
        ),
        Configuration(
            "vllm-encoder-graphs",
            {},
            compilation={"cudagraph_mm_encoder": True},
            plugin=False,
        ),
        # The baseline once more at the end (A/B/A): how far the machine drifted meanwhile.
        Configuration(AGAIN, {**graphs, "encoder_cuda_graph": False}),
    ]


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
    """The traffic mix's kinds; smaller images and clips on the CPU scales.

    MiniCPM-o's images are sized by their slices of 448 px: one (the overview only), 2, 4, 6
    and 9 slices beside the overview.
    """
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


def _png(seed: int, width: int, height: int) -> str:
    from PIL import Image

    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    return data_url("image/png", png(Image.fromarray(pixels)))


def _wav(seed: int, seconds: float) -> str:
    samples = 0.1 * np.random.default_rng(seed).standard_normal(int(seconds * SAMPLING_RATE))
    return data_url("audio/wav", wav(samples, SAMPLING_RATE))


def messages(kind: RequestKind, seed: int) -> list[dict[str, Any]]:
    """One user message of ``kind`` with content from ``seed`` (same sizes, new content)."""
    content: list[dict[str, Any]] = []
    for i, (width, height) in enumerate(kind.images):
        content.append(
            {"type": "image_url", "image_url": {"url": _png(seed * 16 + i, width, height)}}
        )
    for i, seconds in enumerate(kind.clips):
        content.append(
            {"type": "audio_url", "audio_url": {"url": _wav(seed * 16 + 8 + i, seconds)}}
        )
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
    """The server's directory: its log and each worker's event log."""

    @property
    def events(self) -> list[Path]:
        """Each worker's event log (one a tensor-parallel rank), in rank order."""
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


def tensor_parallel_size() -> int:
    """``OMNITRACE_BENCH_ENGINE_TP``: the engines' tensor-parallel size (default 1)."""
    raw = os.environ.get("OMNITRACE_BENCH_ENGINE_TP", "").strip() or "1"
    if not raw.isdigit() or not 1 <= int(raw) <= 8:
        raise ValueError(f"OMNITRACE_BENCH_ENGINE_TP: expected a whole number 1 to 8, got {raw!r}")
    return int(raw)


def _environment(config: Configuration, out: Path, cuda: bool, tp: int) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMNITRACE_", "OTEL_"))}
    env.update(HF_HUB_OFFLINE="1", VLLM_NO_USAGE_STATS="1", PYTHONUNBUFFERED="1")
    env["OMNITRACE_PLUGIN"] = "1" if config.plugin else "0"
    if config.plugin:
        # One log per worker: each rank of a tensor-parallel engine writes its own.
        env["OMNITRACE_EVENTS_LOG"] = str(out / "events-{rank}-{pid}.jsonl")
    env.update(config.env)
    if config.paired:
        env.update(served_pairs.EXTENSION_ENV)
    if cuda:
        env.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
    else:
        # A CPU engine otherwise takes most of the machine's memory for its KV cache.
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        if tp > 1:
            # vLLM's CPU workers cannot bind their threads themselves on a small machine:
            # give each rank its share of the cores.
            cores = sorted(os.sched_getaffinity(0))
            share = max(1, len(cores) // tp)
            env.setdefault(
                "VLLM_CPU_OMP_THREADS_BIND",
                "|".join(
                    ",".join(str(c) for c in cores[r * share : (r + 1) * share] or cores[-1:])
                    for r in range(tp)
                ),
            )
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
) -> Iterator[Server]:
    """Start ``vllm serve`` for ``config`` and stop it after the block, whatever happens."""
    out = work / config.name
    out.mkdir(parents=True, exist_ok=True)
    for stale in out.glob("events-*.jsonl"):
        stale.unlink()
    port = free_port()
    command = serve_command(
        model,
        port,
        max_model_len=ctx.pick(8192, 4096, 4096),
        max_num_seqs=max_num_seqs,
        hf_overrides=config.overrides,
        extra=(
            *(
                ()
                if config.compilation is None
                else ("--compilation-config", json.dumps(config.compilation))
            ),
            *(("--trust-remote-code",) if trust_remote_code else ()),
            *(("--tensor-parallel-size", str(tp)) if tp > 1 else ()),
            *(served_pairs.EXTENSION_ARGS if config.paired else ()),
        ),
    )
    output = out / "serve.log"
    with output.open("wb") as sink:
        process = subprocess.Popen(
            command,
            env=_environment(config, out, ctx.cuda, tp),
            cwd=out,
            stdout=sink,
            stderr=subprocess.STDOUT,
        )
    server = Server(config, process, port, output, out)
    try:
        _wait_ready(server, timeout=ctx.pick(900.0, 600.0, 600.0))
        yield server
    finally:
        server.stop()


def _wait_ready(server: Server, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.process.poll() is not None:
            raise RuntimeError(
                f"vllm serve ({server.config.name}) exited with {server.process.returncode} "
                f"before serving:\n{server.tail()}"
            )
        try:
            with urllib.request.urlopen(
                f"http://127.0.0.1:{server.port}/health", timeout=2
            ) as response:
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
    """One streamed request: its kind, TTFT, total time, token ids and text."""

    kind: str
    ttft_s: float
    total_s: float
    tokens: list[int]
    text: str
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


def _one(client: Any, model: str, kind: RequestKind, seed: int, max_tokens: int) -> Completion:
    # The request's media are made before the clock starts: a user's TTFT begins when the
    # request is sent, not while its PNG is encoded (up to a third of a second at 1344x1344).
    prompt = messages(kind, seed)
    start = time.perf_counter()
    first: float | None = None
    tokens: list[int] = []
    parts: list[str] = []
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
        parts.append(chunk.choices[0].delta.content or "")
    end = time.perf_counter()
    if first is None:
        raise RuntimeError(f"a {kind.name} request streamed no token")
    return Completion(
        kind.name, first - start, end - start, tokens, "".join(parts), request_id=request_id
    )


@dataclass
class Pass:
    """The requests of one measured pass at one concurrency."""

    concurrency: int
    wall_s: float
    completions: list[Completion] = field(default_factory=list)


def run_pass(
    server: Server, traffic: Sequence[RequestKind], *, seed: int, concurrency: int, tokens: int
) -> Pass:
    """Send ``traffic`` with ``concurrency`` requests in flight; every request must succeed."""
    import openai

    client = openai.OpenAI(
        base_url=f"http://127.0.0.1:{server.port}/v1", api_key="unused", timeout=600
    )
    model = client.models.list().data[0].id
    if concurrency == 1:
        return _run_alone(server, client, model, traffic, seed=seed, tokens=tokens)
    start = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(concurrency) as pool:
        futures = [
            pool.submit(_one, client, model, kind, seed * 1000 + i, tokens)
            for i, kind in enumerate(traffic)
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
        completion = _one(client, model, kind, seed * 1000 + i, tokens)
        wall_s += completion.total_s
        after = engine_phases.settled(server.port, before)
        completion.phases = engine_phases.split(
            completion.ttft_s, engine_phases.one_request(before, after)
        )
        completions.append(completion)
    return Pass(1, wall_s, completions)


# -- what the event log says -------------------------------------------------------------------


def event_figures(paths: Sequence[Path], skip: dict[Path, int] | None = None) -> dict[str, Any]:
    """Graphs, pool bytes, encoder device time and hit counts from the workers' event logs
    (each after its first ``skip`` lines, if given): in all, per adapter (misses by reason)
    and per worker (graphs and pool bytes a device)."""
    figures: dict[str, Any] = {"graphs": 0, "pool_bytes": 0, "hits": 0, "misses": 0}
    device: dict[str, float] = {}
    adapters: dict[str, dict[str, Any]] = {}
    workers: dict[str, dict[str, int]] = {}
    for path in paths:
        worker = workers.setdefault(path.stem, {"graphs": 0, "pool_bytes": 0})
        _fold_log(path, figures, device, adapters, worker, (skip or {}).get(path, 0))
    figures["encoder_device_s"] = device if paths else None
    figures["workers"] = workers
    figures["adapters"] = {
        name: entry
        for name, entry in adapters.items()
        if entry["graphs"] or entry["hits"] or entry["misses"]
    }
    return figures


def _fold_log(
    path: Path,
    figures: dict[str, Any],
    device: dict[str, float],
    adapters: dict[str, dict[str, Any]],
    worker: dict[str, int],
    skip: int = 0,
) -> None:
    with path.open(encoding="utf-8") as lines:
        for line in itertools.islice(lines, skip, None):
            event = json.loads(line)
            kind = event.get("type")
            mine = adapters.setdefault(
                str(event.get("adapter")), {"graphs": 0, "hits": 0, "misses": {}}
            )
            if kind == "GraphCaptured":
                pool = int(event["bytes_reserved"]) + int(event["static_bytes"])
                figures["graphs"] += 1
                mine["graphs"] += 1
                worker["graphs"] += 1
                figures["pool_bytes"] += pool
                worker["pool_bytes"] += pool
            elif kind == "GraphReplayed":
                figures["hits"] += 1
                mine["hits"] += 1
            elif kind == "GraphMissed":
                figures["misses"] += 1
                reason = str(event.get("reason"))
                mine["misses"][reason] = mine["misses"].get(reason, 0) + 1
            elif kind == "DeviceTimed":
                device[event["adapter"]] = device.get(event["adapter"], 0.0) + float(
                    event["device_s"]
                )


def _line_counts(paths: Sequence[Path]) -> dict[Path, int]:
    counts = {}
    for path in paths:
        with path.open("rb") as lines:
            counts[path] = sum(1 for _ in lines)
    return counts


def hits_since(paths: Sequence[Path], skip: dict[Path, int]) -> dict[str, Any]:
    """The encoder calls in each log after its first ``skip`` lines (the measured passes,
    once the warm-up captured what it would): calls, hits and the hit rate, in all and per
    encoder, with the misses by reason."""
    encoders: dict[str, dict[str, Any]] = {}
    for name, adapter in event_figures(paths, skip)["adapters"].items():
        calls = adapter["hits"] + sum(adapter["misses"].values())
        if calls:
            hits = adapter["hits"]
            encoders[name] = {
                "calls": calls,
                "hits": hits,
                "misses": adapter["misses"],
                "hit_rate": hits / calls,
            }
    calls = sum(e["calls"] for e in encoders.values())
    hits = sum(e["hits"] for e in encoders.values())
    return {
        "calls": calls,
        "hits": hits,
        "hit_rate": hits / calls if calls else None,
        "encoders": encoders,
    }


def _device_s_since(paths: Sequence[Path], skip: dict[Path, int]) -> float | None:
    """Encoder device seconds in each log's events after its first ``skip`` lines: the most
    of any worker (tensor-parallel ranks run their encoders side by side).

    None when there are none: device timing needs CUDA events, so a CPU run has no figure.
    """
    per_worker = []
    for path in paths:
        with path.open(encoding="utf-8") as lines:
            timed = [
                float(e["device_s"])
                for i, e in enumerate(map(json.loads, lines))
                if i >= skip.get(path, 0) and e.get("type") == "DeviceTimed"
            ]
        if timed:
            per_worker.append(sum(timed))
    return max(per_worker) if per_worker else None


# -- the benchmark -----------------------------------------------------------------------------


#: vLLM 0.26's model class of each checkpoint kind, checked for its encoder graph protocol.
VLLM_MODEL_CLASSES = {
    "qwen2_5_omni": (
        "vllm.model_executor.models.qwen2_5_omni_thinker",
        "Qwen2_5OmniThinkerForConditionalGeneration",
    ),
    "minicpmo": ("vllm.model_executor.models.minicpmo", "MiniCPMO4_5"),
}
#: The models compared, in the order they are served, and their names in the report.
MODELS = {"qwen2_5_omni": "Qwen2.5-Omni-7B thinker", "minicpmo": "MiniCPM-o 4.5"}


def _model_supports_vllm_encoder_graphs(model_kind: str) -> tuple[bool, str]:
    """Whether vLLM's model class for ``model_kind`` implements its encoder graph protocol."""
    module, cls = VLLM_MODEL_CLASSES[model_kind]
    try:
        import importlib

        found = getattr(importlib.import_module(module), cls)
    except Exception as exc:
        return False, f"{module}.{cls} cannot be imported here ({type(exc).__name__}: {exc})"
    if callable(getattr(found, "encoder_cudagraph_forward", None)):
        return True, ""
    return False, f"{cls} does not implement SupportsEncoderCudaGraph in this vLLM"


def _kind_rows(passes: Sequence[Pass]) -> dict[str, dict[str, Any]]:
    rows: dict[str, dict[str, Any]] = {}
    for p in passes:
        by_kind: dict[str, list[float]] = {}
        for c in p.completions:
            by_kind.setdefault(c.kind, []).append(c.ttft_s)
        for kind, samples in by_kind.items():
            ordered = sorted(samples)
            stats = summarize(ordered, scale=1e3)
            rows[f"c{p.concurrency}/{kind}"] = {
                "concurrency": p.concurrency,
                "kind": kind,
                "n": stats["n"],
                "ttft_p50_ms": stats["median"],
                "ttft_p99_ms": ordered[min(len(ordered) - 1, round(0.99 * (len(ordered) - 1)))]
                * 1e3,
            }
            if p.concurrency == 1:
                mine = [c.phases for c in p.completions if c.kind == kind]
                rows[f"c1/{kind}"]["phases_mean_ms"] = engine_phases.mean_phases_ms(mine)
                rows[f"c1/{kind}"]["engine_ttft_p50_ms"] = engine_phases.engine_ttft_p50_ms(mine)
    return rows


def _checkpoint(model_kind: str, directory: Path, scale: str) -> Path:
    """Write ``model_kind``'s checkpoint (the released sizes at full scale) unless it exists."""
    from omnitrace.testing_checkpoints import (
        MiniCPMOSizes,
        Qwen2_5OmniSizes,
        write_minicpmo,
        write_qwen2_5_omni,
    )

    if directory.exists():
        return directory
    if model_kind == "minicpmo":
        write_minicpmo(directory, MiniCPMOSizes.released() if scale == "full" else None)
    else:
        write_qwen2_5_omni(directory, Qwen2_5OmniSizes.released() if scale == "full" else None)
    return directory


def models() -> list[str]:
    """The model kinds this run serves: ``OMNITRACE_BENCH_ENGINE_MODELS`` (comma-separated)
    or every one of :data:`MODELS`."""
    chosen = os.environ.get("OMNITRACE_BENCH_ENGINE_MODELS", "").strip()
    if not chosen:
        return list(MODELS)
    names = [name.strip() for name in chosen.split(",") if name.strip()]
    unknown = [name for name in names if name not in MODELS]
    if unknown or not names:
        raise ValueError(
            f"OMNITRACE_BENCH_ENGINE_MODELS: expected a comma-separated list of "
            f"{', '.join(MODELS)}, got {chosen!r}"
        )
    return names


def chosen_configurations(model_kind: str) -> list[Configuration]:
    """The configurations this run serves: ``OMNITRACE_BENCH_ENGINE_CONFIGS`` (comma-separated
    names, served in :func:`configurations`' order) or all of them."""
    every = configurations(model_kind)
    raw = os.environ.get("OMNITRACE_BENCH_ENGINE_CONFIGS", "").strip()
    if not raw:
        return every
    names = [name.strip() for name in raw.split(",") if name.strip()]
    known = [c.name for c in every]
    unknown = [name for name in names if name not in known]
    if unknown or not names:
        raise ValueError(
            f"OMNITRACE_BENCH_ENGINE_CONFIGS: expected a comma-separated list of "
            f"{', '.join(known)}, got {raw!r}"
        )
    return [c for c in every if c.name in names]


def run(ctx: Context) -> dict[str, Any]:
    """Serve the traffic through each model's configurations back to back; compare with eager."""
    if ctx.scale == "full" and not ctx.cuda:
        raise RuntimeError("the engine benchmark at full scale needs a CUDA device")
    tp = tensor_parallel_size()
    for model_kind in models():
        chosen_configurations(model_kind)  # a misspelt name fails before any server starts
    if ctx.cuda and tp > 1:
        import torch

        if torch.cuda.device_count() < tp:
            raise RuntimeError(
                f"OMNITRACE_BENCH_ENGINE_TP={tp} needs {tp} CUDA devices, "
                f"this machine has {torch.cuda.device_count()}"
            )
    result: dict[str, Any] = {
        "sizes": "released" if ctx.scale == "full" else "tiny",
        "tensor_parallel_size": tp,
        "anchors": list(ANCHORS),
        "models": {},
        "targets": [],
        "figures": [],
    }
    for model_kind in models():
        ctx.log(f"  {MODELS[model_kind]}")
        result["models"][model_kind] = entry = _run_model(ctx, model_kind, result, tp)
        _checks(result, model_kind, entry)
        write_partial(ctx, NAME, result)
    for model_kind, entry in result["models"].items():
        for name, config in entry["configurations"].items():
            if config.get("parity_with_eager") is False:
                raise BenchmarkFailedError(
                    f"{MODELS[model_kind]}: {name}'s completions differ from eager's", result
                )
    return result


def _run_model(ctx: Context, model_kind: str, result: dict[str, Any], tp: int) -> dict[str, Any]:
    # Absolute: each server runs in its own directory.
    work = ctx.out_dir / "engine-work" / (model_kind if tp == 1 else f"{model_kind}-tp{tp}")
    work = work.resolve()
    model = _checkpoint(model_kind, work / "checkpoint", ctx.scale)
    kinds = request_kinds(ctx.scale, model_kind)
    per_kind = ctx.pick(8, 2, 1)
    tokens = ctx.pick(8, 4, 2)
    concurrencies = ctx.pick((1, 8, 32), (1, 4), (1, 2))
    chosen = chosen_configurations(model_kind)
    if ctx.scale != "full":
        # On a CPU nothing graphs: eager, graphs and eager again check the plumbing.
        chosen = [c for c in chosen if c.name in ("eager", "omnitrace", AGAIN)]
    supported, why_not = _model_supports_vllm_encoder_graphs(model_kind)
    entry: dict[str, Any] = {
        "name": MODELS[model_kind],
        "kinds": [k.name for k in kinds],
        "per_kind": per_kind,
        "max_tokens": tokens,
        "vllm_encoder_graphs": {"supported": supported, "reason": why_not},
        "configurations": {},
        "not_applicable": {},
    }
    if offline_enabled():
        ctx.log("  offline: graphs off and on inside one vllm.LLM engine (benchmarks.paired)")
        entry["offline_paired"] = _offline(ctx, model_kind, work)
    texts: dict[str, dict[str, list[int]]] = {}
    for config in chosen:
        if config.compilation is not None and not supported:
            entry["not_applicable"][config.name] = why_not
            ctx.log(f"  {config.name}: not applicable ({why_not})")
            continue
        ctx.log(f"  {config.name}: starting vllm serve")
        started = time.perf_counter()
        with serving(
            config,
            model,
            work,
            ctx,
            max_num_seqs=max(concurrencies),
            trust_remote_code=model_kind == "minicpmo",
            tp=tp,
        ) as server:
            ready_s = time.perf_counter() - started
            # Warm-up: every shape min_capture_calls times, so the graphs are in place.
            for warm in range(2):
                run_pass(server, schedule(kinds, 1, warm), seed=100 + warm, concurrency=1, tokens=1)
            warmed = _line_counts(server.events)
            passes = []
            device_s_c1: float | None = None
            for concurrency in concurrencies:
                skip = _line_counts(server.events)
                traffic = schedule(kinds, per_kind, 7)
                measured = run_pass(
                    server, traffic, seed=200 + concurrency, concurrency=concurrency, tokens=tokens
                )
                passes.append(measured)
                if concurrency == 1 and config.plugin:
                    device_s_c1 = _device_s_since(server.events, skip)
            # Hits after the warm-up count the measured passes only, not the pairs.
            figures = event_figures(server.events)
            after_warmup = hits_since(server.events, warmed) if config.plugin else None
            pairs = None
            if config.paired:
                pairs = _served_pairs(ctx, server, kinds)
            ttft_c1 = sum(c.ttft_s for c in passes[0].completions)
            row = {
                "ready_s": ready_s,
                "kv_cache_tokens": server.kv_cache_tokens(),
                "rows": _kind_rows(passes),
                "requests_per_s": {
                    f"c{p.concurrency}": len(p.completions) / p.wall_s for p in passes
                },
                "encoder_share_of_ttft_c1": (
                    None if device_s_c1 is None or ttft_c1 <= 0 else device_s_c1 / ttft_c1
                ),
                # The measured passes' encoder calls: what the graphs served once warm.
                "after_warmup": after_warmup,
                **{k: v for k, v in figures.items() if k != "encoder_device_s"},
            }
            texts[config.name] = {
                f"c{p.concurrency}/{i}": c.tokens
                for p in passes
                for i, c in enumerate(p.completions)
            }
            if "eager" in texts and config.name != "eager":
                mine, eager = texts[config.name], texts["eager"]
                # One request at a time the engine's batches are the same in every
                # configuration, so its tokens must be too. With several in flight the
                # batches depend on timing and the language model's numerics on the batch,
                # so those are counted, not required.
                solo = [k for k in eager if k.startswith("c1/")]
                row["parity_with_eager"] = all(mine.get(k) == eager[k] for k in solo)
                batched = [k for k in eager if not k.startswith("c1/")]
                row["batched_equal_eager"] = sum(mine.get(k) == eager[k] for k in batched)
                row["batched_requests"] = len(batched)
        if config.plugin:
            # After the server stopped, every process has flushed its log: each request's
            # phases from its own events, per kind and concurrency.
            views = engine_phases.event_views(server.events)
            row["event_phases"] = {}
            row["event_problems"] = []
            for p in passes:
                table, problems = engine_phases.phase_table(p.completions, views)
                row["event_phases"][f"c{p.concurrency}"] = table
                row["event_problems"] += [f"c{p.concurrency} {x}" for x in problems]
            if pairs is not None:
                row["served_pairs"] = _pair_outcomes(pairs, views)
        entry["configurations"][config.name] = row
        write_partial(ctx, NAME, {**result, "models": {**result["models"], model_kind: entry}})
        ctx.log(f"  {config.name}: served in {time.perf_counter() - started:.0f} s")
    return entry


def _served_pairs(ctx: Context, server: Server, kinds: Sequence[RequestKind]) -> dict[str, Any]:
    """Eager and graphed requests of each kind in pairs, one at a time, in this server."""
    import openai

    client = openai.OpenAI(
        base_url=f"http://127.0.0.1:{server.port}/v1", api_key="unused", timeout=600
    )
    model = client.models.list().data[0].id
    ctx.log(f"  {server.config.name}: graphs off and on in pairs (served_pairs)")
    base_url = f"http://127.0.0.1:{server.port}"
    pairs = served_pairs.run(
        base_url,
        kinds,
        lambda kind, seed: _one(client, model, kind, seed, 1),
        pairs=ctx.pick(8, 2, 1),
        seed=300_000,
    )
    ctx.log(f"  {server.config.name}: request timing off and on in rounds (served_pairs)")
    pairs["timing_cost"] = served_pairs.timing_cost(
        base_url,
        kinds,
        lambda kind, seed: _one(client, model, kind, seed, 4),
        rounds=ctx.pick(8, 2, 1),
        seed=400_000,
    )
    return pairs


def _pair_outcomes(pairs: dict[str, Any], views: dict[str, Any]) -> dict[str, Any]:
    """The pairs' summaries and, per half, the outcomes of the encoder calls that served its
    requests (from the request events): every paused call must be ``miss ineligible/paused``
    where graphs capture at all."""
    outcomes: dict[str, dict[str, int]] = {"eager": {}, "graphed": {}}
    missing = 0
    for sent in pairs["requests"]:
        view = views.get(sent["request_id"])
        if view is None:
            missing += 1
            continue
        half = outcomes["eager" if sent["paused"] else "graphed"]
        for step in view.steps:
            for call in step.calls:
                half[call["outcome"]] = half.get(call["outcome"], 0) + 1
    return {
        "kinds": pairs["kinds"],
        "encoder_calls": outcomes,
        "without_event": missing,
        "timing_cost": pairs.get("timing_cost"),
    }


def offline_enabled() -> bool:
    """Whether the offline paired run comes first (``OMNITRACE_BENCH_ENGINE_OFFLINE``, 1 by
    default; 0 leaves it out)."""
    raw = os.environ.get("OMNITRACE_BENCH_ENGINE_OFFLINE", "1").strip()
    if raw not in ("0", "1"):
        raise ValueError(f"OMNITRACE_BENCH_ENGINE_OFFLINE: expected 0 or 1, got {raw!r}")
    return raw == "1"


def _offline(ctx: Context, model_kind: str, work: Path) -> dict[str, Any]:
    """Run :mod:`benchmarks.paired` on this model in a child (its engine's memory is given
    back before the servers start) and return its result; its failure fails the benchmark."""
    out = work / "offline"
    argv = [
        *(sys.executable, "-m", "benchmarks.paired", "--model", model_kind),
        *("--size", "released" if ctx.scale == "full" else "tiny", "--out", str(out)),
        *("--pairs", str(ctx.pick(12, 2, 1)), "--warmup", str(ctx.pick(3, 2, 2))),
        *("--cost-rounds", "0"),
    ]
    if model_kind == "qwen2_5_omni":
        # Its audio tower graphs only through the masked attention, as configured above.
        argv += ["--overrides", json.dumps({"encoder_cuda_graph_audio_attention": "masked"})]
    done = subprocess.run(argv, capture_output=True, text=True, check=False)
    path = out / f"paired-{model_kind}.json"
    if done.returncode != 0 or not path.exists():
        raise RuntimeError(
            f"{MODELS[model_kind]}: the offline paired run failed (exit {done.returncode}):\n"
            f"{done.stdout[-3000:]}{done.stderr[-3000:]}"
        )
    return dict(json.loads(path.read_text()))


def _median_change(
    entry: dict[str, Any],
    model_kind: str,
    scale: str,
    config: str,
    modality: str,
    field: str = "ttft_p50_ms",
) -> float | None:
    """Relative change of the median over ``modality``'s kinds of their ``field`` (TTFT p50,
    or vLLM's own) at concurrency 1."""
    configs = entry["configurations"]
    if config not in configs or "eager" not in configs:
        return None
    kinds = {k.name: k for k in request_kinds(scale, model_kind)}

    def p50(name: str) -> float | None:
        rows = [
            r.get(field)
            for r in configs[name]["rows"].values()
            if r["concurrency"] == 1 and kinds[r["kind"]].modality == modality
        ]
        if not rows or any(v is None for v in rows):
            return None
        return float(np.median(rows))

    base, new = p50("eager"), p50(config)
    return None if base is None or new is None or base <= 0 else (new - base) / base


def _checks(result: dict[str, Any], model_kind: str, entry: dict[str, Any]) -> None:
    configs = entry["configurations"]
    label = MODELS[model_kind]
    scale = "full" if result["sizes"] == "released" else "quick"
    for modality in ("image", "audio"):
        change = _median_change(entry, model_kind, scale, "omnitrace", modality)
        result["targets"].append(
            target(
                f"{label}: {modality} TTFT p50 at concurrency 1, omnitrace vs eager encoders",
                None if change is None else 100 * change,
                "<=",
                -30.0,
                "%",
                goal=GOAL,
            )
        )
        # vLLM's own TTFT leaves out the transfer before its renderer: reported beside.
        inside = _median_change(
            entry, model_kind, scale, "omnitrace", modality, field="engine_ttft_p50_ms"
        )
        result["figures"].append(
            figure(
                f"{label}: {modality} TTFT p50 inside vLLM (renderer to first token) at "
                "concurrency 1, omnitrace vs eager encoders",
                None if inside is None else 100 * inside,
                "%",
                goal=GOAL,
                note="from vLLM's histograms around each request (benchmarks/engine_phases.py)",
            )
        )
    if "omnitrace" in configs and "eager" in configs:
        eager_kv = configs["eager"]["kv_cache_tokens"]
        graph_kv = configs["omnitrace"]["kv_cache_tokens"]
        result["figures"].append(
            figure(
                f"{label}: KV cache with omnitrace's graphs, change against eager",
                None
                if not eager_kv or graph_kv is None
                else 100 * (graph_kv - eager_kv) / eager_kv,
                "%",
                goal=GOAL,
                note=f"pool bytes recorded: {configs['omnitrace']['pool_bytes']}",
            )
        )
    for modality in ("image", "audio"):
        # A/B/A: the baseline served again last; a large drift makes every change suspect.
        drift = _median_change(entry, model_kind, scale, AGAIN, modality)
        result["figures"].append(
            figure(
                f"{label}: {modality} TTFT p50 at concurrency 1, eager served again last vs "
                "eager first (the machine's drift across the run)",
                None if drift is None else 100 * drift,
                "%",
                goal=GOAL,
            )
        )
    _load_checks(result, label, configs)
    for name, why in entry["not_applicable"].items():
        result["figures"].append(
            figure(f"{label}: {name} not applicable", None, "", goal=GOAL, note=why)
        )


def _load_checks(result: dict[str, Any], label: str, configs: dict[str, Any]) -> None:
    """At the highest concurrency: requests/s and TTFT p99 against eager's; and the hit rate
    of the measured passes with the defaults."""
    if "omnitrace" not in configs or "eager" not in configs:
        return
    graphed, eager = configs["omnitrace"], configs["eager"]
    top = max(int(key[1:]) for key in eager["requests_per_s"])
    rate = graphed["requests_per_s"][f"c{top}"] / eager["requests_per_s"][f"c{top}"]
    result["targets"].append(
        target(
            f"{label}: requests/s at concurrency {top}, omnitrace over eager encoders",
            rate,
            ">=",
            1.3,
            "x",
            goal=GOAL,
        )
    )

    def p99(row: dict[str, Any]) -> float:
        return float(
            np.median([r["ttft_p99_ms"] for r in row["rows"].values() if r["concurrency"] == top])
        )

    change = (p99(graphed) - p99(eager)) / p99(eager)
    result["targets"].append(
        target(
            f"{label}: TTFT p99 at concurrency {top} (median over kinds), omnitrace vs eager",
            100 * change,
            "<",
            0.0,
            "%",
            goal=GOAL,
        )
    )
    for name, what in (("omnitrace", "omnitrace defaults"), (BUDGET, "a 2 GiB pool budget")):
        if name not in configs:
            continue
        warm = configs[name].get("after_warmup") or {}
        result["targets"].append(
            target(
                f"{label}: encoder calls served by a graph after the warm-up, {what}",
                None if warm.get("hit_rate") is None else 100 * warm["hit_rate"],
                ">=",
                95.0,
                "%",
                goal=GOAL,
                note=f"pool bytes {configs[name].get('pool_bytes')}; misses by reason: "
                + "; ".join(
                    f"{encoder} {e['misses']}"
                    for encoder, e in sorted(warm.get("encoders", {}).items())
                ),
            )
        )


def plot(result: dict[str, Any], out_dir: Path, plt: Any) -> list[Path]:
    """TTFT p50 per request kind at concurrency 1, one bar per configuration, a panel a model."""
    served = [(k, e) for k, e in result["models"].items() if e["configurations"]]
    if not served:
        return []
    widest = max(len(e["kinds"]) for _, e in served)
    fig, axes = plt.subplots(
        len(served), 1, figsize=(max(6.0, 1.1 * widest), 4.0 * len(served)), squeeze=False
    )
    for ax, (model_kind, entry) in zip(axes[:, 0], served, strict=True):
        configs = entry["configurations"]
        kinds = entry["kinds"]
        width = 0.8 / len(configs)
        for i, (name, row) in enumerate(configs.items()):
            values = [row["rows"].get(f"c1/{kind}", {}).get("ttft_p50_ms", 0.0) for kind in kinds]
            ax.bar([k + i * width for k in range(len(kinds))], values, width, label=name)
        ax.set_xticks([k + 0.4 - width / 2 for k in range(len(kinds))])
        ax.set_xticklabels(kinds, rotation=30, ha="right")
        ax.set_ylabel("TTFT p50 (ms), concurrency 1")
        ax.set_title(f"vllm serve, {MODELS[model_kind]} ({result['sizes']} sizes), dummy weights")
        ax.legend()
    fig.tight_layout()
    path = out_dir / "engine_ttft.png"
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return [path]
