"""hurray-inspect, run as a user would (a subprocess of the installed entry point's module)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from hurray_ipc import BufferHandle, DeviceTag, SyncMode

EV = BufferHandle(1 << 20, 256, DeviceTag.CUDA, SyncMode.EVENT).encode()


def run(*args, stdin=None):
    return subprocess.run([sys.executable, "-m", "hurray_ipc.cli.inspect", *args], input=stdin,
                          capture_output=True, timeout=60)


def test_hex_table():
    r = run(EV.hex())
    assert r.returncode == 0, r.stderr
    out = r.stdout.decode()
    assert "SYNC_EVENT (0x01)" in out and "CUDA (0x01)" in out and "1048576" in out
    assert "stream-wait" in out


def test_json_and_spaced_hex():
    spaced = " ".join(EV.hex()[i:i + 2] for i in range(0, 32, 2))
    r = run("--json", spaced)
    d = json.loads(r.stdout)
    assert r.returncode == 0 and d["valid"] and d["sync_mode"] == "SYNC_EVENT" and d["alignment"] == 256


def test_file_raw_and_stdin(tmp_path):
    f = tmp_path / "h.bin"
    f.write_bytes(EV)
    assert run(f"@{f}").returncode == 0
    assert run("-", stdin=EV).returncode == 0
    (tmp_path / "h.txt").write_text(EV.hex() + "\n")
    assert run(f"@{tmp_path / 'h.txt'}").returncode == 0


@pytest.mark.parametrize("hexs,reason", [("00" * 15, "length"),
                                         ("00" * 8 + "01000000" + "01ff0000", "sync_mode_invalid")])
def test_invalid_exit_2_reason_on_stderr(hexs, reason):
    r = run("--json", hexs)
    assert r.returncode == 2
    assert reason in r.stderr.decode()
    assert json.loads(r.stdout)["reason"] == reason


def test_unreadable_input_exit_1(tmp_path):
    assert run("zz").returncode == 1
    assert run(f"@{tmp_path / 'missing'}").returncode == 1
