"""hurray-caps: which sync modes are valid for a device on a transport, and why the others are not.

    hurray-caps --device cuda:0 --transport ipc                 # probe the local devices
    hurray-caps --device cuda:0 --peer-device cpu --transport ipc --json
    hurray-caps --broker ipc:///run/user/1000/hurray/broker.sock --channel frames --device cuda:0
    hurray-caps --install-hint                                  # the pip install line for this driver

With --broker the running broker answers (with --channel: for each consumer on that channel, and
for each bridge that carries the channel across machines: its data plane and GPU path); without,
the local devices are probed. JSON keys: valid_sync_modes, excluded, host_staged (and with
--channel: consumers, bridges).
--install-hint prints the pip install line that fits the NVIDIA driver here (the cuda12 or cuda13
extra, from the driver's CUDA version; cuda-bindings need not be installed) and exits.
Exit 0 on an answer, 2 on a usage or device error (e.g. "CUDA unavailable: ...").
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

from ..contract.sync import Transport
from ..devices import DeviceError, open_device
from ..format.handle import SyncMode
from ..transport.pairing import Endpoint, pair_modes
from .common import add_version, cuda_hint, device, endpoint

ORDER = [m.wire_name for m in (SyncMode.PRODUCER_SYNCED, SyncMode.EVENT, SyncMode.CONSUMER_STREAM)]


def local_endpoint(spec: str, pid: int, stream: bool) -> Endpoint:
    dev = open_device(spec)
    return Endpoint(dev.identity, dev.capabilities(), pid, 1 if stream and dev.identity.kind == "cuda" else None)


def local_answer(device: str, peer: str | None, transport: Transport, consumer_stream: bool) -> dict[str, Any]:
    me = local_endpoint(device, os.getpid(), False)
    other_pid = os.getpid() if transport is Transport.IN_PROCESS else os.getpid() + 1
    them = local_endpoint(peer or device, other_pid, consumer_stream)
    out = pair_modes(me, them, transport).to_dict()
    out.update(source="local probe", device=me.identity.to_dict(), peer_device=them.identity.to_dict(),
               capabilities=me.caps.to_dict())
    return out


def broker_answer(endpoint: str, device: str, peer: str | None, channel: str | None, transport: Transport | None,
                  timeout: float) -> dict[str, Any]:
    """The broker's CAPS_REPLY for ``device`` (and ``peer``, ``channel``, ``transport``); raises
    NoAnswer (a ConnectionError) when none comes."""
    from ..client.query import BrokerQuery

    header: dict[str, Any] = {"device": local_endpoint(device, os.getpid(), False).to_dict()}
    if peer:
        header["peer"] = local_endpoint(peer, os.getpid() + 1, True).to_dict()
    if channel:
        header["channel"] = channel
    if transport:
        header["transport"] = transport.value
    with BrokerQuery(endpoint) as q:
        reply = q.caps(header, timeout)
    reply.pop("ticket", None)  # a proof of reading for this connection's next query (§6a), not an answer
    return {"source": f"broker {endpoint}", **reply}


def render(d: dict[str, Any]) -> str:
    lines = [f"{d.get('device_tag', '?')} buffer over {d.get('transport', '?')} ({d.get('source')})"]
    for name in ORDER:
        why = d.get("excluded", {}).get(name)
        lines.append(f"  {name:<22} {'valid' if why is None else 'excluded: ' + why}")
    lines.append(f"  host-staged copy       {'yes' if d.get('host_staged') else 'no'}")
    for c in d.get("consumers", []):
        modes = ", ".join(c["valid_sync_modes"]) or "host-staged"
        lines.append(f"  consumer {c.get('name') or c['consumer_id'][:8]}: {modes}")
    for b in d.get("bridges", []):
        who = b.get("name") or b["client_id"][:8]
        if not b["links"]:
            lines.append(f"  bridge {who} ({b['direction']}): no peer linked")
        for x in b["links"]:
            gpu = {"device": ", GPU buffers in GPU memory (no host staging)",
                   "host-staged": ", GPU buffers host-staged"}.get(x["gpu"], "")
            lines.append(f"  bridge {who} ({b['direction']}) {x['peer']}: {x['data_plane']} data plane{gpu}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="hurray-caps", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_version(p)
    p.add_argument("--broker", type=endpoint, help="ask this running broker (else probe locally)")
    p.add_argument("--channel", help="with --broker: answer for the consumers of this channel")
    p.add_argument("--install-hint", action="store_true",
                   help="print the pip install line for this machine's NVIDIA driver and exit")
    p.add_argument("--device", type=device, help="cpu or cuda:N (the producer's device); required")
    p.add_argument("--peer-device", type=device, help="the consumer's device (default: the same device)")
    p.add_argument("--transport", choices=[t.value for t in Transport], default=None,
                   help="in-process, ipc or network (default ipc)")
    p.add_argument("--no-consumer-stream", action="store_true", help="the consumer names no stream")
    p.add_argument("--timeout", type=float, default=3.0)
    p.add_argument("--json", action="store_true")
    a = p.parse_args(argv)
    if a.install_hint:
        from ..devices.backend import driver as cuda_driver

        print(cuda_driver.install_hint(cuda_driver.driver_cuda_version()))
        return 0
    if a.device is None:
        p.error("the following arguments are required: --device")
    if a.channel and not a.broker:
        p.error("--channel asks the running broker about that channel's consumers: add --broker ENDPOINT")
    try:
        t = Transport.parse(a.transport) if a.transport else None
        if a.broker:
            d = broker_answer(a.broker, a.device, a.peer_device, a.channel, t, a.timeout)
        else:
            d = local_answer(a.device, a.peer_device, t or Transport.IPC, not a.no_consumer_stream)
    except (DeviceError, ValueError, ConnectionError) as e:
        print(f"hurray-caps: {cuda_hint(str(e))}", file=sys.stderr)
        return 2
    print(json.dumps(d) if a.json else render(d))
    return 0


if __name__ == "__main__":
    sys.exit(main())
