"""Where recently used objects live, so a repeated get needs no master round trip.

Entries can go stale (another client overwrote or removed the key, a node
restarted); storage nodes check (key, generation) on every read, so a stale
entry costs one failed read and a fresh lookup, never wrong bytes.
"""

from collections import OrderedDict

DEFAULT_CAPACITY = 65536


class PlacementCache:
    """Bounded LRU map of key -> ObjectInfo. Capacity 0 disables caching."""

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
        info = self._entries.get(key)
        if info is not None:
            self._entries.move_to_end(key)
        return info

    def put(self, key: str, info) -> None:
        if not self.capacity:
            return
        entries = self._entries
        entries[key] = info
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
