"""CI-sized stress runs with SIGKILL injection and a broker restart: zero corrupt, zero lost, zero
double releases, zero leaked segments and events. Larger runs: hurray-stress --count/--duration."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time

import pytest

from hurray_ipc import workload
from hurray_ipc.cli import stress
from hurray_ipc.cli.stress import Runner, StressConfig, StressSummary, render
from hurray_ipc.devices.backend.real import RealRuntime

# machine_wide: a run counts the segments and events its dead workers left, which another test's
# sweep beside it could remove first; and each run sweeps every dead process's segments itself.
pytestmark = [pytest.mark.stress, pytest.mark.machine_wide]


def check(cfg: StressConfig):
    s = Runner(cfg).run()
    assert s.errors == [], render(s)
    assert s.corrupt == 0 and s.races == 0, render(s)
    assert s.lost == 0 and s.released_twice == 0, render(s)
    assert s.segments_left == 0 and s.events_left == 0, render(s)
    assert s.handoffs >= cfg.count and s.verified > 0, render(s)
    return s


def test_stress_emulated_cuda_with_kills_and_broker_restart():
    s = check(StressConfig(producers=2, consumers=2, count=300, size=64 << 10, device="cuda:0", emulated=True,
                           kill_consumers=1.0, kill_producers=0.4, broker_restarts=1, seed=11, progress=False))
    assert s.broker_restarts == 1 and s.consumers_killed + s.producers_killed > 0


def test_stress_cpu_with_consumer_kills():
    """With --paths mixed, every other handoff is a new numpy array the library copies into a
    recycled slot, under consumer kills. Each consumer checks that the bytes it read are those of
    the handoff it got (its meta names them), so a slot given back at send time shows as
    corruption (3 runs of 3 when tried; by timing: the rule's every-time test is
    tests/test_host_slots.py)."""
    s = check(StressConfig(producers=2, consumers=3, count=300, size=16 << 10, device="cpu",
                           kill_consumers=1.0, seed=12, progress=False, paths="mixed"))
    assert s.consumers_killed > 0
    assert 0 < s.copied < s.handoffs, (s.copied, s.handoffs)


@pytest.mark.parametrize("delay_ms", [0.0, 50.0])
def test_stress_mixed_paths_are_clean(delay_ms):
    """hurray-stress --paths mixed --pairs 1: writes on other streams and through CUDA Array
    Interface and DLPack-only objects, every preferred mode, reads on streams given to wait() or
    __dlpack__ and released while pending. The issue-22 mutants of those rules (release fencing only
    the consumer's stream or the last fence, PRODUCER_SYNCED host-waiting the wrong stream, the
    consumer's stream not made to wait in CONSUMER_STREAM, a staged copy not host-waited for the
    second consumer, which runs on the CPU) make this run fail; scripts/check-sync-mutants runs it
    against them."""
    s = check(StressConfig(producers=1, consumers=2, count=48, size=4096, device="cuda:0", emulated=True,
                           emu_delay_ms=delay_ms, progress=False, paths="mixed", pairs=1))
    # Between processes no device offers CONSUMER_STREAM (CUDA has no IPC streams): those producers
    # fall back to the cheapest valid mode, as the spec says. The in-process pair uses it.
    assert set(s.modes) == {"SYNC_EVENT", "SYNC_PRODUCER_SYNCED", "SYNC_CONSUMER_STREAM"}, s.modes
    assert s.handoffs == 2 * 48 and s.staged > 0


@pytest.mark.parametrize("delay_ms", [0.0, 100.0])
def test_stress_skip_wait_fails_at_any_delay(delay_ms):
    """The stress checks can fail: a run whose consumers skip the wait fails on every handoff."""
    s = Runner(StressConfig(producers=1, consumers=1, count=10, size=4096, device="cuda:0", emulated=True,
                            emu_delay_ms=delay_ms, progress=False, inject="skip-wait")).run()
    assert s.races == s.handoffs == 10 and not s.ok, render(s)


@pytest.mark.timeout(90)  # with a clock per worker (the old code) this run went past 90 s
def test_duration_is_the_wall_time_of_the_whole_run_with_kills():
    """--duration is one deadline: a replacement for a killed producer does not start the clock
    again, so the run ends within the duration plus a bounded drain (generous bound: a deadline,
    not a speed goal)."""
    # 5 s: four spawned workers start within it even on 2 busy cores (at 3 s some runs sent nothing).
    # seed 21: producers killed at about 1.3, 1.7 and 3.7 s.
    cfg = StressConfig(producers=2, consumers=2, duration=5.0, size=16 << 10, device="cpu",
                       kill_consumers=1.0, kill_producers=1.0, seed=21, progress=False)
    t0 = time.monotonic()
    s = Runner(cfg).run()
    wall = time.monotonic() - t0
    assert wall < 5.0 + 15, f"{wall:.1f} s for --duration 5\n{render(s)}"
    assert s.errors == [] and s.corrupt == 0 and s.lost == 0 and s.released_twice == 0, render(s)
    assert s.segments_left == 0 and s.events_left == 0 and s.verified > 0, render(s)
    assert s.producers_killed > 0, render(s)


def cli(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
    """hurray-stress with stderr a pipe (not a terminal), as in CI logs."""
    e = {k: v for k, v in os.environ.items() if k != "HURRAY_CUDA"} | env
    return subprocess.run([sys.executable, "-m", "hurray_ipc.cli.stress", "--producers", "1", "--consumers", "1",
                           "--count", "20", "--size", "4K", *args], capture_output=True, text=True, timeout=90, env=e)


def test_no_progress_frames_when_stderr_is_not_a_terminal():
    r = cli("--device", "cpu")
    assert r.returncode == 0 and r.stdout.strip().endswith("PASS"), (r.stdout, r.stderr)
    assert "\r" not in r.stderr and "handoff" not in r.stderr, repr(r.stderr)


def test_cuda_device_on_the_emulation_runs():
    r = cli("--device", "cuda:0", HURRAY_CUDA="emulated")
    assert r.returncode == 0 and r.stdout.strip().endswith("PASS"), (r.stdout, r.stderr)


def test_cuda_device_without_cuda_is_one_line_exit_2_and_starts_nothing(monkeypatch, capsys):
    monkeypatch.delenv("HURRAY_CUDA", raising=False)
    try:
        why = RealRuntime().probe()
    except Exception as e:  # noqa: BLE001 - no usable cuda-python: CUDA is unavailable, as wanted here
        why = f"{e}"
    if why is None:
        pytest.skip("this machine has a CUDA device")

    def started(*a, **kw):
        raise AssertionError("a broker or worker was started")

    monkeypatch.setattr(workload, "spawn", started)
    monkeypatch.setattr(Runner, "start_broker", started)
    assert stress.main(["--device", "cuda:0"]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "HURRAY_CUDA=emulated" in err, err
    assert "CUDA unavailable" in err and "Traceback" not in err, err


def test_a_gate_whose_owed_kills_never_come_fails_the_run_promptly(monkeypatch):
    """A counted run with kills holds its producers until the owed kills were made. When they can
    never be made (here: every kill is a no-op), the producers' wait at the gate ends, and the run
    says why and stops its consumers then, instead of running into its result timeout."""
    monkeypatch.setattr(Runner, "_kill", lambda self, role: None)
    monkeypatch.setattr(Runner, "WORKER_TIMEOUT_S", 3.0)
    t0 = time.monotonic()
    s = Runner(StressConfig(producers=1, consumers=1, count=40, size=4096, device="cpu", kill_consumers=1.0,
                            seed=13, progress=False)).run()
    assert any("were never made" in e for e in s.errors), render(s)
    assert any("never let go on" in e for e in s.errors), render(s)
    assert s.lost == 0 and s.segments_left == 0, render(s)
    assert time.monotonic() - t0 < 60, "the consumers waited for the result timeout"


def test_the_table_says_what_a_cpu_run_cannot_check_and_what_kills_left_unchecked():
    """A newcomer read 'races 0' on a cpu run as a check that passed, and 100 handoffs against 70
    verified as a gap: the table says there is no GPU ordering on a cpu run, and why handoffs of
    killed workers are not checked."""
    cpu = render(StressSummary(config={"device": "cpu"}, handoffs=100, verified=70))
    assert "- (cpu: no GPU ordering to check)" in cpu and "30 handoff(s) sent but not checked" in cpu
    gpu = render(StressSummary(config={"device": "cuda:0"}, handoffs=10, verified=10, races=0))
    assert "not checked" not in gpu and re.search(r"races \(happens-before check\) +0\n", gpu)
