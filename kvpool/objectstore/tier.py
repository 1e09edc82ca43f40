"""The deep tier's objects in a bucket: the calls of the shared tier's directory (kvpool/sharedfs/files.py,
SharedDir) on S3, in the same formats (kvpool/sharedfs/layout.py), so a node writes, reads, removes and scans
either the same way. Blocking calls; callers run them in threads. Under the settings' prefix:

    <cluster>/objects/ab/cd/abcd…(32 hex)-<generation, 16 hex>   HEADER | key | payload, one object per version
    <cluster>/manifests/<writer>/<sequence, 16 hex>.log         records, one object per batch of a writer

S3 has no append: a writer's manifest is a run of objects, each written whole by one PUT (never torn), read in
sequence order as one manifest. An object is put before its ADDED record, its REMOVED record before it is
deleted, so a crash leaves at worst an object no record names (space, never a wrong answer). Every object read
is checked against its header and checksum before a byte is used, and against the placement's size and checksum
when read into a caller's buffer. With `?encryption=aes-gcm` in the tier's URL, every object and manifest is
sealed (AES-256-GCM, kvpool/objectstore/sealing.py) and one that is not, or fails its tag, is never used.
"""

import logging
import threading
from concurrent.futures import ThreadPoolExecutor

from ..errors import ChecksumMismatchError, InvalidArgumentError, KeyNotFoundError, KvpoolError
from ..protocol import inventory
from ..protocol.checksum import checksum as checksum_of
from ..security import auth
from ..sharedfs.layout import (ADDED, HEADER_SIZE, MANIFEST_SUFFIX, MANIFESTS_DIR, OBJECTS_DIR, REMOVED, Scan,
                               SharedObject, fold, object_name, pack_header, pack_record, parse_header,
                               parse_records)
from ..sharedfs.files import DeepTier, raise_failures
from .bucket import Bucket
from .sealing import OVERHEAD, ObjectCipher, is_sealed

log = logging.getLogger(__name__)

TIER = "object tier"  # in error messages
PARALLEL = 16  # objects of a batch (and ranges of one object) moved at once
COMPACT_AFTER = 64  # manifest objects a writer's scan folds into its own when it finds more
SNAPSHOT_RECORDS = 100_000  # records per manifest object a compaction writes (about 11 MB of 64-byte keys)
RANGE_SIZE = 8 << 20  # an object larger than this is read by ranged GETs of this size, in parallel
DELETE_CHUNK = 256  # folded manifest objects deleted between checks that the tier is not closing


class BucketTier(DeepTier):
    """One process's view of `<prefix>/<cluster>/` in the bucket. `writer` names this process's manifest run
    (manifests/<writer>/), which no other live process may share (e.g. "node-1-<instance>"); None: a reader's
    view (a client's), which writes nothing. `token`: the cluster secret or the client token, which the key of an
    encrypted tier comes from (the bucket's settings say whether it is)."""

    def __init__(self, bucket: Bucket, cluster: str, writer: str | None, token: str | None = None):
        self.check_names(TIER, cluster, writer)
        self.bucket = bucket
        self._cipher = None
        if bucket.settings.encryption:
            if not token:
                raise ValueError(f"{bucket.settings.url} is encrypted with a key from the cluster secret: give the "
                                 "secret (nodes: --token-file) or the client token (clients: token=)")
            self._cipher = ObjectCipher(auth.object_tier_key(token))
        self.base = f"{cluster}/"
        self.writer = writer
        self._sequence: int | None = None  # this writer's next manifest object, found at its first write
        self._lock = threading.Lock()
        self._threads = ThreadPoolExecutor(PARALLEL, thread_name_prefix="kvpool-object-tier")
        self._folding = ThreadPoolExecutor(1, thread_name_prefix="kvpool-object-tier-fold")  # compactions
        self._closing = threading.Event()

    def path(self, key: bytes, generation: int) -> str:
        return f"{self.base}{OBJECTS_DIR}/{object_name(key, generation)}"

    # -- writing

    def write_many(self, items: list[tuple[SharedObject, object]]) -> list[int]:
        """Each object put (header, key and payload: obj.size bytes whose xxh3_64 is obj.checksum, as the caller
        vouches), then one manifest object of their ADDED records. Returns each object's length. An object that
        cannot be put: BatchError after the others, its `results` each length or error. A manifest that cannot
        be put raises for the whole batch (the objects then are unreferenced: space, never a wrong answer)."""
        self._check_writer()
        prepared = []
        for obj, payload in items:  # every argument checked before any I/O
            view = memoryview(payload).cast("B")
            if view.nbytes != obj.size:
                raise InvalidArgumentError(f"payload of {view.nbytes} bytes for object {obj.key!r} generation "
                                           f"{obj.generation} of size {obj.size}")
            prepared.append((obj, pack_header(obj), view))
        results = list(self._threads.map(self._put_or_error, prepared))
        placed = [obj for (obj, _, _), result in zip(prepared, results) if not isinstance(result, KvpoolError)]
        if placed:
            self._record([pack_record(ADDED, obj) for obj in placed])
        raise_failures("write", [obj.key for obj, _, _ in prepared], results, TIER)
        return results

    def _put_or_error(self, prepared) -> int | KvpoolError:
        obj, header, view = prepared
        name = self.path(obj.key, obj.generation)
        try:
            self.bucket.put(name, self._cipher.seal(name, [header, view]) if self._cipher else [header, view])
        except KvpoolError as exc:
            return exc
        return len(header) + view.nbytes

    def _record(self, records: list[bytes]) -> None:
        """One manifest object holding `records`, the next of this writer's run."""
        with self._lock:
            if self._sequence is None:
                self._sequence = self._next_sequence()
            name = f"{self.base}{MANIFESTS_DIR}/{self.writer}/{self._sequence:016x}{MANIFEST_SUFFIX}"
            body = b"".join(records)
            self.bucket.put(name, self._cipher.seal(name, body) if self._cipher else body)
            self._sequence += 1

    def _next_sequence(self) -> int:
        """After the highest this writer name left (a restart under the same name)."""
        highest = -1
        for page in self.bucket.list(f"{self.base}{MANIFESTS_DIR}/{self.writer}/"):
            for name, _ in page:
                stem = name.rsplit("/", 1)[-1].removesuffix(MANIFEST_SUFFIX)
                try:
                    highest = max(highest, int(stem, 16))
                except ValueError:
                    continue
        return highest + 1

    def _check_writer(self) -> None:
        if self.writer is None:
            raise InvalidArgumentError("a reader's view of the object tier writes nothing")

    # -- reading

    def read(self, key: bytes, generation: int) -> tuple[SharedObject, bytes]:
        """The object and its payload, checked whole: KeyNotFoundError if there is none, ChecksumMismatchError
        naming it and what is wrong with it, UnavailableError if the store cannot be read."""
        name = self.path(key, generation)
        data = self._opened(name, self.bucket.get(name))
        obj = _checked_header(data, name, key, generation)
        start = HEADER_SIZE + len(key)
        if len(data) != start + obj.size:
            raise ChecksumMismatchError(f"{name} holds {len(data) - start} payload bytes, its header says "
                                        f"{obj.size} (truncated or damaged)")
        payload = bytes(data[start:])
        if checksum_of(payload) != obj.checksum:
            raise ChecksumMismatchError(f"{name}: payload fails its checksum (damaged)")
        return obj, payload

    def read_into(self, key: bytes, generation: int, size: int, checksum: int, dest) -> None:
        """The payload of (key, generation) into `dest` (a writable buffer of exactly `size` bytes), refused
        unless the object is of that size and checksum (a placement's) and the bytes read match it. A large one
        is read by ranged GETs in parallel. After an error `dest` holds nothing to use."""
        view = memoryview(dest).cast("B")
        if view.readonly or view.nbytes != size:
            raise InvalidArgumentError(f"read_into needs a writable buffer of {size} bytes, not a "
                                       f"{'read-only ' if view.readonly else ''}one of {view.nbytes}")
        name = self.path(key, generation)
        start = HEADER_SIZE + len(key)
        total = start + size
        if self._cipher is not None:  # opened whole: its tag covers every byte
            stored = total + OVERHEAD
            head = self._opened(name, self.bucket.get(name) if stored <= RANGE_SIZE else
                                b"".join(self._ranges(name, stored)))
            parts = [head[start:]]
        elif total <= RANGE_SIZE:
            data = self._opened(name, self.bucket.get(name))
            parts = [data[start:]]
            head = data
        else:
            ranges = self._ranges(name, total)
            head, parts = ranges[0], [ranges[0][start:], *ranges[1:]]
        obj = _checked_header(head, name, key, generation)
        if obj.size != size or obj.checksum != checksum:
            raise ChecksumMismatchError(f"{name} holds {obj.size} bytes of checksum {obj.checksum:#x}; expected "
                                        f"{size} of {checksum:#x}")
        if sum(map(len, parts)) != size:
            raise ChecksumMismatchError(f"{name} is {sum(map(len, parts)) + start} bytes, not {total} (truncated)")
        offset = 0
        for part in parts:
            view[offset:offset + len(part)] = part
            offset += len(part)
        if checksum_of(view) != checksum:
            raise ChecksumMismatchError(f"{name}: payload fails its checksum (damaged)")

    def _ranges(self, name: str, total: int) -> list[memoryview]:
        """The first `total` bytes of `name` by ranged GETs of RANGE_SIZE, in parallel."""
        starts = list(range(0, total, RANGE_SIZE))
        return self.bucket.get_ranges(name, starts, [min(start + RANGE_SIZE, total) for start in starts])

    def _opened(self, name: str, data) -> memoryview:
        """An object's plain bytes: opened when the tier is encrypted (ChecksumMismatchError if it cannot be), and
        refused when it is not but the object is (the URL lacks ?encryption=aes-gcm)."""
        if self._cipher is not None:
            return memoryview(self._cipher.open(name, data))
        if is_sealed(data):
            raise ChecksumMismatchError(f"{name} is encrypted: give the tier's URL with ?encryption=aes-gcm")
        return memoryview(data)

    def exists(self, key: bytes, generation: int) -> bool:
        try:
            self.bucket.size(self.path(key, generation))
        except KeyNotFoundError:
            return False
        return True

    # -- removing

    def remove_many(self, items: list) -> list[bool]:
        """Each object deleted (items: SharedObject or (key, generation)), its REMOVED record put first. S3's
        DELETE does not say whether there was one: True for each deleted. One the store fails to delete:
        BatchError after the others, its `results` each bool or error (the object is then unreferenced)."""
        self._check_writer()
        objects = [item if isinstance(item, SharedObject) else SharedObject(item[0], item[1], 0, 0, 0, 0, 0)
                   for item in items]
        if not objects:
            return []
        self._record([pack_record(REMOVED, obj) for obj in objects])
        results = list(self._threads.map(self._delete_or_error, objects))
        raise_failures("remove", [obj.key for obj in objects], results, TIER)
        return results

    def _delete_or_error(self, obj: SharedObject) -> bool | KvpoolError:
        try:
            self.bucket.delete(self.path(obj.key, obj.generation))
        except KvpoolError as exc:
            return exc
        return True

    # -- adoption

    def scan(self, now_ms: int) -> Scan:
        """What every writer's manifest run says the tier holds, without reading an object: one listing of
        manifests/ and one GET per manifest object, in parallel. A writer's view (a node's) that found more than
        COMPACT_AFTER manifest objects folds them into a few of its own (compact, in a thread of its own after the
        scan has answered), so the next scan reads few."""
        runs: dict[str, list[str]] = {}
        prefix = f"{self.base}{MANIFESTS_DIR}/"
        for page in self.bucket.list(prefix):
            for name, _ in page:
                writer, _, leaf = name[len(prefix):].partition("/")
                if writer and leaf.endswith(MANIFEST_SUFFIX) and "/" not in leaf:
                    runs.setdefault(writer, []).append(name)
        names = [name for writer in sorted(runs) for name in sorted(runs[writer])]
        bodies = dict(zip(names, self._threads.map(self._manifest_bytes, names)))
        names = [name for name in names if bodies[name] is not None]  # (one refused is never folded away)
        bodies = {name: body or b"" for name, body in bodies.items()}
        manifests = [parse_records(b"".join(bodies[name] for name in sorted(runs[writer])))
                     for writer in sorted(runs)]
        result = fold(manifests, now_ms)
        if self.writer is not None and len(names) > COMPACT_AFTER:
            self._folding.submit(self._compact, result, names, now_ms)  # the scan's answer need not wait
        return result

    def _compact(self, result: Scan, folded: list[str], now_ms: int) -> None:
        """The live objects `result` found, as ADDED records of this writer (SNAPSHOT_RECORDS to a manifest
        object), then the manifest objects they were folded from deleted. Safe beside writers that go on: what
        they wrote after the listing is not deleted, and a removal anywhere still wins over these ADDED records.
        A failure leaves both (the fold reads duplicates as one), never fewer."""
        records = [pack_record(ADDED, SharedObject(entry.key.encode("utf-8", "surrogateescape"), entry.generation,
                                                   entry.size, entry.checksum, entry.flags, entry.raw_size,
                                                   now_ms + entry.ttl_ms if entry.ttl_ms else 0))
                   for entry in inventory.decode(result.reply)]
        try:
            for start in range(0, len(records), SNAPSHOT_RECORDS):
                self._record(records[start:start + SNAPSHOT_RECORDS])
            for start in range(0, len(folded), DELETE_CHUNK):  # a closing tier stops between chunks
                if self._closing.is_set():
                    return
                for _ in self._threads.map(self.bucket.delete, folded[start:start + DELETE_CHUNK]):
                    pass
        except KvpoolError as exc:
            log.warning("folding the object tier's manifests stopped (%s): the next scan folds them", exc)

    def _manifest_bytes(self, name: str) -> bytes | None:
        """A manifest object's records; b"" if it went after the listing; None if it is refused (encrypted with
        another key, or not encrypted when the tier is, or the other way round), said in the log."""
        try:
            return bytes(self._opened(name, self.bucket.get(name)))
        except KeyNotFoundError:  # removed between the listing and the read
            return b""
        except ChecksumMismatchError as exc:
            log.warning("manifest object skipped: %s", exc)
            return None

    def wait_for_folds(self, timeout: float | None = None) -> None:
        """Until the compactions scans started have ended (TimeoutError after `timeout` seconds)."""
        self._folding.submit(lambda: None).result(timeout)

    def close(self) -> None:
        self._closing.set()
        self._folding.shutdown(wait=True)
        self._threads.shutdown(wait=True)


def _checked_header(data, name: str, key: bytes, generation: int) -> SharedObject:
    obj = parse_header(data)  # ChecksumMismatchError when damaged
    if obj.key != key or obj.generation != generation:
        raise ChecksumMismatchError(f"{name} holds generation {obj.generation} of {obj.key!r}, not "
                                    f"{generation} of {key!r} (misplaced)")
    return obj

