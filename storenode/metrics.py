"""Prometheus metrics of one storage node, in their own registry (exported on --metrics-port)."""

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

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


class _TierCollector:
    def __init__(self, tiers):
        self.tiers = tiers

    def describe(self):
        return []  # collected on demand only

    def collect(self):
        stats = {tier.name: tier.stats() for tier in self.tiers}
        for field, (name, doc) in _TIER_GAUGES.items():
            family = GaugeMetricFamily(name, doc, labels=["tier"])
            for tier, values in stats.items():
                family.add_metric([tier], values[field])
            yield family
        for field, (name, doc) in _TIER_COUNTERS.items():
            family = CounterMetricFamily(name, doc, labels=["tier"])
            for tier, values in stats.items():
                family.add_metric([tier], values[field])
            yield family


class NodeMetrics:
    def __init__(self, registry: CollectorRegistry | None = None):
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.ops = Counter("kvpool_node_ops", "Data-protocol requests handled", ["op"], registry=r)
        self.errors = Counter("kvpool_node_errors", "Requests answered with an error status",
                              ["op", "status"], registry=r)
        self.bytes_in = Counter("kvpool_node_bytes_in", "Payload bytes received by WRITE", registry=r)
        self.bytes_out = Counter("kvpool_node_bytes_out", "Payload bytes sent by READ", registry=r)
        self.latency = Histogram("kvpool_node_request_seconds", "Time to handle one request", ["op"],
                                 buckets=_LATENCY_BUCKETS, registry=r)
        self.connections = Gauge("kvpool_node_connections", "Open data connections", registry=r)
        self._per_op: dict = {}

    def per_op(self, op: str):
        """(ops counter, latency histogram) of one op, looked up once per op name."""
        children = self._per_op.get(op)
        if children is None:
            children = self._per_op[op] = (self.ops.labels(op), self.latency.labels(op))
        return children

    def track_tiers(self, tiers) -> None:
        """Export each StorageTier's usage and counters, labelled by tier name."""
        self.registry.register(_TierCollector(tiers))
