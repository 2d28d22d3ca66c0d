"""Process liveness that holds across PID namespaces: a lease the kernel releases at exit.

A heartbeat that stops proves nothing about a process on the same host (SIGSTOP, a C call holding
the GIL for seconds), and a pid proves nothing across PID namespaces (a process in a container
says "I am pid 9"; pid 9 in the broker's namespace is someone else, or no one). What does hold:
an ``flock`` on a file in the shared ``/dev/shm``. The client creates the file, locks it, and keeps
the descriptor open for its whole life; the kernel drops the lock when the process exits, however
it exits (SIGKILL included), in whichever namespace it ran. The broker, given the file's name in
HELLO (``lease``), asks :func:`probe`: the lock is held (alive), or it could take it (dead).

Names: ``hurray-<uid>-lease-<pidns>-<pid>-<rand16hex>`` in ``/dev/shm``: ``pidns`` is the inode of
the holder's ``/proc/self/ns/pid`` and ``pid`` its pid *there*; both are informative only (the
stale-segment sweep uses them to keep the segments of live processes of other namespaces).

Limits: a child forked without exec inherits the descriptor and keeps the lease alive (the
project starts workers with ``spawn``, whose exec closes it: the descriptor is O_CLOEXEC). Only
leases of the caller's own uid are probed; a lease file not owned by that uid is "unknown".
"""

from __future__ import annotations

import atexit
import fcntl
import os
import re
import secrets
import stat
import threading
from pathlib import Path

from hurray_ipc.devices import shm

LEASE_DIR = shm.SHM_DIR
_NAME_RE = re.compile(rf"^{shm.PREFIX}-(\d{{1,10}})-lease-(\d{{1,20}})-(\d{{1,10}})-([0-9a-f]{{16}})$")


def pid_namespace() -> int:
    """The inode of this process's PID namespace (0 where /proc does not say)."""
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0


def parse(name: str) -> tuple[int, int, int] | None:
    """(uid, pid namespace, pid) of a lease name, or None when ``name`` is not one."""
    m = _NAME_RE.match(name) if isinstance(name, str) else None
    return (int(m.group(1)), int(m.group(2)), int(m.group(3))) if m else None


class Lease:
    """A locked file that says "this process is alive" until the process exits or :meth:`close`.

    ``name`` is the token a client sends in HELLO. Creating one takes a file descriptor; the lock
    is taken before the file gets its final name, so no prober ever sees it unlocked.
    """

    def __init__(self, directory: Path | str = LEASE_DIR):
        self.directory = Path(directory)
        self.name = f"{shm.PREFIX}-{os.getuid()}-lease-{pid_namespace()}-{os.getpid()}-{secrets.token_hex(8)}"
        tmp = self.directory / f".{self.name}.tmp"
        fd = os.open(tmp, os.O_CREAT | os.O_EXCL | os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            os.rename(tmp, self.directory / self.name)
        except BaseException:
            os.close(fd)
            tmp.unlink(missing_ok=True)
            raise
        self._fd: int | None = fd
        self.pid = os.getpid()

    @property
    def held(self) -> bool:
        return self._fd is not None

    def close(self) -> None:
        """End the lease: the file goes first, then the lock (a prober then sees it gone)."""
        fd, self._fd = self._fd, None
        if fd is None:
            return
        if os.getpid() == self.pid:
            (self.directory / self.name).unlink(missing_ok=True)
        os.close(fd)

    def __repr__(self) -> str:
        return f"Lease({self.name!r}, held={self.held})"


_process_lease: Lease | None = None
_process_lock = threading.Lock()


def process_lease() -> Lease:
    """This process's lease, created on first use (again after a fork), closed at exit."""
    global _process_lease
    with _process_lock:
        if _process_lease is None or _process_lease.pid != os.getpid():
            _process_lease = Lease()
            atexit.register(_process_lease.close)
        return _process_lease


def probe(name: str, directory: Path | str = LEASE_DIR) -> bool | None:
    """Is the holder of lease ``name`` alive?

    True: its lock is held (the process lives, whatever it answers). False: the lock was free,
    so the holder exited; the file is removed. None: not a lease name of this uid, or no regular
    file of this uid by that name (forged, or already swept: the caller decides, e.g. by pid).
    """
    parsed = parse(name)
    if parsed is None or parsed[0] != os.getuid():
        return None
    path = Path(directory) / name
    try:
        fd = os.open(path, os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW)
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid():
            return None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        # We hold the lock: the holder is gone. Remove the name while holding it.
        try:
            if os.stat(path).st_ino == st.st_ino:
                path.unlink()
        except OSError:
            pass
        return False
    finally:
        os.close(fd)


def live_foreign_pids(directory: Path | str = LEASE_DIR) -> set[int]:
    """Pids (in their own namespaces) of live lease holders in *other* PID namespaces; dead
    leases found on the way are removed. Their segments must not be judged by our pid table."""
    mine = os.getuid()
    ns = pid_namespace()
    out: set[int] = set()
    for e in shm.entries(directory):
        parsed = parse(e)
        if parsed is None or parsed[0] != mine:
            continue
        alive = probe(e, directory)
        if alive and parsed[1] != ns:
            out.add(parsed[2])
    return out


def cleanup_stale() -> list[str]:
    """Remove this uid's segments and leases left by dead processes (all namespaces)."""
    return shm.cleanup_stale(keep_pids=live_foreign_pids())
