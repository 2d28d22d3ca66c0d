"""Reusable device resources: one free list for events, staging slots and destination buffers.

Creating a CUDA event, a page-locked shared-memory slot or a (registered) destination buffer costs
a driver call, page faults, a registration; reusing one costs nothing. Every such pool in the
package is a :class:`Pool`: resources are taken by key (a size class, a kind of event), given back
when their last user let go, kept idle up to ``keep`` per key, destroyed beyond that, on
:meth:`Pool.discard` and on :meth:`Pool.close`. What *when* means (a consumer's RELEASED, an
EVENT_RELEASED, a fence that completed) is the owner's contract, stated where it gives back.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Hashable
from typing import Generic, TypeVar

from .errors import DeviceError

__all__ = ["Pool"]

log = logging.getLogger("hurray.devices")

K = TypeVar("K", bound=Hashable)
T = TypeVar("T")


class Pool(Generic[K, T]):
    """Resources of type ``T`` by key ``K``. ``make(key)`` creates one, ``destroy(item)`` frees
    it, ``key_of(item)`` tells which key an item given back belongs to. ``keep``: idle items kept
    per key (None: all; 0: none, every give destroys). ``what`` names the pool in errors.

    Thread-safe; ``make`` and ``destroy`` run under the pool's lock, so a destroyed resource is
    gone before the same key can be made again. Giving back or discarding an item that is not out
    of this pool (twice, or a stranger) raises DeviceError instead of corrupting the free list.
    """

    def __init__(self, make: Callable[[K], T], destroy: Callable[[T], None], key_of: Callable[[T], K], *,
                 keep: int | None = None, what: str = "pool"):
        self._make, self._destroy, self._key_of = make, destroy, key_of
        self.keep = keep
        self.what = what
        self.made = 0  # resources created so far
        self._idle: dict[K, list[T]] = {}
        self._out: dict[int, T] = {}  # id() -> item, for every item taken and not yet back
        self._lock = threading.RLock()

    def take(self, key: K) -> T:
        """An idle item of ``key``, or a new one (``make`` may raise: nothing is then taken)."""
        with self._lock:
            idle = self._idle.get(key)
            if idle:
                item = idle.pop()
            else:
                item = self._make(key)
                self.made += 1
            self._out[id(item)] = item
            return item

    def give(self, item: T) -> None:
        """``item`` is no one's any more: idle for a later :meth:`take`, or destroyed beyond ``keep``."""
        with self._lock:
            self._taken_back(item, "given back")
            idle = self._idle.setdefault(self._key_of(item), [])
            if self.keep is None or len(idle) < self.keep:
                idle.append(item)
                return
            self._destroy(item)

    def discard(self, item: T) -> None:
        """Destroy ``item`` instead of keeping it (it must never be handed out again)."""
        with self._lock:
            self._taken_back(item, "discarded")
            self._destroy(item)

    def _taken_back(self, item: T, how: str) -> None:
        if self._out.pop(id(item), None) is None:
            raise DeviceError(self.what, f"an item {how} twice, or not from this pool")

    def trim(self, enough: Callable[[], bool], *, spare: K | None = None) -> None:
        """Destroy idle items (any key but ``spare``) until ``enough()`` holds or none is left."""
        with self._lock:
            for key, idle in self._idle.items():
                while idle and key != spare and not enough():
                    self._destroy_logged(idle.pop())

    def drop_idle(self, key: K) -> int:
        """Destroy every idle item of ``key`` (items out stay out); returns how many went."""
        with self._lock:
            idle = self._idle.pop(key, [])
            for item in idle:
                self._destroy_logged(item)
            return len(idle)

    def _destroy_logged(self, item: T) -> None:
        """Destroy ``item``; one that fails is logged and forgotten, and the others still go."""
        try:
            self._destroy(item)
        except Exception:  # noqa: BLE001 - one resource that will not close must not keep the rest
            log.exception("%s: destroying an item failed", self.what)

    def items(self) -> list[T]:
        """Every item alive: idle and out."""
        with self._lock:
            return [i for idle in self._idle.values() for i in idle] + list(self._out.values())

    @property
    def out(self) -> int:
        """Items taken and not yet given back or discarded."""
        return len(self._out)

    @property
    def idle(self) -> int:
        with self._lock:
            return sum(len(v) for v in self._idle.values())

    def close(self, *, taken_too: bool = True) -> None:
        """Destroy every idle item and (``taken_too``) every item still out; the pool stays usable."""
        with self._lock:
            items = [i for idle in self._idle.values() for i in idle]
            if taken_too:
                items += self._out.values()
                self._out.clear()
            self._idle.clear()
            for item in items:
                self._destroy_logged(item)
