"""Speak the broker protocol with raw pyzmq frames written from docs/spec/ipc-protocol.md, not
through the library; and feed the broker bad input, checking that every other client keeps working."""

from __future__ import annotations

import json
import os
import struct

import pytest
import zmq

from brokerproc import BrokerProcess
from hurray_ipc.client.query import Tickets
from hurray_ipc.devices.base import host_id

HOST = host_id()


def endpoint_dict(pid, kind="cpu", ipc_events=False, uuid=None):
    return {"device": {"kind": kind, "ordinal": 0, "uuid": uuid or f"{kind}-test", "pci_bus_id": "",
                       "emulated": kind != "cpu", "host": HOST},
            "caps": {"ipc_memory": True, "ipc_events": ipc_events, "ipc_streams": False, "peers": []},
            "pid": pid, "stream": None}


def handle(size, tag, mode, align=256, reserved=b"\0\0"):
    return struct.pack("<QIBB2s", size, align, tag, mode, reserved)


# The binary hot verbs of protocol v2, packed here from docs/spec/ipc-protocol.md §2.2 with
# struct alone (not through the library): a stranger's implementation.
BATCH = struct.Struct("<HHI")
HANDOFF = struct.Struct("<QQQH6x")
DELIVER = struct.Struct("<24sQQHB5x32s")
RELEASE = struct.Struct("<24sBB6x")
RELEASED = struct.Struct("<QBB6x")
GRANT = struct.Struct("<QIH2x8s")
ACCEPTED = struct.Struct("<Q")
FLAG_BITS = [(0x01, "memory"), (0x02, "event"), (0x04, "ref"), (0x08, "meta")]


def pack_hot(verb, header, frames):
    """[verb, header, frames...] of a one-entry binary message."""
    if verb == "HANDOFF":
        flags = [0, 0x01, 0x03][len(frames) - 1] | (0x20 if header.get("ack") else 0)
        flags |= 0x40 if header.get("keep") else 0
        if "meta" in header:
            flags |= 0x08
            frames = [*frames, json.dumps(header["meta"]).encode()]
        entry = HANDOFF.pack(header["grant_id"], header["handoff_id"], header.get("offset", 0), flags)
        return [b"HANDOFF", BATCH.pack(1, header.get("ready", 0), 0) + entry, *frames]
    if verb in ("RELEASE", "EVENT_RELEASE"):
        reason = header.get("reason")
        entry = RELEASE.pack(bytes.fromhex(header["token"]), 2 if verb == "EVENT_RELEASE" else 1,
                             1 if reason is not None else 0)
        return [b"RELEASE", BATCH.pack(1, header.get("credits", 0), 0) + entry,
                *([reason.encode()] if reason is not None else [])]
    raise AssertionError(verb)


def unpack_hot(parts):
    """The entries of a binary broker message: [(verb, fields, frames)]."""
    out, rest = unpack_part(parts)
    assert not rest, "every frame belongs to an entry"
    return out


def unpack_bundle(parts):
    """The parts of a bundle (§2.2a), each as unpack_hot gives a message's entries."""
    out, rest = [], list(parts)
    while rest:
        assert rest[0] in (b"DELIVER", b"GRANT", b"RELEASED", b"ACCEPTED") and len(rest) >= 2, rest[:1]
        entries, rest = unpack_part(rest)
        out.append(entries)
    assert 1 <= len(out) <= 16
    return out


def unpack_part(parts):
    """The entries of the binary message that starts at parts[0], and the frames after it."""
    verb, head, rest = parts[0].decode(), parts[1], list(parts[2:])
    count, credits, reserved = BATCH.unpack_from(head)
    assert len(head) == 8 + count * {"DELIVER": DELIVER, "GRANT": GRANT, "RELEASED": RELEASED,
                                     "ACCEPTED": ACCEPTED}[verb].size
    assert reserved == 0 and credits == 0
    out = []
    for i in range(count):
        if verb == "DELIVER":
            token, hid, offset, flags, plen, pid = DELIVER.unpack_from(head, 8 + i * DELIVER.size)
            f = {"token": token.hex(), "handoff_id": hid, "offset": offset, "producer_id": pid[:plen].decode(),
                 "staged": bool(flags & 0x10)}
            frames = [rest.pop(0)]
            for bit, name in FLAG_BITS:
                if flags & bit:
                    data = rest.pop(0)
                    if name == "meta":
                        f["meta"] = json.loads(data)
                    elif name == "ref":
                        f["inproc_ref"] = data.decode()
                    else:
                        frames.append(data)
            out.append(("DELIVER", f, frames))
        elif verb == "GRANT":
            gid, epoch, flags, label = GRANT.unpack_from(head, 8 + i * GRANT.size)
            f = {"grant_id": gid, "epoch": epoch, "consumer_id": label.hex()}
            if flags & 1:
                f["consumer"] = json.loads(rest.pop(0))
            out.append(("GRANT", f, []))
        elif verb == "RELEASED":
            hid, kind, reason = RELEASED.unpack_from(head, 8 + i * RELEASED.size)
            text = {0: "released", 1: "consumer_gone"}.get(reason) or rest.pop(0).decode()
            out.append(({1: "RELEASED", 2: "EVENT_RELEASED"}[kind], {"handoff_id": hid, "reason": text}, []))
        elif verb == "ACCEPTED":
            out.append(("ACCEPTED", {"handoff_id": ACCEPTED.unpack_from(head, 8 + 8 * i)[0]}, []))
        else:
            raise AssertionError(verb)
    return out, rest


class Raw:
    def __init__(self, ctx, ep, ident):
        self.s = ctx.socket(zmq.DEALER)
        self.s.setsockopt(zmq.IDENTITY, ident.encode())
        self.s.setsockopt(zmq.LINGER, 0)
        self.s.connect(ep)
        self.pending = []
        self.tickets = Tickets()  # the next query names the latest answer read (spec §6a)

    def send(self, verb, header=None, *frames):
        if verb in ("HANDOFF", "RELEASE", "EVENT_RELEASE") and not isinstance(header, bytes):
            self.s.send_multipart(pack_hot(verb, header, list(frames)))
            return
        if verb in ("CAPS", "STATS") and isinstance(header, dict):
            header = self.tickets.stamp(header)
        body = header if isinstance(header, bytes) else json.dumps(header or {}).encode()
        self.s.send_multipart([verb if isinstance(verb, bytes) else verb.encode(), body, *frames])

    def recv(self, timeout=5000):
        if not self.pending:
            assert self.s.poll(timeout), "no reply from broker"
            parts = self.s.recv_multipart()
            if parts[0] in (b"DELIVER", b"GRANT", b"RELEASED", b"ACCEPTED"):
                self.pending = unpack_hot(parts)
            else:
                self.pending = [(parts[0].decode(), json.loads(parts[1]), parts[2:])]
                self.tickets.read(self.pending[0][1])
        return self.pending.pop(0)

    def expect(self, verb, timeout=5000):
        while True:
            v, h, f = self.recv(timeout)
            if v != "PONG":
                assert v == verb, (v, h)
                return h, f

    def hello(self, role, channel, ep):
        self.send("HELLO", {"protocol": 2, "role": role, "channel": channel, "client_id": "x", "pid": ep["pid"],
                            "endpoint": ep})
        h, _ = self.expect("WELCOME")
        assert h["protocol"] == 2
        return h


@pytest.fixture
def env(tmp_path):
    b = BrokerProcess(f"ipc://{tmp_path}/b.sock", timeout=30).start()
    ctx = zmq.Context()
    yield b, ctx
    ctx.destroy(linger=0)
    b.stop()


def one_handoff(prod, cons, frames_mem=b"M" * 64, offset=0):
    cons.send("REQUEST", {"credits": 1})
    prod.send("READY", {"credits": 1})
    g, _ = prod.expect("GRANT")
    # The consumer's endpoint travels with the first GRANT of a pairing only.
    assert "consumer" not in g or g["consumer"]["pid"] == os.getpid()
    hid = g["grant_id"] * 10
    hd = handle(4096, 0, 0)
    prod.send("HANDOFF", {"grant_id": g["grant_id"], "handoff_id": hid, "offset": offset, "ack": True}, hd,
              frames_mem)
    d, frames = cons.expect("DELIVER")
    assert frames == [hd, frames_mem], "handle verbatim in its own frame, blob in another"
    assert d["offset"] == offset and d["handoff_id"] == hid and len(d["token"]) == 48
    a, _ = prod.expect("ACCEPTED")
    assert a["handoff_id"] == hid
    return d["token"], hid


def test_raw_protocol_roundtrip_and_bad_input(env):
    b, ctx = env
    prod, cons, other = Raw(ctx, b.endpoint, "p1"), Raw(ctx, b.endpoint, "c1"), Raw(ctx, b.endpoint, "c2")
    prod.hello("producer", "raw", endpoint_dict(os.getppid()))
    cons.hello("consumer", "raw", endpoint_dict(os.getpid()))
    other.hello("consumer", "other-channel", endpoint_dict(os.getpid()))

    token, hid = one_handoff(prod, cons)
    cons.send("RELEASE", {"token": token})
    r, _ = prod.expect("RELEASED")
    assert r["handoff_id"] == hid

    # releases: twice, foreign, unknown
    cons.send("RELEASE", {"token": token})
    assert cons.expect("ERROR")[0]["code"] == "already_released"
    token2, hid2 = one_handoff(prod, cons)
    other.send("RELEASE", {"token": token2})
    assert other.expect("ERROR")[0]["code"] == "foreign_token"
    cons.send("RELEASE", {"token": "ab" * 24})
    assert cons.expect("ERROR")[0]["code"] == "unknown_token"

    # malformed messages
    stranger = Raw(ctx, b.endpoint, "s1")
    stranger.s.send_multipart([b"\xff"])
    assert stranger.expect("ERROR")[0]["code"] == "bad_frames"
    stranger.send(b"NOPE", {})
    assert stranger.expect("ERROR")[0]["code"] == "unknown_verb"
    stranger.send("REQUEST", b"{not json")
    assert stranger.expect("ERROR")[0]["code"] == "bad_header"
    stranger.send("REQUEST", {"credits": 1})
    assert stranger.expect("ERROR")[0]["code"] == "not_registered"
    stranger.send("HELLO", {"protocol": 99, "role": "consumer", "channel": "raw", "endpoint": endpoint_dict(1)})
    assert stranger.expect("ERROR")[0]["code"] == "protocol_version"
    cons.send("READY", {"credits": 1})
    assert cons.expect("ERROR")[0]["code"] == "wrong_role"
    cons.send("REQUEST", {"credits": True})
    assert cons.expect("ERROR")[0]["code"] == "bad_header"

    # bad handoffs: each rejected with a reason; the consumer's request is not lost
    cons.send("REQUEST", {"credits": 1})
    g = None
    for hd, frames, code, reason in [
        (handle(64, 1, 0xFF), [b"M" * 64], "bad_handle", "sync_mode_invalid"),
        (handle(64, 0, 1), [b"M" * 64], "bad_handle", "cpu_sync_mode"),
        (handle(64, 0, 0, reserved=b"\1\0"), [b"M" * 64], "bad_handle", "reserved_nonzero"),
        (handle(64, 0, 0), [b"short"], "bad_frames", None),
        (handle(64, 0, 0), [], "payload_mismatch", None),
    ]:
        if g is None:
            prod.send("READY", {"credits": 1})
            g, _ = prod.expect("GRANT")
        prod.send("HANDOFF", {"grant_id": g["grant_id"], "handoff_id": 7, "offset": 0}, hd, *frames)
        err, _ = prod.expect("ERROR")
        assert err["code"] == code, err
        if reason:
            assert err["reason"] == reason and reason in err["message"]
        # A message too malformed to parse cannot use up its grant; any other rejection does,
        # and puts the consumer's request back in the queue.
        g = g if code == "bad_frames" else None
    prod.send("HANDOFF", {"grant_id": 12345, "handoff_id": 8, "offset": 0}, handle(64, 0, 0), b"M" * 64)
    assert prod.expect("ERROR")[0]["code"] == "unknown_grant"

    # ... and the good clients still work, the pending request served first
    prod.send("READY", {"credits": 1})
    g, _ = prod.expect("GRANT")
    prod.send("HANDOFF", {"grant_id": g["grant_id"], "handoff_id": 99, "offset": 0, "ack": True}, handle(8, 0, 0),
              b"M" * 64)
    d, _ = cons.expect("DELIVER")
    assert d["handoff_id"] == 99
    assert prod.expect("ACCEPTED")[0]["handoff_id"] == 99
    cons.send("RELEASE", {"token": token2})
    assert prod.expect("RELEASED")[0]["handoff_id"] == hid2


def test_bundles_go_only_to_a_client_that_reads_them(env):
    """A producer's RELEASED and the GRANT its consumer's piggybacked credit makes possible leave
    the broker in the same drain round: one bundle (§2.2a) to a producer whose HELLO set
    ``bundles``, two messages to one that did not (and a raw reader of §2.2 would refuse a bundle)."""
    b, ctx = env
    for bundles in (True, False):
        prod, cons = Raw(ctx, b.endpoint, f"p-{bundles}"), Raw(ctx, b.endpoint, f"c-{bundles}")
        channel = f"bundles-{bundles}"
        prod.send("HELLO", {"protocol": 2, "role": "producer", "channel": channel, "pid": os.getppid(),
                            "endpoint": endpoint_dict(os.getppid()), **({"bundles": True} if bundles else {})})
        prod.expect("WELCOME")
        cons.hello("consumer", channel, endpoint_dict(os.getpid()))
        token, hid = one_handoff(prod, cons)
        prod.send("READY", {"credits": 1})
        prod.send("PING")
        assert prod.recv()[0] == "PONG"  # the broker holds the READY before the release below arrives
        cons.send("RELEASE", {"token": token, "credits": 1})
        assert prod.s.poll(5000)
        first = prod.s.recv_multipart()
        if bundles:
            parts = unpack_bundle(first)
            assert [[v for v, _f, _fr in p] for p in parts] == [["RELEASED"], ["GRANT"]]
            assert parts[0][0][1]["handoff_id"] == hid
        else:
            assert unpack_hot(first) == [("RELEASED", {"handoff_id": hid, "reason": "released"}, [])]
            assert prod.s.poll(5000)
            assert [v for v, _f, _fr in unpack_hot(prod.s.recv_multipart())] == ["GRANT"]


def test_mode_not_valid_for_pair(env):
    b, ctx = env
    prod, cons = Raw(ctx, b.endpoint, "p1"), Raw(ctx, b.endpoint, "c1")
    prod.hello("producer", "m", endpoint_dict(os.getppid(), "cuda", ipc_events=False, uuid="EMU-x"))
    cons.hello("consumer", "m", endpoint_dict(os.getpid(), "cuda", ipc_events=True, uuid="EMU-x"))
    cons.send("REQUEST", {"credits": 1})
    prod.send("READY", {"credits": 1})
    g, _ = prod.expect("GRANT")
    prod.send("HANDOFF", {"grant_id": g["grant_id"], "handoff_id": 1, "offset": 0}, handle(64, 1, 1), b"M" * 64,
              b"E" * 64)
    err, _ = prod.expect("ERROR")
    assert err["code"] == "mode_not_valid" and "IPC-exportable events" in err["message"] and err["handoff_id"] == 1
    prod.send("HANDOFF", {"grant_id": g["grant_id"] + 1, "handoff_id": 2, "offset": 0}, handle(64, 1, 2), b"M" * 64)
    assert prod.expect("ERROR")[0]["code"] == "unknown_grant"
    prod.send("READY", {"credits": 1})
    g, _ = prod.expect("GRANT")
    prod.send("HANDOFF", {"grant_id": g["grant_id"], "handoff_id": 3, "offset": 0}, handle(64, 1, 2), b"M" * 64)
    assert "IPC-exportable" in prod.expect("ERROR")[0]["message"]


def test_caps_query(env):
    b, ctx = env
    q = Raw(ctx, b.endpoint, "q")
    q.send("CAPS", {"request_id": 5, "device": endpoint_dict(1, "cuda", ipc_events=True, uuid="EMU-a"),
                    "peer": endpoint_dict(2, "cpu"), "transport": "ipc"})
    r, _ = q.expect("CAPS_REPLY")
    assert r["request_id"] == 5 and r["host_staged"] is True and r["valid_sync_modes"] == []
    assert r["excluded"]["SYNC_EVENT"] == "consumer has no GPU"


def test_message_vectors_parse():
    """tests/vectors/ipc_messages.json: the library encodes each binary message's entries to exactly
    the vector's frames and decodes them back; this file's own struct parser (written from the spec)
    reads the broker-to-client ones the same way."""
    from pathlib import Path

    from hurray_ipc import BufferHandle
    from hurray_ipc.wire.ipc import Message, decode_all, encode_batch, hot_message

    vec = json.loads((Path(__file__).parent / "vectors" / "ipc_messages.json").read_text())
    assert vec["format"].endswith("v2 example messages")
    for m in vec["messages"]:
        frames = [bytes.fromhex(f) for f in m["frames"]]
        msgs = decode_all(frames)
        assert msgs[0].verb == m["verb"] or m["verb"] in ("RELEASE", "RELEASED"), m["name"]
        if "entries" not in m:
            assert isinstance(msgs[0], Message)
            assert [len(f) for f in msgs[0].frames.values()] == m["payload_sizes"]
            continue
        entries = [hot_message(e["verb"], e["fields"], {k: bytes.fromhex(v) for k, v in e["frames"].items()})
                   for e in m["entries"]]
        assert encode_batch(entries) == frames, m["name"]
        assert [x.verb for x in msgs] == [e["verb"] for e in m["entries"]], m["name"]
        for got, e in zip(msgs, m["entries"], strict=True):
            for k, v in e["fields"].items():
                if k not in ("ready", "credits"):
                    assert got.fields()[k] == v, (m["name"], k)
            assert got.blobs() == {k: bytes.fromhex(v) for k, v in e["frames"].items() if k != "meta"}
            if "handle" in got.blobs():
                BufferHandle.decode(got.blobs()["handle"])
        credit = sum(e["fields"].get("ready") or e["fields"].get("credits") or 0 for e in m["entries"]) or None
        assert msgs[-1].fields().get("ready", msgs[-1].fields().get("credits")) == credit
        if m["verb"] in ("DELIVER", "GRANT", "RELEASED", "ACCEPTED"):
            mine = unpack_hot(frames)
            assert [v for v, _f, _fr in mine] == [e.verb for e in entries]
            for (_v, fields, _fr), e in zip(mine, m["entries"], strict=True):
                for k, v in fields.items():
                    if k in e["fields"]:
                        assert e["fields"][k] == v, (m["name"], k)


def test_bundle_vectors_parse():
    """tests/vectors/ipc_messages.json's bundles (§2.2a): the library encodes each part's entries
    to exactly the vector's frames, one part after another, and decodes the bundle to the parts'
    entries in order; this file's own parser reads them the same way. The malformed ones are
    refused as a whole with the code given."""
    from pathlib import Path

    from hurray_ipc.wire.ipc import BROKER_VERBS, ProtocolError, decode_all, encode_batch, hot_message

    vec = json.loads((Path(__file__).parent / "vectors" / "ipc_messages.json").read_text())
    assert len(vec["bundles"]) >= 2 and len(vec["bundles_malformed"]) >= 4
    for m in vec["bundles"]:
        frames = [bytes.fromhex(f) for f in m["frames"]]
        encoded = []
        for part in m["parts"]:
            encoded += encode_batch([hot_message(e["verb"], e["fields"], {k: bytes.fromhex(v)
                                                                          for k, v in e["frames"].items()})
                                     for e in part["entries"]])
        assert encoded == frames, m["name"]
        want = [e for part in m["parts"] for e in part["entries"]]
        got = decode_all(frames, allowed=BROKER_VERBS, bundles=True)
        assert [x.verb for x in got] == [e["verb"] for e in want], m["name"]
        for x, e in zip(got, want, strict=True):
            assert {k: x.fields()[k] for k in e["fields"]} == e["fields"], m["name"]
        mine = unpack_bundle(frames)
        assert [[v for v, _f, _fr in p] for p in mine] == [[e["verb"] for e in p["entries"]] for p in m["parts"]]
        with pytest.raises(ProtocolError):
            decode_all(frames)  # a reader that did not ask for bundles
    for m in vec["bundles_malformed"]:
        with pytest.raises(ProtocolError) as e:
            decode_all([bytes.fromhex(f) for f in m["frames"]], allowed=BROKER_VERBS, bundles=True)
        assert e.value.code == m["code"], m["name"]

