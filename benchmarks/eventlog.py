"""The event-log tools (top, replay, advise, ``read_events``) on logs of up to ten million
events, each in a child process: wall time, CPU time, peak memory; the sizes and the
``OMNITRACE_BENCH_EVENTLOG_*`` settings are in BENCHMARKS.md, "Event-log tools at scale"."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.common import Context, figure, target
from benchmarks.eventlog_traffic import GENERATOR_VERSION, write_log
from benchmarks.table import Table, bar, columns, measured, ms, verdict

NAME = "eventlog"
NEEDS_CUDA = False

ROOT = Path(__file__).resolve().parents[1]
MB = 10**6
TOOLS = ("top", "replay", "advise", "read_events")
#: Seconds each tool may take at a million events.
LIMITS_1M = {"top": 10.0, "replay": 20.0, "advise": 60.0}
#: Peak resident memory any tool may reach, at ten million events.
MEMORY_LIMIT_MB = 300.0
GOAL = "eventlog_scale"

_READ_EVENTS = (
    "import sys\n"
    "from omnitrace.eventlog import read_events\n"
    "count = 0\n"
    "for _ in read_events(sys.argv[1]):\n"
    "    count += 1\n"
    "print(count)\n"
)
#: Runs a tool (``-m omnitrace`` or ``-c CODE``) and, however it ends, writes its own process
#: image's peak memory (``VmHWM``) to the file named first: a child's ``ru_maxrss`` would count
#: the runner's memory, torch included, held between fork and exec.
_PEAK = (
    "import runpy, sys\n"
    "peak_file, mode, what = sys.argv[1:4]\n"
    "sys.argv = [what, *sys.argv[4:]]\n"
    "try:\n"
    "    if mode == '-m':\n"
    "        runpy.run_module(what, run_name='__main__', alter_sys=True)\n"
    "    else:\n"
    "        exec(compile(what, '<tool>', 'exec'), {'__name__': '__main__'})\n"
    "finally:\n"
    "    with open('/proc/self/status') as status, open(peak_file, 'w') as out:\n"
    "        out.write(''.join(l for l in status if l.startswith('VmHWM')))\n"
)


def _sizes(ctx: Context) -> list[int]:
    if given := os.environ.get("OMNITRACE_BENCH_EVENTLOG_SIZES"):
        return [int(size) for size in given.split(",") if size.strip()]
    return ctx.pick([100_000, 1_000_000, 10_000_000], [20_000, 100_000], [1_000, 4_000])


def _log(size: int, ctx: Context) -> tuple[Path, float | None]:
    """The log of ``size`` events, written now (and the seconds it took) or found."""
    default = Path(tempfile.gettempdir()) / "omnitrace-eventlog-bench"
    folder = Path(os.environ.get("OMNITRACE_BENCH_EVENTLOG_DIR") or default)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"events-{size}-s0-g{GENERATOR_VERSION}.jsonl"
    if path.exists():
        return path, None
    ctx.log(f"  writing {size:,} events to {path}")
    start = time.perf_counter()
    write_log(path, size)
    return path, time.perf_counter() - start


def _command(tool: str, log: Path, peak: Path) -> list[str]:
    wrapper = [sys.executable, "-c", _PEAK, str(peak)]
    if tool == "read_events":
        return [*wrapper, "-c", _READ_EVENTS, str(log)]
    return [*wrapper, "-m", "omnitrace", tool, "--json", str(log)]


def _peak_mb(peak: Path) -> float | None:
    try:
        text = peak.read_text()
    except OSError:
        return None  # no /proc (not Linux): unknown
    fields = text.split()
    return int(fields[1]) * 1024 / MB if len(fields) >= 2 else None


def measure(tool: str, log: Path, root: Path, out: Path) -> dict[str, Any]:
    """Run ``tool`` on ``log`` with the omnitrace of ``root``; stdout goes to ``out``."""
    env = {**os.environ, "PYTHONPATH": str(root)}
    peak = out.with_suffix(".peak")
    peak.unlink(missing_ok=True)
    with out.open("wb") as stdout:
        start = time.perf_counter()
        child = subprocess.Popen(
            _command(tool, log, peak), cwd=root, env=env, stdout=stdout, stderr=subprocess.PIPE
        )
        assert child.stderr is not None
        with child.stderr:
            err = child.stderr.read()
        # wait4, not wait: it also gives the child's CPU time.
        _, status, usage = os.wait4(child.pid, 0)
        wall = time.perf_counter() - start
    child.returncode = os.waitstatus_to_exitcode(status)
    return {
        "tool": tool,
        "status": child.returncode,
        "wall_s": wall,
        "cpu_s": usage.ru_utime + usage.ru_stime,
        "peak_rss_mb": _peak_mb(peak),
        "stderr": err.decode(errors="replace")[-500:],
        "stdout_bytes": out.stat().st_size,
    }


def run(ctx: Context) -> dict[str, Any]:
    """Write the logs, run every tool on each, and check the goals."""
    baseline = os.environ.get("OMNITRACE_BENCH_EVENTLOG_BASELINE")
    baseline_max = int(os.environ.get("OMNITRACE_BENCH_EVENTLOG_BASELINE_MAX", "100000"))
    outputs = ctx.out_dir / "eventlog-outputs"
    outputs.mkdir(parents=True, exist_ok=True)
    rows: list[dict[str, Any]] = []
    logs: list[dict[str, Any]] = []
    for size in _sizes(ctx):
        path, written_s = _log(size, ctx)
        logs.append({"events": size, "bytes": path.stat().st_size, "written_s": written_s})
        logs[-1]["path"] = str(path)
        arms = [("this tree", ROOT)]
        if baseline and size <= baseline_max:
            arms.append(("baseline", Path(baseline).resolve()))
        for tool in TOOLS:
            printed: dict[str, bytes] = {}
            for arm, root in arms:
                out = outputs / f"{tool}-{size}-{arm.replace(' ', '-')}.out"
                row = measure(tool, path, root, out)
                row.update(events=size, arm=arm)
                printed[arm] = out.read_bytes()
                rows.append(row)
                ctx.log(
                    f"  {tool:<11} {size:>10,} events  {arm:<9}  {row['wall_s']:7.1f} s  "
                    f"cpu {row['cpu_s']:7.1f} s  peak {row['peak_rss_mb'] or 0:7.1f} MB"
                    + ("" if row["status"] == 0 else f"  EXIT {row['status']}")
                )
            if len(printed) == 2:
                same = printed["this tree"] == printed["baseline"]
                for row in rows[-2:]:
                    row["same_output"] = same
    result = {"logs": logs, "rows": rows, "load_average": os.getloadavg(), "cpus": os.cpu_count()}
    mine = [r for r in rows if r["arm"] == "this tree"]
    return {**result, "targets": _targets(mine), "figures": _figures(mine)}


def _targets(mine: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The goals' bars, on the runs of this tree (``mine``)."""
    out = []
    at_1m = {r["tool"]: r for r in mine if r["events"] == 1_000_000}
    for tool, limit in LIMITS_1M.items():
        if (row := at_1m.get(tool)) is not None:
            value = row["wall_s"] if row["status"] == 0 else None
            out.append(target(f"{tool} at 1M events", value, "<=", limit, "s", goal=GOAL))
    largest = max((r["events"] for r in mine), default=0)
    for row in (r for r in mine if r["events"] == largest and largest >= 10_000_000):
        name = f"{row['tool']} peak memory at {largest / 1e6:g}M events"
        value = row["peak_rss_mb"] if row["status"] == 0 else None
        out.append(target(name, value, "<=", MEMORY_LIMIT_MB, "MB", goal=GOAL))
    return out


#: What a tool's memory growth means, where it is not flat by design.
_GROWTH_NOTES = {
    "advise": "grows with the calls: the recording keeps each call's key (5 bytes) and each "
    "call's time (8 bytes); the reading itself is flat",
}


def _figures(mine: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for tool in TOOLS:
        runs = sorted((r for r in mine if r["tool"] == tool), key=lambda r: r["events"])
        if len(runs) < 2:
            continue
        small, large = runs[0], runs[-1]
        small_mb, large_mb = small["peak_rss_mb"], large["peak_rss_mb"]
        growth = large_mb / small_mb if small_mb and large_mb else None
        name = f"{tool} peak memory, {large['events']:,} over {small['events']:,} events"
        note = _GROWTH_NOTES.get(tool, "flat: about 1x while the log grows")
        out.append(figure(name, growth, "x", goal=GOAL, note=note))
    for row in (r for r in mine if r["events"] >= 10_000_000):
        name = f"{row['tool']} at {row['events'] / 1e6:g}M events"
        done = row["status"] == 0
        value, note = (row["wall_s"], "completes") if done else (None, f"exit {row['status']}")
        out.append(figure(name, value, "s", goal=GOAL, note=note))
    return out


def tables(result: dict[str, Any]) -> list[Table]:
    """The benchmark's tables: every run, and the goals."""
    sizes = {log["events"]: log["bytes"] for log in result.get("logs", [])}

    def output(row: dict[str, Any]) -> str:
        same = {None: "", True: ", same as baseline", False: ", DIFFERS from baseline"}
        done = "ok" if row["status"] == 0 else f"exit {row['status']}"
        return done + same[row.get("same_output")]

    t = columns(
        "Event-log tools by log size",
        [
            ("tool", lambda r: r["tool"]),
            ("events", lambda r: f"{r['events']:,}"),
            ("log MB", lambda r: f"{sizes.get(r['events'], 0) / MB:,.0f}"),
            ("omnitrace", lambda r: r["arm"]),
            ("wall s", lambda r: f"{r['wall_s']:,.1f}"),
            ("CPU s", lambda r: f"{r['cpu_s']:,.1f}"),
            ("peak RSS MB", lambda r: ms(r["peak_rss_mb"])),
            ("output", output),
        ],
        sorted(result["rows"], key=lambda r: (TOOLS.index(r["tool"]), r["events"])),
    )
    load = result.get("load_average")
    t.note = (
        "Each tool in a child process of its own (`omnitrace TOOL --json LOG`; `read_events` "
        "counts the events of the generator); peak RSS is that process's `VmHWM`. Logs of "
        "MiniCPM-o-shaped traffic written by the writer's codec "
        "(`benchmarks/eventlog_traffic.py`), about two events per encoder call. "
        f"{result.get('cpus', 'n/a')} CPUs; load average at the end "
        + ("n/a" if not load else ", ".join(f"{x:.2f}" for x in load))
        + "."
    )
    goals = Table("Goals (event-log tools at scale)", ["check", "measured", "bar", "verdict"])
    for item in result.get("targets", []):
        goals.rows.append([item["name"], measured(item), bar(item), verdict(item["met"])])
    for item in result.get("figures", []):
        goals.rows.append([item["name"], measured(item), "-", item.get("note") or "reported"])
    return [t, goals]
