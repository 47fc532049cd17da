"""Find the model integration for a loaded model among omnitrace's own modules and the
``omnitrace.models`` entry-point group: the first, in name order, whose detector accepts it
(docs/vllm.md, "Adding a model")."""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from importlib import metadata
from typing import Any

from omnitrace._discover import declarations
from omnitrace.config import OmnitraceError
from omnitrace.integrations.base import ModelIntegration

__all__ = [
    "ENTRY_POINT_GROUP",
    "IntegrationLoadError",
    "builtin_entry_points",
    "find_integration",
    "model_integrations",
]

logger = logging.getLogger(__name__)

#: The entry-point group model integrations are registered under.
ENTRY_POINT_GROUP = "omnitrace.models"

#: The module-level name a model integration is published under.
_DECLARATION = "INTEGRATION"


class IntegrationLoadError(OmnitraceError, RuntimeError):
    """A registered model integration cannot be loaded, or is not a ModelIntegration."""


def _load(entry_point: metadata.EntryPoint) -> ModelIntegration:
    where = f"{ENTRY_POINT_GROUP} entry point {entry_point.name} = {entry_point.value}"
    try:
        integration = entry_point.load()
    except Exception as exc:
        raise IntegrationLoadError(
            f"{where} cannot be loaded ({type(exc).__name__}: {exc}); reinstall or remove "
            "the package that declares it"
        ) from exc
    if not isinstance(integration, ModelIntegration):
        raise IntegrationLoadError(
            f"{where} is a {type(integration).__name__}, not an "
            "omnitrace.integrations.base.ModelIntegration"
        )
    return integration


def builtin_entry_points(
    package: str = "omnitrace.integrations",
) -> tuple[metadata.EntryPoint, ...]:
    """Return the integrations the modules of ``package`` publish, as entry points.

    A module that assigns ``INTEGRATION`` at top level publishes one, named after the module
    (``minicpmo = omnitrace.integrations.minicpmo:INTEGRATION``). The modules are read from
    their source: none is imported here.
    """
    return tuple(
        metadata.EntryPoint(
            name=declaration.module.rpartition(".")[2],
            value=f"{declaration.module}:{_DECLARATION}",
            group=ENTRY_POINT_GROUP,
        )
        for declaration in declarations(package, _DECLARATION)
    )


def model_integrations(
    entry_points: Iterable[metadata.EntryPoint] | None = None,
) -> tuple[ModelIntegration, ...]:
    """Load the registered model integrations, sorted by entry-point name.

    Args:
        entry_points: where to load from (default: omnitrace's own integrations, then the
            installed ``omnitrace.models`` group).

    Raises:
        IntegrationLoadError: an entry point cannot be loaded or names something else.
    """
    if entry_points is None:
        entry_points = [
            *builtin_entry_points(),
            *metadata.entry_points(group=ENTRY_POINT_GROUP),
        ]
    # The same declaration can be seen twice (an in-tree module an installed distribution
    # still declares, an editable install beside a stale one).
    unique = {(ep.name, ep.value): ep for ep in entry_points}
    return tuple(_load(unique[key]) for key in sorted(unique))


def find_integration(
    model: Any, integrations: Sequence[ModelIntegration] | None = None
) -> ModelIntegration | None:
    """Return the first integration whose detector accepts ``model``, or None.

    Args:
        model: the loaded model.
        integrations: where to look (default: :func:`model_integrations`).

    Raises:
        IntegrationLoadError: a registered integration cannot be loaded.
    """
    if integrations is None:
        integrations = model_integrations()
    if not integrations:
        logger.warning(
            "omnitrace: no model integrations are registered (entry-point group %s is "
            "empty); reinstall omnitrace",
            ENTRY_POINT_GROUP,
        )
        return None
    for integration in integrations:
        if integration.detect(model):
            return integration
    return None
