"""The committed keys in order, for listing them a page at a time (ListKeys) on the leader's event loop.

A leader holds millions of keys and every put adds one, so keeping them in order must cost a put
little and a page must not read the whole table. The keys are cut into buckets by bounds: bucket i
holds the keys in (bounds[i-1], bounds[i]], as an unsorted set. Adding or dropping a key is a bisect
over the bounds (a few hundred strs for a million keys, compared in C) and a set operation: one to two
microseconds each at a million keys, less than half of what a sorted list of every key costs
(sortedcontainers.SortedList, measured alike). A bucket is sorted only when a page reads it, and that order is kept until the bucket
changes. A bucket past 2 * LOAD keys is cut in two at about its median; one that shrinks below
LOAD / 4 joins its next. (Noting changes to fold in later was measured slower: the fold sorts them.)

Keys are valid UTF-8 strs, so their order as strs (by code point) is their bytes' order.
"""

from bisect import bisect_left, bisect_right
from collections.abc import Callable, Iterator
from itertools import islice

from kvpool.protocol.tenants import SCOPE_MARK, Scope

LOAD = 4096  # keys a bucket holds about: fewer bounds to bisect, and a page still sorts at most two or three


class KeyOrder:
    def __init__(self):
        self._bounds: list[str] = []  # the largest key bucket i may hold; the last bucket takes any larger
        self._buckets: list[set[str]] = []
        self._sorted: list[list[str] | None] = []  # each bucket's keys in order, once a page asked; None: stale

    def __len__(self) -> int:
        return sum(map(len, self._buckets))

    def add(self, key: str) -> None:
        """Add `key` (not held yet)."""
        bounds = self._bounds
        i = bisect_left(bounds, key)
        if i == len(bounds):  # above every bound: the last bucket's bound rises to it
            if not bounds:
                bounds.append(key)
                self._buckets.append({key})
                self._sorted.append(None)
                return
            i -= 1
            bounds[i] = key
        bucket = self._buckets[i]
        bucket.add(key)
        self._sorted[i] = None
        if len(bucket) > 2 * LOAD:
            self._cut(i)

    def add_many(self, keys) -> None:
        """add() of many keys (none held yet; a new leader adopts a slice of an inventory at a time): sorted
        at once, then each bucket takes its run of them in one set operation."""
        ordered = sorted(keys)
        if not ordered:
            return
        bounds, buckets, in_order = self._bounds, self._buckets, self._sorted
        if not bounds:
            parts = _parts(ordered)
            bounds += [part[-1] for part in parts]
            buckets += [set(part) for part in parts]
            in_order += parts
            return
        last, start, count, full = len(bounds) - 1, 0, len(ordered), []
        while start < count:
            i = bisect_left(bounds, ordered[start], 0, last)
            if i == last:  # the last bucket takes the rest, its bound rising to the largest
                end = count
                bounds[i] = max(bounds[i], ordered[-1])
            else:
                end = bisect_right(ordered, bounds[i], start)
            bucket = buckets[i]
            bucket.update(ordered[start:end])
            in_order[i] = None
            if len(bucket) > 2 * LOAD:
                full.append(i)
            start = end
        for i in reversed(full):  # from the last, so the indices before stay true
            self._cut(i)

    def discard(self, key: str) -> None:
        """Drop `key` if held."""
        bounds = self._bounds
        i = bisect_left(bounds, key)
        if i == len(bounds):
            return
        bucket = self._buckets[i]
        bucket.discard(key)
        self._sorted[i] = None
        if len(bucket) < LOAD // 4:
            self._join_next(i)

    def clear(self) -> None:
        self.__init__()

    def _cut(self, i: int) -> None:
        """Cut bucket i in two at about its median key (that of a sample: no sort of the bucket), and each half
        again while it holds more than 2 * LOAD keys."""
        bucket = self._buckets[i]
        sample = sorted(islice(bucket, 0, None, max(1, len(bucket) // 63)))
        middle = sample[len(sample) // 2]  # below the sample's largest: neither half is empty
        low = {key for key in bucket if key <= middle}
        high = bucket - low
        self._bounds.insert(i, middle)
        self._buckets[i:i + 1] = [low, high]
        self._sorted[i:i + 1] = [None, None]
        if len(high) > 2 * LOAD:
            self._cut(i + 1)
        if len(low) > 2 * LOAD:
            self._cut(i)

    def _join_next(self, i: int) -> None:
        """Fold bucket i into bucket i + 1 (which then starts where i did); an empty bucket goes."""
        buckets = self._buckets
        if buckets[i]:
            if i + 1 == len(buckets) or len(buckets[i]) + len(buckets[i + 1]) > LOAD:
                return
            buckets[i + 1] |= buckets[i]
            self._sorted[i + 1] = None
        del self._bounds[i], buckets[i], self._sorted[i]

    def _in_order(self, i: int) -> list[str]:
        ordered = self._sorted[i]
        if ordered is None:
            ordered = self._sorted[i] = sorted(self._buckets[i])
        return ordered

    def after(self, start: str, inclusive: bool = False) -> Iterator[str]:
        """The keys above `start` (and `start` itself if inclusive), in order. Read it whole before
        the order changes again (on the event loop: before the next await)."""
        i = bisect_left(self._bounds, start)
        if i < len(self._bounds):
            ordered = self._in_order(i)
            yield from ordered[(bisect_left if inclusive else bisect_right)(ordered, start):]
            for i in range(i + 1, len(self._bounds)):
                yield from self._in_order(i)


def _parts(ordered: list[str]) -> list[list[str]]:
    """`ordered` cut into runs of LOAD keys, the last of them up to twice that."""
    count = max(1, len(ordered) // LOAD)
    return [ordered[k * LOAD:(k + 1) * LOAD] for k in range(count - 1)] + [ordered[(count - 1) * LOAD:]]


_PAST_SCOPES = chr(ord(SCOPE_MARK) + 1)  # the least key above every tenant's (each begins with SCOPE_MARK)


def page(order: KeyOrder, prefix: str, limit: int, cursor: str, scope: Scope | None,
         hidden: Callable[[str], bool]) -> tuple[list[str], str]:
    """Up to `limit` keys of `order` that begin with `prefix`, lie above `cursor` ("": from the first)
    and are in `scope` (None: every key), in order, leaving out those `hidden` says; and the cursor of
    the next page: the last key given, or "" when no key is left. Reads only the keys it gives, those
    hidden among them and one more."""
    if scope is not None:
        if scope.prefix:  # a tenant's keys all begin with its prefix
            if not prefix.startswith(scope.prefix):
                if not scope.prefix.startswith(prefix):
                    return [], ""
                prefix = scope.prefix
        elif prefix.startswith(SCOPE_MARK):  # the client token's: none of a tenant's
            return [], ""
    skip_tenants = scope is not None and not scope.prefix and not prefix
    keys = order.after(prefix, True) if cursor < prefix else order.after(cursor)
    found: list[str] = []
    while True:
        jumped = False
        for key in keys:
            if not key.startswith(prefix):
                break
            if skip_tenants and key.startswith(SCOPE_MARK):  # the tenants' keys lie together: past them at once
                keys, jumped = order.after(_PAST_SCOPES, True), True
                break
            if hidden(key) or (scope is not None and not scope.holds(key)):
                continue
            if len(found) == limit:
                return found, found[-1]
            found.append(key)
        if not jumped:
            return found, ""
