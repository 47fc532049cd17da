"""The checkpoint builder: complete, deterministic directories with consistent token ids."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("transformers", reason="the engine CI tier installs transformers")

from omnitrace.testing_checkpoints import (
    QWEN2_5_OMNI_SPECIAL_TOKENS,
    CheckpointError,
    Qwen2_5OmniSizes,
    main,
    write_qwen2_5_omni,
)


def _files(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir())}


def test_writing_twice_gives_the_same_bytes(tmp_path: Path) -> None:
    """Two directories written with the same sizes are byte for byte the same."""
    first = _files(write_qwen2_5_omni(tmp_path / "a"))
    assert _files(write_qwen2_5_omni(tmp_path / "b")) == first
    assert {"config.json", "tokenizer.json", "processor_config.json"} <= set(first)


def test_token_ids_in_the_config_are_the_tokenizers(tmp_path: Path) -> None:
    """Every multimodal id in the thinker config names that token in the tokenizer."""
    from transformers import AutoProcessor, AutoTokenizer

    directory = write_qwen2_5_omni(tmp_path / "qwen")
    tokenizer = AutoTokenizer.from_pretrained(directory)
    thinker = json.loads((directory / "config.json").read_text())["thinker_config"]
    for field, token in (
        ("audio_token_index", "<|AUDIO|>"),
        ("image_token_index", "<|IMAGE|>"),
        ("video_token_index", "<|VIDEO|>"),
        ("audio_start_token_id", "<|audio_bos|>"),
        ("audio_end_token_id", "<|audio_eos|>"),
    ):
        assert thinker[field] == tokenizer.convert_tokens_to_ids(token), field
    assert all(tokenizer.convert_tokens_to_ids(t) is not None for t in QWEN2_5_OMNI_SPECIAL_TOKENS)
    vocab = thinker["text_config"]["vocab_size"]
    assert vocab % 64 == 0
    assert vocab - 64 < len(tokenizer) <= vocab
    processor = AutoProcessor.from_pretrained(directory)
    assert processor.audio_token == "<|AUDIO|>"
    assert processor.feature_extractor.sampling_rate == 16_000


def test_sizes_vllm_would_refuse_are_errors(tmp_path: Path) -> None:
    """A head dim other than 64 is refused before anything is written."""
    with pytest.raises(CheckpointError, match="head dim of 64, 80 or 128"):
        write_qwen2_5_omni(tmp_path / "bad", Qwen2_5OmniSizes(text_hidden=96))
    assert not (tmp_path / "bad").exists()


def test_a_directory_with_files_is_never_overwritten(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The command line refuses a non-empty target in one line, and the file survives."""
    target = tmp_path / "taken"
    target.mkdir()
    (target / "keep.txt").write_text("mine")
    assert main(["qwen2_5_omni", str(target)]) == 2
    assert capsys.readouterr().err == f"error: {target}: exists and is not an empty directory\n"
    assert [p.name for p in target.iterdir()] == ["keep.txt"]
