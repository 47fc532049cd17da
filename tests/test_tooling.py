"""The repository's own checks: lint, format, strict typing and import contracts stay clean."""

from __future__ import annotations

import ast
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(args, cwd=ROOT, capture_output=True, text=True, check=False, timeout=600)


def test_ruff_lint_is_clean() -> None:
    """ruff check reports nothing on the repository."""
    proc = _run(sys.executable, "-m", "ruff", "check", ".", "--output-format", "concise")
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_ruff_format_is_clean() -> None:
    """Every file is formatted as ruff format would write it."""
    proc = _run(sys.executable, "-m", "ruff", "format", "--check", ".")
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_mypy_strict_on_the_package() -> None:
    """mypy --strict (configured in pyproject.toml) finds no error in the package."""
    proc = _run(sys.executable, "-m", "mypy")
    assert proc.returncode == 0, proc.stdout + proc.stderr


def _lint_imports(cwd: Path) -> subprocess.CompletedProcess[str]:
    """Run lint-imports (this environment's) on the package found first from ``cwd``."""
    script = shutil.which("lint-imports", path=str(Path(sys.executable).parent))
    assert script is not None, "lint-imports is missing: pip install -e '.[dev]'"
    return subprocess.run(
        [script, "--no-cache", "--no-logo"],
        cwd=cwd,
        # Wide enough that no contract name wraps in the report.
        env={**os.environ, "COLUMNS": "200"},
        capture_output=True,
        text=True,
        check=False,
        timeout=600,
    )


def _broken_contracts(output: str) -> set[str]:
    return set(re.findall(r"^(.+?) BROKEN\b", output, flags=re.MULTILINE))


def test_import_contracts_hold() -> None:
    """lint-imports keeps every layer and import contract declared in pyproject.toml."""
    proc = _lint_imports(ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert re.search(r"^Contracts: 7 kept, 0 broken\.$", proc.stdout, re.MULTILINE), proc.stdout


LAYERS = "Layers from the command line down to the core"
NO_TORCH = "The core and the sinks never import torch"
VLLM = "Only the vLLM graph backend and the integrations import vllm"
BUS_UNITS = "The bus's units: process hooks over the runner over channels and folds"


@pytest.mark.parametrize(
    ("module", "line", "broken"),
    [
        ("events.py", "import omnitrace.stats", {LAYERS}),
        ("config.py", "import omnitrace.events", {LAYERS}),
        ("events.py", "import omnitrace.sinks.names", {LAYERS}),
        ("graphs/pools.py", "import omnitrace.sinks.names", {LAYERS}),
        ("sinks/jsonl.py", "import omnitrace.graphs.admission", {LAYERS}),
        ("sinks/names.py", "import torch", {NO_TORCH}),
        ("config.py", "import torch", {NO_TORCH}),
        ("demo/traffic.py", "import vllm", {VLLM}),
        ("graphs/adapter.py", "import vllm", {VLLM}),
        ("graphs/backends/vllm.py", "import vllm", set()),
        ("integrations/minicpmo.py", "import vllm", set()),
        (
            "sinks/live.py",
            "import omnitrace.cli",
            # cli reaches torch through the demo, so the torch contract breaks too.
            {LAYERS, NO_TORCH, "Only omnitrace.__main__ imports the command line"},
        ),
        (
            "integrations/worker.py",
            "import omnitrace.demo.traffic",
            {LAYERS, "Nothing but the command line imports the demo"},
        ),
        ("added.py", "import omnitrace.config", {LAYERS}),
        ("bus/_channels.py", "import omnitrace.bus._runner", {BUS_UNITS}),
        ("bus/_folds.py", "import omnitrace.bus._channels", {BUS_UNITS}),
        ("bus/_added.py", "import omnitrace.bus._types", {BUS_UNITS}),
        (
            "sinks/live.py",
            "import omnitrace.bus._channels",
            {"Only the bus imports its private modules"},
        ),
    ],
)
def test_import_contracts_catch_a_violation(
    module: str, line: str, broken: set[str], tmp_path: Path
) -> None:
    """A cross-layer or forbidden import breaks exactly its contracts; an allowed one none."""
    shutil.copytree(
        ROOT / "omnitrace", tmp_path / "omnitrace", ignore=shutil.ignore_patterns("__pycache__")
    )
    shutil.copy(ROOT / "pyproject.toml", tmp_path)
    target = tmp_path / "omnitrace" / module
    existing = target.read_text() if target.exists() else ""
    target.write_text(f"{existing}\n{line}\n")
    proc = _lint_imports(tmp_path)
    assert proc.returncode == (1 if broken else 0), proc.stdout + proc.stderr
    assert _broken_contracts(proc.stdout) == broken, proc.stdout


def _module_loggers(path: Path) -> list[tuple[int, str]]:
    """Return (line, argument) of each module-level ``logging.getLogger(...)`` assignment."""
    found = []
    for node in ast.parse(path.read_text(), str(path)).body:
        if not isinstance(node, (ast.Assign, ast.AnnAssign)) or not isinstance(
            node.value, ast.Call
        ):
            continue
        func = node.value.func
        if isinstance(func, ast.Attribute) and func.attr == "getLogger":
            found.append((node.lineno, ast.unparse(node.value.args[0])))
    return found


def test_every_module_logger_is_named_after_its_module() -> None:
    """Each module's logger is logging.getLogger(__name__), so it sits under "omnitrace"."""
    loggers = {
        f"{path.relative_to(ROOT)}:{line}": argument
        for path in sorted((ROOT / "omnitrace").rglob("*.py"))
        for line, argument in _module_loggers(path)
    }
    assert len(loggers) >= 5, loggers
    assert {where: arg for where, arg in loggers.items() if arg != "__name__"} == {}
