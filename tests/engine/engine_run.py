"""Run a real ``vllm.LLM`` engine on a tiny checkpoint and write what it did as JSON.

One engine per process: vLLM loads its plugins, reads its environment and sets global state
once per process, so each configuration the engine tests compare (omnitrace on, off, a bad
override) is its own run of this script. The tests start it with the environment of the
configuration (``OMNITRACE_PLUGIN``, ``OMNITRACE_EVENTS_LOG``, ``OMNITRACE_OTLP``, vLLM's
variables) and read the JSON it writes.

The engine runs in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), so
``llm.collective_rpc`` reaches the worker: forward hooks digest every tower output (so runs
compare bit for bit) and the adapters' statistics are read there. The prompts are fixed and
seeded: one image, one audio clip at 16 kHz, two images and two clips, each ``--repeat``
times with new content of the same sizes, then one chat request with an image and a clip;
greedy decoding, so two runs on the same dummy weights must produce the same tokens.

``--model-kind minicpmo`` serves a MiniCPM-o 4.5 directory instead (remote code, so
``trust_remote_code=True``) with its own prompts: images of one, three, four and five slices
in square, wide and tall shapes, clips of 1 s to 30 s, and two of each in one prompt. Its
digests are of what ``get_vision_hidden_states`` and ``get_audio_hidden_states`` return
(each adapter replays its whole path, from the pixels to the resampler and from the mel to
the pooling, as one graph, so no hook inside it would see a replayed call): one digest per
call of each adapter.

``--tensor-parallel-size 2`` runs one worker process per rank (vLLM's multiprocess
executor, also on a CPU); the report's top-level fields are rank 0's, and ``workers`` holds
every rank's. ``--mm-encoder-tp-mode`` passes vLLM's ``mm_encoder_tp_mode``.

Usage: ``python engine_run.py --model DIR --out result.json [--overrides JSON]
[--model-kind {qwen2_5_omni,minicpmo}] [--tensor-parallel-size N]
[--mm-encoder-tp-mode {weights,data}]``
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")

import numpy as np

from omnitrace.testing_checkpoints.serving import data_url, png, wav

#: Towers whose outputs the hooks digest, by the thinker's attribute names.
TOWERS = ("visual", "audio_tower")
#: MiniCPM-o: the batch vision and audio methods, wrapped.
MINICPMO_VISION = "get_vision_hidden_states"
MINICPMO_AUDIO_METHOD = "get_audio_hidden_states"
#: Where each MiniCPM-o adapter lives: (attribute of the model, or "" for the model itself,
#: attribute holding the adapter).
MINICPMO_ADAPTERS = (("vpm", "_encoder_graph"), ("", "_audio_encoder_graph"))
SAMPLING_RATE = 16_000
_USER = "<|im_start|>user\n"
_ASSISTANT = "<|im_end|>\n<|im_start|>assistant\n"
_IMAGE = "<|vision_start|><|IMAGE|><|vision_end|>"
_AUDIO = "<|audio_bos|><|AUDIO|><|audio_eos|>"
# vLLM's MiniCPMO.get_placeholder_str for each modality.
_MO_IMAGE = "(<image>./</image>)"
_MO_AUDIO = "(<audio>./</audio>)"


def image(seed: int, width: int, height: int) -> Any:
    """A seeded random RGB image."""
    from PIL import Image

    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    return Image.fromarray(pixels)


def clip(seed: int, seconds: float) -> tuple[np.ndarray, int]:
    """A seeded noise clip at 16 kHz, as vLLM takes audio: ``(samples, rate)``."""
    samples = np.random.default_rng(seed).standard_normal(int(seconds * SAMPLING_RATE))
    return (0.1 * samples).astype(np.float32), SAMPLING_RATE


def prompts(round_: int = 0) -> list[dict[str, Any]]:
    """One image; one clip; two images and two clips (the order the tests name them).

    Each round has the same sizes (so the same encoder input shapes) and new pixels and
    samples: vLLM caches encoder outputs by content, and a repeated item would never reach
    an encoder again.
    """
    s = 10 * round_
    return [
        {
            "prompt": f"{_USER}{_IMAGE}Describe the image.{_ASSISTANT}",
            "multi_modal_data": {"image": image(s + 1, 280, 224)},
        },
        {
            "prompt": f"{_USER}{_AUDIO}What do you hear?{_ASSISTANT}",
            "multi_modal_data": {"audio": clip(s + 2, 1.0)},
        },
        {
            "prompt": f"{_USER}{_IMAGE}{_IMAGE}{_AUDIO}{_AUDIO}Compare them.{_ASSISTANT}",
            "multi_modal_data": {
                "image": [image(s + 3, 224, 224), image(s + 4, 336, 196)],
                "audio": [clip(s + 5, 0.5), clip(s + 6, 2.5)],
            },
        },
    ]


def minicpmo_prompts(round_: int = 0) -> list[dict[str, Any]]:
    """MiniCPM-o prompts: slice counts 1, 3, 4 and 5, clips of 1 s and 30 s, then a mix.

    The 224x224 image is one thumbnail (upscaled), 896x448 a 2x1 grid (three slices),
    448x1344 a 1x3 grid (four), 1000x700 a 2x2 grid (five); the clips cover one audio chunk,
    the 30 s window and lengths between. Same sizes every round, new content (vLLM caches
    encoder outputs by content).
    """
    s = 20 * round_
    mix = f"{_MO_IMAGE}{_MO_IMAGE}{_MO_AUDIO}{_MO_AUDIO}\nCompare them."
    return [
        {
            "prompt": f"{_USER}{_MO_IMAGE}\nDescribe the image.{_ASSISTANT}",
            "multi_modal_data": {"image": image(s + 1, 224, 224)},
        },
        {
            "prompt": f"{_USER}{_MO_IMAGE}\nDescribe the image.{_ASSISTANT}",
            "multi_modal_data": {"image": image(s + 2, 896, 448)},
        },
        {
            "prompt": f"{_USER}{_MO_IMAGE}\nDescribe the image.{_ASSISTANT}",
            "multi_modal_data": {"image": image(s + 3, 448, 1344)},
        },
        {
            "prompt": f"{_USER}{_MO_AUDIO}\nWhat do you hear?{_ASSISTANT}",
            "multi_modal_data": {"audio": clip(s + 4, 1.0)},
        },
        {
            "prompt": f"{_USER}{_MO_AUDIO}\nWhat do you hear?{_ASSISTANT}",
            "multi_modal_data": {"audio": clip(s + 5, 30.0)},
        },
        {
            "prompt": f"{_USER}{mix}{_ASSISTANT}",
            "multi_modal_data": {
                "image": [image(s + 6, 1000, 700), image(s + 7, 300, 500)],
                "audio": [clip(s + 8, 2.5), clip(s + 9, 7.0)],
            },
        },
    ]


def chat_messages(seed_offset: int = 0) -> list[dict[str, Any]]:
    """One user message with an image, an audio clip and text, as an OpenAI client sends it."""
    s = seed_offset
    return [
        {
            "role": "user",
            "content": [
                {
                    "type": "image_url",
                    "image_url": {"url": data_url("image/png", png(image(s + 7, 252, 252)))},
                },
                {
                    "type": "audio_url",
                    "audio_url": {"url": data_url("audio/wav", wav(*clip(s + 8, 1.5)))},
                },
                {"type": "text", "text": "Describe both."},
            ],
        }
    ]


def digest(output: Any) -> str:
    """A short SHA-256 of a tower's output tensor: bit-for-bit comparisons between runs."""
    import hashlib

    import torch

    tensor = getattr(output, "last_hidden_state", output)
    if isinstance(tensor, (list, tuple)):
        tensor = torch.cat([t.reshape(-1) for t in tensor])
    data = tensor.detach().to("cpu", torch.float32).contiguous().numpy().tobytes()
    return hashlib.sha256(data).hexdigest()[:16]


def _model(worker: Any) -> Any:
    """The worker's model itself, out of any CUDA graph wrapper of vLLM's.

    On CUDA, V1's runner keeps the model in a wrapper that hands attribute reads on to it: a
    method set on the wrapper would never be called by the model.
    """
    runner = worker.model_runner
    get_model = getattr(runner, "get_model", None)
    return get_model() if callable(get_model) else runner.model


def _watch_towers(worker: Any) -> dict[str, Any]:
    """Record a digest of every tower output in the worker, in call order."""
    model = _model(worker)
    outputs: dict[str, list[str]] = {}
    for name in TOWERS:
        tower = getattr(model, name, None)
        if tower is None:
            continue
        outputs[name] = []

        def hook(module: Any, args: Any, output: Any, name: str = name) -> None:
            outputs[name].append(digest(output))

        tower.register_forward_hook(hook)
    model._engine_test_outputs = outputs
    return {"towers": sorted(outputs)}


def _watch_minicpmo(worker: Any) -> dict[str, Any]:
    """Digest every batch vision and audio result, in call order."""
    model = _model(worker)
    outputs: dict[str, list[str]] = {MINICPMO_VISION: [], MINICPMO_AUDIO_METHOD: []}
    for name in outputs:
        # Wraps whatever the instance resolves now: omnitrace's routed method when the plugin
        # attached, vLLM's own otherwise; either way the result the language model receives.
        inner = getattr(model, name)

        def method(data: Any, inner: Any = inner, name: str = name) -> Any:
            result = inner(data)
            outputs[name].append(digest(result))
            return result

        object.__setattr__(model, name, method)
    model._engine_test_outputs = outputs
    return {"towers": sorted(outputs)}


def _adapters(model: Any) -> dict[str, Any]:
    """Every adapter on the model, by name: the towers' ``_encoder_graph`` and MiniCPM-o's."""
    holders = [(getattr(model, name, None), "_encoder_graph") for name in TOWERS]
    holders += [
        (getattr(model, owner, None) if owner else model, attribute)
        for owner, attribute in MINICPMO_ADAPTERS
    ]
    adapters = {}
    for holder, attribute in holders:
        graph = getattr(holder, attribute, None)
        if graph is not None:
            adapters[graph.name] = {
                "stats": graph.get_cumulative_stats(),
                "backend": type(graph.backend).__name__,
                "captured": list(graph.captured_keys()),
            }
    return adapters


def _report(worker: Any) -> dict[str, Any]:
    """What the worker's towers and adapters did (run in the worker)."""
    model = _model(worker)
    runner = type(worker.model_runner)
    return {
        "outputs": dict(getattr(model, "_engine_test_outputs", {})),
        "adapters": _adapters(model),
        "runner": f"{runner.__module__}.{runner.__qualname__}",
        "pid": os.getpid(),
        "rank": getattr(worker, "rank", None),
        # The mode the engine runs its encoders in (vLLM falls back to "weights" for a
        # model that cannot run them data-parallel).
        "mm_encoder_tp_mode": getattr(
            worker.vllm_config.model_config.multimodal_config, "mm_encoder_tp_mode", None
        ),
    }


def _chosen_logprobs(completion: Any) -> list[float]:
    """The log-probability of each generated token."""
    return [
        step[token].logprob
        for token, step in zip(completion.token_ids, completion.logprobs or [], strict=True)
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--overrides", default="{}", help="hf_overrides as JSON")
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--enforce-eager", action="store_true")
    parser.add_argument(
        "--model-kind", choices=("qwen2_5_omni", "minicpmo"), default="qwen2_5_omni"
    )
    parser.add_argument("--tensor-parallel-size", type=int, default=1)
    parser.add_argument(
        "--mm-encoder-tp-mode",
        choices=("weights", "data"),
        default=None,
        help="vLLM's mm_encoder_tp_mode (default: vLLM's, weights)",
    )
    args = parser.parse_args(argv)
    minicpmo = args.model_kind == "minicpmo"

    started = time.monotonic()
    from vllm import LLM, SamplingParams

    llm = LLM(
        model=args.model,
        load_format="dummy",
        seed=0,
        dtype=args.dtype,
        # MiniCPM-o's profiling prompt holds two 10-slice images and two 30 s clips.
        max_model_len=4096 if minicpmo else 2048,
        max_num_seqs=4,
        limit_mm_per_prompt={"image": 2, "audio": 2, "video": 0},
        hf_overrides=json.loads(args.overrides),
        enforce_eager=args.enforce_eager,
        tensor_parallel_size=args.tensor_parallel_size,
        **({"mm_encoder_tp_mode": args.mm_encoder_tp_mode} if args.mm_encoder_tp_mode else {}),
        # MiniCPM-o's config class, image processor and tokenizer are the directory's code.
        **({"trust_remote_code": True} if minicpmo else {}),
    )
    init_s = time.monotonic() - started
    llm.collective_rpc(_watch_minicpmo if minicpmo else _watch_towers)
    # Random weights make the tokens meaningless and often the same for every prompt; the
    # chosen tokens' log-probabilities still depend on every embedding of the prompt, so
    # the comparisons read both.
    greedy = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, logprobs=0)
    tokens, logprobs = [], []
    for round_ in range(args.repeat):
        batch = minicpmo_prompts(round_) if minicpmo else prompts(round_)
        outputs = llm.generate(batch, greedy, use_tqdm=False)
        tokens.append([list(output.outputs[0].token_ids) for output in outputs])
        logprobs.append([_chosen_logprobs(output.outputs[0]) for output in outputs])
    chat = llm.chat(chat_messages(), greedy, use_tqdm=False)
    workers = llm.collective_rpc(_report)
    worker = workers[0]
    result = {
        "tokens": tokens,
        "logprobs": logprobs,
        "chat_tokens": list(chat[0].outputs[0].token_ids),
        "chat_logprobs": _chosen_logprobs(chat[0].outputs[0]),
        "init_s": round(init_s, 2),
        "total_s": round(time.monotonic() - started, 2),
        **worker,
        # Every rank's report, rank 0's first (the fields above are rank 0's).
        "workers": workers,
    }
    with open(args.out, "w", encoding="utf-8") as out:
        json.dump(result, out, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
