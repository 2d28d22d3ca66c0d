"""hurray-top: what a running broker is doing, live (its STATS, docs/spec/ipc-protocol.md §2.3).

    hurray-top                                   # live table, refreshed every second (q quits)
    hurray-top --endpoint ipc:///run/user/1000/hurray/broker.sock --interval 0.5
    hurray-top --once                            # one plain-text snapshot on stdout
    hurray-top --json                            # the raw STATS_REPLY, as JSON

The live table needs a terminal; with stdout not a terminal a plain snapshot is printed every
interval instead. Exit 0; 2 when no broker answers within --timeout (with --once / --json) or on
a usage error (with --json, stdout then holds {"error": "...", "endpoint": "..."}); 130 on Ctrl-C.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Sequence
from typing import Any

from ..client.endpoint import default_endpoint
from ..client.query import BrokerQuery, NoAnswer
from .common import add_version, endpoint, positive_float

# --- rendering ----------------------------------------------------------------------------------

def duration(seconds: float) -> str:
    s = int(seconds)
    d, s = divmod(s, 86400)
    h, s = divmod(s, 3600)
    m, s = divmod(s, 60)
    return (f"{d}d" if d else "") + (f"{h}h" if d or h else "") + (f"{m:02d}m" if d or h else f"{m}m") + f"{s:02d}s"


def table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> list[str]:
    """Left-aligned text columns, two spaces apart."""
    cells = [[str(x) for x in header]] + [[str(x) for x in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    return ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in cells]


def _rate(d: dict[str, Any], key: str) -> str:
    r = d["rates"]
    return f"{d['totals'][key]} ({r['life'][key]:g}/s, last {r['window_s']:g} s {r['window'][key]:g}/s)"


def render(d: dict[str, Any], endpoint: str = "") -> list[str]:
    """A STATS_REPLY as lines of plain text: summary, channels, clients."""
    b, g, t = d["broker"], d["gauges"], d["totals"]
    errors = {k: v for k, v in d["errors_by_code"].items() if v}
    shm = d["shm"]
    lines = [
        f"hurray broker {b['version']} at {endpoint or '?'}  pid {b['pid']}  up {duration(b['uptime_s'])}  "
        f"session {b['session']}  protocol {b['protocol']}",
        f"clients {g['clients']} ({g['producers']} producers, {g['consumers']} consumers, "
        f"{g['unresponsive']} unresponsive)  channels {g['channels']}  queued credits {g['queued']}  "
        f"grants {g['grants']}",
        f"outstanding handoffs {g['outstanding']}  events {g['events_outstanding']}  orphans {g['orphans']}",
        f"handoffs {_rate(d, 'handoffs')}  released {_rate(d, 'releases')}",
        f"messages in {_rate(d, 'messages_in')}  out {_rate(d, 'messages_out')}",
        f"errors {t['errors']}" + (": " + ", ".join(f"{k} {v}" for k, v in errors.items()) if errors else "")
        + f"  rejected {t['rejected']}  undeliverable {t['undeliverable']}  dropped_full {t['dropped_full']}"
        + f"  choked {t['consumers_choked']}  fenced {t['consumers_fenced']}  held too long {t['holds_fenced']}",
        f"shared memory: {shm['segments']} segments, {shm['cleaned']} cleaned in {shm['sweeps']} sweeps",
        "",
    ]
    lines += table(["CHANNEL", "PRODUCERS", "CONSUMERS", "QUEUED", "READY", "GRANTS", "IN-FLIGHT"],
                   [[c["name"], c["producers"], c["consumers"], c["queued"], c["ready"], c["grants"], c["in_flight"]]
                    for c in d["channels"]])
    if d.get("channels_truncated"):
        lines.append(f"(+{d['channels_truncated']} more channels)")
    lines.append("")
    lines += table(["CLIENT", "NAME", "ROLE", "CHANNEL", "PID", "CREDITS", "OUTSTANDING", "EVENTS", "STATE",
                    "SILENT"],
                   [[c["id"], c["name"] or "-", c["role"], c["channel"], c["pid"], c["credits"], c["outstanding"],
                     c["events_outstanding"], c["state"] + ("" if c["lease"] else " (no lease)"),
                     f"{c['silent_s']:.1f}s"] for c in d["clients"]])
    if d.get("clients_truncated"):
        lines.append(f"(+{d['clients_truncated']} more clients)")
    return lines


# --- the live view ------------------------------------------------------------------------------

def live(client: BrokerQuery, interval: float, timeout: float) -> int:
    import curses

    def run(scr: Any) -> int:
        curses.curs_set(0)
        scr.timeout(int(interval * 1000))
        while True:
            try:
                lines = render(client.stats(timeout), client.endpoint)
                status = f"every {interval:g} s, {time.strftime('%H:%M:%S')}; q quits"
            except NoAnswer as e:
                lines, status = [], f"{e}; retrying every {interval:g} s; q quits"
            scr.erase()
            height, width = scr.getmaxyx()
            for y, line in enumerate(lines[:max(0, height - 1)]):
                scr.addnstr(y, 0, line, width - 1, curses.A_BOLD if y == 0 or line.isupper() else 0)
            scr.addnstr(height - 1, 0, status, width - 1, curses.A_REVERSE)
            scr.refresh()
            key = scr.getch()  # waits up to interval
            if key in (ord("q"), ord("Q"), 27):
                return 0

    return int(curses.wrapper(run))


def plain_loop(client: BrokerQuery, interval: float, timeout: float) -> int:
    while True:
        try:
            print("\n".join(render(client.stats(timeout), client.endpoint)), flush=True)
        except NoAnswer as e:
            print(f"hurray-top: {e}", file=sys.stderr, flush=True)
        print(flush=True)
        time.sleep(interval)  # pacing the display, not synchronisation


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="hurray-top", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_version(p)
    p.add_argument("--endpoint", type=endpoint, default=None,
                   help=f"the broker's endpoint (default {default_endpoint()})")
    p.add_argument("--interval", type=positive_float, default=1.0, help="seconds between polls (default %(default)s)")
    p.add_argument("--timeout", type=positive_float, default=3.0,
                   help="seconds to wait for the broker's answer (default %(default)s)")
    once = p.add_mutually_exclusive_group()
    once.add_argument("--once", action="store_true", help="print one plain-text snapshot and exit")
    once.add_argument("--json", action="store_true", help="print the raw STATS_REPLY as JSON and exit")
    a = p.parse_args(argv)
    ep = a.endpoint or default_endpoint()

    def no_broker(e: NoAnswer) -> int:
        """One line on stderr; with --json also an object on stdout, so a script reading stdout
        gets JSON whatever happened."""
        if a.json:
            print(json.dumps({"error": str(e), "endpoint": ep}))
        print(f"hurray-top: {e}", file=sys.stderr)
        return 2

    try:
        client = BrokerQuery(ep)
    except NoAnswer as e:
        return no_broker(e)
    try:
        if a.once or a.json:
            try:
                reply = client.stats(a.timeout)
            except NoAnswer as e:
                return no_broker(e)
            print(json.dumps(reply) if a.json else "\n".join(render(reply, client.endpoint)))
            return 0
        if sys.stdout.isatty():
            return live(client, a.interval, a.timeout)
        return plain_loop(client, a.interval, a.timeout)
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # e.g. piped into head: stop quietly, and say nothing at exit either
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    finally:
        client.close()


if __name__ == "__main__":
    sys.exit(main())
