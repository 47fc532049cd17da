"""Fixtures for the engine tests: tiny checkpoints and a directory for the engines' files.

The tests need vLLM: each module skips without it, and the engine CI tier installs it (and
turns skips into failures).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from engine.support import RUNNERS
from omnitrace.testing_checkpoints import write_minicpmo, write_qwen2_5_omni


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Qwen2.5-Omni directory written by omnitrace's checkpoint builder."""
    return write_qwen2_5_omni(tmp_path_factory.mktemp("checkpoints") / "qwen2_5_omni")


@pytest.fixture(scope="session")
def minicpmo_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny MiniCPM-o 4.5 directory (with its remote code) written by the same builder."""
    return write_minicpmo(tmp_path_factory.mktemp("checkpoints") / "minicpmo")


@pytest.fixture(scope="session")
def engine_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A directory for the engines' reports and logs, kept for the session."""
    return tmp_path_factory.mktemp("engines")


@pytest.fixture(scope="module", params=RUNNERS)
def runner(request: pytest.FixtureRequest) -> str:
    """The model runner a module's engines use: vLLM's CPU runner, or each GPU runner."""
    return str(request.param)
