"""Recorded event logs read whole, for ``top``, ``replay`` and ``advise``."""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from omnitrace.cli.output import _error

if TYPE_CHECKING:
    from omnitrace.eventlog import EventRecord

__all__ = ["_merged", "_read_logs"]


def _read_logs(command: str, paths: Sequence[Path]) -> list[list[EventRecord]] | int:
    """Read each log whole; on a bad path return the exit status after a one-line error."""
    from omnitrace.eventlog import EventLogError, read_records

    logs: list[list[EventRecord]] = []
    for path in paths:
        try:
            logs.append(list(read_records(path)))
        except (FileNotFoundError, EventLogError) as exc:
            return _error(command, str(exc))
        except OSError as exc:
            return _error(command, f"{path}: {exc.strerror or exc}")
    if not any(logs):
        names = ", ".join(str(p) for p in paths)
        return _error(command, f"{names}: no events in the event log", status=1)
    return logs


def _merged(logs: Sequence[Sequence[EventRecord]]) -> list[EventRecord]:
    """Merge several logs in time order (adapter facts first), each log's order kept."""
    from omnitrace.eventlog import AdapterInfo

    infos = [r for log in logs for r in log if isinstance(r.item, AdapterInfo)]
    events = [[r for r in log if not isinstance(r.item, AdapterInfo)] for log in logs]
    return [*infos, *heapq.merge(*events, key=lambda r: r.item.epoch_ns)]  # type: ignore[union-attr]
