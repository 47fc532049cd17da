"""The worker rank, read once, the same way everywhere (event log, OTel resource, plugin)."""

from __future__ import annotations

import os
from collections.abc import Mapping

from omnitrace.errors import ConfigError

__all__ = ["RANK_VARIABLES", "env_rank", "launcher_rank", "worker_rank"]

#: Variables launchers (torchrun, vLLM's executors) set on each worker, in the order read.
RANK_VARIABLES = ("RANK", "LOCAL_RANK")


def env_rank(name: str, environ: Mapping[str, str] | None = None) -> int | None:
    """Return the rank in variable ``name``; None when it is unset or empty.

    Raises:
        ConfigError: the variable is set to something other than a nonnegative integer.
    """
    env = os.environ if environ is None else environ
    raw = env.get(name, "").strip()
    if not raw:
        return None
    if not raw.isascii() or not raw.isdigit() or len(raw) > 18:
        raise ConfigError(f"{name}: expected a nonnegative integer, got {raw[:40]!r}")
    return int(raw)


def launcher_rank(environ: Mapping[str, str] | None = None) -> int | None:
    """Return the rank from ``RANK``, else ``LOCAL_RANK``; None when neither is set.

    Raises:
        ConfigError: a set variable is not a nonnegative integer.
    """
    for name in RANK_VARIABLES:
        rank = env_rank(name, environ)
        if rank is not None:
            return rank
    return None


def worker_rank(environ: Mapping[str, str] | None = None) -> int:
    """Return the rank from ``RANK``, else ``LOCAL_RANK``, else 0 (a single process).

    Raises:
        ConfigError: a set variable is not a nonnegative integer.
    """
    return launcher_rank(environ) or 0
