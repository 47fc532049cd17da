"""Fixtures of the integration tests that build vLLM's own encoder modules."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest


@contextmanager
def vllm_context() -> Iterator[Any]:
    """vLLM's config context and a one-process model-parallel group, as its loader has.

    Yields:
        The ``VllmConfig`` in force.
    """
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.distributed import parallel_state

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    config = VllmConfig()
    with set_current_vllm_config(config):
        parallel_state.init_distributed_environment(
            world_size=1,
            rank=0,
            local_rank=0,
            distributed_init_method=f"tcp://127.0.0.1:{port}",
            backend="gloo",
        )
        parallel_state.initialize_model_parallel(1, 1)
        try:
            yield config
        finally:
            parallel_state.destroy_model_parallel()
            parallel_state.destroy_distributed_environment()


@pytest.fixture(scope="module")
def vllm_env() -> Iterator[Any]:
    """:func:`vllm_context` for a module's tests.

    vLLM is imported here, when a test asks for the fixture: the modules that use it set
    ``VLLM_TARGET_DEVICE`` and skip without vLLM before that.
    """
    with vllm_context() as config:
        yield config
