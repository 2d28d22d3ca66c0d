"""hurray-inspect: decode a 16-byte buffer handle and say what its sync_mode obliges.

    hurray-inspect "0010000000000000400000000100 0000"  # hex (spaces, 0x and ':' allowed; quote spaces)
    hurray-inspect @handle.bin                         # raw bytes (16) or hex text from a file
    hurray-inspect - < handle.bin                      # the same from stdin
    hurray-inspect --json HEX                          # machine-readable

Exit 0: valid. Exit 2: invalid (the reason on stderr; with --json also on stdout).
Exit 1: the input could not be read at all (bad hex, missing file).
"""

from __future__ import annotations

import argparse
import json
import string
import sys
from pathlib import Path

from ..contract.sync import consumer_obligation
from ..format.handle import BufferHandle, HandleError
from .common import add_version

_HEX = set(string.hexdigits)


def _parse_hex(text: str, where: str) -> bytes:
    cleaned = text.strip().lower().replace("0x", "").replace(":", "").replace(" ", "").replace("\n", "")
    bad = next((c for c in cleaned if c not in _HEX), None)
    if bad is not None or len(cleaned) % 2:
        why = f"non-hex character {bad!r}" if bad is not None else "an odd number of hex digits"
        raise ValueError(f"{where}: {why}")
    return bytes.fromhex(cleaned)


def read_input(arg: str) -> bytes:
    """HEX, ``@FILE`` (raw 16 bytes or hex text) or ``-`` (stdin, the same)."""
    if arg == "-" or arg.startswith("@"):
        data = sys.stdin.buffer.read() if arg == "-" else Path(arg[1:]).read_bytes()
        where = "stdin" if arg == "-" else arg[1:]
        try:
            return _parse_hex(data.decode("ascii"), where)
        except (UnicodeDecodeError, ValueError):
            return data  # raw bytes; decode reports a wrong length itself
    return _parse_hex(arg, "argument")


def describe(handle: BufferHandle) -> dict[str, object]:
    d = handle.to_dict()
    d["valid"] = True
    d["hex"] = handle.encode().hex()
    d["consumer_obligation"] = consumer_obligation(handle.sync_mode)
    return d


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="hurray-inspect", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_version(p)
    p.add_argument("handle", help="HEX, @FILE or - (stdin)")
    p.add_argument("--json", action="store_true", help="print JSON")
    args = p.parse_args(argv)
    try:
        raw = read_input(args.handle)
    except (OSError, ValueError) as e:
        print(f"hurray-inspect: cannot read input: {e}", file=sys.stderr)
        return 1
    try:
        h = BufferHandle.decode(raw)
    except HandleError as e:
        print(f"hurray-inspect: invalid handle: {e}", file=sys.stderr)
        if args.json:
            print(json.dumps({"valid": False, "hex": raw.hex(), "reason": e.reason, "field": e.field,
                              "offset": e.offset, "error": str(e)}))
        return 2
    d = describe(h)
    if args.json:
        print(json.dumps(d))
        return 0
    print(f"handle      {d['hex']}")
    print(f"size        {h.size} bytes")
    print(f"alignment   {h.alignment}")
    print(f"device_tag  {h.device_tag.name} (0x{int(h.device_tag):02x})")
    print(f"sync_mode   {h.sync_mode.wire_name} (0x{int(h.sync_mode):02x})")
    print(f"consumer    {d['consumer_obligation']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
