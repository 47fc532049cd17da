"""Write the event logs of this folder and record what the commands print for them.

The outputs (``expected.tar.xz``) were recorded with the readers, ``top``, ``replay`` and
``advise`` as they were before they streamed (omnitrace at 5439577, with the multi-rank
commands: `advise --json` has `per_worker`), so
``tests/test_eventlog_equal.py`` can check that the streaming ones print the same. One
change since: `top --json` gained its `requests` panel (the per-request TTFT table, empty in
these logs, which hold no request events), then each encoder's `miss_details` (its misses by
reason and detail); each time its recorded output is the old one with that key added, checked
to differ in nothing else. Then the summary, `top --json` and `replay --json` came to share one
encoder summary: `replay --json` gained the fields `top` had (and `otlp_endpoints`), `top
--json` lists `backend` after `max_graphs`, and `replay` lists each worker's encoders
together, vision first; those three outputs were recorded again, checked to differ in nothing
else (every other output is still the one of 5439577). Then `advise --json` gained
`requests` (each request kind's TTFT under the recommended setting, empty in these logs): its
recorded outputs are the old ones with that key added, checked to differ in nothing else. Then
the misses' details moved into the shared encoder summary: `replay --json` gained each
encoder's `miss_details` (`top --json` printed them already, and prints the same), recorded
as the old outputs with that key added, checked to differ in nothing else. Then `advise`
gained a note counting the recommended setting's warm-up calls: its outputs are the old ones
with that note added, checked to differ in nothing else. Then `advise` took a key's eager
time from its calls after the first (a worker's first call of an encoder never), and gained
a `seldom shapes:` note: its outputs were recorded again and checked, setting by setting, to
differ only in the time saved, the order of settings the saving ranks alike (the
recommendation is the same in every scenario) and the notes. Then `advise` gained an
`ineligible:` note (the calls no setting can graph, and the recommended setting's hit rate
without them): its outputs are the old ones with that note added, checked to differ in
nothing else. Then `advise` gained a `memory:` note (how much more device-free memory would
let the recommended setting graph the calls it leaves eager under its floor): its outputs
are the old ones with that note added, checked to differ in nothing else. Then the
`warm-up:` note of `advise` gained what the captures logged while serving held up their calls
(count, seconds in all, the longest): its outputs are the old ones with that clause added,
checked to differ in nothing else. Run it from the repository root with the omnitrace to
record:

    python tests/data/eventlog/make.py logs       # rewrite logs.tar.xz (changes the outputs)
    python tests/data/eventlog/make.py outputs    # record the outputs of this omnitrace

Each log is built to reach a part of the format: the demo's own log, two writers in one
file, rotated files with segment headers, torn, unreadable and blank lines, schema-1 lines,
odd values (NaN and integer times, skipped profiling, background warm-ups, a failed
capture), and two logs read together.
"""

from __future__ import annotations

import heapq
import io
import json
import subprocess
import sys
import tarfile
import tempfile
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[2]
#: The logs, packed (they compress tenfold); :func:`unpack` lays them out in a folder.
ARCHIVE = HERE / "logs.tar.xz"
#: What the commands printed, one JSON member per scenario (see :func:`expected`).
EXPECTED = HERE / "expected.tar.xz"

#: Each scenario: the logs the commands read (paths inside the archive).
SCENARIOS: dict[str, list[str]] = {
    "demo": ["demo.jsonl"],
    "two_writers": ["two-writers.jsonl"],
    "rotated": ["rotated/events.jsonl"],
    "damaged": ["damaged.jsonl"],
    "schema1": ["schema1.jsonl"],
    "odd_values": ["odd-values.jsonl"],
    "two_logs": ["worker-a.jsonl", "worker-b.jsonl"],
}

#: Each command and its arguments after the command name (the logs follow).
COMMANDS: dict[str, list[str]] = {
    "top_json": ["top", "--json"],
    "replay_json": ["replay", "--json"],
    "replay_table": ["replay"],
    "advise_json": ["advise", "--json"],
    "advise_table": ["advise"],
    "advise_free_json": ["advise", "--json", "--free-bytes", "1500MiB"],
}


def _traffic(events: int, seed: int) -> list[Any]:
    sys.path.insert(0, str(ROOT))
    from benchmarks.eventlog_traffic import traffic_events

    return list(traffic_events(events, seed))


def _lines(events: Iterable[Any], pid: int, rank: int) -> list[bytes]:
    from omnitrace.eventlog import LineEncoder

    encode = LineEncoder(pid=pid, rank=rank)
    return [encode(event) for event in events]


def _info(adapter: str, pid: int, rank: int, **info: Any) -> bytes:
    from omnitrace.eventlog import INFO_TYPE, SCHEMA_VERSION, dumps

    facts = {"max_graphs": 16, "min_capture_calls": 2, "min_free_bytes": 1 << 30}
    facts.update(info)
    record = {"v": SCHEMA_VERSION, "type": INFO_TYPE, "pid": pid, "rank": rank}
    return dumps({**record, "adapter": adapter, "info": facts})


def _segment(before: int, deleted: int) -> bytes:
    from omnitrace.eventlog import SCHEMA_VERSION, SEGMENT_TYPE, dumps

    record = {"v": SCHEMA_VERSION, "type": SEGMENT_TYPE}
    return dumps({**record, "events_before": before, "events_deleted": deleted})


def _infos(pid: int, rank: int) -> list[bytes]:
    return [_info(name, pid, rank) for name in ("vision", "audio")]


def _demo(path: Path) -> None:
    subprocess.run(
        [
            sys.executable,
            "-m",
            "omnitrace",
            "demo",
            "--cpu",
            "--no-tui",
            "--requests",
            "500",
            "--profiling-runs",
            "1",
            "--sim-free-mib",
            "1700",
            "--events-log",
            str(path),
            "--log-file",
            str(path.with_suffix(".log")),
        ],
        check=True,
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
    )
    path.with_suffix(".log").unlink()


def _merged(*streams: list[Any]) -> Iterator[tuple[Any, int]]:
    tagged = [
        [(event.epoch_ns, i, n, event) for n, event in enumerate(s)] for i, s in enumerate(streams)
    ]
    for _, index, _, event in heapq.merge(*tagged):
        yield event, index


def _two_writers(path: Path) -> None:
    from omnitrace.eventlog import LineEncoder

    encoders = [LineEncoder(pid=100, rank=0), LineEncoder(pid=101, rank=1)]
    lines = _infos(100, 0) + _infos(101, 1)
    for event, index in _merged(_traffic(1600, 1), _traffic(1600, 2)):
        lines.append(encoders[index](event))
    path.write_bytes(b"".join(lines))


def _rotated(folder: Path) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    lines = _lines(_traffic(3300, 3)[1500:], pid=200, rank=0)
    parts = [lines[:600], lines[600:1200], lines[1200:]]
    # The oldest surviving file began after 1500 events, 1500 of them deleted by rotation.
    for name, before, part in zip(
        ("events.jsonl.2", "events.jsonl.1", "events.jsonl"), (1500, 2100, 2700), parts, strict=True
    ):
        head = [_segment(before, 1500), *_infos(200, 0)]
        (folder / name).write_bytes(b"".join(head + part))


def _damaged(path: Path) -> None:
    lines = _infos(300, 0) + _lines(_traffic(1800, 4), pid=300, rank=0)
    lines.insert(40, b'{"v": 2, "type": "GraphRepl\n')  # a writer crashed mid-line
    lines.insert(41, b"\n")
    lines.insert(700, b"   \n")
    lines.insert(1000, b"not json at all\n")
    lines.insert(1300, _segment(0, 0))  # a header where a file began: not an event
    lines.append(b'{"v":2,"type":"GraphReplayed","pid":300,"rank":0,"key":"bf')  # torn last
    path.write_bytes(b"".join(lines))


def _schema1(path: Path) -> None:
    from omnitrace.eventlog import encode_event

    out = [_info("vision", 400, 0), _info("audio", 400, 0)]
    for event in _traffic(1500, 5):
        record = encode_event(event, pid=400, rank=0)
        record["v"] = 1
        del record["signature"]
        out.append(json.dumps(record).encode() + b"\n")
    path.write_bytes(b"".join(out))


def _odd_values(path: Path) -> None:
    import dataclasses

    from omnitrace import events as ev
    from omnitrace.eventlog import encode_event
    from omnitrace.events import MissReason, Phase

    traffic = _traffic(2000, 6)
    out: list[bytes] = [_info("vision", 500, 2, skip_profiling=True), _info("audio", 500, 2)]
    for n, event in enumerate(traffic):
        record = encode_event(event, pid=500, rank=2)
        if isinstance(event, ev.GraphMissed) and event.phase is Phase.PROFILING:
            # Skipped profiling: kept out of admission, without a stream.
            plain = dataclasses.replace(event.signature, stream=None)
            event = dataclasses.replace(
                event, signature=plain, reason=MissReason.INELIGIBLE, detail="profiling"
            )
            record = encode_event(event, pid=500, rank=2)
        elif isinstance(event, ev.GraphMissed) and event.reason is MissReason.WARMUP and n % 3:
            record["detail"] = "preparing"  # background capture's warm-up
        if n % 97 == 0 and "duration_s" in record:
            record["duration_s"] = None  # a non-finite time the writer wrote as null
        elif n % 89 == 0 and "duration_s" in record:
            record["duration_s"] = 1 + n % 3  # an integer number of seconds
        elif n % 83 == 0 and "device_s" in record:
            record["device_s"] = 0
        out.append(json.dumps(record).encode() + b"\n")
        if n == 1500:
            failed = ev.CaptureFailed(
                "audio",
                event.signature,
                event.monotonic_ns + 1,
                event.epoch_ns + 1,
                "RuntimeError",
                "CUDA error: out of memory",
                "cuda:0",
                94,
            )
            out.append(json.dumps(encode_event(failed, pid=500, rank=2)).encode() + b"\n")
    observed = ev.ProfilingObserved(
        "vision", ev.NO_SIGNATURE, 1, 1, "vllm.profile_run", 3, phase=Phase.PROFILING
    )
    out.insert(3, json.dumps(encode_event(observed, pid=500, rank=2)).encode() + b"\n")
    path.write_bytes(b"".join(out))


def _two_logs(folder: Path) -> None:
    a = _infos(600, 0) + _lines(_traffic(1500, 7), pid=600, rank=0)
    b = _infos(601, 1) + _lines(_traffic(1500, 8), pid=601, rank=1)
    (folder / "worker-a.jsonl").write_bytes(b"".join(a))
    (folder / "worker-b.jsonl").write_bytes(b"".join(b))


def write_logs() -> None:
    """Write every log of :data:`SCENARIOS` anew, into :data:`ARCHIVE`."""
    with tempfile.TemporaryDirectory() as tmp:
        logs = Path(tmp)
        _demo(logs / "demo.jsonl")
        _two_writers(logs / "two-writers.jsonl")
        _rotated(logs / "rotated")
        _damaged(logs / "damaged.jsonl")
        _schema1(logs / "schema1.jsonl")
        _odd_values(logs / "odd-values.jsonl")
        _two_logs(logs)
        with tarfile.open(ARCHIVE, "w:xz") as archive:
            for path in sorted(logs.rglob("*")):
                if path.is_file():
                    archive.add(path, arcname=str(path.relative_to(logs)))


def unpack(folder: Path) -> Path:
    """Lay the logs out in ``folder`` (created); return it."""
    folder.mkdir(parents=True, exist_ok=True)
    with tarfile.open(ARCHIVE, "r:xz") as archive:
        for member in archive.getmembers():
            # Only the plain files this script packed, each inside the folder.
            if not member.isfile() or member.name.startswith(("/", "..")):
                raise ValueError(f"{ARCHIVE}: unexpected member {member.name!r}")
            source = archive.extractfile(member)
            assert source is not None
            target = folder / member.name
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(source.read())
    return folder


def run_command(command: list[str], logs: list[Path]) -> dict[str, Any]:
    """Run ``omnitrace COMMAND LOGS`` in a child and return its exit status and output."""
    done = subprocess.run(
        [sys.executable, "-m", "omnitrace", *command, *map(str, logs)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        check=False,
    )
    return {"status": done.returncode, "stdout": done.stdout, "stderr": done.stderr}


def record_outputs() -> None:
    """Record what every command prints for every scenario, with the log paths relative."""
    with tempfile.TemporaryDirectory() as tmp, tarfile.open(EXPECTED, "w:xz") as archive:
        # Run on a copy at a fixed-length path, so tables are laid out the same wherever
        # the repository is; paths are stored relative to the copy.
        copy = unpack(Path(tmp) / "logs")
        for name, logs in SCENARIOS.items():
            outputs = {}
            for label, command in COMMANDS.items():
                result = run_command(command, [copy / log for log in logs])
                for stream in ("stdout", "stderr"):
                    result[stream] = result[stream].replace(str(copy), "LOGS")
                outputs[label] = result
            text = json.dumps({"logs": logs, "outputs": outputs}, indent=1, sort_keys=True)
            data = text.encode() + b"\n"
            member = tarfile.TarInfo(f"{name}.json")
            member.size = len(data)
            archive.addfile(member, io.BytesIO(data))


def expected() -> dict[str, dict[str, Any]]:
    """Return the recorded outputs: per scenario, its logs and per command its output."""
    out = {}
    with tarfile.open(EXPECTED, "r:xz") as archive:
        for member in archive.getmembers():
            source = archive.extractfile(member)
            assert source is not None
            out[member.name.removesuffix(".json")] = json.loads(source.read())
    return out


if __name__ == "__main__":
    what = sys.argv[1:] or ["logs", "outputs"]
    if "logs" in what:
        write_logs()
    if "outputs" in what:
        record_outputs()
