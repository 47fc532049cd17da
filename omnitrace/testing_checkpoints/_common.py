"""What every checkpoint writer shares: the error, the requirements, the tokenizer trainer."""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from omnitrace.config import OmnitraceError

#: The sample rate the feature extractors take (vLLM resamples other rates with PyAV).
SAMPLING_RATE = 16_000

# A fixed corpus: the tokenizer must come out the same on every machine.
CORPUS = (
    "Describe the image and the audio clip in one short sentence.",
    "What is in this picture? What do you hear in the recording?",
    "The quick brown fox jumps over the lazy dog near the river bank.",
    "A cat sits on a red chair; a dog sleeps under the wooden table.",
    "Speech, music, noise and silence: classify the sound you hear.",
    "Numbers 0 1 2 3 4 5 6 7 8 9 10 100 1000 and punctuation , . ; : ! ? ( ) [ ] { }",
    "system user assistant: You are a helpful assistant that answers briefly.",
)


class CheckpointError(OmnitraceError, RuntimeError):
    """A checkpoint directory cannot be written (missing package, bad size, unusable path)."""


def requirements() -> tuple[Any, Any]:
    """Import transformers and tokenizers, or raise CheckpointError naming what is missing."""
    try:
        import tokenizers
        import transformers
    except ImportError as exc:
        raise CheckpointError(
            f"writing a checkpoint needs transformers and tokenizers ({exc}); install them "
            "beside the engine"
        ) from exc
    return transformers, tokenizers


def train_tokenizer(vocab_size: int, specials: Sequence[str]) -> Any:
    """Train a byte-level BPE on the fixed corpus; the specials get the ids after it."""
    _, tokenizers = requirements()
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
    tokenizer.train_from_iterator(CORPUS * 8, trainer=trainer)
    tokenizer.add_special_tokens(list(specials))
    return tokenizer


@contextlib.contextmanager
def quiet(transformers: Any) -> Iterator[None]:
    """Hide transformers' warnings inside the block.

    Building and saving configs validates and diffs against default sub-configs whose token
    ids are the full model's, outside a tiny vocabulary; the warnings they raise are about
    those defaults, not about the directory written.
    """
    verbosity = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()
    try:
        yield
    finally:
        transformers.logging.set_verbosity(verbosity)


def padded(n: int, multiple: int = 64) -> int:
    """``n`` rounded up to a multiple of ``multiple``."""
    return -(-n // multiple) * multiple


def write_staged(path: str | os.PathLike[str], fill: Callable[[Path], None]) -> Path:
    """Fill a temporary sibling of ``path`` with ``fill``, then rename it into place.

    The directory is made (or must be empty), so a failure leaves nothing half-written.

    Raises:
        CheckpointError: ``path`` exists and is not an empty directory.
    """
    target = Path(path)
    if target.exists() and (not target.is_dir() or any(target.iterdir())):
        raise CheckpointError(f"{target}: exists and is not an empty directory")
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        fill(staging)
        if target.exists():
            target.rmdir()
        # mkdtemp makes the directory private; a model directory is read by other users.
        staging.chmod(0o755)
        staging.rename(target)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return target
