"""The paths a command reads or writes, checked before its work starts (``LABEL: PATH: REASON``,
a ConfigError), and results written atomically over the file they replace."""

from __future__ import annotations

import errno
import os
import secrets
import stat
from pathlib import Path

from omnitrace._files import check_regular, write_all
from omnitrace.config import ConfigError

__all__ = ["check_output", "check_readable", "describe_os_error", "write_atomically"]

_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_NONBLOCK = getattr(os, "O_NONBLOCK", 0)
_CLOEXEC = getattr(os, "O_CLOEXEC", 0)


def _reason(exc: OSError) -> str:
    return exc.strerror or str(exc)


def describe_os_error(exc: OSError) -> str:
    """Say what ``exc`` is about in the commands' wording: ``PATH: REASON``.

    ``str(OSError)`` is ``[Errno 13] Permission denied: 'x'``; the commands say
    ``x: Permission denied``.
    """
    if exc.filename is None:
        return _reason(exc)
    where = os.fsdecode(exc.filename)
    if exc.filename2 is not None:
        where += f" -> {os.fsdecode(exc.filename2)}"
    return f"{where}: {_reason(exc)}"


def _refuse(label: str, path: Path, reason: str) -> ConfigError:
    return ConfigError(f"{label}: {path}: {reason}" if label else f"{path}: {reason}")


def _existing_ancestor(directory: Path) -> Path:
    """The nearest of ``directory`` and its parents that exists (the first to be written)."""
    current = directory
    while True:
        try:
            os.stat(current)
        except OSError as exc:
            # Missing, or under a file: the nearest one that exists says which.
            if exc.errno in (errno.ENOENT, errno.ENOTDIR) and current.parent != current:
                current = current.parent
                continue
        return current  # (for another error, the probe below reports it)


def _probe_directory(directory: Path, label: str, path: Path) -> None:
    """Refuse ``path`` unless a file can be created (and is deleted again) in ``directory``."""
    probe = directory / f".omnitrace-check-{os.getpid()}-{secrets.token_hex(4)}"
    try:
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW | _CLOEXEC, 0o600)
    except OSError as exc:
        if exc.errno == errno.ENOTDIR:
            raise _refuse(label, path, f"{directory} is not a directory") from None
        if exc.errno == errno.ENOENT:
            # The directory is there (the caller found it): its file system takes no new
            # files (/proc, /sys). "No such file or directory" would name the wrong problem.
            raise _refuse(
                label, path, f"cannot create files in {directory} (its file system refuses them)"
            ) from None
        raise _refuse(label, path, f"{_reason(exc)} (cannot create files in {directory})") from None
    os.close(fd)
    os.unlink(probe)


def check_output(path: Path, label: str, *, append: bool = False) -> None:
    """Refuse, before any work, an output ``path`` the command could not write at its end.

    ``path`` may be missing, with missing directories above it (they are created when it is
    written); if it exists it must be a regular file that can be written. Its directory, or
    the nearest existing one above it, must take new files, since the output is written
    through a new file (the JSON summary is renamed over the old one, the event log is
    replaced) or creates one; only a file that is ``append``-ed to and exists needs no more
    than being writable (it is opened and written zero bytes, which a file that opens but
    takes no writes, such as ``/proc/version``, refuses). Nothing is created at ``path``,
    and nothing there is changed.

    Raises:
        ConfigError: naming ``label``, ``path`` and the reason, in one line.
    """
    try:
        # A link, a pipe, a device or a directory: refused in the wording of omnitrace._files.
        exists = check_regular(path, label)
    except OSError as exc:
        if exc.errno != errno.ENOTDIR:  # ENOTDIR: a file above it, named below
            raise _refuse(label, path, _reason(exc)) from None
        exists = False
    if exists:
        try:
            # No O_TRUNC, no O_CREAT: opening for writing changes nothing in the file.
            fd = os.open(path, os.O_WRONLY | _NOFOLLOW | _NONBLOCK | _CLOEXEC)
        except OSError as exc:
            raise _refuse(label, path, _reason(exc)) from None
        try:
            # A write of no bytes changes nothing in a regular file, but fails where the file
            # takes no writes though it opens (/proc/version as root: Invalid argument).
            os.write(fd, b"")
        except OSError as exc:
            raise _refuse(label, path, f"cannot be written ({_reason(exc)})") from None
        finally:
            os.close(fd)
        if append:
            return
    parent = path.parent
    ancestor = _existing_ancestor(parent)
    if ancestor != parent:
        try:
            kind = os.stat(ancestor).st_mode
        except OSError as exc:
            raise _refuse(label, path, f"{ancestor}: {_reason(exc)}") from None
        if not stat.S_ISDIR(kind):
            raise _refuse(label, path, f"{ancestor} is not a directory")
    _probe_directory(ancestor, label, path)


def check_readable(path: Path, label: str = "") -> None:
    """Refuse an input ``path`` that exists but cannot be opened for reading.

    The open is non-blocking and the file is closed at once (a named pipe is not waited on;
    what kind of file it is the readers check).

    Raises:
        FileNotFoundError: nothing is at ``path``.
        ConfigError: ``path`` cannot be opened (permissions, a file above it that is not a
            directory), in one line naming it.
    """
    try:
        fd = os.open(path, os.O_RDONLY | _NONBLOCK | _CLOEXEC)
    except FileNotFoundError:
        raise
    except OSError as exc:
        raise _refuse(label, path, _reason(exc)) from None
    os.close(fd)


def write_atomically(path: Path, data: bytes, label: str) -> None:
    """Replace ``path`` with a regular file holding ``data``, whole or not at all.

    The data goes to a temporary file in the same directory (created, with any missing
    directory above it), which is flushed to disk and renamed over ``path``: a reader sees
    the old file or the new one, and a failure (a full disk) leaves the old one as it was.
    An existing file keeps its permission bits.

    Raises:
        ConfigError: ``path`` is not a regular file (a link, a directory...).
        OSError: the file cannot be written.
    """
    existing = check_regular(path, label)
    path.parent.mkdir(parents=True, exist_ok=True)
    mode = stat.S_IMODE(os.stat(path).st_mode) if existing else 0o644
    temporary = path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")
    fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW | _CLOEXEC, mode)
    try:
        try:
            write_all(fd, data)
            os.fsync(fd)
        finally:
            os.close(fd)
        if existing:
            os.chmod(temporary, mode)  # the umask applied to os.open's mode
        os.replace(temporary, path)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise
