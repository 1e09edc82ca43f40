"""A dict that remembers which keys changed, so whoever follows the object table learns of every change.

The object table keeps its committed versions in one of these: whatever code
path commits, removes or re-places an object (now or added later) marks its key
without having to remember to call a hook. For each key it also keeps whether
the key was present before its first change since the last take, so a follower
can tell a key that appeared or vanished from one that was only replaced. It keeps its keys in
order too (key_order.py), for listing them a page at a time, by the same writes.
"""

from kvpool.master.table.key_order import KeyOrder


class ChangeTrackingDict(dict):
    """dict whose every write or delete marks the key as changed (until take_appeared_and_gone())."""

    def __init__(self):
        super().__init__()
        self._changed: dict = {}  # key -> whether it was present before its first change since the last take
        self.tracking = True  # off while nobody follows the changes
        self.order = KeyOrder()  # the keys, in order

    def _note(self, key) -> None:
        # Called before the write: the first change since the last take records the old presence.
        if self.tracking and key not in self._changed:
            self._changed[key] = key in self

    def __setitem__(self, key, value):
        if self.tracking and key not in self._changed:  # _note, inlined: every commit comes here
            self._changed[key] = key in self
        if key not in self:
            self.order.add(key)
        dict.__setitem__(self, key, value)

    def __delitem__(self, key):
        if self.tracking and key not in self._changed:  # _note, inlined: every eviction comes here
            self._changed[key] = key in self
        dict.__delitem__(self, key)
        self.order.discard(key)

    _missing = object()

    def pop(self, key, default=_missing):
        if key in self:
            self._note(key)
            self.order.discard(key)
            return super().pop(key)
        if default is ChangeTrackingDict._missing:
            raise KeyError(key)
        return default

    def popitem(self):
        if not self:
            raise KeyError("popitem(): dictionary is empty")
        key = next(reversed(self.keys()))  # popitem's own choice (LIFO), noted before it goes
        self._note(key)
        self.order.discard(key)
        return key, super().pop(key)

    def setdefault(self, key, default=None):
        if key not in self:
            self[key] = default
        return self[key]

    def update(self, *args, **kwargs):
        for key, value in dict(*args, **kwargs).items():
            self[key] = value

    def clear(self):
        for key in self:
            self._note(key)
        super().clear()
        self.order.clear()

    def add_new(self, keys: list, values: list) -> None:
        """self[k] = v for keys none of which is here, at the speed of dict.update."""
        if self.tracking:
            self._changed.update(dict.fromkeys([k for k in keys if k not in self._changed], False))
        super().update(zip(keys, values))
        self.order.add_many(keys)

    def set_many(self, keys: list, values: list) -> list:
        """self[k] = v for each pair (the keys distinct), at the speed of dict.update; returns the
        values they replaced (None for a key that was not here)."""
        get = self.get
        replaced = [get(k) for k in keys]
        if self.tracking:
            changed = self._changed
            for key in keys:
                if key not in changed:
                    changed[key] = key in self
        dict.update(self, zip(keys, values))
        add = self.order.add
        for key, old in zip(keys, replaced):
            if old is None:
                add(key)
        return replaced

    @property
    def has_changes(self) -> bool:
        return bool(self._changed)

    def take_appeared_and_gone(self) -> tuple[list, list]:
        """Keys present now that were absent before their first change since the last take, and keys
        absent now that were present then; a key replaced (or gone and back) is in neither."""
        appeared, gone = [], []
        for key, was_present in self._changed.items():
            if key in self:
                if not was_present:
                    appeared.append(key)
            elif was_present:
                gone.append(key)
        self._changed = {}
        return appeared, gone
