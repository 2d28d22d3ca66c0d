"""hurray-stress: N producers x M consumers over one broker, with SIGKILLs and broker restarts.

    HURRAY_CUDA=emulated hurray-stress --producers 2 --consumers 2 --count 400 --size 64K \\
        --device cuda:0 --kill-consumers 0.5 --kill-producers 0.2 --broker-restarts 1
    hurray-stress --device cpu --duration 60 --kill-consumers 0.5 --kill-producers 0.2

Every buffer carries a checksum written on the producer's stream and checked on the consumer's
(after the sync rule), so a synchronisation bug shows as corruption. Killed workers are replaced.
At the end: handoffs, checksums verified, corrupt, lost, released twice, shared-memory segments
and events left behind, broker RSS at start and end (table, or --json). Exit 1 if anything is
corrupt, lost, released twice or leaked; exit 2 on a usage or device error (e.g. "CUDA unavailable"),
before any worker starts. Defaults are CI-sized; raise --count/--duration for soak runs.

--device takes cpu or cuda:N, as the other Hurray tools do. HURRAY_CUDA=emulated (the environment
variable every Hurray tool honours) runs cuda:N on the cross-process CUDA emulation, which also
checks every handoff for races; --emu-delay-ms sets its operation time. --duration is the wall time
of the whole run: one deadline, kept by replacement workers too; after it, in-flight handoffs drain
and consumers stop once idle, a few seconds of grace. A progress bar goes to stderr only when it is
a terminal (--progress / --no-progress override); the summary goes to stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from .. import workload
from ..devices import DeviceError, backend_name, parse_spec, shm
from ..format.handle import SyncMode
from .common import (
    add_version,
    buffer_size,
    cuda_hint,
    device,
    non_negative_int,
    positive_float,
    positive_int,
    sync_mode,
)

# After the deadline of a --duration run: producers send nothing new and wait for their releases,
# consumers stop after this many seconds without a buffer. The run ends within duration plus that,
# plus the drain; nothing is killed or restarted after the deadline.
IDLE_STOP_MIN = 3.0


@dataclass
class StressConfig:
    producers: int = 2
    consumers: int = 2
    count: int = 200  # handoffs in total (split over producers)
    duration: float | None = None  # or: run this long, in all (one deadline, replacements included)
    size: int = 64 << 10
    mode: str | None = None
    device: str = "cpu"  # cpu | cuda:N
    emulated: bool = False  # cuda:N on the CUDA emulation (HURRAY_CUDA=emulated for the workers)
    kill_consumers: float = 0.0  # SIGKILLs per second
    kill_producers: float = 0.0
    broker_restarts: int = 0
    seed: int = 1
    emu_delay_ms: float = 1.0
    timeout: float = 2.0  # broker's client timeout
    progress: bool | None = None  # None: a progress bar when stderr is a terminal
    inject: str | None = None  # fault injection (workload.INJECTIONS): the run must FAIL
    paths: str = "plain"  # workload.PATHS: "mixed" varies streams, CAI, DLPack, modes and release paths
    pairs: int = 0  # in-process producer+consumer pairs, each on a channel of its own (CONSUMER_STREAM)


@dataclass
class Worker:
    role: str
    proc: Any
    counters: Any
    share: int = 0
    killed: bool = False
    result: Any = None
    queue: Any = None
    consumer_counters: Any = None  # a "pair" worker's consumer half (its producer half: counters)

    def count(self, i: int, consumer: bool = False) -> int:
        """Counter ``i``, read without the array's lock: a worker SIGKILLed inside its _bump holds
        that lock for ever, and taking it here hung the whole run. The worker is the only writer."""
        return int((self.consumer_counters if consumer and self.role == "pair" else self.counters).get_obj()[i])

    def counts_as(self, role: str) -> bool:
        """Whether this worker's counters include ``role``'s (a pair counts as both)."""
        return self.role in (role, "pair")


@dataclass
class StressSummary:
    config: dict[str, Any]
    seconds: float = 0.0
    handoffs: int = 0
    verified: int = 0
    corrupt: int = 0
    races: int = 0
    lost: int = 0
    released_twice: int = 0
    consumer_gone_releases: int = 0
    producer_gone: int = 0
    consumers_killed: int = 0
    producers_killed: int = 0
    broker_restarts: int = 0
    segments_left: int = 0
    events_left: int = 0
    broker_rss_kib_start: int = 0
    broker_rss_kib_end: int = 0
    modes: dict[str, int] = field(default_factory=dict)  # handoffs by sync mode (producers that lived to the end)
    staged: int = 0  # of those, host-staged copies (for CPU consumers, in --paths mixed)
    copied: int = 0  # of those, new host arrays copied into the library's slots (CPU, --paths mixed)
    errors: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not (self.corrupt or self.races or self.lost or self.released_twice or self.segments_left
                    or self.events_left or self.errors) and self.verified > 0


def check_device(cfg: StressConfig) -> dict[str, str]:
    """The environment the workers need for ``cfg.device``, or DeviceError (one line) when that device
    cannot run here: checked in this process, before the broker or any worker starts."""
    kind, ordinal = parse_spec(cfg.device)
    where = f"--device {cfg.device}"
    if cfg.inject is not None and (kind == "cpu" or not cfg.emulated):
        # A PASS would be a lie: the broken rule is a GPU one, and only the emulation's happens-before
        # checker fails such a run every time (a real GPU shows it by chance; a CPU has no such rule).
        fix = f"HURRAY_CUDA=emulated hurray-stress --device {cfg.device if kind == 'cuda' else 'cuda:0'} " \
              f"--inject {cfg.inject}"
        raise DeviceError(f"--inject {cfg.inject}", f"breaks a GPU sync rule on purpose and needs the CUDA "
                          f"emulation to catch it, not {where}" + ("" if kind == "cpu" else " on real CUDA")
                          + f": run {fix}")
    if kind == "cpu":
        return {}
    if cfg.emulated:
        from ..devices.backend.emulated import EmulationConfig

        emu = replace(EmulationConfig.from_env(), op_delay_s=cfg.emu_delay_ms / 1000)
        if ordinal >= emu.devices:
            raise DeviceError(where, f"the CUDA emulation has {emu.devices} device(s) (HURRAY_EMU_DEVICES)")
        return emu.to_env()
    try:
        from ..devices.backend.real import RealRuntime

        rt = RealRuntime()
        why = rt.probe()
        n = rt.device_count() if why is None else 0
    except Exception as e:  # noqa: BLE001 - a missing or broken CUDA install is "unavailable", said in one line
        why = f"{e}"
    if why is not None:
        raise DeviceError(where, f"CUDA unavailable: {why}")
    if ordinal >= n:
        raise DeviceError(where, f"cuda:{ordinal} does not exist ({n} device(s))")
    return {"HURRAY_CUDA": "real"}


def _rss(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


class Runner:
    """One hurray-stress run: a broker, the workers, the kills and restarts, and the summary."""

    WORKER_TIMEOUT_S = 30.0  # each worker's bound on one wait (a send, a receive, the gate)

    def __init__(self, cfg: StressConfig):
        self.cfg = cfg
        self.spec, self.env = cfg.device, check_device(cfg)  # before anything starts
        self.tmp = Path(tempfile.mkdtemp(prefix="hurray-stress-"))
        self.endpoint = f"ipc://{self.tmp}/broker.sock"
        self.rng = random.Random(cfg.seed)
        self.deadline: float | None = None  # time.time() at which a --duration run stops sending
        self.workers: list[Worker] = []
        # A run of a given count with kills: its producers wait here after a tenth of their share
        # until the kills it owes were made (run_producer's gate), so that they always happen.
        self.gate: Any = None
        # Set once no producer is left alive: the consumers stop as soon as they are idle.
        self.finished: Any = workload.SPAWN.RawValue("b", 0)
        self.broker: subprocess.Popen | None = None
        self.summary = StressSummary(asdict(cfg))

    # --- processes -------------------------------------------------------------------------
    def start_broker(self) -> None:
        self.broker = subprocess.Popen([sys.executable, "-m", "hurray_ipc.broker", "--endpoint", self.endpoint,
                                        "--timeout", str(self.cfg.timeout), "--heartbeat", "0.2",
                                        "--log-level", "error"])
        sock = self.tmp / "broker.sock"
        deadline = time.monotonic() + 20
        while not sock.exists():
            if self.broker.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("broker did not start")
            time.sleep(0.02)

    def _spawn(self, role: str, share: int = 0) -> Worker:
        counters = workload.SPAWN.Array("q", workload.COUNTERS)
        common = dict(endpoint=self.endpoint, channel="stress", device=self.spec, env=self.env, counters=counters,
                      broker_grace=4 * self.cfg.timeout + 10, paths=self.cfg.paths)
        if role == "pair":
            cc = workload.SPAWN.Array("q", workload.COUNTERS)
            p, q = workload.spawn(workload.run_pair, **dict(
                common, channel=f"stress-pair-{share}", count=self.cfg.count if not self.cfg.duration else 1 << 40,
                size=self.cfg.size, consumer_counters=cc, deadline=self.deadline))
            w = Worker(role, p, counters, queue=q, consumer_counters=cc)
            self.workers.append(w)
            return w
        if role == "producer":
            kw = dict(common, count=share, size=self.cfg.size, mode=self.cfg.mode, deadline=self.deadline,
                      timeout=self.WORKER_TIMEOUT_S, gate=self.gate, gate_at=-(-share // 10),
                      inject=self.cfg.inject if self.cfg.inject in workload.PRODUCER_INJECTIONS else None)
            fn: Callable[..., dict[str, Any]] = workload.run_producer
        else:
            # Mixed paths on CUDA: every other consumer (replacements too) runs on the CPU, so the
            # producers' host-staged fallback runs under the same kills and checks.
            started = sum(w.role == "consumer" for w in self.workers)
            if self.cfg.paths == "mixed" and self.spec.startswith("cuda") and started % 2:
                common["device"] = "cpu"
            kw = dict(common, count=None, idle_stop=max(IDLE_STOP_MIN, 2 * self.cfg.timeout), keep_seen=False,
                      timeout=self.WORKER_TIMEOUT_S, gate=self.gate, finished=self.finished,
                      inject=self.cfg.inject if self.cfg.inject in workload.CONSUMER_INJECTIONS else None)
            fn = workload.run_consumer
        p, q = workload.spawn(fn, **kw)
        w = Worker(role, p, counters, share, queue=q)
        self.workers.append(w)
        return w

    def _live(self, role: str) -> list[Worker]:
        return [w for w in self.workers if w.role == role and not w.killed and w.proc.is_alive()]

    def _kill(self, role: str) -> None:
        """SIGKILL one live ``role`` worker at random (if one lives) and start its replacement."""
        alive = self._live(role)
        if not alive:
            return
        w = self.rng.choice(alive)
        os.kill(w.proc.pid, signal.SIGKILL)
        w.proc.join(5)
        w.killed = True
        if role == "consumer":
            self.summary.consumers_killed += 1
            self._spawn("consumer")
        else:
            self.summary.producers_killed += 1
            left = w.share - w.count(workload.P_SENT)
            if self.deadline is not None:  # the replacement keeps the run's deadline
                if time.time() < self.deadline:
                    self._spawn("producer", 1 << 40)
            elif left > 0:
                self._spawn("producer", left)

    def _restart_broker(self) -> None:
        assert self.broker is not None
        os.kill(self.broker.pid, signal.SIGKILL)
        self.broker.wait(10)
        time.sleep(0.5)
        self.start_broker()
        self.summary.broker_restarts += 1

    def _all_registered(self) -> bool:
        """Whether every live worker is registered with the broker (its STATS client list)."""
        from ..client.query import NoAnswer, stats

        try:
            pids = {c["pid"] for c in stats(self.endpoint, 1.0)["clients"]}
        except NoAnswer:
            return False
        return all(w.proc.pid in pids for w in self.workers if not w.killed and w.proc.is_alive())

    def _gate_shut(self) -> bool:
        """Whether this run has a gate and it is not yet open (the owed kills were not yet made)."""
        return self.gate is not None and not self.gate.value

    def _all_held(self) -> bool:
        """Whether every live producer waits at the shut gate."""
        live = self._live("producer")
        return self._gate_shut() and bool(live) and all(w.count(workload.P_HELD) for w in live)

    def _sum(self, role: str, i: int) -> int:
        return sum(w.count(i, consumer=role == "consumer") for w in self.workers if w.counts_as(role))

    # --- the run ---------------------------------------------------------------------------
    def run(self) -> StressSummary:
        cfg = self.cfg
        before = set(shm.list_segments())
        t0 = time.monotonic()
        # One deadline for the whole run; every producer, replacements too, stops sending at it.
        self.deadline = None if cfg.duration is None else time.time() + cfg.duration
        end = None if cfg.duration is None else t0 + cfg.duration
        self.start_broker()
        time.sleep(0.3)
        self.summary.broker_rss_kib_start = _rss(self.broker.pid)  # type: ignore[union-attr]
        if not cfg.duration and (cfg.kill_consumers or cfg.kill_producers):
            # Producers held at a tenth of each share: together at least the tenth of the handoffs
            # that makes the kills owed, so the runner gets there first. The consumers see it too:
            # they do not stop idle while it is shut.
            self.gate = workload.SPAWN.RawValue("b", 0)
        for _ in range(cfg.consumers):
            self._spawn("consumer")
        # Producers start once every consumer registered (30 s at most), so each consumer, the CPU
        # ones of --paths mixed too, is there to take a share from the first handoff on.
        registered_by = time.monotonic() + 30
        while not self._all_registered() and time.monotonic() < registered_by:
            time.sleep(0.05)
        per = [cfg.count // cfg.producers + (i < cfg.count % cfg.producers) for i in range(cfg.producers)]
        for n in per:
            self._spawn("producer", n if not cfg.duration else 1 << 40)
        for i in range(cfg.pairs):
            self._spawn("pair", i)
        bar = None
        if cfg.progress if cfg.progress is not None else sys.stderr.isatty():
            from tqdm import tqdm

            bar = tqdm(total=None if cfg.duration else cfg.count, unit="handoff", file=sys.stderr, leave=False)
        restarts_at = [t0 + (i + 1) * self._expected_seconds() / (cfg.broker_restarts + 1)
                       for i in range(cfg.broker_restarts)]
        tick, done_shown = 0.1, 0
        # After a broker restart, kills wait until every live worker registered again: a producer
        # killed before its re-HELLO dies unknown to any broker, and its segments wait for the new
        # broker's 30 s sweep, past this run's leak count (the leak count would then be luck).
        quiet = False
        while self._live("producer"):
            time.sleep(tick)
            now = time.monotonic()
            live = end is None or now < end  # past the deadline: no kills or restarts; the workers drain
            if quiet:
                quiet = not self._all_registered()
            # Each kind of kill asked for happens at least once, at the first chance once a tenth of
            # the handoffs arrived: a run with kills always tests them, however fast it goes (a
            # run of a given count holds its producers at the gate meanwhile, so the owed kills
            # may find nothing in flight; the random ones after it find the run at full speed).
            # A tenth arrived, or every producer waits at the gate (a tenth was sent, but sends
            # refused while the broker restarted never arrive).
            owed = live and not quiet and bool(cfg.kill_consumers or cfg.kill_producers) and (
                self._sum("consumer", workload.C_INTACT) >= cfg.count // 10 or self._all_held())
            if live and not quiet and (self.rng.random() < cfg.kill_consumers * tick or (
                    owed and cfg.kill_consumers and not self.summary.consumers_killed)):
                self._kill("consumer")
            if live and not quiet and (self.rng.random() < cfg.kill_producers * tick or (
                    owed and cfg.kill_producers and not self.summary.producers_killed)):
                self._kill("producer")
            if owed and self._gate_shut() and \
                    (self.summary.consumers_killed or not cfg.kill_consumers) and \
                    (self.summary.producers_killed or not cfg.kill_producers):
                self.gate.value = 1  # the kills owed were made: the held producers go on
            if live and restarts_at and now >= restarts_at[0]:
                restarts_at.pop(0)
                self._restart_broker()
                quiet = True
            if bar is not None:
                done = self._sum("consumer", workload.C_INTACT) + self._sum("consumer", workload.C_CORRUPT)
                bar.update(done - done_shown)
                done_shown = done
            if now - t0 > 600 + (cfg.duration or 0):
                self.summary.errors.append("stress run exceeded its time bound; stopping")
                break
        if bar is not None:
            bar.close()
        if self._gate_shut():
            # The run loop ended (the producers' gate wait timed out, they failed, or the run's time
            # bound passed) before the owed kills were made: say so, and let the consumers stop now
            # rather than at _collect's result timeout.
            self.summary.errors.append("the kills owed once a tenth of the handoffs arrived were never made "
                                       f"(consumers killed {self.summary.consumers_killed}, producers killed "
                                       f"{self.summary.producers_killed}); the gate opened as the run ended")
            self.gate.value = 1
        self.finished.value = 1
        self._collect()
        self.summary.broker_rss_kib_end = _rss(self.broker.pid)  # type: ignore[union-attr]
        self.broker.terminate()  # type: ignore[union-attr]
        self.broker.wait(10)  # type: ignore[union-attr]
        time.sleep(0.2)
        # This run's workers' and broker's segments only (others may share the uid and /dev/shm).
        ours = {w.proc.pid for w in self.workers} | {self.broker.pid}  # type: ignore[union-attr]
        left = sorted(n for n in set(shm.list_segments()) - before
                      if (parsed := shm.parse_name(n)) is not None and parsed[1] in ours)
        # list_segments() returns only names parse_name() recognises; the None check states it.
        self.summary.events_left = sum(1 for n in left if (parsed := shm.parse_name(n)) and parsed[2] == "v")
        self.summary.segments_left = len(left) - self.summary.events_left
        shm.cleanup_stale()
        shutil.rmtree(self.tmp, ignore_errors=True)
        self.summary.seconds = round(time.monotonic() - t0, 2)
        return self.summary

    def _expected_seconds(self) -> float:
        return self.cfg.duration or max(2.0, self.cfg.count / 150)

    def _collect(self) -> None:
        s = self.summary
        for w in self.workers:
            if w.killed:
                continue
            try:
                w.result = w.queue.get(timeout=120)
            except Exception:  # noqa: BLE001
                s.errors.append(f"{w.role} pid {w.proc.pid} gave no result")
                w.proc.kill()
                continue
            w.proc.join(10)
            halves = [("producer", w.result.get("producer", w.result)), ("consumer", w.result.get("consumer", {}))] \
                if w.role == "pair" else [(w.role, w.result)]
            for role, res in halves:
                if res.get("error"):
                    s.errors.append(f"{w.role} pid {w.proc.pid} ({role}): {res['error'].strip().splitlines()[-1]}")
                if role == "producer":
                    for mode, n in (res.get("modes") or {}).items():
                        s.modes[mode] = s.modes.get(mode, 0) + n
                    s.staged += res.get("staged", 0)
                    s.copied += res.get("copied", 0)
        s.handoffs = self._sum("producer", workload.P_SENT)
        s.verified = self._sum("consumer", workload.C_INTACT)
        s.corrupt = self._sum("consumer", workload.C_CORRUPT)
        s.races = self._sum("consumer", workload.C_RACES) + self._sum("producer", workload.P_RACES)
        s.producer_gone = self._sum("consumer", workload.C_PRODUCER_GONE)
        s.released_twice = self._sum("producer", workload.P_DOUBLE)
        s.consumer_gone_releases = self._sum("producer", workload.P_CONSUMER_GONE)
        # Lost: handed off by a producer that lived to the end, and never released back to it.
        s.lost = sum(w.count(workload.P_SENT) - w.count(workload.P_RELEASED)
                     for w in self.workers if w.counts_as("producer") and not w.killed)


def render(s: StressSummary) -> str:
    rows = [("handoffs", s.handoffs), ("checksums verified", s.verified), ("corrupt", s.corrupt),
            ("races (happens-before check)",
             s.races if str(s.config.get("device", "cpu")).startswith("cuda") else "- (cpu: no GPU ordering to check)"),
            ("lost", s.lost),
            ("released twice", s.released_twice), ("released back for dead consumers", s.consumer_gone_releases),
            ("held when their producer died", s.producer_gone), ("consumers killed", s.consumers_killed),
            ("producers killed", s.producers_killed), ("broker restarts", s.broker_restarts),
            ("shm segments left behind", s.segments_left), ("events left behind", s.events_left),
            ("broker RSS start / end (KiB)", f"{s.broker_rss_kib_start} / {s.broker_rss_kib_end}"),
            ("sync modes", ", ".join(f"{k} {v}" for k, v in sorted(s.modes.items())) or "-"),
            ("host-staged copies", s.staged), ("host arrays copied into slots", s.copied),
            ("seconds", s.seconds)]
    out = [f"{k:<42} {v}" for k, v in rows]
    unchecked = s.handoffs - s.verified - s.corrupt
    if unchecked > 0:  # a killed worker's handoffs: sent, but no live consumer read them
        out.append(f"({unchecked} handoff(s) sent but not checked: received by a consumer killed before it read "
                   "them, or dropped with a killed producer; 'sync modes' counts producers that lived to the end)")
    out += [f"error: {e}" for e in s.errors]
    out.append("PASS" if s.ok else "FAIL")
    return "\n".join(out)


class _HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """The module docstring as written, and "(default: X)" after every option that has a default."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default is None or action.default is False:  # nothing to show: off unless given
            return action.help
        return super()._get_help_string(action)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="hurray-stress", description=__doc__, formatter_class=_HelpFormatter)
    add_version(p)
    d = StressConfig()
    p.add_argument("--producers", type=positive_int, default=d.producers, help="producer processes")
    p.add_argument("--consumers", type=positive_int, default=d.consumers, help="consumer processes")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--count", type=positive_int, default=d.count, help="handoffs in total")
    g.add_argument("--duration", type=positive_float, metavar="SECONDS",
                   help="instead of a count: the wall time of the whole run. One deadline from the start, "
                        "which replacement workers keep; after it nothing is killed or restarted, in-flight "
                        "handoffs drain and the consumers stop once every producer finished (or after "
                        f"{max(IDLE_STOP_MIN, 2 * d.timeout):g} s idle), so the run ends a few seconds after SECONDS")
    p.add_argument("--size", type=buffer_size, default=d.size,
                   help="bytes per buffer (4096, 64K, 1M ...; at least 16, which name the buffer for the check)")
    p.add_argument("--mode", type=sync_mode, help="preferred sync mode (default: the cheapest valid one)")
    p.add_argument("--device", type=device, default=d.device,
                   help="cpu or cuda:N; cuda:N runs on the CUDA emulation when HURRAY_CUDA=emulated is set")
    p.add_argument("--kill-consumers", type=float, default=d.kill_consumers, metavar="RATE",
                   help="SIGKILLs of consumers per second (at least one, once a tenth of the handoffs "
                        "arrived; a run of a --count holds its producers at a tenth of their share until then)")
    p.add_argument("--kill-producers", type=float, default=d.kill_producers, metavar="RATE",
                   help="SIGKILLs of producers per second (at least one, as for consumers)")
    p.add_argument("--broker-restarts", type=int, default=d.broker_restarts, metavar="K",
                   help="SIGKILL and restart the broker K times, spread over the run")
    p.add_argument("--seed", type=int, default=d.seed, help="seed of the kill schedule")
    p.add_argument("--emu-delay-ms", type=float, default=d.emu_delay_ms,
                   help="duration of an emulated CUDA operation (HURRAY_CUDA=emulated only)")
    p.add_argument("--inject", choices=sorted(workload.INJECTIONS), metavar="FAULT",
                   help="break one sync rule, to prove the checks catch it (the run must FAIL; needs "
                        "HURRAY_CUDA=emulated and --device cuda:N): "
                        + "; ".join(f"{k}: {v}" for k, v in workload.INJECTIONS.items()))
    p.add_argument("--inject-skip-wait", action="store_const", dest="inject", const="skip-wait",
                   help="the same as --inject skip-wait")
    p.add_argument("--paths", choices=workload.PATHS, default=d.paths,
                   help="plain: every buffer written on the producer's stream, sent in the cheapest mode, read "
                        "after wait() on the consumer's stream; mixed: on CUDA devices, per buffer, another "
                        "stream, a CUDA Array Interface or DLPack-only object, each preferred mode, reads on "
                        "streams given to wait() or __dlpack__(stream=) released while pending, and every "
                        "other consumer on the CPU (host-staged copies); on the CPU, every other handoff a "
                        "new numpy array, copied into a recycled slot of the library's pool "
                        "(default: %(default)s)")
    p.add_argument("--pairs", type=non_negative_int, default=d.pairs, metavar="N",
                   help="also run N in-process producer+consumer pairs, each alone on a channel of its own: "
                        "the only pairing where CONSUMER_STREAM is valid (default: %(default)s)")
    p.add_argument("--json", action="store_true", help="print the summary as one JSON object")
    p.add_argument("--progress", action=argparse.BooleanOptionalAction,
                   help="a live progress bar on stderr (default: only when stderr is a terminal and "
                        "without --json)")
    a = p.parse_args(argv)
    if a.mode is not None and a.device == "cpu" and SyncMode.from_name(a.mode) is not SyncMode.PRODUCER_SYNCED:
        p.error(f"--mode {a.mode}: a cpu buffer is always SYNC_PRODUCER_SYNCED (sync-contract §1); the other "
                "modes need --device cuda:N")
    progress = a.progress if a.progress is not None else (sys.stderr.isatty() and not a.json)
    try:
        emulated = backend_name() == "emulated"
        cfg = StressConfig(a.producers, a.consumers, a.count, a.duration, a.size, a.mode, a.device, emulated,
                           a.kill_consumers, a.kill_producers, a.broker_restarts, a.seed, a.emu_delay_ms,
                           progress=progress, inject=a.inject, paths=a.paths, pairs=a.pairs)
        runner = Runner(cfg)  # checks the device before the broker or any worker starts
    except DeviceError as e:
        print(f"hurray-stress: {cuda_hint(str(e))}", file=sys.stderr)
        return 2
    s = runner.run()
    print(json.dumps({**asdict(s), "ok": s.ok}) if a.json else render(s))
    return 0 if s.ok else 1


if __name__ == "__main__":
    sys.exit(main())
