"""Per-signature coverage: the fold over the events (:mod:`~omnitrace.coverage.fold`) and the
frozen coverage it returns, with the questions asked of it (:mod:`~omnitrace.coverage.snapshot`:
top missed signatures, the encoder summary, eager loss). This face hands both on."""

from __future__ import annotations

from omnitrace.coverage.fold import (
    DEFAULT_COVERAGE_KEYS,
    MAX_COVERAGE_KEYS,
    CoverageFold,
    derive_coverage,
)
from omnitrace.coverage.snapshot import (
    GRAPHABLE_REASONS,
    AdapterCoverage,
    CallCounts,
    EagerLoss,
    KeyCoverage,
    ProfilingRuns,
    Timing,
    encoder_summary,
)

__all__ = [
    "DEFAULT_COVERAGE_KEYS",
    "GRAPHABLE_REASONS",
    "MAX_COVERAGE_KEYS",
    "AdapterCoverage",
    "CallCounts",
    "CoverageFold",
    "EagerLoss",
    "KeyCoverage",
    "ProfilingRuns",
    "Timing",
    "derive_coverage",
    "encoder_summary",
]
