"""The shared tier's formats, with no I/O: where an object's file is, what the file holds, and the manifest
records that say which files exist.

Under `<shared_dir>/<cluster>/`:

    objects/ab/cd/abcd…(32 hex)-<generation, 16 hex>   HEADER | key | payload, one file per object version
    manifests/<writer>.log                              FRAME | body, appended by one writer each

A file's name comes from its key and generation, so any reader finds it without asking anyone, and an
overwrite or delete of one version never touches another's file. The header carries the key, the payload's
size and checksum and a check of its own (xxh3_64 over the header and the key), so a reader can tell a whole
file of this (key, generation) from a damaged, truncated or misplaced one.

A manifest record is a frame: u32 body length, u64 xxh3_64 of the body, then the body: the fixed part of an
INVENTORY record (kvpool/protocol/inventory.py) with the absolute expiry time for the ttl and the op
(ADDED, REMOVED) in the tiers byte, then the key. A new node adopts the tier by folding every writer's
records (`fold`) without opening a single object file.
"""

import hashlib
import itertools
import struct
from typing import Iterator, NamedTuple

import numpy as np
import xxhash

from ..errors import ChecksumMismatchError
from ..protocol import inventory
from ..protocol.checksum import checksum
from ..protocol.keys import MAX_KEY_BYTES

OBJECTS_DIR = "objects"
MANIFESTS_DIR = "manifests"
MANIFEST_SUFFIX = ".log"

MAGIC = b"KVPSHR01"
# magic, key_len, flags, reserved (0), generation, size, checksum, raw_size, expires_ms; then header_check
_HEADER_FIELDS = struct.Struct("<8sHHIQQQQQ")
_HEADER_CHECK = struct.Struct("<Q")
HEADER_SIZE = _HEADER_FIELDS.size + _HEADER_CHECK.size

ADDED, REMOVED = 1, 2
_FRAME = struct.Struct("<IQ")  # body length, xxh3_64 of the body
_FRAME_LENGTH = struct.Struct("<I")
_BODY = struct.Struct("<QQQQqIHB")  # generation, size, checksum, raw_size, expires_ms, flags, key_len, op
# The body's fixed part as numpy columns: inventory.RECORD_DTYPE's layout under the manifest's own names.
BODY_DTYPE = np.dtype([("generation", "<u8"), ("size", "<u8"), ("checksum", "<u8"), ("raw_size", "<u8"),
                       ("expires_ms", "<i8"), ("flags", "<u4"), ("key_length", "<u2"), ("op", "u1")])
assert BODY_DTYPE.itemsize == _BODY.size == inventory.RECORD_DTYPE.itemsize
_MAX_BODY = _BODY.size + MAX_KEY_BYTES
_xxh3 = xxhash.xxh3_64_intdigest  # checksum() without its Python frame, once per manifest record


class SharedObject(NamedTuple):
    key: bytes  # UTF-8, at most MAX_KEY_BYTES
    generation: int  # u64
    size: int  # payload bytes
    checksum: int  # xxh3_64 of the payload
    flags: int  # u16 write flags
    raw_size: int  # u64
    expires_ms: int  # unix ms; 0 = none

    @property
    def file_size(self) -> int:
        """Bytes of this object's file: header, key and payload."""
        return HEADER_SIZE + len(self.key) + self.size


def object_name(key: bytes, generation: int) -> str:
    """The object file's path relative to objects/: two levels of directories from the key's hash, so that
    none holds more than a small share of the files."""
    h = hashlib.blake2b(key, digest_size=16).hexdigest()
    return f"{h[0:2]}/{h[2:4]}/{h}-{generation:016x}"


def pack_header(obj: SharedObject) -> bytes:
    """The start of obj's file: HEADER and the key."""
    fields = _HEADER_FIELDS.pack(MAGIC, len(obj.key), obj.flags, 0, obj.generation, obj.size, obj.checksum,
                                 obj.raw_size, obj.expires_ms)
    return fields + _HEADER_CHECK.pack(checksum(fields + obj.key)) + obj.key


def parse_header(data) -> SharedObject:
    """The object a file's first bytes (at least HEADER and the key; more is ignored) describe, or
    ChecksumMismatchError saying what is wrong with them."""
    view = memoryview(data).cast("B")
    if len(view) < HEADER_SIZE:
        raise ChecksumMismatchError(f"shared object header is {len(view)} bytes, shorter than {HEADER_SIZE}")
    magic, key_len, flags, _reserved, generation, size, value_checksum, raw_size, expires_ms = \
        _HEADER_FIELDS.unpack_from(view)
    if magic != MAGIC:
        raise ChecksumMismatchError(f"shared object header has magic {magic!r}, not {MAGIC!r}")
    if key_len > MAX_KEY_BYTES:
        raise ChecksumMismatchError(f"shared object header names a key of {key_len} bytes; at most {MAX_KEY_BYTES}")
    if len(view) < HEADER_SIZE + key_len:
        raise ChecksumMismatchError(f"shared object header and key are {len(view)} bytes, shorter than the "
                                    f"{HEADER_SIZE + key_len} its key length says")
    key = bytes(view[HEADER_SIZE:HEADER_SIZE + key_len])
    (header_check,) = _HEADER_CHECK.unpack_from(view, _HEADER_FIELDS.size)
    if checksum(bytes(view[:_HEADER_FIELDS.size]) + key) != header_check:
        raise ChecksumMismatchError("shared object header fails its check (damaged)")
    return SharedObject(key, generation, size, value_checksum, flags, raw_size, expires_ms)


def pack_record(op: int, obj: SharedObject) -> bytes:
    """One manifest frame saying obj's file was ADDED or REMOVED."""
    body = _BODY.pack(obj.generation, obj.size, obj.checksum, obj.raw_size, obj.expires_ms, obj.flags,
                      len(obj.key), op) + obj.key
    return _FRAME.pack(len(body), checksum(body)) + body


class ManifestRecords:
    """The whole records at the start of a manifest's bytes, in columns: `bodies` (BODY_DTYPE), and each
    record's key at `key_starts` in `data` (bodies["key_length"] bytes), not copied out: while a list of a
    million keys is held, every garbage collection walks it. Parsing stops quietly
    at the first frame that is torn (a writer that crashed mid-append, or one appending right now) or fails its
    check; `valid_bytes` is where that frame starts (the whole length if none does), where the manifest's writer
    cuts it before appending again. Iterating yields (op, SharedObject) in file order."""

    def __init__(self, data: bytes):
        frames = np.array(_frame_starts(data), np.int64)
        length = _gather(data, np.dtype("<u4"), frames)
        body_check = _gather(data, np.dtype("<u8"), frames + _FRAME_LENGTH.size)
        body_starts = frames + _FRAME.size
        body_ends = body_starts + length
        # Past the walk no Python code runs per record: each step is one C loop over all of them.
        found = np.fromiter(map(_xxh3, _slices(data, body_starts, body_ends)), np.uint64, len(frames))
        bodies = _gather(data, np.dtype((np.void, _BODY.size)), body_starts).view(BODY_DTYPE)
        # A frame failing its check ends the manifest, as does one whose body says something impossible.
        bad = np.flatnonzero((found != body_check) | (bodies["key_length"] != length - _BODY.size)
                             | ((bodies["op"] != ADDED) & (bodies["op"] != REMOVED)))
        whole = int(bad[0]) if len(bad) else len(frames)
        self.data = data
        self.bodies = bodies[:whole]
        self.key_starts = body_starts[:whole] + _BODY.size
        self.valid_bytes = int(body_ends[whole - 1]) if whole else 0

    def __len__(self) -> int:
        return len(self.bodies)

    def key_slices(self) -> Iterator[bytes]:
        """Each record's key, lazily."""
        return _slices(self.data, self.key_starts, self.key_starts + self.bodies["key_length"])

    @property
    def keys(self) -> list[bytes]:
        return list(self.key_slices())

    def __iter__(self) -> Iterator[tuple[int, SharedObject]]:
        return zip(self.bodies["op"].tolist(), _objects(self.keys, self.bodies))


def _frame_starts(data: bytes) -> list[int]:
    """Where each frame starts, up to the first one that is torn or whose length cannot be a record's."""
    starts: list[int] = []
    append, unpack_length = starts.append, _FRAME_LENGTH.unpack_from
    least, most, frame_size = _BODY.size, _MAX_BODY, _FRAME.size
    pos, last = 0, len(data) - frame_size
    while pos <= last:  # the least Python per record: a large manifest holds millions
        (length,) = unpack_length(data, pos)
        if not least <= length <= most or pos + length > last:
            break
        append(pos)
        pos += frame_size + length
    return starts


def _gather(data: bytes, dtype: np.dtype, offsets: np.ndarray) -> np.ndarray:
    """The values of `dtype` at each byte offset of `data` (any alignment), copied out in one go."""
    every_byte = np.ndarray((max(len(data) - dtype.itemsize + 1, 0),), dtype, buffer=data, strides=(1,))
    return every_byte[offsets]


def parse_records(data) -> ManifestRecords:
    """The whole records of a manifest's bytes: iterable as (op, SharedObject), with `valid_bytes`."""
    return ManifestRecords(data)


class Scan(NamedTuple):
    """What every manifest says the tier holds, at one moment."""

    reply: bytes  # the live, unexpired objects as an INVENTORY reply (tiers = SHARED_BIT, ttl_ms remaining)
    superseded: list[SharedObject]  # live files of a key that has a higher live generation
    expired: list[SharedObject]  # a key's highest live generation, past its expiry time
    records: int  # manifest records read
    manifests: int  # manifest files read
    bytes: int  # of the files in `reply` (header, key and payload each)


def fold(manifests: list[ManifestRecords], now_ms: int) -> Scan:
    """The tier's contents from every writer's records. A writer's last record of a (key, generation) is its
    word on that file (it may remove a version and write it again); the version is live if some writer's
    word is ADDED and none's is REMOVED (the order between writers is unknown, so a removal anywhere
    counts). Of one key's live generations the highest is its object, the rest are superseded."""
    count = sum(map(len, manifests))
    if not count:
        return Scan(inventory.encode_records(np.empty(0, inventory.RECORD_DTYPE), b""), [], [], 0, len(manifests), 0)
    bodies = np.concatenate([m.bodies for m in manifests])
    keys = list(itertools.chain.from_iterable(map(ManifestRecords.key_slices, manifests)))
    # Each key labelled by the position of its first record (the dict filled in a C loop).
    first_seen: dict[bytes, int] = {}
    key_id = np.fromiter(map(first_seen.setdefault, keys, itertools.count()), np.int64, count)
    del first_seen
    generation, op = bodies["generation"], bodies["op"]
    writer = np.repeat(np.arange(len(manifests)), [len(m) for m in manifests])
    # Records of one (key, generation) next to each other, each writer's in its order (lexsort is stable).
    order = np.lexsort((generation, key_id))
    k, g, w = key_id[order], generation[order], writer[order]
    last_words = order[np.r_[(k[1:] != k[:-1]) | (g[1:] != g[:-1]) | (w[1:] != w[:-1]), True]]
    k, g = key_id[last_words], generation[last_words]
    first = np.flatnonzero(np.r_[True, (k[1:] != k[:-1]) | (g[1:] != g[:-1])])
    added = np.maximum.reduceat(op[last_words] == ADDED, first)
    removed = np.maximum.reduceat(op[last_words] == REMOVED, first)
    live = last_words[first[added & ~removed]]  # ADDED records, sorted by key, then generation
    highest = np.ones(len(live), bool)  # the last of each key's run
    highest[:-1] = key_id[live][1:] != key_id[live][:-1]
    expires = bodies["expires_ms"][live]
    expired = highest & (expires != 0) & (expires <= now_ms)
    current = live[highest & ~expired]

    records = bodies[current].view(inventory.RECORD_DTYPE)  # the same layout: ttl and tiers rewritten
    expires = records["ttl_ms"].copy()
    records["ttl_ms"] = np.where(expires == 0, 0, expires - now_ms)
    records["tiers"] = inventory.SHARED_BIT
    reply = inventory.encode_records(records, b"".join(map(keys.__getitem__, current.tolist())))
    superseded, expired = live[~highest], live[expired]
    superseded_keys, expired_keys = [keys[i] for i in superseded.tolist()], [keys[i] for i in expired.tolist()]
    del keys  # while a list of a million keys is held, every garbage collection walks it
    return Scan(reply=reply, superseded=_objects(superseded_keys, bodies[superseded]),
                expired=_objects(expired_keys, bodies[expired]), records=count, manifests=len(manifests),
                bytes=int(records["size"].sum()) + int(records["key_length"].sum()) + HEADER_SIZE * len(records))


def _slices(data: bytes, starts: np.ndarray, ends: np.ndarray):
    """data[start:end] for each pair, lazily."""
    return map(data.__getitem__, map(slice, starts.tolist(), ends.tolist()))


def _objects(keys: list[bytes], bodies: np.ndarray) -> list[SharedObject]:
    """The objects of `bodies` (BODY_DTYPE) and their keys."""
    b = bodies
    return list(map(SharedObject, keys, b["generation"].tolist(), b["size"].tolist(), b["checksum"].tolist(),
                    b["flags"].tolist(), b["raw_size"].tolist(), b["expires_ms"].tolist()))
