"""The end-to-end demo behind ``scripts/demo``."""

from __future__ import annotations

import sys

from .cli import inspect as inspect_cli
from .format.handle import BufferHandle, DeviceTag, SyncMode


def show_handles() -> None:
    samples = [
        BufferHandle(4096, 4096, DeviceTag.CPU),
        BufferHandle(1 << 20, 256, DeviceTag.CUDA, SyncMode.EVENT),
        BufferHandle(64 << 20, 256, DeviceTag.CUDA, SyncMode.CONSUMER_STREAM),
    ]
    for h in samples:
        print(f"$ hurray-inspect {h.encode().hex()}")
        inspect_cli.main([h.encode().hex()])
        print()
    bad = "00100000000000000010000001ff0000"
    print(f"$ hurray-inspect {bad}   # sync_mode 0xFF: rejected")
    rc = inspect_cli.main([bad])
    print(f"(exit {rc})\n")


def main(argv: list[str] | None = None) -> int:
    show_handles()
    return 0


if __name__ == "__main__":
    sys.exit(main())
