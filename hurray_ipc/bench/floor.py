"""Floor rows for ``hurray-bench``: the cheapest brokered design, measured like Hurray's rows.

Three spawned processes: a relay (ROUTER) and a producer and a consumer (DEALER, identities ``b"P"``
and ``b"C"``). One handoff is four ZeroMQ messages, the least a design can use in which a third
process sees every handoff and every release:

    producer -> relay -> consumer   [b"H", header, handle (16 B), blob (64 B)]
    consumer -> relay -> producer   [b"R", header]

Nothing is shared or mapped: what is measured is the message path itself (``size`` only labels the
row and travels in the header).

``header=False``: the relay forwards the frames untouched. ``header=True``: the header is a fixed
little-endian struct; the relay decodes it with a precompiled :class:`struct.Struct`, checks the
flags, and encodes a different struct (one field more) before forwarding, in both directions: the
least a broker with a binary header must do.

Measured exactly like the Hurray rows (:mod:`.suite`): one-way latency of ``n`` paced ping-pongs (the
producer stamps CLOCK_MONOTONIC in ns, the consumer subtracts on receipt), then the rate with a
window of :func:`~.harness.window` handoffs outstanding (a handoff is outstanding until its release is
back), and the CPU each of the three processes spent in that pipelined phase, per handoff. The phase
is bracketed by a start and a stop marker that the producer sends through the relay to the consumer
and that come back the same way, so every process measures the same span.
"""

from __future__ import annotations

import math
import secrets
import struct
import time
from pathlib import Path
from typing import Any

from ..workload import spawn
from .harness import PACE, latency, run_pair, window

# Producer -> relay: handoff id, CLOCK_MONOTONIC ns (0: not timed), size, flags.
H_IN = struct.Struct("<QQQH")
# Relay -> consumer: the same plus the relay's sequence number (only with header=True).
H_OUT = struct.Struct("<QQQHI")
# Consumer -> relay: handoff id, flags.
R_IN = struct.Struct("<QH")
# Relay -> producer: the same plus the relay's sequence number (only with header=True).
R_OUT = struct.Struct("<QHI")
KNOWN_FLAGS = 0x0001
RELAYED = 0x0100  # set by the relay on what it re-encodes

HANDOFF, RELEASE = b"H", b"R"
HELLO, GO, START, STOP = b"HELLO", b"GO", b"START", b"STOP"
TIMEOUT_S = 60.0  # every recv gives up after this long: each process stops by itself
WARMUP = 20
IPC_PATH_MAX = 100  # sun_path is 108 bytes on Linux, with room to spare


class CpuMeter:
    """Process CPU seconds (user + system, every thread) between :meth:`start` and :meth:`stop`."""

    def __init__(self) -> None:
        self._t0: float | None = None
        self.seconds = float("nan")

    def start(self) -> CpuMeter:
        self._t0 = time.process_time()
        return self

    def stop(self) -> float:
        if self._t0 is None:
            raise RuntimeError("CpuMeter.stop() before start()")
        self.seconds = time.process_time() - self._t0
        self._t0 = None
        return self.seconds

    def __enter__(self) -> CpuMeter:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _socket(endpoint: str, kind: int, ident: bytes | None = None) -> Any:
    import zmq

    s = zmq.Context.instance().socket(kind)
    s.setsockopt(zmq.LINGER, 0)
    s.setsockopt(zmq.SNDTIMEO, int(TIMEOUT_S * 1000))
    if ident is None:
        s.setsockopt(zmq.ROUTER_MANDATORY, 1)  # an unknown peer is an error, not a silent drop
        s.bind(endpoint)
    else:
        s.setsockopt(zmq.IDENTITY, ident)
        s.connect(endpoint)
    return s


def _recv(s: Any) -> list[bytes]:
    if not s.poll(int(TIMEOUT_S * 1000)):
        raise TimeoutError(f"no message for {TIMEOUT_S} s")
    return s.recv_multipart()


def _relay(endpoint: str, header: bool) -> dict[str, Any]:
    import zmq

    s = _socket(endpoint, zmq.ROUTER)
    h_in, h_out, r_in, r_out = H_IN.unpack_from, H_OUT.pack, R_IN.unpack_from, R_OUT.pack
    meter = CpuMeter()
    peers: set[bytes] = set()
    try:
        while len(peers) < 2:  # both ends must be connected before the relay can route to them
            peers.add(_recv(s)[0])
        if peers != {b"P", b"C"}:
            raise RuntimeError(f"unexpected peers {peers!r}")
        for p in (b"C", b"P"):
            s.send_multipart([p, GO])
        seq = 0
        while True:
            parts = _recv(s)
            src, verb = parts[0], parts[1]
            if verb == HANDOFF:
                if header:
                    hid, t, size, flags = h_in(parts[2])
                    if flags & ~KNOWN_FLAGS:
                        raise ValueError(f"handoff {hid}: unknown flags {flags:#x}")
                    seq += 1
                    parts[2] = h_out(hid, t, size, flags | RELAYED, seq)
                parts[0] = b"C"
            elif verb == RELEASE:
                if header:
                    hid, flags = r_in(parts[2])
                    if flags & ~KNOWN_FLAGS:
                        raise ValueError(f"release {hid}: unknown flags {flags:#x}")
                    seq += 1
                    parts[2] = r_out(hid, flags | RELAYED, seq)
                parts[0] = b"P"
            else:  # the phase markers: the producer's go to the consumer and come back
                parts[0] = b"C" if src == b"P" else b"P"
                if verb == START and src == b"P":
                    meter.start()
                elif verb == STOP and src == b"P":
                    meter.stop()
            s.send_multipart(parts)
            if verb == STOP and src == b"C":
                break
    finally:
        s.close()
    return {"cpu_s": meter.seconds}


def _consumer(endpoint: str, header: bool) -> dict[str, Any]:
    import zmq

    s = _socket(endpoint, zmq.DEALER, b"C")
    unpack = (H_OUT if header else H_IN).unpack_from
    pack = R_IN.pack
    meter = CpuMeter()
    lat: list[float] = []
    try:
        s.send_multipart([HELLO])
        while True:
            parts = _recv(s)
            verb = parts[0]
            if verb == HANDOFF:
                hid, t = unpack(parts[1])[:2]
                if t:
                    lat.append((time.monotonic_ns() - t) / 1e9)
                s.send_multipart([RELEASE, pack(hid, 0)])
            elif verb == START:
                meter.start()
                s.send_multipart([START])
            elif verb == STOP:
                meter.stop()
                s.send_multipart([STOP])
                break
    finally:
        s.close()
    return {"latency": latency(lat), "cpu_s": meter.seconds}


def _producer(endpoint: str, header: bool, size: int, n: int, window_n: int | None = None) -> dict[str, Any]:
    import zmq

    s = _socket(endpoint, zmq.DEALER, b"P")
    pack = H_IN.pack
    unpack = (R_OUT if header else R_IN).unpack_from
    handle, blob = bytes(16), bytes(64)
    meter = CpuMeter()
    try:
        s.send_multipart([HELLO])
        if _recv(s)[0] != GO:
            raise RuntimeError("expected GO from the relay")

        def one(hid: int, timed: bool) -> None:
            s.send_multipart([HANDOFF, pack(hid, time.monotonic_ns() if timed else 0, size, 0), handle, blob])
            if unpack(_recv(s)[1])[0] != hid:
                raise RuntimeError(f"release {hid} out of order")

        for i in range(WARMUP):
            one(i, False)
        for i in range(n):
            time.sleep(PACE)  # idle between round trips, as in every latency row
            one(WARMUP + i, True)
        # The pipelined phase, bracketed: START went through the relay and the consumer and back.
        s.send_multipart([START])
        if _recv(s)[0] != START:
            raise RuntimeError("expected START back")
        meter.start()
        t0 = time.perf_counter()
        sent = done = 0
        w = window() if window_n is None else window_n
        while done < n:
            while sent < n and sent - done < w:
                s.send_multipart([HANDOFF, pack(sent, 0, size, 0), handle, blob])
                sent += 1
            if unpack(_recv(s)[1])[0] != done:
                raise RuntimeError(f"release {done} out of order")
            done += 1
        rate = n / (time.perf_counter() - t0)
        meter.stop()
        s.send_multipart([STOP])
        if _recv(s)[0] != STOP:  # back once the relay and the consumer stopped their meters
            raise RuntimeError("expected STOP back")
    finally:
        s.close()
    return {"per_s": round(rate), "cpu_s": meter.seconds, "window": w}


def bench_relay(tmp: Path, size: int, n: int, header: bool, window_n: int | None = None) -> dict[str, Any]:
    """One floor row: ``n`` paced handoffs for latency, ``n`` pipelined for the rate and the CPU, with
    ``window_n`` in flight (None: :func:`~.harness.window`, read in the producer's process)."""
    path = Path(tmp) / f"relay-{secrets.token_hex(4)}.sock"
    if len(str(path)) > IPC_PATH_MAX:
        raise ValueError(f"socket path too long for ipc:// ({len(str(path))} chars): {path}")
    ep = f"ipc://{path}"
    rp, rq = spawn(_relay, endpoint=ep, header=header)
    try:
        deadline = time.monotonic() + TIMEOUT_S
        while not path.exists():
            if not rp.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"relay did not start: {rq.get(timeout=1) if not rq.empty() else 'timeout'}")
            time.sleep(0.01)
        pr, cr = run_pair((_producer, {"endpoint": ep, "header": header, "size": size, "n": n,
                                       "window_n": window_n}),
                       (_consumer, {"endpoint": ep, "header": header}), timeout=3 * TIMEOUT_S)
        rr = rq.get(timeout=TIMEOUT_S)
        if "error" in rr:
            raise RuntimeError(rr["error"] + "\n" + rr.get("trace", ""))
    finally:
        rp.join(10)
        if rp.is_alive():
            rp.kill()
            rp.join(5)
        path.unlink(missing_ok=True)

    def per(cpu_s: float) -> float:
        return round(cpu_s / n * 1e6, 2) if math.isfinite(cpu_s) else float("nan")

    return {"name": "relay, struct header" if header else "relay, forwarding only",
            "what": "one-way; 4 messages per handoff", "size": size, "latency": cr["latency"],
            "per_s": int(pr["per_s"]),
            "cpu_us": {"producer": per(pr["cpu_s"]), "broker": per(rr["cpu_s"]), "consumer": per(cr["cpu_s"])},
            "messages_per_handoff": 4, "window": pr["window"]}
