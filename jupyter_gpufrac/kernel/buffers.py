"""The notebook's large buffers (NumPy arrays' memory): the blob each is saved in, and whether it changed."""

from __future__ import annotations

import ctypes
import mmap
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from jupyter_gpufrac.kernel import store, tensor_io
from jupyter_gpufrac.kernel.writes import WATCH, Anonymous, WriteWatch

# Buffers from this size on are followed here; smaller ones are hashed, which costs less than
# the page faults of watching them and keeps their content address.
TRACKED_MIN = 1024 * 1024
_SAMPLES = 64
_SAMPLE = 64
_ENDS = 256
# A hot buffer whose sample stopped changing is watched again; one then found written all over
# at once (a cell that writes the same values again, cell after cell) stays hot for HOT_FIRST,
# then twice as many snapshots, up to HOT_MAX, before the next try. A try costs that cell a
# fault per page (about four copies of the buffer here); staying hot costs a copy at each cell
# that leaves the buffer alone, so tries come no more often than every four such copies.
HOT_FIRST = 4
HOT_MAX = 8
# Up to this size a hot buffer that may have settled is hashed to prove it (40 ms at most here).
HASHED_MAX = 32 * 1024 * 1024


def inner_pages(address: int, nbytes: int) -> tuple[int, int, int]:
    """(start, length) of the whole pages inside ``nbytes`` at ``address``, and how many bytes
    come before them: the pages at either end may be shared with other objects (a buffer on
    the heap), whose writes would read as the buffer's, so only those inside are watched and
    the bytes around them compared."""
    page = mmap.PAGESIZE
    start = -(-address // page) * page
    end = (address + nbytes) // page * page
    return start, max(0, end - start), start - address


def sample(view: memoryview) -> bytes:
    """A few bytes spread over ``view`` and its ends: a sample that differs proves a change (one
    that does not proves nothing)."""
    n = view.nbytes
    step = max(1, (n - _SAMPLE) // _SAMPLES)
    parts = [view[:_ENDS], view[max(0, n - _ENDS):]]
    parts += [view[at:at + _SAMPLE] for at in range(0, max(1, n - _SAMPLE), step)][:_SAMPLES]
    return b"".join(bytes(part) for part in parts)


@dataclass(eq=False)
class Followed:
    """One buffer followed from one snapshot to the next."""

    owner: weakref.ref[Any]  # the array (not held: a notebook's dropped array goes at once)
    address: int
    nbytes: int
    blob: str
    sample: bytes
    watched: bool = False
    digest: str | None = None  # of the bytes in ``blob``, once the writer hashed them
    edges: bytes = b""  # while watched: the bytes outside its whole pages, compared instead
    # While hot: snapshots left before it is watched again; and how often watching it again
    # met it written all over at once (the next wait doubles with each, up to HOT_MAX).
    hot_for: int = 0
    strikes: int = 0
    rewatched: bool = False  # watched again, from hot, by this snapshot

    def hashed(self, digest: str) -> None:
        """The writer hashed the bytes it saved in ``blob`` (its thread)."""
        self.digest = digest


class BufferTracker:
    """Finds which large buffers changed since the last snapshot, without reading them all.

    A buffer is *watched* (the kernel marks the pages written since, see :mod:`writes`) or
    *hot*. A new buffer is watched at once; one found written over most of its pages (an
    update of all of it, as a training step does) becomes hot, one written here and there
    stays watched: a hot buffer is not watched (its writes cost no page faults while a
    notebook updates it cell after cell), and a sample of its bytes that differs from the last
    one proves it changed again. A hot buffer whose sample did not change is hashed, and
    unchanged when its digest is that of the bytes last saved, which the writer took
    (:meth:`Followed.hashed`); it is watched again from then on. Where nothing can be watched
    (before Linux 6.7, under a seccomp policy that refuses userfaultfd) every buffer is hot.

    A changed buffer gets a new blob name, never its content's: naming by content would read
    every changed byte at the cell's end. The writer hashes what it writes instead, to share
    equal bytes with the user's other kernels (:attr:`store.Staged.shared`).
    """

    def __init__(self, watch: WriteWatch = WATCH,
                 new_name: Callable[[], str] = store.new_blob_name) -> None:
        self._watch = watch
        self._new_name = new_name
        self._current: dict[int, Followed] = {}
        self._next: dict[int, Followed] = {}
        self._anonymous: Anonymous | None = None

    @property
    def watching(self) -> bool:
        """Whether buffers can be watched in this process."""
        return self._watch.usable()

    def decide(self, owner: Any, view: memoryview, address: int) -> tuple[str, bool]:
        """(the blob ``owner``'s buffer, ``view`` at ``address``, is in for this snapshot,
        whether it changed since the last one: then the blob is new, and it must be saved)."""
        key = id(owner)
        met = self._next.get(key)
        if met is not None and met.owner() is owner:
            return met.blob, False  # met twice in one snapshot
        entry = self._current.get(key)
        if entry is None or entry.owner() is not owner or (entry.address, entry.nbytes) != (
                address, view.nbytes):
            return self._follow(owner, view, address, watch=True), True
        if entry.watched:
            start, length, before = inner_pages(address, view.nbytes)
            written = self._watch.written(start, length, protect_again=True)
            if written == 0 and _edges(view, before, length) == entry.edges:
                entry.strikes, entry.rewatched = 0, False  # quiet a whole cell: it settled
                self._next[key] = entry
                return entry.blob, False
            if written is not None and written * mmap.PAGESIZE * 2 < length:
                # A few values set: still watched (its pages protected again by that call).
                return self._follow(owner, view, address, watch=False, keep=True,
                                    strikes=entry.strikes), True
            self._watch.unwatch(start, length)
            self._watch.collapse(start, length)
            strikes = entry.strikes + 1 if entry.rewatched else entry.strikes
            hot_for = min(HOT_FIRST * 2 ** (strikes - 1), HOT_MAX) if strikes else 0
            return self._follow(owner, view, address, watch=False, strikes=strikes,
                                hot_for=hot_for), True
        now = sample(view)
        if now != entry.sample:
            return self._follow(owner, view, address, watch=False, taken=now,
                                strikes=entry.strikes, hot_for=entry.hot_for), True
        # Hot, and perhaps no longer changing: only its digest against that of the bytes last
        # saved (which the writer took) proves it unchanged, and it is watched again. A large
        # one is not hashed where writes can be watched (on the notebook's thread that costs
        # 1.2 s a GiB here, three times a watch's page faults): it is saved once more and
        # watched again, unless watching it again met it rewritten all over before (then it
        # waits its turn).
        if entry.digest is not None and (view.nbytes <= HASHED_MAX or not self.watching) \
                and tensor_io.digest(view) == entry.digest:
            self._next[key] = self._rewatched(entry, view)
            return entry.blob, False
        if not self.watching:
            return self._follow(owner, view, address, watch=False, taken=now), True
        if entry.hot_for > 0:
            return self._follow(owner, view, address, watch=False, taken=now,
                                strikes=entry.strikes, hot_for=entry.hot_for - 1), True
        return self._follow(owner, view, address, watch=True, taken=now,
                            strikes=entry.strikes, rewatched=True), True

    def _rewatched(self, entry: Followed, view: memoryview) -> Followed:
        """``entry`` watched again, where that can be."""
        start, length, before = inner_pages(entry.address, entry.nbytes)
        if length:
            if self._anonymous is None:
                self._anonymous = Anonymous()
            entry.watched = self._watch.watch(start, length, self._anonymous)
            entry.edges = _edges(view, before, length) if entry.watched else b""
        entry.rewatched = entry.watched
        return entry

    def unchanged_check(self, owner: Any) -> Callable[[], bool] | None:
        """For an array this snapshot decided on and watches: a check that none of its bytes
        was written since (None when it is not watched: nothing could tell)."""
        entry = self.followed(owner)
        if entry is None or not entry.watched:
            return None
        start, length, before = inner_pages(entry.address, entry.nbytes)
        # The bytes in memory order, as the snapshot's view of them (C or Fortran order alike).
        view = memoryview((ctypes.c_ubyte * entry.nbytes).from_address(entry.address)).cast("B")
        edges = entry.edges

        def unchanged() -> bool:
            if self._watch.written(start, length, protect_again=False) != 0:
                return False
            return _edges(view, before, length) == edges

        return unchanged

    def followed(self, owner: Any) -> Followed | None:
        """The entry of ``owner`` decided in this snapshot, if any."""
        entry = self._next.get(id(owner))
        return entry if entry is not None and entry.owner() is owner else None

    def _follow(self, owner: Any, view: memoryview, address: int, *, watch: bool,
                taken: bytes | None = None, keep: bool = False, strikes: int = 0,
                hot_for: int = 0, rewatched: bool = False) -> str:
        """A new blob for ``owner``'s buffer, watched from now on if ``watch`` (or, with
        ``keep``, still watched as it was)."""
        watched = keep
        start, length, before = inner_pages(address, view.nbytes)
        if watch and length:
            if self._anonymous is None:
                self._anonymous = Anonymous()
            watched = self._watch.watch(start, length, self._anonymous)
        followed = Followed(weakref.ref(owner, self._gone), address, view.nbytes,
                            self._new_name(),
                            taken if taken is not None else sample(view), watched,
                            edges=_edges(view, before, length) if watched else b"",
                            hot_for=hot_for, strikes=strikes, rewatched=rewatched and watched)
        self._next[id(owner)] = followed
        return followed.blob

    def _gone(self, ref: weakref.ref[Any]) -> None:
        """An array followed is being freed (its memory is still there): stop watching it,
        before that memory is another's."""
        for entries in (self._current, self._next):
            for entry in list(entries.values()):
                if entry.owner is ref and entry.watched:
                    entry.watched = False
                    self._unwatch(entry)

    def commit(self) -> None:
        """The snapshot is taken: the buffers it met are the ones followed from now on (those
        it did not meet are let go)."""
        for key, entry in self._current.items():
            if entry.watched and not _still_watched(self._next.get(key), entry):
                self._unwatch(entry)
        self._current = {key: entry for key, entry in self._next.items()
                         if entry.owner() is not None}
        self._next = {}
        self._anonymous = None

    def abandon(self) -> None:
        """The snapshot failed: what was followed before stays followed."""
        for key, entry in self._next.items():
            if entry.watched and not _still_watched(self._current.get(key), entry):
                self._unwatch(entry)
        self._next = {}
        self._anonymous = None

    def clear(self) -> None:
        """Follow nothing: the next snapshot saves every buffer again."""
        self.abandon()
        for entry in self._current.values():
            if entry.watched:
                self._unwatch(entry)
        self._current = {}

    def _unwatch(self, entry: Followed) -> None:
        start, length, _before = inner_pages(entry.address, entry.nbytes)
        self._watch.unwatch(start, length)


def _still_watched(other: Followed | None, entry: Followed) -> bool:
    """Whether ``other`` watches the same memory as ``entry`` (then it is not unwatched)."""
    return other is not None and other.watched and (other.address, other.nbytes) == (
        entry.address, entry.nbytes)


def _edges(view: memoryview, before: int, length: int) -> bytes:
    """The bytes of ``view`` outside its whole pages (``before`` them, and after ``length``)."""
    return bytes(view[:before]) + bytes(view[before + length:])
