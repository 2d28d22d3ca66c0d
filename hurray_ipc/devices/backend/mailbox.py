"""The race checker's happens-before notes: what a message's receiver learns about its sender's host.

A process about to send a message notes its host's vector clock under the message's key
(:meth:`Mailbox.put`); the receiver takes the note once the message arrived (:meth:`Mailbox.take`),
and the sender drops a note whose message will never be received (:meth:`Mailbox.drop`). A key
names one message, so a note has one writer and at most one reader, and the reader looks only
after the message arrived, which left after the note was written: a note is complete before anyone
looks for it. (EmulatedRuntime.hb_send / hb_receive / hb_forget; ../DESIGN.md, "The emulation".)

Where notes live. One shared-memory table per user, ``/dev/shm/hurray-<uid>-hbtable``: BUCKETS
buckets of BUCKET slots, a key's bucket chosen by a 64-bit tag of the key. The slots' tags come
first, contiguous (a bucket's tags are read in one step), then the slots' bodies::

    tags:   SLOTS x u64 (0: free)                    lock byte of slot i: byte 8 * i
    bodies: SLOTS x (f64 wall time written, u32 length, u32 0, payload of PAYLOAD bytes)

A writer or reader reads its bucket's tags without a lock, then locks the one slot it chose (an
open-file-description lock on its tag's first byte, and a process-local lock for the threads of
this process) and checks the tag again before it writes, reads or frees the slot. A note that does
not fit a slot, or whose bucket is full, is a file of the directory ``hurray-<uid>-hb`` beside the
table, as every note was until 2026-12-06: an open, write and close to send and an open, read,
close and unlink to receive, in one directory that both ends of every handoff change. A note
sent and taken costs 8.3 µs in a hot loop against 16.7 as files (a lock and an unlock on each side);
in
the three-process benchmark, where both ends work on the directory at once, the emulated row ran
1.1-1.3x as fast (docs/benchmarks.md). Notes nobody took within MAX_AGE_S (a process killed between a send and its
receipt) are swept by the next process that opens the table, files and slots alike.
"""

from __future__ import annotations

import hashlib
import marshal
import mmap
import os
import stat
import struct
import threading
import time
from typing import Any

from .. import shm
from ..errors import DeviceError
from ..shm import SHM_DIR, lock_byte

__all__ = ["BUCKET", "BUCKETS", "MAX_AGE_S", "PAYLOAD", "SLOTS", "Mailbox", "mailbox"]

BUCKET = 8
BUCKETS = 256
SLOTS = BUCKET * BUCKETS
PAYLOAD = 1000  # bytes of marshalled clock a slot holds: about 50 agents (a clock is pruned past 64)
_BODY = struct.Struct("<dII")  # wall time written, length, 0
_SLOT = _BODY.size + PAYLOAD
_TAGS = struct.Struct(f"<{BUCKET}Q")
_BODIES = SLOTS * 8  # where the bodies start
SIZE = _BODIES + SLOTS * _SLOT
MAX_AGE_S = 600.0  # a note no receiver took in 10 minutes never will be (its sender or receiver died)
SPILLED_MAX = 4096  # keys this process wrote as files and may still drop (past it, the sweep has them)


def tag(key: str) -> int:
    """The note's 64-bit tag (never 0, which marks a free slot); its low bits pick the bucket."""
    return int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "little") | (1 << 63)


class Mailbox:
    """This process's view of the user's notes: the shared table, and the directory for what
    does not fit it. Thread-safe. ``directory``: where table and files live (tests)."""

    def __init__(self, directory: str | os.PathLike[str] = SHM_DIR):
        self.dir = os.path.join(directory, f"hurray-{os.getuid()}-hb")
        self.local = threading.Lock()
        self.spilled: set[str] = set()
        self.fd = -1
        self.map: Any = None
        self._table_path = os.path.join(directory, f"hurray-{os.getuid()}-hbtable")
        self._dir_checked = False
        if self._open():
            self.sweep()

    def _open(self) -> bool:
        """Map the table (made if missing); False, leaving notes to files, when it cannot be made
        (/dev/shm full) or is not a private file of ours. Tried again before each note while it
        failed: a receiver that could not map it must still find what senders put there later."""
        if self.map is not None:
            return True
        with self.local:  # two threads retrying at once map it once
            return self.map is not None or self._map()

    def _map(self) -> bool:
        try:
            # /dev/shm is writable by everyone: never follow a link someone else put at this name,
            # and map only a regular file of our own, private to us.
            fd = os.open(self._table_path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        except OSError:
            return False
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077:
                raise OSError(f"{self._table_path} is not a private file of ours")
            if st.st_size < SIZE:
                shm.reserve(fd, SIZE)  # extends it; a second process doing the same changes nothing
            self.map = mmap.mmap(fd, SIZE)
        except Exception:  # noqa: BLE001 - /dev/shm full, or the file is not ours to map: files only
            os.close(fd)
            return False
        self.fd = fd
        return True

    # --- the table -------------------------------------------------------------------------------
    def _find(self, t: int, want: int) -> int:
        """Slot of ``t``'s bucket whose tag is ``want`` (read without a lock), or -1."""
        first = (t % BUCKETS) * BUCKET
        tags = _TAGS.unpack_from(self.map, first * 8)
        return first + tags.index(want) if want in tags else -1

    def _claim(self, slot: int, expect: int) -> bool:
        """Lock ``slot`` if its tag is still ``expect`` (True; unlock with :meth:`_free`)."""
        lock_byte(self.fd, slot * 8, True)
        if struct.unpack_from("<Q", self.map, slot * 8)[0] == expect:
            return True
        lock_byte(self.fd, slot * 8, False)
        return False

    def _free(self, slot: int) -> None:
        lock_byte(self.fd, slot * 8, False)

    def _body(self, slot: int) -> int:
        return _BODIES + slot * _SLOT

    def _stale(self, slot: int, now: float) -> bool:
        """Whether the note in ``slot`` was written more than MAX_AGE_S before ``now``."""
        return now - _BODY.unpack_from(self.map, self._body(slot))[0] > MAX_AGE_S

    def _remove(self, key: str, read: bool) -> tuple[bool, bytes]:
        """Free the slot of ``key``'s note: (whether there was one, its payload if ``read``)."""
        t = tag(key)
        with self.local:
            slot = self._find(t, t)
            if slot < 0 or not self._claim(slot, t):
                return False, b""
            try:
                raw = b""
                if read:
                    body = self._body(slot)
                    n = _BODY.unpack_from(self.map, body)[1]
                    raw = self.map[body + _BODY.size:body + _BODY.size + n]
                struct.pack_into("<Q", self.map, slot * 8, 0)
            finally:
                self._free(slot)
            return True, raw

    def _put_slot(self, t: int, raw: bytes) -> bool:
        """Write ``raw`` under tag ``t`` in its own slot, else a free one of its bucket; False when
        the bucket is full (or every free slot it chose was taken meanwhile)."""
        with self.local:
            for want in (t, 0, 0, 0):  # the key's own slot, else a free one (taken meanwhile: again)
                slot = self._find(t, want)
                if slot < 0:
                    if want:
                        continue
                    return False
                if not self._claim(slot, want):
                    continue
                try:
                    body = self._body(slot)
                    _BODY.pack_into(self.map, body, time.time(), len(raw), 0)
                    self.map[body + _BODY.size:body + _BODY.size + len(raw)] = raw
                    struct.pack_into("<Q", self.map, slot * 8, t)
                finally:
                    self._free(slot)
                return True
        return False

    def put(self, key: str, note: Any) -> None:
        """Note ``note`` (marshallable) under ``key``, replacing an earlier note of the same key."""
        raw = marshal.dumps(note)
        if self._open() and len(raw) <= PAYLOAD and self._put_slot(tag(key), raw):
            if key in self.spilled:  # an earlier note of this key went to a file
                self._drop_file(key)
            return
        if self.map is not None:
            self._remove(key, read=False)  # an earlier note of this key in the table would be taken first
        self._put_file(key, raw)

    def take(self, key: str) -> Any:
        """The note of ``key``, removed; None when there is none (its sender noted nothing)."""
        if self._open():
            found, raw = self._remove(key, read=True)
            if found:
                return marshal.loads(raw)
        return self._take_file(key)

    def drop(self, key: str) -> None:
        """Remove the note of ``key`` if it is still there (its message will not be received)."""
        if self._open() and self._remove(key, read=False)[0]:
            return
        if key in self.spilled or self.map is None:
            self._drop_file(key)

    def sweep(self, now: float | None = None) -> int:
        """Remove the notes older than MAX_AGE_S, slots and files; how many."""
        now = time.time() if now is None else now
        removed = 0
        if self.map is not None:
            with self.local:
                for slot, (t,) in enumerate(struct.iter_unpack("<Q", self.map[:_BODIES])):
                    if t and self._stale(slot, now) and self._claim(slot, t):
                        if self._stale(slot, now):  # again under the lock: rewritten meanwhile?
                            struct.pack_into("<Q", self.map, slot * 8, 0)
                            removed += 1
                        self._free(slot)
        for name in shm.entries(self.dir):
            path = os.path.join(self.dir, name)
            try:
                if now - os.lstat(path).st_mtime > MAX_AGE_S:
                    os.unlink(path)
                    removed += 1
            except OSError:
                continue  # taken meanwhile
        return removed

    # --- files: what the table cannot hold ---------------------------------------------------------
    def _path(self, key: str) -> str:
        return os.path.join(self.dir, hashlib.sha1(key.encode()).hexdigest())

    def _check_dir(self) -> None:
        """Make the directory if missing; DeviceError unless it is a private directory of ours
        (someone else's would let them read, forge or remove our notes)."""
        if self._dir_checked:
            return
        try:
            os.mkdir(self.dir, 0o700)
        except FileExistsError:
            pass
        st = os.lstat(self.dir)
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077:
            raise DeviceError("emulated race check", f"{self.dir} is not a private directory of ours: "
                              "happens-before notes cannot be kept there")
        self._dir_checked = True

    def _put_file(self, key: str, raw: bytes) -> None:
        # Written in place, not renamed into place: the receiver opens it only once the message
        # arrived, which leaves after this returns.
        self._check_dir()
        fd = os.open(self._path(key), os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            view = memoryview(raw)
            while view:
                view = view[os.write(fd, view):]
        finally:
            os.close(fd)
        with self.local:
            if len(self.spilled) >= SPILLED_MAX:
                self.spilled.clear()  # what it forgets to drop, the sweep removes
            self.spilled.add(key)

    def _drop_file(self, key: str) -> None:
        with self.local:
            self.spilled.discard(key)
        try:
            os.unlink(self._path(key))
        except FileNotFoundError:
            pass

    def _take_file(self, key: str) -> Any:
        self._check_dir()  # a note in someone else's directory could be forged
        path = self._path(key)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except FileNotFoundError:
            return None
        try:
            chunks = [os.read(fd, 1 << 16)]
            while len(chunks[-1]) == 1 << 16:
                chunks.append(os.read(fd, 1 << 16))
        finally:
            os.close(fd)
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
        return marshal.loads(b"".join(chunks))

    def close(self) -> None:
        if self.map is not None:
            self.map.close()
            os.close(self.fd)
            self.map, self.fd = None, -1


_mine: tuple[int, Mailbox] | None = None
_mine_lock = threading.Lock()


def _after_fork_in_child() -> None:
    """A forked child starts without its parent's mailbox: the lock may have been held by a
    thread that does not exist here, and the inherited descriptor would keep a slot locked by
    the parent locked for as long as this child lives, should the parent die holding it."""
    global _mine, _mine_lock
    if _mine is not None:
        _mine[1].close()
    _mine, _mine_lock = None, threading.Lock()


os.register_at_fork(after_in_child=_after_fork_in_child)


def mailbox() -> Mailbox:
    """This process's mailbox, opened once per process (a forked child opens its own: a lock of
    its parent's descriptor would not exclude the parent)."""
    global _mine
    with _mine_lock:
        if _mine is None or _mine[0] != os.getpid():
            _mine = (os.getpid(), Mailbox())
        return _mine[1]
