"""Shared test configuration: GPU tests skip cleanly on machines without CUDA, and a test that
leaves torch's default dtype changed fails without changing the tests after it.

With ``OMNITRACE_FORBID_SKIPS=1`` (set by the CI tiers, which install everything their tests
need) any skip other than a GPU test's is reported as a failure, so a tier whose set-up
step went missing fails instead of passing on skipped tests.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Generator, Iterator
from typing import Any

import pytest
import torch

from omnitrace import EventBus

FORBID_SKIPS = os.environ.get("OMNITRACE_FORBID_SKIPS", "") == "1"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def _forbid(report: pytest.TestReport | pytest.CollectReport) -> None:
    if report.skipped and not hasattr(report, "wasxfail"):
        reason = report.longrepr[-1] if isinstance(report.longrepr, tuple) else report.longrepr
        report.outcome = "failed"
        report.longrepr = f"skipped, but OMNITRACE_FORBID_SKIPS=1 forbids skips: {reason}"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, Any, None]:
    outcome = yield
    if FORBID_SKIPS and "gpu" not in item.keywords:
        _forbid(outcome.get_result())


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(
    collector: pytest.Collector,
) -> Generator[None, Any, None]:
    outcome = yield
    if FORBID_SKIPS:
        _forbid(outcome.get_result())


@pytest.fixture
def bus() -> Iterator[EventBus]:
    """An event bus, closed after the test."""
    b = EventBus()
    yield b
    b.close()


@contextlib.contextmanager
def default_dtype_kept() -> Iterator[None]:
    """Fail if the block leaves torch's default dtype changed, after restoring it.

    vLLM 0.26's ``set_default_torch_dtype`` restores the dtype only when its block returns:
    a test that raised inside it would leave bf16 behind, and every later test that makes
    tensors without a dtype would fail with it, hiding which test broke.
    """
    before = torch.get_default_dtype()
    try:
        yield
    except BaseException:
        torch.set_default_dtype(before)
        raise
    after = torch.get_default_dtype()
    if after != before:
        torch.set_default_dtype(before)
        pytest.fail(f"the test left torch's default dtype at {after}; restored {before}")


@pytest.fixture(autouse=True)
def _default_dtype_kept() -> Iterator[None]:
    with default_dtype_kept():
        yield
