"""CI-sized stress runs with SIGKILL injection and a broker restart: zero corrupt, zero lost, zero
double releases, zero leaked segments and events. Larger runs: hurray-stress --count/--duration."""

from __future__ import annotations

import pytest

from hurray_ipc.cli.stress import Runner, StressConfig, render

pytestmark = pytest.mark.stress


def check(cfg: StressConfig):
    s = Runner(cfg).run()
    assert s.errors == [], render(s)
    assert s.corrupt == 0 and s.races == 0, render(s)
    assert s.lost == 0 and s.released_twice == 0, render(s)
    assert s.segments_left == 0 and s.events_left == 0, render(s)
    assert s.handoffs >= cfg.count and s.verified > 0, render(s)
    return s


def test_stress_emulated_cuda_with_kills_and_broker_restart():
    s = check(StressConfig(producers=2, consumers=2, count=300, size=64 << 10, device="emulated",
                           kill_consumers=1.0, kill_producers=0.4, broker_restarts=1, seed=11, progress=False))
    assert s.broker_restarts == 1 and s.consumers_killed + s.producers_killed > 0


def test_stress_cpu_with_consumer_kills():
    s = check(StressConfig(producers=2, consumers=3, count=300, size=16 << 10, device="cpu",
                           kill_consumers=1.0, seed=12, progress=False))
    assert s.consumers_killed > 0


@pytest.mark.parametrize("delay_ms", [0.0, 100.0])
def test_stress_skip_wait_fails_at_any_delay(delay_ms):
    """The stress checks can fail: a run whose consumers skip the wait fails on every handoff."""
    s = Runner(StressConfig(producers=1, consumers=1, count=10, size=4096, device="emulated", emu_delay_ms=delay_ms,
                            progress=False, inject="skip-wait")).run()
    assert s.races == s.handoffs == 10 and not s.ok, render(s)
