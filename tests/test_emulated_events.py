"""The emulation's event locking: a cross-process flock only where another process can reach the event.

A non-interprocess event has no IPC handle, so no other process maps its state: its record,
completion and queries exclude threads only (no flock syscalls on the consumer's fence path). An
interprocess event is recorded, waited on and destroyed from several processes, so every update of
its shared state still takes the flock (test_races and test_fencing keep the verdicts).
"""

from __future__ import annotations

import fcntl

import pytest

from hurray_ipc.devices.backend import emulated
from hurray_ipc.devices.backend.emulated import EmulatedRuntime
from tests.conftest import emu_config


@pytest.fixture
def flocks(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Every fcntl.flock the emulation makes, by operation."""
    calls: list[int] = []
    real = fcntl.flock

    def counting(fd: int, op: int) -> None:
        calls.append(op)
        real(fd, op)

    monkeypatch.setattr(emulated.fcntl, "flock", counting)
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
