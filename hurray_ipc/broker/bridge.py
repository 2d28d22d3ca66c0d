"""Cross-machine bridge between two brokers (docs/spec/interchange.md, docs/spec/sync-contract.md §6).

    # host A: take handoffs of channel "frames" from the local broker, serve them over TCP
    python -m hurray_ipc.broker.bridge out --channel frames --listen tcp://*:5555 --server-key keys/server.key_secret \\
        --clients keys/clients
    # host B: receive them and hand them to local consumers of "frames"
    python -m hurray_ipc.broker.bridge in --channel frames --connect tcp://hostA:5555 \\
        --client-key keys/client.key_secret --server-public keys/server.key [--device cuda:0]
    python -m hurray_ipc.broker.bridge keygen keys          # server and client certificates (CurveZMQ)

The sending side is a consumer of its local broker. As a CPU consumer (the default) it gets every
GPU buffer host-staged (the producer host-waited the copy); with ``--device cuda:N`` it gets GPU
buffers by IPC and host-waits the producer's writes itself. Either way device writes are retired
before the first TENSOR_DATA frame or NIXL WRITE, and every handle it sends is
SYNC_PRODUCER_SYNCED. The receiving side is a producer on its local broker: it reassembles each
transfer straight into one buffer (a buffer never has to fit in memory twice), never hands it on
before TENSOR_DATA_END, and hands it on as SYNC_PRODUCER_SYNCED (with ``--device cuda:N``: copied
to its GPU first, or, on the NIXL plane where the GPU allows, written there by the NIC and flushed).

Flow control is by credit: the receiver grants one transfer per CREDIT{n: 1} (its window, WINDOW
by default, at link set-up), and sends the next CREDIT once a buffer was handed to a local
consumer. It holds up to its window of partial transfers, each in its own buffer, and hands them
on in descriptor order. The sender queues a transfer's frames and goes on to the next without
waiting for the socket to drain (at most MAX_IN_FLIGHT queued, each released once ZeroMQ is done
with its zero-copy frames), so the link does not idle between transfers; on the NIXL plane it keeps
up to the receiver's window of WRITEs in flight. Within a transfer, TCP backpressure and a bounded
send queue (HWM) bound memory. Traffic is CurveZMQ-authenticated and
encrypted; plaintext needs ``--insecure``.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import itertools
import json
import logging
import os
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator

from hurray_ipc.cli.common import LOG_LEVELS
from hurray_ipc.client import BrokerUnavailable, Consumer, Producer, Ticket
from hurray_ipc.client.endpoint import default_endpoint
from hurray_ipc.contract.sync import check_network_handle
from hurray_ipc.devices import CudaDevice, DeviceError, open_device, shm
from hurray_ipc.devices.base import Mapping
from hurray_ipc.devices.pool import Pool
from hurray_ipc.errors import EndOfStream
from hurray_ipc.format.handle import BufferHandle, HandleError, SyncMode
from hurray_ipc.interchange.receiver import (
    Announce,
    Closed,
    Closing,
    ConsumerAsked,
    Free,
    HandoffEnded,
    HandOn,
    HandOnFailed,
    Keep,
    LinkReceived,
    Offered,
    OfferFailed,
    Quarantine,
    ReceiverAction,
    ReceiverConfig,
    ReceiverCore,
    ReceiverEvent,
    Reserve,
    Reserved,
    ReserveFailed,
    Send,
    Tick,
    Write,
)
from hurray_ipc.interchange.receiver import Offer as OfferAction
from hurray_ipc.interchange.rules import WINDOW, Plane
from hurray_ipc.interchange.sender import (
    MAX_IN_FLIGHT,
    WRITE_CHUNK,
    AcceptOffer,
    CloseEngine,
    Describe,
    EndWrites,
    EngineRenewed,
    ForgetAgent,
    OfferAccepted,
    OfferRefused,
    Peer,
    PostNext,
    PostWrite,
    Reaped,
    Release,
    SenderAction,
    SenderConfig,
    SenderCore,
    SenderEvent,
    SendFailed,
    SendTransfer,
    Started,
    Unreachable,
    Unreadable,
    Unregister,
    WriteDone,
    WriteFailed,
    WritesEnded,
)
from hurray_ipc.interchange.sender import Closing as SenderClosing
from hurray_ipc.interchange.sender import LinkReceived as SenderLinkReceived
from hurray_ipc.interchange.sender import Send as SenderSend
from hurray_ipc.interchange.sender import Tick as SenderTick
from hurray_ipc.interop import dlpack
from hurray_ipc.transport.route import MAX_LINKS, MAX_PEER_CHARS, Link, Route
from hurray_ipc.wire import link
from hurray_ipc.wire.ipc import ProtocolError
from hurray_ipc.wire.link import MAX_WINDOW

from .keyfile import read_token, route_key_path
from .logfmt import FORMATS
from .logfmt import configure as configure_logging
from .rdma import BadOffer, Offer, RdmaEngine, RdmaError, Registration, Transfer, nixl_available, nixl_info

log = logging.getLogger("hurray.bridge")
__all__ = ["BridgeIn", "BridgeOut", "Dest", "main"]

CHUNK = 1 << 20
SEND_HWM = 16  # chunks queued per peer: with CHUNK, at most 16 MiB in flight per transfer
MAX_TENSOR = 1 << 40
FAULT_CHUNK = 64 << 20  # bytes of a new destination faulted in per turn of the loop (BridgeIn._fault_in)
POLL_RDMA_S = 0.001  # how often a sending bridge looks at posted NIXL WRITEs
POLL_QUEUED_S = 0.005  # ... at queued zmq frames (their trackers have no descriptor either)
POLL_IDLE_S = 0.05
DRAIN_S = 0.05  # at most this long handling link messages before a receiver's loop goes round again


def open_engine(rdma: bool, role: str, channel: str) -> RdmaEngine | None:
    """The NIXL engine when asked for (--rdma) and usable; None (the zmq plane only) otherwise,
    saying why in the log."""
    if not rdma:
        return None
    reason = nixl_available()
    if reason is None:
        try:
            return RdmaEngine(f"bridge-{role}-{channel}", progress_thread=False)
        except RdmaError as e:
            reason = str(e)
    log.warning(json.dumps({"event": "rdma_unavailable", "reason": reason, "data_planes": ["zmq"]}))
    return None




@dataclass
class Curve:
    """CurveZMQ key material read from files (zmq.auth certificate format)."""

    public: bytes
    secret: bytes
    server_public: bytes | None = None  # client side
    clients_dir: str | None = None  # server side: authorised client public keys

    @classmethod
    def server(cls, secret_file: str, clients_dir: str) -> Curve:
        pub, sec = zmq.auth.load_certificate(secret_file)
        if sec is None:
            raise ValueError(f"{secret_file} holds no secret key")
        if not Path(clients_dir).is_dir():
            raise ValueError(f"{clients_dir} is not a directory of authorised client keys")
        return cls(pub, sec, clients_dir=clients_dir)

    @classmethod
    def client(cls, secret_file: str, server_public_file: str) -> Curve:
        pub, sec = zmq.auth.load_certificate(secret_file)
        spub, _ = zmq.auth.load_certificate(server_public_file)
        if sec is None:
            raise ValueError(f"{secret_file} holds no secret key")
        return cls(pub, sec, server_public=spub)


def keygen(directory: str) -> None:
    d = Path(directory)
    (d / "clients").mkdir(parents=True, exist_ok=True)
    zmq.auth.create_certificates(str(d), "server")
    zmq.auth.create_certificates(str(d), "client")
    (d / "clients" / "client.key").write_bytes((d / "client.key").read_bytes())
    for f in d.glob("*.key_secret"):
        os.chmod(f, 0o600)


def read_route_key(endpoint: str | None, given: str | None) -> str:
    """The key a bridge's ROUTE carries (ipc-protocol.md §2.4): ``given`` (a bridge in the broker's
    own process), else the content of the broker's owner-only ``<socket>.route-key``, else "" (the
    broker then refuses the route, not_authorized, and says so in its ERROR, which the log shows)."""
    if given:
        return given
    path = route_key_path(endpoint or default_endpoint())
    if path is None:
        return ""
    try:
        token = read_token(path)
    except OSError as e:
        log.warning("cannot read the broker's route key %s (%s): this bridge's route will not be announced", path, e)
        return ""
    if token is None:  # not the broker's file: another uid's, a link, a wrong mode or content
        log.warning("%s is not an owner-only route key of this user: this bridge's route will not be announced", path)
        return ""
    return token


class BridgeOut:
    """Host A: a consumer of ``channel`` on the local broker (on ``device``: cpu, or cuda:N to take
    GPU buffers by IPC), streaming each buffer to peers.

    The protocol is :class:`~hurray_ipc.interchange.sender.SenderCore`'s; this loop owns the link
    socket and its zero-copy trackers, the local consumer, the sources it reads (staging buffers,
    kept NIXL registrations) and the NIXL agent and its WRITEs, feeds the core what happened and
    runs the actions it returns (each source it started a transfer of is released when the core
    says :class:`~hurray_ipc.interchange.sender.Release`, once)."""

    def __init__(self, channel: str, listen: str, *, endpoint: str | None = None, curve: Curve | None = None,
                 timeout_s: float = 3.0, chunk: int = CHUNK, rdma: bool = False, device: str = "cpu",
                 route_key: str | None = None):
        self.channel, self.chunk, self.timeout_s, self.device = channel, chunk, timeout_s, device
        self.route_key = read_route_key(endpoint, route_key)
        self.ctx = zmq.Context()
        self.auth = None
        self.sock = self.ctx.socket(zmq.ROUTER)
        if curve is not None:
            self.auth = ThreadAuthenticator(self.ctx)
            self.auth.start()
            if curve.clients_dir is None:
                raise ValueError("a bridge sender needs server keys with a clients directory (Curve.server)")
            self.auth.configure_curve(domain="*", location=curve.clients_dir)
            self.sock.curve_server = True
            self.sock.curve_publickey, self.sock.curve_secretkey = curve.public, curve.secret
        self.sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # an unreachable peer is an error, not a drop
        self.sock.setsockopt(zmq.SNDHWM, SEND_HWM)
        self.sock.setsockopt(zmq.SNDTIMEO, int(timeout_s * 1000))
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.bind(listen)
        # The address bound: ``--listen tcp://*:*`` (any free port) is only known from here
        self.endpoint = self.sock.getsockopt_string(zmq.LAST_ENDPOINT)
        log.info(json.dumps({"event": "bridge_listening", "channel": channel, "endpoint": self.endpoint}))
        self.local = endpoint
        # A local consumer exists only while a remote peer is linked: with no peer, the bridge
        # must not hold handoffs that nobody can receive (its BYE gives them back to the broker).
        self.consumer: Consumer | None = None
        # GPU buffers this bridge stages to host itself (``device`` cuda:N, where the NIC cannot read them)
        self.staging = DestinationPool(open_device("cpu"), keep=MAX_IN_FLIGHT)
        self.engine = open_engine(rdma, "out", channel)
        # What each transfer under way reads and what carries it, by the core's ids
        self.sources: dict[int, TransferSource] = {}  # source id -> source, until the core's Release
        self.src_ids = itertools.count(1)
        self.trackers: dict[int, list[zmq.MessageTracker]] = {}  # zmq transfer id -> its frames' trackers
        self.writes: dict[int, list[Posted]] = {}  # NIXL transfer id -> its WRITEs posted, not yet DONE
        self.regs: dict[int, Registration] = {}  # NIXL transfer id -> its source's registration
        self.offers: dict[int, Offer] = {}  # NIXL transfer id -> the receiver's checked offer
        # Source registrations kept between transfers, one per region of an imported mapping, each
        # released once the mapping is unmapped (the key then lands in ``unmapped``, from any thread)
        self.kept: dict[tuple[int, int, int], Registration] = {}
        self.unmapped: deque[tuple[int, int, int]] = deque()
        planes = (Plane.NIXL, Plane.ZMQ) if self.engine is not None else (Plane.ZMQ,)
        self.core = SenderCore(SenderConfig(channel, timeout_s, planes, self.gpu_source, MAX_IN_FLIGHT, WRITE_CHUNK))
        self.running = False

    @property
    def peers(self) -> dict[bytes, Peer]:
        return self.core.peers

    @property
    def stats(self) -> dict[str, int]:
        s = self.core.stats
        return {"sent": s.sent, "rejected": s.rejected, "aborted": s.aborted, "rdma_writes": s.writes}

    @property
    def gpu_source(self) -> str:
        """What this bridge's NIXL WRITEs read for GPU buffers (LINK_WELCOME, informational):
        "device" (GPU memory in place: ``device`` cuda:N and NIXL takes VRAM) or "host-staged" (a
        CPU consumer gets GPU buffers host-staged by the producer; a GPU one stages them itself)."""
        return "device" if self.engine is not None and self._nic_reads_gpu else "host-staged"

    @functools.cached_property
    def _nic_reads_gpu(self) -> bool:
        if self.device == "cpu":
            return False
        dev = open_device(self.device)
        return isinstance(dev, CudaDevice) and (dev.identity.emulated or nixl_info().gpudirect)

    def route(self) -> Route:
        """What this bridge tells its broker (ROUTE, so that CAPS_REPLY names the data plane and the
        GPU path): one link per linked peer. On the zmq plane a GPU consumer stages GPU buffers
        itself; a CPU one gets them host-staged by their producers (``gpu`` None)."""
        gpu = None if self.device == "cpu" else self.gpu_source
        return Route("export", tuple(
            Link(p.name, p.plane.value, gpu if p.plane is Plane.NIXL or gpu is None else "host-staged", p.window)
            for p in itertools.islice(self.peers.values(), MAX_LINKS)))

    # -- running the core's actions --------------------------------------------------------------

    def _feed(self, event: SenderEvent) -> None:
        self._run(self.core.handle(event))

    def _run(self, actions: list[SenderAction]) -> None:
        """Do what the core asked, in order; an action's outcome goes back to the core at once."""
        for a in actions:
            if isinstance(a, SenderSend):
                self._reply(a.rid, a.msg)
            elif isinstance(a, SendTransfer):
                self._transfer(a)
            elif isinstance(a, Describe):
                try:
                    self._describe(a.rid, a.tid, self.sources[a.src])
                except (zmq.ZMQError, HandleError) as e:
                    self._feed(SendFailed(a.tid, str(e), time.monotonic()))
            elif isinstance(a, AcceptOffer):
                self._accept_offer(a)
            elif isinstance(a, PostWrite):
                self._post_write(a)
            elif isinstance(a, EndWrites):
                self._end_writes(a.tid)
            elif isinstance(a, Unregister):
                self._unregister(a.tid)
            elif isinstance(a, Release):
                self.sources.pop(a.src).done()
            elif isinstance(a, ForgetAgent):
                self._forget_agent(a.agent)
            elif isinstance(a, CloseEngine):
                self._close_engine()

    def _reply(self, rid: bytes, msg: link.LinkMessage) -> None:
        try:
            self.sock.send_multipart([rid, *link.encode(msg)])
        except zmq.ZMQError as e:
            self._feed(Unreachable(rid, str(e), time.monotonic()))

    def _handle(self, parts: list[bytes], address: str = "?") -> None:
        """One link message; ``address`` is where it came from (the peer's IP address, for logs and ROUTE)."""
        try:
            msg = link.decode(parts[1:], link.FROM_RECEIVER)
        except ProtocolError as e:
            log.warning(json.dumps({"event": "bad_message", "error": str(e)}))
            return
        self._feed(SenderLinkReceived(parts[0], msg, time.monotonic(), address))

    def _describe(self, rid: bytes, tid: int, src: TransferSource) -> None:
        """Send a transfer's TENSOR_DESCRIPTOR (both data planes)."""
        handle = check_network_handle(src.handle)
        self.sock.send_multipart([rid, *link.encode(link.TensorDescriptor(tid, handle, src.meta))])

    def _source(self, h: Any, nic: bool) -> TransferSource:
        """What a transfer of handoff ``h`` reads, every write to it retired (sync-contract §6), and how it
        is given back. Host memory is read in place. GPU memory (``device`` cuda:N) is read in place
        by the NIC (``nic``) where NIXL takes it (VRAM; an emulated GPU's memory is host memory),
        else copied to a host buffer here (host-waited) and the handoff released at once."""
        buf = h.buffer.device_buffer
        handle = dataclasses.replace(h.handle, sync_mode=SyncMode.PRODUCER_SYNCED)  # true once retired
        dev = buf.device
        if not isinstance(dev, CudaDevice):
            # a host buffer: the producer host-waited its writes (PRODUCER_SYNCED or host-staged)
            return TransferSource(handle, h.wire_meta, buf.ptr, "DRAM", 0, h.buffer, buf.host_view(), h.release,
                                  buf.mapping)
        consumer = self.consumer
        if consumer is None or consumer.stream is None:
            raise RuntimeError(f"bridge consumer on {self.device} has no CUDA stream")
        h.wait()  # the consumer's stream after the producer's writes...
        consumer.stream.synchronize()  # ...and the host after the stream: the writes retired
        if nic and (dev.identity.emulated or nixl_info().gpudirect):
            dev.rdma_source(buf)
            kind, ordinal = ("DRAM", 0) if dev.identity.emulated else ("VRAM", dev.ordinal)
            return TransferSource(handle, h.wire_meta, buf.ptr, kind, ordinal, h.buffer, None, h.release, buf.mapping)
        host = self.staging.take(buf.size)
        try:
            consumer.stream.copy(host, buf)
            consumer.stream.synchronize()
        except BaseException:
            self.staging.give(host)
            raise
        h.release()
        return TransferSource(handle, h.wire_meta, host.ptr, "DRAM", 0, host, host.host_view(),
                              lambda: self.staging.give(host), pool=self.staging)

    def _accept_offer(self, a: AcceptOffer) -> None:
        """RDMA_REGISTER: check the offer, register the source (its writes retired, see
        :meth:`_source`); its WRITEs are then posted one per turn (PostNext)."""
        src, now = self.sources[a.src], time.monotonic()
        try:
            if self.engine is None:
                raise RdmaError("this bridge closed its NIXL agent")
            offer = Offer.from_wire({"header": a.offer.offer, "frames": [a.offer.metadata]})
            if offer.size < a.size:
                raise BadOffer(f"bad offer: {offer.size} bytes offered for a transfer of {a.size}")
            self._forget_unmapped()  # first: a region it kept may be at these very addresses
            self.regs[a.tid] = self.engine.register(src.ptr, a.size, src.kind, src.nixl_device, owner=src.owner)
            self._keep_registered(src)
        except RdmaError as e:
            self._feed(OfferRefused(a.tid, "bad_offer" if isinstance(e, BadOffer) else "rdma_failed", str(e), now))
            return
        self.offers[a.tid] = offer
        self.writes[a.tid] = []
        self._feed(OfferAccepted(a.tid, offer.agent, now))

    def _keep_registered(self, src: TransferSource) -> None:
        """Keep ``src``'s registration after its transfer (a producer sends the same buffers again
        and again; on an RDMA NIC a registration pins memory): as long as the mapping it lies in
        (released once that is unmapped, when the same addresses may name other memory), or the
        staging buffer it is. Other sources are registered per transfer."""
        if self.engine is None:
            return
        if src.pool is not None:
            src.pool.registration(self.engine, src.owner)
            return
        if src.mapping is None:
            return
        key = (src.mapping.serial, src.ptr, src.handle.size)
        if key in self.kept:
            return
        self.kept[key] = self.engine.register(src.ptr, src.handle.size, src.kind, src.nixl_device, owner=src.owner)
        src.mapping.on_unmap(lambda: self.unmapped.append(key))  # deque.append: safe from another thread

    def _forget_unmapped(self) -> None:
        """Release the kept registrations of regions whose mapping was unmapped since."""
        while self.unmapped:
            reg = self.kept.pop(self.unmapped.popleft(), None)
            if reg is not None and self.engine is not None:
                try:
                    self.engine.release(reg)
                except RdmaError as e:
                    log.warning(json.dumps({"event": "rdma_release_failed", "error": str(e)}))

    def _post_write(self, a: PostWrite) -> None:
        """One WRITE of at most WRITE_CHUNK bytes: a post copies synchronously on UCX's shared-memory
        transports, so one per turn of the loop keeps the link answered (a 1 GiB post would hold it
        for a second or more)."""
        try:
            if self.engine is None:
                raise RdmaError("this bridge closed its NIXL agent")
            x = self.engine.write(self.regs[a.tid], self.offers[a.tid], notif=str(a.tid).encode() if a.last else b"",
                                  part=(a.offset, a.length))
        except RdmaError as e:
            reason = "bad_offer" if isinstance(e, BadOffer) else "rdma_failed"
            self._feed(WriteFailed(a.tid, reason, str(e), time.monotonic()))
            return
        self.writes[a.tid].append(Posted(x, a.offset, a.length))

    def _poll_rdma(self) -> None:
        """Each posted WRITE whose completion NIXL reports (DONE) is released and told to the core
        (RDMA_READY for its range; TENSOR_DATA_END once all are, R3.4-R3.5, sync-contract §6)."""
        for tid, ws in list(self.writes.items()):
            try:
                for w in [w for w in ws if w.write.poll()]:
                    if self.writes.get(tid) is not ws:
                        break  # ended while we told the peer (it was dropped): its writes are released
                    ws.remove(w)
                    w.write.release()  # DONE: NIXL reads none of it any more
                    self._feed(WriteDone(tid, w.offset, w.length, time.monotonic()))
            except RdmaError as e:
                self._feed(WriteFailed(tid, "rdma_failed", str(e), time.monotonic()))

    def _end_writes(self, tid: int) -> None:
        """Cancel (release) the transfer's posted WRITEs (NIXL cancels an in-flight one, R4.1) and
        tell the core whether NIXL let go of the source."""
        ws = self.writes.pop(tid, [])
        try:
            while ws:
                ws[-1].write.release()
                ws.pop()
        except RdmaError as e:
            log.warning(json.dumps({"event": "rdma_not_cancelled", "transfer_id": tid, "error": str(e)}))
            self._feed(WritesEnded(tid, False, time.monotonic()))
            return
        self._feed(WritesEnded(tid, True, time.monotonic()))

    def _unregister(self, tid: int) -> None:
        self.offers.pop(tid, None)
        reg = self.regs.pop(tid, None)
        if reg is not None and self.engine is not None:
            try:
                self.engine.release(reg)
            except RdmaError as e:
                log.warning(json.dumps({"event": "rdma_release_failed", "transfer_id": tid, "error": str(e)}))

    def _forget_agent(self, agent: str) -> None:
        if self.engine is None:
            return
        try:
            self.engine.forget(agent)
            log.info(json.dumps({"event": "rdma_peer_forgotten", "agent": agent}))
        except RdmaError as e:
            log.warning(json.dumps({"event": "rdma_forget_failed", "agent": agent, "error": str(e)}))

    def _close_engine(self) -> None:
        """R4.5: close the NIXL agent (every WRITE and registration ends with it); the core releases
        the sources after this."""
        engine, self.engine = self.engine, None
        self.kept.clear()  # closing the agent ends every registration
        self.writes.clear()
        self.regs.clear()
        self.offers.clear()
        if engine is not None:
            try:
                engine.close()
            except RdmaError as e:
                log.warning(json.dumps({"event": "rdma_close_failed", "error": str(e)}))

    def _renew_engine(self) -> None:
        """Replace the NIXL agent once MAX_FAILED_WRITES transfers failed on it and none is in
        flight. UCX keeps a socket for every connection attempt that failed (an offer of an agent
        that is gone: about one per transfer, red team item 14) until its worker closes; only a
        new agent gives them back. Peers notice nothing: the next offer loads into the new agent."""
        if self.engine is None or not self.core.renew_due:
            return
        old, self.engine = self.engine, None
        for reg in self.kept.values():
            try:
                old.release(reg)
            except RdmaError as e:
                log.warning(json.dumps({"event": "rdma_release_failed", "error": str(e)}))
        self.kept.clear()
        try:
            old.close()
        except RdmaError as e:
            log.warning(json.dumps({"event": "rdma_close_failed", "error": str(e)}))
        self.engine = open_engine(True, "out", self.channel)
        log.info(json.dumps({"event": "rdma_agent_renewed", "failed_writes": self.core.failed_writes,
                             "data_planes": ["nixl", "zmq"] if self.engine is not None else ["zmq"]}))
        self._feed(EngineRenewed(self.engine is not None))

    def _transfer(self, a: SendTransfer) -> None:
        """Queue one transfer's frames on the socket, each data chunk zero-copy and tracked: its
        source is released when the core says (Reaped: ZeroMQ is done with every frame)."""
        src, rid, tid = self.sources[a.src], a.rid, a.tid
        trackers = self.trackers[tid] = []
        view, size = src.view, src.handle.size
        try:
            if view is None:  # _source(nic=False) always gives host bytes
                raise RuntimeError("a zmq-plane source without host bytes")
            self._describe(rid, tid, src)
            for off in range(0, size, self.chunk):
                # copy=False: the chunk goes from the mapped buffer to the socket without a copy;
                # its tracker says when ZeroMQ is done with it, so the release can follow safely.
                # Every chunk is tracked: pyzmq copies small frames anyway and reports them done at
                # once, so the last chunk's tracker says nothing about the earlier ones.
                tracker = self.sock.send_multipart([rid, *link.tensor_data_head(tid, off), view[off:off + self.chunk]],
                                                   copy=False, track=True)
                if tracker is None:  # pyzmq returns a tracker for every track=True send
                    raise RuntimeError("pyzmq returned no MessageTracker for a tracked send")
                trackers.append(tracker)
            self.sock.send_multipart([rid, *link.encode(link.TensorDataEnd(tid, size))])
        except (zmq.ZMQError, HandleError) as e:
            self._feed(SendFailed(tid, str(e), time.monotonic()))

    def _reap(self, block: bool = False) -> None:
        """Tell the core about every queued transfer ZeroMQ is done with, oldest first (it releases
        each once). ``block``: wait for them (closing). Past its deadline (a peer that stopped
        reading) a transfer is reaped anyway (the core counts it aborted)."""
        while self.core.queued:
            t = self.core.queued[0]
            pending = [x for x in self.trackers.get(t.tid, []) if not x.done]
            if pending and not block and time.monotonic() < t.deadline:
                return  # the oldest is still being sent; the later ones queue behind it
            ok = True
            try:
                for x in pending:
                    x.wait(max(0.0, t.deadline - time.monotonic()))
            except zmq.NotDone:
                ok = False
            self.trackers.pop(t.tid, None)
            self._feed(Reaped(t.tid, ok, time.monotonic()))

    def serve(self, stop: threading.Event | None = None) -> None:
        """Serve until ``stop`` is set. One thread does everything; it sleeps only in one poll, on
        the link socket, the local consumer's socket (while a handoff could be taken) and a pipe its
        pump thread writes to when it dispatched something, so neither a link message nor a handoff
        waits for a timer. NIXL completions have no descriptor to wait on: while a WRITE is posted
        the poll returns every POLL_RDMA_S to look (interchange.md R3.4)."""
        stop = stop or threading.Event()
        self.running = True
        wake_r, wake_w = os.pipe()
        os.set_blocking(wake_r, False)
        os.set_blocking(wake_w, False)

        def wake() -> None:  # the consumer's pump thread dispatched a message (a handoff, perhaps)
            try:
                os.write(wake_w, b"w")
            except BlockingIOError:  # the pipe is full: a wake-up is pending anyway
                pass

        try:
            while not stop.is_set():
                self._drain_link()
                if self.writes:
                    self._poll_rdma()  # before the deadlines: a WRITE that completed is not a timeout
                self._feed(SenderTick(time.monotonic()))  # silent peers, NIXL deadlines
                more = False
                if self.writes:
                    actions = self.core.handle(PostNext(time.monotonic()))
                    self._run(actions)
                    more = any(isinstance(a, PostWrite) for a in actions)
                if self.peers and self.consumer is None:
                    self.consumer = Consumer(
                        self.local, self.channel, self.device, prefetch=0, name=f"bridge-out:{self.channel}"
                    )
                    self.consumer.session.wakers.append(wake)
                elif not self.peers and self.consumer is not None:
                    self._reap(block=True)  # release what was queued to the peers now gone, then leave
                    self.consumer.close()
                    self.consumer = None
                if self.consumer is not None:
                    self.consumer.session.set_route(self.route().to_dict(), self.route_key)  # sent when it changed
                self._reap()
                self._forget_unmapped()
                self._renew_engine()
                taking = self._take_handoffs()
                poller = zmq.Poller()
                poller.register(self.sock, zmq.POLLIN)
                poller.register(wake_r, zmq.POLLIN)
                if taking and self.consumer is not None:
                    poller.register(self.consumer.session.fd, zmq.POLLIN)
                posted = any(self.writes.values())
                wait = 0 if more else POLL_RDMA_S if posted else POLL_QUEUED_S if self.core.queued else POLL_IDLE_S
                if poller.poll(int(wait * 1000)):
                    try:
                        while os.read(wake_r, 4096):
                            pass
                    except BlockingIOError:
                        pass
        finally:
            self.close()
            os.close(wake_r)
            os.close(wake_w)

    def _drain_link(self) -> None:
        while True:
            try:
                frames = self.sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            try:
                try:
                    address = frames[0].get("Peer-Address")
                except zmq.ZMQError:  # a transport without one (inproc)
                    address = "?"
                self._handle([f.bytes for f in frames], str(address))
            except Exception:  # noqa: BLE001 - one peer's message must not end the bridge
                log.exception("handling a link message failed; the bridge goes on")

    def _take_handoffs(self) -> bool:
        """Start a transfer for every handoff the local broker has for us while the core has a peer
        for it (credit, room in its window, fewer than MAX_IN_FLIGHT under way). True when it
        stopped only because no handoff was there (so the caller waits for one)."""
        while self.consumer is not None:
            rid = self.core.pick()
            if rid is None:
                return False
            try:
                h = self.consumer.receive(timeout=0)
            except TimeoutError:
                return True
            except EndOfStream:
                # Every producer of the channel here ended (ipc-protocol.md §4.9): nothing to carry
                # until one registers again. The end itself does not cross the link.
                return False
            except BrokerUnavailable:
                return False  # the session says hello again on its own; nothing to wait on meanwhile
            try:
                src = self._source(h, nic=self.core.nixl(rid, h.handle.size))
            except (DeviceError, RdmaError, RuntimeError) as e:
                if not h.released:
                    h.release()
                self._feed(Unreadable(str(e)))
                continue
            sid = next(self.src_ids)
            self.sources[sid] = src
            self._feed(Started(rid, sid, src.handle.size, time.monotonic()))
        return False

    def close(self) -> None:
        if self.running:
            self.running = False
            log.info(json.dumps({"event": "bridge_closed", "side": "out", **self.stats,
                                 "nixl_registrations": self.engine.registered_total if self.engine else None,
                                 "sources_kept": len(self.kept)}))
            self._reap(block=True)  # every handoff taken is released once, before the consumer goes
            self._feed(SenderClosing(time.monotonic()))
            if self.engine is not None:
                self.engine.close()
            if self.consumer is not None:
                self.consumer.close()
            self.staging.close()
            self.sock.close(linger=0)
            if self.auth is not None:
                self.auth.stop()
            self.ctx.term()


@dataclass
class TransferSource:
    """What one transfer of a sending bridge reads: ``ptr`` in NIXL memory ``kind`` (and GPU
    ``nixl_device``), every write to it retired; ``view`` its bytes where the host can read them.
    ``done`` gives it back (releases the handoff, or returns a staging buffer), exactly once, when
    neither ZeroMQ nor NIXL reads it any more."""

    handle: BufferHandle  # as the descriptor declares it: SYNC_PRODUCER_SYNCED
    meta: dict[str, Any]
    ptr: int
    kind: str
    nixl_device: int
    owner: Any  # kept alive by a NIXL registration of it
    view: memoryview | None
    done: Callable[[], None]
    mapping: Mapping | None = None  # the opening it lies in (imported memory): its registration lives as long
    pool: DestinationPool | None = None  # the pool that owns ``owner`` (a staging buffer): the same


@dataclass(frozen=True)
class Posted:
    """One NIXL WRITE a sending bridge posted: ``length`` bytes at ``offset`` of its transfer."""

    write: Transfer
    offset: int
    length: int


class DestinationPool:
    """The buffers of one device a receiving bridge reassembles transfers into, reused. A fresh
    allocation per transfer costs its creation, a page fault per page on first write and (NIXL
    plane) a registration; reused, a buffer costs none of them again. A buffer comes back when the
    local consumer released it (or its transfer was dropped); at most ``keep`` idle ones per size
    are kept, the others freed. A NIXL registration lives as long as its buffer, as memory ``kind``
    ("DRAM", or "VRAM" of GPU ``nixl_device``)."""

    def __init__(self, device: Any, keep: int = WINDOW + 1, kind: str = "DRAM", nixl_device: int = 0):
        self.device, self.keep, self.kind, self.nixl_device = device, keep, kind, nixl_device
        self._bufs: Pool[int, Any] = Pool(device.allocate, self._free, lambda buf: buf.size, keep=keep,
                                          what="destinations")
        self._regs: dict[int, tuple[RdmaEngine, Registration]] = {}  # id(buffer) -> its registration
        self._lock = threading.Lock()

    def take(self, size: int) -> Any:
        return self._bufs.take(size)

    def give(self, buf: Any) -> None:
        """``buf`` is no one's any more (released by its consumer, or its transfer dropped)."""
        self._bufs.give(buf)

    def registered(self, engine: RdmaEngine, buf: Any) -> bool:
        """Whether ``buf`` has a live registration with ``engine`` (it was offered before)."""
        with self._lock:
            known = self._regs.get(id(buf))
        return known is not None and known[0] is engine and not known[1].released

    def registration(self, engine: RdmaEngine, buf: Any) -> Registration:
        """``buf``'s registration with ``engine``, made on first use."""
        with self._lock:
            known = self._regs.get(id(buf))
        if known is not None and known[0] is engine and not known[1].released:
            return known[1]
        reg = engine.register(buf.ptr, buf.size, self.kind, self.nixl_device, owner=buf)
        with self._lock:
            self._regs[id(buf)] = (engine, reg)
        return reg

    def deregister(self, buf: Any) -> None:
        """Release ``buf``'s registration now (the buffer itself stays out of the pool)."""
        with self._lock:
            known = self._regs.pop(id(buf), None)
        if known is not None and not known[0].closed:
            known[0].release(known[1])

    def _free(self, buf: Any) -> None:
        with self._lock:
            known = self._regs.pop(id(buf), None)
        if known is not None and not known[0].closed:
            try:
                known[0].release(known[1])
            except RdmaError as e:
                log.warning(json.dumps({"event": "rdma_release_failed", "error": str(e)}))
        buf.close()

    def close(self) -> None:
        """Free the idle buffers (those still out belong to handoffs not yet released)."""
        self._bufs.close(taken_too=False)


@dataclass
class Dest:
    """A destination the receiver core named (:class:`~hurray_ipc.interchange.receiver.Reserve`):
    its buffer, how it goes back (its pool's ``give``, or closed: a device copy), and, while it is
    being faulted in before its offer, the offset from which its pages still are."""

    buf: Any
    give: Callable[[Any], None]
    pool: DestinationPool | None
    tid: int = 0
    unfaulted: int | None = None


class BridgeIn:
    """Host B: receives transfers and hands each, once complete, to local consumers of ``channel``.

    The protocol is :class:`~hurray_ipc.interchange.receiver.ReceiverCore`'s; this loop owns the
    link socket, the destination buffers (:class:`DestinationPool`), the NIXL agent and the local
    producer, feeds the core what happened (link messages, time, what its actions came to) and runs
    the actions it returns. One thread changes both: a handed-on buffer's release is seen by
    whichever thread pumps the producer's session, which only queues it (:attr:`ended`) for the loop."""

    def __init__(self, channel: str, connect: str, *, endpoint: str | None = None, curve: Curve | None = None,
                 device: str = "cpu", timeout_s: float = 3.0, max_bytes: int = MAX_TENSOR, rdma: bool = False,
                 window: int = WINDOW, route_key: str | None = None):
        if not 1 <= window <= MAX_WINDOW:
            raise ValueError(f"window {window} is outside 1-{MAX_WINDOW}")
        self.channel, self.timeout_s, self.max_bytes, self.window = channel, timeout_s, max_bytes, window
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        if curve is not None:
            self.sock.curve_serverkey = curve.server_public
            self.sock.curve_publickey, self.sock.curve_secretkey = curve.public, curve.secret
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(connect)
        self.connect = connect
        self.cpu = open_device("cpu")
        self.producer = Producer(endpoint, channel, device, name=f"bridge-in:{channel}")
        self.route_key = read_route_key(endpoint, route_key)
        self.gpu = self.producer.gpu
        self.dests: dict[int, Dest] = {}  # the core's destination ids -> their buffers
        self.faulting: deque[int] = deque()  # destinations to fault in before their offer, oldest first
        # Handed-on buffers whose handoff ended: (destination, ticket). The session's pump fills it
        # from whichever thread pumps; only the loop reads it (_settle), so state is changed by one thread.
        self.ended: deque[tuple[int, Ticket]] = deque()
        self.delivered = 0
        self.fenced_buffers: list[Any] = []  # handed on to a consumer that was fenced: kept, never reused
        self.engine = open_engine(rdma, "in", channel)
        self.planes = (Plane.NIXL, Plane.ZMQ) if self.engine is not None else (Plane.ZMQ,)
        self.pool = DestinationPool(self.cpu, keep=window + 1)
        self.device_pool = self._device_destinations(window)  # NIXL plane into GPU memory, where it can
        self.core = ReceiverCore(ReceiverConfig(channel, window, timeout_s, max_bytes, self.planes,
                                                self.gpu_destination))
        self.running = False

    @property
    def linked(self) -> bool:
        return self.core.linked

    @property
    def plane(self) -> str:
        return self.core.plane.value

    @property
    def stats(self) -> dict[str, int]:
        return {"delivered": self.delivered, "rejected": self.core.stats.rejected,
                "discarded": self.core.stats.discarded}

    @property
    def gpu_destination(self) -> str | None:
        """Where a GPU receiver's NIXL transfers land: "device" (GPUDirect, no host staging) or
        "host-staged" (host memory, then copied to the GPU); None on a CPU receiver."""
        if not isinstance(self.producer.device, CudaDevice):
            return None
        return "device" if self.device_pool is not None else "host-staged"

    def route(self) -> Route:
        """What this bridge tells its broker (ROUTE, so that CAPS_REPLY names the data plane and the
        GPU path): its link once linked. A GPU receiver's transfers land in GPU memory ("device")
        only on the NIXL plane where R5 allows; otherwise in host memory ("host-staged")."""
        if not self.linked:
            return Route("import")
        gpu = self.gpu_destination
        if gpu is not None and self.plane != "nixl":
            gpu = "host-staged"
        return Route("import", (Link(self.connect[:MAX_PEER_CHARS], self.plane, gpu, self.window),))

    def _announce(self) -> None:
        self.producer.session.set_route(self.route().to_dict(), self.route_key)  # sent only when it changed

    def _device_destinations(self, window: int) -> DestinationPool | None:
        """A pool of GPU destinations for the NIXL plane (R5), or None (host-staged), saying why in the log."""
        dev = self.producer.device
        if self.engine is None or not isinstance(dev, CudaDevice):
            return None
        try:
            why = dev.rdma_write_ordering()  # R5.2: the receiver can order the NIC's writes before its kernels
        except DeviceError as e:  # a driver that cannot say: host-staged
            why = str(e)
        if why is None and not dev.identity.emulated and not nixl_info().gpudirect:
            why = "NIXL's UCX backend takes no VRAM regions (R5.3)"
        pool = None
        if why is None:
            # An emulated GPU's memory is host memory: NIXL writes it as DRAM, the rest is the same.
            kind = "DRAM" if dev.identity.emulated else "VRAM"
            pool = DestinationPool(dev, keep=window + 1, kind=kind, nixl_device=0 if kind == "DRAM" else dev.ordinal)
        log.info(json.dumps({"event": "gpu_destination", "device": dev.identity.spec,
                             "path": "host-staged" if pool is None else "device", "why": why}))
        return pool

    # -- running the core's actions --------------------------------------------------------------

    def _feed(self, event: ReceiverEvent) -> list[ReceiverAction]:
        actions = self.core.handle(event)
        self._run(actions)
        return actions

    def _run(self, actions: list[ReceiverAction]) -> None:
        """Do what the core asked, in order (an action's outcome goes back to the core at once, so
        nothing else happens between an action and its answer)."""
        for a in actions:
            if isinstance(a, Send):
                self.sock.send_multipart(link.encode(a.msg))
            elif isinstance(a, Write):
                self.dests[a.dest].buf.host_view()[a.offset:a.offset + len(a.data)] = a.data
            elif isinstance(a, Reserve):
                self._reserve(a)
            elif isinstance(a, OfferAction):
                self._offer(a)
            elif isinstance(a, HandOn):
                self._hand_on_one(a)
            elif isinstance(a, Free):
                d = self.dests.pop(a.dest)
                d.give(d.buf)
            elif isinstance(a, Quarantine):
                d = self.dests[a.dest]
                d.unfaulted = None
                if d.pool is not None:
                    d.pool.deregister(d.buf)
            elif isinstance(a, Keep):
                self.fenced_buffers.append(self.dests.pop(a.dest).buf)
            elif isinstance(a, Announce):
                self._announce()

    def _reserve(self, a: Reserve) -> None:
        pool = self.device_pool if a.nixl and self.device_pool is not None else self.pool
        self._settle()  # buffers released since the last round go back to their pool first
        try:
            buf = pool.take(a.size)  # host memory: every page reserved now (shm.reserve)
        except DeviceError as e:  # e.g. /dev/shm cannot hold it beside what is held: refused, not SIGBUS later
            self._feed(ReserveFailed(a.dest, str(e), time.monotonic()))
            return
        self.dests[a.dest] = Dest(buf, pool.give, pool)
        self._feed(Reserved(a.dest, time.monotonic()))

    def _offer(self, a: OfferAction) -> None:
        """Offer the destination (RDMA_REGISTER, R3.2): at once where it was offered before, else
        once :meth:`_fault_in` has faulted in its pages (host memory)."""
        if self.engine is None:
            return
        d = self.dests[a.dest]
        d.tid = a.transfer_id
        if d.pool is not None and d.pool.kind == "DRAM" and not d.pool.registered(self.engine, d.buf):
            d.unfaulted = 0
            self.faulting.append(a.dest)
            return
        self._send_offer(a.dest, d)

    def _fault_in(self) -> bool:
        """Fault in the next FAULT_CHUNK of the oldest destination waiting for it, and offer it once
        all of it is: a page first faulted by the peer's NIXL write costs ~7x one faulted here
        (shm.populate), and one chunk per turn of the loop keeps the link answered (1 GiB takes
        about a second). True while destinations still wait."""
        while self.faulting:
            dest = self.faulting[0]
            d = self.dests.get(dest)
            if d is not None and d.unfaulted is not None:
                break
            self.faulting.popleft()  # dropped meanwhile
        else:
            return False
        off = d.unfaulted
        n = min(FAULT_CHUNK, d.buf.size - off)
        try:
            shm.populate(d.buf.ptr + off, n)
        except DeviceError as e:  # e.g. /dev/shm full: said now, not as the peer's failed write
            d.unfaulted = None
            self.faulting.popleft()
            self._feed(OfferFailed(dest, f"could not fault in the destination: {e}", time.monotonic()))
            self._hand_on()
            return True
        d.unfaulted = off + n
        if d.unfaulted >= d.buf.size:
            d.unfaulted = None
            self.faulting.popleft()
            self._send_offer(dest, d)
        return True

    def _send_offer(self, dest: int, d: Dest) -> None:
        if self.engine is None or d.pool is None:
            return
        try:
            reg = d.pool.registration(self.engine, d.buf)
            offer = self.engine.expose(reg)
            if d.pool is self.device_pool:
                d.pool.device.rdma_expose(d.buf)  # nothing on the GPU reads it before the flush
        except RdmaError as e:
            self._feed(OfferFailed(dest, f"could not offer the destination: {e}", time.monotonic()))
            return
        self.sock.send_multipart(link.encode(link.RdmaRegister(d.tid, offer["header"], offer["frames"][0])))
        self._feed(Offered(dest, time.monotonic()))

    def _hand_on_one(self, a: HandOn) -> None:
        """Only now, after TENSOR_DATA_END, may anyone read the buffer: hand it on, PRODUCER_SYNCED
        (the first time: made visible to the local device first)."""
        d = self.dests[a.dest]
        d.unfaulted = None  # an offer not yet made is void: its transfer ended
        if not a.again:
            if d.pool is not None and d.pool is self.device_pool:
                # R5.2, the receiver's half of sync-contract §6: the sender saw its WRITE complete, which
                # does not order the NIC's writes into our GPU before the consumers' kernels. This does.
                d.pool.device.flush_rdma_writes()
            elif isinstance(self.producer.device, CudaDevice):
                stream = self.producer.stream
                if stream is None:  # Producer gives every CUDA device a stream; never expected
                    raise RuntimeError(f"bridge producer on {self.producer.device.identity} has no CUDA stream")
                dev = self.producer.device.allocate(d.buf.size)
                stream.copy(dev, d.buf.host_view())
                stream.synchronize()  # visible before the handle leaves: PRODUCER_SYNCED
                d.give(d.buf)
                d = self.dests[a.dest] = Dest(dev, lambda b: b.close(), None)  # device copies are not pooled
        self._send_on(a, d.buf)

    def _send_on(self, a: HandOn, buf: Any) -> None:
        """Hand ``buf`` to the local consumer whose grant is held, without waiting for the broker's
        answer (the loop must go on answering the link): its end comes back through :attr:`ended`."""
        m = a.meta or {}
        array: dict[str, Any] = {}
        if "typestr" in m:  # checked at the descriptor: the array arrives as it left
            dl = m.get("dl_dtype")
            array = {"shape": tuple(m["shape"]), "dtype": dlpack.EXTRA_BY_CODE[dl[0]][0] if dl else m["typestr"],
                     "readonly": bool(m.get("readonly", False))}
        dest = a.dest

        def released(ticket: Ticket) -> None:  # runs in whichever thread pumps the session: queue it
            self.ended.append((dest, ticket))

        try:
            self.producer.send(buf, SyncMode.PRODUCER_SYNCED, block=False, on_release=released, meta=m.get("user"),
                               **array)
            self.delivered += 1
        except (BrokerUnavailable, TimeoutError) as e:
            # The local broker is gone: this buffer cannot be handed on. Drop it (loudly) and keep
            # the link; the session re-registers when the broker is back.
            self._feed(HandOnFailed(dest, str(e), self.producer.holds(buf), time.monotonic()))

    def _settle(self) -> None:
        """Tell the core about the handoffs that ended since the last round (:attr:`ended`), in the
        loop's thread (it decides: hand on again, keep, or give back)."""
        while self.ended:
            dest, ticket = self.ended.popleft()
            err = ticket.error
            self._feed(HandoffEnded(dest, time.monotonic(),
                                    consumer_gone=err is not None and err.code in ("consumer_gone", "unknown_grant"),
                                    error=None if err is None else str(err),
                                    fenced=ticket.outcome == "consumer_fenced"))

    def _hand_on(self) -> bool:
        """Hand on every buffer the core has ready, in its order, while a local consumer has asked:
        never waiting for one (the loop must go on answering the link). True when a buffer waits
        for a consumer (an ended transfer's CREDIT goes when it is handed on: that is the sender's
        backpressure)."""
        while True:
            self._settle()  # a handoff that came back since is older than any partial transfer
            if not self.core.ready:
                return False
            try:
                if not self.producer.grant_ready(0):
                    return True
            except BrokerUnavailable:  # the session says hello again on its own; the buffer waits
                return True
            self._feed(ConsumerAsked(time.monotonic()))

    def _handle(self, parts: list[zmq.Frame]) -> None:
        """One link message from the sender, decoded once (wire/link.py), to the core."""
        try:
            msg: link.LinkMessage | link.TransferFault = link.decode(parts, link.FROM_SENDER)
        except link.TransferFault as e:
            msg = e
        except ProtocolError as e:
            log.warning(json.dumps({"event": "bad_message", "error": str(e)}))
            return
        self._feed(LinkReceived(msg, time.monotonic()))
        if not isinstance(msg, link.TensorData):  # one may have ended, or been dropped before the others
            self._hand_on()

    def serve(self, stop: threading.Event | None = None) -> None:
        stop = stop or threading.Event()
        self.running = True
        try:
            while not stop.is_set():
                self._feed(Tick(time.monotonic()))
                self._announce()
                offered = self.engine is not None and self.core.offered
                if offered and self.engine is not None:
                    try:
                        self.engine.progress()  # UCX may need us for a WRITE into an offered region to land
                    except RdmaError as e:  # the sender's REJECT or the link timeout ends the transfer
                        log.warning(json.dumps({"event": "rdma_progress_failed", "error": str(e)}))
                faulting = self._fault_in()
                waiting = self._hand_on()  # a local consumer may have asked since
                wait = 0 if faulting else POLL_RDMA_S if offered else POLL_QUEUED_S if waiting else POLL_IDLE_S
                if self.sock.poll(int(wait * 1000)):
                    until = time.monotonic() + DRAIN_S
                    while time.monotonic() < until:  # then round the loop: pings, liveness, faulting in
                        try:
                            # copy=False: each data chunk is copied once, socket to shared memory
                            frames = self.sock.recv_multipart(zmq.NOBLOCK, copy=False)
                        except zmq.Again:
                            break
                        try:
                            self._handle(frames)
                        except Exception:  # noqa: BLE001 - one bad message must not end the bridge
                            log.exception("handling a link message failed; the bridge goes on")
        finally:
            self.close()

    def close(self) -> None:
        if self.running:
            self.running = False
            log.info(json.dumps({"event": "bridge_closed", "side": "in", **self.stats,
                                 "nixl_registrations": self.engine.registered_total if self.engine else None}))
            self._feed(Closing(time.monotonic()))
            # Held buffers come back to the pool (or are freed) first. A bridge stopping does not
            # end the stream of the channel it feeds: its upstream producers did not end it.
            self.producer.close(end=False)
            self._settle()
            self._feed(Closed(time.monotonic()))  # what is still quarantined is left to exit (R4.4)
            self.pool.close()
            if self.device_pool is not None:
                self.device_pool.close()
            if self.engine is not None:
                self.engine.close()
            self.sock.close(linger=0)
            self.ctx.term()



def parser() -> argparse.ArgumentParser:
    """The command line of ``python -m hurray_ipc.broker.bridge`` (:func:`main`)."""
    ap = argparse.ArgumentParser(prog="python -m hurray_ipc.broker.bridge", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    k = sub.add_parser("keygen", help="write server and client CurveZMQ certificates into DIR")
    k.add_argument("dir")
    for name in ("out", "in"):
        s = sub.add_parser(name)
        s.add_argument("--channel", required=True)
        s.add_argument("--endpoint", default=None, help=f"the local broker (default {default_endpoint()})")
        s.add_argument("--insecure", action="store_true", help="plaintext TCP (no CurveZMQ)")
        s.add_argument("--timeout", type=float, default=3.0)
        s.add_argument("--duration", type=float, default=None)
        s.add_argument("--rdma", action="store_true",
                       help="offer NIXL (UCX) as the data plane; its bytes do not ride CurveZMQ, so use it only "
                            "on a trusted fabric (interchange.md R1.5); without nixl the link stays on zmq")
        s.add_argument("--log-file", metavar="PATH", help="append the log to PATH instead of stderr")
        s.add_argument("--log-format", choices=FORMATS, default="json")
        s.add_argument("--log-level", choices=LOG_LEVELS, default="info")
        # The broker that runs this bridge (hurray_ipc/broker/supervise.py): leave when it is gone.
        s.add_argument("--parent", type=int, default=None, help=argparse.SUPPRESS)
    o, i = sub.choices["out"], sub.choices["in"]
    o.add_argument("--listen", required=True,
                   help="the address to bind, e.g. tcp://*:5555 (tcp://*:* binds a free port and logs it, event "
                        "bridge_listening: peers connect to this host's address on that port)")
    o.add_argument("--device", default="cpu",
                   help="take buffers as cpu (GPU ones host-staged by their producer) or cuda:N (GPU memory: read "
                        "in place by NIXL where it takes VRAM, else copied to host here)")
    o.add_argument("--server-key", help="server secret certificate (keygen: server.key_secret)")
    o.add_argument("--clients", help="directory of authorised client public certificates")
    i.add_argument("--connect", required=True)
    i.add_argument("--client-key", help="client secret certificate (keygen: client.key_secret)")
    i.add_argument("--server-public", help="the server's public certificate (keygen: server.key)")
    i.add_argument("--device", default="cpu", help="hand buffers on as cpu or cuda:N")
    i.add_argument("--window", type=int, default=WINDOW,
                   help=f"transfers granted ahead and held at once (1-{MAX_WINDOW}); memory: window x buffer size")
    return ap


def bound_endpoint(log_text: str) -> str | None:
    """The address a sending bridge bound, from its log in ``--log-format json`` (the bridge's
    default; its ``bridge_listening`` line), or None while that line is not there whole: what a
    caller that passed ``--listen tcp://HOST:*`` reads to learn the port."""
    for line in log_text.splitlines():
        try:
            rec = json.loads(line)
        except ValueError:  # not JSON, or the last line half written
            continue
        if isinstance(rec, dict) and rec.get("event") == "bridge_listening":
            return str(rec["endpoint"])
    return None


def wait_bound(read_log: Callable[[], str], running: Callable[[], bool], timeout: float) -> str | None:
    """The address a sending bridge started with ``--listen tcp://HOST:*`` bound: ``read_log()``
    (its whole log so far) is read every 20 ms until :func:`bound_endpoint` finds it. None once
    ``running()`` is false or ``timeout`` seconds passed without it; the caller then stops the bridge
    and reports its log."""
    deadline = time.monotonic() + timeout
    while (url := bound_endpoint(read_log())) is None:
        if not running() or time.monotonic() > deadline:
            return None
        time.sleep(0.02)
    return url


def build(a: argparse.Namespace, route_key: str | None = None) -> BridgeOut | BridgeIn:
    """The bridge that the parsed command line ``a`` (an ``out`` or ``in`` of :func:`parser`) names,
    not yet serving. Raises OSError, ValueError or zmq.ZMQError (keys, endpoints) and DeviceError."""
    if a.cmd == "out":
        curve = None if a.insecure else Curve.server(a.server_key or "", a.clients or "")
        return BridgeOut(a.channel, a.listen, endpoint=a.endpoint, curve=curve, timeout_s=a.timeout,
                         rdma=a.rdma, device=a.device, route_key=route_key)
    curve = None if a.insecure else Curve.client(a.client_key or "", a.server_public or "")
    return BridgeIn(
        a.channel, a.connect, endpoint=a.endpoint, curve=curve, device=a.device, timeout_s=a.timeout,
        rdma=a.rdma, window=a.window, route_key=route_key,
    )


def main(argv: list[str] | None = None) -> int:
    a = parser().parse_args(argv)
    if a.cmd == "keygen":
        keygen(a.dir)
        print(f"certificates written to {a.dir}")
        return 0
    why = configure_logging(a.log_file, a.log_format, a.log_level)
    if why is not None:
        print(f"bridge: {why}", file=sys.stderr)
        return 2
    # The key its ROUTE needs (ipc-protocol.md §2.4): from the broker that started it, else read
    # from the broker's owner-only file.
    route_key = os.environ.pop("HURRAY_ROUTE_KEY", None)
    try:
        bridge = build(a, route_key)
    except (OSError, ValueError, zmq.ZMQError) as e:
        print(f"bridge: {e} (CurveZMQ keys are required unless --insecure)", file=sys.stderr)
        return 2
    except DeviceError as e:
        print(f"bridge: --device {a.device}: {e}", file=sys.stderr)
        return 2
    stop = threading.Event()
    import signal

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    if a.duration:
        threading.Timer(a.duration, stop.set).start()
    if a.parent is not None:
        threading.Thread(target=_leave_with, args=(a.parent, stop), name="parent-watch", daemon=True).start()
    bridge.serve(stop)
    return 0


def _leave_with(parent: int, stop: threading.Event) -> None:
    """Set ``stop`` once ``parent`` (the broker that started this bridge) is no longer our parent:
    a broker killed outright must not leave its bridges holding their ports and handoffs."""
    while not stop.wait(0.5):
        if os.getppid() != parent:
            log.warning(json.dumps({"event": "broker_gone", "parent": parent}))
            stop.set()


if __name__ == "__main__":
    sys.exit(main())
