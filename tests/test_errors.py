"""Every misuse a new user meets gets a typed, one-line error naming what, where and the value
(issue 21): a HurrayError that is also the builtin a numpy or torch user catches."""

from __future__ import annotations

import re
import time
from typing import Any

import numpy as np
import pytest

import hurray_ipc
from hurray_ipc import (
    AlreadyReleasedError,
    BrokerUnavailable,
    ClosedError,
    Consumer,
    DeviceError,
    HurrayError,
    HurrayTimeout,
    InvalidArgument,
    MissingDependency,
    Producer,
    SyncMode,
    UnsupportedObject,
)
from test_end_of_stream import channel_state  # noqa: E402 - a test helper module

BUILTIN = {BrokerUnavailable: ConnectionError, InvalidArgument: ValueError, MissingDependency: ImportError,
           UnsupportedObject: TypeError, ClosedError: RuntimeError, DeviceError: RuntimeError,
           AlreadyReleasedError: RuntimeError, HurrayTimeout: TimeoutError}


def refused(call: Any, error: type[BaseException], *words: str) -> str:
    with pytest.raises(error) as e:
        call()
    msg = str(e.value)
    assert isinstance(e.value, HurrayError) and isinstance(e.value, BUILTIN.get(error, error)), type(e.value).__mro__
    assert "\n" not in msg and len(msg) < 600, msg
    for w in words:
        assert w in msg, (w, msg)
    return msg


def test_the_hierarchy_is_exported_and_each_is_its_builtin_too():
    for name in ("HurrayError", "InvalidArgument", "UnsupportedObject", "ExportRefused", "HurrayTimeout",
                 "ClosedError", "EndOfStream", "BrokerUnavailable", "RemoteError", "ProducerGone", "DeviceError",
                 "HandleError", "HandoffError", "AlreadyReleasedError"):
        assert issubclass(getattr(hurray_ipc, name), HurrayError), name
        assert name in hurray_ipc.__all__
    assert issubclass(hurray_ipc.ExportRefused, BufferError) and issubclass(hurray_ipc.EndOfStream, EOFError)
    assert issubclass(hurray_ipc.BrokerUnavailable, ConnectionError)
    assert SyncMode.SYNC_EVENT is SyncMode.EVENT and SyncMode.SYNC_CONSUMER_STREAM is SyncMode.CONSUMER_STREAM
    assert [m.wire_name for m in SyncMode] == ["SYNC_PRODUCER_SYNCED", "SYNC_EVENT", "SYNC_CONSUMER_STREAM"]


def test_constructor_arguments_are_checked_before_anything_connects(tmp_path):
    ep = f"ipc://{tmp_path}/none.sock"
    refused(lambda: Producer(ep, channel=""), InvalidArgument, "Producer(channel=)", "1 to 256 characters")
    refused(lambda: Consumer(ep, channel="x" * 300), InvalidArgument, "Consumer(channel=)")
    refused(lambda: Producer(ep, "c", prefetch=0), InvalidArgument, "Producer(prefetch=)", "from 1 to 4096", "got 0")
    # More than one request may ask for: the broker would refuse every REQUEST and the client never receive.
    refused(lambda: Consumer(ep, "c", prefetch=4097), InvalidArgument, "Consumer(prefetch=)", "4097")
    refused(lambda: Producer(ep, "c", prefetch=2**64), InvalidArgument, "Producer(prefetch=)")
    refused(lambda: Producer(ep, "c", heartbeat_s=float("inf")), InvalidArgument, "Producer(heartbeat_s=)", "inf")
    refused(lambda: Consumer(ep, "c", prefetch=-1), InvalidArgument, "Consumer(prefetch=)", "-1")
    refused(lambda: Producer(ep, "c", timeout_s=0), InvalidArgument, "Producer(timeout_s=)")
    refused(lambda: Producer(ep, "c", device="gpu"), InvalidArgument, "Producer(device=)", "'cpu' or 'cuda:N'",
            "'gpu'")
    refused(lambda: Consumer(ep, "c", device=3), InvalidArgument, "Consumer(device=)", "(got 3)")
    refused(lambda: Producer(ep, "c", stream=1), InvalidArgument, "Producer(stream=)", "cpu has no streams")
    refused(lambda: Producer("/tmp/x.sock", "c"), InvalidArgument, "endpoint=", "did you mean ipc:///tmp/x.sock")


def test_cuda_without_a_gpu_names_the_emulation(monkeypatch):
    monkeypatch.delenv("HURRAY_CUDA", raising=False)
    from hurray_ipc.devices import CudaDevice
    from hurray_ipc.devices.backend import real

    monkeypatch.setattr(real.RealRuntime, "probe", lambda self: "no NVIDIA driver found")
    monkeypatch.setattr("hurray_ipc.devices.backend.driver.driver_cuda_version", lambda: None)
    refused(lambda: CudaDevice(0, runtime=real.RealRuntime()), DeviceError, "CUDA unavailable",
            "HURRAY_CUDA=emulated")


def test_what_send_refuses_and_how(broker):
    with Producer(broker.endpoint, "refuse", "cpu") as p:
        refused(lambda: p.send([1, 2, 3]), UnsupportedObject, "send()", "cannot hand off a list", "numpy.asarray")
        refused(lambda: p.send({"a": 1}), UnsupportedObject, "cannot hand off a dict")
        refused(lambda: p.send(np.array(["2020-01-01"], dtype="datetime64[D]")), UnsupportedObject,
                "dtype datetime64[D]", "only numbers and bools")
        refused(lambda: p.send(np.arange(12.0).reshape(3, 4)[:, ::2]), InvalidArgument, "strides (32, 16)",
                "numpy.ascontiguousarray")
        refused(lambda: p.send(b"x", mode="EVENT"), InvalidArgument, "send(mode=)", "SYNC_EVENT is for GPU buffers")
        refused(lambda: p.send(b"x", mode=3), InvalidArgument, "send(mode=)")
        refused(lambda: p.send(b"x", mode="FAST"), InvalidArgument, "send(mode=)", "unknown sync mode 'FAST'")
        refused(lambda: p.send(b"x", timeout="5"), InvalidArgument, "send(timeout=)", "'5'")
        refused(lambda: p.send(b"x", stream=1), InvalidArgument, "send(stream=)", "without a CUDA device")
        refused(lambda: p.allocate(-1), InvalidArgument, "allocate(size=)", "-1")
        refused(lambda: p.allocate(1.5), InvalidArgument, "allocate(size=)", "1.5")
        refused(lambda: p.send(b"x", on_release=5), InvalidArgument, "send(on_release=)", "callable", "5")
        refused(lambda: p.send_many([b"x"], on_release="f"), InvalidArgument, "send_many(on_release=)")
        refused(lambda: p.send(b"x", readonly="no"), InvalidArgument, "send(readonly=)", "'no'")
        refused(lambda: p.send(np.zeros(8, np.uint8), shape=[1] * 33 + [8]), InvalidArgument, "send(shape=)",
                "at most 32")  # was where='send()' and '(got None)'
        refused(lambda: p.send(b"x", meta={"n": 10**5000}), InvalidArgument, "send(meta=)", "meta['n']",
                "16610 bits")
        refused(lambda: p.send_many(None), InvalidArgument, "send_many(objs=)", "a list", "NoneType")  # type: ignore[arg-type]
        refused(lambda: p.send_many(np.zeros((2, 4))), InvalidArgument, "send_many(objs=)", "ndarray")  # type: ignore[arg-type]
        assert p.allocate(np.int64(8)).size == 8
        assert not p._out and not p.grants and p.staging.in_use == 0  # none of it took anything


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -1, "5", 10**400, True])
def test_every_wait_checks_its_timeout(broker, bad):
    """A timeout is None or finite seconds >= 0 on every call that waits: NaN once hung flush() for
    ever, a huge int raised OverflowError from inside the wait, a str a TypeError."""
    with Producer(broker.endpoint, "timeouts", "cpu") as p, Consumer(broker.endpoint, "timeouts", "cpu") as c:
        for where, call in [("send(timeout=)", lambda: p.send(b"x", timeout=bad)),
                            ("flush(timeout=)", lambda: p.flush(bad)),
                            ("wait_released(timeout=)", lambda: p.wait_released(bad)),
                            ("grant_ready(timeout=)", lambda: p.grant_ready(bad)),
                            ("receive(timeout=)", lambda: c.receive(bad)),
                            ("flush_releases(timeout=)", lambda: c.flush_releases(bad)),
                            ("wait_open(timeout=)", lambda: c.wait_open(bad))]:
            refused(call, InvalidArgument, where, "finite number of seconds")
        refused(lambda: p.close(bad), InvalidArgument, "close(timeout=)")
        assert not p.session.closed


def test_send_with_timeout_0_and_a_grant_here_returns_the_ticket_of_the_one_handoff(broker):
    """``timeout`` bounds the wait for a grant, not the broker's answer to a handoff already out: with a
    grant here, send(timeout=0) returns its ticket. (It used to raise HurrayTimeout for a handoff that was
    delivered all the same, so a caller that retried sent it twice.)"""
    with Producer(broker.endpoint, "t0", "cpu") as p, Consumer(broker.endpoint, "t0", "cpu") as c:
        refused(lambda: c.receive(timeout=0), HurrayTimeout)  # asks for a buffer: the producer gets a grant
        assert p.grant_ready(10)
        t = p.send(np.arange(3), timeout=0)
        assert t.error is None
        h = c.receive(timeout=10)
        assert list(h.numpy()) == [0, 1, 2]
        h.release()
        p.flush(10)
        refused(lambda: c.receive(timeout=0), HurrayTimeout)  # nothing else came


def test_receive_and_handoff_misuse(broker):
    with Consumer(broker.endpoint, "misuse", "cpu") as c, Producer(broker.endpoint, "misuse", "cpu") as p:
        refused(lambda: c.receive(timeout=-1), InvalidArgument, "receive(timeout=)", "-1")
        refused(lambda: Consumer(broker.endpoint, "misuse", "cpu", stream=5), InvalidArgument, "has no streams")
        refused(lambda: c.receive(timeout=0), HurrayTimeout, "timed out after 0 s", "channel 'misuse'")
        p.send(np.arange(3), timeout=5)
        h = c.receive(timeout=5)
        refused(lambda: h.buffer.__dlpack__(stream=3), InvalidArgument, "takes only None")
        # the standard's types, each checked (they raised TypeError/ValueError from inside):
        refused(lambda: h.buffer.__dlpack__(max_version=5), InvalidArgument, "__dlpack__(max_version=)", "5")
        refused(lambda: h.buffer.__dlpack__(max_version="ab"), InvalidArgument, "(major, minor)")
        refused(lambda: h.buffer.__dlpack__(dl_device=("a", "b")), InvalidArgument, "__dlpack__(dl_device=)")
        refused(lambda: h.buffer.__dlpack__(copy="yes"), InvalidArgument, "__dlpack__(copy=)", "'yes'")
        assert np.from_dlpack(h.buffer).tolist() == [0, 1, 2]  # numpy's own keywords still pass
        refused(lambda: h.buffer.copy_to_host(bytearray(2)), InvalidArgument, "exactly 24 bytes")
        h.release()
        refused(h.release, AlreadyReleasedError, "already released")
        refused(h.numpy, AlreadyReleasedError, "was released")


def test_after_close_every_call_is_a_closed_error(broker):
    p = Producer(broker.endpoint, "closed", "cpu")
    c = Consumer(broker.endpoint, "closed", "cpu")
    p.close()
    c.close()
    refused(lambda: p.send(b"x"), ClosedError, "was closed before send")
    refused(lambda: p.allocate(8), ClosedError, "was closed before allocate")
    refused(lambda: p.send_many([b"x"]), ClosedError, "was closed")
    p.end()  # close() ended the stream already: nothing to do
    refused(lambda: c.receive(timeout=1), ClosedError, "was closed", "channel 'closed'")
    q = Producer(broker.endpoint, "closed", "cpu")
    q.close(end=False)
    refused(q.end, ClosedError, "was closed before end()")
    refused(lambda: list(c), ClosedError, "was closed before iterating over it", "channel 'closed'")
    p.close()
    c.close()  # idempotent


def test_without_a_broker_the_error_says_so_and_how_to_start_one(tmp_path):
    ep = f"ipc://{tmp_path}/none.sock"
    with Consumer(ep, "nobroker", "cpu", heartbeat_s=0.1, timeout_s=1.0) as c:
        # No socket file: no broker can answer, so the call's own timeout ends as BrokerUnavailable.
        msg = refused(lambda: c.receive(timeout=0.3), BrokerUnavailable, "no broker answered", "does not exist",
                      "hurray-broker --daemon")
        assert re.search(r"\(this call waited 0\.\d s while waiting for a handoff on channel 'nobroker'\)", msg), msg
        msg = str(pytest.raises(BrokerUnavailable, c.receive, timeout=10).value)  # silence past timeout_s
        assert "no broker answered" in msg and "hurray-broker --daemon" in msg and "does not exist" in msg
        assert re.search(r"in the \d+\.\d s since this consumer connected \(this call waited \d+\.\d s", msg), msg


def test_ctrl_c_leaves_a_producer_at_once_without_ending_the_stream(broker):
    """A handoff is outstanding (delivered, not released): a normal close waits up to 5 s for its
    release; leaving through Ctrl-C does not wait, and does not end the stream."""
    with Consumer(broker.endpoint, "ctrlc", "cpu") as c:
        pytest.raises(HurrayTimeout, c.receive, timeout=0)  # asks for one
        t0 = time.monotonic()
        with pytest.raises(KeyboardInterrupt), Producer(broker.endpoint, "ctrlc", "cpu") as p:
            p.send(b"held", timeout=5)
            raise KeyboardInterrupt
        assert time.monotonic() - t0 < 2.5, "close waited for the release after Ctrl-C"
        until_gone = time.monotonic() + 10
        while channel_state(broker.endpoint, "ctrlc")[0]:  # the broker saw the producer go...
            assert time.monotonic() < until_gone
            time.sleep(0.02)
        assert channel_state(broker.endpoint, "ctrlc") == (0, False)  # ...and no END came before


def test_a_cuda_buffer_and_a_torch_without_cuda(broker, monkeypatch):
    """h.torch() on a CUDA buffer with a CPU build of torch (or none) says what to do instead of
    torch's AssertionError; h.cupy() without CuPy is a MissingDependency (an ImportError)."""
    import sys
    import threading
    import types

    from conftest import emu_config
    from hurray_ipc.devices import CudaDevice, set_runtime
    from hurray_ipc.devices.backend.emulated import EmulatedRuntime

    cpu_torch = types.SimpleNamespace(cuda=types.SimpleNamespace(is_available=lambda: False),
                                      from_dlpack=lambda x: pytest.fail("torch was asked for CUDA memory"))
    monkeypatch.setitem(sys.modules, "torch", cpu_torch)
    monkeypatch.setitem(sys.modules, "cupy", None)  # import cupy -> ImportError
    rt = EmulatedRuntime(emu_config(op_delay_s=0.0))
    set_runtime(rt)
    try:
        dev = CudaDevice(0, runtime=rt)
        with Producer(broker.endpoint, "torchless", dev) as p, Consumer(broker.endpoint, "torchless", dev) as c:
            th = threading.Thread(target=lambda: p.send(p.allocate(16)), daemon=True)
            th.start()
            with c.receive(timeout=10) as h:
                refused(h.torch, UnsupportedObject, "ReceivedHandoff.torch()", "this torch has no CUDA",
                        "copy_to_host()")
                refused(h.cupy, MissingDependency, "this needs cupy", "pip install cupy")
                refused(h.numpy, UnsupportedObject, "numpy()", "has no host view", "copy_to_host()")
            th.join(10)
    finally:
        set_runtime(None)


def test_clients_refuse_a_socket_directory_another_user_could_swap(tmp_path):
    """Red team high item 6: with XDG_RUNTIME_DIR unset, another user creates /tmp/hurray-<uid>
    and runs a fake broker there; the broker refused such a directory but clients connected to it.
    Clients now check it as the broker does before they connect."""
    import os
    import stat

    from hurray_ipc import UnsafeEndpoint

    open_dir = tmp_path / "open"
    open_dir.mkdir()
    open_dir.chmod(0o777)
    refused(lambda: Producer(f"ipc://{open_dir}/broker.sock", "c"), UnsafeEndpoint, "mode 777",
            "other users could replace")
    sticky = tmp_path / "sticky"
    sticky.mkdir()
    sticky.chmod(0o1777)
    Consumer(f"ipc://{sticky}/broker.sock", "c").close()  # /tmp-like: the sticky bit protects names
    if os.getuid() == 0:
        theirs = tmp_path / "theirs"
        theirs.mkdir(mode=0o755)
        os.chown(theirs, 54321, 54321)
        refused(lambda: Consumer(f"ipc://{theirs}/broker.sock", "c"), UnsafeEndpoint, "belongs to uid 54321")
    assert issubclass(UnsafeEndpoint, PermissionError) and stat.S_ISVTX


@pytest.mark.parametrize(("message", "value", "shown"), [
    ("a prefetch from 1 to 4096", 0, True),  # '0' is not in '4096' as a word
    ("between 1.5 and 2", 1, True),  # nor '1' in '1.5'
    ("no window of 1.5.", 1.5, False),  # a value that ends the sentence is shown already
    ("no window of 1.5: ask again", 1.5, False),
    ("size 16 at least", 16, False),
])
def test_a_refusal_shows_the_value_once(message, value, shown):
    text = str(InvalidArgument(message, where="f(x=)", value=value))
    assert text.endswith(f"(got {value!r})") == shown, text

