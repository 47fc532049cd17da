"""Find the modules of a package (and, on request, of its subpackages) that declare ``SINK``
or ``INTEGRATION``, from their source: a registry lists its entries without importing modules
whose imports are optional."""

from __future__ import annotations

import ast
import importlib
import importlib.machinery
import pkgutil
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from importlib.machinery import ModuleSpec

__all__ = ["Declaration", "declarations"]


@dataclass(frozen=True, slots=True)
class Declaration:
    """One module's top-level assignment of the declared name."""

    module: str
    """The module's full name."""
    value: ast.expr
    """The assigned expression, unevaluated."""
    where: str
    """``path:line`` of the assignment, for messages."""
    docstring: str | None = None
    """The module's docstring, cleaned as :func:`inspect.cleandoc` does."""


def declarations(package: str, name: str, *, subpackages: bool = False) -> list[Declaration]:
    """Return the modules of ``package`` that assign ``name`` at top level.

    Modules are listed with :mod:`pkgutil` from the package's ``__path__`` and read from
    their source, sorted by module name; the last top-level assignment counts, as it would
    when the module runs. A module whose source is not installed (bytecode only) is not
    found. With ``subpackages``, the modules of the package's subpackages (at any depth) are
    read too, without importing the subpackages.
    """
    path = importlib.import_module(package).__path__
    marker = re.compile(rf"^{re.escape(name)}\b", re.MULTILINE)
    found = []
    for spec in sorted(_specs(package, path, subpackages), key=lambda spec: spec.name):
        source = _source(spec)
        if source is None or not marker.search(source):
            continue
        filename = spec.origin or spec.name
        tree = ast.parse(source, filename=filename)
        node = _assignment(tree, name)
        if node is not None and node.value is not None:
            where = f"{filename}:{node.lineno}"
            docstring = ast.get_docstring(tree)
            found.append(Declaration(spec.name, node.value, where, docstring))
    return found


def _specs(package: str, path: Sequence[str], subpackages: bool) -> Iterator[ModuleSpec]:
    """The specs of the modules on ``path`` (a package's), and of its subpackages' with
    ``subpackages``, found without importing any of them."""
    for info in pkgutil.iter_modules(path, f"{package}."):
        # PathFinder looks on the package's path only: a module already imported, or blocked
        # in sys.modules, is found all the same.
        spec = importlib.machinery.PathFinder.find_spec(info.name, path)
        if spec is None:
            continue
        yield spec
        locations = spec.submodule_search_locations
        if info.ispkg and subpackages and locations:
            yield from _specs(info.name, list(locations), subpackages)


def _source(spec: ModuleSpec) -> str | None:
    # A loader that can show source has get_source (importlib.abc, whose types say so, costs
    # more to import than the whole search).
    get_source = getattr(spec.loader, "get_source", None)
    source = get_source(spec.name) if callable(get_source) else None
    return source if isinstance(source, str) else None


def _assignment(tree: ast.Module, name: str) -> ast.Assign | ast.AnnAssign | None:
    last: ast.Assign | ast.AnnAssign | None = None
    for node in tree.body:
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, ast.AnnAssign):
            targets = [node.target]
        else:
            continue
        if any(isinstance(target, ast.Name) and target.id == name for target in targets):
            last = node
    return last
