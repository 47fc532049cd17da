"""Start-up notices about vLLM settings that cost a multimodal request time outside the
encoders (docs/operations.md, "Why is my TTFT high?")."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

__all__ = ["QWEN_AUDIO_PAD_SAMPLES", "audio_processor_notice", "processor_pad_samples"]

#: 30 s at 16 kHz, Whisper's window: the pad length the notice suggests.
QWEN_AUDIO_PAD_SAMPLES = 480_000
#: Where a model keeps its feature extractor's settings: transformers 4's file of its own, or
#: transformers 5's one processor file with a ``feature_extractor`` section.
_FILES = (("preprocessor_config.json", None), ("processor_config.json", "feature_extractor"))


def _local_file(model: str, name: str, revision: str | None) -> Path | None:
    """``name`` in the model's directory, or in the local Hugging Face cache for a repository
    id; None where neither has it (nothing is downloaded)."""
    local = Path(model) / name
    if local.is_file():
        return local
    try:
        from huggingface_hub import try_to_load_from_cache
    except ImportError:
        return None
    try:
        cached = try_to_load_from_cache(model, name, revision=revision)
    except Exception:  # not a repository id: nothing to read
        return None
    return Path(cached) if isinstance(cached, str) else None


def _feature_extractor(model: str, revision: str | None) -> Mapping[str, Any] | None:
    """The feature extractor's settings the model's files hold, read locally, or None."""
    for name, section in _FILES:
        path = _local_file(model, name, revision)
        if path is None:
            continue
        try:
            config = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return None
        if section is not None and isinstance(config, Mapping):
            config = config.get(section)
        return config if isinstance(config, Mapping) else None
    return None


def processor_pad_samples(model: str, revision: str | None = None) -> tuple[int, int] | None:
    """The samples the model's audio feature extractor pads every clip to (``n_samples``,
    else ``chunk_length`` times ``sampling_rate``) and its sampling rate, from its
    ``preprocessor_config.json`` (or ``processor_config.json``'s ``feature_extractor``);
    None where that cannot be read locally."""
    config = _feature_extractor(model, revision)
    if config is None:
        return None
    rate, samples = config.get("sampling_rate", 16_000), config.get("n_samples")
    if type(samples) is not int:
        chunk = config.get("chunk_length")
        samples = chunk * rate if type(chunk) is int and type(rate) is int else None
    if type(samples) is not int or type(rate) is not int or samples <= 0 or rate <= 0:
        return None
    return samples, rate


def audio_processor_notice(vllm_config: Any, model_kind: str) -> str | None:
    """The warning for a Qwen2.5-Omni engine whose processor pads every clip to more than
    30 s of features on the API server, else None.

    transformers' ``Qwen2_5OmniProcessor`` pads audio to the feature extractor's
    ``n_samples`` (300 s for the released model) unless ``--mm-processor-kwargs`` gives
    ``audio_kwargs.max_length``; a notice names that setting. Nothing is said where the
    setting is given, the pad is 30 s or less, or the processor's configuration cannot be
    read locally.
    """
    if model_kind != "qwen2_5_omni":
        return None
    model_config = getattr(vllm_config, "model_config", None)
    model = getattr(model_config, "model", None)
    if not isinstance(model, str):
        return None
    options = getattr(model_config, "mm_processor_kwargs", None)
    audio = options.get("audio_kwargs") if isinstance(options, Mapping) else None
    if isinstance(audio, Mapping) and "max_length" in audio:
        return None
    pad = processor_pad_samples(model, getattr(model_config, "revision", None))
    if pad is None or pad[0] <= QWEN_AUDIO_PAD_SAMPLES:
        return None
    samples, rate = pad
    setting = json.dumps({"audio_kwargs": {"max_length": QWEN_AUDIO_PAD_SAMPLES}})
    return (
        f"omnitrace: the Qwen2.5-Omni processor pads every audio clip to {samples} samples "
        f"({samples / rate:g} s at {rate} Hz) of features on the API server (on an H200, "
        "245-282 ms of a 1-s clip's request); "
        f"--mm-processor-kwargs '{setting}' "
        "pads to 30 s (22-26 ms) with the same features for every shorter clip; vLLM 0.26 "
        "cuts a longer clip to max_length, so set it above the longest clip served"
    )
