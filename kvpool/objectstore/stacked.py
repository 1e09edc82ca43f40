"""The shared tier in a directory with a bucket beneath it (a node given both --shared-dir and --object-store):
the order is DRAM, SSD, the directory, the bucket.

What the node's last tier gives up is written to the directory, as without a bucket. The node keeps the files it
wrote (and those the leader's scan found there) in the order they came, and while they hold more than its share
of the directory (`--shared-dir-share`) it moves the oldest on to the bucket (`spill`): each object put there and
recorded, then its file removed and recorded, so a crash between leaves two copies of one version, never none.
Both stores name an object by its key and generation, so a read tries the directory, then the bucket, and the
master keeps one shared copy for either. A removal goes to both. A scan folds each store's manifests on its own
(a move is a REMOVED record in one and an ADDED in the other) and keeps each key's highest generation of the two.

A version the leader frees while it is being moved is removed from the bucket again once it landed there (its
REMOVED record after the move's ADDED one), never left live in it to come back at the next adoption.
"""

import itertools
import logging
import threading
from collections import OrderedDict

import numpy as np

from ..errors import BatchError, KeyNotFoundError, KvpoolError
from ..protocol import inventory
from ..sharedfs.files import DeepTier, SharedDir
from ..sharedfs.layout import HEADER_SIZE, Scan, SharedObject
from .tier import BucketTier

log = logging.getLogger(__name__)

SPILL_BATCH = 32  # files moved to the bucket per step (one manifest object each side)


class StackedTier(DeepTier):
    """`upper` (the directory) over `lower` (the bucket); `share`: bytes of its files this process keeps in the
    directory before moving the oldest on. Both views writers, or both readers (a client's)."""

    def __init__(self, upper: SharedDir, lower: BucketTier, share: int):
        self.upper, self.lower, self.share = upper, lower, share
        self.writer = lower.writer
        self._files: OrderedDict[tuple[bytes, int], int] = OrderedDict()  # in the directory, oldest first -> bytes
        self._file_bytes = 0
        self._lock = threading.Lock()  # over the sets below (never held across I/O)
        self._moving: set[tuple[bytes, int]] = set()  # the batch a spill is moving now
        self._freed: set[tuple[bytes, int]] = set()  # of those, the ones removed meanwhile
        self._halt = threading.Event()  # set: a spill ends after its batch
        self.spilled = self.spilled_bytes = 0

    def probe(self) -> None:
        self.upper.probe()  # the bucket's calls have deadlines of their own

    # -- writing

    def write_many(self, items: list[tuple[SharedObject, object]]) -> list[int]:
        try:
            results = self.upper.write_many(items)
        except BatchError as exc:
            self._track(items, exc.results)
            raise
        self._track(items, results)
        return results

    def _track(self, items, results) -> None:
        with self._lock:
            for (obj, _), result in zip(items, results):
                if not isinstance(result, BaseException):
                    self._add_file((obj.key, obj.generation), result)

    def _add_file(self, name: tuple[bytes, int], length: int) -> None:
        if name not in self._files:
            self._files[name] = length
            self._file_bytes += length

    def spill(self) -> int:
        """Move the oldest of this process's files to the bucket while they hold more than its share; the
        number moved. A file the bucket cannot take stays (the next call tries again). One call at a time
        (the node runs it in a thread of its own, beside its sweeps)."""
        moved = 0
        while not self._halt.is_set():
            with self._lock:
                if self._file_bytes <= self.share or not self._files:
                    return moved
                batch, excess = [], self._file_bytes - self.share
                for name, length in itertools.islice(self._files.items(), SPILL_BATCH):
                    if excess <= 0:
                        break
                    batch.append(name)
                    excess -= length
                self._moving.update(batch)
            try:
                done = self._spill(batch)
            finally:
                with self._lock:
                    self._moving.difference_update(batch)
            if not done:
                return moved
            moved += done
        return moved

    def halt_spill(self) -> None:
        self._halt.set()

    def _spill(self, batch: list[tuple[bytes, int]]) -> int:
        items, gone = [], []
        for name in batch:
            try:
                items.append(self.upper.read(*name))
            except KeyNotFoundError:  # removed by another node (a FREE reaches every one)
                gone.append(name)
            except KvpoolError as exc:  # damaged: never moved on, left to the leader's checks
                log.error("not moving %r to the bucket: %s", name[0], exc)
                gone.append(name)
        if items:
            try:
                results = self.lower.write_many(items)
            except BatchError as exc:
                results = exc.results
            except KvpoolError as exc:
                log.warning("moving files to the bucket failed (%s): they stay in the directory", exc)
                results = [exc] * len(items)
        landed = [obj for (obj, _), result in zip(items, results if items else [])
                  if not isinstance(result, BaseException)]
        with self._lock:  # what was freed while it moved: its removal may have come before it landed
            freed = [obj for obj in landed if (obj.key, obj.generation) in self._freed]
            self._freed.difference_update(batch)
            for name in gone + [(obj.key, obj.generation) for obj in landed]:
                self._forget(name)
        if freed:
            self._removed(self.lower, freed)
        if landed:
            self._removed(self.upper, landed)  # now the bucket's copy is the one read
            self.spilled += len(landed)
            self.spilled_bytes += sum(obj.size for obj in landed)
        return len(landed) + len(gone)

    def _forget(self, name: tuple[bytes, int]) -> None:
        length = self._files.pop(name, None)
        if length is not None:
            self._file_bytes -= length

    # -- reading: the directory, else the bucket

    def read(self, key: bytes, generation: int) -> tuple[SharedObject, bytes]:
        try:
            return self.upper.read(key, generation)
        except KeyNotFoundError:
            return self.lower.read(key, generation)

    def read_into(self, key: bytes, generation: int, size: int, checksum: int, dest) -> None:
        try:
            self.upper.read_into(key, generation, size, checksum, dest)
        except KeyNotFoundError:
            self.lower.read_into(key, generation, size, checksum, dest)

    def exists(self, key: bytes, generation: int) -> bool:
        return self.upper.exists(key, generation) or self.lower.exists(key, generation)

    # -- removing: from both

    def remove_many(self, items: list) -> list[bool]:
        names = [(item.key, item.generation) if isinstance(item, SharedObject) else tuple(item) for item in items]
        with self._lock:
            for name in names:
                self._forget(name)
                if name in self._moving:  # removed again from the bucket once it landed there (spill)
                    self._freed.add(name)
        outcomes = [self._removed(store, names) for store in (self.upper, self.lower)]
        results = [a if isinstance(a, BaseException) else b if isinstance(b, BaseException) else a or b
                   for a, b in zip(*outcomes)]
        if any(isinstance(result, BaseException) for result in results):
            raise BatchError(f"{sum(isinstance(r, BaseException) for r in results)} of {len(names)} shared "
                             "objects could not be removed", results)
        return results

    @staticmethod
    def _removed(store: DeepTier, names: list) -> list:
        try:
            return store.remove_many(names)
        except BatchError as exc:
            return exc.results
        except KvpoolError as exc:
            return [exc] * len(names)

    # -- adoption

    def scan(self, now_ms: int) -> Scan:
        """Each store's scan, each key's highest generation of the two kept (one copy where a crash left the
        same version in both); the directory's files found are this process's to move on from now."""
        upper, lower = self.upper.scan(now_ms), self.lower.scan(now_ms)
        merged = merge(upper, lower)
        if self.writer is not None:  # the directory's files of the versions kept
            merged_reply = inventory.Reply(merged.reply)
            kept = set(zip(_keys(merged_reply), merged_reply.records["generation"].tolist()))
            in_upper = inventory.Reply(upper.reply)
            with self._lock:
                for key, record in zip(_keys(in_upper), in_upper.records.tolist()):
                    generation, size, key_length = record[0], record[1], record[6]
                    if (key, generation) in kept:
                        self._add_file((key, generation), HEADER_SIZE + key_length + size)
        return merged

    def close(self) -> None:
        self._halt.set()
        self.upper.close()
        self.lower.close()


def merge(upper: Scan, lower: Scan) -> Scan:
    """Two stores' scans as one. Of a key's versions in either, the highest generation is its object (the same
    version in both is one); the others are superseded; a key whose highest is past its expiry has none."""
    a, b = inventory.Reply(upper.reply), inventory.Reply(lower.reply)
    expired = upper.expired + lower.expired
    records = np.concatenate([a.records, b.records])
    keys = _keys(a) + _keys(b)
    live = len(keys)
    first_seen: dict[bytes, int] = {}
    candidates = keys + [obj.key for obj in expired]
    key_id = np.fromiter(map(first_seen.setdefault, candidates, itertools.count()), np.int64, len(candidates))
    generation = np.concatenate([records["generation"], np.array([o.generation for o in expired], np.uint64)])
    order = np.lexsort((generation, key_id))
    highest = order[np.r_[key_id[order][1:] != key_id[order][:-1], True]] if len(order) else order
    kept_generation = np.zeros(len(candidates), np.uint64)  # by label: the position of its first record
    kept_generation[key_id[highest]] = generation[highest]
    current = highest[highest < live]  # (an expired highest: the key has none)
    older = np.flatnonzero(generation[:live] != kept_generation[key_id[:live]])
    kept = records[current]
    reply = inventory.encode_records(kept, b"".join(keys[i] for i in current.tolist()))
    others = [SharedObject(keys[i], *map(int, (r[0], r[1], r[2], r[5], r[3])), 0)
              for i, r in zip(older.tolist(), records[older].tolist())]
    return Scan(reply=reply, superseded=upper.superseded + lower.superseded + others, expired=expired,
                records=upper.records + lower.records, manifests=upper.manifests + lower.manifests,
                bytes=int(kept["size"].sum()) + int(kept["key_length"].sum()) + HEADER_SIZE * len(kept))


def _keys(reply: inventory.Reply) -> list[bytes]:
    blob, ends = reply.key_bytes
    starts = ends - reply.records["key_length"]
    return [blob[start:end] for start, end in zip(starts.tolist(), ends.tolist())]
