"""Make omnitrace's log lines visible in a vLLM process, next to vLLM's own and in its format,
unless the host configured logging itself (docs/vllm.md, "Environment")."""

from __future__ import annotations

import logging
import sys
from collections.abc import Mapping

__all__ = ["show_plugin_logs"]

#: The logger every omnitrace module's logger descends from.
ROOT = "omnitrace"
_MARK = "_omnitrace_vllm_handler"


def show_plugin_logs(environ: Mapping[str, str]) -> logging.Handler | None:
    """Give the ``omnitrace`` logger a handler like vLLM's, once per process.

    Returns:
        The handler added, or None where logging is the host's (``VLLM_CONFIGURE_LOGGING=0``,
        or the root logger has handlers) or the ``omnitrace`` logger already has one.
    """
    if environ.get("VLLM_CONFIGURE_LOGGING", "1") == "0":
        return None
    logger = logging.getLogger(ROOT)
    if logger.handlers or logging.getLogger().handlers:
        return None
    template = next(
        (h for h in logging.getLogger("vllm").handlers if isinstance(h, logging.StreamHandler)),
        None,
    )
    handler = logging.StreamHandler(sys.stdout if template is None else template.stream)
    if template is not None and template.formatter is not None:
        handler.setFormatter(template.formatter)
    else:
        handler.setFormatter(
            logging.Formatter("%(levelname)s %(asctime)s %(message)s", "%m-%d %H:%M:%S")
        )
    setattr(handler, _MARK, True)
    logger.addHandler(handler)
    if logger.level == logging.NOTSET:
        logger.setLevel(logging.INFO)
    # The root logger has no handler (checked above), so nothing else would print these.
    logger.propagate = False
    return handler
