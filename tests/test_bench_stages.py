"""hurray-bench --stages: each stage's CPU per handoff, measured alone (hurray_ipc/bench/stages.py)."""

from __future__ import annotations

import json
import subprocess
import sys

from hurray_ipc.bench import stages


def test_each_stage_runs_its_handoffs_and_reports_a_positive_cpu_figure():
    for name, stage in {**stages.STAGES, stages.FLOOR: stages.socket_floor}.items():
        fig = stage(300)
        assert 0 < fig.us < 10_000, (name, fig)
        if name == stages.FLOOR:
            assert fig.messages == 2.0, fig  # one out and one back per handoff, by construction
        elif name != "broker":  # messages are counted (a batch of DELIVERs is one), a few per handoff at most
            assert fig.messages is not None and 0 < fig.messages <= 4.0, (name, fig)


def test_the_cli_writes_the_table_of_pure_and_compiled_side_by_side(tmp_path):
    r = subprocess.run([sys.executable, "-m", "hurray_ipc.cli.bench", "--stages", "--iterations", "300",
                        "--rounds", "1", "--quiet", "--out", str(tmp_path)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    res = json.loads((tmp_path / "stages.json").read_text())
    assert [row["stage"] for row in res["rows"]] == list(stages.STAGES)
    assert all(row["pure_us"] > 0 for row in res["rows"])
    if "compiled" in res["compiled"].values():
        assert all(row["compiled_us"] > 0 and row["compiled_over_pure"] > 0 for row in res["rows"])
    assert res["raw"][stages.FLOOR] and res["floor_us"] > 0 and res["floor_messages_per_handoff"] == 2.0
    assert all(row["messages_per_handoff"] > 0 for row in res["rows"] if row["stage"] != "broker")
    md = (tmp_path / "stages.md").read_text()
    assert "| broker |" in md and "Socket floor of the client stages" in md and "- consumer: " in md
