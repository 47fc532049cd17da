"""Flush the workers' buses on vLLM's own shutdown paths, before anything kills them; nothing
here runs on an encoder call (docs/vllm.md, "Stopping the server", says why and how)."""

from __future__ import annotations

import atexit
import contextlib
import functools
import logging
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, MutableMapping
from pathlib import Path
from typing import Any

__all__ = [
    "CLOSE_S",
    "ENV_SHUTDOWN_DIR",
    "KILL_DELAY_S",
    "announce",
    "hook_model_process",
    "hook_process_manager",
    "pending",
    "retire",
    "wait_for_flushes",
]

logger = logging.getLogger(__name__)

#: Set by the plugin in the first process that loads it (don't set it yourself): the
#: directory where the model processes of one server say that their bus is still open.
ENV_SHUTDOWN_DIR = "OMNITRACE_SHUTDOWN_DIR"
#: How long a model process spends closing its adapters and its bus at vLLM's shutdown.
CLOSE_S = 2.0
#: The longest the process manager's kill is held back for the model processes' close:
#: their close, its sinks' grace, and a margin for the process to get there.
KILL_DELAY_S = 3.0
_POLL_S = 0.01
_PATCHED = "_omnitrace_patched"
_METHOD = "shutdown"

_KILL_MODULE = "vllm.v1.utils"
_KILL_FUNCTION = "kill_process_tree"
#: (module, class) whose ``shutdown`` vLLM runs first when a model process stops.
_SHUTDOWN_OWNERS = (
    ("vllm.v1.engine.core", "EngineCoreProc"),
    ("vllm.v1.executor.multiproc_executor", "WorkerProc"),
)


def _directory(environ: MutableMapping[str, str] | None = None) -> Path | None:
    env = os.environ if environ is None else environ
    value = env.get(ENV_SHUTDOWN_DIR)
    return Path(value) if value else None


def announce(pid: int | None = None) -> Path | None:
    """Say that process ``pid`` (this one) has a bus to flush before it is killed.

    Returns:
        The file that says so, or None where no process manager waits (no directory, or it
        cannot be written: logged once, and the kill is then not held back).
    """
    directory = _directory()
    if directory is None:
        return None
    marker = directory / str(os.getpid() if pid is None else pid)
    try:
        marker.touch()
    except OSError as exc:
        logger.warning(
            "omnitrace: cannot write %s (%s); vLLM's shutdown may kill this worker before "
            "its event log and final summary are written",
            marker,
            exc,
        )
        return None
    return marker


def retire(pid: int | None = None) -> None:
    """Say that process ``pid`` (this one) closed its bus: a kill need not wait for it."""
    directory = _directory()
    if directory is not None:
        with contextlib.suppress(OSError):
            (directory / str(os.getpid() if pid is None else pid)).unlink()


def _running(pid: int) -> bool:
    """Whether ``pid`` is a process that still runs (a zombie has exited)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    fields = _stat_fields(pid)
    return fields is None or fields[:1] != ["Z"]


#: Where the kernel says each process's state and parent; without it (not Linux) every
#: announced process counts as running and as one a kill reaches.
_PROC = Path("/proc")
#: Deeper than any tree vLLM starts (API server, engine core, workers).
_MAX_DEPTH = 64


def _stat_fields(pid: int) -> list[str] | None:
    """The fields of ``/proc/PID/stat`` after the command (state, parent, ...); None where
    it cannot be read."""
    try:
        stat = (_PROC / str(pid) / "stat").read_text()
    except OSError:
        return None
    # "pid (comm) state ppid ...": the command may hold spaces and parentheses.
    return stat.rpartition(")")[2].split()


def _parent(pid: int) -> int | None:
    """The parent of ``pid``, None once it is gone."""
    fields = _stat_fields(pid)
    return int(fields[1]) if fields and len(fields) > 1 and fields[1].isdigit() else None


def _in_tree(pid: int, root: int) -> bool:
    """Whether ``pid`` is ``root`` or one of its descendants: a process vLLM's
    ``kill_process_tree(root)`` kills. True where the kernel cannot say (no ``/proc``)."""
    if not (_PROC / "self" / "stat").exists():
        return True
    for _ in range(_MAX_DEPTH):
        if pid == root:
            return True
        parent = _parent(pid)
        if parent is None or parent <= 1:
            return False
        pid = parent
    return False


def pending(directory: Path | None = None, root: int | None = None) -> list[int]:
    """The pids whose bus is still open, less those that exited, less this process; with
    ``root``, only ``root`` and its descendants (what killing ``root``'s tree reaches)."""
    directory = _directory() if directory is None else directory
    if directory is None:
        return []
    try:
        names = [path.name for path in directory.iterdir()]
    except OSError:
        return []
    me = os.getpid()
    return [
        int(n)
        for n in names
        if n.isdigit()
        and int(n) != me
        and _running(int(n))
        and (root is None or _in_tree(int(n), root))
    ]


def wait_for_flushes(timeout: float, root: int | None = None) -> list[int]:
    """Wait up to ``timeout`` seconds until no process of this server that announced a bus
    (in ``root``'s tree, with ``root``) has it open.

    Returns:
        The pids still flushing when the time ran out (empty when none was left).
    """
    deadline = time.monotonic() + timeout
    left = pending(root=root)
    while left and time.monotonic() < deadline:
        time.sleep(_POLL_S)
        left = pending(root=root)
    return left


def _killed_root(args: tuple[Any, ...], kwargs: dict[str, Any]) -> int | None:
    """The pid ``kill_process_tree`` is called with; None if it is not one (every announced
    process is then waited for)."""
    pid = kwargs.get("pid", args[0] if args else None)
    return pid if isinstance(pid, int) and not isinstance(pid, bool) and pid > 0 else None


def _wrap_kill(kill: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(kill)
    def kill_after_flush(*args: Any, **kwargs: Any) -> Any:
        start = time.monotonic()
        # Only what this kill reaches: with several API servers vLLM kills each of them
        # before the engine core, and the workers close only once the engine core stops.
        left = wait_for_flushes(KILL_DELAY_S, _killed_root(args, kwargs))
        waited = time.monotonic() - start
        if left:
            logger.warning(
                "omnitrace: workers %s had not closed their event bus after %.1f s; vLLM "
                "kills them now, and what they had not written is lost",
                ", ".join(map(str, left)),
                waited,
            )
        elif waited >= 0.05:
            logger.info(
                "omnitrace: the workers closed their event bus; vLLM's kill waited %.2f s",
                waited,
            )
        return kill(*args, **kwargs)

    setattr(kill_after_flush, _PATCHED, True)
    return kill_after_flush


def hook_process_manager(environ: MutableMapping[str, str] | None = None) -> bool:
    """Hold vLLM's process-manager kill of a process tree back until the processes in that
    tree that announced a bus (model processes, and API servers that are not the manager)
    closed it or exited.

    Only where vLLM's process manager is already imported (the API server, ``vllm.LLM``'s
    process, or ``vllm serve --api-server-count N``'s parent): the first such process makes
    the directory the others announce themselves in, and removes it at its exit; the
    children inherit its name.

    Returns:
        Whether the kill is held back in this process.
    """
    env = os.environ if environ is None else environ
    module = sys.modules.get(_KILL_MODULE)
    kill = getattr(module, _KILL_FUNCTION, None)
    if module is None or not callable(kill):
        return False
    if not env.get(ENV_SHUTDOWN_DIR):
        try:
            made = tempfile.mkdtemp(prefix="omnitrace-shutdown-")
        except OSError as exc:
            logger.warning(
                "omnitrace: cannot make a directory for the workers' shutdown (%s); vLLM's "
                "shutdown may kill them before their event logs and final summaries are "
                "written",
                exc,
            )
            return False
        env[ENV_SHUTDOWN_DIR] = made
        atexit.register(shutil.rmtree, made, True)
    if not getattr(kill, _PATCHED, False):
        setattr(module, _KILL_FUNCTION, _wrap_kill(kill))
    return True


def _wrap_shutdown(
    shutdown: Callable[..., Any], close: Callable[[str], object], where: str
) -> Callable[..., Any]:
    @functools.wraps(shutdown)
    def shutdown_after_close(self: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            close(where)
        except Exception:
            # vLLM's own teardown must run whatever the close did.
            logger.exception("omnitrace: closing the event bus at %s failed", where)
        return shutdown(self, *args, **kwargs)

    setattr(shutdown_after_close, _PATCHED, True)
    return shutdown_after_close


def hook_model_process(close: Callable[[str], object]) -> list[str]:
    """Run ``close(where)`` first when vLLM shuts down this model process.

    Wraps ``shutdown`` of the engine core process and of the multiprocess executor's worker
    (where vLLM imported them; nothing is imported here), once per process.

    Returns:
        The methods that are wrapped, as ``module.Class.shutdown``.
    """
    hooked = []
    for module_name, class_name in _SHUTDOWN_OWNERS:
        owner = getattr(sys.modules.get(module_name), class_name, None)
        # EngineCoreProc inherits shutdown from EngineCore, which an engine in the caller's
        # own process runs too: the wrapper is set on the subclass only.
        if not isinstance(owner, type):
            continue
        method = getattr(owner, _METHOD, None)
        if not callable(method):
            continue
        where = f"{module_name}.{class_name}.shutdown"
        if not getattr(method, _PATCHED, False):
            setattr(owner, _METHOD, _wrap_shutdown(method, close, where))
        hooked.append(where)
    return hooked
