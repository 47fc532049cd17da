"""Fixtures of the integration tests that build vLLM's own encoder modules."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest


@pytest.fixture(scope="module")
def vllm_env() -> Iterator[Any]:
    """vLLM's config context and a one-process model-parallel group, as its loader has.

    vLLM is imported here, when a test asks for the fixture: the modules that use it set
    ``VLLM_TARGET_DEVICE`` and skip without vLLM before that.
    """
    from benchmarks.vision_path import vllm_context

    with vllm_context() as config:
        yield config
