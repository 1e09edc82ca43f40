"""Each tenant within its share of this node's limits, and its reserve kept from other tenants' pressure.

Quota: a write of a tenant with a quota (tenant_usage.TenantUsage.limited) is admitted only once its bytes
in the write's tier, its bytes in all tiers and its object count, counting its writes still in flight,
leave room for it; else its own coldest objects go first (expired ones already gone, then its tier's
order, soft-pinned last; never hard-pinned, held or busy ones). They are planned before anything goes: if
they cannot make room, QuotaExceededError and nothing changed. A write at a full DRAM share goes to SSD
if the SSD share has room, and the sweep demotes the tenant's coldest (maintenance.py). A demotion keeps
the SSD quota as a write does (or drops the object), a promotion never takes a tenant past its DRAM
quota, and the sweep brings a tenant whose share was lowered back within it.

Reserve: under pool pressure (store.make_room, the sweep), an object of a tenant other than the writer
goes only while its tenant keeps at least its reserve after it. Protected tenants' orders are not walked
at all, and an over-reserve tenant's order only until its budget is spent (policy.within), so choosing a
victim costs a few steps per tenant, whatever the protected tenants hold.
"""

from itertools import islice

from kvpool.errors import QuotaExceededError

from kvpool.storenode.storage import policy
from kvpool.storenode.storage.tenant_usage import TenantUsage

QUOTA = "quota"  # the eviction reason: counted as the tenant's evicted_quota
_TIER_LIMIT = ("quota_dram", "quota_ssd")


def tier_limit(usage: TenantUsage, number: int) -> int:
    return getattr(usage.share, _TIER_LIMIT[number]) if usage.share is not None else 0


def tier_has_room(usage: TenantUsage, tier, size: int) -> bool:
    """Whether `size` more bytes in `tier` keep the tenant within its share of that tier."""
    limit = tier_limit(usage, tier.number)
    n = tier.number
    return not limit or usage.tier_bytes[n] + usage.pending_tier[n] + size <= limit


def protected(usage: TenantUsage, size: int) -> bool:
    """Whether evicting `size` bytes of the tenant's would leave it below its reserve."""
    return usage.reserve > 0 and usage.bytes - size < usage.reserve


def _plan(store, usage: TenantUsage, tier, size: int, whole_object: bool):
    """The tenant's own objects to give up so that `size` more bytes fit its share of `tier` (None: no
    tier) and, if `whole_object` (a new object), its total and object quotas: ({record: evicted whole,
    else only its copy in `tier` goes}, None), or (what it could pick, (limit name, limit, held)) if those
    cannot make room."""
    share, now = usage.share, store.clock()
    chosen = {}
    if tier is not None and (limit := tier_limit(usage, tier.number)):
        n = tier.number
        need_tier = usage.tier_bytes[n] + usage.pending_tier[n] + size - limit
    else:
        n, need_tier = None, 0
    need_total = need_objects = 0
    if whole_object or tier is None:
        if share.quota:
            need_total = usage.bytes + usage.pending_bytes + (size if whole_object else 0) - share.quota
        if share.quota_objects:
            need_objects = usage.objects + usage.pending_objects + whole_object - share.quota_objects
    if need_tier > 0:
        for rec in policy.in_order(usage.orders[n], now):
            whole = need_total > 0 or need_objects > 0 or (rec.ssd if n == 0 else rec.dram) is None
            chosen[rec] = whole
            need_tier -= rec.size
            if whole:
                need_total, need_objects = need_total - rec.size, need_objects - 1
            if need_tier <= 0:
                break
    if need_total > 0 or need_objects > 0:
        streams = [policy.in_order(order, now) for order in reversed(usage.orders) if order]
        for rec in policy.coldest_of(streams, now, store.coldness):
            if chosen.get(rec):  # in both tiers' orders, or picked whole already
                continue
            chosen[rec] = True
            need_total, need_objects = need_total - rec.size, need_objects - 1
            if need_total <= 0 and need_objects <= 0:
                break
    if need_tier > 0:
        return chosen, (f"{_TIER_LIMIT[n]}", limit, usage.tier_bytes[n] + usage.pending_tier[n])
    if need_total > 0:
        return chosen, ("quota", share.quota, usage.bytes + usage.pending_bytes)
    if need_objects > 0:
        return chosen, ("quota_objects", share.quota_objects, usage.objects + usage.pending_objects)
    return chosen, None


def _give_up(store, tier, chosen: dict) -> None:
    for rec, whole in chosen.items():
        if not rec.live:
            continue
        if whole:
            store.evict(rec, QUOTA)
        else:
            store.drop_copy(rec, tier)


def dram_excess(usage: TenantUsage, dram) -> int:
    """Bytes of the tenant's DRAM copies to demote now: down to the tier's low watermark of its DRAM share
    once above the high one (as the tier itself, policy.excess), so its next writes land in DRAM again."""
    limit = tier_limit(usage, 0)
    return policy.excess(usage.tier_bytes[0] + usage.pending_tier[0], limit, dram.high, dram.low) if limit else 0


def own_victims(store, usage: TenantUsage, tier, need: int, limit: int) -> list:
    """The tenant's own coldest objects in `tier` whose bytes add up to `need` (at most `limit`)."""
    return policy.pick(usage.orders[tier.number], need, store.clock(), _size, limit)


def _size(rec) -> int:
    return rec.size


def admit(store, usage: TenantUsage, order: list, size: int) -> list:
    """The tiers of `order` a new object of `size` bytes of a tenant with a quota may take, after giving
    up the tenant's own coldest objects as its quota needs; QuotaExceededError (nothing given up) if
    they cannot make room. The first tier of `order` whose quota has room is the one to make room in
    (a write spills to SSD rather than evict at a full DRAM quota), else the first of `order`."""
    store.expire_due()  # what ran out of time goes before anything else
    roomy = [tier for tier in order if tier_has_room(usage, tier, size)]
    tier = roomy[0] if roomy else order[0]
    if tier is not order[0] and tier is store.ssd:
        store.on_pressure()  # spilled past a full DRAM share: the sweep demotes the tenant's coldest
    chosen, unmet = _plan(store, usage, tier, size, True)
    if unmet is not None:
        name, limit, held = unmet
        unit = "objects" if name == "quota_objects" else "bytes"
        asked = 1 if name == "quota_objects" else size
        if asked > limit:
            raise QuotaExceededError(f"a {size}-byte object of tenant {usage.name!r} is larger than its "
                                     f"{name} of {limit} bytes on this node")
        raise QuotaExceededError(
            f"tenant {usage.name!r} is at its {name} of {limit} {unit} on this node ({held} held, "
            f"{asked} more asked) and none of its own objects may be evicted (pinned, held or being read)")
    _give_up(store, tier, chosen)
    return roomy or [tier]


def make_tier_room(store, usage: TenantUsage, tier, size: int) -> bool:
    """Make room for an existing object's `size` bytes moving into `tier` (a demotion) within the tenant's
    share of it, by its own coldest objects there; False (nothing given up) if they cannot."""
    if tier_has_room(usage, tier, size):
        return True
    chosen, unmet = _plan(store, usage, tier, size, False)
    if unmet is not None:
        return False
    _give_up(store, tier, chosen)
    return True


def enforce(store) -> int:
    """Bring every tenant over its share (e.g. just lowered) back within it, as far as its own objects may
    go (the sweep); the objects given up."""
    given_up = 0
    for usage in store.tenants.limited():
        for tier in store.tiers:
            if not tier_has_room(usage, tier, 0):
                chosen, _ = _plan(store, usage, tier, 0, False)
                _give_up(store, tier, chosen)
                given_up += len(chosen)
        chosen, _ = _plan(store, usage, None, 0, False)
        _give_up(store, None, chosen)
        given_up += len(chosen)
    return given_up


def pressure_victims(store, tier, need: int | None, limit: int, writer: TenantUsage | None,
                     protect: bool = True) -> list:
    """Up to `limit` records of `tier` to give up under pool pressure, coldest first across tenants (all
    of them if `need` is None, else the first whose extents add up to `need`). With `protect` (the
    victims are evicted, not demoted), a tenant other than `writer` gives up objects only while it keeps
    its reserve after them."""
    n, now = tier.number, store.clock()
    if not store.tenants.named():  # a node without tenants: the tier's order alone, as it always was
        if need is None:
            return policy.victims(tier.members, now, limit)
        return policy.pick(tier.members, need, now, tier.extent_length, limit)
    streams = []
    for usage in store.tenants.usages():
        order = usage.orders[n]
        if not order:
            continue
        if protect and usage.reserve and usage is not writer:
            budget = usage.bytes - usage.reserve
            if budget > 0:
                streams.append(policy.within(order, now, budget))
        else:
            streams.append(policy.in_order(order, now))
    if not streams:
        return []
    candidates = policy.coldest_of(streams, now, store.coldness)
    if need is None:
        return list(islice(candidates, limit))
    return policy.take(candidates, need, tier.extent_length, limit)


class SpareVictims:
    """What is left of the last batch of pressure victims of each tier (store.make_room), for the next
    writes: merging the heads of every tenant's order costs a step per tenant, so a batch serves the
    writes that follow while its records still may go as they would have been chosen. A record is taken
    again only if it is still in the tier, still a victim, untouched since (its coldness stamp unchanged:
    nothing newer is colder), and, unless it is the writer's, its tenant keeps its reserve after it.
    A batch holds at most ROOM_BATCH records, so what it left out (the next writer's own objects, a tenant
    grown past its reserve since) waits at most that many victims."""

    def __init__(self):
        self._left: dict[int, list] = {}  # tier number -> [(record, coldness stamp)]

    def take(self, store, tier, writer: TenantUsage | None, limit: int) -> list:
        n, now, coldness = tier.number, store.clock(), store.coldness
        kept = [(rec, stamp) for rec, stamp in self._left.get(n, ())
                if rec.live and (rec.dram, rec.ssd)[n] is not None and coldness(rec) == stamp
                and policy.victim_class(rec, now) is not None
                and (rec.tenant is writer or not protected(rec.tenant, rec.size))]
        if not kept:
            kept = [(rec, coldness(rec)) for rec in pressure_victims(store, tier, None, limit, writer)]
        self._left[n] = kept
        return [rec for rec, _ in kept]
