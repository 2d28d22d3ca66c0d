"""The broker core, driven over every interleaving hypothesis finds (no sockets, no clock).

A model of each client's view (grants, outstanding handoffs, held tokens) is fed by what the core
sends; after every step the core's invariants hold and no handoff has ended twice; at the end,
with every client gone, every handoff the broker accepted has ended exactly once (RELEASED to its
producer, or PRODUCER_GONE to its consumer). ``HURRAY_HYPOTHESIS_EXAMPLES`` raises the number of
runs for a soak (CI: the default below).
"""

from __future__ import annotations

import itertools
import json
import logging
import math
import os
import struct
from typing import Any

import hypothesis.strategies as st
import pytest
from hypothesis import HealthCheck, settings
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from hurray_ipc.broker.core import (
    MAX_CREDITS,
    MAX_HELD,
    BrokerCore,
    Send,
    _Recent,
)
from hurray_ipc.broker.queries import MAX_QUERY_PEERS, MAX_UNREAD, PROBE_FIRST_S, refill
from hurray_ipc.devices.base import host_id
from hurray_ipc.wire.ipc import ERROR_CODES, HOT_VERBS, PROTOCOL_VERSION, Message, encode_batch

HOST = host_id()
TIMEOUT = 3.0
PRODUCERS = [b"p0", b"p1"]
CONSUMERS = [b"c0", b"c1", b"c2"]
EXAMPLES = int(os.environ.get("HURRAY_HYPOTHESIS_EXAMPLES", "150"))


def endpoint(pid: int) -> dict:
    return {"device": {"kind": "cpu", "ordinal": 0, "uuid": "cpu-test", "pci_bus_id": "", "emulated": False,
                       "host": HOST},
            "caps": {"ipc_memory": True, "ipc_events": False, "ipc_streams": False, "peers": []},
            "pid": pid, "stream": None}


def frames(verb: str, header: dict, *payload: bytes) -> list[bytes]:
    """A message's frames: JSON verbs as JSON; binary hot verbs (HANDOFF, RELEASE) packed by the
    library (tests/test_protocol_raw.py packs them from the spec alone), positional payload
    frames named handle, memory, event."""
    if verb in HOT_VERBS:
        return Message(verb, header, dict(zip(("handle", "memory", "event"), payload, strict=False))).encode()
    return [verb.encode(), json.dumps(header).encode(), *payload]


def _forged(i: int) -> str:
    return "f0" * 23 + f"{i:02x}"  # a well-formed token no broker issued


def cpu_handle(size: int = 4096) -> bytes:
    return struct.pack("<QIBB2s", size, 256, 0, 0, b"\0\0")


class View:
    def __init__(self) -> None:
        self.registered = False
        self.grants: list[int] = []
        self.outstanding: set[int] = set()
        self.held: dict[str, tuple[bytes, int]] = {}
        # Kept mappings (§4.10): the consumer has the allocation MEM mapped (its process keeps it
        # across registrations and brokers), and the UNMAPs it got and has not answered yet.
        self.mapped = False
        self.unmaps: list[tuple[str, int]] = []


class BrokerMachine(RuleBasedStateMachine):
    hold_s: float | None = None  # no hold bound (the default): see BrokerMachineWithHold

    def __init__(self) -> None:
        super().__init__()
        self.now = 1000.0
        self.core = self.new_broker()
        self.views = {rid: View() for rid in PRODUCERS + CONSUMERS}
        self.pids = {rid: 100 + i for i, rid in enumerate(PRODUCERS + CONSUMERS)}
        self.accepted: dict[tuple[bytes, int], str] = {}
        self.holder: dict[tuple[bytes, int], bytes] = {}
        self.token_of: dict[str, tuple[bytes, int]] = {}
        self.released: dict[tuple[bytes, int], int] = {}  # RELEASED to the producer
        self.gone: dict[tuple[bytes, int], int] = {}  # PRODUCER_GONE to the consumer that held it
        self.hids = iter(range(1, 1 << 30))
        self.errors: list[str] = []
        self.requests = iter(range(1, 1 << 30))
        self.rounds: dict[tuple[bytes, int], set[bytes]] = {}  # open UNMAPs: the consumers each names
        self.delivered_at: dict[str, float] = {}  # token -> when its DELIVER went out
        self.fenced_keys: set[tuple[bytes, int]] = set()  # handoffs whose holder was told PRODUCER_GONE fenced

    # --- plumbing ---------------------------------------------------------------------------
    def new_broker(self) -> BrokerCore:
        """A broker whose session and tokens follow from the steps so far: the rules draw from
        sorted tokens, and hypothesis needs a replayed run to draw the same."""
        self.brokers = getattr(self, "brokers", 0) + 1
        n = itertools.count(1)
        # A fence a few timeouts long, so that silent holders are fenced within a run (spec §5).
        return BrokerCore(host=HOST, timeout_s=TIMEOUT, session=f"{self.brokers:016x}",
                          token=lambda: f"{next(n):032x}", fence_s=3 * TIMEOUT, hold_s=self.hold_s)

    def feed(self, outs: list) -> None:
        for o in outs:
            if not isinstance(o, Send):
                continue
            v, h = self.views.get(o.rid), o.msg.fields()
            verb = o.msg.verb
            if verb == "GRANT":
                v.grants.append(h["grant_id"])
            elif verb == "REVOKE":
                v.grants = [g for g in v.grants if g not in h["grant_ids"]]
            elif verb == "DELIVER":
                key = (h["producer_id"].encode(), h["handoff_id"])
                self.delivered_at[h["token"]] = self.now
                v.held[h["token"]] = key
                self.token_of[h["token"]] = key
                self.holder[key] = o.rid
            elif verb == "ACCEPTED":
                v.outstanding.add(h["handoff_id"])
            elif verb == "RELEASED":
                key = (o.rid, h["handoff_id"])
                readers = [c for c in CONSUMERS if self.views[c].registered and key in self.views[c].held.values()]
                assert not readers, f"{key} went back to its producer while {readers} still hold it"
                if key in self.fenced_keys:  # its holder may still read it: the producer must retire it
                    assert h["reason"] == "consumer_fenced", f"{key} was fenced but went back {h['reason']!r}"
                self._end(self.released, key)
                v.outstanding.discard(h["handoff_id"])
            elif verb == "PRODUCER_GONE":
                for t in h["tokens"]:
                    key = v.held.pop(t, None)
                    if key is not None and h.get("reason") != "reclaimed":  # reclaimed: a claim refused
                        self._end(self.gone, key)
                    if key is not None and h.get("reason") == "fenced":
                        self.fenced_keys.add(key)
                        hold = self.core.hold_s
                        if hold is not None and o.rid in self.core.clients and t in self.delivered_at:
                            # Fenced while registered: for holding, never before the bound (§5).
                            assert self.now - self.delivered_at[t] > hold, f"{t} fenced after holding " \
                                f"{self.now - self.delivered_at[t]} s, under the bound {hold}"
            elif verb == "UNMAP":
                v.unmaps.append((h["producer_id"], h["request"]))
            elif verb == "UNMAPPED":
                named = self.rounds.pop((o.rid, h["request"]))
                mapped = {BrokerCore.label_of(c) for c in named if c in self.views and self.views[c].mapped}
                # What a consumer may still have mapped must be fenced: the producer frees otherwise.
                assert mapped <= set(h["fenced"]), f"UNMAPPED {h} lets {sorted(mapped)} be freed under a mapping"
                assert sorted(h["unmapped"] + h["gone"] + h["fenced"]) == sorted(
                    BrokerCore.label_of(c) for c in named), f"UNMAPPED {h} does not answer for {named}"
            elif verb == "ERROR":
                assert h["code"] in ERROR_CODES and h["code"] != "internal", h
                self.errors.append(h["code"])

    @staticmethod
    def _end(ends: dict[tuple[bytes, int], int], key: tuple[bytes, int]) -> None:
        """A handoff ends at most once for each side: RELEASED to its producer, PRODUCER_GONE to
        its holder. Both happen when a producer comes back after its holder was told it gone."""
        ends[key] = ends.get(key, 0) + 1
        assert ends[key] == 1, f"handoff {key} ended {ends[key]} times"

    def send(self, rid: bytes, verb: str, header: dict, *payload: bytes) -> None:
        self.feed(self.core.receive(rid, frames(verb, header, *payload), self.now))

    def hello(self, rid: bytes) -> None:
        v = self.views[rid]
        role = "producer" if rid in PRODUCERS else "consumer"
        h = {"protocol": PROTOCOL_VERSION, "role": role, "channel": "ch", "pid": self.pids[rid],
             "endpoint": endpoint(self.pids[rid])}
        if role == "producer":
            h["outstanding"] = [{"handoff_id": hid, "consumer_id": BrokerCore.label_of(self.holder[(rid, hid)])}
                                for hid in sorted(v.outstanding)]
            v.grants.clear()  # void with the old registration
        else:
            h["held"] = [{"token": t, "producer_id": k[0].decode(), "handoff_id": k[1], "event_pending": False}
                         for t, k in v.held.items()]
            h["kept_mappings"] = True
        v.registered = True
        self.send(rid, "HELLO", h)

    # --- rules ------------------------------------------------------------------------------
    @initialize()
    def everyone_registers(self) -> None:
        for rid in PRODUCERS + CONSUMERS:
            self.hello(rid)

    @rule(who=st.sampled_from(PRODUCERS + CONSUMERS))
    def register(self, who: bytes) -> None:
        self.hello(who)

    @rule(who=st.sampled_from(CONSUMERS), n=st.integers(1, 3))
    def request(self, who: bytes, n: int) -> None:
        self.send(who, "REQUEST", {"credits": n})

    @rule(who=st.sampled_from(CONSUMERS), why=st.sampled_from(["full", "unreachable"]))
    def deliver_lost(self, who: bytes, why: str) -> None:
        """The socket could not take the consumer's latest DELIVER: it never saw that handoff."""
        live = self.core.deliveries
        mine = [t for t in self.views[who].held if t in live and live[t].consumer == who]
        if mine:
            del self.views[who].held[mine[-1]]
            before = self._asked(who)
            self.feed(self.core.undeliverable(who, Message("DELIVER", {"token": mine[-1]}), why))
            assert self._asked(who) == before, "a bounced DELIVER's credit was lost or made up"

    @rule(who=st.sampled_from(CONSUMERS), why=st.sampled_from(["full", "unreachable"]))
    def send_fails(self, who: bytes, why: str) -> None:
        """Any message to the consumer could not be sent (a PONG, a probe): it is choked (spec §1)."""
        before = self._asked(who)
        self.feed(self.core.undeliverable(who, Message("PONG", {}), why))
        assert self._asked(who) == before, "choking lost or made up credits"

    def _asked(self, who: bytes) -> int:
        """What the broker counts ``who`` asked for and not yet answered, with what it holds."""
        c = self.core.clients.get(who)
        return -1 if c is None else c.credits + c.granted + c.held

    @rule(who=st.sampled_from(PRODUCERS), n=st.integers(1, 3))
    def ready(self, who: bytes, n: int) -> None:
        self.send(who, "READY", {"credits": n})

    @rule(who=st.sampled_from(PRODUCERS), how=st.sampled_from(["ok", "ok", "ok", "bad_meta", "bad_typestr",
                                                                  "bogus_grant", "dup_hid"]))
    def handoff(self, who: bytes, how: str) -> None:
        v = self.views[who]
        if not v.grants and how != "bogus_grant":
            # Ask for one grant so most handoff steps reach the interesting part.
            self.send(who, "READY", {"credits": 1})
            if not v.grants:
                consumer = CONSUMERS[next(self.hids) % len(CONSUMERS)]
                self.send(consumer, "REQUEST", {"credits": 1})
        gid = v.grants.pop(0) if v.grants and how != "bogus_grant" else 12345
        hid = next(self.hids)
        if how == "dup_hid":
            if not v.outstanding:
                how = "ok"  # nothing to duplicate: an ordinary handoff
            else:
                hid = min(v.outstanding)
        h = {"grant_id": gid, "handoff_id": hid, "offset": 0, "ack": True,
             "meta": {"shape": [1024], "typestr": "<f4"}}
        if how == "bad_meta":
            h["meta"] = {"shape": [1 << 20], "typestr": "<f8"}
        elif how == "bad_typestr":
            h["meta"] = {"shape": [1024], "typestr": "f4"}
        before = dict(self.core.deliveries)
        self.send(who, "HANDOFF", h, cpu_handle(), b"M" * 64)
        new = set(self.core.deliveries) - set(before)
        for t in new:
            self.accepted[self.core.deliveries[t].producer, self.core.deliveries[t].handoff_id] = t
        if how not in ("ok",):
            assert not new, f"{how} handoff was accepted"

    @rule(who=st.sampled_from(CONSUMERS), data=st.data(),
          how=st.sampled_from(["own", "own", "own", "foreign", "unknown", "double", "event"]))
    def release(self, who: bytes, data: st.DataObject, how: str) -> None:
        v = self.views[who]
        if not v.registered:
            return  # a client that lost its broker says HELLO before anything else
        if how in ("own", "double", "event") and v.held:
            token = data.draw(st.sampled_from(sorted(v.held)))
            if how == "event":
                self.send(who, "EVENT_RELEASE", {"token": token})  # a PRODUCER_SYNCED token has no event
                assert self.errors[-1] == "already_released"
                return
            del v.held[token]  # first: the consumer stops reading, then tells the broker
            self.send(who, "RELEASE", {"token": token, "credits": 1})
            if how == "double":
                self.send(who, "RELEASE", {"token": token})
                assert self.errors[-1] == "already_released"
        elif how == "foreign":
            others = [t for c in CONSUMERS if c != who for t in self.views[c].held]
            if others:
                before = len(self.errors)
                token = data.draw(st.sampled_from(sorted(others)))
                own_claim = (who, token) in self.core.claim_of  # forge_held claimed it under the copied token
                self.send(who, "RELEASE", {"token": token})
                if own_claim:  # withdrawing its own claim touches no one else's (the RELEASED check)
                    assert len(self.errors) == before
                else:  # unknown_token: the victim has not re-claimed it from a restarted broker yet
                    assert len(self.errors) == before + 1 and self.errors[-1] in ("foreign_token", "unknown_token")
        elif how == "unknown":
            self.send(who, "RELEASE", {"token": "ee" * 24})

    @rule(who=st.sampled_from(CONSUMERS), data=st.data())
    def release_batch(self, who: bytes, data: st.DataObject) -> None:
        """Several releases in one RELEASE message (spec §2.2), a token twice among them and one
        never issued: each entry is answered on its own, exactly as if sent alone, and the
        batch's credits are applied once, after the last entry."""
        v = self.views[who]
        if not v.registered or not v.held:
            return
        tokens = data.draw(st.lists(st.sampled_from(sorted(v.held)), min_size=1, max_size=3, unique=True))
        entries = [Message("RELEASE", {"token": t}) for t in tokens]
        entries += [Message("RELEASE", {"token": tokens[0]}), Message("RELEASE", {"token": "ee" * 24, "credits": 2})]
        before = len(self.errors)
        for t in tokens:
            del v.held[t]
        self.feed(self.core.receive(who, encode_batch(entries), self.now))
        assert self.errors[before:] == ["already_released", "unknown_token"], self.errors[before:]

    @rule(who=st.sampled_from(CONSUMERS))
    def forge_held(self, who: bytes) -> None:
        """Re-HELLO claiming another consumer's handoffs under made-up tokens, then release them."""
        victims = [(t, k) for c in CONSUMERS if c != who for t, k in self.views[c].held.items()]
        if not victims:
            return
        h = {"protocol": PROTOCOL_VERSION, "role": "consumer", "channel": "ch", "pid": self.pids[who],
             "endpoint": endpoint(self.pids[who]),
             "held": [{"token": _forged(i), "producer_id": k[0].decode(), "handoff_id": k[1]}
                      for i, (_, k) in enumerate(victims)]
             + [{"token": t, "producer_id": k[0].decode(), "handoff_id": k[1]} for t, k in victims]
             + [{"token": t, "producer_id": k[0].decode(), "handoff_id": k[1]}
                for t, k in self.views[who].held.items()]}
        self.views[who].registered = True
        self.send(who, "HELLO", h)
        for i, (t, k) in enumerate(victims):
            if k[0] not in self.core.clients:
                # Its producer is not registered here: a claim is provisional until the producer's
                # HELLO confirms who holds it (then a wrong claim is voided); nothing can be
                # recycled meanwhile, so the release is not checked here.
                continue
            for tok in (_forged(i), t):
                self.send(who, "RELEASE", {"token": tok})
                assert self.errors[-1] in ("unknown_token", "foreign_token", "already_released",
                                           "not_registered"), self.errors[-1]

    @rule(who=st.sampled_from(PRODUCERS + CONSUMERS),
          raw=st.one_of(st.lists(st.binary(max_size=40), max_size=4),
                        st.sampled_from([[b"HELLO", b"[" * 5000], [b"RELEASE", b'{"token": 7}'],
                                         [b"REQUEST", b'{"credits": 99999999999999999999}'],
                                         [b"HANDOFF", b"{}"], [b"NOPE", b"[" * 100000], [b"BYE"]])))
    def malformed(self, who: bytes, raw: list[bytes]) -> None:
        self.feed(self.core.receive(who, raw, self.now))

    @rule(who=st.sampled_from(CONSUMERS))
    def keep_mapping(self, who: bytes) -> None:
        """It opened MEM and keeps it mapped (a DELIVER with ``keep``), unless a round that names
        it is open: a producer sets ``keep`` only while none is (§4.10 step 1)."""
        if self.views[who].registered and not any(who in named for named in self.rounds.values()):
            self.views[who].mapped = True

    @rule(who=st.sampled_from(PRODUCERS), named=st.sets(st.sampled_from([*CONSUMERS, b"stranger"]), min_size=1))
    def unmap(self, who: bytes, named: set[bytes]) -> None:
        if not self.views[who].registered:
            return
        request = next(self.requests)
        self.rounds[(who, request)] = named
        self.send(who, "UNMAP", {"request": request, "consumers": sorted(BrokerCore.label_of(c) for c in named)},
                  b"M" * 64)

    @rule(who=st.sampled_from(CONSUMERS))
    def answer_unmap(self, who: bytes) -> None:
        """It closes its mapping, then answers the oldest UNMAP it got (§4.10 step 5)."""
        v = self.views[who]
        if v.unmaps and v.registered:
            producer_id, request = v.unmaps.pop(0)
            v.mapped = False
            self.send(who, "UNMAPPED", {"request": request, "producer_id": producer_id})

    @rule(who=st.sampled_from(PRODUCERS + CONSUMERS))
    def die(self, who: bytes) -> None:
        self.views[who] = View()  # a new process would start from nothing
        self.feed(self.core.client_gone(who, "process gone"))
        self.rounds = {k: v for k, v in self.rounds.items() if k[0] != who}  # a producer takes its rounds

    @rule(who=st.sampled_from(PRODUCERS + CONSUMERS))
    def bye(self, who: bytes) -> None:
        if who in CONSUMERS and self.views[who].held:
            return  # the library releases before BYE; a BYE with held buffers is covered by die
        self.views[who].mapped = False  # a consumer closes its kept mappings before its BYE (§4.10 step 2)
        self.send(who, "BYE", {})
        # A producer's BYE ends its handoffs (PRODUCER_GONE) and its rounds: a clean slate.
        self.views[who] = View()
        self.rounds = {k: v for k, v in self.rounds.items() if k[0] != who}

    @rule(dt=st.floats(0.0, 4 * TIMEOUT))  # past the fence (3 timeouts) in one step, too
    def time_passes(self, dt: float) -> None:
        self.now += dt
        self.feed(self.core.tick(self.now, lambda c: True))  # every process lives: silence is no death
        for rid, v in self.views.items():
            if v.registered and rid not in self.core.clients:
                # Silent past the timeout holding nothing, or a consumer silent past the fence
                # (spec §5): deregistered; a fenced one was told PRODUCER_GONE for all it held
                # before its producers got RELEASED (feed checks the order). Its next message
                # would get not_registered; the library then says HELLO again, as register does.
                # Provisional claims (its producer not registered since a restart, §6) are dropped
                # with it and not told: its next HELLO claims them again.
                claims_only = all(k[0] not in self.core.clients for k in v.held.values())
                assert claims_only and not v.outstanding, f"{rid!r} was dropped while it held something"
                v.registered = False
                v.grants.clear()

    @rule(dt=st.floats(0.0, 0.3))
    def a_moment_passes(self, dt: float) -> None:
        """Ticks closer together than the timeout: a choked consumer is probed and its choke ends."""
        self.time_passes(dt)

    @rule(order=st.permutations(PRODUCERS + CONSUMERS), late=st.sets(st.sampled_from(PRODUCERS + CONSUMERS)))
    def broker_restart(self, order: list[bytes], late: set[bytes]) -> None:
        """A new broker; clients re-HELLO with what they hold, the ``late`` ones only at a later
        ``register`` step (a late consumer after its producer's orphan deadline may have passed,
        a late producer after other consumers may have claimed its handoffs)."""
        self.core = self.new_broker()
        self.rounds.clear()  # lost with the broker; a producer asks again (the unmap rule)
        for rid in order:
            if rid in late:
                self.views[rid].registered = False
            elif self.views[rid].registered:
                self.hello(rid)

    @invariant()
    def core_invariants(self) -> None:
        self.core.check_invariants()

    def teardown(self) -> None:
        """Every consumer goes, then time passes, then every producer: whatever a registered
        producer counts outstanding comes back to it exactly once (RELEASED): held ones as their
        consumers go, the rest as orphans."""
        owed = {(p, hid) for p in PRODUCERS if self.views[p].registered for hid in self.views[p].outstanding}
        for rid in CONSUMERS:
            self.views[rid].registered = False  # it stopped reading: its buffers may go back
            self.views[rid].mapped = False  # its process exited: no mapping outlives it
            self.feed(self.core.client_gone(rid, "process gone"))
        self.now += 10 * TIMEOUT
        self.feed(self.core.tick(self.now, lambda c: True))
        missing = {key for key in owed if self.released.get(key) != 1}
        assert not missing, f"never came back to their producers: {sorted(missing)}"
        for rid in PRODUCERS:
            self.feed(self.core.client_gone(rid, "process gone"))
        self.now += 10 * TIMEOUT
        self.feed(self.core.tick(self.now, lambda c: True))
        self.core.check_invariants()
        assert not self.core.deliveries and not self.core.clients and not self.core.claims


TestBrokerCore = BrokerMachine.TestCase
# CI runs a fixed set of examples (derandomized: the same interleavings every run, so a red CI is a
# regression, not a new draw); a soak run (HURRAY_HYPOTHESIS_EXAMPLES) explores at random.
TestBrokerCore.settings = settings(max_examples=EXAMPLES, stateful_step_count=40, deadline=None,
                                   derandomize="HURRAY_HYPOTHESIS_EXAMPLES" not in os.environ,
                                   suppress_health_check=[HealthCheck.too_slow])



class BrokerMachineWithHold(BrokerMachine):
    """The same steps against a broker with a hold bound (spec §5) shorter than the fence: held
    deliveries are fenced while their consumers live, speak and stay registered, and every check
    of the machine holds (a handoff ends once for each side, never RELEASED while a registered
    consumer holds it, everything owed comes back)."""

    hold_s = TIMEOUT / 2

    # Steps of a tenth of a timeout: floats() draws mostly 0 and tiny values, past the bound rarely.
    @rule(who=st.sampled_from(PRODUCERS), dt=st.integers(0, 9).map(lambda k: k * TIMEOUT / 10))
    def hand_off_and_speak_while_time_passes(self, who: bytes, dt: float) -> None:
        """A handoff, then every registered client speaks (PING) and less than a timeout passes:
        what ends a delivery then is the hold bound, never silence."""
        self.handoff(who, "ok")
        for rid, v in self.views.items():
            if v.registered and rid in self.core.clients:
                self.send(rid, "PING", {})
        self.time_passes(dt)


TestBrokerCoreWithHold = BrokerMachineWithHold.TestCase
TestBrokerCoreWithHold.settings = TestBrokerCore.settings


# --- direct checks of single rules ------------------------------------------------------------

def _core() -> BrokerCore:
    return BrokerCore(host=HOST, timeout_s=TIMEOUT)


def _hello(core: BrokerCore, rid: bytes, role: str, pid: int = 5, now: float = 0.0, **extra) -> list:
    h = {"protocol": PROTOCOL_VERSION, "role": role, "channel": "ch", "pid": pid, "endpoint": endpoint(pid), **extra}
    return core.receive(rid, frames("HELLO", h), now)


def _errors(outs: list) -> list[dict]:
    return [o.msg.fields() for o in outs if isinstance(o, Send) and o.msg.verb == "ERROR"]


def _grant_ids(outs: list) -> list[int]:
    return [o.msg.fields()["grant_id"] for o in outs if isinstance(o, Send) and o.msg.verb == "GRANT"]


def _handoff(core: BrokerCore, gid: int, now: float = 0.0, *, hid: int = 1, handle: bytes | None = None,
             blobs: tuple[bytes, ...] = (b"M" * 64,), **extra: Any) -> list:
    """Producer ``p`` hands off on grant ``gid``: a CPU buffer (or ``handle``) at offset 0."""
    header = {"grant_id": gid, "handoff_id": hid, "offset": 0, **extra}
    return core.receive(b"p", frames("HANDOFF", header, handle or cpu_handle(), *blobs), now)


def test_core_events_go_to_the_note_it_was_given_not_to_a_logger(caplog):
    """The core formats no log line: what it has to say reaches ``note`` as (level, fields)."""
    noted: list[tuple[int, dict]] = []
    core = BrokerCore(host=HOST, timeout_s=TIMEOUT, note=lambda level, fields: noted.append((level, fields)))
    with caplog.at_level(logging.DEBUG, logger="hurray.broker"):
        _hello(core, b"c", "consumer")
        core.receive(b"c", frames("NOPE", {}), 0.0)
    assert [(lv, f["event"]) for lv, f in noted] == [(logging.INFO, "hello"), (logging.WARNING, "error")], noted
    assert noted[0][1]["role"] == "consumer" and noted[1][1]["code"] == "unknown_verb"
    assert not caplog.records, [r.getMessage() for r in caplog.records]


def test_deeply_nested_json_is_refused_not_fatal():
    core = _core()
    for raw in ([b"NOPE", b"[" * 100_000], [b"HELLO", b"[" * 100_000], [b"HELLO", b'{"a":' * 50_000]):
        (err,) = _errors(core.receive(b"x", raw, 0.0))
        assert err["code"] in ("bad_header", "unknown_verb")
    _hello(core, b"ok", "consumer")
    assert b"ok" in core.clients


def test_hello_pid_out_of_range_is_refused():
    core = _core()
    (err,) = _errors(_hello(core, b"x", "producer", pid=2**31))
    assert err["code"] == "bad_header" and "endpoint.pid" in err["message"]


def test_endpoint_fields_are_typed_not_coerced():
    core = _core()
    ep = endpoint(5)
    ep["device"]["uuid"] = None
    _hello(core, b"c", "consumer", pid=5, endpoint=ep)
    assert core.clients[b"c"].endpoint.identity.uuid == ""
    for bad in ({"ipc_memory": "false"}, {"ipc_events": 1}):
        ep = endpoint(5)
        ep["caps"].update(bad)
        (err,) = _errors(_hello(core, b"d", "consumer", pid=5, endpoint=ep))
        assert err["code"] == "bad_header" and "endpoint.caps" in err["message"]


def test_limits_refuse_with_a_clear_error():
    core = _core()
    _hello(core, b"c", "consumer")
    outs = core.receive(b"c", frames("REQUEST", {"credits": 100}), 0.0)
    assert not _errors(outs)
    c = core.clients[b"c"]
    c.held = MAX_HELD - 150  # as if it held that many
    (err,) = _errors(core.receive(b"c", frames("REQUEST", {"credits": 100}), 0.0))
    assert err["code"] == "limit_exceeded" and "release some first" in err["message"]
    assert (err["limit"], err["value"], err["credits"]) == ("held", MAX_HELD + 50, 100) and c.credits == 100
    c.held = 0


@pytest.mark.parametrize("verb", ["REQUEST", "READY"])
def test_queued_credits_past_the_limit_are_refused_and_nothing_is_added(verb):
    """Spec §6a: more than 4096 queued credits refuses the message, naming the limit, and adds
    nothing; before, the broker clamped them silently and a client waited for deliveries that
    could never come."""
    core = _core()
    _hello(core, b"x", "consumer" if verb == "REQUEST" else "producer")
    assert not _errors(core.receive(b"x", frames(verb, {"credits": MAX_CREDITS - 100}), 0.0))
    (err,) = _errors(core.receive(b"x", frames(verb, {"credits": 200}), 0.0))
    assert (err["code"], err["limit"], err["value"]) == ("limit_exceeded", "queued_credits", MAX_CREDITS + 100)
    assert err["credits"] == 200, "named: none was applied, and the client asks for them again"
    assert core.clients[b"x"].credits == MAX_CREDITS - 100 and core.stats.limits_refused == 1
    core.check_invariants()


def test_a_piggybacked_ready_past_the_limit_is_refused_alone():
    """A HANDOFF's ready over the limit is answered on its own (field ready); the handoff goes."""
    core = _core()
    _hello(core, b"p", "producer", pid=5)
    _hello(core, b"c", "consumer", pid=6)
    core.receive(b"c", frames("REQUEST", {"credits": 1}), 0.0)
    (gid,) = _grant_ids(core.receive(b"p", frames("READY", {"credits": 1}), 0.0))
    core.receive(b"p", frames("READY", {"credits": MAX_CREDITS}), 0.0)
    handle = bytes.fromhex("0010000000000000" "00010000" "00" "00" "0000")
    outs = core.receive(b"p", encode_batch([Message("HANDOFF", {"grant_id": gid, "handoff_id": 1,
                                                                   "offset": 0, "ready": 5},
                                                    {"handle": handle, "memory": b"M" * 64})]), 0.0)
    (err,) = _errors(outs)
    assert (err["code"], err["field"], err["limit"], err["credits"]) == ("limit_exceeded", "ready", "queued_credits", 5)
    assert [o.msg.verb for o in outs if o.msg.verb == "DELIVER"] == ["DELIVER"]
    core.check_invariants()


def test_every_refusal_names_the_credits_it_did_not_apply_and_none_it_did():
    """Credits a RELEASE carried past a limit were answered without naming them (or, on a refused
    RELEASE, only logged), so a consumer that once held close to MAX_HELD counted as asked credits
    the broker never queued, and waited for ever. Every ERROR now names the credits it did not
    apply (spec §2), and only those: credits named but applied would be asked twice."""
    core = _core()
    tokens = _holding(core, 3)
    core.receive(b"c", frames("REQUEST", {"credits": MAX_CREDITS - 10}), 0.0)
    batch = lambda m: encode_batch([m])  # noqa: E731
    # Past the limit, on a RELEASE that is handled: its own ERROR names them.
    (err,) = _errors(core.receive(b"c", batch(Message("RELEASE", {"token": tokens[0], "credits": 20})), 0.0))
    assert (err["field"], err["limit"], err["credits"]) == ("credits", "queued_credits", 20)
    # Past the limit, on a RELEASE that is refused: the refusal names them.
    (err,) = _errors(core.receive(b"c", batch(Message("RELEASE", {"token": _forged(1), "credits": 20})), 0.0))
    assert (err["code"], err["credits"]) == ("unknown_token", 20)
    # Within it, on a RELEASE that is refused: applied, so not named.
    (err,) = _errors(core.receive(b"c", batch(Message("RELEASE", {"token": _forged(2), "credits": 5})), 0.0))
    assert err["code"] == "unknown_token" and "credits" not in err
    assert core.clients[b"c"].credits == MAX_CREDITS - 5
    # Past the rate, dropped entries: the one ERROR names what a limit refused among theirs.
    c = core.clients[b"c"]
    c.allowance, c.allowance_at = 0.5, 10.0
    (err,) = _errors(core.receive(b"c", batch(Message("RELEASE", {"token": _forged(3), "credits": 30})), 10.0))
    assert (err["limit"], err["credits"]) == ("message_rate", 30)
    # Not registered: its next HELLO declares what it asked, so nothing is named to ask again.
    (err,) = _errors(core.receive(b"stranger", frames("REQUEST", {"credits": 5}), 10.0))
    assert err["code"] == "not_registered" and "credits" not in err
    core.check_invariants()


def test_clients_per_process_are_bounded():
    from hurray_ipc.broker.core import MAX_CLIENTS_PER_PROCESS
    core = _core()
    lease = f"hurray-{os.getuid()}-lease-1-77-{'a' * 16}"
    for i in range(MAX_CLIENTS_PER_PROCESS):
        assert not _errors(_hello(core, f"c{i}".encode(), "consumer", lease=lease))
    (err,) = _errors(_hello(core, b"one-too-many", "consumer", lease=lease))
    assert err["code"] == "limit_exceeded"
    assert len(core.clients) == MAX_CLIENTS_PER_PROCESS and len(core.channels) == 1


def test_channels_of_gone_clients_are_forgotten():
    core = _core()
    for i in range(200):
        h = {"protocol": PROTOCOL_VERSION, "role": "consumer", "channel": f"ch{i}", "pid": 5, "endpoint": endpoint(5)}
        core.receive(b"c", frames("HELLO", h), 0.0)  # re-HELLO onto another channel each time
    assert len(core.channels) == 1
    core.client_gone(b"c", "bye")
    assert not core.channels


def test_unresponsive_client_keeps_its_deliveries_until_it_dies():
    core = _core()
    _hello(core, b"p", "producer", pid=5)
    _hello(core, b"c", "consumer", pid=6, credits=1)
    (gid,) = _grant_ids(core.receive(b"p", frames("READY", {"credits": 1}), 0.0))
    outs = _handoff(core, gid, ack=True)
    assert [o.msg.verb for o in outs] == ["DELIVER", "ACCEPTED"]
    alive = {b"p": True, b"c": True}
    outs = core.tick(10 * TIMEOUT, lambda c: alive[c.rid])  # silent far past the timeout, but alive
    assert not outs and core.clients[b"c"].unresponsive and core.stats.unresponsive == 2
    assert len(core.deliveries) == 1
    alive[b"c"] = False
    outs = core.tick(10 * TIMEOUT, lambda c: alive[c.rid])
    assert [(o.msg.verb, o.msg.fields().get("reason")) for o in outs if isinstance(o, Send)] == [
        ("RELEASED", "consumer_gone")]
    core.check_invariants()


def _event_handoff(core: BrokerCore) -> str:
    """Producer ``p`` hands consumer ``c`` an EVENT-mode CUDA buffer at time 0; its token."""
    from hurray_ipc.format.handle import BufferHandle, DeviceTag, SyncMode
    gpu = dict(endpoint(5), device={"kind": "cuda", "ordinal": 0, "uuid": "GPU-x", "pci_bus_id": "", "emulated": True,
                                     "host": HOST}, caps=dict(endpoint(5)["caps"], ipc_events=True))
    _hello(core, b"p", "producer", pid=5, endpoint=gpu)
    _hello(core, b"c", "consumer", pid=6, endpoint=dict(gpu, pid=6), credits=1)
    (gid,) = _grant_ids(core.receive(b"p", frames("READY", {"credits": 1}), 0.0))
    hd = BufferHandle(4096, 256, DeviceTag.CUDA, SyncMode.EVENT).encode()
    outs = _handoff(core, gid, handle=hd, blobs=(b"M" * 64, b"E" * 64))
    (deliver,) = [o.msg for o in outs if o.msg.verb == "DELIVER"]
    return deliver.fields()["token"]


def test_a_live_consumer_silent_past_the_fence_is_fenced():
    """Spec §5: a consumer whose process lives (its lease) but which is silent past ``fence_s``
    while it holds a buffer is fenced: told PRODUCER_GONE (reason fenced) for everything it
    holds, then its producer gets RELEASED ``consumer_fenced`` (never ``consumer_gone``, which
    allows reuse) and no EVENT_RELEASED (its wait may not have been issued). Before the fence it
    only becomes unresponsive. It is deregistered; re-registering, a listing of the token is told
    PRODUCER_GONE fenced again, and a RELEASE of it is already_released."""
    core = BrokerCore(host=HOST, timeout_s=TIMEOUT, fence_s=5 * TIMEOUT)
    token = _event_handoff(core)
    assert not _sent(core.tick(5 * TIMEOUT, lambda c: True))  # unresponsive, not fenced yet
    assert core.clients[b"c"].unresponsive
    core.receive(b"p", frames("PING", {}), 5 * TIMEOUT)  # the producer is not silent
    sent = _sent(core.tick(5 * TIMEOUT + 0.01, lambda c: True))
    assert sent == [(b"c", "PRODUCER_GONE", {"tokens": [token], "reason": "fenced"}),
                    (b"p", "RELEASED", {"handoff_id": 1, "reason": "consumer_fenced"})]
    assert b"c" not in core.clients and b"p" in core.clients and core.stats.consumers_fenced == 1
    assert [e["code"] for e in _errors(core.receive(b"c", frames("PING", {}), 6 * TIMEOUT))] == ["not_registered"]
    held = [{"token": token, "producer_id": "p", "handoff_id": 1, "event_pending": True}]
    sent = _sent(_hello(core, b"c", "consumer", pid=6, held=held))
    assert sent == [(b"c", "PRODUCER_GONE", {"tokens": [token], "reason": "fenced"})]
    assert core.clients[b"c"].held == 0
    (err,) = _errors(core.receive(b"c", frames("RELEASE", {"token": token}), 6 * TIMEOUT))
    assert err["code"] == "already_released"
    core.check_invariants()


def test_a_consumer_judged_by_heartbeats_alone_is_fenced_not_gone():
    """Spec §5: a consumer the broker cannot judge by its process (no lease, another host) that
    falls silent is dropped after the timeout, but nothing proves it dead: what it holds goes back
    ``consumer_fenced``. A proven death (its lease free) is ``consumer_gone``, which allows reuse."""
    core = _core()
    token = _event_handoff(core)
    core.receive(b"p", frames("PING", {}), 2 * TIMEOUT)
    sent = _sent(core.tick(2 * TIMEOUT, lambda c: None if c.rid == b"c" else True))
    assert sent == [(b"c", "PRODUCER_GONE", {"tokens": [token], "reason": "fenced"}),
                    (b"p", "RELEASED", {"handoff_id": 1, "reason": "consumer_fenced"})]
    core = _core()
    _event_handoff(core)
    sent = _sent(core.tick(0.0, lambda c: c.rid != b"c"))
    assert sent == [(b"p", "EVENT_RELEASED", {"handoff_id": 1, "reason": "consumer_gone"}),
                    (b"p", "RELEASED", {"handoff_id": 1, "reason": "consumer_gone"})]


def test_an_unclaimed_handoff_after_a_restart_comes_back_fenced_not_gone():
    """Spec §6 with §5: after a broker restart, a handoff its producer lists and no consumer claims
    within the timeout goes back to the producer, but nothing proves its holder gone (stopped
    across the restart, it has not spoken yet): RELEASED consumer_fenced, never consumer_gone."""
    core = _core()
    _hello(core, b"p", "producer", pid=5, outstanding=[{"handoff_id": 3, "consumer_id": "0" * 16}])
    assert not _sent(core.tick(TIMEOUT - 0.01, lambda c: True))
    assert _sent(core.tick(TIMEOUT, lambda c: True)) == [
        (b"p", "RELEASED", {"handoff_id": 3, "reason": "consumer_fenced"})]
    core.check_invariants()


HOLD = 2.0  # the hold bound of the tests below: shorter than the fence, longer than a tick


def _hold_core() -> BrokerCore:
    return BrokerCore(host=HOST, timeout_s=TIMEOUT, hold_s=HOLD)


def _ping_both(core: BrokerCore, now: float) -> None:
    """Producer and consumer speak: whatever the tick does then is not about silence."""
    for rid in (b"p", b"c"):
        assert not _errors(core.receive(rid, frames("PING", {}), now))


def test_a_delivery_held_past_the_hold_bound_is_fenced_though_its_consumer_lives_and_speaks():
    """Spec §5, hold bound: a delivery its consumer holds longer than ``hold_s`` is fenced, however
    live and talkative the consumer: it is told PRODUCER_GONE ``fenced`` first, then the producer
    gets RELEASED ``consumer_fenced`` (never ``consumer_gone`` or ``released``, which allow reuse
    while the consumer may still read) and no EVENT_RELEASED (its wait may not have been issued).
    Never before the bound. The consumer stays registered; its RELEASE crossing the PRODUCER_GONE
    is refused without charge, once."""
    core = _hold_core()
    token = _event_handoff(core)  # bound at time 0
    _ping_both(core, HOLD)
    assert not _sent(core.tick(HOLD, lambda c: True)), "fenced at the bound, not past it"
    assert core.deliveries[token].consumer == b"c"
    _ping_both(core, HOLD + 0.01)
    sent = _sent(core.tick(HOLD + 0.01, lambda c: True))
    assert sent == [(b"c", "PRODUCER_GONE", {"tokens": [token], "reason": "fenced"}),
                    (b"p", "RELEASED", {"handoff_id": 1, "reason": "consumer_fenced"})]
    assert b"c" in core.clients and core.clients[b"c"].held == 0 and not core.deliveries
    assert core.stats.holds_fenced == 1 and core.stats.consumers_fenced == 0
    c = core.clients[b"c"]
    before = c.allowance
    (err,) = _errors(core.receive(b"c", frames("RELEASE", {"token": token}), HOLD + 0.01))
    assert err["code"] == "already_released" and c.allowance == before - 1, "a crossing RELEASE is not charged"
    (err,) = _errors(core.receive(b"c", frames("RELEASE", {"token": token}), HOLD + 0.01))
    assert err["code"] == "already_released" and c.allowance == before - 11, "a second one is (1 + 9)"
    core.check_invariants()


def test_the_hold_bound_fences_only_the_deliveries_held_past_it():
    """Two deliveries bound a second apart: the tick between their bounds fences the older alone,
    the next one the other; each consumer is told in one PRODUCER_GONE."""
    core = _hold_core()
    _hello(core, b"p", "producer", pid=5)
    _hello(core, b"c", "consumer", pid=6, credits=2)
    gids = _grant_ids(core.receive(b"p", frames("READY", {"credits": 2}), 0.0))
    tokens = [[o.msg.fields()["token"] for o in _handoff(core, gid, now, hid=hid) if o.msg.verb == "DELIVER"][0]
              for gid, hid, now in zip(gids, (1, 2), (0.0, 1.0), strict=True)]
    _ping_both(core, HOLD + 0.5)
    assert _sent(core.tick(HOLD + 0.5, lambda c: True)) == [
        (b"c", "PRODUCER_GONE", {"tokens": tokens[:1], "reason": "fenced"}),
        (b"p", "RELEASED", {"handoff_id": 1, "reason": "consumer_fenced"})]
    assert list(core.deliveries) == tokens[1:]
    _ping_both(core, HOLD + 1.5)
    assert _sent(core.tick(HOLD + 1.5, lambda c: True)) == [
        (b"c", "PRODUCER_GONE", {"tokens": tokens[1:], "reason": "fenced"}),
        (b"p", "RELEASED", {"handoff_id": 2, "reason": "consumer_fenced"})]
    assert core.stats.holds_fenced == 2
    core.check_invariants()


def _grant_and_hand_off(core: BrokerCore, now: float, hid: int) -> str:
    """Producer ``p`` asks for one grant (for ``c``, the only consumer) and hands off on it at
    ``now``: the DELIVER's token."""
    (gid,) = _grant_ids(core.receive(b"p", frames("READY", {"credits": 1}), now))
    (token,) = [o.msg.fields()["token"] for o in _handoff(core, gid, now, hid=hid) if o.msg.verb == "DELIVER"]
    return token


def test_a_consumer_fenced_for_holding_is_benched_then_benched_twice_as_long():
    """Spec §5, hold bound: a consumer a delivery of which was fenced for holding gets none of its
    credits granted for one hold bound (else it takes each buffer its producer gets back as soon
    as it comes back); its unused grants are revoked (REVOKE), their credits kept. A re-HELLO
    keeps the bench. The next bench, after a later fence, lasts twice as long."""
    core = _hold_core()
    _hello(core, b"p", "producer", pid=5)
    _hello(core, b"c", "consumer", pid=6, credits=2)
    _grant_and_hand_off(core, 0.0, 1)
    (gid,) = _grant_ids(core.receive(b"p", frames("READY", {"credits": 1}), 0.0))  # unused, for c
    fence = HOLD + 0.01
    _ping_both(core, fence)
    sent = _sent(core.tick(fence, lambda c: True))
    assert [v for _, v, _ in sent] == ["PRODUCER_GONE", "RELEASED", "REVOKE"] and sent[2][2]["grant_ids"] == [gid]
    assert core.clients[b"c"].credits == 1 and core.stats.grants_revoked == 0  # kept; not the producer's fault
    assert not _grant_ids(core.receive(b"p", frames("READY", {"credits": 1}), fence)), "granted while benched"
    # A re-HELLO declaring that credit: the bench stays.
    outs = _hello(core, b"c", "consumer", pid=6, now=fence, credits=1)
    assert not _grant_ids(outs + core.tick(fence, lambda c: True))
    _ping_both(core, fence + 0.9 * HOLD)
    assert not _grant_ids(core.tick(fence + 0.9 * HOLD, lambda c: True))
    _ping_both(core, fence + HOLD)
    gids = _grant_ids(core.tick(fence + HOLD, lambda c: True))
    assert len(gids) == 1, "the bench never ended"
    gid = gids[0]
    # Held past the bound again: benched twice as long.
    again = fence + HOLD
    _handoff(core, gid, again, hid=2)
    second = again + HOLD + 0.01
    _ping_both(core, second)
    assert "PRODUCER_GONE" in [v for _, v, _ in _sent(core.tick(second, lambda c: True))]
    core.receive(b"c", frames("REQUEST", {"credits": 1}), second)
    core.receive(b"p", frames("READY", {"credits": 1}), second)
    for now in (second + 1.0, second + 2.0, second + 3.0, second + 2 * HOLD - 0.01):
        _ping_both(core, now)
        assert not _grant_ids(core.tick(now, lambda c: True)), f"the bench ended early: {now}"
    _ping_both(core, second + 2 * HOLD)
    assert _grant_ids(core.tick(second + 2 * HOLD, lambda c: True))
    core.check_invariants()


def _benched_at_two_holds(core: BrokerCore) -> float:
    """Consumer ``c`` (pid 6) holds a delivery of ``p`` past the bound from time 0 and is benched:
    the time of that fence."""
    assert core.hold_s is not None
    _hello(core, b"p", "producer", pid=5)
    _hello(core, b"c", "consumer", pid=6, credits=1)
    _grant_and_hand_off(core, 0.0, 1)
    fence = core.hold_s + 0.01
    _ping_both(core, fence)
    core.tick(fence, lambda c: True)
    assert b"c" in core.benched
    return fence


def _benched_process(core: BrokerCore) -> tuple[str, str]:
    return (core.clients[b"c"].process, "ch") if b"c" in core.clients else ("", "")


@pytest.mark.parametrize("how", ["bye", "silent", "new_id_first", "dies"])
def test_a_bench_binds_every_registration_of_its_process_on_the_channel(how):
    """Spec §5: a benched consumer holds nothing (its deliveries were fenced), so a BYE costs it
    nothing, nor does falling silent until it is dropped, nor registering under a new routing id
    before it leaves. Every consumer registration of its process on the channel is benched until
    the bench ends; another process is not. A process that died cannot come back: a new process
    that reuses its pid is not benched."""
    core = BrokerCore(host=HOST, timeout_s=TIMEOUT, hold_s=2 * TIMEOUT)  # a bench that outlasts silence
    hold = 2 * TIMEOUT
    fence = _benched_at_two_holds(core)
    key = _benched_process(core)
    now = fence + TIMEOUT + 0.1
    if how == "new_id_first":
        assert not _grant_ids(_hello(core, b"c2", "consumer", pid=6, now=fence, credits=1))
    if how in ("bye", "new_id_first"):
        core.receive(b"c", frames("BYE", {}), fence)
    elif how == "silent":
        core.receive(b"p", frames("PING", {}), now)
        core.tick(now, lambda c: True)  # silent past the timeout, holding nothing: dropped
    else:
        core.client_gone(b"c", "process gone")
    assert b"c" not in core.clients and b"c" not in core.benched
    core.receive(b"p", frames("PING", {}), now)
    again = [] if how == "new_id_first" else _hello(core, b"c2", "consumer", pid=6, now=now, credits=1)
    again += _hello(core, b"other", "consumer", pid=7, now=now, credits=1)
    again += core.receive(b"p", frames("READY", {"credits": 1}), now)
    (grant,) = [o.msg.fields() for o in again if isinstance(o, Send) and o.msg.verb == "GRANT"]
    if how == "dies":
        assert b"c2" not in core.benched and key not in core.bench_of
        return
    assert core.benched.get(b"c2") == fence + hold and b"other" not in core.benched
    assert grant["consumer_id"] == BrokerCore.label_of(b"other"), "the benched process's credit was granted"
    core.receive(b"c2", frames("PING", {}), fence + hold)
    core.receive(b"other", frames("PING", {}), fence + hold)
    core.receive(b"p", frames("READY", {"credits": 1}), fence + hold)
    (grant,) = [o.msg.fields() for o in core.tick(fence + hold, lambda c: True)
                if isinstance(o, Send) and o.msg.verb == "GRANT"]
    assert grant["consumer_id"] == BrokerCore.label_of(b"c2"), "the bench never ended"
    core.check_invariants()


def test_a_choke_ending_as_the_bound_fences_grants_nothing_to_revoke():
    """Spec §5: fences for holding come first in a tick, so a choke that ends in the same tick
    (or a rematch) does not grant a credit that the bench then revokes."""
    core = _hold_core()
    _hello(core, b"p", "producer", pid=5)
    _hello(core, b"c", "consumer", pid=6, credits=2)
    _grant_and_hand_off(core, 0.0, 1)
    core.undeliverable(b"c", Message("PONG", {}), "full")  # choked
    core.receive(b"p", frames("READY", {"credits": 1}), 1.9)
    _ping_both(core, 1.95)
    core.tick(1.95, lambda c: True)  # the probe goes out
    _ping_both(core, HOLD + 0.05)
    sent = _sent(core.tick(HOLD + 0.05, lambda c: True))  # the probe got through, and the delivery is due
    assert [v for _, v, _ in sent] == ["PRODUCER_GONE", "RELEASED"], sent
    assert b"c" in core.benched and b"c" not in core.choked
    core.check_invariants()


def test_consumers_whose_benches_end_in_one_tick_take_turns():
    """§4: credits of consumers benched together are queued together when their benches end, so
    grants alternate between them, as for any consumers with queued credits."""
    core = _hold_core()
    _hello(core, b"p", "producer", pid=5)
    _hello(core, b"a", "consumer", pid=6, credits=1)
    _hello(core, b"b", "consumer", pid=7, credits=1)
    (g1, g2) = _grant_ids(core.receive(b"p", frames("READY", {"credits": 2}), 0.0))
    _handoff(core, g1, 0.0, hid=1)
    _handoff(core, g2, 0.0, hid=2)
    fence = HOLD + 0.01
    for rid in (b"a", b"b", b"p"):
        core.receive(rid, frames("PING", {}), fence)
    core.tick(fence, lambda c: True)
    assert set(core.benched) == {b"a", b"b"}
    core.receive(b"a", frames("REQUEST", {"credits": 2}), fence)
    core.receive(b"b", frames("REQUEST", {"credits": 2}), fence)
    core.receive(b"p", frames("READY", {"credits": 2}), fence)
    for rid in (b"a", b"b", b"p"):
        core.receive(rid, frames("PING", {}), fence + HOLD)
    grants = [o.msg.fields()["consumer_id"] for o in core.tick(fence + HOLD, lambda c: True)
              if isinstance(o, Send) and o.msg.verb == "GRANT"]
    assert sorted(grants) == sorted([BrokerCore.label_of(b"a"), BrokerCore.label_of(b"b")]), grants
    core.check_invariants()


def test_a_delivery_bound_during_a_bench_and_due_as_it_ends_does_not_bench_again():
    """Spec §5: deliveries fenced while their consumer is benched do not bench it again, also in
    the tick where the bench ends (fences are judged before benches end): no grant made and
    revoked in one tick, no doubled bench."""
    core = _hold_core()
    _hello(core, b"p", "producer", pid=5)
    _hello(core, b"c", "consumer", pid=6, credits=2)
    _grant_and_hand_off(core, 0.0, 1)
    gid = _grant_ids(core.receive(b"p", frames("READY", {"credits": 1}), 0.0))[0]
    _handoff(core, gid, HOLD + 0.005, hid=2)  # on its way before the fence: bound at HOLD + 0.005
    fence = HOLD + 0.01
    _ping_both(core, fence)
    core.tick(fence, lambda c: True)
    assert core.benched[b"c"] == fence + HOLD
    core.receive(b"c", frames("REQUEST", {"credits": 1}), fence)
    core.receive(b"p", frames("READY", {"credits": 1}), fence)
    _ping_both(core, fence + HOLD)
    sent = _sent(core.tick(fence + HOLD, lambda c: True))  # the second delivery is due, the bench ends
    assert [v for _, v, _ in sent] == ["PRODUCER_GONE", "RELEASED", "GRANT"], sent
    assert b"c" not in core.benched and core.bench_of[_benched_process(core)] == (HOLD, fence + HOLD)
    core.check_invariants()


def test_a_bench_long_after_the_last_starts_short_again():
    """Spec §5: the bench doubles only while the last one ended less than 64 hold bounds ago; a
    consumer that overholds once in a long while is benched one hold bound each time."""
    core = _hold_core()
    fence = _benched_at_two_holds(core)
    later = fence + HOLD + 64 * HOLD
    _ping_both(core, later)
    core.tick(later, lambda c: True)
    assert b"c" not in core.benched
    core.receive(b"c", frames("REQUEST", {"credits": 1}), later)
    (gid,) = _grant_ids(core.receive(b"p", frames("READY", {"credits": 1}), later))
    _handoff(core, gid, later, hid=2)
    _ping_both(core, later + HOLD + 0.01)
    core.tick(later + HOLD + 0.01, lambda c: True)
    assert core.benched[b"c"] == later + 2 * HOLD + 0.01
    core.check_invariants()


def test_without_a_hold_bound_a_live_consumer_holds_as_long_as_it_likes():
    """No ``hold_s`` (the default): nothing is fenced for holding, and WELCOME carries no hold_ms;
    with one, WELCOME says it in milliseconds (spec §2)."""
    core = _core()
    token = _event_handoff(core)
    for now in (HOLD + 1, 100 * TIMEOUT):
        _ping_both(core, now)
        assert not _sent(core.tick(now, lambda c: True))
    assert core.deliveries[token].consumer == b"c"
    welcome = [o.msg.fields() for o in _hello(core, b"x", "consumer", pid=9) if o.msg.verb == "WELCOME"]
    assert "hold_ms" not in welcome[0]
    welcome = [o.msg.fields() for o in _hello(_hold_core(), b"x", "consumer", pid=9) if o.msg.verb == "WELCOME"]
    assert welcome[0]["hold_ms"] == 2000
    for bad in (0.0, -1.0, math.inf, math.nan, 0.0009, 1e17):  # 1e17 s: a hold_ms past 2^63 - 1
        with pytest.raises(ValueError, match="hold_s"):
            BrokerCore(host=HOST, timeout_s=TIMEOUT, hold_s=bad)
    # Whole milliseconds: the bound applied is the one WELCOME states, never shorter.
    core = BrokerCore(host=HOST, timeout_s=TIMEOUT, hold_s=1.0004)
    welcome = [o.msg.fields() for o in _hello(core, b"x", "consumer", pid=9) if o.msg.verb == "WELCOME"]
    assert welcome[0]["hold_ms"] == 1000 and core.hold_s == 1.0


def test_a_claim_adopted_after_a_restart_is_held_from_its_adoption():
    """A consumer claims a handoff after a broker restart (§6); its producer registers later and
    adopts the claim. The hold bound counts from the adoption, not from the claim, so the
    consumer gets its full ``hold_s`` from when the handoff is bound to it again."""
    core = BrokerCore(host=HOST, timeout_s=TIMEOUT, hold_s=TIMEOUT / 2)
    honest = "1b" * 24
    _claim(core, b"c", honest, pid=12, now=0.0)
    h = {"protocol": PROTOCOL_VERSION, "role": "producer", "channel": "ch", "pid": 10, "endpoint": endpoint(10),
         "outstanding": [{"handoff_id": 7, "consumer_id": BrokerCore.label_of(b"c")}]}
    core.receive(b"p", frames("HELLO", h), 0.9 * TIMEOUT)
    assert core.deliveries[honest].consumer == b"c"
    _ping_both(core, 1.2 * TIMEOUT)
    assert not _sent(core.tick(1.2 * TIMEOUT, lambda c: True)), "fenced for the time it waited as a claim"
    _ping_both(core, 1.5 * TIMEOUT)
    assert _sent(core.tick(1.5 * TIMEOUT, lambda c: True)) == [
        (b"c", "PRODUCER_GONE", {"tokens": [honest], "reason": "fenced"}),
        (b"p", "RELEASED", {"handoff_id": 7, "reason": "consumer_fenced"})]
    core.check_invariants()


def test_heartbeat_alone_drops_only_peers_it_cannot_judge():
    core = _core()
    _hello(core, b"c", "consumer")
    core.tick(10 * TIMEOUT, lambda c: None)
    assert b"c" not in core.clients


def test_caps_lists_consumers_by_label_not_routing_id():
    core = _core()
    _hello(core, b"secret-rid", "consumer")
    (reply,) = [o.msg for o in core.receive(b"q", frames("CAPS", {"device": endpoint(9), "channel": "ch"}), 0.0)]
    (entry,) = reply.fields()["consumers"]
    assert entry["consumer_id"] == core.label_of(b"secret-rid") and "secret-rid" not in json.dumps(reply.fields())


def _caps_bridges(core: BrokerCore) -> list[dict]:
    (reply,) = [o.msg for o in core.receive(b"q", frames("CAPS", {"device": endpoint(9), "channel": "ch"}), 0.0)]
    return reply.fields()["bridges"]


def _route(core: BrokerCore, rid: bytes, route: Any) -> list:
    """``rid`` announces ``route`` with the broker's route key (spec §2.4)."""
    return core.receive(rid, frames("ROUTE", {"key": core.route_key, "route": route}), 0.0)


NIXL_LINK = {"peer": "tcp://10.0.0.2#0080000001", "data_plane": "nixl", "gpu": "device", "window": 4}


def test_route_is_repeated_in_caps_until_replaced_withdrawn_or_the_client_goes():
    core = _core()
    _hello(core, b"out", "consumer", pid=6, name="bridge-out:ch")
    _hello(core, b"in", "producer", pid=7)
    _hello(core, b"plain", "consumer", pid=8)
    assert _caps_bridges(core) == []
    assert _route(core, b"out", {"direction": "export", "links": [NIXL_LINK]}) == []
    assert _route(core, b"in", {"direction": "import", "links": [
        {"peer": "tcp://a:1", "data_plane": "zmq"}]}) == []
    assert _caps_bridges(core) == [
        {"client_id": core.label_of(b"out"), "name": "bridge-out:ch", "role": "consumer", "direction": "export",
         "links": [NIXL_LINK]},
        {"client_id": core.label_of(b"in"), "name": "", "role": "producer", "direction": "import",
         "links": [{"peer": "tcp://a:1", "data_plane": "zmq", "gpu": None, "window": None}]}]  # normalised
    _route(core, b"out", {"direction": "export", "links": []})  # peer gone
    _route(core, b"in", None)  # withdrawn
    assert [(b["role"], b["links"]) for b in _caps_bridges(core)] == [("consumer", [])]
    core.client_gone(b"out", "bye")
    assert _caps_bridges(core) == []


@pytest.mark.parametrize(("route", "field", "value"), [
    ({"direction": "import", "links": []}, "route.direction", "import"),  # a consumer's route is an export
    ({"direction": "sideways", "links": []}, "route.direction", "sideways"),
    ({"direction": "export"}, "route.links", None),
    ({"direction": "export", "links": [NIXL_LINK] * 65}, "route.links", json.dumps([NIXL_LINK] * 65,
                                                                               separators=(",", ":"))[:64]),
    ({"direction": "export", "links": [NIXL_LINK, {**NIXL_LINK, "data_plane": "rdma"}]},
     "route.links.1.data_plane", "rdma"),
    ({"direction": "export", "links": [{**NIXL_LINK, "peer": ""}]}, "route.links.0.peer", ""),
    ({"direction": "export", "links": [{**NIXL_LINK, "peer": "p" * 129}]}, "route.links.0.peer", "p" * 64),
    ({"direction": "export", "links": [{**NIXL_LINK, "gpu": "vram"}]}, "route.links.0.gpu", "vram"),
    ({"direction": "export", "links": [{**NIXL_LINK, "window": True}]}, "route.links.0.window", True),
    ({"direction": "export", "links": [{**NIXL_LINK, "window": 65}]}, "route.links.0.window", 65),
    ({"direction": "export", "links": ["tcp://x"]}, "route.links.0", "tcp://x"),
    ("export", "route", "export"),
])
def test_bad_route_is_refused_naming_field_and_value_and_keeps_the_earlier_one(route, field, value):
    core = _core()
    _hello(core, b"out", "consumer", pid=6)
    _route(core, b"out", {"direction": "export", "links": [NIXL_LINK]})
    (err,) = _errors(_route(core, b"out", route))
    assert (err["code"], err["field"], err["value"]) == ("bad_header", field, value), err
    assert [b["links"] for b in _caps_bridges(core)] == [[NIXL_LINK]]


def test_route_needs_hello_and_a_route_field():
    core = _core()
    (err,) = _errors(_route(core, b"x", None))
    assert err["code"] == "not_registered"
    _hello(core, b"x", "producer")
    (err,) = _errors(core.receive(b"x", frames("ROUTE", {"key": core.route_key}), 0.0))
    assert (err["code"], err["field"]) == ("bad_header", "route")


@pytest.mark.parametrize("key", [None, "", "0" * 64, 7])
def test_route_without_the_route_key_is_not_authorized_and_changes_nothing(key):
    """Red team item 18: any client could ROUTE a made-up NIXL/GPUDirect bridge into CAPS answers.
    A ROUTE must carry the broker's route key (spec §2.4), which only the broker's own user can
    read; without it the route is refused and the client's earlier one stays."""
    core = _core()
    _hello(core, b"out", "consumer", pid=6)
    _route(core, b"out", {"direction": "export", "links": []})
    header = {"route": {"direction": "export", "links": [NIXL_LINK]}, **({} if key is None else {"key": key})}
    (err,) = _errors(core.receive(b"out", frames("ROUTE", header), 0.0))
    assert (err["code"], err["field"]) == ("not_authorized", "key"), err
    assert [b["links"] for b in _caps_bridges(core)] == [[]]


def test_caps_with_unknown_transport_names_it_and_keeps_request_id():
    core = _core()
    (err,) = _errors(core.receive(b"q", frames("CAPS", {"device": endpoint(9), "transport": "carrier-pigeon",
                                                        "request_id": 7}), 0.0))
    assert err["code"] == "bad_header" and err["request_id"] == 7 and err["field"] == "transport"


def test_bye_before_hello_is_silent_and_event_release_of_synced_token_refused():
    core = _core()
    assert core.receive(b"x", frames("BYE", {}), 0.0) == []


def test_mode_cache_does_not_confuse_consumers_that_come_and_go():
    """The cache once keyed on id(Client): a new consumer at a recycled address got the old one's
    modes. 300 handoffs, consumers with and without IPC events alternating: none wrongly refused."""
    from hurray_ipc.format.handle import BufferHandle, DeviceTag, SyncMode
    core = _core()
    gpu = dict(endpoint(5), device={"kind": "cuda", "ordinal": 0, "uuid": "GPU-x", "pci_bus_id": "", "emulated": True,
                                     "host": HOST})
    _hello(core, b"p", "producer", pid=5, endpoint=dict(gpu, caps=dict(gpu["caps"], ipc_events=True)))
    refused = 0
    for i in range(300):
        events = i % 2 == 0
        ep = dict(gpu, pid=6, caps=dict(gpu["caps"], ipc_events=events))
        _hello(core, b"c%d" % i, "consumer", pid=6, endpoint=ep, credits=1)
        (gid,) = _grant_ids(core.receive(b"p", frames("READY", {"credits": 1}), 0.0))
        mode = SyncMode.EVENT if events else SyncMode.PRODUCER_SYNCED
        hd = BufferHandle(4096, 256, DeviceTag.CUDA, mode).encode()
        blobs = [b"M" * 64] + ([b"E" * 64] if events else [])
        outs = _handoff(core, gid, hid=i, handle=hd, blobs=tuple(blobs), ack=True)
        refused += bool(_errors(outs))
        core.client_gone(b"c%d" % i, "process gone")
    assert refused == 0


def test_one_consumer_gets_each_producers_own_modes_when_they_alternate():
    """expected_modes remembers a consumer's last answer by the producer's endpoint object: two
    producers whose devices allow different modes, alternating on one consumer, are each judged
    by their own (a remembered answer used for the other would accept or refuse wrongly)."""
    from hurray_ipc.format.handle import BufferHandle, DeviceTag, SyncMode
    core = _core()
    gpu = dict(endpoint(5), device={"kind": "cuda", "ordinal": 0, "uuid": "GPU-x", "pci_bus_id": "", "emulated": True,
                                     "host": HOST})
    for rid, events in ((b"pe", True), (b"pn", False)):
        _hello(core, rid, "producer", pid=5, endpoint=dict(gpu, caps=dict(gpu["caps"], ipc_events=events)))
    _hello(core, b"c", "consumer", pid=6, endpoint=dict(gpu, pid=6, caps=dict(gpu["caps"], ipc_events=True)),
           credits=64)
    hd = BufferHandle(4096, 256, DeviceTag.CUDA, SyncMode.EVENT).encode()
    verdicts = []
    for i in range(20):
        rid = (b"pe", b"pn")[i % 2]
        (gid,) = _grant_ids(core.receive(rid, frames("READY", {"credits": 1}), 0.0))
        header = {"grant_id": gid, "handoff_id": i, "offset": 0}
        outs = core.receive(rid, frames("HANDOFF", header, hd, b"M" * 64, b"E" * 64), 0.0)
        verdicts.append([e["code"] for e in _errors(outs)])
    assert verdicts == [[], ["mode_not_valid"]] * 10, verdicts


def test_a_refused_re_hello_changes_nothing():
    """A registered consumer's HELLO with a malformed ``held`` is refused before any state changes:
    it stays registered with its credits and deliveries."""
    core = _core()
    _hello(core, b"p", "producer", pid=5)
    _hello(core, b"c", "consumer", pid=6, credits=2)
    (gid,) = _grant_ids(core.receive(b"p", frames("READY", {"credits": 1}), 0.0))
    _handoff(core, gid, ack=True)
    before = (core.clients[b"c"].credits, core.clients[b"c"].held, len(core.deliveries))
    for who, role, pid, bad in ((b"c", "consumer", 6, {"held": "all of them"}),
                                (b"p", "producer", 5, {"outstanding": [{"handoff_id": "x"}]})):
        (err,) = _errors(_hello(core, who, role, pid=pid, **bad))
        assert err["code"] == "bad_header"
        core.check_invariants()
    assert (core.clients[b"c"].credits, core.clients[b"c"].held, len(core.deliveries)) == before


def test_undeliverable_sends_are_counted_by_kind():
    core = _core()
    core.undeliverable(b"x", Message("PONG", {}), "unreachable")
    core.undeliverable(b"x", Message("PONG", {}), "full")
    assert (core.stats.undeliverable, core.stats.dropped_full) == (1, 1)


def test_message_rate_is_bounded_per_client():
    from hurray_ipc.broker.core import MAX_RATE
    core = _core()
    _hello(core, b"c", "consumer", pid=6)
    ping = frames("PING", {})
    refused = sum(bool(_errors(core.receive(b"c", ping, 1.0))) for _ in range(int(MAX_RATE) + 10))
    assert refused == 10  # the burst allowance is one second's worth
    assert not _errors(core.receive(b"c", ping, 1.5)), "the allowance refills with time"


def test_refusals_count_against_the_message_rate_and_a_message_past_it_costs_one_error():
    """A flood whose every entry is refused (RELEASE batches of 64 made-up tokens) kept the
    broker busy at 30-45k entries/s under the 50k/s limit, and each message cost 64 ERRORs. Each
    refused entry now costs 1 + ERROR_COST, and a message past the rate is refused whole: one
    ERROR however many entries it carries (spec §6a)."""
    core = _core()
    _hello(core, b"c", "consumer", pid=6)
    forged = [Message("RELEASE", {"token": _forged(i)}) for i in range(64)]
    batch = encode_batch(forged)
    # The spec's figures: a burst of 50,000, each refused entry 10 of it (1 + ERROR_COST); a
    # message is refused once the allowance is below 1 when it arrives: 50,000 // 640 + 1.
    answered = 79
    counts = [len(_errors(core.receive(b"c", batch, 1.0))) for _ in range(answered + 3)]
    assert counts == [64] * answered + [1] * 3, counts
    (err,) = _errors(core.receive(b"c", batch, 1.0))
    assert (err["code"], err["limit"], err["ref"]) == ("limit_exceeded", "message_rate", "RELEASE"), err
    core.check_invariants()
    # The refusals were not charged: the allowance is 50,000 - 79 * 640 = -560, so 562 units of
    # refill (more than the 561 that reach exactly 1, a float comparison) admit the next batch.
    assert len(_errors(core.receive(b"c", batch, 1.0 + 559 / 50_000))) == 1
    assert len(_errors(core.receive(b"c", batch, 1.0 + 562 / 50_000))) == 64
    assert len(_errors(core.receive(b"c", batch, 2.5))) == 64, "the allowance refills with time"


def test_releases_crossing_producer_gone_are_answered_but_not_charged_once():
    """A consumer holding 8192 deliveries whose producer dies releases them all at once, each
    answered unknown_token: charged 10 each, that crossed the rate after 5,000 and refused the
    RELEASEs of a live producer's buffers that came after, whole, so those stayed held."""
    core = _core()
    _hello(core, b"c", "consumer", pid=6)
    _hello(core, b"p", "producer", pid=5)
    _hello(core, b"q", "producer", pid=7)
    tokens: dict[bytes, list[str]] = {b"p": [], b"q": []}
    hid = itertools.count(1)
    for who, n in ((b"p", 4096), (b"p", 4032), (b"q", 64)):
        core.receive(b"c", frames("REQUEST", {"credits": n}), 0.0)
        gids = _grant_ids(core.receive(who, frames("READY", {"credits": n}), 0.0))
        for i in range(0, n, 64):
            msgs = [Message("HANDOFF", {"grant_id": g, "handoff_id": next(hid), "offset": 0},
                            {"handle": cpu_handle(), "memory": b"M" * 64}) for g in gids[i:i + 64]]
            outs = core.receive(who, encode_batch(msgs), 0.0)
            tokens[who] += [o.msg.fields()["token"] for o in outs if isinstance(o, Send) and o.msg.verb == "DELIVER"]
    assert core.clients[b"c"].held == 8192
    core.client_gone(b"p", "process gone")
    order = tokens[b"p"] + tokens[b"q"]
    codes = [e["code"] for i in range(0, len(order), 64)
             for e in _errors(core.receive(b"c", encode_batch([Message("RELEASE", {"token": t})
                                                              for t in order[i:i + 64]]), 10.0))]
    assert codes == ["unknown_token"] * 8128, set(codes)
    assert core.clients[b"c"].held == 0, "the live producer's 64 came back"
    # Once each: a replay of those tokens is charged as any made-up token. The 8192 entries cost
    # 1 each, so 41,808 are left: 41,808 // 640 + 1 = 66 batches are answered, then one ERROR.
    replay = encode_batch([Message("RELEASE", {"token": t}) for t in tokens[b"p"][:64]])
    counts = [len(_errors(core.receive(b"c", replay, 10.0))) for _ in range(68)]
    assert counts == [64] * 66 + [1] * 2, counts
    core.check_invariants()


def _holding(core: BrokerCore, n: int) -> list[str]:
    """Consumer ``c`` and producer ``p`` registered; ``c`` holds ``n`` (<= 64) deliveries of
    ``p``: their tokens."""
    _hello(core, b"c", "consumer", pid=6)
    _hello(core, b"p", "producer", pid=5)
    core.receive(b"c", frames("REQUEST", {"credits": n}), 0.0)
    gids = _grant_ids(core.receive(b"p", frames("READY", {"credits": n}), 0.0))
    outs = core.receive(b"p", encode_batch([Message("HANDOFF", {"grant_id": g, "handoff_id": i, "offset": 0},
                                                    {"handle": cpu_handle(), "memory": b"M" * 64})
                                            for i, g in enumerate(gids)]), 0.0)
    tokens = [o.msg.fields()["token"] for o in outs if isinstance(o, Send) and o.msg.verb == "DELIVER"]
    assert len(tokens) == n and core.clients[b"c"].held == n
    return tokens


def test_a_consumer_past_its_rate_still_gives_back_the_buffers_it_holds():
    """A RELEASE batch past the rate was refused whole: the consumer counted its buffers given
    back, the broker kept them bound, and their producer never had them back (a consumer of a
    fast broker releasing 25,000 event-mode handoffs a second is past 50,000 entries). Now
    each entry naming a delivery bound to the sender is handled past the rate, for nothing; the
    rest of the message is dropped with one ERROR, and its credits are applied as on any RELEASE
    (§6a)."""
    core = _core()
    tokens = _holding(core, 8)
    c = core.clients[b"c"]
    c.allowance, c.allowance_at = 0.5, 10.0  # past the rate: below 1 as the message arrives
    batch = [Message("RELEASE", {"token": t}) for t in tokens[:4]]
    batch += [Message("RELEASE", {"token": _forged(i)}) for i in range(3)]
    batch += [Message("RELEASE", {"token": tokens[4], "credits": 5})]
    outs = core.receive(b"c", encode_batch(batch), 10.0)
    released = sorted(f["handoff_id"] for to, verb, f in _sent(outs) if to == b"p" and verb == "RELEASED")
    assert released == [0, 1, 2, 3, 4], released
    (err,) = _errors(outs)
    assert (err["code"], err["limit"], err["ref"]) == ("limit_exceeded", "message_rate", "RELEASE"), err
    assert (c.held, c.credits) == (3, 5)
    assert c.allowance == 0.5, "what passes the rate costs nothing, nor does the refusal"
    core.check_invariants()
    # Nothing bound among them: refused whole as before, its credits applied all the same.
    outs = core.receive(b"c", encode_batch([Message("RELEASE", {"token": tokens[0], "credits": 2})]), 10.0)
    assert [e["limit"] for e in _errors(outs)] == ["message_rate"] and c.credits == 7
    # A producer's batch of the same verbs past its rate is refused whole, as anything else.
    p = core.clients[b"p"]
    p.allowance, p.allowance_at = 0.5, 10.0
    (err,) = _errors(core.receive(b"p", encode_batch([Message("RELEASE", {"token": tokens[5]})]), 10.0))
    assert err["limit"] == "message_rate" and c.held == 3


def test_past_its_rate_a_consumer_cannot_release_another_consumers_buffer():
    """Past the rate only the sender's own deliveries are handled: another consumer's token is
    dropped with the rest (one ERROR, the rate's), not handled (which would answer
    foreign_token, charged) and never released."""
    core = _core()
    (mine,) = _holding(core, 1)
    _hello(core, b"d", "consumer", pid=7)
    core.receive(b"d", frames("REQUEST", {"credits": 1}), 0.0)
    (gid,) = _grant_ids(core.receive(b"p", frames("READY", {"credits": 1}), 0.0))
    outs = core.receive(b"p", encode_batch([Message("HANDOFF", {"grant_id": gid, "handoff_id": 9, "offset": 0},
                                                    {"handle": cpu_handle(), "memory": b"M" * 64})]), 0.0)
    (theirs,) = [f["token"] for to, verb, f in _sent(outs) if to == b"d" and verb == "DELIVER"]
    c = core.clients[b"c"]
    c.allowance, c.allowance_at = 0.5, 10.0
    outs = core.receive(b"c", encode_batch([Message("RELEASE", {"token": t}) for t in (theirs, mine)]), 10.0)
    assert [(e["code"], e.get("limit")) for e in _errors(outs)] == [("limit_exceeded", "message_rate")]
    assert [f["handoff_id"] for to, verb, f in _sent(outs) if verb == "RELEASED"] == [0]
    assert (core.clients[b"d"].held, c.held) == (1, 0)
    core.check_invariants()


def test_past_its_rate_only_what_gives_back_passes_so_a_repeat_costs_one_error():
    """Past the rate an entry passed when its token was bound to the sender, whether or not it
    would be refused: an EVENT_RELEASE of a held delivery whose event was released (or that has
    none) stays bound and is refused every time, so a consumer holding one delivery got 64
    ERRORs per batch past its rate without end (a reviewer's finding). Only the first
    EVENT_RELEASE of a pending event passes, and the first RELEASE."""
    core = _core()
    token = _event_handoff(core)
    c = core.clients[b"c"]
    c.allowance, c.allowance_at = 0.5, 10.0
    batch = encode_batch([Message("EVENT_RELEASE", {"token": token})] * 64)
    outs = core.receive(b"c", batch, 10.0)
    assert [(to, verb) for to, verb, _ in _sent(outs)] == [(b"p", "EVENT_RELEASED"), (b"c", "ERROR")]
    for _ in range(10):
        assert [e["limit"] for e in _errors(core.receive(b"c", batch, 10.0))] == ["message_rate"]
    assert c.allowance == 0.5 and c.held == 1
    # A RELEASE asking credits out of range (1..4096, §4) would be refused bad_header: dropped.
    (err,) = _errors(core.receive(b"c", encode_batch([Message("RELEASE", {"token": token, "credits": 60000})]),
                                  10.0))
    assert err["limit"] == "message_rate" and c.held == 1, err
    release = encode_batch([Message("RELEASE", {"token": token})] * 2)
    outs = core.receive(b"c", release, 10.0)
    assert [(to, verb) for to, verb, _ in _sent(outs)] == [(b"p", "RELEASED"), (b"c", "ERROR")]
    assert c.held == 0
    core.check_invariants()


def test_past_its_rate_a_consumer_withdraws_its_own_provisional_claim():
    """A claim made by re-HELLO (§6) is the consumer's as a delivery is: its RELEASE passes the
    rate and withdraws it; a second is dropped."""
    core = _core()
    _claim(core, b"c-a", _forged(0), pid=11, now=0.0)
    c = core.clients[b"c-a"]
    assert c.held == 1
    c.allowance, c.allowance_at = 0.5, 10.0
    assert not _errors(core.receive(b"c-a", encode_batch([Message("RELEASE", {"token": _forged(0)})]), 10.0))
    assert c.held == 0 and not core.claims
    (err,) = _errors(core.receive(b"c-a", encode_batch([Message("RELEASE", {"token": _forged(0)})]), 10.0))
    assert err["limit"] == "message_rate", err
    core.check_invariants()


def test_a_producer_past_its_rate_still_ends_its_stream():
    """An END past the rate was refused whole: the producer counted its stream ended, and its
    consumers waited for an end that had been sent. END passes the rate (once per stream, §6a);
    a consumer's END past its rate is refused whole as before, not answered wrong_role."""
    core = _core()
    _hello(core, b"c", "consumer", pid=6)
    _hello(core, b"p", "producer", pid=5)
    for rid in (b"c", b"p"):
        core.clients[rid].allowance, core.clients[rid].allowance_at = 0.5, 10.0
    (err,) = _errors(core.receive(b"c", frames("END", {}), 10.0))
    assert err["limit"] == "message_rate", err
    outs = core.receive(b"p", frames("END", {}), 10.0)
    assert [(to, verb, f) for to, verb, f in _sent(outs)] == [(b"c", "CHANNEL_STATE", {"ended": True})]
    assert core.clients[b"p"].ended and core.clients[b"p"].allowance == 0.5
    core.check_invariants()


def test_a_bye_past_the_rate_ends_the_registration_and_gives_back_what_it_held():
    """A BYE past the rate was refused whole: the consumer left, but stayed registered holding its
    producers' buffers until the broker found it gone (its lease) or fenced it (20 timeouts of
    silence, for a client without one). A BYE passes the rate, once per registration (§6a)."""
    core = _core()
    _holding(core, 2)
    c = core.clients[b"c"]
    c.allowance, c.allowance_at = 0.5, 10.0
    outs = core.receive(b"c", frames("BYE", {}), 10.0)
    assert sorted((to, verb, f["handoff_id"], f["reason"]) for to, verb, f in _sent(outs)) == [
        (b"p", "RELEASED", 0, "consumer_gone"), (b"p", "RELEASED", 1, "consumer_gone")]
    assert b"c" not in core.clients and not _errors(outs)
    core.check_invariants()


def test_a_clock_reading_earlier_than_the_last_takes_no_allowance_away():
    """The rate refilled by (now - then) * rate, so a reading earlier than the last (a caller's
    clock that is not monotonic, an injected one) took a second's allowance away per second
    back, as the byte budgets' shared refill (queries.refill) never did."""
    core = _core()
    _hello(core, b"c", "consumer", pid=6)
    c = core.clients[b"c"]
    c.allowance, c.allowance_at = 100.0, 10.0
    assert not _errors(core.receive(b"c", frames("PING", {}), 9.0))
    assert c.allowance == 99.0
    # Nor is the earlier reading kept as the time of the refill: 10.0 again refills nothing.
    assert not _errors(core.receive(b"c", frames("PING", {}), 10.0))
    assert (c.allowance, c.allowance_at) == (98.0, 10.0)


def test_every_budget_refills_by_one_mechanism_that_never_runs_time_back():
    """The message rate, the query budgets and the unregistered budgets all refill with
    ``queries.refill`` (§6a): at ``rate`` a second up to one second's worth, and a reading earlier
    than the last keeps the last as the refill's time (storing the earlier one refilled the same
    interval twice, a reviewer's finding in the unregistered budget; the other budgets did it
    too)."""
    assert refill(0.0, 10.0, 8.0, 10.5) == (4.0, 10.5)
    assert refill(7.0, 10.0, 8.0, 11.0) == (8.0, 11.0), "one second's worth at most"
    assert refill(-3.0, 10.0, 8.0, 9.0) == (-3.0, 10.0), "earlier: nothing taken, nothing refilled, 10.0 kept"


def test_a_request_or_ready_past_the_rate_names_its_credits():
    """A REQUEST refused by the rate left its credits counted as asked by the consumer, which
    then asked for nothing more and waited for deliveries that could not come. The refusal names
    them, so that the client counts them as not asked (§6a)."""
    core = _core()
    _hello(core, b"c", "consumer", pid=6)
    _hello(core, b"p", "producer", pid=5)
    for rid, verb in ((b"c", "REQUEST"), (b"p", "READY")):
        cl = core.clients[rid]
        cl.allowance, cl.allowance_at = 0.5, 10.0
        (err,) = _errors(core.receive(rid, frames(verb, {"credits": 7}), 10.0))
        assert (err["limit"], err["ref"], err["credits"]) == ("message_rate", verb, 7), err
        assert cl.credits == 0
    # A PING past the rate names none.
    (err,) = _errors(core.receive(b"c", frames("PING", {}), 10.0))
    assert err["limit"] == "message_rate" and "credits" not in err, err


def test_peers_not_registered_share_a_byte_budget_and_past_it_are_dropped_unread():
    """A HELLO is parsed whole before anything can refuse it, and peers not registered have no
    rate: one connection sending 0.88 MB HELLOs (18 ms each to parse) held a healthy pair at
    9-10 handoffs/s. They now share 8 MiB a second (burst 8 MiB, spec §6a); past it a message
    (here of 1 MiB: over the 4 KiB a routing id may still send, tested below) is dropped unread
    and unanswered, and registered clients are not charged."""
    core = _core()
    _hello(core, b"c", "consumer", pid=6)
    mib = [b"HELLO", json.dumps({"pad": "x" * ((1 << 20) - 16)}).encode()]
    assert sum(map(len, mib)) == 1 << 20
    answered = [len(_errors(core.receive(b"x%d" % i, mib, 1.0))) for i in range(10)]
    assert answered == [1] * 8 + [0] * 2, answered  # 8 MiB read, then the budget is spent
    assert core.stats.limits_refused == 2
    assert [o.msg.verb for o in core.receive(b"c", frames("PING", {}), 1.0)] == ["PONG"], "registered: unaffected"
    # Read while the budget is above 0, then charged in full: half a MiB of refill admits one
    # (leaving -0.5 MiB), not two; another half MiB and a little admits the next.
    assert [len(_errors(core.receive(b"y", mib, 1.0 + 0.5 / 8))) for _ in range(2)] == [1, 0]
    assert not _errors(core.receive(b"y", mib, 1.0 + 0.999 / 8))
    assert len(_errors(core.receive(b"y", mib, 1.0 + 1.001 / 8))) == 1


def _spend_the_unregistered_budget(core: BrokerCore, now: float) -> int:
    """Peers not registered send 1 MiB messages at ``now``, each from a connection of its own,
    until one is dropped unread: the budget they share is spent. Returns how many were read."""
    mib = [b"HELLO", json.dumps({"pad": "x" * ((1 << 20) - 16)}).encode()]
    assert sum(map(len, mib)) == 1 << 20
    for i in range(10):
        if not _errors(core.receive(b"x%d" % i, mib, now)):
            return i
    raise AssertionError("10 MiB read at one instant: the budget is 8 MiB")


# A message over the 4 KiB a routing id may send past the unregistered budget, far under the budget.
_BIG_HELLO = [b"HELLO", json.dumps({"pad": "x" * (32 << 10)}).encode()]


def _padded_ping(size: int) -> list[bytes]:
    """A PING of exactly ``size`` bytes, all frames (a peer not registered is answered
    not_registered)."""
    ping = [b"PING", b'{"pad": "' + b"x" * (size - 15) + b'"}']
    assert sum(map(len, ping)) == size
    return ping


def test_past_the_unregistered_budget_a_newcomers_hello_is_still_read_and_charged():
    """While peers that never registered spend the budget they share, a new client's HELLO was
    dropped with theirs: no client could register until the flood stopped (broker/DESIGN.md,
    Known limits). Each routing id's first two messages of at most 4 KiB a second are read all
    the same (§6a), and charged to the shared budget."""
    core = _core()
    assert _spend_the_unregistered_budget(core, 1.0) == 8  # exactly 0 left
    hello = frames("HELLO", {"protocol": PROTOCOL_VERSION, "role": "consumer", "channel": "ch", "pid": 7,
                             "endpoint": endpoint(7)})
    size = sum(map(len, hello))
    assert size <= 4096
    assert [o.msg.verb for o in core.receive(b"n", hello, 1.0)] == ["WELCOME"]
    assert b"n" in core.clients
    # Charged: the shared budget is -size now, so it admits a big message again only once it
    # refilled past that (8 MiB a second), not at 0.
    big = _BIG_HELLO
    assert not _errors(core.receive(b"y", big, 1.0 + (size - 1) / (8 << 20)))
    assert len(_errors(core.receive(b"y", big, 1.0 + (size + 1) / (8 << 20)))) == 1


def test_past_the_unregistered_budget_each_routing_id_gets_two_messages_of_4_kib_a_second():
    """The exception is per routing id, per second, and for messages of at most 4 KiB: a flooder
    whose budget is spent gets two PINGs a second read (each answered not_registered), a message
    of 4097 bytes none; the broker remembers at most 16384 routing ids, and one it forgot starts
    with a full bucket again."""
    core = _core()
    _spend_the_unregistered_budget(core, 1.0)
    ping = frames("PING", {})
    assert [len(_errors(core.receive(b"f", ping, 1.0))) for _ in range(3)] == [1, 1, 0]
    assert _spend_the_unregistered_budget(core, 1.49) > 0
    assert not _errors(core.receive(b"f", ping, 1.49)), "0.98 of a message refilled (2 a second)"
    _spend_the_unregistered_budget(core, 1.5)
    assert [len(_errors(core.receive(b"f", ping, 1.5))) for _ in range(2)] == [1, 0]
    _spend_the_unregistered_budget(core, 9.0)  # idle for 7.5 s: refilled to 2, no more
    assert [len(_errors(core.receive(b"f", ping, 9.0))) for _ in range(3)] == [1, 1, 0]
    assert len(_errors(core.receive(b"g", _padded_ping(4096), 9.0))) == 1, "4 KiB: read"
    dropped = core.stats.limits_refused
    assert not core.receive(b"h", _padded_ping(4097), 9.0), "over 4 KiB: dropped unread, unanswered"
    assert core.stats.limits_refused == dropped + 1
    assert [len(_errors(core.receive(b"h", ping, 9.0))) for _ in range(3)] == [1, 1, 0], "the 4097 took none"
    # Forgotten least recently used first: of 16,384 more routing ids, r0 is used again, so one
    # more forgets r1, the least recent, not r0.
    for i in range(16384):
        core.receive(b"r%d" % i, ping, 9.0)
    assert len(core._newcomers) == 16384
    core.check_invariants()
    core.receive(b"r0", ping, 9.0)  # r0 used again: now the most recent
    core.receive(b"new", ping, 9.0)  # one more routing id: r1 is forgotten, r0 kept
    assert not _errors(core.receive(b"r0", ping, 9.0)), "r0 remembered, its bucket empty"
    assert [len(_errors(core.receive(b"r1", ping, 9.0))) for _ in range(3)] == [1, 1, 0], "forgotten: full again"


def test_a_routing_ids_bucket_is_untouched_while_the_budget_lasts_and_the_budgets_debt_stops_at_8_mib():
    """Messages read within the shared budget take nothing from their routing id's bucket; and
    however many routing ids read past the budget at once, its debt stops at -8 MiB (§6a), so a
    flood of newcomers from thousands of connections leaves at most a second of it (without the
    floor, 4,000 messages of 4 KiB left 16 MiB: two seconds in which no message over 4 KiB was
    read, then more for each further wave)."""
    core = _core()
    ping = frames("PING", {})
    assert [len(_errors(core.receive(b"z", ping, 1.0))) for _ in range(3)] == [1, 1, 1]  # within the budget
    assert _spend_the_unregistered_budget(core, 1.0) == 8
    assert [len(_errors(core.receive(b"z", ping, 1.0))) for _ in range(3)] == [1, 1, 0], "z's bucket was full"
    for i in range(4000):
        assert len(_errors(core.receive(b"n%d" % i, _padded_ping(4096), 1.0))) == 1
    big = _BIG_HELLO
    step = 64 / (8 << 20)  # the time 64 bytes of the budget take to refill
    assert not _errors(core.receive(b"y", big, 2.0 - step)), "at -8 MiB, just under 1 s of refill is not enough"
    assert len(_errors(core.receive(b"y", big, 2.0 + step))) == 1, "exactly -8 MiB, not lower"


def test_a_big_message_read_within_the_unregistered_budget_is_charged_in_full_and_no_clock_refills_twice():
    """A message read while the budget is above 0 is charged in full, however big (frames are
    limited, their number is not), and the -8 MiB floor of reads past the budget never raises a
    deeper debt; a clock reading earlier than the last refills nothing, then or later (a
    reviewer showed that storing the earlier reading refilled the same interval twice)."""
    core = _core()
    huge = [b"HELLO", json.dumps({"pad": "x" * (20 << 20)}).encode()]
    assert len(_errors(core.receive(b"x", huge, 1.0))) == 1  # the budget is now about -12 MiB
    assert len(_errors(core.receive(b"n", _padded_ping(4096), 1.0))) == 1  # read past it: debt deeper, not -8 MiB
    big = _BIG_HELLO
    assert not _errors(core.receive(b"y", big, 2.49)), "12 MiB and 4 KiB of debt: 1.49 s is not enough"
    assert len(_errors(core.receive(b"y", big, 2.51))) == 1
    # Spent again at 10.0; readings of 9.0 then 10.0 give no second refill of that interval.
    _spend_the_unregistered_budget(core, 10.0)
    assert not _errors(core.receive(b"y", big, 9.0))
    assert not _errors(core.receive(b"y", big, 10.0)), "the interval 9-10 was refilled already"
    # The same for a routing id's bucket: one of two taken at 10.0, the other at 9.0, none back at 10.0.
    assert [len(_errors(core.receive(b"z", frames("PING", {}), t))) for t in (10.0, 9.0, 10.0)] == [1, 1, 0]


def test_an_event_release_and_a_release_crossing_producer_gone_are_each_uncharged_once():
    """An event-mode consumer sends EVENT_RELEASE and RELEASE per token: the first must not use
    up the second's exemption (a reviewer's finding: one memory for both kinds did)."""
    core = _core()
    _hello(core, b"c", "consumer", pid=6)
    _hello(core, b"p", "producer", pid=5)
    core.receive(b"c", frames("REQUEST", {"credits": 64}), 0.0)
    gids = _grant_ids(core.receive(b"p", frames("READY", {"credits": 64}), 0.0))
    outs = core.receive(b"p", encode_batch([Message("HANDOFF", {"grant_id": g, "handoff_id": i, "offset": 0},
                                                    {"handle": cpu_handle(), "memory": b"M" * 64})
                                            for i, g in enumerate(gids)]), 0.0)
    tokens = [o.msg.fields()["token"] for o in outs if isinstance(o, Send) and o.msg.verb == "DELIVER"]
    core.client_gone(b"p", "process gone")
    c = core.clients[b"c"]
    c.allowance, c.allowance_at = 129.0, 10.0  # at 10 an answer, the 14th entry would be past the rate
    batch = [Message(verb, {"token": t}) for t in tokens[:32] for verb in ("EVENT_RELEASE", "RELEASE")]
    codes = [e["code"] for e in _errors(core.receive(b"c", encode_batch(batch), 10.0))]
    codes += [e["code"] for e in _errors(core.receive(b"c", encode_batch(
        [Message(v, {"token": t}) for t in tokens[32:] for v in ("EVENT_RELEASE", "RELEASE")]), 10.0))]
    assert codes == ["unknown_token"] * 128, codes
    assert c.allowance == 1.0
    # The exemption answered its entry only: a malformed message next is charged its 10.
    c.allowance = 20.0
    core.receive(b"c", [b"NOPE", b"{}"], 10.0)
    assert c.allowance == 10.0


def test_a_batch_before_hello_is_refused_whole():
    """An unregistered peer's 64-entry RELEASE batch got 64 not_registered ERRORs, so a flood
    that never registered escaped the message rate and cost 64 answers a message."""
    core = _core()
    forged = encode_batch([Message("RELEASE", {"token": _forged(i)}) for i in range(64)])
    (err,) = _errors(core.receive(b"x", forged, 0.0))
    assert (err["code"], err["ref"]) == ("not_registered", "RELEASE"), err
    handoffs = encode_batch([Message("HANDOFF", {"grant_id": 1, "handoff_id": 10 + i, "offset": 0},
                                     {"handle": cpu_handle(), "memory": b"M" * 64}) for i in range(3)])
    (err,) = _errors(core.receive(b"x", handoffs, 0.0))
    assert (err["code"], err["handoff_ids"]) == ("not_registered", [10, 11, 12]), err  # §2.2: refused whole


def test_malformed_messages_count_against_the_message_rate_too():
    """A registered client's malformed messages were never judged by the rate (the check sat
    after decoding), so a flood of them was answered one ERROR each for ever."""
    core = _core()
    _hello(core, b"c", "consumer", pid=6)
    codes = [e["code"] for _ in range(5003) for e in _errors(core.receive(b"c", [b"NOPE", b"{}"], 1.0))]
    assert codes == ["unknown_verb"] * 5000 + ["limit_exceeded"] * 3, codes[4995:]  # 50,000 // (1 + 9)


def test_a_handoff_message_past_the_rate_is_refused_whole_naming_its_handoffs_and_keeps_its_grants():
    from hurray_ipc.broker.core import MAX_RATE
    core = _core()
    _hello(core, b"p", "producer", pid=5)
    _hello(core, b"c", "consumer", pid=6, credits=2)
    gids = _grant_ids(core.receive(b"p", frames("READY", {"credits": 2}), 0.0))
    core.clients[b"p"].allowance = 0.5  # as after MAX_RATE messages within the second
    msgs = [Message("HANDOFF", {"grant_id": g, "handoff_id": 10 + i, "offset": 0},
                    {"handle": cpu_handle(), "memory": b"M" * 64}) for i, g in enumerate(gids)]
    (err,) = _errors(core.receive(b"p", encode_batch(msgs), 0.0))
    assert (err["code"], err["limit"], err["handoff_ids"]) == ("limit_exceeded", "message_rate", [10, 11]), err
    assert not core.deliveries and len(gids) == 2
    core.check_invariants()
    outs = core.receive(b"p", encode_batch(msgs), 1.0 / MAX_RATE * 200)  # refilled: the same grants work
    assert not _errors(outs) and len(core.deliveries) == 2


def test_bad_handle_error_names_the_handle_field_and_offset():
    core = _core()
    _hello(core, b"p", "producer", pid=5)
    _hello(core, b"c", "consumer", pid=6, credits=1)
    (gid,) = _grant_ids(core.receive(b"p", frames("READY", {"credits": 1}), 0.0))
    bad = struct.pack("<QIBB2s", 4096, 256, 0, 0x7F, b"\0\0")  # sync_mode 0x7f
    (err,) = _errors(_handoff(core, gid, handle=bad, ack=True))
    assert (err["code"], err["handle_field"], err["handle_offset"], err["value"]) == (
        "bad_handle", "sync_mode", 13, 0x7F), err


def test_release_after_producer_gone_is_unknown_token():
    core = _core()
    _hello(core, b"p", "producer", pid=5)
    _hello(core, b"c", "consumer", pid=6, credits=1)
    (gid,) = _grant_ids(core.receive(b"p", frames("READY", {"credits": 1}), 0.0))
    (d, _) = [o.msg for o in _handoff(core, gid, ack=True)]
    gone = [o.msg for o in core.client_gone(b"p", "process gone") if isinstance(o, Send)]
    assert [(m.verb, m.fields()["tokens"]) for m in gone] == [("PRODUCER_GONE", [d.fields()["token"]])]
    (err,) = _errors(core.receive(b"c", frames("RELEASE", {"token": d.fields()["token"]}), 0.0))
    assert err["code"] == "unknown_token"


def test_a_meta_frame_nested_too_deep_names_its_field():
    """Red team low item 18: a meta nested 17 levels got bad_header without field 'meta'."""
    core = _core()
    _hello(core, b"p", "producer", pid=5)
    deep = b'{"user":' + b"[" * 16 + b"]" * 16 + b"}"
    head = struct.pack("<HHI", 1, 0, 0) + struct.pack("<QQQH6s", 1, 1, 0, 0x01 | 0x08, bytes(6))
    (err,) = _errors(core.receive(b"p", [b"HANDOFF", head, bytes(16), b"M" * 64, deep], 0.0))
    assert (err["code"], err["field"]) == ("bad_header", "meta") and "nests deeper" in err["message"]


def test_a_caps_reply_over_64_kib_reaches_its_client():
    """Red team low item 18: ~300 consumers on a channel made CAPS_REPLY 71 KB, over the header
    cap, and hurray-caps --channel failed. CAPS_REPLY may be 16 MiB, as STATS_REPLY."""
    from hurray_ipc.wire.ipc import decode

    core = _core()
    for i in range(400):
        _hello(core, f"c{i:04d}".encode(), "consumer", pid=1000 + i, name="consumer-with-a-long-name-" * 3)
    (out,) = core.receive(b"q", frames("CAPS", {"device": endpoint(9), "channel": "ch"}), 0.0)
    wire = out.msg.encode()
    assert len(wire[1]) > 65536
    assert len(decode(wire).fields()["consumers"]) == 400


def test_a_consumer_holding_8192_buffers_can_register_again():
    """The spec-only implementation's finding 1: 'held' may have 8192 entries, but a header was
    capped at 64 KiB, so a consumer holding more than ~428 buffers got bad_header at its re-HELLO
    after a broker restart. HELLO may now be 2 MiB; every claim is heard."""
    from hurray_ipc.wire.ipc import MAX_HEADER_BYTES

    core = _core()
    held = [{"token": f"{i:048x}", "producer_id": "f" * 32, "handoff_id": i, "event_pending": False}
            for i in range(MAX_HELD)]
    h = {"protocol": PROTOCOL_VERSION, "role": "consumer", "channel": "ch", "pid": 5, "endpoint": endpoint(5),
         "held": held}
    raw = frames("HELLO", h)
    assert len(raw[1]) > 16 * MAX_HEADER_BYTES
    outs = core.receive(b"c", raw, 0.0)
    assert not _errors(outs) and [o.msg.verb for o in outs] == ["WELCOME"]
    core.check_invariants()
    too_many = dict(h, held=[*held, held[0]])
    (err,) = _errors(core.receive(b"c2", frames("HELLO", too_many), 0.0))
    assert (err["code"], err["field"], err["value"]) == ("bad_header", "held", MAX_HELD + 1)


def _claim(core: BrokerCore, rid: bytes, token: str, pid: int, now: float) -> list:
    held = [{"token": token, "producer_id": "p", "handoff_id": 7, "event_pending": False}]
    h = {"protocol": PROTOCOL_VERSION, "role": "consumer", "channel": "ch", "pid": pid, "endpoint": endpoint(pid),
         "held": held}
    return core.receive(rid, frames("HELLO", h), now)


def _sent(outs: list) -> list[tuple[bytes, str, dict]]:
    return [(o.rid, o.msg.verb, o.msg.fields()) for o in outs if isinstance(o, Send) and o.msg.verb != "WELCOME"]


@pytest.mark.parametrize("thief_releases_first", [False, True])
@pytest.mark.parametrize("stolen", [False, True])
def test_a_claim_made_first_by_another_consumer_does_not_cost_the_holder_its_buffer(thief_releases_first, stolen):
    """After a broker restart, a consumer claims a handoff it never received (with a made-up
    token, or the holder's own token) before its real holder re-registers, and before the
    producer does. The producer's list names the real holder: the holder keeps it (no RELEASED
    to the producer while it reads), the thief is told PRODUCER_GONE reclaimed. Before, the
    first claim shut the real one out, and the producer got RELEASED consumer_gone while the
    holder still read the buffer. The thief withdrawing first must not lose the holder's
    claim either."""
    core = _core()
    honest = "1b" * 24  # the token an earlier broker delivered to c-honest
    thief = honest if stolen else _forged(0)
    assert not _sent(_claim(core, b"c-thief", thief, pid=11, now=0.0))
    assert not _sent(_claim(core, b"c-honest", honest, pid=12, now=0.1))
    core.check_invariants()
    if thief_releases_first:
        assert not _sent(core.receive(b"c-thief", frames("RELEASE", {"token": thief}), 0.2))
        core.check_invariants()
    h = {"protocol": PROTOCOL_VERSION, "role": "producer", "channel": "ch", "pid": 10, "endpoint": endpoint(10),
         "outstanding": [{"handoff_id": 7, "consumer_id": BrokerCore.label_of(b"c-honest")}]}
    sent = _sent(core.receive(b"p", frames("HELLO", h), 0.3))
    core.check_invariants()
    expected = [] if thief_releases_first else [(b"c-thief", "PRODUCER_GONE",
                                                 {"tokens": [thief], "reason": "reclaimed"})]
    assert sent == expected
    assert core.deliveries[honest].consumer == b"c-honest"
    assert not _sent(core.tick(0.3 + 10 * TIMEOUT, lambda c: True))  # no orphan: it is held
    (released,) = _sent(core.receive(b"c-honest", frames("RELEASE", {"token": honest}), 40.0))
    assert released == (b"p", "RELEASED", {"handoff_id": 7, "reason": "released"})
    core.check_invariants()


def test_claims_end_with_the_claimer_or_with_a_producer_that_never_comes_back():
    core = _core()
    _claim(core, b"c-a", _forged(0), pid=11, now=0.0)
    _claim(core, b"c-b", _forged(1), pid=12, now=0.0)
    _claim(core, b"c-c", _forged(2), pid=13, now=0.0)
    assert core.clients[b"c-b"].held == 1  # a provisional claim counts against MAX_HELD
    core.client_gone(b"c-b", "process gone")
    core.check_invariants()
    sent = _sent(core.tick(1 + TIMEOUT, lambda c: True))  # the producer never registered
    assert sorted(sent) == [(b"c-a", "PRODUCER_GONE", {"tokens": [_forged(0)]}),
                            (b"c-c", "PRODUCER_GONE", {"tokens": [_forged(2)]})]
    assert not core.deliveries and not core.claims and core.clients[b"c-c"].held == 0
    core.check_invariants()


def test_a_claim_withdrawn_before_its_producer_decides_is_forgotten():
    core = _core()
    _claim(core, b"c-a", _forged(0), pid=11, now=0.0)
    _claim(core, b"c-b", _forged(1), pid=12, now=0.0)
    assert not _sent(core.receive(b"c-b", frames("RELEASE", {"token": _forged(1)}), 0.1))
    (err,) = _errors(core.receive(b"c-b", frames("RELEASE", {"token": _forged(1)}), 0.1))
    assert err["code"] == "already_released"  # withdrawn
    assert not _sent(_claim(core, b"c-b", _forged(1), pid=12, now=0.15))  # and not claimable again
    assert core.clients[b"c-b"].held == 0
    assert not _errors(core.receive(b"c-a", frames("RELEASE", {"token": _forged(0)}), 0.2))
    assert not core.deliveries and core.clients[b"c-b"].held == 0
    core.check_invariants()


def test_the_model_checks_that_no_buffer_goes_back_while_a_consumer_reads_it():
    """The interleaving the stateful test's RELEASED check is there for, spelled out (random
    search rarely draws it): a broker restart, a thief claims first, the holder second, then
    the producer; the holder keeps its buffer past every deadline."""
    m = BrokerMachine()
    m.everyone_registers()
    m.send(b"c1", "REQUEST", {"credits": 1})
    m.handoff(b"p0", "ok")
    assert m.views[b"c1"].held
    m.broker_restart([*PRODUCERS, *CONSUMERS], {b"p0", *CONSUMERS})
    m.forge_held(b"c0")
    m.register(b"c1")
    m.register(b"p0")
    m.time_passes(2 * TIMEOUT)
    m.core_invariants()
    assert m.views[b"c1"].held and not m.released and not m.gone


def test_many_rival_claims_do_not_crowd_out_the_holder():
    """Twenty registrations (one process may have 256) claim a handoff before its holder does: a
    cap per handoff would have dropped the holder's claim, and its producer would then get
    RELEASED while the holder reads."""
    core = _core()
    for i in range(20):
        _claim(core, f"c-rival-{i}".encode(), _forged(i), pid=11, now=0.0)
    _claim(core, b"c-honest", "1b" * 24, pid=12, now=0.1)
    h = {"protocol": PROTOCOL_VERSION, "role": "producer", "channel": "ch", "pid": 10, "endpoint": endpoint(10),
         "outstanding": [{"handoff_id": 7, "consumer_id": BrokerCore.label_of(b"c-honest")}]}
    sent = _sent(core.receive(b"p", frames("HELLO", h), 0.3))
    assert sorted(rid for rid, verb, _ in sent if verb == "PRODUCER_GONE") == \
        sorted(f"c-rival-{i}".encode() for i in range(20))
    assert core.deliveries["1b" * 24].consumer == b"c-honest"
    assert not _sent(core.tick(40.0, lambda c: True))
    core.check_invariants()


def _tick(core: BrokerCore, now: float) -> list[tuple[bytes, str, dict]]:
    return _sent(core.tick(now, lambda c: True))


@pytest.mark.parametrize("why", ["full", "unreachable"])
def test_a_deliver_that_could_not_be_sent_goes_back_to_its_producer_and_its_credit_waits_for_a_probe(why):
    """Red team item 16: a DELIVER dropped at the high-water mark stayed held by a consumer that
    never saw it, stranding the producer's buffer until that consumer died. Then its credit went
    straight back to the queue, so the producer's next handoff went to the same consumer and
    bounced as well (spec §1: it is choked until a probe gets through)."""
    core = _core()
    _hello(core, b"p", "producer", pid=5)
    _hello(core, b"c", "consumer", pid=6, credits=1)
    (gid,) = _grant_ids(core.receive(b"p", frames("READY", {"credits": 2}), 0.0))
    (d, _) = [o.msg for o in _handoff(core, gid, ack=True)]
    assert d.verb == "DELIVER" and core.clients[b"c"].held == 1
    sent = _sent(core.undeliverable(b"c", d, why))
    assert [(rid, verb, h.get("reason")) for rid, verb, h in sent] == [(b"p", "RELEASED", f"undelivered: {why}")]
    assert core.clients[b"c"].held == 0 and d.fields()["token"] not in core.deliveries
    (err,) = _errors(core.receive(b"c", frames("RELEASE", {"token": d.fields()["token"]}), 0.01))
    assert err["code"] == "already_released"
    core.check_invariants()
    assert _tick(core, 0.049) == []
    assert _tick(core, 0.05) == [(b"c", "PONG", {})]  # the probe
    # Nothing said the probe failed: the consumer's credit, kept, is granted to the producer's
    # second READY credit.
    assert [(rid, verb, h["consumer_id"]) for rid, verb, h in _tick(core, 0.1)] == [
        (b"p", "GRANT", BrokerCore.label_of(b"c"))]
    core.check_invariants()


def test_a_consumer_a_send_to_which_failed_gets_no_grant_until_a_probe_to_it_got_through():
    """A consumer that never reads its socket, once its queue at the broker is full, made every
    handoff granted on its credits bounce back to its producer (``undelivered: full``): 190 of
    the healthy pair's handoffs a second (scripts/floods.py deaf-pings, 2026-12-07). Once any
    send to it fails it is choked: its credits are kept but not granted, probed with an unasked
    PONG 50 ms later, then 100, 200 ... ms after each probe that failed too (spec §1)."""
    core = _core()
    _hello(core, b"p", "producer", pid=5)
    _hello(core, b"deaf", "consumer", pid=6, credits=4)
    _hello(core, b"good", "consumer", pid=7)
    _tick(core, 1.0)
    core.undeliverable(b"deaf", Message("PONG", {}), "full")  # any message: here a PONG it asked for
    core.receive(b"good", frames("REQUEST", {"credits": 3}), 1.0)
    granted = _sent(core.receive(b"p", frames("READY", {"credits": 3}), 1.0))
    assert [h["consumer_id"] for _, verb, h in granted if verb == "GRANT"] == [BrokerCore.label_of(b"good")] * 3
    core.check_invariants()
    assert _tick(core, 1.049) == []
    assert _tick(core, 1.05) == [(b"deaf", "PONG", {})]
    core.undeliverable(b"deaf", Message("PONG", {}), "full")  # the probe failed: twice as long
    core.receive(b"p", frames("READY", {"credits": 1}), 1.06)
    assert _tick(core, 1.1) == [] and _tick(core, 1.149) == []
    assert _tick(core, 1.151) == [(b"deaf", "PONG", {})]
    assert [(rid, verb, h["consumer_id"]) for rid, verb, h in _tick(core, 1.2)] == [
        (b"p", "GRANT", BrokerCore.label_of(b"deaf"))]
    assert core.clients[b"deaf"].credits == 3  # none lost: 4 asked, 1 granted
    assert core.stats.consumers_choked == 1
    core.check_invariants()


def test_grants_count_against_a_consumers_credit_limits():
    """Only queued credits counted: once granted they left the count, so a consumer's REQUEST of
    4096 and a producer's READY of 4096, over and over, made 204,800 grants from 100 messages,
    unbounded broker memory (a reviewer, 2026-12-07). Granted and unused, a credit is still not
    answered: it counts against ``queued_credits`` and ``held`` (spec §6a)."""
    core = _core()
    _hello(core, b"p", "producer", pid=5)
    _hello(core, b"c", "consumer", pid=6)
    core.receive(b"c", frames("REQUEST", {"credits": 4096}), 0.0)
    assert len(_grant_ids(core.receive(b"p", frames("READY", {"credits": 4096}), 0.0))) == 4096
    (err,) = _errors(core.receive(b"c", frames("REQUEST", {"credits": 1}), 0.0))
    assert (err["code"], err["limit"], err["value"]) == ("limit_exceeded", "queued_credits", 4097), err
    assert _grant_ids(core.receive(b"p", frames("READY", {"credits": 4096}), 0.0)) == [] and len(core.grants) == 4096
    core.check_invariants()


def test_a_producer_holds_at_most_4096_unused_grants():
    """A consumer's re-HELLO left its old registration's grants on record (its producer may still
    use one, refused consumer_gone), counted against no consumer (a reviewer, 2026-12-07): its HELLO
    and a producer's READY of 4096, over and over, made 102,400 grants from 52 messages. A producer
    holding MAX_CREDITS unused grants gets no more until it uses or loses some (spec §6a)."""
    core = _core()
    _hello(core, b"p", "producer", pid=5)
    first: list[int] = []
    for _ in range(25):
        _hello(core, b"c", "consumer", pid=6, credits=4096)
        gids = _grant_ids(core.receive(b"p", frames("READY", {"credits": 4096}), 0.0))
        first = first or gids
        assert len(core.grants) == 4096 and len(gids) == (4096 if gids is first else 0)
    core.check_invariants()
    (err,) = _errors(_handoff(core, first[0]))
    assert err["code"] == "consumer_gone", "the consumer it names left: refused as before"
    # One used: the producer's READY that waited takes a grant at the next tick.
    assert [(to, f["consumer_id"]) for to, verb, f in _tick(core, 0.01) if verb == "GRANT"] == [
        (b"p", BrokerCore.label_of(b"c"))]
    core.check_invariants()


def _holding_many(batches: int) -> BrokerCore:
    """Producer ``p`` and consumer ``c`` registered; ``c`` holds ``batches`` x 64 deliveries of ``p``."""
    core = _core()
    _hello(core, b"p", "producer", pid=5)
    _hello(core, b"c", "consumer", pid=6)
    for i in range(batches):
        core.receive(b"c", frames("REQUEST", {"credits": 64}), 0.0)
        gids = _grant_ids(core.receive(b"p", frames("READY", {"credits": 64}), 0.0))
        core.receive(b"p", encode_batch([Message("HANDOFF", {"grant_id": g, "handoff_id": 64 * i + j, "offset": 0},
                                                 {"handle": cpu_handle(), "memory": b"M" * 64})
                                         for j, g in enumerate(gids)]), 0.0)
    assert core.clients[b"c"].held == 64 * batches
    return core


def test_grants_count_against_what_a_consumer_may_hold():
    core = _holding_many(66)
    core.receive(b"c", frames("REQUEST", {"credits": 3900}), 0.0)
    assert len(_grant_ids(core.receive(b"p", frames("READY", {"credits": 4000}), 0.0))) == 3900
    (err,) = _errors(core.receive(b"c", frames("REQUEST", {"credits": 100}), 0.0))
    assert (err["limit"], err["value"]) == ("held", 4224 + 3900 + 100), err
    core.check_invariants()


def test_hello_credits_past_what_a_consumer_may_hold_are_named_after_the_welcome():
    """A HELLO's credits past ``held`` were queued only up to it, silently: the client counted the
    rest as asked, and one re-registering while it held close to 8192 could ask for nothing more.
    The rest is named (ERROR limit_exceeded, credits) after the WELCOME, so the client counts them
    as not asked (spec §6a)."""
    core = _holding_many(66)
    held = [{"token": d.token, "producer_id": "p", "handoff_id": d.handoff_id, "event_pending": False}
            for d in core.deliveries.values()]
    outs = _hello(core, b"c", "consumer", pid=6, credits=4096, held=held)
    verbs = [o.msg.verb for o in outs if isinstance(o, Send)]
    assert verbs == ["WELCOME", "ERROR"], verbs
    (err,) = _errors(outs)
    assert (err["code"], err["ref"], err["limit"], err["credits"]) == ("limit_exceeded", "HELLO", "held", 128)
    c = core.clients[b"c"]
    assert (c.held, c.credits) == (4224, 8192 - 4224)
    core.check_invariants()


def test_a_bounced_delivers_credit_comes_back_whatever_the_limits():
    """The credit of a DELIVER that could not be sent went back through the REQUEST limits: with
    4096 queued already, the limit refused it and the credit was lost, while the consumer counted
    it asked (a reviewer, 2026-12-07). It is the consumer's own credit, never answered, and the
    delivery it leaves counted as much: it comes back whatever the limits."""
    core = _core()
    _hello(core, b"p", "producer", pid=5)
    _hello(core, b"c", "consumer", pid=6, credits=4096)
    (gid,) = _grant_ids(core.receive(b"p", frames("READY", {"credits": 1}), 0.0))
    (d, _) = [o.msg for o in _handoff(core, gid, ack=True)]
    core.receive(b"c", frames("REQUEST", {"credits": 1}), 0.0)  # 4096 queued again
    core.undeliverable(b"c", d, "full")
    c = core.clients[b"c"]
    assert (c.held, c.credits, c.granted, core.stats.limits_refused) == (0, 4097, 0, 0)
    core.check_invariants()


def test_the_wait_between_probes_doubles_up_to_two_seconds():
    core = _core()
    _hello(core, b"deaf", "consumer", pid=6, credits=1)
    now, probes = 0.0, []
    core.undeliverable(b"deaf", Message("PONG", {}), "full")
    while now < 12.0:
        now = round(now + 0.001, 3)
        if now % 1 == 0:
            core.receive(b"deaf", frames("PING", {}), now)  # it is not silent: it is not dropped
        if _tick(core, now):
            probes.append(now)
            core.undeliverable(b"deaf", Message("PONG", {}), "full")
    assert [round(b - a, 2) for a, b in itertools.pairwise(probes)][:7] == [0.1, 0.2, 0.4, 0.8, 1.6, 2.0, 2.0]


def test_a_choked_consumers_unused_grants_are_revoked_without_passing_their_producer_over():
    """Grants the producer holds for a choked consumer would bounce too: they are revoked, their
    credits kept with the consumer's. The producer did nothing wrong, so unlike a hoarder's
    (§4.3a) it is not passed over."""
    core = _core()
    _hello(core, b"p", "producer", pid=5)
    _hello(core, b"q", "producer", pid=8)
    _hello(core, b"good", "consumer", pid=7)
    _hello(core, b"deaf", "consumer", pid=6, credits=2)
    gids = _grant_ids(core.receive(b"p", frames("READY", {"credits": 3}), 0.0))  # one READY credit left
    assert len(gids) == 2
    sent = _sent(core.undeliverable(b"deaf", Message("PONG", {}), "full"))
    assert sent == [(b"p", "REVOKE", {"grant_ids": gids})]
    assert core.clients[b"deaf"].credits == 2
    # Producers take turns: q, then p, which has not asked since and is not passed over.
    core.receive(b"q", frames("READY", {"credits": 1}), 0.0)
    assert _grants_to(core.receive(b"good", frames("REQUEST", {"credits": 1}), 0.0)) == [b"q"]
    core.receive(b"q", frames("READY", {"credits": 1}), 0.0)
    assert _grants_to(core.receive(b"good", frames("REQUEST", {"credits": 1}), 0.0)) == [b"p"]
    core.check_invariants()


def test_a_choke_revokes_the_grants_of_the_consumers_registration_only():
    """Grants made for an earlier registration of the same consumer (before its re-HELLO) are
    not its credits any more: a HANDOFF on one is refused consumer_gone, and a choke leaves them."""
    core = _core()
    _hello(core, b"p", "producer", pid=5)
    _hello(core, b"c", "consumer", pid=6, credits=2)
    old = _grant_ids(core.receive(b"p", frames("READY", {"credits": 2}), 0.0))
    _hello(core, b"c", "consumer", pid=6, credits=1)
    new = _grant_ids(core.receive(b"p", frames("READY", {"credits": 1}), 0.0))
    assert len(old) == 2 and len(new) == 1
    assert _sent(core.undeliverable(b"c", Message("PONG", {}), "full")) == [(b"p", "REVOKE", {"grant_ids": new})]
    assert core.clients[b"c"].credits == 1
    core.check_invariants()
    (err,) = _errors(_handoff(core, old[0]))
    assert err["code"] == "consumer_gone"
    core.check_invariants()


def test_a_choked_consumer_stays_choked_when_it_says_hello_again():
    """A re-HELLO re-declares credits; were the choke forgotten with the old registration, a deaf
    client could re-HELLO to get each of its credits granted, one bounce each."""
    core = _core()
    _hello(core, b"p", "producer", pid=5)
    _hello(core, b"deaf", "consumer", pid=6)
    core.undeliverable(b"deaf", Message("PONG", {}), "full")
    _hello(core, b"deaf", "consumer", pid=6, credits=4)
    assert _grant_ids(core.receive(b"p", frames("READY", {"credits": 1}), 0.01)) == []
    core.check_invariants()
    core.receive(b"deaf", frames("BYE", {}), 0.02)  # gone: nothing of it is kept
    assert not core.choked and _tick(core, 5.0) == []
    core.check_invariants()


def test_silent_registrations_that_hold_nothing_expire_so_squatters_cannot_fill_the_table():
    """Red team item 3: HELLOs from routing ids that then close, each with a made-up lease of
    this uid naming pid 1 (always alive), stayed 'unresponsive' for ever until every later client
    got limit_exceeded. Alive but silent past the timeout, holding nothing: dropped."""
    from hurray_ipc.broker.core import MAX_CLIENTS_PER_PROCESS

    core = _core()
    for i in range(2000):
        lease = f"hurray-{os.getuid()}-lease-1-1-{i:016x}"  # one 'process' each: no per-process limit
        assert not _errors(_hello(core, f"squat-{i}".encode(), "consumer", pid=1, lease=lease))
    assert len(core.clients) == 2000 > MAX_CLIENTS_PER_PROCESS
    core.tick(TIMEOUT + 0.1, lambda c: True)
    assert not core.clients and not core.channels and core.stats.unresponsive == 0
    core.check_invariants()


def _grants_to(outs: list) -> list[bytes]:
    return [o.rid for o in outs if isinstance(o, Send) and o.msg.verb == "GRANT"]


def test_a_greedy_consumer_gets_its_turn_not_every_grant():
    """Red team item 12: a consumer that asks for 4096 and never reads took every grant until
    its credits ran out. Consumers now take turns: the next grant goes to the one that asked
    after it."""
    core = _core()
    _hello(core, b"p", "producer", pid=5)
    _hello(core, b"greedy", "consumer", pid=6)
    _hello(core, b"c", "consumer", pid=7)
    core.receive(b"greedy", frames("REQUEST", {"credits": 4096}), 0.0)
    core.receive(b"c", frames("REQUEST", {"credits": 1}), 0.0)
    assert _grants_to(core.receive(b"p", frames("READY", {"credits": 2}), 0.0)) == [b"p", b"p"]
    assert sorted(g.consumer for g in core.grants.values()) == [b"c", b"greedy"]
    core.check_invariants()


def _hoarder_world() -> BrokerCore:
    """Producer 'hoard' asked for 4096 grants and never sends; consumer 'c' asks for one at a
    time; producer 'p' arrives and asks for one."""
    core = _core()
    _hello(core, b"hoard", "producer", pid=5)
    core.receive(b"hoard", frames("READY", {"credits": 4096}), 0.0)
    _hello(core, b"c", "consumer", pid=6)
    assert _grants_to(core.receive(b"c", frames("REQUEST", {"credits": 1}), 0.0)) == [b"hoard"]
    _hello(core, b"p", "producer", pid=7)
    assert _grants_to(core.receive(b"p", frames("READY", {"credits": 1}), 0.1)) == []  # nothing to give yet
    return core


def test_a_grant_a_producer_sits_on_goes_to_one_that_asks_after_a_heartbeat():
    """Red team item 12: a producer that asked for 4096 grants and never sent kept the consumer's
    credit for ever. A grant unused for a heartbeat while another producer asks is revoked
    (REVOKE to its holder) and given to the one that asks; the hoarder is then passed over
    until it hands off or asks again."""
    core = _hoarder_world()
    hb = core.heartbeat_s
    assert not _sent(core.tick(0.0 + hb - 0.01, lambda c: True))  # not a heartbeat yet
    sent = _sent(core.tick(0.0 + hb + 0.01, lambda c: True))
    (gid,) = [gid for gid, g in core.grants.items() if g.producer == b"p"]
    assert [(rid, verb) for rid, verb, _ in sent] == [(b"hoard", "REVOKE"), (b"p", "GRANT")]
    assert core.stats.grants_revoked == 1 and not core.clients[b"hoard"].grants
    # The consumer's next credits go to the producer that uses them, not to the hoarder.
    for i in range(3):
        t = 1.0 + i
        _handoff(core, gid, t, hid=i + 1, ready=1)
        core.receive(b"c", frames("REQUEST", {"credits": 1}), t)
        (gid,) = [gid for gid, g in core.grants.items() if g.producer == b"p"]
        assert not core.clients[b"hoard"].grants
    # Asking again, it takes turns like anyone.
    _handoff(core, gid, 5.0, hid=9)
    assert _grants_to(core.receive(b"hoard", frames("READY", {"credits": 1}), 5.0)) == []
    assert _grants_to(core.receive(b"c", frames("REQUEST", {"credits": 1}), 5.0)) == [b"hoard"]
    core.check_invariants()


def test_a_grant_unused_for_the_timeout_is_revoked_and_the_credit_goes_back():
    core = _core()
    _hello(core, b"p", "producer", pid=5)
    _hello(core, b"c", "consumer", pid=6, credits=1)
    (gid,) = _grant_ids(core.receive(b"p", frames("READY", {"credits": 1}), 0.0))
    assert not _sent(core.tick(TIMEOUT, lambda c: True))
    core.receive(b"c", frames("PING", {}), TIMEOUT)  # a live consumer pings; the producer is busy
    assert _sent(core.tick(TIMEOUT + 0.01, lambda c: True)) == [(b"p", "REVOKE", {"grant_ids": [gid]})]
    assert core.clients[b"c"].credits == 1 and not core.grants
    (err,) = _errors(_handoff(core, gid, 4.0))
    assert err["code"] == "unknown_grant"
    assert _grants_to(core.receive(b"p", frames("READY", {"credits": 1}), 4.0)) == [b"p"]  # asks again: served
    core.check_invariants()


def test_query_answers_are_budgeted_per_connection_and_a_flood_gets_one_error_a_second():
    """Red team items 4 and 9: STATS from a socket that never reads grew the broker by 500 MB in
    5 s, and a reading client's STATS/CAPS flood left the good pair a tenth of its rate. One
    connection, registered or not, is sent at most ``query_bytes`` of answers a second (2 MiB; a
    small budget here so a few answers reach it); the query that finds the budget spent is refused
    with ERROR limit_exceeded, and every further one that second goes unanswered, so a peer that
    never reads has nothing more queued for it. Others are answered meanwhile."""
    core = BrokerCore(host=HOST, timeout_s=TIMEOUT, query_bytes=5000, query_bytes_total=1 << 30)
    answers = [_sent(core.receive(b"mon", frames("STATS", {"request_id": i}), 1.0)) for i in range(100)]
    size = len(Message("STATS_REPLY", answers[0][0][2]).encode()[1])  # what one answer is charged
    n = -(-5000 // size)  # answered while the budget is not overdrawn
    assert 1 < n < 10
    assert all(a[0][1] == "STATS_REPLY" for a in answers[:n])
    (err,) = [h for _, verb, h in answers[n]]
    assert (err["code"], err["limit"], err["value"], err["request_id"]) == ("limit_exceeded", "query_bytes", 5000, n)
    assert all(a == [] for a in answers[n + 1:]), "a flood gets one ERROR a second, nothing else"
    assert core.stats.limits_refused == 100 - n
    assert _sent(core.receive(b"other", frames("STATS", {}), 1.0))[0][1] == "STATS_REPLY"
    debt = n * size - 5000  # what the answers overdrew; half of it refilled is not enough
    assert _sent(core.receive(b"mon", frames("STATS", {}), 1.0 + 0.5 * debt / 5000)) == []  # not refilled yet
    assert _sent(core.receive(b"mon", frames("STATS", {}), 3.0))[0][1] == "STATS_REPLY"  # refilled
    core.check_invariants()


def test_all_connections_together_get_at_most_the_total_query_budget_and_handoffs_go_on():
    """Many connections (a socket each) cannot multiply the per-connection budget: the broker
    sends ``query_bytes_total`` of answers a second in all, and handoffs never count against it."""
    core = BrokerCore(host=HOST, timeout_s=TIMEOUT, query_bytes=1 << 20, query_bytes_total=20_000)
    _hello(core, b"p", "producer", pid=5)
    _hello(core, b"c", "consumer", pid=6, credits=1)
    verbs = [_sent(core.receive(f"q{i}".encode(), frames("CAPS", {"device": endpoint(9)}), 1.0)) for i in range(200)]
    answered = sum(1 for v in verbs if v and v[0][1] == "CAPS_REPLY")
    refused = [v[0][2] for v in verbs if v and v[0][1] == "ERROR"]
    assert 1 < answered < 200 and len(refused) == 200 - answered
    assert {h["limit"] for h in refused} == {"query_bytes_total"}
    out = core.receive(b"p", frames("READY", {"credits": 1}), 1.0)
    (gid,) = _grant_ids(out)
    out = _handoff(core, gid, 1.0)
    assert [(rid, verb) for rid, verb, _ in _sent(out)] == [(b"c", "DELIVER")]
    core.check_invariants()


def test_a_small_answer_is_never_limited_at_the_default_budget():
    """The default budget (2 MiB a second per connection) is about answers' bytes, not their
    count: a harness that syncs with a CAPS after every step, thousands a second, is answered
    (each CAPS names the ticket of the answer before it, §6a)."""
    core = _core()
    ticket = None
    for i in range(2000):
        (ans,) = _sent(core.receive(b"sync", frames("CAPS", _ask({"device": endpoint(9)}, ticket)), 1.0 + i * 1e-4))
        assert ans[1] == "CAPS_REPLY"
        ticket = ans[2]["ticket"]
    assert core.snapshot(2.0)["gauges"]["unread_answers"] == 1


# --- what waits for a peer that never reads (spec §6a unread answers) ------------------------------

def _ask(header: dict, ticket: str | None) -> dict:
    return header if ticket is None else {**header, "ticket": ticket}


def _stats(core: BrokerCore, rid: bytes, now: float, ticket: str | None = None) -> list[tuple[bytes, str, dict]]:
    return _sent(core.receive(rid, frames("STATS", _ask({"request_id": 1}, ticket)), now))


def test_a_connection_that_never_reads_is_sent_eight_answers_ever():
    """Red team item 4: STATS from sockets that never read grew the broker by 500 MB. A rate
    alone bounds that per second, not in all: here the deaf connection asks once a second for
    an hour (its rate budget full every time) and is answered 8 times, never again, while a
    connection that names its latest ticket is answered every time."""
    core = _core()
    deaf = [_stats(core, b"deaf", 1.0 + i) for i in range(3600)]
    assert [len(a) for a in deaf[:MAX_UNREAD]] == [1] * MAX_UNREAD
    assert all(a == [] for a in deaf[MAX_UNREAD:]), "answers past the 8th wait for a peer that never reads"
    assert core.stats.answers_withheld == 3600 - MAX_UNREAD
    ticket = None
    for i in range(100):
        (ans,) = _stats(core, b"reader", 1.0 + i, ticket)
        ticket = ans[2]["ticket"]
    assert len({t for t in [ans[2]["ticket"]] + [a[0][2]["ticket"] for a in deaf[:MAX_UNREAD]]}) == MAX_UNREAD + 1
    core.check_invariants()


def test_a_ticket_shows_its_answer_and_every_earlier_one_read_and_no_other_ticket_does():
    """A client may ask ahead of its answers: naming the 3rd of 8 unread frees 3. A ticket from
    another connection, one already used, or a made-up one shows nothing; one that is not a
    string is bad_header, itself an answer (with a ticket)."""
    core = _core()
    tickets = [_stats(core, b"c", 1.0)[0][2]["ticket"] for _ in range(MAX_UNREAD)]
    other = _stats(core, b"other", 1.0)[0][2]["ticket"]
    for wrong in (other, "0" * 16, "", tickets[0] + "0"):
        assert _stats(core, b"c", 2.0, wrong) == [], wrong
    assert [len(_stats(core, b"c", 3.0, tickets[2])) for _ in range(4)] == [1, 1, 1, 0]
    assert _stats(core, b"c", 4.0, tickets[2]) == []  # used: shows nothing more
    (err,) = _sent(core.receive(b"fresh", frames("STATS", {"ticket": 7}), 5.0))
    assert (err[1], err[2]["code"], err[2]["field"], err[2]["value"]) == ("ERROR", "bad_header", "ticket", 7)
    assert isinstance(err[2]["ticket"], str) and core.snapshot(5.0)["gauges"]["unread_answers"] == 8 + 1 + 1
    assert core.stats.answers_withheld == 4 + 1 + 1
    assert _stats(core, b"fresh", 5.0, None) and core.receive(b"fresh", frames("STATS", {"ticket": None}), 5.0)
    # At 8 unread, a malformed ticket gets nothing either: the limit comes before any other check
    # (the spec-only peer's 100 bad tickets once reached 108 unread ERRORs).
    for _ in range(100):
        core.receive(b"fresh", frames("STATS", {"ticket": [1]}), 6.0)
    assert core.snapshot(6.0)["gauges"]["unread_answers"] == 8 + 1 + 8


def test_an_answer_is_charged_its_header_exactly():
    """What an answer costs (``unread_bytes`` and ``query_bytes``) is its header frame's length,
    request_id and ticket included. A STATS_REPLY was once charged its snapshot alone, so a
    60 KB request_id echoed in each answer passed the 2 MiB/s budget 40-fold."""
    core = _core()
    _hello(core, b"p", "producer", pid=5)
    for verb, header in (("STATS", {"request_id": "r" * 64}), ("STATS", {"request_id": 7}),
                         ("CAPS", {"device": endpoint(9), "request_id": "é" * 64}),
                         ("CAPS", {"device": endpoint(9), "channel": "ch"}), ("STATS", {"request_id": [1]})):
        before = core.snapshot(1.0)["gauges"]["unread_bytes"]
        outs = [o for o in core.receive(b"q", frames(verb, header), 1.0) if isinstance(o, Send)]
        (out,) = outs
        assert core.snapshot(1.0)["gauges"]["unread_bytes"] - before == len(out.msg.encode()[1]), (verb, header)
        ticket = out.msg.fields()["ticket"]
        core.receive(b"q", frames("STATS", {"ticket": ticket}), 1.0)  # read: the next is charged alone
        core.queries.forget(b"q")


def test_a_refusal_never_grows_with_the_refused_message():
    """Red team item 4, second form (found in review): every ERROR echoed the refused message's
    request_id or token whole, so 8 refused queries with a 60 KB request_id held 480 KB for one
    connection, and a not_registered ERROR echoing a 60 KB token let the high-water mark hold
    4 GB. A request_id is at most 64 characters (or a 64-bit integer), and an ERROR echoes only
    such values: every refusal below stays under 1 KB."""
    core = _core()
    huge = "x" * 60_000
    cases = [(b"q1", "STATS", {"request_id": huge}), (b"q2", "CAPS", {"device": endpoint(9), "request_id": huge}),
             (b"q3", "CAPS", {"device": {**endpoint(9), "pid": huge}, "request_id": 1}),
             (b"q4", "STATS", {"request_id": 1 << 70}), (b"q5", "PING", {"token": huge, "request_id": huge}),
             (b"q6", "CAPS", {"device": endpoint(9), "transport": huge})]
    for rid, verb, header in cases:
        (out,) = [o for o in core.receive(rid, frames(verb, header), 1.0) if isinstance(o, Send)]
        size = len(out.msg.encode()[1])
        assert out.msg.verb == "ERROR" and size < 1024, (verb, size, str(out.msg.fields())[:300])
        assert huge not in json.dumps(out.msg.fields())
    (err,) = _sent(core.receive(b"q7", frames("STATS", {"request_id": huge}), 1.0))
    assert (err[2]["code"], err[2]["field"], "request_id" in err[2]) == ("bad_header", "request_id", False)
    assert _stats(core, b"q7", 1.0, err[2]["ticket"])[0][1] == "STATS_REPLY"  # 64 characters: fine


def test_a_reader_is_answered_while_peers_that_never_read_hold_the_total():
    """Found in review: peers that stay connected and never read are never forgotten, so once
    they held unread_bytes_total every tool was refused for as long as they stayed. A query whose
    ticket shows that its connection read everything it was sent is answered from a reserve of
    as much again; a connection that has not shown it is still refused, and nothing passes
    twice the total."""
    core = BrokerCore(host=HOST, timeout_s=TIMEOUT, unread_bytes_total=20_000, query_bytes_total=1 << 40)
    (first,) = _stats(core, b"tool", 0.0)
    i = 0
    while core.snapshot(1.0)["gauges"]["unread_bytes"] < 20_000:
        _stats(core, f"deaf{i}".encode(), 1.0)
        i += 1
    (refused,) = _stats(core, b"newcomer", 2.0)
    assert refused[2]["limit"] == "unread_bytes_total"
    ticket = first[2]["ticket"]
    for hour in range(1, 50):  # a tool polling once an hour, for as long as the deaf peers stay
        (ans,) = _stats(core, b"tool", 2.0 + 3600 * hour, ticket)
        assert ans[1] == "STATS_REPLY", hour
        ticket = ans[2]["ticket"]
    replies = 0  # bytes of STATS_REPLY the reserve let out to peers that read once, then stop
    for j in range(200):  # they can fill the reserve, one answer each, and no more
        (a,) = _stats(core, f"more{j}".encode(), 9e5)
        for _rid, verb, h in _stats(core, f"more{j}".encode(), 9e5, a[2]["ticket"]):
            replies += len(Message(verb, h).encode()[1]) if verb == "STATS_REPLY" else 0
    one = len(Message("STATS_REPLY", ans[2]).encode()[1])
    held = core.snapshot(9e5)["gauges"]["unread_bytes"]
    assert held >= 2 * 20_000 and 0 < replies < 20_000 + 2 * one, (held, replies)


def test_unread_answers_of_all_connections_are_bounded_in_bytes():
    """Many deaf connections cannot multiply the 8 answers each: past ``unread_bytes_total``
    a query is refused with a small ERROR (an answer too, so at most 8 of those per connection).
    What the broker sent to deaf peers, summed from its own output, stays under the bound; a
    reader that shows its answers read frees their bytes for others."""
    core = BrokerCore(host=HOST, timeout_s=TIMEOUT, unread_bytes_total=200_000, query_bytes_total=1 << 40)
    for i in range(40):
        _hello(core, f"p{i}".encode(), "producer", pid=100 + i)  # a STATS of a few KB
    size = len(json.dumps(core.snapshot(0.0)))
    sent_to_deaf = 0
    for i in range(300):
        for _rid, verb, h in _stats(core, f"deaf{i}".encode(), 1.0 + i):
            sent_to_deaf += len(json.dumps(h))
            assert verb == "STATS_REPLY" or (h["code"], h["limit"]) == ("limit_exceeded", "unread_bytes_total")
    assert 200_000 <= sent_to_deaf <= 200_000 + size + 300 * 400
    assert core.snapshot(400.0)["gauges"]["unread_bytes"] >= 200_000
    (refused,) = _stats(core, b"reader", 400.0)
    assert refused[2]["limit"] == "unread_bytes_total"
    for i in range(300):  # as undeliverable(unreachable) does once a probe finds them gone
        core.undeliverable(f"deaf{i}".encode(), Message("PONG", {}), "unreachable")
    assert core.snapshot(401.0)["gauges"]["unread_bytes"] == len(Message("ERROR", refused[2]).encode()[1])
    (ans,) = _stats(core, b"reader", 401.0, refused[2]["ticket"])
    assert ans[1] == "STATS_REPLY"
    core.check_invariants()


def test_a_connection_with_unread_answers_is_probed_and_forgotten_once_it_has_gone():
    """A one-shot query tool never names its last ticket: its entry is probed with an unasked
    PONG 2, 4, 8 s after its last proof of reading; a probe the socket could not deliver
    (disconnected) forgets it and frees its bytes. A connection that keeps reading is never
    probed; one still connected but deaf is probed ever more rarely."""
    core = _core()
    (ans,) = _stats(core, b"gone", 0.0)
    ticket = None
    pongs: list[tuple[float, bytes]] = []
    for k in range(1, 40):
        now = k * 0.5
        reply = _stats(core, b"reader", now, ticket)
        ticket = reply[0][2]["ticket"]
        pongs += [(now, rid) for rid, verb, _ in _sent(core.tick(now, lambda c: True)) if verb == "PONG"]
    assert [t for t, rid in pongs if rid == b"gone"] == [PROBE_FIRST_S, 3 * PROBE_FIRST_S, 7 * PROBE_FIRST_S]
    assert all(rid == b"gone" for _, rid in pongs), "a reader is never probed"
    before = core.snapshot(20.0)["gauges"]
    assert before["unread_answers"] == 2
    core.undeliverable(b"gone", Message("PONG", {}), "full")  # connected, not reading: kept
    assert core.snapshot(20.0)["gauges"] == before
    core.undeliverable(b"gone", Message("PONG", {}), "unreachable")
    after = core.snapshot(20.0)["gauges"]
    assert after["unread_answers"] == 1  # the reader's latest only
    assert before["unread_bytes"] - after["unread_bytes"] == len(Message("STATS_REPLY", ans[2]).encode()[1])


def test_released_tokens_are_remembered_up_to_the_bound_oldest_forgotten_first():
    """Spec §6a: the broker remembers the latest released (and fenced) tokens, so that a second
    RELEASE of one is already_released; past the bound the oldest is forgotten (then unknown_token).
    A token noted twice is one entry: it must not push out a newer one."""
    r = _Recent(3)
    for k in ("t1", "t2", "t3", "t3", "t4"):
        r.add(k)
    assert len(r) == 3 and "t1" not in r, "the oldest is forgotten first, and only once the bound is passed"
    assert all(k in r for k in ("t2", "t3", "t4")), "a token noted twice pushed out a newer one"
    assert "t5" not in r and ("c0", "t2") not in r


def test_the_query_table_is_bounded_and_forgets_idle_connections_first():
    """16384 connections are remembered. When every one has unread answers, a new connection is
    not answered until a probe finds one of them gone; one with nothing unread (its answers read,
    its last query dropped by the rate budget) is forgotten to make room at once."""
    core = BrokerCore(host=HOST, timeout_s=TIMEOUT, query_bytes=1)  # every answer overdraws
    for i in range(MAX_QUERY_PEERS + 10):
        core.receive(f"q{i}".encode(), frames("CAPS", {"device": endpoint(9)}), 1.0)
    assert len(core.queries._waiting) == MAX_QUERY_PEERS and not core.queries._idle
    assert core.stats.answers_withheld == 10
    assert _stats(core, b"new", 1.0) == []
    core.undeliverable(b"q0", Message("PONG", {}), "unreachable")  # a probe found q0 gone
    (ans,) = _stats(core, b"new", 1.0)
    (err,) = _stats(core, b"new", 1.0, ans[2]["ticket"])  # budget spent: the ERROR is an answer too
    assert err[2]["limit"] == "query_bytes"
    assert _stats(core, b"new", 1.0, err[2]["ticket"]) == []  # read both; this one dropped: idle
    assert b"new" in core.queries._idle and len(core.queries._waiting) == MAX_QUERY_PEERS - 1
    assert _stats(core, b"newer", 1.0)  # the idle one made room
    assert b"new" not in core.queries._idle and len(core.queries._waiting) == MAX_QUERY_PEERS


def test_a_refused_handoffs_credit_is_matched_in_the_same_step():
    """A HANDOFF refused after its grant was taken gives the consumer's credit back to the front
    of the queue and matches it at once: the producer's READY carried on that very HANDOFF gets
    its GRANT in the broker's answer to it, not at a later tick (mutant refusal-rematch; the live
    channel would otherwise heal only when a recheck or the grant timeout comes round)."""
    import struct

    core = _core()
    _hello(core, b"p", "producer", pid=5)
    _hello(core, b"c", "consumer", pid=6, credits=1)
    (gid,) = _grant_ids(core.receive(b"p", frames("READY", {"credits": 1}), 0.0))
    bad_mode = struct.pack("<QIBB2s", 4096, 256, 0, 7, b"\0\0")  # sync_mode 7: bad_handle
    out = _sent(_handoff(core, gid, handle=bad_mode, ready=1))
    assert sorted((rid, verb) for rid, verb, _ in out) == [(b"p", "ERROR"), (b"p", "GRANT")], out
    assert next(h for _, verb, h in out if verb == "ERROR")["code"] == "bad_handle"
    core.check_invariants()


def test_the_core_draws_all_its_randomness_from_the_entropy_it_is_given():
    """Sessions, route keys, grant ids, delivery tokens and query tickets all come from one
    injected source: two cores given the same bytes answer the same messages identically, so any
    interleaving a test finds can be replayed exactly."""
    import random

    def run() -> list[tuple[bytes, str, dict]]:
        rng = random.Random(7)
        core = BrokerCore(host=HOST, timeout_s=TIMEOUT, entropy=rng.randbytes)
        out = [(b"", "SESSION", {"session": core.session, "route_key": core.route_key})]
        out += _sent(core.receive(b"q", frames("STATS", {}), 0.0))
        _hello(core, b"p", "producer", pid=5)
        _hello(core, b"c", "consumer", pid=6, credits=2)
        for _ in range(2):
            granted = core.receive(b"p", frames("READY", {"credits": 1}), 0.0)
            out += _sent(granted)  # the GRANT's id
            (gid,) = _grant_ids(granted)
            out += _sent(_handoff(core, gid, 0.0))  # the DELIVER's token
        return [(rid, verb, {k: v for k, v in h.items() if k not in ("broker", "rates")}) for rid, verb, h in out]

    first, second = run(), run()
    assert first == second
    assert first[0][2]["session"] != BrokerCore(host=HOST).session  # the OS's entropy by default


def _unmap(core: BrokerCore, request: int, now: float, *named: bytes) -> list:
    return _sent(core.receive(b"p", frames("UNMAP", {"request": request, "consumers": [BrokerCore.label_of(c)
                                                                                        for c in named]}, b"M" * 64),
                              now))


def test_a_live_consumer_dropped_silent_holding_nothing_is_proven_gone_by_its_bye():
    """Spec §4.10 step 4: a consumer whose process lives (its lease) but which fell silent past the
    timeout holding nothing is deregistered without proof, so an UNMAP naming it awaits it
    unregistered, and so does a round that had asked it while it was registered. If it then says
    BYE (the library closes its idle kept mappings first) with no HELLO between, it is gone: the
    rounds answer at once, and later rounds count it gone too. A consumer that registered again is
    asked as any other."""
    core = _core()
    _hello(core, b"p", "producer", pid=5)
    _hello(core, b"c", "consumer", pid=6, kept_mappings=True)
    assert _unmap(core, 1, 0.0, b"c") == [(b"c", "UNMAP", {"request": 1, "producer_id": "p"})]
    core.receive(b"p", frames("PING", {}), TIMEOUT + 0.1)  # the producer is not silent
    assert _sent(core.tick(TIMEOUT + 0.1, lambda c: True)) == []  # round 1 awaits it unregistered now
    assert b"c" not in core.clients  # silent, holding nothing: dropped although alive
    assert _unmap(core, 2, TIMEOUT + 0.2, b"c") == []  # awaited unregistered
    core.check_invariants()
    gone = {"unmapped": [], "gone": [BrokerCore.label_of(b"c")], "fenced": []}
    assert _sent(core.receive(b"c", frames("BYE", {}), TIMEOUT + 0.3)) == [
        (b"p", "UNMAPPED", {"request": 1, **gone}), (b"p", "UNMAPPED", {"request": 2, **gone})]
    assert _unmap(core, 3, TIMEOUT + 0.4, b"c") == [
        (b"p", "UNMAPPED", {"request": 3, "unmapped": [], "gone": [BrokerCore.label_of(b"c")], "fenced": []})]
    assert not core.left_unproven
    core.check_invariants()
    # Dropped silent again after a new registration, it registers once more before its BYE: that
    # HELLO ends what the drop left; the BYE is an ordinary one (holding nothing: gone).
    _hello(core, b"c", "consumer", pid=6, kept_mappings=True)
    core.receive(b"p", frames("PING", {}), 3 * TIMEOUT)
    core.tick(3 * TIMEOUT, lambda c: True)
    assert b"c" in core.left_unproven
    _hello(core, b"c", "consumer", pid=6, kept_mappings=True)
    assert b"c" not in core.left_unproven
    core.check_invariants()
