"""The vLLM connector's transfer counts in vLLM's own forms: KVConnectorStats, which vLLM sums across workers and
steps and logs ("KV Transfer metrics: ..."), and Prometheus counters vllm:kvpool_<count> (`llm.get_metrics()`,
the server's /metrics)."""

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats

from .transfer_stats import COUNTS, add_counts, is_empty, summarize


class KVPoolConnectorStats(KVConnectorStats):
    """`data` holds the counts of transfer_stats.COUNTS (a dict of numbers, as vLLM sends it between
    processes)."""

    def reset(self):
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> "KVPoolConnectorStats":
        add_counts(self.data, other.data)
        return self

    def reduce(self) -> dict[str, int | float]:
        return summarize(self.data)

    def is_empty(self) -> bool:
        return is_empty(self.data)


class KVPoolPromMetrics(KVConnectorPromMetrics):
    """One counter per count, per engine."""

    def __init__(self, vllm_config, metric_types, labelnames, per_engine_labelvalues):
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        counters = {name: self._counter_cls(name=f"vllm:kvpool_{name}", documentation=f"kvpool: {meaning}",
                                            labelnames=labelnames)
                    for name, meaning in COUNTS.items()}
        self._counters = {engine: {name: counter.labels(*values) for name, counter in counters.items()}
                          for engine, values in per_engine_labelvalues.items()}

    def observe(self, transfer_stats_data: dict, engine_idx: int = 0):
        counters = self._counters[engine_idx]
        for name, value in transfer_stats_data.items():
            if name in counters and value:
                counters[name].inc(value)
