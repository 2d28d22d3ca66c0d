"""hurray-bench: Hurray handoffs side by side with raw pyzmq, multiprocessing.Queue, hand-made
shared_memory, torch.multiprocessing (when installed) and memcpy, in one run.

    hurray-bench                      # CI-sized: 4 KiB, 1 MiB, 64 MiB
    hurray-bench --full               # more iterations (minutes)
    hurray-bench --sizes 4K,1M --out results/mine
    hurray-bench --sizes 4K --rounds 7 --profile   # cProfile per process in <out>/profile/
    hurray-bench --sizes 4K --window 64           # the rows' window (and prefetch) 64 instead of 8
    hurray-bench --scaling            # only the scaling table: 1x1, 4x4, 16x16 on 1 and 16 channels
    hurray-bench --scaling --full     # the same with more handoffs per configuration and 5 rounds
    hurray-bench --stages             # CPU per handoff of broker, producer, consumer alone (pure vs compiled),
                                      # beside the socket floor of the client stages' harness
    hurray-bench --legs               # where one paced handoff's latency goes, process by process

Writes results.json, results.md and plot.png (with the bench extra) into the results folder and
prints the markdown table. Targets are reported, never asserted.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..bench.harness import MAX_WINDOW, WINDOW, WINDOW_ENV, window
from ..bench.scaling import run_scaling, scaling_targets
from ..bench.suite import aggregate, machine, markdown, plot, run_suite, targets
from ..errors import InvalidArgument
from .common import add_version, parse_size, positive_int


def _sizes(text: str) -> list[int]:
    """--sizes: comma-separated sizes, each at least one byte (an empty buffer has nothing to time)."""
    sizes = [parse_size(s) for s in text.split(",") if s.strip()]
    if not sizes or min(sizes) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: comma-separated sizes of at least 1 byte, e.g. 4K,1M")
    return sizes


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="hurray-bench", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_version(p)
    p.add_argument("--sizes", type=_sizes, default="4K,1M,64M", help="comma-separated buffer sizes (each >= 1 byte)")
    p.add_argument("--iterations", type=positive_int, default=None, help="round trips per row for sizes <= 1 MiB")
    p.add_argument("--full", action="store_true", help="2000 / 200 iterations instead of 300 / 40")
    p.add_argument("--out", default=None, help="results folder (default results/bench-<time>)")
    p.add_argument("--rounds", type=positive_int, default=None,
                   help="rounds, each in a new shuffled order; rows report medians over them (default 3; --full 5)")
    p.add_argument("--seed", type=int, default=0, help="seed of the shuffles")
    p.add_argument("--window", type=int, default=None,
                   help=f"handoffs each throughput row keeps in flight, and its clients' prefetch (1-{MAX_WINDOW}; "
                        f"default {WINDOW}, where the targets are set); memory: window x size per producer row. "
                        "The main rows only")
    p.add_argument("--profile", action="store_true",
                   help="write cProfile output of the broker and of every Hurray producer and consumer process "
                        "to <out>/profile/*.pstats (read with python -m pstats; slows every row)")
    p.add_argument("--render", metavar="RESULTS_JSON", default=None,
                   help="no run: aggregate and print the markdown of an earlier run's results.json again")
    p.add_argument("--scaling", action="store_true",
                   help="run only the scaling table: N producers x N consumers on one channel and on several")
    p.add_argument("--scaling-counts", default="1,4,16", help="the N of the scaling table, comma-separated")
    p.add_argument("--scaling-channels", type=int, default=16,
                   help="channels of the spread configurations (each N uses min(this, N))")
    p.add_argument("--scaling-handoffs", type=int, default=None,
                   help="handoffs per scaling configuration, split over its producers (default 3000; --full 20000)")
    p.add_argument("--stages", action="store_true",
                   help="instead of the rows: the CPU per handoff of each stage alone (broker dispatch, producer, "
                        "consumer; hurray_ipc/bench/stages.py), pure Python and compiled side by side, and "
                        "the socket floor of the client stages' harness (its socket traffic, no library code)")
    p.add_argument("--legs", action="store_true",
                   help="instead of the rows: one paced 4 KiB handoff's one-way latency split leg by leg (producer, "
                        "each hop, the broker's dispatch, flush and send, consumer; hurray_ipc/bench/legs.py), "
                        "send() and send(block=False) beside the relay")
    p.add_argument("--quiet", action="store_true")
    a = p.parse_args(argv)
    asked = {"argv": list(sys.argv[1:] if argv is None else argv), "seed": a.seed}  # recorded with the results
    if a.window is not None:
        if not 1 <= a.window <= MAX_WINDOW:
            p.error(f"--window: an integer in 1-{MAX_WINDOW}, got {a.window}")
        other = [f for f, on in (("--render", a.render), ("--scaling", a.scaling), ("--stages", a.stages),
                                 ("--legs", a.legs)) if on]
        if other:
            p.error(f"--window sets the main rows' window; {other[0]} keeps its own ({WINDOW})")
        os.environ[WINDOW_ENV] = str(a.window)  # every row reads it, in every process it spawns
    if a.render:
        try:
            res = json.loads(Path(a.render).read_text())
        except (OSError, ValueError) as e:
            p.error(f"--render {a.render}: {e}")
        res["rows"], res["targets"] = aggregate(res["raw"]), targets(res["raw"], res.get("window", WINDOW))
        if res.get("scaling"):
            res["scaling"]["rows"] = sorted(aggregate(res["scaling"]["raw"]),
                                            key=lambda r: (r["producers"], r["channels"]))
            res["scaling"]["targets"] = scaling_targets(res["scaling"]["raw"])
        print(markdown(res))
        return 0
    if a.stages:
        return _stages(a)
    if a.legs:
        return _legs(a)
    if not a.scaling:
        try:
            window()  # HURRAY_BENCH_WINDOW may come from the environment: refused before anything starts
        except InvalidArgument as e:
            p.error(f"{e}: unset it, or pass --window")
    sizes = a.sizes
    n_small = a.iterations or (2000 if a.full else 300)
    n_large = max(5, n_small // 10) if a.iterations else (200 if a.full else 40)
    out = Path(a.out or f"results/bench-{time.strftime('%Y%m%d-%H%M%S')}")
    out.mkdir(parents=True, exist_ok=True)
    say = _say(a)
    rounds = a.rounds or (5 if a.full else 3)
    if a.scaling:
        try:
            counts = [int(c) for c in a.scaling_counts.split(",") if c]
        except ValueError:
            p.error(f"--scaling-counts: comma-separated integers, got {a.scaling_counts!r}")
        try:
            sc = run_scaling(counts, a.scaling_channels, a.scaling_handoffs or (20000 if a.full else 3000), rounds,
                             a.seed, say)
        except InvalidArgument as e:
            p.error(str(e))
        res = {"machine": machine(), "window": sc["window"], "rounds": rounds, "rows": [], "raw": [],
               "targets": [], "scaling": sc, "run": asked}
        md = markdown(res)
        (out / "results.json").write_text(json.dumps(res, indent=1))
        (out / "results.md").write_text(md)
        print(md)
        print(f"results in {out}/")
        return 0
    res = run_suite(sizes, n_small, n_large, say, rounds=rounds, seed=a.seed,
                    profile=(out / "profile").resolve() if a.profile else None)
    res["run"] = asked
    (out / "results.json").write_text(json.dumps(res, indent=1))
    md = markdown(res)
    (out / "results.md").write_text(md)
    why = plot(res, out / "plot.png")
    print(md)
    print(f"results in {out}/" + (f" (no plot: {why})" if why else ""))
    return 0


def _say(a: argparse.Namespace) -> Callable[[str], None]:
    return (lambda s: None) if a.quiet else (lambda s: print(f"  running {s} ...", file=sys.stderr, flush=True))


def _write(a: argparse.Namespace, name: str, res: dict[str, Any], md: str) -> int:
    """Write ``res`` as <out>/<name>.json and ``md`` as <out>/<name>.md, print the markdown."""
    out = Path(a.out or f"results/{name}-{time.strftime('%Y%m%d-%H%M%S')}")
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps(res, indent=1))
    (out / f"{name}.md").write_text(md)
    print(md)
    print(f"results in {out}/")
    return 0


def _stages(a: argparse.Namespace) -> int:
    from ..bench import stages

    res = stages.run_stages(a.iterations or (20000 if a.full else 5000), rounds=a.rounds or (5 if a.full else 3),
                            seed=a.seed, say=_say(a))
    return _write(a, "stages", res, stages.markdown(res))


def _legs(a: argparse.Namespace) -> int:
    from ..bench import legs

    res = legs.run_legs(a.iterations or (3000 if a.full else 1000), rounds=a.rounds or (5 if a.full else 3),
                        seed=a.seed, say=_say(a))
    return _write(a, "legs", res, legs.markdown(res))


if __name__ == "__main__":
    sys.exit(main())
