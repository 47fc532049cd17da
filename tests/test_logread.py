"""How the commands read recorded logs: a chunk at a time, with a progress bar on a terminal.

The bar goes to stderr, only when stderr is a terminal and the command does not print
JSON; the quick pass before a replay finds exactly the writers whose lines read as records.
"""

from __future__ import annotations

import io
import os
import sys
import tracemalloc
from pathlib import Path

import pytest

from omnitrace.cli import main
from omnitrace.eventlog import INFO_TYPE, SCHEMA_VERSION, LineEncoder, dumps
from omnitrace.eventlog import chunks as logread
from omnitrace.eventlog import reader as eventlog
from omnitrace.eventlog.chunks import LogReadError, ReadProgress, read_logs, writers
from omnitrace.events import GraphMissed, GraphReplayed, MissReason
from omnitrace.signature import InputSpec, Signature

SIG = Signature((InputSpec("float32", (1, 8), "cuda:0"),), 7)


class _Terminal(io.StringIO):
    """A stderr that says it is a terminal."""

    def isatty(self) -> bool:
        return True


def _log(path: Path, events: int, *, pid: int = 1, rank: int = 0) -> Path:
    encode = LineEncoder(pid=pid, rank=rank)
    info = {"v": SCHEMA_VERSION, "type": INFO_TYPE, "pid": pid, "rank": rank}
    lines = [dumps({**info, "adapter": "vision", "info": {"max_graphs": 4}})]
    lines += [encode(GraphReplayed("vision", SIG, n, n, 0.001)) for n in range(events)]
    with path.open("ab") as file:
        file.write(b"".join(lines))
    return path


def test_the_bar_shows_on_a_terminal_and_nothing_elsewhere() -> None:
    """ReadProgress draws on a terminal stream, and writes nothing to a pipe or a file."""
    terminal, pipe = _Terminal(), io.StringIO()
    for stream in (terminal, pipe):
        with ReadProgress(100, enabled=True, stream=stream) as progress:
            progress.advance(50)
            step = progress.phase("replaying settings", 4)
            step(4)
    assert "reading" in terminal.getvalue() or "replaying settings" in terminal.getvalue()
    assert pipe.getvalue() == ""


def test_a_disabled_bar_draws_nothing_even_on_a_terminal() -> None:
    """enabled=False (a command printing JSON) keeps the terminal clean."""
    terminal = _Terminal()
    with ReadProgress(100, enabled=False, stream=terminal) as progress:
        assert not progress.shown
        progress.advance(100)
    assert terminal.getvalue() == ""


@pytest.mark.parametrize("command", ["top", "advise"])
def test_top_and_advise_show_progress_on_a_terminal_stderr_but_not_with_json(
    command: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """On a terminal the reading shows a bar on stderr; with --json, stderr stays empty; the
    results on stdout are the same either way."""
    monkeypatch.setattr(eventlog, "READ_CHUNK", 4096)  # several chunks, several updates
    log = _log(tmp_path / "events.jsonl", 400)
    outputs = []
    for flags in ([], ["--json"]):
        terminal = _Terminal()
        monkeypatch.setattr(sys, "stderr", terminal)
        main([command, *flags, str(log)])
        outputs.append((capsys.readouterr().out, terminal.getvalue()))
    (_, with_bar), (json_out, quiet) = outputs
    assert "reading" in with_bar
    assert quiet == ""
    assert json_out.startswith("{")


@pytest.mark.parametrize(
    ("flags", "shown"),
    [([], True), (["--json"], False), (["--tui", "--speed", "0"], False)],
)
def test_replay_shows_progress_while_finding_the_writers_only_on_a_bare_terminal(
    flags: list[str],
    shown: bool,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """The pass that finds a replay's writers has a bar of its own on a terminal stderr; with
    --json or the live view (--tui) stderr stays clean of bars."""
    monkeypatch.setattr(eventlog, "READ_CHUNK", 4096)
    log = _log(tmp_path / "events.jsonl", 400)
    terminal = _Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    assert main(["replay", *flags, str(log)]) == 0
    capsys.readouterr()
    drawn = terminal.getvalue()
    assert ("finding writers" in drawn) is shown
    assert ("reading" in drawn) is shown


def test_writers_reports_the_bytes_it_scans(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """writers() counts every byte of the logs, rotated files included, to its progress."""
    monkeypatch.setattr(logread, "READ_CHUNK", 4096)  # several chunks
    path = _log(tmp_path / "events.jsonl", 300)
    _log(tmp_path / "events.jsonl.1", 200, pid=2)
    counted: list[int] = []
    sources, _ = writers([path], progress=counted.append)
    assert sources == {(0, 1), (0, 2)}
    assert len(counted) > 1
    assert sum(counted) == eventlog.log_bytes(path)


def test_read_logs_yields_each_log_in_turn_and_refuses_logs_without_records(
    tmp_path: Path,
) -> None:
    """Chunks come log by log with their index; logs with no record are exit status 1."""
    first, second = _log(tmp_path / "a.jsonl", 3), _log(tmp_path / "b.jsonl", 2, pid=2)
    seen = [(index, len(chunk)) for index, chunk in read_logs([first, second])]
    assert seen == [(0, 4), (1, 3)]
    empty = tmp_path / "empty.jsonl"
    empty.write_bytes(b"")
    with pytest.raises(LogReadError, match="no events in the event log") as caught:
        list(read_logs([empty]))
    assert caught.value.status == 1
    with pytest.raises(LogReadError, match="no event log at") as missing:
        list(read_logs([tmp_path / "nope.jsonl"]))
    assert missing.value.status == 2


def test_writers_counts_only_writers_whose_lines_read_as_records(tmp_path: Path) -> None:
    """A torn or unreadable line naming a new writer does not count it; the adapter facts of
    every writer come back in the order written."""
    path = _log(tmp_path / "events.jsonl", 5, pid=10)
    with path.open("ab") as file:
        file.write(b'{"v":2,"type":"GraphReplayed","pid":11,"rank":3,"adapter":\n')
        file.write(b'{"v":2,"type":"GraphReplayed","pid":12,"rank":4,"key":"x"}\n')
    _log(path, 2, pid=13, rank=1)
    with path.open("ab") as file:
        file.write(b'{"v":2,"type":"GraphReplayed","pid":14,"rank":0,"key":"to')
    sources, infos = writers([path])
    assert sources == {(0, 10), (1, 13)}
    assert [record.source for record in infos] == [(0, 10), (1, 13)]


def test_writers_skips_lines_past_max_line_as_the_reading_does(tmp_path: Path) -> None:
    """A record longer than MAX_LINE does not count its writer (the reading skips it), and a
    16 MiB last line without a newline is scanned holding at most MAX_LINE of it."""
    path = _log(tmp_path / "events.jsonl", 3, pid=1)
    huge = GraphMissed("vision", SIG, 1, 1, MissReason.INELIGIBLE, "d" * eventlog.MAX_LINE)
    with path.open("ab") as file:
        file.write(LineEncoder(pid=2, rank=0)(huge))
        file.write(b"z" * (16 << 20))
    tracemalloc.start()
    try:
        sources, infos = writers([path])
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert sources == {(0, 1)}
    assert [record.source for record in infos] == [(0, 1)]
    assert peak < eventlog.MAX_LINE + 4 * eventlog.READ_CHUNK + (256 << 10)


def test_writers_finds_every_writer_and_adapter_fact_of_many_interleaved_writers(
    tmp_path: Path,
) -> None:
    """Twenty writers' lines interleaved, each one's adapter facts written after some of its
    events: every writer and every fact is found, in the order written (past a few writers
    the scan reads each head in full; the result is the same)."""
    path = tmp_path / "events.jsonl"
    lines: list[bytes] = []
    for round_ in range(3):
        for pid in range(100, 120):
            encode = LineEncoder(pid=pid, rank=pid % 4)
            lines.append(encode(GraphReplayed("vision", SIG, round_, round_, 0.001)))
            if round_ == 1:
                info = {"v": SCHEMA_VERSION, "type": INFO_TYPE, "pid": pid, "rank": pid % 4}
                lines.append(dumps({**info, "adapter": "vision", "info": {"max_graphs": pid}}))
    path.write_bytes(b"".join(lines))
    sources, infos = writers([path])
    assert sources == {(pid % 4, pid) for pid in range(100, 120)}
    assert [record.pid for record in infos] == list(range(100, 120))


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="named pipes are POSIX")
def test_writers_never_opens_a_named_pipe_for_a_blocking_read(tmp_path: Path) -> None:
    """A log path that is a named pipe is skipped by the quick pass (the replay reports it)."""
    pipe = tmp_path / "events.jsonl"
    os.mkfifo(pipe)
    assert writers([pipe]) == (set(), [])
