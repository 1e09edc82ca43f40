"""The records of one tier kept coldest first, updated on each access, so choosing victims costs
O(victims) rather than ranking the tier.

LRU is a linked ordered dict: an access moves the record to the end. LFU keeps one such
dict per hit count (coldest count first, least recent first within it), which is the
(hits, last_access) order without ever sorting the records. A record joins a tier as its
most recent member: an object demoted to SSD ranks there by when it came down, as in a
victim cache, and one promoted or written was just used.
"""

from bisect import insort
from collections import OrderedDict

from kvpool.storenode.storage import policy

_ABSENT = object()


class LruOrder:
    def __init__(self):
        self._order: OrderedDict = OrderedDict()

    def __len__(self) -> int:
        return len(self._order)

    def __contains__(self, rec) -> bool:
        return rec in self._order

    def __iter__(self):
        """Coldest first. The order must not change while this runs (take a slice, then act)."""
        return iter(self._order)

    def add(self, rec) -> None:
        self._order[rec] = None
        self._order.move_to_end(rec)

    def discard(self, rec) -> bool:
        """Forget `rec`; whether it was a member."""
        return self._order.pop(rec, _ABSENT) is not _ABSENT

    def touch(self, rec) -> None:
        """`rec` was just read: it becomes the most recent."""
        if rec in self._order:
            self._order.move_to_end(rec)


class LfuOrder:
    def __init__(self):
        self._buckets: dict[int, OrderedDict] = {}  # hit count -> records, least recent first
        self._counts: list[int] = []  # the keys of _buckets, ascending
        self._count_of: dict = {}  # record -> the bucket it is in

    def __len__(self) -> int:
        return len(self._count_of)

    def __contains__(self, rec) -> bool:
        return rec in self._count_of

    def __iter__(self):
        """Fewest hits first, least recent first among equals. Not to be changed while this runs."""
        for count in self._counts:
            yield from self._buckets[count]

    def add(self, rec) -> None:
        self.discard(rec)
        self._put(rec, rec.hits)

    def discard(self, rec) -> bool:
        """Forget `rec`; whether it was a member."""
        count = self._count_of.pop(rec, None)
        if count is None:
            return False
        bucket = self._buckets[count]
        del bucket[rec]
        if not bucket:
            del self._buckets[count]
            self._counts.remove(count)  # few distinct counts: a short list
        return True

    def touch(self, rec) -> None:
        """`rec` was just read (its hits already counted): it moves to its new count, as the most recent."""
        if rec in self._count_of:
            self.discard(rec)
            self._put(rec, rec.hits)

    def _put(self, rec, count: int) -> None:
        bucket = self._buckets.get(count)
        if bucket is None:
            bucket = self._buckets[count] = OrderedDict()
            insort(self._counts, count)
        bucket[rec] = None
        self._count_of[rec] = count


def _recency(rec) -> float:
    return rec.last_access


def _frequency(rec) -> tuple:
    return rec.hits, rec.last_access


def coldness(mode: str):
    """A record's place in the order `mode` keeps, as a value comparable across orders (policy.coldest_of):
    the last use (LRU), or the hit count, then the last use (LFU). An order's own sequence is exact; this
    stamp ranks the heads of several orders against each other."""
    return _frequency if mode == policy.LFU else _recency


def new_order(mode: str):
    return LfuOrder() if mode == policy.LFU else LruOrder()
