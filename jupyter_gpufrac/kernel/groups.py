"""Groups of variables that share objects: found, sized, packed into blobs, left on disk by a budget."""

from __future__ import annotations

import zlib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

from jupyter_gpufrac.kernel.blobs import BlobWriter
from jupyter_gpufrac.kernel.fingerprints import Fingerprint
from jupyter_gpufrac.kernel.pickler import NamespacePickler, NullSink

PACK_BYTES = 64 * 1024  # a pack holds small pickles up to about this size
PACK_SPREAD = 128  # about this many small groups per pack


T = TypeVar("T")


@dataclass
class Packs:
    """Where groups were packed: pack blob -> bytes, and which pickles each pack holds."""

    sizes: dict[str, int]
    composition: dict[tuple[int, ...], str]


@dataclass
class Group:
    """A group as the last checkpoint saved it: its header record and, unless it fills a pack
    of its own, its pickle (to pack it again with its neighbours without re-pickling it)."""

    record: dict[str, Any]
    data: bytes | None


def components(items: Iterable[T], joined: Iterable[tuple[T, T]]) -> list[list[T]]:
    """``items`` split into the sets that the ``joined`` pairs connect, in first-seen order."""
    parent: dict[T, T] = {item: item for item in items}

    def find(item: T) -> T:
        while parent[item] != item:
            parent[item] = parent[parent[item]]
            item = parent[item]
        return item

    for a, b in joined:
        parent[find(a)] = find(b)
    found: dict[T, list[T]] = {}
    for item in parent:
        found.setdefault(find(item), []).append(item)
    return list(found.values())


def group_size(groups: list[dict[str, Any]], measure: str) -> int:
    """Bytes ``groups`` take once loaded: ``bytes`` (pickles, buffers and storages, each storage
    once) or ``gpu_bytes`` (storages that go to the GPU)."""
    tensors: dict[str, int] = {}
    on_gpu: set[str] = set()
    for group in groups:
        tensors.update(group.get("tensors", {}))
        on_gpu.update(group.get("gpu", []))
    if measure == "gpu_bytes":
        return sum(int(n) for blob, n in tensors.items() if blob in on_gpu)
    buffers = sum(int(n) for group in groups for _, n in group.get("buffers", []))
    return (sum(int(g.get("pickle", 0)) for g in groups) + sum(int(n) for n in tensors.values())
            + buffers)


def sharing(groups: list[dict[str, Any]]) -> list[list[int]]:
    """Indexes of ``groups`` in sets that share a tensor storage (a view stays a view of its
    base only while the two are saved and loaded together)."""
    holder: dict[str, int] = {}
    joined = [(i, holder.setdefault(blob, i))
              for i, group in enumerate(groups) for blob in group.get("tensors", {})]
    return components(range(len(groups)), joined)


def defer(groups: list[dict[str, Any]], budget: int, measure: str) -> list[dict[str, Any]]:
    """The groups to leave on disk so that the rest, counted by ``measure``, fits ``budget``.

    Groups that share a tensor storage go together (a view must stay a view of its base); the
    largest go first, so the fewest variables wait.
    """
    units = sharing(groups)

    def size(unit: list[int]) -> int:
        return group_size([groups[i] for i in unit], measure)

    total = sum(size(unit) for unit in units)
    chosen: list[int] = []
    for unit in sorted(units, key=size, reverse=True):
        if total <= budget:
            break
        if size(unit) > 0:
            chosen += unit
            total -= size(unit)
    return [groups[i] for i in sorted(chosen)]


def group_names(
    values: Mapping[str, Any], prints: Mapping[str, Fingerprint | None],
    blobs: BlobWriter, ns: dict[str, Any],
) -> list[list[str]]:
    """Names whose values share objects (aliases, a model and its optimizer, an instance and its
    cell class), grouped: each group is pickled as one unit so they stay shared after a restore.

    A fingerprint says what each value reaches; a value without one is pickled alone, without
    writing anything, to learn it. A value that cannot be pickled alone is its own group (its
    failure is reported when it is saved).
    """
    owner: dict[int, str] = {}
    joined: list[tuple[str, str]] = []
    dry = BlobWriter(blobs.folder, blobs.cache, dry=True)
    # Everything each dry pickling met stays alive until the grouping is done: a temporary
    # freed after one variable's pickling could lend its id to an object of the next one.
    alive: list[Any] = []
    for name, value in values.items():
        found = prints[name]
        if found is not None:
            shared: Iterable[int] = found[1]
        else:
            pickler = NamespacePickler(NullSink(), dry, ns)
            wrapper = {name: value}
            try:
                pickler.dump(wrapper)
            except Exception:
                continue
            alive.append(pickler.memo.copy())
            shared = pickler.shared_ids() - {id(wrapper)}
        joined += [(name, owner.setdefault(key, name)) for key in shared]
    return [sorted(names) for names in components(values, joined)]


def pack_groups(
    groups: list[Group], blobs: BlobWriter, known: Mapping[tuple[int, ...], str]
) -> Packs:
    """Put the groups' pickles into content-addressed packs and set each record's place.

    Small pickles share packs, so a namespace of many small variables is a few files; which
    pack a group joins depends on the names alone (a pack ends after a group whose first name
    hashes to 0 modulo PACK_SPREAD, or once it holds PACK_BYTES), so a change rewrites one
    pack of about PACK_SPREAD groups and a new variable moves no others. ``known`` maps packs
    by the pickles they hold, to skip hashing a pack that did not change.
    """
    small = sorted((g for g in groups if g.data is not None and len(g.data) < PACK_BYTES),
                   key=lambda g: g.record["names"][0])
    runs: list[list[Group]] = [[]]
    size = 0
    for group in small:
        runs[-1].append(group)
        size += len(group.data or b"")
        if size >= PACK_BYTES or zlib.crc32(group.record["names"][0].encode()) % PACK_SPREAD == 0:
            runs.append([])
            size = 0
    packs = Packs({}, {})
    for run in filter(None, runs):
        pickles = [g.data or b"" for g in run]
        # The pickles are held by the groups as long as this key is kept: ids stay theirs.
        key = tuple(id(data) for data in pickles)
        name = known.get(key)
        if name is None or blobs.found(name) is None:
            name = blobs.pack_blob(b"".join(pickles))
        packs.composition[key] = name
        _place(run, name, packs)
    for group in groups:
        if group.data is not None and len(group.data) >= PACK_BYTES:
            # A pack of its own, reused whole while the group is; its pickle is not kept.
            _place([group], blobs.pack_blob(group.data), packs)
            group.data = None
        elif group.data is None:
            packs.sizes[group.record["blob"]] = int(group.record["pickle"])
    return packs


def _place(run: list[Group], name: str, packs: Packs) -> None:
    offset = 0
    for group in run:
        group.record.update(blob=name, offset=offset)
        offset += len(group.data or b"")
    packs.sizes[name] = offset


def referenced_blobs(records: list[dict[str, Any]], packs: Packs) -> dict[str, int]:
    """Every blob the records name, with its size."""
    found: dict[str, int] = {}
    for record in records:
        blob = str(record["blob"])
        found[blob] = packs.sizes.get(blob, int(record.get("offset", 0)) + int(record["pickle"]))
        found.update(record.get("tensors", {}))
        found.update((str(b), int(n)) for b, n in record.get("buffers", []))
    return found
