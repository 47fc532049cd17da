"""The demo's output paths that open but cannot be written: one line naming option and path.

``/proc/version`` exists and opens for writing as root, but takes no write; ``/proc`` takes
no new file. Each is refused before the run, ``omnitrace demo: error: OPTION: PATH: REASON``
with exit status 2, as every other path problem.
"""

from __future__ import annotations

import errno
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import structlog

from omnitrace._paths import check_output
from omnitrace.cli import main
from omnitrace.config import ConfigError

ROOT = Path(__file__).resolve().parent.parent
DEMO = ["demo", "--no-tui", "--cpu", "--requests", "3"]
OPTIONS = ["--log-file", "--events-log", "--json-summary"]
PROC_FILE = Path("/proc/version")


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


def _demo(tmp_path: Path, option: str, path: Path) -> list[str]:
    argv = [*DEMO, "--events-log", str(tmp_path / "events.jsonl"), option, str(path)]
    proc = subprocess.run(
        [sys.executable, "-m", "omnitrace", *argv],
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 2, proc.stderr
    return proc.stderr.strip().splitlines()


@pytest.mark.parametrize("option", OPTIONS)
def test_a_file_that_takes_no_writes_is_refused_naming_option_and_path(
    tmp_path: Path, option: str
) -> None:
    """`/proc/version` as the log file, the event log or the summary: one line naming the
    option and the path with why it cannot be written (root: the kernel's refusal of a
    write; another user: Permission denied), exit 2, and no run."""
    assert PROC_FILE.is_file(), "this test needs Linux's /proc"
    lines = _demo(tmp_path, option, PROC_FILE)
    assert len(lines) == 1, lines
    head = f"omnitrace demo: error: {option}: {PROC_FILE}: "
    assert lines[0].startswith(head), lines
    reason = lines[0][len(head) :]
    expected = r"cannot be written \([A-Z][\w/ ]+\)" if os.geteuid() == 0 else "Permission denied"
    assert re.fullmatch(expected, reason), reason
    assert not (tmp_path / "events.jsonl").exists()


@pytest.mark.parametrize("option", OPTIONS)
def test_a_directory_that_takes_no_new_files_says_so(tmp_path: Path, option: str) -> None:
    """A new file in /proc is refused as such, not as "No such file or directory" (the
    directory is there; its file system takes no files)."""
    path = Path("/proc") / f"omnitrace-{os.getpid()}.out"
    reason = (
        "cannot create files in /proc (its file system refuses them)"
        if os.geteuid() == 0
        else "Permission denied (cannot create files in /proc)"
    )
    assert _demo(tmp_path, option, path) == [f"omnitrace demo: error: {option}: {path}: {reason}"]


@pytest.mark.parametrize("option", OPTIONS)
def test_a_directory_given_as_an_output_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], option: str
) -> None:
    """A directory where a file is expected: one line naming option and path, exit 2."""
    target = tmp_path / "adir"
    target.mkdir()
    argv = [*DEMO, "--events-log", str(tmp_path / "events.jsonl"), option, str(target)]
    assert main(argv) == 2
    assert capsys.readouterr().err.splitlines() == [
        f"omnitrace demo: error: {option}: {target} is a directory, not a regular file; "
        "omnitrace only writes, rotates and deletes regular files"
    ]


def test_check_output_refuses_a_file_whose_write_fails_and_writes_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An existing file that opens but refuses a write is `LABEL: PATH: cannot be written
    (REASON)`; the check's write is of no bytes, so a file that takes writes is unchanged."""
    target = tmp_path / "demo.log"
    target.write_text("kept\n")
    before = target.stat()
    for append in (True, False):
        check_output(target, "--log-file", append=append)
    assert target.read_text() == "kept\n"
    assert target.stat().st_mtime_ns == before.st_mtime_ns

    def refuse(fd: int, data: bytes) -> int:
        raise OSError(errno.EINVAL, os.strerror(errno.EINVAL))

    monkeypatch.setattr(os, "write", refuse)
    with pytest.raises(ConfigError) as caught:
        check_output(target, "--log-file", append=True)
    assert str(caught.value) == f"--log-file: {target}: cannot be written (Invalid argument)"


def test_an_os_error_during_the_run_reads_without_pythons_errno_prefix(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """An OSError the checks could not foresee is one line in the commands' wording, not
    `[Errno 22] Invalid argument`, exit 1."""
    import omnitrace.demo.run

    def fail(*args: object, **kwargs: object) -> None:
        raise OSError(errno.EINVAL, os.strerror(errno.EINVAL))

    monkeypatch.setattr(omnitrace.demo.run, "run_demo", fail)
    code = main([*DEMO, "--events-log", str(tmp_path / "events.jsonl")])
    assert code == 1
    assert capsys.readouterr().err.splitlines() == ["omnitrace demo: error: Invalid argument"]


def test_the_permission_case_holds_for_a_read_only_log_file(tmp_path: Path) -> None:
    """An existing log file the user may not write (mode 0444) is `Permission denied`."""
    log = tmp_path / "ro.log"
    log.write_text("")
    log.chmod(0o444)
    command = [sys.executable, "-m", "omnitrace", *DEMO, "--log-file", str(log)]
    if os.geteuid() == 0:
        setpriv = shutil.which("setpriv")
        assert setpriv is not None, "setpriv (util-linux) is needed to test permissions as root"
        command = [setpriv, "--bounding-set=-dac_override,-dac_read_search", "--", *command]
    proc = subprocess.run(
        command,
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.splitlines() == [
        f"omnitrace demo: error: --log-file: {log}: Permission denied"
    ]
