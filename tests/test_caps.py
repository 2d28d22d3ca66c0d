"""hurray-caps: local probe and broker query, as a user runs them."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from brokerproc import BrokerProcess
from conftest import cuda_error, emu_config, fake_cuda_install


def caps(*args, env=None):
    e = {**os.environ, **(env or {})}
    r = subprocess.run([sys.executable, "-m", "hurray_ipc.cli.caps", *args], capture_output=True, text=True,
                       timeout=60, env=e)
    return r.returncode, r.stdout, r.stderr


EMU = emu_config().to_env()


@pytest.mark.parametrize("args,env,valid,staged", [
    (["--device", "cuda:0", "--transport", "ipc"], EMU, ["SYNC_PRODUCER_SYNCED", "SYNC_EVENT"], False),
    (["--device", "cuda:0", "--transport", "in-process"], EMU,
     ["SYNC_PRODUCER_SYNCED", "SYNC_EVENT", "SYNC_CONSUMER_STREAM"], False),
    (["--device", "cuda:0", "--transport", "network"], EMU, ["SYNC_PRODUCER_SYNCED"], False),
    (["--device", "cuda:0", "--peer-device", "cpu", "--transport", "ipc"], EMU, [], True),
    (["--device", "cuda:0", "--transport", "ipc"], {**EMU, "HURRAY_EMU_IPC_EVENTS": "0"}, ["SYNC_PRODUCER_SYNCED"],
     False),
    (["--device", "cpu", "--transport", "ipc"], {}, ["SYNC_PRODUCER_SYNCED"], False),
])
def test_local_probe(args, env, valid, staged):
    rc, out, err = caps(*args, "--json", env=env)
    assert rc == 0, err
    d = json.loads(out)
    assert d["valid_sync_modes"] == valid and d["host_staged"] is staged
    assert set(d["excluded"]) == {"SYNC_PRODUCER_SYNCED", "SYNC_EVENT", "SYNC_CONSUMER_STREAM"} - set(valid)


def test_table_output_names_reasons():
    rc, out, _ = caps("--device", "cuda:0", "--peer-device", "cuda:1", "--transport", "ipc",
                      env={**EMU, "HURRAY_EMU_PEER": "0"})
    assert rc == 0 and "consumer on another GPU without peer access" in out and "host-staged copy       yes" in out


def test_real_cuda_missing_is_a_clear_error():
    from conftest import REAL_SKIP

    if not REAL_SKIP:
        pytest.skip("a real GPU is present")
    rc, _, err = caps("--device", "cuda:0", "--transport", "ipc", env={"HURRAY_CUDA": "real"})
    assert rc == 2 and "CUDA unavailable" in err



@pytest.mark.parametrize(("driver", "bindings", "count", "says"), [
    ((12, 4), (13, 1), (cuda_error(35, "cudaErrorInsufficientDriver"), None),
     "driver supports CUDA 12.4, cuda-bindings 13.1 installed (needs a CUDA 13 driver): install hurray-ipc[cuda12]"),
    ((12, 4), None, None, "cuda-bindings is not installed (the driver supports CUDA 12.4): install hurray-ipc[cuda12]"),
])
def test_caps_names_a_driver_bindings_mismatch(monkeypatch, capsys, driver, bindings, count, says):
    """hurray-caps on a GPU whose driver the installed cuda-bindings do not fit (injected): one line
    naming both versions and the extra to install, exit 2."""
    from hurray_ipc.cli import caps as caps_cli
    from hurray_ipc.devices import set_runtime

    fake_cuda_install(monkeypatch, driver, bindings, count)
    monkeypatch.setenv("HURRAY_CUDA", "real")
    set_runtime(None)
    try:
        rc = caps_cli.main(["--device", "cuda:0"])
    finally:
        set_runtime(None)
    err = capsys.readouterr().err
    assert rc == 2 and err.startswith(f"hurray-caps: CudaDevice: CUDA unavailable: {says}"), err


@pytest.mark.parametrize(("driver", "line"), [
    ((12, 4), "pip install 'hurray-ipc[cuda12]'"),
    ((13, 0), "pip install 'hurray-ipc[cuda13]'"),
    (None, "no NVIDIA driver found: pip install hurray-ipc"),
])
def test_install_hint_is_the_pip_line_for_the_driver(monkeypatch, capsys, driver, line):
    from hurray_ipc.cli import caps as caps_cli
    from hurray_ipc.devices.backend import driver as cuda_driver

    monkeypatch.setattr(cuda_driver, "driver_cuda_version", lambda: driver)
    assert caps_cli.main(["--install-hint"]) == 0
    assert capsys.readouterr().out == line + "\n"


def test_install_hint_needs_no_device_argument():
    rc, out, err = caps("--install-hint")
    assert rc == 0 and "pip install" in out, err
    rc, _, err = caps()
    assert rc == 2 and "the following arguments are required: --device" in err, err

def test_broker_query(tmp_path):
    b = BrokerProcess(f"ipc://{tmp_path}/b.sock").start()
    try:
        rc, out, err = caps("--broker", b.endpoint, "--device", "cuda:0", "--peer-device", "cpu", "--json", env=EMU)
        assert rc == 0, err
        d = json.loads(out)
        assert d["host_staged"] and d["excluded"]["SYNC_EVENT"] == "consumer has no GPU"
    finally:
        b.stop()
    rc, _, err = caps("--broker", b.endpoint, "--device", "cpu", "--timeout", "0.5")
    assert rc == 2 and "no reply from broker" in err


def test_exclusions_carry_the_device_probe_reason():
    """A device whose probe said why IPC events or memory fail: CAPS repeats it (the hardware's
    own words, e.g. the CUDA error), not only 'no IPC events'."""
    from hurray_ipc.devices.base import DeviceCapabilities, DeviceIdentity
    from hurray_ipc.format.handle import SyncMode
    from hurray_ipc.transport.pairing import Endpoint, pair_modes
    gpu = DeviceIdentity("cuda", 0, "GPU-x", emulated=True, host="h")
    why = (("ipc_events", "cudaIpcGetEventHandle: cudaErrorNotSupported"),)
    a = Endpoint(gpu, DeviceCapabilities(True, False, why_not=why), 1)
    b = Endpoint(gpu, DeviceCapabilities(True, True), 2)
    assert "cudaErrorNotSupported" in (pair_modes(a, b).reasons[SyncMode.EVENT] or "")
    c = Endpoint(gpu, DeviceCapabilities(False, False, why_not=(("ipc_memory", "WSL2: no IPC"),)), 1)
    assert all("WSL2: no IPC" in (r or "") for r in pair_modes(c, b).reasons.values())


def test_no_memory_events_or_streams_across_hosts_whatever_the_transport_asked():
    """CPU endpoints on different hosts asked about over IPC, and CUDA peers with different hosts,
    get no shared memory and no SYNC_EVENT: nothing crosses machines but bytes."""
    from hurray_ipc.contract.sync import Transport
    from hurray_ipc.devices.base import DeviceCapabilities, DeviceIdentity
    from hurray_ipc.format.handle import SyncMode
    from hurray_ipc.transport.pairing import Endpoint, pair_modes
    caps = DeviceCapabilities(True, True)
    for kind in ("cpu", "cuda"):
        a = Endpoint(DeviceIdentity(kind, 0, "U", host="host-a"), caps, 1)
        b = Endpoint(DeviceIdentity(kind, 0, "U", host="host-b"), caps, 2)
        pm = pair_modes(a, b, Transport.IPC)
        assert SyncMode.EVENT not in pm.valid, pm
        if kind == "cpu":
            assert not pm.valid and "different hosts" in (pm.reasons[SyncMode.PRODUCER_SYNCED] or "")
