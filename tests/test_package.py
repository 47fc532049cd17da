"""Package surface: public names, import hygiene and the README's examples."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import omnitrace

ROOT = Path(__file__).resolve().parent.parent


def test_all_is_sorted_and_importable() -> None:
    """__all__ is sorted and every name in it exists."""
    assert list(omnitrace.__all__) == sorted(omnitrace.__all__)
    for name in omnitrace.__all__:
        assert hasattr(omnitrace, name), name


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


def test_readme_python_examples_run_as_pasted() -> None:
    """Every python block in the README runs without error."""
    text = (ROOT / "README.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, re.S)
    assert blocks
    for block in blocks:
        proc = subprocess.run(
            [sys.executable, "-c", block], capture_output=True, text=True, cwd=ROOT, check=False
        )
        assert proc.returncode == 0, proc.stderr


def test_readme_has_exactly_the_two_setup_commands() -> None:
    """The README's bash blocks are the demo command and the test command CI runs."""
    text = (ROOT / "README.md").read_text()
    quick = text.split("## Quick start", 1)[1].split("\n## ", 1)[0]
    commands = re.findall(r"```bash\n(.*?)\n```", quick, re.S)
    assert len(commands) == 2
    demo, test = commands
    assert "omnitrace demo" in demo
    ci = (ROOT / ".ci" / "run").read_text()
    assert test in ci.splitlines()


def test_readme_documents_every_exported_name() -> None:
    """Every metric (OTel and Prometheus), span and log event name of names.py is in the README."""
    from omnitrace.sinks import names

    text = (ROOT / "README.md").read_text()
    wanted = {names.SPANS.CAPTURE, names.SPANS.MEMORY_DEFERRAL, *names.LOG_EVENTS}
    for metric in names.METRICS.values():
        wanted.update({metric.otel, metric.prometheus, *metric.attributes})
    missing = sorted(n for n in wanted if f"`{n}`" not in text)
    assert missing == []
