"""tests/vectors/ipc_refusals.json, run against the broker core and against a live broker over raw
frames: the spec's refusal rules (§2-§6a) and the code agree, in both places."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
import zmq

from barrier import Barrier
from hurray_ipc.broker.core import BrokerCore, Send
from hurray_ipc.broker.keyfile import route_key_path
from hurray_ipc.devices.base import host_id
from hurray_ipc.wire.ipc import Message, decode_all
from test_protocol_raw import pack_hot

VEC = json.loads((Path(__file__).parent / "vectors" / "ipc_refusals.json").read_text())["vectors"]
HOST = host_id()


def _subst(x: Any, env: dict[str, Any]) -> Any:
    if isinstance(x, str) and x in env:
        return env[x]
    if isinstance(x, dict):
        return {k: _subst(v, env) for k, v in x.items()}
    if isinstance(x, list):
        return [_subst(v, env) for v in x]
    return x


def _frames(verb: str, header: Any, frames: list[str], env: dict[str, Any]) -> list[bytes]:
    payload = [bytes.fromhex(f) for f in frames]
    if isinstance(header, str) and header.startswith("$raw:"):
        body = header[len("$raw:"):].encode()
    elif isinstance(header, str) and header.startswith("$hex:"):
        body = bytes.fromhex(header[len("$hex:"):])
    elif verb in ("HANDOFF", "RELEASE", "EVENT_RELEASE"):
        return pack_hot(verb, _subst(header, env), payload)  # binary, packed from the spec (§2.2)
    else:
        body = json.dumps(_subst(header, env)).encode()
    return [verb.encode(), body, *payload]


def _ep(pid: int) -> dict:
    return {"device": {"kind": "cpu", "ordinal": 0, "uuid": "cpu-v", "pci_bus_id": "", "emulated": False,
                       "host": HOST},
            "caps": {"ipc_memory": True, "ipc_events": False, "ipc_streams": False, "peers": []},
            "pid": pid, "stream": None}


class Driver:
    """Send frames as a named client and collect its replies (core or live broker)."""

    pids: dict[int, int] = {}  # the vectors' pids -> real ones (a live broker checks same-host pids)

    def send(self, who: str, frames: list[bytes]) -> list[Message]:
        raise NotImplementedError

    route_key = ""

    def setup(self, kind: str) -> dict[str, Any]:
        env: dict[str, Any] = {"$host": HOST, "$route_key": self.route_key}
        if kind == "none":
            return env
        for who, role, pid in (("p", "producer", 100), ("c", "consumer", 200), ("c2", "consumer", 201)):
            pid = self.pids.get(pid, pid)
            (w,) = self.send(who, [b"HELLO", json.dumps({"protocol": 2, "role": role, "channel": "v", "pid": pid,
                                                         "endpoint": _ep(pid)}).encode()])
            assert w.verb == "WELCOME", w
        self.send("c", [b"REQUEST", b'{"credits": 1}'])
        (g,) = self.send("p", [b"READY", b'{"credits": 1}'])
        assert g.verb == "GRANT", g
        env["$grant"] = g.fields()["grant_id"]
        if kind == "delivered":
            handle = bytes.fromhex("0010000000000000" "00010000" "00" "00" "0000")
            acc = self.send("p", pack_hot("HANDOFF", {"grant_id": env["$grant"], "handoff_id": 1, "offset": 0,
                                                      "ack": True}, [handle, b"M" * 64]))
            assert [m.verb for m in acc] == ["ACCEPTED"], acc
            (d,) = self.pending["c"]
            env["$token"] = d.fields()["token"]
        return env


class CoreDriver(Driver):
    def __init__(self) -> None:
        self.core = BrokerCore(host=HOST)
        self.route_key = self.core.route_key
        self.pending: dict[str, list[Message]] = {}

    def send(self, who: str, frames: list[bytes]) -> list[Message]:
        mine: list[Message] = []
        for o in self.core.receive(who.encode(), frames, 0.0):
            if isinstance(o, Send):
                if o.rid == who.encode():
                    mine.append(o.msg)
                else:
                    self.pending.setdefault(o.rid.decode(), []).append(o.msg)
        return mine


class LiveDriver(Driver):
    def __init__(self, endpoint: str, ctx: zmq.Context, run: int) -> None:
        self.endpoint, self.ctx, self.run = endpoint, ctx, run
        self.route_key = route_key_path(endpoint).read_text().strip()  # type: ignore[union-attr]
        self.pids = {100: os.getppid(), 200: os.getpid(), 201: os.getpid()}
        self.socks: dict[str, zmq.Socket] = {}
        self.barriers: dict[str, Barrier] = {}
        self.pending: dict[str, list[Message]] = {}

    def _sock(self, who: str) -> zmq.Socket:
        if who not in self.socks:
            s = self.ctx.socket(zmq.DEALER)
            # A fresh routing id per vector: the broker refuses a second connection with the id of
            # one it still holds (no ROUTER_HANDOVER), and the previous vector's may not be gone yet.
            s.setsockopt(zmq.IDENTITY, f"vec{self.run}-{who}".encode())
            s.setsockopt(zmq.LINGER, 0)
            s.connect(self.endpoint)
            self.socks[who] = s
            self.barriers[who] = Barrier(_ep(300), "vec-sync")
        return self.socks[who]

    def send(self, who: str, frames: list[bytes]) -> list[Message]:
        """Replies to ``who`` up to the answer to a CAPS sent right after (ordered on the socket)."""
        s = self._sock(who)
        s.send_multipart(frames)
        barrier = self.barriers[who]
        s.send_multipart(barrier.frames())
        out: list[Message] = []
        while True:
            assert s.poll(10_000), "the broker did not answer"
            parts = s.recv_multipart()
            if barrier.is_answer(parts):
                break
            out.extend(decode_all(parts))
        if who == "p":  # deliveries to c arrive on c's socket: collect them for '$token'
            c = self._sock("c")
            while c.poll(200 if out and out[0].verb == "ACCEPTED" else 0):
                self.pending.setdefault("c", []).extend(decode_all(c.recv_multipart()))
        return out


def _check(vec: dict, replies: list[Message]) -> None:
    exp = vec["expect"]
    if exp is None:
        assert replies == [], replies
        return
    assert replies, "no reply"
    first = replies[0]
    if "code" in exp:
        assert first.verb == "ERROR", (first.verb, first.fields())
        for k in ("code", "field", "request_id", "value", "limit", "credits"):
            if k in exp:
                assert first.fields().get(k) == exp[k], (k, first.fields())
        if "field" in exp:  # spec §2: an ERROR naming a field at fault shows its value
            assert "value" in first.fields(), ("value", first.fields())
    else:
        assert first.verb == exp["verb"], (first.verb, first.fields())
        if "request_id" in exp:
            assert first.fields()["request_id"] == exp["request_id"]


@pytest.mark.parametrize("vec", VEC, ids=[v["name"] for v in VEC])
def test_vector_on_the_core(vec):
    d = CoreDriver()
    env = d.setup(vec["setup"])
    _check(vec, d.send(vec["client"], _frames(vec["verb"], vec["header"], vec["frames"], env)))
    d.core.check_invariants()


def test_vectors_on_a_live_broker(broker):
    ctx = zmq.Context()
    try:
        for i, vec in enumerate(VEC):
            d = LiveDriver(broker.endpoint, ctx, i)
            env = d.setup(vec["setup"])
            try:
                _check(vec, d.send(vec["client"], _frames(vec["verb"], vec["header"], vec["frames"], env)))
            except AssertionError as e:
                raise AssertionError(f"vector {vec['name']!r}: {e}") from None
            for s in d.socks.values():
                s.send_multipart([b"BYE", b"{}"])
                s.close(0)
    finally:
        ctx.destroy(linger=0)
