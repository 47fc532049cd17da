"""Shared test configuration: GPU tests skip cleanly on machines without CUDA."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from omnitrace import EventBus


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def bus() -> Iterator[EventBus]:
    """An event bus, closed after the test."""
    b = EventBus()
    yield b
    b.close()
