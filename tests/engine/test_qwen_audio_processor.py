"""Qwen2.5-Omni's audio processor pads every clip to 300 s; a shorter pad length passed
through vLLM's ``--mm-processor-kwargs`` gives the same features for every shorter clip.
Holds docs/operations.md ("Why is my TTFT high?") to the installed transformers and vLLM.
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

from engine.engine_run import SAMPLING_RATE, clip
from engine.support import ENGINE_TIMEOUT_S, engine_environment

pytestmark = pytest.mark.engine

#: The setting the page gives: clips padded to 30 s instead of 300 s.
SHORTER = {"audio_kwargs": {"max_length": 30 * SAMPLING_RATE}}
TEXT = "<|im_start|>user\n<|audio_bos|><|AUDIO|><|audio_eos|>What do you hear?<|im_end|>\n"


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
    audio = clip(0, seconds)[0]
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
    audio = clip(0, 45.0)[0]
    default = processed(checkpoint, audio)
    shorter = processed(checkpoint, audio, **SHORTER)
    assert int(default["feature_attention_mask"].sum()) == 4_500
    assert int(shorter["feature_attention_mask"].sum()) == 3_000
    assert shorter["input_ids"].shape[-1] < default["input_ids"].shape[-1]


_ENGINE = """
import json, sys
import numpy as np
import transformers

calls = []
extract = transformers.WhisperFeatureExtractor.__call__


def spy(self, *args, **kwargs):
    out = extract(self, *args, **kwargs)
    frames = out["input_features"].shape[-1]
    calls.append({"frames": frames, "truncation": kwargs.get("truncation")})
    return out


transformers.WhisperFeatureExtractor.__call__ = spy
from vllm import LLM, SamplingParams

model, kwargs, text = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3]
llm = LLM(model=model, load_format="dummy", seed=0, max_model_len=2048, max_num_seqs=1,
          limit_mm_per_prompt={"image": 0, "audio": 1, "video": 0}, **kwargs)
tokens = {}
for seconds in (1, 45):
    calls.clear()
    samples = np.random.default_rng(0).standard_normal(seconds * 16000)
    audio = ((0.1 * samples).astype(np.float32), 16000)
    prompt = {"prompt": text + "<|im_start|>assistant\\n", "multi_modal_data": {"audio": audio}}
    out = llm.generate([prompt], SamplingParams(max_tokens=1), use_tqdm=False)[0]
    tokens[seconds] = {"prompt_tokens": len(out.prompt_token_ids), "extractor": calls[-1]}
print("RESULT", json.dumps(tokens))
"""


@pytest.mark.timeout(ENGINE_TIMEOUT_S + 60)
def test_vllm_hands_the_setting_to_the_processor(checkpoint: Path, tmp_path: Path) -> None:
    """Through ``vllm.LLM(mm_processor_kwargs=...)`` a 1-s clip is padded to 30 s, not 300 s;
    a 45-s clip is cut to 30 s where vLLM lets the processor truncate (0.26), and keeps its
    length where vLLM passes ``truncation=False`` (0.32), as the processor does alone."""
    done = subprocess.run(
        [
            sys.executable,
            "-c",
            _ENGINE,
            str(checkpoint),
            json.dumps({"mm_processor_kwargs": SHORTER}),
            TEXT,
        ],
        env=engine_environment(OMNITRACE_PLUGIN="0"),
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=ENGINE_TIMEOUT_S,
        check=False,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    assert lines, done.stdout[-3000:]
    got = json.loads(lines[-1].removeprefix("RESULT "))
    assert got["1"]["extractor"]["frames"] == 3_000
    truncation = got["45"]["extractor"]["truncation"]
    extra = {} if truncation is None else {"truncation": truncation}
    prompt = TEXT + "<|im_start|>assistant\n"
    audio = {"audio_kwargs": {**SHORTER["audio_kwargs"], **extra}}
    expected = processed(checkpoint, clip(0, 45.0)[0], prompt, **audio)
    assert got["45"]["prompt_tokens"] == expected["input_ids"].shape[-1]
    assert got["45"]["extractor"]["frames"] == (4_500 if truncation is False else 3_000)
