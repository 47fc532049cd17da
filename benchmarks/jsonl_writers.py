"""The JSONL event-log sink under several writers of one path, and the cost of a rotation.

Not part of a suite: a probe of two promises of :mod:`omnitrace.sinks.jsonl`, run by hand::

    python -m benchmarks.jsonl_writers writers [--writers 6] [--events 4000] [--max-bytes 50000]
    python -m benchmarks.jsonl_writers rotation [--backups 3,10000,100000]

``writers`` starts that many processes at ``events-{rank}.jsonl``, all rank 0 (one file for
all of them, as a misconfigured or data-parallel deployment has), each emitting its events
with ids of its own through an :class:`~omnitrace.EventBus` into a
:class:`~omnitrace.sinks.jsonl.JsonlSink` with enough backups that rotation deletes
nothing. It then reads every file back line by line (with :mod:`json`, not omnitrace's
reader) and reconciles each writer's ids: read back, duplicated, missing, against what its bus
counted as delivered and dropped; and it reports the largest file against ``max_bytes``.

``rotation`` times a rotation (one event per ``handle`` call, each starting a new file) with
about 20 files present, for each number of backups.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

CHILD = """
import json, sys
from omnitrace import EventBus, GraphReplayed
from omnitrace.signature import Signature
from omnitrace.sinks.jsonl import JsonlSink

template, writer, events, max_bytes, backups = sys.argv[1:6]
key = Signature.parse("float32[1,1024,1152]")
print("ready", flush=True)
sys.stdin.readline()
try:
    sink = JsonlSink(template, max_bytes=int(max_bytes), backups=int(backups), rank=0)
except Exception as exc:
    print(json.dumps({"refused": f"{type(exc).__name__}: {exc}"}), flush=True)
    sys.exit(0)
bus = EventBus(sinks=[sink], queue_size=1_000_000, drain_interval=0.002)
for i in range(int(events)):
    bus.emit(GraphReplayed(f"w{writer}", key, i, i, 0.0))
bus.close(timeout=30.0)
(stats,) = bus.statistics().sinks
print(json.dumps({
    "delivered": stats.delivered,
    "dropped_by": dict(stats.dropped_by),
    "disabled": stats.disabled,
    "error": stats.error,
}), flush=True)
"""


def _read_back(folder: Path) -> tuple[dict[str, list[int]], int, int]:
    """Every event id per adapter in the files of ``folder``, unreadable lines, largest file."""
    ids: dict[str, list[int]] = {}
    bad = 0
    largest = 0
    for file in sorted(folder.iterdir()):
        base, _, suffix = file.name.partition(".jsonl")
        if base != "events-0" or not (suffix == "" or suffix[1:].isdigit()):
            continue
        largest = max(largest, file.stat().st_size)
        for line in file.read_bytes().splitlines():
            try:
                record = json.loads(line)
            except ValueError:
                bad += 1
                continue
            if record.get("type") == "GraphReplayed":
                ids.setdefault(record["adapter"], []).append(record["monotonic_ns"])
    return ids, bad, largest


def writers(count: int, events: int, max_bytes: int, backups: int) -> dict[str, Any]:
    """Run ``count`` writers of one path; return what each reported and what was read back."""
    with tempfile.TemporaryDirectory(prefix="omnitrace-writers-") as tmp:
        folder = Path(tmp)
        template = str(folder / "events-{rank}.jsonl")
        args = [template, "", str(events), str(max_bytes), str(backups)]
        procs = []
        for writer in range(count):
            args[1] = str(writer)
            procs.append(
                subprocess.Popen(
                    [sys.executable, "-c", CHILD, *args],
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    text=True,
                )
            )
        for proc in procs:
            assert proc.stdout is not None
            assert proc.stdout.readline() == "ready\n"
        start = time.monotonic()
        for proc in procs:
            assert proc.stdin is not None
            proc.stdin.write("go\n")
            proc.stdin.flush()
        reports = []
        for proc in procs:
            out, err = proc.communicate(timeout=300)
            reports.append({"report": json.loads(out.splitlines()[-1]), "stderr": err})
        took = time.monotonic() - start
        ids, bad, largest = _read_back(folder)
        files = len(list(folder.iterdir()))
    rows = []
    for writer, entry in enumerate(reports):
        report = entry["report"]
        got = ids.get(f"w{writer}", [])
        distinct = set(got)
        rows.append(
            {
                "writer": writer,
                **report,
                "read_back": len(got),
                "duplicated": len(got) - len(distinct),
                "missing": events - len(distinct),
                "stderr_lines": [line for line in entry["stderr"].splitlines() if line][:3],
            }
        )
    return {
        "writers": count,
        "events_each": events,
        "max_bytes": max_bytes,
        "backups": backups,
        "seconds": round(took, 2),
        "files": files,
        "largest_file": largest,
        "unreadable_lines": bad,
        "per_writer": rows,
    }


def rotation(backups: int, present: int = 20, timed: int = 40) -> dict[str, Any]:
    """Time rotations of a sink keeping ``backups`` files once ``present`` files exist."""
    from omnitrace import GraphReplayed
    from omnitrace.signature import Signature
    from omnitrace.sinks.jsonl import JsonlSink

    key = Signature.parse("float32[1,1024,1152]")
    with tempfile.TemporaryDirectory(prefix="omnitrace-rotation-") as tmp:
        path = Path(tmp) / "events.jsonl"
        # Room for the header and one event line: every later event starts a new file.
        probe = JsonlSink(path, max_bytes=0, fresh=True)
        probe.handle([GraphReplayed("vision", key, 10**12, 10**12, 0.0)])
        probe.close()
        line = path.stat().st_size
        sink = JsonlSink(path, max_bytes=line + 16, backups=backups, fresh=True)
        try:
            for i in range(present):
                sink.handle([GraphReplayed("vision", key, 10**12 + i, 10**12, 0.0)])
            before = sink.rotations
            start = time.perf_counter()
            for i in range(timed):
                sink.handle([GraphReplayed("vision", key, 2 * 10**12 + i, 10**12, 0.0)])
            took = time.perf_counter() - start
            rotations = sink.rotations - before
        finally:
            sink.close()
        files = len(os.listdir(tmp))
    return {
        "backups": backups,
        "files_present": files,
        "rotations": rotations,
        "ms_per_rotation": round(took / max(rotations, 1) * 1000, 3),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="what", required=True)
    w = sub.add_parser("writers")
    w.add_argument("--writers", type=int, default=6)
    w.add_argument("--events", type=int, default=4000)
    w.add_argument("--max-bytes", type=int, default=50_000)
    w.add_argument("--backups", type=int, default=1000)
    r = sub.add_parser("rotation")
    r.add_argument("--backups", default="3,10000,100000")
    options = parser.parse_args()
    # Rotation with few backups deletes files, and says so on every rotation.
    logging.getLogger("omnitrace.sinks.jsonl").setLevel(logging.ERROR)
    if options.what == "writers":
        result = writers(options.writers, options.events, options.max_bytes, options.backups)
        print(json.dumps(result, indent=1))
    else:
        for backups in options.backups.split(","):
            print(json.dumps(rotation(int(backups))))


if __name__ == "__main__":
    main()
