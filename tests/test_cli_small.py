"""The command line's small promises: filters, refusals, help texts and the words it prints."""

from __future__ import annotations

import json
import os
import re
import time
from pathlib import Path
from typing import Any

import pytest

from omnitrace import derive_coverage
from omnitrace.cli import main
from omnitrace.cli.parser import HELP_EPILOGS, build_parser
from omnitrace.demo.run import _Progress
from omnitrace.events import GraphMissed, MissReason, Phase
from omnitrace.sinks.jsonl import read_records
from omnitrace.sinks.live.layout import _profiling_row
from omnitrace.sinks.live.model import EncoderSnapshot
from omnitrace.stats import AdapterStats
from omnitrace.testing import sig

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    """A simulated demo's log, and a copy of it as rank 1 wrote it."""
    saved = {name: os.environ.pop(name) for name in list(os.environ) if name.startswith("OTEL_")}
    tmp = tmp_path_factory.mktemp("ranks")
    first = tmp / "rank0.jsonl"
    try:
        argv = ["demo", "--no-tui", "--cpu", "--requests", "30", "--events-log", str(first)]
        assert main(argv) == 0
    finally:
        os.environ.update(saved)
    second = tmp / "rank1.jsonl"
    lines = []
    for line in first.read_text().splitlines():
        data = json.loads(line)
        if "rank" in data:
            data["rank"] = 1
        lines.append(json.dumps(data))
    second.write_text("\n".join(lines) + "\n")
    assert {record.rank for record in read_records(second)} == {1}
    return [first, second]


def _top_json(capsys: pytest.CaptureFixture[str], *argv: str) -> Any:
    assert main(["top", "--json", *argv]) == 0
    return json.loads(capsys.readouterr().out)


def test_top_shows_only_the_encoders_and_ranks_asked_for(
    two_ranks: list[Path], capsys: pytest.CaptureFixture[str]
) -> None:
    """``--encoder`` and ``--rank`` keep those encoders and workers (each repeatable)."""
    paths = [str(p) for p in two_ranks]
    every = _top_json(capsys, *paths)
    pairs = {(e["encoder"], e["rank"]) for e in every["encoders"]}
    assert pairs == {("vision", 0), ("audio", 0), ("vision", 1), ("audio", 1)}
    audio = _top_json(capsys, "--encoder", "audio", *paths)
    assert {(e["encoder"], e["rank"]) for e in audio["encoders"]} == {("audio", 0), ("audio", 1)}
    one = _top_json(capsys, "--rank", "1", "--encoder", "vision", *paths)
    (entry,) = one["encoders"]
    assert (entry["encoder"], entry["rank"]) == ("vision", 1)
    full = next(e for e in every["encoders"] if (e["encoder"], e["rank"]) == ("vision", 1))
    assert entry == full
    both = _top_json(capsys, "--rank", "0", "--rank", "1", *paths)
    assert len(both["encoders"]) == 4


def test_top_refuses_an_encoder_or_rank_the_logs_do_not_have(
    two_ranks: list[Path], capfd: pytest.CaptureFixture[str]
) -> None:
    """A name or rank no record has is one line naming what the logs hold, exit 2."""
    assert main(["top", "--encoder", "visoin", str(two_ranks[0])]) == 2
    assert capfd.readouterr().err == (
        "omnitrace top: error: --encoder visoin: no such encoder in the logs (audio, vision)\n"
    )
    assert main(["top", "--rank", "3", str(two_ranks[0])]) == 2
    assert capfd.readouterr().err == (
        "omnitrace top: error: --rank 3: no such rank in the logs (ranks: 0)\n"
    )


def test_top_duration_without_follow_is_an_error(
    two_ranks: list[Path], capfd: pytest.CaptureFixture[str]
) -> None:
    """As replay's follow options: ``--duration`` has no meaning for a recorded log."""
    assert main(["top", "--duration", "5", str(two_ranks[0])]) == 2
    assert capfd.readouterr().err == (
        "omnitrace top: error: --duration needs --follow (a recorded log is read at once)\n"
    )


@pytest.mark.parametrize("command", ["top", "replay"])
def test_a_pattern_that_matches_no_file_says_so_without_follow(
    command: str, tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    """The documented line, as with ``--follow``, not "no event log at"."""
    pattern = tmp_path / "nomatch-*.jsonl"
    assert main([command, str(pattern)]) == 2
    err = capfd.readouterr().err
    assert err.startswith(
        f"omnitrace {command}: error: {pattern}: no file matches this pattern (a pattern"
    )
    assert len(err.splitlines()) == 1


def test_a_json_line_that_is_no_object_is_shown_as_text(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    """A JSON array line is named as an array and quoted as the text it is, not as bytes."""
    log = tmp_path / "array.jsonl"
    log.write_text("[1,2]\n")
    assert main(["top", str(log)]) == 2
    assert capfd.readouterr().err == (
        f"omnitrace top: error: {log}:1: expected a JSON object, got an array: '[1,2]'\n"
    )


def test_the_demo_view_keeps_the_elapsed_time_of_the_summary() -> None:
    """Once the traffic has ended, the view's elapsed time stops where the summary's
    "requests N in T s" does, while the bus closes."""
    progress = _Progress(200, None)
    progress.start = time.monotonic() - 10.0
    progress.end = progress.start + 7.2
    progress.done = 200
    assert progress.lines() == ["requests 200 / 200 · elapsed 7.2 s"]


def test_one_profiling_call_is_one_call() -> None:
    """The compact profiling row says "1 call", not "1 calls"."""
    key = sig("float32[1,1024,64], None @cpu s=0")
    miss = GraphMissed(
        "vision", key, 0, 0, MissReason.WARMUP, "call 1 of 2", 0.02, phase=Phase.PROFILING
    )
    coverage = derive_coverage([miss])["vision"]
    encoder = EncoderSnapshot(stats=AdapterStats(adapter="vision"), coverage=coverage)
    row = _profiling_row(encoder, coverage, compact=True)
    assert row is not None
    assert row.plain == "1 call · 0 cap"


def test_the_event_log_argument_has_help() -> None:
    """``EVENTS.jsonl`` of top, replay and advise says what it takes."""
    parser = build_parser()
    for name in ("top", "replay", "advise"):
        text = _subcommand(parser, name).format_help()
        assert re.search(r"EVENTS\.jsonl\s+event logs \(--events-log of the demo", text), name


def _subcommand(parser: Any, name: str) -> Any:
    action = next(a for a in parser._actions if a.dest == "command")
    return action.choices[name]


def test_each_command_help_names_its_variables_and_a_docs_section_that_exists() -> None:
    """Every subcommand's help ends with the variables it reads and a section of the docs,
    and each section it names is a heading of that file."""
    parser = build_parser()
    action = next(a for a in parser._actions if a.dest == "command")
    assert set(HELP_EPILOGS) == set(action.choices)
    for name, (environment, docs) in HELP_EPILOGS.items():
        text = " ".join(_subcommand(parser, name).format_help().split())
        assert "environment: " in text, name
        for variable in re.findall(r"\b(?:OTEL|OMNITRACE)_[A-Z_]+[A-Z]\b", environment or ""):
            assert variable in text, (name, variable)
        path, _, sections = docs.partition(", ")
        headings = {
            line.lstrip("#").strip()
            for line in (ROOT / path).read_text().splitlines()
            if line.startswith("#")
        }
        for section in re.findall(r"'([^']+)'", sections):
            assert section in headings, (name, section)
        assert f"docs: {path}" in text, name


def test_the_readme_makes_the_venv_before_the_commands_that_need_it() -> None:
    """The virtual environment is made before the Quick start's two commands, which stay
    the two one-line bash blocks CI runs."""
    quick = (ROOT / "README.md").read_text().split("## Quick start", 1)[1].split("\n## ", 1)[0]
    venv = quick.index("python3 -m venv .venv && . .venv/bin/activate")
    blocks = [match.start() for match in re.finditer(r"```bash\n", quick)]
    assert len(blocks) == 2
    assert venv < blocks[0]
