"""Protocol v2's batching and message-saving rules (docs/spec/ipc-protocol.md §2.2, §4.6, §4.7),
each beside what breaking it would look like: credits of a batch add up, entries of a batch are
answered one by one, a consumer's endpoint travels once per pairing, ACCEPTED only on request,
coalescing never reorders what a client depends on, and a consumer holds releases only while
more deliveries are queued."""

from __future__ import annotations

import gc
import json
import struct
import threading
import weakref

import hypothesis.strategies as st
import pytest
from hypothesis import given, settings

from hurray_ipc.broker.core import BrokerCore, Send
from hurray_ipc.devices.base import host_id
from hurray_ipc.wire.ipc import (
    MAX_BATCH,
    MAX_BUNDLE,
    Message,
    ProtocolError,
    bundle,
    coalesce,
    decode_all,
    encode_batch,
    encode_group,
    wire_verb,
)

HOST = host_id()
TOKEN = "11" * 8 + "22" * 16


def _ep(pid: int) -> dict:
    return {"device": {"kind": "cpu", "ordinal": 0, "uuid": "cpu-b", "pci_bus_id": "", "emulated": False,
                       "host": HOST},
            "caps": {"ipc_memory": True, "ipc_events": False, "ipc_streams": False, "peers": []},
            "pid": pid, "stream": None}


def _hello(core: BrokerCore, rid: bytes, role: str, pid: int, **extra: object) -> list:
    h = {"protocol": 2, "role": role, "channel": "b", "pid": pid, "endpoint": _ep(pid), **extra}
    return core.receive(rid, [b"HELLO", json.dumps(h).encode()], 0.0)


def _to(outs: list, rid: bytes) -> list[Message]:
    return [o.msg for o in outs if isinstance(o, Send) and o.rid == rid]


def _handle(size: int = 64) -> bytes:
    return struct.pack("<QIBB2s", size, 256, 0, 0, b"\0\0")


def test_batch_credits_add_up():
    """Two releases that each ask for buffers, sent as one message, ask for both (a decoder that
    kept one entry's credits would starve the consumer)."""
    frames = encode_batch([Message("RELEASE", {"token": TOKEN, "credits": 1}),
                           Message("RELEASE", {"token": TOKEN, "credits": 2})])
    assert struct.unpack_from("<HHI", frames[1]) == (2, 3, 0)
    msgs = decode_all(frames)
    assert "credits" not in msgs[0].fields() and msgs[-1].fields()["credits"] == 3


def test_batch_frames_must_add_up_exactly():
    ok = encode_batch([Message("HANDOFF", {"grant_id": 1, "handoff_id": 1, "offset": 0},
                               {"handle": _handle(), "memory": b"M" * 64})])
    with pytest.raises(ProtocolError) as e:
        decode_all(ok + [b"extra"])
    assert e.value.code == "bad_frames"
    with pytest.raises(ProtocolError) as e:
        decode_all(ok[:-1])
    assert e.value.code == "bad_frames"
    head = bytearray(ok[1])
    head[0:2] = struct.pack("<H", MAX_BATCH + 1)
    with pytest.raises(ProtocolError) as e:
        decode_all([ok[0], bytes(head), *ok[2:]])
    assert e.value.code == "bad_header" and e.value.extra["field"] == "count"


def _world() -> tuple[BrokerCore, int]:
    core = BrokerCore(host=HOST)
    _hello(core, b"p", "producer", 100)
    _hello(core, b"c", "consumer", 200)
    core.receive(b"c", [b"REQUEST", b'{"credits": 3}'], 0.0)
    outs = core.receive(b"p", [b"READY", b'{"credits": 3}'], 0.0)
    return core, [m.fields()["grant_id"] for m in _to(outs, b"p")]


def test_each_entry_of_a_batch_is_answered_on_its_own():
    """A bad entry in the middle costs that entry alone: the others are delivered, in order, and
    the refusal names the bad entry's handoff id."""
    core, gids = _world()
    entries = [Message("HANDOFF", {"grant_id": gids[0], "handoff_id": 1, "offset": 0},
                       {"handle": _handle(), "memory": b"M" * 64}),
               Message("HANDOFF", {"grant_id": 999, "handoff_id": 2, "offset": 0},
                       {"handle": _handle(), "memory": b"M" * 64}),
               Message("HANDOFF", {"grant_id": gids[2], "handoff_id": 3, "offset": 0, "ack": True},
                       {"handle": _handle(), "memory": b"M" * 64})]
    outs = core.receive(b"p", encode_batch(entries), 0.0)
    assert [(m.verb, m.fields()["handoff_id"]) for m in _to(outs, b"c")] == [("DELIVER", 1), ("DELIVER", 3)]
    to_p = _to(outs, b"p")
    assert [(m.verb, m.fields().get("handoff_id")) for m in to_p] == [("ERROR", 2), ("ACCEPTED", 3)]
    assert to_p[0].fields()["code"] == "unknown_grant"
    core.check_invariants()


def test_accepted_only_when_asked():
    core, gids = _world()
    for hid, ack in ((1, False), (2, True)):
        outs = core.receive(b"p", Message("HANDOFF", {"grant_id": gids[hid], "handoff_id": hid, "offset": 0,
                                                      "ack": ack},
                                          {"handle": _handle(), "memory": b"M" * 64}).encode(), 0.0)
        assert [m.verb for m in _to(outs, b"p")] == ([] if not ack else ["ACCEPTED"])
        assert [m.verb for m in _to(outs, b"c")] == ["DELIVER"]


def test_consumer_endpoint_travels_once_per_pairing():
    """The first GRANT of a pairing carries the consumer's endpoint, later ones do not; after
    either side registers again, the next GRANT carries it again (the producer forgot it)."""
    core, _ = _world()

    def grants() -> list[bool]:
        core.receive(b"c", [b"REQUEST", b'{"credits": 2}'], 0.0)
        outs = core.receive(b"p", [b"READY", b'{"credits": 2}'], 0.0)
        return ["consumer" in m.fields() for m in _to(outs, b"p") if m.verb == "GRANT"]

    core2, gids = BrokerCore(host=HOST), None
    _hello(core2, b"p", "producer", 100)
    _hello(core2, b"c", "consumer", 200)
    core2.receive(b"c", [b"REQUEST", b'{"credits": 2}'], 0.0)
    outs = core2.receive(b"p", [b"READY", b'{"credits": 2}'], 0.0)
    gids = [("consumer" in m.fields()) for m in _to(outs, b"p")]
    assert gids == [True, False]
    assert grants() == [False, False]  # the world's three grants already sent it
    _hello(core, b"c", "consumer", 200)  # the consumer registers again
    assert grants() == [True, False]
    _hello(core, b"p", "producer", 100)  # the producer registers again
    assert grants() == [True, False]


hot = st.sampled_from(["GRANT", "RELEASED", "EVENT_RELEASED", "ACCEPTED", "DELIVER"])
cold = st.sampled_from(["ERROR", "PRODUCER_GONE", "PONG"])


@settings(max_examples=300, derandomize=True, deadline=None)
@given(st.lists(st.one_of(hot, cold), max_size=200))
def test_coalesce_keeps_what_clients_depend_on(verbs):
    """Flattened batches hold every message once; messages of one wire verb keep their order; a
    JSON message is never moved across a hot one; no batch exceeds MAX_BATCH or mixes verbs."""
    msgs = [Message(v, {"i": i}) for i, v in enumerate(verbs)]
    groups = coalesce(msgs)
    flat = [m for g in groups for m in g]
    assert sorted(m.fields()["i"] for m in flat) == list(range(len(msgs)))
    for g in groups:
        assert 1 <= len(g) <= MAX_BATCH and len({wire_verb(m.verb) for m in g}) == 1
    pos = {m.fields()["i"]: k for k, m in enumerate(flat)}
    for a in msgs:
        for b in msgs:
            if a.fields()["i"] < b.fields()["i"] and (
                    wire_verb(a.verb) == wire_verb(b.verb) or a.verb in ("ERROR", "PRODUCER_GONE", "PONG")
                    or b.verb in ("ERROR", "PRODUCER_GONE", "PONG")):
                assert pos[a.fields()["i"]] < pos[b.fields()["i"]], (a, b)


@settings(max_examples=300, derandomize=True, deadline=None)
@given(st.lists(st.one_of(hot, cold), max_size=300))
def test_bundles_are_the_batches_in_order_and_never_hold_json(verbs):
    """bundle() over coalesce()'s batches (spec §2.2a): every batch once, in the same order; a JSON
    message alone in its parcel; at most MAX_BUNDLE batches in a bundle; a hot batch after a
    hot one shares its bundle while there is room (so RELEASED and GRANT travel together)."""
    groups = coalesce([Message(v, {"i": i}) for i, v in enumerate(verbs)])
    parcels = bundle(groups)
    assert [g for p in parcels for g in p] == groups
    for p in parcels:
        assert 1 <= len(p) <= MAX_BUNDLE
        if any(wire_verb(g[0].verb) not in ("DELIVER", "GRANT", "RELEASED", "ACCEPTED") for g in p):
            assert len(p) == 1, p
    for a, b in zip(parcels, parcels[1:], strict=False):
        hot_pair = all(wire_verb(g[0].verb) in ("DELIVER", "GRANT", "RELEASED", "ACCEPTED") for g in (a[-1], b[0]))
        assert not (hot_pair and len(a) < MAX_BUNDLE), "two hot batches in a row were sent apart"


def _bundle_frames(*groups: list[Message]) -> list[bytes]:
    return [f for g in groups for f in encode_group(g)]


def test_a_bundle_decodes_as_its_messages_one_after_another_and_only_when_asked():
    released = [Message("RELEASED", {"handoff_id": 1, "reason": "rejected: meta"}),
                Message("EVENT_RELEASED", {"handoff_id": 2})]
    grant = [Message("GRANT", {"grant_id": 7, "epoch": 1, "consumer_id": "00" * 8, "consumer": _ep(5)})]
    accepted = [Message("ACCEPTED", {"handoff_id": 3})]
    frames = _bundle_frames(released, grant, accepted)
    alone = [m for g in (released, grant, accepted) for m in decode_all(encode_group(g))]
    assert decode_all(frames, bundles=True) == alone
    assert [m.verb for m in alone] == ["RELEASED", "EVENT_RELEASED", "GRANT", "ACCEPTED"]
    # A reader that did not ask for bundles (the broker reading a client, a client without
    # ``bundles``) refuses the frames after the first message's, as §2.2 says.
    with pytest.raises(ProtocolError) as e:
        decode_all(frames)
    assert e.value.code == "bad_frames"
    # A lone message reads the same either way.
    assert decode_all(encode_group(grant), bundles=True) == decode_all(encode_group(grant))


def test_a_bundle_past_its_limit_or_with_a_json_part_is_malformed_as_a_whole():
    accepted = [Message("ACCEPTED", {"handoff_id": 3})]
    assert len(decode_all(_bundle_frames(*[accepted] * MAX_BUNDLE), bundles=True)) == MAX_BUNDLE
    for frames, code in [(_bundle_frames(*[accepted] * (MAX_BUNDLE + 1)), "bad_frames"),
                         (_bundle_frames(accepted) + [b"PONG", b"{}"], "bad_frames"),
                         (_bundle_frames(accepted) + [b"GRANT"], "bad_frames"),
                         (_bundle_frames(accepted) + [b"GRANT", b"\1\0\0\0\0\0\0\0"], "bad_header")]:
        with pytest.raises(ProtocolError) as e:
            decode_all(frames, bundles=True)
        assert e.value.code == code, frames


_PARTS = [[Message("RELEASED", {"handoff_id": 1, "reason": "rejected: meta"}),
           Message("EVENT_RELEASED", {"handoff_id": 2})],
          [Message("GRANT", {"grant_id": 7, "epoch": 1, "consumer_id": "00" * 8, "consumer": {"pid": 5}})],
          [Message("ACCEPTED", {"handoff_id": 3}), Message("ACCEPTED", {"handoff_id": 4})],
          [Message("DELIVER", {"token": TOKEN, "handoff_id": 9, "producer_id": "p", "offset": 64},
                   {"handle": bytes(16), "memory": bytes(64)})]]


@settings(max_examples=400, derandomize=True, deadline=None)
@given(st.lists(st.sampled_from(range(len(_PARTS))), min_size=1, max_size=5),
       st.lists(st.tuples(st.sampled_from(["cut", "flip", "drop", "insert"]), st.integers(0, 10 ** 6),
                          st.binary(max_size=12)), max_size=3))
def test_a_damaged_bundle_is_refused_with_a_protocol_error_never_another(picks, damage):
    """What a client's pump catches is ProtocolError (client/session.py): any other exception
    from decoding a broker message would end the pump. Bundles of real parts, then cut short,
    a byte flipped, a frame dropped or one inserted: decoded, or refused as ProtocolError."""
    from hurray_ipc.wire.ipc import BROKER_VERBS

    frames = _bundle_frames(*[_PARTS[i] for i in picks])
    for what, at, data in damage:
        i = at % len(frames)
        if what == "cut":
            frames = frames[:max(1, i)]
        elif what == "flip" and frames[i]:
            f = bytearray(frames[i])
            f[at % len(f)] ^= 0xFF
            frames[i] = bytes(f)
        elif what == "drop" and len(frames) > 1:
            del frames[i]
        elif what == "insert":
            frames.insert(i, data)
    try:
        decode_all(frames, allowed=BROKER_VERBS, bundles=True)
    except ProtocolError:
        pass


def test_bundles_follow_the_latest_accepted_hello():
    """Spec §2.2a: the broker may bundle to a client whose latest accepted HELLO said so; a
    HELLO without the field turns it off, a refused one changes nothing."""
    core = BrokerCore(host=HOST)
    _hello(core, b"p", "producer", 100, bundles=True)
    assert core.reads_bundles(b"p")
    refused = _hello(core, b"p", "consumer", 100)  # a registered client cannot change its role
    assert [m.verb for m in _to(refused, b"p")] == ["ERROR"] and core.reads_bundles(b"p")
    _hello(core, b"p", "producer", 100)
    assert not core.reads_bundles(b"p") and not core.reads_bundles(b"nobody")


def test_a_bundle_that_cannot_leave_is_undeliverable_part_by_part_and_a_bad_part_costs_itself(monkeypatch):
    """The broker loop's two failures (broker/server.py): a bundle the socket refuses (a full
    queue) costs each of its messages, counted once each, nothing sent; a part that cannot be
    encoded costs that part alone, and the rest still leaves as one message."""
    import zmq

    from hurray_ipc.broker import server

    b = server.Broker("tcp://127.0.0.1:*")
    try:
        core = b.core
        _hello(core, b"p", "producer", 100, bundles=True)
        _hello(core, b"c", "consumer", 200)
        tokens = []
        for hid in (1, 2):
            core.receive(b"c", [b"REQUEST", b'{"credits": 1}'], 0.0)
            (gid,) = [m.grant_id for m in _to(core.receive(b"p", [b"READY", b'{"credits": 1}'], 0.0), b"p")]
            outs = core.receive(b"p", Message("HANDOFF", {"grant_id": gid, "handoff_id": hid, "offset": 0},
                                              {"handle": _handle(), "memory": b"M" * 64}).encode(), 0.0)
            tokens += [m.token for m in _to(outs, b"c")]
        core.receive(b"p", [b"READY", b'{"credits": 2}'], 0.0)
        sent: list[list[bytes]] = []

        def full(sock: object, frames: list[bytes], flags: int = 0) -> None:
            if frames[0] == b"p":
                raise zmq.Again()
            sent.append(list(frames))

        monkeypatch.setattr(server, "send_frames", full)
        before = core.stats.wire_out
        b._apply(core.receive(b"c", encode_batch([Message("RELEASE", {"token": tokens[0], "credits": 1})]), 0.0))
        assert (core.stats.dropped_full, sent, core.stats.wire_out) == (2, [], before)  # RELEASED and GRANT

        def no_grants(group: list) -> list[bytes]:
            if group[0].verb == "GRANT":
                raise ValueError("a bug in the GRANT encoder")
            return encode_group(group)

        monkeypatch.setattr(server, "send_frames", lambda sock, frames, flags=0: sent.append(list(frames)))
        monkeypatch.setattr(server, "encode_group", no_grants)
        b._apply(core.receive(b"c", encode_batch([Message("RELEASE", {"token": tokens[1], "credits": 1})]), 0.0))
        assert [f[:2] for f in sent] == [[b"p", b"RELEASED"]] and core.stats.undeliverable == 1
        assert [m.verb for m in decode_all(sent[0][1:], bundles=True)] == ["RELEASED"]
        assert core.stats.wire_out == before + 1
    finally:
        b.shutdown("test over")


def test_received_handoff_is_freed_without_the_garbage_collector(broker):
    """No reference cycle per handoff: with the collector off, a released handoff dies by
    refcount the moment its last reference goes."""
    from hurray_ipc.client import Consumer, Producer

    with Producer(broker.endpoint, "nocycle") as p, Consumer(broker.endpoint, "nocycle") as c:
        buf = p.allocate(64)
        th = threading.Thread(target=p.send, args=(buf,), kwargs={"block": False, "timeout": 10})
        th.start()  # the consumer asks at its first receive()
        h = c.receive(timeout=10)
        th.join(10)
        _ = h.buffer.numpy()  # the buffer object exists and refers to its handoff
        h.release()
        gc.collect()
        gc.disable()
        try:
            ref = weakref.ref(h)
            del h, _
            assert ref() is None, gc.get_referrers(ref())
        finally:
            gc.enable()
        p.flush(10)


def test_consumer_holds_releases_only_while_deliveries_are_queued(broker):
    """Releases made while more deliveries wait in the inbox are held and leave together when the
    last queued one is taken; a release with nothing queued leaves at once (no timer involved)."""
    from hurray_ipc.client import Consumer, Producer

    with Producer(broker.endpoint, "hold", prefetch=4) as p, Consumer(broker.endpoint, "hold", prefetch=4) as c:
        bufs = [p.allocate(64) for _ in range(3)]
        th = threading.Thread(target=lambda: [p.send(b, block=False, timeout=10) for b in bufs])
        th.start()  # the consumer asks at its first receive()
        first = c.receive(timeout=10)
        th.join(10)
        c.session.pump(lambda: len(c._inbox) == 2, 10, "deliveries")
        with c.session.lock:  # the background pump must not flush between our steps
            first.release()
            assert [m.verb for m in c.session._outbox] == ["RELEASE"], "held: two deliveries still queued"
            second = c.receive(timeout=10)
            second.release()
            assert len(c.session._outbox) == 2
            third = c.receive(timeout=10)  # takes the last queued delivery: the held ones leave now
            assert c.session._outbox == []
            third.release()  # nothing queued: leaves at once
            assert c.session._outbox == []
        p.flush(10)


def test_send_many_batches_what_the_grants_allow(broker):
    """send_many sends every handoff it has a grant for in one HANDOFF message, hands each object
    back through its ticket, and keeps a grant it could not use for the next send."""
    from hurray_ipc.client import Consumer, Producer

    with Producer(broker.endpoint, "many", prefetch=4) as p, Consumer(broker.endpoint, "many", prefetch=4) as c:
        c.session.send(Message("REQUEST", {"credits": 4}))
        c.credits.ask(4)
        p.session.send(Message("READY", {"credits": 4}))
        p.credits.ask(4)
        p.session.pump(lambda: len(p.grants) == 4, 10, "grants")
        bufs = [p.allocate(64) for _ in range(3)]
        back: list = []
        before = p.session.messages_sent
        tickets = p.send_many(bufs, on_release=back.append)
        assert p.session.messages_sent - before == 1, "three handoffs, one message"
        assert [t.obj for t in tickets] == bufs and len(p.grants) == 1, "the fourth grant is kept"
        got = [c.receive(timeout=10) for _ in range(3)]
        assert sorted(h.handoff_id for h in got) == sorted(t.handoff_id for t in tickets)
        for h in got:
            h.release()
        p.flush(10)
        assert sorted(id(t.obj) for t in back) == sorted(id(b) for b in bufs)
        real = p._prepare

        def fail(*a, **k):
            raise RuntimeError("injected: the producer obligation failed")

        p._prepare = fail  # type: ignore[method-assign]
        p.session.pump(lambda: len(p.grants) > 0, 10, "a grant")
        with p.session.lock:  # no pump between the two counts
            held = len(p.grants)
            with pytest.raises(RuntimeError):
                p.send_many([bufs[0]])
            assert len(p.grants) == held, "a grant that was not used is kept for the next send"
        p._prepare = real  # type: ignore[method-assign]
        p.send(bufs[0], block=False)
        c.receive(timeout=10).release()
        p.flush(10)


def test_release_credits_apply_even_when_the_release_is_refused():
    """A batch carries its REQUEST on its last entry; if that entry is refused the consumer has
    still counted the credits as asked, so the broker applies them (else it would starve)."""
    core, _ = _world()  # c asked for 3, p was granted 3: c has no credits queued
    assert core.clients[b"c"].credits == 0
    outs = core.receive(b"c", encode_batch([Message("RELEASE", {"token": "ee" * 24, "credits": 2})]), 0.0)
    assert [m.fields()["code"] for m in _to(outs, b"c")] == ["unknown_token"]
    assert core.clients[b"c"].credits == 2
    core.check_invariants()


def test_credits_on_an_event_release_last_in_its_batch_are_applied():
    """A batch whose last entry is an EVENT_RELEASE carries the batch's credits on it; the broker
    dropped them (refused entry or not), and the consumer waited for buffers it never got."""
    core, _ = _world()
    outs = core.receive(b"c", encode_batch([Message("RELEASE", {"token": "ee" * 24}),
                                            Message("EVENT_RELEASE", {"token": "ee" * 24, "credits": 2})]), 0.0)
    assert [m.fields()["code"] for m in _to(outs, b"c")] == ["unknown_token", "unknown_token"]
    assert core.clients[b"c"].credits == 2
    core.check_invariants()


def test_a_lone_surrogate_in_a_name_is_sent_escaped():
    """JSON lets a client put "\\ud800" in a string; echoing it (CAPS_REPLY names consumers) must
    not fail to encode, or one client's name would stop the broker's sends."""
    core = BrokerCore(host=HOST)
    h = {"protocol": 2, "role": "consumer", "channel": "b", "pid": 200, "endpoint": _ep(200), "name": "\ud800x"}
    core.receive(b"c", [b"HELLO", json.dumps(h).encode()], 0.0)
    outs = core.receive(b"q", [b"CAPS", json.dumps({"device": _ep(300), "channel": "b"}).encode()], 0.0)
    (reply,) = _to(outs, b"q")
    frames = reply.encode()
    assert json.loads(frames[1])["consumers"][0]["name"] == "\ud800x"


def test_the_binary_layouts_are_the_hot_verbs():
    """HOT_VERBS (the spec's §2.2 list) and the binary layouts the codec has are one set: a hot
    verb without a layout, or a layout the verb table does not call hot, is a codec bug."""
    from hurray_ipc.wire import ipc as protocol

    assert set(protocol._LAYOUTS) == protocol.HOT_VERBS
    assert {protocol.wire_verb(v) for v in protocol.HOT_VERBS} == protocol._HOT_WIRE
