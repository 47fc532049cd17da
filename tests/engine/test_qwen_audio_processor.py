"""Qwen2.5-Omni's audio processor pads every clip to 300 s, and a shorter pad length passed
through vLLM's ``--mm-processor-kwargs`` gives the same features for every shorter clip
(docs/operations.md, "Why is my TTFT high?"). These tests hold the page to the installed
transformers and vLLM.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (the engine CI tier installs it)")

from engine.support import ENGINE_TIMEOUT_S, engine_environment

pytestmark = pytest.mark.engine

RATE = 16_000
#: The setting the page gives: clips padded to 30 s instead of 300 s.
SHORTER = {"audio_kwargs": {"max_length": 30 * RATE}}
TEXT = "<|im_start|>user\n<|audio_bos|><|AUDIO|><|audio_eos|>What do you hear?<|im_end|>\n"


def clip(seconds: float, seed: int = 0) -> np.ndarray:
    samples = np.random.default_rng(seed).standard_normal(int(seconds * RATE))
    return (0.1 * samples).astype(np.float32)


def processed(
    checkpoint: Path, audio: np.ndarray, text: str = TEXT, **kwargs: Any
) -> dict[str, np.ndarray]:
    from transformers import AutoProcessor

    out = AutoProcessor.from_pretrained(checkpoint)(text=text, audio=[audio], **kwargs)
    return {key: np.asarray(out[key]) for key in ("input_features", "feature_attention_mask")} | {
        "input_ids": np.asarray(out["input_ids"])
    }


@pytest.mark.parametrize("seconds", [1.0, 10.0, 29.5])
def test_a_shorter_pad_gives_the_same_features_for_every_shorter_clip(
    checkpoint: Path, seconds: float
) -> None:
    audio = clip(seconds)
    default = processed(checkpoint, audio)
    shorter = processed(checkpoint, audio, **SHORTER)
    # By default every clip, a 1-s one too, becomes 300 s of features (30,000 frames).
    assert default["input_features"].shape[-1] == 30_000
    assert shorter["input_features"].shape[-1] == 3_000
    frames = int(default["feature_attention_mask"].sum())
    assert frames == int(shorter["feature_attention_mask"].sum()) == int(seconds * 100)
    np.testing.assert_array_equal(
        default["input_features"][..., :frames], shorter["input_features"][..., :frames]
    )
    np.testing.assert_array_equal(default["input_ids"], shorter["input_ids"])


def test_a_clip_as_long_as_the_pad_is_cut_to_it(checkpoint: Path) -> None:
    audio = clip(45.0)
    default = processed(checkpoint, audio)
    shorter = processed(checkpoint, audio, **SHORTER)
    assert int(default["feature_attention_mask"].sum()) == 4_500
    assert int(shorter["feature_attention_mask"].sum()) == 3_000
    assert shorter["input_ids"].shape[-1] < default["input_ids"].shape[-1]


_ENGINE = """
import json, sys
import numpy as np
from vllm import LLM, SamplingParams

model, kwargs, seconds = sys.argv[1], json.loads(sys.argv[2]), float(sys.argv[3])
llm = LLM(model=model, load_format="dummy", seed=0, max_model_len=2048, max_num_seqs=1,
          limit_mm_per_prompt={"image": 0, "audio": 1, "video": 0}, **kwargs)
samples = np.random.default_rng(0).standard_normal(int(seconds * 16000))
audio = ((0.1 * samples).astype(np.float32), 16000)
prompt = sys.argv[4] + "<|im_start|>assistant\\n"
out = llm.generate([{"prompt": prompt, "multi_modal_data": {"audio": audio}}],
                   SamplingParams(max_tokens=1), use_tqdm=False)[0]
print("PROMPT_TOKENS", len(out.prompt_token_ids))
"""


@pytest.mark.timeout(ENGINE_TIMEOUT_S + 60)
def test_vllm_hands_the_setting_to_the_processor(checkpoint: Path, tmp_path: Path) -> None:
    """A 45-s clip through ``vllm.LLM(mm_processor_kwargs=...)`` is cut to 30 s, as the
    processor cuts it with the setting: vLLM handed the setting on."""
    kwargs = {"mm_processor_kwargs": SHORTER}
    done = subprocess.run(
        [sys.executable, "-c", _ENGINE, str(checkpoint), json.dumps(kwargs), "45", TEXT],
        env=engine_environment(OMNITRACE_PLUGIN="0"),
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=ENGINE_TIMEOUT_S,
        check=False,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    tokens = [line for line in done.stdout.splitlines() if line.startswith("PROMPT_TOKENS")]
    assert tokens, done.stdout[-3000:]
    prompt = TEXT + "<|im_start|>assistant\n"
    with_setting = processed(checkpoint, clip(45.0), prompt, **SHORTER)["input_ids"].shape[-1]
    without = processed(checkpoint, clip(45.0), prompt)["input_ids"].shape[-1]
    assert without > with_setting
    assert int(tokens[-1].split()[1]) == with_setting
