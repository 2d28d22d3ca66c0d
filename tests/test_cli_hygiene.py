"""The command lines behave like Unix tools (issue 12, first part): --version everywhere, bad
arguments refused in one line with exit status 2 before anything runs, a hint where CUDA is
missing; the library refuses an endpoint without a scheme with the same words."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from hurray_ipc import __version__

ROOT = Path(__file__).resolve().parents[1]
CLIS = {"hurray-broker": "hurray_ipc.broker", "hurray-caps": "hurray_ipc.cli.caps",
        "hurray-inspect": "hurray_ipc.cli.inspect", "hurray-stress": "hurray_ipc.cli.stress",
        "hurray-bench": "hurray_ipc.cli.bench", "hurray-top": "hurray_ipc.cli.top"}


def run(module: str, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", module, *args], capture_output=True, text=True, timeout=60,
                          env=env)


@pytest.mark.parametrize("prog", sorted(CLIS))
def test_version(prog):
    r = run(CLIS[prog], "--version")
    assert r.returncode == 0 and r.stdout.strip() == f"{prog} {__version__}", (r.stdout, r.stderr)


@pytest.mark.parametrize(("module", "args", "says"), [
    ("hurray_ipc.broker", ["--endpoint", "/tmp/hurray-no-scheme.sock"], "did you mean ipc:///tmp/hurray-no-scheme.sock"),
    ("hurray_ipc.broker", ["--log-level", "chatty"], "invalid choice: 'chatty'"),
    ("hurray_ipc.broker", ["--import-device", "gpu"], "'gpu' is not a device"),
    ("hurray_ipc.cli.caps", ["--device", "cuda0"], "'cuda0' is not a device"),
    ("hurray_ipc.cli.caps", ["--device", "cpu", "--broker", "localhost:5555"], "is not a ZeroMQ endpoint"),
    ("hurray_ipc.cli.stress", ["--mode", "bogus"], "unknown sync mode 'bogus'"),
    ("hurray_ipc.cli.stress", ["--producers", "0"], "0 is not a positive integer"),
    ("hurray_ipc.cli.top", ["--interval", "0"], "0 is not a positive number of seconds"),
    ("hurray_ipc.cli.top", ["--endpoint", "broker.sock"], "is not a ZeroMQ endpoint"),
    ("hurray_ipc.broker", ["--metrics-port", "70000"], "70000 is not a port number"),
])
def test_bad_arguments_are_one_line_and_exit_2(module, args, says):
    r = run(module, *args)
    assert r.returncode == 2, r
    assert "Traceback" not in r.stderr and says in r.stderr.strip().splitlines()[-1], r.stderr


def test_caps_without_a_gpu_names_the_emulation():
    env = {k: v for k, v in os.environ.items() if k != "HURRAY_CUDA"}
    r = run("hurray_ipc.cli.caps", "--device", "cuda:0", env=env)
    if r.returncode == 0:
        pytest.skip("this machine has a CUDA device")
    assert r.returncode == 2 and "HURRAY_CUDA=emulated" in r.stderr and "Traceback" not in r.stderr, r.stderr


@pytest.mark.parametrize(("device", "backend"), [("cpu", None), ("cpu", "emulated"), ("cuda:1", "real")])
def test_stress_refuses_an_injection_it_could_not_catch(device, backend):
    """--inject breaks a GPU sync rule on purpose; only the CUDA emulation's checker fails such a run
    every time. Anywhere else the run could print PASS: refused before anything starts, naming the fix."""
    env = {k: v for k, v in os.environ.items() if k != "HURRAY_CUDA"} | ({"HURRAY_CUDA": backend} if backend else {})
    r = run("hurray_ipc.cli.stress", "--device", device, "--inject", "skip-wait", env=env)
    assert r.returncode == 2 and r.stdout == "" and len(r.stderr.strip().splitlines()) == 1, r
    fix = f"HURRAY_CUDA=emulated hurray-stress --device {'cuda:0' if device == 'cpu' else device} --inject skip-wait"
    assert r.stderr.startswith("hurray-stress: --inject skip-wait: ") and r.stderr.strip().endswith(f"run {fix}"), r
    assert f"not --device {device}" in r.stderr


def test_library_refuses_an_endpoint_without_a_scheme():
    from hurray_ipc.client import Producer

    with pytest.raises(ValueError, match="is not a ZeroMQ endpoint"):
        Producer(endpoint="nonsense")


def test_wheel_installs_only_hurray_ipc_and_builds_quietly(tmp_path: Path) -> None:
    """The broker/ folder ships as hurray_ipc.broker (nothing generic at the top of site-packages),
    and building the wheel prints no setuptools deprecation warning (SPDX license string)."""
    src = tmp_path / "src"  # a copy: building in place would leave build/ in the checkout
    shutil.copytree(ROOT, src, ignore=shutil.ignore_patterns(".venv", ".git", "build", "results", "*.egg-info",
                                                             "__pycache__", ".whl"))
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                        "--disable-pip-version-check", "-w", str(tmp_path), str(src)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "Deprecat" not in r.stderr + r.stdout, r.stderr
    (wheel,) = tmp_path.glob("hurray_ipc-*.whl")
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
    tops = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
    assert tops == {"hurray_ipc"}, tops
    assert "hurray_ipc/broker/core.py" in names and "hurray_ipc/interop/dlpack.py" in names


def test_python_m_hurray_ipc_broker_is_the_broker() -> None:
    r = subprocess.run([sys.executable, "-m", "hurray_ipc.broker", "--help"], capture_output=True, text=True,
                       timeout=60, cwd="/")
    assert r.returncode == 0 and "--endpoint" in r.stdout, r.stderr


def test_stress_help_shows_defaults_and_the_duration_rule():
    r = run("hurray_ipc.cli.stress", "--help")
    text = " ".join(r.stdout.split())
    assert r.returncode == 0 and "--count COUNT handoffs in total (default: 200)" in text, r.stdout
    assert "(default: cpu)" in text and "(default: 0.0)" in text and "wall time of the whole run" in text, r.stdout
