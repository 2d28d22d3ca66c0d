"""hurray-bench runs end to end and writes its three outputs (tiny sizes; real runs: scripts/bench)."""

from __future__ import annotations

import json
import subprocess
import sys


def test_bench_smoke(tmp_path):
    out = tmp_path / "res"
    r = subprocess.run([sys.executable, "-m", "hurray_ipc.cli.bench", "--sizes", "4K", "--iterations", "10",
                        "--rounds", "1", "--out", str(out), "--quiet"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    res = json.loads((out / "results.json").read_text())
    names = {row["name"] for row in res["rows"]}
    assert {"pyzmq ROUTER/DEALER echo (200 B)", "relay, forwarding only", "relay, struct header", "hurray cpu",
            "hurray emulated cuda", "multiprocessing.Queue + numpy", "shared_memory + names via Queue",
            "host-staged copy vs memcpy"} <= names
    failed = [row for row in res["rows"] if str(row.get("skipped", "")).startswith("failed")]
    assert not failed, failed
    assert any(t["target"].startswith("one-way p50 <= 1.5x relay") for t in res["targets"])
    cpu = next(r for r in res["rows"] if r["name"] == "hurray cpu")
    assert set(cpu["cpu_us"]) == {"producer", "broker", "consumer"} and cpu["messages_per_handoff"] > 0
    assert "| benchmark |" in (out / "results.md").read_text()
