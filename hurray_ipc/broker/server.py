"""The Hurray broker's socket loop: a thin ZeroMQ shell around :class:`broker.core.BrokerCore`.

One thread, one ZeroMQ ROUTER socket. Everything the broker decides is in the core (pure, tested
over every interleaving); this loop only receives frames, passes them in with the time, sends what
comes out, judges same-host clients' liveness by their lease (transport/liveness.py), and runs the
effects (stale-segment sweeps). See hurray_ipc/broker/DESIGN.md.

Socket policy (docs/spec/ipc-protocol.md §1, §5):
- ROUTER_MANDATORY: a message for a disconnected peer raises instead of vanishing; the core counts
  it (``undeliverable``). The outgoing high-water mark sits far above what MAX_CREDITS can queue,
  so a full queue (``dropped_full``) means a peer that stopped reading; it is counted and logged.
  The incoming one is small (RCV_HWM): a peer that sends faster than the broker reads waits.
- No ROUTER_HANDOVER: a second connection cannot take over a connected client's routing id.
- MAXMSGSIZE: a frame over 4 MiB drops its connection unread (no answer); up to that size an
  oversized header is refused with bad_header as the spec says.
- ``ipc://`` endpoints: one broker per socket file (``hurray_ipc/broker/lock.py``); the socket directory must
  not be writable by other users.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import time
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import zmq

from hurray_ipc.client.endpoint import check_socket_dir
from hurray_ipc.devices import shm
from hurray_ipc.devices.base import host_id
from hurray_ipc.transport import liveness
from hurray_ipc.transport.sockets import NOBLOCK, readable, recv_frames, send_frames
from hurray_ipc.wire.ipc import encode_group, parcels
from hurray_ipc.wire.messages import MAX_CREDITS, AnyMessage

from .core import BrokerCore, CleanSegments, Client, Out, Send
from .keyfile import kept_token, route_key_path
from .lock import BrokerAlreadyRunning, EndpointLock, acquire_endpoint

__all__ = ["MAX_CREDITS", "Broker", "BrokerAlreadyRunning"]

log = logging.getLogger("hurray.broker")
HWM = 16 * MAX_CREDITS + 1024  # per peer, outgoing: every credit's DELIVER/RELEASED and then some
# Per peer, incoming: past it ZeroMQ stops reading that peer (its own queue fills and its send
# waits), so nothing is lost. A client's traffic is bounded by its credits and batched (8192 held
# deliveries are 128 RELEASE batches), so it needs far less. 200 connections flooding STATS made the
# broker hold 66,560 messages each at HWM: its RSS grew by 200 MB/s to 2.27 GB; at 1024 it stayed
# at 320 MB, at 256 at 126 MB (measured 2026-12-07).
RCV_HWM = 256
LIVENESS_PERIOD_S = 0.2  # how often a same-host client's lease is probed
MAX_FRAME = 4 << 20  # bytes: the largest inbound frame a peer may send (spec §2); a legal one is <= 2 MiB (HELLO)
SWEEP_PERIOD_S = 30.0  # stale segments and leases of dead processes
STATS_CACHE_S = 0.25  # a STATS_REPLY may be this old: a flood of STATS costs one snapshot per period
# One drain round (Broker.round) ends after this many entries (a batch counts its entries), this
# long, or one peer's this many messages, and then what it produced is sent. ZeroMQ reads peers in
# turn, one message each whatever it costs, so a round bounded only by messages held a quiet
# client's answer behind hundreds of a flooder's 64-entry batches (measured 2026-12-07: a healthy
# pair fell from 1,600 to 0-1 handoffs/s), and one bounded only by entries and time held it for the
# whole 2 ms behind a client's PINGs sent within its message rate (a pair at 1,174/s fell to 142/s;
# with the bound per peer, 692-726/s, scripts/floods.py deaf-pings, 2026-12-07). A client in step
# with the broker seldom sends 8 messages in one round (in the bench's window-8 rows at 4 KiB, 1
# round in 2,000 handoffs ended that way); a producer whose send()s arrive 64 at a time has
# its rounds cut every 8, perhaps 10% of its rate (broker/DESIGN.md, Known limits).
ROUND_ENTRIES = 256
ROUND_S = 0.002
ROUND_PEER_MESSAGES = 8
round_clock = time.monotonic  # what Broker.round reads the time with (tests drive it by hand)


class Broker:
    """Bind ``endpoint`` and serve. ``group``: share the socket (and its directory) with the group."""

    def __init__(self, endpoint: str, *, timeout_s: float = 3.0, heartbeat_s: float = 0.5, group: bool = False,
                 ctx: zmq.Context | None = None, publish_every_s: float | None = None,
                 fence_s: float | None = None, hold_s: float | None = None):
        self.endpoint = endpoint
        # publish_every_s: how often the loop publishes core.snapshot() as ``published`` for
        # readers in other threads (the metrics endpoint, hurray_ipc/broker/metrics.py); None: never.
        self.publish_every_s = publish_every_s
        self.published: dict[str, Any] | None = None
        self._last_publish = 0.0
        self.ctx = ctx or zmq.Context.instance()
        self._lock: EndpointLock | None = None
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self.sock.setsockopt(zmq.SNDHWM, HWM)
        self.sock.setsockopt(zmq.RCVHWM, RCV_HWM)
        # A frame over MAX_FRAME drops its connection before it is buffered (spec §2): a 256 MiB
        # header would otherwise be read whole before the header-size check refused it.
        self.sock.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME)
        self.sock.setsockopt(zmq.LINGER, 0)
        try:
            self._bind(group)
            key_file = route_key_path(self.endpoint)
            # owner-only even with --group: group members may not ROUTE; written once the lock is held
            route_key = kept_token(key_file) if key_file is not None else None
        except BaseException:
            self.sock.close(linger=0)
            if self._lock is not None:
                self._lock.release()
            raise
        self.core = BrokerCore(host=host_id(), timeout_s=timeout_s, heartbeat_s=heartbeat_s,
                               started=time.monotonic(), pid=os.getpid(), stats_cache_s=STATS_CACHE_S,
                               fence_s=fence_s, route_key=route_key, hold_s=hold_s)
        self.session = self.core.session
        self.running = False
        self._last_tick = 0.0
        self._last_clean = 0.0
        self._verdicts: dict[bytes, tuple[float, bool | None]] = {}
        self._pending: dict[bytes, list[AnyMessage]] = {}  # outgoing, per peer, until the drain round ends
        self.messages_received = 0
        self._ns = liveness.pid_namespace()
        self._clean()

    def _bind(self, group: bool) -> None:
        if self.endpoint.startswith("ipc://"):
            path = Path(self.endpoint[len("ipc://"):])
            check_socket_dir(path.parent, group)
            path.parent.mkdir(parents=True, exist_ok=True, mode=0o750 if group else 0o700)
            self._lock = acquire_endpoint(path, self.endpoint)  # BrokerAlreadyRunning if one lives
            old = os.umask(0o007 if group else 0o077)
            try:
                if path.exists() or path.is_symlink():
                    path.unlink()  # a stale socket file: its broker is dead (we hold the lock)
                self.sock.bind(self.endpoint)
            finally:
                os.umask(old)
            os.chmod(path, 0o660 if group else 0o600)
        else:
            self.sock.bind(self.endpoint)
            self.endpoint = self.sock.getsockopt_string(zmq.LAST_ENDPOINT)

    # --- plumbing --------------------------------------------------------------------------
    def _queue(self, outs: list[Out]) -> None:
        for o in outs:
            if isinstance(o, Send):
                q = self._pending.get(o.rid)
                if q is None:
                    q = self._pending[o.rid] = []
                q.append(o.msg)
            elif isinstance(o, CleanSegments):
                self._clean()

    def _flush(self) -> None:
        """Send what the last events produced: per peer, in order, hot messages of one verb
        batched, and consecutive batches in one bundle to a client that reads bundles (spec §2.2a;
        wire.ipc.parcels). Called once per drain round, so a lone message waits for nothing and
        a burst travels in few messages."""
        core = self.core
        while self._pending:
            pending, self._pending = self._pending, {}
            for rid, msgs in pending.items():
                for parcel in parcels(msgs, core.reads_bundles(rid)):
                    self._send_parcel(rid, parcel)

    def _send_parcel(self, rid: bytes, parcel: list[Sequence[AnyMessage]]) -> None:
        """Send one ZeroMQ message to ``rid``: the groups of ``parcel``, one after another. What
        cannot be sent goes back to the core (``undeliverable``), which gives back what it took."""
        frames: list[bytes] = [rid]
        sent: list[Sequence[AnyMessage]] = []
        for group in parcel:
            try:
                frames += encode_group(group)
            except Exception:  # noqa: BLE001 - a bug must cost these messages, never the broker
                log.exception("could not encode %s for %r", group[0].verb, rid[:32])
                for m in group:
                    self._queue(self.core.undeliverable(rid, m, "internal: not encodable"))
                continue
            sent.append(group)
        if not sent:
            return
        try:
            send_frames(self.sock, frames, NOBLOCK)
        except zmq.ZMQError as e:
            why = "full" if e.errno == zmq.EAGAIN else (
                "unreachable" if e.errno == zmq.EHOSTUNREACH else f"zmq error {e.errno}: {e}")
            for group in sent:
                for m in group:
                    self._queue(self.core.undeliverable(rid, m, why))
        else:
            self.core.note_sent()

    def _apply(self, outs: list[Out]) -> None:
        self._queue(outs)
        self._flush()

    def _clean(self) -> None:
        self._last_clean = time.monotonic()
        try:
            removed = liveness.cleanup_stale()
        except Exception as e:  # noqa: BLE001 - a sweep is housekeeping: it must never end the broker
            log.warning(json.dumps({"event": "stale_sweep_failed", "error": f"{type(e).__name__}: {e}"}))
            return
        self.core.note_sweep(len(shm.list_segments()), len(removed))
        if removed:
            log.info(json.dumps({"event": "stale_segments_removed", "count": len(removed)}))

    def _alive(self, c: Client) -> bool | None:
        """A same-host client's process: by its lease (None without one: heartbeats decide, spec §5);
        by pid only for a lease we cannot read that names our own PID namespace."""
        now = time.monotonic()
        hit = self._verdicts.get(c.rid)
        if hit is not None and now - hit[0] < LIVENESS_PERIOD_S and hit[1] is not False:
            return hit[1]
        verdict: bool | None = None
        parsed = liveness.parse(c.lease) if c.lease else None
        if c.lease:
            try:
                verdict = liveness.probe(c.lease)
            except OSError as e:  # e.g. ENOLCK: cannot judge by the lease this time
                log.warning(json.dumps({"event": "lease_probe_failed", "lease": c.lease, "error": str(e)}))
        if verdict is None and parsed is not None and parsed[1] == self._ns:
            # A lease we cannot read (another uid) that names our PID namespace: its pid means
            # something here. Without a lease a pid proves nothing (another namespace, a container,
            # or a reused pid): heartbeats alone decide, as for a client on another host.
            verdict = shm.pid_alive(c.endpoint.pid)
        self._verdicts[c.rid] = (now, verdict)
        if len(self._verdicts) > 2 * len(self.core.clients) + 64:
            self._verdicts = {r: v for r, v in self._verdicts.items() if r in self.core.clients}
        return verdict

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
                if poller.poll(50):
                    self.round()
                now = time.monotonic()
                if now - self._last_tick >= 0.05:
                    self._last_tick = now
                    self._apply(self.core.tick(now, self._alive))
                if now - self._last_clean >= SWEEP_PERIOD_S:
                    self._clean()
                if self.publish_every_s is not None and now - self._last_publish >= self.publish_every_s:
                    self.publish(now)
        finally:
            self.shutdown("broker stopping")

    def round(self) -> None:
        """Handle what waits on the socket, then send what that produced (no exception ends
        it). The round ends when nothing waits, after ROUND_ENTRIES entries, after ROUND_S or
        after one peer's ROUND_PEER_MESSAGES-th message, so no peer's answer waits behind more
        than that of other peers' work, and the loop keeps ticking and sweeping under load."""
        sock, core, clock = self.sock, self.core, round_clock
        first = core.stats.messages_in
        now = clock()
        until = now + ROUND_S
        read: dict[bytes, int] = {}
        while readable(sock):
            parts = recv_frames(sock, NOBLOCK)
            self.messages_received += 1
            n = read[parts[0]] = read.get(parts[0], 0) + 1
            if len(parts) > 1:
                self._queue(core.receive(parts[0], parts[1:], now))
            now = clock()
            if core.stats.messages_in - first >= ROUND_ENTRIES or now >= until or n >= ROUND_PEER_MESSAGES:
                break
        self._flush()

    def publish(self, now: float | None = None) -> None:
        """Hand other threads a fresh stats snapshot. Why publish instead of locking: the
        snapshot walks the core's dicts, which only this thread may touch while it serves, and
        a lock taken by a scrape would stall the loop for as long as the scrape holds it. So the
        loop builds a new dict (never mutated afterwards) and rebinds one attribute, which is
        atomic; a reader takes the reference once and sees one consistent snapshot, at most
        ``publish_every_s`` old."""
        self._last_publish = time.monotonic() if now is None else now
        self.published = self.core.snapshot(self._last_publish)

    def stop(self) -> None:
        self.running = False

    def install_signal_handlers(self) -> None:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: self.stop())

    def shutdown(self, reason: str) -> None:
        if self.sock.closed:
            return
        self._apply(self.core.shutdown(reason))
        log.info(json.dumps({"event": "shutdown", "reason": reason, "clients": len(self.core.clients),
                             "messages_received": self.messages_received, "messages_sent": self.core.stats.wire_out,
                             **asdict(self.core.stats), "errors_by_code": self.core.errors_by_code}))
        self.sock.close(linger=200)
        if self.endpoint.startswith("ipc://"):
            Path(self.endpoint[len("ipc://"):]).unlink(missing_ok=True)
        if self._lock is not None:
            self._lock.release()
            self._lock = None
