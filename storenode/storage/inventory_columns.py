"""The node's live objects kept as columns, so an INVENTORY reply costs array copies, not a pass per object.

A new leader cannot serve before every node has sent its INVENTORY
(kvpool/protocol/inventory.py), so a takeover waits for the slowest node's
reply. Built from the records at the moment it is asked, a reply costs Python
work per object (about 2 µs: ~1 s per 500,000 objects here); kept as columns as
records come and go, it costs a few numpy copies (~0.1 s per 500,000).

Each indexed record owns a slot (ObjectRecord.slot): a row in one array per
field, plus its key in a list. A record leaving the index frees its slot for the
next one; arrays never shrink (they hold at most the peak number of objects).

Every change to a slot (a record added or removed, a tier copy made or dropped)
is numbered: `changes` counts them and each slot keeps the number of its last
one, so a master that read the columns once can later read only the slots
changed since (INVENTORY_CHANGES, kvpool/protocol/inventory.py); `series` names
the numbering, which starts again with the process.
"""

import os
from array import array
from itertools import compress

import numpy as np

from kvpool.protocol.inventory import RECORD_DTYPE, encode_changes, encode_parts

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
        self._changed = array("Q")  # the number of each slot's last change
        self.changes = 0  # changes made so far (each slot's is at most this)
        self.series = os.urandom(8).hex()  # names this numbering: slots and numbers mean nothing in another

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
            self.changes += 1
            self._changed[slot] = self.changes
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
            self.changes += 1
            self._changed.append(self.changes)

    def remove(self, rec) -> None:
        """Free an unindexed record's slot."""
        slot = rec.slot
        if slot >= 0:
            rec.slot = -1
            self._live[slot] = 0
            self._keys[slot] = b""
            self._free.append(slot)
            self.changes += 1
            self._changed[slot] = self.changes

    def join(self, rec, bit: int) -> None:
        """The record now has a copy in the tier of `bit` (no-op for a record not indexed)."""
        if (slot := rec.slot) >= 0:
            self._tiers[slot] |= bit
            self.changes += 1
            self._changed[slot] = self.changes

    def leave(self, rec, bit: int) -> None:
        if (slot := rec.slot) >= 0:
            self._tiers[slot] &= ~bit & 0xFF
            self.changes += 1
            self._changed[slot] = self.changes

    def reply(self, now: float) -> bytes:
        """The INVENTORY reply: every live object whose TTL has not run out by `now`, in slot order."""
        return b"".join(self.reply_parts(now))

    def reply_parts(self, now: float) -> list:
        """reply() as the buffers it joins (inventory.encode_parts)."""
        kept, expired = self._unexpired(now)
        return self._parts(kept, now, every_key=not expired)

    def changes_parts(self, now: float, since: int) -> list:
        """The INVENTORY_CHANGES reply (inventory.encode_changes): every slot changed after change number
        `since`, the live ones (TTL not run out by `now`) as INVENTORY entries with their slots, the rest as
        slots gone; `since` 0 gives every live object."""
        changed = np.frombuffer(self._changed, dtype=np.uint64) > np.uint64(since)
        unexpired, expired = self._unexpired(now)
        kept = changed & unexpired
        slots = np.flatnonzero(kept).astype(np.uint32)
        gone = np.flatnonzero(changed & ~kept).astype(np.uint32)
        every_key = since == 0 and not expired
        return encode_changes(self.series, self.changes, slots, gone, self._parts(kept, now, every_key))

    def _unexpired(self, now: float) -> tuple[np.ndarray, bool]:
        """A mask of the slots holding a live record whose TTL has not run out by `now`, and whether any
        live one's has."""
        live = np.frombuffer(self._live, dtype=np.bool_)
        expires = np.frombuffer(self._expires, dtype=np.float64)
        expired = live & (expires > 0) & (expires <= now)
        if expired.any():
            return live & ~expired, True
        return live.copy(), False  # a copy: no view of the growable arrays outlives the call

    def _parts(self, live: np.ndarray, now: float, every_key: bool) -> list:
        """The INVENTORY reply of the slots in the mask `live`, in slot order. `every_key`: it holds every
        live slot (a free slot's key is b"", so all keys are joined as they are)."""
        count = int(np.count_nonzero(live))
        if every_key:
            keys = b"".join(self._keys)
        elif count * 8 > len(self._keys):  # most slots: one pass over them all
            keys = b"".join(compress(self._keys, live.tolist()))
        else:
            all_keys = self._keys
            keys = b"".join([all_keys[slot] for slot in np.flatnonzero(live).tolist()])
        records = np.zeros(count, dtype=RECORD_DTYPE)
        for (name, _code), column in zip(_FIXED, (self._generation, self._size, self._checksum, self._raw_size,
                                                  self._flags)):
            records[name] = np.frombuffer(column, dtype=RECORD_DTYPE[name])[live]
        records["key_length"] = np.frombuffer(self._key_length, dtype=np.uint16)[live]
        records["tiers"] = np.frombuffer(self._tiers, dtype=np.uint8)[live]
        left = np.frombuffer(self._expires, dtype=np.float64)[live]
        # Remaining lifetime in ms, at least 1 while alive; 0 = no ttl (as ObjectRecord.ttl_ms).
        records["ttl_ms"] = np.where(left > 0, np.maximum(1, ((left - now) * 1000).astype(np.int64)), 0)
        return encode_parts(records, keys)
