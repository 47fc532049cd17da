"""``omnitrace demo --ranks N``: one demo process per rank, as a tensor-parallel engine runs
them, each with its own traffic and event log, followed into one live view."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from rich.console import Console

from omnitrace._files import check_regular, write_regular
from omnitrace._signals import signals_set, sigterm_sets
from omnitrace.demo.run import LOG_STARTED
from omnitrace.eventlog import EventLogFollower
from omnitrace.ranks import totals, totals_json
from omnitrace.sinks.jsonl import worker_log_path
from omnitrace.sinks.live import LiveSnapshot, LiveView, RecordBoard, render

__all__ = ["MAX_RANKS", "RanksResult", "rank_log_path", "run_command", "run_ranks"]

#: Most ranks one demo starts (each is a process with its own torch).
MAX_RANKS = 16
#: Seconds between two reads of the ranks' logs.
POLL_S = 0.1
#: Seconds the ranks get to finish once told to stop, before they are killed.
STOP_GRACE_S = 15.0
_PREFIX = "omnitrace: "
_OWN_SUMMARY = "summary: "


def rank_log_path(path: Path) -> Path:
    """Return the per-rank log path: ``path`` itself when it names ``{rank}`` or ``{pid}``,
    else ``path`` with ``-{rank}`` before its suffix (``events.jsonl``: ``events-{rank}
    .jsonl``), so the ranks never write one file."""
    if "{rank}" in path.name or "{pid}" in path.name:
        return path
    return path.with_name(f"{path.stem}-{{rank}}{path.suffix}")


@dataclass
class _Rank:
    rank: int
    process: subprocess.Popen[str]
    log: Path
    summary: Path
    forwarder: threading.Thread | None = None
    follower: EventLogFollower | None = None
    log_started: threading.Event = field(default_factory=threading.Event)
    """Set once the rank said it (re)created its log: before that the file may still be an
    earlier run's, which a rank replaces only once its settings are read."""


@dataclass
class RanksResult:
    """What the ranks did: the final frame's snapshot and each rank's summary and status."""

    snapshot: LiveSnapshot
    logs: list[Path]
    summaries: list[dict[str, Any] | None]
    """Each rank's ``--json-summary`` (None for a rank that wrote none)."""
    returncodes: list[int]
    interrupted: bool = False
    devices: list[str] = field(default_factory=list)
    """``CUDA_VISIBLE_DEVICES`` of each rank (empty: the simulated backend)."""
    pattern: str = ""
    """The pattern the ranks' logs match (``events-*.jsonl``), for ``omnitrace top``."""

    @property
    def status(self) -> int:
        """The run's exit status: 130 when stopped, else the worst rank's."""
        if self.interrupted:
            return 130
        return max((code if code >= 0 else 1 for code in self.returncodes), default=0)


_STDERR_LINES = threading.Lock()
"""Held while a forwarder writes one line: the ranks' lines reach standard error whole."""


def _forward(rank: _Rank, stream: IO[str]) -> None:
    """Copy a rank's stderr to ours, line by line, until the rank closes it."""
    with stream:
        for line in stream:
            text = _relabel(rank, line.rstrip("\n"))
            if text is not None:
                # One write under the lock: print() writes the text and the newline apart, so
                # two ranks' lines could join into one (two JSON objects on a line).
                with _STDERR_LINES:
                    # Looked up per line: the live view takes sys.stderr over while it is up,
                    # and shows the last lines.
                    out = sys.stderr
                    out.write(f"{text}\n")
                    out.flush()


def _locked(say: Callable[[str], None]) -> Callable[[str], None]:
    """``say`` under the forwarders' lock: a status line of the launcher's own never lands
    inside a rank's forwarded line, nor one of those inside it."""

    def locked(text: str) -> None:
        with _STDERR_LINES:
            say(text)

    return locked


def _relabel(rank: _Rank, text: str) -> str | None:
    """A rank's line as this process prints it: a JSON log line with the rank added, a
    status line prefixed with it; None for a line about the launcher's own scratch file."""
    try:
        record = json.loads(text)
    except ValueError:
        record = None
    if isinstance(record, dict):
        return json.dumps({**record, "rank": rank.rank})
    if not text.startswith(_PREFIX):
        return text
    status = text[len(_PREFIX) :]
    if status.startswith(LOG_STARTED):
        rank.log_started.set()
    if status.startswith(_OWN_SUMMARY):
        return None  # the launcher reads that file and removes it
    return f"{_PREFIX}rank {rank.rank}: {status}"


def _devices(ranks: int, force_cpu: bool) -> list[str] | str:
    """Each rank's ``CUDA_VISIBLE_DEVICES`` (empty: no CUDA), or the error to report."""
    if force_cpu:
        return []
    import torch

    count = torch.cuda.device_count()
    if count == 0:
        return []
    if count < ranks:
        return (
            f"--ranks {ranks} needs {ranks} CUDA devices, one per rank (found {count}); add "
            "--cpu to run the ranks on the simulated backend"
        )
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "").strip()
    names = [name.strip() for name in visible.split(",")] if visible else []
    return [names[r] if r < len(names) else str(r) for r in range(ranks)]


def _start(
    rank: int,
    ranks: int,
    argv: Sequence[str],
    device: str | None,
    summary: Path,
    pattern: Path,
) -> _Rank:
    env = dict(os.environ)
    env.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(ranks))
    env["LOCAL_WORLD_SIZE"] = str(ranks)
    if device is not None:
        env["CUDA_VISIBLE_DEVICES"] = device
    process = subprocess.Popen(
        [*argv, "--json-summary", str(summary)],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,  # the rank's own table: the launcher shows them all
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    log = worker_log_path(pattern, pid=process.pid, rank=rank)
    started = _Rank(rank, process, log, summary)
    if process.stderr is None:  # asked for as a pipe: never None
        raise RuntimeError("the rank's stderr is not a pipe")
    started.forwarder = threading.Thread(
        target=_forward,
        args=(started, process.stderr),
        name=f"omnitrace-rank-{rank}",
        daemon=True,
    )
    started.forwarder.start()
    return started


def _stop(ranks: Sequence[_Rank], signum: int) -> None:
    """Pass ``signum`` on to every rank still running, then wait for them (killed past the
    grace period)."""
    for rank in ranks:
        if rank.process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                rank.process.send_signal(signum)
    deadline = time.monotonic() + STOP_GRACE_S
    for rank in ranks:
        try:
            rank.process.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            rank.process.kill()
            rank.process.wait()


def run_ranks(
    child_argv: Sequence[str],
    *,
    ranks: int,
    events_log: Path,
    seed: int,
    tui: bool,
    console: Console,
    say: Callable[[str], None],
    force_cpu: bool = False,
    prometheus_port: int | None = None,
    command: Sequence[str] = (sys.executable, "-m", "omnitrace"),
) -> RanksResult | str:
    """Run ``omnitrace demo`` once per rank and follow their logs until all have ended.

    Args:
        child_argv: the demo's options every rank runs with (none of ``--events-log``,
            ``--json-summary``, ``--seed``, ``--prometheus-port`` or the live view's).
        ranks: how many ranks, from 2 to :data:`MAX_RANKS`.
        events_log: the log path; see :func:`rank_log_path`.
        seed: rank r runs with ``seed + r``.
        tui: show the live view of all ranks while they run.
        console: where the live view draws.
        say: prints one status line.
        force_cpu: run every rank on the simulated backend, whatever devices there are.
        prometheus_port: rank r serves ``/metrics`` on this port plus r (0: each a free one).
        command: how to run omnitrace's command line.

    Returns:
        What the ranks did, or the one-line error that kept them from starting.
    """
    devices = _devices(ranks, force_cpu)
    if isinstance(devices, str):
        return devices
    pattern = rank_log_path(events_log)
    if pattern != events_log:
        say(f"--ranks {ranks}: each rank writes its own log, {pattern}")
    where = "one CUDA device each" if devices else "the simulated backend"
    say(f"starting {ranks} ranks on {where}")
    board = RecordBoard(title=f"omnitrace demo · {ranks} ranks")
    stop = threading.Event()
    # Ctrl-C sets its own event, checked between two polls like SIGTERM's: never raised
    # inside a log read or a child's wait, and one more during the stop does not cut it.
    ctrl_c = threading.Event()
    interrupted = False
    started: list[_Rank] = []
    with (
        tempfile.TemporaryDirectory(prefix="omnitrace-ranks-") as scratch,
        sigterm_sets(stop),
        signals_set(ctrl_c, signal.SIGINT),
    ):
        try:
            for index in range(ranks):
                argv = _rank_argv(command, child_argv, pattern, seed, prometheus_port, index)
                summary = Path(scratch) / f"rank-{index}.json"
                device = devices[index] if devices else None
                started.append(_start(index, ranks, argv, device, summary, pattern))
            interrupted = _watch_in_view(started, board, stop, ctrl_c, console if tui else None)
        except KeyboardInterrupt:
            # Where the handler is not in place (off the main thread, or before it was
            # set), Ctrl-C arrives as this exception.
            interrupted = True
            _stop(started, signal.SIGINT)
        finally:
            _shut_down(started)
        summaries = _collect(started, board)
    board.progress = ()
    board.footer = ()
    return RanksResult(
        snapshot=board.snapshot(),
        logs=[rank.log for rank in started],
        summaries=summaries,
        returncodes=[rank.process.returncode for rank in started],
        interrupted=interrupted,
        devices=list(devices),
        pattern=str(pattern).replace("{rank}", "*").replace("{pid}", "*"),
    )


def _rank_argv(
    command: Sequence[str],
    child_argv: Sequence[str],
    pattern: Path,
    seed: int,
    prometheus_port: int | None,
    index: int,
) -> list[str]:
    """The command line of rank ``index``: the demo's options, its log pattern, its seed
    (``seed + index``) and (where asked) its ``/metrics`` port."""
    argv = [*command, "demo", *child_argv, "--no-tui", "--events-log", str(pattern)]
    argv += ["--seed", str(seed + index)]
    if prometheus_port is not None:
        port = prometheus_port + index if prometheus_port else 0
        argv += ["--prometheus-port", str(port)]
    return argv


def _watch_in_view(
    started: Sequence[_Rank],
    board: RecordBoard,
    stop: threading.Event,
    ctrl_c: threading.Event,
    console: Console | None,
) -> bool:
    """:func:`_watch` the ranks, in the live view drawn on ``console`` (None: no view)."""
    board.footer = ("Ctrl-C stops every rank",) if console is not None else ()
    view = LiveView(board, console=console) if console is not None else contextlib.nullcontext()
    with view:
        interrupted = _watch(started, board, stop, ctrl_c)
        board.footer = ()  # the frame the view leaves on the terminal: no key hint
    return interrupted


def _shut_down(started: Sequence[_Rank]) -> None:
    """Stop every rank still running (SIGTERM), and wait for their output to be passed on."""
    _stop(started, signal.SIGTERM)
    for rank in started:
        if rank.forwarder is not None:
            rank.forwarder.join(5.0)


def _collect(started: Sequence[_Rank], board: RecordBoard) -> list[dict[str, Any] | None]:
    """Once the ranks have ended: read the rest of each log onto ``board``, close the logs,
    and return each rank's summary (None where it wrote none)."""
    for rank in started:
        _poll(rank, board)
        if rank.follower is not None:
            rank.follower.close()
    return [_summary(rank.summary) for rank in started]


def _poll(rank: _Rank, board: RecordBoard) -> None:
    """Read what ``rank``'s log gained (its follower opened once the log exists)."""
    if rank.follower is None and rank.log_started.is_set():
        rank.follower = EventLogFollower(rank.log)
    if rank.follower is not None:
        board.add(rank.follower.poll())


def _watch(
    started: Sequence[_Rank], board: RecordBoard, stop: threading.Event, ctrl_c: threading.Event
) -> bool:
    """Follow the ranks' logs until every rank ended, SIGTERM (``stop``) or Ctrl-C
    (``ctrl_c``), which are passed on to every rank; return whether a signal ended it."""
    start = time.monotonic()

    def poll() -> None:
        for rank in started:
            _poll(rank, board)
        running = sum(r.process.poll() is None for r in started)
        board.progress = (
            f"ranks {running} running of {len(started)} · elapsed {time.monotonic() - start:.1f} s",
        )

    while not (stop.is_set() or ctrl_c.is_set()) and any(r.process.poll() is None for r in started):
        poll()
        time.sleep(POLL_S)
    interrupted = False
    if ctrl_c.is_set():
        # A Ctrl-C at the terminal reached the ranks too; one sent to this process alone
        # is passed on. Each rank closes its bus and log and says how far it got.
        interrupted = True
        _stop(started, signal.SIGINT)
    elif stop.is_set():
        interrupted = True
        _stop(started, signal.SIGTERM)
    poll()
    return interrupted


def _summary(path: Path) -> dict[str, Any] | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


#: The demo options the launcher sets per rank itself, or that only its own process uses.
_LAUNCHER_OWN = {"ranks", "events_log", "json_summary", "seed", "prometheus_port", "no_tui"}


def rank_argv(args: argparse.Namespace) -> list[str]:
    """The demo options given (those not at their default) that every rank runs with."""
    argv: list[str] = []
    for action in args.demo_parser._actions:
        if not action.option_strings or action.dest in _LAUNCHER_OWN | {"help", "demo_parser"}:
            continue
        value = getattr(args, action.dest, action.default)
        if value == action.default:
            continue
        flag = max(action.option_strings, key=len)
        argv += [flag] if action.nargs == 0 else [flag, str(value)]
    return argv


def run_command(
    args: argparse.Namespace, *, console: Console, say: Callable[[str], None]
) -> int | str:
    """Run ``omnitrace demo --ranks N`` as parsed: the ranks, the final frame, each rank's
    line, and ``--json-summary`` (each rank's summary and their total).

    Returns:
        The exit status, or the one-line error that kept the ranks from starting.
    """
    if args.json_summary is not None:
        # Checked before the run, so a bad path does not cost the run's results.
        check_regular(args.json_summary, "--json-summary")
    # A forwarder may still be writing a rank's last lines after the ranks' join gave up.
    say = _locked(say)
    tui = not args.no_tui and console.is_terminal
    result = run_ranks(
        rank_argv(args),
        ranks=args.ranks,
        events_log=args.events_log,
        seed=args.seed,
        tui=tui,
        console=console,
        say=say,
        force_cpu=args.cpu,
        prometheus_port=args.prometheus_port,
    )
    if isinstance(result, str):
        return result
    if not tui:  # the live view leaves its last frame on the terminal
        console.print(render(result.snapshot))
    for rank, summary in enumerate(result.summaries):
        done = "" if summary is None else f"requests {summary.get('requests')}, "
        code = result.returncodes[rank]
        say(f"rank {rank}: {done}exit status {code}, event log {result.logs[rank]}")
    say(f"see them again: omnitrace top '{result.pattern}'")
    if args.json_summary is not None:
        workers = [
            ((e.rank, e.pid), e.stats)
            for e in result.snapshot.encoders
            if e.rank is not None and e.pid is not None
        ]
        data = {"ranks": result.summaries, "total": totals_json(totals(workers))}
        args.json_summary.parent.mkdir(parents=True, exist_ok=True)
        text = json.dumps(data, indent=2) + "\n"
        write_regular(args.json_summary, text.encode(), "--json-summary")
        say(f"summary: {args.json_summary.resolve()}")
    return result.status
