"""hurray-broker: run the broker. SIGTERM/SIGINT shut it down cleanly and tell the clients."""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time

from hurray_ipc.client.endpoint import default_endpoint

from .server import Broker


class _JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        msg = record.getMessage()
        try:
            body = json.loads(msg)
            if not isinstance(body, dict):
                raise ValueError
        except ValueError:
            body = {"message": msg}
        return json.dumps({"ts": round(time.time(), 3), "level": record.levelname.lower(), "logger": record.name, **body})


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="hurray-broker", description=__doc__)
    p.add_argument("--endpoint", default=None, help=f"ZeroMQ endpoint to bind (default {default_endpoint()})")
    p.add_argument("--timeout", type=float, default=3.0, help="seconds of client silence before it is dead")
    p.add_argument("--heartbeat", type=float, default=0.5, help="heartbeat interval clients are told")
    p.add_argument("--group", action="store_true", help="socket 0660 and directory 0750 (default owner-only)")
    p.add_argument("--duration", type=float, default=None, help="stop after this many seconds")
    p.add_argument("--log-level", default="info")
    a = p.parse_args(argv)
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(_JsonFormatter())
    logging.basicConfig(level=a.log_level.upper(), handlers=[handler])
    b = Broker(a.endpoint or default_endpoint(), timeout_s=a.timeout, heartbeat_s=a.heartbeat, group=a.group)
    b.install_signal_handlers()
    b.serve(stop_after=a.duration)
    return 0


if __name__ == "__main__":
    sys.exit(main())
