"""OpenTelemetry export beside the worker, off its GIL: ``omnitrace replay --follow`` on the
worker's event log (``OMNITRACE_EVENTS_LOG``)."""

from __future__ import annotations

import contextlib
import logging
import os
import subprocess
import sys
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from omnitrace._env import env_flag
from omnitrace._worker import worker_rank
from omnitrace.config import ConfigError
from omnitrace.sinks.jsonl import worker_log_path
from omnitrace.sinks.names import ATTR
from omnitrace.sinks.registry import SinkDeclaration, SinkRequest

if TYPE_CHECKING:
    from omnitrace.events import Event

__all__ = ["SINK", "RelayedExport"]

logger = logging.getLogger(__name__)

#: The variables of the worker the child does not get: it must not write, log or relay
#: again what the worker already does.
_WORKER_ONLY = "OMNITRACE_"


class RelayedExport:
    """Run ``omnitrace replay --follow LOG`` in a child process for as long as the bus runs.

    Args:
        log: the worker's event log (its ``{pid}``/``{rank}`` already filled in).
        environ: the worker's environment; the child gets its ``OTEL_*`` variables and
            none of its ``OMNITRACE_*`` ones.
        pid: the worker's process id (the child stops once it has exited).
        rank: the worker's rank, when known (a resource attribute, as in-process).
        command: how to run omnitrace's command line (this interpreter's ``-m omnitrace``).

    Raises:
        OSError: the child could not be started.
    """

    name = "otlp-relay"

    def __init__(
        self,
        log: str | os.PathLike[str],
        *,
        environ: Mapping[str, str],
        pid: int,
        rank: int | None = None,
        command: Sequence[str] = (sys.executable, "-m", "omnitrace"),
    ) -> None:
        self.log = Path(os.fspath(log))
        try:
            # This worker's lines start here: an earlier run's, above, were exported then.
            offset = os.path.getsize(self.log)
        except OSError:
            offset = 0
        self.argv = [
            *command,
            "replay",
            "--follow",
            str(self.log),
            "--from-offset",
            str(offset),
            # OpenTelemetry's own variables say where (per-signal endpoints too).
            "--otlp",
            "--until-exit",
            str(pid),
            "--until-stdin-closes",
        ]
        child_env = {k: v for k, v in environ.items() if not k.startswith(_WORKER_ONLY)}
        # The worker's identity, as OMNITRACE_OTLP=1 would have exported it from inside:
        # its service name (default "omnitrace"), its pid and rank as resource attributes.
        child_env["OTEL_SERVICE_NAME"] = environ.get("OTEL_SERVICE_NAME", "").strip() or "omnitrace"
        identity = f"{ATTR.PROCESS_PID}={pid}"
        if rank is not None:
            identity += f",{ATTR.RANK}={rank}"
        given = environ.get("OTEL_RESOURCE_ATTRIBUTES", "").strip()
        child_env["OTEL_RESOURCE_ATTRIBUTES"] = f"{given},{identity}" if given else identity
        self._process = subprocess.Popen(
            self.argv,
            # Closing this pipe tells it to stop: close() does, and so does the worker's
            # exit, however it ends (the relay also watches the worker's pid).
            stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL,  # the final stats table; the worker has its own
            env=child_env,
            # A session of its own: a Ctrl-C at the server's terminal does not cut its final
            # export short; the worker's close or its exit ends the child.
            start_new_session=True,
        )
        self._reported = False
        # A forked child of the worker inherits this object, not the relay: it leaves it be.
        self._owner = os.getpid()

    @property
    def pid(self) -> int:
        """The child's process id."""
        return self._process.pid

    @property
    def returncode(self) -> int | None:
        """The child's exit status, None while it runs."""
        return self._process.poll()

    def __repr__(self) -> str:
        state = "running" if self.returncode is None else f"exited {self.returncode}"
        return f"<RelayedExport {str(self.log)!r} pid={self.pid} {state}>"

    def handle(self, events: Sequence[Event]) -> None:
        """Check the child is still there (the events reach it through the log)."""
        if os.getpid() != self._owner:
            return
        if not self._reported and self._process.poll() is not None:
            self._reported = True
            logger.error(
                "the OpenTelemetry relay of %s (pid %d) exited with status %s; spans and "
                "metrics are no longer exported (its error is on this process's stderr)",
                self.log,
                self._process.pid,
                self._process.returncode,
            )

    def close(self) -> None:
        """Tell the child to relay what is left, export it and exit; do not wait for it."""
        if os.getpid() != self._owner or self._process.stdin is None:
            return
        with contextlib.suppress(OSError):
            self._process.stdin.close()
        # Reaped when it is done, so it never lingers as a zombie of a long-lived worker.
        threading.Thread(
            target=self._process.wait, name="omnitrace-relay-reaper", daemon=True
        ).start()


def _build_sink(request: SinkRequest) -> RelayedExport:
    environ = request.environ
    log = environ.get("OMNITRACE_EVENTS_LOG", "").strip()
    if not log:
        raise ConfigError(
            "OMNITRACE_OTLP_RELAY: the relay follows the worker's event log; set "
            "OMNITRACE_EVENTS_LOG too"
        )
    if env_flag(environ, "OMNITRACE_OTLP", False):
        raise ConfigError(
            "OMNITRACE_OTLP_RELAY: OMNITRACE_OTLP is set too, and every span and metric would "
            "be exported twice; set one of them"
        )
    # The path the worker's JSONL sink writes, with the same rank.
    path = worker_log_path(
        log, pid=request.pid, rank=worker_rank(environ), label="OMNITRACE_EVENTS_LOG"
    )
    return RelayedExport(path, environ=environ, pid=request.pid, rank=request.rank)


#: This sink's entry in the table of omnitrace.sinks.registry, which reads it from here (its
#: description is the first paragraph of this module's docstring).
SINK = SinkDeclaration(
    name="otlp-relay", env="OMNITRACE_OTLP_RELAY", order=30, build=_build_sink, switch=True
)
