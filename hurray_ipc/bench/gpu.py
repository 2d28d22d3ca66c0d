"""The GPU rows of the benchmark, for scripts/gpu-check on a machine with a real GPU:
CUDA IPC handoff latency with the mapping cached (EVENT and PRODUCER_SYNCED), against
torch.multiprocessing with CUDA tensors, and the producer-side stall of P1 vs P2.
Run: ``python -m hurray_ipc.bench.gpu``."""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from .stall import measure
from .suite import bench_hurray, bench_torch, machine, markdown


def main() -> int:
    env = {"HURRAY_CUDA": "real"}
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
            for mode in ("EVENT", "PRODUCER_SYNCED"):
                rows.append(bench_hurray(ep, f"cuda ipc {mode}", "cuda:0", "cuda:0", size, n, env, mode))
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
