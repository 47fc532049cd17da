"""The live terminal view: the snapshot and its boards (``model``), the frame's layout
(``layout``, its total across workers ``total``) and the view (``view``). This face hands on
their names on first access, so a board's snapshot (``omnitrace top --json``) loads no rich."""

from __future__ import annotations

from typing import TYPE_CHECKING

from omnitrace._lazy import lazy_getattr

if TYPE_CHECKING:
    from omnitrace._units import format_bytes
    from omnitrace.sinks.live.layout import render
    from omnitrace.sinks.live.model import (
        Board,
        BusBoard,
        EncoderSnapshot,
        LiveSnapshot,
        Notice,
        RecordBoard,
    )
    from omnitrace.sinks.live.view import REFRESH_PER_SECOND, LiveView

__all__ = [
    "REFRESH_PER_SECOND",
    "Board",
    "BusBoard",
    "EncoderSnapshot",
    "LiveSnapshot",
    "LiveView",
    "Notice",
    "RecordBoard",
    "format_bytes",
    "render",
]

_MODULE_OF = {
    "REFRESH_PER_SECOND": "omnitrace.sinks.live.view",
    "Board": "omnitrace.sinks.live.model",
    "BusBoard": "omnitrace.sinks.live.model",
    "EncoderSnapshot": "omnitrace.sinks.live.model",
    "LiveSnapshot": "omnitrace.sinks.live.model",
    "LiveView": "omnitrace.sinks.live.view",
    "Notice": "omnitrace.sinks.live.model",
    "RecordBoard": "omnitrace.sinks.live.model",
    "format_bytes": "omnitrace._units",
    "render": "omnitrace.sinks.live.layout",
}

__getattr__ = lazy_getattr(__name__, globals(), _MODULE_OF)
