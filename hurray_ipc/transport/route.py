"""What a bridge tells its broker about the way a channel's buffers leave or enter this machine
(the ROUTE verb, docs/spec/ipc-protocol.md §2.4), so that CAPS_REPLY can say which data plane
and which GPU path they take.

A :class:`Route` is informational: the broker checks and stores it and repeats it to whoever asks
(CAPS); nothing in the broker's handling of handoffs depends on it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, NoReturn

from .protocol import ProtocolError

DIRECTIONS = {"export": "consumer", "import": "producer"}  # direction -> the role that may announce it
DATA_PLANES = ("nixl", "zmq")  # interchange.md R1
GPU_PATHS = ("device", "host-staged")  # interchange.md R5: LINK_WELCOME gpu_source, LINK_HELLO gpu_destination
MAX_LINKS = 64
MAX_PEER_CHARS = 128
MAX_WINDOW = 64  # interchange.md §3: the largest LINK_HELLO window


@dataclass(frozen=True)
class Link:
    """One linked peer bridge: ``peer`` names the other end (an address), ``data_plane`` the plane
    the two agreed on, ``gpu`` how GPU buffers travel on it ("device": read or written in GPU memory
    by the NIC; "host-staged": through host memory; None: this side has no GPU), ``window`` the
    receiver's window of transfers."""

    peer: str
    data_plane: str
    gpu: str | None = None
    window: int | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"peer": self.peer, "data_plane": self.data_plane, "gpu": self.gpu, "window": self.window}

    @classmethod
    def parse(cls, d: Any, where: str) -> Link:
        if not isinstance(d, dict):
            _bad(where, d, "must be an object")
        peer = d.get("peer")
        if not isinstance(peer, str) or not 1 <= len(peer) <= MAX_PEER_CHARS:
            _bad(f"{where}.peer", peer, f"must be a string of 1-{MAX_PEER_CHARS} characters")
        plane = d.get("data_plane")
        if plane not in DATA_PLANES:
            _bad(f"{where}.data_plane", plane, f"must be one of {list(DATA_PLANES)}")
        gpu = d.get("gpu")
        if gpu is not None and gpu not in GPU_PATHS:
            _bad(f"{where}.gpu", gpu, f"must be null or one of {list(GPU_PATHS)}")
        window = d.get("window")
        if window is not None and (type(window) is not int or not 1 <= window <= MAX_WINDOW):
            _bad(f"{where}.window", window, f"must be null or an integer 1-{MAX_WINDOW}")
        return cls(peer, plane, gpu, window)


@dataclass(frozen=True)
class Route:
    """How a client moves its channel's buffers across machines: ``direction`` "export" (a consumer
    that sends them to peer bridges) or "import" (a producer that hands on what a peer bridge sent),
    and its current ``links`` (none while no peer is linked)."""

    direction: str
    links: tuple[Link, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        return {"direction": self.direction, "links": [x.to_dict() for x in self.links]}

    @classmethod
    def parse(cls, d: Any, role: str) -> Route:
        """The ROUTE header's ``route`` object, checked for a client of ``role``; ProtocolError
        ``bad_header`` naming the field (``route.links.3.data_plane``) and its value otherwise."""
        if not isinstance(d, dict):
            _bad("route", d, "must be an object or null")
        direction = d.get("direction")
        if direction not in DIRECTIONS:
            _bad("route.direction", direction, f"must be one of {list(DIRECTIONS)}")
        if DIRECTIONS[direction] != role:
            _bad("route.direction", direction, f"a {role} cannot announce an {direction} route "
                 f"(only a {DIRECTIONS[direction]} can)")
        links = d.get("links")
        if not isinstance(links, list) or len(links) > MAX_LINKS:
            _bad("route.links", links, f"must be a list of at most {MAX_LINKS} links")
        return cls(direction, tuple(Link.parse(x, f"route.links.{i}") for i, x in enumerate(links)))


def _bad(where: str, value: Any, why: str) -> NoReturn:
    """Refuse the ROUTE: ``value`` as found, a string cut to 64 characters, a list or object as its
    JSON text cut to 64 (spec §2.4)."""
    if isinstance(value, str):
        shown: Any = value[:64]
    elif isinstance(value, list | dict):
        shown = json.dumps(value, separators=(",", ":"))[:64]
    else:
        shown = value
    raise ProtocolError("bad_header", f"ROUTE {where} {why}", field=where, value=shown)
