"""Happens-before race detection for the emulated CUDA runtime: vector clocks and shadow memory.

Pure data and functions, no I/O: :mod:`.emulated` keeps these structures in shared memory (one
shadow per allocation, one clock per event, one clock per handoff message) so that every process
that touches an allocation sees the same history. The model and its limits are in
``hurray_ipc/devices/DESIGN.md`` ("The happens-before checker").

Agents are the things that run operations in program order: each stream, and the host (one agent
per runtime instance). Each agent has a vector clock (:data:`Clock`, agent id -> count). An
operation is ordered after another (happens-before) when the later one's clock covers the
earlier one's ``(agent, count)`` epoch. Edges come only from the program's own synchronisation:
stream order, event record/wait, stream/event synchronize and successful queries, and the
handoff messages between processes. Nothing here reads a wall clock, so a verdict never depends
on how fast anything ran.

Shadow memory (FastTrack-style, over byte ranges) keeps, for every byte range of an allocation,
the last write and the reads since it that are not ordered before one another. An access checks
against them, whichever process made them and in whichever order they actually executed, so an
unordered pair is reported whether the read or the write came first.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

Clock = dict  # dict[int, int]: agent id -> the count of that agent's operations known to be done

# An access record: (agent, count, pid, process start time, description). The description names
# the process, stream, operation, and byte range; the allocation is named by the caller.
Record = tuple  # tuple[int, int, int, int, str]
# A shadow interval: [lo, hi, last write record or None, list of read records].
Interval = list

MAX_READS = 32  # unordered reads kept per interval; beyond that the oldest are forgotten


def join(into: Clock, other: Clock) -> None:
    """``into`` := the pointwise maximum of both clocks (``into`` learns what ``other`` knew)."""
    for agent, count in other.items():
        if into.get(agent, 0) < count:
            into[agent] = count


# A clock key no agent has (agents are positive): present when the clock, or one it joined,
# forgot exited agents (prune), so that what it knew of their writes is no longer known.
PRUNED = -1


def prune(clock: Clock, gone: Callable[[int], bool]) -> Clock:
    """``clock`` without the agents ``gone`` says belong to exited processes, marked PRUNED. A
    read by an exited process is forgiven anyway (``access``), so what a clock knows of it is never
    asked again; a write by one is judged by the accessor's clock, which no longer knows it once
    pruned: such a clock forgives exited writers again (the price of a clock as small as the live
    agents it has met, however many processes came and went: a soak of thousands of lifetimes)."""
    kept = {a: n for a, n in clock.items() if not gone(a)}
    if len(kept) < len(clock):
        kept[PRUNED] = 1
    return kept


def ordered(clock: Clock, rec: Record) -> bool:
    """True when the access ``rec`` happens-before whatever runs with ``clock``."""
    return clock.get(rec[0], 0) >= rec[1]


def race_kind(is_write: bool, other_is_write: bool) -> str:
    if is_write:
        return "write-after-write" if other_is_write else "write-after-read"
    return "read-after-write"


def access(shadow: list[Interval], lo: int, hi: int, is_write: bool, rec: Record, clock: Clock,
           gone: Callable[[Record], bool]) -> tuple[list[Interval], list[tuple[str, Record, int, int]]]:
    """Check the access ``rec`` to bytes ``[lo, hi)`` running with ``clock``, and record it.

    Returns the new shadow and the races found: ``(kind, other record, lo, hi)`` for each earlier
    access that conflicts (at least one is a write, the byte ranges overlap) and is not ordered
    before this one. ``gone(rec)`` says that the record's process has exited: its streams ran to
    completion or were torn down with it, so a *read* of it can no longer see a later write (its
    write-after-read is forgiven). Its *writes* keep their history: an exited writer whose write
    nobody ordered an access after is still a race (what that access sees depends on whether the
    writer's work ran before it exited), so the verdict does not change when the writer exits.
    """
    if hi <= lo:
        return shadow, []
    races: list[tuple[str, Record, int, int]] = []
    seen: set[tuple[int, int]] = set()

    def conflict(kind: str, other: Record, a: int, b: int, forgive_gone: bool) -> None:
        if other[0] == rec[0] or ordered(clock, other) or forgive_gone and gone(other):
            return
        key = (other[0], other[1])
        if key not in seen:
            seen.add(key)
            races.append((kind, other, a, b))

    def touched(a: int, b: int, w: Record | None, reads: list[Record]) -> Interval:
        if w is not None:
            conflict(race_kind(is_write, True), w, a, b, forgive_gone=PRUNED in clock)
        if is_write:
            for r in reads:
                conflict(race_kind(True, False), r, a, b, forgive_gone=True)
            return [a, b, rec, []]
        kept = [r for r in reads if not (r[0] == rec[0] or ordered(clock, r) or gone(r))]
        kept.append(rec)
        return [a, b, w, kept[-MAX_READS:]]

    out: list[Interval] = []
    cursor = lo  # the first byte of [lo, hi) no interval has covered yet
    for iv in shadow:
        s, e, w, reads = iv
        if e <= lo or s >= hi:
            if s >= hi and cursor < hi:
                out.append(touched(cursor, hi, None, []))
                cursor = hi
            out.append(iv)
            continue
        if s < lo:
            out.append([s, lo, w, reads])
        a, b = max(s, lo), min(e, hi)
        if cursor < a:
            out.append(touched(cursor, a, None, []))
        out.append(touched(a, b, w, reads))
        cursor = b
        if e > hi:
            out.append([hi, e, w, reads])
    if cursor < hi:
        out.append(touched(cursor, hi, None, []))
    return _merge(out), races


def _merge(shadow: Iterable[Interval]) -> list[Interval]:
    merged: list[Interval] = []
    for iv in shadow:
        if merged and merged[-1][1] == iv[0] and merged[-1][2] == iv[2] and merged[-1][3] == iv[3]:
            merged[-1] = [merged[-1][0], iv[1], iv[2], iv[3]]
        else:
            merged.append(iv)
    return merged


def describe(kind: str, alloc: str, rec: Record, other: Record, lo: int, hi: int) -> str:
    """The race report: both operations (process, stream, op, byte range) and the allocation."""
    return (f"{kind} race on {alloc} bytes [{lo}, {hi}): {rec[4]} is not ordered after {other[4]} "
            "(a missing stream-wait, event record, host synchronize or release-after-work)")
