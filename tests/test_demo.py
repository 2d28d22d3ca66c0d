"""The demo (``scripts/demo``, ``python -m hurray_ipc.demo``) end to end, and every command line it
prints works when pasted into the shell it ran from (issue 21): where the demo chose the CUDA
emulation (no GPU here), that line starts with HURRAY_CUDA=emulated, and pasted it prints what the
demo printed under it."""

from __future__ import annotations

import os
import re
import subprocess
import sys


def fresh_shell() -> dict[str, str]:
    """A shell's environment with no HURRAY_* variable and this project's tools on PATH."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("HURRAY_")}
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")
    return env


def shown_commands(out: str) -> list[tuple[str, list[str], int]]:
    """(command line, the output the demo printed under it, its exit status) for every '$ ' line:
    the output runs to the next command, a blank line or a '==' heading; '(exit N)' is the status."""
    found: list[tuple[str, list[str], list[int]]] = []
    current: tuple[str, list[str], list[int]] | None = None
    for line in out.splitlines():
        if line.startswith("$ "):
            current = (line[2:], [], [0])
            found.append(current)
        elif current is None:
            continue
        elif m := re.fullmatch(r"\(exit (\d+)\)", line):
            current[2][0] = int(m[1])
            current = None
        elif not line or line.startswith("=="):
            current = None
        else:
            current[1].append(line)
    return [(cmd, lines, status[0]) for cmd, lines, status in found]


def test_demo_passes_and_each_command_it_prints_works_pasted():
    shell = fresh_shell()
    r = subprocess.run([sys.executable, "-m", "hurray_ipc.demo", "--count", "2"], env=shell, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    shown = shown_commands(r.stdout)
    assert len(shown) == 5 and sum("hurray-caps" in cmd for cmd, _, _ in shown) == 2, r.stdout
    for cmd, lines, status in shown:
        pasted = subprocess.run(["bash", "-c", cmd], env=shell, capture_output=True, text=True, timeout=120)
        assert (pasted.returncode, pasted.stdout.splitlines()) == (status, lines), (cmd, pasted.stderr)
