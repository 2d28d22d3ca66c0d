"""One client's connection to the broker: registration, heartbeats, and message pumping.

The calling thread does the socket work itself (no extra thread hop on the fast path): an API call
*pumps* — sends, drains, dispatches what arrives — until its condition holds. A background thread
pumps only while no API call does, so releases and heartbeats are handled while the application is
busy elsewhere. Callbacks produced by dispatch run after the lock is dropped, so a release callback
may itself call into the client; one that raises is contained (:func:`run_callbacks`).

Several threads may wait at once (:meth:`Session.pull` is thread-safe), and none waits holding the
lock: a pump round (under the lock) never blocks, and between rounds one waiting thread, the
*leader*, sleeps on the socket's file descriptor and a wake-up pipe while the others sleep on a
condition. Whoever dispatched something or touched the socket while others wait wakes them (the
ZMQ_FD is edge-triggered: another thread's send or drain can consume the edge the leader sleeps
on), so a thread that sends a HANDOFF never waits for another thread's sleep to end.

The broker is considered gone after ``timeout_s`` without any message from it; calls then raise
:class:`BrokerUnavailable`. The session keeps pinging, and when a broker answers again (a restarted
one replies ``not_registered``) it registers anew with the state its owner reports.
"""

from __future__ import annotations

import logging
import math
import os
import secrets
import select
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import partial
from pathlib import Path
from typing import Any

import zmq

from ..errors import BrokerUnavailable, ClosedError, HurrayTimeout, InvalidArgument
from ..transport.liveness import process_lease
from ..transport.sockets import NOBLOCK, readable, recv_frames, send_frames
from ..wire.ipc import BROKER_VERBS, HotMessage, Message, ProtocolError, coalesce, decode_all, encode_group
from ..wire.messages import (
    MAX_CREDITS,
    AnyMessage,
    Bye,
    Error,
    Hello,
    Ping,
    Pong,
    Ready,
    Request,
    Shutdown,
    Welcome,
    parse,
)
from ..wire.messages import Route as RouteMessage
from .endpoint import check_endpoint, check_socket_dir, default_endpoint

log = logging.getLogger("hurray.client")

Callback = Callable[[], None]
POLL_BUSY_S = 0.002  # how long one pump round blocks on the socket while the owner's poll has work pending


callback_errors = 0  # user callbacks that raised (all sessions of this process); see run_callbacks


def _drain(fd: int) -> None:
    try:
        while os.read(fd, 4096):
            pass
    except BlockingIOError:
        pass


def _close_fds(*fds: int) -> None:
    for fd in fds:
        os.close(fd)


def run_callbacks(callbacks: list[Callback]) -> None:
    """Run callbacks produced by dispatch, outside the session lock. A callback that raises (a
    user's ``on_release``, for one) is contained: logged on 'hurray.client' and counted in
    :data:`callback_errors`; it never escapes into the API call that happened to pump."""
    global callback_errors
    for cb in callbacks:
        try:
            cb()
        except Exception:  # noqa: BLE001 - a user callback must not break an unrelated call
            callback_errors += 1
            log.exception("callback %r raised; contained (callback_errors=%d)", cb, callback_errors)


START_BROKER = "hurray-broker --daemon"


def no_socket_file(endpoint: str) -> bool:
    """True for an ipc:// endpoint whose socket file does not exist: no broker listens there."""
    return endpoint.startswith("ipc://") and not os.path.exists(endpoint[len("ipc://"):])


def unavailable_hint(endpoint: str) -> str:
    """Why nothing may answer at ``endpoint``, and what to do: for ipc:// whether the socket file exists."""
    if endpoint.startswith("ipc://"):
        path = endpoint[len("ipc://"):]
        if no_socket_file(endpoint):
            return f"the socket file {path} does not exist: start a broker with `{START_BROKER}`"
        return (f"the socket file {path} exists but nothing answered: the broker may have died or be stopped; "
                f"restart it with `{START_BROKER}`")
    return f"is a broker listening there? start one with `{START_BROKER} --endpoint {endpoint}`"


def _seconds(v: Any, low: float, above: bool) -> bool:
    """``v`` is an int or float (not a bool) of finite seconds, above ``low`` or from it."""
    if isinstance(v, bool) or not isinstance(v, int | float):
        return False
    try:
        f = float(v)  # an int too large for a float raises: no deadline can be computed from it
    except OverflowError:
        return False
    return math.isfinite(f) and (f > low if above else f >= low)


def check_timeout(timeout: float | None, where: str) -> None:
    """A timeout is None (no end) or a finite number of seconds >= 0; else InvalidArgument naming
    ``where``."""
    if timeout is None or (type(timeout) is float and 0.0 <= timeout < math.inf):  # the usual: no call
        return
    if not _seconds(timeout, 0, above=False):
        raise InvalidArgument("a timeout is a finite number of seconds >= 0, or None to wait without end",
                              where=where, value=timeout)


def check_client_args(role: str, channel: Any, prefetch: Any, low: int, heartbeat_s: Any, timeout_s: Any) -> None:
    """What a Producer or Consumer is constructed with, checked before anything connects."""
    cls = role.capitalize()
    if not isinstance(channel, str) or not 1 <= len(channel) <= 256:
        raise InvalidArgument("a channel is a name of 1 to 256 characters", where=f"{cls}(channel=)", value=channel)
    if isinstance(prefetch, bool) or not isinstance(prefetch, int) or not low <= prefetch <= MAX_CREDITS:
        raise InvalidArgument(f"prefetch is an int from {low} to {MAX_CREDITS} (the credits one request may ask "
                              "for, spec §2)", where=f"{cls}(prefetch=)", value=prefetch)
    for name, v in (("heartbeat_s", heartbeat_s), ("timeout_s", timeout_s)):
        if not _seconds(v, 0, above=True):
            raise InvalidArgument("a finite number of seconds > 0", where=f"{cls}({name}=)", value=v)


class Session:
    """``hello(epoch)``: the role's HELLO fields for registration number ``epoch`` (1, 2, ...;
    called before each HELLO, the first during construction). ``dispatch(msg)``: a broker
    message for the role, under the session lock; returns callbacks to run after it."""

    def __init__(
        self,
        endpoint: str | None,
        role: str,
        channel: str,
        hello: Callable[[int], dict[str, Any]],
        dispatch: Callable[[AnyMessage], list[Callback]],
        *,
        heartbeat_s: float = 0.5,
        timeout_s: float = 3.0,
        poll: Callable[[], bool] | None = None,
    ):
        self.endpoint = check_endpoint(endpoint or default_endpoint())
        if self.endpoint.startswith("ipc://"):  # as the broker checks before it binds (spec §1)
            check_socket_dir(Path(self.endpoint[len("ipc://"):]).parent, group=True)
        self.role = role
        self.channel = channel
        self.client_id = secrets.token_hex(16)
        self._hello = hello
        self._dispatch = dispatch
        self.heartbeat_s = heartbeat_s
        self.timeout_s = timeout_s
        self.lock = threading.RLock()
        self.ctx = zmq.Context.instance()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.IDENTITY, self.client_id.encode())
        self.sock.setsockopt(zmq.LINGER, 0)
        # No send high-water mark: a pump round sends under the lock and must never block, and the
        # broker reads a peer only 256 messages ahead (spec §1). What waits here is this client's
        # own traffic, which its credits and held deliveries bound, plus, while no broker answers,
        # one PING a heartbeat (about 120 bytes queued each) and at most one HELLO (_pump_once).
        self.sock.setsockopt(zmq.SNDHWM, 0)
        self.sock.connect(self.endpoint)
        self.fd = int(self.sock.getsockopt(zmq.FD))  # readable when the socket has work (edge-triggered)
        # Waiting between pump rounds (see the module doc): the leader polls the socket's fd and
        # the wake pipe; followers wait for ``_gen`` to move. ``_leader`` and ``_followers`` are
        # read and written under ``lock``; ``_gen`` under ``_turn``.
        self._leader = False
        self._followers = 0
        self._gen = 0
        self._turn = threading.Condition(threading.Lock())
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        weakref.finalize(self, _close_fds, self._wake_r, self._wake_w)  # a leader may still poll it at close()
        self._sleep = select.poll()  # used by the leader only, one at a time
        self._sleep.register(self.fd, select.POLLIN)
        self._sleep.register(self._wake_r, select.POLLIN)
        # Called (under the lock; each must be thread-safe and never block) after a pump round that
        # received something: the asyncio API wakes its coroutine this way when another thread
        # took the message it waits for.
        self.wakers: list[Callable[[], None]] = []
        self._outbox: list[AnyMessage] = []  # hot messages held for one batch (see queue())
        self._held = 0  # holding() depth: flush_out waits for the outermost to end
        self.messages_sent = 0
        self.messages_received = 0
        self.registered = False
        self.shutdown_reason: str | None = None
        self.broker_session: str | None = None
        self.kept_mappings = False  # the latest WELCOME said the broker carries kept mappings (§4.10)
        self.hold_s: float | None = None  # the latest WELCOME's hold bound (§5, hold_ms); None: none
        self.last_rx = time.monotonic()
        self.last_tx = 0.0
        self._hello_sent = 0.0
        self.closed = False
        self.deferred: list[Callback] = []  # callbacks the owner queued outside a dispatch
        self.route: dict[str, Any] | None = None  # announced again after every WELCOME (set_route)
        self.on_welcome: list[Callable[[], None]] = []  # the owner's, called (under the lock) after every WELCOME
        self.on_pong: list[Callable[[], None]] = []  # the owner's, called (under the lock) at every PONG
        self.route_key = ""
        # The owner's own work to check on every pump round (e.g. deferred releases); it returns
        # True while work is pending, and the pump then polls the socket briefly to come back soon.
        self._poll = poll
        self._register()
        self._bg = threading.Thread(target=self._background, name=f"hurray-{role}-pump", daemon=True)
        self._bg.start()

    # --- sending ---------------------------------------------------------------------------
    def send(self, msg: AnyMessage) -> None:
        """Send now (after anything queued, which keeps its order)."""
        self.send_batch([msg])

    def send_batch(self, msgs: list[AnyMessage]) -> None:
        """Send now, after anything queued, in as few messages as protocol.coalesce allows.
        Raises ClosedError after :meth:`close`."""
        with self.lock:
            self.check_open("sending")
            self._outbox.extend(msgs)
            self.flush_out()

    def check_open(self, what: str) -> None:
        """Raise ClosedError when this session was closed."""
        if self.closed:
            of = "" if f"channel {self.channel!r}" in what else f" of channel {self.channel!r}"
            raise ClosedError(f"this {self.role}{of} was closed before {what}; create a new one")

    def queue(self, msg: AnyMessage) -> None:
        """Hold a hot message for the next :meth:`flush_out` (at the latest the next pump round,
        or the next :meth:`send`), so that several travel as one batch. The caller flushes at
        once when nothing else is about to follow (a lone release waits for nothing)."""
        with self.lock:
            self._outbox.append(msg)

    @contextmanager
    def holding(self) -> Iterator[None]:
        """Under the lock: what is sent meanwhile is held, and leaves on exit in as few messages
        as coalesce allows (a batch of releases travels as one)."""
        with self.lock:
            self._held += 1
            try:
                yield
            finally:
                self._held -= 1
                self.flush_out()

    def flush_out(self) -> None:
        with self.lock:
            if not self._outbox or self._held:
                return
            out, self._outbox = self._outbox, []
            for group in coalesce(out):
                send_frames(self.sock, encode_group(group))
                self.messages_sent += 1
            self.last_tx = time.monotonic()
            if self._leader and readable(self.sock):
                self._poke()  # the send took the edge of what arrived meanwhile: the leader would sleep on

    def set_route(self, route: dict[str, Any] | None, key: str) -> None:
        """Announce this client's route across machines (ROUTE, spec §2.4; a bridge's, see
        transport/route.py), replacing the last one; None withdraws it. ``key``: the broker's route
        key (its owner-only ``<socket>.route-key`` file; the broker's own bridges are given it). Sent
        now when it changed and the broker knows us, and again after every WELCOME: a restarted
        broker knows no route (and has a new key: a refused ROUTE is logged, as any ERROR)."""
        with self.lock:
            self.route_key = key
            if route == self.route:
                return
            self.route = route
            if self.registered:
                self.send(RouteMessage(key, route))

    def _register(self) -> None:
        # The epoch tells this registration's GRANTs from those of an earlier one still in flight.
        self.epoch = getattr(self, "epoch", 0) + 1
        self.send(Hello(role=self.role, channel=self.channel, client_id=self.client_id, pid=os.getpid(),
                        epoch=self.epoch, lease=process_lease().name, bundles=True, **self._hello(self.epoch)))
        self._hello_sent = time.monotonic()

    # --- receiving -------------------------------------------------------------------------
    def _handle(self, parts: list[bytes], out: list[Callback]) -> None:
        self.last_rx = time.monotonic()
        self.messages_received += 1
        try:
            msgs = decode_all(parts, allowed=BROKER_VERBS, bundles=True)
        except ProtocolError as e:
            log.warning("dropping malformed message from broker: %s", e)
            return
        for msg in msgs:
            self._handle_one(msg, out)

    def _handle_one(self, raw: Message | HotMessage, out: list[Callback]) -> None:
        try:
            msg = parse(raw) if isinstance(raw, Message) else raw
        except ProtocolError as e:
            log.warning("dropping malformed %s from broker: %s", raw.verb, e)
            return
        if isinstance(msg, Welcome):
            self.registered = True
            self.shutdown_reason = None
            self.broker_session = msg.session
            self.kept_mappings = msg.kept_mappings
            self.hold_s = msg.hold_ms / 1000 if msg.hold_ms else None
            if self.route is not None:
                self.send(RouteMessage(self.route_key, self.route))
            for f in self.on_welcome:
                f()
            return
        if isinstance(msg, Pong):
            for f in self.on_pong:
                f()
            return
        if isinstance(msg, Shutdown):
            self.registered = False
            self.shutdown_reason = msg.reason
            return
        if isinstance(msg, Error) and msg.code == "not_registered":
            # A restarted broker (or one that timed us out): register again, once per round trip.
            self.registered = False
            if time.monotonic() - self._hello_sent > min(self.heartbeat_s, 0.2):
                self._register()
            return
        out.extend(self._dispatch(msg))

    def pull(self, queue: deque[Any], verb: str, want: Callable[[], int], asked: Callable[[int], None],
             timeout: float | None, what: str, stop: Callable[[], bool] | None = None,
             take_next: Callable[[], Any] | None = None) -> Any:
        """Take the next item of ``queue`` (filled by dispatch), asking the broker for ``want()``
        more with ``verb{credits}`` whenever the queue is empty and ``want()`` is positive (REQUEST /
        READY). Thread-safe: the check-and-take is one step under the lock (so two callers never
        race for one item), and the ask is re-evaluated on every pump round (so a credit that came
        back, e.g. a delivery the consumer rejected, or a second waiting thread, is asked again
        instead of starving until the timeout). Returns None, asking nothing more, once the queue
        is empty and ``stop()`` is true (the consumer's end of stream). ``take_next``: how the next item
        is taken (under the lock, ``queue`` not empty; default ``queue.popleft``), for an owner
        whose queue belongs to a state machine of its own (the consumer's core)."""
        got: list[Any] = []
        stopped: list[bool] = []

        def take() -> bool:  # runs under the lock, inside the pump
            if got or stopped:
                return True
            if queue:
                got.append(queue.popleft() if take_next is None else take_next())
                if not queue and self._outbox:
                    self.flush_out()  # e.g. releases held while more deliveries were queued
                return True
            if stop is not None and stop():
                stopped.append(True)
                return True
            n = want()
            if n > 0:
                self.send(Request(n) if verb == "REQUEST" else Ready(n))
                asked(n)
            return False

        self.pump(take, timeout, what)
        return got[0] if got else None

    def pump(self, until: Callable[[], bool], timeout: float | None, what: str) -> None:
        """Send heartbeats and dispatch messages until ``until()`` is true.

        Raises TimeoutError after ``timeout`` seconds, BrokerUnavailable once the broker has been
        silent for ``timeout_s`` (or shut down) while ``until()`` is still false.
        """
        start = time.monotonic()
        deadline = None if timeout is None else start + timeout
        following = False
        while True:
            callbacks: list[Callback] = []
            lead, gen, stop = False, 0, None
            with self.lock:
                if following:
                    self._followers -= 1
                    following = False
                self.check_open(what)
                done, wait = self._pump_once(until, deadline, callbacks)
                if not done:
                    stop = self._why_stop(start, deadline, timeout, what)
                    if stop is None:
                        lead = not self._leader
                        if lead:
                            self._leader = True
                        else:
                            self._followers += 1
                            following = True
                            gen = self._gen
            run_callbacks(callbacks)
            if done:
                return
            if stop is not None:
                raise stop
            if lead:
                try:
                    self._lead(wait)
                except BaseException:
                    with self.lock:
                        self._stop_leading()
                    raise
                callbacks = []
                with self.lock:
                    self._stop_leading()
                    if not self.closed:  # what woke it, at once (the next round would look again)
                        self._take_in(callbacks)
                        done = until()
                run_callbacks(callbacks)
                if done:
                    return
            else:
                try:
                    with self._turn:
                        self._turn.wait_for(partial(self._moved, gen), wait)
                except BaseException:  # e.g. KeyboardInterrupt: it no longer follows
                    with self.lock:
                        self._followers -= 1
                    raise

    def _why_stop(self, start: float, deadline: float | None, timeout: float | None, what: str) -> Exception | None:
        """Why a pump that is not done must stop now (shutdown, a silent broker, its deadline), or None."""
        now = time.monotonic()
        if self.shutdown_reason and not self.registered:
            return BrokerUnavailable(f"broker at {self.endpoint} shut down ({self.shutdown_reason}) while {what}")
        if now - self.last_rx > self.timeout_s:
            return BrokerUnavailable(self._silence(now, start, what))
        if deadline is not None and now >= deadline:
            if self.broker_session is None and no_socket_file(self.endpoint):
                return BrokerUnavailable(self._silence(now, start, what))  # nobody can answer
            never = "" if self.broker_session is not None else (
                f"; no broker has answered at {self.endpoint} yet: {unavailable_hint(self.endpoint)}")
            return HurrayTimeout(f"timed out after {timeout} s while {what}{never}")
        return None

    def _pump_once(self, until: Callable[[], bool], deadline: float | None, out: list[Callback]) -> tuple[bool, float]:
        """One pump round, under the lock, never blocking: returns whether ``until()`` holds, and
        how long the caller may sleep before the next round (heartbeat, deadline, owner's work)."""
        busy = self._poll() if self._poll is not None else False  # it may queue callbacks: taken just below
        if self.deferred:
            out.extend(self.deferred)
            self.deferred.clear()
        if until():
            return True, 0.0  # held messages stay held: the caller goes on and may add to them
        if self._outbox:
            self.flush_out()  # before waiting: nothing held waits on the socket
        now = time.monotonic()
        if now - self.last_tx >= self.heartbeat_s:
            # HELLO again only once something came since the last one (an ERROR refusing it, a
            # SHUTDOWN): while nothing answers, the last HELLO may still wait in the socket, and
            # one a heartbeat (up to 1.3 MB with the held list) would pile up for as long as the
            # broker is away. A PING meanwhile is answered not_registered by a broker that lost
            # the HELLO, and that answer sends the next (_handle_one; spec §5).
            answered = self.last_rx >= self._hello_sent
            if not self.registered and answered and now - self._hello_sent >= self.heartbeat_s:
                self._register()
            else:
                self.send(Ping())
        self._take_in(out)
        wait = self.heartbeat_s if deadline is None else max(0.0, min(self.heartbeat_s, deadline - now))
        return until(), (min(wait, POLL_BUSY_S) if busy else wait)

    def _lead(self, wait: float) -> None:
        """Sleep (without the lock) until the socket has a message, a poke, or ``wait`` passed. The
        ZMQ_FD also wakes for libzmq's own commands (e.g. after our send): those are told apart here
        with one locked ZMQ_EVENTS look, as zmq_poll does inside, not with a whole pump round."""
        end = time.monotonic() + wait
        while True:
            woke = self._sleep.poll(max(1, int((end - time.monotonic()) * 1000)))
            if not woke:
                return
            if any(fd == self._wake_r for fd, _ in woke):
                _drain(self._wake_r)
                return
            with self.lock:
                if self.closed or readable(self.sock):
                    return
            if time.monotonic() >= end:
                return

    def _stop_leading(self) -> None:
        """Under the lock: the leader woke; a follower may have to lead now."""
        self._leader = False
        self._wake_followers()

    def _take_in(self, out: list[Callback]) -> None:
        """Under the lock: receive and dispatch everything readable (no exception ends it), then
        wake whoever waits between rounds when something came."""
        received = self.messages_received
        sock = self.sock
        while readable(sock):
            self._handle(recv_frames(sock, NOBLOCK), out)
        if received != self.messages_received:
            self._wake_others()

    def _moved(self, gen: int) -> bool:
        return self._gen != gen

    def _wake_others(self) -> None:
        """Under the lock, after a dispatch: the threads waiting between rounds look again, and so
        do the coroutines waiting on this socket (their waker is thread-safe and never blocks)."""
        if self._leader:
            self._poke()
        self._wake_followers()
        for wake in list(self.wakers):  # a coroutine may add or remove its own meanwhile
            try:
                wake()
            except RuntimeError:  # its event loop closed meanwhile: nobody waits there
                pass

    def _wake_followers(self) -> None:
        if self._followers:
            with self._turn:
                self._gen += 1
                self._turn.notify_all()

    def _poke(self) -> None:
        try:
            os.write(self._wake_w, b"\0")
        except BlockingIOError:
            pass  # the pipe is full: the leader wakes anyway

    def _silence(self, now: float, start: float, what: str) -> str:
        silent, waited = now - self.last_rx, now - start
        if self.broker_session is None:  # never heard from one
            return (f"no broker answered at {self.endpoint} in the {silent:.1f} s since this {self.role} connected "
                    f"(this call waited {waited:.1f} s while {what}): {unavailable_hint(self.endpoint)}")
        return (f"the broker at {self.endpoint} has been silent for {silent:.1f} s (timeout_s={self.timeout_s}; "
                f"this call waited {waited:.1f} s while {what}): {unavailable_hint(self.endpoint)}; this "
                f"{self.role} registers again by itself when a broker answers")

    @property
    def alive(self) -> bool:
        return self.registered and time.monotonic() - self.last_rx <= self.timeout_s

    def _background(self) -> None:
        # Never blocks while holding the lock: an API call waits at most one non-blocking drain.
        # Pumps only while no API call waits: a waiting call's own rounds do the work (its
        # leader wakes on the socket, and at least every heartbeat), and a round here would
        # flush messages the caller holds for one batch and take away its wake-ups.
        idle = min(0.02, self.heartbeat_s / 5)
        while not self.closed:
            if not self._leader and self.lock.acquire(blocking=False):
                callbacks: list[Callback] = []
                try:
                    if not self.closed and not self._leader:
                        self._pump_once(lambda: False, None, callbacks)
                except zmq.ZMQError:
                    return
                finally:
                    self.lock.release()
                run_callbacks(callbacks)
            time.sleep(idle)

    def close(self, bye: Callable[[], bool] | None = None) -> None:
        """Send what is queued, then BYE (unless ``bye`` returns False: the broker then judges
        this client by its silence, spec §5), and close the socket. ``bye`` is asked under the
        lock, so no dispatch runs between its answer and the BYE. Idempotent."""
        if self.closed:
            return
        with self.lock:
            try:
                self.flush_out()
                # Also before the WELCOME came: the HELLO went first on this socket, so the BYE
                # ends that registration (a BYE the broker cannot place is ignored, spec §2).
                if bye is None or bye():
                    self.send(Bye())
            except zmq.ZMQError:
                pass
            self.closed = True
            self._wake_others()  # before the socket goes: a leader polls its fd
            self.sock.close(linger=100)
        if self._bg.is_alive():
            self._bg.join(timeout=2)
