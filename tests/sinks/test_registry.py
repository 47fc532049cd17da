"""The sink table: variables to sinks, for the vLLM plugin, the demo and replay alike."""

from __future__ import annotations

import json
import os
import re
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
import structlog

from omnitrace import ConfigError, Event, EventBus, GraphMissed, GraphReplayed
from omnitrace.cli import main
from omnitrace.integrations import vllm_plugin
from omnitrace.sinks import registry
from omnitrace.sinks.jsonl import JsonlSink, read_events
from omnitrace.sinks.logs import LogSink
from omnitrace.sinks.registry import (
    SINKS,
    SinkRequest,
    SinkSpec,
    SinkUnavailableError,
    build_sinks,
    requested,
)

#: Events each Recorder saw, by the value of the variable that asked for it.
RECORDED: dict[str, list[Event]] = {}
RECORDER_ENV = "OMNITRACE_TEST_RECORDER"


class Recorder:
    """A sink a new table entry builds: keeps every event it is handed."""

    def __init__(self, request: SinkRequest) -> None:
        self.name = "recorder"
        self.request = request
        RECORDED[request.value] = []

    def handle(self, events: Sequence[Event]) -> None:
        RECORDED[self.request.value].extend(events)


RECORDER = SinkSpec(
    name="recorder",
    env=RECORDER_ENV,
    module=__name__,
    build=lambda module, request: module.Recorder(request),
    description="records events in this test module",
)


@pytest.fixture
def with_recorder(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The table with one more entry, as adding a sink would make it."""
    monkeypatch.setattr(registry, "SINKS", (*SINKS, RECORDER))
    for name in ("OTEL_EXPORTER_OTLP_ENDPOINT", "OMNITRACE_EVENTS_LOG", "OMNITRACE_OTLP"):
        monkeypatch.delenv(name, raising=False)
    RECORDED.clear()
    yield
    RECORDED.clear()
    structlog.reset_defaults()


def test_table_names_each_sink_once_with_its_variable() -> None:
    """Every entry has a unique name and variable, and its module is importable."""
    assert [spec.name for spec in SINKS] == ["jsonl", "otlp", "logs"]
    assert [spec.env for spec in SINKS] == [
        "OMNITRACE_EVENTS_LOG",
        "OMNITRACE_OTLP",
        "OMNITRACE_LOGS",
    ]
    assert all(spec.description for spec in SINKS)


def test_logs_switch_attaches_a_log_sink_that_summarizes_the_bus(bus: EventBus) -> None:
    """OMNITRACE_LOGS=1 builds a LogSink on the bus, with the environment's summary interval,
    and configures JSON lines when the host configured no structlog."""
    structlog.reset_defaults()
    try:
        (sink,) = build_sinks(bus, {"OMNITRACE_LOGS": "1", "OMNITRACE_SUMMARY_INTERVAL": "5"})
        assert isinstance(sink, LogSink)
        assert sink.summary_interval == 5.0
        assert sink._bus is bus
        assert structlog.is_configured()
    finally:
        structlog.reset_defaults()
    assert build_sinks(bus, {"OMNITRACE_LOGS": "0"}) == []


def test_unset_and_empty_variables_ask_for_no_sink(bus: EventBus) -> None:
    """Without the variables, or with empty and false values, nothing is built."""
    assert build_sinks(bus, {}) == []
    assert build_sinks(bus, {"OMNITRACE_EVENTS_LOG": "  ", "OMNITRACE_OTLP": "off"}) == []


def test_path_variable_builds_a_jsonl_sink_at_that_path(bus: EventBus, tmp_path: Path) -> None:
    """OMNITRACE_EVENTS_LOG=path builds one JsonlSink writing there."""
    path = tmp_path / "events.jsonl"
    (sink,) = build_sinks(bus, {"OMNITRACE_EVENTS_LOG": f" {path} "})
    assert isinstance(sink, JsonlSink)
    assert sink.path == path
    sink.close()


def test_switch_variable_with_a_non_boolean_names_the_variable() -> None:
    """OMNITRACE_OTLP=maybe is a ConfigError naming the variable and the accepted words."""
    message = "OMNITRACE_OTLP: expected 1/0, true/false, yes/no or on/off, got 'maybe'"
    with pytest.raises(ConfigError, match=re.escape(message)):
        requested({"OMNITRACE_OTLP": "maybe"})


def test_excluded_sinks_are_not_read() -> None:
    """A caller that wires a sink itself never has its variable read, even a bad one."""
    environ = {"OMNITRACE_OTLP": "maybe", "OMNITRACE_EVENTS_LOG": "x.jsonl"}
    assert requested(environ, exclude={"otlp", "jsonl"}) == []
    assert [spec.name for spec, _ in requested(environ, exclude={"otlp"})] == ["jsonl"]


def test_unimportable_sink_module_names_the_variable(
    bus: EventBus, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A sink whose module cannot be imported raises SinkUnavailableError naming the variable."""
    monkeypatch.setitem(sys.modules, "omnitrace.sinks.jsonl", None)
    message = "OMNITRACE_EVENTS_LOG is set but omnitrace.sinks.jsonl cannot be imported"
    with pytest.raises(SinkUnavailableError, match=re.escape(message)):
        build_sinks(bus, {"OMNITRACE_EVENTS_LOG": "/tmp/x.jsonl"})


def test_factories_get_the_value_the_environment_and_the_worker(
    with_recorder: None, bus: EventBus
) -> None:
    """A factory is given the stripped value, the environment, this pid and the rank."""
    environ = {RECORDER_ENV: " topic-a ", "OTHER": "1"}
    (sink,) = build_sinks(bus, environ, rank=3)
    request = sink.request
    assert (request.bus, request.value, request.pid, request.rank) == (
        bus,
        "topic-a",
        os.getpid(),
        3,
    )
    assert request.environ is environ


def test_a_new_table_entry_reaches_the_vllm_plugin(
    with_recorder: None, bus: EventBus, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The plugin builds a sink added to the table from its variable, nothing else changed."""
    monkeypatch.setenv("RANK", "5")
    sinks = vllm_plugin._build_sinks(bus, {RECORDER_ENV: "plugin", "RANK": "5"})
    assert [type(s).__name__ for s in sinks] == ["Recorder"]
    assert sinks[0].request.rank == 5


def test_a_new_table_entry_reaches_the_demo(
    with_recorder: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """omnitrace demo attaches a sink added to the table when its variable is set."""
    monkeypatch.setenv(RECORDER_ENV, "demo")
    log = tmp_path / "demo.jsonl"
    args = ["demo", "--no-tui", "--cpu", "--requests", "30", "--events-log", str(log)]
    assert main(args) == 0
    logged = [e for e in read_events(log) if isinstance(e, (GraphMissed, GraphReplayed))]
    seen = [e for e in RECORDED["demo"] if isinstance(e, (GraphMissed, GraphReplayed))]
    assert len(seen) == len(logged) > 0


def test_a_new_table_entry_reaches_replay(
    with_recorder: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """omnitrace replay feeds the replayed events into a sink added to the table."""
    log = tmp_path / "run.jsonl"
    assert main(["demo", "--no-tui", "--cpu", "--requests", "20", "--events-log", str(log)]) == 0
    monkeypatch.setenv(RECORDER_ENV, "replay")
    assert main(["replay", "--json", str(log)]) == 0
    assert len(RECORDED["replay"]) == len(list(read_events(log)))


def test_replay_never_writes_the_event_log_variable(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """OMNITRACE_EVENTS_LOG naming the replayed log leaves it unchanged (replay reads it)."""
    log = tmp_path / "run.jsonl"
    assert main(["demo", "--no-tui", "--cpu", "--requests", "20", "--events-log", str(log)]) == 0
    before = log.read_bytes()
    capsys.readouterr()
    monkeypatch.setenv("OMNITRACE_EVENTS_LOG", str(log))
    assert main(["replay", "--json", str(log)]) == 0
    assert log.read_bytes() == before
    assert json.loads(capsys.readouterr().out)["events"] > 0
    structlog.reset_defaults()


def test_module_docstring_example_is_a_valid_entry() -> None:
    """The Kafka example in the module docstring constructs a SinkSpec as written."""
    doc = registry.__doc__ or ""
    example = doc[doc.index("SinkSpec(") : doc.index("\n\nErrors")]
    spec: Any = eval(example, {"SinkSpec": SinkSpec})
    assert (spec.name, spec.env) == ("kafka", "OMNITRACE_KAFKA")
    assert spec.module == "omnitrace.sinks.kafka"
