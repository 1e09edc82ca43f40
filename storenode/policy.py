"""Which objects a tier gives up first, and when: pure functions of the records and the clock.

A record here is anything with the attributes of index.ObjectRecord that these
functions read (size, expires_at, hard_pin, hold_until, soft_pin_until,
last_access, hits, refcount), so the rules are unit-tested without a node.
Times are unix seconds (time.time()): expiry is stored on disk as wall-clock time.
"""

import random

LRU = "lru"
LFU = "lfu"
POLICIES = (LRU, LFU)

# Ranking every record of a big tier on each sweep would cost more than the
# eviction itself: above this many, rank a random sample (approximate LRU/LFU).
SAMPLE = 4096

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


def _coldness(rec, mode: str):
    if mode == LFU:
        return (rec.hits, rec.last_access)
    return (rec.last_access,)


def victims(records, now: float, mode: str = LRU, rng: random.Random | None = None) -> list:
    """Evictable records in the order to give them up: expired (soonest first), then
    unpinned coldest first, then soft-pinned coldest first. Pinned-hard and held ones are left out.

    Soft-pinned ones come only after every unpinned one, so callers that stop once
    they have freed enough touch soft pins only when nothing unpinned is left.
    """
    pool = records if isinstance(records, list) else list(records)
    if len(pool) > SAMPLE:
        pool = (rng or random).sample(pool, SAMPLE)
    ranked = []
    for rec in pool:
        group = victim_class(rec, now)
        if group is not None:
            key = (rec.expires_at,) if group == _EXPIRED else _coldness(rec, mode)
            ranked.append(((group, *key), id(rec), rec))
    ranked.sort(key=lambda item: item[:2])
    return [rec for _, _, rec in ranked]


def pick(records, need: int, now: float, mode: str = LRU, size=lambda rec: rec.size) -> list:
    """The first victims whose sizes add up to at least `need` bytes (all of them if they don't)."""
    chosen, freed = [], 0
    for rec in victims(records, now, mode):
        if freed >= need:
            break
        chosen.append(rec)
        freed += size(rec)
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
