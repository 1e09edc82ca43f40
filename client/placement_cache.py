"""Where recently used objects live, so a repeated get needs no master round trip.

Entries can go stale (another client overwrote or removed the key, a node
restarted); storage nodes check (key, generation) on every read, so a stale
entry costs one failed read and a fresh lookup, never wrong bytes.
"""

from collections import OrderedDict

from kvpool.proto import kvpool_pb2 as pb

DEFAULT_CAPACITY = 65536
_parse = pb.ObjectInfo.FromString


class PlacementCache:
    """Bounded LRU map of key -> ObjectInfo. Capacity 0 disables caching.

    Entries are kept serialized: tens of thousands of live message objects made every full
    garbage collection of the client's process walk them all (a tenth of a busy client's time);
    bytes are not tracked by the collector. Each get parses its own copy."""

    def __init__(self, capacity: int = DEFAULT_CAPACITY):
        if capacity < 0:
            raise ValueError(f"capacity must not be negative: {capacity}")
        self.capacity = capacity
        self._entries: OrderedDict = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: str) -> bool:
        return key in self._entries

    def get(self, key: str):
        """The cached info (now most recently used), or None."""
        entry = self._entries.get(key)
        if entry is None:
            return None
        self._entries.move_to_end(key)
        if type(entry) is bytes:
            return _parse(entry)
        placement, generation, size, checksum, compressed, raw_size = entry
        info = _parse(placement)
        info.key, info.generation, info.size, info.checksum = key, generation, size, checksum
        info.compressed, info.raw_size = compressed, raw_size
        return info

    def put_placed(self, key: str, placement: bytes, generation: int, size: int, checksum: int,
                   compressed: bool, raw_size: int) -> None:
        """put() of a version given as its placement (a serialized ObjectInfo holding replicas, which
        many keys share) and its own fields: no message is made per key (a batch put's keys)."""
        if not self.capacity:
            return
        entries = self._entries
        entries[key] = (placement, generation, size, checksum, compressed, raw_size)
        entries.move_to_end(key)
        if len(entries) > self.capacity:
            entries.popitem(last=False)

    def put(self, key: str, info) -> None:
        if not self.capacity:
            return
        entries = self._entries
        entries[key] = info.SerializeToString()
        entries.move_to_end(key)
        if len(entries) > self.capacity:
            entries.popitem(last=False)

    def invalidate(self, key: str) -> None:
        self._entries.pop(key, None)

    def invalidate_prefix(self, prefix: str) -> int:
        """Drop every key starting with `prefix`; returns how many were dropped."""
        doomed = [key for key in self._entries if key.startswith(prefix)]
        for key in doomed:
            del self._entries[key]
        return len(doomed)

    def clear(self) -> None:
        self._entries.clear()
