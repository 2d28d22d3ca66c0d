"""How many pytest-xdist workers the suite runs on, for scripts/test and scripts/sync_mutants.py
alike: one per core this process may use, at most 4 (why: the comment above its use in scripts/test).
Run as a script it prints the number."""

from __future__ import annotations

import os


def count() -> int:
    """One worker per core this process may run on, at least 1 and at most 4."""
    return max(1, min(4, len(os.sched_getaffinity(0))))


if __name__ == "__main__":
    print(count())
