"""``python -m hurray_ipc``: what the package is and how to start; ``python -m hurray_ipc demo`` runs
the end-to-end demo (:func:`hurray_ipc.demo.main`, arguments passed on)."""

from __future__ import annotations

import sys

from . import __version__

OVERVIEW = f"""\
Hurray IPC {__version__}: zero-copy, race-free handoff of GPU and host buffers between processes.
A producer hands an array (numpy, PyTorch, CuPy, anything with __cuda_array_interface__,
__dlpack__ or the buffer protocol) through a local broker to a consumer process, which gets a
zero-copy view ordered after the producer's writes.

Start a broker:
  hurray-broker --daemon          in the background (plain hurray-broker: in the foreground)

Use it from Python:
  from hurray_ipc import Producer, Consumer
  with Producer(channel="frames") as p: p.send(array)
  with Consumer(channel="frames") as c, c.receive() as h: view = h.numpy()

Commands:
  hurray-broker                   the broker (also python -m hurray_ipc.broker)
  hurray-caps --device cuda:0     which sync modes are valid here, and why not the others
  hurray-caps --install-hint      the pip install line for this machine's NVIDIA driver
  hurray-top                      what a running broker is doing, live
  hurray-inspect HEX              decode a buffer handle
  hurray-stress                   checksummed multi-process load with fault injection
  hurray-bench                    Hurray beside pyzmq, multiprocessing and shared memory

Run the demo (starts its own broker; on the CUDA emulation when there is no GPU):
  python -m hurray_ipc demo [--count N] [--size BYTES]
"""

USAGE = "usage: python -m hurray_ipc [demo [ARGS...] | --help | --version]"


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if not args or args[0] in ("-h", "--help", "help"):
        print(OVERVIEW, end="")
        return 0
    if args[0] == "--version":
        print(f"hurray_ipc {__version__}")
        return 0
    if args[0] == "demo":
        from .demo import main as demo_main  # the demo pulls in ZeroMQ and the device layer

        return demo_main(args[1:], prog="python -m hurray_ipc demo")
    print(f"{USAGE}\npython -m hurray_ipc: error: unknown command {args[0]!r}; the one command is 'demo'",
          file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
