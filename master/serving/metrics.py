"""Prometheus metrics of the master.

RPC counts and latencies are plain numbers added to as requests are served and
turned into metrics at scrape time (CallCounter, RpcStats): a labelled
prometheus Counter or Histogram takes a lock per update, which cost more than
serving a small call. Everything about the table (objects, bytes, nodes,
pending puts, each node's last REPORT) is read from it at scrape time, so the
numbers can never drift from the table itself.
"""

import bisect
import math
import time

from prometheus_client import CollectorRegistry, Counter, Gauge
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.samples import Sample
from prometheus_client.utils import floatToGoString

from kvpool.runtime.health import Health, serve_http
from kvpool.runtime.process import register_build_info

from kvpool.master.table.objects import ObjectTable

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


class CallCounter:
    """A counter by label values, kept as plain ints and exposed at scrape time as the labelled
    prometheus Counter `name` would be (`name`_total and `name`_created per label set)."""

    def __init__(self, name: str, doc: str, labelnames: tuple[str, ...], registry: CollectorRegistry | None):
        self._name, self._doc, self._labelnames = name, doc, list(labelnames)
        self.counts: dict[tuple, int] = {}  # label values -> count
        self._created: dict[tuple, float] = {}
        if registry is not None:
            registry.register(self)

    def inc(self, labels: tuple, amount: int = 1) -> None:
        counts = self.counts
        if labels in counts:
            counts[labels] += amount
        else:
            self.touch(labels)
            counts[labels] += amount

    def touch(self, labels: tuple) -> None:
        """Expose `labels` (at 0 until counted), as Counter.labels() does."""
        if labels not in self.counts:
            self._created[labels] = time.time()
            self.counts[labels] = 0

    def collect(self):
        family = CounterMetricFamily(self._name, self._doc, labels=self._labelnames)
        created = self._created
        for labels, value in dict(self.counts).items():  # a copy: the scrape runs on another thread
            family.add_metric(list(labels), value, created=created.get(labels))
        yield family


class RpcStats:
    """Calls served, their latency and their non-OK statuses, by method, kept as plain numbers and
    exposed at scrape time as kvpool_master_rpcs (counter), kvpool_master_rpc_seconds (histogram)
    and kvpool_master_rpc_errors (counter, by method and status)."""

    def __init__(self, registry: CollectorRegistry):
        self._bounds = (*LATENCY_BUCKETS, math.inf)
        # method -> [calls per bucket (non-cumulative)..., sum of seconds]
        self._per_method: dict[str, list] = {}
        self._created: dict[str, float] = {}
        self.errors = CallCounter("kvpool_master_rpc_errors", "Answers (or batch items) with a non-OK status",
                                  ("method", "status"), registry)
        registry.register(self)

    def observe(self, method: str, seconds: float, error_statuses: list[str]) -> None:
        stats = self._per_method.get(method)
        if stats is None:
            self._created[method] = time.time()
            stats = self._per_method[method] = [0] * len(self._bounds) + [0.0]
        stats[bisect.bisect_left(self._bounds, seconds)] += 1  # a bucket counts values <= its bound
        stats[-1] += seconds
        for status in error_statuses:
            self.errors.inc((method, status))

    def collect(self):
        calls = CounterMetricFamily("kvpool_master_rpcs", "RPCs served", labels=["method"])
        latency = HistogramMetricFamily("kvpool_master_rpc_seconds", "Time to serve an RPC", labels=["method"])
        bounds = [floatToGoString(b) for b in self._bounds]
        for method, stats in list(self._per_method.items()):
            stats = list(stats)  # a copy: the scrape runs on another thread
            created = self._created[method]
            cumulative, buckets = 0, []
            for bound, count in zip(bounds, stats):
                cumulative += count
                buckets.append((bound, cumulative))
            calls.add_metric([method], cumulative, created=created)
            latency.add_metric([method], buckets, stats[-1])
            latency.samples.append(Sample("kvpool_master_rpc_seconds_created", {"method": method}, created))
        yield calls
        yield latency


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
        shared = t.shared.node
        yield GaugeMetricFamily("kvpool_master_nodes", "Registered storage nodes",
                                value=len(t.nodes) - (shared is not None))
        if shared is not None:
            yield GaugeMetricFamily("kvpool_master_shared_bytes", "Bytes of objects in the shared tier",
                                    value=shared.keys.bytes)
            yield GaugeMetricFamily("kvpool_master_shared_objects", "Objects in the shared tier",
                                    value=len(shared.keys))
            yield GaugeMetricFamily("kvpool_master_shared_capacity_bytes", "The shared tier's --shared-capacity",
                                    value=t.shared.capacity)
        yield GaugeMetricFamily("kvpool_master_under_replicated", "Objects with fewer live copies than their target",
                                value=t.under_replicated())
        yield GaugeMetricFamily("kvpool_master_draining_nodes", "Storage nodes being drained",
                                value=sum(1 for n in t.nodes.values() if n.draining))
        gauges = {name: GaugeMetricFamily(f"kvpool_master_tier_{name}", doc, labels=["node", "tier"])
                   for name, doc in _TIER_GAUGES}
        counters = {name: CounterMetricFamily(f"kvpool_master_tier_{name}", doc, labels=["node", "tier"])
                    for name, doc in _TIER_COUNTERS}
        for node in t.nodes.values():
            if node.shared:
                continue
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
        register_build_info(self.registry)
        self.rpcs = RpcStats(self.registry)
        self.unauthenticated = Counter("kvpool_master_grpc_unauthenticated",
                                       "gRPC calls refused for a missing or wrong credential", registry=self.registry)
        self.leader = Gauge("kvpool_master_leader", "1 while this master leads and serves, else 0",
                            registry=self.registry)
        self.term = Gauge("kvpool_master_term", "The election term this master last led or saw",
                          registry=self.registry)
        self.registry.register(_TableCollector(table))
        self._http = None
        self.observe = self.rpcs.observe  # observe(method, seconds, error statuses): per call

    def refused_call(self) -> None:
        self.unauthenticated.inc()

    async def serve(self, port: int, host: str, health: Health) -> None:
        """/metrics, and the /healthz and /readyz probes (kvpool/runtime/health.py), on the running loop."""
        self._http = await serve_http(port, host, self.registry, health)

    def stop(self) -> None:
        if self._http is not None:
            self._http.close()
            self._http = None
