"""The files omnitrace writes: regular files only, never through a symbolic link; anything else
(a device, a pipe, a planted link) is refused with a one-line ConfigError."""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path

from omnitrace.config import ConfigError

__all__ = [
    "check_regular",
    "kind_of",
    "open_regular",
    "open_regular_for_reading",
    "unlink_regular",
    "write_all",
    "write_regular",
]

_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_NONBLOCK = getattr(os, "O_NONBLOCK", 0)
_CLOEXEC = getattr(os, "O_CLOEXEC", 0)


def kind_of(mode: int) -> str:
    """Name the kind of file ``mode`` (an ``st_mode``) describes."""
    for test, name in (
        (stat.S_ISREG, "a regular file"),
        (stat.S_ISDIR, "a directory"),
        (stat.S_ISLNK, "a symbolic link"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISFIFO, "a named pipe"),
        (stat.S_ISSOCK, "a socket"),
    ):
        if test(mode):
            return name
    return "not a regular file"


def _refuse(label: str, path: Path, kind: str) -> ConfigError:
    return ConfigError(
        f"{label}: {path} is {kind}, not a regular file; omnitrace only writes, rotates and "
        "deletes regular files"
    )


def check_regular(path: Path, label: str) -> bool:
    """Return whether ``path`` exists as a regular file (False when nothing is there).

    Raises:
        ConfigError: something other than a regular file is at ``path`` (a symbolic link
            too, whatever it points to).
    """
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return False
    if not stat.S_ISREG(mode):
        raise _refuse(label, path, kind_of(mode))
    return True


def open_regular(path: Path, label: str) -> int:
    """Open or create ``path`` for appending and return the descriptor.

    The open never follows a final symbolic link and never blocks on a named pipe, and the
    opened file is checked to be regular before anything is written.

    Raises:
        ConfigError: ``path`` is not a regular file.
        OSError: the file cannot be opened for another reason (permissions, ...).
    """
    flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | _NOFOLLOW | _NONBLOCK | _CLOEXEC
    try:
        fd = os.open(path, flags, 0o644)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENXIO, errno.EISDIR, errno.EOPNOTSUPP):
            try:
                kind = kind_of(os.lstat(path).st_mode)
            except OSError:
                raise exc from None
            raise _refuse(label, path, kind) from None
        raise
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        raise _refuse(label, path, kind_of(mode))
    return fd


def open_regular_for_reading(path: Path) -> tuple[int, str | None]:
    """Open ``path`` for reading without blocking; return the descriptor, or -1 and the
    kind of file it is when that is not a regular file (the descriptor is then closed).

    A reader that opened a named pipe would wait for a writer forever (and ``/dev/zero``
    never ends), so the open is non-blocking and the opened file is checked before a read;
    a symbolic link is followed, since reading through one writes nothing.

    Raises:
        OSError: the file cannot be opened (missing, permissions, ...).
    """
    fd = os.open(path, os.O_RDONLY | _NONBLOCK | _CLOEXEC)
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        return -1, kind_of(mode)
    return fd, None


def write_regular(path: Path, data: bytes, label: str) -> None:
    """Replace the contents of the regular file ``path`` (created if missing) with ``data``.

    Raises:
        ConfigError: ``path`` is not a regular file.
    """
    fd = open_regular(path, label)
    try:
        os.ftruncate(fd, 0)
        write_all(fd, data)
    finally:
        os.close(fd)


def write_all(fd: int, data: bytes) -> None:
    """Write all of ``data`` to ``fd`` (``os.write`` may write only part of it)."""
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def unlink_regular(path: Path, label: str) -> bool:
    """Delete ``path`` if it is a regular file; return whether something was deleted.

    Raises:
        ConfigError: something other than a regular file is at ``path``.
    """
    if not check_regular(path, label):
        return False
    path.unlink(missing_ok=True)
    return True
