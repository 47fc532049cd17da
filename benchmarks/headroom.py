"""Whether an offline engine still serves bursts of large images while the graphs hold their
pools: one engine per configuration (encoders eager, omnitrace's defaults), warmed up on the
paired kinds, then bursts of growing size sent in one call each. Usage, results: BENCHMARKS.md."""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

from benchmarks.common import write_json
from benchmarks.paired import KINDS, graph_settings, media_request, offline_engine, request
from benchmarks.table import Table, markdown
from omnitrace.events import GraphCaptured, GraphMissed, GraphReplayed, MemoryDeferred

#: The configurations: their ``hf_overrides``.
CONFIGS: dict[str, dict[str, Any]] = {"eager": {"encoder_cuda_graph": False}, "omnitrace": {}}
#: Exit status when every engine ran but one stopped at a burst (a measured outcome).
STOPPED = 2
_OOM_MARKERS = ("OutOfMemoryError", "out of memory")


def _positive_ints(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected integers separated by commas, got {text!r}"
        ) from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected integers of 1 or more, got {text!r}")
    return values


def _size(text: str) -> tuple[int, int]:
    width, sep, height = text.partition("x")
    if not sep or not width.isdigit() or not height.isdigit() or min(int(width), int(height)) < 28:
        raise argparse.ArgumentTypeError(f"expected WIDTHxHEIGHT of 28 px or more, got {text!r}")
    return int(width), int(height)


def _engine(args: argparse.Namespace, save: Callable[[dict[str, Any]], None]) -> dict[str, Any]:
    """Start one engine of ``args.engine``'s configuration, warm it up, send the bursts; an
    exception from a burst ends the bursts and is recorded, not raised. ``save`` gets the result
    before and after each burst: a burst that never returns is still on record, unanswered."""
    from vllm import SamplingParams

    llm, _, init_s = offline_engine(
        args.model,
        args.size,
        Path(args.out) / args.engine,
        max_num_seqs=max(args.bursts),
        hf_overrides=_hf_overrides(args.engine, args.overrides),
        images_per_prompt=args.images,
    )
    result: dict[str, Any] = {"config": args.engine, "init_s": init_s}
    result["scheduler"] = _scheduler_limits(llm)
    one_token = SamplingParams(max_tokens=1, temperature=0.0)
    seeds = iter(range(1, 1 << 30))

    def big(n: int) -> list[dict[str, Any]]:
        prompts = []
        for _ in range(n):
            seed = next(seeds)
            for _ in range(args.images - 1):
                next(seeds)  # the prompt's other images take the seeds after its first
            prompts.append(media_request(args.model, "image", args.image, seed, args.images))
        return prompts

    for _ in range(args.warmup):
        for kind in KINDS:
            llm.generate([request(args.model, kind, next(seeds))], one_token, use_tqdm=False)
        llm.generate(big(1), one_token, use_tqdm=False)
    result["bursts"] = []
    for n in args.bursts:
        for repeat in range(args.repeats):
            prompts = big(n)
            row: dict[str, Any] = {"requests": n, "repeat": repeat, "start_ns": time.monotonic_ns()}
            result["bursts"].append(row)
            save(result)
            t0 = time.perf_counter()
            try:
                llm.generate(prompts, one_token, use_tqdm=False)
            except Exception as exc:  # the engine stopped: the measured outcome
                row.update(ok=False, error=f"{type(exc).__name__}: {exc}".splitlines()[0][:400])
            else:
                row["ok"] = True
            row.update(wall_s=time.perf_counter() - t0, end_ns=time.monotonic_ns())
            save(result)
            if not row["ok"]:
                return result
    return result


def _hf_overrides(config: str, overrides: dict[str, Any]) -> dict[str, Any]:
    """``config``'s ``hf_overrides``: ``--overrides`` on top where it runs graphs."""
    own = CONFIGS[config]
    return own if own.get("encoder_cuda_graph") is False else {**own, **overrides}


def _overrides(text: str) -> dict[str, Any]:
    try:
        return graph_settings("--overrides", text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc).removeprefix("--overrides: ")) from None


def _scheduler_limits(llm: Any) -> dict[str, Any]:
    """The scheduler's token budgets, which bound how many images one encoder step takes."""
    config = getattr(getattr(llm, "llm_engine", None), "vllm_config", None)
    scheduler = getattr(config, "scheduler_config", None)
    names = ("max_num_batched_tokens", "max_num_encoder_input_tokens", "encoder_cache_size")
    return {name: getattr(scheduler, name, None) for name in names}


def burst_calls(events: Iterable[Any], start_ns: int, end_ns: int) -> dict[str, Any]:
    """What the vision encoder did between ``start_ns`` and ``end_ns``: its calls, how they
    ran (a graph, or eagerly and why), the graphs captured, the largest call's leading dimension
    (MiniCPM-o: image slices; Qwen2.5-Omni: patches) and the graphs' memory taken meanwhile.

    Args:
        events: a worker's events (:func:`omnitrace.eventlog.read_events`).
        start_ns: ``time.monotonic_ns()`` when the burst was sent.
        end_ns: the same when it returned.
    """
    outcomes: dict[str, int] = {}
    largest = 0
    taken = captured = 0
    free: int | None = None
    for event in events:
        if not start_ns <= event.monotonic_ns <= end_ns or event.adapter != "vision":
            continue
        if isinstance(event, (GraphReplayed, GraphMissed)):
            name = "graph" if isinstance(event, GraphReplayed) else f"eager {event.reason.value}"
            outcomes[name] = outcomes.get(name, 0) + 1
            first = event.signature.inputs[0] if event.signature.inputs else None
            largest = max(largest, first.shape[0] if first is not None and first.shape else 0)
        elif isinstance(event, GraphCaptured):
            # The capturing call is served by its graph: counted as "graph" by its own event.
            captured += 1
            taken += event.bytes_reserved + event.static_bytes
            free = event.free_bytes
        elif isinstance(event, MemoryDeferred):
            free = event.free_bytes
    calls = sum(outcomes.values())
    return {
        "calls": calls,
        "outcomes": outcomes,
        "largest": largest,
        "captured": captured,
        "captured_bytes": taken,
        "free_bytes": free,
    }


def _oom_line(log: Path) -> str | None:
    """The first out-of-memory line of an engine's output, if any."""
    if not log.exists():
        return None
    for line in log.read_text(errors="replace").splitlines():
        if any(marker in line for marker in _OOM_MARKERS):
            return line.strip()[:600]
    return None


def _run_config(args: argparse.Namespace, config: str, given: Sequence[str]) -> dict[str, Any]:
    """One configuration's engine in a child, its bursts joined with its worker's events.

    Raises:
        RuntimeError: the child failed without a result, or ran past ``--timeout``.
    """
    from omnitrace.eventlog import read_events

    folder = Path(args.out) / config
    folder.mkdir(parents=True, exist_ok=True)
    for stale in folder.glob("events-*.jsonl*"):
        stale.unlink()
    raw, log = folder / "raw.json", folder / "engine.log"
    raw.unlink(missing_ok=True)
    argv = [sys.executable, "-m", "benchmarks.headroom", *given, "--engine", config]
    with log.open("wb") as sink:
        # Its own process group: a timeout stops the engine's processes with it.
        child = subprocess.Popen(
            argv, stdout=sink, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            code: int | str = child.wait(timeout=args.timeout)
        except subprocess.TimeoutExpired:
            code = f"killed after {args.timeout:g} s"
        finally:
            # Also on Ctrl-C or SIGTERM here: no engine outlives the run, holding the GPU.
            if child.poll() is None:
                os.killpg(child.pid, signal.SIGKILL)
                child.wait()
    if not raw.exists():
        # The first line names the cause where the output holds one: the report keeps it.
        oom = _oom_line(log)
        tail = log.read_text(errors="replace")[-2000:]
        cause = f": {oom}" if oom else ":"
        raise RuntimeError(f"{config}: the engine failed ({code}) before a burst{cause}\n{tail}")
    result: dict[str, Any] = json.loads(raw.read_text())
    # Written before the engine shut down: a shutdown that failed or hung is reported.
    result["exit"] = code
    # An offline engine's logs are its workers': no API server writes one.
    workers = sorted(folder.glob("events-*.jsonl"))
    events = [event for path in workers for event in read_events(path)]
    last_ns = max((event.monotonic_ns for event in events), default=0)
    for row in result["bursts"]:
        if "ok" not in row:  # sent, and the engine ended before it returned
            error = f"no answer: the engine ended ({code})"
            row.update(ok=False, error=error, wall_s=None, end_ns=max(last_ns, row["start_ns"]))
        row["vision"] = burst_calls(events, row["start_ns"], row["end_ns"])
    result["pool_bytes"] = sum(
        e.bytes_reserved + e.static_bytes for e in events if isinstance(e, GraphCaptured)
    )
    result["oom"] = _oom_line(log)
    result["logs"] = [p.name for p in workers]
    return result


def largest_served(result: dict[str, Any]) -> int:
    """The largest burst every repeat of which the engine served (0: none)."""
    served: dict[int, bool] = {}
    for row in result["bursts"]:
        served[row["requests"]] = served.get(row["requests"], True) and row["ok"]
    return max((n for n, ok in served.items() if ok), default=0)


def _cell(text: str) -> str:
    return text.replace("|", "/")


def table(result: dict[str, Any]) -> str:
    """The report: each burst of each configuration, then the largest burst each served."""
    rows = []
    for config, engine in result["configs"].items():
        for row in engine["bursts"]:
            vision = row.get("vision", {})
            how = ", ".join(f"{k} {v}" for k, v in sorted(vision.get("outcomes", {}).items()))
            if vision.get("captured"):
                how += f" ({vision['captured']} captured)"
            served = "yes" if row["ok"] else "no: " + _cell(row.get("error", ""))[:120]
            cells = [config, str(row["requests"]), str(row["repeat"] + 1), served]
            wall = "-" if row["wall_s"] is None else f"{row['wall_s']:.2f}"
            rows.append([*cells, wall, str(vision.get("largest", 0)), how or "-"])
    headers = ["config", "burst", "repeat", "served", "wall s", "largest call", "vision calls"]
    width, height = result["image"]
    each = result.get("images", 1)
    title = f"Bursts of {width}x{height} images" + (f", {each} a request" if each > 1 else "")
    title += f", {result['model']} ({result['device']})"
    if result.get("overrides"):
        title += f", omnitrace's graphs with {json.dumps(result['overrides'])}"
    lines = [markdown(Table(title, headers, rows)), ""]
    for config, engine in result["configs"].items():
        line = f"- {config}: the largest burst served {largest_served(engine)}, the graphs' "
        line += f"memory {engine['pool_bytes'] / 2**30:.2f} GiB"
        if engine.get("exit", 0) != 0:
            line += f", engine exit: {engine['exit']}"
        lines.append(line + (f"; {_cell(engine['oom'])}" if engine["oom"] else ""))
    if failed := result.get("failed"):
        lines.append(f"- {failed['config']}: no result, {_cell(failed['error'].splitlines()[0])}")
    return "\n".join(lines)


def _device_name() -> str:
    """The GPU's name, read in a child: a CUDA context here would hold device memory beside
    the engines this process starts."""
    from benchmarks.common import cuda_status

    usable, name = cuda_status()
    return name if usable else "cpu"


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.headroom", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--model", choices=("minicpmo", "qwen2_5_omni"), default="minicpmo")
    parser.add_argument("--size", choices=("tiny", "released"), default="tiny")
    parser.add_argument("--out", required=True, help="folder for the event logs and results")
    configs = ",".join(CONFIGS)
    parser.add_argument(
        "--configs", default=configs, help=f"configurations, in order (default {configs})"
    )
    parser.add_argument(
        "--bursts",
        type=_positive_ints,
        default=(1, 2, 4, 8, 16, 32),
        help="requests a burst, in order (default 1,2,4,8,16,32)",
    )
    parser.add_argument("--repeats", type=int, default=3, help="sends of each burst (default 3)")
    parser.add_argument("--warmup", type=int, default=3, help="warm-up rounds (default 3)")
    parser.add_argument(
        "--image", type=_size, default=(1344, 1344), help="image size (default 1344x1344)"
    )
    parser.add_argument(
        "--images",
        type=int,
        default=1,
        help="images a request (default 1): several make one request's images one vision call",
    )
    parser.add_argument(
        "--timeout", type=float, default=900.0, help="seconds an engine may run (default 900)"
    )
    parser.add_argument(
        "--overrides",
        type=_overrides,
        default={},
        help="omnitrace's settings for the graphed engine, as JSON of encoder_cuda_graph_* keys "
        '(the eager engine keeps its own), e.g. \'{"encoder_cuda_graph_pool_budget_bytes": '
        "4294967296}'",
    )
    parser.add_argument("--engine", choices=sorted(CONFIGS), help=argparse.SUPPRESS)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the configurations; exit 0 when every engine served every burst, 2 when one stopped
    at a burst (reported), 1 when an engine failed otherwise, 143 on SIGTERM, 130 on Ctrl-C."""
    parser = _parser()
    args = parser.parse_args(argv)
    configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    unknown = sorted(set(configs) - set(CONFIGS))
    if unknown or not configs:
        parser.error(f"--configs: expected names from {', '.join(CONFIGS)}, got {args.configs!r}")
    if args.repeats < 1 or args.warmup < 2 or args.timeout <= 0 or not 1 <= args.images <= 64:
        parser.error(
            "--repeats must be 1 or more, --warmup 2 or more, --timeout positive, "
            "--images from 1 to 64"
        )
    out = Path(args.out)
    if args.engine:
        _engine(args, lambda result: write_json(out / args.engine / "raw.json", result))
        return 0
    out.mkdir(parents=True, exist_ok=True)
    given = sys.argv[1:] if argv is None else list(argv)
    result: dict[str, Any] = {
        "model": args.model,
        "size": args.size,
        "image": list(args.image),
        "images": args.images,
        "device": _device_name(),
        "bursts": list(args.bursts),
        "repeats": args.repeats,
        "overrides": args.overrides,
        "configs": {},
    }
    status = _run_configs(args, configs, given, result)
    # Saved after each engine: only a failure adds to it since.
    print(_save(out, result) if status else table(result))
    if status:
        print(f"benchmarks.headroom: {result['failed']['error']}", file=sys.stderr)
        return status
    stopped = any(not row["ok"] for e in result["configs"].values() for row in e["bursts"])
    return STOPPED if stopped else 0


class _Terminated(Exception):
    """SIGTERM arrived: the run ends as on Ctrl-C, its engine stopped, its results kept."""


def _terminate(signum: int, frame: object) -> None:
    raise _Terminated


def _run_configs(
    args: argparse.Namespace, configs: Sequence[str], given: Sequence[str], result: dict[str, Any]
) -> int:
    """Each configuration in turn into ``result``, which is saved after each: its exit status,
    0 when every engine gave a result; else ``result["failed"]`` says which did not and why."""
    out = Path(args.out)
    previous = signal.signal(signal.SIGTERM, _terminate)
    config = configs[0]
    try:
        for config in configs:
            print(f"headroom: {config} ...", flush=True)
            result["configs"][config] = _run_config(args, config, given)
            _save(out, result)
    except RuntimeError as exc:
        result["failed"] = {"config": config, "error": str(exc)}
        return 1
    except (KeyboardInterrupt, _Terminated) as exc:
        name = "Ctrl-C" if isinstance(exc, KeyboardInterrupt) else "SIGTERM"
        result["failed"] = {"config": config, "error": f"{config}: stopped by {name}"}
        return 130 if isinstance(exc, KeyboardInterrupt) else 143
    finally:
        signal.signal(signal.SIGTERM, previous)
    return 0


def _save(out: Path, result: dict[str, Any]) -> str:
    """Write the result and its report; the report's text."""
    write_json(out / f"headroom-{result['model']}.json", result)
    text = table(result)
    (out / f"headroom-{result['model']}.md").write_text(text + "\n")
    return text


if __name__ == "__main__":
    sys.exit(main())
