"""The floor rows (raw pyzmq through a relay process) run end to end and return a well-formed row.
Shape and sanity only: no timing assertions."""

from __future__ import annotations

import math
import tempfile
import time
from pathlib import Path

import pytest

from hurray_ipc.bench.floor import CpuMeter, bench_relay


def _positive(x: object) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool) and math.isfinite(x) and x > 0


@pytest.mark.parametrize("header", [False, True], ids=["forwarding", "struct"])
def test_relay_row(header: bool) -> None:
    # A short folder of our own: pytest's tmp_path can exceed the ipc:// path limit.
    with tempfile.TemporaryDirectory(prefix="hfloor-") as d:
        tmp = Path(d)
        t = time.monotonic()
        row = bench_relay(tmp, 4096, 30, header=header)
        elapsed = time.monotonic() - t
        assert not list(tmp.glob("relay-*.sock")), "the socket file was not cleaned up"
    assert elapsed < 30, elapsed
    assert row["name"] == ("relay, struct header" if header else "relay, forwarding only")
    assert row["what"] == "one-way; 4 messages per handoff"
    assert row["size"] == 4096
    assert row["messages_per_handoff"] == 4
    lat = row["latency"]
    assert set(lat) == {"p50_us", "p99_us", "n"}
    assert lat["n"] == 30
    assert _positive(lat["p50_us"]) and _positive(lat["p99_us"]) and lat["p99_us"] >= lat["p50_us"]
    assert isinstance(row["per_s"], int) and row["per_s"] > 0
    assert set(row["cpu_us"]) == {"producer", "broker", "consumer"}
    assert all(_positive(v) for v in row["cpu_us"].values()), row["cpu_us"]


def test_cpu_meter() -> None:
    m = CpuMeter().start()
    x = 0
    for i in range(200_000):
        x += i
    s = m.stop()
    assert _positive(s) and s == m.seconds
    with pytest.raises(RuntimeError):
        m.stop()
    with CpuMeter() as m2:
        sum(range(100_000))
    assert _positive(m2.seconds)
