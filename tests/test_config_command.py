"""``omnitrace config``: every setting in force, its value and where it came from."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from omnitrace import EncoderGraphConfig
from omnitrace._env import otlp_endpoints
from omnitrace.cli import main
from omnitrace.cli.config import settings
from omnitrace.config import HF_OVERRIDE_KEYS
from omnitrace.sinks.registry import SINKS

ROOT = Path(__file__).resolve().parent.parent
DEFAULT = EncoderGraphConfig()
MAX = "encoder_cuda_graph_max_graphs"
BASE = "OTEL_EXPORTER_OTLP_ENDPOINT"
TRACES = "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"
METRICS = "OTEL_EXPORTER_OTLP_METRICS_ENDPOINT"


@pytest.fixture(autouse=True)
def _clean(monkeypatch: pytest.MonkeyPatch) -> None:
    """The command reads the process's environment: start from none of its variables."""
    import os

    for name in list(os.environ):
        if name.startswith(("OMNITRACE_", "OTEL_")):
            monkeypatch.delenv(name)


def _rows(report: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {row["name"]: row for row in report["settings"]}


def test_without_overrides_or_variables_every_setting_is_its_default() -> None:
    """Each encoder graph key shows the config's default, each plugin variable its
    documented default, and both endpoints the http/protobuf localhost default per signal."""
    report = settings({})
    rows = _rows(report)
    assert (report["warnings"], report["errors"]) == ([], [])
    for key, field_name in HF_OVERRIDE_KEYS.items():
        assert rows[key]["value"] == getattr(DEFAULT, field_name)
        assert (rows[key]["source"], rows[key]["variable"]) == ("default", None)
    for spec in SINKS:
        assert rows[spec.env]["value"] is (False if spec.switch else None)
        assert rows[spec.env]["source"] == "default"
    assert rows["OMNITRACE_PLUGIN"]["value"] is True
    assert rows["OMNITRACE_REQUESTS"]["value"] is True
    assert rows["OMNITRACE_SUMMARY_INTERVAL"]["value"] == 60.0
    assert rows["traces endpoint"]["value"] == "http://localhost:4318/v1/traces"
    assert rows["metrics endpoint"]["value"] == "http://localhost:4318/v1/metrics"
    assert rows["OTEL_SERVICE_NAME"]["value"] == "omnitrace"


def test_each_value_names_the_override_flag_or_variable_that_set_it() -> None:
    """An override key is `override`, `enabled` under --enforce-eager is `enforce_eager`,
    and a variable's value is `environment` with the variable named."""
    environ = {
        "OMNITRACE_EVENTS_LOG": "events-{rank}.jsonl",
        "OMNITRACE_LOGS": "1",
        "OMNITRACE_SUMMARY_INTERVAL": "5",
        "OTEL_SERVICE_NAME": "vision-serve",
    }
    overrides = json.dumps({MAX: 2, "encoder_cuda_graph": True, "architectures": ["X"]})
    rows = _rows(settings(environ, overrides, enforce_eager=True))
    assert (rows[MAX]["value"], rows[MAX]["source"]) == (2, "override")
    assert (rows["encoder_cuda_graph"]["value"], rows["encoder_cuda_graph"]["source"]) == (
        False,
        "enforce_eager",
    )
    assert rows["encoder_cuda_graph_min_capture_calls"]["source"] == "default"
    for name, value in [
        ("OMNITRACE_EVENTS_LOG", "events-{rank}.jsonl"),
        ("OMNITRACE_LOGS", True),
        ("OMNITRACE_SUMMARY_INTERVAL", 5.0),
        ("OTEL_SERVICE_NAME", "vision-serve"),
    ]:
        assert (rows[name]["value"], rows[name]["source"], rows[name]["variable"]) == (
            value,
            "environment",
            name,
        )
    assert rows["OMNITRACE_OTLP"]["source"] == "default"


@pytest.mark.parametrize(
    ("environ", "traces", "metrics"),
    [
        (
            {BASE: "http://collector:4318"},
            ("http://collector:4318/v1/traces", BASE),
            ("http://collector:4318/v1/metrics", BASE),
        ),
        (
            {BASE: "http://collector:4318/otlp/"},
            ("http://collector:4318/otlp/v1/traces", BASE),
            ("http://collector:4318/otlp/v1/metrics", BASE),
        ),
        (
            {BASE: "http://collector:4318", TRACES: "http://tempo:4318/custom"},
            ("http://tempo:4318/custom", TRACES),
            ("http://collector:4318/v1/metrics", BASE),
        ),
        (
            {TRACES: "http://tempo:4318/v1/traces", METRICS: "http://mimir:9090/otlp/v1/metrics"},
            ("http://tempo:4318/v1/traces", TRACES),
            ("http://mimir:9090/otlp/v1/metrics", METRICS),
        ),
        (
            {METRICS: "  "},
            ("http://localhost:4318/v1/traces", None),
            ("http://localhost:4318/v1/metrics", None),
        ),
    ],
    ids=["base", "base-with-path", "traces-over-base", "per-signal-only", "blank-is-unset"],
)
def test_http_endpoints_follow_the_otel_rules_per_signal(
    environ: dict[str, str], traces: tuple[str, str | None], metrics: tuple[str, str | None]
) -> None:
    """A signal's own variable is used as given and wins over the base, to which
    http/protobuf adds v1/traces or v1/metrics; unset, the protocol's localhost default."""
    found = otlp_endpoints(environ, "http/protobuf")
    assert {s: (e.url, e.source) for s, e in found.items()} == {
        "traces": traces,
        "metrics": metrics,
    }
    rows = _rows(settings(environ))
    assert (rows["traces endpoint"]["value"], rows["traces endpoint"]["variable"]) == traces
    assert (rows["metrics endpoint"]["value"], rows["metrics endpoint"]["variable"]) == metrics


def test_grpc_endpoints_are_used_as_given() -> None:
    """Over gRPC no path is added: the base or the signal's variable is the endpoint."""
    environ = {"OTEL_EXPORTER_OTLP_PROTOCOL": "grpc", BASE: "http://collector:4317"}
    rows = _rows(settings(environ))
    assert rows["OTEL_EXPORTER_OTLP_PROTOCOL"]["value"] == "grpc"
    assert rows["traces endpoint"]["value"] == "http://collector:4317"
    assert rows["metrics endpoint"]["value"] == "http://collector:4317"
    assert _rows(settings({"OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"}))["traces endpoint"]["value"] == (
        "http://localhost:4317"
    )


def test_a_bad_per_signal_endpoint_is_an_error_and_the_rest_still_prints(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """`OTEL_EXPORTER_OTLP_TRACES_ENDPOINT=ftp://x` is shown invalid and said in one error
    line naming the variable, exit 2; the metrics endpoint and the other settings print."""
    monkeypatch.setenv(TRACES, "ftp://x")
    assert main(["config"]) == 2
    out, err = capsys.readouterr()
    lines = err.splitlines()
    assert len(lines) == 1
    assert lines[0].startswith(f"omnitrace config: error: {TRACES}: expected a URL such as ")
    assert "got 'ftp://x'" in lines[0]
    shown = {line.split()[0]: line.split() for line in out.splitlines() if line.startswith("  ")}
    assert shown["traces"][2] == "invalid"
    assert shown["metrics"][2:] == ["http://localhost:4318/v1/metrics", "default"]
    assert shown[MAX][1:] == [str(DEFAULT.max_graphs), "default"]


def test_a_bad_base_endpoint_is_said_once(capsys: pytest.CaptureFixture[str]) -> None:
    """The base endpoint serves both signals, and its problem is one line, not two."""
    report = settings({BASE: "localhost:4318"})
    assert len(report["errors"]) == 1
    assert report["errors"][0].startswith(f"{BASE}: expected a URL such as ")
    rows = _rows(report)
    assert rows["traces endpoint"]["error"] == rows["metrics endpoint"]["error"]


def test_the_text_lists_every_setting_once_with_value_and_source(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each row of the report is one line: name, value, source (the flag or variable)."""
    monkeypatch.setenv("OMNITRACE_EVENTS_LOG", "/var/log/events.jsonl")
    assert main(["config", "--hf-overrides", json.dumps({MAX: 8})]) == 0
    out, err = capsys.readouterr()
    assert err == ""
    lines = [line.split() for line in out.splitlines() if line.startswith("  ")]
    names = [line[0] for line in lines]
    expected = [row["name"].split()[0] for row in settings({}, None)["settings"]]
    assert names == expected
    by_name = {line[0]: line[1:] for line in lines}
    assert by_name[MAX] == ["8", "--hf-overrides"]
    assert by_name["OMNITRACE_EVENTS_LOG"] == ["/var/log/events.jsonl", "OMNITRACE_EVENTS_LOG"]
    assert by_name["encoder_cuda_graph_compile"] == ["false", "default"]


def test_json_prints_the_report_and_escapes_nothing_into_the_terminal(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """`--json` prints the same report `settings()` returns; a control character in a
    variable's value is escaped in the text view, never sent to the terminal."""
    monkeypatch.setenv("OMNITRACE_EVENTS_LOG", "ev\x1b[31mil.jsonl")
    assert main(["config", "--json", "--enforce-eager"]) == 0
    import os

    assert json.loads(capsys.readouterr().out) == settings(os.environ, None, enforce_eager=True)
    assert main(["config"]) == 0
    out = capsys.readouterr().out
    assert "\x1b" not in out
    assert "ev\\x1b[31mil.jsonl" in out


def test_misspellings_are_warned_about_naming_the_right_key(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A bare override name and a misspelt OMNITRACE_* variable are one warning line each,
    naming the right key or variable; the run's status stays 0."""
    monkeypatch.setenv("OMNITRACE_EVENT_LOG", "events.jsonl")
    monkeypatch.setenv("OMNITRACE_BENCH_ENGINE_TP", "2")  # a tool's own variable: no word
    assert main(["config", "--hf-overrides", '{"max_graphs": 2}']) == 0
    assert capsys.readouterr().err.splitlines() == [
        "omnitrace: warning: --hf-overrides: max_graphs: not an encoder graph option, so "
        f"omnitrace leaves it to the model; did you mean '{MAX}'?",
        "omnitrace: warning: OMNITRACE_EVENT_LOG: not an omnitrace variable; did you mean "
        "OMNITRACE_EVENTS_LOG?",
    ]


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            '{"encoder_cudagraph_max_graphs": 2}',
            "--hf-overrides: encoder_cudagraph_max_graphs: unknown encoder graph option "
            "(omnitrace's keys are spelt encoder_cuda_graph_*); did you mean "
            f"'{MAX}'?",
        ),
        (
            '{"encoder_cuda_graph_max_graphs": -1}',
            f"--hf-overrides: {MAX}: expected an integer from 0 to 1024 (0 keeps no graph), "
            "got -1 (int)",
        ),
        ("", "--hf-overrides: expected a JSON object, e.g. "),
    ],
    ids=["misspelt", "out-of-range", "blank"],
)
def test_overrides_a_worker_would_refuse_are_one_error_line(
    capsys: pytest.CaptureFixture[str], overrides: str, message: str
) -> None:
    """What would stop a vLLM worker stops the command with the same line, exit 2."""
    assert main(["config", "--hf-overrides", overrides]) == 2
    out, err = capsys.readouterr()
    assert MAX not in out
    lines = err.splitlines()
    assert len(lines) == 1
    assert lines[0].startswith(f"omnitrace config: error: {message}")


def test_the_command_is_listed_in_the_help() -> None:
    """`omnitrace --help` lists config, and its own help names the OTel variables."""
    run = [sys.executable, "-m", "omnitrace"]
    listed = subprocess.run([*run, "--help"], capture_output=True, text=True, check=True)
    assert "config" in listed.stdout.split("COMMAND", 2)[-1]
    own = subprocess.run([*run, "config", "--help"], capture_output=True, text=True, check=True)
    assert TRACES in own.stdout.replace("\n", " ").replace("  ", " ")


def test_settings_cover_every_config_field() -> None:
    """A field added to EncoderGraphConfig is listed too (through its override key)."""
    names = {row["name"] for row in settings({})["settings"]}
    keys = {key for key, name in HF_OVERRIDE_KEYS.items()}
    assert keys <= names
    assert {f.name for f in dataclasses.fields(EncoderGraphConfig)} == set(
        HF_OVERRIDE_KEYS.values()
    )
