"""A tiny MiniCPM-o 4.5 directory that vLLM 0.26 serves as ``MiniCPMO`` (``MiniCPMO4_5``), with
omnitrace's own remote code for the model type neither transformers nor vLLM knows
(docs/vllm.md, "A tiny MiniCPM-o 4.5 for the engine tests", says what each file holds)."""

from __future__ import annotations

import importlib
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omnitrace.testing_checkpoints._common import (
    SAMPLING_RATE,
    CheckpointError,
    padded,
    quiet,
    requirements,
    train_tokenizer,
    write_staged,
)

__all__ = [
    "MINICPMO_REMOTE_FILES",
    "MINICPMO_SPECIAL_TOKENS",
    "MiniCPMOSizes",
    "write_minicpmo",
]

#: The model's special tokens, in the order they get ids after the trained vocabulary.
MINICPMO_SPECIAL_TOKENS = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<unk>",
    "<image>",
    "</image>",
    "<slice>",
    "</slice>",
    "<image_id>",
    "</image_id>",
    "<audio>",
    "</audio>",
    "<spk>",
    "</spk>",
)

#: The remote-code modules copied into the directory, by file name.
MINICPMO_REMOTE_FILES = (
    "configuration_minicpmo.py",
    "image_processing_minicpmo.py",
    "tokenization_minicpmo.py",
)

_REMOTE = Path(__file__).resolve().parent / "minicpmo_remote"

_AUTO_CONFIG = {"AutoConfig": "configuration_minicpmo.MiniCPMOConfig"}
_AUTO_TOKENIZER = {"AutoTokenizer": [None, "tokenization_minicpmo.MiniCPMOTokenizerFast"]}
_AUTO_IMAGE_PROCESSOR = {"AutoImageProcessor": "image_processing_minicpmo.MiniCPMOImageProcessor"}

# String content only: vLLM's chat parser then writes each image or audio part as its
# placeholder string ahead of the text, as the model's own template expects.
_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


#: Head dims the attention kernels take (72: SigLIP so400m's vision heads).
_HEAD_DIMS = frozenset({64, 72, 80, 128})


@dataclass(frozen=True, slots=True)
class MiniCPMOSizes:
    """The sizes of a tiny MiniCPM-o 4.5 (defaults: a few MB of random weights)."""

    text_hidden: int = 128
    text_layers: int = 2
    text_heads: int = 2
    text_kv_heads: int = 1
    text_intermediate: int = 256
    vision_hidden: int = 128
    vision_layers: int = 2
    vision_heads: int = 2
    vision_intermediate: int = 256
    audio_hidden: int = 128
    audio_layers: int = 2
    audio_heads: int = 2
    query_num: int = 64
    max_slice_nums: int = 9
    tokenizer_vocab: int = 400
    max_position_embeddings: int = 8192
    text_vocab: int | None = None
    """The language model's vocabulary in the config; None: the tokenizer's length padded
    to a multiple of 64. A larger one (Qwen3-8B's 151,936) gives the LM head its real cost;
    ids past the tokenizer are never produced by a prompt."""

    @classmethod
    def released(cls) -> MiniCPMOSizes:
        """The sizes of the released MiniCPM-o 4.5: Qwen3-8B, SigLIP-400M, Whisper-medium.

        The SigLIP so400m tower with its 27 layers (width 1152, 16 heads of 72, MLP 4304), the
        Whisper-medium encoder (width 1024, 24 layers, 16 heads), and Qwen3-8B (width 4096,
        36 layers, 32 query and 8 key/value heads of 128, MLP 12288, vocabulary 151,936).
        """
        return cls(
            text_hidden=4096,
            text_layers=36,
            text_heads=32,
            text_kv_heads=8,
            text_intermediate=12288,
            vision_hidden=1152,
            vision_layers=27,
            vision_heads=16,
            vision_intermediate=4304,
            audio_hidden=1024,
            audio_layers=24,
            audio_heads=16,
            max_position_embeddings=40960,
            text_vocab=151_936,
        )

    def check(self) -> None:
        """Raise CheckpointError for sizes vLLM's model code or kernels would refuse."""
        for name, hidden, heads in (
            ("text", self.text_hidden, self.text_heads),
            ("vision", self.vision_hidden, self.vision_heads),
            ("audio", self.audio_hidden, self.audio_heads),
        ):
            if heads < 1 or hidden % heads or hidden // heads not in _HEAD_DIMS:
                raise CheckpointError(
                    f"{name}: hidden size {hidden} over {heads} heads must give a head dim "
                    f"of 64, 72, 80 or 128 (FlashAttention and SDPA take them), got "
                    f"{hidden / heads:g}"
                )
        if self.text_hidden % 128:
            raise CheckpointError(
                f"text_hidden {self.text_hidden} must be a multiple of 128 (vLLM gives the "
                "resampler text_hidden // 128 heads)"
            )
        if self.text_heads % self.text_kv_heads:
            raise CheckpointError(
                f"text_kv_heads {self.text_kv_heads} must divide text_heads {self.text_heads}"
            )
        for name in ("text_layers", "vision_layers", "audio_layers", "query_num"):
            if getattr(self, name) < 1:
                raise CheckpointError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.max_slice_nums < 1:
            raise CheckpointError(f"max_slice_nums must be at least 1, got {self.max_slice_nums}")
        if self.text_vocab is not None and (self.text_vocab % 64 or self.text_vocab < 1024):
            raise CheckpointError(
                f"text_vocab must be a multiple of 64 of at least 1024, got {self.text_vocab}"
            )
        if self.tokenizer_vocab < 300:
            raise CheckpointError(
                f"tokenizer_vocab must be at least 300 (256 bytes plus merges), "
                f"got {self.tokenizer_vocab}"
            )


def write_minicpmo(path: str | os.PathLike[str], sizes: MiniCPMOSizes | None = None) -> Path:
    """Write a tiny MiniCPM-o 4.5 model directory at ``path`` and return it.

    The directory is made (or must be empty) and filled in a temporary sibling first, then
    renamed into place, so a failure leaves nothing half-written.

    Raises:
        CheckpointError: transformers or tokenizers is missing, a size is unusable, or
            ``path`` exists and is not an empty directory.
    """
    sizes = sizes or MiniCPMOSizes()
    sizes.check()
    transformers, _ = requirements()
    return write_staged(path, lambda staging: _write_minicpmo(transformers, staging, sizes))


def _dump(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


def _amend(path: Path, **entries: Any) -> None:
    """Add ``entries`` to a JSON file transformers wrote."""
    data = json.loads(path.read_text())
    data.update(entries)
    _dump(path, data)


def _write_minicpmo(transformers: Any, directory: Path, sizes: MiniCPMOSizes) -> None:
    # The package's own copies of the remote modules build what the directory describes, so
    # the files written and the classes that read them back are the same code.
    remote = f"{__package__}.minicpmo_remote"
    configuration_minicpmo = importlib.import_module(f"{remote}.configuration_minicpmo")
    image_processing_minicpmo = importlib.import_module(f"{remote}.image_processing_minicpmo")
    tokenization_minicpmo = importlib.import_module(f"{remote}.tokenization_minicpmo")

    for name in MINICPMO_REMOTE_FILES:
        shutil.copyfile(_REMOTE / name, directory / name)

    raw = train_tokenizer(sizes.tokenizer_vocab, MINICPMO_SPECIAL_TOKENS)
    tokenizer = tokenization_minicpmo.MiniCPMOTokenizerFast(
        tokenizer_object=raw,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token="<unk>",
        model_max_length=sizes.max_position_embeddings,
        chat_template=_CHAT_TEMPLATE,
    )
    ids = {token: tokenizer.convert_tokens_to_ids(token) for token in MINICPMO_SPECIAL_TOKENS}
    vocab_size = padded(len(tokenizer)) if sizes.text_vocab is None else sizes.text_vocab
    _save_config(transformers, configuration_minicpmo, directory, sizes, vocab_size, ids)
    _amend(directory / "config.json", auto_map=_AUTO_CONFIG)

    tokenizer.save_pretrained(directory)
    _amend(
        directory / "tokenizer_config.json",
        auto_map=_AUTO_TOKENIZER,
        tokenizer_class="MiniCPMOTokenizerFast",
    )

    _save_processor_config(transformers, image_processing_minicpmo, directory, sizes)
    _dump(
        directory / "generation_config.json",
        {"eos_token_id": ids["<|im_end|>"], "pad_token_id": ids["<|endoftext|>"]},
    )


def _save_config(
    transformers: Any,
    configuration_minicpmo: Any,
    directory: Path,
    sizes: MiniCPMOSizes,
    vocab_size: int,
    ids: dict[str, int],
) -> None:
    """Save the model's config.json: the language model and the vision and audio towers."""
    text_head_dim = sizes.text_hidden // sizes.text_heads
    with quiet(transformers):
        config = configuration_minicpmo.MiniCPMOConfig(
            vocab_size=vocab_size,
            hidden_size=sizes.text_hidden,
            intermediate_size=sizes.text_intermediate,
            num_hidden_layers=sizes.text_layers,
            num_attention_heads=sizes.text_heads,
            num_key_value_heads=sizes.text_kv_heads,
            head_dim=text_head_dim,
            max_position_embeddings=sizes.max_position_embeddings,
            rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},
            tie_word_embeddings=False,
            eos_token_id=ids["<|im_end|>"],
            pad_token_id=ids["<|endoftext|>"],
            vision_config={
                "hidden_size": sizes.vision_hidden,
                "intermediate_size": sizes.vision_intermediate,
                "num_hidden_layers": sizes.vision_layers,
                "num_attention_heads": sizes.vision_heads,
                "num_channels": 3,
                # so400m's 980 px tower: a 70x70 position grid the slices' patches bucket into.
                "image_size": 980,
                "patch_size": 14,
                "hidden_act": "gelu_pytorch_tanh",
                "layer_norm_eps": 1e-6,
            },
            audio_config={
                "d_model": sizes.audio_hidden,
                "encoder_layers": sizes.audio_layers,
                "encoder_attention_heads": sizes.audio_heads,
                "encoder_ffn_dim": 4 * sizes.audio_hidden,
                "decoder_layers": 1,
                "decoder_attention_heads": sizes.audio_heads,
                "decoder_ffn_dim": 4 * sizes.audio_hidden,
                "num_mel_bins": 80,
                "max_source_positions": 1500,
            },
            query_num=sizes.query_num,
            image_size=448,
            max_slice_num=sizes.max_slice_nums,
            audio_pool_step=5,
            audio_chunk_length=1.0,
            version="4.5",
        )
        config.architectures = ["MiniCPMO"]
        config.save_pretrained(directory)


def _save_processor_config(
    transformers: Any, image_processing_minicpmo: Any, directory: Path, sizes: MiniCPMOSizes
) -> None:
    """Save processor_config.json: the image processor and the Whisper feature extractor."""
    image_processor = image_processing_minicpmo.MiniCPMOImageProcessor(
        max_slice_nums=sizes.max_slice_nums,
        scale_resolution=448,
        patch_size=14,
        image_feature_size=sizes.query_num,
    )
    feature_extractor = transformers.WhisperFeatureExtractor(
        feature_size=80, sampling_rate=SAMPLING_RATE, hop_length=160, chunk_length=30, n_fft=400
    )
    _dump(
        directory / "processor_config.json",
        {
            # vLLM resolves this name to its vendored wrapper, which loads the image processor
            # through AutoImageProcessor (the auto_map below) and the Whisper extractor.
            "processor_class": "MiniCPMOProcessor",
            "image_processor": {
                **_image_processor_dict(image_processor),
                "image_processor_type": "MiniCPMOImageProcessor",
                "auto_map": _AUTO_IMAGE_PROCESSOR,
            },
            "feature_extractor": feature_extractor.to_dict(),
        },
    )


def _image_processor_dict(processor: Any) -> dict[str, Any]:
    """The constructor arguments that rebuild ``processor``."""
    names = (
        "max_slice_nums",
        "scale_resolution",
        "patch_size",
        "image_feature_size",
        "use_image_id",
        "slice_mode",
        "norm_mean",
        "norm_std",
        "im_start",
        "im_end",
        "slice_start",
        "slice_end",
        "unk",
        "im_id_start",
        "im_id_end",
        "version",
    )
    return {name: getattr(processor, name) for name in names}
