"""Producer-side stall of SYNC_PRODUCER_SYNCED (host waits its stream) vs SYNC_EVENT (records an
event and returns). The same device work precedes each handoff; we time only the producer's
handoff step, which is what the mode changes. Run: ``python -m hurray_ipc.bench.stall``."""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from typing import Any

from ..devices import open_device


def measure(spec: str = "cuda:0", size: int = 64 << 20, work: int = 8, rounds: int = 30) -> dict[str, Any]:
    dev = open_device(spec)
    s = dev.create_stream()
    buf = dev.allocate(size)
    ev = dev.create_event(interprocess=True)
    out: dict[str, list[float]] = {"PRODUCER_SYNCED": [], "EVENT": []}
    for i in range(rounds):
        for mode in out:
            for k in range(work):  # the producer's writes: `work` passes over the buffer
                s.memset(buf, (i + k) & 0xFF)
            t0 = time.perf_counter()
            if mode == "PRODUCER_SYNCED":
                s.synchronize()
            else:
                ev.record(s)
            out[mode].append(time.perf_counter() - t0)
            s.synchronize()  # drain before the next round so both modes start alike
    ev.close()
    buf.close()
    s.close()
    med = {m: statistics.median(v) for m, v in out.items()}
    return {
        "device": dev.identity.spec, "emulated": dev.identity.emulated, "buffer_bytes": size,
        "work_passes": work, "rounds": rounds,
        "p50_stall_us": {m: round(v * 1e6, 2) for m, v in med.items()},
        "p1_over_p2": round(med["PRODUCER_SYNCED"] / max(med["EVENT"], 1e-9), 1),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--device", default="cuda:0")
    p.add_argument("--size", type=int, default=64 << 20)
    p.add_argument("--rounds", type=int, default=30)
    a = p.parse_args(argv)
    r = measure(a.device, a.size, rounds=a.rounds)
    print(json.dumps(r))
    print(f"producer stall p50: SYNC_PRODUCER_SYNCED {r['p50_stall_us']['PRODUCER_SYNCED']} us, "
          f"SYNC_EVENT {r['p50_stall_us']['EVENT']} us ({r['p1_over_p2']}x)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
