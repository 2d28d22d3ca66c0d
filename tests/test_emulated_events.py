"""The emulation's events: locking, and the event tables that hold interprocess events.

A non-interprocess event has no IPC handle, so no other process maps its state: its record,
completion and queries exclude threads only (no lock syscalls on the consumer's fence path). An
interprocess event is recorded, waited on and destroyed from several processes, so every update of
its shared state still takes the cross-process lock (test_races and test_fencing keep the verdicts).

An interprocess event is a slot of its process's event table, named in its handle with the slot's
generation (devices/DESIGN.md, "The emulation"): a destroyed event's handle must not open, an
importer's use of it after the destroy must fail, and a reused slot must look like a new event.
"""

from __future__ import annotations

import ctypes
import fcntl
import os
import platform
import threading
import time
from typing import Any

import pytest

from hurray_ipc.devices.backend import emulated
from hurray_ipc.devices.backend.emulated import EmulatedRuntime
from hurray_ipc.devices.backend.mailbox import mailbox
from hurray_ipc.devices.errors import DeviceError
from tests.conftest import emu_config


@pytest.fixture
def flocks(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Every cross-process lock operation the emulation makes (a byte lock on an allocation's or
    an event slot's segment; a flock too, should anything take one): LOCK_EX or LOCK_UN."""
    mailbox()  # opened (and swept, which locks any stale note's slot) before counting starts
    calls: list[int] = []
    real_flock, real_fcntl = fcntl.flock, fcntl.fcntl

    def counting_flock(fd: int, op: int) -> None:
        calls.append(op)
        real_flock(fd, op)

    def counting_fcntl(fd: int, cmd: int, arg: Any = 0) -> Any:
        if cmd in (fcntl.F_OFD_SETLKW, fcntl.F_OFD_SETLK):
            calls.append(fcntl.LOCK_EX if cmd == fcntl.F_OFD_SETLKW else fcntl.LOCK_UN)
        return real_fcntl(fd, cmd, arg)

    monkeypatch.setattr(fcntl, "flock", counting_flock)
    monkeypatch.setattr(fcntl, "fcntl", counting_fcntl)
    return calls


def _use(rt: EmulatedRuntime, interprocess: bool) -> None:
    s = rt.stream_create()
    ev = rt.event_create(interprocess)
    for _ in range(3):
        rt.event_record(ev, s)
        rt.stream_wait_event(s, ev)
        rt.event_synchronize(ev)
        assert rt.event_query(ev)
    rt.stream_synchronize(s)
    rt.event_destroy(ev)
    rt.stream_destroy(s)


def test_a_process_local_event_takes_no_flock(flocks: list[int]) -> None:
    _use(EmulatedRuntime(emu_config(op_delay_s=0.0)), interprocess=False)
    assert flocks == []


def test_an_interprocess_event_locks_across_processes(flocks: list[int]) -> None:
    _use(EmulatedRuntime(emu_config(op_delay_s=0.0)), interprocess=True)
    # Three records, their completions and the reads of the latest record: each one locked section.
    assert flocks.count(fcntl.LOCK_EX) >= 9
    assert flocks.count(fcntl.LOCK_EX) == flocks.count(fcntl.LOCK_UN)


def test_a_destroyed_events_handle_does_not_open_even_when_its_slot_serves_a_new_event() -> None:
    rt = EmulatedRuntime(emu_config(op_delay_s=0.0))
    old = rt.event_create(interprocess=True)
    blob = rt.ipc_get_event_handle(old)
    rt.event_destroy(old)
    with pytest.raises(DeviceError, match="destroyed by its exporter") as e:
        rt.ipc_open_event_handle(blob)
    assert e.value.code == "cudaErrorInvalidValue"
    new = rt.event_create(interprocess=True)
    assert (new.table, new.slot) == (old.table, old.slot), "the freed slot is reused"
    with pytest.raises(DeviceError, match="destroyed by its exporter"):
        rt.ipc_open_event_handle(blob)  # the slot is live again, under a later generation
    opened = rt.ipc_open_event_handle(rt.ipc_get_event_handle(new))
    assert rt.event_query(opened)
    rt.event_destroy(opened)
    rt.event_destroy(new)
    assert rt.live_events == 0


@pytest.mark.races_expected
def test_an_importers_use_of_an_event_its_exporter_destroyed_fails() -> None:
    exporter, importer = EmulatedRuntime(emu_config(op_delay_s=0.0)), EmulatedRuntime(emu_config(op_delay_s=0.0))
    ev = exporter.event_create(interprocess=True)
    theirs = importer.ipc_open_event_handle(exporter.ipc_get_event_handle(ev))
    s = importer.stream_create()
    importer.stream_wait_event(s, theirs)  # before the destroy: fine
    exporter.event_destroy(ev)
    assert any("destroy-before-wait race" in r for r in exporter.races), "the checker's verdict is unchanged"
    for call in (lambda: importer.stream_wait_event(s, theirs), lambda: importer.event_record(theirs, s),
                 lambda: importer.event_query(theirs), lambda: importer.event_synchronize(theirs)):
        with pytest.raises(DeviceError, match="destroyed by its exporter") as e:
            call()
        assert e.value.code == "cudaErrorInvalidResourceHandle"
    importer.event_destroy(theirs)  # dropping the importer's copy still works
    importer.stream_synchronize(s)
    importer.stream_destroy(s)


@pytest.mark.races_expected
def test_a_wait_issued_while_its_exporter_destroys_the_event_is_checked_or_refused(monkeypatch) -> None:
    """The destroy reads the waits importers issued and moves the slot to its next generation in
    one locked section: a wait issued meanwhile is either among those checked (a destroy-before-
    wait race) or refused as a destroyed event's. Forced here: the importer's wait runs the moment
    the destroying thread first unlocks the slot (when these were two sections, it landed between
    them, was neither checked nor refused, and the race went unreported)."""
    exporter, importer = EmulatedRuntime(emu_config(op_delay_s=0.0)), EmulatedRuntime(emu_config(op_delay_s=0.0))
    ev = exporter.event_create(interprocess=True)
    theirs = importer.ipc_open_event_handle(exporter.ipc_get_event_handle(ev))
    s = importer.stream_create()
    real_fcntl, me = fcntl.fcntl, threading.current_thread()
    outcome: list[object] = []
    destroying = False

    def lock(fd: int, cmd: int, arg: Any = 0) -> Any:
        nonlocal destroying
        out = real_fcntl(fd, cmd, arg)
        if destroying and cmd == fcntl.F_OFD_SETLK and threading.current_thread() is me:
            destroying = False  # once: the first unlock of the destroy
            try:
                importer.stream_wait_event(s, theirs)
                outcome.append("issued")
            except DeviceError as e:
                outcome.append(e.code)
        return out

    monkeypatch.setattr(fcntl, "fcntl", lock)
    destroying = True
    exporter.event_destroy(ev)
    monkeypatch.undo()
    assert outcome, "the destroy took no slot lock"
    checked = any("destroy-before-wait race" in r for r in exporter.races)
    assert outcome == ["cudaErrorInvalidResourceHandle"] or checked, \
        f"a wait issued during the destroy was neither refused nor checked: {outcome}"
    importer.event_destroy(theirs)
    importer.stream_synchronize(s)
    importer.stream_destroy(s)


@pytest.mark.races_expected
def test_a_destroy_is_judged_by_what_its_host_knew_when_it_read_the_waits(monkeypatch) -> None:
    """The waits and the host's clock are read together: what the exporter's host learns after
    the destroy read the waits (another of its threads, forced here into the destroy's first
    unlock) cannot excuse a destroy that was not ordered after an importer's wait."""
    exporter, importer = EmulatedRuntime(emu_config(op_delay_s=0.0)), EmulatedRuntime(emu_config(op_delay_s=0.0))
    ev = exporter.event_create(interprocess=True)
    theirs = importer.ipc_open_event_handle(exporter.ipc_get_event_handle(ev))
    s = importer.stream_create()
    importer.stream_wait_event(s, theirs)  # nothing orders the destroy after this wait: a race
    real_fcntl, me = fcntl.fcntl, threading.current_thread()
    learned: list[int] = []

    def lock(fd: int, cmd: int, arg: Any = 0) -> Any:
        out = real_fcntl(fd, cmd, arg)
        if not learned and cmd == fcntl.F_OFD_SETLK and threading.current_thread() is me:
            waits = ev._state()[1]
            exporter._learn(*({rec[0]: rec[1]} for rec in waits))  # learnt now: too late for this destroy
            learned.append(len(waits))
        return out

    monkeypatch.setattr(fcntl, "fcntl", lock)
    exporter.event_destroy(ev)
    monkeypatch.undo()
    assert learned == [1]
    assert any("destroy-before-wait race" in r for r in exporter.races), "a later lesson excused the destroy"
    importer.event_destroy(theirs)
    importer.stream_synchronize(s)
    importer.stream_destroy(s)


def test_a_slot_whose_last_record_is_pending_is_not_reused_and_the_old_wait_completes() -> None:
    """The destroyed event's record is still queued behind a gate (an event recorded by no stream,
    completed by hand): a new event must not take its slot (it would look recorded and never
    complete), and a wait an importer issued on the old event completes when the record does."""
    exporter = EmulatedRuntime(emu_config(op_delay_s=0.0, race_check=False))
    importer = EmulatedRuntime(emu_config(op_delay_s=0.0, race_check=False))
    gate = exporter.event_create(interprocess=False)
    gate.words[1] = 1  # recorded, not yet completed: whatever waits on it is held back
    s = exporter.stream_create()
    exporter.stream_wait_event(s, gate)
    old = exporter.event_create(interprocess=True)
    exporter.event_record(old, s)  # pending behind the gate
    theirs = importer.ipc_open_event_handle(exporter.ipc_get_event_handle(old))
    t = importer.stream_create()
    importer.stream_wait_event(t, theirs)
    exporter.event_destroy(old)
    new = exporter.event_create(interprocess=True)
    assert (new.table, new.slot) != (old.table, old.slot), "a slot with a pending record was reused"
    assert exporter.event_query(new), "a new event that was never recorded is complete"
    assert not importer.stream_query(t), "the importer's wait ran before the record it orders after"
    done = threading.Event()
    threading.Thread(target=lambda: (importer.stream_synchronize(t), done.set()), daemon=True).start()
    gate.words[2] = 1
    assert done.wait(10), "the importer's wait on the destroyed event never completed"
    exporter.stream_synchronize(s)
    again = exporter.event_create(interprocess=True)
    assert exporter.event_query(again)
    for ev in (new, again, gate):
        exporter.event_destroy(ev)
    importer.event_destroy(theirs)


def test_two_events_of_one_table_lock_apart() -> None:
    """Each slot has its own cross-process lock: one process holding an event's lock (recording
    it, issuing a wait on it) does not hold up another event of the same table in another process."""
    import multiprocessing

    rt = EmulatedRuntime(emu_config(op_delay_s=0.0))
    a, b = rt.event_create(interprocess=True), rt.event_create(interprocess=True)
    assert a.table is b.table and a.slot != b.slot
    ctx = multiprocessing.get_context("spawn")
    result = ctx.Queue()
    with a.lock:  # held here: another process locks b, then a
        p = ctx.Process(target=_lock_in_child, args=(rt.ipc_get_event_handle(b), rt.ipc_get_event_handle(a), result))
        p.start()
        assert result.get(timeout=60) == "b locked", "event b's lock waited for event a's"
    assert result.get(timeout=60) == "a locked"
    p.join(30)
    rt.event_destroy(a), rt.event_destroy(b)


_SYS_FCNTL = {"x86_64": 72, "aarch64": 25}.get(platform.machine())  # the kernel's syscall number


def _sleeping_in_fcntl(t: threading.Thread) -> bool:
    """Is ``t`` asleep inside fcntl(F_OFD_SETLKW)? A lock granted at once returns without sleeping,
    so this is a wait for a lock another descriptor holds. (False once the thread ended.)"""
    task = f"/proc/self/task/{t.native_id}"
    try:
        with open(f"{task}/syscall") as f:
            call = f.read().split()
        with open(f"{task}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state == "S" and call[:1] == [str(_SYS_FCNTL)] and int(call[2], 16) == fcntl.F_OFD_SETLKW


def test_two_runtimes_in_one_process_exclude_each_other_on_a_slot() -> None:
    """Tests run two runtimes in one process as two processes: their descriptors of one table
    must exclude each other on a slot (a process-owned record lock would not)."""
    if _SYS_FCNTL is None or not os.path.exists(f"/proc/self/task/{threading.get_native_id()}/syscall"):
        pytest.skip(f"no way here to see a thread wait in fcntl ({platform.machine()}, /proc/<tid>/syscall)")
    exporter, importer = EmulatedRuntime(emu_config(op_delay_s=0.0)), EmulatedRuntime(emu_config(op_delay_s=0.0))
    ev = exporter.event_create(interprocess=True)
    theirs = importer.ipc_open_event_handle(exporter.ipc_get_event_handle(ev))
    got = threading.Event()
    with ev.lock:
        t = threading.Thread(target=lambda: (theirs.lock.__enter__(), got.set(), theirs.lock.__exit__()), daemon=True)
        t.start()
        # Until it got the lock, or sleeps in the kernel waiting for the byte lock (so it cannot have it).
        deadline = time.monotonic() + 30
        while not (got.is_set() or _sleeping_in_fcntl(t)) and t.is_alive():
            assert time.monotonic() < deadline, "the importer's thread neither took the lock nor waited for it"
            time.sleep(0.001)  # polling an observable condition
        assert not got.is_set(), "the importer's runtime took the slot's lock while the exporter's held it"
        assert t.is_alive(), "the importer's thread died"
    assert got.wait(30), "the importer's runtime never got the slot's lock"
    t.join(10)
    importer.event_destroy(theirs), exporter.event_destroy(ev)


def _lock_in_child(blob_b: bytes, blob_a: bytes, result: Any) -> None:
    rt = EmulatedRuntime(emu_config(op_delay_s=0.0))
    b, a = rt.ipc_open_event_handle(blob_b), rt.ipc_open_event_handle(blob_a)
    with b.lock:
        result.put("b locked")
    with a.lock:
        result.put("a locked")


def test_an_instant_operation_never_overtakes_a_queued_one() -> None:
    """A zero-delay memset may run in the calling thread, but only on an idle stream: behind a
    queued wait it must wait its turn (its bytes land only once the gate opened)."""
    rt = EmulatedRuntime(emu_config(op_delay_s=0.0, race_check=False))
    s, ptr = rt.stream_create(), rt.malloc(64)
    rt.memset_async(ptr, 1, 64, s)  # idle stream: runs at once
    assert ctypes.string_at(ptr, 64) == b"\x01" * 64
    gate = rt.event_create(interprocess=False)
    gate.words[1] = 1  # recorded, not completed
    rt.stream_wait_event(s, gate)
    rt.memset_async(ptr, 2, 64, s)
    assert ctypes.string_at(ptr, 64) == b"\x01" * 64, "the memset ran before the wait queued ahead of it"
    gate.words[2] = 1
    rt.stream_synchronize(s)
    assert ctypes.string_at(ptr, 64) == b"\x02" * 64
    rt.event_destroy(gate), rt.free(ptr), rt.stream_destroy(s)


def test_event_tables_start_small_and_grow() -> None:
    rt = EmulatedRuntime(emu_config(op_delay_s=0.0))
    evs = [rt.event_create(interprocess=True) for _ in range(9)]
    tables = list(dict.fromkeys(ev.table for ev in evs))
    assert [t.slots for t in tables] == [8, 8], "8 slots first, then as many again"
    evs += [rt.event_create(interprocess=True) for _ in range(8)]
    assert [t.slots for t in dict.fromkeys(ev.table for ev in evs)] == [8, 8, 16]
    for ev in evs:
        rt.event_destroy(ev)
    assert rt.live_events == 0


def test_a_handle_naming_no_event_table_does_not_open() -> None:
    rt = EmulatedRuntime(emu_config(op_delay_s=0.0))
    ptr = rt.malloc(64)
    name = emulated._BLOB.unpack(rt.ipc_get_mem_handle(ptr))[4]  # an allocation's segment
    blob = emulated._BLOB.pack(emulated._EVT_MAGIC, 0, 0, 0, name)
    with pytest.raises(DeviceError, match="names no emulated event table") as e:
        rt.ipc_open_event_handle(blob)
    assert e.value.code == "cudaErrorInvalidValue"
    rt.free(ptr)


def test_an_attached_table_never_closes_under_a_late_record(monkeypatch: pytest.MonkeyPatch) -> None:
    """An importer records its copy of an event on a busy stream, destroys the copy, and later
    opens events of more tables than it keeps idle: the first table's descriptor is closed. A
    record still completing on the stream thread holds the slot's lock from its "still open?"
    check to its unlock; the close started exactly in that window must wait for it (else the lock
    call hits a closed, or reused, descriptor: a stream error)."""
    exporters = [EmulatedRuntime(emu_config(op_delay_s=0.0, race_check=False))
                 for _ in range(emulated.IDLE_TABLES + 1)]
    importer = EmulatedRuntime(emu_config(op_delay_s=0.0, race_check=False))
    events = [rt.event_create(interprocess=True) for rt in exporters]
    mine = importer.ipc_open_event_handle(exporters[0].ipc_get_event_handle(events[0]))
    s = importer.stream_create()
    gate = importer.event_create(interprocess=False)
    gate.words[1] = 1  # the stream holds the record back: its worker thread completes it
    importer.stream_wait_event(s, gate)
    importer.event_record(mine, s)
    importer.event_destroy(mine)  # CUDA allows it with the record pending
    real_fcntl, closed, progress = fcntl.fcntl, threading.Event(), threading.Event()
    early: list[bool] = []

    def detach_others() -> None:  # opens and drops one event of every other table: the first is evicted
        for rt, ev in zip(exporters[1:], events[1:], strict=True):
            importer.event_destroy(importer.ipc_open_event_handle(rt.ipc_get_event_handle(ev)))
        closed.set()
        progress.set()

    class NotedLock:  # the slot's thread lock, noting when the closing thread comes to take it
        def __init__(self, real: Any) -> None:
            self.real = real

        def acquire(self) -> bool:
            if threading.current_thread().name == "detach":
                progress.set()  # from here the close waits for the stream thread's unlock
            return bool(self.real.acquire())

        def release(self) -> None:
            self.real.release()

    mine.lock.local = NotedLock(mine.lock.local)

    def lock(fd: int, cmd: int, arg: Any = 0) -> Any:
        if cmd == fcntl.F_OFD_SETLKW and not early and threading.current_thread().name.startswith("emu-stream"):
            threading.Thread(target=detach_others, name="detach", daemon=True).start()
            assert progress.wait(30), "the close neither came to the slot's lock nor finished"
            early.append(closed.is_set())  # fixed: the close waits at this slot's lock, so it is not closed
        return real_fcntl(fd, cmd, arg)

    monkeypatch.setattr(fcntl, "fcntl", lock)
    gate.words[2] = 1
    importer.stream_synchronize(s)  # raises the stream's error when the descriptor went first
    assert closed.wait(10) and early == [False], "the table closed while a record held its slot's lock"
    assert exporters[0].event_query(events[0]), "the late record completed"
    importer.event_destroy(gate), importer.stream_destroy(s)
    for rt, ev in zip(exporters, events, strict=True):
        rt.event_destroy(ev)
