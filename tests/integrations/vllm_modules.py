"""What the tests of vLLM's real encoder modules share: the setups they run under, and
bitwise comparison of what the encoders return."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from omnitrace.testing import SimulatedGraphBackend

#: Where the modules run: on the CPU with the simulated backend (the vLLM CI tiers), and on
#: a CUDA device with the torch and the vLLM graph backends.
SETUPS = [
    pytest.param(
        "cpu-simulated",
        marks=pytest.mark.skipif(
            torch.cuda.is_available(),
            reason="vLLM's CUDA build registers its custom ops for CUDA only; on a CUDA machine "
            "the cuda cases run vLLM's modules",
        ),
        id="cpu-simulated",
    ),
    pytest.param("cuda-torch", marks=pytest.mark.gpu, id="cuda-torch"),
    pytest.param("cuda-vllm", marks=pytest.mark.gpu, id="cuda-vllm"),
]


def setup_for(name: str, vllm_config: Any) -> tuple[torch.device, torch.dtype, dict[str, Any]]:
    """The device, dtype and ``instrument`` arguments of one of :data:`SETUPS`."""
    if name == "cpu-simulated":
        return torch.device("cpu"), torch.float32, {"backend": SimulatedGraphBackend()}
    if name == "cuda-torch":
        return torch.device("cuda"), torch.bfloat16, {}
    return torch.device("cuda"), torch.bfloat16, {"vllm_config": vllm_config}


def equal(got: Any, want: Any) -> bool:
    """Whether ``got`` is ``want`` bit for bit: a tensor, or a sequence of them, nested."""
    if isinstance(want, torch.Tensor):
        return isinstance(got, torch.Tensor) and got.shape == want.shape and torch.equal(got, want)
    return len(got) == len(want) and all(equal(g, w) for g, w in zip(got, want, strict=True))
