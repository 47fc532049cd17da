"""The checkpoint builder: complete, deterministic directories with consistent token ids."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("transformers", reason="the engine CI tier installs transformers")

from omnitrace.testing_checkpoints import (
    MINICPMO_REMOTE_FILES,
    MINICPMO_SPECIAL_TOKENS,
    QWEN2_5_OMNI_SPECIAL_TOKENS,
    CheckpointError,
    MiniCPMOSizes,
    Qwen2_5OmniSizes,
    main,
    minicpmo_remote,
    write_minicpmo,
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


@pytest.mark.parametrize(("released", "grid"), [(False, [1, 26, 36]), (True, [1, 72, 96])])
def test_released_sizes_keep_the_released_image_bounds(
    tmp_path: Path, released: bool, grid: list[int]
) -> None:
    """A 1344x1008 image: 6,912 patches (1,728 tokens) with the released model's bounds,
    scaled down to at most 448x448's pixels (234 tokens) with the tiny default's."""
    import numpy as np
    from transformers import AutoProcessor

    bounds = Qwen2_5OmniSizes.released() if released else Qwen2_5OmniSizes()
    sizes = Qwen2_5OmniSizes(
        image_min_pixels=bounds.image_min_pixels, image_max_pixels=bounds.image_max_pixels
    )
    processor = AutoProcessor.from_pretrained(write_qwen2_5_omni(tmp_path / "qwen", sizes))
    image = np.zeros((1008, 1344, 3), dtype=np.uint8)
    found = processor.image_processor(images=[image], return_tensors="np")["image_grid_thw"]
    assert found.tolist() == [grid]


def test_image_bounds_out_of_order_are_errors(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="image_min_pixels <= image_max_pixels"):
        write_qwen2_5_omni(
            tmp_path / "bad", Qwen2_5OmniSizes(image_min_pixels=4096, image_max_pixels=2048)
        )
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


def test_minicpmo_writing_twice_gives_the_same_bytes(tmp_path: Path) -> None:
    """Two MiniCPM-o directories are byte for byte the same and carry the package's remote code."""
    first = _files(write_minicpmo(tmp_path / "a"))
    assert _files(write_minicpmo(tmp_path / "b")) == first
    assert {
        "config.json",
        "tokenizer.json",
        "processor_config.json",
        *MINICPMO_REMOTE_FILES,
    } <= set(first)
    remote = Path(minicpmo_remote.__file__).parent
    for name in MINICPMO_REMOTE_FILES:
        assert first[name] == (remote / name).read_bytes(), name


def test_minicpmo_loads_through_auto_map_with_the_ids_vllm_reads(tmp_path: Path) -> None:
    """AutoConfig and AutoTokenizer load the remote classes; every id the processor reads exists."""
    from transformers import AutoConfig, AutoTokenizer

    directory = write_minicpmo(tmp_path / "minicpmo")
    config = AutoConfig.from_pretrained(directory, trust_remote_code=True)
    assert type(config).__name__ == "MiniCPMOConfig"
    assert (config.model_type, str(config.version), config.architectures) == (
        "minicpmo",
        "4.5",
        ["MiniCPMO"],
    )
    assert type(config.vision_config).__name__ == "SiglipVisionConfig"
    assert type(config.audio_config).__name__ == "WhisperConfig"
    # vLLM's audio projection reads encoder_ffn_dim // 4 features off the Whisper output.
    assert config.audio_config.encoder_ffn_dim // 4 == config.audio_config.d_model
    assert (config.query_num, config.audio_pool_step, config.audio_config.num_mel_bins) == (
        64,
        5,
        80,
    )
    tokenizer = AutoTokenizer.from_pretrained(directory, trust_remote_code=True)
    assert type(tokenizer).__name__ == "MiniCPMOTokenizerFast"
    for name in (
        "im_start_id",
        "im_end_id",
        "slice_start_id",
        "slice_end_id",
        "audio_start_id",
        "audio_end_id",
        "spk_start_id",
        "spk_end_id",
    ):
        token = getattr(tokenizer, name.removesuffix("_id"))
        assert getattr(tokenizer, name) == tokenizer.convert_tokens_to_ids(token), name
        assert token in MINICPMO_SPECIAL_TOKENS
    assert config.eos_token_id == tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert config.vocab_size % 64 == 0
    assert config.vocab_size - 64 < len(tokenizer) <= config.vocab_size
    # Each marker is one token, so the processor's spans are found by id.
    pattern = tokenizer.tokenize("(<image>./</image>)(<audio>./</audio>)")
    assert {"<image>", "</image>", "<audio>", "</audio>"} <= set(pattern)


@pytest.mark.parametrize(
    ("width", "height", "grid"),
    [
        (224, 224, None),
        (448, 448, None),
        (896, 448, (2, 1)),
        (448, 1344, (1, 3)),
        (1000, 700, (2, 2)),
        (448, 4032, (1, 9)),
    ],
)
def test_minicpmo_placeholders_match_the_slices_the_processor_makes(
    tmp_path: Path, width: int, height: int, grid: tuple[int, int] | None
) -> None:
    """The placeholder holds 64 ``<unk>`` per slice, and the pixels come as that many slices."""
    pytest.importorskip("vllm", reason="vLLM's vendored processor is what reads the directory")
    from PIL import Image
    from transformers import AutoTokenizer
    from vllm.transformers_utils.processors.minicpmo import MiniCPMOProcessor

    directory = write_minicpmo(tmp_path / "minicpmo")
    tokenizer = AutoTokenizer.from_pretrained(directory, trust_remote_code=True)
    processor = MiniCPMOProcessor.from_pretrained(
        directory, trust_remote_code=True, tokenizer=tokenizer
    )
    images = processor.image_processor
    assert images.get_sliced_grid((width, height), images.max_slice_nums) == grid
    slices = 1 + (grid[0] * grid[1] if grid else 0)
    placeholder = images.get_slice_image_placeholder((width, height), 0)
    assert tokenizer.tokenize(placeholder).count("<unk>") == slices * images.image_feature_size
    picture = Image.new("RGB", (width, height), (10, 200, 30))
    out = processor(text=["(<image>./</image>)"], images=[[picture]])
    assert len(out["pixel_values"][0]) == slices
    tgt_sizes = out["tgt_sizes"][0].tolist()
    for pixels, (rows, columns) in zip(out["pixel_values"][0], tgt_sizes, strict=True):
        # (3, patch, patches * patch): what vLLM's patch-sized convolution reads.
        assert tuple(pixels.shape) == (3, 14, rows * columns * 14)
    ids = out["input_ids"][0].tolist()
    assert ids.count(tokenizer.unk_token_id) == slices * images.image_feature_size
    assert len(out["image_bound"][0]) == slices


@pytest.mark.parametrize("seconds", [1.0, 2.5, 30.0])
def test_minicpmo_audio_placeholders_match_the_pooled_length(
    tmp_path: Path, seconds: float
) -> None:
    """An audio clip's placeholder holds as many ``<unk>`` as vLLM's pooling makes embeddings."""
    pytest.importorskip("vllm", reason="vLLM's vendored processor is what reads the directory")
    import numpy as np
    from transformers import AutoTokenizer
    from vllm.transformers_utils.processors.minicpmo import MiniCPMOProcessor

    directory = write_minicpmo(tmp_path / "minicpmo")
    tokenizer = AutoTokenizer.from_pretrained(directory, trust_remote_code=True)
    processor = MiniCPMOProcessor.from_pretrained(
        directory, trust_remote_code=True, tokenizer=tokenizer, pool_step=5
    )
    samples = np.zeros(int(seconds * 16_000), dtype=np.float32)
    out = processor(text=["(<audio>./</audio>)"], audios=[[samples]], chunk_input=True)
    frames = int(out["audio_feature_lens"][0][0])
    assert frames == seconds * 100
    # MiniCPMOBaseModel._get_feat_extract_output_lengths, with audio_pool_step 5.
    pooled = ((frames - 1) // 2 + 1 - 5) // 5 + 1
    assert out["input_ids"][0].tolist().count(tokenizer.unk_token_id) == pooled


def test_minicpmo_sizes_vllm_would_refuse_are_errors(tmp_path: Path) -> None:
    """A text width the resampler cannot split into 128-wide heads is refused before writing."""
    with pytest.raises(CheckpointError, match="multiple of 128"):
        write_minicpmo(tmp_path / "bad", MiniCPMOSizes(text_hidden=192, text_heads=3))
    assert not (tmp_path / "bad").exists()


def test_the_command_line_writes_a_minicpmo_directory(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``python -m omnitrace.testing_checkpoints minicpmo DIR`` writes it and prints its path."""
    assert main(["minicpmo", str(tmp_path / "cli")]) == 0
    assert capsys.readouterr().out == f"{tmp_path / 'cli'}\n"
    assert (tmp_path / "cli" / "configuration_minicpmo.py").exists()


def test_minicpmo_vision_heads_of_72_are_taken_and_96_refused(tmp_path: Path) -> None:
    """SigLIP so400m's heads of 72 pass the size check; a head dim no kernel takes does not."""
    MiniCPMOSizes(vision_hidden=144, vision_heads=2).check()
    with pytest.raises(CheckpointError, match="got 96"):
        write_minicpmo(tmp_path / "bad", MiniCPMOSizes(vision_hidden=192, vision_heads=2))
    assert not (tmp_path / "bad").exists()


@pytest.mark.parametrize(
    ("model", "expected"),
    [
        (
            "minicpmo",
            {
                ("hidden_size",): 4096,
                ("num_hidden_layers",): 36,
                ("num_key_value_heads",): 8,
                ("vocab_size",): 151_936,
                ("vision_config", "num_hidden_layers"): 27,
                ("vision_config", "hidden_size"): 1152,
                ("vision_config", "intermediate_size"): 4304,
                ("audio_config", "d_model"): 1024,
                ("audio_config", "encoder_layers"): 24,
            },
        ),
        (
            "qwen2_5_omni",
            {
                ("thinker_config", "text_config", "hidden_size"): 3584,
                ("thinker_config", "text_config", "vocab_size"): 152_064,
                ("thinker_config", "vision_config", "depth"): 32,
                ("thinker_config", "audio_config", "encoder_layers"): 32,
            },
        ),
    ],
)
def test_the_command_line_writes_the_released_sizes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], model: str, expected: dict
) -> None:
    """``--size released`` writes the released model's sizes into the config (no weights)."""
    assert main([model, str(tmp_path / model), "--size", "released"]) == 0
    config = json.loads((tmp_path / model / "config.json").read_text())
    for path, value in expected.items():
        found = config
        for key in path:
            found = found[key]
        assert found == value, path
