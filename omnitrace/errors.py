"""The errors omnitrace raises on purpose.

::

    OmnitraceError
     ├── ConfigError              (also a ValueError)   bad configuration value
     │    └── ... every argument, override and variable check (omnitrace._validate)
     ├── EncoderGraphFailedError  (also a RuntimeError) adapter is terminal after a failed capture
     ├── EventLogError            (also a ValueError)   an event log line cannot be read
     └── UnsupportedVllmError     (also a RuntimeError) vLLM lacks a usable encoder graph API
"""

from __future__ import annotations

from omnitrace._display import safe

__all__ = ["ConfigError", "EncoderGraphFailedError", "OmnitraceError"]


class OmnitraceError(Exception):
    """Base class of every error omnitrace raises on purpose."""


class ConfigError(OmnitraceError, ValueError):
    """A configuration value is missing, of the wrong type or out of range.

    Its message is one line: a control character in it (a new line in a key, an ESC in a
    path) is shown as an escape, so a log line or a terminal shows the whole error intact.
    """

    def __init__(self, *args: object) -> None:
        if len(args) == 1 and isinstance(args[0], str):
            args = (safe(args[0]),)
        super().__init__(*args)


class EncoderGraphFailedError(OmnitraceError, RuntimeError):
    """The adapter is terminal: an earlier CUDA graph capture failed."""
