"""The host-staged fallback's pool of POSIX shared-memory slots (sync-contract §5).

When no sync mode is valid for a GPU buffer, the producer copies it into a slot, host-waits the
copy, and hands the slot off as a CPU buffer (SYNC_PRODUCER_SYNCED). Slots come in power-of-two
size classes (at least 64 KiB), are page-locked with CUDA when the given device supports it
(cudaDevAttrHostRegisterSupported; the emulation does not), so the copy runs at DMA speed, and go
back to their class when the consumer releases them. Pinning is an optimisation only: if
cudaHostRegister fails, the pool logs it once and goes on with unpinned slots.
"""

from __future__ import annotations

import logging
import os
import threading

from ..devices.base import Buffer
from ..devices.cpu import CpuDevice
from ..devices.cuda import CudaDevice
from ..devices.errors import DeviceError
from ..errors import InvalidArgument

log = logging.getLogger("hurray.staging")

MIN_SLOT = 64 << 10


class StagingExhausted(DeviceError):
    """Every slot is in use and the pool is at its byte limit; wait for a release."""


def size_class(nbytes: int) -> int:
    return max(MIN_SLOT, 1 << max(nbytes - 1, 0).bit_length())


class StagingPool:
    """Host slots for staged handoffs. The producer acquires a slot, copies into it, hands it off,
    and releases it when the consumer released the handoff; ``close`` frees (and unpins) them all.

    ``pin_with``: the CUDA device the slots are copied from; slots are page-locked for it when it
    supports cudaHostRegister (:attr:`pin_with` is None when they are not pinned).
    """

    def __init__(self, cpu: CpuDevice, pin_with: CudaDevice | None = None, max_bytes: int | None = None):
        self.cpu = cpu
        self.pin_with: CudaDevice | None = None
        if pin_with is not None:
            try:
                if pin_with.host_register_supported():
                    self.pin_with = pin_with
            except DeviceError as e:
                log.warning("staging slots stay unpinned: %s", e)
        self._unpin_with = self.pin_with  # stays set when pinning is given up: earlier slots are pinned
        self._pinned: set[int] = set()  # id() of the slots cudaHostRegister accepted
        if max_bytes is None:
            max_bytes = int(os.environ.get("HURRAY_STAGING_BYTES", str(1 << 30)))
        self.max_bytes = max_bytes
        self._free: dict[int, list[Buffer]] = {}
        self._busy: set[int] = set()
        self._all: list[Buffer] = []
        self.total = 0
        self._lock = threading.Lock()

    def acquire(self, nbytes: int) -> Buffer:
        """A slot of at least ``nbytes``; raises StagingExhausted at the byte limit while slots
        are in use (a release frees room), InvalidArgument when no slot of that size can ever fit.
        Idle slots of other sizes are freed to make room before the limit refuses."""
        cls = size_class(nbytes)
        with self._lock:
            free = self._free.setdefault(cls, [])
            if free:
                slot = free.pop()
            else:
                if cls > self.max_bytes:
                    raise InvalidArgument(f"a host-staged copy of {nbytes} bytes needs a {cls}-byte slot; the staging "
                                          f"pool holds at most {self.max_bytes} bytes (HURRAY_STAGING_BYTES)",
                                          where="send()", value=nbytes)
                for other in self._free.values():
                    while other and self.total + cls > self.max_bytes:
                        self._close_slot(other.pop())
                if self.total + cls > self.max_bytes:
                    raise StagingExhausted(
                        "staging", f"pool at its limit ({self.total} of {self.max_bytes} bytes in slots)"
                    )
                slot = self.cpu.allocate(cls)
                self._pin(slot)
                self.total += cls
                self._all.append(slot)
            self._busy.add(id(slot))
            return slot

    def _pin(self, slot: Buffer) -> None:
        if self.pin_with is None:
            return
        try:
            self.pin_with.host_register(slot)
        except DeviceError as e:
            # Likely to fail again (memlock limit, WSL): stop trying, say so once.
            log.warning("staging: %s; going on with unpinned slots (slower copies)", e)
            self.pin_with = None
            return
        self._pinned.add(id(slot))

    def release(self, slot: Buffer) -> None:
        with self._lock:
            if id(slot) not in self._busy:
                raise DeviceError("staging", "slot released twice or not from this pool")
            self._busy.discard(id(slot))
            self._free.setdefault(slot.size, []).append(slot)

    def retire(self, slot: Buffer) -> None:
        """Free a busy slot instead of pooling it: a fenced consumer may still read it (spec §5).
        Its pages live on in that consumer's mapping and are never handed out again."""
        with self._lock:
            if id(slot) not in self._busy:
                raise DeviceError("staging", "slot retired twice or not from this pool")
            self._busy.discard(id(slot))
            self._close_slot(slot)

    @property
    def in_use(self) -> int:
        return len(self._busy)

    def _close_slot(self, slot: Buffer) -> None:
        """Unpin and free one idle slot (under the lock)."""
        if id(slot) in self._pinned and self._unpin_with is not None:
            try:
                self._unpin_with.host_unregister(slot)
            except DeviceError as e:
                log.warning("staging: %s", e)
        self._pinned.discard(id(slot))
        self._all.remove(slot)
        self.total -= slot.size
        slot.close()

    def close(self) -> None:
        with self._lock:
            for slot in list(self._all):
                self._close_slot(slot)
            self._all.clear()
            self._free.clear()
            self._busy.clear()
            self._pinned.clear()
            self.total = 0
