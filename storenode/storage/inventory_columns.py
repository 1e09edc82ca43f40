"""The node's live objects kept as columns, so an INVENTORY reply costs array copies, not a pass per object.

A new leader cannot serve before every node has sent its INVENTORY
(kvpool/protocol/inventory.py), so a takeover waits for the slowest node's
reply. Built from the records at the moment it is asked, a reply costs Python
work per object (about 2 µs: ~1 s per 500,000 objects here); kept as columns as
records come and go, it costs a few numpy copies (~0.1 s per 500,000).

Each indexed record owns a slot (ObjectRecord.slot): a row in one array per
field, plus its key in a list. A record leaving the index frees its slot for the
next one; arrays never shrink (they hold at most the peak number of objects).
"""

from array import array
from itertools import compress

import numpy as np

from kvpool.protocol.inventory import RECORD_DTYPE, encode_parts

# The fields copied from a record as it is indexed (never changed afterwards), with their array type codes.
_FIXED = (("generation", "Q"), ("size", "Q"), ("checksum", "Q"), ("raw_size", "Q"), ("flags", "I"))


class InventoryColumns:
    def __init__(self):
        self._generation, self._size, self._checksum, self._raw_size, self._flags = (
            array(code) for _name, code in _FIXED)
        self._expires = array("d")  # unix seconds; 0 = no TTL (ObjectRecord.expires_at)
        self._key_length = array("H")
        self._tiers = array("B")  # inventory.DRAM_BIT | SSD_BIT of the copies it has
        self._live = bytearray()  # 1 for a slot in use
        self._keys: list[bytes] = []  # b"" in a free slot
        self._free: list[int] = []

    def add(self, rec) -> None:
        """Give an indexed record a slot (rec.slot) holding its fields; its tiers start empty.
        Written out field by field: it runs for every object a node stores."""
        if self._free:
            rec.slot = slot = self._free.pop()
            self._generation[slot] = rec.generation
            self._size[slot] = rec.size
            self._checksum[slot] = rec.checksum
            self._raw_size[slot] = rec.raw_size
            self._flags[slot] = rec.flags
            self._expires[slot] = rec.expires_at
            self._key_length[slot] = len(rec.key)
            self._tiers[slot] = 0
            self._live[slot] = 1
            self._keys[slot] = rec.key
        else:
            rec.slot = len(self._keys)
            self._generation.append(rec.generation)
            self._size.append(rec.size)
            self._checksum.append(rec.checksum)
            self._raw_size.append(rec.raw_size)
            self._flags.append(rec.flags)
            self._expires.append(rec.expires_at)
            self._key_length.append(len(rec.key))
            self._tiers.append(0)
            self._live.append(1)
            self._keys.append(rec.key)

    def remove(self, rec) -> None:
        """Free an unindexed record's slot."""
        slot = rec.slot
        if slot >= 0:
            rec.slot = -1
            self._live[slot] = 0
            self._keys[slot] = b""
            self._free.append(slot)

    def join(self, rec, bit: int) -> None:
        """The record now has a copy in the tier of `bit` (no-op for a record not indexed)."""
        if rec.slot >= 0:
            self._tiers[rec.slot] |= bit

    def leave(self, rec, bit: int) -> None:
        if rec.slot >= 0:
            self._tiers[rec.slot] &= ~bit & 0xFF

    def reply(self, now: float) -> bytes:
        """The INVENTORY reply: every live object whose TTL has not run out by `now`, in slot order."""
        return b"".join(self.reply_parts(now))

    def reply_parts(self, now: float) -> list:
        """reply() as the buffers it joins (inventory.encode_parts)."""
        live = np.frombuffer(self._live, dtype=np.bool_).copy()  # copies: the arrays stay growable
        expires = np.frombuffer(self._expires, dtype=np.float64).copy()
        expired = live & (expires > 0) & (expires <= now)
        if expired.any():
            live &= ~expired
            keys = b"".join(compress(self._keys, live.tolist()))
        else:
            keys = b"".join(self._keys)  # a free slot holds b"": nothing to skip
        records = np.zeros(int(np.count_nonzero(live)), dtype=RECORD_DTYPE)
        for (name, _code), column in zip(_FIXED, (self._generation, self._size, self._checksum, self._raw_size,
                                                  self._flags)):
            records[name] = np.frombuffer(column, dtype=RECORD_DTYPE[name])[live]
        records["key_length"] = np.frombuffer(self._key_length, dtype=np.uint16)[live]
        records["tiers"] = np.frombuffer(self._tiers, dtype=np.uint8)[live]
        left = expires[live]
        # Remaining lifetime in ms, at least 1 while alive; 0 = no ttl (as ObjectRecord.ttl_ms).
        records["ttl_ms"] = np.where(left > 0, np.maximum(1, ((left - now) * 1000).astype(np.int64)), 0)
        return encode_parts(records, keys)
