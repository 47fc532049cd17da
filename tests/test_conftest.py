"""The shared fixtures' own checks."""

from __future__ import annotations

import pytest
import torch
from conftest import default_dtype_kept


def _leave(dtype: torch.dtype, *, raise_inside: bool = False) -> None:
    with default_dtype_kept():
        torch.set_default_dtype(dtype)
        if raise_inside:
            raise RuntimeError("raised inside")


def test_a_changed_default_dtype_fails_the_test_and_is_restored() -> None:
    """Leaving bf16 as the default fails, and the next test starts from the dtype it found;
    a block that raised keeps its own error; one that put the dtype back passes."""
    before = torch.get_default_dtype()
    with pytest.raises(pytest.fail.Exception, match=r"default dtype at torch\.bfloat16"):
        _leave(torch.bfloat16)
    assert torch.get_default_dtype() == before
    with pytest.raises(RuntimeError, match="raised inside"):
        _leave(torch.float64, raise_inside=True)
    assert torch.get_default_dtype() == before
    with default_dtype_kept():
        torch.set_default_dtype(torch.float64)
        torch.set_default_dtype(before)
    assert torch.randn(1).dtype == before
