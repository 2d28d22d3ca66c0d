"""hurray-bench's scaling table: its shape and counts at tiny sizes, and its target's arithmetic."""

from __future__ import annotations

import pytest

from hurray_ipc.bench.harness import WINDOW
from hurray_ipc.bench.scaling import configurations, ideal_ratio, run_scaling, scaling_targets
from hurray_ipc.bench.suite import machine, markdown
from hurray_ipc.errors import InvalidArgument


def test_scaling_table_small():
    """1x1 and 2x2 on one and two channels: every handoff (warm-up included) reached a consumer, and
    every figure is there and positive. 1000 handoffs each: the broker's CPU counts in 10 ms ticks."""
    sc = run_scaling([1, 2], channels=2, handoffs=1000, rounds=1)
    rows = sc["rows"]
    assert [(r["producers"], r["consumers"], r["channels"]) for r in rows] == [(1, 1, 1), (2, 2, 1), (2, 2, 2)]
    for r in rows:
        assert "skipped" not in r, r
        assert r["handoffs"] == 1000
        assert r["received"] == r["handoffs"] + r["producers"] * WINDOW, r
        for k in ("per_s", "broker_cpu_us", "broker_share", "broker_rss_kib", "producer_cpu_us"):
            assert r[k] > 0, (k, r)
    assert [t["target"].split(" ", 1)[0] for t in sc["targets"]] == ["2x2"]
    md = markdown({"machine": machine(), "rounds": 1, "rows": [], "raw": [], "targets": [], "scaling": sc})
    assert "### Scaling" in md and md.count("| 2 x 2 |") == 2 and "| 1 x 1 | 1 |" in md


def test_configurations_spread_no_wider_than_n():
    assert configurations([1, 4, 16], 16) == [(1, 1), (4, 1), (4, 4), (16, 1), (16, 16)]
    assert configurations([16], 4) == [(16, 1), (16, 4)]


def test_ideal_ratio_and_target_from_fixed_rows():
    # 1x1 at 6000/s with the broker at 0.4 of a core would reach 15000/s on a whole core.
    assert ideal_ratio(4500, 6000, 0.4) == pytest.approx(0.3)
    assert ideal_ratio(12000, 6000, 0.4) == pytest.approx(0.8)

    def row(n, ch, rnd, per_s, share):
        return {"name": f"{n}x{n}", "producers": n, "channels": ch, "round": rnd, "per_s": per_s,
                "broker_share": share}

    raw = [row(1, 1, 0, 6000, 0.4), row(4, 1, 0, 12000, 0.9), row(4, 4, 0, 99999, 1.0),
           row(1, 1, 1, 5000, 0.5), row(4, 1, 1, 9000, 0.9), {"name": "4x4", "producers": 4, "channels": 1,
                                                               "round": 2, "skipped": "failed: x"}]
    # round 0: 12000 / 15000 = 0.8; round 1: 9000 / 10000 = 0.9; the spread row and the failed one do not count
    assert scaling_targets(raw) == [{"target": "4x4 on one channel >= 0.8x the 1x1 rate / the broker's share "
                                               "of one core in 1x1", "value": 0.85, "met": True,
                                    "issue": 24}]
    assert scaling_targets([row(1, 1, 0, 6000, 0.4)]) == []


def test_bad_inputs_are_typed():
    with pytest.raises(InvalidArgument, match="broker_share_1x1"):
        ideal_ratio(1, 1, 0)
    with pytest.raises(InvalidArgument, match="counts"):
        run_scaling([0])
    with pytest.raises(InvalidArgument, match="rounds"):
        run_scaling([1], rounds=0)
