"""The observability benchmark's sinks: each arm's set on its bus (a sink that cannot be built
skipped, with the reason), and the relay exporting the event log's OTel from another process."""

from __future__ import annotations

import atexit
import contextlib
import io
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from omnitrace import EventBus
from omnitrace.testing_checkpoints.serving import free_port

#: structlog level for the log sink: the library's default (at "debug" every hit is a line).
LOG_LEVEL = "info"
#: Seconds of an arm's timed windows between two OTel metric collections.
METRIC_INTERVAL_S = 1.0
#: The sinks a server runs (the live view runs out of process there, on the JSONL log).
PRODUCTION_SINKS = ("otel", "logs", "jsonl")

#: The relayed arm's scraper: GET the URL every INTERVAL seconds until SIGTERM, then print the
#: scrapes that succeeded and those that failed after one had (before, the relay is starting).
_SCRAPER = """
import signal, sys, time, urllib.request
url, interval = sys.argv[1], float(sys.argv[2])
ok = failed = 0
stop = []
signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
while not stop:
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            response.read()
        ok += 1
    except OSError as exc:
        if ok:
            failed += 1
            print(f"scrape failed: {exc}", file=sys.stderr)
    time.sleep(interval)
print(ok, failed)
"""


class _Null(io.TextIOBase):
    """A text stream that drops everything."""

    def write(self, s: str) -> int:
        return len(s)

    def writable(self) -> bool:
        return True


@contextlib.contextmanager
def quiet() -> Iterator[None]:
    null = _Null()
    with contextlib.redirect_stdout(null), contextlib.redirect_stderr(null):
        yield


class _ActiveTimer:
    """Call ``fn`` every ``interval`` seconds spent inside :meth:`running` blocks (the countdown
    pauses between them), so a metric collection never lands in another arm's window."""

    def __init__(self, fn: Callable[[], object], interval: float) -> None:
        self.fn = fn
        self.interval = interval
        self.left = interval
        self.runs = 0

    @contextlib.contextmanager
    def running(self) -> Iterator[None]:
        stop = threading.Event()

        def loop() -> None:
            while True:
                started = time.monotonic()
                if stop.wait(self.left):
                    self.left = max(0.0, self.left - (time.monotonic() - started))
                    return
                with contextlib.suppress(Exception):
                    self.fn()
                self.runs += 1
                self.left = self.interval

        thread = threading.Thread(target=loop, name="bench-metric-collect", daemon=True)
        thread.start()
        try:
            yield
        finally:
            stop.set()
            thread.join()


class SinkSet:
    """The sinks ``names`` on one bus; ``report`` says per sink whether it is on or why it was
    skipped; ``active()`` runs what may run only in the arm's timed windows."""

    def __init__(self, bus: EventBus, names: Sequence[str], workdir: Path, arm: str) -> None:
        self.bus = bus
        self.report: dict[str, dict[str, Any]] = {}
        self.spans_exported: Callable[[], int] | None = None
        self.collector: _ActiveTimer | None = None
        self.jsonl_path: Path | None = None
        self._closers: list[Callable[[], Any]] = []
        self._live: Callable[[], Any] | None = None
        self._relay: Relay | None = None
        builders: dict[str, Callable[[], str]] = {
            "otel": self._otel,
            "logs": self._logs,
            "live": self._live_view,
            "jsonl": lambda: self._jsonl(workdir / f"{arm}.jsonl"),
            "relay": lambda: self._relayed(workdir, arm),
        }
        for name in names:
            try:
                with quiet():
                    detail = builders[name]()
            except Exception as exc:  # ImportError on a machine without the library, too
                self.report[name] = {
                    "status": "skipped",
                    "reason": f"{type(exc).__name__}: {exc}"[:300],
                    "not_importable": isinstance(exc, ImportError),
                }
            else:
                self.report[name] = {"status": "on", "reason": "", "detail": detail}

    @property
    def on(self) -> list[str]:
        return [n for n, s in self.report.items() if s["status"] == "on"]

    def _otel(self) -> str:
        from opentelemetry.sdk.metrics import MeterProvider
        from opentelemetry.sdk.metrics.export import InMemoryMetricReader
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
        from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

        from omnitrace.sinks.otel import OTelSink

        spans = InMemorySpanExporter()
        tracer_provider = TracerProvider()
        tracer_provider.add_span_processor(BatchSpanProcessor(spans))
        reader = InMemoryMetricReader()
        meter_provider = MeterProvider(metric_readers=[reader])
        sink = OTelSink(self.bus, tracer_provider=tracer_provider, meter_provider=meter_provider)
        self.bus.add_sink(sink)
        self._closers += [tracer_provider.shutdown, meter_provider.shutdown]
        self.spans_exported = lambda: len(spans.get_finished_spans())

        def collect() -> None:  # as a busy scraper or exporter would
            if (data := reader.get_metrics_data()) is not None:
                data.to_json()

        self.collector = _ActiveTimer(collect, METRIC_INTERVAL_S)
        return (
            "OTelSink: BatchSpanProcessor(in-memory exporter), metrics collected and "
            f"serialised every {METRIC_INTERVAL_S:g} s of this arm's timed windows"
        )

    def _logs(self) -> str:
        import structlog

        from omnitrace.sinks.logs import LogSink, configure_logging

        configure_logging(level=LOG_LEVEL, json=True, stream=_Null())
        self.bus.add_sink(LogSink())
        self._closers.append(structlog.reset_defaults)
        return f"LogSink: structlog JSON lines at level {LOG_LEVEL} to a null stream"

    def _live_view(self) -> str:
        from rich.console import Console

        from omnitrace.sinks.live import BusBoard, LiveView

        board = BusBoard(self.bus)  # attaches itself to the bus
        console = Console(file=_Null(), width=120, force_terminal=True)
        self._live = lambda: LiveView(board, console=console)
        return "BusBoard + LiveView rendering at its fixed rate to a null console"

    def _jsonl(self, path: Path) -> str:
        from omnitrace.sinks.jsonl import JsonlSink

        self.bus.add_sink(JsonlSink(path, bus=self.bus))
        self.jsonl_path = path
        return f"JsonlSink({path.name})"

    def _relayed(self, workdir: Path, arm: str) -> str:
        if self.jsonl_path is None:
            raise RuntimeError("the relay follows the arm's JSONL event log: add jsonl first")
        import opentelemetry.exporter.prometheus  # noqa: F401 -- skipped here if missing

        self._relay = Relay(self.jsonl_path, workdir / arm)
        return (
            f"omnitrace replay --follow {self.jsonl_path.name} --prometheus-port "
            f"{self._relay.port} in another process, /metrics scraped every "
            f"{METRIC_INTERVAL_S:g} s by a third"
        )

    def finish_relay(self) -> dict[str, Any] | None:
        """Stop the relay's processes; what they did (None without a relay)."""
        return None if self._relay is None else self._relay.finish()

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        with quiet(), contextlib.ExitStack() as stack:
            if self._live is not None:
                stack.enter_context(self._live())
            if self.collector is not None:
                stack.enter_context(self.collector.running())
            yield

    def close(self) -> None:
        if self._relay is not None:
            self._relay.kill()
        with quiet():
            for closer in self._closers:
                with contextlib.suppress(Exception):
                    closer()


class Relay:
    """``omnitrace replay --follow`` on an event log, and a process scraping its /metrics."""

    def __init__(self, log: Path, stem: Path) -> None:
        self.port = free_port()
        env = {k: v for k, v in os.environ.items() if not k.startswith(("OMNITRACE_", "OTEL_"))}
        self.out, self.err = stem.with_suffix(".relay.out"), stem.with_suffix(".relay.err")
        relay = [sys.executable, "-m", "omnitrace", "replay", "--follow", str(log)]
        self.process = subprocess.Popen(
            [*relay, "--prometheus-port", str(self.port)],
            stdout=self.out.open("w"),
            stderr=self.err.open("w"),
            env=env,
        )
        atexit.register(self.kill)  # never outlive the benchmark
        url = f"http://127.0.0.1:{self.port}/metrics"
        self.scraper = subprocess.Popen(
            [sys.executable, "-c", _SCRAPER, url, str(METRIC_INTERVAL_S)],
            stdout=subprocess.PIPE,
            text=True,
            env=env,
        )

    def finish(self) -> dict[str, Any]:
        """SIGTERM both; the relay must exit 0 having relayed the whole log."""
        self.scraper.send_signal(signal.SIGTERM)
        counts, _ = self.scraper.communicate(timeout=30)
        self.process.send_signal(signal.SIGTERM)
        code = self.process.wait(timeout=60)
        out, err = self.out.read_text(), self.err.read_text()
        if code != 0:
            raise RuntimeError(f"the relay exited with {code}: {err.strip()[-500:]}")
        relayed = next(
            (int(line.split()[1]) for line in out.splitlines() if line.startswith("replayed ")),
            None,
        )
        scrapes, failed = (int(n) for n in counts.split())
        if failed:
            raise RuntimeError(f"{failed} scrapes of the relay's /metrics failed ({scrapes} ok)")
        return dict(exit_code=code, relayed_events=relayed, scrapes=scrapes, scrape_failures=failed)

    def kill(self) -> None:
        for process in (self.scraper, self.process):
            if process.poll() is None:
                process.kill()
                process.wait()
