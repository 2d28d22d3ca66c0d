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
                    "errors": [e.code for e in c.errors], "hold_s": c.hold_s, "error": None}
    except Exception:  # noqa: BLE001 - reported to the parent
        import traceback
        return {"error": traceback.format_exc()}


def hold_fenced_then_leave(endpoint, channel, ready, go, left, after, env):
    """Receive one GPU buffer and hold it; say so on ``ready`` and wait for ``go`` (the fencing
    test stops this process in between, until the broker fenced it). Once the library read the
    fence and registered again, leave (close: BYE) while the application still holds the fenced
    handoff, which the broker no longer counts as held; say so on ``left``, wait for ``after``
    (the producer's application closed the buffer meanwhile), and only then close the mapping, as
    the handoff's release or this process's exit would. Reports the races the emulated runtime
    found here: a free of the producer's before that close is one."""
    import time

    os.environ.update(env)
    from hurray_ipc.client import Consumer
    from hurray_ipc.workload import emulated_races
    try:
        c = Consumer(endpoint, channel, "cuda:0")
        h = c.receive(timeout=30)
        h.buffer.copy_to_host()
        ready.set()
        go.wait(60)
        deadline = time.monotonic() + 30
        # The pump thread reads PRODUCER_GONE, its next PING is answered not_registered, and it
        # registers again (a second epoch) before its BYE.
        while not (h.fenced and c.session.epoch >= 2 and c.session.registered) and time.monotonic() < deadline:
            time.sleep(0.01)
        again = bool(h.fenced and c.session.epoch >= 2 and c.session.registered)
        c.close()
        left.set()
        after.wait(60)
        c.gpu.import_cache.clear()  # the fenced handoff's mapping closes now
        return {"fenced": h.fenced, "registered_again": again, "races": emulated_races(c.gpu), "error": None}
    except Exception:  # noqa: BLE001 - reported to the parent
        return {"error": traceback.format_exc()}


def _as_older_consumer() -> None:
    """Consumers of this process register as ones older than kept mappings: their HELLO lacks
    ``kept_mappings`` (spec §4.10 step 0)."""
    from hurray_ipc.client import consumer as C
    hello = C.Consumer._hello
    C.Consumer._hello = lambda self, epoch: {k: v for k, v in hello(self, epoch).items() if k != "kept_mappings"}


def read_after_its_producer_closed(endpoint, channel, holding, closed, env):
    """A consumer older than kept mappings (its HELLO lacks ``kept_mappings``: the broker answers
    an UNMAP for it at once, spec §4.10 step 4): receive one GPU buffer, say so on ``holding``,
    wait for ``closed`` (the producer's application closed the buffer meanwhile), then read and
    release it. Reports its first byte and the races the emulated runtime found here: a free
    before this read and its release is one."""
    os.environ.update(env)
    from hurray_ipc.client import consumer as C
    from hurray_ipc.workload import emulated_races
    _as_older_consumer()
    try:
        with C.Consumer(endpoint, channel, "cuda:0") as c:
            h = c.receive(timeout=30)
            holding.set()
            closed.wait(60)
            first = int(h.buffer.copy_to_host()[0])
            h.release()
            c.flush_releases(30)
            return {"first": first, "races": emulated_races(c.gpu), "error": None}
    except Exception:  # noqa: BLE001 - reported to the parent
        return {"error": traceback.format_exc()}


def inproc_close_while_out(endpoint, channel, part, env):
    """tests/test_kept_mappings_processes.py's in-process close, in a process of its own: a broken
    variant reads freed memory or address 0, which crashes the emulator's copy (CUDA would answer
    an illegal address), so the crash fails that test instead of the whole test run. A producer
    and a consumer of this process; the consumer's session lock is held across the send and the
    application's close of the buffer (``part``: the whole buffer or a view inside it is sent), so
    the consumer takes the delivery only after the close; then it reads and releases."""
    import threading

    from hurray_ipc.client import Consumer, Producer
    from hurray_ipc.errors import InvalidArgument
    from hurray_ipc.workload import emulated_races
    device = _device("cuda:0", env)
    with Consumer(endpoint, channel, device) as c, Producer(endpoint, channel, device) as p:
        got: list = []
        receiver = threading.Thread(target=lambda: got.append(c.receive(timeout=30)))
        receiver.start()  # its REQUEST gives the producer a grant
        if not p.grant_ready(timeout=30):
            return {"error": "no grant"}
        buf = p.allocate(4096)
        p.stream.memset(buf, 0x5A)
        sent = buf if part == "whole" else device.buffer_at(buf.ptr + 1024, 1024)
        with c.session.lock:  # no pump round of the consumer's until the close returned
            t = p.send(sent, "PRODUCER_SYNCED", timeout=30)
            buf.close()
        receiver.join(60)
        data = got[0].buffer.copy_to_host()
        got[0].release()
        p.wait_released(timeout=30)
        try:
            p.send(buf, timeout=5)
            refused = ""
        except InvalidArgument as e:
            refused = str(e)
        return {"transport": t.transport.value, "size": int(data.size), "intact": bool((data == 0x5A).all()),
                "kept": len(p._kept), "refused": refused, "races": emulated_races(device), "error": None}


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


# --- kept mappings (tests/test_kept_mappings_processes.py, ipc-protocol.md §4.10) -----------------

def kept_producer(endpoint, channel, env, allocs, rounds, size, done, breaks=None, consumer_counted=None):
    """Send each of ``allocs`` buffers ``rounds`` times (written on the producer's stream, each
    release awaited), then close them (once ``consumer_counted`` is set, when given) and wait for
    their UNMAP rounds. ``breaks``: "free-at-close"
    frees a closed buffer at once, without asking its consumers back; "refused" sends UNMAPs the
    broker refuses; "old-broker" reads WELCOMEs
    as from a broker older than kept mappings; "stranger" names a consumer
    the broker never saw among those of every kept buffer; "device-memory" sends
    buffers the producer does not own (allocated on the device, not by ``allocate()``), freed
    after their release as any owner may; "raise-inside" leaves the producer's with-block through an
    exception instead of closing the buffers (so without waiting), and reports its warnings;
    "interrupt-in-wait" gets a Ctrl-C (KeyboardInterrupt) while close() waits for the UNMAP answers,
    with a host slot and (``HURRAY_EVENT_POOL=1``) events idle in its pools, and reports what it
    left: the application catches the Ctrl-C and lives on, as a notebook does."""
    os.environ.update(env)
    import numpy as np

    from hurray_ipc import Producer
    from hurray_ipc.client import producer as P
    from hurray_ipc.workload import emulated_races

    if breaks == "free-at-close":
        P.Producer._closed = lambda self, ptr, free: free()
    elif breaks == "refused":  # every UNMAP names a consumer label the broker refuses
        unmap = P.UnmapMessage
        P.UnmapMessage = lambda request, blob, consumers: unmap(request, blob, consumers=[*consumers, "NOT-A-LABEL"])
    elif breaks == "old-broker":  # its WELCOME does not say it carries kept mappings
        import dataclasses

        from hurray_ipc.wire import messages
        parse = messages.Welcome.parse
        messages.Welcome.parse = classmethod(lambda cls, m: dataclasses.replace(parse(m), kept_mappings=False))
    try:
        with Producer(endpoint, channel, "cuda:0") as p:
            bufs = [p.gpu.allocate(size) if breaks == "device-memory" else p.allocate(size) for _ in range(allocs)]
            for r in range(rounds):
                for i, b in enumerate(bufs):
                    src = np.full(size, (r * allocs + i) & 0xFF, np.uint8)
                    p.stream.copy(b, src)
                    p.send(b)
                    p.flush(30)  # released: ours again
                    p.stream.synchronize()  # src may go
            kept = sum(1 for k in p._kept.values() if k.consumers)
            if breaks == "stranger":  # as if a consumer of a previous broker had been sent them too
                for k in p._kept.values():
                    k.consumers.add("0123456789abcdef")
            if consumer_counted is not None and not consumer_counted.wait(60):
                raise TimeoutError("the consumer never counted its mappings")
            if breaks in ("raise-inside", "interrupt-in-wait"):
                import logging
                seen: list[str] = []
                h = logging.Handler(logging.WARNING)
                h.emit = lambda rec: seen.append(rec.getMessage())  # type: ignore[method-assign]
                logging.getLogger("hurray.producer").addHandler(h)

                def after_close(**more):  # what the producer kept after its close, and what it logged
                    retired = sum(1 for k in p._kept.values() if k.retired)
                    return {"kept": kept, "left": len(p._kept), "retired": retired, "warnings": seen,
                            "races": emulated_races(p.device), **more}
            if breaks == "interrupt-in-wait":
                from hurray_ipc.devices import shm

                def slots() -> int:  # a GPU producer's CPU segments: its staging slots
                    return sum(1 for n in shm.list_segments() if shm.parse_name(n)[1:3] == (os.getpid(), "c"))

                p.staging.release(p.staging.acquire(size))  # idle in the pool, as after any host copy
                pooled = (slots(), p.events.size)
                pump = p.session.pump

                def interrupted(cond, timeout, what):
                    if what == "waiting for consumers to unmap":
                        raise KeyboardInterrupt
                    return pump(cond, timeout, what)

                p.session.pump = interrupted
                try:
                    p.close()
                except KeyboardInterrupt:
                    pass
                else:
                    raise AssertionError("close() never waited for the UNMAP answers")
                return after_close(pooled=pooled, after=(slots(), p.events.size), disconnected=p.session.closed)
            if breaks == "raise-inside":  # leaves a with-block through an exception: close(timeout=0)
                try:
                    with p:
                        raise KeyError("the application failed")
                except KeyError:
                    pass
                return after_close()
            for b in bufs:
                b.close()
            p.session.pump(lambda: not p._rounds, 30, "waiting for the UNMAP rounds")
            left = len(p._kept)
            retired = sum(1 for k in p._kept.values() if k.retired)
        return {"kept": kept, "left": left, "retired": retired, "races": emulated_races(p.device)}
    finally:
        done.set()


def kept_consumer(endpoint, channel, env, count, size, done, breaks=None, counted=None):
    """Receive ``count`` buffers, check each on the consumer's stream, release it; count the
    mappings it opened and keeps, then set ``counted`` (the producer closes its buffers only then:
    an UNMAP answered before the count would empty it); stay registered until ``done`` (the
    producer's UNMAP rounds need our answers), then close. ``breaks``:
    "old-consumer" registers as a consumer older than kept mappings (no ``kept_mappings``);
    "leave-first" closes the consumer (BYE) before ``counted``, so before the producer closes its
    buffers (the process lives on); "bye-with-mappings" does so without closing its kept mappings
    first; "answer-first"
    answers UNMAP before closing the mapping; "keep-everything" keeps every mapping open after its
    release, ``keep`` or not; "deaf-to-unmap" never answers UNMAP (its mappings close when it
    does), so the producer's rounds stay open whatever the timing."""
    os.environ.update(env)
    import numpy as np

    from hurray_ipc import Consumer
    from hurray_ipc.client import consumer as C
    from hurray_ipc.devices import cuda
    from hurray_ipc.wire.messages import Unmapped
    from hurray_ipc.workload import emulated_races

    if breaks == "answer-first":
        def unmap(self, msg):
            self.device.order_send(C.order_key(msg.producer_id, msg.request, f"unmapped:{self._label}"))
            self.session.send(Unmapped(msg.request, producer_id=msg.producer_id))
            self.gpu.import_cache.unmap(bytes(msg.memory), lambda: None)
        C.Consumer._unmap = unmap
    elif breaks == "keep-everything":
        imp = cuda.CudaDevice.import_memory
        cuda.CudaDevice.import_memory = lambda self, exp, keep=False: imp(self, exp, keep=True)
    elif breaks == "bye-with-mappings":
        from hurray_ipc.devices.base import ImportCache
        ImportCache.close_idle = lambda self: None
    elif breaks == "old-consumer":
        _as_older_consumer()
    elif breaks == "deaf-to-unmap":
        C.Consumer._unmap = lambda self, msg: None
    leave = breaks in ("leave-first", "bye-with-mappings")  # BYE before the producer closes its buffers
    values = []
    with Consumer(endpoint, channel, "cuda:0") as c:
        for _ in range(count):
            h = c.receive(timeout=30)
            h.wait()
            out = np.empty(size, np.uint8)
            c.stream.copy(out, h.buffer)
            c.stream.synchronize()
            values.append(int(out[0]) if (out == out[0]).all() else -1)
            h.release()
        c.flush_releases(30)
        opens, kept = c.gpu.import_cache.opens, c.gpu.import_cache.kept()
        if leave:
            c.close()  # the process lives on, and so would a mapping the close left open
        if counted is not None:
            counted.set()  # only now may the producer ask back (an UNMAP taken before the BYE is answered)
        if not done.wait(60):
            raise TimeoutError("the producer never finished")
        left = len(c.gpu.import_cache)
        c.gpu.import_cache.clear()  # what exiting does: a mapping still open closes now
    return {"values": values, "opens": opens, "kept": kept, "left": left, "races": emulated_races(c.device)}


def kept_restart_producer(endpoint, channel, env, size, round_open, restarted, reasked):
    """Send one buffer of allocate() with keep, close it (an UNMAP round opens), tell the test,
    wait while it restarts the broker, tell the test once the round was asked again (or ended),
    then wait for the round to end. Reports whether it did, and how (freed, or retired: the
    consumer was fenced)."""
    os.environ.update(env)
    import time

    from hurray_ipc import BrokerUnavailable, Producer
    from hurray_ipc.workload import emulated_races

    with Producer(endpoint, channel, "cuda:0", heartbeat_s=0.2, timeout_s=3.0) as p:
        b = p.allocate(size)
        p.send(b)
        p.flush(30)
        b.close()
        before = set(p._rounds)
        round_open.set()
        if not restarted.wait(60):
            raise TimeoutError("the broker was never restarted")
        deadline = time.monotonic() + 30
        while set(p._rounds) == before and time.monotonic() < deadline:
            try:  # the broker is away until the test started the new one: BrokerUnavailable meanwhile
                p.session.pump(lambda: set(p._rounds) != before, 1.0, "waiting to ask the new broker")
            except (TimeoutError, BrokerUnavailable):
                pass
        reasked.set()
        deadline = time.monotonic() + 20
        while p._rounds and time.monotonic() < deadline:
            try:
                p.session.pump(lambda: not p._rounds, 1.0, "waiting for the UNMAP round")
            except (TimeoutError, BrokerUnavailable):
                pass
        closed = not p._rounds
        freed, retired = not p._kept, any(k.retired for k in p._kept.values())
    return {"closed": closed, "freed": freed, "retired": retired, "races": emulated_races(p.device)}


def kept_consumer_deaf_to_the_first_broker(endpoint, channel, env, done):
    """Receive one kept buffer and release it; ignore the UNMAPs of the broker it first
    registered with (as if lost with that broker, which the test kills), answer those of a later
    one; stay registered until ``done``."""
    os.environ.update(env)
    from hurray_ipc import Consumer
    from hurray_ipc.client import consumer as C
    from hurray_ipc.workload import emulated_races

    unmap, seen, answered, first = C.Consumer._unmap, [], [], []

    def silent_to_the_first_broker(self, msg):
        seen.append(msg.request)
        if self.session.broker_session not in first:
            answered.append(msg.request)
            unmap(self, msg)

    C.Consumer._unmap = silent_to_the_first_broker
    with Consumer(endpoint, channel, "cuda:0", heartbeat_s=0.2, timeout_s=3.0) as c:
        h = c.receive(timeout=30)
        first.append(c.session.broker_session)
        h.wait()
        h.release()
        c.flush_releases(30)
        if not done.wait(60):
            raise TimeoutError("the producer never finished")
        c.gpu.import_cache.clear()
    return {"asked": seen, "answered": answered, "races": emulated_races(c.device)}


def take_without_waiting(endpoint, channel, how, env):
    """A consumer that orders nothing after its producer's writes: it receives one GPU buffer, then
    ``release``s it at once without ``wait()`` (its fences are on a stream that never waited on the
    producer's event), or exits holding it (``exit``: no release, no BYE; the broker releases it
    for us, RELEASED consumer_gone). Reports the handoff's sync mode (``exit``: nothing)."""
    os.environ.update(env)
    from hurray_ipc.client import Consumer
    try:
        c = Consumer(endpoint, channel, "cuda:0")
        h = c.receive(timeout=30)
        if how == "exit":
            os._exit(0)
        mode = h.sync_mode.wire_name
        h.release()
        c.flush_releases(30)
        c.close()
        return {"mode": mode, "error": None}
    except Exception:  # noqa: BLE001 - reported to the parent
        return {"error": traceback.format_exc()}
