"""Identify the serving worker process that emits events."""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping

from omnitrace._worker import launcher_rank

__all__ = ["worker_identity"]


def _vllm_rank() -> int | None:
    # Only ask vLLM when this process already imported its parallel state: importing vLLM
    # just to learn a rank would cost seconds in processes that are not vLLM workers.
    state = sys.modules.get("vllm.distributed.parallel_state")
    if state is None:
        return None
    try:
        if state.model_parallel_is_initialized():
            return int(state.get_world_group().rank)
    except Exception:  # an uninitialised or changed vLLM API: the rank is just unknown
        return None
    return None


def worker_identity(environ: Mapping[str, str] | None = None) -> tuple[int, int | None]:
    """Return ``(pid, rank)`` of this process; rank is None when nothing names it.

    The rank comes from ``RANK``, then ``LOCAL_RANK``, then vLLM's distributed world group
    when this process has initialised it.

    Raises:
        ConfigError: a rank variable is set to something other than a nonnegative integer.
    """
    rank = launcher_rank(environ)
    if rank is None:
        rank = _vllm_rank()
    return os.getpid(), rank
