"""A cross-process emulation of the CUDA runtime surface in :mod:`.base`.

What is emulated, and how (see ../DESIGN.md for why):

* **Device memory** is POSIX shared memory: one segment per allocation, a 64 KiB header (race-check
  table) followed by the data. A device pointer is the data's real address in this process, so
  copies are ``memmove``; an IPC mem handle names the segment, and opening it maps the segment at
  another address, as CUDA IPC does.
* **Streams** are per-process worker threads that run queued operations in order. Each memory
  operation (copy, memset) takes ``op_delay_s``: it reads its source when it starts and its
  writes land when it ends, so an unsynchronised reader reliably sees stale bytes.
* **Events** are slots of a shared table segment of the creating process (a table serves 8 to
  32 events; an importer attaches it once), each holding two counters: ``recorded`` (bumped when
  ``event_record`` is *called*) and ``completed`` (raised when the stream *reaches* the record).
  An IPC event handle names the table, the slot and the slot's generation (bumped by the destroy).
  ``stream_wait_event`` captures ``recorded`` at call time and blocks the stream until
  ``completed`` reaches it: CUDA's rule that a wait orders after the latest record at the time of
  the wait, so a released event may be re-recorded.
* **Race check**: a happens-before analysis (:mod:`.hb`): every stream and each runtime's host
  is an agent with a vector clock; stream order, event record/wait, synchronize, successful
  queries and the handoff messages (:meth:`EmulatedRuntime.hb_send` / :meth:`~EmulatedRuntime.hb_receive`)
  are its edges. Each allocation's header holds its shadow memory (the last write and the reads
  since, per byte range), shared by every process that maps it. An access that conflicts with an
  earlier one it is not ordered after is a race, reported as a :class:`RaceError` at this
  process's next synchronize and counted in :attr:`EmulatedRuntime.races`. Verdicts are computed
  when operations are *enqueued*, from the program's synchronisation alone: no timing involved.

Configuration comes from :class:`EmulationConfig` (``HURRAY_EMU_*`` variables for spawned
processes). Emulated UUIDs start with ``EMU-`` and every blob with :data:`EMULATED_MAGIC`, so a
real CUDA process never opens an emulated blob, and vice versa.
"""

from __future__ import annotations

import bisect
import ctypes
import itertools
import marshal
import os
import queue
import struct
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from .. import shm
from ..errors import DeviceError, RaceError
from ..shm import Segment, lock_byte
from . import hb
from .base import EMULATED_MAGIC, IPC_HANDLE_SIZE, Runtime, check_blob
from .mailbox import mailbox

HEADER = 64 << 10  # per allocation: magic, size, device, then the shadow memory of the race check
EVENT_SLOT = 16 << 10  # per event: the counters, then the race-check state of its latest records
TABLE_SLOTS = 32  # the most event slots of one shared table segment (see _EventTable)
IDLE_TABLES = 8  # other processes' event tables an importer keeps attached with no event open
# Both keep their race-check state marshalled at _STATE, its length a u32 at _STATE_LEN.
_STATE_LEN, _STATE = 32, 64
# An allocation's u8 at _NIC: 1 while it is offered for NIC (GPUDirect RDMA) writes and no
# cudaDeviceFlushGPUDirectRDMAWrites of its device followed; in the header, so importers see it.
_NIC = 24
_GEN = 36  # an event slot's u32 generation (see _EventTable)
_MEM_MAGIC = EMULATED_MAGIC + b"M1"
_EVT_MAGIC = EMULATED_MAGIC + b"E1"
_BLOB = struct.Struct("<8sIIQ40s")  # magic, device ordinal, pid of exporter, size, segment name
assert _BLOB.size == IPC_HANDLE_SIZE


def _env_bool(name: str, default: bool) -> bool:
    raw = os.environ.get(name)
    if raw is None:
        return default
    if raw.lower() in ("1", "true", "yes", "on"):
        return True
    if raw.lower() in ("0", "false", "no", "off"):
        return False
    raise DeviceError("emulation config", f"{name}={raw!r} is not a boolean (1/0)")


@dataclass(frozen=True)
class EmulationConfig:
    """What the emulated machine offers. ``from_env`` reads ``HURRAY_EMU_*``."""

    devices: int = 2
    ipc_memory: bool = True
    ipc_events: bool = True
    peer_access: bool = True
    op_delay_s: float = 0.002
    race_check: bool = True

    @classmethod
    def from_env(cls) -> EmulationConfig:
        try:
            devices = int(os.environ.get("HURRAY_EMU_DEVICES", "2"))
            delay = float(os.environ.get("HURRAY_EMU_DELAY_MS", "2")) / 1000.0
        except ValueError as e:
            raise DeviceError("emulation config", f"HURRAY_EMU_DEVICES / HURRAY_EMU_DELAY_MS: {e}") from None
        if devices < 0 or delay < 0:
            raise DeviceError("emulation config", "HURRAY_EMU_DEVICES and HURRAY_EMU_DELAY_MS must be >= 0")
        return cls(
            devices=devices,
            ipc_memory=_env_bool("HURRAY_EMU_IPC_MEMORY", True),
            ipc_events=_env_bool("HURRAY_EMU_IPC_EVENTS", True),
            peer_access=_env_bool("HURRAY_EMU_PEER", True),
            op_delay_s=delay,
            race_check=_env_bool("HURRAY_EMU_RACE_CHECK", True),
        )

    def to_env(self) -> dict[str, str]:
        """The variables that make a spawned process see the same machine."""
        b = lambda v: "1" if v else "0"  # noqa: E731
        return {
            "HURRAY_CUDA": "emulated",
            "HURRAY_EMU_DEVICES": str(self.devices),
            "HURRAY_EMU_IPC_MEMORY": b(self.ipc_memory),
            "HURRAY_EMU_IPC_EVENTS": b(self.ipc_events),
            "HURRAY_EMU_PEER": b(self.peer_access),
            "HURRAY_EMU_DELAY_MS": repr(self.op_delay_s * 1000.0),
            "HURRAY_EMU_RACE_CHECK": b(self.race_check),
        }


class _Locked:
    """Process-local lock plus a lock on byte ``off`` of the segment: threads and processes both
    exclude. An allocation locks byte 0 of its segment; an event locks its slot's first byte of
    the table, so events of one table lock apart (recording one handoff's event never waits for
    the wait another process issues on the previous one's). The byte lock belongs to this
    process's descriptor of the segment, so threads exclude each other by the local lock.

    ``seg=None``: the state never leaves this process (a non-interprocess event: no handle names
    it), so only threads need excluding and the byte lock's two syscalls per section are skipped.
    """

    def __init__(self, seg: Segment | None, off: int = 0):
        self.seg, self.off = seg, off
        self.local = threading.Lock()

    def __enter__(self) -> None:
        self.local.acquire()
        try:
            # Past the segment's close a late record needs no cross-process lock.
            self.held = self.seg is not None and not self.seg.closed
            if self.held:
                lock_byte(self.seg.fd, self.off, True)  # type: ignore[union-attr]  # held implies seg
        except BaseException:  # e.g. KeyboardInterrupt while waiting for another process
            self.local.release()
            raise

    def __exit__(self, *exc: object) -> None:
        if self.held:
            lock_byte(self.seg.fd, self.off, False)  # type: ignore[union-attr]
        self.local.release()


_AGENT_SEQ = itertools.count(1)  # process-wide: two runtimes in one process get distinct agents
_starts: dict[int, int | None] = {}


def proc_start(pid: int) -> int | None:
    """The start time of live process ``pid`` (clock ticks since boot), or None if it has exited.

    (pid, start time) names a process exactly even when the kernel reuses the pid; a zombie has
    exited (its threads, and so its emulated streams, are gone).
    """
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return None if fields[0] in (b"Z", b"X") else int(fields[19])


def _recorder_dead(pid: int) -> bool:
    """True when the process that records an event can never complete it: exited, or a zombie
    (``pid_alive`` says a zombie is alive, so a wait on a killed, not yet reaped child spun forever)."""
    return pid != os.getpid() and proc_start(pid) is None


def _self_start() -> int:
    pid = os.getpid()
    if pid not in _starts:
        _starts[pid] = proc_start(pid) or 0
    return _starts[pid] or 0


def new_agent() -> int:
    """A vector-clock agent id unique across processes: (pid, start time, sequence number)."""
    return (os.getpid() << 44) | ((_self_start() & 0xFFFFFF) << 20) | (next(_AGENT_SEQ) & 0xFFFFF)


def _gone(rec: hb.Record) -> bool:
    return rec[2] != os.getpid() and proc_start(rec[2]) != rec[3]


_GONE_AGENTS: set[tuple[int, int]] = set()  # (pid, start) of exited processes: they never come back
PRUNE_AT = 64  # clock entries: past this many, the agents of exited processes are dropped (hb.prune)


def _agent_gone(agent: int) -> bool:
    """Whether the process of a vector-clock agent (``new_agent``: pid, start time) has exited."""
    pid, start = agent >> 44, (agent >> 20) & 0xFFFFFF
    if pid == os.getpid() or (pid, start) not in _GONE_AGENTS and ((proc_start(pid) or -1) & 0xFFFFFF) == start:
        return False
    _GONE_AGENTS.add((pid, start))
    return True


def _small(clock: hb.Clock) -> hb.Clock:
    """``clock``, pruned of exited processes' agents once it has grown past PRUNE_AT entries."""
    return hb.prune(clock, _agent_gone) if len(clock) > PRUNE_AT else clock


def _load(buf: Any, off: int, limit: int) -> Any:
    """The race-check state marshalled in ``buf[off:off + limit]`` (an allocation's header or an
    event's slot), or None when none was stored."""
    n = struct.unpack_from("<I", buf, off + _STATE_LEN)[0]
    return marshal.loads(buf[off + _STATE:off + _STATE + n]) if 0 < n <= limit - _STATE else None


def _store(buf: Any, off: int, limit: int, value: Any, what: str) -> None:
    raw = marshal.dumps(value)
    if _STATE + len(raw) > limit:
        raise DeviceError("emulated race check", f"{what} outgrew its {limit - _STATE} bytes of shared state")
    buf[off + _STATE:off + _STATE + len(raw)] = raw
    struct.pack_into("<I", buf, off + _STATE_LEN, len(raw))


@dataclass
class _Alloc:
    seg: Segment
    base: int  # address of the data in this process
    size: int
    device: int
    imported: bool
    lock: _Locked

    def access(self, lo: int, hi: int, is_write: bool, rec: hb.Record, clock: hb.Clock) -> list[str]:
        """Check and record one access to bytes [lo, hi) in the shared shadow; the races found."""
        with self.lock:
            shadow, races = hb.access(_load(self.seg.map, 0, HEADER) or [], lo, hi, is_write, rec, clock, _gone)
            _store(self.seg.map, 0, HEADER, shadow, f"the shadow memory of {self.seg.name}")
        return [hb.describe(kind, self.seg.name, rec, other, a, b) for kind, other, a, b in races]


def _mapping_end(a: _Alloc) -> int:
    """The address of the byte past an allocation that stands for its IPC mappings in the race
    check: an importer's cudaIpcCloseMemHandle reads it, the exporter's cudaFree writes it (with
    the whole allocation), so a free not ordered after every close is a race, and nothing else
    (a close is no access to the bytes) conflicts with a close."""
    return a.base + max(a.size, 1)


_RECORDS_KEPT = 4  # records an event remembers for the race check (a wait picks among them)


class _EventTable:
    """One shared segment of event slots, each ``EVENT_SLOT`` bytes: [magic, recorded, completed,
    recording process] as u64 words, the race-check state's length (u32 at _STATE_LEN) and the
    slot's generation (u32 at _GEN), then the state. The process that creates events makes the
    tables; an importer attaches a table once for every event of it. One lock per slot and process.

    A destroy bumps its slot's generation (an IPC handle carries the generation it was made for,
    so a handle of a destroyed event no longer opens) and frees the slot; a later event of the
    process reuses it, its counters going on from where the last one left them, so a wait issued
    on the old event still completes. A slot is reused only once its last record completed.
    """

    def __init__(self, seg: Segment):
        self.seg = seg
        self.slots = seg.size // EVENT_SLOT
        self.locks = [_Locked(seg, i * EVENT_SLOT) for i in range(self.slots)]
        self.refs = 0  # importer: events of this table opened and not yet destroyed

    def generation(self, slot: int) -> int:
        return int(struct.unpack_from("<I", self.seg.map, slot * EVENT_SLOT + _GEN)[0])

    def close(self) -> None:
        """Unmap (and, for the creator, unlink) with every slot's thread lock held: a record of a
        destroyed event that completes late on a stream thread holds its slot's from its "still
        open?" check to its unlock, so the descriptor never closes (or is reused) in between."""
        for lock in self.locks:
            lock.local.acquire()
        try:
            self.seg.close()
        finally:
            for lock in self.locks:
                lock.local.release()

    def idle(self, slot: int) -> bool:
        """No record of the slot's last event is still pending on a stream (recorded == completed)."""
        recorded, completed = struct.unpack_from("<QQ", self.seg.map, slot * EVENT_SLOT + 8)
        return bool(recorded == completed)


class _Event:
    """One event: a slot of an :class:`_EventTable` (interprocess), or a private buffer of the
    same layout (no other process ever sees it, so no cross-process lock). After the counters,
    the race-check state: (its latest records, newest last, each ``(sequence number, clock of its
    operation, recording host agent, that host's count at the call)``; the stream-waits other
    processes issued on it since the latest record: their access records)."""

    def __init__(self, buf: Any, off: int, lock: _Locked, *, owner: bool, interprocess: bool, device: int,
                 table: _EventTable | None = None, slot: int = 0, generation: int = 0):
        self.buf, self.off = buf, off
        self.owner = owner
        self.interprocess = interprocess
        self.device = device
        self.lock = lock
        self.table, self.slot, self.generation = table, slot, generation
        self.words = np.frombuffer(buf, dtype=np.uint64, count=4, offset=off)
        self.destroyed = False

    @property
    def name(self) -> str:
        return f"{self.table.seg.name}#{self.slot}" if self.table is not None else f"local event {id(self):#x}"

    def stale(self) -> bool:
        """An imported event whose exporter destroyed it (its slot moved to a later generation)."""
        return self.table is not None and self.table.generation(self.slot) != self.generation

    def _check_live(self, call: str) -> None:
        """Raise for an imported event whose exporter destroyed it (caller holds the lock, so the
        slot cannot pass to a later event between this check and the update)."""
        if not self.owner and self.stale():
            raise DeviceError(call, f"interprocess event {self.name} was destroyed by its exporter",
                              code="cudaErrorInvalidResourceHandle")

    def owner_pid(self) -> int:
        return int(self.words[3])

    def _state(self) -> tuple[list[Any], list[hb.Record]]:
        """(records, waits) from the slot (caller holds the lock)."""
        records, waits = _load(self.buf, self.off, EVENT_SLOT) or ([], [])
        return records, waits

    def _put(self, records: list[Any], waits: list[hb.Record], what: str) -> None:
        _store(self.buf, self.off, EVENT_SLOT, (records, waits), what)

    def record(self, clock: hb.Clock | None, host: int = 0, stamp: int = 0) -> int:
        """Note a record (at call time) whose operation runs with ``clock``, called by ``host`` at
        its count ``stamp``; its sequence number."""
        with self.lock:
            self._check_live("cudaEventRecord")
            seq = int(self.words[1]) + 1
            self.words[1] = seq
            if clock is not None:
                records = [*self._state()[0][-(_RECORDS_KEPT - 1):], (seq, _small(clock), host, stamp)]
                self._put(records, [], "an event's clock")
            return seq

    def latest(self) -> tuple[int, hb.Clock]:
        """(sequence number, clock) of the latest record: what a wait issued now blocks on, and
        what a host that saw the event complete (synchronize, query) learns."""
        with self.lock:
            records = self._state()[0]
            return int(self.words[1]), (records[-1][1] if records else {})

    def issue_wait(self, known: hb.Clock | None, tick: Callable[[hb.Clock], hb.Record | None]) -> int:
        """A stream-wait issued now, in one locked section. ``tick`` gets the clock of the latest
        record whose *call* happens-before a host that knows ``known`` (its recording host's count
        at the call is covered; ``{}`` when none, or ``known`` is None: no race check): what the
        wait orders after in the race check. A record made after the handoff message left is later
        in time but not ordered before the wait: joining it would hide the race (the checker's
        limit A), so it is passed over. ``tick`` returns the wait's access record when the
        exporter's destroy must be ordered after it (a wait by another process), else None.
        Returns the latest record's sequence number: what the wait blocks on (CUDA: the latest
        record at the time of the wait call)."""
        with self.lock:
            self._check_live("cudaStreamWaitEvent")
            records, waits = self._state()
            target = int(self.words[1])
            before: hb.Clock = {}
            for _seq, clock, host, stamp in reversed(records if known is not None else []):
                if known.get(host, 0) >= stamp:  # type: ignore[union-attr]  # known is set here
                    before = dict(clock)
                    break
            rec = tick(before)
            if rec is not None:
                self._put(records, [*waits, rec], "an event's stream-waits")
        return target

    def done(self, seq: int) -> bool:
        return int(self.words[2]) >= seq


class _Stream:
    """One worker thread running this stream's operations in order; an operation that takes no
    device time runs in the enqueuing thread when nothing is queued before it (see enqueue)."""

    _ids = itertools.count(1)

    def __init__(self, runtime: EmulatedRuntime, device: int, label: str = ""):
        self.id = 0x5EA0_0000 + next(self._ids)
        self.device = device
        self.rt = runtime
        self.label = label or f"stream {self.id:#x}"
        self.agent = new_agent()  # happens-before state, guarded by the runtime's _hb lock
        self.clock: hb.Clock = {}
        self.count = 0
        self.q: queue.Queue[Callable[[], None] | None] = queue.Queue()
        self.pending = 0
        self.cv = threading.Condition()
        self.error: DeviceError | None = None
        self.running = threading.Lock()  # held while an operation runs: they never overlap
        self.thread = threading.Thread(target=self._run, name=f"emu-stream-{self.id:x}", daemon=True)
        self.thread.start()

    def enqueue(self, op: Callable[[], None], instant: bool = False) -> None:
        """Run ``op`` after every operation enqueued before it and before every later one.
        ``instant``: it takes no device time (a record's completion, a copy at zero op delay, a
        wait whose event already completed) and can run twice; when nothing is queued it runs here
        and now, as an idle GPU starts it at once, instead of a hop to the worker thread (two
        thread switches a handoff step); interrupted here, the worker runs it again. The race
        check's verdicts are made by the callers at enqueue time, so where an operation runs
        changes none."""
        if instant and self.running.acquire(blocking=False):
            try:
                with self.cv:
                    idle = self.pending == 0
                if idle:  # a later enqueue queues behind us; the worker waits for `running`
                    try:
                        self._do(op)
                    except BaseException:  # interrupted (KeyboardInterrupt): the worker runs it again
                        with self.cv:
                            self.pending += 1
                        self.q.put(op)
                        raise
                    return
            finally:
                self.running.release()
        with self.cv:
            self.pending += 1
        self.q.put(op)

    def _do(self, op: Callable[[], None]) -> None:
        try:
            op()
        except DeviceError as e:
            with self.cv:
                self.error = self.error or e  # sticky, like a CUDA stream error
        except Exception as e:  # noqa: BLE001 - surface anything at the next synchronize
            with self.cv:
                self.error = self.error or DeviceError("emulated stream op", repr(e))

    def _run(self) -> None:
        while True:
            op = self.q.get()
            if op is None:
                return
            with self.running:
                self._do(op)
            with self.cv:
                self.pending -= 1
                self.cv.notify_all()

    def synchronize(self) -> None:
        with self.cv:
            while self.pending:
                self.cv.wait()
            err, self.error = self.error, None
        if err is not None:
            raise err

    def idle(self) -> bool:
        with self.cv:
            return self.pending == 0

    def close(self) -> None:
        self.q.put(None)


class EmulatedRuntime(Runtime):
    name = "emulated"
    emulated = True

    def __init__(self, config: EmulationConfig | None = None):
        self.config = config or EmulationConfig.from_env()
        self._lock = threading.Lock()
        self._bases: list[int] = []  # sorted, for mem_range
        self._allocs: dict[int, _Alloc] = {}
        self._tls = threading.local()
        self._default: dict[int, _Stream] = {}
        self.races: list[str] = []  # every race this runtime found (its race counter is len(races))
        self._unraised: list[str] = []  # found, not yet raised at a synchronize
        self._streams: weakref.WeakSet[_Stream] = weakref.WeakSet()
        # Interprocess events: slots of this process's tables; other processes' tables attached
        # by name, most recently used last (see _EventTable). Guarded by _lock.
        self._tables: dict[str, _EventTable] = {}
        self._free_slots: deque[tuple[_EventTable, int]] = deque()
        self._attached: dict[str, _EventTable] = {}
        self.live_events = 0  # interprocess events created here and not yet destroyed
        # Happens-before state: this runtime's host agent and clock. One lock orders every clock
        # update of this runtime with the enqueue it belongs to.
        self._hb = threading.RLock()
        self._host = new_agent()
        self._host_clock: hb.Clock = {}
        self._host_count = 0
        # Device writes of host memory (device-to-host copies) not yet known to have retired, as
        # (lo, hi, record): what hb_publish_host checks another process's host read against.
        self._host_writes: list[tuple[int, int, hb.Record]] = []
        self._host_writes_prune_at = self.HOST_WRITES_MAX // 4
        mailbox()  # opened once per process (not per runtime: a forked child opens its own), and swept

    def _drain(self, learn: bool = True) -> None:
        """Wait for this process's pending device work. cudaFree synchronizes the device, so the
        host learns that work completed (``learn``). cudaIpcCloseMemHandle is not documented to
        synchronize: the emulation still drains (it must not unmap under a pending copy) but the
        checker credits nothing, so a RELEASE sent after a close alone is not ordered after reads."""
        streams = list(self._streams)
        with self._hb:
            clocks = [dict(st.clock) for st in streams]
        for st in streams:
            with st.cv:
                while st.pending:
                    st.cv.wait()
        if learn:
            self._learn(*clocks)

    # --- happens-before bookkeeping (see hb.py) --------------------------------------------------
    @property
    def checking(self) -> bool:
        return self.config.race_check

    def _learn(self, *clocks: hb.Clock) -> None:
        """The host now knows that the operations these clocks cover have completed."""
        if self.checking:
            with self._hb:
                for c in clocks:
                    hb.join(self._host_clock, c)
                self._host_clock = _small(self._host_clock)  # bounded by the live agents (a soak's dead ones go)

    def _tick(self, st: _Stream) -> hb.Clock:
        """The clock of the next operation on ``st`` (caller holds _hb): after the stream's
        previous operations and after everything the host knew when it enqueued this one."""
        hb.join(st.clock, self._host_clock)
        st.clock = _small(st.clock)
        st.count += 1
        st.clock[st.agent] = st.count
        return dict(st.clock)

    def _host_tick(self) -> int:
        """A host event (caller holds _hb): the host's count after it."""
        self._host_count += 1
        self._host_clock[self._host] = self._host_count
        return self._host_count

    def _record(self, agent: int, count: int, what: str) -> hb.Record:
        return (agent, count, os.getpid(), _self_start(), f"pid {os.getpid()} {what}")

    def _check(self, a: _Alloc, ptr: int, nbytes: int, is_write: bool, agent: int, clock: hb.Clock,
               where: str, call: str) -> None:
        lo = ptr - a.base
        access = "write" if is_write else "read"
        rec = self._record(agent, clock[agent], f"{where} {call} {access} [{lo}, {lo + nbytes})")
        found = a.access(lo, lo + nbytes, is_write, rec, clock)
        if found:
            self.races.extend(found)
            self._unraised.extend(found)

    def _raise_races(self, call: str) -> None:
        """Raise the first race found since the last synchronize (all stay counted in races)."""
        with self._hb:
            found, self._unraised = self._unraised, []
        if found:
            more = f" (and {len(found) - 1} more)" if len(found) > 1 else ""
            raise RaceError(call, found[0] + more, code="emulated race")

    def _host_access(self, a: _Alloc, call: str, ptr: int | None = None, nbytes: int | None = None,
                     is_write: bool = True) -> None:
        """A host operation on an allocation: the whole of it as a write (cudaFree), or a range."""
        with self._hb:
            self._host_tick()
            lo = a.base if ptr is None else ptr
            n = max(a.size, 1) if nbytes is None else nbytes
            self._check(a, lo, n, is_write, self._host, dict(self._host_clock), "host", call)

    # --- happens-before edges carried by messages between processes ----------------------------
    def hb_send(self, key: str) -> None:
        """This process is about to send the message ``key``: what its host knows now (which
        streams it synchronized, which events it saw complete) is what the receiver learns."""
        if not self.checking:
            return
        with self._hb:
            self._host_tick()
            clock = dict(self._host_clock)
        mailbox().put(key, clock)

    def hb_receive(self, key: str) -> bool:
        """The message ``key`` arrived: this host is now ordered after its sender's host at send
        time. False when no such message was noted (its sender does not run the checker)."""
        if not self.checking:
            return False
        clock = mailbox().take(key)
        if clock is None:
            return False
        self._learn(clock)
        return True

    HOST_WRITES_MAX = 4096  # device-to-host copies remembered unretired (the oldest are forgotten)

    def _note_host_write(self, lo: int, hi: int, rec: hb.Record) -> None:
        """A device operation writes host memory [lo, hi) (caller holds _hb). The retired ones
        are dropped whenever the list doubled since the last pass (amortised O(1) per copy)."""
        self._host_writes.append((lo, hi, rec))
        if len(self._host_writes) >= self._host_writes_prune_at:
            host = self._host_clock
            self._host_writes = [w for w in self._host_writes if not hb.ordered(host, w[2])][-self.HOST_WRITES_MAX:]
            self._host_writes_prune_at = max(self.HOST_WRITES_MAX // 4, 2 * len(self._host_writes))

    def hb_publish_host(self, ptr: int, nbytes: int, what: str) -> None:
        """Another process reads ``[ptr, ptr + nbytes)`` on its host once the next message arrives:
        a device write of it that does not happen-before this host's present is a read-after-write
        race, whatever the timing (the reader's only edge to this process is the message)."""
        if not self.checking or nbytes <= 0:
            return
        with self._hb:
            self._host_tick()
            host, keep = self._host_clock, []
            for lo, hi, rec in self._host_writes:
                if hb.ordered(host, rec):
                    continue  # retired: nothing can race with it any more
                if lo < ptr + nbytes and ptr < hi:
                    why = (f"read-after-write race on host memory [0x{ptr:x}, +{nbytes}): {what} is read by "
                           f"another process's host, not ordered after {rec[4]} (host-wait the stream before "
                           "the message leaves)")
                    self.races.append(why)
                    self._unraised.append(why)
                    continue  # reported once
                keep.append((lo, hi, rec))
            self._host_writes = keep

    def hb_forget(self, key: str) -> None:
        """The message ``key`` will not be received (its handoff ended another way)."""
        mailbox().drop(key)

    # --- devices -------------------------------------------------------------------------------
    def probe(self) -> str | None:
        return None if self.config.devices > 0 else "emulated runtime configured with 0 devices"

    def device_count(self) -> int:
        return self.config.devices

    def _device(self) -> int:
        return getattr(self._tls, "device", 0)

    def _check_ordinal(self, call: str, ordinal: int) -> None:
        if not 0 <= ordinal < self.config.devices:
            raise DeviceError(call, f"device {ordinal} does not exist ({self.config.devices} emulated)",
                              code="cudaErrorInvalidDevice")

    def set_device(self, ordinal: int) -> None:
        self._check_ordinal("cudaSetDevice", ordinal)
        self._tls.device = ordinal

    def get_device(self) -> int:
        return self._device()

    def device_uuid(self, ordinal: int) -> str:
        self._check_ordinal("cudaGetDeviceProperties", ordinal)
        return f"EMU-{os.getuid():08x}-{ordinal:04x}"

    def pci_bus_id(self, ordinal: int) -> str:
        self._check_ordinal("cudaDeviceGetPCIBusId", ordinal)
        return f"emu:{ordinal:02x}:00.0"

    def ipc_memory_support(self, ordinal: int) -> bool:
        self._check_ordinal("cudaDeviceGetAttribute", ordinal)
        return self.config.ipc_memory

    def ipc_event_support(self, ordinal: int) -> bool:
        self._check_ordinal("cudaDeviceGetAttribute", ordinal)
        return self.config.ipc_events

    def unsupported_reason(self, ordinal: int, capability: str) -> str | None:
        off = {"ipc_memory": not self.config.ipc_memory, "ipc_events": not self.config.ipc_events}
        return f"{capability} disabled in this emulation (HURRAY_EMU_*)" if off.get(capability) else None

    def can_access_peer(self, ordinal: int, peer: int) -> bool:
        self._check_ordinal("cudaDeviceCanAccessPeer", ordinal)
        self._check_ordinal("cudaDeviceCanAccessPeer", peer)
        return ordinal == peer or self.config.peer_access

    # --- memory --------------------------------------------------------------------------------
    def _register(self, seg: Segment, device: int, imported: bool) -> _Alloc:
        base = seg.address() + HEADER
        a = _Alloc(seg, base, seg.size - HEADER, device, imported, _Locked(seg))
        with self._lock:
            bisect.insort(self._bases, base)
            self._allocs[base] = a
        return a

    def _unregister(self, base: int) -> _Alloc:
        with self._lock:
            a = self._allocs.pop(base, None)
            if a is None:
                raise DeviceError("cudaFree", f"0x{base:x} is not an allocation base", code="cudaErrorInvalidValue")
            self._bases.remove(base)
        return a

    def _find(self, ptr: int) -> _Alloc | None:
        with self._lock:
            i = bisect.bisect_right(self._bases, ptr) - 1
            if i >= 0:
                a = self._allocs[self._bases[i]]
                if ptr < a.base + max(a.size, 1):
                    return a
        return None

    def malloc(self, nbytes: int) -> int:
        seg = Segment.create(HEADER + max(nbytes, 1), "m")
        seg.map[:8] = _MEM_MAGIC
        struct.pack_into("<QQ", seg.map, 8, nbytes, self._device())
        return self._register(seg, self._device(), imported=False).base

    def free(self, ptr: int) -> None:
        self._drain()
        a = self._unregister(ptr)
        if a.imported:
            raise DeviceError("cudaFree", "pointer came from cudaIpcOpenMemHandle; close it instead",
                              code="cudaErrorInvalidValue")
        if self.checking:  # ordered after every other process's use, and after every importer's close
            self._host_access(a, "cudaFree", a.base, _mapping_end(a) + 1 - a.base)
        self._drop(a)

    @staticmethod
    def _drop(a: _Alloc) -> None:
        a.seg.close()

    def rdma_write_ordering(self, ordinal: int) -> str | None:
        self._check_ordinal("cudaDeviceGetAttribute", ordinal)
        return None  # emulated memory is host memory: a NIC (NIXL over UCX) writes it as DRAM

    def rdma_expose(self, ptr: int) -> None:
        a = self._find(ptr)
        if a is None:
            raise DeviceError("rdma_expose", f"0x{ptr:x} is not emulated device memory", code="cudaErrorInvalidValue")
        a.seg.map[_NIC] = 1

    def rdma_source(self, ptr: int, nbytes: int) -> None:
        a = self._find(ptr)
        if a is None or ptr + nbytes > a.base + a.size:
            raise DeviceError("rdma_source", f"[0x{ptr:x}, +{nbytes}) is not emulated device memory",
                              code="cudaErrorInvalidValue")
        if self.checking:  # the NIC reads with the host's knowledge: checked as a host read, raised now
            self._host_access(a, "NIXL WRITE source read", ptr, nbytes, is_write=False)
            self._raise_races("NIXL WRITE source read")

    def flush_rdma_writes(self) -> None:
        dev = self._device()
        with self._lock:
            allocs = [a for a in self._allocs.values() if a.device == dev]
        for a in allocs:
            a.seg.map[_NIC] = 0

    def _nic_check(self, a: _Alloc, call: str) -> None:
        """The race check's rule for NIC writes: no device read of memory a NIC may have written
        before a flush of its device made the writes visible (interchange.md R5)."""
        if self.checking and a.seg.map[_NIC]:
            why = (f"reads {a.seg.name}, offered for GPUDirect RDMA writes with no "
                   "cudaDeviceFlushGPUDirectRDMAWrites of its device since (interchange.md R5)")
            with self._hb:
                self.races.append(why)
            raise RaceError(call, why)

    def mem_range(self, ptr: int) -> tuple[int, int]:
        a = self._find(ptr)
        if a is None:
            raise DeviceError("cuMemGetAddressRange", f"0x{ptr:x} is not emulated device memory",
                              code="CUDA_ERROR_NOT_FOUND")
        return a.base, a.size

    def ipc_get_mem_handle(self, base: int) -> bytes:
        if not self.config.ipc_memory:
            raise DeviceError("cudaIpcGetMemHandle", "IPC memory disabled in this emulation",
                              code="cudaErrorNotSupported")
        a = self._allocs.get(base)
        if a is None:
            raise DeviceError("cudaIpcGetMemHandle", f"0x{base:x} is not an allocation base",
                              code="cudaErrorInvalidValue")
        return _BLOB.pack(_MEM_MAGIC, a.device, os.getpid(), a.size, a.seg.name.encode())

    def ipc_open_mem_handle(self, blob: bytes) -> int:
        raw = check_blob(blob, "cudaIpcOpenMemHandle", emulated=True)
        magic, device, _pid, size, name = _BLOB.unpack(raw)
        if magic != _MEM_MAGIC:
            raise DeviceError("cudaIpcOpenMemHandle", "not an emulated memory handle", code="cudaErrorInvalidValue")
        self._check_ordinal("cudaIpcOpenMemHandle", device)
        if not self.can_access_peer(self._device(), device):
            raise DeviceError("cudaIpcOpenMemHandle",
                              f"memory on device {device} is not peer-accessible from device {self._device()}",
                              code="cudaErrorPeerAccessUnsupported")
        try:
            seg = Segment.attach(name.rstrip(b"\0").decode())
        except DeviceError as e:  # CUDA reports a freed allocation's handle as an invalid value
            raise DeviceError("cudaIpcOpenMemHandle", str(e), code="cudaErrorInvalidValue") from e
        return self._register(seg, device, imported=True).base

    def ipc_close_mem_handle(self, base: int) -> None:
        self._drain(learn=False)
        a = self._unregister(base)
        if not a.imported:
            raise DeviceError("cudaIpcCloseMemHandle", "pointer was not opened from an IPC handle",
                              code="cudaErrorInvalidValue")
        if self.checking:  # the exporter's cudaFree must come after this close (devices/DESIGN.md)
            self._host_access(a, "cudaIpcCloseMemHandle", _mapping_end(a), 1, is_write=False)
        self._drop(a)

    def host_register(self, ptr: int, nbytes: int) -> None:
        pass  # all emulated "device" copies are host copies; page-locking changes nothing here

    def host_unregister(self, ptr: int) -> None:
        pass

    # --- streams -------------------------------------------------------------------------------
    def _stream(self, s: Any) -> _Stream:
        if s is None or s == 0:
            dev = self._device()
            with self._lock:
                st = self._default.get(dev)
                if st is None:
                    st = self._default[dev] = _Stream(self, dev, "default stream")
                    self._streams.add(st)
            return st
        if not isinstance(s, _Stream):
            raise DeviceError("stream", f"{s!r} is not an emulated stream", code="cudaErrorInvalidResourceHandle")
        return s

    def stream_create(self) -> Any:
        st = _Stream(self, self._device())
        self._streams.add(st)
        return st

    def stream_destroy(self, stream: Any) -> None:
        self._stream(stream).close()

    def stream_synchronize(self, stream: Any) -> None:
        st = self._stream(stream)
        with self._hb:
            clock = dict(st.clock)  # everything enqueued on it so far
        try:
            st.synchronize()
        finally:
            self._learn(clock)
        self._raise_races("cudaStreamSynchronize")

    def stream_query(self, stream: Any) -> bool:
        st = self._stream(stream)
        with self._hb:  # enqueues take this lock too: idle and clock describe the same moment
            done, clock = st.idle(), dict(st.clock)
        if done:
            self._learn(clock)
        return done

    def stream_id(self, stream: Any) -> int:
        return self._stream(stream).id

    def stream_from_id(self, ident: int) -> Any:
        if ident in (0, 1, 2):
            return self._stream(0)
        for st in list(self._streams):
            if st.id == ident:
                return st
        raise DeviceError("stream", f"no emulated stream {ident:#x} in this process",
                          code="cudaErrorInvalidResourceHandle")

    def stream_wait_event(self, stream: Any, event: Any) -> None:
        ev = self._event(event, "cudaStreamWaitEvent")
        st = self._stream(stream)
        owner = ev.owner_pid()
        with self._hb:
            def tick(before: hb.Clock) -> hb.Record | None:
                hb.join(st.clock, before)  # the race check: only a record that happens-before this call orders it
                self._tick(st)
                if self.checking and ev.interprocess and not ev.owner:  # the exporter's destroy must follow it
                    return self._record(st.agent, st.count, f"{st.label} cudaStreamWaitEvent")
                return None

            target = ev.issue_wait(self._host_clock if self.checking else None, tick)

            def wait() -> None:
                spin = 0
                while not ev.done(target):
                    spin += 1
                    time.sleep(0.00005 if spin < 100 else 0.001)
                    if spin % 500 == 0 and owner and _recorder_dead(owner):
                        raise DeviceError("cudaStreamWaitEvent", f"the process {owner} that records this event died",
                                          code="cudaErrorLaunchFailure")

            st.enqueue(wait, instant=ev.done(target))

    def memcpy_async(self, dst: int, src: int, nbytes: int, stream: Any) -> None:
        if nbytes <= 0:
            return
        st = self._stream(stream)
        d, s = self._find(dst), self._find(src)
        for a, p, what in ((d, dst, "destination"), (s, src, "source")):
            if a is not None and p + nbytes > a.base + a.size:
                raise DeviceError("cudaMemcpyAsync", f"{what} range exceeds its allocation",
                                  code="cudaErrorInvalidValue")
        delay = self.config.op_delay_s

        def copy() -> None:
            # Reads happen when the op starts, writes land when it ends: the widest window in
            # which an unordered reader sees stale bytes, as a slow kernel would make it.
            if delay:
                snapshot = ctypes.string_at(src, nbytes)
                time.sleep(delay)
                ctypes.memmove(dst, snapshot, nbytes)
            else:
                ctypes.memmove(dst, src, nbytes)

        if s is not None:
            self._nic_check(s, "cudaMemcpyAsync")
        with self._hb:
            if self.checking and (d is not None or s is not None):
                clock = self._tick(st)
                if s is not None:
                    self._check(s, src, nbytes, False, st.agent, clock, st.label, "cudaMemcpyAsync")
                if d is not None:
                    self._check(d, dst, nbytes, True, st.agent, clock, st.label, "cudaMemcpyAsync")
                else:  # device to host: a host reader in another process must be ordered after it
                    self._note_host_write(dst, dst + nbytes, self._record(
                        st.agent, clock[st.agent], f"{st.label} cudaMemcpyAsync write of host [0x{dst:x}, +{nbytes})"))
            st.enqueue(copy, instant=not delay)

    def memset_async(self, ptr: int, value: int, nbytes: int, stream: Any) -> None:
        if nbytes <= 0:
            return
        a = self._find(ptr)
        if a is None or ptr < a.base or ptr + nbytes > a.base + a.size:
            raise DeviceError("cudaMemsetAsync", f"0x{ptr:x}+{nbytes} is not inside emulated device memory",
                              code="cudaErrorInvalidValue")
        st = self._stream(stream)
        delay = self.config.op_delay_s

        def fill() -> None:
            if delay:
                time.sleep(delay)
            ctypes.memset(ptr, value & 0xFF, nbytes)

        with self._hb:
            if self.checking:
                self._check(a, ptr, nbytes, True, st.agent, self._tick(st), st.label, "cudaMemsetAsync")
            st.enqueue(fill, instant=not delay)

    # --- events --------------------------------------------------------------------------------
    def _event(self, e: Any, call: str, live: bool = True) -> _Event:
        """``e`` as a live event; ``live``: an imported one whose exporter destroyed it is not."""
        if not isinstance(e, _Event) or e.destroyed:
            raise DeviceError(call, f"{e!r} is not a live emulated event", code="cudaErrorInvalidResourceHandle")
        if live:
            e._check_live(call)  # again under the slot's lock where it records or waits
        return e

    def _take_slot(self) -> tuple[_EventTable, int]:
        """A free event slot of this process's tables (caller holds _lock); a new table when none."""
        for _ in range(len(self._free_slots)):
            table, slot = self._free_slots.pop()  # the latest freed first: few slots stay in use
            if table.idle(slot):
                return table, slot
            self._free_slots.appendleft((table, slot))  # its last event's record is still pending
        # 8 slots first (most processes hold few events at once), then as many as it has, up to TABLE_SLOTS
        slots = min(TABLE_SLOTS, max(8, sum(t.slots for t in self._tables.values())))
        table = _EventTable(Segment.create(slots * EVENT_SLOT, "v"))
        self._tables[table.seg.name] = table
        self._free_slots.extendleft((table, i) for i in range(1, table.slots))
        return table, 0

    def event_create(self, interprocess: bool) -> Any:
        dev = self._device()
        if not interprocess:
            ev = _Event(bytearray(EVENT_SLOT), 0, _Locked(None), owner=True, interprocess=False, device=dev)
        else:
            with self._lock:
                table, slot = self._take_slot()
                self.live_events += 1
            off = slot * EVENT_SLOT
            ev = _Event(table.seg.map, off, table.locks[slot], owner=True, interprocess=True, device=dev, table=table,
                        slot=slot, generation=table.generation(slot))
        with ev.lock:
            ev.buf[ev.off:ev.off + 8] = _EVT_MAGIC
            ev.words[3] = os.getpid()
            struct.pack_into("<I", ev.buf, ev.off + _STATE_LEN, 0)  # no records, no waits (a reused slot)
        return ev

    def event_destroy(self, event: Any) -> None:
        ev = self._event(event, "cudaEventDestroy", live=False)
        table = ev.table
        waits: list[hb.Record] = []
        host: hb.Clock = {}
        if table is not None and ev.owner:
            # A wait already enqueued still completes, as in CUDA (the counters go on in the slot);
            # a handle of this event no longer opens, and the slot serves a later event. The waits
            # other processes issued are read in the same locked section, with what this host knows
            # at the call (_hb, then the slot: the order stream_wait_event takes them in): each wait
            # issued before this destroy is checked below, and none can be issued after it.
            with self._hb, ev.lock:
                if self.checking:
                    waits, host = ev._state()[1], dict(self._host_clock)
                struct.pack_into("<I", table.seg.map, ev.off + _GEN, (ev.generation + 1) & 0xFFFFFFFF)
        if waits:
            # An importer's operations on an interprocess event after its exporter destroyed it are
            # undefined in CUDA: the destroy must be ordered after every wait other processes issued
            # on it (devices/DESIGN.md).
            with self._hb:
                for rec in waits:
                    if not hb.ordered(host, rec) and not _gone(rec):
                        why = (f"destroy-before-wait race on interprocess event {ev.name}: pid {os.getpid()} "
                               f"cudaEventDestroy is not ordered after {rec[4]} (an importer's wait may not have "
                               "run yet: destroy the event after the handoff's RELEASED)")
                        self.races.append(why)
                        self._unraised.append(why)
        ev.destroyed = True
        if table is None:
            return
        if ev.owner:
            with self._lock:
                self._free_slots.append((table, ev.slot))
                self.live_events -= 1
        else:
            with self._lock:
                table.refs -= 1
                self._detach_idle()

    def _detach_idle(self) -> None:
        """Close the least recently used attached tables with no event open beyond IDLE_TABLES
        (caller holds _lock); a wait still enqueued on one keeps its mapping until it ran."""
        idle = [name for name, t in self._attached.items() if t.refs <= 0]
        for name in idle[:max(0, len(idle) - IDLE_TABLES)]:
            self._attached.pop(name).close()

    def event_record(self, event: Any, stream: Any) -> None:
        ev = self._event(event, "cudaEventRecord")
        st = self._stream(stream)
        with self._hb:
            if self.checking:
                stamp = self._host_tick()  # the call is a host event: a message sent after it carries it
                seq = ev.record(self._tick(st), self._host, stamp)
            else:
                seq = ev.record(None)

            def complete() -> None:
                with ev.lock:
                    if int(ev.words[2]) < seq:
                        ev.words[2] = seq

            st.enqueue(complete, instant=True)

    def event_synchronize(self, event: Any) -> None:
        ev = self._event(event, "cudaEventSynchronize")
        target, clock = ev.latest()
        owner, spin = ev.owner_pid(), 0
        while not ev.done(target):
            spin += 1
            time.sleep(0.0001)
            if spin % 500 == 0 and owner and _recorder_dead(owner):
                raise DeviceError("cudaEventSynchronize", f"the process {owner} that records this event died",
                                  code="cudaErrorLaunchFailure")
        self._learn(clock)
        self._raise_races("cudaEventSynchronize")

    def event_query(self, event: Any) -> bool:
        ev = self._event(event, "cudaEventQuery")
        target, clock = ev.latest()
        done = ev.done(target)
        if done:
            self._learn(clock)
        return done

    def ipc_get_event_handle(self, event: Any) -> bytes:
        ev = self._event(event, "cudaIpcGetEventHandle")
        if not self.config.ipc_events:
            raise DeviceError("cudaIpcGetEventHandle", "IPC events disabled in this emulation",
                              code="cudaErrorNotSupported")
        if ev.table is None:
            raise DeviceError("cudaIpcGetEventHandle", "event was not created with cudaEventInterprocess",
                              code="cudaErrorInvalidResourceHandle")
        return _BLOB.pack(_EVT_MAGIC, ev.device, ev.owner_pid(), (ev.slot << 32) | ev.generation,
                          ev.table.seg.name.encode())

    def ipc_open_event_handle(self, blob: bytes) -> Any:
        raw = check_blob(blob, "cudaIpcOpenEventHandle", emulated=True)
        magic, device, _pid, where, raw_name = _BLOB.unpack(raw)
        if magic != _EVT_MAGIC:
            raise DeviceError("cudaIpcOpenEventHandle", "not an emulated event handle", code="cudaErrorInvalidValue")
        slot, generation = where >> 32, where & 0xFFFFFFFF
        name = raw_name.rstrip(b"\0").decode(errors="replace")
        if (shm.parse_name(name) or (0, 0, ""))[2] != "v":
            raise DeviceError("cudaIpcOpenEventHandle", f"{name!r} names no emulated event table",
                              code="cudaErrorInvalidValue")
        with self._lock:
            table = self._tables.get(name) or self._attached.pop(name, None)
            if table is None:
                seg = Segment.attach(name)
                if seg.size % EVENT_SLOT:
                    seg.close()
                    raise DeviceError("cudaIpcOpenEventHandle", f"{name} is no emulated event table ({seg.size} bytes)",
                                      code="cudaErrorInvalidValue")
                table = _EventTable(seg)
            if name not in self._tables:
                self._attached[name] = table  # most recently used last
            off = slot * EVENT_SLOT
            if slot >= table.slots or table.generation(slot) != generation or \
                    table.seg.map[off:off + 8] != _EVT_MAGIC:
                self._detach_idle()
                raise DeviceError("cudaIpcOpenEventHandle", f"event {name}#{slot} (generation {generation}) was "
                                  "destroyed by its exporter", code="cudaErrorInvalidValue")
            table.refs += 1
            self._detach_idle()
        return _Event(table.seg.map, off, table.locks[slot], owner=False, interprocess=True, device=device, table=table,
                      slot=slot, generation=generation)
