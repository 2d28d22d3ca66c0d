"""The broker's numbers in Prometheus text format (``hurray-broker --metrics-port N``).

The same numbers as STATS_REPLY (docs/spec/ipc-protocol.md §2.3), rendered by a custom collector
from the snapshot the broker loop publishes once a second (``Broker.publish``). The HTTP thread
never touches the core, whose state only the loop's thread may walk, and renders each published
snapshot once: a scrape flood costs a cached body and a socket write per request, not a render.

Owner-only: a TCP port is open to every local user, and the metrics name channels and clients. So
every request must carry ``Authorization: Bearer <token>``, the token read from a file only the
broker's user (and group, with ``--group``) can read (Prometheus: ``authorization:
{credentials_file: ...}``); any other request gets 401 and nothing else. Needs the optional extra
``hurray-ipc[metrics]`` (prometheus-client, for the exposition format); importing this module
without it raises ImportError, which ``hurray-broker`` turns into one line and exit 2.
"""

from __future__ import annotations

import hmac
import threading
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, InfoMetricFamily, Metric

Snapshot = Callable[[], "dict[str, Any] | None"]

# STATS_REPLY "gauges" key -> (metric name, help)
_GAUGES = {
    "clients": ("hurray_broker_clients", "Registered clients"),
    "producers": ("hurray_broker_producers", "Registered producers"),
    "consumers": ("hurray_broker_consumers", "Registered consumers"),
    "channels": ("hurray_broker_channels", "Channels with a registered client"),
    "queued": ("hurray_broker_queued_credits", "Consumer credits waiting for a producer's grant"),
    "grants": ("hurray_broker_grants", "Grants issued and not yet used by a HANDOFF"),
    "outstanding": ("hurray_broker_outstanding_handoffs", "Handoffs delivered and not yet released"),
    "events_outstanding": ("hurray_broker_outstanding_events", "SYNC_EVENT events not yet released"),
    "orphans": ("hurray_broker_orphans", "Handoffs a re-registered producer listed that no consumer claimed yet"),
    "unresponsive": ("hurray_broker_unresponsive_clients", "Clients silent past the timeout whose process lives"),
    "unread_answers": ("hurray_broker_unread_answers", "STATS/CAPS answers queued that their connection has not "
                       "shown it read (spec 6a)"),
    "unread_bytes": ("hurray_broker_unread_answer_bytes", "Bytes of those answers"),
}
# STATS_REPLY "totals" key -> (counter name without _total, help)
_COUNTERS = {
    "handoffs": ("hurray_broker_handoffs", "Handoffs delivered to a consumer"),
    "releases": ("hurray_broker_releases", "Handoffs released back to their producer"),
    "rejected": ("hurray_broker_rejected", "Handoffs refused"),
    "messages_in": ("hurray_broker_messages_in", "Messages received (each entry of a batch counts one)"),
    "messages_out": ("hurray_broker_messages_out", "Messages sent (each entry of a batch counts one)"),
    "wire_in": ("hurray_broker_wire_messages_in", "ZeroMQ messages received"),
    "wire_out": ("hurray_broker_wire_messages_out", "ZeroMQ messages sent"),
    "consumers_lost": ("hurray_broker_consumers_lost", "Consumers that died or timed out"),
    "producers_lost": ("hurray_broker_producers_lost", "Producers that died or timed out"),
    "undeliverable": ("hurray_broker_undeliverable", "Sends to a disconnected peer"),
    "dropped_full": ("hurray_broker_dropped_full", "Sends refused because the peer's queue was full"),
    "limits_refused": ("hurray_broker_limits_refused", "Messages refused by a limit"),
    "answers_withheld": ("hurray_broker_answers_withheld",
                         "STATS/CAPS left unanswered: 8 answers unread, or the query table full (spec 6a)"),
    "grants_revoked": ("hurray_broker_grants_revoked", "Grants revoked because their producer did not use them"),
    "consumers_choked": ("hurray_broker_consumers_choked",
                         "Times a consumer's credits were set aside because a send to it failed (spec 1)"),
    "consumers_fenced": ("hurray_broker_consumers_fenced",
                         "Consumers deregistered holding buffers while they may live (spec 5)"),
    "holds_fenced": ("hurray_broker_holds_fenced",
                     "Deliveries fenced because their consumer held them past the hold bound (spec 5)"),
}
_CHANNEL = ("producers", "consumers", "queued", "ready", "grants", "in_flight")
_CLIENT = ("credits", "outstanding", "events_outstanding", "silent_s")


class StatsCollector:
    """A prometheus-client collector over the latest published snapshot (``snapshot()``)."""

    def __init__(self, snapshot: Snapshot):
        self.snapshot = snapshot

    def collect(self) -> Iterator[Metric]:
        snap = self.snapshot()  # one reference, read once: one consistent snapshot per scrape
        if snap is None:
            return
        b = snap["broker"]
        yield InfoMetricFamily("hurray_broker", "The broker's version, protocol and session",
                               value={"version": str(b["version"]), "protocol": str(b["protocol"]),
                                      "session": str(b["session"]), "pid": str(b["pid"])})
        yield GaugeMetricFamily("hurray_broker_uptime_seconds", "Seconds since the broker started",
                                value=b["uptime_s"])
        for key, (name, doc) in _GAUGES.items():
            yield GaugeMetricFamily(name, doc, value=snap["gauges"][key])
        for key, (name, doc) in _COUNTERS.items():
            yield CounterMetricFamily(name, doc, value=snap["totals"][key])
        errors = CounterMetricFamily("hurray_broker_errors", "ERROR messages sent, by code", labels=["code"])
        for code, n in snap["errors_by_code"].items():
            errors.add_metric([code], n)
        yield errors
        rates = GaugeMetricFamily("hurray_broker_rate_per_second", "Per-second rates over the broker's life and "
                                  "over the recent window (about 10 s)", labels=["counter", "window"])
        for window in ("life", "window"):
            for key, value in snap["rates"][window].items():
                rates.add_metric([key, "life" if window == "life" else "recent"], value)
        yield rates
        shm = snap["shm"]
        yield GaugeMetricFamily("hurray_broker_shm_segments", "This uid's hurray shared-memory segments at the "
                                "last sweep", value=shm["segments"])
        yield CounterMetricFamily("hurray_broker_shm_segments_cleaned", "Stale segments the sweeps removed",
                                  value=shm["cleaned"])
        yield CounterMetricFamily("hurray_broker_shm_sweeps", "Stale-segment sweeps", value=shm["sweeps"])
        truncated = GaugeMetricFamily("hurray_broker_listed_truncated", "Clients / channels left out of the lists",
                                      labels=["list"])
        truncated.add_metric(["clients"], snap["clients_truncated"])
        truncated.add_metric(["channels"], snap["channels_truncated"])
        yield truncated
        per_channel = {k: GaugeMetricFamily(f"hurray_channel_{k}", f"Per channel: {k}", labels=["channel"])
                       for k in _CHANNEL}
        for ch in snap["channels"]:
            for k in _CHANNEL:
                per_channel[k].add_metric([ch["name"]], ch[k])
        yield from per_channel.values()
        labels = ["id", "name", "role", "channel"]
        per_client = {k: GaugeMetricFamily(f"hurray_client_{'silent_seconds' if k == 'silent_s' else k}",
                                           f"Per client: {k}", labels=labels) for k in _CLIENT}
        unresponsive = GaugeMetricFamily("hurray_client_unresponsive", "Per client: 1 when unresponsive",
                                         labels=labels)
        for c in snap["clients"]:
            values = [c["id"], c["name"], c["role"], c["channel"]]
            for k in _CLIENT:
                per_client[k].add_metric(values, c[k])
            unresponsive.add_metric(values, 1 if c["state"] == "unresponsive" else 0)
        yield from per_client.values()
        yield unresponsive


class _Rendered:
    """The exposition text of the latest published snapshot, rendered once per snapshot."""

    def __init__(self, snapshot: Snapshot):
        self.snapshot = snapshot
        self.registry = CollectorRegistry()
        self.registry.register(StatsCollector(lambda: self._snap))
        self._snap: dict[str, Any] | None = None
        self._body = b""
        self._lock = threading.Lock()

    def body(self) -> bytes:
        with self._lock:
            snap = self.snapshot()
            if snap is not self._snap or not self._body:
                self._snap = snap
                self._body = generate_latest(self.registry)
            return self._body


def serve_metrics(snapshot: Snapshot, port: int, addr: str, token: str) -> ThreadingHTTPServer:
    """Serve GET /metrics on ``addr:port`` from a daemon thread, to requests that carry
    ``Authorization: Bearer <token>`` (401 otherwise). OSError when it cannot bind."""
    rendered = _Rendered(snapshot)
    expected = f"Bearer {token}".encode()

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - the http.server API
            given = self.headers.get("Authorization", "").encode(errors="replace")
            if not hmac.compare_digest(given, expected):
                self._reply(401, b"a bearer token is required (hurray-broker --metrics-token-file)\n",
                            {"WWW-Authenticate": "Bearer"})
            elif self.path.split("?", 1)[0] != "/metrics":
                self._reply(404, b"not found: try /metrics\n")
            else:
                self._reply(200, rendered.body(), {"Content-Type": CONTENT_TYPE_LATEST})

        def _reply(self, code: int, body: bytes, headers: dict[str, str] | None = None) -> None:
            self.send_response(code)
            for k, v in (headers or {}).items():
                self.send_header(k, v)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - quiet: the broker logs JSON
            pass

    server = ThreadingHTTPServer((addr, port), Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, name="hurray-metrics", daemon=True).start()
    return server
