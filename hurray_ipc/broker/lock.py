"""One broker per endpoint: an flock beside the socket file, so a second broker refuses to start.

Binding an ``ipc://`` endpoint over a live broker's socket file would silently orphan it (the old
broker keeps running, unreachable). The lock file ``<socket>.lock`` is held for the broker's whole
life; the kernel releases it when the broker exits, however it exits. Whoever holds it may replace
a socket file left behind by a dead broker. TCP endpoints need no lock: bind fails on a live port.

The holder writes its pid into the lock file (decimal, one line), so that ``hurray-broker --stop``
and the "already running" message can name it. A pid read from the file is only believed when that
process holds the very lock file open (:func:`holder`): a broker killed with SIGKILL leaves its pid
behind, and the number may since belong to any other process.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from pathlib import Path


class BrokerAlreadyRunning(RuntimeError):
    """Another live broker holds this endpoint."""


class EndpointLock:
    def __init__(self, path: Path, fd: int):
        self.path = path
        self._fd: int | None = fd

    def release(self) -> None:
        """Let another broker take the endpoint (the lock file itself stays: unlinking it would
        let two brokers lock two different files of the same name). Its pid goes first."""
        fd, self._fd = self._fd, None
        if fd is not None:
            with contextlib.suppress(OSError):  # else the pid stays: holder() believes no pid that holds nothing
                os.ftruncate(fd, 0)
            os.close(fd)


def lock_path(socket_path: str | os.PathLike[str]) -> Path:
    return Path(f"{os.fspath(socket_path)}.lock")


def acquire_endpoint(socket_path: str | os.PathLike[str], endpoint: str | None = None) -> EndpointLock:
    """Lock ``socket_path`` for this broker, or raise :class:`BrokerAlreadyRunning`."""
    path = lock_path(socket_path)
    fd = os.open(path, os.O_CREAT | os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        try:
            pid = holder(socket_path)
        except PermissionError:
            pid = None
        raise BrokerAlreadyRunning(f"broker already running at {endpoint or 'ipc://' + os.fspath(socket_path)} "
                                   + (f"(pid {pid}, " if pid else "(") + f"it holds {path})") from None
    except BaseException:
        os.close(fd)
        raise
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    except BaseException:
        os.close(fd)
        raise
    return EndpointLock(path, fd)


def written_pid(socket_path: str | os.PathLike[str]) -> int | None:
    """The pid the lock file names (None: no file, empty, or not a pid)."""
    try:
        text = lock_path(socket_path).read_text()[:32].strip()
    except (FileNotFoundError, NotADirectoryError):
        return None
    return int(text) if text.isdigit() and 0 < int(text) < 2**31 else None


def holder(socket_path: str | os.PathLike[str]) -> int | None:
    """The pid of the live broker of ``socket_path``: the pid its lock file names, if that process
    (visible in this PID namespace) holds the lock file open. None: no broker, an empty file, or a
    stale pid. PermissionError, naming the pid, when that process is one this user may not inspect
    (another user's): that is no answer to "is there a broker"."""
    pid = written_pid(socket_path)
    if pid is None:
        return None
    try:
        want = os.stat(lock_path(socket_path))
    except FileNotFoundError:
        return None
    fds = f"/proc/{pid}/fd"
    try:
        names = os.listdir(fds)
    except FileNotFoundError:
        return None  # no such process (here)
    except PermissionError:
        raise PermissionError(f"{lock_path(socket_path)} names pid {pid}, a process this user may not "
                              "inspect (another user's)") from None
    for name in names:
        try:
            st = os.stat(f"{fds}/{name}")
        except OSError:
            continue  # closed meanwhile, or not a file
        if (st.st_dev, st.st_ino) == (want.st_dev, want.st_ino):
            return pid
    return None
