"""Every python, sh and bash block of the README and docs/ runs as pasted.

The blocks of a page run in order, in one fresh copy of the repository (as a reader pastes
them in a clone), with ``omnitrace`` and ``python`` on the PATH. A block says, in an HTML
comment on the line before its fence, how it is run when it needs more than that:

``<!-- docs-test: skip: REASON -->``
    not run here (it needs Docker, vLLM on a GPU server, or a fresh virtual environment,
    which CI gives the Quick start); the reason is required.
``<!-- docs-test: collector -->``
    exports to a collector: a loopback OTLP receiver the test starts stands in for it,
    and ``OTEL_EXPORTER_OTLP_ENDPOINT`` points there.
``<!-- docs-test: stop after N s -->``
    runs until stopped (a follow): it gets SIGTERM after N seconds and must exit 0.

Marks combine with ``;`` (``collector; stop after 3 s``).

Every block stands alone: nothing it needs comes from an earlier block but the files those
wrote (the demo's event log). The well-known ports in a block (4317, 4318, 9464) are
replaced with free ones the test picks, the same ones throughout a page.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from omnitrace.otlp_receiver import OTLPReceiver

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
RUN = ("python", "sh", "bash")
PORTS = (4317, 4318, 9464)
_FENCE = re.compile(
    r"^(?P<indent> *)```(?P<lang>[\w-]*)[^\n]*\n(?P<body>.*?)^(?P=indent)```", re.M | re.S
)
_MARK = re.compile(r"<!-- docs-test: (?P<what>[^>]*?) -->\s*$")
_STOP = re.compile(r"stop after (\d+(?:\.\d+)?) s")


@dataclass(frozen=True)
class Block:
    page: str
    line: int
    lang: str
    body: str
    mark: str

    @property
    def parts(self) -> list[str]:
        """The mark's directives (``collector; stop after 3 s``: both)."""
        return [part.strip() for part in self.mark.split(";") if part.strip()]

    @property
    def where(self) -> str:
        return f"{self.page}:{self.line}"


def blocks(page: Path) -> list[Block]:
    """The fenced blocks of ``page`` in a language that runs, with their marks."""
    text = page.read_text(encoding="utf-8")
    found = []
    for match in _FENCE.finditer(text):
        if match["lang"] not in RUN:
            continue
        start = text.count("\n", 0, match.start())
        before = text.splitlines()[start - 1] if start else ""
        mark = _MARK.search(before)
        indent = len(match["indent"])
        body = "\n".join(line[indent:] for line in match["body"].splitlines()) + "\n"
        found.append(Block(page.name, start + 1, match["lang"], body, mark["what"] if mark else ""))
    return found


def test_every_mark_is_known_and_every_skip_says_why() -> None:
    """A mark is skip with a reason, or collector and/or stop after N s; a block that
    installs packages is marked skip (it would install into the environment of the tests)."""
    for page in PAGES:
        for block in blocks(page):
            if block.mark.startswith("skip: "):
                assert len(block.mark) > len("skip: ") + 10, f"{block.where}: say why"
                continue
            assert not _INSTALLS.search(block.body), f"{block.where} installs: mark it skip"
            for part in block.parts:
                ok = part == "collector" or bool(_STOP.fullmatch(part))
                assert ok, f"{block.where}: unknown docs-test mark {part!r}"


def _free_ports() -> dict[int, int]:
    chosen: dict[int, int] = {}
    holders = []
    for port in PORTS:
        probe = socket.socket()
        probe.bind(("127.0.0.1", 0))
        holders.append(probe)
        chosen[port] = probe.getsockname()[1]
    for probe in holders:
        probe.close()
    return chosen


def _repository_copy(dest: Path) -> Path:
    lines = (ROOT / ".gitignore").read_text().splitlines()
    patterns = shutil.ignore_patterns(
        ".git", *(line.strip().strip("/") for line in lines if line.strip()[:1] not in "#")
    )

    def ignore(directory: str, names: list[str]) -> set[str]:
        caches = {n for n in names if (Path(directory) / n / "CACHEDIR.TAG").exists()}
        return set(patterns(directory, names)) | caches

    shutil.copytree(ROOT, dest, ignore=ignore)
    return dest


def _shims(directory: Path) -> Path:
    """A bin directory where ``omnitrace``, ``python`` and ``python3`` are this Python."""
    directory.mkdir()
    for name, command in (
        ("omnitrace", f'exec "{sys.executable}" -m omnitrace "$@"'),
        ("python", f'exec "{sys.executable}" "$@"'),
        ("python3", f'exec "{sys.executable}" "$@"'),
    ):
        path = directory / name
        path.write_text(f"#!/bin/sh\n{command}\n")
        path.chmod(0o755)
    return directory


#: What no block may do in the test's environment: install packages into it.
_INSTALLS = re.compile(r"\bpip3?\b[^\n]*\binstall\b|\bapt(-get)?\b[^\n]*\binstall\b")


def _run(block: Block, body: str, cwd: Path, env: dict[str, str], ports: dict[int, int]) -> str:
    """Run ``body`` as ``block`` says; return what it printed."""
    # Checked before anything runs: the shims' python is the one running the tests.
    assert not _INSTALLS.search(body), f"{block.where} installs packages: mark it skip"
    receivers = []
    if "collector" in block.parts:
        receivers.append(OTLPReceiver(port=ports[4318]).start())
        if str(ports[4317]) in body:
            receivers.append(OTLPReceiver("grpc", port=ports[4317]).start())
        env = {**env, "OTEL_EXPORTER_OTLP_ENDPOINT": receivers[0].endpoint}
    if block.lang == "python":
        argv = [sys.executable, "-c", body]
    else:
        argv = ["bash", "-e", "-o", "pipefail", "-c", body]
    stop = next((m for m in map(_STOP.fullmatch, block.parts) if m), None)
    try:
        proc = subprocess.Popen(
            argv,
            cwd=cwd,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            text=True,
            start_new_session=True,
        )
        try:
            if stop:
                time.sleep(float(stop[1]))
                assert proc.poll() is None, f"{block.where} ended before it was stopped"
                os.killpg(proc.pid, signal.SIGTERM)
            out, _ = proc.communicate(timeout=180)
        except BaseException:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
            raise
    finally:
        for receiver in receivers:
            receiver.stop()
    assert proc.returncode == 0, f"{block.where} failed ({proc.returncode}):\n{body}\n{out}"
    return out


def _relayed_every_event(out: str, cwd: Path) -> None:
    """The relay example: the follow relayed as many events as the demo emitted."""
    relayed = re.search(r"replayed (\d+) events", out)
    emitted = re.search(r"bus events (\d+), dropped 0", (cwd / "demo.out").read_text())
    assert relayed is not None, out
    assert emitted is not None
    assert relayed[1] == emitted[1]


#: What some blocks promise beyond running: (page, text in the block) -> check of the output.
PROMISES = {("operations.md", "--until-exit $!"): _relayed_every_event}


def _runnable(page: Path) -> list[Block]:
    return [b for b in blocks(page) if not b.mark.startswith("skip")]


#: The pages with a block to run (docs/architecture.md has diagrams only).
RUNNABLE = [page for page in PAGES if _runnable(page)]


def test_the_pages_with_blocks_to_run_are_found() -> None:
    """The README and the operations, telemetry and stack guides have blocks that run, and
    every promise is about a block that runs."""
    names = {page.name for page in RUNNABLE}
    assert {"README.md", "operations.md", "telemetry.md", "observability-stack.md"} <= names
    for name, text in PROMISES:
        page = next(p for p in RUNNABLE if p.name == name)
        assert any(text in block.body for block in _runnable(page)), (name, text)


@pytest.mark.parametrize("page", RUNNABLE, ids=[p.name for p in RUNNABLE])
def test_the_blocks_of_a_page_run_as_pasted(page: Path, tmp_path: Path) -> None:
    """Each python, sh and bash block of the page that is not marked skip runs with exit
    status 0, in order, in one copy of the repository."""
    runnable = _runnable(page)
    cwd = _repository_copy(tmp_path / "repo")
    bin_dir = _shims(tmp_path / "bin")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "OMNITRACE_"))}
    env.update(PATH=f"{bin_dir}{os.pathsep}{env.get('PATH', '')}", PYTHONPATH=str(cwd))
    ports = _free_ports()
    for block in runnable:
        body = block.body
        for known, free in ports.items():
            body = re.sub(rf"(?<![\d.]){known}(?!\d)", str(free), body)
        out = _run(block, body, cwd, env, ports)
        for (name, text), check in PROMISES.items():
            if name == page.name and text in body:
                check(out, cwd)
