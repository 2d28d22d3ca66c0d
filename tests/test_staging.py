"""The host-staged fallback's slot pool: pinning is an optimisation that may fail without harm."""

from __future__ import annotations

import logging
import os

from conftest import emu_config
from hurray_ipc.devices import CpuDevice, CudaDevice, DeviceError, shm
from hurray_ipc.devices.backend.emulated import EmulatedRuntime
from hurray_ipc.interop.staging import MIN_SLOT, StagingPool


def _device(pinnable: bool, fail: bool = False) -> tuple[CudaDevice, list[str]]:
    rt = EmulatedRuntime(emu_config())
    calls: list[str] = []
    if pinnable:
        rt.host_register_support = lambda ordinal: True  # as cudaDevAttrHostRegisterSupported=1 reports

    def register(ptr: int, nbytes: int) -> None:
        calls.append("register")
        if fail:
            raise DeviceError("cudaHostRegister", "CUDA call failed", code="cudaErrorNotSupported")

    rt.host_register = register
    rt.host_unregister = lambda ptr: calls.append("unregister")
    return CudaDevice(0, runtime=rt), calls


def _segments() -> set[str]:
    return set(shm.list_segments(pid=os.getpid()))


def test_failed_host_register_logs_once_and_goes_on_unpinned(caplog):
    dev, calls = _device(pinnable=True, fail=True)
    before = _segments()
    pool = StagingPool(CpuDevice(), pin_with=dev)
    assert pool.pin_with is dev
    with caplog.at_level(logging.WARNING, logger="hurray.staging"):
        a = pool.acquire(100)  # must not raise: the slot is usable unpinned
        b = pool.acquire(100)
    assert pool.in_use == 2 and pool.total == 2 * MIN_SLOT, "both slots are in the pool, none leaked"
    assert calls == ["register"], "pinning is given up after the first failure"
    assert pool.pin_with is None
    assert len([r for r in caplog.records if "cudaHostRegister" in r.getMessage()]) == 1
    pool.release(a), pool.release(b)
    pool.close()
    assert calls == ["register"], "nothing to unregister"
    assert _segments() <= before, "every slot freed"


def test_slots_are_pinned_where_supported_and_unpinned_on_close():
    dev, calls = _device(pinnable=True)
    pool = StagingPool(CpuDevice(), pin_with=dev)
    pool.release(pool.acquire(100))
    pool.release(pool.acquire(100))  # the same slot again: pinned once
    pool.close()
    assert calls == ["register", "unregister"]


def test_the_emulation_does_not_pin_by_default():
    dev, calls = _device(pinnable=False)
    pool = StagingPool(CpuDevice(), pin_with=dev)
    assert pool.pin_with is None
    pool.release(pool.acquire(100))
    pool.close()
    assert calls == []
