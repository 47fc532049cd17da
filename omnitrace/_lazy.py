"""Attributes of a package loaded on first access (PEP 562), for the package facades."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping, MutableMapping
from typing import Any

__all__ = ["lazy_getattr"]


def lazy_getattr(
    package: str, namespace: MutableMapping[str, Any], module_of: Mapping[str, str]
) -> Callable[[str], Any]:
    """Return a module ``__getattr__`` that imports ``name`` from ``module_of[name]``.

    The value is cached in ``namespace`` (the package's globals), so the next access is a
    plain attribute lookup; an unknown name raises AttributeError as a module would.
    """

    def __getattr__(name: str) -> Any:
        module = module_of.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module), name)
        namespace[name] = value
        return value

    return __getattr__
