"""Structured log events: how a pure core says what happened without logging it itself.

Every core (``BrokerCore``, ``SenderCore``, ``ReceiverCore``) takes a :data:`Note`, called as
``note(level, {"event": name, ...fields})``. Its loop passes :func:`to_logger`'s, which writes one
JSON object per record, the shape ``broker/logfmt.py`` renders as text or JSON; a test passes a
list's ``append`` and reads the events without a logger.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from typing import Any

__all__ = ["Note", "to_logger"]

Note = Callable[[int, dict[str, Any]], None]  # (logging level, {"event": name, ...fields})


def to_logger(name: str) -> Note:
    """A Note that logs each event as one JSON object on logger ``name``."""
    logger = logging.getLogger(name)

    def note(level: int, fields: dict[str, Any]) -> None:
        logger.log(level, json.dumps(fields))

    return note
