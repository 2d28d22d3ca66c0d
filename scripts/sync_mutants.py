"""Sabotage one sync step at a time and show the suite catches each (scripts/check-sync-mutants).

Each mutant turns one step of the sync contract into a no-op in a copy of the tree; the sync tests
then run against that copy (PYTHONPATH, so spawned workers and the broker import it too). A mutant
that no test catches is a hole in the suite: the script exits 1.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TESTS = ["tests/test_races.py", "tests/test_paths.py", "tests/test_clients.py", "tests/test_devices.py",
         "tests/test_stress.py"]

# name -> (file, the exact text of the step, what replaces it)
MUTANTS: dict[str, tuple[str, str, str]] = {
    "stream-wait": ("hurray_ipc/devices/cuda.py",
                    "        self.device.rt.stream_wait_event(self.raw, event._live())\n",
                    "        pass  # MUTANT: no stream-wait\n"),
    "event-record": ("hurray_ipc/devices/cuda.py",
                     "        self.device.rt.event_record(self._live(), stream.raw)\n",
                     "        pass  # MUTANT: no event record\n"),
    "producer-host-wait": ("hurray_ipc/client/producer.py",
                           "        if mode is SyncMode.PRODUCER_SYNCED:\n            stream.synchronize()\n",
                           "        if mode is SyncMode.PRODUCER_SYNCED:\n            pass  # MUTANT: no host wait\n"),
    # The library's release-after-work: ReceivedHandoff.release() fences the consumer's streams
    # and sends RELEASE only once those fences completed. The mutant sends it at once.
    "release-after-work": ("hurray_ipc/client/consumer.py",
                           "        self._consumer._release_after(self, fences)\n",
                           "        self._consumer._release_after(self, [])  # MUTANT: RELEASE before the work completed\n"),
}


def make_copy(dest: Path) -> None:
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=ROOT, check=True,
                           capture_output=True, text=True).stdout.split()
    for f in files:
        src = ROOT / f
        if src.is_file():
            (dest / f).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / f)


def apply(dest: Path, name: str) -> None:
    path, old, new = MUTANTS[name]
    text = (dest / path).read_text()
    if text.count(old) != 1:
        raise SystemExit(f"mutant {name}: the step to sabotage occurs {text.count(old)} times in {path} "
                         "(expected exactly once): update MUTANTS in scripts/sync_mutants.py")
    (dest / path).write_text(text.replace(old, new))


def run_suite(tree: Path, tests: list[str]) -> tuple[int, int, str]:
    env = dict(os.environ, PYTHONPATH=str(tree), PYTHONDONTWRITEBYTECODE="1")
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rfE", "-p", "no:cacheprovider",
                           *tests], cwd=tree, env=env, capture_output=True, text=True, timeout=1200)
    lines = proc.stdout.strip().splitlines()
    tail = lines[-1] if lines else proc.stderr[-500:]
    failed = sum(int(n) for n in re.findall(r"(\d+) (?:failed|error)", tail))
    passed = sum(int(n) for n in re.findall(r"(\d+) passed", tail))
    # A test can both fail and error (in its race-check teardown): count each test once.
    which = list(dict.fromkeys(ln.split(" - ")[0].removeprefix("FAILED ").removeprefix("ERROR ") for ln in lines
                               if ln.startswith(("FAILED ", "ERROR "))))
    return (len(which) if which else failed), passed, tail, which


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("mutants", nargs="*", metavar="MUTANT", help=f"which to run (default: all of {', '.join(MUTANTS)})")
    ap.add_argument("--tests", nargs="+", default=TESTS, help="test files to run against each mutant")
    ap.add_argument("--no-baseline", action="store_true", help="skip the unmutated run")
    ap.add_argument("-v", "--verbose", action="store_true", help="list the tests that caught each mutant")
    a = ap.parse_args(argv)
    unknown = [m for m in a.mutants if m not in MUTANTS]
    if unknown:
        ap.error(f"unknown mutant(s) {', '.join(unknown)}; expected {', '.join(MUTANTS)}")
    names = a.mutants or list(MUTANTS)
    holes = 0
    runs = ([] if a.no_baseline else [None]) + names
    for name in runs:
        with tempfile.TemporaryDirectory(prefix="hurray-mutant-") as tmp:
            tree = Path(tmp)
            make_copy(tree)
            if name is not None:
                apply(tree, name)
            t0 = time.monotonic()
            failed, passed, tail, which = run_suite(tree, a.tests)
            secs = time.monotonic() - t0
        label = name or "baseline (no mutant)"
        if name is None:
            verdict = "ok" if failed == 0 else "THE UNMUTATED SUITE FAILS"
            holes += failed > 0
        else:
            verdict = f"caught by {failed} test(s)" if failed else "NOT CAUGHT"
            holes += failed == 0
        print(f"{label:<24} {verdict:<28} ({passed} passed, {secs:.0f} s)  [{tail}]", flush=True)
        for test in which if a.verbose or name is None else []:
            print(f"    {test}", flush=True)
    return 1 if holes else 0


if __name__ == "__main__":
    sys.exit(main())
