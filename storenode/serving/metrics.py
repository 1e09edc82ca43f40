"""Prometheus metrics of one storage node, in their own registry (exported on --metrics-port).

What changes with every request (ops, latency, bytes) is kept in plain numbers and turned into
metric families only when scraped: a prometheus_client Counter or Histogram takes a lock per
update, which cost a tenth of a busy node's time.
"""

from bisect import bisect_left

from prometheus_client import CollectorRegistry, Gauge
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

from kvpool.runtime.process import register_build_info

_LATENCY_BUCKETS = (50e-6, 100e-6, 250e-6, 500e-6, 1e-3, 2.5e-3, 5e-3, 10e-3, 25e-3, 50e-3, 0.1, 0.25, 1.0)

# Per-tier values read from the tiers at scrape time instead of being updated per request.
_TIER_GAUGES = {
    "capacity": ("kvpool_node_capacity_bytes", "Usable bytes of the tier"),
    "used": ("kvpool_node_used_bytes", "Bytes of the tier held by objects"),
    "objects": ("kvpool_node_objects", "Objects with a copy in the tier"),
    "pinned_bytes": ("kvpool_node_pinned_bytes", "Bytes of hard-pinned objects in the tier"),
}
_TIER_COUNTERS = {
    "hits": ("kvpool_node_tier_hits", "READs served from the tier"),
    "misses": ("kvpool_node_tier_misses", "READs the tier could not serve"),
    "demotions": ("kvpool_node_tier_demotions", "Objects moved DRAM -> SSD (counted in both tiers)"),
    "promotions": ("kvpool_node_tier_promotions", "Objects copied SSD -> DRAM (counted in both tiers)"),
    "evictions": ("kvpool_node_tier_evictions", "Objects the node dropped for good from the tier"),
    "evicted_bytes": ("kvpool_node_tier_evicted_bytes", "Bytes of the objects dropped for good"),
}


class _OnScrape:
    """A collector whose metric families are made when scraped (by `families`, a function of no argument)
    and announced to nobody beforehand: their values are read from the node's parts, not kept in metrics."""

    def __init__(self, families):
        self.collect = families

    def describe(self):
        return []


def _tier_families(tiers, shared=None):
    stats = {tier.name: tier.stats() for tier in tiers}
    yield from _families(GaugeMetricFamily, _TIER_GAUGES, "tier", stats)
    yield from _families(CounterMetricFamily, _TIER_COUNTERS, "tier", stats)
    # A disk or mount that fails (kvpool/sharedfs/file_gate.py): 1 while the tier is skipped, and how often.
    health = {name: (1 if row["fault"] else 0, row["faults"]) for name, row in stats.items()}
    if shared is not None:
        health["shared"] = (0 if shared.usable else 1, shared.gate.faults)
    failing = GaugeMetricFamily("kvpool_node_tier_failing", "1 while the tier's disk or mount fails and it is "
                                "skipped (until a probe answers)", labels=["tier"])
    faults = CounterMetricFamily("kvpool_node_tier_faults", "Times the tier's disk or mount was found failing",
                                 labels=["tier"])
    for name, (now, times) in health.items():
        failing.add_metric([name], now)
        faults.add_metric([name], times)
    yield failing
    yield faults


def _families(kind, fields: dict, label: str, rows: dict):
    """A metric family of `kind` per field of `fields` ({field: (name, doc)}), a sample per row of `rows`
    ({label value: {field: value}}) labelled `label`."""
    for field, (name, doc) in fields.items():
        family = kind(name, doc, labels=[label])
        for labelled, values in rows.items():
            family.add_metric([labelled], values[field])
        yield family


_SHARED_COUNTERS = {
    "moved": ("kvpool_node_shared_moved", "Objects this node wrote to the shared tier (its copy then dropped)"),
    "moved_bytes": ("kvpool_node_shared_moved_bytes", "Bytes of those objects"),
    "reads": ("kvpool_node_shared_reads", "READs this node served from the shared tier's files"),
    "read_bytes": ("kvpool_node_shared_read_bytes", "Bytes of those READs"),
    "promotions": ("kvpool_node_shared_promotions", "Shared objects read twice and copied into DRAM"),
    "unlinked": ("kvpool_node_shared_unlinked", "Files this node removed as the leader ordered"),
    "damaged": ("kvpool_node_shared_damaged", "Files that failed their checks when read (never served)"),
    "spilled": ("kvpool_node_shared_spilled", "Files moved from the shared directory on to the bucket beneath it"),
}


def _shared_families(shared):
    figures = shared.report()
    for field, (name, doc) in _SHARED_COUNTERS.items():
        yield CounterMetricFamily(name, doc, value=figures[field])


_TENANT_COUNTERS = {
    "hits": ("kvpool_node_tenant_hits", "READs of the tenant's keys served"),
    "misses": ("kvpool_node_tenant_misses", "READs of the tenant's keys answered NOT_FOUND or STALE"),
    "refused": ("kvpool_node_tenant_refused", "The tenant's writes refused QUOTA_EXCEEDED or NO_SPACE"),
}


def _tenant_families(table):
    """Per-tenant figures (storenode/storage/tenant_usage.py). The tenant label is bounded whatever names keys
    carry: a tenant with a share (at most MAX_TENANTS) by name, "" for keys of no tenant, every other
    name in one "_other" series (TenantTable.labelled)."""
    figures = table.labelled()
    size = GaugeMetricFamily("kvpool_node_tenant_bytes", "Bytes of the tenant's objects in the tier",
                             labels=["tier", "tenant"])
    objects = GaugeMetricFamily("kvpool_node_tenant_objects", "The tenant's objects on the node",
                                labels=["tenant"])
    evictions = CounterMetricFamily("kvpool_node_tenant_evictions",
                                    "The tenant's objects the node evicted, by its own quota or pool pressure",
                                    labels=["tenant", "reason"])
    for tenant, values in figures.items():
        size.add_metric(["dram", tenant], values["dram_bytes"])
        size.add_metric(["ssd", tenant], values["ssd_bytes"])
        objects.add_metric([tenant], values["objects"])
        evictions.add_metric([tenant, "quota"], values["evicted_quota"])
        evictions.add_metric([tenant, "pressure"], values["evicted_pressure"])
    yield size
    yield objects
    yield evictions
    yield from _families(CounterMetricFamily, _TENANT_COUNTERS, "tenant", figures)


class Total:
    """A counter the event loop bumps (one thread: no lock); read at scrape time."""

    __slots__ = ("value",)

    def __init__(self):
        self.value = 0

    def inc(self, amount: int = 1) -> None:
        self.value += amount


class OpStats:
    """Requests of one op: how many, and how long each took, in the latency buckets."""

    __slots__ = ("count", "buckets", "seconds")

    def __init__(self):
        self.count = 0
        self.buckets = [0] * (len(_LATENCY_BUCKETS) + 1)  # the last: above every bound (+Inf)
        self.seconds = 0.0

    def record(self, seconds: float) -> None:
        self.count += 1
        self.buckets[bisect_left(_LATENCY_BUCKETS, seconds)] += 1
        self.seconds += seconds


class _RequestCollector:
    def __init__(self, metrics: "NodeMetrics"):
        self.metrics = metrics

    def describe(self):
        return []  # collected on demand only

    def collect(self):
        m = self.metrics
        ops = CounterMetricFamily("kvpool_node_ops", "Data-protocol requests handled", labels=["op"])
        latency = HistogramMetricFamily("kvpool_node_request_seconds", "Time to handle one request", labels=["op"])
        bounds = [repr(b) for b in _LATENCY_BUCKETS] + ["+Inf"]
        for op, stats in list(m.ops_by_name.items()):
            ops.add_metric([op], stats.count)
            cumulative, running = [], 0
            for bound, n in zip(bounds, list(stats.buckets)):
                running += n
                cumulative.append((bound, running))
            latency.add_metric([op], cumulative, stats.seconds)
        yield ops
        yield latency
        errors = CounterMetricFamily("kvpool_node_errors", "Requests answered with an error status",
                                     labels=["op", "status"])
        for (op, status), total in list(m.errors_by_status.items()):
            errors.add_metric([op, status], total.value)
        yield errors
        yield CounterMetricFamily("kvpool_node_bytes_in", "Payload bytes received by WRITE", value=m.bytes_in.value)
        yield CounterMetricFamily("kvpool_node_bytes_out", "Payload bytes sent by READ", value=m.bytes_out.value)


class NodeMetrics:
    def __init__(self, registry: CollectorRegistry | None = None):
        self.registry = registry or CollectorRegistry()
        register_build_info(self.registry)
        self._shared = None  # the SharedTier, once track_shared names it
        r = self.registry
        self.bytes_in = Total()
        self.bytes_out = Total()
        self.ops_by_name: dict[str, OpStats] = {}
        self.errors_by_status: dict[tuple[str, str], Total] = {}
        self.connections = Gauge("kvpool_node_connections", "Open data connections", registry=r)
        r.register(_RequestCollector(self))

    def per_op(self, op: str) -> OpStats:
        stats = self.ops_by_name.get(op)
        if stats is None:
            stats = self.ops_by_name[op] = OpStats()
        return stats

    def error(self, op: str, status: str) -> None:
        total = self.errors_by_status.get((op, status))
        if total is None:
            total = self.errors_by_status[(op, status)] = Total()
        total.inc()

    def track_tiers(self, tiers) -> None:
        """Export each StorageTier's usage and counters, labelled by tier name."""
        self.registry.register(_OnScrape(lambda: _tier_families(tiers, self._shared)))

    def track_shared(self, shared) -> None:
        """Export what this node did with the shared tier (storenode/background/shared_tier.py SharedTier.report)."""
        self._shared = shared
        self.registry.register(_OnScrape(lambda: _shared_families(shared)))

    def track_tenants(self, table) -> None:
        """Export each tenant's figures (storenode/storage/tenant_usage.py TenantTable), labelled by tenant."""
        self.registry.register(_OnScrape(lambda: _tenant_families(table)))
