"""omnitrace: fast, observable exact-shape CUDA graphs for multimodal encoders."""

from omnitrace.bus import BusStatistics, EventBus, Sink, SinkStatistics
from omnitrace.config import (
    ConfigError,
    EncoderGraphConfig,
    EncoderGraphFailedError,
    OmnitraceError,
)
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

__version__ = "0.1.0"

__all__ = [
    "AdapterStats",
    "BusStatistics",
    "CaptureFailed",
    "ConfigError",
    "EncoderCudaGraph",
    "EncoderGraphConfig",
    "EncoderGraphFailedError",
    "Event",
    "EventBus",
    "GraphCaptured",
    "GraphMissed",
    "GraphReplayed",
    "MemoryDeferred",
    "MissReason",
    "OmnitraceError",
    "STATS_KEYS",
    "Sink",
    "SinkStatistics",
    "StatsFold",
    "__version__",
    "derive_stats",
]
