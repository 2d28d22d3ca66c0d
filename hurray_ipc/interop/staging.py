"""The producer's pool of POSIX shared-memory slots: every copy the library makes to share bytes.

Two uses, one pool (one byte limit, one set of idle slots, one release and retire rule):

- the host-staged fallback (sync-contract §5): when no sync mode is valid for a GPU buffer, the
  producer copies it into a slot, host-waits the copy, and hands the slot off as a CPU buffer
  (SYNC_PRODUCER_SYNCED);
- host bytes not already in shared memory (``send(numpy_array)``, bytes, a torch CPU tensor): one
  memcpy into a slot, handed off as the slot's first ``nbytes`` (interop/source.py).

Slots come in power-of-two size classes (at least 64 KiB), so a steady stream of arrays of one
size class reuses the same few slots: no segment is created or unlinked per send, and a consumer
maps each slot once (its import cache is keyed by segment). A slot goes back to its class only
when the consumer released its handoff; one a fenced consumer may still read is retired (freed,
never handed out again). Idle slots are kept for reuse (as many per class as were ever in use at
once), freed when a slot of another class needs their room under the byte limit, freed when their
class was not asked for during ``HURRAY_STAGING_IDLE_S`` seconds (30; checked when a slot is
taken), and all freed at close. Slots are page-locked with CUDA when the given device supports it
(cudaDevAttrHostRegisterSupported; the emulation does not), so a staged copy runs at DMA speed.
Pinning is an optimisation only: if cudaHostRegister fails, the pool logs it once and goes on with
unpinned slots.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable

from ..devices.base import Buffer
from ..devices.cpu import CpuDevice
from ..devices.cuda import CudaDevice
from ..devices.errors import DeviceError
from ..devices.pool import Pool
from ..errors import InvalidArgument
from ..units import parse_bytes

log = logging.getLogger("hurray.staging")

MIN_SLOT = 64 << 10


class StagingExhausted(DeviceError):
    """Every slot is in use and the pool is at its byte limit; wait for a release."""


def _env_bytes(name: str, default: int) -> int:
    """A byte count from the environment variable ``name`` (:func:`units.parse_bytes`: 1073741824,
    1G, 512M); InvalidArgument naming the variable otherwise."""
    raw = os.environ.get(name)
    if raw is None:
        return default
    try:
        return parse_bytes(raw)
    except ValueError as e:
        raise InvalidArgument(str(e), where=name) from None


def size_class(nbytes: int) -> int:
    return max(MIN_SLOT, 1 << max(nbytes - 1, 0).bit_length())


class StagingPool:
    """Host slots for staged handoffs and host copies. The producer acquires a slot, copies into
    it, hands it off, and releases it when the consumer released the handoff (or retires it when a
    fenced consumer may still read it); ``close`` frees (and unpins) them all.

    ``pin_with``: the CUDA device the slots are copied from; slots are page-locked for it when it
    supports cudaHostRegister (:attr:`pin_with` is None when they are not pinned).
    """

    def __init__(self, cpu: CpuDevice, pin_with: CudaDevice | None = None, max_bytes: int | None = None,
                 idle_s: float | None = None, clock: Callable[[], float] = time.monotonic):
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
            max_bytes = _env_bytes("HURRAY_STAGING_BYTES", 1 << 30)
        self.max_bytes = max_bytes
        if idle_s is None:
            raw = os.environ.get("HURRAY_STAGING_IDLE_S", "30")
            try:
                idle_s = float(raw)
            except ValueError:
                idle_s = -1.0
            if not idle_s >= 0:  # also NaN
                raise InvalidArgument("expected seconds >= 0", where="HURRAY_STAGING_IDLE_S", value=raw)
        self.idle_s = idle_s
        self._clock = clock
        self._asked: dict[int, float] = {}  # size class -> when a slot of it was last asked for
        self._swept = clock()
        self.total = 0  # bytes in slots, idle or in use
        self._slots: Pool[int, Buffer] = Pool(self._new_slot, self._close_slot, lambda slot: slot.size,
                                              what="staging")

    def acquire(self, nbytes: int) -> Buffer:
        """A slot of at least ``nbytes``; raises StagingExhausted at the byte limit while slots
        are in use (a release frees room), InvalidArgument when no slot of that size can ever fit.
        Idle slots of other sizes are freed to make room before the limit refuses."""
        cls = size_class(nbytes)
        if cls > self.max_bytes:
            raise InvalidArgument(f"a copy of {nbytes} bytes into shared memory needs a {cls}-byte slot; the "
                                  f"producer's staging pool holds at most {self.max_bytes} bytes "
                                  "(HURRAY_STAGING_BYTES): raise it (a host array may instead be written into a "
                                  "buffer from Producer.allocate(), which travels without a copy)", where="send()",
                                  value=nbytes)
        now = self._clock()
        self._asked[cls] = now
        if now - self._swept >= self.idle_s:
            self._sweep(now)
        return self._slots.take(cls)

    def _sweep(self, now: float) -> None:
        """Free the idle slots of every class not asked for during ``idle_s``: a size the
        producer stopped sending holds no shared memory for long."""
        self._swept = now
        for cls, asked in list(self._asked.items()):
            if now - asked >= self.idle_s:
                self._asked.pop(cls, None)
                self._slots.drop_idle(cls)

    def _new_slot(self, cls: int) -> Buffer:
        """A new slot of ``cls`` bytes (under the pool's lock), once idle ones made room."""
        self._slots.trim(lambda: self.total + cls <= self.max_bytes, spare=cls)
        if self.total + cls > self.max_bytes:
            raise StagingExhausted("staging", f"pool at its limit ({self.total} of {self.max_bytes} bytes in slots)")
        slot = self.cpu.allocate(cls)
        self._pin(slot)
        self.total += cls
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
        """``slot``'s handoff was released by its consumer: idle for the next staged copy."""
        self._slots.give(slot)

    def retire(self, slot: Buffer) -> None:
        """Free a busy slot instead of pooling it: a fenced consumer may still read it (spec §5).
        Its pages live on in that consumer's mapping and are never handed out again."""
        self._slots.discard(slot)

    @property
    def in_use(self) -> int:
        return self._slots.out

    def slots(self) -> list[Buffer]:
        """Every slot alive, idle or in use."""
        return self._slots.items()

    def _close_slot(self, slot: Buffer) -> None:
        """Unpin and free one slot (under the pool's lock)."""
        if id(slot) in self._pinned and self._unpin_with is not None:
            try:
                self._unpin_with.host_unregister(slot)
            except DeviceError as e:
                log.warning("staging: %s", e)
        self._pinned.discard(id(slot))
        self.total -= slot.size
        slot.close()

    def close(self) -> None:
        """Free every slot, in use or not (the producer closes: its handoffs are over)."""
        self._slots.close()
