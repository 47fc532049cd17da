"""configure_sdk against a loopback receiver: OpenTelemetry's variables and a bounded shutdown."""

from __future__ import annotations

import logging
import socket
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from omnitrace import ConfigError, EncoderCudaGraph, EncoderGraphConfig, EventBus
from omnitrace.integrations import vllm_plugin
from omnitrace.otlp_receiver import OTLPReceiver, attributes
from omnitrace.sinks.names import ATTR, METRICS
from omnitrace.sinks.otel import OTelSink
from omnitrace.sinks.otel import sdk as otel_sdk
from omnitrace.sinks.otel.sdk import OTelSetup, configure_sdk
from omnitrace.testing import SimulatedGraphBackend

OTEL_VARIABLES = (
    "OTEL_SERVICE_NAME",
    "OTEL_RESOURCE_ATTRIBUTES",
    "OTEL_METRIC_EXPORT_INTERVAL",
    "OTEL_BSP_SCHEDULE_DELAY",
    "OTEL_EXPORTER_OTLP_ENDPOINT",
    "OTEL_EXPORTER_OTLP_PROTOCOL",
)


@pytest.fixture(autouse=True)
def _no_otel_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in OTEL_VARIABLES:
        monkeypatch.delenv(name, raising=False)


@pytest.fixture
def receiver() -> Iterator[OTLPReceiver]:
    with OTLPReceiver() as r:
        yield r


def _resource_of_a_span(receiver: OTLPReceiver, **kwargs: Any) -> dict[str, Any]:
    """Export one span with configure_sdk(**kwargs); return the resource it arrived with."""
    setup = configure_sdk(endpoint=receiver.endpoint, export_interval_s=600, **kwargs)
    try:
        setup.tracer_provider.get_tracer("test").start_span("probe").end()
        assert setup.force_flush()
        assert receiver.wait_for(lambda r: r.spans("probe"))
    finally:
        setup.shutdown()
    return attributes(receiver.resource_spans()[-1].resource.attributes)


@pytest.mark.parametrize(
    ("variables", "kwargs", "expected"),
    [
        ({}, {}, "omnitrace"),
        ({}, {"default_service_name": "omnitrace-demo"}, "omnitrace-demo"),
        ({"OTEL_SERVICE_NAME": "myservice"}, {"default_service_name": "x"}, "myservice"),
        ({"OTEL_RESOURCE_ATTRIBUTES": "service.name=fromattrs"}, {}, "fromattrs"),
        (
            {"OTEL_SERVICE_NAME": "myservice", "OTEL_RESOURCE_ATTRIBUTES": "service.name=other"},
            {},
            "myservice",
        ),
        ({"OTEL_SERVICE_NAME": "myservice"}, {"service_name": "explicit"}, "explicit"),
    ],
)
def test_service_name_is_argument_then_variables_then_default(
    receiver: OTLPReceiver,
    monkeypatch: pytest.MonkeyPatch,
    variables: dict[str, str],
    kwargs: dict[str, str],
    expected: str,
) -> None:
    """service.name: argument, else OTEL_SERVICE_NAME, else the attributes, else the default."""
    for name, value in variables.items():
        monkeypatch.setenv(name, value)
    assert _resource_of_a_span(receiver, **kwargs)[ATTR.SERVICE_NAME] == expected


def test_resource_attributes_variable_overrides_defaults_not_arguments(
    receiver: OTLPReceiver, monkeypatch: pytest.MonkeyPatch
) -> None:
    """OTEL_RESOURCE_ATTRIBUTES adds and overrides defaults; resource_attributes= beats it."""
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv(
        "OTEL_RESOURCE_ATTRIBUTES",
        "deployment.environment=staging,omnitrace.worker.rank=7,team=encoders",
    )
    resource = _resource_of_a_span(receiver, resource_attributes={"team": "graphs"})
    assert resource["deployment.environment"] == "staging"
    assert resource[ATTR.RANK] == "7"  # the variable beats the RANK default
    assert resource["team"] == "graphs"  # the argument beats the variable


def _serve_vision(bus: EventBus, calls: int) -> None:
    """Make ``calls`` calls of one shape on a simulated vision adapter, then flush the bus."""
    graph = EncoderCudaGraph(
        torch.tanh,
        name="vision",
        config=EncoderGraphConfig(min_free_bytes=0),
        bus=bus,
        backend=SimulatedGraphBackend(),
    )
    with torch.no_grad():
        for _ in range(calls):
            graph(torch.ones(2))
    assert bus.flush(5.0)


def _record_setups(monkeypatch: pytest.MonkeyPatch) -> list[OTelSetup]:
    """Wrap ``otel_sdk.configure_sdk`` so every setup it makes is listed."""
    created: list[OTelSetup] = []
    real = otel_sdk.configure_sdk

    def recording(**kwargs: Any) -> OTelSetup:
        created.append(real(**kwargs))
        return created[-1]

    monkeypatch.setattr(otel_sdk, "configure_sdk", recording)
    return created


def _hits_metric_arrives_within(receiver: OTLPReceiver, seconds: float, **kwargs: Any) -> bool:
    setup = configure_sdk(endpoint=receiver.endpoint, **kwargs)
    bus = EventBus()
    bus.register_adapter("vision", {"max_graphs": 4})
    bus.add_sink(
        OTelSink(bus, tracer_provider=setup.tracer_provider, meter_provider=setup.meter_provider)
    )
    try:
        # No force_flush: only the periodic reader can deliver the metric.
        return receiver.wait_for(lambda r: r.metrics(METRICS["hits"].otel), timeout=seconds)
    finally:
        bus.close()
        setup.shutdown()


def test_metric_export_interval_variable_sets_the_period(
    receiver: OTLPReceiver, monkeypatch: pytest.MonkeyPatch
) -> None:
    """OTEL_METRIC_EXPORT_INTERVAL=200 (ms) makes metrics arrive without a flush."""
    monkeypatch.setenv("OTEL_METRIC_EXPORT_INTERVAL", "200")
    assert _hits_metric_arrives_within(receiver, 3.0)


def test_explicit_export_interval_beats_the_variable(
    receiver: OTLPReceiver, monkeypatch: pytest.MonkeyPatch
) -> None:
    """export_interval_s=600 wins over OTEL_METRIC_EXPORT_INTERVAL=200: nothing within 1 s."""
    monkeypatch.setenv("OTEL_METRIC_EXPORT_INTERVAL", "200")
    assert not _hits_metric_arrives_within(receiver, 1.0, export_interval_s=600)


def test_span_schedule_delay_variable_sets_the_batch_delay(
    receiver: OTLPReceiver, monkeypatch: pytest.MonkeyPatch
) -> None:
    """OTEL_BSP_SCHEDULE_DELAY=100 (ms) sends spans without a flush (default would be 5 s)."""
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "100")
    setup = configure_sdk(endpoint=receiver.endpoint, export_interval_s=600)
    try:
        setup.tracer_provider.get_tracer("test").start_span("probe").end()
        assert receiver.wait_for(lambda r: r.spans("probe"), timeout=3.0)
    finally:
        setup.shutdown()


@pytest.mark.parametrize("variable", ["OTEL_METRIC_EXPORT_INTERVAL", "OTEL_BSP_SCHEDULE_DELAY"])
@pytest.mark.parametrize("raw", ["abc", "0", "-5", "nan", "1e-300", "9", "1e300", "86400001"])
def test_bad_interval_variable_is_named_in_the_error(
    monkeypatch: pytest.MonkeyPatch, variable: str, raw: str
) -> None:
    """An export interval variable outside 10 ms to a day (1e300 once ended in an
    OverflowError in the SDK's thread) is a ConfigError naming the variable, range and value."""
    monkeypatch.setenv(variable, raw)
    message = f"{variable}: expected a number of milliseconds from 10 to 86400000, got {raw!r}"
    with pytest.raises(ConfigError) as info:
        configure_sdk(otlp=False)
    assert str(info.value) == message


@pytest.mark.parametrize(
    ("argument", "value", "message"),
    [
        ("export_interval_s", 1e300, "a number of seconds from 0.01 to 86400, got 1e+300"),
        ("export_interval_s", 1e-300, "a number of seconds from 0.01 to 86400, got 1e-300"),
        ("export_timeout_s", 1e300, "a number of seconds from 0.01 to 600, got 1e+300"),
        ("export_timeout_s", 0, "a number of seconds from 0.01 to 600, got 0"),
    ],
)
def test_interval_and_timeout_arguments_have_a_range(
    argument: str, value: float, message: str
) -> None:
    """export_interval_s and export_timeout_s are refused outside their range, in one line."""
    with pytest.raises(ConfigError) as info:
        configure_sdk(otlp=False, **{argument: value})
    assert str(info.value).startswith(f"{argument}: expected {message}")


def test_vllm_plugin_takes_its_service_name_from_otel_service_name(
    receiver: OTLPReceiver, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The plugin's OTLP sink exports with OTEL_SERVICE_NAME from the worker's environment."""
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", receiver.endpoint)
    created = _record_setups(monkeypatch)
    bus = EventBus()
    try:
        environ = {"OMNITRACE_OTLP": "1", "OTEL_SERVICE_NAME": "minicpmo-worker"}
        for sink in vllm_plugin._build_sinks(bus, environ):
            bus.add_sink(sink)
        _serve_vision(bus, 3)
        (setup,) = created
        assert setup.force_flush()
        assert receiver.wait_for(lambda r: r.spans())
        resource = attributes(receiver.resource_spans()[0].resource.attributes)
        assert resource[ATTR.SERVICE_NAME] == "minicpmo-worker"
    finally:
        bus.close()
        for setup in created:
            setup.shutdown()


# -- a dead endpoint at shutdown -------------------------------------------------------------


@pytest.fixture
def silent_endpoint() -> Iterator[str]:
    """A port that accepts connections and never answers."""
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(64)
        yield f"http://127.0.0.1:{server.getsockname()[1]}"


def _refused_endpoint() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"


def _setup_with_pending_span(endpoint: str) -> OTelSetup:
    setup = configure_sdk(endpoint=endpoint, export_interval_s=600, export_timeout_s=10)
    setup.tracer_provider.get_tracer("test").start_span("pending").end()
    return setup


@pytest.mark.parametrize("kind", ["refused", "silent"])
def test_shutdown_against_a_dead_endpoint_takes_under_a_second_and_says_why(
    kind: str, silent_endpoint: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Shutdown with a span pending returns within 1 s, False, with one line naming the endpoint."""
    endpoint = _refused_endpoint() if kind == "refused" else silent_endpoint
    setup = _setup_with_pending_span(endpoint)
    with caplog.at_level(logging.DEBUG, logger="opentelemetry"):
        start = time.monotonic()
        exported = setup.shutdown()
        elapsed = time.monotonic() - start
    assert exported is False
    assert elapsed < 1.0
    error = setup.export_error
    assert error is not None
    assert error.startswith(f"OTLP export to {endpoint} (http/protobuf) failed: ")
    cause = "Connection refused" if kind == "refused" else "no answer within 0.8 s"
    assert cause in error
    # The SDK's "Transient error ... retrying" lines are suppressed.
    assert [r.getMessage() for r in caplog.records if r.name.startswith("opentelemetry")] == []


def test_shutdown_after_a_successful_export_reports_no_error(receiver: OTLPReceiver) -> None:
    """Against a live receiver, shutdown exports the pending span and returns True."""
    setup = _setup_with_pending_span(receiver.endpoint)
    assert setup.shutdown() is True
    assert setup.export_error is None
    assert receiver.spans("pending")


# -- sdk_sink: the one OpenTelemetry wiring of the plugin, the demo and replay ---------------


def test_sdk_sink_exports_the_bus_through_the_sdk_it_wired(receiver: OTLPReceiver) -> None:
    """sdk_sink returns an OTelSink on configure_sdk's providers and the setup that owns them."""
    bus = EventBus()
    sink, setup = otel_sdk.sdk_sink(
        bus, endpoint=receiver.endpoint, export_interval_s=600, service_name="wired"
    )
    try:
        assert isinstance(sink, OTelSink)
        assert isinstance(setup, OTelSetup)
        bus.add_sink(sink)
        _serve_vision(bus, 2)
        assert setup.force_flush()
        assert receiver.wait_for(lambda r: r.spans())
        resource = attributes(receiver.resource_spans()[0].resource.attributes)
        assert resource[ATTR.SERVICE_NAME] == "wired"
    finally:
        bus.close()
        setup.shutdown()


def test_sdk_sink_stops_the_sdk_when_the_sink_cannot_be_made(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """If OTelSink raises, the scrape endpoint configure_sdk started is closed again."""
    from prometheus_client import CollectorRegistry

    created = _record_setups(monkeypatch)

    def broken(*args: Any, **kwargs: Any) -> OTelSink:
        raise RuntimeError("no sink today")

    monkeypatch.setattr(otel_sdk, "OTelSink", broken)
    bus = EventBus()
    try:
        with pytest.raises(RuntimeError, match="no sink today"):
            otel_sdk.sdk_sink(
                bus,
                otlp=False,
                prometheus=True,
                prometheus_port=0,
                prometheus_registry=CollectorRegistry(),
            )
    finally:
        bus.close()
    (setup,) = created
    port = setup.prometheus_port
    assert port is not None
    assert setup.force_flush() is False  # shut down
    with socket.socket() as probe, pytest.raises(ConnectionRefusedError):
        probe.connect(("127.0.0.1", port))
