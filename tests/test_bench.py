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
            "host-staged copy vs memcpy", "hurray cpu, new array per send", "hurray cpu, reused array",
            "hurray cpu, send_many", "hurray cpu, send_many + receive_many"} <= names
    failed = [row for row in res["rows"] if str(row.get("skipped", "")).startswith("failed")]
    assert not failed, failed
    assert any(t["target"].startswith("one-way p50 <= 1.5x relay") for t in res["targets"])
    cpu = next(r for r in res["rows"] if r["name"] == "hurray cpu")
    assert set(cpu["cpu_us"]) == {"producer", "broker", "consumer"} and cpu["messages_per_handoff"] > 0
    assert "| benchmark |" in (out / "results.md").read_text()
    host = [r for r in res["rows"] if r["name"] in ("hurray cpu, new array per send", "hurray cpu, reused array")]
    assert len(host) == 2 and all(r["latency"]["p50_us"] > 0 and r["per_s"] > 0 for r in host), host
    # 10 warm-up + 2 x 10 sends of one size: a window's worth of pooled slots, not a segment per send
    assert all(0 < r["segments"] <= 8 for r in host), [r["segments"] for r in host]
    torch_rows = [r for r in res["rows"] if r["name"].startswith("torch.multiprocessing Queue (cpu tensor")]
    if all("skipped" not in r for r in torch_rows):  # torch is optional
        assert len(torch_rows) == 2
        assert {t["target"].split(" p50")[0] for t in res["targets"] if "torch.multiprocessing" in t["target"]} == {
            "new host array per send", "reused host array"}
