"""The Hurray broker: matches consumer requests with producers, routes handoffs and releases.

One thread, one ZeroMQ ROUTER socket. The broker never touches device memory: it validates the
16-byte handle and the declared sync mode against the pair's capabilities (the same
:func:`pair_modes` the producer used), forwards the out-of-band IPC blobs untouched, issues an
unguessable release token bound to the receiving consumer, and routes releases back.

Flow control is pull/credit: a consumer's REQUEST adds credits to its channel's queue; a
producer's READY asks for grants; each grant pairs one request with one producer, so a producer is
never handed more than consumers asked for, and a slow consumer, which simply asks less, holds up
nobody else.

Failure handling: any message that fails validation gets an ERROR to its sender and a log line,
and changes no other client's state. A client is dead after ``timeout_s`` of silence, or at once
when its process is gone (same host). A dead consumer's handoffs and events are released back to
their producers; a dead producer's consumers get PRODUCER_GONE for its handoffs, and its unfilled
grants go back to the front of the queue. After a broker restart clients register again and report
what they hold, so deliveries made through the old broker can still be released.
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import secrets
import signal
import time
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import zmq

from hurray_ipc.contract.sync import Transport
from hurray_ipc.devices import shm
from hurray_ipc.devices.base import host_id
from hurray_ipc.format.handle import BufferHandle, DeviceTag, HandleError, SyncMode
from hurray_ipc.transport.pairing import Endpoint, PairModes, host_side, pair_modes
from hurray_ipc.transport.protocol import (
    CLIENT_VERBS,
    PROTOCOL_VERSION,
    Message,
    ProtocolError,
    decode,
    error,
    field_of,
)

log = logging.getLogger("hurray.broker")
MAX_CREDITS = 4096
_RELEASED_MEMORY = 100_000  # released tokens remembered, to tell "already released" from "unknown"


@dataclass
class Client:
    rid: bytes
    role: str
    channel: str
    endpoint: Endpoint
    name: str
    last_seen: float
    credits: int = 0  # consumer: requests not yet granted; producer: READY not yet granted
    epoch: int = 0  # the client's registration number, echoed in GRANT
    pairs: dict = field(default_factory=dict)  # producer side: (consumer Client id, cpu?) -> PairModes


@dataclass
class Grant:
    gid: int
    producer: bytes
    consumer: bytes
    channel: str
    consumer_gone: bool = False


@dataclass
class Delivery:
    token: str
    producer: bytes
    consumer: bytes
    handoff_id: int
    event_pending: bool
    since: float = field(default_factory=time.monotonic)


@dataclass
class Channel:
    requests: deque = field(default_factory=deque)  # consumer rids, one entry per credit
    producers: "OrderedDict[bytes, None]" = field(default_factory=OrderedDict)  # round-robin order


@dataclass
class Stats:
    handoffs: int = 0
    releases: int = 0
    rejected: int = 0
    errors: int = 0
    consumers_lost: int = 0
    producers_lost: int = 0


class Broker:
    def __init__(self, endpoint: str, *, timeout_s: float = 3.0, heartbeat_s: float = 0.5, group: bool = False,
                 ctx: zmq.Context | None = None):
        self.endpoint = endpoint
        self.timeout_s = timeout_s
        self.heartbeat_s = heartbeat_s
        self.session = secrets.token_hex(8)
        self.host = host_id()
        self.ctx = ctx or zmq.Context.instance()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.ROUTER_HANDOVER, 1)  # a reconnecting client keeps its identity
        self.sock.setsockopt(zmq.LINGER, 0)
        self._bind(group)
        self.clients: dict[bytes, Client] = {}
        self.channels: dict[str, Channel] = {}
        self.grants: dict[int, Grant] = {}
        self.deliveries: dict[str, Delivery] = {}
        self.released: "OrderedDict[str, bytes]" = OrderedDict()
        self.orphans: dict[tuple[bytes, int], float] = {}  # (producer, handoff) -> release deadline
        # Random start: a grant id a client kept from a previous broker never names one of ours.
        self._gids = itertools.count(secrets.randbits(40) << 8)
        self.stats = Stats()
        self.running = False
        self._last_sweep = 0.0

    def _bind(self, group: bool) -> None:
        if self.endpoint.startswith("ipc://"):
            path = Path(self.endpoint[len("ipc://"):])
            path.parent.mkdir(parents=True, exist_ok=True, mode=0o750 if group else 0o700)
            old = os.umask(0o007 if group else 0o077)
            try:
                if path.exists():
                    path.unlink()  # a stale socket file of a dead broker
                self.sock.bind(self.endpoint)
            finally:
                os.umask(old)
            os.chmod(path, 0o660 if group else 0o600)
        else:
            self.sock.bind(self.endpoint)
            self.endpoint = self.sock.getsockopt_string(zmq.LAST_ENDPOINT)

    # --- plumbing --------------------------------------------------------------------------
    def _send(self, rid: bytes, msg: Message) -> None:
        try:
            self.sock.send_multipart([rid, *msg.encode()], zmq.NOBLOCK)
        except zmq.Again:
            log.warning(json.dumps({"event": "send_dropped", "client": rid.decode(errors="replace"), "verb": msg.verb}))

    def _error(self, rid: bytes, code: str, message: str, **extra: Any) -> None:
        self.stats.errors += 1
        log.warning(json.dumps({"event": "error", "client": rid.decode(errors="replace")[:32], "code": code,
                                "message": message, **extra}))
        self._send(rid, error(code, message, **extra))

    def _channel(self, name: str) -> Channel:
        ch = self.channels.get(name)
        if ch is None:
            ch = self.channels[name] = Channel()
        return ch

    # --- the loop --------------------------------------------------------------------------
    def serve(self, stop_after: float | None = None) -> None:
        """Run until SIGTERM/SIGINT (when in the main thread), ``stop()``, or ``stop_after`` s."""
        self.running = True
        end = None if stop_after is None else time.monotonic() + stop_after
        log.info(json.dumps({"event": "listening", "endpoint": self.endpoint, "session": self.session}))
        poller = zmq.Poller()
        poller.register(self.sock, zmq.POLLIN)
        try:
            while self.running and (end is None or time.monotonic() < end):
                for _ in dict(poller.poll(50)):
                    for _ in range(1000):  # drain, but keep sweeping under load
                        try:
                            parts = self.sock.recv_multipart(zmq.NOBLOCK)
                        except zmq.Again:
                            break
                        self.handle(parts)
                now = time.monotonic()
                if now - self._last_sweep >= 0.05:
                    self._last_sweep = now
                    self.sweep(now)
        finally:
            self.shutdown("broker stopping")

    def stop(self) -> None:
        self.running = False

    def install_signal_handlers(self) -> None:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: self.stop())

    def shutdown(self, reason: str) -> None:
        if self.sock.closed:
            return
        for rid in list(self.clients):
            self._send(rid, Message("SHUTDOWN", {"reason": reason}))
        log.info(json.dumps({"event": "shutdown", "reason": reason, "clients": len(self.clients),
                             **self.stats.__dict__}))
        self.sock.close(linger=200)
        if self.endpoint.startswith("ipc://"):
            Path(self.endpoint[len("ipc://"):]).unlink(missing_ok=True)

    def handle(self, parts: list[bytes]) -> None:
        """Handle one message; nothing a client sends can raise out of here."""
        if len(parts) < 1:
            return
        rid, body = parts[0], parts[1:]
        try:
            msg = decode(body, allowed=CLIENT_VERBS)
            client = self.clients.get(rid)
            if client is not None:
                client.last_seen = time.monotonic()
            if msg.verb == "HELLO":
                self.on_hello(rid, msg)
                return
            if msg.verb == "CAPS":
                self.on_caps(rid, msg)
                return
            if client is None:
                raise ProtocolError("not_registered", f"{msg.verb} before HELLO (or the broker restarted): send HELLO")
            getattr(self, "on_" + msg.verb.lower())(client, msg)
        except ProtocolError as e:
            extra = {}
            if len(body) >= 2:
                try:
                    hdr = json.loads(bytes(body[1]))
                    if isinstance(hdr, dict):
                        extra = {k: hdr[k] for k in ("handoff_id", "request_id", "token") if k in hdr}
                except ValueError:
                    pass
            extra.update(e.extra)
            self._error(rid, e.code, str(e), ref=bytes(body[0])[:32].decode(errors="replace") if body else "", **extra)
        except Exception as e:  # noqa: BLE001 - a bug must cost one message, never the broker
            log.exception("internal error handling a message")
            self._error(rid, "bad_header", f"internal error: {e!r}")

    # --- registration ----------------------------------------------------------------------
    def on_hello(self, rid: bytes, msg: Message) -> None:
        version = field_of(msg, "protocol", int)
        if version != PROTOCOL_VERSION:
            raise ProtocolError("protocol_version", f"this broker speaks protocol {PROTOCOL_VERSION}, not {version}")
        role = field_of(msg, "role", str)
        if role not in ("producer", "consumer"):
            raise ProtocolError("bad_header", f"role must be 'producer' or 'consumer', not {role!r}")
        channel = field_of(msg, "channel", str)
        if not channel or len(channel) > 256:
            raise ProtocolError("bad_header", "channel must be a non-empty string of at most 256 characters")
        try:
            endpoint = Endpoint.from_dict(field_of(msg, "endpoint", dict))
        except (KeyError, TypeError, ValueError) as e:
            raise ProtocolError("bad_header", f"endpoint: {e!r}") from None
        if rid in self.clients:
            self._reregister(rid)
        credits = field_of(msg, "credits", int, optional=True) or 0
        if not 0 <= credits <= MAX_CREDITS:
            raise ProtocolError("bad_header", f"credits must be 0..{MAX_CREDITS}, got {credits}")
        epoch = field_of(msg, "epoch", int, optional=True) or 0
        c = Client(rid, role, channel, endpoint, str(msg.header.get("name", ""))[:128], time.monotonic(), credits, epoch)
        self.clients[rid] = c
        ch = self._channel(channel)
        if role == "producer":
            ch.producers[rid] = None
            self._restore_outstanding(c, msg.header.get("outstanding") or [])
        else:
            ch.requests.extend([rid] * credits)
            self._restore_held(c, msg.header.get("held") or [])
        self._send(rid, Message("WELCOME", {"protocol": PROTOCOL_VERSION, "session": self.session,
                                            "heartbeat_ms": int(self.heartbeat_s * 1000),
                                            "timeout_ms": int(self.timeout_s * 1000)}))
        log.info(json.dumps({"event": "hello", "client": rid.decode(errors="replace"), "role": role,
                             "channel": channel, "device": endpoint.identity.spec, "pid": endpoint.pid}))
        self._match(channel)

    def _restore_held(self, c: Client, held: list[Any]) -> None:
        """A consumer re-registering after a broker restart: keep its deliveries releasable."""
        for item in held[:MAX_CREDITS]:
            if not isinstance(item, dict) or not isinstance(item.get("token"), str):
                continue
            token, prod = item["token"], str(item.get("producer_id", "")).encode()
            hid = int(item.get("handoff_id", 0))
            if token in self.deliveries:
                continue
            self.deliveries[token] = Delivery(token, prod, c.rid, hid, bool(item.get("event_pending")))
            self.orphans.pop((prod, hid), None)

    def _restore_outstanding(self, c: Client, outstanding: list[Any]) -> None:
        """A producer re-registering: handoffs no consumer claims within the timeout come back."""
        claimed = {(d.producer, d.handoff_id) for d in self.deliveries.values()}
        deadline = time.monotonic() + self.timeout_s
        for hid in outstanding[:MAX_CREDITS]:
            if isinstance(hid, int) and (c.rid, hid) not in claimed:
                self.orphans[(c.rid, hid)] = deadline

    def on_bye(self, c: Client, msg: Message) -> None:
        self._drop(c.rid, "bye")

    def on_ping(self, c: Client, msg: Message) -> None:
        self._send(c.rid, Message("PONG", {}))

    # --- flow control ----------------------------------------------------------------------
    def _credits(self, msg: Message) -> int:
        n = field_of(msg, "credits", int)
        if not 1 <= n <= MAX_CREDITS:
            raise ProtocolError("bad_header", f"credits must be 1..{MAX_CREDITS}, got {n}")
        return n

    def on_request(self, c: Client, msg: Message) -> None:
        if c.role != "consumer":
            raise ProtocolError("wrong_role", "REQUEST is a consumer's message")
        self._add_requests(c, self._credits(msg))

    def _add_requests(self, c: Client, n: int) -> None:
        n = min(n, MAX_CREDITS - c.credits)
        c.credits += n
        self._channel(c.channel).requests.extend([c.rid] * n)
        self._match(c.channel)

    def on_ready(self, c: Client, msg: Message) -> None:
        if c.role != "producer":
            raise ProtocolError("wrong_role", "READY is a producer's message")
        self._add_ready(c, self._credits(msg))

    def _add_ready(self, c: Client, n: int) -> None:
        c.credits = min(MAX_CREDITS, c.credits + n)
        self._match(c.channel)

    def _piggyback(self, msg: Message, name: str) -> int:
        """Credits carried on a HANDOFF (``ready``) or RELEASE (``credits``): one message fewer."""
        n = field_of(msg, name, int, optional=True)
        if n is None:
            return 0
        if not 1 <= n <= MAX_CREDITS:
            raise ProtocolError("bad_header", f"{name} must be 1..{MAX_CREDITS}, got {n}")
        return n

    def _match(self, name: str) -> None:
        ch = self._channel(name)
        while ch.requests:
            producer = next((p for p in ch.producers if self.clients[p].credits > 0), None)
            if producer is None:
                return
            ch.producers.move_to_end(producer)  # round robin
            consumer_rid = ch.requests.popleft()
            consumer = self.clients.get(consumer_rid)
            if consumer is None:
                continue
            consumer.credits -= 1
            self.clients[producer].credits -= 1
            g = Grant(next(self._gids), producer, consumer_rid, name)
            self.grants[g.gid] = g
            self._send(producer, Message("GRANT", {"grant_id": g.gid, "epoch": self.clients[producer].epoch,
                                                   "consumer_id": consumer_rid.decode(),
                                                   "consumer": consumer.endpoint.to_dict()}))

    # --- handoffs --------------------------------------------------------------------------
    def expected_modes(self, producer: Client, consumer: Client, handle: BufferHandle) -> PairModes:
        cpu = handle.device_tag is DeviceTag.CPU
        key = (id(consumer), cpu)  # a re-registered consumer is a new Client object: a new key
        pm = producer.pairs.get(key)
        if pm is None:
            ep = host_side(producer.endpoint) if cpu else producer.endpoint
            if len(producer.pairs) > 1024:
                producer.pairs.clear()
            pm = producer.pairs[key] = pair_modes(ep, consumer.endpoint)
        return pm

    def on_handoff(self, c: Client, msg: Message) -> None:
        if c.role != "producer":
            raise ProtocolError("wrong_role", "HANDOFF is a producer's message")
        gid = field_of(msg, "grant_id", int)
        hid = field_of(msg, "handoff_id", int)
        ready = self._piggyback(msg, "ready")
        if ready:
            self._add_ready(c, ready)  # before validation: a refused handoff still asked for more
        g = self.grants.get(gid)
        if g is None or g.producer != c.rid:
            raise ProtocolError("unknown_grant", f"grant {gid} is not one this producer holds")
        del self.grants[gid]  # a grant is used once, whatever the outcome
        consumer = self.clients.get(g.consumer)
        if consumer is None or g.consumer_gone:
            self.stats.rejected += 1
            raise ProtocolError("consumer_gone", f"the consumer of grant {gid} died before the handoff arrived")
        try:
            try:
                handle = BufferHandle.decode(msg.frames["handle"])
            except HandleError as e:
                raise ProtocolError("bad_handle", str(e), reason=e.reason) from None
            self._check_handoff(c, consumer, msg, handle)
        except ProtocolError:
            # The consumer's request is not lost with a bad handoff: it goes back to the front.
            self._channel(g.channel).requests.appendleft(g.consumer)
            consumer.credits += 1
            self.stats.rejected += 1
            raise
        token = secrets.token_urlsafe(24)
        self.deliveries[token] = Delivery(token, c.rid, g.consumer, hid, handle.sync_mode is SyncMode.EVENT)
        header = {k: msg.header[k] for k in ("handoff_id", "size", "meta", "staged", "inproc", "inproc_ref", "offset")
                  if k in msg.header}
        header.update(token=token, producer_id=c.rid.decode())
        self._send(g.consumer, Message("DELIVER", header, dict(msg.frames)))
        self._send(c.rid, Message("ACCEPTED", {"handoff_id": hid}))
        self.stats.handoffs += 1

    def _check_handoff(self, producer: Client, consumer: Client, msg: Message, handle: BufferHandle) -> None:
        pm = self.expected_modes(producer, consumer, handle)
        mode = handle.sync_mode
        if mode not in pm.valid:
            why = pm.reasons.get(mode) or "not valid for this pair"
            raise ProtocolError("mode_not_valid", f"{mode.wire_name} for a {handle.device_tag.name} buffer "
                                f"from {producer.endpoint.identity.spec} to {consumer.endpoint.identity.spec} "
                                f"over {pm.transport.value}: {why}")
        inproc = bool(msg.header.get("inproc"))
        if inproc != (pm.transport is Transport.IN_PROCESS):
            raise ProtocolError("payload_mismatch", "inproc flag does not match the endpoints' processes")
        if inproc:
            if not isinstance(msg.header.get("inproc_ref"), str) or len(msg.frames) != 1:
                raise ProtocolError("payload_mismatch", "an in-process handoff carries an inproc_ref and no blobs")
            return
        if "memory" not in msg.frames:
            raise ProtocolError("payload_mismatch", "an IPC handoff needs the memory blob frame")
        offset = field_of(msg, "offset", int)
        if offset < 0:
            raise ProtocolError("bad_header", f"offset must be >= 0, got {offset}")
        if (mode is SyncMode.EVENT) != ("event" in msg.frames):
            raise ProtocolError("payload_mismatch",
                                f"{mode.wire_name} {'needs' if mode is SyncMode.EVENT else 'carries no'} event blob frame")

    # --- releases --------------------------------------------------------------------------
    def _delivery_of(self, c: Client, msg: Message) -> Delivery:
        if c.role != "consumer":
            raise ProtocolError("wrong_role", f"{msg.verb} is a consumer's message")
        token = field_of(msg, "token", str)
        d = self.deliveries.get(token)
        if d is None:
            if token in self.released:
                raise ProtocolError("already_released", f"token {token[:8]}... was already released")
            raise ProtocolError("unknown_token", f"token {token[:8]}... is not one this broker issued")
        if d.consumer != c.rid:
            raise ProtocolError("foreign_token", f"token {token[:8]}... was delivered to another consumer")
        return d

    def on_event_release(self, c: Client, msg: Message) -> None:
        d = self._delivery_of(c, msg)
        if not d.event_pending:
            raise ProtocolError("already_released", "this handoff's event was already released (or it has none)")
        d.event_pending = False
        if d.producer in self.clients:
            self._send(d.producer, Message("EVENT_RELEASED", {"handoff_id": d.handoff_id}))

    def on_release(self, c: Client, msg: Message) -> None:
        credits = self._piggyback(msg, "credits")
        d = self._delivery_of(c, msg)
        self._release(d, str(msg.header.get("reason", "released"))[:200])
        if credits:
            self._add_requests(c, credits)

    def _release(self, d: Delivery, reason: str) -> None:
        self.deliveries.pop(d.token, None)
        self.released[d.token] = d.consumer
        while len(self.released) > _RELEASED_MEMORY:
            self.released.popitem(last=False)
        self.stats.releases += 1
        if d.producer in self.clients:
            if d.event_pending:
                self._send(d.producer, Message("EVENT_RELEASED", {"handoff_id": d.handoff_id, "reason": reason}))
            self._send(d.producer, Message("RELEASED", {"handoff_id": d.handoff_id, "reason": reason}))

    # --- capability queries ----------------------------------------------------------------
    def on_caps(self, rid: bytes, msg: Message) -> None:
        """CAPS {device: endpoint, peer?: endpoint, channel?, transport?} -> CAPS_REPLY."""
        try:
            me = Endpoint.from_dict(field_of(msg, "device", dict))
            peer_d = msg.header.get("peer")
            peer = Endpoint.from_dict(peer_d) if isinstance(peer_d, dict) else None
        except (KeyError, TypeError, ValueError) as e:
            raise ProtocolError("bad_header", f"CAPS endpoint: {e!r}") from None
        transport = msg.header.get("transport")
        t = Transport.parse(transport) if isinstance(transport, str) else None
        channel = msg.header.get("channel")
        reply: dict[str, Any] = {"request_id": msg.header.get("request_id")}
        if peer is not None:
            reply.update(pair_modes(me, peer, t).to_dict())
        elif isinstance(channel, str) and channel in self.channels:
            per = []
            for rid2, cl in self.clients.items():
                if cl.channel == channel and cl.role == "consumer":
                    per.append({"consumer_id": rid2.decode(), "name": cl.name, **pair_modes(me, cl.endpoint, t).to_dict()})
            reply["consumers"] = per
            if per:
                reply.update({k: per[0][k] for k in ("transport", "device_tag", "valid_sync_modes", "excluded", "host_staged")})
        if "valid_sync_modes" not in reply:
            # No consumer named: answer for a consumer on the same device, as hurray-caps does.
            reply.update(pair_modes(me, me, t or Transport.IPC).to_dict())
        self._send(rid, Message("CAPS_REPLY", reply))

    # --- liveness --------------------------------------------------------------------------
    def sweep(self, now: float) -> None:
        for rid, c in list(self.clients.items()):
            same_host = c.endpoint.identity.host == self.host
            if now - c.last_seen > self.timeout_s:
                self._drop(rid, "heartbeat timeout")
            elif same_host and not shm.pid_alive(c.endpoint.pid):
                self._drop(rid, "process gone")
        for key, deadline in list(self.orphans.items()):
            if now >= deadline:
                del self.orphans[key]
                if key[0] in self.clients:
                    self._send(key[0], Message("RELEASED", {"handoff_id": key[1], "reason": "consumer_gone"}))
        # Deliveries a consumer re-registered whose producer never came back to this broker.
        lost = [d for d in self.deliveries.values() if d.producer not in self.clients and now - d.since > self.timeout_s]
        if lost:
            self._producer_gone(lost)

    def _producer_gone(self, ds: list[Delivery]) -> None:
        by_consumer: dict[bytes, list[str]] = {}
        for d in ds:
            self.deliveries.pop(d.token, None)
            by_consumer.setdefault(d.consumer, []).append(d.token)
        for rid, tokens in by_consumer.items():
            self._send(rid, Message("PRODUCER_GONE", {"tokens": tokens}))

    def _void_credits(self, c: Client) -> None:
        """Forget a client's queued credits and grants: a producer's grants give their consumers'
        credits back (front of the queue); grants *for* a consumer must go to another consumer."""
        ch = self._channel(c.channel)
        ch.requests = deque(r for r in ch.requests if r != c.rid)
        ch.producers.pop(c.rid, None)
        for g in list(self.grants.values()):
            if g.producer == c.rid:
                del self.grants[g.gid]
                consumer = self.clients.get(g.consumer)
                if consumer is not None:
                    ch.requests.appendleft(g.consumer)
                    consumer.credits += 1
            elif g.consumer == c.rid:
                g.consumer_gone = True

    def _reregister(self, rid: bytes) -> None:
        """A registered client said HELLO again (it thought us gone). Its credits and grants are
        void, as its HELLO re-declares them; its deliveries stay bound: they are real."""
        self._void_credits(self.clients.pop(rid))

    def _drop(self, rid: bytes, why: str) -> None:
        c = self.clients.pop(rid, None)
        if c is None:
            return
        log.info(json.dumps({"event": "client_gone", "client": rid.decode(errors="replace"), "role": c.role,
                             "why": why, "pid": c.endpoint.pid}))
        self._void_credits(c)
        if c.role == "consumer":
            self.stats.consumers_lost += why != "bye"
            for d in [d for d in self.deliveries.values() if d.consumer == rid]:
                self._release(d, "consumer_gone")
        else:
            self.stats.producers_lost += why != "bye"
            self._producer_gone([d for d in self.deliveries.values() if d.producer == rid])
            self.orphans = {k: v for k, v in self.orphans.items() if k[0] != rid}
            self._match(c.channel)
        if why != "bye" and c.endpoint.identity.host == self.host:
            removed = shm.cleanup_stale()
            if removed:
                log.info(json.dumps({"event": "stale_segments_removed", "count": len(removed)}))
