"""NIXL data plane of the cross-machine bridge (docs/spec/interchange.md, "RDMA data plane (NIXL)").

A small engine over one NIXL agent (UCX backend). One concept per class, every lifetime explicit:

* :class:`RdmaEngine` owns the agent. ``close()`` (or leaving the ``with`` block) cancels and releases
  every open transfer, deregisters every region it registered and removes every remote agent it added.
* :class:`Registration` is one registered memory region: a host pointer ("DRAM") or a device pointer
  ("VRAM" + device id). The engine caches registrations per (ptr, size, kind, device) with a
  reference count; :meth:`RdmaEngine.release` drops one reference and deregisters at zero.
* Receiver (host B): :meth:`RdmaEngine.expose` turns a registration into an *offer*: a JSON-able header
  (agent name, memory kind, the descriptor) plus one raw frame, the agent's partial NIXL metadata for
  that region only (so the sender can reach the offered region and nothing else B registered).
* Sender (host A): :meth:`RdmaEngine.write` loads the offer's metadata (once per distinct metadata) and
  posts a NIXL WRITE of a local registration into the offered region: a :class:`Transfer`, which is
  polled (:meth:`Transfer.poll`), waited on with a deadline (:meth:`Transfer.wait`) and released.

Descriptors travel as JSON integers, never pickled: NIXL's own ``get_serialized_descs`` /
``deserialize_descs`` are ``pickle``, and unpickling what a peer sent runs the peer's code.

Ordering (sync-contract §6): the caller retires its writes to the source before :meth:`RdmaEngine.write`;
:meth:`Transfer.wait` returning is the sender observing the completion (NIXL state DONE), which must
happen before TENSOR_DATA_END is sent. An engine is safe to share between threads (one lock around
the agent) but is meant for one bridge thread.
"""

from __future__ import annotations

import hashlib
import importlib
import logging
import os
import sys
import threading
import time
import uuid
from dataclasses import dataclass
from functools import lru_cache
from types import ModuleType
from typing import Any

import numpy as np

from hurray_ipc.wire.fields import FieldError, check, obj, one_of, take

KINDS = ("DRAM", "VRAM")
BACKEND = "UCX"
OFFER_VERSION = 1
MAX_METADATA = 1 << 20  # bytes of agent metadata accepted in an offer
POLL_MIN_S = 20e-6  # first backoff step of a wait; doubles up to POLL_MAX_S
POLL_MAX_S = 1e-3
DEFAULT_TIMEOUT_S = 30.0


class RdmaError(RuntimeError):
    """A NIXL call failed or a transfer ended in a state other than DONE (the message names it)."""


class RdmaTimeout(RdmaError):
    """A transfer was still in flight (NIXL state PROC) at its deadline."""


class BadOffer(RdmaError):
    """A receiver's offer (RDMA_REGISTER, interchange.md) is malformed or does not fit the
    transfer: the link's fault, answered ``bad_offer``, never NIXL's."""


def _import_nixl() -> ModuleType:
    """The NIXL Python API: the ``nixl-cu12`` wheel installs it as ``nixl_cu12``; the ``nixl`` meta
    package as ``nixl``. Returned as a plain module: NIXL's types are not ours to check."""
    errors = []
    for name in ("nixl_cu12", "nixl._api", "nixl"):
        try:
            mod = importlib.import_module(name)
        except ImportError as e:
            errors.append(f"{name}: {e}")
            continue
        if hasattr(mod, "nixl_agent"):
            _quiet_nixl_logging()
            return mod
        errors.append(f"{name}: no nixl_agent")
    raise ImportError("NIXL is not installed (pip install --no-deps nixl-cu12): " + "; ".join(errors))


def _quiet_nixl_logging() -> None:
    """NIXL's Python logger prints INFO lines (one per agent) on stdout, which is a CLI's output: keep
    warnings and errors only, on stderr. NIXL_LOG_LEVEL, when set, still decides the level."""
    logger = logging.getLogger("nixl")
    if not os.environ.get("NIXL_LOG_LEVEL"):
        logger.setLevel(logging.WARNING)
    for h in logger.handlers:
        if isinstance(h, logging.StreamHandler) and h.stream is sys.stdout:
            h.setStream(sys.stderr)


@dataclass(frozen=True)
class NixlInfo:
    """What this machine's NIXL offers: every plugin, and the memory kinds its UCX backend takes."""

    plugins: tuple[str, ...]
    ucx_mem_types: tuple[str, ...]

    @property
    def gpudirect(self) -> bool:
        """The UCX backend accepts VRAM (device) regions: built with CUDA support. Whether a NIC can
        DMA into this GPU (GPUDirect RDMA) depends on the machine; without it UCX stages through host."""
        return "VRAM_SEG" in self.ucx_mem_types


@lru_cache(maxsize=1)
def _probe() -> tuple[NixlInfo | None, str | None]:
    try:
        nixl = _import_nixl()
    except ImportError as e:
        return None, str(e)
    name = f"hurray-probe-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        agent = nixl.nixl_agent(name, nixl.nixl_agent_config(backends=[BACKEND]))
    except Exception as e:  # noqa: BLE001 - the reason is returned, not swallowed
        return None, f"NIXL agent could not start: {type(e).__name__}: {e}"
    plugins = tuple(agent.get_plugin_list())
    if BACKEND not in plugins:
        return None, f"NIXL has no {BACKEND} plugin (plugins: {', '.join(plugins) or 'none'})"
    if BACKEND not in agent.backends:
        return None, f"NIXL's {BACKEND} backend did not start"
    return NixlInfo(plugins, tuple(agent.get_backend_mem_types(BACKEND))), None


def nixl_available() -> str | None:
    """None when NIXL with a working UCX backend is usable here, else the reason it is not."""
    return _probe()[1]


def nixl_info() -> NixlInfo:
    """Plugins and UCX memory kinds (``.gpudirect``); raises :class:`RdmaError` when NIXL is unusable."""
    info, reason = _probe()
    if info is None:
        raise RdmaError(reason or "NIXL unusable")
    return info


def _nixl_error(what: str, e: BaseException) -> RdmaError:
    # NIXL's binding exceptions carry the status name (NIXL_ERR_NOT_FOUND, NIXL_ERR_REMOTE_DISCONNECT...).
    return RdmaError(f"{what}: {type(e).__name__}: {e}")


class Registration:
    """One region registered with an engine's agent. Made by :meth:`RdmaEngine.register`; ended by
    :meth:`RdmaEngine.release` (one call per register call: registrations are reference-counted)."""

    def __init__(self, ptr: int, size: int, kind: str, device: int, descs: Any, owner: Any) -> None:
        self.ptr, self.size, self.kind, self.device = ptr, size, kind, device
        self._descs = descs  # the nixlRegDList handed to deregister_memory
        self._owner = owner  # keeps the buffer alive (numpy array, ...) while registered
        self.refs = 1
        self.released = False

    @property
    def key(self) -> tuple[int, int, str, int]:
        return (self.ptr, self.size, self.kind, self.device)

    def descriptor(self) -> list[int]:
        """[address, length, device id]: the transfer descriptor of the whole region."""
        return [self.ptr, self.size, self.device]

    def __repr__(self) -> str:
        state = "released" if self.released else f"refs={self.refs}"
        return f"Registration({self.kind} 0x{self.ptr:x}+{self.size} dev {self.device}, {state})"


def _serdes_str(md: bytes, at: int, tag: bytes) -> tuple[bytes, int]:
    """One ``tag``, 8-byte little-endian length, value entry of NIXL's serialisation (nixlSerDes)
    at ``at``: the value and where the next entry starts; RdmaError if it is not there whole."""
    if md[at:at + len(tag)] != tag:
        raise BadOffer(f"bad offer: metadata lacks {tag.decode()!r} at byte {at}")
    at += len(tag)
    if at + 8 > len(md):
        raise BadOffer(f"bad offer: metadata ends inside the length of {tag.decode()!r}")
    n = int.from_bytes(md[at:at + 8], "little")
    at += 8
    if n > len(md) - at:
        raise BadOffer(f"bad offer: metadata entry {tag.decode()!r} of {n} bytes runs past its end")
    return md[at:at + n], at + n


MAX_CONNS = 16  # backends one agent's metadata may list


def check_metadata(md: bytes, agent: str) -> None:
    """Check the head of an offer's NIXL metadata before NIXL parses it: its agent name, and for
    each backend connection entry that the UCX worker address names a UCX address version this
    UCX knows (V1 or V2, the low 4 bits of its first byte). UCX asserts on any other version and
    aborts the whole process (red team item 1: one RDMA_REGISTER killed an exporting broker).
    This is a check of the entries a malformed offer was seen to crash NIXL with, not a proof
    that NIXL cannot crash on the rest (the memory section, the address's inner fields)."""
    at = len(_SERDES_MAGIC)
    if md[:at] != _SERDES_MAGIC:
        raise BadOffer("bad offer: metadata is not NIXL's serialisation (no 'nixlSerDes' header)")
    name, at = _serdes_str(md, at, b"|Agent")
    if name != agent.encode():
        raise BadOffer(f"bad offer: offer names agent {agent} but its metadata is agent "
                        f"{name[:64].decode(errors='replace')}")
    raw, at = _serdes_str(md, at, b"|Conns")
    conns = int.from_bytes(raw, "little") if len(raw) == 8 else -1
    if not 0 < conns <= MAX_CONNS:
        raise BadOffer(f"bad offer: metadata lists {conns} backend connections (1..{MAX_CONNS})")
    for _ in range(conns):
        backend, at = _serdes_str(md, at, b"|t")
        address, at = _serdes_str(md, at, b"|c")
        if backend == BACKEND.encode():
            if not address:
                raise BadOffer("bad offer: empty UCX worker address")
            version = address[0] & 0x0F
            if version not in _UCX_ADDRESS_VERSIONS:
                raise BadOffer(f"bad offer: UCX worker address version {version} (byte 0x{address[0]:02x}); "
                                f"this UCX reads versions {sorted(_UCX_ADDRESS_VERSIONS)}")


_SERDES_MAGIC = b"nixlSerDes"
_UCX_ADDRESS_VERSIONS = frozenset({0, 1})  # UCP_OBJECT_VERSION_V1, _V2 (ucp_address.c)


@dataclass(frozen=True)
class Offer:
    """A receiver's destination region as the sender sees it (RDMA_REGISTER's content)."""

    agent: str
    kind: str
    descs: tuple[tuple[int, int, int], ...]
    metadata: bytes

    @property
    def size(self) -> int:
        return sum(d[1] for d in self.descs)

    def to_wire(self) -> dict[str, Any]:
        header = {"version": OFFER_VERSION, "agent": self.agent, "mem": self.kind,
                  "descs": [list(d) for d in self.descs], "size": self.size}
        return {"header": header, "frames": [self.metadata]}

    @classmethod
    def from_wire(cls, wire: dict[str, Any]) -> Offer:
        """Validate an offer received from a peer: every field, type and bound; BadOffer if bad."""
        try:
            o = obj(wire, "offer")
            header = obj(take(o, "offer.header", dict), "offer.header")
            frames = take(o, "offer.frames", (list, tuple))
            if len(frames) != 1:
                raise FieldError("offer.frames", f"must be exactly [metadata], got {len(frames)} frames")
            one_of(header.get("version"), "version", (OFFER_VERSION,))
            agent = take(header, "agent", str, min_len=1, max_len=256)
            kind = one_of(header.get("mem"), "mem", KINDS)
            raw = take(header, "descs", list, min_len=1, max_len=1)
            descs = []
            for i, d in enumerate(raw):
                where = f"descs.{i}"
                check(d, where, list, min_len=3, max_len=3)
                descs.append((check(d[0], f"{where}.address", int, lo=1, hi=(1 << 64) - 1),
                              check(d[1], f"{where}.length", int, lo=1, hi=(1 << 48) - 1),
                              check(d[2], f"{where}.device", int, lo=0, hi=(1 << 16) - 1)))
            metadata = check(frames[0], "metadata", (bytes, bytearray, memoryview))
            if not 0 < len(metadata) <= MAX_METADATA:
                raise FieldError("metadata", f"must be 1..{MAX_METADATA} bytes, got {len(metadata)}")
            size = header.get("size")
        except FieldError as e:
            raise BadOffer(f"bad offer: {e}") from None
        offer = cls(agent, kind, tuple(descs), bytes(metadata))
        if size != offer.size:
            raise BadOffer(f"bad offer: 'size' {size!r} is not the descriptors' total {offer.size}")
        check_metadata(offer.metadata, agent)
        return offer


class Transfer:
    """One posted NIXL WRITE. Poll or wait until DONE, then :meth:`release` (also on error)."""

    def __init__(self, engine: RdmaEngine, handle: Any, peer: str, nbytes: int, state: str) -> None:
        self._engine, self._handle, self.peer, self.nbytes = engine, handle, peer, nbytes
        self.state = state  # NIXL's last word: "PROC" or "DONE" ("ERR" raises)
        self.released = False

    def poll(self) -> bool:
        """True once NIXL reports DONE; False while PROC; RdmaError on ERR or any other state."""
        if self.state == "DONE":
            return True
        if self.released:
            raise RdmaError(f"transfer to {self.peer} was released before it completed")
        self.state = self._engine._check(self._handle, self.peer)
        return self.state == "DONE"

    def wait(self, timeout: float = DEFAULT_TIMEOUT_S) -> None:
        """Return once DONE (the sender has observed the completion); RdmaTimeout at the deadline.
        Polls with a backoff from 20 us to 1 ms: no busy spin."""
        deadline = time.monotonic() + timeout
        delay = POLL_MIN_S
        while not self.poll():
            left = deadline - time.monotonic()
            if left <= 0:
                raise RdmaTimeout(f"transfer of {self.nbytes} bytes to {self.peer}: NIXL state {self.state} "
                                  f"after {timeout:g} s")
            time.sleep(min(delay, left))
            delay = min(delay * 2, POLL_MAX_S)

    def release(self) -> None:
        """Free the NIXL request; an in-flight one is cancelled by NIXL (RdmaError if it refuses).
        Idempotent."""
        if not self.released:
            self._engine._release_transfer(self)

    def __enter__(self) -> Transfer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def __repr__(self) -> str:
        return f"Transfer({self.nbytes} B -> {self.peer}, {self.state}{', released' if self.released else ''})"


class RdmaEngine:
    """One NIXL agent with the UCX backend. ``name`` is a prefix: the agent's name (``.name``) gets a
    random suffix, so two bridges never collide in a peer's table of remote agents.

    ``progress_thread``: NIXL's own progress thread, which polls UCX without pause (a whole core
    per agent, idle or not, measured). Without it (what the bridges use), UCX makes progress only
    inside calls into this engine: a sender's :meth:`Transfer.poll` / :meth:`Transfer.wait`, and a
    receiver's :meth:`progress`, which it MUST call every millisecond or so while it has a region
    offered (some UCX transports, TCP among them, need the target to progress for a WRITE to land)."""

    def __init__(self, name: str = "hurray", *, progress_thread: bool = True) -> None:
        reason = nixl_available()
        if reason is not None:
            raise RdmaError(reason)
        self._nixl = _import_nixl()
        self.name = f"{name}-{uuid.uuid4().hex[:12]}"
        self._lock = threading.RLock()
        try:
            config = self._nixl.nixl_agent_config(enable_prog_thread=progress_thread, backends=[BACKEND])
            self._agent = self._nixl.nixl_agent(self.name, config)
        except Exception as e:  # noqa: BLE001 - re-raised as RdmaError
            raise _nixl_error(f"NIXL agent {self.name} did not start", e) from e
        if BACKEND not in self._agent.backends:
            raise RdmaError(f"NIXL agent {self.name}: {BACKEND} backend did not start")
        self._regs: dict[tuple[int, int, str, int], Registration] = {}
        self.registered_total = 0  # regions registered with NIXL so far (cache hits not counted)
        self._remotes: dict[str, set[bytes]] = {}  # agent name -> digests of the metadata loaded
        self._transfers: set[Transfer] = set()
        self.closed = False

    # -- lifetime ---------------------------------------------------------------------------------------

    def __enter__(self) -> RdmaEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Release every transfer, registration and remote agent; the first failure is raised after
        everything else was attempted. Idempotent."""
        with self._lock:
            if self.closed:
                return
            self.closed = True
            errors: list[RdmaError] = []
            for t in list(self._transfers):
                try:
                    self._release_transfer(t)
                except RdmaError as e:
                    errors.append(e)
            for reg in list(self._regs.values()):
                reg.refs = 1
                try:
                    self._deregister(reg)
                except RdmaError as e:
                    errors.append(e)
            for agent in list(self._remotes):
                try:
                    self._forget(agent)
                except RdmaError as e:
                    errors.append(e)
            # Drop the agent: its UCX worker goes with it and peers are disconnected. They learn of
            # it asynchronously, so this is no fence against a write racing the close (spec R4.4).
            self._agent = None
            if errors:
                raise errors[0]

    def _live(self) -> None:
        if self.closed:
            raise RdmaError(f"engine {self.name} is closed")

    @property
    def registrations(self) -> list[Registration]:
        """The regions registered now (a copy)."""
        with self._lock:
            return list(self._regs.values())

    @property
    def remote_agents(self) -> list[str]:
        with self._lock:
            return list(self._remotes)

    @property
    def open_transfers(self) -> int:
        with self._lock:
            return len(self._transfers)

    # -- memory -----------------------------------------------------------------------------------------

    def register(self, ptr: int, size: int, kind: str = "DRAM", device: int = 0, *, owner: Any = None
                 ) -> Registration:
        """Register [ptr, ptr+size) of host ("DRAM") or device ``device`` ("VRAM") memory. A region
        already registered with the same (ptr, size, kind, device) is returned with one more
        reference (a cache hit). ``owner`` is kept alive until the registration is released."""
        if kind not in KINDS:
            raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
        if ptr <= 0 or size <= 0 or device < 0:
            raise ValueError(f"bad region: ptr 0x{ptr:x}, size {size}, device {device}")
        if kind == "VRAM" and not nixl_info().gpudirect:
            raise RdmaError(f"NIXL's {BACKEND} backend here does not take VRAM regions")
        with self._lock:
            self._live()
            key = (ptr, size, kind, device)
            reg = self._regs.get(key)
            if reg is not None:
                reg.refs += 1
                return reg
            try:
                descs = self._agent.register_memory([(ptr, size, device, "")], kind, backends=[BACKEND])
            except Exception as e:  # noqa: BLE001 - re-raised as RdmaError
                raise _nixl_error(f"register {kind} 0x{ptr:x}+{size}", e) from e
            if descs is None:
                raise RdmaError(f"register {kind} 0x{ptr:x}+{size}: NIXL built no descriptor list")
            reg = self._regs[key] = Registration(ptr, size, kind, device, descs, owner)
            self.registered_total += 1
            return reg

    def register_array(self, arr: np.ndarray) -> Registration:
        """Register a C-contiguous host numpy array (kept alive while registered)."""
        if not arr.flags.c_contiguous or arr.nbytes == 0:
            raise ValueError("register_array needs a non-empty C-contiguous array")
        return self.register(int(arr.ctypes.data), int(arr.nbytes), "DRAM", 0, owner=arr)

    def release(self, reg: Registration) -> None:
        """Drop one reference; the region is deregistered with NIXL when none is left."""
        with self._lock:
            if reg.released or self._regs.get(reg.key) is not reg:
                raise RdmaError(f"{reg!r} is not registered with engine {self.name}")
            reg.refs -= 1
            if reg.refs == 0:
                self._deregister(reg)

    def _deregister(self, reg: Registration) -> None:
        del self._regs[reg.key]
        reg.released, reg.refs = True, 0
        try:
            self._agent.deregister_memory(reg._descs, backends=[BACKEND])
        except Exception as e:  # noqa: BLE001 - re-raised as RdmaError
            raise _nixl_error(f"deregister {reg!r}", e) from e
        finally:
            reg._owner = None

    # -- receiver ---------------------------------------------------------------------------------------

    def expose(self, reg: Registration) -> dict[str, Any]:
        """The offer for ``reg`` (RDMA_REGISTER's content): ``{"header": {...JSON...}, "frames":
        [metadata]}``. The metadata is partial: it lets the peer reach this region only."""
        with self._lock:
            self._live()
            if reg.released or self._regs.get(reg.key) is not reg:
                raise RdmaError(f"{reg!r} is not registered with engine {self.name}")
            try:
                md = self._agent.get_partial_agent_metadata(reg._descs, True, [BACKEND])
            except Exception as e:  # noqa: BLE001 - re-raised as RdmaError
                raise _nixl_error(f"metadata of {reg!r}", e) from e
        return Offer(self.name, reg.kind, ((reg.ptr, reg.size, reg.device),), bytes(md)).to_wire()

    def progress(self) -> int:
        """Let UCX make progress (see the class notes) and drop the notifications it delivered; how many."""
        return sum(len(v) for v in self.notifications().values())

    def notifications(self) -> dict[str, list[bytes]]:
        """Notifications NIXL delivered since the last call: {sender agent: [notif, ...]}. Not an
        ordering signal for the bridge (TENSOR_DATA_END is); useful for tests and diagnostics."""
        with self._lock:
            self._live()
            try:
                got = self._agent.get_new_notifs()
            except Exception as e:  # noqa: BLE001 - re-raised as RdmaError
                raise _nixl_error("get_new_notifs", e) from e
        return {(k.decode() if isinstance(k, bytes) else str(k)): list(v) for k, v in got.items()}

    # -- sender -----------------------------------------------------------------------------------------

    def _connect(self, offer: Offer) -> None:
        digest = hashlib.sha256(offer.metadata).digest()
        loaded = self._remotes.get(offer.agent)
        if loaded is not None and digest in loaded:
            return
        try:
            name = self._agent.add_remote_agent(offer.metadata)
        except Exception as e:  # noqa: BLE001 - re-raised as RdmaError
            raise _nixl_error(f"load metadata of agent {offer.agent}", e) from e
        name = name.decode() if isinstance(name, bytes) else str(name)
        if name != offer.agent:
            # Loaded under another name than the offer claims: undo, refuse.
            try:
                self._agent.remove_remote_agent(name)
            except Exception as e:  # noqa: BLE001 - re-raised as RdmaError
                raise _nixl_error(f"offer names agent {offer.agent} but its metadata is {name}", e) from e
            raise RdmaError(f"offer names agent {offer.agent} but its metadata is agent {name}")
        self._remotes.setdefault(name, set()).add(digest)

    def write(self, local: Registration, offer: dict[str, Any] | Offer, notif: bytes = b"", *,
              offset: int = 0, part: tuple[int, int] | None = None) -> Transfer:
        """Post a NIXL WRITE of all of ``local`` to ``offset`` bytes into the offered region; with
        ``part`` = (start, length), of those bytes of ``local`` only, to ``offset + start``. The
        caller MUST have retired its writes to ``local`` (sync-contract §6). ``notif`` reaches the peer's
        agent with the data. Returns the posted :class:`Transfer`; RdmaError names NIXL's state or
        error. On UCX's shared-memory transports the post itself copies: it returns after
        about ``length`` bytes' worth of memcpy."""
        o = offer if isinstance(offer, Offer) else Offer.from_wire(offer)
        start, n = part if part is not None else (0, local.size)
        if start < 0 or n <= 0 or start + n > local.size:
            raise RdmaError(f"part [{start}, +{n}) is outside the {local.size} registered bytes")
        if offset < 0 or offset + start + n > o.size:
            raise RdmaError(f"write of {n} bytes at offset {offset + start} does not fit the offered {o.size}")
        with self._lock:
            self._live()
            if local.released or self._regs.get(local.key) is not local:
                raise RdmaError(f"{local!r} is not registered with engine {self.name}")
            self._connect(o)
            dst_addr, _, dst_dev = o.descs[0]
            try:
                src = self._agent.get_xfer_descs([(local.ptr + start, n, local.device)], local.kind)
                dst = self._agent.get_xfer_descs([(dst_addr + offset + start, n, dst_dev)], o.kind)
                if src is None or dst is None:
                    raise RdmaError(f"write to {o.agent}: NIXL built no transfer descriptor list")
                handle = self._agent.initialize_xfer("WRITE", src, dst, o.agent, bytes(notif), [BACKEND])
            except RdmaError:
                raise
            except Exception as e:  # noqa: BLE001 - re-raised as RdmaError
                raise _nixl_error(f"prepare WRITE of {n} bytes to {o.agent}", e) from e
            transfer = Transfer(self, handle, o.agent, n, "PROC")
            self._transfers.add(transfer)
            try:
                state = self._agent.transfer(handle)
            except Exception as e:  # noqa: BLE001 - re-raised as RdmaError
                self._release_transfer(transfer, quiet=True)
                raise _nixl_error(f"post WRITE of {n} bytes to {o.agent}", e) from e
            if state not in ("DONE", "PROC"):
                self._release_transfer(transfer, quiet=True)
                raise RdmaError(f"post WRITE of {n} bytes to {o.agent}: NIXL state {state}")
            transfer.state = state
            return transfer

    def _check(self, handle: Any, peer: str) -> str:
        with self._lock:
            self._live()
            try:
                state = self._agent.check_xfer_state(handle)
            except Exception as e:  # noqa: BLE001 - re-raised as RdmaError
                raise _nixl_error(f"transfer to {peer}: check_xfer_state", e) from e
        if state not in ("DONE", "PROC"):
            raise RdmaError(f"transfer to {peer}: NIXL state {state}")
        return str(state)

    def _release_transfer(self, t: Transfer, quiet: bool = False) -> None:
        with self._lock:
            if t.released:
                return
            try:
                self._agent.release_xfer_handle(t._handle)
            except Exception as e:  # noqa: BLE001 - re-raised as RdmaError (unless already failing)
                if not quiet:
                    raise _nixl_error(f"release transfer to {t.peer} (state {t.state})", e) from e
            t.released = True
            self._transfers.discard(t)

    def forget(self, agent: str) -> None:
        """Remove a remote agent (and disconnect from it): the next write to an offer of it loads
        its metadata again."""
        with self._lock:
            self._live()
            self._forget(agent)

    def _forget(self, agent: str) -> None:
        if self._remotes.pop(agent, None) is None:
            return
        try:
            self._agent.remove_remote_agent(agent)
        except Exception as e:  # noqa: BLE001 - re-raised as RdmaError
            raise _nixl_error(f"remove remote agent {agent}", e) from e

    def __repr__(self) -> str:
        return (f"RdmaEngine({self.name}, {len(self._regs)} regions, {len(self._remotes)} peers, "
                f"{len(self._transfers)} transfers{', closed' if self.closed else ''})")
