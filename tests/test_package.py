"""Package surface: public names, import hygiene and the README's examples."""

from __future__ import annotations

import importlib
import importlib.metadata
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

import omnitrace

ROOT = Path(__file__).resolve().parent.parent


def test_all_is_sorted_and_importable() -> None:
    """__all__ is sorted and every name in it exists."""
    assert list(omnitrace.__all__) == sorted(omnitrace.__all__)
    for name in omnitrace.__all__:
        assert hasattr(omnitrace, name), name


#: The packages whose __init__ only hands on the names of their modules.
_FACES = ("advise", "coverage", "eventlog", "sinks.live", "sinks.otel")


@pytest.mark.parametrize("face", [f"omnitrace.{name}" for name in _FACES])
def test_each_package_face_hands_on_every_name_it_lists(face: str) -> None:
    """A package's face hands on each name of its __all__, loaded or on first access, and
    lists each once."""
    module = importlib.import_module(face)
    assert len(set(module.__all__)) == len(module.__all__)
    for name in module.__all__:
        assert getattr(module, name) is not None, name


def test_fixed_public_api_names_exist() -> None:
    """The names the design fixes are importable from the top level and omnitrace.testing."""
    from omnitrace import (  # noqa: F401
        ConfigError,
        EncoderCudaGraph,
        EncoderGraphConfig,
        EventBus,
        derive_stats,
    )
    from omnitrace.testing import SimulatedGraphBackend, capture_events  # noqa: F401


def test_importing_the_core_pulls_in_no_sink_library() -> None:
    """import omnitrace loads neither OpenTelemetry, structlog, rich nor vLLM."""
    code = (
        "import sys, omnitrace, omnitrace.testing\n"
        "bad = [m for m in sys.modules if m.split('.')[0] in "
        "{'opentelemetry', 'structlog', 'rich', 'vllm'}]\n"
        "print(','.join(sorted(bad)))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ""


def test_py_typed_marker_ships() -> None:
    """The package is marked as typed."""
    assert (ROOT / "omnitrace" / "py.typed").exists()


def _readme_commands() -> list[str]:
    proc = subprocess.run(
        [sys.executable, str(ROOT / ".ci" / "readme_commands.py")],
        capture_output=True,
        text=True,
        check=True,
    )
    return proc.stdout.splitlines()


def test_readme_has_exactly_the_two_setup_commands_and_ci_runs_them() -> None:
    """The Quick start holds the demo and the test command, both pinning the CPU torch."""
    demo, test = _readme_commands()
    assert demo == "python3 -m pip install torch==2.13.0 -e . && omnitrace demo"
    assert test == "python3 -m pip install torch==2.13.0 -e '.[dev]' && python3 -m pytest"
    ci = (ROOT / ".ci" / "run").read_text()
    # CI reads the commands from the README and runs them in a fresh virtual environment.
    assert "mapfile -t readme < <(python3 .ci/readme_commands.py)" in ci
    assert ci.index('fresh_venv "$work/readme"') < ci.index('bash -c "$command"')
    assert ci.index('bash -c "$command"') < ci.index("for tier in .ci/tiers/*.sh")


def test_every_ci_tier_makes_its_own_fresh_environment_and_runs_its_tests() -> None:
    """Each tier script creates a virtual environment of its own and runs pytest in it."""
    tiers = sorted((ROOT / ".ci" / "tiers").glob("*.sh"))
    assert [t.name for t in tiers] == [
        "engine-0.32.sh",
        "engine.sh",
        "ops.sh",
        "vllm-0.26.sh",
        "vllm.sh",
    ]
    for tier in (t for t in tiers if t.name != "vllm-0.26.sh"):
        text = tier.read_text()
        assert 'fresh_venv "$work/' in text, tier.name
        # The engine tiers test an installed wheel, so they run the pytest script (which puts
        # no checkout on sys.path) instead of python3 -m pytest.
        runs = (
            "OMNITRACE_FORBID_SKIPS=1 pytest"
            if tier.name.startswith("engine")
            else ("OMNITRACE_FORBID_SKIPS=1 python3 -m pytest")
        )
        assert runs in text, tier.name
    assert 'VLLM_VERSION="${VLLM_VERSION:-0.33.0}"' in (ROOT / ".ci/tiers/vllm.sh").read_text()
    # The 0.26 tier is the same script for the release the GPU machine's torch allows.
    wrapper = (ROOT / ".ci/tiers/vllm-0.26.sh").read_text()
    assert 'VLLM_VERSION=0.26.0 exec bash "$(dirname "$0")/vllm.sh"' in wrapper


def test_installed_distribution_declares_numpy_and_a_torch_range() -> None:
    """The installed metadata needs NumPy (torch warns without it) and a torch range."""
    requires = importlib.metadata.requires("omnitrace-graphs") or []
    names = {re.split(r"[<>=!~ ;\[]", r, maxsplit=1)[0].lower(): r for r in requires}
    assert "numpy" in names
    assert re.fullmatch(r"torch>=[0-9.]+", names["torch"])
    assert importlib.metadata.version("omnitrace-graphs") == omnitrace.__version__


def test_importing_torch_here_raises_no_warning() -> None:
    """Under -W error, torch imports cleanly: the environment has everything it wants."""
    proc = subprocess.run(
        [sys.executable, "-W", "error", "-c", "import torch"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr


def test_facade_loads_names_lazily_and_lists_them() -> None:
    """import omnitrace loads no torch; dir() lists __all__; a name loads on first access."""
    code = (
        "import sys, omnitrace\n"
        "assert 'torch' not in sys.modules, 'torch at import'\n"
        "assert set(omnitrace.__all__) <= set(dir(omnitrace))\n"
        "assert omnitrace.EventBus.__module__ == 'omnitrace.bus._bus'\n"
        "assert 'torch' not in sys.modules, 'torch via EventBus'\n"
        "from omnitrace import EncoderCudaGraph\n"
        "assert 'torch' in sys.modules\n"
        "try:\n"
        "    omnitrace.Nope\n"
        "except AttributeError as exc:\n"
        "    print(exc)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "module 'omnitrace' has no attribute 'Nope'"


_LIGHT_MODULES = (
    "omnitrace",
    "omnitrace.events",
    "omnitrace.bus",
    "omnitrace.stats",
    "omnitrace.coverage",
    "omnitrace.config",
    "omnitrace.advise",
    "omnitrace.graphs.admission",
    "omnitrace.sinks.jsonl",
    "omnitrace.sinks.live",
    "omnitrace.sinks.logs",
    "omnitrace.sinks.names",
    "omnitrace.sinks.otel",
    "omnitrace.cli",
)


@pytest.mark.parametrize("module", _LIGHT_MODULES)
def test_events_stats_and_sinks_import_without_torch(module: str) -> None:
    """The modules top and replay need (events, stats, bus, every sink) never import torch."""
    code = f"import sys, {module}\nprint('torch' in sys.modules)"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "False"


def _modules_after_cli(args: list[str], cwd: Path) -> set[str]:
    code = (
        "import sys\n"
        "from omnitrace.cli import main\n"
        "try:\n"
        f"    main({args!r})\n"
        "except SystemExit:\n"
        "    pass\n"
        "print(' '.join(sorted(sys.modules)), file=sys.stderr)\n"
    )
    # The checkout's package, not whichever one the environment installed.
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=cwd, env=env
    )
    return set(proc.stderr.strip().splitlines()[-1].split())


@pytest.mark.parametrize("args", [["--help"], ["--version"], ["demo", "--help"], ["demo", "-x"]])
def test_help_version_and_usage_errors_import_no_torch_sinks_or_events(
    args: list[str], tmp_path: Path
) -> None:
    """--help, --version and a mistyped flag load neither torch, a sink nor omnitrace.events."""
    loaded = _modules_after_cli(args, tmp_path)
    assert "omnitrace.cli" in loaded
    heavy = {"torch", "omnitrace.events", "rich", "opentelemetry", "structlog"}
    assert {m for m in loaded if m.split(".")[0] in heavy or m in heavy} == set()
    assert not any(m.startswith("omnitrace.sinks") for m in loaded)


def test_top_replay_and_advise_import_no_torch(tmp_path: Path) -> None:
    """`top LOG`, `replay LOG` and `advise LOG` read a log through the event-log reader,
    without torch."""
    log = tmp_path / "e.jsonl"
    log.write_text(
        '{"v":1,"type":"GraphReplayed","pid":1,"rank":0,"adapter":"vision",'
        '"key":"float32[1]","monotonic_ns":1,"epoch_ns":1,"duration_s":0.001}\n'
    )
    runs = (["top", str(log)], ["replay", str(log)], ["top", "--json", str(log)])
    for args in (*runs, ["advise", str(log)]):
        loaded = _modules_after_cli(args, tmp_path)
        assert "omnitrace.eventlog" in loaded, args
        # Reading a log needs the format, not the sink that writes it.
        assert "omnitrace.sinks.jsonl" not in loaded, args
        assert "torch" not in loaded, args


def test_top_json_loads_neither_the_terminal_view_nor_the_bus(tmp_path: Path) -> None:
    """`top --json LOG` prints JSON: it loads no rich and no bus (nor its asyncio); the
    table of `top LOG` still loads rich."""
    log = tmp_path / "e.jsonl"
    log.write_text(
        '{"v":1,"type":"GraphReplayed","pid":1,"rank":0,"adapter":"vision",'
        '"key":"float32[1]","monotonic_ns":1,"epoch_ns":1,"duration_s":0.001}\n'
    )
    loaded = _modules_after_cli(["top", "--json", str(log)], tmp_path)
    assert "omnitrace.sinks.live.model" in loaded
    unneeded = {"rich", "asyncio", "omnitrace.bus", "omnitrace.sinks.live.view"}
    unneeded |= {"omnitrace.sinks.live.layout", "omnitrace.sinks.live.total"}
    assert {m for m in loaded if m in unneeded or m.split(".")[0] in unneeded} == set()
    assert "rich" in _modules_after_cli(["top", str(log)], tmp_path)


def test_help_answers_in_under_half_a_second() -> None:
    """`python -m omnitrace --help` returns in under 0.5 s (best of three runs)."""
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        subprocess.run(
            [sys.executable, "-m", "omnitrace", "--help"], capture_output=True, check=True
        )
        best = min(best, time.perf_counter() - start)
    assert best < 0.5


def test_readme_alert_queries_are_the_shipped_rules() -> None:
    """The README's PromQL and LogQL alert expressions are those of the shipped rule files."""
    import yaml

    text = (ROOT / "README.md").read_text()
    (promql,) = re.findall(r"```promql\n(.*?)\n```", text, re.S)
    (logql,) = re.findall(r"```logql\n(.*?)\n```", text, re.S)
    rules = ROOT / "deploy" / "otel"
    prometheus = yaml.safe_load((rules / "prometheus/rules/omnitrace.rules.yml").read_text())
    loki = yaml.safe_load((rules / "loki/rules/fake/omnitrace-logs.rules.yml").read_text())

    def exprs(document: dict[str, object]) -> dict[str, str]:
        groups = document["groups"]
        assert isinstance(groups, list)
        return {r["alert"]: r["expr"].strip() for g in groups for r in g["rules"]}

    assert promql == exprs(prometheus)["OmnitraceCaptureFailed"]
    assert logql == exprs(loki)["OmnitraceCaptureFailedLogged"]


def test_docs_install_lines_name_a_real_source() -> None:
    """No doc tells users to pip install the unrelated PyPI project named omnitrace."""
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        text = path.read_text()
        for arguments in re.findall(r"pip install ([^&\n`]*)", text):
            targets = [t.strip("'\"") for t in arguments.split()]
            assert not [t for t in targets if re.fullmatch(r"omnitrace(\[.*\])?", t)], path.name
    assert "`omnitrace-graphs`" in (ROOT / "README.md").read_text()


def test_readme_documents_every_exported_name() -> None:
    """Every metric (OTel and Prometheus), span and log event name of names.py is in the README."""
    from omnitrace.sinks import names

    text = (ROOT / "README.md").read_text()
    wanted = {
        names.SPANS.CAPTURE,
        names.SPANS.MEMORY_DEFERRAL,
        names.SPANS.PROFILING_RUN,
        *names.LOG_EVENTS,
    }
    for metric in names.METRICS.values():
        wanted.update({metric.otel, metric.prometheus, *metric.attributes})
    missing = sorted(n for n in wanted if f"`{n}`" not in text)
    assert missing == []


def test_the_sdk_wiring_s_former_module_name_hands_on_the_same_names() -> None:
    """``omnitrace.sinks.otel_sdk`` (the wiring's documented home before the OpenTelemetry
    package) hands on every public name of :mod:`omnitrace.sinks.otel.sdk`, as the face of
    :mod:`omnitrace.sinks.otel` does."""
    import omnitrace.sinks.otel as face
    import omnitrace.sinks.otel.sdk as sdk
    import omnitrace.sinks.otel_sdk as former

    assert set(former.__all__) == set(sdk.__all__)
    for name in sdk.__all__:
        assert getattr(former, name) is getattr(sdk, name), name
        assert getattr(face, name) is getattr(sdk, name), name


def test_the_receiver_s_former_module_name_hands_on_the_same_names() -> None:
    """``omnitrace.testing_otlp`` (users' tests import it) is the receiver's module, renamed:
    every public name is the same object."""
    import omnitrace.otlp_receiver as receiver
    import omnitrace.testing_otlp as former

    assert set(former.__all__) == set(receiver.__all__)
    for name in receiver.__all__:
        assert getattr(former, name) is getattr(receiver, name), name
