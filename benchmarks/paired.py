"""Graphs off and on inside one offline engine: paired requests of each kind, so drift hits both.
Each request has new content (vLLM caches encoder outputs by content) and asks for one token, so
its wall time is its TTFT; on a CPU the graphed half stays eager. Usage, results: BENCHMARKS.md."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.common import quantile
from benchmarks.engine_phases import request_views, view_phases_ms
from benchmarks.table import Table, markdown, ms

SAMPLING_RATE = 16_000
_USER = "<|im_start|>user\n"
_ASSISTANT = "<|im_end|>\n<|im_start|>assistant\n"
_PLACEHOLDERS = {
    # vLLM's get_placeholder_str of each model, per modality.
    "minicpmo": {"image": "(<image>./</image>)", "audio": "(<audio>./</audio>)"},
    "qwen2_5_omni": {
        "image": "<|vision_start|><|IMAGE|><|vision_end|>",
        "audio": "<|audio_bos|><|AUDIO|><|audio_eos|>",
    },
}
#: The request kinds: (name, modality, image width and height or clip seconds).
KINDS: dict[str, tuple[str, tuple[int, int] | float]] = {
    "image 448x448": ("image", (448, 448)),
    "image 896x896": ("image", (896, 896)),
    "audio 1 s": ("audio", 1.0),
    "audio 10 s": ("audio", 10.0),
}


def random_image(seed: int, width: int, height: int) -> Any:
    """A PIL image of seeded random pixels: new content for each ``seed``."""
    from PIL import Image

    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    return Image.fromarray(pixels)


def random_clip(seed: int, seconds: float) -> np.ndarray:
    """``seconds`` of seeded noise at :data:`SAMPLING_RATE`, amplitude about 0.1 (float64)."""
    return 0.1 * np.random.default_rng(seed).standard_normal(int(seconds * SAMPLING_RATE))


def request(model: str, kind: str, seed: int) -> dict[str, Any]:
    """One prompt of ``kind`` for ``model``, with new content for each ``seed``."""
    modality, size = KINDS[kind]
    return media_request(model, modality, size, seed)


def media_request(
    model: str, modality: str, size: tuple[int, int] | float, seed: int, images: int = 1
) -> dict[str, Any]:
    """One prompt for ``model`` of an image of ``size`` (width, height) or a clip of ``size``
    seconds (``modality`` ``"image"`` or ``"audio"``), with new content for each ``seed``;
    ``images`` images of that size where it is more than 1 (seeds ``seed`` onwards)."""
    placeholder = _PLACEHOLDERS[model][modality]
    if modality == "image":
        assert isinstance(size, tuple)
        pictures = [random_image(seed + i, *size) for i in range(images)]
        data: Any = pictures if images > 1 else pictures[0]
        text = "Describe the images." if images > 1 else "Describe the image."
        placeholder *= images
    else:
        assert isinstance(size, float)
        data = random_clip(seed, size).astype(np.float32), SAMPLING_RATE
        text = "What do you hear?"
    return {
        "prompt": f"{_USER}{placeholder}\n{text}{_ASSISTANT}",
        "multi_modal_data": {modality: data},
    }


def mm_processor_kwargs() -> dict[str, Any] | None:
    """``OMNITRACE_BENCH_ENGINE_MM_PROCESSOR_KWARGS``: a JSON object every engine of the run
    gets, the offline one and each ``vllm serve`` (``--mm-processor-kwargs``); default none.

    Raises:
        ValueError: the value is not a JSON object.
    """
    name = "OMNITRACE_BENCH_ENGINE_MM_PROCESSOR_KWARGS"
    return _json_object(name, os.environ.get(name, ""), null=True)


def _json_object(name: str, raw: str, *, null: bool) -> dict[str, Any] | None:
    """``raw``, the value of ``name``, as a JSON object; None when it is empty (or JSON
    ``null`` where ``null`` allows it).

    Raises:
        ValueError: the value is not a JSON object.
    """
    raw = raw.strip()
    try:
        value = json.loads(raw) if raw else None
    except ValueError:
        value = raw
    if not (isinstance(value, dict) or (value is None and (null or not raw))):
        raise ValueError(f"{name}: expected a JSON object, got {raw!r}")
    return value


def graph_settings(name: str, raw: str) -> dict[str, Any]:
    """``raw``, the value of ``name``: a JSON object of omnitrace's ``encoder_cuda_graph_*``
    settings (empty: none).

    Raises:
        ValueError: the value is not a JSON object of ``encoder_cuda_graph_*`` keys.
    """
    value = _json_object(name, raw, null=False) or {}
    if stray := sorted(k for k in value if not k.startswith("encoder_cuda_graph_")):
        raise ValueError(f"{name}: expected encoder_cuda_graph_* keys only, got {stray[0]!r}")
    return value


def write_checkpoint(model: str, directory: Path, *, released: bool) -> Path:
    """Write ``model``'s checkpoint (``minicpmo`` or ``qwen2_5_omni``) to ``directory``, at the
    released model's sizes or the tiny defaults; return its path."""
    from omnitrace import testing_checkpoints as checkpoints

    if model == "minicpmo":
        minicpmo = checkpoints.MiniCPMOSizes.released() if released else None
        return checkpoints.write_minicpmo(directory, minicpmo)
    qwen = checkpoints.Qwen2_5OmniSizes.released() if released else None
    return checkpoints.write_qwen2_5_omni(directory, qwen)


def paired_summary(eager: Sequence[float], graphed: Sequence[float]) -> dict[str, Any]:
    """The two halves' p50/p99 and the paired differences (graphed minus eager), in ms.

    Raises:
        ValueError: the halves differ in length or are empty.
    """
    if len(eager) != len(graphed) or not eager:
        raise ValueError(f"expected pairs, got {len(eager)} eager and {len(graphed)} graphed")
    diffs = [(g - e) * 1e3 for e, g in zip(eager, graphed, strict=True)]
    rel = [100.0 * (g - e) / e for e, g in zip(eager, graphed, strict=True) if e > 0]
    return {
        "pairs": len(diffs),
        "eager_p50_ms": statistics.median(eager) * 1e3,
        "eager_p99_ms": quantile(eager, 0.99) * 1e3,
        "graphed_p50_ms": statistics.median(graphed) * 1e3,
        "graphed_p99_ms": quantile(graphed, 0.99) * 1e3,
        "diff_median_ms": statistics.median(diffs),
        "diff_q25_ms": quantile(diffs, 0.25),
        "diff_q75_ms": quantile(diffs, 0.75),
        "diff_median_pct": statistics.median(rel) if rel else float("nan"),
        "graphed_faster": sum(d < 0 for d in diffs),
    }


def offline_engine(
    model: str,
    size: str,
    logs: Path,
    *,
    max_num_seqs: int,
    hf_overrides: dict[str, Any],
    lm_graph_tokens: int = 0,
    images_per_prompt: int = 1,
) -> tuple[Any, bool, float]:
    """Start a ``vllm.LLM`` on a new checkpoint of ``model`` (``size`` ``"released"`` or
    ``"tiny"``) with dummy weights, its workers' event logs in ``logs``.

    Args:
        model: ``minicpmo`` or ``qwen2_5_omni``.
        size: the checkpoint's sizes, ``released`` or ``tiny``.
        logs: the folder of the workers' ``events-{rank}.jsonl``.
        max_num_seqs: vLLM's limit of requests a step.
        hf_overrides: omnitrace's settings (``encoder_cuda_graph_*``).
        lm_graph_tokens: on CUDA, the language model's largest CUDA graph; 0: vLLM's choice.
        images_per_prompt: the most images a prompt may carry.

    Returns:
        The engine, whether it runs on CUDA, and its start-up seconds.
    """
    os.environ["OMNITRACE_EVENTS_LOG"] = str(logs / "events-{rank}.jsonl")
    os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
    # This process reads the device before the engine starts; its children must not fork it.
    os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
    import torch

    cuda = torch.cuda.is_available()
    if not cuda:
        # vLLM's CPU engine otherwise takes most of the machine's memory for its KV cache.
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    checkpoint = Path(tempfile.mkdtemp(prefix=f"offline-{model}-")) / "model"
    write_checkpoint(model, checkpoint, released=size == "released")

    from vllm import LLM

    lm_graphs = {"max_cudagraph_capture_size": lm_graph_tokens}
    started = time.monotonic()
    llm = LLM(
        model=str(checkpoint),
        load_format="dummy",
        seed=0,
        dtype="bfloat16" if cuda else "float32",
        max_model_len=8192 if cuda else 4096,
        max_num_seqs=max_num_seqs,
        # vLLM's own limit with its default max_num_seqs on an H200 (with 4 it would be 8).
        compilation_config=lm_graphs if cuda and lm_graph_tokens else None,
        limit_mm_per_prompt={"image": images_per_prompt, "audio": 1, "video": 0},
        hf_overrides=hf_overrides,
        mm_processor_kwargs=mm_processor_kwargs(),
        **({"trust_remote_code": True} if model == "minicpmo" else {}),
    )
    return llm, cuda, time.monotonic() - started


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Start the engine, serve the warm-up and the pairs (in the engine's own process)."""
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for stale in out.glob("events-*.jsonl"):
        stale.unlink()
    # collective_rpc sends pause_graphs to the engine core by pickle: vLLM must allow it.
    os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
    from vllm import SamplingParams

    from omnitrace.integrations.vllm_plugin import pause_graphs

    llm, cuda, init_s = offline_engine(
        args.model,
        args.size,
        out,
        max_num_seqs=4,
        hf_overrides=json.loads(args.overrides),
        lm_graph_tokens=args.lm_graph_tokens,
    )
    started = time.monotonic() - init_s  # when the engine's start began
    one_token = SamplingParams(max_tokens=1, temperature=0.0)
    seed = 0

    def serve(kind: str, paused: bool) -> tuple[float, str]:
        nonlocal seed
        seed += 1
        workers = llm.collective_rpc(pause_graphs, args=(paused,))
        if not any(workers):
            raise RuntimeError("no omnitrace adapter is attached in any worker")
        t0 = time.perf_counter()
        outputs = llm.generate([request(args.model, kind, seed)], one_token, use_tqdm=False)
        return time.perf_counter() - t0, str(outputs[0].request_id)

    # Warm-up: every kind captured (min_capture_calls) and served paused once.
    for _ in range(args.warmup):
        for kind in KINDS:
            serve(kind, paused=False)
    for kind in KINDS:
        serve(kind, paused=True)
    measured: dict[str, dict[str, list[Any]]] = {
        k: {"eager": [], "graphed": [], "eager_ids": [], "graphed_ids": []} for k in KINDS
    }
    for pair in range(args.pairs):
        for kind in KINDS:
            order = (True, False) if pair % 2 == 0 else (False, True)
            for paused in order:
                wall, request_id = serve(kind, paused)
                half = "eager" if paused else "graphed"
                measured[kind][half].append(wall)
                measured[kind][f"{half}_ids"].append(request_id)
    llm.collective_rpc(pause_graphs, args=(False,))
    cost = _timing_cost(llm, args, one_token, seed)
    return {
        "measured": measured,
        "cost": cost,
        "init_s": init_s,
        "total_s": time.monotonic() - started,
        "cuda": cuda,
    }


#: Requests a batch of the timing-cost rounds: concurrency 8.
COST_BATCH = 8


def _timing_cost(llm: Any, args: argparse.Namespace, params: Any, seed: int) -> dict[str, Any]:
    """Requests/s of batches of :data:`COST_BATCH` with request timing off and on, alternating.

    Timing is switched in this process (``vllm.LLM``'s request hooks) and in every worker
    (the encoder-step hooks, through ``collective_rpc``); graphs stay on. Each round serves
    one batch each way, the order alternating, every request new content of the mix's kinds.
    """
    from omnitrace.integrations.vllm_plugin import time_requests

    kinds = list(KINDS)
    rates: dict[str, list[float]] = {"off": [], "on": []}
    for round_ in range(args.cost_rounds):
        for on in (False, True) if round_ % 2 == 0 else (True, False):
            time_requests(None, on)
            llm.collective_rpc(time_requests, args=(on,))
            prompts = []
            for i in range(COST_BATCH):
                seed += 1
                prompts.append(request(args.model, kinds[i % len(kinds)], seed))
            t0 = time.perf_counter()
            llm.generate(prompts, params, use_tqdm=False)
            rates["on" if on else "off"].append(COST_BATCH / (time.perf_counter() - t0))
    time_requests(None, True)
    llm.collective_rpc(time_requests, args=(True,))
    return rates


def cost_summary(off: Sequence[float], on: Sequence[float]) -> dict[str, Any]:
    """Requests/s with timing off and on (p50) and the paired change of each round, in %.

    Raises:
        ValueError: the halves differ in length or are empty.
    """
    if len(off) != len(on) or not off:
        raise ValueError(f"expected rounds, got {len(off)} off and {len(on)} on")
    change = [100.0 * (b / a - 1.0) for a, b in zip(off, on, strict=True)]
    # The mean change's 95 % interval (normal approximation): what says whether a cost below
    # a bar (1 %) is resolved, where the IQR only shows the rounds' spread.
    half = 1.96 * statistics.stdev(change) / len(change) ** 0.5 if len(change) > 1 else None
    return {
        "rounds": len(change),
        "batch": COST_BATCH,
        "off_rps_p50": statistics.median(off),
        "on_rps_p50": statistics.median(on),
        "change_median_pct": statistics.median(change),
        "change_q25_pct": quantile(change, 0.25),
        "change_q75_pct": quantile(change, 0.75),
        "change_mean_pct": statistics.fmean(change),
        "change_ci95_pct": half,
    }


def _report(args: argparse.Namespace, out: Path, engine: dict[str, Any]) -> dict[str, Any]:
    """The result of the engine's run (:func:`run`'s), its requests joined with their events."""
    # Read after the engine's processes exited: each flushed its event log as it did.
    logs = sorted(out.glob("events-*.jsonl"))
    joined = request_views(logs)
    # Found by either id: the one LLM.generate reports, or the engine's.
    views = {v.event.request_id: v for v in joined}
    views |= {v.event.engine_request_id: v for v in joined}
    kinds: dict[str, Any] = {}
    problems: list[str] = []
    for kind, halves in engine["measured"].items():
        row = paired_summary(halves["eager"], halves["graphed"])
        for half in ("eager", "graphed"):
            ids = halves[f"{half}_ids"]
            found = [views[i] for i in ids if i in views]
            if len(found) != len(ids):
                problems.append(f"{kind} {half}: {len(ids) - len(found)} requests without events")
            if found:
                row[f"{half}_phases_ms"] = view_phases_ms(found)
                row[f"{half}_ttft_event_p50_ms"] = statistics.median(v.ttft_s for v in found) * 1e3
                outcomes = [c.get("outcome") for v in found for s in v.steps for c in s.calls]
                row[f"{half}_encoder_calls"] = {o: outcomes.count(o) for o in set(outcomes)}
        kinds[kind] = row
    return {
        "model": args.model,
        "size": args.size,
        "cuda": engine["cuda"],
        "device": _device_name(),
        "pairs": args.pairs,
        "warmup": args.warmup,
        "overrides": json.loads(args.overrides),
        "mm_processor_kwargs": mm_processor_kwargs(),
        "runner": "V1" if os.environ.get("VLLM_USE_V2_MODEL_RUNNER") == "0" else "default",
        "init_s": round(engine["init_s"], 1),
        "total_s": round(engine["total_s"], 1),
        "logs": [p.name for p in logs],
        "request_events": len(joined),
        "kinds": kinds,
        "problems": problems,
    }


def _device_name() -> str:
    import torch

    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"


#: The columns of a kind's paired difference (:func:`_paired_cells`).
_PAIRED_HEADERS = ("paired diff median (IQR)", "median %", "graphed faster")


def _paired_cells(r: dict[str, Any]) -> list[str]:
    """A kind's paired difference, median (interquartile range) in ms, its median in %, and
    how many pairs the graphed request won."""
    diff = f"{r['diff_median_ms']:+.1f} ({r['diff_q25_ms']:+.1f} … {r['diff_q75_ms']:+.1f})"
    return [diff, f"{r['diff_median_pct']:+.1f} %", f"{r['graphed_faster']}/{r['pairs']}"]


def pairs_table(title: str, kinds: dict[str, dict[str, Any]]) -> Table:
    """The engine report's table of paired kinds (:func:`paired_summary` rows), in ms."""
    return Table(
        title,
        ["request kind", "eager p50", "graphed p50", *_PAIRED_HEADERS],
        [
            [kind, ms(r["eager_p50_ms"]), ms(r["graphed_p50_ms"]), *_paired_cells(r)]
            for kind, r in kinds.items()
        ],
    )


def cost_text(
    cost: dict[str, Any], what: str = "Request timing's cost", halves: Sequence[str] = ("off", "on")
) -> str:
    """A switch's rounds (:func:`cost_summary`, with ``batch``) as one sentence: ``what``, then
    the rates of the ``halves`` (switched off, on)."""
    text = (
        f"{what}: {cost['rounds']} rounds of a batch of {cost['batch']} "
        f"requests each way, alternating: {cost['off_rps_p50']:.2f} requests/s {halves[0]}, "
        f"{cost['on_rps_p50']:.2f} {halves[1]}; paired change {cost['change_median_pct']:+.1f} % "
        f"(IQR {cost['change_q25_pct']:+.1f} … {cost['change_q75_pct']:+.1f} %)"
    )
    if cost.get("change_ci95_pct") is not None:
        text += f", mean {cost['change_mean_pct']:+.1f} ± {cost['change_ci95_pct']:.1f} % (95 %)"
    if "off_ttft_ms" in cost:
        ttft = zip((cost["off_ttft_ms"], cost["on_ttft_ms"]), halves, strict=True)
        text += "; TTFT p50 / p99: " + ", ".join(
            f"{t['p50']:,.0f} / {t['p99']:,.0f} ms {half}" for t, half in ttft
        )
    return text


def table(result: dict[str, Any]) -> str:
    """The result as Markdown: the paired table, then the phases of each half."""
    from omnitrace.requests import PHASES

    pairs = Table(
        f"{result['model']} ({result['size']}, {result['device']}, runner {result['runner']}): "
        f"{result['pairs']} pairs a kind after {result['warmup']} warm-up rounds, "
        f"engine start {result['init_s']} s, run {result['total_s']} s",
        ["kind", "eager p50", "eager p99", "graphed p50", "graphed p99", *_PAIRED_HEADERS],
    )
    phases = Table("Phases (ms)", ["kind", "half", *PHASES, "encoder calls"])
    for kind, r in result["kinds"].items():
        times = [
            f"{r[f'{half}_{q}_ms']:.1f}" for half in ("eager", "graphed") for q in ("p50", "p99")
        ]
        pairs.rows.append([kind, *times, *_paired_cells(r)])
        for half in ("eager", "graphed"):
            if (spent := r.get(f"{half}_phases_ms")) is not None:
                calls = ", ".join(f"{k} {v}" for k, v in sorted(r[f"{half}_encoder_calls"].items()))
                phases.rows.append([kind, half, *(f"{spent[p]:.1f}" for p in PHASES), calls])
    cost = result.get("timing_cost")
    notes = [cost_text(cost)] if cost else []
    problems = [f"PROBLEM: {problem}" for problem in result["problems"]]
    return "\n\n".join([markdown(pairs), markdown(phases), *notes, *problems])


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.paired", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--model", choices=sorted(_PLACEHOLDERS), default="minicpmo")
    parser.add_argument("--size", choices=("tiny", "released"), default="tiny")
    parser.add_argument("--pairs", type=int, default=12, help="pairs a kind (default 12)")
    parser.add_argument("--warmup", type=int, default=3, help="warm-up rounds (default 3)")
    parser.add_argument("--out", required=True, help="folder for the event logs and results")
    parser.add_argument(
        "--overrides",
        default="{}",
        help="hf_overrides as JSON (omnitrace's defaults without it), e.g. "
        '\'{"encoder_cuda_graph_audio_attention": "masked"}\' for Qwen2.5-Omni\'s audio',
    )
    cost = (
        "rounds after the pairs of 8 requests with request timing off, then on (default 8; 0: none)"
    )
    parser.add_argument("--cost-rounds", type=int, default=8, help=cost)
    graphs = "on CUDA, the language model's largest CUDA graph (default 512; 0: vLLM's choice)"
    parser.add_argument("--lm-graph-tokens", type=int, default=512, help=graphs)
    parser.add_argument("--engine-only", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.cost_rounds < 0 or not 0 <= args.lm_graph_tokens <= 8192:
        parser.error("--cost-rounds must be 0 or more, --lm-graph-tokens 0 to 8192")
    if args.pairs < 1 or args.warmup < 2:
        parser.error(
            "--pairs must be at least 1 and --warmup at least 2 (graphs capture on the second call)"
        )
    try:
        overrides = json.loads(args.overrides)
    except ValueError as exc:
        parser.error(f"--overrides: not JSON ({exc})")
    if not isinstance(overrides, dict):
        parser.error("--overrides: expected a JSON object")
    out = Path(args.out)
    raw = out / f"paired-{args.model}-raw.json"
    if args.engine_only:
        raw.write_text(json.dumps(run(args)))
        return 0
    # The engine runs in a child, so that every process of it has exited (and flushed its
    # event log) before the logs are read; its failure is this run's failure.
    out.mkdir(parents=True, exist_ok=True)
    raw.unlink(missing_ok=True)
    given = sys.argv[1:] if argv is None else list(argv)
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.paired", *given, "--engine-only"], check=False
    )
    if done.returncode != 0 or not raw.exists():
        print(f"benchmarks.paired: the engine run failed (exit {done.returncode})", file=sys.stderr)
        return 1
    engine = json.loads(raw.read_text())
    result = _report(args, out, engine)
    cost = engine.get("cost") or {}
    if cost.get("off"):
        result["timing_cost"] = cost_summary(cost["off"], cost["on"])
    (Path(args.out) / f"paired-{args.model}.json").write_text(json.dumps(result, indent=1))
    text = table(result)
    (Path(args.out) / f"paired-{args.model}.md").write_text(text + "\n")
    print(text)
    return 1 if result["problems"] else 0


if __name__ == "__main__":
    sys.exit(main())
