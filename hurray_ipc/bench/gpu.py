"""The GPU rows of the benchmark, for scripts/gpu-check on a machine with a real GPU:
CUDA IPC handoff latency with the mapping cached (EVENT with one record-once event per handoff,
the default, and with re-recorded pooled events; PRODUCER_SYNCED), side by side with
torch.multiprocessing with CUDA tensors, and the producer-side stall of P1 vs P2.
Run: ``python -m hurray_ipc.bench.gpu`` (``HURRAY_CUDA=emulated`` runs it on the emulation, to
try the script; its figures mean nothing there)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from .stall import measure
from .suite import bench_hurray, bench_torch, machine, markdown


def main() -> int:
    env = {"HURRAY_CUDA": os.environ.get("HURRAY_CUDA", "real")}
    pooled = {**env, "HURRAY_EVENT_POOL": "1"}
    tmp = Path(tempfile.mkdtemp(prefix="hurray-gpu-bench-"))
    ep = f"ipc://{tmp}/broker.sock"
    broker = subprocess.Popen([sys.executable, "-m", "hurray_ipc.broker", "--endpoint", ep, "--log-level", "error"])
    rows = []
    try:
        while not (tmp / "broker.sock").exists():
            if broker.poll() is not None:
                raise RuntimeError("broker did not start")
            time.sleep(0.02)
        for size in (4 << 10, 1 << 20, 64 << 20):
            n = 200 if size <= 1 << 20 else 40
            for label, mode, e in (("EVENT", "EVENT", env), ("EVENT pooled events", "EVENT", pooled),
                                   ("PRODUCER_SYNCED", "PRODUCER_SYNCED", env)):
                rows.append(bench_hurray(ep, f"cuda ipc {label}", "cuda:0", "cuda:0", size, n, e, mode,
                                         broker_pid=broker.pid))
            rows.append(bench_torch(size, n, "cuda"))
    finally:
        broker.terminate()
        broker.wait(10)
    res = {"machine": machine(), "rows": rows}
    print(markdown(res))
    print(json.dumps({"stall": measure("cuda:0")}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
