"""The sync contract: valid modes per transport (vectors) and the handoff object's lifetimes."""

from __future__ import annotations

import gc
import json
import threading
import warnings
from pathlib import Path

import pytest

from hurray_ipc import (
    AlreadyReleasedError,
    BufferHandle,
    DeviceTag,
    EndpointCapabilities,
    HandleError,
    Handoff,
    HandoffError,
    SyncMode,
    Transport,
    check_network_handle,
    choose_sync_mode,
    explain_sync_modes,
    valid_sync_modes,
)

VEC = Path(__file__).parent / "vectors"
SYNC_CASES = json.loads((VEC / "sync_modes.json").read_text())["cases"]
HANDLES = json.loads((VEC / "buffer_handles.json").read_text())


def _case_id(c):
    caps = "".join(k[0] for k, v in c["capabilities"].items() if v)
    return f"{c['device_tag']}-{c['transport']}-{caps or 'none'}-{'s' if c['consumer_stream'] else 'nos'}"


@pytest.mark.parametrize("case", SYNC_CASES, ids=_case_id)
def test_sync_mode_vectors(case):
    caps = EndpointCapabilities(**case["capabilities"])
    got = valid_sync_modes(DeviceTag[case["device_tag"]], Transport.parse(case["transport"]), caps,
                           consumer_stream=case["consumer_stream"])
    assert sorted(m.wire_name for m in got) == sorted(case["valid"])
    assert (not got and DeviceTag[case["device_tag"]] is not DeviceTag.CPU) == case["host_staged"]


def test_every_excluded_mode_has_a_reason():
    why = explain_sync_modes(DeviceTag.CUDA, Transport.IPC, EndpointCapabilities(ipc_events=False))
    assert why[SyncMode.PRODUCER_SYNCED] is None
    assert "IPC-exportable events" in why[SyncMode.EVENT]
    assert "not IPC-exportable" in why[SyncMode.CONSUMER_STREAM]
    why = explain_sync_modes(DeviceTag.CUDA, Transport.IPC,
                             EndpointCapabilities(shared_memory=False,
                                                  memory_reason="consumer on another GPU without peer access"))
    assert set(why.values()) == {"consumer on another GPU without peer access"}


def test_choose_prefers_cheapest_then_preferred():
    allm = frozenset(SyncMode)
    assert choose_sync_mode(allm) is SyncMode.EVENT
    assert choose_sync_mode(frozenset({SyncMode.PRODUCER_SYNCED})) is SyncMode.PRODUCER_SYNCED
    assert choose_sync_mode(allm, SyncMode.CONSUMER_STREAM) is SyncMode.CONSUMER_STREAM
    assert choose_sync_mode(frozenset({SyncMode.PRODUCER_SYNCED}), SyncMode.EVENT) is SyncMode.PRODUCER_SYNCED
    assert choose_sync_mode(frozenset()) is None


@pytest.mark.parametrize("vec", HANDLES["network"], ids=lambda v: v["name"])
def test_network_vectors(vec):
    h = BufferHandle.decode(bytes.fromhex(vec["hex"]))
    if vec["accept"]:
        assert check_network_handle(h) is h
    else:
        with pytest.raises(HandleError) as ei:
            check_network_handle(h)
        assert ei.value.reason == vec["reason"]


# --- handoff ---------------------------------------------------------------------------------

CUDA_EV = BufferHandle(64, 64, DeviceTag.CUDA, SyncMode.EVENT)
CUDA_P1 = BufferHandle(64, 64, DeviceTag.CUDA)
CUDA_P3 = BufferHandle(64, 64, DeviceTag.CUDA, SyncMode.CONSUMER_STREAM)


class Counter:
    def __init__(self):
        self.n = 0
        self.lock = threading.Lock()

    def __call__(self):
        with self.lock:
            self.n += 1


@pytest.mark.parametrize(
    "handle,kw,reason",
    [
        (CUDA_EV, {}, "missing_sync_handle"),
        (CUDA_EV, {"sync_handle": 1, "sync_handle_device_tag": DeviceTag.CUDA}, "missing_event_release"),
        (CUDA_EV, {"sync_handle": 1, "event_release": lambda: None}, "sync_handle_device_tag"),
        (CUDA_EV, {"sync_handle": 1, "sync_handle_device_tag": DeviceTag.ROCM, "event_release": lambda: None},
         "sync_handle_device_tag"),
        (CUDA_EV, {"sync_handle": 1, "sync_handle_device_tag": DeviceTag.CUDA, "event_release": lambda: None,
                   "consumer_stream": 5}, "unexpected_consumer_stream"),
        (CUDA_P1, {"sync_handle": 1}, "unexpected_sync_handle"),
        (CUDA_P1, {"consumer_stream": 7}, "unexpected_consumer_stream"),
        (CUDA_P3, {}, "missing_consumer_stream"),
        (CUDA_P3, {"consumer_stream": 7, "event_release": lambda: None}, "unexpected_sync_handle"),
    ],
)
def test_mismatched_payload_rejected(handle, kw, reason):
    with pytest.raises(HandoffError) as ei:
        Handoff(handle, object(), lambda: None, **kw)
    assert ei.value.reason == reason


def test_event_handoff_releases_each_once():
    rel, ev = Counter(), Counter()
    h = Handoff(CUDA_EV, b"x", rel, sync_handle=object(), sync_handle_device_tag=DeviceTag.CUDA, event_release=ev)
    h.release_event()
    assert ev.n == 1 and not h.released
    with pytest.raises(AlreadyReleasedError):
        h.release_event()
    h.release()
    assert rel.n == 1 and ev.n == 1
    with pytest.raises(AlreadyReleasedError):
        h.release()


def test_buffer_release_releases_owed_event_first():
    order = []
    h = Handoff(CUDA_EV, b"x", lambda: order.append("buf"), sync_handle=1,
                sync_handle_device_tag=DeviceTag.CUDA, event_release=lambda: order.append("ev"))
    h.release()
    assert order == ["ev", "buf"]


def test_event_release_only_for_event_mode():
    h = Handoff(CUDA_P1, b"x", lambda: None)
    with pytest.raises(HandoffError):
        h.release_event()
    h.release()


def test_release_is_thread_safe_exactly_once():
    rel = Counter()
    h = Handoff(CUDA_P1, b"x", rel)
    errors = []
    barrier = threading.Barrier(8)

    def go():
        barrier.wait()
        try:
            h.release()
        except AlreadyReleasedError:
            errors.append(1)

    ts = [threading.Thread(target=go) for _ in range(8)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert rel.n == 1 and len(errors) == 7


def test_context_manager_releases():
    rel = Counter()
    with Handoff(CUDA_P3, b"x", rel, consumer_stream=3) as h:
        assert h.consumer_stream == 3
    assert rel.n == 1


def test_gc_of_unreleased_handoff_warns_and_releases():
    rel, ev = Counter(), Counter()
    h = Handoff(CUDA_EV, b"x", rel, sync_handle=1, sync_handle_device_tag=DeviceTag.CUDA, event_release=ev)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        del h
        gc.collect()
    assert any(issubclass(x.category, ResourceWarning) for x in w)
    assert rel.n == 1 and ev.n == 1


def test_gc_of_released_handoff_is_silent():
    h = Handoff(CUDA_P1, b"x", lambda: None)
    h.release()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        del h
        gc.collect()
