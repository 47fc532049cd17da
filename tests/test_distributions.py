"""The sdist and the wheel, built as a packager builds them and looked inside.

The sdist is the repository (less what .gitignore keeps out), so a packager can run the tests
from it; the wheel is the package, its metadata and the license, nothing else.
"""

from __future__ import annotations

import email
import os
import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

import omnitrace

ROOT = Path(__file__).resolve().parent.parent
DIST = f"omnitrace_graphs-{omnitrace.__version__}"
#: Files setuptools writes into every sdist.
GENERATED = {"PKG-INFO", "setup.cfg"}
#: Test modules run from the unpacked sdist: a conftest.py of a subfolder and its helpers
#: (integrations), the benchmarks (imported by their tests), the dashboards and deployment
#: files (ops), the README and the CI scripts (package).
FROM_THE_SDIST = [
    "tests/test_stats.py",
    "tests/integrations/test_registry.py",
    "tests/ops/test_dashboards.py",
    "tests/test_benchmarks_cpu.py::test_gpu_suites_refuse_to_start_without_cuda",
    "tests/test_package.py::test_readme_has_exactly_the_two_setup_commands_and_ci_runs_them",
]


def _ignored() -> list[str]:
    """The .gitignore patterns, as shutil.ignore_patterns takes them (and .git itself)."""
    lines = (ROOT / ".gitignore").read_text().splitlines()
    return [".git", *(line.strip().strip("/") for line in lines if line.strip()[:1] not in "#")]


def _run(*argv: str | Path, cwd: Path) -> str:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMNITRACE_", "OTEL_"))}
    proc = subprocess.run(
        [str(a) for a in argv],
        cwd=cwd,
        env={**env, "PYTHONPATH": str(cwd)},
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


def _build(hook: str, source: Path, out: Path) -> Path:
    """Build with setuptools' own PEP 517 hook (``build_sdist``, ``build_wheel``)."""
    code = f"from setuptools import build_meta; print(build_meta.{hook}({str(out)!r}))"
    name = _run(sys.executable, "-c", code, cwd=source).strip().splitlines()[-1]
    return out / name


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Path, set[str]]:
    """A copy of the repository, its sdist, the sdist unpacked and the wheel built from it."""
    work = tmp_path_factory.mktemp("dist")
    tree = work / "tree"
    patterns = shutil.ignore_patterns(*_ignored())

    def ignore(directory: str, names: list[str]) -> set[str]:
        # Tools' caches (import-linter's) mark themselves with CACHEDIR.TAG, not .gitignore.
        caches = {n for n in names if (Path(directory) / n / "CACHEDIR.TAG").exists()}
        return set(patterns(directory, names)) | caches

    shutil.copytree(ROOT, tree, ignore=ignore)
    files = {p.relative_to(tree).as_posix() for p in tree.rglob("*") if p.is_file()}
    sdist = _build("build_sdist", tree, work / "out")
    with tarfile.open(sdist) as archive:
        archive.extractall(work / "unpacked", filter="data")
    unpacked = work / "unpacked" / DIST
    wheel = _build("build_wheel", unpacked, work / "out")
    return sdist, unpacked, wheel, files


def test_the_sdist_holds_every_file_of_the_repository(
    built: tuple[Path, Path, Path, set[str]],
) -> None:
    """Every file of the repository but .gitignore is in the sdist (tests with their
    conftest.py files, benchmarks, docs, dashboards, deploy, .ci, the LICENSE), and nothing
    else but what setuptools generates."""
    sdist, _, _, files = built
    with tarfile.open(sdist) as archive:
        names = {
            name.removeprefix(f"{DIST}/")
            for name in archive.getnames()
            if archive.getmember(name).isfile()
        }
    shipped = {n for n in names if not n.startswith("omnitrace_graphs.egg-info/")}
    assert shipped - GENERATED == files - {".gitignore"}
    for needed in ("LICENSE", "tests/conftest.py", "tests/integrations/conftest.py"):
        assert needed in shipped
    assert any(n.startswith("benchmarks/") for n in shipped)


def test_the_wheel_holds_the_package_and_the_license_with_an_spdx_expression(
    built: tuple[Path, Path, Path, set[str]],
) -> None:
    """The wheel built from the sdist has the package, py.typed and the LICENSE under its
    dist-info, no test or benchmark, and declares `License-Expression: Apache-2.0` with no
    deprecated License table."""
    _, _, wheel, _ = built
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
        info = f"omnitrace_graphs-{omnitrace.__version__}.dist-info"
        metadata = email.message_from_bytes(archive.read(f"{info}/METADATA"))
        license_text = archive.read(f"{info}/licenses/LICENSE").decode()
    assert "omnitrace/py.typed" in names
    assert "omnitrace/cli/__init__.py" in names
    assert {n.split("/")[0] for n in names} == {"omnitrace", info}
    assert metadata["License-Expression"] == "Apache-2.0"
    assert metadata.get_all("License-File") == ["LICENSE"]
    assert metadata["License"] is None
    assert license_text == (ROOT / "LICENSE").read_text()
    assert "Apache License" in license_text
    assert "Version 2.0, January 2004" in license_text


def test_the_tests_run_from_the_unpacked_sdist(built: tuple[Path, Path, Path, set[str]]) -> None:
    """From the unpacked sdist alone, with its own omnitrace imported: every test module is
    collected, and a selection that needs its subfolders, benchmarks, docs and CI files
    passes."""
    _, unpacked, _, _ = built
    where = _run(sys.executable, "-c", "import omnitrace; print(omnitrace.__file__)", cwd=unpacked)
    assert Path(where.strip()).is_relative_to(unpacked)
    pytest_ = (sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider")
    collected = _run(*pytest_, "--collect-only", cwd=unpacked)
    assert " collected" in collected or "tests collected" in collected, collected[-500:]
    assert "error" not in collected.splitlines()[-1], collected[-2000:]
    passed = _run(*pytest_, *FROM_THE_SDIST, cwd=unpacked)
    assert " passed" in passed.splitlines()[-1]
