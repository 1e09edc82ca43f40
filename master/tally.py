"""Bytes a node's last REPORT cannot show yet, kept with running totals per tier.

Every PutStart asks each candidate node how much it has free in each tier, and
that subtracts these bytes; summing them entry by entry made a put's cost grow
with the puts since the node's last REPORT (thousands at a high put rate).
"""

import collections


class PendingBytes(dict):
    """generation -> (tier, bytes) of puts placed on a node and not ended yet."""

    def __init__(self):
        super().__init__()
        self.by_tier: collections.Counter = collections.Counter()

    def __setitem__(self, generation: int, entry: tuple[str, int]) -> None:
        old = dict.get(self, generation)
        if old is not None:
            self.by_tier[old[0]] -= old[1]
        dict.__setitem__(self, generation, entry)
        self.by_tier[entry[0]] += entry[1]

    def __delitem__(self, generation: int) -> None:
        self.pop(generation)

    def pop(self, generation: int, *default):
        if generation not in self:
            if default:
                return default[0]
            raise KeyError(generation)
        tier, size = entry = dict.pop(self, generation)
        self.by_tier[tier] -= size
        return entry


class Unreported(collections.deque):
    """(table sequence, tier, bytes) of copies committed on a node since the REPORT it last
    answered, in sequence order."""

    def __init__(self):
        super().__init__()
        self.bytes_by_tier: collections.Counter = collections.Counter()
        self.count_by_tier: collections.Counter = collections.Counter()

    def append(self, entry: tuple[int, str, int]) -> None:
        super().append(entry)
        self.bytes_by_tier[entry[1]] += entry[2]
        self.count_by_tier[entry[1]] += 1

    def drop_through(self, mark: int) -> None:
        """Forget the commits up to sequence `mark`: a REPORT asked for at `mark` shows them."""
        while self and self[0][0] <= mark:
            _, tier, size = self.popleft()
            self.bytes_by_tier[tier] -= size
            self.count_by_tier[tier] -= 1
