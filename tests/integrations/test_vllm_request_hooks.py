"""The request-timing hooks' points exist in the installed vLLM, read from its source.

The source is parsed, not imported: the API server's and the runners' modules import far more
than the CPU tiers install, and a hook point that moved must fail here, not at serving time.
Runs wherever vLLM is installed (the vLLM and engine CI tiers); skips elsewhere.
"""

from __future__ import annotations

import ast
import importlib.util
from pathlib import Path

import pytest

vllm_spec = importlib.util.find_spec("vllm")
pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(vllm_spec is None, reason="vLLM is not installed (CI installs it)"),
]

from omnitrace.integrations.vllm_requests import HOOK_POINTS  # noqa: E402


def _source(module: str) -> Path | None:
    assert vllm_spec is not None
    assert vllm_spec.submodule_search_locations is not None
    root = Path(next(iter(vllm_spec.submodule_search_locations))).parent
    path = root.joinpath(*module.split("."))
    for candidate in (path.with_suffix(".py"), path / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def _defines(path: Path, owner: str | None, name: str) -> bool:
    tree = ast.parse(path.read_text())
    body = tree.body
    if owner is not None:
        classes = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == owner]
        if not classes:
            return False
        body = classes[0].body
    return any(
        isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.name == name for n in body
    )


@pytest.mark.parametrize(
    ("modules", "owner", "name"), HOOK_POINTS, ids=lambda v: v if isinstance(v, str) else None
)
def test_every_hook_point_is_in_this_vllm(
    modules: tuple[str, ...], owner: str | None, name: str
) -> None:
    """Each method the request hooks wrap is defined where the hooks look for it."""
    found = [m for m in modules if (p := _source(m)) is not None and _defines(p, owner, name)]
    assert found, f"{owner or 'function'}.{name} is in none of {modules}"
