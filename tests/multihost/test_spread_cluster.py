"""kvpool spread over hosts: etcd, the master, two storage nodes and a client each on a host of its own
(network namespaces joined by a bridge, netns_hosts.py), a storage node cut off silently and healed."""

from spread_cluster import SpreadCluster

SIZE = 64 * 1024
KEYS = [f"spread/{i}" for i in range(16)]


def _reads(agent) -> list:
    """Every key read once by the client on `agent` (its answers name the version read)."""
    return [agent.call("get", client="c", key=key) for key in KEYS]


def test_cluster_spread_over_hosts_serves_across_them_and_around_a_partitioned_node(network, tmp_path):
    with SpreadCluster(network, nodes=2, lease_ttl=2, put_timeout=3, dram_per_node="64MiB", metrics=True,
                       data_dir=tmp_path / "cluster") as cluster:
        components = ["etcd", "master", "node-0", "node-1"]
        addresses = {cluster.host_of(c).address for c in components} | {cluster.client_hosts[0].address}
        assert len(addresses) == 5  # five hosts
        node_hosts = [cluster.host_of(n) for n in ("node-0", "node-1")]
        assert sorted(a.split(":")[0] for a in cluster.master_stats().nodes) == sorted(h.address for h in node_hosts)

        client = cluster.probe  # runs on client0
        assert client.call("ping")["hostname"] == "client0"
        on_node = cluster.agent(node_hosts[0]).call("ping")
        assert on_node["hostname"] == "node0"
        assert on_node["shm"]  # the node's DRAM segment, in its own /dev/shm ...
        assert not set(on_node["shm"]) & set(client.call("ping")["shm"])  # ... which the client's host lacks

        assert client.call("open", name="c", spec={"masters": cluster.master_address, "cluster": cluster.cluster,
                                                    "read_timeout": 1.0}) == {}
        for key in KEYS:
            put = client.call("put", client="c", key=key, version=1, size=SIZE, replicas=2)
            assert put["ok"], put
        for got in _reads(client):
            assert got["ok"] and got["version"] == 1, got  # bytes checked by the client against their digest

        cut = node_hosts[0]
        node0_metrics = cluster.metrics_url("node-0")
        assert client.call("http", url=node0_metrics)["status"] == 200
        with network.cut(cut):
            assert client.call("http", url=node0_metrics, timeout=1.0)["status"] == 0  # silent: no answer
            for got in _reads(client):  # every key has a copy on the cut node, and is served from the other
                assert got["ok"] and got["version"] == 1, got
                assert got["t1"] - got["t0"] < 5.0, got
            cluster.wait_for_nodes(1, timeout=20)  # its lease expired: the master dropped it

        cluster.wait_for_nodes(2, timeout=30)  # it registered again
        assert client.call("http", url=node0_metrics)["status"] == 200
        for got in _reads(client):
            assert got["ok"] and got["version"] == 1, got
