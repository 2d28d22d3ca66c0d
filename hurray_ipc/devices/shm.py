"""POSIX shared-memory segments with findable names, reserved space and stale-segment cleanup.

A segment's pages are allocated when it is created (:func:`reserve`): a full /dev/shm is then a
DeviceError at creation, never a SIGBUS at some later write into memory that looked allocated.

Every segment this project creates is named ``/hurray-<uid>-<pid>-<kind><n>-<rand>``: the uid and
pid of the creating process, so :func:`cleanup_stale` can remove what a crashed process left behind
(POSIX shared memory outlives its creator); ``kind`` says what it holds (``c`` CPU buffer, ``s``
staging slot, ``m`` emulated device memory, ``v`` emulated event).

Segments are mode 0600 by default; ``HURRAY_SHM_MODE=0660`` (octal) shares them with the group.
We use posix_ipc + mmap rather than ``multiprocessing.shared_memory``, whose resource tracker
unlinks segments that a process merely attached (CPython #82300).
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import itertools
import mmap
import os
import re
import secrets
import stat
import struct
import threading
import weakref
from pathlib import Path

import posix_ipc

from .errors import DeviceError

SHM_DIR = Path("/dev/shm")
PREFIX = "hurray"
_NAME_RE = re.compile(rf"^{PREFIX}-(\d+)-(\d+)-([a-z])(\d+)-([0-9a-f]+)$")
_counter = itertools.count(1)
_counter_lock = threading.Lock()
# Headroom kept free in /dev/shm: running it to zero turns the next page fault into SIGBUS.
SPACE_MARGIN = 16 << 20


def shm_mode() -> int:
    raw = os.environ.get("HURRAY_SHM_MODE", "0600")
    try:
        mode = int(raw, 8)
    except ValueError:
        raise DeviceError("shm_mode", f"HURRAY_SHM_MODE={raw!r} is not an octal mode such as 0600 or 0660") from None
    if mode & 0o007:
        raise DeviceError("shm_mode", f"HURRAY_SHM_MODE={raw!r} would open segments to every user; at most 0660")
    return mode


def new_name(kind: str) -> str:
    with _counter_lock:
        n = next(_counter)
    return f"/{PREFIX}-{os.getuid()}-{os.getpid()}-{kind}{n}-{secrets.token_hex(3)}"


def free_bytes() -> int:
    st = os.statvfs(SHM_DIR)
    return st.f_bavail * st.f_frsize


def check_space(nbytes: int) -> None:
    """Refuse an allocation that would fill /dev/shm (which later surfaces as SIGBUS)."""
    avail = free_bytes()
    if nbytes + SPACE_MARGIN > avail:
        raise DeviceError(
            "shm_open",
            f"not enough space in {SHM_DIR}: need {nbytes} bytes plus {SPACE_MARGIN} headroom, "
            f"{avail} available",
        )


class Segment:
    """One mapped POSIX shared-memory segment.

    The creator owns it: :meth:`close` unmaps and, for the owner, unlinks. An attached segment
    stays valid after its owner unlinked it, until this process unmaps it.
    """

    def __init__(self, name: str, size: int, mem: posix_ipc.SharedMemory, owner: bool):
        self.name = name
        self.size = size
        self.owner = owner
        self._shm = mem
        self.map = mmap.mmap(mem.fd, size)
        self.fd = mem.fd  # kept open: emulated allocations lock it with flock
        self.closed = False
        self._pin: ctypes.Array | None = None
        self._finalizer: weakref.finalize | None = None  # owners: unlinks the name once

    @classmethod
    def create(cls, size: int, kind: str) -> Segment:
        size = max(int(size), 1)  # mmap refuses length 0; a 0-byte buffer still gets a segment
        check_space(size)
        name = new_name(kind)
        mode = shm_mode()
        try:
            mem = posix_ipc.SharedMemory(name, posix_ipc.O_CREX, mode=mode, size=size)
            os.fchmod(mem.fd, mode)  # exactly the mode asked for, whatever the umask
        except (posix_ipc.Error, OSError) as e:
            raise DeviceError("shm_open", f"cannot create {name} ({size} bytes): {e}") from e
        try:
            reserve(mem.fd, size)
        except DeviceError as e:
            mem.close_fd()
            unlink(name)
            raise DeviceError("shm_open", f"cannot create {name}: {e}") from e
        seg = cls(name, size, mem, owner=True)
        # An owner collected, or still alive at a clean exit, without close() must not leave its
        # name behind; crashes are what cleanup_stale() is for.
        seg._finalizer = weakref.finalize(seg, unlink, name)
        return seg

    @classmethod
    def attach(cls, name: str) -> Segment:
        if not isinstance(name, str) or not _NAME_RE.match(name.lstrip("/")):
            raise DeviceError("shm_open", f"{name!r} is not a hurray shared-memory segment name")
        try:
            mem = posix_ipc.SharedMemory(name)
        except posix_ipc.ExistentialError as e:
            raise DeviceError("shm_open", f"segment {name} does not exist (owner gone or released): {e}") from e
        except (posix_ipc.Error, OSError) as e:
            raise DeviceError("shm_open", f"cannot open {name}: {e}") from e
        if mem.size <= 0:
            mem.close_fd()
            raise DeviceError("shm_open", f"segment {name} is empty")
        return cls(name, mem.size, mem, owner=False)

    def address(self) -> int:
        """The mapping's address in this process (pins the mapping until close)."""
        if self._pin is None:
            # The ctypes view pins the mapping (mmap.close() raises BufferError while it lives):
            # an address must never outlive its mapping.
            self._pin = (ctypes.c_char * self.size).from_buffer(self.map)
        return ctypes.addressof(self._pin)

    def renew(self) -> None:
        """Put fresh pages under this owner's mapping, in place: same address, same size, same
        bytes, a new name. Whoever else maps the old segment keeps its pages, and this process never
        writes them again (a fenced consumer's buffer, spec §5). The old name is unlinked; its pages
        are freed when the last other mapping goes (and this mapping's own descriptor closes)."""
        if not self.owner or self.closed:
            raise DeviceError("shm_renew", f"{self.name} is not a live segment this process created")
        parsed = parse_name(self.name)
        fresh = Segment.create(self.size, parsed[2] if parsed else "c")
        try:
            addr = self.address()
            ctypes.memmove(fresh.address(), addr, len(self.map))  # no temporary copy of the whole buffer
            fresh._pin = None
            got = _libc.mmap(ctypes.c_void_p(addr), ctypes.c_size_t(len(self.map)),
                             mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_SHARED | _MAP_FIXED, fresh.fd, 0)
            if got != addr:
                raise DeviceError("shm_renew", f"cannot map {fresh.name} over {self.name}: "
                                  f"{os.strerror(ctypes.get_errno())}")
        except BaseException:
            fresh.close()
            raise
        fresh.map.close()  # its own second mapping; the descriptor and the name pass to self
        old_shm, old_finalizer = self._shm, self._finalizer
        self.name, self._shm, self.fd = fresh.name, fresh._shm, fresh.fd
        # The new name's unlink belongs to self now: fresh's finalizer would run when fresh is
        # collected (at once) and unlink the name under every later attach.
        if fresh._finalizer is not None:
            fresh._finalizer.detach()
        fresh._finalizer = None
        self._finalizer = weakref.finalize(self, unlink, self.name)
        fresh.closed = True
        try:
            old_shm.close_fd()
        except (posix_ipc.Error, OSError):
            pass
        if old_finalizer is not None:
            old_finalizer()  # unlinks the old name, once

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self._pin = None
        try:
            self.map.close()
        except BufferError:
            # Someone still holds a view (a numpy array or memoryview a user kept); the mapping
            # is released when that view is collected. Unlinking below is still correct.
            pass
        try:
            self._shm.close_fd()
        except (posix_ipc.Error, OSError):
            pass
        if self.owner and self._finalizer is not None:
            self._finalizer()  # unlinks, once

    def __enter__(self) -> Segment:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


_MADV_POPULATE_WRITE = 23  # Linux 5.14; Python's mmap names it only from 3.13 on
_MAP_FIXED = 0x10
_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]


def reserve(fd: int, size: int) -> None:
    """Allocate every page of the file ``fd`` now (``posix_fallocate``), so that a full /dev/shm
    is an error here and never a SIGBUS at a later write, also when several allocations passed
    :func:`check_space` before any was written. It costs what the first write would have (the
    pages are zeroed now instead of at their first fault): 64 MiB created and filled in 40.5 ms
    with it, 42.0 ms without (median of 7 shuffled rounds). Where the file system cannot reserve
    (no fallocate), the space check is all there is."""
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as e:
        if e.errno in (errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
            return
        raise DeviceError("shm_reserve", f"cannot reserve {size} bytes in {SHM_DIR}: {os.strerror(e.errno or 0)} "
                          f"({free_bytes()} bytes free)") from e


def populate(ptr: int, size: int) -> None:
    """Fault in, for writing, every page of the mapped host memory [ptr, ptr+size) now, leaving its
    content as it is. Why: a page first faulted by another process's write into this memory (a
    NIXL WRITE over UCX's shared-memory transports faults it through the kernel on the writer's
    side) costs about seven times a local fault (64 MiB of shared memory: ~300 ms against ~45 ms
    here). On kernels before 5.14 each page's first byte is read and written back instead, which
    is only safe while nobody else writes the memory."""
    page = mmap.PAGESIZE
    start = ptr - ptr % page
    length = size + (ptr - start)
    if length <= 0:
        return
    if _libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(length), _MADV_POPULATE_WRITE) == 0:
        return
    err = ctypes.get_errno()
    if err != errno.EINVAL:  # not "unknown advice": e.g. ENOMEM, a full /dev/shm, said now and not as SIGBUS
        raise DeviceError("populate", f"faulting in {size} bytes at 0x{ptr:x}: {os.strerror(err)}")
    import numpy as np

    view = np.frombuffer(memoryview((ctypes.c_ubyte * length).from_address(start)), np.uint8)
    view[::page] |= 0


_FLOCK = struct.Struct("hhqqi4x")  # Linux struct flock: type, whence, start, len, pid (0 for OFD locks)


def lock_byte(fd: int, off: int, lock: bool) -> None:
    """Lock (wait) or unlock one byte of ``fd``'s file with an open-file-description lock: owned by
    the descriptor like flock, so two descriptors exclude each other even in one process (tests
    run two runtimes in one process as two processes), and closing one never drops another's."""
    fcntl.fcntl(fd, fcntl.F_OFD_SETLKW if lock else fcntl.F_OFD_SETLK,
                _FLOCK.pack(fcntl.F_WRLCK if lock else fcntl.F_UNLCK, os.SEEK_SET, off, 1, 0))


def unlink(name: str) -> bool:
    """Remove a segment's name; False (never an error) when it is gone already or may not be
    removed (another user's file: posix_ipc raises PermissionsError, which is no OSError)."""
    try:
        posix_ipc.unlink_shared_memory(name)
        return True
    except (posix_ipc.Error, OSError):
        return False


def parse_name(name: str) -> tuple[int, int, str] | None:
    """(uid, pid, kind) of a hurray segment name, or None for any other name."""
    m = _NAME_RE.match(name.lstrip("/"))
    return (int(m.group(1)), int(m.group(2)), m.group(3)) if m else None


PID_MAX = 1 << 22  # Linux's upper bound for pid_max (kernel/pid.c PID_MAX_LIMIT)


def pid_alive(pid: int) -> bool:
    """Is ``pid`` a live process in this PID namespace? False for anything that is not a pid
    (0, negative, past PID_MAX_LIMIT, not an int): ``os.kill`` would signal a group or overflow."""
    if not isinstance(pid, int) or isinstance(pid, bool) or not 0 < pid <= PID_MAX:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    # A zombie (exited, not yet reaped) still answers kill(0) but holds nothing any more: its
    # segments are stale. Lease-based liveness reports deaths before the parent reaps.
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
        return stat[stat.rindex(b")") + 2:stat.rindex(b")") + 3] != b"Z"
    except (OSError, ValueError):
        return True


def entries(directory: Path | str = SHM_DIR) -> list[str]:
    """File names in ``directory`` (/dev/shm), or none when it cannot be read."""
    try:
        return os.listdir(directory)
    except OSError:
        return []


def list_segments(uid: int | None = None, pid: int | None = None, directory: Path | str = SHM_DIR) -> list[str]:
    """Names of this project's segments in /dev/shm (optionally of one uid / pid): regular files
    that ``uid`` owns and whose name says so. Anything else with such a name (another user's
    file, a directory, a symlink) is not ours, and is neither listed nor touched."""
    uid = os.getuid() if uid is None else uid
    out: list[str] = []
    for e in entries(directory):
        parsed = parse_name(e)
        if not parsed or parsed[0] != uid or (pid is not None and parsed[1] != pid):
            continue
        try:
            st = os.lstat(os.path.join(directory, e))
        except OSError:
            continue  # gone meanwhile
        if stat.S_ISREG(st.st_mode) and st.st_uid == uid:
            out.append("/" + e)
    return sorted(out)


def cleanup_stale(uid: int | None = None, keep_pids: set[int] | frozenset[int] = frozenset()) -> list[str]:
    """Unlink segments whose creating process is gone. Returns the names removed.

    ``keep_pids``: pids to treat as alive whatever our pid table says (live processes of other
    PID namespaces, whose names carry their own namespace's pid; see transport/liveness.py).
    Safe while consumers still map them: unlinking removes the name, not a live mapping.
    """
    removed = []
    for name in list_segments(uid):
        parsed = parse_name(name)
        if parsed and parsed[1] not in keep_pids and not pid_alive(parsed[1]) and unlink(name):
            removed.append(name)
    return removed
