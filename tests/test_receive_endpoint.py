"""An OTLP endpoint whose brackets do not close is one line and exit 2, like every other
malformed endpoint, whether it comes from the environment or from ``--otlp-endpoint``."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import structlog

from omnitrace.cli import main
from omnitrace.events import GraphReplayed
from omnitrace.sinks.jsonl import JsonlSink
from omnitrace.testing import sig

BRACKETS = ["http://[::1:4318", "http://::1]:4318", "http://[notanaddress]:4318"]
WHY = ", whose host is not a valid [IPv6] address"


@pytest.fixture(autouse=True)
def _clean(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    for name in ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_PROTOCOL", "OTEL_SERVICE_NAME"):
        monkeypatch.delenv(name, raising=False)
    yield
    structlog.reset_defaults()


def _log(path: Path) -> Path:
    sink = JsonlSink(path)
    try:
        sink.handle([GraphReplayed("audio", sig("float32[1,80,100]"), 1, 1, 0.001)])
    finally:
        sink.close()
    return path


def _expected(name: str, value: str) -> str:
    return (
        f"{name}: expected a URL such as http://localhost:4318 (http:// or https://, a host, "
        f"and a port from 1 to 65535 if any), got {value!r}{WHY}"
    )


@pytest.mark.parametrize("value", BRACKETS)
def test_replay_otlp_endpoint_with_an_unclosed_bracket_is_one_line_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], value: str
) -> None:
    code = main(["replay", "--otlp-endpoint", value, str(_log(tmp_path / "events.jsonl"))])
    out, err = capsys.readouterr()
    assert code == 2
    assert err.strip().splitlines() == [
        f"omnitrace replay: error: {_expected('--otlp-endpoint', value)}"
    ]
    assert out == ""


@pytest.mark.parametrize("command", ["demo", "replay"])
def test_an_endpoint_variable_with_an_unclosed_bracket_is_one_line_exit_2(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    command: str,
) -> None:
    value = BRACKETS[0]
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", value)
    log = tmp_path / "events.jsonl"
    argv = (
        ["demo", "--no-tui", "--cpu", "--requests", "5", "--events-log", str(log)]
        if command == "demo"
        else ["replay", str(_log(log))]
    )
    code = main(argv)
    err = capsys.readouterr().err
    assert code == 2
    assert err.strip().splitlines() == [
        f"omnitrace {command}: error: {_expected('OTEL_EXPORTER_OTLP_ENDPOINT', value)}"
    ]
