"""A dict that remembers which keys changed, so the placement record learns of every change.

The object table keeps its committed versions in one of these: whatever code
path commits, removes or re-places an object (now or added later) marks its key
without having to remember to call a hook.
"""


class ChangeTrackingDict(dict):
    """dict whose every write or delete marks the key as changed (until take_changed())."""

    def __init__(self):
        super().__init__()
        self._changed: set = set()
        self.tracking = True  # off while the table is filled from the record it already matches

    def __setitem__(self, key, value):
        super().__setitem__(key, value)
        if self.tracking:
            self._changed.add(key)

    def __delitem__(self, key):
        super().__delitem__(key)
        if self.tracking:
            self._changed.add(key)

    _missing = object()

    def pop(self, key, default=_missing):
        if key in self:
            if self.tracking:
                self._changed.add(key)
            return super().pop(key)
        if default is ChangeTrackingDict._missing:
            raise KeyError(key)
        return default

    def popitem(self):
        key, value = super().popitem()
        if self.tracking:
            self._changed.add(key)
        return key, value

    def setdefault(self, key, default=None):
        if key not in self:
            self[key] = default
        return self[key]

    def update(self, *args, **kwargs):
        for key, value in dict(*args, **kwargs).items():
            self[key] = value

    def clear(self):
        if self.tracking:
            self._changed.update(self.keys())
        super().clear()

    def mark(self, key) -> None:
        self._changed.add(key)

    @property
    def has_changes(self) -> bool:
        return bool(self._changed)

    def take_changed(self, limit: int | None = None) -> list:
        """Keys changed since the last call (at most `limit`; the rest stay marked)."""
        if limit is None or len(self._changed) <= limit:
            keys, self._changed = list(self._changed), set()
            return keys
        keys = [self._changed.pop() for _ in range(limit)]
        return keys
