"""omnitrace's masked audio attention for Qwen2.5-Omni's audio tower (one SDPA with a
block-diagonal mask made on the device), and its binding into transformers' dispatch
(docs/vllm.md, "Qwen2.5-Omni", says how and why it is opt-in)."""

from __future__ import annotations

import sys
import threading
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

__all__ = [
    "AUDIO_ATTENTION_LAYER",
    "MASKED_AUDIO_ATTENTION",
    "AttentionBinding",
    "masked_audio_attention",
    "masked_binding",
]

#: The audio attention layers' class, whose configs the masked route binds.
AUDIO_ATTENTION_LAYER = "Qwen2_5OmniAudioAttention"
#: omnitrace's audio attention's name in transformers' AttentionInterface. It contains
#: "flash": transformers hands cu_seqlens to the attention function, instead of splitting
#: on the host, only for implementations it takes for flash attention.
MASKED_AUDIO_ATTENTION = "omnitrace_flash_varlen_masked_sdpa"


def masked_audio_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    cu_seq_lens_q: torch.Tensor | None = None,
    cu_seq_lens_k: torch.Tensor | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """Attend within each packed sequence of ``cu_seq_lens_q`` in one SDPA over all of them.

    transformers' attention-function signature: ``query``, ``key`` and ``value`` are
    ``(1, heads, n, head_dim)`` over the packed sequence; returns ``(1, n, heads, head_dim)``
    and no weights. The launch bounds (``max_length_q``, ``max_length_k``) are not needed.

    Raises:
        ValueError: no ``cu_seq_lens_q``, other key boundaries, an attention mask of the
            caller's or a batch of more than one packed sequence (this function serves only
            transformers' packed audio attention).
    """
    if (
        cu_seq_lens_q is None
        or (cu_seq_lens_k is not None and cu_seq_lens_k is not cu_seq_lens_q)
        or attention_mask is not None
        or query.shape[0] != 1
    ):
        raise ValueError(
            f"{MASKED_AUDIO_ATTENTION}: expected one packed sequence with cu_seq_lens_q (the "
            "same as cu_seq_lens_k) and no attention_mask, as transformers' Qwen2.5-Omni audio "
            "attention passes them; set encoder_cuda_graph_audio_attention to 'native' for "
            "another caller"
        )
    cu_seqlens = cu_seq_lens_q
    positions = torch.arange(query.shape[2], device=query.device, dtype=cu_seqlens.dtype)
    # Each position's chunk, found on the device: the first boundary past it. No value
    # leaves the device and every shape follows from the inputs' shapes, so this captures.
    chunk = torch.searchsorted(cu_seqlens[1:], positions, right=True)
    mask = chunk[:, None] == chunk[None, :]
    out = F.scaled_dot_product_attention(
        query, key, value, attn_mask=mask, dropout_p=dropout, scale=scaling
    )
    return out.transpose(1, 2).contiguous(), None


class AttentionBinding:
    """Name omnitrace's attention in the tower's attention configs while a forward runs."""

    def __init__(self, configs: list[Any]):
        self._configs = configs
        self._lock = threading.Lock()
        self._depth = 0
        self._saved: list[Any] = []

    def __enter__(self) -> None:
        # Counted, not saved per call: a capture on the preparation thread and an eager
        # call on the serving thread may overlap, and the first to leave must not restore
        # the native name under the other.
        with self._lock:
            if self._depth == 0:
                self._saved = [config._attn_implementation for config in self._configs]
                for config in self._configs:
                    config._attn_implementation = MASKED_AUDIO_ATTENTION
            self._depth += 1

    def __exit__(self, *exc: object) -> None:
        with self._lock:
            self._depth -= 1
            if self._depth == 0:
                for config, saved in zip(self._configs, self._saved, strict=True):
                    config._attn_implementation = saved


def masked_binding(tower: nn.Module) -> AttentionBinding | None:
    """Register omnitrace's attention for ``tower``'s module and return its binding, if it can."""
    registry = getattr(sys.modules.get(type(tower).__module__), "ALL_ATTENTION_FUNCTIONS", None)
    register = getattr(registry, "register", None)
    if registry is None or not callable(register) or not callable(getattr(registry, "get", None)):
        return None
    configs: dict[int, Any] = {}
    for module in tower.modules():
        config = getattr(module, "config", None)
        if type(module).__name__ == AUDIO_ATTENTION_LAYER and config is not None:
            configs.setdefault(id(config), config)
    if not configs:
        return None
    if registry.get(MASKED_AUDIO_ATTENTION) is not masked_audio_attention:
        # transformers' extension point: a new name, reachable only from a config naming it.
        register(MASKED_AUDIO_ATTENTION, masked_audio_attention)
    return AttentionBinding(list(configs.values()))
