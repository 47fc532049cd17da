"""omnitrace: fast, observable exact-shape CUDA graphs for multimodal encoders.

Its public names load on first access, so ``import omnitrace`` never imports torch."""

from __future__ import annotations

from typing import TYPE_CHECKING

from omnitrace._lazy import lazy_getattr
from omnitrace._version import __version__

if TYPE_CHECKING:
    from omnitrace.bus import BusStatistics, EventBus, Sink, SinkStatistics
    from omnitrace.config import (
        ConfigError,
        EncoderGraphConfig,
        EncoderGraphFailedError,
        OmnitraceError,
    )
    from omnitrace.coverage import AdapterCoverage, CoverageFold, KeyCoverage, derive_coverage
    from omnitrace.events import (
        CaptureFailed,
        Event,
        GraphCaptured,
        GraphMissed,
        GraphReplayed,
        MemoryDeferred,
        MissReason,
    )
    from omnitrace.graphs.adapter import EncoderCudaGraph
    from omnitrace.stats import STATS_KEYS, AdapterStats, StatsFold, derive_stats

#: Where each public name lives; a name is imported from there when first asked for.
_MODULE_OF: dict[str, str] = {
    "AdapterCoverage": "omnitrace.coverage",
    "AdapterStats": "omnitrace.stats",
    "BusStatistics": "omnitrace.bus",
    "CaptureFailed": "omnitrace.events",
    "ConfigError": "omnitrace.config",
    "CoverageFold": "omnitrace.coverage",
    "EncoderCudaGraph": "omnitrace.graphs.adapter",
    "EncoderGraphConfig": "omnitrace.config",
    "EncoderGraphFailedError": "omnitrace.config",
    "Event": "omnitrace.events",
    "EventBus": "omnitrace.bus",
    "GraphCaptured": "omnitrace.events",
    "GraphMissed": "omnitrace.events",
    "GraphReplayed": "omnitrace.events",
    "KeyCoverage": "omnitrace.coverage",
    "MemoryDeferred": "omnitrace.events",
    "MissReason": "omnitrace.events",
    "OmnitraceError": "omnitrace.config",
    "STATS_KEYS": "omnitrace.stats",
    "Sink": "omnitrace.bus",
    "SinkStatistics": "omnitrace.bus",
    "StatsFold": "omnitrace.stats",
    "derive_coverage": "omnitrace.coverage",
    "derive_stats": "omnitrace.stats",
}

__all__ = [
    "AdapterCoverage",
    "AdapterStats",
    "BusStatistics",
    "CaptureFailed",
    "ConfigError",
    "CoverageFold",
    "EncoderCudaGraph",
    "EncoderGraphConfig",
    "EncoderGraphFailedError",
    "Event",
    "EventBus",
    "GraphCaptured",
    "GraphMissed",
    "GraphReplayed",
    "KeyCoverage",
    "MemoryDeferred",
    "MissReason",
    "OmnitraceError",
    "STATS_KEYS",
    "Sink",
    "SinkStatistics",
    "StatsFold",
    "__version__",
    "derive_coverage",
    "derive_stats",
]


__getattr__ = lazy_getattr(__name__, globals(), _MODULE_OF)


def __dir__() -> list[str]:
    dunders = (name for name in globals() if name.startswith("__") and name.endswith("__"))
    return sorted({*__all__, *dunders})
