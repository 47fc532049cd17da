"""The sinks a setting can ask for, each declared by its own module's ``SINK`` and read from
its source without importing it, so a sink's library loads only when its variable is set
(docs/architecture.md, "The sinks")."""

from __future__ import annotations

import ast
import importlib
import inspect
import os
import sys
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from types import ModuleType
from typing import TYPE_CHECKING, Any

from omnitrace._discover import Declaration, declarations
from omnitrace._env import env_flag
from omnitrace.config import OmnitraceError

if TYPE_CHECKING:
    from omnitrace.bus import EventBus, Sink

__all__ = [
    "SINKS",
    "SinkDeclaration",
    "SinkDeclarationError",
    "SinkRequest",
    "SinkSpec",
    "SinkUnavailableError",
    "build_sink",
    "build_sinks",
    "discover_sinks",
    "docstring_summary",
    "requested",
]

#: The module-level name a sink module declares its sink under.
_DECLARATION = "SINK"


class SinkUnavailableError(OmnitraceError, RuntimeError):
    """A sink was asked for, but its module cannot be imported."""


class SinkDeclarationError(OmnitraceError, TypeError):
    """A sink module's declaration cannot be read from its source, or repeats another's."""


@dataclass(frozen=True, slots=True)
class SinkRequest:
    """What a sink factory gets: the bus, the setting's value and who is asking."""

    bus: EventBus
    value: str
    """The variable's value, stripped (``"1"`` for a switch)."""
    environ: Mapping[str, str]
    """The environment of the process the sink runs in (OpenTelemetry reads its own there)."""
    pid: int
    rank: int | None
    """The serving worker's rank, when the caller knows it."""


@dataclass(frozen=True, slots=True)
class SinkDeclaration:
    """A sink module's ``SINK``: how the registry offers the module's sink.

    Every field but ``build`` must be a literal in the module's source, where the registry
    reads it without importing the module.
    """

    name: str
    env: str
    """The environment variable that asks for the sink."""
    order: int
    """The sink's place among the others: sinks are attached by ascending order, then name."""
    build: Callable[[SinkRequest], Sink]
    """Build the sink for the request (called once the module is imported)."""
    description: str = ""
    """One line on what the sink does; by default the first paragraph of the docstring of
    the module that defines ``build`` (the sink module)."""
    switch: bool = False
    """A 1/0 variable; otherwise any non-empty value asks for the sink and is passed on."""

    def __post_init__(self) -> None:
        if not self.description:
            module = sys.modules.get(getattr(self.build, "__module__", None) or "")
            summary = docstring_summary(getattr(module, "__doc__", None))
            if not summary:
                raise SinkDeclarationError(
                    f"sink {self.name!r}: give a description, or a docstring to its module"
                )
            object.__setattr__(self, "description", summary)


def docstring_summary(docstring: str | None) -> str:
    """Return the first paragraph of a docstring on one line ("" for none)."""
    if not docstring:
        return ""
    first = inspect.cleandoc(docstring).split("\n\n", 1)[0]
    return " ".join(first.replace("``", "").split())


@dataclass(frozen=True, slots=True)
class SinkSpec:
    """One sink a setting can ask for."""

    name: str
    env: str
    """The environment variable that asks for the sink."""
    module: str
    """The module implementing the sink, imported when the sink is built."""
    build: Callable[[ModuleType, SinkRequest], Sink]
    """Build the sink from the imported module and the request."""
    description: str
    switch: bool = False
    """A 1/0 variable; otherwise any non-empty value asks for the sink and is passed on."""

    def value(self, environ: Mapping[str, str]) -> str | None:
        """Return the setting that asks for this sink, or None when ``environ`` does not.

        Raises:
            ConfigError: a switch variable is not a boolean word (the message names it).
        """
        if self.switch:
            return "1" if env_flag(environ, self.env, False) else None
        return environ.get(self.env, "").strip() or None


# -- reading the declarations ------------------------------------------------------------------

#: The declaration's fields read from the source, with their types; ``build`` is not read.
_LITERAL_FIELDS: dict[str, type] = {
    "name": str,
    "env": str,
    "order": int,
    "description": str,
    "switch": bool,
}
_REQUIRED_FIELDS = ("name", "env", "order", "build")


def _build_declared(module: ModuleType, request: SinkRequest) -> Sink:
    declaration = getattr(module, _DECLARATION, None)
    if not isinstance(declaration, SinkDeclaration):
        raise SinkDeclarationError(
            f"{module.__name__}.{_DECLARATION} is a {type(declaration).__name__}, not a "
            "SinkDeclaration"
        )
    return declaration.build(request)


def _read(declaration: Declaration) -> tuple[int, SinkSpec]:
    """Return the attach order and the spec a ``SINK = SinkDeclaration(...)`` declares."""
    where = f"{_DECLARATION} in {declaration.module} ({declaration.where})"
    call = declaration.value
    callee = call.func if isinstance(call, ast.Call) else None
    named = isinstance(callee, ast.Name) and callee.id == SinkDeclaration.__name__
    qualified = isinstance(callee, ast.Attribute) and callee.attr == SinkDeclaration.__name__
    if not isinstance(call, ast.Call) or not (named or qualified) or call.args:
        raise SinkDeclarationError(
            f"{where}: write it as SinkDeclaration(name=..., env=..., ...) with keyword arguments"
        )
    fields: dict[str, Any] = {}
    for keyword in call.keywords:
        field = keyword.arg
        if field == "build":
            fields[field] = None
            continue
        if field is None or field not in _LITERAL_FIELDS:
            raise SinkDeclarationError(f"{where}: unexpected argument {field or '**'}")
        kind = _LITERAL_FIELDS[field]
        try:
            value = ast.literal_eval(keyword.value)
        except ValueError:
            value = None
        if type(value) is not kind:
            raise SinkDeclarationError(
                f"{where}: {field} must be a {kind.__name__} literal (the registry reads it "
                "without importing the module)"
            )
        fields[field] = value
    missing = [name for name in _REQUIRED_FIELDS if name not in fields]
    if missing:
        raise SinkDeclarationError(f"{where}: missing {', '.join(missing)}")
    if not fields.get("description"):
        fields["description"] = docstring_summary(declaration.docstring)
        if not fields["description"]:
            raise SinkDeclarationError(
                f"{where}: missing description (give one, or a docstring to the module)"
            )
    spec = SinkSpec(
        name=fields["name"],
        env=fields["env"],
        module=declaration.module,
        build=_build_declared,
        description=fields["description"],
        switch=fields.get("switch", False),
    )
    return fields["order"], spec


def discover_sinks(package: str = "omnitrace.sinks") -> tuple[SinkSpec, ...]:
    """Return the sinks the modules of ``package`` and of its subpackages declare, in attach
    order.

    The declarations are read from the modules' source: no sink module (nor subpackage) is
    imported.

    Raises:
        SinkDeclarationError: a declaration cannot be read from its source, or two modules
            declare the same name or variable.
    """
    ordered = sorted(
        (
            _read(declaration)
            for declaration in declarations(package, _DECLARATION, subpackages=True)
        ),
        key=lambda item: (item[0], item[1].name),
    )
    specs = tuple(spec for _, spec in ordered)
    for field in ("name", "env"):
        seen: dict[str, str] = {}
        for spec in specs:
            key = getattr(spec, field)
            if key in seen:
                raise SinkDeclarationError(
                    f"{seen[key]} and {spec.module} both declare a sink with {field} {key!r}"
                )
            seen[key] = spec.module
    return specs


#: Every sink a setting can ask for, in the order they are attached: the declarations of
#: the modules of :mod:`omnitrace.sinks` and its subpackages, read on first use (a sink
#: module imports this one).
SINKS: tuple[SinkSpec, ...]


def _table() -> tuple[SinkSpec, ...]:
    """Return :data:`SINKS`, discovering it on first use."""
    table: tuple[SinkSpec, ...] | None = globals().get("SINKS")
    if table is None:
        table = globals()["SINKS"] = discover_sinks()
    return table


if not TYPE_CHECKING:  # to mypy, a module __getattr__ would make every unknown name Any

    def __getattr__(name: str) -> Any:
        if name == "SINKS":
            return _table()
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def requested(
    environ: Mapping[str, str], *, exclude: Collection[str] = ()
) -> list[tuple[SinkSpec, str]]:
    """Return the sinks ``environ`` asks for, with their settings, in table order.

    Args:
        environ: the environment to read.
        exclude: names of sinks the caller wires itself; their variables are not read.

    Raises:
        ConfigError: a variable has an invalid value (the message names it).
    """
    asked = []
    for spec in _table():
        if spec.name in exclude:
            continue
        value = spec.value(environ)
        if value is not None:
            asked.append((spec, value))
    return asked


def build_sink(spec: SinkSpec, request: SinkRequest) -> Sink:
    """Import ``spec``'s module and build its sink for ``request``.

    Raises:
        SinkUnavailableError: the module cannot be imported (the message names the variable).
    """
    try:
        module = importlib.import_module(spec.module)
    except ImportError as exc:
        raise SinkUnavailableError(
            f"{spec.env} is set but {spec.module} cannot be imported ({exc}); install "
            "omnitrace with its telemetry dependencies or unset the variable"
        ) from exc
    return spec.build(module, request)


def build_sinks(
    bus: EventBus,
    environ: Mapping[str, str],
    *,
    rank: int | None = None,
    exclude: Collection[str] = (),
) -> list[Sink]:
    """Build every sink ``environ`` asks for (the caller adds them to ``bus``).

    Args:
        bus: the bus the sinks will serve (some read its adapters and statistics).
        environ: the environment to read.
        rank: the serving worker's rank, when known.
        exclude: names of sinks the caller wires itself.

    Raises:
        ConfigError: a variable has an invalid value (the message names it).
        SinkUnavailableError: an asked-for sink's module cannot be imported.
    """
    pid = os.getpid()
    return [
        build_sink(spec, SinkRequest(bus=bus, value=value, environ=environ, pid=pid, rank=rank))
        for spec, value in requested(environ, exclude=exclude)
    ]
