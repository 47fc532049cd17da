"""Write tiny, complete model directories that a real vLLM engine loads offline.

For tests and benchmarks that start an engine (``vllm.LLM`` or ``vllm serve``) without a
model hub: everything a checkpoint directory holds except weights, which the engine makes
itself with ``load_format="dummy"``. The weights are random, so the text an engine generates
is meaningless; the encoders still run on real inputs, which forward hooks and omnitrace's
events prove.

:func:`write_qwen2_5_omni` writes a Qwen2.5-Omni directory (the thinker is what vLLM serves):

- ``config.json`` from transformers' own config classes, at tiny sizes that vLLM 0.26
  accepts: head dims of 64 (FlashAttention and SDPA both take them), an ``mrope_section``
  summing to half the text head dim, vision ``out_hidden_size`` and audio ``output_dim``
  equal to the text hidden size, ``fullatt_block_indexes`` naming existing blocks, 128 mel
  bins (the Whisper feature extractor's size), and ``vocab_size`` equal to the tokenizer's
  length padded to a multiple of 64, with every multimodal token id taken from the tokenizer;
- a byte-level BPE tokenizer trained here with ``tokenizers`` on a fixed corpus, holding
  every special token the processor and the chat template use;
- the processor's configs (Qwen2-VL image and video processors, Whisper feature extractor at
  16 kHz) and a chat template that places an image, a video or an audio clip where a message
  part asks for one.

Writing is deterministic (same arguments, same bytes) and takes about a second. It needs
``transformers`` (5.x) and ``tokenizers``, which an engine's environment has; omnitrace itself
does not depend on them.

From a shell: ``python -m omnitrace.testing_checkpoints qwen2_5_omni DIR``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import tempfile
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from omnitrace.config import OmnitraceError

__all__ = [
    "CheckpointError",
    "QWEN2_5_OMNI_SPECIAL_TOKENS",
    "Qwen2_5OmniSizes",
    "main",
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

# A fixed corpus: the tokenizer must come out the same on every machine.
_CORPUS = (
    "Describe the image and the audio clip in one short sentence.",
    "What is in this picture? What do you hear in the recording?",
    "The quick brown fox jumps over the lazy dog near the river bank.",
    "A cat sits on a red chair; a dog sleeps under the wooden table.",
    "Speech, music, noise and silence: classify the sound you hear.",
    "Numbers 0 1 2 3 4 5 6 7 8 9 10 100 1000 and punctuation , . ; : ! ? ( ) [ ] { }",
    "system user assistant: You are a helpful assistant that answers briefly.",
)

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

#: The sample rate the feature extractor takes (vLLM resamples other rates with PyAV).
SAMPLING_RATE = 16_000


#: Head dims every attention backend vLLM 0.26 picks for these towers accepts.
_HEAD_DIMS = frozenset({64, 80, 128})


class CheckpointError(OmnitraceError, RuntimeError):
    """A checkpoint directory cannot be written (missing package, bad size, unusable path)."""


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

    @classmethod
    def seven_b(cls) -> Qwen2_5OmniSizes:
        """The sizes of Qwen2.5-Omni-7B's thinker (transformers' default configs)."""
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
        if self.tokenizer_vocab < 300:
            raise CheckpointError(
                f"tokenizer_vocab must be at least 300 (256 bytes plus merges), "
                f"got {self.tokenizer_vocab}"
            )


def _requirements() -> tuple[Any, Any]:
    try:
        import tokenizers
        import transformers
    except ImportError as exc:
        raise CheckpointError(
            f"writing a checkpoint needs transformers and tokenizers ({exc}); install them "
            "beside the engine"
        ) from exc
    return transformers, tokenizers


def _train_tokenizer(vocab_size: int, specials: Sequence[str]) -> Any:
    """Train a byte-level BPE on the fixed corpus; the specials get the ids after it."""
    _, tokenizers = _requirements()
    from tokenizers import decoders, models, pre_tokenizers, trainers

    tokenizer = tokenizers.Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=1,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(_CORPUS * 8, trainer=trainer)
    tokenizer.add_special_tokens(list(specials))
    return tokenizer


@contextlib.contextmanager
def _quiet(transformers: Any) -> Iterator[None]:
    """Hide transformers' warnings inside the block.

    Building and saving a Qwen2_5OmniConfig validates and diffs against default sub-configs
    whose token ids are the full model's, outside a tiny vocabulary; the warnings they raise
    are about those defaults, not about the directory written.
    """
    verbosity = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()
    try:
        yield
    finally:
        transformers.logging.set_verbosity(verbosity)


def _padded(n: int, multiple: int = 64) -> int:
    return -(-n // multiple) * multiple


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
    transformers, _ = _requirements()
    target = Path(path)
    if target.exists() and (not target.is_dir() or any(target.iterdir())):
        raise CheckpointError(f"{target}: exists and is not an empty directory")
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        _write_qwen2_5_omni(transformers, staging, sizes)
        if target.exists():
            target.rmdir()
        # mkdtemp makes the directory private; a model directory is read by other users.
        staging.chmod(0o755)
        staging.rename(target)
    except BaseException:
        for child in staging.glob("*"):
            child.unlink()
        staging.rmdir()
        raise
    return target


def _write_qwen2_5_omni(transformers: Any, directory: Path, sizes: Qwen2_5OmniSizes) -> None:
    from transformers.models.qwen2_5_omni import configuration_qwen2_5_omni as configs

    raw = _train_tokenizer(sizes.tokenizer_vocab, QWEN2_5_OMNI_SPECIAL_TOKENS)
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
    text_head_dim = sizes.text_hidden // sizes.text_heads
    eighth = text_head_dim // 16
    # Temporal, height, width sections of the rotary half-dim (32 for head dim 64).
    mrope_section = [2 * eighth, 3 * eighth, 3 * eighth]
    thinker = configs.Qwen2_5OmniThinkerConfig(
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
    # The talker (speech output) is not served; its token ids must still lie in the vocabulary.
    talker = configs.Qwen2_5OmniTalkerConfig(
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
    with _quiet(transformers):
        config = configs.Qwen2_5OmniConfig(
            thinker_config=thinker, talker_config=talker, enable_audio_output=False
        )
    config.architectures = ["Qwen2_5OmniModel"]
    with _quiet(transformers):
        config.save_pretrained(directory)

    from transformers import (
        Qwen2_5OmniProcessor,
        Qwen2VLImageProcessor,
        WhisperFeatureExtractor,
    )

    image_processor = Qwen2VLImageProcessor(
        patch_size=14,
        merge_size=2,
        temporal_patch_size=2,
        min_pixels=28 * 28 * 4,
        max_pixels=28 * 28 * 256,
    )
    feature_extractor = WhisperFeatureExtractor(
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
    processor = Qwen2_5OmniProcessor(**processor_parts)
    processor.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    (directory / "generation_config.json").write_text(
        json.dumps({"eos_token_id": ids["<|im_end|>"], "pad_token_id": ids["<|endoftext|>"]}) + "\n"
    )


def _video_processor(transformers: Any) -> Any:
    """Qwen2-VL's video processor, where its dependencies (torchvision) import."""
    try:
        from transformers import Qwen2VLVideoProcessor
    except ImportError:
        return None
    try:
        return Qwen2VLVideoProcessor(patch_size=14, merge_size=2, temporal_patch_size=2)
    except ImportError:
        return None


_WRITERS = {"qwen2_5_omni": write_qwen2_5_omni}


def main(argv: Sequence[str] | None = None) -> int:
    """Write a tiny checkpoint directory from the command line; return the exit status."""
    parser = argparse.ArgumentParser(
        prog="python -m omnitrace.testing_checkpoints",
        description="Write a tiny model directory (config, tokenizer, processor; no weights) "
        'that vLLM loads offline with load_format="dummy".',
    )
    parser.add_argument("model", choices=sorted(_WRITERS))
    parser.add_argument("directory", help="where to write it (made; must not hold files)")
    parser.add_argument(
        "--size",
        choices=("tiny", "7b"),
        default="tiny",
        help="tiny (default, a few MB of weights) or the released 7B thinker's sizes",
    )
    parser.add_argument("--sizes", action="store_true", help="print the sizes used, as JSON")
    args = parser.parse_args(argv)
    sizes = Qwen2_5OmniSizes.seven_b() if args.size == "7b" else Qwen2_5OmniSizes()
    try:
        written = _WRITERS[args.model](args.directory, sizes)
    except CheckpointError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.sizes:
        print(json.dumps(asdict(sizes)))
    print(written)
    return 0


if __name__ == "__main__":
    sys.exit(main())
