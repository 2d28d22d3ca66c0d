"""hurray-bench --legs: one paced handoff's latency split by the process and hop it is spent in
(hurray_ipc/bench/legs.py)."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest

from hurray_ipc.bench import legs


def _stamps(n: int, steps_us: list[float]) -> dict[str, list[float]]:
    """Every point of every handoff, each leg taking its fixed step; handoff i starts at i ms."""
    points = [legs.LEGS[0][1]] + [b for _, _, b in legs.LEGS]
    out: dict[str, list[float]] = {p: [] for p in points}
    for i in range(legs.WARMUP + n):
        t = i * 1e-3
        out[points[0]].append(t)
        for p, step in zip(points[1:], steps_us, strict=False):
            t += step * 1e-6
            out[p].append(t)
    out["deliver_sent"] = [t + 3e-6 for t in out["deliver_send"]]  # the send call, inside "hop out"
    return out


def test_each_leg_is_the_time_between_its_two_points_and_the_total_spans_them_all():
    steps = [10.0, 20.0, 30.0, 5.0, 11.0, 13.0]
    res = legs.legs_of(_stamps(20, steps), 20)
    assert [res["legs"][leg]["p50"] for leg, _, _ in legs.LEGS] == steps
    assert res["total"]["p50"] == sum(steps)
    assert res["asides"]["broker send call"]["p50"] == 3.0  # beside the legs, not added to the total


def test_the_warm_up_handoffs_are_not_counted():
    stamps = _stamps(5, [10.0] * 6)
    stamps["received"][: legs.WARMUP] = [x + 1.0 for x in stamps["received"][: legs.WARMUP]]  # 1 s late
    assert legs.legs_of(stamps, 5)["legs"]["consumer"]["p90"] == 10.0


@pytest.mark.parametrize("point", ["send", "broker_in", "dispatched", "deliver_sent", "deliver_in", "received"])
def test_a_point_stamped_once_too_often_or_never_is_refused_rather_than_shifted(point):
    stamps = _stamps(5, [10.0] * 6)
    stamps[point].append(stamps[point][-1])
    with pytest.raises(RuntimeError, match="do not pair up"):
        legs.legs_of(stamps, 5)
    del stamps[point]
    with pytest.raises(RuntimeError, match="do not pair up"):
        legs.legs_of(stamps, 5)


def test_the_cli_splits_real_handoffs_into_every_leg_in_both_modes(tmp_path):
    """The wrapped functions are the library's real ones: renaming one makes its point unstamped,
    and the run fails here instead of reporting shifted legs."""
    r = subprocess.run([sys.executable, "-m", "hurray_ipc.cli.bench", "--legs", "--iterations", "40",
                        "--rounds", "1", "--quiet", "--out", str(tmp_path)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    res = json.loads((tmp_path / "legs.json").read_text())
    assert set(res["modes"]) == set(legs.MODES)
    for mode in legs.MODES:
        got = res["modes"][mode]
        assert list(got["legs"]) == [leg for leg, _, _ in legs.LEGS]
        # One clock for every process, and each point after the one before it.
        assert all(f["p10"] >= 0 for f in got["legs"].values()), got
        assert got["asides"]["broker send call"]["p10"] >= 0
        assert got["total"]["p50"] > 0
    assert math.isfinite(res["relay_p50_us"]) and res["relay_p50_us"] > 0
    assert "| broker dispatch |" in (tmp_path / "legs.md").read_text()
