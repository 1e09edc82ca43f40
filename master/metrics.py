"""Prometheus metrics of the master.

RPC counters are updated as requests are served; everything about the table
(objects, bytes, nodes, pending puts) is read from it at scrape time, so the
numbers can never drift from the table itself.
"""

from prometheus_client import CollectorRegistry, Counter, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from .objects import ObjectTable

LATENCY_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0)


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
        capacity = GaugeMetricFamily("kvpool_master_tier_capacity_bytes", "Segment capacity per node and tier",
                                     labels=["node", "tier"])
        used = GaugeMetricFamily("kvpool_master_tier_used_bytes", "Bytes allocated per node and tier "
                                 "(committed and pending)", labels=["node", "tier"])
        for node in t.nodes.values():
            for name, alloc in node.tiers.items():
                capacity.add_metric([node.node_id, name], alloc.capacity)
                used.add_metric([node.node_id, name], alloc.used)
        yield capacity
        yield used
        c = t.counters
        for name, doc, value in (("reclaimed_puts", "Pending puts reclaimed after the put timeout",
                                  c.reclaimed_puts),
                                 ("puts", "Puts committed", c.puts),
                                 ("removes", "Objects removed", c.removes),
                                 ("lookup_hits", "Replica-list lookups that found the key", c.hits),
                                 ("lookup_misses", "Replica-list lookups that did not", c.misses)):
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
        self.registry.register(_TableCollector(table))
        self._http = None

    def observe(self, method: str, seconds: float, error_statuses: list[str]) -> None:
        self.rpcs.labels(method).inc()
        self.latency.labels(method).observe(seconds)
        for status in error_statuses:
            self.errors.labels(method, status).inc()

    def serve(self, port: int, host: str) -> None:
        self._http, _thread = start_http_server(port, addr=host, registry=self.registry)

    def stop(self) -> None:
        if self._http is not None:
            self._http.shutdown()
            self._http = None
