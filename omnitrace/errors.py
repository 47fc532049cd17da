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

__all__ = ["ConfigError", "EncoderGraphFailedError", "OmnitraceError"]


class OmnitraceError(Exception):
    """Base class of every error omnitrace raises on purpose."""


class ConfigError(OmnitraceError, ValueError):
    """A configuration value is missing, of the wrong type or out of range."""


class EncoderGraphFailedError(OmnitraceError, RuntimeError):
    """The adapter is terminal: an earlier CUDA graph capture failed."""
