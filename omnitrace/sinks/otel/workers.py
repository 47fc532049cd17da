"""OpenTelemetry export of replayed event logs, each worker under a resource of its own (its
rank and pid) and, for Prometheus, a registry of its own."""

from __future__ import annotations

import os
import threading
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from omnitrace._env import OTLPEndpoint, otlp_endpoints, otlp_where
from omnitrace.bus import EventBus
from omnitrace.eventlog import AdapterInfo, EventRecord
from omnitrace.sinks.names import ATTR
from omnitrace.sinks.otel.sdk import OTelSetup, configure_sdk, sdk_sink

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry
    from prometheus_client.metrics_core import Metric

__all__ = ["WorkerExport"]

#: Events emitted into a writer's bus between two waits for its sink (a bus queue is larger).
CHUNK = 1_000
#: Seconds one wait for a writer's sink may take (what it still could not take is counted
#: as dropped by that bus).
DRAIN_TIMEOUT_S = 30.0
#: Prometheus labels of a writer's series: its resource attributes as a collector names them.
RANK_LABEL = ATTR.RANK.replace(".", "_")
PID_LABEL = ATTR.PROCESS_PID.replace(".", "_")


@dataclass
class _Writer:
    """One worker of the logs: its bus, the export of its bus, and its scrape registry."""

    rank: int
    pid: int
    bus: EventBus
    setup: OTelSetup
    registry: CollectorRegistry | None
    pending: int = 0


class _Merged:
    """A Prometheus collector serving every writer's metrics, labelled with the writer."""

    def __init__(self, export: WorkerExport) -> None:
        self._export = export

    def collect(self) -> Iterator[Metric]:
        from prometheus_client.metrics_core import Metric

        families: dict[str, Metric] = {}
        for writer in self._export.writers():
            if writer.registry is None:
                continue
            labels = {RANK_LABEL: str(writer.rank), PID_LABEL: str(writer.pid)}
            for family in writer.registry.collect():
                merged = families.get(family.name)
                if merged is None:
                    merged = families[family.name] = Metric(
                        family.name, family.documentation, family.type, family.unit
                    )
                for sample in family.samples:
                    merged.samples.append(sample._replace(labels={**sample.labels, **labels}))
        yield from families.values()


class WorkerExport:
    """Spans and metrics of replayed logs, one OpenTelemetry resource per writer.

    The settings are checked, and the scrape endpoint started, when this is built, so a bad
    ``OTEL_*`` variable, a missing extra or a taken port fail the replay before it reads;
    each writer's providers are made when its first record arrives.

    Args:
        prometheus_port: serve ``/metrics`` for all writers on this port (0: a free one).
        prometheus_host: the address the scrape endpoint binds.
        settings: the other arguments of :func:`~omnitrace.sinks.otel.sdk.configure_sdk`
            (``prometheus=True`` adds each writer's metrics to the scrape endpoint).

    Raises:
        ConfigError: a setting or a standard variable is out of range (as configure_sdk).
        ImportError: an exporter that is asked for is not installed (as configure_sdk).
        OSError: the scrape endpoint cannot listen on the port.
    """

    def __init__(
        self,
        *,
        prometheus_port: int | None = None,
        prometheus_host: str = "127.0.0.1",
        **settings: Any,
    ) -> None:
        self._settings = settings
        self._prometheus = bool(settings.pop("prometheus", False)) or prometheus_port is not None
        # The settings as the first writer will use them, without exporting anything: no
        # metric exporter, and a span processor that is shut down before any span.
        check = configure_sdk(**{**settings, "otlp_metrics": False})
        check.shutdown()
        self.protocol = check.protocol
        #: Each exported signal's endpoint, as every writer's exporters get them.
        self.endpoints: dict[str, OTLPEndpoint] = {}
        #: Where the signals go, in a few words (None: no OTLP export).
        self.endpoint: str | None = None
        if check.protocol is not None:
            self.endpoints = otlp_endpoints(
                os.environ, check.protocol, base=settings.get("endpoint")
            )
            if not settings.get("otlp_metrics", True):
                del self.endpoints["metrics"]
            self.endpoint = otlp_where(self.endpoints, check.protocol)
        self._lock = threading.Lock()
        self._writers: dict[tuple[tuple[int, int], str], _Writer] = {}
        self._closed = False
        self._server: Any = None
        self._thread: threading.Thread | None = None
        if prometheus_port is not None:
            from prometheus_client import CollectorRegistry, start_http_server

            registry = CollectorRegistry()
            registry.register(_Merged(self))
            self._server, self._thread = start_http_server(
                prometheus_port, addr=prometheus_host, registry=registry
            )

    @property
    def prometheus_port(self) -> int | None:
        """The port the scrape endpoint listens on, if one was started."""
        return None if self._server is None else int(self._server.server_port)

    def writers(self) -> list[_Writer]:
        """The writers seen so far, in the order they were seen."""
        with self._lock:
            return list(self._writers.values())

    def __call__(self, record: EventRecord, suffix: str) -> None:
        """Emit ``record`` into its writer's bus (made on the writer's first record)."""
        writer = self._writers.get((record.source, suffix))
        if writer is None:
            writer = self._add(record.source, suffix)
        item = record.item
        if isinstance(item, AdapterInfo):
            writer.bus.register_adapter(item.adapter, item.info)
            return
        writer.bus.emit(item)
        writer.pending += 1
        if writer.pending >= CHUNK:
            # The bus's queue is bounded: wait for its sink now and then, so a log of any
            # length goes through without a drop.
            writer.pending = 0
            writer.bus.flush(timeout=DRAIN_TIMEOUT_S)

    def _add(self, source: tuple[int, int], suffix: str) -> _Writer:
        rank, pid = source
        registry = None
        if self._prometheus:
            from prometheus_client import CollectorRegistry

            registry = CollectorRegistry()
        bus = EventBus()
        sink, setup = sdk_sink(
            bus,
            **self._settings,
            prometheus=registry is not None,
            prometheus_registry=registry,
            resource_defaults={
                ATTR.RANK: rank,
                ATTR.PROCESS_PID: pid,
                # The SDK gives every resource of a process one instance id; a collector
                # makes it Prometheus's `instance` label, so each writer gets its own.
                ATTR.SERVICE_INSTANCE_ID: str(uuid.uuid4()),
            },
        )
        bus.add_sink(sink)
        writer = _Writer(rank, pid, bus, setup, registry)
        with self._lock:
            self._writers[(source, suffix)] = writer
        return writer

    @property
    def dropped(self) -> int:
        """Events a writer's sink lost (a full queue, a sink that failed)."""
        return sum(writer.bus.statistics().dropped for writer in self.writers())

    @property
    def export_error(self) -> str | None:
        """One line saying which OTLP export failed, where and why; None when none did."""
        for writer in self.writers():
            error = writer.setup.export_error
            if error is not None:
                return error
        return None

    def shutdown(self) -> bool:
        """Deliver what the writers' buses hold, export it, and stop the scrape endpoint.

        Idempotent. Returns:
            True when everything handed to the exporters was exported.
        """
        with self._lock:
            if self._closed:
                return self.export_error is None
            self._closed = True
        writers = self.writers()
        for writer in writers:
            writer.bus.close()
        # Side by side: each shutdown is bounded (0.8 s against a dead endpoint), so the
        # replay's exit is too, however many workers it exported.
        results = [False] * len(writers)

        def stop(index: int) -> None:
            results[index] = writers[index].setup.shutdown()

        threads = [threading.Thread(target=stop, args=(i,)) for i in range(len(writers))]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        exported = all(results)
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            if self._thread is not None:
                self._thread.join(1.0)
        return exported
