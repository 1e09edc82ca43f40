"""Every component serves Prometheus metrics that move with the traffic: after a known workload, the master's
and the nodes' counters moved by exactly what it did."""

import os

from storenode_harness import metric_samples, metric_total

from kvpool import Client

VALUE = 100_000


def test_master_and_node_metrics_follow_the_traffic(own_cluster):
    cluster = own_cluster(nodes=2, metrics=True)
    urls = cluster.metrics_urls
    assert set(urls) == {"master", "node-0", "node-1"}
    keys = [f"m/{i}" for i in range(10)]
    master_before = metric_samples(urls["master"])
    with Client(cluster.master_address) as writer:
        writer.batch_put(keys, [os.urandom(VALUE)] * 10)
        writer.flush()  # the PutEnds are posted: wait for the master's answers
    with Client(cluster.master_address) as reader:  # an empty placement cache: its reads ask the master
        values = reader.batch_get(keys + ["m/missing-1", "m/missing-2"])
        assert [len(v) for v in values[:10]] == [VALUE] * 10 and values[10:] == [None, None]
        for key in keys[:3]:
            reader.remove(key)
    master = metric_samples(urls["master"])
    nodes = [metric_samples(urls[f"node-{i}"]) for i in range(2)]

    def moved(name: str, **labels) -> float:
        return metric_total(master, name, **labels) - metric_total(master_before, name, **labels)

    assert moved("kvpool_master_puts_total") == 10
    assert moved("kvpool_master_removes_total") == 3
    assert metric_total(master, "kvpool_master_objects") == 7
    assert metric_total(master, "kvpool_master_object_bytes") == 7 * VALUE
    assert metric_total(master, "kvpool_master_pending_puts") == 0
    assert moved("kvpool_master_lookup_hits_total") == 10 and moved("kvpool_master_lookup_misses_total") == 2
    # One call per batch, one per remove; the two missing keys are the lookup's only non-OK items.
    calls = {method: moved("kvpool_master_rpcs_total", method=method)
             for method in ("BatchPutStart", "BatchPutEnd", "BatchGetReplicaList", "Remove", "PutStart")}
    assert calls == {"BatchPutStart": 1, "BatchPutEnd": 1, "BatchGetReplicaList": 1, "Remove": 3, "PutStart": 0}
    assert moved("kvpool_master_rpc_errors_total") == 2
    assert moved("kvpool_master_rpc_errors_total", method="BatchGetReplicaList", status="NOT_FOUND") == 2
    assert metric_total(master, "kvpool_master_nodes") == 2
    # The nodes received every value once and sent every value read once.
    assert sum(metric_total(s, "kvpool_node_bytes_in_total") for s in nodes) == 10 * VALUE
    assert sum(metric_total(s, "kvpool_node_bytes_out_total") for s in nodes) == 10 * VALUE
