"""ModeCache (transport/pairing.py): the valid modes of a pair, remembered, never another pair's.

The broker checks each HANDOFF's declared mode against the cache and the producer chooses its
mode from it, so an answer served for the wrong pair would accept (or choose) a mode the pair
cannot honour: an EVENT handle to a consumer without IPC events is a race.
"""

from __future__ import annotations

import itertools
import os
import pickle
import subprocess
import sys

from hurray_ipc.devices.base import DeviceCapabilities, DeviceIdentity
from hurray_ipc.transport.pairing import Endpoint, ModeCache, host_side, pair_modes

GPU = DeviceIdentity("cuda", 0, "GPU-x", emulated=True, host="h")


def _grid() -> tuple[list[Endpoint], list[Endpoint]]:
    """Producers and consumers whose pairs differ in their valid modes, both ways round."""
    producers = [Endpoint(GPU, DeviceCapabilities(True, events), 10 + i) for i, events in enumerate((True, False))]
    producers.append(Endpoint(DeviceIdentity("cpu", 0, "CPU-h", host="h"), DeviceCapabilities(True, False), 12))
    consumers = [Endpoint(GPU, DeviceCapabilities(True, True), 20),
                 Endpoint(GPU, DeviceCapabilities(True, False), 21),
                 Endpoint(GPU, DeviceCapabilities(True, True), 22, stream=7),
                 Endpoint(DeviceIdentity("cpu", 0, "CPU-h", host="h"), DeviceCapabilities(True, False), 23)]
    return producers, consumers


def test_each_pair_gets_its_own_answer_in_any_order():
    """Every (producer, consumer) pair, asked repeatedly in an interleaved order, gets exactly
    what pair_modes computes for it: neither side of the key may be dropped or confused."""
    producers, consumers = _grid()
    truth = {(p.pid, c.pid): pair_modes(p, c).valid for p in producers for c in consumers}
    assert len(set(map(frozenset, truth.values()))) >= 3  # the grid really has different answers
    cache = ModeCache()
    pairs = list(itertools.product(producers, consumers))
    for rnd in range(3):
        order = pairs if rnd % 2 == 0 else [(p, c) for c in consumers for p in producers]
        for p, c in order:
            assert cache.get(p, c).valid == truth[(p.pid, c.pid)], (p.pid, c.pid)


def test_equal_endpoints_share_an_answer_and_bounds_hold():
    """Equal endpoints in distinct objects get the same answer (the value key), and neither part
    of the cache grows past its size however many pairs pass through it."""
    producers, consumers = _grid()
    cache = ModeCache(size=5)
    p, c = producers[0], consumers[0]
    twin = Endpoint(p.identity, p.caps, p.pid)
    assert twin is not p and cache.get(p, c) is cache.get(twin, c)
    for pid in range(100, 140):
        q = Endpoint(GPU, DeviceCapabilities(True, pid % 2 == 0), pid)
        for c in consumers:
            assert cache.get(q, c).valid == pair_modes(q, c).valid
            assert len(cache._hits) <= 5 and len(cache._by_id) <= 5


def test_host_side_is_one_object_per_endpoint():
    """A GPU producer's host-staged handoffs ask with host_side(its endpoint): the same object
    every time, so the identity fast path serves them; a CPU endpoint is its own host side."""
    producers, _ = _grid()
    gpu, cpu = producers[0], producers[2]
    hs = host_side(gpu)
    assert hs is host_side(gpu) and hs.identity.kind == "cpu" and hs.pid == gpu.pid
    assert host_side(cpu) is cpu
    assert host_side(Endpoint(gpu.identity, gpu.caps, gpu.pid)) == hs


def test_an_id_freed_and_taken_by_another_endpoint_never_gets_the_old_answer():
    """The identity fast path keys by id(): only sound while its entry holds both objects alive.
    A twin of a known endpoint (equal value, another object: only the fast path holds it) is asked
    about and dropped, then an endpoint with other caps is made: CPython gives a freed object's
    memory, and so its id, to the next object of its size, so a cache that dropped its hold on
    the twin would serve the twin's answer to the newcomer."""
    _, consumers = _grid()
    c = consumers[0]
    cache = ModeCache()
    caps = [DeviceCapabilities(True, events) for events in (True, False)]  # made now: nothing else is
    for cap in caps:  # allocated between the twin's drop and the newcomer, which so takes its place
        cache.get(Endpoint(GPU, cap, 7), c)
    for i in range(200):
        twin = Endpoint(GPU, caps[i % 2], 7)
        assert cache.get(twin, c).valid == pair_modes(twin, c).valid
        del twin
        newcomer = Endpoint(GPU, caps[(i + 1) % 2], 1000 + i)
        assert cache.get(newcomer, c).valid == pair_modes(newcomer, c).valid, i


def test_a_pickled_endpoint_is_filed_by_its_value_in_another_process():
    """Endpoints cache their hash (and host side) on themselves; a pickled one carries neither
    into another process, whose str hashes differ (another PYTHONHASHSEED), so there it still
    finds, and is found by, an equal endpoint made there."""
    ep = Endpoint(GPU, DeviceCapabilities(True, True), 7)
    hash(ep), host_side(ep)  # both cached here
    blob = pickle.dumps(ep).hex()
    child = ("import pickle, sys\n"
             "from hurray_ipc.devices.base import DeviceCapabilities, DeviceIdentity\n"
             "from hurray_ipc.transport.pairing import Endpoint, host_side\n"
             "ep = pickle.loads(bytes.fromhex(sys.argv[1]))\n"
             "mine = Endpoint(DeviceIdentity('cuda', 0, 'GPU-x', emulated=True, host='h'), "
             "DeviceCapabilities(True, True), 7)\n"
             "print(ep in {mine: 1}, mine in {ep: 1}, host_side(ep) == host_side(mine))\n")
    for seed in ("1", "2"):
        r = subprocess.run([sys.executable, "-c", child, blob], capture_output=True, text=True, timeout=60,
                           env={**os.environ, "PYTHONHASHSEED": seed})
        assert r.stdout.split() == ["True", "True", "True"], (seed, r.stdout, r.stderr)
