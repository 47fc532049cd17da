"""The streaming readers, top, replay and advise print what the whole-file ones printed.

``tests/data/eventlog`` holds logs that reach every part of the format (the demo's log, two
writers in one file, rotated files, damaged lines, schema 1, odd values, two logs read
together) and what ``top``, ``replay`` and ``advise`` printed for them before they
streamed; each command is run again here and must print the same, byte for byte.
"""

from __future__ import annotations

import importlib.util
import logging
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from omnitrace.cli import main

DATA = Path(__file__).resolve().parent / "data" / "eventlog"


def _make() -> ModuleType:
    spec = importlib.util.spec_from_file_location("eventlog_fixtures", DATA / "make.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


MAKE = _make()
EXPECTED: dict[str, dict[str, Any]] = MAKE.expected()
CASES = [(name, label) for name in sorted(EXPECTED) for label in sorted(MAKE.COMMANDS)]


@pytest.fixture(scope="module")
def logs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder: Path = MAKE.unpack(tmp_path_factory.mktemp("eventlog") / "logs")
    return folder


def _cli_lines(text: str) -> list[str]:
    # The command's own status lines; the reader's warnings go through logging, which
    # pytest captures, and have tests of their own.
    return [line for line in text.splitlines() if line.startswith("omnitrace")]


def test_every_scenario_and_command_was_recorded() -> None:
    """The recording covers each scenario of the script with each command."""
    assert set(EXPECTED) == set(MAKE.SCENARIOS)
    for recorded in EXPECTED.values():
        assert set(recorded["outputs"]) == set(MAKE.COMMANDS)


@pytest.mark.parametrize(("scenario", "command"), CASES)
def test_output_equals_the_recorded_one(
    scenario: str,
    command: str,
    logs: Path,
    capsys: pytest.CaptureFixture[str],
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The command prints what it printed before, with the same exit status."""
    monkeypatch.setattr(sys, "argv", ["omnitrace"])
    recorded = EXPECTED[scenario]
    want = recorded["outputs"][command]
    paths = [str(logs / log) for log in recorded["logs"]]
    caplog.set_level(logging.WARNING)
    status = main([*MAKE.COMMANDS[command], *paths])
    out, err = capsys.readouterr()
    assert status == want["status"]
    assert out.replace(str(logs), "LOGS") == want["stdout"]
    assert _cli_lines(err.replace(str(logs), "LOGS")) == _cli_lines(want["stderr"])
