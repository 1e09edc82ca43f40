"""What each tenant holds on this node and what it was served, kept exact as objects come and go, with the
share of its limits the node keeps (kvpool/protocol/tenants.py NodeShare; quota.py enforces it).

Every record points at its tenant's TenantUsage (`rec.tenant`), found once when it is written or adopted,
so the store keeps the figures with a few additions as a record joins and leaves tiers and the index.
Each tenant keeps its own eviction order per tier, for every tenant rather than only those with a share:
its quota evicts from it, pool pressure merges the heads of the orders of the tenants that may lose
objects (quota.pressure_victims) and never walks a protected tenant's objects, and a share set or changed
later needs no record moved between orders. Keys of no tenant (tenant "") keep the tiers' own orders
(tier.members), so a node without tenants orders and evicts exactly as before.

Bounded: a usage is made for each tenant given a share and for at most MAX_SEEN other names found in
keys; keys of further names (only a member may write a key of any scope) are counted together as OTHER.
"""

from kvpool.errors import InvalidArgumentError
from kvpool.protocol.tenants import MAX_TENANTS, SCOPE_MARK_BYTE, NodeShare, name_problem, tenant_of

from kvpool.storenode.storage import eviction_order

OTHER = "_other"  # the names beyond the bound, together; no tenant is so named (names begin a-z or 0-9)
MAX_SEEN = MAX_TENANTS  # usages made for names that have no share


class TenantUsage:
    """One tenant on this node: its share (None: no limits), its orders per tier and its figures.
    Tier figures are indexed by tier number (0 DRAM, 1 SSD); bytes are the objects' payload bytes."""

    __slots__ = ("name", "share", "limited", "reserve", "orders", "objects", "bytes", "tier_bytes",
                 "pending_tier", "pending_bytes", "pending_objects", "hits", "misses", "evicted_quota",
                 "evicted_pressure", "refused")

    def __init__(self, name: str, orders: list):
        self.name = name
        self.orders = orders  # per tier: its records there, coldest first
        self.set_share(None)
        self.objects = self.bytes = 0  # indexed objects and their bytes, each counted once
        self.tier_bytes = [0, 0]  # bytes of its copies in each tier
        # Reserved for writes of a tenant with a quota, not yet committed: counted against its quota.
        self.pending_tier = [0, 0]
        self.pending_bytes = self.pending_objects = 0
        self.hits = self.misses = self.refused = 0
        self.evicted_quota = self.evicted_pressure = 0

    def set_share(self, share: NodeShare | None) -> None:
        self.share = share
        self.limited = share is not None and any(share[:4])  # a quota of some kind: admission checks it
        self.reserve = share.reserve if share is not None else 0

    def pend(self, number: int, size: int, sign: int) -> None:
        """Count (sign 1) or uncount (-1) a reserved write of `size` bytes in tier `number`."""
        self.pending_tier[number] += sign * size
        self.pending_bytes += sign * size
        self.pending_objects += sign

    def figures(self) -> dict:
        return {"objects": self.objects, "dram_bytes": self.tier_bytes[0], "ssd_bytes": self.tier_bytes[1],
                "hits": self.hits, "misses": self.misses, "evicted_quota": self.evicted_quota,
                "evicted_pressure": self.evicted_pressure, "refused": self.refused}

    def shown(self) -> bool:
        """Whether a report lists it: it holds objects, or (a named tenant) has counted anything."""
        return bool(self.objects or self.name and any(self.figures().values()))


class TenantTable:
    """The usages of the tenants met on this node, by name; `none` is tenant "" (keys of no tenant)."""

    def __init__(self, mode: str, tiers: list):
        self.mode = mode
        self._tier_count = len(tiers)
        self.none = TenantUsage("", [tier.members for tier in tiers] + [None] * (2 - len(tiers)))
        self._by_name: dict[str, TenantUsage] = {}
        self._seen = 0  # usages made for names without a share (bounded by MAX_SEEN)

    def named(self) -> bool:
        """Whether any key of a tenant has been met (or a share set) here."""
        return bool(self._by_name)

    def usages(self):
        yield self.none
        yield from self._by_name.values()

    def of_key(self, key: bytes) -> TenantUsage:
        """The usage of the tenant whose scope holds the stored key `key`."""
        if not key.startswith(SCOPE_MARK_BYTE):
            return self.none
        try:
            name = tenant_of(key)
        except UnicodeDecodeError:  # no tenant has such a name: a member's odd key
            return self._named(OTHER, True)
        if not name:
            return self.none
        usage = self._by_name.get(name)
        return usage if usage is not None else self._named(name, False)

    def _named(self, name: str, always: bool) -> TenantUsage:
        usage = self._by_name.get(name)
        if usage is None:
            if not always and (self._seen >= MAX_SEEN or name_problem(name)):
                return self._named(OTHER, True)
            self._seen += not always
            orders = [eviction_order.new_order(self.mode) for _ in range(self._tier_count)]
            usage = self._by_name[name] = TenantUsage(name, orders + [None] * (2 - len(orders)))
        return usage

    def set_shares(self, shares: dict) -> None:
        """Keep `shares` ({tenant: NodeShare}) from now on; a tenant absent has no limits."""
        if len(shares) > MAX_TENANTS:
            raise InvalidArgumentError(f"{len(shares)} tenants' shares: at most {MAX_TENANTS}")
        checked = {}
        for name, share in shares.items():
            problem = name_problem(name)
            if problem:
                raise InvalidArgumentError(problem)
            share = NodeShare(*share)
            if not all(isinstance(v, int) and v >= 0 for v in share):
                raise InvalidArgumentError(f"tenant {name}: a share is whole numbers >= 0, not {share}")
            checked[name] = share
        for usage in self._by_name.values():
            usage.set_share(None)
        for name, share in checked.items():
            self._named(name, True).set_share(share)
        # A tenant left without a share or anything here is forgotten (e.g. deleted), so names come and go
        # without the table growing; no record or reservation points at such a usage.
        self._by_name = {name: usage for name, usage in self._by_name.items()
                         if usage.share is not None or usage.objects or usage.pending_objects}
        self._seen = sum(usage.share is None for usage in self._by_name.values())

    def limited(self):
        """The usages of tenants with a quota of some kind."""
        return [usage for usage in self._by_name.values() if usage.limited]

    def report(self) -> dict:
        """{tenant: figures} of each tenant with objects or counters here ("" only with objects)."""
        return {usage.name: usage.figures() for usage in self.usages() if usage.shown()}

    def labelled(self) -> dict:
        """Figures by metric label: tenants with a share by name, "" for keys of no tenant, every other
        tenant summed under OTHER. The labels are thus at most MAX_TENANTS + 2, whatever names keys carry."""
        out = {"": self.none.figures()}
        for usage in self._by_name.values():
            label = usage.name if usage.share is not None else OTHER
            figures = usage.figures()
            into = out.get(label)
            if into is None:
                out[label] = figures
            else:
                for field, value in figures.items():
                    into[field] += value
        return out
