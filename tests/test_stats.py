"""Observability (issue 12): the STATS verb (spec §2.3) on the broker core and on a real broker,
hurray-top, and the Prometheus endpoint of ``hurray-broker --metrics-port``.

Counters are checked for exact values after known traffic, so a counter that counts wrong (or not
at all) fails here; nothing waits by sleeping: the real-broker tests poll until a condition holds,
with a deadline.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import zmq

from brokerproc import BrokerProcess
from conftest import free_port
from hurray_ipc.broker.core import BrokerCore, Send
from hurray_ipc.broker.queries import MAX_STATS_CHANNELS, MAX_STATS_CLIENTS
from hurray_ipc.wire.ipc import (
    BROKER_VERBS,
    CLIENT_VERBS,
    ERROR_CODES,
    MAX_STATS_REPLY_BYTES,
    PAYLOAD,
    Message,
    decode,
    encode_batch,
)
from test_broker_core import HOST, cpu_handle, endpoint, frames
from test_protocol_raw import Raw, endpoint_dict, one_handoff

ROOT = Path(__file__).resolve().parents[1]
SPEC = (ROOT / "docs" / "spec" / "ipc-protocol.md").read_text()


# --- the core, without I/O -------------------------------------------------------------------------

class World:
    """A core with producer p and consumer c on channel ch; ``now`` advances only when told."""

    def __init__(self, credits: int = 8, **core_kw: Any) -> None:
        self.core = BrokerCore(host=HOST, timeout_s=3.0, started=0.0, pid=4242, **core_kw)
        self.now = 0.0
        self.to: dict[bytes, list[Message]] = {}
        self.hello(b"p", "producer", 5)
        self.hello(b"c", "consumer", 6, credits=credits)

    def send(self, rid: bytes, parts: list[bytes]) -> list[Message]:
        mine = []
        for o in self.core.receive(rid, parts, self.now):
            if isinstance(o, Send):
                (mine if o.rid == rid else self.to.setdefault(o.rid, [])).append(o.msg)
        return mine

    def hello(self, rid: bytes, role: str, pid: int, channel: str = "ch", ep: dict | None = None, **extra: Any):
        (w,) = self.send(rid, frames("HELLO", {"protocol": 2, "role": role, "channel": channel, "pid": pid,
                                               "endpoint": ep or endpoint(pid), **extra}))
        assert w.verb == "WELCOME", w

    def handoffs(self, n: int, start: int = 1) -> list[str]:
        """``n`` accepted CPU handoffs from p to c; their tokens."""
        tokens = []
        for hid in range(start, start + n):
            (g,) = [m for m in self.send(b"p", frames("READY", {"credits": 1})) if m.verb == "GRANT"]
            assert self.send(b"p", frames("HANDOFF", {"grant_id": g.fields()["grant_id"], "handoff_id": hid,
                                                      "offset": 0}, cpu_handle(), b"M" * 64)) == []
            (d,) = self.to.pop(b"c")
            tokens.append(d.fields()["token"])
        return tokens

    def stats(self, rid: bytes = b"observer", **header: Any) -> dict[str, Any]:
        (r,) = self.send(rid, frames("STATS", header))
        assert r.verb == "STATS_REPLY", r
        return r.fields()


def client(reply: dict[str, Any], role: str) -> dict[str, Any]:
    (c,) = [c for c in reply["clients"] if c["role"] == role]
    return c


def test_three_handoffs_one_release_leave_two_outstanding():
    w = World(credits=8)
    tokens = w.handoffs(3)
    assert w.send(b"c", frames("RELEASE", {"token": tokens[0]})) == []
    r = w.stats(request_id="q")
    assert r["request_id"] == "q"
    assert (r["totals"]["handoffs"], r["totals"]["releases"], r["gauges"]["outstanding"]) == (3, 1, 2)
    p, c = client(r, "producer"), client(r, "consumer")
    assert (p["outstanding"], c["outstanding"]) == (2, 2)
    assert (p["credits"], c["credits"]) == (0, 5)  # 8 asked, 3 granted
    assert (p["name"], p["channel"], p["pid"], p["device"], p["state"], p["lease"]) == ("", "ch", 5, "cpu", "alive",
                                                                                        False)
    assert p["id"] == BrokerCore.label_of(b"p") and c["id"] == BrokerCore.label_of(b"c"), "labels, not routing ids"
    (ch,) = r["channels"]
    assert ch == {"name": "ch", "producers": 1, "consumers": 1, "queued": 5, "ready": 0, "grants": 0, "in_flight": 2,
                  "ended": False}
    g = r["gauges"]
    assert (g["clients"], g["producers"], g["consumers"], g["channels"], g["queued"], g["grants"]) == (2, 1, 1, 1, 5, 0)
    assert r["broker"]["pid"] == 4242 and r["broker"]["protocol"] == 2 and r["broker"]["session"] == w.core.session
    assert (r["clients_truncated"], r["channels_truncated"]) == (0, 0)


def test_grants_and_ready_credits_are_counted_per_channel():
    w = World(credits=1)
    w.send(b"p", frames("READY", {"credits": 3}))  # one grant (one consumer credit), two READY left
    r = w.stats()
    assert r["gauges"]["grants"] == 1 and r["channels"][0]["grants"] == 1 and r["channels"][0]["ready"] == 2
    assert client(r, "producer")["credits"] == 2 and r["gauges"]["queued"] == 0


def test_errors_by_code_count_each_refusal():
    w = World()
    assert w.send(b"stranger", frames("PING", {}))[0].fields()["code"] == "not_registered"
    assert w.send(b"stranger", frames("REQUEST", {"credits": 1}))[0].fields()["code"] == "not_registered"
    assert w.send(b"c", frames("RELEASE", {"token": "ab" * 24}))[0].fields()["code"] == "unknown_token"
    assert w.send(b"c", frames("READY", {"credits": 1}))[0].fields()["code"] == "wrong_role"
    (err,) = w.send(b"x", frames("STATS", {"request_id": [1]}))  # a malformed STATS: the usual ERROR
    assert (err.verb, err.fields()["code"], err.fields()["field"]) == ("ERROR", "bad_header", "request_id")
    r = w.stats()
    by_code = r["errors_by_code"]
    assert set(by_code) == ERROR_CODES, "every code, zeros included"
    assert {k: v for k, v in by_code.items() if v} == {"not_registered": 2, "unknown_token": 1, "wrong_role": 1,
                                                       "bad_header": 1}
    assert r["totals"]["errors"] == 5 == sum(by_code.values())


def test_a_refused_handoff_counts_as_rejected_and_by_code():
    w = World()
    (g,) = [m for m in w.send(b"p", frames("READY", {"credits": 1})) if m.verb == "GRANT"]
    bad = cpu_handle()[:13] + b"\x02" + cpu_handle()[14:]  # a CPU buffer must be SYNC_PRODUCER_SYNCED
    (err,) = w.send(b"p", frames("HANDOFF", {"grant_id": g.fields()["grant_id"], "handoff_id": 1, "offset": 0},
                                 bad, b"M" * 64))
    r = w.stats()
    assert err.fields()["code"] == "bad_handle" and r["errors_by_code"]["bad_handle"] == 1
    assert (r["totals"]["rejected"], r["totals"]["handoffs"], r["gauges"]["outstanding"]) == (1, 0, 0)
    assert r["gauges"]["queued"] == 8, "the consumer's credit went back to the queue"


def test_messages_count_entries_and_wire_messages():
    w = World()
    before = w.stats()["totals"]
    grants = [m for m in w.send(b"p", frames("READY", {"credits": 2})) if m.verb == "GRANT"]
    batch = encode_batch([Message("HANDOFF", {"grant_id": g.fields()["grant_id"], "handoff_id": i, "offset": 0},
                                  {"handle": cpu_handle(), "memory": b"M" * 64}) for i, g in enumerate(grants)])
    w.send(b"p", batch)
    after = w.stats()["totals"]
    # in (a STATS counts itself): READY, one HANDOFF message of 2 entries, the second STATS
    assert after["messages_in"] - before["messages_in"] == 1 + 2 + 1
    assert after["wire_in"] - before["wire_in"] == 1 + 1 + 1
    # out: the first STATS_REPLY, 2 GRANTs, 2 DELIVERs (the second STATS_REPLY is not sent yet)
    assert after["messages_out"] - before["messages_out"] == 1 + 2 + 2
    assert after["wire_out"] == 0, "the loop counts wire messages out, not the core"


def _cuda_ep(pid: int) -> dict:
    ep = endpoint(pid)
    ep["device"].update(kind="cuda", uuid="EMU-stats", emulated=True)
    ep["caps"]["ipc_events"] = True
    return ep


def test_event_handoffs_count_until_their_event_is_released():
    w = World()
    w.hello(b"gp", "producer", 7, channel="gpu", ep=_cuda_ep(7))
    w.hello(b"gc", "consumer", 8, channel="gpu", ep=_cuda_ep(8), credits=2)
    event_handle = cpu_handle()[:12] + b"\x01\x01" + cpu_handle()[14:]  # CUDA, SYNC_EVENT
    tokens = []
    for hid in (1, 2):
        (g,) = [m for m in w.send(b"gp", frames("READY", {"credits": 1})) if m.verb == "GRANT"]
        assert w.send(b"gp", frames("HANDOFF", {"grant_id": g.fields()["grant_id"], "handoff_id": hid, "offset": 0},
                                    event_handle, b"M" * 64, b"E" * 64)) == []
        tokens.append(w.to.pop(b"gc")[0].fields()["token"])
    r = w.stats()
    assert r["gauges"]["events_outstanding"] == 2
    assert w.send(b"gc", frames("EVENT_RELEASE", {"token": tokens[0]})) == []
    r = w.stats()
    gp = [c for c in r["clients"] if c["channel"] == "gpu" and c["role"] == "producer"][0]
    gc = [c for c in r["clients"] if c["channel"] == "gpu" and c["role"] == "consumer"][0]
    assert (r["gauges"]["events_outstanding"], gp["events_outstanding"], gc["events_outstanding"]) == (1, 1, 1)
    assert (gp["outstanding"], r["gauges"]["outstanding"]) == (2, 2)
    gpu = [ch for ch in r["channels"] if ch["name"] == "gpu"][0]
    assert gpu["in_flight"] == 2 and [ch for ch in r["channels"] if ch["name"] == "ch"][0]["in_flight"] == 0


def test_rates_over_the_life_and_the_recent_window():
    w = World(credits=20)
    for t in range(0, 21):
        w.now = float(t)
        for rid in (b"p", b"c"):  # live clients ping
            w.send(rid, frames("PING", {}))
        w.core.tick(w.now, lambda c: True)
        if t == 5:
            w.handoffs(10)
        if t == 15:
            w.handoffs(4, start=100)
    r = w.stats()  # at t = 20: the window reaches back to the sample of t = 10 (10 handoffs by then)
    assert r["broker"]["uptime_s"] == 20.0 and r["rates"]["window_s"] == 10.0
    assert r["rates"]["life"]["handoffs"] == 14 / 20
    assert r["rates"]["window"]["handoffs"] == (14 - 10) / 10
    assert r["rates"]["life"]["releases"] == 0.0 == r["rates"]["window"]["releases"]


def test_recent_window_starts_at_the_start_while_the_broker_is_young():
    w = World(credits=4)
    w.now = 2.0
    w.core.tick(w.now, lambda c: True)
    w.handoffs(4)
    w.now = 4.0
    r = w.stats()
    assert r["rates"]["window_s"] == 4.0 and r["rates"]["window"]["handoffs"] == 1.0 == r["rates"]["life"]["handoffs"]


def test_unresponsive_and_lease_state():
    """Silent past the timeout, process alive: a client that holds something (a delivery, a
    handoff at a consumer) is unresponsive and keeps it; one that holds nothing is dropped (it
    registers again when it speaks), so silent registrations cannot fill the client table."""
    w = World()
    w.hello(b"l", "consumer", 9, channel="ch2", lease="hurray-0-lease-1-9-0123456789abcdef", credits=1)
    w.hello(b"p2", "producer", 10, channel="ch2")
    (g,) = [m for m in w.send(b"p2", frames("READY", {"credits": 1})) if m.verb == "GRANT"]
    w.send(b"p2", frames("HANDOFF", {"grant_id": g.fields()["grant_id"], "handoff_id": 1, "offset": 0}, cpu_handle(),
                         b"M" * 64))
    w.now = 10.0
    w.core.tick(w.now, lambda c: True)
    r = w.stats()
    leased = [c for c in r["clients"] if c["pid"] == 9][0]
    assert leased["lease"] is True and leased["state"] == "unresponsive" and leased["silent_s"] == 10.0
    assert r["gauges"]["unresponsive"] == 2 and sorted(c["pid"] for c in r["clients"]) == [9, 10]


def test_shared_memory_sweeps():
    w = World()
    w.core.note_sweep(7, 2)
    w.core.note_sweep(5, 1)
    assert w.stats()["shm"] == {"segments": 5, "cleaned": 3, "sweeps": 2}


def test_cached_snapshot_is_reused_only_for_its_period():
    w = World(stats_cache_s=0.25)
    w.now = 1.0
    first = w.stats()
    w.handoffs(1)
    w.now = 1.2
    assert w.stats()["totals"] == first["totals"], "within the period: the same snapshot"
    w.now = 1.3
    assert w.stats()["totals"]["handoffs"] == 1


def test_lists_are_bounded_and_the_reply_fits_its_limit():
    """More clients and channels than are listed, each with the longest name and channel there can
    be, of characters JSON escapes to 12 bytes: the lists stop at their caps, the rest is counted,
    and the encoded reply stays under MAX_STATS_REPLY_BYTES and decodes."""
    core = BrokerCore(host=HOST, started=0.0)
    n = max(MAX_STATS_CLIENTS, MAX_STATS_CHANNELS) + 3
    wide = "\U0001f600"
    for i in range(n):
        pid = 1000 + i
        core.receive(f"c{i}".encode(), frames("HELLO", {"protocol": 2, "role": "consumer", "pid": pid,
                                                        "channel": f"{i:05d}" + wide * 251, "name": wide * 128,
                                                        "endpoint": endpoint(pid)}), 0.0)
    assert len(core.clients) == n
    (out,) = core.receive(b"q", frames("STATS", {}), 1.0)
    assert isinstance(out, Send)
    r = out.msg.fields()
    assert (len(r["clients"]), r["clients_truncated"]) == (MAX_STATS_CLIENTS, n - MAX_STATS_CLIENTS)
    assert (len(r["channels"]), r["channels_truncated"]) == (MAX_STATS_CHANNELS, n - MAX_STATS_CHANNELS)
    parts = out.msg.encode()
    assert 4_000_000 < len(parts[1]) < MAX_STATS_REPLY_BYTES
    assert decode(parts, allowed=BROKER_VERBS).fields()["clients_truncated"] == n - MAX_STATS_CLIENTS


def test_stats_is_in_the_verb_tables_and_the_spec():
    assert "STATS" in CLIENT_VERBS and "STATS_REPLY" in BROKER_VERBS
    assert PAYLOAD["STATS"] == () == PAYLOAD["STATS_REPLY"]
    assert "| STATS |" in SPEC and "| STATS_REPLY |" in SPEC and "### 2.3 STATS" in SPEC


def _keys(x: Any, prefix: str = "") -> set[str]:
    """Dotted field names of a reply (list entries by their fields, as the spec's tables name them)."""
    out: set[str] = set()
    if isinstance(x, dict):
        for k, v in x.items():
            name = f"{prefix}{k}"
            out.add(name)
            if prefix != "errors_by_code." and k != "errors_by_code":
                out |= _keys(v, name + ".")
    elif isinstance(x, list) and x:
        out |= _keys(x[0], prefix)
    return out


def test_vector_reply_has_the_fields_the_core_sends_and_the_spec_names():
    vec = json.loads((ROOT / "tests" / "vectors" / "ipc_messages.json").read_text())["messages"]
    (m,) = [m for m in vec if m["verb"] == "STATS_REPLY"]
    parts = [bytes.fromhex(f) for f in m["frames"]]
    assert decode(parts).fields() == m["header"]
    w = World()
    w.handoffs(1)
    assert _keys(w.stats()) == _keys(m["header"])
    assert set(m["header"]["errors_by_code"]) == set(w.stats()["errors_by_code"]) == ERROR_CODES
    section = SPEC[SPEC.index("### 2.3 STATS"):SPEC.index("## 3. Endpoint object")]
    groups = {"broker", "gauges", "totals", "rates", "rates.life", "rates.window", "shm"}
    for name in _keys(m["header"]) - groups:
        if name.startswith(("clients.", "channels.")):  # the entry tables name their fields bare
            name = name.split(".", 1)[1]
        elif name.startswith(("rates.life.", "rates.window.")):
            name = name.rsplit(".", 1)[0] + ".<name>"
        assert f"`{name}`" in section, name


# --- a real broker ---------------------------------------------------------------------------------

def wait_for(what: str, probe: Callable[[], Any], ok: Callable[[Any], bool], timeout: float = 15.0) -> Any:
    """Call ``probe`` until ``ok`` holds for its result; fail naming ``what`` and the last result."""
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        last = probe()
        if ok(last):
            return last
        time.sleep(0.05)  # the poll's pace; correctness never depends on it
    raise AssertionError(f"{what}: not within {timeout} s; last {last!r}")


def stats_of(raw: Raw) -> dict[str, Any]:
    raw.send("STATS", {"request_id": "t"})
    while True:
        v, h, _f = raw.recv()
        if v == "STATS_REPLY" and h["request_id"] == "t":
            return h


def traffic(ctx: zmq.Context, ep: str) -> tuple[Raw, Raw, Raw]:
    """Three handoffs, one released, one PING before HELLO: (producer, consumer, observer)."""
    prod, cons, obs = Raw(ctx, ep, "stats-p"), Raw(ctx, ep, "stats-c"), Raw(ctx, ep, "stats-o")
    prod.hello("producer", "frames", endpoint_dict(os.getppid()))
    cons.hello("consumer", "frames", endpoint_dict(os.getpid()))
    tokens = [one_handoff(prod, cons)[0] for _ in range(3)]
    cons.send("RELEASE", {"token": tokens[0]})
    prod.expect("RELEASED")
    obs.send("PING", {})
    assert obs.expect("ERROR")[0]["code"] == "not_registered"
    return prod, cons, obs


def expected(r: dict[str, Any]) -> bool:
    return (r["totals"]["handoffs"], r["totals"]["releases"], r["gauges"]["outstanding"],
            r["errors_by_code"]["not_registered"]) == (3, 1, 2, 1)


@pytest.fixture
def busy_broker(tmp_path):
    """A real broker after :func:`traffic` (its clients stay connected for the test)."""
    b = BrokerProcess(f"ipc://{tmp_path}/b.sock", timeout=30).start()
    ctx = zmq.Context()
    try:
        socks = traffic(ctx, b.endpoint)
        yield b, socks
    finally:
        ctx.destroy(linger=0)
        b.stop()


def test_stats_from_a_real_broker(busy_broker):
    b, (prod, cons, obs) = busy_broker
    r = wait_for("STATS after the traffic", lambda: stats_of(obs), expected)
    assert client(r, "producer")["outstanding"] == 2 and client(r, "consumer")["outstanding"] == 2
    assert r["broker"]["pid"] == b.proc.pid and r["broker"]["uptime_s"] > 0
    assert r["totals"]["wire_out"] > 0 and r["shm"]["sweeps"] >= 1
    assert [ch["name"] for ch in r["channels"]] == ["frames"] and r["channels"][0]["in_flight"] == 2
    # a registered client may ask too, and the counters go on (a snapshot is reused for 0.25 s)
    wait_for("a newer snapshot", lambda: stats_of(cons), lambda r2: r2["totals"]["messages_in"] > r["totals"][
        "messages_in"])


def test_a_socket_that_never_reads_is_sent_eight_answers_and_a_reading_one_every_answer(busy_broker):
    """Red team item 4, end to end: a socket floods 2000 STATS and reads nothing (before, the
    2 MiB/s budget answered about 1500 of them, 1.3 KB each, queued in the broker). The broker's
    own counters say 1992 were withheld and 8 answers wait; reading the socket afterwards finds
    exactly those 8. Meanwhile a BrokerQuery (hurray-top's), which names its latest ticket, is answered
    every time on one connection."""
    from hurray_ipc.client.query import BrokerQuery

    b, (_p, _c, obs) = busy_broker
    deaf = zmq.Context.instance().socket(zmq.DEALER)
    deaf.setsockopt(zmq.LINGER, 0)
    deaf.connect(b.endpoint)
    watcher = BrokerQuery(b.endpoint)
    try:
        for _ in range(2000):
            deaf.send_multipart([b"STATS", b"{}"])
        r = wait_for("the flood handled", lambda: watcher.stats(10.0),
                     lambda r: r["totals"]["answers_withheld"] >= 1992)
        assert r["totals"]["answers_withheld"] == 1992 and r["gauges"]["unread_answers"] >= 8
        for _ in range(30):
            watcher.stats(10.0)
        replies = []
        while deaf.poll(0 if len(replies) >= 8 else 10_000):
            parts = deaf.recv_multipart()
            if parts[0] != b"PONG":  # a probe of whether it is still connected
                replies.append((parts[0], json.loads(parts[1])["ticket"]))
        assert [verb for verb, _ in replies] == [b"STATS_REPLY"] * 8
        # It read them now: naming the latest gets it answered again.
        deaf.send_multipart([b"STATS", json.dumps({"ticket": replies[-1][1], "request_id": "again"}).encode()])
        while True:
            assert deaf.poll(10_000), "no answer after the ticket"
            parts = deaf.recv_multipart()
            if parts[0] != b"PONG":
                assert json.loads(parts[1])["request_id"] == "again"
                break
    finally:
        deaf.close(0)
        watcher.close()


def top(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "hurray_ipc.cli.top", *args], capture_output=True, text=True,
                          timeout=timeout)


def test_top_once_and_json_against_a_real_broker(busy_broker):
    b, (_p, _c, obs) = busy_broker
    wait_for("STATS after the traffic", lambda: stats_of(obs), expected)
    r = top("--endpoint", b.endpoint, "--json")
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout)
    assert expected(d) and d["request_id"].startswith("q-")
    r = top("--endpoint", b.endpoint, "--once")
    assert r.returncode == 0, r.stderr
    out = r.stdout
    assert f"pid {b.proc.pid}" in out and "outstanding handoffs 2" in out and "handoffs 3 (" in out
    assert "released 1 (" in out and "not_registered 1" in out
    rows = {line.split()[0]: line.split() for line in out.splitlines() if line.strip()}
    assert rows["frames"][1:] == ["1", "1", "0", "0", "0", "2"]  # producers consumers queued ready grants in-flight
    assert rows[BrokerCore.label_of(b"stats-p")][2:4] == ["producer", "frames"]


def test_top_once_without_a_broker_is_one_line_and_exit_2(tmp_path):
    r = top("--endpoint", f"ipc://{tmp_path}/none.sock", "--once", "--timeout", "0.3")
    assert r.returncode == 2 and r.stdout == ""
    assert len(r.stderr.strip().splitlines()) == 1 and "no reply from broker" in r.stderr, r.stderr
    r = top("--endpoint", f"ipc://{tmp_path}/none.sock", "--json", "--timeout", "0.3")
    assert r.returncode == 2 and "Traceback" not in r.stderr
    # --json: stdout is JSON whatever happened (a script parses it), stderr the same one line
    assert json.loads(r.stdout) == {"error": f"no reply from broker at ipc://{tmp_path}/none.sock within 0.3 s",
                                    "endpoint": f"ipc://{tmp_path}/none.sock"}, r.stdout
    assert r.stderr.strip().splitlines() == [f"hurray-top: {json.loads(r.stdout)['error']}"], r.stderr
    r = top("--endpoint", "tcp://no-port-here", "--json")
    assert r.returncode == 2 and json.loads(r.stdout)["endpoint"] == "tcp://no-port-here", r.stdout
    assert json.loads(r.stdout)["error"].startswith("cannot connect to tcp://no-port-here: "), r.stdout
    r = top("--endpoint", "tcp://no-port-here", "--once")  # ZeroMQ refuses the address itself
    assert r.returncode == 2 and r.stderr.strip().startswith("hurray-top: cannot connect to tcp://no-port-here: ")
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr


def scrape(port: int, token: str) -> dict[str, float]:
    req = urllib.request.Request(f"http://127.0.0.1:{port}/metrics", headers={"Authorization": f"Bearer {token}"})
    with urllib.request.urlopen(req, timeout=5) as resp:
        text = resp.read().decode()
    out = {}
    for line in text.splitlines():
        m = re.match(r"^([a-zA-Z_:][\w:]*(?:\{[^}]*\})?) (\S+)$", line)
        if m:
            out[m.group(1)] = float(m.group(2))
    return out


def test_metrics_endpoint_serves_the_same_numbers(tmp_path):
    pytest.importorskip("prometheus_client")
    token_file = tmp_path / "m.sock.metrics-token"
    for _attempt in range(3):  # a free port can be taken between the probe and the broker's bind
        port = free_port()
        b = BrokerProcess(f"ipc://{tmp_path}/m.sock", timeout=30,
                          extra_args=["--metrics-port", str(port)]).start()
        try:
            wait_for("the metrics endpoint", lambda p=port: _try_scrape(p, token_file), lambda m: m is not None,
                     timeout=10)
            break
        except AssertionError:
            b.stop()
    else:
        pytest.fail("the metrics endpoint never answered")
    ctx = zmq.Context()
    try:
        traffic(ctx, b.endpoint)
        token = token_file.read_text().strip()
        m = wait_for("metrics after the traffic", lambda: scrape(port, token),
                     lambda m: m.get("hurray_broker_handoffs_total") == 3.0
                     and m.get('hurray_broker_errors_total{code="not_registered"}') == 1.0)
        assert m["hurray_broker_releases_total"] == 1.0
        assert m["hurray_broker_outstanding_handoffs"] == 2.0
        assert m["hurray_broker_clients"] == 2.0 and m["hurray_broker_consumers"] == 2.0 - m["hurray_broker_producers"]
        assert m['hurray_channel_in_flight{channel="frames"}'] == 2.0
        label = BrokerCore.label_of(b"stats-c")
        (key,) = [k for k in m if k.startswith("hurray_client_outstanding{") and f'id="{label}"' in k]
        assert m[key] == 2.0
        assert m["hurray_broker_uptime_seconds"] > 0
        assert any(k.startswith("hurray_broker_info{") and f'pid="{b.proc.pid}"' in k for k in m)
        # Red team item 10: owner-only. The token file is the owner's alone, and a request without
        # its token (any other local user) learns nothing, not even a channel's name.
        assert token_file.stat().st_mode & 0o777 == 0o600
        for headers in ({}, {"Authorization": "Bearer " + "0" * 64}, {"Authorization": token}):
            req = urllib.request.Request(f"http://127.0.0.1:{port}/metrics", headers=headers)
            with pytest.raises(urllib.error.HTTPError) as e:
                urllib.request.urlopen(req, timeout=5)
            assert e.value.code == 401 and b"frames" not in e.value.read()
    finally:
        ctx.destroy(linger=0)
        b.stop()


def _try_scrape(port: int, token_file) -> dict[str, float] | None:
    try:
        return scrape(port, token_file.read_text().strip())
    except OSError:
        return None


def test_a_scrape_renders_each_published_snapshot_once(monkeypatch):
    """Red team item 10's flood: a scrape is a cached body, rendered once per snapshot the loop
    publishes (once a second), so many scrapes cost the broker no renders of their own."""
    pytest.importorskip("prometheus_client")
    from hurray_ipc.broker import metrics

    core = BrokerCore(host=HOST, timeout_s=3.0, heartbeat_s=0.5, started=0.0, pid=1)
    published = [core.snapshot(1.0)]
    renders = []
    real = metrics.generate_latest
    monkeypatch.setattr(metrics, "generate_latest", lambda registry: renders.append(1) or real(registry))
    rendered = metrics._Rendered(lambda: published[0])
    bodies = {rendered.body() for _ in range(100)}
    assert len(renders) == 1 and len(bodies) == 1 and b"hurray_broker_clients 0.0" in bodies.pop()
    published[0] = core.snapshot(2.0)  # the loop publishes a new snapshot
    rendered.body()
    assert len(renders) == 2


def test_metrics_port_without_prometheus_client_is_one_line_exit_2(tmp_path):
    code = ("import sys; sys.modules['prometheus_client'] = None; from hurray_ipc.broker.__main__ import main; "
            f"sys.exit(main(['--endpoint', 'ipc://{tmp_path}/x.sock', '--metrics-port', '9']))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2, r
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "prometheus-client" in lines[0] and "hurray-ipc[metrics]" in lines[0], r.stderr
    assert not (tmp_path / "x.sock").exists(), "refused before binding"


def test_metrics_port_in_use_is_one_line_exit_2(tmp_path):
    pytest.importorskip("prometheus_client")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        r = subprocess.run([sys.executable, "-m", "hurray_ipc.broker", "--endpoint", f"ipc://{tmp_path}/y.sock",
                            "--metrics-port", str(port), "--log-level", "error"], capture_output=True, text=True,
                           timeout=60)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert f"metrics endpoint 127.0.0.1:{port}" in r.stderr.strip().splitlines()[-1]
