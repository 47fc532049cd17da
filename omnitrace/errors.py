"""The errors omnitrace raises on purpose: ``OmnitraceError`` and its subclasses, each also the
builtin error a caller would catch (docs/architecture.md, "The core", draws the whole tree)."""

from __future__ import annotations

from omnitrace._display import safe

__all__ = ["ConfigError", "EncoderGraphFailedError", "MissingExtraError", "OmnitraceError"]


class OmnitraceError(Exception):
    """Base class of every error omnitrace raises on purpose."""


class ConfigError(OmnitraceError, ValueError):
    """A configuration value is missing, of the wrong type or out of range.

    Its message is one line: a control character in it (a new line in a key, an ESC in a
    path) is shown as an escape, so a log line or a terminal shows the whole error intact.

    Args:
        *args: as for ValueError; a single string argument is the message, made safe.
    """

    def __init__(self, *args: object) -> None:
        if len(args) == 1 and isinstance(args[0], str):
            args = (safe(args[0]),)
        super().__init__(*args)


class EncoderGraphFailedError(OmnitraceError, RuntimeError):
    """The adapter is terminal: an earlier CUDA graph capture failed."""


class MissingExtraError(OmnitraceError, ImportError):
    """A feature that was asked for needs an optional dependency (an extra) not installed.

    Its message says what to install; the command line prints it as one line, since the
    traceback of the failed import says nothing more to an operator.
    """
