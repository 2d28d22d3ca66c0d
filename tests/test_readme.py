"""The README's first snippet works as written after its set-up command (issue 21).

The "Your first handoff" shell block runs verbatim in bash (with a temporary XDG_RUNTIME_DIR, so
its broker is this test's own), and the Python blocks shown beside it are the shipped examples.
"""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()
SECTION = README[README.index("### Your first handoff"):]
SECTION = SECTION[:SECTION.index("\n## ")]


def blocks(lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", SECTION, re.S)


def code_lines(text: str) -> list[str]:
    """The lines of a program without its docstring, comments-only lines kept."""
    text = re.sub(r'^""".*?"""\n', "", text, flags=re.S)
    return [ln for ln in text.splitlines() if ln.strip() and not ln.startswith("# examples/")]


@pytest.mark.parametrize("name", ["producer", "consumer"])
def test_the_readme_shows_the_shipped_examples(name):
    shown = [b for b in blocks("python") if b.startswith(f"# examples/{name}.py")]
    assert len(shown) == 1
    assert code_lines(shown[0]) == code_lines((ROOT / "examples" / f"{name}.py").read_text())


@pytest.mark.skipif(not (ROOT / ".venv" / "bin" / "activate").exists(),
                    reason="the README's set-up command (scripts/demo or scripts/test) made no .venv here")
def test_the_first_handoff_runs_as_written(tmp_path):
    (script,) = blocks("sh")
    env = {k: v for k, v in os.environ.items() if not k.startswith("HURRAY_")}
    env["XDG_RUNTIME_DIR"] = str(tmp_path)
    venv = ROOT / ".venv" / "bin"
    try:
        r = subprocess.run(["bash", "-c", script + "\nwait $! || exit 1\n"], cwd=ROOT, env=env, capture_output=True,
                           text=True, timeout=90)
    finally:
        subprocess.run([str(venv / "hurray-broker"), "--stop"], env=env, capture_output=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    lines = r.stdout.splitlines()
    assert lines[0].startswith("hurray-broker: running at ipc://") and str(tmp_path) in lines[0]
    assert lines[1:] == [f"{i} {[[float(i)] * 3] * 2}" for i in range(5)], r.stdout
    assert "Traceback" not in r.stderr and "Warning" not in r.stderr, r.stderr
