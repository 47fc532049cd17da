"""torch.compile around captured forwards: the compiled forward, made once per adapter, and
the lock its tracing needs."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["compile_forward", "compile_lock"]

logger = logging.getLogger(__name__)


def _recompile_limit() -> int | None:
    config = getattr(getattr(torch, "_dynamo", None), "config", None)
    for name in ("recompile_limit", "cache_size_limit"):
        value = getattr(config, name, None)
        if isinstance(value, int):
            return value
    return None


def compile_forward(
    forward: Callable[..., Any], *, name: str, max_graphs: int
) -> Callable[..., Any]:
    """Return ``torch.compile(forward)`` for adapter ``name``, which may capture ``max_graphs``.

    Logs a warning when torch.compile would stop recompiling before the last shape.
    """
    # Default mode: inductor's fused kernels and no CUDA graphs of its own, since the
    # adapter captures them, one graph per exact shape.
    compiled = torch.compile(forward, dynamic=False)
    limit = _recompile_limit()
    if limit is not None and max_graphs > limit:
        logger.warning(
            "omnitrace: %r may capture %d compiled shapes but torch.compile recompiles "
            "a forward at most %d times; later shapes are captured from the uncompiled "
            "kernels (correct, not fused). Raise torch._dynamo.config.recompile_limit "
            "to compile them all.",
            name,
            max_graphs,
            limit,
        )
    return compiled


def compile_lock(compiled: bool) -> contextlib.AbstractContextManager[Any]:
    """With a compiled forward, torch.compile's own lock, to hold around warm-up and capture.

    torch.compile's tracing state is process-wide: a compiled forward called while another
    thread traces or compiles raises ("using FX to symbolically trace a dynamo-optimized
    function"). Holding dynamo's compile lock makes the two wait for each other instead.
    """
    if not compiled:
        return contextlib.nullcontext()
    convert_frame = getattr(getattr(torch, "_dynamo", None), "convert_frame", None)
    lock = getattr(convert_frame, "compile_lock", None)
    return lock if lock is not None else contextlib.nullcontext()
