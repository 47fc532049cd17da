"""The repository's own checks: lint, format, strict typing and import contracts stay clean."""

from __future__ import annotations

import ast
import importlib
import inspect
import os
import re
import shutil
import subprocess
import sys
import textwrap
from collections.abc import Callable, Sequence
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
    assert re.search(r"^Contracts: 12 kept, 0 broken\.$", proc.stdout, re.MULTILINE), proc.stdout


LAYERS = "Layers from the command line down to the core"
NO_TORCH = "The core and the sinks never import torch"
VLLM = "Only the vLLM graph backend and the integrations import vllm"
BUS_UNITS = "The bus's units: the bus over process hooks over the runner over channels and folds"
EVENTLOG_UNITS = "The event log's units: the commands' reading over the readers over the line codec"
ADVISE_UNITS = "advise's units: the spread over the grid over the replays over the recording"
COVERAGE_UNITS = "Coverage's units: the fold over what it freezes"
OTEL_UNITS = "OTel's units: a replay's export over the SDK over the exporters over the sink"
LIVE_UNITS = "The live view's units: the view over the layout over the snapshot and the total"


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
            "sinks/live/view.py",
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
        ("bus/_process.py", "import omnitrace.bus._bus", {BUS_UNITS}),
        ("eventlog/codec.py", "import omnitrace.eventlog.reader", {EVENTLOG_UNITS}),
        ("eventlog/reader.py", "import omnitrace.eventlog.chunks", {EVENTLOG_UNITS}),
        ("advise/recording.py", "import omnitrace.advise.grid", {ADVISE_UNITS}),
        ("advise/grid.py", "import omnitrace.advise.spread", {ADVISE_UNITS}),
        ("coverage/snapshot.py", "import omnitrace.coverage.fold", {COVERAGE_UNITS}),
        (
            "coverage/snapshot.py",
            "import omnitrace.coverage",
            # The face imports the fold: the snapshot reaches it through the face.
            {COVERAGE_UNITS},
        ),
        ("coverage/fold.py", "import omnitrace.ranks", {LAYERS}),
        ("sinks/otel/sink.py", "import omnitrace.sinks.otel.sdk", {OTEL_UNITS}),
        ("sinks/otel/env.py", "import omnitrace.sinks.otel.export", {OTEL_UNITS}),
        ("sinks/otel/export.py", "import omnitrace.sinks.otel.relay", {OTEL_UNITS}),
        ("sinks/live/model.py", "import omnitrace.sinks.live.layout", {LIVE_UNITS}),
        ("sinks/live/total.py", "import omnitrace.sinks.live.model", {LIVE_UNITS}),
        ("sinks/live/layout.py", "import omnitrace.sinks.live.view", {LIVE_UNITS}),
        (
            "eventlog/codec.py",
            "import omnitrace.advise",
            # advise reads the event log: the circle breaks both packages' units too.
            {LAYERS, ADVISE_UNITS, EVENTLOG_UNITS},
        ),
        (
            "sinks/live/view.py",
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


def docstring_lines(path: Path) -> int:
    """Lines of the module docstring of ``path``, cleaned as :func:`inspect.cleandoc` does
    (0 without one)."""
    docstring = ast.get_docstring(ast.parse(path.read_text(encoding="utf-8"), str(path)))
    return len(docstring.splitlines()) if docstring else 0


def test_every_module_docstring_is_at_most_three_lines() -> None:
    """A module's docstring says in one to three lines what it is for; the reasoning behind
    it is in docs/ (docs/architecture.md, docs/vllm.md, docs/telemetry.md)."""
    long = [
        path.relative_to(ROOT).as_posix()
        for path in sorted((ROOT / "omnitrace").rglob("*.py"))
        if docstring_lines(path) > 3
    ]
    assert long == [], "shorten these to three lines; the reasoning goes to docs/"


def test_the_docstring_count_skips_blank_edges(tmp_path: Path) -> None:
    """Blank lines after the opening quotes and before the closing ones do not count."""
    short = tmp_path / "short.py"
    short.write_text('"""\nOne line.\n\nAnother two\nlines.\n"""\n\nX = 1\n')
    (tmp_path / "none.py").write_text("X = 1\n")
    assert docstring_lines(short) == 4
    assert docstring_lines(tmp_path / "none.py") == 0


def _package_of(module: str, base: Path) -> str:
    """The package a module under ``base`` belongs to: itself for a package's ``__init__``."""
    path = base / module.replace(".", "/")
    return module if (path / "__init__.py").exists() else module.rpartition(".")[0]


def private_imports(root: Path) -> list[tuple[str, str, str]]:
    """``(importer, module, name)`` of each private name (``_x``) a module of ``root``
    imports from a module of another package: only a package's own modules share them."""
    found = []
    for path in sorted(root.rglob("*.py")):
        parts = list(path.relative_to(root.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        importer = ".".join(parts)
        own = importer if path.name == "__init__.py" else importer.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if not isinstance(node, ast.ImportFrom) or node.level or not node.module:
                continue
            if not node.module.startswith(f"{root.name}."):
                continue
            package = _package_of(node.module, root.parent)
            if package == own:
                continue
            found += [
                (importer, node.module, alias.name)
                for alias in node.names
                if alias.name.startswith("_") and not alias.name.startswith("__")
            ]
    return found


def test_no_module_imports_another_package_s_private_names() -> None:
    """A private name stays inside its package: what another package uses is public there."""
    assert private_imports(ROOT / "omnitrace") == []


def test_the_private_name_check_finds_one(tmp_path: Path) -> None:
    package = tmp_path / "pkg"
    (package / "inner").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "inner" / "__init__.py").write_text("")
    (package / "inner" / "core.py").write_text("_SECRET = 1\n_SHARED = 2\n")
    (package / "inner" / "sibling.py").write_text("from pkg.inner.core import _SHARED\n")
    (package / "user.py").write_text("from pkg.inner.core import _SECRET\n")
    assert private_imports(package) == [("pkg.user", "pkg.inner.core", "_SECRET")]


# -- import circles ---------------------------------------------------------------------------

#: Folders whose modules may import each other: the package, the benchmarks, the tests (which
#: also import each other by names under tests/, the folder pytest puts on sys.path).
CIRCLE_FOLDERS = ("omnitrace", "benchmarks", "tests", ".ci")


def _module_names(root: Path) -> dict[str, Path]:
    """Map every importable name of each Python file under ``root``'s folders to the file."""
    names: dict[str, Path] = {}
    for folder in CIRCLE_FOLDERS:
        for path in sorted((root / folder).rglob("*.py")):
            for base in {root, root / "tests"}:
                if not path.is_relative_to(base):
                    continue
                parts = list(path.relative_to(base).with_suffix("").parts)
                if parts[-1] == "__init__":
                    parts.pop()
                if parts:
                    names[".".join(parts)] = path
    return names


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imported(tree: ast.Module, package: str) -> list[str]:
    """Names each import statement of ``tree`` reaches, function-level ones included;
    imports under ``if TYPE_CHECKING:`` never run and are left out."""
    found: list[str] = []
    stack: list[ast.AST] = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            stack.extend(node.orelse)
            continue
        if isinstance(node, ast.Import):
            found += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            found += [f"{base}.{alias.name}" for alias in node.names] + [base]
        stack.extend(ast.iter_child_nodes(node))
    return found


def import_graph(root: Path) -> dict[Path, set[Path]]:
    """Each Python file under ``root``'s folders and the files of the repository it imports."""
    names = _module_names(root)
    graph: dict[Path, set[Path]] = {path: set() for path in names.values()}
    for name, path in names.items():
        tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for target in _imported(tree, package):
            # The longest known prefix: `from a.b import c` reaches a.b.c when it is a module.
            parts = target.split(".")
            while parts and ".".join(parts) not in names:
                parts.pop()
            if parts and names[".".join(parts)] != path:
                graph[path].add(names[".".join(parts)])
    return graph


def import_circles(graph: dict[Path, set[Path]]) -> list[list[Path]]:
    """The strongly connected groups of more than one file (Tarjan's algorithm, iterative)."""
    index: dict[Path, int] = {}
    low: dict[Path, int] = {}
    on_stack: set[Path] = set()
    stack: list[Path] = []
    circles: list[list[Path]] = []
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                group = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    group.append(member)
                    if member == node:
                        break
                if len(group) > 1:
                    circles.append(sorted(group))
    return circles


def test_no_import_circle_in_the_repository() -> None:
    """No two files of the package, the benchmarks or the tests import each other, however
    indirectly, at module level or inside a function."""
    circles = import_circles(import_graph(ROOT))
    assert [[str(p.relative_to(ROOT)) for p in group] for group in circles] == []


def test_the_circle_check_finds_a_circle_through_a_function_level_import(tmp_path: Path) -> None:
    """Two benchmark modules that import each other, one of them only inside a function, are
    one circle; an import under TYPE_CHECKING closes none."""
    bench = tmp_path / "benchmarks"
    bench.mkdir()
    (bench / "__init__.py").write_text("")
    (bench / "a.py").write_text("from benchmarks.b import X\n")
    (bench / "b.py").write_text("X = 1\ndef f():\n    from benchmarks import a\n")
    (bench / "c.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from benchmarks import d\n"
    )
    (bench / "d.py").write_text("from . import c\n")
    circles = import_circles(import_graph(tmp_path))
    assert [[p.name for p in group] for group in circles] == [["a.py", "b.py"]]


# -- function length --------------------------------------------------------------------------

#: The most lines a function or method of the package may take, from its ``def`` line to the
#: last line of its body (decorators left out).
MAX_FUNCTION_LINES = 80


def long_functions(root: Path, limit: int) -> dict[str, int]:
    """``path:line:name`` of each function or method (nested ones included) of the Python
    files under ``root`` longer than ``limit`` lines, and its length."""
    found = {}
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            assert node.end_lineno is not None
            lines = node.end_lineno - node.lineno + 1
            if lines > limit:
                where = path.relative_to(root.parent).as_posix()
                found[f"{where}:{node.lineno}:{node.name}"] = lines
    return found


def test_no_function_in_the_package_is_too_long() -> None:
    """Every function and method of the package fits in MAX_FUNCTION_LINES lines."""
    assert long_functions(ROOT / "omnitrace", MAX_FUNCTION_LINES) == {}


def test_the_length_check_counts_from_def_to_the_last_line(tmp_path: Path) -> None:
    """A function's lines run from ``def`` to its body's last line, decorators left out;
    methods and nested functions are counted on their own too."""
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "mod.py").write_text(
        "import functools\n"
        "\n"
        "@functools.cache\n"
        "def short():\n"
        "    return 1\n"
        "\n"
        "class C:\n"
        "    def method(self):\n"
        "        def inner():\n"
        "            x = 1\n"
        "            return x\n"
        "        return inner\n"
    )
    assert long_functions(package, 1) == {
        "pkg/mod.py:4:short": 2,
        "pkg/mod.py:8:method": 5,
        "pkg/mod.py:9:inner": 3,
    }
    assert long_functions(package, 3) == {"pkg/mod.py:8:method": 5}


# -- arguments of the public API --------------------------------------------------------------

#: The package faces whose ``__all__`` is the public API (``omnitrace.sinks`` and
#: ``omnitrace.integrations`` export no names of their own).
PUBLIC_FACES = (
    "omnitrace",
    "omnitrace.advise",
    "omnitrace.bus",
    "omnitrace.coverage",
    "omnitrace.eventlog",
    "omnitrace.integrations",
    "omnitrace.sinks",
    "omnitrace.sinks.live",
    "omnitrace.sinks.otel",
    "omnitrace.testing",
)

#: Public callables allowed to lack an ``Args:`` section, each with the reason.
ARGS_EXCEPTIONS: dict[str, str] = {}


def _arguments(function: Callable[..., object]) -> list[str]:
    """The parameters of ``function`` other than ``self`` and ``cls``."""
    try:
        parameters = inspect.signature(function).parameters
    except (TypeError, ValueError):
        return []
    return [name for name in parameters if name not in ("self", "cls")]


def _constructor_arguments(cls: type, package: str) -> list[str]:
    """The arguments of ``cls(...)`` when ``package`` defines its constructor (an
    ``__init__`` of its own, a dataclass's or a NamedTuple's); none for one inherited from
    elsewhere (an exception's, an enum's, a Protocol's placeholder)."""
    for klass in cls.__mro__:
        constructor = klass.__dict__.get("__init__") or klass.__dict__.get("__new__")
        if constructor is None:
            continue
        if klass.__module__.partition(".")[0] != package:
            return []
        module = getattr(constructor, "__module__", None) or ""
        # A NamedTuple's __new__ is compiled in a module of its own name.
        if module.partition(".")[0] != package and not hasattr(klass, "_fields"):
            return []
        return _arguments(cls)
    return []


def undocumented_arguments(faces: Sequence[str], package: str) -> list[str]:
    """Qualified names of the functions, classes and public methods that ``faces`` export
    (their ``__all__``), defined in ``package``, that take arguments and whose docstring has
    no ``Args:`` section (for a class: neither its own nor its ``__init__``'s)."""
    found: set[str] = set()
    for face in faces:
        module = importlib.import_module(face)
        for name in getattr(module, "__all__", ()):
            obj = getattr(module, name)
            if not (inspect.isfunction(obj) or inspect.isclass(obj)):
                continue
            if obj.__module__.partition(".")[0] != package:
                continue
            where = f"{obj.__module__}.{obj.__qualname__}"
            if inspect.isfunction(obj):
                if _arguments(obj) and "Args:" not in (obj.__doc__ or ""):
                    found.add(where)
                continue
            init = obj.__dict__.get("__init__")
            docs = (obj.__doc__ or "") + (getattr(init, "__doc__", None) or "")
            if _constructor_arguments(obj, package) and "Args:" not in docs:
                found.add(where)
            for attribute, value in vars(obj).items():
                if attribute.startswith("_"):
                    continue
                method = value.__func__ if isinstance(value, (staticmethod, classmethod)) else value
                if not inspect.isfunction(method) or not _arguments(method):
                    continue
                if "Args:" not in (method.__doc__ or ""):
                    found.add(f"{where}.{attribute}")
    return sorted(found)


def test_every_public_callable_documents_its_arguments() -> None:
    """Every public function, class and public method that takes arguments says what they
    are in an ``Args:`` section (Google style, as EncoderGraphConfig does)."""
    missing = undocumented_arguments(PUBLIC_FACES, "omnitrace")
    assert [name for name in missing if name not in ARGS_EXCEPTIONS] == []
    # An exception that is documented by now is dropped from the list.
    assert sorted(ARGS_EXCEPTIONS) == [name for name in missing if name in ARGS_EXCEPTIONS]


def test_the_arguments_check_finds_an_undocumented_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Functions, classes and public methods without ``Args:`` are found; those without
    arguments, private methods, names not exported and constructors from elsewhere (an
    exception's, an enum's, a Protocol's) are not."""
    package = tmp_path / "docpkg"
    package.mkdir()
    (package / "__init__.py").write_text(
        textwrap.dedent('''
            import enum
            from dataclasses import dataclass
            from typing import NamedTuple, Protocol

            __all__ = [
                "Doc", "Err", "Kind", "Pair", "Proto", "Record", "Undoc", "bare", "documented",
                "plain", "VALUE",
            ]
            VALUE = 1

            def documented(x):
                """Do.

                Args:
                    x: a value.
                """

            def bare(x):
                """Do without saying."""

            def plain():
                """Take nothing."""

            def hidden(x):
                """Not exported."""

            class Doc:
                """A class.

                Args:
                    x: a value.
                """

                def __init__(self, x):
                    pass

                def method(self, y):
                    """Use y."""

                def _private(self, y):
                    pass

                @classmethod
                def build(cls):
                    """Take nothing."""

            class Undoc:
                def __init__(self, x):
                    """Make one."""

            @dataclass
            class Record:
                """Fields without Args."""

                x: int

            class Pair(NamedTuple):
                """Fields without Args."""

                a: int

            class Err(ValueError):
                """An error."""

            class Kind(enum.Enum):
                A = "a"

            class Proto(Protocol):
                """A protocol."""

                def handle(self, events): ...
        ''')
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    assert undocumented_arguments(["docpkg"], "docpkg") == [
        "docpkg.Doc.method",
        "docpkg.Pair",
        "docpkg.Proto.handle",
        "docpkg.Record",
        "docpkg.Undoc",
        "docpkg.bare",
    ]
