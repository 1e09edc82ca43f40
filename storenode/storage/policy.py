"""Which objects a tier gives up first, and when: pure functions of the records and the clock.

A record here is anything with the attributes of index.ObjectRecord that these
functions read (size, expires_at, hard_pin, hold_until, soft_pin_until,
refcount), so the rules are unit-tested without a node; the order among them
(coldest first) is kept by eviction_order.py.
Times are unix seconds (time.time()): expiry is stored on disk as wall-clock time.
"""

from heapq import merge
from itertools import islice

LRU = "lru"
LFU = "lfu"
POLICIES = (LRU, LFU)

_EXPIRED, _UNPINNED, _SOFT_PINNED = 0, 1, 2


def watermark(used: int, capacity: int, high: float, low: float) -> str:
    """"high" above the high watermark, "low" at or below the low one, else "normal"."""
    if capacity <= 0:
        return "low"
    if used > high * capacity:
        return "high"
    return "low" if used <= low * capacity else "normal"


def excess(used: int, capacity: int, high: float, low: float) -> int:
    """Bytes a tier should release now: down to the low watermark once above the high one, else 0."""
    if capacity <= 0 or used <= high * capacity:
        return 0
    return used - int(low * capacity)


def expired(rec, now: float) -> bool:
    return 0 < rec.expires_at <= now


def victim_class(rec, now: float) -> int | None:
    """Rank group of a record (lower goes first), or None if it must stay.

    An expired object is dead whatever its pins or holds (it is never served
    again); a busy one (a transfer holds it) waits for the next sweep.
    """
    if rec.refcount:
        return None
    if expired(rec, now):
        return _EXPIRED
    if rec.hard_pin or rec.hold_until > now:
        return None
    return _SOFT_PINNED if rec.soft_pin_until > now else _UNPINNED


def in_order(ordered, now: float):
    """Evictable records of `ordered` (a tier's records, coldest first): unpinned and expired ones in
    that order, then the soft-pinned ones in that order. Lazy and one pass, so taking a few victims
    costs a few steps plus the protected records passed over on the way."""
    soft = []
    for rec in ordered:
        group = victim_class(rec, now)
        if group == _SOFT_PINNED:
            soft.append(rec)
        elif group is not None:
            yield rec
    yield from soft


def victims(ordered, now: float, limit: int | None = None) -> list:
    """Up to `limit` evictable records in the order to give them up, from records given coldest first
    (LRU or LFU order, storenode/storage/eviction_order.py): unpinned ones coldest first, then soft-pinned ones
    coldest first. Hard-pinned, held and busy ones are left out.

    Soft-pinned ones come only after every unpinned one, so callers that stop once
    they have freed enough touch soft pins only when nothing unpinned is left. An
    expired object is a victim whatever its pins; the node drops those its expiry
    queue names before it evicts anything, so here they just rank as unpinned.
    The result is a list: act on it only after this returns (the order changes then).
    """
    return list(islice(in_order(ordered, now), limit))


def pick(ordered, need: int, now: float, size=lambda rec: rec.size, limit: int | None = None) -> list:
    """The first victims whose sizes add up to at least `need` bytes (all of them, or `limit`, if they don't)."""
    return take(in_order(ordered, now), need, size, limit)


def within(ordered, now: float, budget: int):
    """in_order's records of `ordered` while their sizes add up to at most `budget` bytes: it stops at the
    first that would pass it, so a tenant near its reserve costs a step, not a walk of its objects."""
    for rec in in_order(ordered, now):
        budget -= rec.size
        if budget < 0:
            return
        yield rec


def coldest_of(streams: list, now: float, coldness):
    """The records of several streams (each in_order's or within's, coldest first) merged coldest first by
    `coldness(rec)` (eviction_order.coldness): unpinned ones of every stream, then soft-pinned ones. Lazy:
    a few victims cost a few steps per stream."""
    if len(streams) == 1:
        return streams[0]

    def rank(rec):
        return (_SOFT_PINNED if rec.soft_pin_until > now and not expired(rec, now) else _UNPINNED,
                coldness(rec))

    return merge(*streams, key=rank)


def take(candidates, need: int, size, limit: int | None) -> list:
    """The first of `candidates` whose sizes add up to at least `need` (all of them, or `limit`, if they don't)."""
    chosen, freed = [], 0
    if need <= 0:
        return chosen
    for rec in candidates:
        chosen.append(rec)
        freed += size(rec)
        if freed >= need or len(chosen) == limit:
            break
    return chosen


def count_hit_for_promotion(rec, now: float, window: float, after: int) -> bool:
    """Count a read served from SSD; True when it is the `after`-th within `window` seconds.

    The window restarts at the first hit after it lapses, so steady but rare
    reads never promote and a burst does.
    """
    if now - rec.window_start > window:
        rec.window_start, rec.window_hits = now, 0
    rec.window_hits += 1
    return rec.window_hits >= after


def hard_pin_fits(pinned_bytes: int, size: int, quota: int) -> bool:
    return pinned_bytes + size <= quota
