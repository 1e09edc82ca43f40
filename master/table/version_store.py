"""The committed versions, one small bytes record per key: a leader holds millions of objects.

An ObjectVersion as a Python object costs ~400 bytes with its ints and tuple, and
the cyclic GC walks every one of them. Here each version is one bytes value
(generation, checksum, size, which replica set, target copies; the rarely set
fields only when set) in a dict keyed by the key: ~65 bytes beside the key, and
nothing for the GC to traverse. Replica sets repeat across objects (and only
the leader makes them), so each distinct one is stored once and named by its
index; a put's options are kept in its record, as a client may send any. Reads
unpack a fresh ObjectVersion; callers replace a version by assigning a new one.

Keys with a ttl are also kept in a side dict, so expiry sweeps look at those only.
"""

import functools
import math
import struct
from collections.abc import Iterator

import numpy as np

from kvpool.master.table.change_tracking import ChangeTrackingDict
from kvpool.master.table.key_order import KeyOrder
from kvpool.master.table.versions import NO_OPTIONS, PINS, ObjectVersion, PutOptions, Replica

# generation, checksum, size, replica set, target copies (min(target, 255)), has the extra block
_CORE = struct.Struct("<QQQIBB")
# tier, pin, pin_ttl_seconds, ttl_seconds (the put's options, kept whole: a table of the distinct ones would grow
# with every value a client thinks of), compressed, raw size, expires_at (NaN = never)
_EXTRA = struct.Struct("<BBddBQd")
_TIER_CODES = {None: 0, "dram": 1, "ssd": 2, "shared": 3}
_TIER_NAMES = {code: name for name, code in _TIER_CODES.items()}
_PIN_CODES = {name: code for code, name in enumerate(PINS)}
# The same options read back as one shared value while they are the few in use (a batch's puts share one).
_options_of = functools.lru_cache(maxsize=1024)(PutOptions)
_SIZE_AT, _REPLICAS_AT = 16, 24  # where _CORE keeps the size and the replica set
_SIZE, _REPLICAS = struct.Struct("<Q"), struct.Struct("<I")
_CORE_DTYPE = np.dtype([("generation", "<u8"), ("checksum", "<u8"), ("size", "<u8"), ("replicas", "<u4"),
                        ("target", "u1"), ("extra", "u1")])
assert _CORE_DTYPE.itemsize == _CORE.size
_pack_core, _unpack_core = _CORE.pack, _CORE.unpack_from
_new_version = tuple.__new__


class _Interned:
    """Each distinct value once, named by its index in the list."""

    def __init__(self):
        self.values: list = []
        self._ids: dict = {}

        self._last, self._last_index = None, 0  # the value asked for last (puts share one tuple)

    def id_of(self, value) -> int:
        if value is self._last:  # the same object again: no hash of a tuple of tuples
            return self._last_index
        index = self._ids.get(value)
        if index is None:
            index = self._ids[value] = len(self.values)
            self.values.append(value)
        self._last, self._last_index = value, index
        return index


class VersionStore:
    def __init__(self):
        self._records = ChangeTrackingDict()
        self._records.tracking = False
        self._replica_sets = _Interned()
        self._left_of: dict[tuple[int, str], int | None] = {}  # (replica set, node id) -> _set_without
        self.expiring: dict[str, float] = {}  # key -> expires_at, of the versions that have one

    # --- change tracking, passed through to the records
    @property
    def tracking(self) -> bool:
        return self._records.tracking

    @tracking.setter
    def tracking(self, on: bool) -> None:
        self._records.tracking = on

    @property
    def has_changes(self) -> bool:
        return self._records.has_changes

    def take_appeared_and_gone(self) -> tuple[list, list]:
        return self._records.take_appeared_and_gone()

    # --- the mapping
    def _pack(self, v: ObjectVersion) -> bytes:
        _key, size, checksum, generation, replicas, options, compressed, raw_size, expires_at, target = v
        extra = ((options is not NO_OPTIONS and options != NO_OPTIONS) or compressed or raw_size != size
                 or expires_at is not None)
        core = _pack_core(generation, checksum, size, self._replica_sets.id_of(replicas),
                          target if target < 256 else 255, extra)
        if not extra:
            return core
        return core + _EXTRA.pack(_TIER_CODES[options.tier], _PIN_CODES[options.pin], options.pin_ttl_seconds,
                                  options.ttl_seconds, compressed, raw_size,
                                  math.nan if expires_at is None else expires_at)

    def _unpack(self, key: str, record: bytes) -> ObjectVersion:
        generation, checksum, size, replicas, target, extra = _unpack_core(record)
        if not extra:  # built as a plain tuple: ObjectVersion() with keywords costs several times more
            return _new_version(ObjectVersion, (key, size, checksum, generation, self._replica_sets.values[replicas],
                                                NO_OPTIONS, False, size, None, target))
        tier, pin, pin_ttl, ttl, compressed, raw_size, expires_at = _EXTRA.unpack_from(record, _CORE.size)
        options = NO_OPTIONS if not (tier or pin or pin_ttl or ttl) else _options_of(_TIER_NAMES[tier], PINS[pin],
                                                                                     pin_ttl, ttl)
        return ObjectVersion(key, size, checksum, generation, self._replica_sets.values[replicas],
                             options=options, compressed=bool(compressed),
                             raw_size=raw_size, expires_at=None if math.isnan(expires_at) else expires_at,
                             target_replicas=target)

    def add_plain(self, key: str, generation: int, checksum: int, size: int, replicas: tuple[Replica, ...]) -> None:
        """self[key] = a version with one copy per replica, no options, no ttl, uncompressed."""
        self._records[key] = _CORE.pack(generation, checksum, size, self._replica_sets.id_of(replicas),
                                        len(replicas), False)
        if self.expiring:
            self.expiring.pop(key, None)

    def add_plain_many(self, keys: list[str], generations, checksums, sizes, replicas: tuple[Replica, ...]) -> None:
        """add_plain of many keys none of which is here (numpy columns beside `keys`): one array
        packed at once, so a new leader takes in millions of inventory entries quickly."""
        packed = np.zeros(len(keys), dtype=_CORE_DTYPE)
        packed["generation"], packed["checksum"], packed["size"] = generations, checksums, sizes
        packed["replicas"] = self._replica_sets.id_of(replicas)
        packed["target"] = len(replicas)
        blob = packed.tobytes()
        width = _CORE.size
        self._records.add_new(keys, [blob[i:i + width] for i in range(0, len(blob), width)])

    def _set_without(self, replicas: int, node_id: str) -> int | None:
        """The replica set `replicas` less node_id's copy (the same index if it has none; None if
        nothing is left). Sets are never renumbered, so each answer is kept."""
        left = self._left_of.get((replicas, node_id), False)
        if left is False:
            copies = self._replica_sets.values[replicas]
            rest = tuple(r for r in copies if r.node_id != node_id)
            left = replicas if len(rest) == len(copies) else self._replica_sets.id_of(rest) if rest else None
            self._left_of[(replicas, node_id)] = left
        return left

    def generations(self, keys) -> dict[str, int]:
        """The committed generation of each of `keys` held here (without unpacking the versions)."""
        records = self._records
        return {key: _unpack_core(record)[0] for key in keys if (record := records.get(key)) is not None}

    def without_node(self, node_id: str, keys) -> tuple[list[str], list[str], int]:
        """Take node_id's copy off the versions of `keys` without unpacking them (a node lost may
        have held millions): (keys that had no other copy, now gone; keys that keep other copies;
        bytes of the gone ones)."""
        records = self._records
        gone, kept, gone_bytes = [], [], 0
        for key in keys:
            record = records.get(key)
            if record is None:
                continue
            (replicas,) = _REPLICAS.unpack_from(record, _REPLICAS_AT)
            left = self._set_without(replicas, node_id)
            if left is None:
                del self[key]
                gone_bytes += _SIZE.unpack_from(record, _SIZE_AT)[0]
                gone.append(key)
            elif left != replicas:
                records[key] = record[:_REPLICAS_AT] + _REPLICAS.pack(left) + record[_REPLICAS_AT + 4:]
                kept.append(key)
        return gone, kept, gone_bytes

    def without_copies(self, evicted: list[tuple[str, int]], node_id: str) -> list[tuple[bool, int] | None]:
        """Take node_id's copy off each version (key, generation), in order, without unpacking them (every
        eviction a node reports comes here). Per entry: None when that is not the version here; else
        (whether the object is gone, having had no other copy; its size)."""
        records, set_without, outcomes = self._records, self._set_without, []
        for key, generation in evicted:
            record = records.get(key)
            if record is None:
                outcomes.append(None)
                continue
            generation_here, _checksum, size, replicas, _target, _extra = _unpack_core(record)
            if generation_here != generation:
                outcomes.append(None)
                continue
            left = set_without(replicas, node_id)
            if left is None:
                del self[key]
                outcomes.append((True, size))
                continue
            if left != replicas:
                records[key] = record[:_REPLICAS_AT] + _REPLICAS.pack(left) + record[_REPLICAS_AT + 4:]
            outcomes.append((False, size))
        return outcomes

    def get(self, key: str, default=None) -> ObjectVersion | None:
        record = self._records.get(key)
        return default if record is None else self._unpack(key, record)

    def __getitem__(self, key: str) -> ObjectVersion:
        return self._unpack(key, self._records[key])

    def __setitem__(self, key: str, version: ObjectVersion) -> None:
        self._records[key] = self._pack(version)
        if version.expires_at is not None:
            self.expiring[key] = version.expires_at
        elif self.expiring:
            self.expiring.pop(key, None)

    def swap_many(self, keys: list[str], versions: list[ObjectVersion]) -> list[ObjectVersion]:
        """self[key] = version for each pair (the keys distinct); returns the versions they replaced."""
        replaced = self._records.set_many(keys, [self._pack(v) for v in versions])
        expiring = self.expiring
        if expiring:
            for key in keys:
                expiring.pop(key, None)
        expiring.update([(key, v.expires_at) for key, v in zip(keys, versions) if v.expires_at is not None])
        return [self._unpack(key, record) for key, record in zip(keys, replaced) if record is not None]

    def __delitem__(self, key: str) -> None:
        del self._records[key]
        if self.expiring:
            self.expiring.pop(key, None)

    def pop(self, key: str, default=None) -> ObjectVersion | None:
        record = self._records.pop(key, None)
        if record is None:
            return default
        if self.expiring:
            self.expiring.pop(key, None)
        return self._unpack(key, record)

    def keys(self):
        return self._records.keys()

    @property
    def order(self) -> KeyOrder:
        """The keys in order (key_order.py), kept by every write."""
        return self._records.order

    def __contains__(self, key: str) -> bool:
        return key in self._records

    def contains_many(self, keys: list[str]) -> list[bool]:
        records = self._records
        return [key in records for key in keys]

    def __len__(self) -> int:
        return len(self._records)

    def __iter__(self) -> Iterator[str]:
        return iter(self._records)
