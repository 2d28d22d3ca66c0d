"""The command lines behave like Unix tools (issue 12, first part): --version everywhere, bad
arguments refused in one line with exit status 2 before anything runs, a hint where CUDA is
missing; the library refuses an endpoint without a scheme with the same words."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import textwrap
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
    ("hurray_ipc.cli.caps", ["--device", "cpu", "--channel", "first"], "add --broker ENDPOINT"),  # was ignored
    ("hurray_ipc.cli.stress", ["--mode", "bogus"], "unknown sync mode 'bogus'"),
    ("hurray_ipc.cli.stress", ["--producers", "0"], "0 is not a positive integer"),
    # Each of these used to run, and then report its own workload as corrupt or FAIL (exit 1):
    ("hurray_ipc.cli.stress", ["--size", "8"], "at least 16 bytes"),
    ("hurray_ipc.cli.stress", ["--size", "-5"], "'-5' is not a byte count"),
    ("hurray_ipc.cli.stress", ["--duration", "0"], "0 is not a finite number > 0"),
    ("hurray_ipc.cli.stress", ["--mode", "SYNC_EVENT"], "a cpu buffer is always SYNC_PRODUCER_SYNCED"),
    ("hurray_ipc", ["demo", "--count", "0"], "0 is not a positive integer"),
    ("hurray_ipc", ["demo", "--size", "15"], "at least 16 bytes"),
    # ... and these hung (size 0: the mp.Queue row) or printed a traceback:
    ("hurray_ipc.cli.bench", ["--sizes", "4K,0"], "sizes of at least 1 byte"),
    ("hurray_ipc.cli.bench", ["--sizes", "4Q"], "size '4Q' is not a byte count"),
    ("hurray_ipc.cli.bench", ["--iterations", "0"], "0 is not a positive integer"),
    ("hurray_ipc.cli.bench", ["--render", "/nonexistent/results.json"], "No such file or directory"),
    ("hurray_ipc.cli.top", ["--interval", "0"], "0 is not a finite number > 0"),
    ("hurray_ipc.cli.top", ["--interval", "inf"], "inf is not a finite number > 0"),  # it polled never
    ("hurray_ipc.cli.top", ["--once", "--json"], "not allowed with argument"),  # --json won silently
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


@pytest.fixture(scope="module")
def built_wheel(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """The wheel, built once for this module's tests from a copy of the tree (building in place
    would leave build/ in the checkout), and what pip printed while building it."""
    tmp = tmp_path_factory.mktemp("wheel")
    src = tmp / "src"
    shutil.copytree(ROOT, src, ignore=shutil.ignore_patterns(".venv", ".git", "build", "results", "*.egg-info",
                                                             "__pycache__", ".whl", "*.so"))
    # HURRAY_COMPILE=0: these tests read the wheel's layout and metadata; the compiled build is
    # what scripts/test installs (tests/test_compiled.py), and mypyc takes a minute on 2 busy cores.
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                        "--disable-pip-version-check", "-w", str(tmp), str(src)],
                       capture_output=True, text=True, timeout=120, env={**os.environ, "HURRAY_COMPILE": "0"})
    assert r.returncode == 0, r.stderr
    (wheel,) = tmp.glob("hurray_ipc-*.whl")
    return wheel, r.stderr + r.stdout


def _metadata(wheel: Path) -> str:
    with zipfile.ZipFile(wheel) as z:
        (name,) = [n for n in z.namelist() if n.endswith(".dist-info/METADATA")]
        return z.read(name).decode()


def test_wheel_installs_only_hurray_ipc_and_builds_quietly(built_wheel: tuple[Path, str]) -> None:
    """The broker ships as hurray_ipc.broker (nothing generic at the top of site-packages but the
    compiled modules' runtime library),
    and building the wheel prints no setuptools deprecation warning (SPDX license string)."""
    wheel, printed = built_wheel
    assert "Deprecat" not in printed, printed
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
    tops = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
    # Where a C compiler built the hot path (hurray_ipc/compiled.py), mypyc's shared library of the
    # compiled group sits at the top, named by a hash of the group: nothing else may.
    runtime = {t for t in tops if re.fullmatch(r"[0-9a-f]{20}__mypyc\.[\w.-]+\.so", t)}
    assert tops - runtime == {"hurray_ipc"} and len(runtime) <= 1, tops
    assert "hurray_ipc/broker/core.py" in names and "hurray_ipc/interop/dlpack.py" in names
    packages = {str(p.parent.relative_to(ROOT)) for p in (ROOT / "hurray_ipc").rglob("__init__.py")}
    missing = sorted(p for p in packages if f"{p}/__init__.py" not in names)
    assert not missing, f"packages of the tree the wheel leaves out: {missing}"



def test_wheel_metadata_keeps_cuda_in_the_cuda_extras(built_wheel: tuple[Path, str]) -> None:
    """A CPU-only `pip install hurray-ipc` gets no CUDA package; cuda12/cuda13 pin cuda-bindings to
    the driver's major version."""
    meta = _metadata(built_wheel[0])
    cuda = {}
    for line in meta.splitlines():
        if line.startswith("Requires-Dist:"):
            req, _, marker = line.removeprefix("Requires-Dist:").strip().partition(";")
            if "cuda" in re.split(r"[<>=!~\[ ]", req, maxsplit=1)[0].lower():
                cuda[req.strip()] = marker.strip()
    assert cuda == {"cuda-bindings<13,>=12.8": 'extra == "cuda12"',
                    "cuda-bindings<14,>=13.0": 'extra == "cuda13"'}, cuda



def test_wheel_long_description_is_the_package_index_page(built_wheel: tuple[Path, str]) -> None:
    """The package index shows docs/package-index.md: install lines per driver, the broker, and
    nothing a wheel user cannot follow (no scripts/, nothing outside the repository)."""
    meta = _metadata(built_wheel[0])
    headers, _, body = meta.partition("\n\n")
    assert "Description-Content-Type: text/markdown" in headers
    assert body.strip() == (ROOT / "docs" / "package-index.md").read_text().strip()
    for absent in ("scripts/", "../shared"):
        assert absent not in body, f"the package-index description mentions {absent!r}"
    for present in ("pip install hurray-ipc", "pip install 'hurray-ipc[cuda12]'", "pip install 'hurray-ipc[cuda13]'",
                    "hurray-caps --install-hint", "hurray-broker --daemon", "python -m hurray_ipc demo"):
        assert present in body, f"the package-index description lacks {present!r}"


def test_package_index_example_runs(tmp_path: Path) -> None:
    """The producer/consumer example of docs/package-index.md, as written, against a broker."""
    from brokerproc import BrokerProcess

    text = (ROOT / "docs" / "package-index.md").read_text()
    blocks = {b.split("\n", 1)[0].strip("# "): b for b in re.findall(r"```python\n(.*?)```", text, re.S)}
    assert set(blocks) == {"producer.py", "consumer.py"}, blocks.keys()
    for name, code in blocks.items():
        (tmp_path / name).write_text(code)
    broker = BrokerProcess(f"ipc://{tmp_path}/b.sock").start()
    try:
        env = {**os.environ, "HURRAY_BROKER": broker.endpoint}
        consumer = subprocess.Popen([sys.executable, "consumer.py"], cwd=tmp_path, env=env, text=True,
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        producer = subprocess.run([sys.executable, "producer.py"], cwd=tmp_path, env=env, text=True,
                                  capture_output=True, timeout=60)
        out, err = consumer.communicate(timeout=60)
    finally:
        broker.stop()
    assert producer.returncode == 0, producer.stderr
    assert consumer.returncode == 0, err
    assert out.splitlines() == [f"(480, 640) float32 {i}.0" for i in range(3)], out + err

def test_wheel_ships_its_types(built_wheel: tuple[Path, str], tmp_path: Path) -> None:
    """PEP 561: installed from the wheel (into a fresh venv, without dependencies), hurray_ipc's
    types reach mypy: a user program that misuses Producer.send's return type is reported, one that
    uses Producer and Consumer correctly passes."""
    pytest.importorskip("mypy", reason="mypy is in the test extra")
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=60)
    purelib = "import sysconfig; print(sysconfig.get_paths()['purelib'])"
    site = subprocess.run([str(venv / "bin" / "python"), "-c", purelib], capture_output=True, text=True,
                          check=True, timeout=60).stdout.strip()
    r = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-compile",
                        "--disable-pip-version-check", "--target", site, str(built_wheel[0])],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    (tmp_path / "good.py").write_text(textwrap.dedent("""
        from hurray_ipc import Consumer, Producer, Ticket


        def produce(data: bytes) -> Ticket:
            with Producer(channel="frames") as p:
                return p.send(data)


        def consume() -> bytes:
            with Consumer(channel="frames") as c, c.receive(timeout=5) as h:
                return bytes(h.numpy())
    """))
    (tmp_path / "bad.py").write_text(textwrap.dedent("""
        from hurray_ipc import Producer

        with Producer(channel="frames") as p:
            n: int = p.send(b"x")
    """))
    (tmp_path / "mypy.ini").write_text("[mypy]\n")  # not the project's settings: a user's defaults
    r = subprocess.run([sys.executable, "-m", "mypy", "--config-file", "mypy.ini", "--cache-dir", "cache",
                        "--python-executable", str(venv / "bin" / "python"), "good.py", "bad.py"],
                       capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert r.stdout.splitlines() == [
        'bad.py:5: error: Incompatible types in assignment (expression has type "Ticket", variable has type "int")  '
        '[assignment]',
        "Found 1 error in 1 file (checked 2 source files)"], r.stdout + r.stderr


def test_python_m_hurray_ipc_broker_is_the_broker() -> None:
    r = subprocess.run([sys.executable, "-m", "hurray_ipc.broker", "--help"], capture_output=True, text=True,
                       timeout=60, cwd="/")
    assert r.returncode == 0 and "--endpoint" in r.stdout, r.stderr


def test_stress_help_shows_defaults_and_the_duration_rule():
    r = run("hurray_ipc.cli.stress", "--help")
    text = " ".join(r.stdout.split())
    assert r.returncode == 0 and "--count COUNT handoffs in total (default: 200)" in text, r.stdout
    assert "(default: cpu)" in text and "(default: 0.0)" in text and "wall time of the whole run" in text, r.stdout


DRIVER_PY = ROOT / "hurray_ipc" / "devices" / "backend" / "driver.py"
SMI_12_4 = "#!/bin/sh\necho '| NVIDIA-SMI 550.54.15   Driver Version: 550.54.15   CUDA Version: 12.4     |'\n"


def _no_real_driver() -> None:
    from hurray_ipc.devices.backend import driver

    if driver._from_libcuda() is not None:
        pytest.skip("this machine has an NVIDIA driver; these scenarios fake one with nvidia-smi")


def _fake_smi(folder: Path, text: str = SMI_12_4) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "nvidia-smi").write_text(text)
    (folder / "nvidia-smi").chmod(0o755)
    return folder


def test_driver_py_runs_by_path_before_anything_is_installed(tmp_path: Path) -> None:
    """scripts/_venv.sh and scripts/gpu-check run driver.py as a file, in a bare Python."""
    _no_real_driver()

    def query(*args: str, path: Path) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-S", str(DRIVER_PY), *args], capture_output=True, text=True,
                              timeout=60, env={"PATH": str(path)}, cwd=tmp_path)

    smi = _fake_smi(tmp_path / "bin")
    assert query("extra", path=smi).stdout == "cuda12\n"
    assert query("hint", path=smi).stdout == "pip install 'hurray-ipc[cuda12]'\n"
    assert query("extra", path=tmp_path / "none").stdout == "\n"
    r = query("major", path=smi)
    assert r.returncode == 2 and "expected one argument, one of extra, hint; got ['major']" in r.stderr, r.stderr


def test_venv_script_installs_what_each_script_needs_once(tmp_path: Path) -> None:
    """scripts/_venv.sh over a fake venv whose python logs pip calls: the demo installs the base
    package only, the tests add their extras (and cuda13 without a driver, for the enums) once,
    nothing re-installs until pyproject.toml changes, and a driver's extra replaces another."""
    _no_real_driver()
    root = tmp_path / "root"
    (root / "scripts").mkdir(parents=True)
    shutil.copy(ROOT / "scripts" / "_venv.sh", root / "scripts")
    (root / "hurray_ipc" / "devices" / "backend").mkdir(parents=True)
    shutil.copy(DRIVER_PY, root / "hurray_ipc" / "devices" / "backend")
    (root / "pyproject.toml").write_text("")
    os.utime(root / "pyproject.toml", (1, 1))
    log = tmp_path / "pip.log"
    (root / ".venv" / "bin").mkdir(parents=True)
    (root / ".venv" / "bin" / "python").write_text(
        f'#!/bin/sh\nif [ "$1" = -m ] && [ "$2" = pip ]; then echo "$*" >>{log}; exit 0; fi\n'
        f'exec {sys.executable} "$@"\n')
    (root / ".venv" / "bin" / "python").chmod(0o755)
    no_driver, driver_12 = tmp_path / "none", _fake_smi(tmp_path / "smi")

    def source(script_extras: str, cuda_without_driver: str = "", path: Path = no_driver) -> list[str]:
        log.write_text("")
        r = subprocess.run(["bash", "-c", f"script_extras={script_extras} "
                            f"script_cuda_without_driver={cuda_without_driver}; source scripts/_venv.sh"],
                           capture_output=True, text=True, timeout=60, cwd=root,
                           env={"PATH": f"{path}:/usr/bin:/bin", "HOME": str(tmp_path)})
        assert r.returncode == 0, r.stderr
        return [line.replace(str(root), "ROOT") for line in log.read_text().splitlines() if " -e " in line
                or "nixl" in line]

    demo, test = ("",), ("test,+nixl", "cuda13")
    assert source(*demo) == ["-m pip install -q --disable-pip-version-check -e ROOT"]
    assert source(*test) == ["-m pip install -q --disable-pip-version-check -e ROOT[cuda13,test]",
                             '-m pip install -q --disable-pip-version-check --no-deps nixl-cu12>=1.0']
    assert source(*demo) == [] and source(*test) == [], "nothing new: no install"
    os.utime(root / "pyproject.toml")  # changed since the last install: all of it again
    assert source(*demo) == ["-m pip install -q --disable-pip-version-check -e ROOT[cuda13,test]",
                             '-m pip install -q --disable-pip-version-check --no-deps nixl-cu12>=1.0']
    assert source(*demo, path=driver_12) == [
        "-m pip install -q --disable-pip-version-check -e ROOT[cuda12,test]",
        '-m pip install -q --disable-pip-version-check --no-deps nixl-cu12>=1.0'], "cuda12 replaces cuda13"
    assert source(*test, path=driver_12) == [], "a driver's extra wins over the no-driver default"


def test_python_m_hurray_ipc_says_what_it_is_and_how_to_start() -> None:
    r = subprocess.run([sys.executable, "-m", "hurray_ipc"], capture_output=True, text=True, timeout=60, cwd="/")
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith(f"Hurray IPC {__version__}: zero-copy, race-free handoff"), r.stdout
    for says in ("hurray-broker --daemon", "python -m hurray_ipc demo", "from hurray_ipc import Producer, Consumer",
                 "hurray-caps --install-hint", *CLIS):
        assert says in r.stdout, f"python -m hurray_ipc does not mention {says!r}"
    assert run("hurray_ipc", "--help").stdout == r.stdout
    assert run("hurray_ipc", "--version").stdout == f"hurray_ipc {__version__}\n"


@pytest.mark.parametrize(("args", "says"), [
    (["deom"], "python -m hurray_ipc: error: unknown command 'deom'; the one command is 'demo'"),
    (["demo", "--count", "x"], "python -m hurray_ipc demo: error: argument --count: 'x' is not an integer"),
])
def test_python_m_hurray_ipc_refuses_bad_arguments(args: list[str], says: str) -> None:
    r = run("hurray_ipc", *args)
    assert r.returncode == 2 and r.stderr.strip().splitlines()[-1] == says, r.stderr


def test_python_m_hurray_ipc_demo_runs_the_demo() -> None:
    """The demo, small: every scenario intact (on the CUDA emulation without a GPU)."""
    r = run("hurray_ipc", "demo", "--count", "2", "--size", "4096")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "all handoffs intact" in r.stdout and "in-process threads" in r.stdout, r.stdout
