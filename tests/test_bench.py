"""hurray-bench runs end to end and writes its three outputs (tiny sizes; real runs: scripts/bench)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest


def test_bench_smoke(tmp_path):
    """Every row runs and reports; with ``--window 16`` (the default 8 is what every other run
    uses) the rows' processes, spawned by the rows, ran with that window and prefetch."""
    out = tmp_path / "res"
    argv = ["--sizes", "4K", "--iterations", "10", "--rounds", "1", "--window", "16", "--out", str(out), "--quiet"]
    r = subprocess.run([sys.executable, "-m", "hurray_ipc.cli.bench", *argv], capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr
    res = json.loads((out / "results.json").read_text())
    assert res["window"] == 16
    assert res["run"] == {"argv": argv, "seed": 0}
    commit = res["machine"]["commit"]
    if (Path(__file__).resolve().parents[1] / ".git").exists() and shutil.which("git"):  # a checkout: its HEAD
        assert commit is not None and len(commit.split("+")[0]) >= 7, commit
    assert f"code {commit or 'unknown'}." in (out / "results.md").read_text()
    windowed = [row for row in res["rows"] if "per_s" in row and "skipped" not in row]
    assert {"relay, forwarding only", "hurray cpu", "hurray cpu, send_many + receive_many", "hurray cpu, reused array",
            "multiprocessing.Queue + numpy", "shared_memory + names via Queue",
            "pyzmq ROUTER/DEALER echo (200 B)"} <= {row["name"] for row in windowed}
    # each Hurray row's producer and consumer read it in their own processes (a disagreement fails the row)
    assert all(row.get("window") == 16 for row in windowed), [(row["name"], row.get("window")) for row in windowed]
    rate = next(t for t in res["targets"] if t["target"].startswith("handoffs/s (window 16) >= 1.0x relay"))
    assert rate["met"] is None  # the issues set it at window 8: reported, not judged
    assert "window 16;" in (out / "results.md").read_text()
    names = {row["name"] for row in res["rows"]}
    assert {"pyzmq ROUTER/DEALER echo (200 B)", "relay, forwarding only", "relay, struct header", "hurray cpu",
            "hurray emulated cuda", "multiprocessing.Queue + numpy", "shared_memory + names via Queue",
            "host-staged copy vs memcpy", "hurray cpu, new array per send", "hurray cpu, reused array",
            "hurray cpu, send_many", "hurray cpu, send_many + receive_many"} <= names
    failed = [row for row in res["rows"] if str(row.get("skipped", "")).startswith("failed")]
    assert not failed, failed
    assert any(t["target"].startswith("one-way p50 <= 1.2x relay") and t["issue"] == 24 for t in res["targets"])
    assert "| target | issue | measured | met |" in (out / "results.md").read_text()
    cpu = next(r for r in res["rows"] if r["name"] == "hurray cpu")
    assert set(cpu["cpu_us"]) == {"producer", "broker", "consumer"} and cpu["messages_per_handoff"] > 0
    assert "| benchmark |" in (out / "results.md").read_text()
    host = [r for r in res["rows"] if r["name"] in ("hurray cpu, new array per send", "hurray cpu, reused array")]
    assert len(host) == 2 and all(r["latency"]["p50_us"] > 0 and r["per_s"] > 0 for r in host), host
    # 10 warm-up + 2 x 10 sends of one size: at most a window's worth (16) of pooled slots, not a
    # segment per send (30)
    assert all(0 < r["segments"] <= 16 for r in host), [r["segments"] for r in host]
    torch_rows = [r for r in res["rows"] if r["name"].startswith("torch.multiprocessing Queue (cpu tensor")]
    if all("skipped" not in r for r in torch_rows):  # torch is optional
        assert len(torch_rows) == 2
        assert {t["target"].split(" p50")[0] for t in res["targets"] if "torch.multiprocessing" in t["target"]} == {
            "new host array per send", "reused host array"}


def test_window_out_of_range_is_refused_before_anything_runs(tmp_path):
    for argv, env, needle in ((["--window", "0"], {}, "--window: an integer in 1-64, got 0"),
                              (["--window", "65"], {}, "--window: an integer in 1-64, got 65"),
                              (["--window", "8", "--scaling"], {}, "--scaling keeps its own (8)"),
                              ([], {"HURRAY_BENCH_WINDOW": "many"}, "HURRAY_BENCH_WINDOW: the window is an integer"),
                              ([], {"HURRAY_BENCH_WINDOW": "65"}, "(got '65'): unset it, or pass --window")):
        r = subprocess.run([sys.executable, "-m", "hurray_ipc.cli.bench", "--sizes", "4K", "--out",
                            str(tmp_path / "res"), *argv], capture_output=True, text=True, timeout=60,
                           env={**os.environ, **env})
        assert r.returncode == 2 and needle in r.stderr, (argv, env, r.stderr)
        assert not (tmp_path / "res").exists()


def _row(name, rnd, p50, per_s, size=4096):
    return {"name": name, "size": size, "round": rnd, "latency": {"p50_us": p50}, "per_s": per_s}


def test_targets_are_issue_24s_where_it_set_them():
    """The relay ratios of the plain send row are judged by issue 24's bounds (p50 <= 1.2x, rate
    >= 1.0x), not issue 11's looser ones (1.5x, 0.5x) that it replaced: a row at 1.4x the relay's p50
    and 0.6x its rate met issue 11's and meets neither of issue 24's. Per-round ratios, medians."""
    from hurray_ipc.bench.suite import targets

    relay, hurray, emu = "relay, forwarding only", "hurray cpu", "hurray emulated cuda"
    raw = []
    for rnd, (rp50, rrate) in enumerate([(100.0, 10_000), (200.0, 5_000), (150.0, 8_000)]):
        raw += [_row(relay, rnd, rp50, rrate), _row(hurray, rnd, rp50 * 1.4, rrate * 0.6),
                _row(emu, rnd, rp50 * 1.4 * 1.25, rrate * 0.6 * 0.8)]
    got = {t["target"].rsplit(" (", 1)[0]: t for t in targets(raw)}
    p50, rate = got["one-way p50 <= 1.2x relay"], got["handoffs/s (window 8) >= 1.0x relay"]
    assert (p50["value"], p50["met"], p50["issue"]) == (1.4, False, 24)
    assert (rate["value"], rate["met"], rate["issue"]) == (0.6, False, 24)
    assert not any("0.5x relay" in k or "1.5x relay" in k for k in got), sorted(got)
    emu_p50, emu_rate = got["emulated CUDA p50 <= 1.3x cpu"], got["emulated CUDA handoffs/s >= 1/1.3x cpu"]
    assert (emu_p50["value"], emu_p50["met"], emu_p50["issue"]) == (1.25, True, 24)
    assert (emu_rate["value"], emu_rate["met"]) == (0.8, True)
    # the same rows at issue 24's bounds exactly meet them
    raw = [_row(relay, 0, 100.0, 10_000), _row(hurray, 0, 120.0, 10_000)]
    got = {t["target"].rsplit(" (", 1)[0]: t for t in targets(raw)}
    assert got["one-way p50 <= 1.2x relay"]["met"] and got["handoffs/s (window 8) >= 1.0x relay"]["met"]


def test_window_reads_the_environment_each_call(monkeypatch):
    from hurray_ipc.bench.harness import WINDOW, window
    from hurray_ipc.errors import InvalidArgument

    monkeypatch.delenv("HURRAY_BENCH_WINDOW", raising=False)
    assert window() == WINDOW == 8
    for ok in ("1", "64", "16"):
        monkeypatch.setenv("HURRAY_BENCH_WINDOW", ok)
        assert window() == int(ok)
    for bad in ("0", "65", "-1", "8.5", ""):
        monkeypatch.setenv("HURRAY_BENCH_WINDOW", bad)
        with pytest.raises(InvalidArgument, match="HURRAY_BENCH_WINDOW"):
            window()


def test_pipelined_targets_are_not_judged_at_another_window():
    """The issues set the rate and CPU targets at window 8: at 64 they are reported, met None."""
    from hurray_ipc.bench.suite import targets

    raw = [_row("relay, forwarding only", 0, 100.0, 10_000), _row("hurray cpu", 0, 110.0, 20_000)]
    at8 = {t["target"]: t for t in targets(raw)}
    at64 = {t["target"]: t for t in targets(raw, at_window=64)}
    assert at8["handoffs/s (window 8) >= 1.0x relay (4096 B, cpu)"]["met"] is True
    assert at64["handoffs/s (window 64) >= 1.0x relay (4096 B, cpu)"]["met"] is None
    assert at64["one-way p50 <= 1.2x relay (4096 B, cpu)"]["met"] is True  # paced: no window in it
