"""torch.compile around captured forwards: the compiled forward, made once per adapter, and
the lock its tracing needs."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["compile_forward", "compile_lock", "recompile_limit_at_least"]

logger = logging.getLogger(__name__)


def _limit_name() -> str | None:
    """The name of dynamo's per-function recompile limit in this PyTorch, None without one."""
    config = getattr(getattr(torch, "_dynamo", None), "config", None)
    for name in ("recompile_limit", "cache_size_limit"):
        if isinstance(getattr(config, name, None), int):
            return name
    return None


def recompile_limit_at_least(entries: int) -> contextlib.AbstractContextManager[Any]:
    """Raise dynamo's per-function recompile limit to ``entries`` while inside, if lower.

    dynamo compiles one function for at most ``recompile_limit`` (8 by default) sets of
    guards; past it a new shape runs uncompiled, with a warning. The config is process-wide:
    hold :func:`compile_lock` around it, as the adapter's warm-ups and captures do, so no
    other compile reads the raised value.

    Args:
        entries: the number of compiled entries the function may need.
    """
    name = _limit_name()
    if name is None or getattr(torch._dynamo.config, name) >= entries:
        return contextlib.nullcontext()
    patch: contextlib.AbstractContextManager[Any] = torch._dynamo.config.patch({name: entries})
    return patch


def compile_forward(
    forward: Callable[..., Any], *, name: str, max_graphs: int
) -> Callable[..., Any]:
    """Return ``torch.compile(forward)`` for adapter ``name``, wrapped so that it compiles
    each shape the adapter captures, up to ``max_graphs``.

    Admission bounds the shapes an adapter captures, so dynamo's own bound on recompiles
    (8 by default, far below the default cap of 32 graphs) is raised around each call of
    the compiled forward: without that, the ninth shape and later would be captured from
    the uncompiled kernels. A shape may take two entries: its warm-up on a preparation
    thread and its capture on the caller's thread may differ in a thread-local mode that
    dynamo guards on.

    Args:
        forward: the encoder's forward.
        name: the adapter's name (for its log lines).
        max_graphs: the most graphs the adapter may capture.
    """
    # Default mode: inductor's fused kernels and no CUDA graphs of its own, since the
    # adapter captures them, one graph per exact shape.
    compiled = torch.compile(forward, dynamic=False)
    entries = 2 * max_graphs
    overall = getattr(torch._dynamo.config, "accumulated_recompile_limit", None)
    if isinstance(overall, int) and entries > overall:
        logger.warning(
            "omnitrace: %r may capture %d compiled shapes but torch.compile compiles at most "
            "%d entries in a process; later shapes are captured from the uncompiled kernels "
            "(correct, not fused). Raise torch._dynamo.config.accumulated_recompile_limit "
            "to compile them all.",
            name,
            max_graphs,
            overall,
        )

    def call(*args: Any, **kwargs: Any) -> Any:
        # Called under compile_lock only (captures and compiling warm-ups hold it).
        with recompile_limit_at_least(entries):
            return compiled(*args, **kwargs)

    return call


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
