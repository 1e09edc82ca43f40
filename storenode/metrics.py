"""Prometheus metrics of one storage node, in their own registry (exported on --metrics-port)."""

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

_LATENCY_BUCKETS = (50e-6, 100e-6, 250e-6, 500e-6, 1e-3, 2.5e-3, 5e-3, 10e-3, 25e-3, 50e-3, 0.1, 0.25, 1.0)


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
        self.capacity = Gauge("kvpool_node_capacity_bytes", "Size of the DRAM segment", registry=r)
        self.used = Gauge("kvpool_node_used_bytes", "Bytes held by recorded extents", registry=r)
        self.objects = Gauge("kvpool_node_objects", "Recorded extents", registry=r)
        self._per_op: dict = {}

    def per_op(self, op: str):
        """(ops counter, latency histogram) of one op, looked up once per op name."""
        children = self._per_op.get(op)
        if children is None:
            children = self._per_op[op] = (self.ops.labels(op), self.latency.labels(op))
        return children

    def track_table(self, table, capacity: int) -> None:
        """Read usage from the extent table at scrape time instead of updating it per request."""
        self.capacity.set(capacity)
        self.used.set_function(lambda: table.bytes)
        self.objects.set_function(lambda: table.objects)
