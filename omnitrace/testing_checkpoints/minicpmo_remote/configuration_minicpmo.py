"""MiniCPM-o 4.5's config class for a tiny test checkpoint (loaded with trust_remote_code): a
Qwen3 config with SigLIP vision and Whisper audio sub-configs of transformers' own classes."""

from __future__ import annotations

from typing import Any, ClassVar

from transformers import PreTrainedConfig, Qwen3Config, SiglipVisionConfig, WhisperConfig


class MiniCPMOConfig(Qwen3Config):
    """A Qwen3 config carrying MiniCPM-o's vision, audio, resampler and slicing fields."""

    model_type = "minicpmo"
    sub_configs: ClassVar[dict[str, type[PreTrainedConfig]]] = {
        "vision_config": SiglipVisionConfig,
        "audio_config": WhisperConfig,
    }

    vision_config: dict[str, Any] | PreTrainedConfig | None = None
    audio_config: dict[str, Any] | PreTrainedConfig | None = None
    # vLLM dispatches MiniCPMO to MiniCPMO4_5 (Qwen3 backbone) on this string.
    version: str = "4.5"
    # Resampler queries per image slice: each slice is this many embeddings.
    query_num: int = 64
    # The slice resolution; vLLM profiles with an image of image_size x image_size * 9.
    image_size: int = 448
    max_slice_num: int = 9
    drop_vision_last_layer: bool = False
    # Whisper frames pooled into one audio embedding (2 before 4.5) and the length in seconds
    # of the attention chunks of the audio encoder (vLLM's chunk mask uses 50 frames a second).
    audio_pool_step: int = 5
    audio_chunk_length: float = 1.0

    def __post_init__(self, **kwargs: Any) -> None:
        """Turn the sub-config dicts of a saved config.json back into config objects."""
        if isinstance(self.vision_config, dict):
            self.vision_config = SiglipVisionConfig(**self.vision_config)
        elif self.vision_config is None:
            self.vision_config = SiglipVisionConfig()
        if isinstance(self.audio_config, dict):
            self.audio_config = WhisperConfig(**self.audio_config)
        elif self.audio_config is None:
            self.audio_config = WhisperConfig()
        super().__post_init__(**kwargs)
