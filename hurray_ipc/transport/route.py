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

from ..wire.fields import ABSENT, FieldError, check, obj, one_of
from ..wire.ipc import ProtocolError
from ..wire.link import MAX_WINDOW

DIRECTIONS = {"export": "consumer", "import": "producer"}  # direction -> the role that may announce it
DATA_PLANES = ("nixl", "zmq")  # interchange.md R1
GPU_PATHS = ("device", "host-staged")  # interchange.md R5: LINK_WELCOME gpu_source, LINK_HELLO gpu_destination
MAX_LINKS = 64
MAX_PEER_CHARS = 128


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
        """One entry of ``route.links`` at path ``where``; FieldError naming the field otherwise."""
        d = obj(d, where)
        peer = check(d.get("peer"), f"{where}.peer", str, min_len=1, max_len=MAX_PEER_CHARS)
        plane = one_of(d.get("data_plane"), f"{where}.data_plane", DATA_PLANES)
        gpu = one_of(d.get("gpu"), f"{where}.gpu", (None, *GPU_PATHS))
        window = check(d.get("window"), f"{where}.window", (int, type(None)), lo=1, hi=MAX_WINDOW)
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
        try:
            d = obj(d, "route")
            direction = one_of(d.get("direction"), "route.direction", tuple(DIRECTIONS))
            if DIRECTIONS[direction] != role:
                raise FieldError("route.direction", f"a {role} cannot announce an {direction} route "
                                 f"(only a {DIRECTIONS[direction]} can)", direction)
            links = check(d.get("links"), "route.links", list, max_len=MAX_LINKS)
            return cls(direction, tuple(Link.parse(x, f"route.links.{i}") for i, x in enumerate(links)))
        except FieldError as e:
            _bad(e.path, None if e.value is ABSENT else e.value, e.why)


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
