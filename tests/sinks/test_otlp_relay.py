"""OMNITRACE_OTLP_RELAY: the OTel export runs in a child process that follows the event log."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from omnitrace import ConfigError, EventBus, GraphReplayed
from omnitrace.events import Event
from omnitrace.otlp_receiver import OTLPReceiver, attributes
from omnitrace.sinks.jsonl import JsonlSink
from omnitrace.sinks.otel.relay import RelayedExport
from omnitrace.sinks.registry import build_sinks
from omnitrace.testing import captured, sig

HITS = "omnitrace.encoder.graph.hits"


def events(n: int) -> list[Event]:
    """One capture, then ``n`` hits of its signature."""
    key = sig("float32[1,8] @cpu s=0")
    now = time.time_ns()
    first = captured("audio", "float32[1,8] @cpu s=0", epoch_ns=now)
    return [first, *(GraphReplayed("audio", key, 2 + i, now + i, 1e-4) for i in range(n))]


def hits(receiver: OTLPReceiver) -> int | None:
    metric = receiver.latest_metric(HITS)
    return None if metric is None else sum(p.as_int for p in metric.sum.data_points)


def environ(tmp_path: Path, receiver: OTLPReceiver, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMNITRACE_", "OTEL_"))}
    return {
        **env,
        "OMNITRACE_EVENTS_LOG": str(tmp_path / "events-{rank}.jsonl"),
        "OMNITRACE_OTLP_RELAY": "1",
        "OTEL_EXPORTER_OTLP_ENDPOINT": receiver.endpoint,
        # Metrics are exported at the child's shutdown only: what arrives is the final count.
        "OTEL_METRIC_EXPORT_INTERVAL": "600000",
        **extra,
    }


def test_the_worker_writes_the_log_and_a_child_exports_it_as_the_worker(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Spans and metrics arrive from the child, under the worker's name, pid and rank."""
    monkeypatch.setenv("RANK", "3")
    with OTLPReceiver() as receiver:
        env = environ(tmp_path, receiver, OTEL_SERVICE_NAME="minicpmo-serve", RANK="3")
        bus = EventBus()
        sinks = build_sinks(bus, env, rank=3)
        assert [type(s).__name__ for s in sinks] == ["JsonlSink", "RelayedExport"]
        relay = sinks[1]
        assert isinstance(relay, RelayedExport)
        assert relay.log == tmp_path / "events-3.jsonl"
        for sink in sinks:
            bus.add_sink(sink)
        for event in events(40):
            bus.emit(event)
        bus.close()  # the JSONL sink writes everything, then the child is told to stop
        assert receiver.wait_for(lambda r: hits(r) == 40, timeout=30), hits(receiver)
        assert len(receiver.spans("omnitrace.graph.capture")) == 1
        resource = attributes(receiver.resource_spans()[0].resource.attributes)
        assert resource["service.name"] == "minicpmo-serve"
        # OTEL_RESOURCE_ATTRIBUTES carries them to the child, as strings.
        assert resource["process.pid"] == str(os.getpid())
        assert resource["omnitrace.worker.rank"] == "3"
        process = relay._process
        assert process.wait(timeout=30) == 0


def test_a_worker_that_dies_without_closing_still_gets_its_log_exported(tmp_path: Path) -> None:
    """The child notices its worker is gone, relays the rest of the log, exports, exits."""
    worker = textwrap.dedent(
        """
        import os, sys, time
        sys.path[:0] = [{tests!r}]
        from sinks.test_otlp_relay import events
        from omnitrace import EventBus
        from omnitrace.sinks.registry import build_sinks

        bus = EventBus()
        for sink in build_sinks(bus, os.environ):
            bus.add_sink(sink)
        for event in events(25):
            bus.emit(event)
        bus.flush()
        print(sink._process.pid, flush=True)
        os._exit(0)  # no close, no exit handlers: as if killed
        """
    ).format(tests=str(Path(__file__).parents[1]))
    with OTLPReceiver() as receiver:
        done = subprocess.run(
            [sys.executable, "-c", worker],
            env=environ(tmp_path, receiver),
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert done.returncode == 0, done.stderr
        assert receiver.wait_for(lambda r: hits(r) == 25, timeout=30), done.stderr
        assert len(receiver.spans("omnitrace.graph.capture")) == 1
    child = int(done.stdout.split()[0])
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and _alive(child):
        time.sleep(0.05)
    assert not _alive(child)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"OMNITRACE_EVENTS_LOG": ""}, "set OMNITRACE_EVENTS_LOG too"),
        ({"OMNITRACE_OTLP": "1"}, "exported twice"),
    ],
)
def test_the_relay_needs_the_log_and_no_in_process_export(
    extra: dict[str, str], message: str, tmp_path: Path
) -> None:
    bus = EventBus()
    env = {"OMNITRACE_EVENTS_LOG": str(tmp_path / "e.jsonl"), "OMNITRACE_OTLP_RELAY": "1"}
    try:
        with pytest.raises(ConfigError, match=message):
            build_sinks(bus, {**env, **extra}, exclude=("jsonl", "otlp"))
    finally:
        bus.close()


def test_a_child_that_dies_is_logged_once_and_the_worker_goes_on(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    relay = RelayedExport(
        tmp_path / "e.jsonl",
        environ=dict(os.environ),
        pid=os.getpid(),
        command=(sys.executable, "-c", "raise SystemExit(3)", "--"),
    )
    assert relay._process.wait(timeout=30) == 3
    with caplog.at_level(logging.ERROR, logger="omnitrace.sinks.otel.relay"):
        relay.handle([])
        relay.handle([])
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 1
    assert "exited with status 3" in errors[0]
    relay.close()  # nothing left to stop: no error


def test_the_child_gets_none_of_the_workers_omnitrace_variables(tmp_path: Path) -> None:
    """It must not write, log or relay again what the worker does; it exports as the worker."""
    captured = tmp_path / "captured.json"
    script = f"import json, os; open({str(captured)!r}, 'w').write(json.dumps(dict(os.environ)))"
    worker_env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    relay = RelayedExport(
        tmp_path / "e.jsonl",
        environ={**worker_env, "OMNITRACE_LOGS": "1", "OMNITRACE_EVENTS_LOG": "x"},
        pid=4242,
        rank=2,
        command=(sys.executable, "-c", script, "--"),
    )
    assert relay._process.wait(timeout=30) == 0
    relay.close()
    child = json.loads(captured.read_text())
    assert not [k for k in child if k.startswith("OMNITRACE_")]
    assert child["OTEL_SERVICE_NAME"] == "omnitrace"
    assert child["OTEL_RESOURCE_ATTRIBUTES"] == "process.pid=4242,omnitrace.worker.rank=2"
    assert relay.argv[-9:] == [
        "replay",
        "--follow",
        str(tmp_path / "e.jsonl"),
        "--from-offset",
        "0",
        "--otlp",
        "--until-exit",
        "4242",
        "--until-stdin-closes",
    ]


def test_a_restarted_worker_exports_only_its_own_run(tmp_path: Path) -> None:
    """The log already holds an earlier run: the relay joins it where this worker starts."""
    path = tmp_path / "events.jsonl"
    earlier = JsonlSink(path)
    earlier.handle(events(30))
    earlier.close()
    with OTLPReceiver() as receiver:
        env = environ(tmp_path, receiver, OMNITRACE_EVENTS_LOG=str(path))
        bus = EventBus()
        sinks = build_sinks(bus, env)
        for sink in sinks:
            bus.add_sink(sink)
        for event in events(4):
            bus.emit(event)
        bus.close()
        assert receiver.wait_for(lambda r: hits(r) is not None, timeout=30)
        assert hits(receiver) == 4
        assert len(receiver.spans("omnitrace.graph.capture")) == 1


def test_per_signal_endpoints_are_the_childs_to_read(tmp_path: Path) -> None:
    """No endpoint is named on the child's command line: OTEL_EXPORTER_OTLP_TRACES_ENDPOINT and
    the like reach its exporters as they would the worker's."""
    relay = RelayedExport(
        tmp_path / "e.jsonl",
        environ={"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://traces:4318/v1/traces"},
        pid=os.getpid(),
        command=(sys.executable, "-c", "pass", "--"),
    )
    assert relay._process.wait(timeout=30) == 0
    relay.close()
    assert "--otlp" in relay.argv
    assert "--otlp-endpoint" not in relay.argv


def test_a_forked_child_of_the_worker_leaves_the_relay_alone(tmp_path: Path) -> None:
    relay = RelayedExport(
        tmp_path / "e.jsonl",
        environ=dict(os.environ),
        pid=os.getpid(),
        command=(sys.executable, "-c", "import sys; sys.stdin.read()", "--"),
    )
    try:
        child = os.fork()
        if child == 0:  # pragma: no cover - runs in the forked child
            relay.handle([])
            relay.close()  # must not close the pipe the parent's relay listens on
            os._exit(0)
        assert os.waitpid(child, 0)[1] == 0
        time.sleep(0.2)
        assert relay.returncode is None  # still running: the fork did not stop it
    finally:
        relay.close()
    assert relay._process.wait(timeout=30) == 0
