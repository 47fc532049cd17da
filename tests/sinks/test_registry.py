"""The sink table: variables to sinks, for the vLLM plugin, the demo and replay alike."""

from __future__ import annotations

import importlib
import json
import os
import re
import subprocess
import sys
import textwrap
import types
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import pytest
import structlog

import omnitrace.sinks
from omnitrace import ConfigError, Event, EventBus, GraphMissed, GraphReplayed
from omnitrace.cli import main
from omnitrace.integrations import vllm_plugin
from omnitrace.sinks import registry
from omnitrace.sinks.jsonl import JsonlSink, read_events
from omnitrace.sinks.logs import LogSink
from omnitrace.sinks.registry import (
    SINKS,
    SinkDeclaration,
    SinkDeclarationError,
    SinkRequest,
    SinkSpec,
    SinkUnavailableError,
    build_sinks,
    requested,
)

#: The page whose "Adding a sink" example the discovery tests add to the package.
OPERATIONS = Path(__file__).resolve().parents[2] / "docs" / "operations.md"

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
    """Every sink module of the package is in the table, once, with a variable of its own."""
    names = [spec.name for spec in SINKS]
    assert len(set(names)) == len(names)
    assert len({spec.env for spec in SINKS}) == len(SINKS)
    # Read independently of the registry: the modules whose source declares a sink, those of
    # the subpackages (omnitrace.sinks.otel) included.
    package = Path(omnitrace.sinks.__file__).parent
    declaring = {
        ".".join(("omnitrace.sinks", *p.relative_to(package).with_suffix("").parts))
        for p in package.rglob("*.py")
        if "\nSINK = SinkDeclaration(" in p.read_text()
    }
    assert {spec.module for spec in SINKS} == declaring
    assert {"jsonl", "otlp", "logs"} <= set(names)
    # The event log first: the sinks after it may follow it.
    assert names[0] == "jsonl"
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


def test_the_documented_example_is_a_valid_entry(kafka_example: str) -> None:
    """The Kafka module of docs/operations.md, put in omnitrace.sinks, declares its sink."""
    spec = {spec.name: spec for spec in registry.discover_sinks()}["kafka"]
    assert (spec.name, spec.env) == ("kafka", "OMNITRACE_KAFKA")
    assert spec.module == "omnitrace.sinks.kafka"


# -- discovery ---------------------------------------------------------------------------------


@pytest.fixture
def kafka_example(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """The omnitrace/sinks/kafka.py of docs/operations.md ("Adding a sink"), importing its
    library as a sink module does, added to the package; the library is missing."""
    page = OPERATIONS.read_text(encoding="utf-8")
    start = page.index("```python\n", page.index("### Adding a sink")) + len("```python\n")
    example = textwrap.dedent(page[start : page.index("```", start)])
    (tmp_path / "kafka.py").write_text(f"import kafka\n\n{example}")
    monkeypatch.setattr(omnitrace.sinks, "__path__", [*omnitrace.sinks.__path__, str(tmp_path)])
    monkeypatch.setitem(sys.modules, "kafka", None)
    for name in ("OMNITRACE_EVENTS_LOG", "OMNITRACE_OTLP", "OMNITRACE_LOGS"):
        monkeypatch.delenv(name, raising=False)
    yield "omnitrace.sinks.kafka"
    sys.modules.pop("omnitrace.sinks.kafka", None)
    vars(omnitrace.sinks).pop("kafka", None)


def test_sinks_are_found_without_importing_a_sink_module() -> None:
    """Reading the table in a fresh interpreter imports no sink module and no sink library."""
    code = (
        "import sys\n"
        "from omnitrace.sinks.registry import SINKS\n"
        "print(' '.join(spec.name for spec in SINKS))\n"
        "print(' '.join(sorted(m for m in sys.modules if m.startswith('omnitrace.sinks.')"
        " or m.split('.')[0] in {'opentelemetry', 'structlog', 'orjson', 'rich', 'torch'})))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    names = " ".join(spec.name for spec in SINKS)
    assert proc.stdout.splitlines() == [names, "omnitrace.sinks.registry"]


def test_each_entry_is_what_its_module_declares() -> None:
    """The fields read from each module's source are those of its SINK once imported."""
    for spec in SINKS:
        declared = importlib.import_module(spec.module).SINK
        assert isinstance(declared, SinkDeclaration)
        assert (declared.name, declared.env, declared.description, declared.switch) == (
            spec.name,
            spec.env,
            spec.description,
            spec.switch,
        )
    orders = [importlib.import_module(spec.module).SINK.order for spec in SINKS]
    assert orders == sorted(orders)


def test_a_new_module_is_discovered_and_ordered_by_its_declaration(
    kafka_example: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A module added to omnitrace.sinks joins the table at its order, without being imported."""
    table = registry.discover_sinks()
    assert [spec for spec in table if spec.name != "kafka"] == list(SINKS)
    # Its order (40) puts it after every sink of the package (orders 10 to 30).
    assert table[-1].name == "kafka"
    assert kafka_example not in sys.modules
    monkeypatch.setattr(registry, "SINKS", table)
    assert [
        spec.name for spec, _ in requested({"OMNITRACE_KAFKA": "t", "OMNITRACE_LOGS": "1"})
    ] == [
        "logs",
        "kafka",
    ]


def test_a_sink_whose_library_is_missing_fails_only_when_asked_for(
    kafka_example: str, bus: EventBus, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Other sinks build as before; asking for it is a SinkUnavailableError naming the variable,
    and in the vLLM plugin a PluginError."""
    monkeypatch.setattr(registry, "SINKS", registry.discover_sinks())
    (sink,) = build_sinks(bus, {"OMNITRACE_EVENTS_LOG": str(tmp_path / "e.jsonl")})
    assert isinstance(sink, JsonlSink)
    sink.close()
    assert kafka_example not in sys.modules
    message = (
        re.escape("OMNITRACE_KAFKA is set but omnitrace.sinks.kafka cannot be imported (")
        + r".*\bkafka\b.*"
        + re.escape("); install omnitrace with its telemetry dependencies or unset the variable")
    )
    with pytest.raises(SinkUnavailableError, match=message):
        build_sinks(bus, {"OMNITRACE_KAFKA": "events"})
    with pytest.raises(vllm_plugin.PluginError, match=message):
        vllm_plugin._build_sinks(bus, {"OMNITRACE_KAFKA": "events"})


def test_a_discovered_sink_is_built_by_its_declared_factory(
    kafka_example: str, bus: EventBus, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With its library installed, the module is imported and its SINK.build makes the sink."""
    monkeypatch.setitem(sys.modules, "kafka", types.ModuleType("kafka"))
    monkeypatch.setattr(registry, "SINKS", registry.discover_sinks())
    (sink,) = build_sinks(bus, {"OMNITRACE_KAFKA": " events "})
    assert type(sink).__module__ == kafka_example
    assert type(sink).__name__ == "KafkaSink"


@pytest.fixture
def package(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[..., str]]:
    """Write a uniquely named package of sink modules on sys.path; return its name."""
    made: list[str] = []

    def make(**modules: str) -> str:
        name = f"probe_sinks_{len(made)}_{tmp_path.name}".replace("-", "_")
        root = tmp_path / name
        root.mkdir()
        (root / "__init__.py").write_text("")
        for module, source in modules.items():
            (root / f"{module}.py").write_text(textwrap.dedent(source))
        made.append(name)
        return name

    monkeypatch.syspath_prepend(str(tmp_path))
    yield make
    for name in made:
        sys.modules.pop(name, None)


_PROBE = """
    from omnitrace.sinks.registry import SinkDeclaration

    SINK = SinkDeclaration(name={name!r}, env={env!r}, order=1, build=print, description="p")
"""


def test_only_modules_assigning_sink_at_top_level_are_entries(
    package: Callable[..., str],
) -> None:
    """A SINK in a docstring, a function or under another name declares nothing."""
    name = package(
        probe=_PROBE.format(name="probe", env="PROBE_ENV"),
        quoted='"""\nSINK = SinkDeclaration(name="no")\n"""\nraise ImportError("imported")\n',
        nested="def f():\n    SINK = 1\nSINKS = ()\n",
    )
    (spec,) = registry.discover_sinks(name)
    assert (spec.name, spec.env, spec.module, spec.switch) == (
        "probe",
        "PROBE_ENV",
        f"{name}.probe",
        False,
    )


def test_a_module_of_a_subpackage_is_an_entry_without_importing_the_subpackage(
    package: Callable[..., str], tmp_path: Path
) -> None:
    """Sink modules in subpackages, at any depth, are read from their source: the
    subpackages themselves are never imported."""
    name = package(top=_PROBE.format(name="top", env="PROBE_TOP_ENV"))
    deeper = tmp_path / name / "inner" / "deeper"
    deeper.mkdir(parents=True)
    for init in (deeper.parent / "__init__.py", deeper / "__init__.py"):
        init.write_text('raise ImportError("imported")\n')
    (deeper / "probe.py").write_text(
        textwrap.dedent(_PROBE.format(name="deep", env="PROBE_DEEP_ENV"))
    )
    specs = registry.discover_sinks(name)
    assert [(spec.name, spec.module) for spec in specs] == [
        ("deep", f"{name}.inner.deeper.probe"),
        ("top", f"{name}.top"),
    ]
    assert f"{name}.inner" not in sys.modules


@pytest.mark.parametrize(
    ("source", "error"),
    [
        (
            "ENV = 'X'\nSINK = SinkDeclaration(name='a', env=ENV, order=1, build=f, "
            "description='d')\n",
            "env must be a str literal (the registry reads it without importing the module)",
        ),
        ("SINK = make_sink()\n", "write it as SinkDeclaration(name=..., env=..., ...)"),
        ("SINK = SinkDeclaration(name='a', env='X', build=f, description='d')\n", "missing order"),
        (
            "SINK = SinkDeclaration(name='a', env='X', order=1, build=f, description='d', x=1)\n",
            "unexpected argument x",
        ),
    ],
)
def test_a_declaration_the_registry_cannot_read_names_its_module_and_line(
    package: Callable[..., str], source: str, error: str
) -> None:
    """A SINK whose fields are not literals is a SinkDeclarationError naming where it is."""
    name = package(bad=source)
    pattern = rf"SINK in {name}\.bad \(.*bad\.py:\d+\): {re.escape(error)}"
    with pytest.raises(SinkDeclarationError, match=pattern):
        registry.discover_sinks(name)


def test_two_modules_declaring_one_variable_is_an_error(package: Callable[..., str]) -> None:
    """Two sinks cannot share a variable (or a name): the error names both modules."""
    name = package(
        a=_PROBE.format(name="a", env="SAME_ENV"), b=_PROBE.format(name="b", env="SAME_ENV")
    )
    message = f"{name}.a and {name}.b both declare a sink with env 'SAME_ENV'"
    with pytest.raises(SinkDeclarationError, match=re.escape(message)):
        registry.discover_sinks(name)


def test_a_declaration_without_a_description_takes_its_modules_docstring(
    package: Callable[..., str],
) -> None:
    """The description defaults to the module docstring's first paragraph, on one line, both
    as the registry reads it from the source and on the imported declaration."""
    source = '''
        """Events to a ``probe``: one
        line each.

        More detail that is not part of the description.
        """
        from omnitrace.sinks.registry import SinkDeclaration

        def build(request):
            return None

        SINK = SinkDeclaration(name="probe", env="PROBE_DOC_ENV", order=1, build=build)
    '''
    name = package(probe=source)
    (spec,) = registry.discover_sinks(name)
    assert spec.description == "Events to a probe: one line each."
    declared = importlib.import_module(f"{name}.probe").SINK
    assert declared.description == spec.description


def test_a_declaration_with_neither_description_nor_docstring_is_an_error(
    package: Callable[..., str],
) -> None:
    """Without a description and a module docstring, reading and importing both refuse it."""
    source = """
        from omnitrace.sinks.registry import SinkDeclaration

        def build(request):
            return None

        SINK = SinkDeclaration(name="probe", env="PROBE_NODOC_ENV", order=1, build=build)
    """
    name = package(probe=source)
    with pytest.raises(SinkDeclarationError, match=r"missing description \(give one, or a"):
        registry.discover_sinks(name)
    with pytest.raises(SinkDeclarationError, match="sink 'probe': give a description"):
        importlib.import_module(f"{name}.probe")
