"""hurray-broker: run the broker. SIGTERM/SIGINT shut it down cleanly and tell the clients.

    hurray-broker                  # in the foreground, logging to stderr
    hurray-broker --daemon         # in the background; prints where, its pid and its log; exit 0
    hurray-broker --stop           # stops the one at the endpoint (SIGTERM), waits until it exited; exit 0

Exit 1 when the broker cannot serve (another broker holds the endpoint, an unsafe socket
directory) or --daemon / --stop could not do what they say; 2 on a usage error.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import signal
import sys
from pathlib import Path
from typing import Any

import zmq

from hurray_ipc.cli.common import LOG_LEVELS, add_version, device, endpoint
from hurray_ipc.client.endpoint import default_endpoint

from . import daemon
from .core import HOLD_MAX_S, HOLD_MIN_S
from .logfmt import FORMATS
from .logfmt import configure as configure_logging
from .server import Broker, BrokerAlreadyRunning
from .supervise import Child, Supervisor


def _port(value: str) -> int:
    try:
        n = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r} is not a port number") from None
    if not 0 <= n <= 65535:
        raise argparse.ArgumentTypeError(f"{n} is not a port number (0-65535)")
    return n


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="hurray-broker", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_version(p)
    p.add_argument("--endpoint", type=endpoint, default=None,
                   help=f"ZeroMQ endpoint to bind (default {default_endpoint()})")
    run = p.add_mutually_exclusive_group()
    run.add_argument("--daemon", action="store_true",
                     help="start in the background (ipc:// endpoints) and exit 0 once it answers, or at once "
                     "when a broker already answers there; the log goes to --log-file, else PATH.log beside "
                     "the socket")
    run.add_argument("--stop", action="store_true",
                     help="stop the broker of this endpoint (SIGTERM; this user's only) and wait until it exited")
    # What --daemon starts: the same options plus this one, which makes it serve in the foreground.
    p.add_argument("--detached-child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--log-file", metavar="PATH", help="append the log to PATH instead of stderr")
    p.add_argument("--log-format", choices=FORMATS, default="text",
                   help="text: 'TIME LEVEL EVENT key=value ...' for people (client ids shortened to 8 hex "
                   "digits); json: one object per line (ts, time, level, logger, event, fields). "
                   "Default: %(default)s")
    p.add_argument("--timeout", type=float, default=3.0, help="seconds of client silence before it is dead")
    p.add_argument("--heartbeat", type=float, default=0.5, help="heartbeat interval clients are told")
    p.add_argument("--fence", type=float, default=None, metavar="SECONDS",
                   help="a live consumer silent this long while it holds buffers is fenced: deregistered, "
                   "its buffers retired by their producers, never reused under it (spec §5). "
                   "Default: 20 timeouts; at least --timeout")
    p.add_argument("--hold", type=float, default=None, metavar="SECONDS",
                   help="a delivery a consumer holds this long is fenced, however live the consumer: it is told "
                   "the buffer is gone, its producer retires it, and none of its credits is granted for that long "
                   "(twice as long each later time), so one consumer cannot keep a producer's buffers from the "
                   "others (spec §5). Default: no bound")
    p.add_argument("--group", action="store_true", help="socket 0660 and directory 0750 (default owner-only)")
    p.add_argument("--duration", type=float, default=None, help="stop after this many seconds")
    p.add_argument("--log-level", choices=LOG_LEVELS, default="info", help="default: %(default)s")
    p.add_argument("--export", action="append", default=[], metavar="CHANNEL=tcp://ADDR:PORT",
                   help="bridge: serve this channel's handoffs to remote brokers (repeatable)")
    p.add_argument("--import", dest="imports", action="append", default=[], metavar="CHANNEL=tcp://HOST:PORT",
                   help="bridge: receive this channel from a remote broker's --export (repeatable)")
    p.add_argument("--import-device", type=device, default="cpu", help="hand imported buffers on as cpu or cuda:N")
    p.add_argument("--export-device", type=device, default="cpu",
                   help="take exported buffers as cpu (GPU ones host-staged by their producer) or cuda:N")
    p.add_argument("--bridge-rdma", action="store_true",
                   help="offer NIXL (UCX) as the bridges' data plane (trusted fabrics only: interchange.md R1)")
    p.add_argument("--bridge-keys", metavar="DIR",
                   help="CurveZMQ keys as written by 'python -m hurray_ipc.broker.bridge keygen'")
    p.add_argument("--bridge-insecure", action="store_true", help="bridge over plaintext TCP")
    p.add_argument("--metrics-port", type=_port, default=0, metavar="N",
                   help="serve Prometheus metrics on http://ADDR:N/metrics (0, the default: off; needs "
                   "the 'metrics' extra, prometheus-client)")
    p.add_argument("--metrics-addr", default="127.0.0.1", metavar="ADDR",
                   help="address the metrics endpoint binds (default %(default)s)")
    p.add_argument("--metrics-token-file", metavar="PATH",
                   help="where to write the bearer token every scrape must send (mode 0600, 0640 with "
                   "--group; Prometheus: authorization.credentials_file). Default for an ipc:// endpoint: "
                   "SOCKET.metrics-token beside the socket; required for a tcp:// one")
    a = p.parse_args(argv)
    if a.fence is not None and not (math.isfinite(a.fence) and a.fence >= a.timeout):
        p.error(f"--fence {a.fence} must be at least --timeout ({a.timeout}): a consumer is fenced only "
                "after it was found unresponsive")
    if a.hold is not None and not (math.isfinite(a.hold) and HOLD_MIN_S <= a.hold <= HOLD_MAX_S):
        p.error(f"--hold {a.hold} must be {HOLD_MIN_S} to {HOLD_MAX_S:.0f} seconds (rounded to whole milliseconds)")
    ep = a.endpoint or default_endpoint()
    if (a.daemon and not a.detached_child) or a.stop:
        try:
            line = (daemon.start(sys.argv[1:] if argv is None else argv, ep, a.log_file, a.group) if a.daemon
                    else daemon.stop(ep))
        except daemon.Refused as e:
            print(f"hurray-broker: {e}", file=sys.stderr)
            return e.status
        print(line)
        return 0
    why = configure_logging(a.log_file, a.log_format, a.log_level)
    if why is not None:
        print(f"hurray-broker: {why}", file=sys.stderr)
        return 1
    serve_metrics: Any = None
    token_file: Path | None = None
    if a.metrics_port:
        try:
            from .keyfile import write_token
            from .metrics import serve_metrics
        except ImportError as e:
            print(f"hurray-broker: --metrics-port needs prometheus-client ({e}); install hurray-ipc[metrics]",
                  file=sys.stderr)
            return 2
        if a.metrics_token_file:
            token_file = Path(a.metrics_token_file)
        elif ep.startswith("ipc://"):
            token_file = Path(ep[len("ipc://"):] + ".metrics-token")
        else:
            print(f"hurray-broker: --metrics-port with {ep} needs --metrics-token-file PATH (the bearer token "
                  "every scrape must send)", file=sys.stderr)
            return 2
    try:
        b = Broker(ep, timeout_s=a.timeout, heartbeat_s=a.heartbeat, group=a.group,
                   publish_every_s=1.0 if a.metrics_port else None, fence_s=a.fence,
                   hold_s=a.hold)
    except BrokerAlreadyRunning as e:
        print(f"hurray-broker: {e}", file=sys.stderr)
        return 1
    except (RuntimeError, OSError, zmq.ZMQError) as e:  # an unsafe socket directory, a port in use ...
        print(f"hurray-broker: cannot serve {ep}: {e}", file=sys.stderr)
        return 1
    b.install_signal_handlers()
    if serve_metrics is not None:
        b.publish()
        assert token_file is not None
        try:
            token = write_token(token_file, a.group)  # after the broker checked and made its socket directory
        except OSError as e:
            print(f"hurray-broker: metrics token file {token_file}: {e.strerror or e}", file=sys.stderr)
            b.shutdown("metrics token file unavailable")
            return 2
        try:
            serve_metrics(lambda: b.published, a.metrics_port, a.metrics_addr, token)
        except OSError as e:
            print(f"hurray-broker: metrics endpoint {a.metrics_addr}:{a.metrics_port}: {e.strerror or e}",
                  file=sys.stderr)
            b.shutdown("metrics endpoint unavailable")
            return 2
        logging.getLogger("hurray.broker").info(json.dumps({"event": "metrics_listening", "addr": a.metrics_addr,
                                                            "port": a.metrics_port, "token_file": str(token_file)}))
    try:
        bridges = _bridges(a, b.endpoint)
    except (ValueError, OSError) as e:
        print(f"hurray-broker: {e}", file=sys.stderr)
        b.shutdown("bad bridge options")
        return 2
    # Each bridge in a process of its own (hurray_ipc/broker/supervise.py): a native abort in its NIXL
    # engine costs that link, not this broker and every client's connection.
    supervisor = Supervisor(bridges, {"HURRAY_ROUTE_KEY": b.core.route_key}) if bridges else None
    try:
        if supervisor is not None:
            supervisor.start()
        b.serve(stop_after=a.duration)
    finally:
        # Stopping from here on: a second SIGTERM must not cut the shutdown short. The Python
        # handler would do nothing, but Python puts SIG_DFL back while the interpreter finalizes,
        # and a SIGTERM then killed the broker (exit -15) after its bridges and socket were gone.
        # SIG_IGN stays in place to the end.
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        if supervisor is not None:
            supervisor.stop()
    return 0


def _bridges(a: argparse.Namespace, endpoint: str) -> list[Child]:
    """The bridge processes asked for, each a client of this broker (see hurray_ipc/broker/bridge.py), with
    their options checked here first: a mistake is this command's exit status 2, not a child's."""
    if not (a.export or a.imports):
        return []
    from pathlib import Path

    from .bridge import Curve

    if not a.bridge_keys and not a.bridge_insecure:
        raise ValueError("--export/--import need --bridge-keys DIR (CurveZMQ) or --bridge-insecure")
    keys = Path(a.bridge_keys) if a.bridge_keys else None
    common = ["--endpoint", endpoint, "--timeout", str(a.timeout), "--log-format", a.log_format,
              "--log-level", a.log_level, "--parent", str(os.getpid()),
              *(["--log-file", a.log_file] if a.log_file else []), *(["--rdma"] if a.bridge_rdma else [])]
    out: list[Child] = []
    for spec, make in [(s, "out") for s in a.export] + [(s, "in") for s in a.imports]:
        channel, sep, url = spec.partition("=")
        if not sep or not channel or not url.startswith("tcp://"):
            raise ValueError(f"bridge {spec!r}: expected CHANNEL=tcp://ADDRESS:PORT")
        if not url.rpartition(":")[2].isdigit():  # tcp://*:* would bind a new port at every restart
            raise ValueError(f"bridge {spec!r}: the port must be a number, which the other broker's "
                             f"{'--import' if make == 'out' else '--export'} names too")
        if make == "out":
            if keys:
                Curve.server(str(keys / "server.key_secret"), str(keys / "clients"))  # readable, or ValueError/OSError
            auth = ["--server-key", str(keys / "server.key_secret"), "--clients", str(keys / "clients")] if keys \
                else ["--insecure"]
            argv = ["out", "--channel", channel, "--listen", url, "--device", a.export_device, *auth, *common]
        else:
            if keys:
                Curve.client(str(keys / "client.key_secret"), str(keys / "server.key"))
            auth = ["--client-key", str(keys / "client.key_secret"), "--server-public", str(keys / "server.key")] \
                if keys else ["--insecure"]
            argv = ["in", "--channel", channel, "--connect", url, "--device", a.import_device, *auth, *common]
        out.append(Child(f"{make}:{channel}={url}", argv))
    return out


if __name__ == "__main__":
    sys.exit(main())
