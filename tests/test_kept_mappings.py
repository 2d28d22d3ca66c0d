"""Kept mappings (docs/spec/ipc-protocol.md §4.10): the broker's UNMAP rounds, driven without
sockets, and the consumer's import cache that keeps and gives back mappings. Producer and consumer
processes, each rule broken: tests/test_kept_mappings_processes.py."""

from __future__ import annotations

import json
import struct

import pytest

from hurray_ipc.broker.core import MAX_UNMAPS, MAX_UNSEEN, BrokerCore, Send
from hurray_ipc.devices.base import ImportCache, host_id
from hurray_ipc.wire.fields import consumer_label
from hurray_ipc.wire.ipc import PROTOCOL_VERSION, Handoff, Message, decode_all
from hurray_ipc.wire.messages import Unmap

HOST = host_id()
MEM = bytes(range(64))
P, C1, C2, C3, OLD = b"p", b"c1", b"c2", b"c3", b"old"
L1, L2, L3, LOLD = (consumer_label(r) for r in (C1, C2, C3, OLD))


def endpoint(pid: int) -> dict:
    return {"device": {"kind": "cpu", "ordinal": 0, "uuid": "cpu-test", "pci_bus_id": "", "emulated": False,
                       "host": HOST},
            "caps": {"ipc_memory": True, "ipc_events": False, "ipc_streams": False, "peers": []},
            "pid": pid, "stream": None}


class World:
    """A broker core with producer ``p``, consumers c1..c3 that keep mappings and consumer ``old``
    that does not say so (a client older than §4.10) registered; what it sends, by peer."""

    def __init__(self) -> None:
        self.core = BrokerCore(host=HOST, timeout_s=3.0)
        self.now = 0.0
        self.welcome: dict[bytes, dict] = {}
        for i, rid in enumerate((P, C1, C2, C3, OLD)):
            self.hello(rid, "producer" if rid == P else "consumer", 100 + i)

    def hello(self, rid: bytes, role: str, pid: int) -> list[tuple[bytes, str, dict]]:
        h = {"protocol": PROTOCOL_VERSION, "role": role, "channel": "ch", "pid": pid, "endpoint": endpoint(pid),
             **({"kept_mappings": True} if role == "consumer" and rid != OLD else {})}
        sent = self.send(rid, [b"HELLO", json.dumps(h).encode()])
        self.welcome[rid] = next(f for r, verb, f in sent if r == rid and verb == "WELCOME")
        return sent

    def send(self, rid: bytes, frames: list[bytes]) -> list[tuple[bytes, str, dict]]:
        outs = self.core.receive(rid, frames, self.now)
        self.core.check_invariants()
        return [(o.rid, o.msg.verb, {**o.msg.fields(), **o.msg.blobs()}) for o in outs if isinstance(o, Send)]

    def unmap(self, request: int, labels: list[str], memory: bytes = MEM, rid: bytes = P) -> list:
        return self.send(rid, Message("UNMAP", {"request": request, "consumers": labels}, {"memory": memory}).encode())

    def unmapped(self, rid: bytes, request: int, producer_id: str = "p") -> list:
        return self.send(rid, Message("UNMAPPED", {"request": request, "producer_id": producer_id}).encode())


# An emulated-CUDA handle (device_tag 1, SYNC_PRODUCER_SYNCED) for handoffs the broker accepts.
CUDA_HANDLE = struct.pack("<QIBB2s", 64, 256, 1, 0, b"\0\0")


def _grant(w: World, consumer: bytes) -> int:
    """A grant of ``p`` for ``consumer``: it asks for one buffer, p for one grant."""
    w.send(consumer, Message("REQUEST", {"credits": 1}).encode())
    sent = w.send(P, Message("READY", {"credits": 1}).encode())
    (g,) = [f for rid, verb, f in sent if rid == P and verb == "GRANT"]
    assert g["consumer_id"] == consumer_label(consumer)
    return g["grant_id"]


def answer(sent: list) -> dict:
    """The UNMAPPED the producer got, its lists as sets."""
    (got,) = [f for rid, verb, f in sent if rid == P and verb == "UNMAPPED"]
    return {k: set(v) if isinstance(v, list) else v for k, v in got.items()}


def errors(sent: list) -> list[dict]:
    return [f for _rid, verb, f in sent if verb == "ERROR"]


def test_each_registered_consumer_named_is_asked_and_the_producer_answered_once_all_did():
    w = World()
    sent = w.unmap(7, [L1, L2])
    assert sorted((rid, verb, f["request"], f["producer_id"], f["memory"]) for rid, verb, f in sent) == \
        [(C1, "UNMAP", 7, "p", MEM), (C2, "UNMAP", 7, "p", MEM)], "only the consumers named, with the blob"
    assert w.unmapped(C1, 7) == [], "one still owes its answer"
    assert w.unmapped(C1, 7) == [] and w.unmapped(C3, 7) == [], "a second answer, or one never asked, is ignored"
    sent = w.unmapped(C2, 7)
    assert answer(sent) == {"request": 7, "unmapped": {L1, L2}, "gone": set(), "fenced": set()}
    assert sorted(next(f for _r, v, f in sent if v == "UNMAPPED")["unmapped"]) == sorted([L1, L2]), "each once"
    assert w.unmapped(C2, 7) == [], "an answer after the round closed changes nothing"
    assert not w.core.unmaps


def test_the_broker_says_it_carries_kept_mappings():
    assert World().welcome[C1]["kept_mappings"] is True


def test_a_consumer_that_did_not_say_it_keeps_mappings_is_never_sent_keep_nor_asked():
    """It would not read the flag (a client older than §4.10): DELIVER goes without it, so it
    closes its mapping at each release, and the broker answers UNMAP for it at once."""
    w = World()
    gid = _grant(w, OLD)
    sent = w.send(P, Message("HANDOFF", {"grant_id": gid, "handoff_id": 1, "offset": 0, "keep": True},
                             {"handle": CUDA_HANDLE, "memory": MEM}).encode())
    (deliver,) = [f for rid, verb, f in sent if rid == OLD and verb == "DELIVER"]
    assert "keep" not in deliver
    gid = _grant(w, C1)
    sent = w.send(P, Message("HANDOFF", {"grant_id": gid, "handoff_id": 2, "offset": 0, "keep": True},
                             {"handle": CUDA_HANDLE, "memory": MEM}).encode())
    (deliver,) = [f for rid, verb, f in sent if rid == C1 and verb == "DELIVER"]
    assert deliver["keep"] is True
    sent = w.unmap(1, [LOLD, L1])
    assert [(rid, verb) for rid, verb, _f in sent] == [(C1, "UNMAP")], "only the one that keeps is asked"
    assert answer(w.unmapped(C1, 1)) == {"request": 1, "unmapped": {LOLD, L1}, "gone": set(), "fenced": set()}


def _deliver_kept(w: World, consumer: bytes, hid: int) -> str:
    """p hands ``consumer`` a kept CUDA buffer; its token."""
    gid = _grant(w, consumer)
    sent = w.send(P, Message("HANDOFF", {"grant_id": gid, "handoff_id": hid, "offset": 0, "keep": True},
                             {"handle": CUDA_HANDLE, "memory": MEM}).encode())
    (d,) = [f for rid, verb, f in sent if rid == consumer and verb == "DELIVER"]
    return d["token"]


def test_a_bye_while_holding_a_delivery_proves_nothing_about_its_mappings():
    """It may still have the buffer mapped (taken and not released): not gone; fenced unless it
    registers again in time (and answers)."""
    w = World()
    _deliver_kept(w, C1, 1)
    w.send(C1, [b"BYE", b"{}"])
    assert w.unmap(1, [L1]) == []
    assert answer(tick(w, w.core.timeout_s))["fenced"] == {L1}


def test_a_consumer_that_withdraws_kept_mappings_after_it_was_sent_keep_is_fenced():
    w = World()
    _deliver_kept(w, C1, 1)
    w.unmap(1, [L1])
    h = {"protocol": PROTOCOL_VERSION, "role": "consumer", "channel": "ch", "pid": 101, "endpoint": endpoint(101)}
    sent = w.send(C1, [b"HELLO", json.dumps(h).encode()])  # again, without kept_mappings
    assert not [verb for rid, verb, _f in sent if rid == C1 and verb == "UNMAP"], "it would not answer"
    assert answer(sent)["fenced"] == {L1}, "it may still keep the mapping"
    assert answer(w.unmap(2, [L1]))["fenced"] == {L1}


def tick(w: World, at: float) -> list:
    """The broker's clock at ``at`` (its clients kept alive): what it sent."""
    w.now = at
    for rid in list(w.core.clients):
        w.core.receive(rid, [b"PING", b"{}"], at)
    outs = w.core.tick(at, lambda c: True)
    w.core.check_invariants()
    return [(o.rid, o.msg.verb, {**o.msg.fields(), **o.msg.blobs()}) for o in outs if isinstance(o, Send)]


STRANGER = b"stranger"
LS = consumer_label(STRANGER)


def test_a_label_that_said_bye_is_gone_and_one_never_registered_is_fenced_once_the_time_ran_out():
    """Never registered here (a consumer of a broker that restarted, say): the round waits
    ``timeout_ms`` for it to register, then calls it fenced."""
    w = World()
    w.send(C3, [b"BYE", b"{}"])
    assert w.unmap(1, [L3, LS]) == [], "nobody to ask yet, and not over"
    assert tick(w, w.core.timeout_s - 0.01) == [], "its time has not run out"
    sent = tick(w, w.core.timeout_s)
    assert answer(sent) == {"request": 1, "unmapped": set(), "gone": {L3}, "fenced": {LS}}
    assert not w.core.unmaps and not w.core.unseen_in and not w.core.unseen_of and not w.core.unseen_rounds
    assert [v for _r, v, _f in w.hello(STRANGER, "consumer", 200) if v == "UNMAP"] == [], "too late: not asked"


def test_a_label_not_registered_yet_is_asked_when_it_registers():
    """A consumer that registers while a round awaits its label is asked after its WELCOME, and
    the round is over only once it answered (also when the others named answered before)."""
    w = World()
    assert [(rid, verb) for rid, verb, _f in w.unmap(2, [L1, LS])] == [(C1, "UNMAP")]
    assert w.unmapped(C1, 2) == [], "the stranger may still register"
    sent = w.hello(STRANGER, "consumer", 200)
    assert [(rid, verb) for rid, verb, _f in sent] == [(STRANGER, "WELCOME"), (STRANGER, "UNMAP")]
    assert sent[1][2]["request"] == 2 and sent[1][2]["memory"] == MEM
    assert tick(w, w.core.timeout_s + 1) == [], "asked: its answer, not the clock, ends the round"
    assert answer(w.unmapped(STRANGER, 2)) == {"request": 2, "unmapped": {L1, LS}, "gone": set(), "fenced": set()}


def test_a_label_that_registers_without_kept_mappings_is_answered_for():
    """It never read ``keep`` from this broker: it closes at each release (step 4), as when it
    was registered at the UNMAP."""
    w = World()
    w.unmap(3, [LS])
    h = {"protocol": PROTOCOL_VERSION, "role": "consumer", "channel": "ch", "pid": 200, "endpoint": endpoint(200)}
    sent = w.send(STRANGER, [b"HELLO", json.dumps(h).encode()])
    assert answer(sent)["unmapped"] == {LS} and not [v for _r, v, _f in sent if v == "UNMAP"]


def test_a_consumer_dropped_without_proof_is_fenced_unless_it_registers_in_time():
    w = World()
    w.now = 10.0  # every client silent past the timeout; nobody can judge their processes
    w.core.tick(w.now, lambda c: None)
    assert C1 not in w.core.clients and L1 not in w.core.gone_labels
    w.hello(P, "producer", 100)
    assert w.unmap(1, [L1]) == [] and w.unmap(2, [L1]) == []
    w.hello(C1, "consumer", 101)  # back within both rounds' time: asked in both
    assert answer(w.unmapped(C1, 1))["unmapped"] == {L1}
    assert answer(w.unmapped(C1, 2))["unmapped"] == {L1}
    w.now = 20.0
    w.core.tick(w.now, lambda c: None)  # dropped again, without proof
    w.hello(P, "producer", 100)
    w.unmap(3, [L1])
    assert answer(tick(w, w.now + w.core.timeout_s))["fenced"] == {L1}


def test_a_producer_awaits_at_most_max_unseen_unregistered_labels_the_rest_are_fenced_at_once():
    w = World()
    labels = [f"{i:016x}" for i in range(MAX_UNSEEN)]
    for i in range(0, MAX_UNSEEN, 4096):  # 4096 labels at most in one UNMAP
        w.unmap(1 + i // 4096, labels[i:i + 4096])
    assert w.core.unseen_of == {P: MAX_UNSEEN}
    assert answer(w.unmap(99, [LS])) == {"request": 99, "unmapped": set(), "gone": set(), "fenced": {LS}}
    assert [(rid, verb) for rid, verb, _f in w.unmap(100, [L1, LS])] == [(C1, "UNMAP")]
    sent = w.unmapped(C1, 100)
    assert answer(sent) == {"request": 100, "unmapped": {L1}, "gone": set(), "fenced": {LS}}


def test_a_producer_that_leaves_drops_the_labels_its_rounds_awaited():
    w = World()
    w.unmap(1, [LS])
    w.send(P, [b"BYE", b"{}"])
    assert not w.core.unmaps and not w.core.unseen_in and not w.core.unseen_of and not w.core.unseen_rounds
    assert [v for _r, v, _f in w.hello(STRANGER, "consumer", 200) if v == "UNMAP"] == []


def sends(outs: list) -> list[tuple[bytes, str, dict]]:
    return [(o.rid, o.msg.verb, o.msg.fields()) for o in outs if isinstance(o, Send)]


@pytest.mark.parametrize("why", ["bye", "process gone"])
def test_an_awaited_consumer_that_leaves_proven_is_answered_gone(why):
    w = World()
    w.unmap(3, [L1, L2])
    w.unmapped(C2, 3)
    outs = w.core.client_gone(C1, why)
    w.core.check_invariants()
    assert answer(sends(outs)) == {"request": 3, "unmapped": {L2}, "gone": {L1}, "fenced": set()}


@pytest.mark.parametrize("then", ["bye", "hello", "silence"])
def test_an_awaited_consumer_dropped_silent_holding_nothing_is_awaited_unregistered_from_its_drop(then):
    """Step 4: deregistered without proof while it held nothing, it may yet speak. The round that
    asked it awaits its label unregistered for timeout_ms from the drop (not from the UNMAP, whose
    time ran out before the next tick): its BYE proves it gone, its HELLO gets the UNMAP again, and
    silence past that time fences it."""
    w = World()
    w.unmap(1, [L1, L2])
    w.unmapped(C2, 1)
    w.now = 2.0
    w.send(P, [b"PING", b"{}"])  # the broker's clock
    assert sends(w.core.client_gone(C1, "heartbeat timeout")) == []
    w.core.check_invariants()
    assert tick(w, 4.9) == [], "awaited until timeout_ms after the drop"
    if then == "bye":
        got = answer(w.send(C1, [b"BYE", b"{}"]))
        assert got == {"request": 1, "unmapped": {L2}, "gone": {L1}, "fenced": set()}
    elif then == "hello":
        sent = w.hello(C1, "consumer", 101)
        assert [(rid, f["request"]) for rid, verb, f in sent if verb == "UNMAP"] == [(C1, 1)]
        assert answer(w.unmapped(C1, 1)) == {"request": 1, "unmapped": {L1, L2}, "gone": set(), "fenced": set()}
    else:
        assert answer(tick(w, 5.1)) == {"request": 1, "unmapped": {L2}, "gone": set(), "fenced": {L1}}


def test_an_awaited_consumer_dropped_while_it_holds_a_delivery_is_fenced_at_once():
    """It may still read (and have mapped) what it held: nothing it says later proves otherwise."""
    w = World()
    _deliver_kept(w, C1, 1)
    w.unmap(1, [L1, L2])
    w.unmapped(C2, 1)
    got = answer(sends(w.core.client_gone(C1, "heartbeat timeout")))
    w.core.check_invariants()
    assert got == {"request": 1, "unmapped": {L2}, "gone": set(), "fenced": {L1}}


def test_a_consumer_sent_keep_that_registers_again_without_kept_mappings_after_a_silent_drop_is_fenced():
    """Step 0: a consumer this broker sent ``keep`` that registers again without kept_mappings
    withdrew them (it may still keep the mapping, and will not answer): fenced in every round, also
    when a silent drop came between (step 4: the broker remembers what it sent by routing id)."""
    w = World()
    token = _deliver_kept(w, C1, 1)
    w.send(C1, Message("RELEASE", {"token": token}).encode())  # an idle kept mapping now
    w.unmap(1, [L1])
    w.now = 2.0
    w.send(P, [b"PING", b"{}"])
    assert sends(w.core.client_gone(C1, "heartbeat timeout")) == []
    h = {"protocol": PROTOCOL_VERSION, "role": "consumer", "channel": "ch", "pid": 101, "endpoint": endpoint(101)}
    sent = w.send(C1, [b"HELLO", json.dumps(h).encode()])  # again, without kept_mappings
    assert answer(sent) == {"request": 1, "unmapped": set(), "gone": set(), "fenced": {L1}}
    assert answer(w.unmap(2, [L1]))["fenced"] == {L1}


def test_a_dropped_consumer_past_the_unregistered_bound_is_fenced_at_once_and_restarts_nothing():
    """Step 4: a producer's rounds await at most MAX_UNSEEN labels unregistered; a label past that
    at a drop is fenced at once, and the round's other labels keep their time."""
    w = World()
    labels = [f"{i:016x}" for i in range(MAX_UNSEEN - 1)]
    for i in range(0, MAX_UNSEEN - 1, 4096):  # 4096 labels at most in one UNMAP
        w.unmap(1 + i // 4096, labels[i:i + 4096])
    w.unmap(100, [LS, L1])  # the last place for LS; L1 is registered, asked
    assert w.core.unseen_of == {P: MAX_UNSEEN}
    w.now = 2.0
    w.send(P, [b"PING", b"{}"])
    assert sends(w.core.client_gone(C1, "heartbeat timeout")) == []
    w.core.check_invariants()
    got = [f for rid, verb, f in tick(w, 3.1) if verb == "UNMAPPED" and f["request"] == 100]
    assert got == [{"request": 100, "unmapped": [], "gone": [], "fenced": [L1, LS]}], "LS's time ran from the UNMAP"


def test_a_round_whose_time_restarts_at_a_drop_expires_after_rounds_opened_before_the_drop():
    """Rounds awaiting labels unregistered expire in the order of their deadlines (an invariant):
    one that already awaited a label and restarts its time at a drop moves behind the others."""
    w = World()
    w.unmap(1, [L1, LS])
    w.now = 1.0
    w.unmap(2, [LS])
    w.now = 2.0
    w.send(P, [b"PING", b"{}"])
    assert sends(w.core.client_gone(C1, "heartbeat timeout")) == []
    w.core.check_invariants()
    assert answer(tick(w, 4.1)) == {"request": 2, "unmapped": set(), "gone": set(), "fenced": {LS}}
    assert answer(tick(w, 5.1)) == {"request": 1, "unmapped": set(), "gone": set(), "fenced": {L1, LS}}


def test_a_forward_that_cannot_be_delivered_counts_as_fenced():
    w = World()
    ((rid, verb, fwd),) = w.unmap(4, [L1])
    assert (rid, verb) == (C1, "UNMAP")
    outs = w.core.undeliverable(C1, Unmap(fwd["request"], fwd["memory"], producer_id=fwd["producer_id"]), "full")
    assert answer([(o.rid, o.msg.verb, o.msg.fields()) for o in outs if isinstance(o, Send)])["fenced"] == {L1}


def test_a_consumer_that_registers_again_while_awaited_is_asked_again():
    w = World()
    w.unmap(5, [L1])
    again = w.hello(C1, "consumer", 101)
    assert [(rid, verb, f["request"]) for rid, verb, f in again if verb == "UNMAP"] == [(C1, "UNMAP", 5)]
    assert answer(w.unmapped(C1, 5))["unmapped"] == {L1}


def test_a_producer_that_leaves_takes_its_rounds_and_late_answers_change_nothing():
    w = World()
    w.unmap(6, [L1])
    w.send(P, [b"BYE", b"{}"])
    assert not w.core.unmaps and not w.core.awaited_in
    assert w.unmapped(C1, 6) == []


def test_refusals_name_the_field_and_change_nothing():
    w = World()
    assert [e["code"] for e in errors(w.unmap(1, [L1], rid=C2))] == ["wrong_role"]
    assert [e["code"] for e in errors(w.unmapped(P, 1))] == ["wrong_role"]
    no_list = w.send(P, Message("UNMAP", {"request": 1}, {"memory": MEM}).encode())
    assert [(e["code"], e["field"]) for e in errors(no_list)] == [("bad_header", "consumers")]
    for bad in ([], [L1, L1], ["not-a-label"], [L1.upper()]):
        assert [(e["code"], e["field"]) for e in errors(w.unmap(1, bad))] == [("bad_header", "consumers")], bad
    for request in (0, -1, 1 << 63, "1", True):
        sent = w.send(P, Message("UNMAP", {"request": request, "consumers": [L1]}, {"memory": MEM}).encode())
        assert [(e["code"], e["field"]) for e in errors(sent)] == [("bad_header", "request")], request
    big = w.send(P, [b"UNMAP", json.dumps({"request": 1, "consumers": [L1], "x": "x" * (128 << 10)}).encode(), MEM])
    assert [e["code"] for e in errors(big)] == ["bad_header"], "a header over 128 KiB"
    short = w.send(P, [b"UNMAP", json.dumps({"request": 1, "consumers": [L1]}).encode(), MEM[:63]])
    assert [e["code"] for e in errors(short)] == ["bad_frames"]
    assert [e["code"] for e in errors(w.send(P, [b"UNMAP", b'{"request": 1, "consumers": []}']))] == ["bad_frames"]
    no_producer = w.send(C1, Message("UNMAPPED", {"request": 1}).encode())
    assert [(e["code"], e["field"]) for e in errors(no_producer)] == [("bad_header", "producer_id")]
    assert not w.core.unmaps, "nothing refused opened a round"
    w.unmap(9, [L1])
    (dup,) = errors(w.unmap(9, [L2]))
    assert (dup["code"], dup["field"], dup["request"]) == ("bad_header", "request", 9), "names the round refused"
    assert list(w.core.unmaps) == [("p", 9)] and w.core.unmaps[("p", 9)].waiting == {C1}


def test_a_producer_may_have_at_most_max_unmaps_open():
    w = World()
    for r in range(1, MAX_UNMAPS + 1):
        w.unmap(r, [L1])
    (err,) = errors(w.unmap(MAX_UNMAPS + 1, [L1]))
    assert err["code"] == "limit_exceeded" and err["limit"] == "unmaps"
    assert len(w.core.unmaps) == MAX_UNMAPS
    answer(w.unmapped(C1, 1))
    assert not errors(w.unmap(MAX_UNMAPS + 1, [L1])), "one answered, one more may open"


def test_gone_labels_are_remembered_until_the_consumer_registers_again():
    w = World()
    w.send(C1, [b"BYE", b"{}"])
    assert L1 in w.core.gone_labels
    w.hello(C1, "consumer", 101)
    assert L1 not in w.core.gone_labels
    sent = w.unmap(1, [L1])
    assert [(rid, verb) for rid, verb, _f in sent] == [(C1, "UNMAP")], "registered again: it is asked, not answered for"


# --- the consumer's import cache ------------------------------------------------------------------

class Opened:
    """Openers that record what was opened and closed."""

    def __init__(self) -> None:
        self.log: list[str] = []

    def opener(self, name: str):
        def open_() -> tuple[str, object]:
            self.log.append(f"open {name}")
            return name, lambda: self.log.append(f"close {name}")
        return open_


def test_a_kept_mapping_stays_open_idle_and_a_plain_one_closes_at_its_last_release():
    o, cache = Opened(), ImportCache(limit=0, keep=2)
    cache.acquire(b"a", o.opener("a"), keep=True)
    cache.acquire(b"b", o.opener("b"))
    cache.release(b"a")
    cache.release(b"b")
    assert o.log == ["open a", "open b", "close b"] and cache.kept() == 1
    cache.acquire(b"a", o.opener("a"), keep=True)
    assert cache.opens == 2, "the kept mapping was reused"


def test_a_delivery_without_keep_ends_the_keeping():
    o, cache = Opened(), ImportCache(limit=0, keep=2)
    cache.acquire(b"a", o.opener("a"), keep=True)
    cache.acquire(b"a", o.opener("a"), keep=False)
    cache.release(b"a")
    cache.release(b"a")
    assert o.log == ["open a", "close a"]


def test_only_the_newest_kept_mappings_stay_beyond_the_keep_limit():
    o, cache = Opened(), ImportCache(limit=0, keep=2)
    for name in "abc":
        cache.acquire(name.encode(), o.opener(name), keep=True)
        cache.release(name.encode())
    assert o.log == ["open a", "open b", "open c", "close a"] and cache.kept() == 2


def test_unmap_closes_before_it_answers_at_once_when_idle_or_absent():
    o, cache = Opened(), ImportCache(limit=0, keep=2)
    cache.acquire(b"a", o.opener("a"), keep=True)
    cache.release(b"a")
    cache.unmap(b"a", lambda: o.log.append("answer a"))
    cache.unmap(b"z", lambda: o.log.append("answer z"))
    assert o.log == ["open a", "close a", "answer a", "answer z"]


def test_unmap_of_a_held_mapping_answers_after_its_last_release_closed_it():
    o, cache = Opened(), ImportCache(limit=0, keep=2)
    cache.acquire(b"a", o.opener("a"), keep=True)
    cache.acquire(b"a", o.opener("a"), keep=True)
    cache.unmap(b"a", lambda: o.log.append("answer"))
    cache.release(b"a")
    assert o.log == ["open a"], "still held once: neither closed nor answered"
    cache.release(b"a")
    assert o.log == ["open a", "close a", "answer"]


def test_close_idle_closes_kept_mappings_and_leaves_held_ones():
    o, cache = Opened(), ImportCache(limit=0, keep=4)
    for name in "ab":
        cache.acquire(name.encode(), o.opener(name), keep=True)
    cache.release(b"a")
    cache.close_idle()
    assert o.log == ["open a", "open b", "close a"] and len(cache) == 1


def test_the_wire_carries_keep_both_ways():
    h = Handoff(grant_id=1, handoff_id=2, handle=struct.pack("<QIBB2s", 64, 256, 1, 1, b"\0\0"), memory=MEM,
                keep=True)
    (back,) = decode_all(h.encode())
    assert back.keep and back.deliver("00" * 24, "p").keep
    (plain,) = decode_all(Handoff(grant_id=1, handoff_id=2, handle=h.handle, memory=MEM).encode())
    assert not plain.keep


def test_an_unmapped_past_the_rate_still_answers_its_round():
    """An UNMAPPED past the consumer's message rate was refused whole: the round never ended and
    its producer kept the allocation until it closed. An UNMAPPED answering a round that awaits
    the sender passes the rate, for nothing (spec §6a); a second one is refused whole."""
    w = World()
    w.unmap(7, [L1])
    c = w.core.clients[C1]
    c.allowance, c.allowance_at = 0.5, 0.0
    assert answer(w.unmapped(C1, 7)) == {"request": 7, "unmapped": {L1}, "gone": set(), "fenced": set()}
    assert c.allowance == 0.5
    assert [(e["code"], e["limit"]) for e in errors(w.unmapped(C1, 7))] == [("limit_exceeded", "message_rate")]
