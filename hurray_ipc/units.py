"""Byte counts as people write them (command lines, environment variables): one parser for all."""

from __future__ import annotations

_SCALE = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def parse_bytes(text: str) -> int:
    """``4096``, ``64K``, ``1.5M``, ``2GiB``, ``512 MB`` (powers of 1024; case ignored) as a byte
    count >= 0. Raises ValueError saying what is expected."""
    t = text.strip().upper().removesuffix("B").removesuffix("I").rstrip()
    unit = t[-1:] if t[-1:] in "KMG" else ""
    try:
        n = float(t[:len(t) - len(unit)] or "x") * _SCALE[unit]
        if not 0 <= n < float(1 << 63):  # also NaN and inf
            raise ValueError
    except ValueError:
        raise ValueError(f"{text!r} is not a byte count: expected e.g. 4096, 64K, 1M or 2G (powers of 1024)") from None
    return int(n)
