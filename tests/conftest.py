"""Shared fixtures: the device implementations every conformance test runs against."""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import random
import shutil
import signal
import socket
import subprocess

import pytest

from brokerproc import BrokerProcess
from fakebroker import FakeBroker
from hurray_ipc import workload
from hurray_ipc.devices import CpuDevice, CudaDevice, set_runtime
from hurray_ipc.devices.backend.emulated import EmulatedRuntime, EmulationConfig
from hurray_ipc.devices.backend.real import RealRuntime

SPAWN = mp.get_context("spawn")


def free_port() -> int:
    """A TCP port for an address that must be known before its server binds it (a broker's
    ``--export``/``--import`` pair, bound again after each bridge restart; a metrics port): a free
    one outside the kernel's ephemeral range, so that no outgoing connection (another test's)
    takes it between this probe and the bind. Where the server can bind ``tcp://HOST:*`` and say which
    port it got, use that instead (test_bridge.ANY_PORT)."""
    with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
        low, high = (int(x) for x in f.read().split())
    ports = [*range(10000, low), *range(high + 1, 65536)]  # outside the ephemeral range, either side
    rng = random.Random()
    for port in rng.sample(ports, min(100, len(ports))):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise AssertionError(f"no free port outside the ephemeral range [{low}, {high}]")


@pytest.fixture(autouse=True)
def no_unexpected_races(request, monkeypatch):
    """A correct program never gets a race report: every emulated runtime a test makes in this
    process must end with none, unless the test is marked ``races_expected`` (it breaks a rule on
    purpose). Worker processes report theirs in their results, which the tests assert on."""
    made: list[EmulatedRuntime] = []
    init = EmulatedRuntime.__init__

    def tracking_init(self, *a, **kw):
        init(self, *a, **kw)
        made.append(self)

    monkeypatch.setattr(EmulatedRuntime, "__init__", tracking_init)
    yield
    if request.node.get_closest_marker("races_expected") is None:
        found = [r for rt in made for r in rt.races]
        assert not found, f"unexpected race report(s) in a correct program: {found}"


def real_cuda_reason() -> str | None:
    try:
        return RealRuntime().probe()
    except Exception as e:  # noqa: BLE001
        return f"cuda-python unusable: {e}"


REAL_SKIP = real_cuda_reason()


class _CudaError(int):
    """A cudaError_t stand-in: an int with the enum member's name."""

    def __new__(cls, value: int, name: str) -> _CudaError:
        e = super().__new__(cls, value)
        e.name = name
        return e


def fake_cuda_install(monkeypatch, driver_version, bindings_version, count_result):
    """The real backend over injected facts: the driver's CUDA version, the installed cuda-bindings
    version, and what cudaGetDeviceCount returns (None: cuda.bindings does not import)."""
    from hurray_ipc.devices.backend import driver, real

    monkeypatch.setattr(driver, "driver_cuda_version", lambda: driver_version)
    monkeypatch.setattr(driver, "bindings_version", lambda: bindings_version)

    def import_bindings():
        if count_result is None:
            raise ModuleNotFoundError("No module named 'cuda'")
        return type("FakeRuntime", (), {"cudaGetDeviceCount": staticmethod(lambda: count_result)})(), None

    monkeypatch.setattr(real, "_import_bindings", import_bindings)


def cuda_error(value: int, name: str) -> int:
    """A cudaError_t member as cuda.bindings returns it (an int with a name), without cuda.bindings."""
    return _CudaError(value, name)


def emu_config(**kw) -> EmulationConfig:
    base = dict(devices=2, op_delay_s=0.002)
    base.update(kw)
    return EmulationConfig(**base)


@contextlib.contextmanager
def emulated_gpu(delay: float):
    """An emulated GPU in this process whose device operations each take ``delay`` seconds."""
    rt = EmulatedRuntime(emu_config(op_delay_s=delay))
    set_runtime(rt)
    try:
        yield CudaDevice(0, runtime=rt)
    finally:
        set_runtime(None)


@pytest.fixture(params=["cpu", "emulated", "real"])
def impl(request):
    """(device, spec, env for spawned children) for each implementation."""
    kind = request.param
    if kind == "cpu":
        dev = CpuDevice()
        yield dev, "cpu", {}
    elif kind == "emulated":
        cfg = emu_config()
        dev = CudaDevice(0, runtime=EmulatedRuntime(cfg))
        yield dev, "cuda:0", cfg.to_env()
    else:
        if REAL_SKIP:
            pytest.skip(f"real CUDA not available here: {REAL_SKIP}")
        dev = CudaDevice(0, runtime=RealRuntime())
        yield dev, "cuda:0", {"HURRAY_CUDA": "real"}
    dev.close()


@pytest.fixture
def cuda_impl(impl):
    dev, spec, env = impl
    if spec == "cpu":
        pytest.skip("CPU device has no streams/events to order")
    return impl


def run_child(target, *args, timeout=60):
    q = SPAWN.Queue()
    p = SPAWN.Process(target=target, args=(*args, q))
    p.start()
    try:
        res = q.get(timeout=timeout)
    finally:
        p.join(timeout=10)
        if p.is_alive():
            p.kill()
    if res[0] == "error":
        raise AssertionError("child failed:\n" + res[1])
    return res[1:]


class Proc:
    """``fn(**kwargs)`` in a spawned process (workload.spawn); ``result()`` waits for its return."""

    def __init__(self, fn, **kwargs):
        self.p, self.q = workload.spawn(fn, **kwargs)

    def result(self, timeout=90):
        r = self.q.get(timeout=timeout)
        self.p.join(10)
        return r

    def kill(self):
        os.kill(self.p.pid, signal.SIGKILL)
        self.p.join(10)


@pytest.fixture
def broker(tmp_path):
    """A real broker process on a fresh ipc:// endpoint."""
    b = BrokerProcess(f"ipc://{tmp_path}/broker.sock", timeout=2.0).start()
    yield b
    b.stop()


@pytest.fixture
def fake(tmp_path):
    """A fake broker (tests/fakebroker.py) on a fresh ipc:// endpoint."""
    f = FakeBroker(tmp_path)
    yield f
    f.close()


def emu_env(**kw):
    return emu_config(**kw).to_env()


def unshare_cmd() -> list[str]:
    """``unshare`` into a new user + PID namespace (a container's view), or skip saying why."""
    cmd = ["unshare", "--user", "--pid", "--fork", "--map-root-user"]
    if shutil.which("unshare") is None:
        pytest.skip("unshare(1) is not installed")
    if subprocess.run([*cmd, "true"], capture_output=True).returncode != 0:
        pytest.skip("this kernel does not let this user create user+pid namespaces")
    if os.getuid() != 0:
        pytest.skip("inside --map-root-user segments and leases are named for uid 0; run as root to compare")
    return cmd
