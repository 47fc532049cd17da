"""A tiny Qwen2.5-Omni directory (the thinker is what vLLM serves): transformers' own config
and processor classes at sizes vLLM accepts, and a tokenizer trained here."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omnitrace.testing_checkpoints._common import (
    SAMPLING_RATE,
    CheckpointError,
    quiet,
    requirements,
    train_tokenizer,
    write_staged,
)
from omnitrace.testing_checkpoints._common import padded as _padded

__all__ = [
    "QWEN2_5_OMNI_SPECIAL_TOKENS",
    "Qwen2_5OmniSizes",
    "write_qwen2_5_omni",
]

#: The model's special tokens, in the order they get ids after the trained vocabulary.
QWEN2_5_OMNI_SPECIAL_TOKENS = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|AUDIO|>",
    "<|audio_bos|>",
    "<|audio_eos|>",
    "<|IMAGE|>",
    "<|VIDEO|>",
    "<|vision_bos|>",
    "<|vision_eos|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
)

# The processor reads these names off the tokenizer (``tokenizer.image_token`` ...).
_NAMED_TOKENS = {
    "image_token": "<|IMAGE|>",
    "audio_token": "<|AUDIO|>",
    "video_token": "<|VIDEO|>",
    "vision_bos_token": "<|vision_bos|>",
    "vision_eos_token": "<|vision_eos|>",
    "audio_bos_token": "<|audio_bos|>",
    "audio_eos_token": "<|audio_eos|>",
}

# Messages whose content is a list get one placeholder per image, video or audio part, in
# the order vLLM's chat parser and the processor expect; string content is used as is.
_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'text' %}{{ part['text'] }}"
    "{% elif part['type'] in ('image', 'image_url') %}<|vision_start|><|IMAGE|><|vision_end|>"
    "{% elif part['type'] in ('video', 'video_url') %}<|vision_start|><|VIDEO|><|vision_end|>"
    "{% elif part['type'] in ('audio', 'audio_url', 'input_audio') %}"
    "<|audio_bos|><|AUDIO|><|audio_eos|>"
    "{% endif %}{% endfor %}{% endif %}"
    "<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

#: Head dims every attention backend vLLM 0.26 picks for these towers accepts.
_HEAD_DIMS = frozenset({64, 80, 128})


@dataclass(frozen=True, slots=True)
class Qwen2_5OmniSizes:
    """The sizes of a tiny Qwen2.5-Omni thinker (defaults: a few MB of random weights)."""

    text_hidden: int = 128
    text_layers: int = 2
    text_heads: int = 2
    text_kv_heads: int = 1
    text_intermediate: int = 256
    vision_hidden: int = 128
    vision_depth: int = 2
    vision_heads: int = 2
    vision_intermediate: int = 256
    audio_hidden: int = 128
    audio_layers: int = 2
    audio_heads: int = 2
    audio_ffn: int = 256
    tokenizer_vocab: int = 400
    max_position_embeddings: int = 8192
    text_vocab: int | None = None
    """The language model's vocabulary in the config; None: the tokenizer's length padded
    to a multiple of 64. A larger one (the real model's 152,064) gives the LM head its real
    cost; ids past the tokenizer are never produced by a prompt."""
    # The image processor's resize bounds, in pixels: a larger image is scaled down to at
    # most image_max_pixels (by default 448x448's, 256 tokens; the released model allows
    # 16,384 tokens), a smaller one up to image_min_pixels.
    image_min_pixels: int = 28 * 28 * 4
    image_max_pixels: int = 28 * 28 * 256

    @classmethod
    def released(cls) -> Qwen2_5OmniSizes:
        """The sizes of the released Qwen2.5-Omni-7B's thinker (transformers' default configs)."""
        return cls(
            text_hidden=3584,
            text_layers=28,
            text_heads=28,
            text_kv_heads=4,
            text_intermediate=18944,
            vision_hidden=1280,
            vision_depth=32,
            vision_heads=16,
            vision_intermediate=3420,
            audio_hidden=1280,
            audio_layers=32,
            audio_heads=20,
            audio_ffn=5120,
            max_position_embeddings=32768,
            text_vocab=152_064,
            # The released preprocessor_config.json's bounds.
            image_min_pixels=3136,
            image_max_pixels=12_845_056,
        )

    def check(self) -> None:
        """Raise CheckpointError for sizes vLLM's kernels or the configs would refuse."""
        for name, hidden, heads in (
            ("text", self.text_hidden, self.text_heads),
            ("vision", self.vision_hidden, self.vision_heads),
            ("audio", self.audio_hidden, self.audio_heads),
        ):
            if heads < 1 or hidden % heads or hidden // heads not in _HEAD_DIMS:
                raise CheckpointError(
                    f"{name}: hidden size {hidden} over {heads} heads must give a head dim "
                    f"of 64, 80 or 128 (FlashAttention and SDPA take them), got "
                    f"{hidden}/{heads}"
                )
        if self.text_heads % self.text_kv_heads:
            raise CheckpointError(
                f"text_kv_heads {self.text_kv_heads} must divide text_heads {self.text_heads}"
            )
        for name in ("text_layers", "vision_depth", "audio_layers"):
            if getattr(self, name) < 1:
                raise CheckpointError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.text_vocab is not None and (self.text_vocab % 64 or self.text_vocab < 1024):
            raise CheckpointError(
                f"text_vocab must be a multiple of 64 of at least 1024, got {self.text_vocab}"
            )
        if not 28 * 28 <= self.image_min_pixels <= self.image_max_pixels:
            raise CheckpointError(
                f"image pixels: need 784 <= image_min_pixels <= image_max_pixels, got "
                f"{self.image_min_pixels} and {self.image_max_pixels}"
            )
        if self.tokenizer_vocab < 300:
            raise CheckpointError(
                f"tokenizer_vocab must be at least 300 (256 bytes plus merges), "
                f"got {self.tokenizer_vocab}"
            )


def write_qwen2_5_omni(path: str | os.PathLike[str], sizes: Qwen2_5OmniSizes | None = None) -> Path:
    """Write a tiny Qwen2.5-Omni model directory at ``path`` and return it.

    The directory is made (or must be empty) and filled in a temporary sibling first, then
    renamed into place, so a failure leaves nothing half-written.

    Raises:
        CheckpointError: transformers or tokenizers is missing, a size is unusable, or
            ``path`` exists and is not an empty directory.
    """
    sizes = sizes or Qwen2_5OmniSizes()
    sizes.check()
    transformers, _ = requirements()
    return write_staged(path, lambda staging: _write_qwen2_5_omni(transformers, staging, sizes))


def _write_qwen2_5_omni(transformers: Any, directory: Path, sizes: Qwen2_5OmniSizes) -> None:
    # Through the module object (Any): the classes' own annotations are not this code's.
    configs = transformers.models.qwen2_5_omni.configuration_qwen2_5_omni

    raw = train_tokenizer(sizes.tokenizer_vocab, QWEN2_5_OMNI_SPECIAL_TOKENS)
    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_object=raw,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        extra_special_tokens=_NAMED_TOKENS,
        model_max_length=sizes.max_position_embeddings,
        chat_template=_CHAT_TEMPLATE,
    )
    ids = {token: tokenizer.convert_tokens_to_ids(token) for token in QWEN2_5_OMNI_SPECIAL_TOKENS}
    vocab_size = _padded(len(tokenizer)) if sizes.text_vocab is None else sizes.text_vocab
    thinker = _thinker_config(configs, sizes, ids, vocab_size)
    talker = _talker_config(configs, ids)
    with quiet(transformers):
        config = configs.Qwen2_5OmniConfig(
            thinker_config=thinker, talker_config=talker, enable_audio_output=False
        )
    config.architectures = ["Qwen2_5OmniModel"]
    with quiet(transformers):
        config.save_pretrained(directory)

    _save_processor(transformers, directory, tokenizer, sizes)
    tokenizer.save_pretrained(directory)
    (directory / "generation_config.json").write_text(
        json.dumps({"eos_token_id": ids["<|im_end|>"], "pad_token_id": ids["<|endoftext|>"]}) + "\n"
    )


def _thinker_config(
    configs: Any, sizes: Qwen2_5OmniSizes, ids: dict[str, int], vocab_size: int
) -> Any:
    """The thinker's configuration: the text model and the vision and audio encoders."""
    text_head_dim = sizes.text_hidden // sizes.text_heads
    eighth = text_head_dim // 16
    # Temporal, height, width sections of the rotary half-dim (32 for head dim 64).
    mrope_section = [2 * eighth, 3 * eighth, 3 * eighth]
    return configs.Qwen2_5OmniThinkerConfig(
        text_config=configs.Qwen2_5OmniTextConfig(
            vocab_size=vocab_size,
            hidden_size=sizes.text_hidden,
            intermediate_size=sizes.text_intermediate,
            num_hidden_layers=sizes.text_layers,
            num_attention_heads=sizes.text_heads,
            num_key_value_heads=sizes.text_kv_heads,
            max_position_embeddings=sizes.max_position_embeddings,
            rope_parameters={
                "rope_type": "default",
                "rope_theta": 1_000_000.0,
                "mrope_section": mrope_section,
            },
            tie_word_embeddings=False,
            eos_token_id=ids["<|im_end|>"],
            pad_token_id=ids["<|endoftext|>"],
        ),
        vision_config=configs.Qwen2_5OmniVisionEncoderConfig(
            depth=sizes.vision_depth,
            hidden_size=sizes.vision_hidden,
            intermediate_size=sizes.vision_intermediate,
            num_heads=sizes.vision_heads,
            out_hidden_size=sizes.text_hidden,
            # Every eighth block attends over the whole image, as in the released model.
            fullatt_block_indexes=[i for i in range(sizes.vision_depth) if i % 8 == 7]
            or [sizes.vision_depth - 1],
            window_size=112,
            patch_size=14,
            spatial_merge_size=2,
            temporal_patch_size=2,
            in_channels=3,
        ),
        audio_config=configs.Qwen2_5OmniAudioEncoderConfig(
            d_model=sizes.audio_hidden,
            encoder_layers=sizes.audio_layers,
            encoder_attention_heads=sizes.audio_heads,
            encoder_ffn_dim=sizes.audio_ffn,
            num_mel_bins=128,
            output_dim=sizes.text_hidden,
            n_window=100,
            max_source_positions=1500,
        ),
        audio_token_index=ids["<|AUDIO|>"],
        image_token_index=ids["<|IMAGE|>"],
        video_token_index=ids["<|VIDEO|>"],
        audio_start_token_id=ids["<|audio_bos|>"],
        audio_end_token_id=ids["<|audio_eos|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=False,
    )


def _talker_config(configs: Any, ids: dict[str, int]) -> Any:
    """The talker's configuration: speech output is not served, but its token ids must
    still lie in the vocabulary."""
    return configs.Qwen2_5OmniTalkerConfig(
        **{
            name: ids[token]
            for name, token in (
                ("tts_text_start_token_id", "<|im_start|>"),
                ("tts_text_end_token_id", "<|im_end|>"),
                ("tts_text_pad_token_id", "<|endoftext|>"),
                ("vision_start_token_id", "<|vision_start|>"),
                ("vision_end_token_id", "<|vision_end|>"),
                ("audio_start_token_id", "<|audio_bos|>"),
                ("audio_end_token_id", "<|audio_eos|>"),
                ("audio_token_index", "<|AUDIO|>"),
                ("image_token_index", "<|IMAGE|>"),
                ("video_token_index", "<|VIDEO|>"),
            )
        }
    )


def _save_processor(
    transformers: Any, directory: Path, tokenizer: Any, sizes: Qwen2_5OmniSizes
) -> None:
    """Save the processor: images, audio features, the tokenizer, video where it imports."""
    image_processor = transformers.Qwen2VLImageProcessor(
        patch_size=14,
        merge_size=2,
        temporal_patch_size=2,
        min_pixels=sizes.image_min_pixels,
        max_pixels=sizes.image_max_pixels,
    )
    feature_extractor = transformers.WhisperFeatureExtractor(
        feature_size=128, sampling_rate=SAMPLING_RATE, chunk_length=300, n_samples=4_800_000
    )
    processor_parts: dict[str, Any] = {
        "image_processor": image_processor,
        "feature_extractor": feature_extractor,
        "tokenizer": tokenizer,
        "chat_template": _CHAT_TEMPLATE,
    }
    video_processor = _video_processor(transformers)
    if video_processor is not None:
        processor_parts["video_processor"] = video_processor
    processor = transformers.Qwen2_5OmniProcessor(**processor_parts)
    processor.save_pretrained(directory)


def _video_processor(transformers: Any) -> Any:
    """Qwen2-VL's video processor, where its dependencies (torchvision) import."""
    try:
        # A lazy attribute of transformers: it raises where torchvision does not import.
        video_processor = transformers.Qwen2VLVideoProcessor
    except (ImportError, AttributeError):
        return None
    try:
        return video_processor(patch_size=14, merge_size=2, temporal_patch_size=2)
    except ImportError:
        return None
