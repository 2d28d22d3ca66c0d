"""One peer's backlog must not hold other peers' answers (docs/spec/ipc-protocol.md §1, §6a).

ZeroMQ reads the broker's peers in turn, one message each, whatever a message costs. A round of
the broker loop that sent its answers only once it had read everything waiting (up to 1000
messages) let a peer flooding 64-entry RELEASE batches hold a healthy pair's every answer for
hundreds of milliseconds: the pair fell from 1,600 to 0-1 handoffs a second, and stayed there
while the broker worked through the flood's backlog. Here the socket is a scripted queue, so
what the loop does between reading a message and sending its answer is counted exactly, not timed.
"""

from __future__ import annotations

import json
from collections import deque

import pytest

from hurray_ipc.broker import server
from hurray_ipc.devices.base import host_id
from hurray_ipc.wire.ipc import PROTOCOL_VERSION, Message, encode_batch


def _hello(rid: bytes, pid: int) -> list[bytes]:
    endpoint = {"device": {"kind": "cpu", "ordinal": 0, "uuid": "cpu-test", "pci_bus_id": "", "emulated": False,
                           "host": host_id()},
                "caps": {"ipc_memory": True, "ipc_events": False, "ipc_streams": False, "peers": []},
                "pid": pid, "stream": None}
    header = {"protocol": PROTOCOL_VERSION, "role": "consumer", "channel": "ch", "pid": pid, "endpoint": endpoint}
    return [rid, b"HELLO", json.dumps(header).encode()]


@pytest.fixture
def scripted(monkeypatch):
    """A Broker whose socket reads from ``inbox`` and records into ``log``: ("in", rid,
    entries handled so far) per message read, ("out", rid, verb) per message sent. Its loop's
    clock stands still unless a test sets ``tick[0]``, the seconds each reading of it adds."""
    b = server.Broker("tcp://127.0.0.1:*")
    inbox: deque[list[bytes]] = deque()
    log: list[tuple[str, bytes, object]] = []
    tick, now = [0.0], [1000.0]

    def clock() -> float:
        now[0] += tick[0]
        return now[0]

    def recv(sock: object, flags: int = 0) -> list[bytes]:
        parts = inbox.popleft()
        log.append(("in", parts[0], b.core.stats.messages_in))
        return parts

    monkeypatch.setattr(server, "readable", lambda sock: bool(inbox))
    monkeypatch.setattr(server, "recv_frames", recv)
    monkeypatch.setattr(server, "send_frames", lambda sock, frames, flags=0: log.append(("out", frames[0], frames[1])))
    monkeypatch.setattr(server, "round_clock", clock)
    try:
        yield b, inbox, log, tick
    finally:
        monkeypatch.undo()
        b.shutdown("test over")


def _register(b, inbox) -> None:
    inbox.extend([_hello(b"flood", 7), _hello(b"quiet", 8)])
    while inbox:
        b.round()
    assert b"flood" in b.core.clients and b"quiet" in b.core.clients


def test_an_answer_waits_behind_at_most_one_round_of_another_peers_backlog(scripted, monkeypatch):
    """By entries: the clock stands still and the bound per peer is lifted, so only the entry
    bound can end a round."""
    b, inbox, log, _ = scripted
    monkeypatch.setattr(server, "ROUND_PEER_MESSAGES", 1 << 30)
    _register(b, inbox)
    forged = encode_batch([Message("RELEASE", {"token": "f0" * 23 + f"{i:02x}"}) for i in range(64)])
    inbox.extend([[b"flood", *forged] for _ in range(3)])
    inbox.append([b"quiet", b"PING", b"{}"])
    inbox.extend([[b"flood", *forged] for _ in range(40)])  # 2,560 entries, each answered unknown_token
    log.clear()
    rounds = 0
    while inbox:
        b.round()
        rounds += 1
    (read_at,) = [n for kind, rid, n in log if kind == "in" and rid == b"quiet"]
    pong = next(i for i, (kind, rid, _) in enumerate(log) if kind == "out" and rid == b"quiet")
    handled_before_pong = max(n for kind, _, n in log[:pong] if kind == "in")  # entries when the last read began
    assert log[pong][2] == b"PONG"
    # The spec's bound, not the module's constant (a test reading that would follow it): the PING's
    # round goes on for at most 256 entries (the last read begins below it).
    assert handled_before_pong - read_at < 256, (read_at, handled_before_pong)
    assert rounds == 11, "43 batches of 64 entries, 4 a round (the read that reaches 256 ends it)"
    assert b.core.stats.errors == 43 * 64  # every entry still answered: a round ends, it drops nothing


def test_a_round_of_cheap_messages_ends_after_two_milliseconds(scripted, monkeypatch):
    """By time: 1-entry PINGs never reach the entry bound, the bound per peer is lifted, and each
    reading of the clock adds 0.6 ms (not a divisor of 2 ms, so no float equality decides), so a
    round reads 4 of them (spec §1: 2 ms) before its answers go out."""
    b, inbox, log, tick = scripted
    monkeypatch.setattr(server, "ROUND_PEER_MESSAGES", 1 << 30)
    _register(b, inbox)
    inbox.extend([[b"flood", b"PING", b"{}"] for _ in range(20)])
    log.clear()
    tick[0] = 0.0006
    b.round()
    assert [rid for kind, rid, _ in log if kind == "in"] == [b"flood"] * 4, log
    assert [verb for kind, _, verb in log if kind == "out"] == [b"PONG"] * 4, "what it read is answered"
    assert len(inbox) == 16


def test_a_round_ends_at_one_peers_eighth_message(scripted):
    """By peer: the flood's messages are 2-entry batches, so the entry bound (256) is far off and
    the clock stands still: only the peer bound can end a round. The round in which two quiet
    peers' PINGs are read (ZeroMQ reads peers in turn, so they come among the first of the
    flood's) reads 8 of the flood's messages, 10 in all (a bound on the round's messages, not one
    peer's, would end it sooner; one counting entries, at 4 of them), and their PONGs go out
    before the flood's 9th is read (spec §1). Without it, a client flooding PINGs within its
    message rate held each of a healthy pair's answers for the whole 2 ms a round may last: the
    pair fell from 1,174 to 142 handoffs a second (scripts/floods.py deaf-pings, 2026-12-07)."""
    b, inbox, log, _ = scripted
    _register(b, inbox)
    inbox.append(_hello(b"other", 9))
    b.round()
    assert b"other" in b.core.clients
    ping = [b"PING", b"{}"]
    pair = encode_batch([Message("RELEASE", {"token": "f0" * 23 + f"{i:02x}"}) for i in range(2)])
    inbox.extend([[b"flood", *pair], [b"quiet", *ping], [b"flood", *pair], [b"other", *ping]])
    inbox.extend([[b"flood", *pair] for _ in range(30)])
    log.clear()
    errors = b.core.stats.errors
    b.round()
    read = [rid for kind, rid, _ in log if kind == "in"]
    assert read == [b"flood", b"quiet", b"flood", b"other"] + [b"flood"] * 6, log
    sent = [(rid, verb) for kind, rid, verb in log if kind == "out"]
    assert sent.count((b"quiet", b"PONG")) == 1 and sent.count((b"other", b"PONG")) == 1, sent
    per_round = []
    while inbox:
        before = len(inbox)
        b.round()
        per_round.append(before - len(inbox))
    assert per_round == [8, 8, 8], "the flood's other 24 messages, 8 a round"  # the bound is per round, not for ever
    assert b.core.stats.errors - errors == 32 * 2, "every entry answered"
