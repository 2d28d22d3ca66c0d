"""Functions run in spawned child processes by the cross-process tests (spawn: CUDA and ZeroMQ
contexts do not survive fork). Each takes a device spec and the environment that selects the
backend, and reports through a multiprocessing queue."""

from __future__ import annotations

import hashlib
import os
import traceback


def _device(spec: str, env: dict[str, str]):
    os.environ.update(env)
    from hurray_ipc.devices import open_device, set_runtime

    set_runtime(None)
    return open_device(spec)


def import_and_read(spec, env, blob, parts, key, q):
    """Import one allocation at several (offset, size) parts; report digests and open count.
    ``key``: the message (the parent's order_send) that orders this after the parent's writes."""
    try:
        from hurray_ipc.devices import MemoryExport

        dev = _device(spec, env)
        dev.order_receive(key)
        stream = dev.create_stream()
        digests = []
        held = []
        for off, size in parts:  # all parts held at once: they share one mapping
            buf = dev.import_memory(MemoryExport(blob, off, size))
            held.append(buf)
            out = bytearray(size)
            stream.copy(out, buf)
            stream.synchronize()
            digests.append(hashlib.sha256(out).hexdigest())
        cache = getattr(dev, "import_cache", None) or dev._cache
        opens = cache.opens
        for buf in held:
            buf.close()
        q.put(("ok", digests, opens, len(cache), cache.closes))
    except Exception:
        q.put(("error", traceback.format_exc()))


def wait_and_read(spec, env, mem_blob, offset, size, ev_blob, do_wait, key, q):
    """Import a buffer and an event; stream-wait on it (unless told not to), read, report.
    ``key``: the parent's order_send key, as a DELIVER would carry it (the blobs travel as
    process arguments, which the race checker does not see)."""
    try:
        from hurray_ipc.devices import MemoryExport, RaceError

        dev = _device(spec, env)
        dev.order_receive(key)
        stream = dev.create_stream()
        buf = dev.import_memory(MemoryExport(mem_blob, offset, size))
        ev = dev.import_event(ev_blob)
        if do_wait:
            stream.wait(ev)
        ev.close()  # the importer destroys its copy once the wait is issued
        out = bytearray(size)
        stream.copy(out, buf)
        race = None
        try:
            stream.synchronize()
        except RaceError as e:
            race = str(e)
        buf.close()
        q.put(("ok", bytes(out), race))
    except Exception:
        q.put(("error", traceback.format_exc()))


def hold_one_buffer(endpoint, channel, ready, go):
    """Receive one CPU buffer, say so on ``ready``, wait for ``go``, then check it and release it.

    The paused-consumer test stops this process between ``ready`` and ``go``."""
    import numpy as np

    from hurray_ipc import workload
    from hurray_ipc.client import Consumer
    try:
        with Consumer(endpoint, channel, "cpu") as c:
            h = c.receive(timeout=30)
            ready.set()
            go.wait(60)
            data = np.frombuffer(h.buffer.host_view() if hasattr(h.buffer, "host_view") else memoryview(h.buffer),
                                 dtype=np.uint8).copy()
            tag, seq, ok = workload.verify(data)
            h.release()
            c.flush_releases(10)
            return {"intact": ok, "seq": seq, "error": None}
    except Exception:  # noqa: BLE001 - reported to the parent
        import traceback
        return {"error": traceback.format_exc()}


def hold_while_fenced(endpoint, channel, ready, go, device="cpu", env=None):
    """Receive one buffer and keep a zero-copy view of it (host buffers) and a copy of its bytes;
    say so on ``ready``, wait for ``go`` (the fencing test stops this process in between, until the
    broker fenced it and the producer reused what it could), then report whether the view still
    shows the bytes as delivered and what the library says of the handoff."""
    import time

    import numpy as np

    os.environ.update(env or {})
    from hurray_ipc.client import Consumer, ProducerGone
    try:
        with Consumer(endpoint, channel, device) as c:
            h = c.receive(timeout=30)
            view = np.frombuffer(h.buffer.host_view(), dtype=np.uint8) if device == "cpu" else None
            first = view.copy() if view is not None else h.buffer.copy_to_host()
            ready.set()
            go.wait(60)
            same = bool(view is None or np.array_equal(view, first))
            deadline = time.monotonic() + 30
            while not h.fenced and time.monotonic() < deadline:  # the pump thread reads PRODUCER_GONE
                time.sleep(0.01)
            try:
                h.buffer.host_view() if view is not None else h.buffer.copy_to_host()
                refused = ""
            except ProducerGone as e:
                refused = str(e)
            h.release()
            return {"same": same, "fenced": h.fenced, "times_fenced": c.fenced, "refused": refused,
                    "errors": [e.code for e in c.errors], "error": None}
    except Exception:  # noqa: BLE001 - reported to the parent
        import traceback
        return {"error": traceback.format_exc()}


def emulated_writer_that_exits(delay, host_wait, key, q, done):
    """Write a pattern into emulated device memory on a stream, host-wait it before telling the
    parent (``host_wait``) or only after, hand the parent the memory (a queue message, annotated as
    the broker's would be), and exit once the parent imported it (``done``)."""
    try:
        from hurray_ipc.devices import CudaDevice
        from hurray_ipc.devices.backend.emulated import EmulatedRuntime, EmulationConfig
        dev = CudaDevice(0, runtime=EmulatedRuntime(EmulationConfig(op_delay_s=delay)))
        s = dev.create_stream()
        buf = dev.allocate(4096)
        s.memset(buf, 0x5A)
        if host_wait:
            s.synchronize()
        dev.order_send(key)
        exp = dev.export_memory(buf)
        q.put(("ok", exp.blob, exp.offset, exp.size))
        s.synchronize()  # the write ran, but the parent was told before: nothing orders its read after it
        done.wait(60)
    except Exception:  # noqa: BLE001 - reported to the parent
        q.put(("error", traceback.format_exc()))


def copy_to_host_consumer(endpoint, channel, device, count, env, q):
    """A consumer process that reads each buffer with copy_to_host() (no framework): (tag, seq, ok)
    per buffer, and the races its emulated runtime recorded."""
    try:
        os.environ.update(env)
        from hurray_ipc import Consumer, workload

        out = []
        with Consumer(endpoint, channel, device) as c:
            for _ in range(count):
                with c.receive(timeout=30) as h:
                    out.append((workload.verify(h.buffer.copy_to_host().reshape(-1).view("u1")), h.staged))
            races = workload.emulated_races(c.device)
        q.put(("ok", out, races))
    except Exception:
        q.put(("error", traceback.format_exc()))


def receive_one_later(endpoint, channel, ready, go):
    """Register, say so on ``ready``, wait for ``go`` (the squatting test stops this process
    meanwhile), then receive one CPU buffer, check it and release it."""
    import numpy as np

    from hurray_ipc import workload
    from hurray_ipc.client import Consumer
    try:
        with Consumer(endpoint, channel, "cpu") as c:
            c.session.pump(lambda: c.session.registered, 30, "registration")
            ready.set()
            go.wait(60)
            with c.receive(timeout=30) as h:
                tag, seq, ok = workload.verify(np.frombuffer(h.buffer.host_view(), dtype=np.uint8).copy())
            c.flush_releases(10)
            return {"intact": ok, "seq": seq, "error": None}
    except Exception:  # noqa: BLE001 - reported to the parent
        import traceback
        return {"error": traceback.format_exc()}


def collect(endpoint, channel, n):
    """Receive ``n`` CPU buffers of ``channel``: their bytes (hex), typestr and shape, each released."""
    from hurray_ipc.client import Consumer

    out = []
    with Consumer(endpoint, channel, "cpu") as c:
        for _ in range(n):
            h = c.receive(timeout=30)
            out.append({"hex": bytes(h.buffer.host_view()).hex(), "typestr": h.buffer.typestr,
                        "shape": list(h.buffer.shape)})
            h.release()
    return out


def once_let_through(gate, target, **kwargs):
    """``target(**kwargs)`` once ``gate`` (a multiprocessing Event) is set: a test starts the process
    ahead of the moment its scenario needs it (a spawned interpreter takes a good part of a
    second), and lets it through then. Nothing of ``target`` runs before: a consumer has not connected."""
    if not gate.wait(60):
        return {"error": "the test never let this process through"}
    return target(**kwargs)


def hold_first_then_receive(endpoint, channel, count, held, go, timeout=20.0):
    """A CPU consumer that keeps its first handoff (A) unreleased, sets ``held``, receives and
    releases ``count`` more (waiting for ``go`` before releasing A, if given, else after the
    rest), then reads A again. Reports A's bytes as received and as read at the end, the others'
    (tag, seq, intact) and how many shared-memory mappings it opened (tests/test_host_slots.py)."""
    from hurray_ipc import Consumer, workload

    with Consumer(endpoint, channel, "cpu") as c:
        a = c.receive(timeout=timeout)
        first = a.numpy().copy()
        held.set()
        if go is not None:
            assert go.wait(timeout), "go was never set"
            a.release()
        others = []
        for _ in range(count):
            h = c.receive(timeout=timeout)
            others.append(workload.verify(h.numpy()))
            h.release()
        last = a.numpy().copy() if go is None else first
        if go is None:
            a.release()
        c.flush_releases(timeout)
        return {"first": first.tobytes(), "last": last.tobytes(), "others": others,
                "opens": c.device._cache.opens}
