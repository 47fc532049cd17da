"""The repository's own checks: lint, format and strict typing stay clean."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

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
