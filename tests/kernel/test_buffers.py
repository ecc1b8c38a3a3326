"""Large buffers found changed or not without reading them all (issue 38): the kernel's write
marks where it keeps them, samples and digests where it does not; never a change missed."""

from __future__ import annotations

import ctypes
import mmap
import tempfile
import weakref
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy
import pandas
import pytest

from jupyter_gpufrac.kernel import buffers, tensor_io, writes
from jupyter_gpufrac.kernel.buffers import (
    HOT_FIRST,
    TRACKED_MIN,
    BufferTracker,
    inner_pages,
    sample,
)
from jupyter_gpufrac.kernel.checkpoint import Checkpointer
from jupyter_gpufrac.kernel.writes import Anonymous, WriteWatch

MiB = 2**20


def view_of(array: Any) -> tuple[memoryview, int]:
    return memoryview(array.reshape(-1).view(numpy.uint8)), int(array.ctypes.data)


@pytest.fixture
def watch() -> Iterator[WriteWatch]:
    found = WriteWatch()
    if not found.usable():
        pytest.skip(f"this kernel does not track writes here: {found.why_not}")
    yield found
    found.close()


@pytest.fixture
def unwatched(monkeypatch: pytest.MonkeyPatch) -> Iterator[WriteWatch]:
    monkeypatch.setenv(writes.MODE_ENV, "off")
    found = WriteWatch()
    assert not found.usable() and found.why_not == f"{writes.MODE_ENV}=off"
    yield found


def test_a_watched_buffer_tells_each_write_once(watch: WriteWatch) -> None:
    a = numpy.ones(MiB)
    address, nbytes = int(a.ctypes.data), a.nbytes
    assert watch.watch(address, nbytes, Anonymous())
    assert watch.written(address, nbytes, protect_again=True) == 0
    a[123_456] = 5.0  # one element, far from any sample
    assert watch.written(address, nbytes, protect_again=False) == 1
    assert watch.written(address, nbytes, protect_again=True) == 1, "one page"
    assert watch.written(address, nbytes, protect_again=True) == 0, "protected again"
    a += 1
    pages = -(-(address % mmap.PAGESIZE + nbytes) // mmap.PAGESIZE)
    assert watch.written(address, nbytes, protect_again=True) == pages, "every page"
    watch.unwatch(address, nbytes)
    assert watch.written(address, nbytes, protect_again=True) is None, "not watched: no answer"


def test_memory_another_process_can_write_is_never_watched(watch: WriteWatch) -> None:
    with tempfile.TemporaryFile() as fh:
        fh.truncate(MiB)
        mapped = mmap.mmap(fh.fileno(), MiB)
        address = ctypes.addressof(ctypes.c_char.from_buffer(mapped))
        assert not watch.watch(address, MiB, Anonymous()), "a file mapping is not ours alone"
        del address
        mapped.close()
    shared = mmap.mmap(-1, MiB, flags=mmap.MAP_SHARED)
    address = ctypes.addressof(ctypes.c_char.from_buffer(shared))
    assert not watch.watch(address, MiB, Anonymous()), "nor is shared memory"


def test_a_new_buffer_is_watched_at_once_and_skipped_while_unchanged(watch: WriteWatch) -> None:
    tracker = BufferTracker(watch)
    a = numpy.random.default_rng(0).random(MiB)
    view, address = view_of(a)
    first, changed = tracker.decide(a, view, address)
    assert changed, "a new buffer is saved"
    tracker.commit()
    for _ in range(3):
        assert tracker.decide(a, view, address) == (first, False), "watched, not written"
        tracker.commit()
    a[MiB // 2 + 7] = -1.0  # a change no sample sees
    second, changed = tracker.decide(a, view, address)
    assert changed and second != first, "the write mark tells"


def test_a_buffer_written_cell_after_cell_is_not_watched_and_its_sample_tells(
        watch: WriteWatch) -> None:
    tracker = BufferTracker(watch)
    w = numpy.random.default_rng(3).random(MiB)
    view, address = view_of(w)
    tracker.decide(w, view, address)
    tracker.commit()
    blobs = []
    for _ in range(4):  # a training loop: all of it changes every cell
        w *= 0.999
        w += 0.001
        blob, changed = tracker.decide(w, view, address)
        assert changed
        blobs.append(blob)
        tracker.commit()
    assert len(set(blobs)) == 4
    start, length, _before = inner_pages(address, w.nbytes)
    assert watch.written(start, length, protect_again=False) is None, \
        "a hot buffer is not watched: its writes cost no faults"
    # It stops changing: its sample is the same, so it is watched again (and saved once more).
    blob, changed = tracker.decide(w, view, address)
    assert changed
    tracker.commit()
    assert watch.written(start, length, protect_again=False) == 0
    assert tracker.decide(w, view, address) == (blob, False)


def test_a_buffer_rewritten_with_the_same_values_is_not_watched_again_every_other_cell(
        watch: WriteWatch, monkeypatch: pytest.MonkeyPatch) -> None:
    """``a *= 1.0`` cell after cell: its sample never changes, so it looks settled, and
    watching it again costs the next cell a fault per page. After one such try it stays hot
    for HOT_FIRST snapshots (saved each time, as a watch would have found it written), and
    it is never hashed on the notebook's thread where it is large (slower than the faults it
    would save)."""
    def no_hashing(_data: Any) -> str:
        raise AssertionError("hashed on the notebook's thread")

    monkeypatch.setattr(tensor_io, "digest", no_hashing)
    monkeypatch.setattr(buffers, "HASHED_MAX", MiB)  # as for buffers of GiBs
    tracker = BufferTracker(watch)
    a = numpy.random.default_rng(5).random(MiB)
    view, address = view_of(a)
    start, length, _before = inner_pages(address, a.nbytes)

    def cell() -> bool:
        """A cell rewriting every value as it was; whether the buffer was watched during it."""
        watched = watch.written(start, length, protect_again=False) is not None
        numpy.multiply(a, 1.0, out=a)
        changed = tracker.decide(a, view, address)[1]
        entry = tracker.followed(a)
        assert changed and entry is not None
        entry.hashed("0" * 40)  # the writer's digest: known, and never used while watching
        tracker.commit()
        return watched

    tracker.decide(a, view, address)
    tracker.commit()
    watched = [cell() for _ in range(3 + HOT_FIRST + 2)]
    # New: watched; then hot; its sample unchanged: watched again (the try); found written
    # all over again: hot for HOT_FIRST snapshots; then the next try.
    assert watched == [True, False, True] + [False] * (HOT_FIRST + 1) + [True], watched


def anon_huge_kib(address: int) -> int:
    """AnonHugePages of the mapping holding ``address``, in KiB."""
    inside = False
    with open("/proc/self/smaps") as fh:
        for line in fh:
            head = line.split(maxsplit=1)[0]
            if "-" in head and not head.endswith(":"):
                low, high = (int(part, 16) for part in head.split("-"))
                inside = low <= address < high
            elif inside and head == "AnonHugePages:":
                return int(line.split()[1])
    return 0


def test_a_buffer_gone_hot_gets_back_the_huge_pages_its_watch_split(watch: WriteWatch) -> None:
    a = numpy.ones(64 * MiB // 8)
    view, address = view_of(a)
    middle = address + a.nbytes // 2  # NumPy's huge pages start past the allocator's header
    if anon_huge_kib(middle) == 0:
        pytest.skip("no transparent huge pages for NumPy's memory here")
    tracker = BufferTracker(watch)
    tracker.decide(a, view, address)
    tracker.commit()
    a += 1.0  # every page written once while watched: each becomes a page of its own
    assert anon_huge_kib(middle) == 0, "the watch split them"
    tracker.decide(a, view, address)  # written all over: hot, no longer watched
    tracker.commit()
    assert anon_huge_kib(middle) >= 32 * 1024, "collapsed again (MADV_COLLAPSE)"


def test_a_few_values_set_keep_a_buffer_watched(watch: WriteWatch) -> None:
    tracker = BufferTracker(watch)
    a = numpy.random.default_rng(4).random(MiB)
    view, address = view_of(a)
    first, _ = tracker.decide(a, view, address)
    tracker.commit()
    a[10_000] = 0.0  # a cell cleaning a value: one page of 2,048 written
    second, changed = tracker.decide(a, view, address)
    assert changed and second != first
    tracker.commit()
    start, length, _before = inner_pages(address, a.nbytes)
    assert watch.written(start, length, protect_again=False) == 0, "still watched, protected"
    assert tracker.decide(a, view, address) == (second, False), "and not saved again"


def test_without_write_marks_the_writers_digest_proves_a_buffer_unchanged(
        unwatched: WriteWatch) -> None:
    tracker = BufferTracker(unwatched)
    a = numpy.random.default_rng(1).random(MiB)
    view, address = view_of(a)

    def save() -> str:
        """As the writer does once it wrote the blob: it tells the digest of what it saved."""
        blob, changed = tracker.decide(a, view, address)
        assert changed
        entry = tracker.followed(a)
        assert entry is not None
        entry.hashed(tensor_io.digest(view))
        tracker.commit()
        return blob

    blob = save()
    for _ in range(2):
        assert tracker.decide(a, view, address) == (blob, False), "its digest is the saved one"
        tracker.commit()
    before = sample(view)
    a[MiB // 3] += 1.0
    assert sample(view) == before, "a change the sample misses"
    again, changed = tracker.decide(a, view, address)
    assert changed and again != blob, "the digest tells"


def test_a_failed_snapshot_keeps_what_was_followed(watch: WriteWatch) -> None:
    tracker = BufferTracker(watch)
    a = numpy.ones(MiB)
    view, address = view_of(a)
    blob, _ = tracker.decide(a, view, address)  # watched from now on
    tracker.commit()
    assert tracker.decide(a, view, address) == (blob, False)
    tracker.abandon()
    assert tracker.decide(a, view, address) == (blob, False)
    tracker.clear()
    assert tracker.decide(a, view, address)[1], "cleared: saved again"


def bytes_written(ck: Checkpointer, ns: dict[str, Any], count: int) -> int:
    result = ck.take(ns, execution_count=count)
    return result.bytes_written


def test_checkpoints_write_a_large_array_only_when_it_changed(ckdir: Path,
                                                              watch: WriteWatch) -> None:
    a = numpy.random.default_rng(2).random(4 * MiB // 8 * 8)
    frame = pandas.DataFrame({"x": numpy.arange(MiB, dtype=numpy.float64)})
    ns: dict[str, Any] = {"a": a, "frame": frame, "n": 1}
    ck = Checkpointer(ckdir)
    assert a.nbytes >= TRACKED_MIN
    assert bytes_written(ck, ns, 1) >= a.nbytes
    assert bytes_written(ck, ns, 2) == 0
    assert bytes_written(ck, ns, 3) == 0
    ns["n"] = 2
    assert bytes_written(ck, ns, 4) == 0, "a change elsewhere writes no array"
    a[len(a) // 2] = -1.0
    assert bytes_written(ck, ns, 5) == a.nbytes
    frame.iloc[MiB // 2, 0] = -7.0  # in place, through pandas
    assert bytes_written(ck, ns, 6) >= MiB
    loaded: dict[str, Any] = {}
    assert Checkpointer(ckdir).load(loaded).execution_count == 6
    assert numpy.array_equal(loaded["a"], a)
    pandas.testing.assert_frame_equal(loaded["frame"], frame)


def test_an_array_the_notebook_drops_is_let_go(watch: WriteWatch) -> None:
    tracker = BufferTracker(watch)
    a = numpy.ones(MiB)
    gone = weakref.ref(a)
    view, address = view_of(a)
    tracker.decide(a, view, address)
    tracker.commit()
    start, length, _before = inner_pages(address, a.nbytes)
    assert watch.written(start, length, protect_again=False) == 0, "followed and watched"
    del view, a
    assert gone() is None, "the tracker does not keep a dropped array's memory"
    tracker.commit()
