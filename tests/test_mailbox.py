"""The race checker's happens-before notes (devices/backend/mailbox.py): one note per message key,
taken once, never lost to another writer, spilled to a file when the table cannot hold it, swept
when nobody took it. Two Mailbox objects on one directory hold two descriptors, so their slot
locks exclude each other as two processes' do; one test crosses a real process boundary."""

from __future__ import annotations

import itertools
import os
import struct
import subprocess
import sys
import threading
import time

import pytest

from hurray_ipc.devices.backend import mailbox as mb
from hurray_ipc.devices.backend.mailbox import BUCKET, BUCKETS, PAYLOAD, Mailbox


@pytest.fixture
def where(tmp_path):
    return tmp_path


def _keys_of_one_bucket(n: int, bucket: int = 7) -> list[str]:
    """``n`` keys whose notes all go to ``bucket``."""
    return list(itertools.islice((k for k in (f"key-{i}" for i in itertools.count())
                                  if mb.tag(k) % BUCKETS == bucket), n))


def _files(box: Mailbox) -> list[str]:
    return os.listdir(box.dir) if os.path.isdir(box.dir) else []


def test_a_note_is_taken_once_by_whoever_receives_the_message(where):
    a, b = Mailbox(where), Mailbox(where)
    a.put("h:1:handoff", {1: 2, 3: 4})
    assert b.take("h:1:handoff") == {1: 2, 3: 4}
    assert b.take("h:1:handoff") is None and a.take("h:1:handoff") is None
    assert _files(a) == [], "a note that fits the table left a file"


def test_a_note_crosses_a_process(where):
    Mailbox(where).put("cross", {7: 8})
    code = ("import sys; from hurray_ipc.devices.backend.mailbox import Mailbox; "
            "print(Mailbox(sys.argv[1]).take('cross'))")
    out = subprocess.run([sys.executable, "-c", code, str(where)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "{7: 8}"


def test_a_second_note_of_a_key_replaces_the_first(where):
    box = Mailbox(where)
    box.put("k", {1: 1})
    box.put("k", {1: 2})
    assert box.take("k") == {1: 2}
    assert box.take("k") is None, "the first note stayed behind in a second slot"


def test_what_the_table_cannot_hold_goes_to_a_file_and_comes_back(where):
    box, other = Mailbox(where), Mailbox(where)
    big = {i: i for i in range(PAYLOAD)}  # marshalled, far more than a slot
    box.put("big", big)
    assert len(_files(box)) == 1
    assert other.take("big") == big and _files(box) == []

    keys = _keys_of_one_bucket(BUCKET + 2)
    for i, k in enumerate(keys):
        box.put(k, {i: i})
    assert len(_files(box)) == 2, "a full bucket's notes must spill, not overwrite"
    assert [other.take(k) for k in keys] == [{i: i} for i in range(len(keys))]
    assert _files(box) == []


def test_drop_removes_a_note_in_the_table_or_in_a_file(where):
    box = Mailbox(where)
    box.put("small", {1: 1})
    box.put("big", {i: i for i in range(PAYLOAD)})
    box.drop("small"), box.drop("big"), box.drop("never noted")
    assert box.take("small") is None and box.take("big") is None
    assert _files(box) == []


class _Interleaved(Mailbox):
    """Before its first claim of a slot, another writer puts a note in the same bucket: it takes
    the free slot this one just chose."""

    def __init__(self, where, other: Mailbox, other_key: str):
        super().__init__(where)
        self.other, self.other_key, self.done = other, other_key, False

    def _claim(self, slot: int, expect: int) -> bool:
        if not self.done:
            self.done = True
            self.other.put(self.other_key, {"other": 1})
        return super()._claim(slot, expect)


def test_a_slot_another_writer_took_meanwhile_is_not_overwritten(where):
    """The free slot a writer chose without a lock may be taken before it locks it: the writer
    checks the tag again under the lock and moves on, so both notes survive."""
    mine, theirs = _keys_of_one_bucket(2)
    box = _Interleaved(where, Mailbox(where), theirs)
    box.put(mine, {"mine": 1})
    reader = Mailbox(where)
    assert reader.take(theirs) == {"other": 1}, "the other writer's note was overwritten"
    assert reader.take(mine) == {"mine": 1}


def test_writers_in_threads_and_descriptors_never_lose_a_note(where):
    boxes = [Mailbox(where), Mailbox(where)]
    keys = _keys_of_one_bucket(4 * 50, bucket=3)
    errors: list[BaseException] = []

    def run(t: int) -> None:
        try:
            box = boxes[t % 2]
            for k in keys[t::4]:
                box.put(k, {k: t})
            for k in keys[t::4]:
                got = boxes[(t + 1) % 2].take(k)
                assert got == {k: t}, (k, got)
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=run, args=(t,)) for t in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(60)
    assert errors == []
    assert _files(boxes[0]) == []


def test_notes_nobody_took_are_swept(where):
    """A note whose receiver died stays until a process opens the table MAX_AGE_S later: slots
    and files alike (1,095 files once piled up after a 10-minute kill run)."""
    box = Mailbox(where)
    box.put("old", {1: 1})
    box.put("fresh", {2: 2})
    box.put("old file", {i: i for i in range(PAYLOAD)})
    slot = box._find(mb.tag("old"), mb.tag("old"))
    struct.pack_into("<d", box.map, box._body(slot), time.time() - mb.MAX_AGE_S - 60)
    path = box._path("old file")
    os.utime(path, (time.time() - mb.MAX_AGE_S - 60,) * 2)
    assert box.sweep() == 2
    assert box.take("old") is None and not os.path.exists(path)
    box.put("old", {1: 1})
    slot = box._find(mb.tag("old"), mb.tag("old"))
    struct.pack_into("<d", box.map, box._body(slot), time.time() - mb.MAX_AGE_S - 60)
    Mailbox(where)  # a process that opens the table sweeps it
    assert box.take("old") is None
    assert box.take("fresh") == {2: 2}


def test_without_a_table_every_note_is_a_file(where, monkeypatch):
    """Where the table cannot be made (no space, not ours), notes still travel, as files."""
    monkeypatch.setattr(mb.shm, "reserve", lambda fd, size: (_ for _ in ()).throw(OSError(28, "no space")))
    box = Mailbox(where)
    assert box.map is None
    box.put("k", {1: 1})
    assert len(_files(box)) == 1
    assert Mailbox(where).take("k") == {1: 1}


def test_a_forked_child_opens_its_own_table():
    """A slot lock belongs to the descriptor, and a forked child shares its parent's: the
    child's notes must go through a descriptor of its own, or its locks would not exclude the
    parent's."""
    parent = mb.mailbox()
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: report and leave without running the parent's cleanup
        try:
            child = mb.mailbox()
            # the parent's descriptor is closed here: it would keep a slot the parent locked
            # locked after the parent died, for as long as this child lives
            own = child is not parent and parent.map is None and child.map is not None
            os.write(w, b"own" if own else b"shared")
        finally:
            os._exit(0)
    os.close(w)
    try:
        assert os.read(r, 16) == b"own"
    finally:
        os.close(r)
        os.waitpid(pid, 0)
    assert mb.mailbox() is parent


def test_a_table_someone_else_could_write_is_not_used(where):
    """The table's name in /dev/shm is predictable: a file there that others may write (or a link
    planted at the name) is not mapped; notes go to files instead."""
    path = where / f"hurray-{os.getuid()}-hbtable"
    path.write_bytes(b"")
    os.chmod(path, 0o666)
    assert Mailbox(where).map is None
    path.unlink()
    os.symlink(where / "elsewhere", path)
    assert Mailbox(where).map is None and not (where / "elsewhere").exists()


def test_a_receiver_that_could_not_map_the_table_still_finds_notes_put_there(where, monkeypatch):
    """A process that started while the table could not be made (a full /dev/shm) keeps trying:
    senders that came later put their notes in the table, and it must find them there."""
    real = mb.shm.reserve
    monkeypatch.setattr(mb.shm, "reserve", lambda fd, size: (_ for _ in ()).throw(OSError(28, "no space")))
    late = Mailbox(where)
    assert late.map is None
    monkeypatch.setattr(mb.shm, "reserve", real)
    Mailbox(where).put("k", {1: 1})
    assert late.take("k") == {1: 1}


def test_a_later_note_of_a_key_replaces_the_earlier_wherever_each_lives(where):
    box = Mailbox(where)
    big = {i: i for i in range(PAYLOAD)}
    box.put("k", {1: 1})
    box.put("k", big)  # to a file: the slot's older note must not be taken first
    assert box.take("k") == big and box.take("k") is None
    box.put("k", big)
    box.put("k", {2: 2})  # to the table: the older file goes
    assert box.take("k") == {2: 2} and box.take("k") is None and _files(box) == []


def test_a_note_directory_someone_else_could_write_is_refused(where):
    os.mkdir(where / f"hurray-{os.getuid()}-hb", 0o700)
    os.chmod(where / f"hurray-{os.getuid()}-hb", 0o777)
    with pytest.raises(mb.DeviceError, match="not a private directory"):
        Mailbox(where).put("big", {i: i for i in range(PAYLOAD)})
