"""The end-to-end demo behind ``scripts/demo`` and ``python -m hurray_ipc demo``.

Starts a broker process, then producer and consumer worker processes (spawned: CUDA and ZeroMQ
contexts do not survive fork) that hand checksummed buffers to each other in every sync mode and
through the host-staged fallback, and a pair whose consumer stops by itself at the end of the
stream; on a real GPU when one is present and on the emulated CUDA runtime otherwise. Exits
non-zero if any buffer arrived corrupt, any race was found, any release went missing, or the
ended stream did not stop its consumer.
"""

from __future__ import annotations

import argparse
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from . import workload
from .cli import caps as caps_cli
from .cli import inspect as inspect_cli
from .cli.common import buffer_size, positive_int
from .format.handle import BufferHandle, DeviceTag, SyncMode


def _closer(buf: Any) -> Callable[[object], None]:
    """An ``on_release`` callback that closes ``buf`` (bound now, not when it runs)."""
    return lambda _ticket: buf.close()


def choose_cuda() -> tuple[dict[str, str], str]:
    """The environment for the GPU scenarios: real CUDA if it works here, else the emulation."""
    if os.environ.get("HURRAY_CUDA"):
        return {}, f"HURRAY_CUDA={os.environ['HURRAY_CUDA']} (as set)"
    from .devices.backend.real import RealRuntime

    try:
        why = RealRuntime().probe()
    except Exception as e:  # noqa: BLE001
        why = str(e)
    if why is None:
        return {"HURRAY_CUDA": "real"}, "real CUDA"
    from .devices.backend.emulated import EmulationConfig

    return EmulationConfig(devices=2, op_delay_s=0.002).to_env(), f"emulated CUDA (no GPU here: {why})"


def in_process(endpoint: str, env: dict[str, str], count: int, size: int) -> dict[str, Any]:
    """Producer and consumer as threads of one process: SYNC_CONSUMER_STREAM and in-process EVENT."""
    os.environ.update(env)
    from .client import Consumer, Producer
    from .devices import open_device

    dev = open_device("cuda:0")
    cstream = dev.create_stream()
    modes: dict[str, int] = {}
    intact = 0
    with Producer(endpoint, "inproc", dev) as p, Consumer(endpoint, "inproc", dev, stream=cstream) as c:
        pstream = p.stream
        if pstream is None:  # Producer gives every CUDA device a stream; never expected
            raise RuntimeError(f"producer on {dev.identity} has no CUDA stream")

        def produce() -> None:
            for i in range(count):
                buf = p.allocate(size)
                pstream.copy(buf, workload.pattern(1, i, size))
                mode = SyncMode.CONSUMER_STREAM if i % 2 == 0 else SyncMode.EVENT
                p.send(buf, mode, on_release=_closer(buf))

        th = threading.Thread(target=produce)
        th.start()
        for _ in range(count):
            h = c.receive(timeout=30)
            h.wait()
            out = np.empty(size, np.uint8)
            cstream.copy(out, h.buffer.device_buffer)
            cstream.synchronize()
            intact += workload.verify(out)[2]
            modes[h.sync_mode.wire_name] = modes.get(h.sync_mode.wire_name, 0) + 1
            h.release()
        th.join()
        p.flush(10)
    return {"received": count, "intact": intact, "corrupt": count - intact, "modes": modes, "staged": 0,
            "error": None, "released": count, "sent": count, "races": workload.emulated_races(dev)}


def scenario(endpoint: str, name: str, pdev: str, cdev: str, env: dict[str, str], count: int, size: int,
             mode: str | None = None, ends: bool = False) -> dict[str, Any]:
    """``ends``: the producer ends its stream and the consumer, given no count, stops at that end."""
    ch = name.replace(" ", "-").replace(",", "")
    pc, qc = workload.spawn(workload.run_consumer, endpoint=endpoint, channel=ch, device=cdev,
                            count=None if ends else count, env=env, keep_seen=False)
    pp, qp = workload.spawn(workload.run_producer, endpoint=endpoint, channel=ch, device=pdev, count=count, size=size,
                            mode=mode, env=env, end_stream=ends)
    t0 = time.perf_counter()
    pr, cr = qp.get(timeout=120), qc.get(timeout=120)
    dt = time.perf_counter() - t0
    pp.join(10), pc.join(10)
    return {"name": name, "producer": pr, "consumer": cr, "seconds": dt, "ends": ends}


def pasteable(prog: str, args: list[str], env: dict[str, str], shell: dict[str, str]) -> str:
    """The command line that runs ``prog args`` as the demo does when pasted into the shell the demo
    ran from (whose environment was ``shell``): prefixed with the variables of ``env`` that the shell
    lacks, e.g. ``HURRAY_CUDA=emulated`` where the demo chose the emulation (no GPU). A variable
    left unset that means the same value (an emulation default, HURRAY_CUDA=real) is left out."""
    from .devices.backend.emulated import EmulationConfig

    unset_means = {**EmulationConfig().to_env(), "HURRAY_CUDA": "real"}
    prefix = [f"{k}={shlex.quote(v)}" for k, v in env.items()
              if shell.get(k) != v and not (k not in shell and unset_means.get(k) == v)]
    return " ".join([*prefix, prog, *map(shlex.quote, args)])


def show_handles() -> None:
    print("== buffer handles (hurray-inspect)")
    for h in (BufferHandle(4096, 4096, DeviceTag.CPU), BufferHandle(1 << 20, 256, DeviceTag.CUDA, SyncMode.EVENT)):
        print(f"$ hurray-inspect {h.encode().hex()}")
        inspect_cli.main([h.encode().hex()])
    bad = "00100000000000000010000001ff0000"
    print(f"$ hurray-inspect {bad}   # sync_mode 0xFF")
    print(f"(exit {inspect_cli.main([bad])})\n")


def show_caps(env: dict[str, str], shell: dict[str, str]) -> None:
    """hurray-caps as the GPU scenarios see the device, each printed as a line that works pasted."""
    for args in (["--device", "cuda:0", "--transport", "ipc"],
                 ["--device", "cuda:0", "--peer-device", "cpu", "--transport", "ipc"]):
        print(f"$ {pasteable('hurray-caps', args, env, shell)}", flush=True)
        status = caps_cli.main(args)
        if status:
            print(f"(exit {status})")


def main(argv: list[str] | None = None, prog: str | None = None) -> int:
    ap = argparse.ArgumentParser(prog=prog, description=__doc__)
    ap.add_argument("--count", type=positive_int, default=8, help="buffers per scenario")
    ap.add_argument("--size", type=buffer_size, default=256 << 10,
                    help="bytes per buffer (4096, 64K, 1M ...; at least 16, which name the buffer for the check)")
    a = ap.parse_args(argv)
    show_handles()
    shell = dict(os.environ)  # what a command pasted from this output runs with
    env, which = choose_cuda()
    print(f"== GPU scenarios run on {which}\n")
    os.environ.update(env)
    show_caps(env, shell)
    print()
    tmp = Path(tempfile.mkdtemp(prefix="hurray-demo-"))
    endpoint = f"ipc://{tmp}/broker.sock"
    broker = subprocess.Popen([sys.executable, "-m", "hurray_ipc.broker", "--endpoint", endpoint,
                               "--log-level", "warning"])
    try:
        deadline = time.monotonic() + 20
        while not (tmp / "broker.sock").exists():
            if broker.poll() is not None or time.monotonic() > deadline:
                print("broker failed to start", file=sys.stderr)
                return 1
            time.sleep(0.05)
        print(f"== broker pid {broker.pid} at {endpoint}")
        runs = [
            scenario(endpoint, "cpu to cpu", "cpu", "cpu", {}, a.count, a.size),
            scenario(endpoint, "gpu to gpu", "cuda:0", "cuda:0", env, a.count, a.size),
            scenario(endpoint, "gpu to gpu synced", "cuda:0", "cuda:0", env, a.count, a.size, "PRODUCER_SYNCED"),
            scenario(endpoint, "gpu to cpu consumer", "cuda:0", "cpu", env, a.count, a.size),
            scenario(endpoint, "gpu, stream ends", "cuda:0", "cuda:0", env, a.count, a.size, ends=True),
        ]
        p, q = workload.spawn(in_process, endpoint=endpoint, env=env, count=a.count, size=a.size)
        t0 = time.perf_counter()
        r = q.get(timeout=120)
        p.join(10)
        runs.append({"name": "in-process threads", "producer": {**r, "races": 0}, "consumer": r,
                     "seconds": time.perf_counter() - t0})
    finally:
        broker.terminate()
        broker.wait(10)
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"\n{'scenario':<22} {'modes seen by consumer':<46} {'staged':>6} {'intact':>7} {'corrupt':>7} "
          f"{'races':>5} {'released':>8}")
    ok = True
    for run in runs:
        pr, cr = run["producer"], run["consumer"]
        for who, rep in (("producer", pr), ("consumer", cr)):
            if rep.get("error"):
                print(f"{run['name']}: {who} failed:\n{rep['error']}", file=sys.stderr)
                ok = False
        modes = ", ".join(f"{k} x{v}" for k, v in sorted(cr.get("modes", {}).items()))
        races = cr.get("races", 0) + pr.get("races", 0)
        print(f"{run['name']:<22} {modes:<46} {cr.get('staged', 0):>6} {cr.get('intact', 0):>7} "
              f"{cr.get('corrupt', 0):>7} {races:>5} {pr.get('released', 0):>8}")
        ok &= (cr.get("corrupt", 1) == 0 and races == 0 and cr.get("intact") == a.count
               and pr.get("released") == a.count and (not run.get("ends") or cr.get("ended") is True))
    print("\nall handoffs intact, no race (happens-before check on the emulation), every buffer released "
          "exactly once, the ended stream stopped its consumer; broker stopped" if ok else "\nDEMO FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
