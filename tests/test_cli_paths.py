"""Paths and endpoints the commands are given: checked before the work, in one wording.

Each problem is one line, ``omnitrace COMMAND: error: LABEL: PATH: REASON``, with exit
status 2 like any other bad argument, and nothing is created, truncated or run first.
"""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import structlog

from omnitrace._paths import check_output, write_atomically
from omnitrace.cli import main
from omnitrace.config import ConfigError
from omnitrace.events import GraphReplayed
from omnitrace.sinks.jsonl import JsonlSink
from omnitrace.testing import sig

ROOT = Path(__file__).resolve().parent.parent
DEMO = ["demo", "--no-tui", "--cpu", "--requests", "5"]


@pytest.fixture(autouse=True)
def _clean(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    for name in (
        "OTEL_EXPORTER_OTLP_ENDPOINT",
        "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
        "OTEL_EXPORTER_OTLP_METRICS_ENDPOINT",
    ):
        monkeypatch.delenv(name, raising=False)
    yield
    structlog.reset_defaults()


def _log(path: Path) -> Path:
    sink = JsonlSink(path)
    try:
        sink.handle([GraphReplayed("audio", sig("float32[1,80,100]"), 1, 1, 0.001)])
    finally:
        sink.close()
    return path


def _lines(err: str) -> list[str]:
    return err.strip().splitlines()


# -- output paths of the demo -------------------------------------------------------------


@pytest.mark.parametrize("option", ["--events-log", "--log-file", "--json-summary"])
def test_an_output_under_a_file_is_refused_before_the_run(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], option: str
) -> None:
    """An output path whose directory is a regular file is one line naming the option, the
    path and the file, exit 2, before the demo starts (no device line, no event log)."""
    blocker = tmp_path / "afile"
    blocker.write_text("keep me\n")
    events = tmp_path / "events.jsonl"
    bad = blocker / "x" / "out.json"
    argv = [*DEMO, "--events-log", str(events), option, str(bad)]
    code = main(argv)
    err = capsys.readouterr().err
    assert code == 2
    assert _lines(err) == [f"omnitrace demo: error: {option}: {bad}: {blocker} is not a directory"]
    assert not events.exists()
    assert blocker.read_text() == "keep me\n"


def test_the_checks_create_and_truncate_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """When a later output path is refused, the earlier ones were only checked: a missing
    log file is not created, an existing summary and event log keep their bytes."""
    events = _log(tmp_path / "events.jsonl")
    events_before = events.read_bytes()
    summary = tmp_path / "summary.json"
    summary.write_text('{"old": true}\n')
    log_file = tmp_path / "new" / "demo.log"
    bad = tmp_path / "afile"
    bad.write_text("")
    argv = [*DEMO, "--events-log", str(events), "--log-file", str(log_file)]
    code = main([*argv, "--json-summary", str(bad / "s.json")])
    assert code == 2
    assert capsys.readouterr().err.count("\n") == 1
    assert events.read_bytes() == events_before
    assert summary.read_text() == '{"old": true}\n'
    assert not log_file.exists()
    assert not log_file.parent.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile", "events.jsonl", "summary.json"]


def test_check_output_names_the_file_in_the_way_and_changes_nothing(tmp_path: Path) -> None:
    """A path under a regular file names that file; a file appended to needs only to be
    writable; missing directories are accepted and not created; the file is unchanged."""
    target = tmp_path / "afile"
    target.write_text("x")
    with pytest.raises(ConfigError) as caught:
        check_output(target / "s.json", "--json-summary")
    assert str(caught.value) == f"--json-summary: {target / 's.json'}: {target} is not a directory"
    # Appending to an existing writable file needs nothing more; missing directories are fine.
    check_output(target, "--log-file", append=True)
    check_output(tmp_path / "a" / "b" / "c.json", "--json-summary")
    assert not (tmp_path / "a").exists()
    assert target.read_text() == "x"


def test_the_json_summary_is_replaced_atomically_and_keeps_its_mode(tmp_path: Path) -> None:
    """The summary is written to a new file renamed over the old one (a new inode, the old
    permission bits); a write that fails midway leaves the old file whole and no temporary
    file behind."""
    path = tmp_path / "s.json"
    path.write_text("old\n")
    path.chmod(0o600)
    inode = path.stat().st_ino
    write_atomically(path, b"new\n", "--json-summary")
    assert path.read_text() == "new\n"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert path.stat().st_ino != inode

    class Full(OSError):
        pass

    def fail(fd: int) -> None:
        raise Full(28, "No space left on device")

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(os, "fsync", fail)
        with pytest.raises(Full):
            write_atomically(path, b"x" * 100_000, "--json-summary")
    assert path.read_text() == "new\n"
    assert [p.name for p in tmp_path.iterdir()] == ["s.json"]


def test_a_demo_summary_through_a_link_is_still_refused(tmp_path: Path) -> None:
    """Writing by rename must not turn a planted symbolic link into a replaced file: the
    link is refused as before and stays a link."""
    target = tmp_path / "precious.txt"
    target.write_text("keep\n")
    link = tmp_path / "s.json"
    link.symlink_to(target)
    with pytest.raises(ConfigError, match="is a symbolic link, not a regular file"):
        write_atomically(link, b"{}", "--json-summary")
    assert link.is_symlink()
    assert target.read_text() == "keep\n"


# -- permissions: as a user without the right to write or read ------------------------------


@pytest.fixture
def shared_dir(tmp_path: Path) -> Iterator[Path]:
    """A directory holding a read-only directory and a log no one may read."""
    (tmp_path / "rodir").mkdir()
    (tmp_path / "rodir").chmod(0o555)
    _log(tmp_path / "locked.jsonl").chmod(0o000)
    try:
        yield tmp_path
    finally:
        (tmp_path / "rodir").chmod(0o755)


def _as_user(top: Path, *argv: str) -> subprocess.CompletedProcess[str]:
    """Run ``omnitrace ARGV`` in ``top`` where file permissions hold.

    Root (as CI runs) passes every permission check by its capabilities to override them:
    the command then runs without those two (setpriv drops them from its bounding set), so
    the owner's bits of rodir and the log apply to it as to any user.
    """
    command = [sys.executable, "-m", "omnitrace", *argv]
    if os.geteuid() == 0:
        setpriv = shutil.which("setpriv")
        assert setpriv is not None, "setpriv (util-linux) is needed to test permissions as root"
        command = [setpriv, "--bounding-set=-dac_override,-dac_read_search", "--", *command]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("OTEL_EXPORTER_OTLP_ENDPOINT", None)
    return subprocess.run(
        command, cwd=top, env=env, capture_output=True, text=True, timeout=120, check=False
    )


@pytest.mark.parametrize("option", ["--events-log", "--log-file", "--json-summary"])
def test_an_output_in_a_read_only_directory_is_refused_before_the_run(
    shared_dir: Path, option: str
) -> None:
    """`--events-log`, `--log-file` and `--json-summary` in a directory the user cannot
    write: the same line and exit 2 for each, before the run (no device line printed)."""
    argv = [*DEMO, "--events-log", "events.jsonl", option, "rodir/out"]
    proc = _as_user(shared_dir, *argv)
    assert proc.returncode == 2, proc.stderr
    assert _lines(proc.stderr) == [
        f"omnitrace demo: error: {option}: rodir/out: Permission denied (cannot create files "
        "in rodir)"
    ]
    assert list((shared_dir / "rodir").iterdir()) == []
    if option != "--events-log":
        assert not (shared_dir / "events.jsonl").exists()


@pytest.mark.parametrize(
    "argv",
    [["top"], ["top", "--follow", "--no-tui", "--duration", "5"], ["replay"], ["advise"]],
    ids=["top", "top-follow", "replay", "advise"],
)
def test_an_unreadable_log_is_the_same_line_for_every_command(
    shared_dir: Path, argv: list[str]
) -> None:
    """A log the user cannot read is `PATH: Permission denied`, exit 2, for top, top
    --follow, replay and advise alike (not Python's `[Errno 13] ...`)."""
    proc = _as_user(shared_dir, *argv, "locked.jsonl")
    assert proc.returncode == 2, proc.stderr
    assert _lines(proc.stderr) == [f"omnitrace {argv[0]}: error: locked.jsonl: Permission denied"]


def test_an_os_error_outside_the_checks_is_worded_as_they_are(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A path problem only the reader meets (a followed log under a file) reads `PATH:
    REASON` too, exit 2."""
    (tmp_path / "afile").write_text("")
    code = main(["top", "--follow", "--no-tui", str(tmp_path / "afile" / "x.jsonl")])
    err = capsys.readouterr().err
    assert code == 2
    assert _lines(err) == [
        f"omnitrace top: error: {tmp_path / 'afile' / 'x.jsonl'}: Not a directory"
    ]


# -- OTLP endpoints ------------------------------------------------------------------------

BAD_ENDPOINTS = [
    ("notaurl", "which does not start with http:// or https://"),
    ("localhost:4318", "which does not start with http:// or https://"),
    ("ftp://collector:4318", "which does not start with http:// or https://"),
    ("http://:4318", "which has no host"),
    ("http://collector:70000", "whose port is not a number from 1 to 65535"),
    ("http://collector:0", "whose port is not a number from 1 to 65535"),
    ("http://collector:43a8", "whose port is not a number from 1 to 65535"),
    ("http://collector:4318?x=1", "which has a query or a fragment"),
    ("http://coll ector:4318", "which has white space or a control character in it"),
]
EXPECTED = (
    "expected a URL such as http://localhost:4318 (http:// or https://, a host, and a port "
    "from 1 to 65535 if any), got {value!r}, {why}"
)


@pytest.mark.parametrize(("value", "why"), BAD_ENDPOINTS)
def test_replay_checks_the_otlp_endpoint_before_reading_the_log(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], value: str, why: str
) -> None:
    """A bad --otlp-endpoint is one whole line naming the option and what is wrong, exit 2,
    before anything is replayed or exported."""
    log = _log(tmp_path / "events.jsonl")
    code = main(["replay", "--otlp-endpoint", value, str(log)])
    out, err = capsys.readouterr()
    assert code == 2
    assert _lines(err) == [
        f"omnitrace replay: error: --otlp-endpoint: {EXPECTED.format(value=value, why=why)}"
    ]
    assert out == ""


@pytest.mark.parametrize("command", ["demo", "replay"])
@pytest.mark.parametrize(
    "variable", ["OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"]
)
def test_an_endpoint_variable_is_checked_before_the_run(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    command: str,
    variable: str,
) -> None:
    """`OTEL_EXPORTER_OTLP_ENDPOINT=notaurl` (or a per-signal endpoint) stops demo and
    replay with one line naming the variable, exit 2, before the demo writes its log."""
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:9")
    monkeypatch.setenv(variable, "notaurl")
    log = tmp_path / "events.jsonl"
    argv = [*DEMO, "--events-log", str(log)] if command == "demo" else ["replay", str(_log(log))]
    code = main(argv)
    err = capsys.readouterr().err
    why = "which does not start with http:// or https://"
    assert code == 2
    assert _lines(err) == [
        f"omnitrace {command}: error: {variable}: " + EXPECTED.format(value="notaurl", why=why)
    ]
    assert log.exists() == (command == "replay")


def test_configure_sdk_refuses_a_bad_endpoint_argument() -> None:
    """The SDK wiring (the vLLM plugin's too) refuses the same endpoints, as a ConfigError."""
    from omnitrace.sinks.otel.sdk import configure_sdk

    with pytest.raises(ConfigError, match=r"^endpoint: expected a URL such as http://local"):
        configure_sdk(endpoint="collector:4318")
