"""Prometheus metrics of the master.

RPC counters are updated as requests are served; everything about the table
(objects, bytes, nodes, pending puts, each node's last REPORT) is read from it
at scrape time, so the numbers can never drift from the table itself.
"""

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from kvpool.runtime.health import Health, serve_http

from .objects import ObjectTable

# Per node and tier, as the node last reported them (the master only relays them).
_TIER_GAUGES = (
    ("capacity_bytes", "Tier capacity per node, as registered"),
    ("used_bytes", "Bytes used per node and tier: last reported, plus puts committed since (at most the capacity)"),
    ("reserved_bytes", "Bytes of puts sent to the node (pending or committed) that its last report cannot "
                       "show yet"),
    ("objects", "Objects per node and tier: last reported, plus puts committed since"),
    ("pinned_bytes", "Hard-pinned bytes per node and tier, as last reported"),
)
# Named as the node's REPORT fields; cumulative on the node (they restart from 0 with it).
_TIER_COUNTERS = (
    ("hits", "Reads served per node and tier"),
    ("misses", "Reads of objects the node did not hold"),
    ("demotions", "Objects moved down from this tier"),
    ("promotions", "Objects copied up into this tier"),
    ("evictions", "Objects evicted for good from this tier"),
    ("evicted_bytes", "Bytes evicted for good from this tier"),
)

LATENCY_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0)


def _number(reported: dict, field: str) -> float:
    try:
        return float(reported.get(field) or 0)
    except (TypeError, ValueError):
        return 0.0


class _TableCollector:
    def __init__(self, table: ObjectTable):
        self._table = table

    def collect(self):
        t = self._table
        yield GaugeMetricFamily("kvpool_master_objects", "Committed objects", value=t.object_count)
        yield GaugeMetricFamily("kvpool_master_object_bytes", "Bytes of committed objects", value=t.total_bytes)
        yield GaugeMetricFamily("kvpool_master_pending_puts", "Puts started and not yet ended",
                                value=t.pending_count)
        yield GaugeMetricFamily("kvpool_master_nodes", "Registered storage nodes", value=len(t.nodes))
        yield GaugeMetricFamily("kvpool_master_under_replicated", "Objects with fewer live copies than their target",
                                value=t.under_replicated())
        yield GaugeMetricFamily("kvpool_master_draining_nodes", "Storage nodes being drained",
                                value=sum(1 for n in t.nodes.values() if n.draining))
        gauges = {name: GaugeMetricFamily(f"kvpool_master_tier_{name}", doc, labels=["node", "tier"])
                   for name, doc in _TIER_GAUGES}
        counters = {name: CounterMetricFamily(f"kvpool_master_tier_{name}", doc, labels=["node", "tier"])
                    for name, doc in _TIER_COUNTERS}
        for node in t.nodes.values():
            for tier in sorted(set(node.capacity) | set(node.reported)):
                labels = [node.node_id, tier]
                reported = node.reported.get(tier, {})
                gauges["capacity_bytes"].add_metric(labels, node.capacity.get(tier, 0))
                gauges["reserved_bytes"].add_metric(labels, node.reserved(tier))
                objects, used = node.estimated_use(tier)
                gauges["used_bytes"].add_metric(labels, used)
                gauges["objects"].add_metric(labels, objects)
                gauges["pinned_bytes"].add_metric(labels, _number(reported, "pinned_bytes"))
                for name, _doc in _TIER_COUNTERS:
                    counters[name].add_metric(labels, _number(reported, name))
        yield from gauges.values()
        yield from counters.values()
        c = t.counters
        for name, doc, value in (("reclaimed_puts", "Pending puts reclaimed after the put timeout",
                                  c.reclaimed_puts),
                                 ("puts", "Puts committed", c.puts),
                                 ("removes", "Objects removed", c.removes),
                                 ("lookup_hits", "Replica-list lookups that found the key", c.hits),
                                 ("lookup_misses", "Replica-list lookups that did not", c.misses),
                                 ("expired", "Objects dropped because their ttl passed", c.expired),
                                 ("evicted_replicas", "Replicas dropped because their node evicted them",
                                  c.evicted_replicas),
                                 ("evicted_objects", "Objects gone because their last replica was evicted",
                                  c.evicted_objects),
                                 ("adopted_replicas", "Replicas taken back from a node's inventory", c.adopted),
                                 ("node_reports", "REPORT answers applied", c.reports),
                                 ("repairs", "Replicas copied to restore an object's target", c.repairs_done),
                                 ("repair_bytes", "Bytes copied by repairs", c.repair_bytes)):
            yield CounterMetricFamily(f"kvpool_master_{name}", doc, value=value)


class MasterMetrics:
    def __init__(self, table: ObjectTable, registry: CollectorRegistry | None = None):
        # A registry of its own: several masters may live in one test process.
        self.registry = registry or CollectorRegistry()
        self.rpcs = Counter("kvpool_master_rpcs", "RPCs served", ["method"], registry=self.registry)
        self.errors = Counter("kvpool_master_rpc_errors", "Answers (or batch items) with a non-OK status",
                              ["method", "status"], registry=self.registry)
        self.latency = Histogram("kvpool_master_rpc_seconds", "Time to serve an RPC", ["method"],
                                 buckets=LATENCY_BUCKETS, registry=self.registry)
        self.unauthenticated = Counter("kvpool_master_grpc_unauthenticated",
                                       "gRPC calls refused for a missing or wrong credential", registry=self.registry)
        self.leader = Gauge("kvpool_master_leader", "1 while this master leads and serves, else 0",
                            registry=self.registry)
        self.term = Gauge("kvpool_master_term", "The election term this master last led or saw",
                          registry=self.registry)
        self.registry.register(_TableCollector(table))
        self._http = None
        self._per_method: dict[str, tuple] = {}  # labels() costs more than the update itself

    def observe(self, method: str, seconds: float, error_statuses: list[str]) -> None:
        counters = self._per_method.get(method)
        if counters is None:
            counters = self._per_method[method] = (self.rpcs.labels(method), self.latency.labels(method))
        counters[0].inc()
        counters[1].observe(seconds)
        for status in error_statuses:
            self.errors.labels(method, status).inc()

    def refused_call(self) -> None:
        self.unauthenticated.inc()

    def serve(self, port: int, host: str, health: Health) -> None:
        """/metrics, and the /healthz and /readyz probes (kvpool/runtime/health.py)."""
        self._http = serve_http(port, host, self.registry, health)

    def stop(self) -> None:
        if self._http is not None:
            self._http.shutdown()
            self._http = None
