"""Asking a broker what it knows: STATS and CAPS (docs/spec/ipc-protocol.md §2, §2.3, §6a).

A query needs no HELLO. One :class:`BrokerQuery` is one connection, and it may ask any number of
times: each query names the ticket of the latest answer read on it (§6a), without which the
broker stops answering a connection after 8 unread answers. An answer to an earlier query that
timed out is skipped by its ``request_id`` (its ticket still counts: it was read), and so is an
unasked PONG, the broker's check that a connection with unread answers is still there.

Who uses it: ``hurray-top`` and ``hurray-caps --broker``, the daemon's start and status checks,
``hurray-stress`` (waiting for its workers to register), and the tests.
"""

from __future__ import annotations

import itertools
import time
from types import TracebackType
from typing import Any

import zmq

from ..wire.ipc import BROKER_VERBS, Message, ProtocolError, decode
from ..wire.messages import CapsReply, Error, JsonMessage, StatsReply, parse

__all__ = ["BrokerQuery", "NoAnswer", "Tickets", "stats"]

_REQUEST_IDS = itertools.count(1)


class NoAnswer(ConnectionError):
    """No answer came: no broker, it did not answer in time, or it refused (the message says which)."""


class Tickets:
    """What one connection shows the broker it read (§6a): every message read passes through
    :meth:`read`; every STATS or CAPS sent is :meth:`stamp`-ed with the latest ticket read."""

    def __init__(self) -> None:
        self.latest: str | None = None

    def read(self, header: object) -> None:
        """Note the ticket of a header read from the broker (an answer carries one; other messages not)."""
        if isinstance(header, dict) and isinstance(header.get("ticket"), str):
            self.latest = header["ticket"]

    def stamp(self, header: dict[str, Any]) -> dict[str, Any]:
        """``header`` of a query, naming the latest ticket read (unchanged before any)."""
        return header if self.latest is None else {**header, "ticket": self.latest}


class BrokerQuery:
    """One DEALER connection to the broker at ``endpoint`` for STATS and CAPS. Raises
    :class:`NoAnswer` when the endpoint cannot be connected to."""

    def __init__(self, endpoint: str):
        self.endpoint = endpoint
        self.tickets = Tickets()
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 0)
        try:
            self._sock.connect(endpoint)
        except zmq.ZMQError as e:
            self.close()
            raise NoAnswer(f"cannot connect to {endpoint}: {e.strerror}") from None

    def stats(self, timeout: float) -> dict[str, Any]:
        """The broker's STATS_REPLY header (§2.3), or NoAnswer within ``timeout`` seconds."""
        return self._ask("STATS", {}, timeout)

    def caps(self, header: dict[str, Any], timeout: float) -> dict[str, Any]:
        """The CAPS_REPLY header for a CAPS of ``header`` (``device``, and ``peer``, ``channel``,
        ``transport`` as §2 allows), or NoAnswer within ``timeout`` seconds."""
        return self._ask("CAPS", header, timeout)

    def _ask(self, verb: str, fields: dict[str, Any], timeout: float) -> dict[str, Any]:
        request_id = f"q-{next(_REQUEST_IDS)}"
        deadline = time.monotonic() + timeout
        silent = NoAnswer(f"no reply from broker at {self.endpoint} within {timeout:g} s")
        while self._sock.poll(0):  # answers to queries that timed out: read, so name the latest
            self._read()
        header = self.tickets.stamp({**fields, "request_id": request_id})
        try:
            self._sock.send_multipart(Message(verb, header).encode(), flags=zmq.NOBLOCK)
        except zmq.Again:
            raise silent from None
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not self._sock.poll(max(1, int(left * 1000))):
                raise silent
            msg = self._read()
            if isinstance(msg, Error) and msg.extra.get("request_id") == request_id:
                raise NoAnswer(f"broker at {self.endpoint} refused {verb}: {msg.code}: {msg.message}")
            if isinstance(msg, CapsReply | StatsReply) and msg.verb == f"{verb}_REPLY" and msg.request_id == request_id:
                return msg.fields()

    def _read(self) -> JsonMessage | None:
        """One message from the broker (None: not one a query understands); its ticket noted."""
        try:
            raw = decode(self._sock.recv_multipart(), allowed=BROKER_VERBS)
            msg = parse(raw) if isinstance(raw, Message) else None  # a hot verb answers no query
        except ProtocolError:
            return None
        if msg is not None:
            self.tickets.read(msg.fields())
        return msg

    def close(self) -> None:
        self._sock.close(0)
        self._ctx.term()

    def __enter__(self) -> BrokerQuery:
        return self

    def __exit__(self, kind: type[BaseException] | None, value: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()


def stats(endpoint: str, timeout: float) -> dict[str, Any]:
    """One STATS_REPLY from the broker at ``endpoint`` on a connection of its own (NoAnswer if none)."""
    with BrokerQuery(endpoint) as q:
        return q.stats(timeout)
