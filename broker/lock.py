"""One broker per endpoint: an flock beside the socket file, so a second broker refuses to start.

Binding an ``ipc://`` endpoint over a live broker's socket file would silently orphan it (the old
broker keeps running, unreachable). The lock file ``<socket>.lock`` is held for the broker's whole
life; the kernel releases it when the broker exits, however it exits. Whoever holds it may replace
a socket file left behind by a dead broker. TCP endpoints need no lock: bind fails on a live port.
"""

from __future__ import annotations

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
        let two brokers lock two different files of the same name)."""
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)


def acquire_endpoint(socket_path: str | os.PathLike[str], endpoint: str | None = None) -> EndpointLock:
    """Lock ``socket_path`` for this broker, or raise :class:`BrokerAlreadyRunning`."""
    path = Path(f"{os.fspath(socket_path)}.lock")
    fd = os.open(path, os.O_CREAT | os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise BrokerAlreadyRunning(f"broker already running at {endpoint or 'ipc://' + os.fspath(socket_path)} "
                                   f"(it holds {path})") from None
    except BaseException:
        os.close(fd)
        raise
    return EndpointLock(path, fd)
