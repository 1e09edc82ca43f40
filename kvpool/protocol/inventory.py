"""The INVENTORY reply: what a node holds, as the record a new leader rebuilds its table from.

A node may hold millions of objects and a new leader reads every node's
inventory before it serves, so the reply is binary, not JSON: a count, one
fixed-size record per object, then every key's bytes back to back. The records
are read as numpy columns (no Python object per field), a slice at a time.
"""

import struct
from typing import NamedTuple

import numpy as np

from ..errors import ProtocolError
from .wire import MAX_GENERATION

# generation, size, checksum, raw_size, ttl_ms (0 = none), write flags, key length, tiers held (bit per tier)
_RECORD = struct.Struct("<QQQQqIHB")
RECORD_DTYPE = np.dtype([("generation", "<u8"), ("size", "<u8"), ("checksum", "<u8"), ("raw_size", "<u8"),
                         ("ttl_ms", "<i8"), ("flags", "<u4"), ("key_length", "<u2"), ("tiers", "u1")])
assert RECORD_DTYPE.itemsize == _RECORD.size
_COUNT = struct.Struct("<I")
DRAM_BIT, SSD_BIT = 1, 2
SHARED_BIT = 4  # a file in the directory every node mounts (kvpool/sharedfs)


class Entry(NamedTuple):
    key: str
    generation: int
    size: int
    checksum: int
    flags: int = 0
    raw_size: int = 0
    ttl_ms: int = 0   # remaining lifetime; 0 = none
    tiers: int = DRAM_BIT

    @property
    def in_dram(self) -> bool:
        return bool(self.tiers & DRAM_BIT) or not self.tiers & SSD_BIT


def encode(entries: list[Entry]) -> bytes:
    keys = [e.key.encode("utf-8", "surrogateescape") for e in entries]
    records = b"".join(_RECORD.pack(e.generation, e.size, e.checksum, e.raw_size, e.ttl_ms, e.flags, len(k), e.tiers)
                       for e, k in zip(entries, keys))
    return _COUNT.pack(len(entries)) + records + b"".join(keys)


def encode_records(records: np.ndarray, keys: bytes) -> bytes:
    """The reply from its records (RECORD_DTYPE) and every key's bytes back to back, in the records' order."""
    return b"".join(encode_parts(records, keys))


def encode_parts(records: np.ndarray, keys: bytes) -> list:
    """encode_records as the buffers it joins (a node sends them as they are: a reply of millions of
    objects is hundreds of MB, and each copy of it costs a new leader's takeover time)."""
    return [_COUNT.pack(len(records)), memoryview(np.ascontiguousarray(records)).cast("B"), keys]


# The INVENTORY_CHANGES reply: what changed on a node since a change number, so a standby master that read a
# node's inventory once reads only what changed since. Its head (the numbering's series, the change number it
# reaches, how many slots live and gone), the series' ASCII, then the live slots and the gone slots (u32 each),
# then an INVENTORY reply of the live ones in the same order.
_CHANGES_HEAD = struct.Struct("<QIIB")
MAX_SERIES = 64


def encode_changes(series: str, changes: int, slots: np.ndarray, gone: np.ndarray, reply_parts: list) -> list:
    """The INVENTORY_CHANGES reply as buffers: `slots` (uint32) the slot of each entry of `reply_parts`
    (encode_parts), `gone` the slots changed since that hold nothing now."""
    name = series.encode("ascii")
    return [_CHANGES_HEAD.pack(changes, len(slots), len(gone), len(name)), name,
            memoryview(np.ascontiguousarray(slots, dtype="<u4")).cast("B"),
            memoryview(np.ascontiguousarray(gone, dtype="<u4")).cast("B"), *reply_parts]


class Changes:
    """An INVENTORY_CHANGES reply as received: series, changes (the number it reaches), slots (of the
    entries of `reply`, in order), gone (slots that hold nothing now), reply (an inventory Reply)."""

    def __init__(self, body):
        view = memoryview(body)
        if len(view) < _CHANGES_HEAD.size:
            raise ProtocolError(f"INVENTORY_CHANGES reply of {len(view)} bytes has no head")
        self.changes, live, gone, name_length = _CHANGES_HEAD.unpack_from(view)
        at = _CHANGES_HEAD.size
        slots_at = at + name_length
        reply_at = slots_at + 4 * (live + gone)
        if name_length > MAX_SERIES or reply_at > len(view):
            raise ProtocolError(f"INVENTORY_CHANGES reply of {len(view)} bytes is too short for {live + gone} slots")
        self.series = bytes(view[at:slots_at]).decode("ascii", "replace")
        self.slots = np.frombuffer(view, dtype="<u4", count=live, offset=slots_at).astype(np.int64)
        self.gone = np.frombuffer(view, dtype="<u4", count=gone, offset=slots_at + 4 * live).astype(np.int64)
        self.reply = Reply(view[reply_at:])
        if len(self.reply) != live:
            raise ProtocolError(f"INVENTORY_CHANGES reply names {live} slots for {len(self.reply)} entries")


class Columns(NamedTuple):
    """A slice of an inventory: its keys, and a structured array (RECORD_DTYPE) of the rest."""

    keys: list[str]
    records: np.ndarray

    def entries(self) -> list[Entry]:
        r = self.records
        return [Entry(*fields) for fields in zip(
            self.keys, r["generation"].tolist(), r["size"].tolist(), r["checksum"].tolist(), r["flags"].tolist(),
            r["raw_size"].tolist(), r["ttl_ms"].tolist(), r["tiers"].tolist())]


def count_down(ttl_ms: np.ndarray, ms: int) -> np.ndarray:
    """Remaining lifetimes (`ttl_ms`, 0 = none; changed in place) made `ms` shorter; returns a mask of those that
    ran out, left at 1 (never 0, which means none): whoever keeps the mask takes them as expired."""
    lived = ttl_ms > 0
    ttl_ms[lived] -= ms
    ran_out = lived & (ttl_ms <= 0)
    ttl_ms[ran_out] = 1
    return ran_out


class Reply:
    """An INVENTORY reply as received, checked whole on arrival, decoded a slice at a time."""

    def __init__(self, body: bytes):
        view = memoryview(body)
        if len(view) < _COUNT.size:
            raise ProtocolError(f"INVENTORY reply of {len(view)} bytes has no count")
        (count,) = _COUNT.unpack_from(view)
        keys_at = _COUNT.size + count * _RECORD.size
        if keys_at > len(view):
            raise ProtocolError(f"INVENTORY reply of {len(view)} bytes is too short for {count} records")
        self.count = count
        self._records = np.frombuffer(view, dtype=RECORD_DTYPE, count=count, offset=_COUNT.size)
        self._ends = np.cumsum(self._records["key_length"], dtype=np.int64)
        if (int(self._ends[-1]) if count else 0) != len(view) - keys_at:
            raise ProtocolError("INVENTORY reply's keys do not add up to its records")
        if count and int(self._records["generation"].max()) > MAX_GENERATION:
            raise ProtocolError(f"INVENTORY reply names a generation beyond {MAX_GENERATION}")
        self._keys = bytes(view[keys_at:])
        # All-ASCII keys (the usual case) are decoded in one go and cut by position.
        self._text = self._keys.decode("ascii") if self._keys.isascii() else None

    def __len__(self) -> int:
        return self.count

    @property
    def records(self) -> np.ndarray:
        """Every record (RECORD_DTYPE), in reply order."""
        return self._records

    def age(self, ms: int) -> np.ndarray:
        """The entries' remaining lifetimes made `ms` shorter (a reply kept that long before it is adopted);
        returns a mask of those that ran out meanwhile."""
        if ms <= 0 or not self.count:
            return np.zeros(self.count, dtype=bool)
        if not self._records.flags.writeable:
            self._records = self._records.copy()
        return count_down(self._records["ttl_ms"], ms)

    @property
    def key_bytes(self) -> tuple[bytes, np.ndarray]:
        """Every key's bytes back to back, and where each ends (int64, cumulative)."""
        return self._keys, self._ends

    def columns_at(self, positions: np.ndarray) -> Columns:
        """The entries at `positions` (indices into the reply, any order)."""
        records = self._records[positions]
        return Columns(self._keys_ending_at(self._ends[positions], records), records)

    def _keys_ending_at(self, ends: np.ndarray, records: np.ndarray) -> list[str]:
        """The keys of `records`, whose bytes end at `ends` in the reply's key blob."""
        starts = (ends - records["key_length"]).tolist()
        ends = ends.tolist()
        if self._text is not None:
            text = self._text
            return [text[a:b] for a, b in zip(starts, ends)]
        blob = self._keys
        return [blob[a:b].decode("utf-8", "surrogateescape") for a, b in zip(starts, ends)]

    def __iter__(self):
        return (entry for part in self.slices() for entry in part)

    def column_slices(self, size: int = 20_000):
        for first in range(0, self.count, size):
            records = self._records[first:first + size]
            yield Columns(self._keys_ending_at(self._ends[first:first + size], records), records)

    def slices(self, size: int = 20_000):
        return (columns.entries() for columns in self.column_slices(size))


def decode(body: bytes) -> list[Entry]:
    """The entries of an INVENTORY reply; ProtocolError if it is not one."""
    return list(Reply(body))
