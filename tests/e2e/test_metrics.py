"""Every component serves Prometheus metrics that move with the traffic."""

import os
import urllib.request

from prometheus_client.parser import text_string_to_metric_families

from kvpool import Client


def _samples(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=5) as resp:
        text = resp.read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def _total(samples: dict, name: str, **labels) -> float:
    return sum(v for (n, lab), v in samples.items()
               if n == name and all(dict(lab).get(k) == want for k, want in labels.items()))


def test_master_and_node_metrics_follow_the_traffic(own_cluster):
    cluster = own_cluster(nodes=2, metrics=True)
    urls = cluster.metrics_urls
    assert set(urls) == {"master", "node-0", "node-1"}
    with Client(cluster.master_address) as c:
        c.batch_put([f"m/{i}" for i in range(10)], [os.urandom(100_000)] * 10)
        assert all(v is not None for v in c.batch_get([f"m/{i}" for i in range(10)]))
    master = _samples(urls["master"])
    nodes = [_samples(urls[f"node-{i}"]) for i in range(2)]
    names = {name for name, _ in master}
    assert any(n.startswith("kvpool_master_") for n in names), sorted(names)[:20]
    node_bytes_in = sum(_total(s, "kvpool_node_bytes_in_total") for s in nodes)
    node_bytes_out = sum(_total(s, "kvpool_node_bytes_out_total") for s in nodes)
    assert node_bytes_in == 10 * 100_000
    assert node_bytes_out == 10 * 100_000
