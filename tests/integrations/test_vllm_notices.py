"""The plugin's start-up notice about Qwen2.5-Omni's audio processor padding, on CPU stand-ins."""

from __future__ import annotations

import json
import types
from pathlib import Path
from typing import Any

import pytest

from omnitrace.integrations.vllm_notices import (
    QWEN_AUDIO_PAD_SAMPLES,
    audio_processor_notice,
    processor_pad_samples,
)

RELEASED = {"n_samples": 4_800_000, "chunk_length": 300, "sampling_rate": 16_000}


def _model_dir(tmp_path: Path, preprocessor: Any) -> Path:
    """A model directory whose ``preprocessor_config.json`` holds ``preprocessor``."""
    directory = tmp_path / "model"
    directory.mkdir(exist_ok=True)
    text = preprocessor if isinstance(preprocessor, str) else json.dumps(preprocessor)
    (directory / "preprocessor_config.json").write_text(text)
    return directory


def _config(model: Any, options: Any = None) -> Any:
    """The parts of a VllmConfig the notice reads (graphs off, so no other notice speaks)."""
    return types.SimpleNamespace(
        model_config=types.SimpleNamespace(
            model=str(model), mm_processor_kwargs=options, enforce_eager=True
        )
    )


@pytest.mark.parametrize(
    ("preprocessor", "expected"),
    [
        (RELEASED, (4_800_000, 16_000)),
        ({"chunk_length": 30, "sampling_rate": 16_000}, (480_000, 16_000)),
        ({"chunk_length": 30}, (480_000, 16_000)),
        ({"n_samples": 0}, None),
        ({"n_samples": "4800000"}, None),
        ({"sampling_rate": 16_000}, None),
        ([1, 2], None),
        ("{not json", None),
    ],
)
def test_the_pad_length_is_read_from_the_preprocessor_config(
    tmp_path: Path, preprocessor: Any, expected: Any
) -> None:
    """n_samples, else chunk_length times sampling_rate; anything else reads as unknown."""
    assert processor_pad_samples(str(_model_dir(tmp_path, preprocessor))) == expected


def test_transformers_5s_processor_file_is_read_too(tmp_path: Path) -> None:
    """transformers 5 saves the feature extractor as a section of processor_config.json."""
    (tmp_path / "processor_config.json").write_text(json.dumps({"feature_extractor": RELEASED}))
    assert processor_pad_samples(str(tmp_path)) == (4_800_000, 16_000)
    (tmp_path / "processor_config.json").write_text(json.dumps({"image_processor": {}}))
    assert processor_pad_samples(str(tmp_path)) is None


def test_a_model_whose_processor_config_is_not_here_reads_as_unknown(tmp_path: Path) -> None:
    """No file in the directory, or a repository id not in the local cache: nothing is
    downloaded, and nothing is known."""
    assert processor_pad_samples(str(tmp_path)) is None
    assert processor_pad_samples("omnitrace-tests/no-such-model") is None


def test_the_notice_names_the_pad_and_the_setting_that_shortens_it(tmp_path: Path) -> None:
    """A 300-s pad: the notice says so in samples and seconds, and gives the option's JSON."""
    notice = audio_processor_notice(_config(_model_dir(tmp_path, RELEASED)), "qwen2_5_omni")
    assert notice is not None
    assert "pads every audio clip to 4800000 samples (300 s at 16000 Hz)" in notice
    option = notice.split("--mm-processor-kwargs ")[1].split("'")[1]
    assert json.loads(option) == {"audio_kwargs": {"max_length": QWEN_AUDIO_PAD_SAMPLES}}
    assert "cuts a longer clip to max_length" in notice


@pytest.mark.parametrize(
    ("preprocessor", "options", "kind"),
    [
        (RELEASED, {"audio_kwargs": {"max_length": 480_000}}, "qwen2_5_omni"),
        (RELEASED, {"audio_kwargs": {"max_length": 9_600_000}}, "qwen2_5_omni"),
        ({"n_samples": 480_000}, None, "qwen2_5_omni"),
        (RELEASED, None, "minicpmo"),
        ("{not json", None, "qwen2_5_omni"),
    ],
)
def test_no_notice_where_the_setting_is_given_or_nothing_to_shorten(
    tmp_path: Path, preprocessor: Any, options: Any, kind: str
) -> None:
    """The operator's own max_length (any), a pad of 30 s or less, another model (MiniCPM-o's
    processor has no such option in vLLM 0.26), or an unreadable config: nothing said."""
    config = _config(_model_dir(tmp_path, preprocessor), options)
    assert audio_processor_notice(config, kind) is None


def test_no_notice_without_a_model_path() -> None:
    assert audio_processor_notice(None, "qwen2_5_omni") is None
    assert audio_processor_notice(types.SimpleNamespace(model_config=None), "qwen2_5_omni") is None
