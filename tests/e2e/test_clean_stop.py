"""A clean stop keeps the data (storenode/background/stop_keep.py): a cluster with a shared tier, stopped as
`kvpool up` is stopped (SIGTERM to each process), writes what its nodes' DRAM held to the shared tier first, so a
new cluster started over the same directory serves every object, byte-exact; with --stop-grace 0 the hot objects
that only DRAM held are gone."""

import hashlib

from kvpool import Client
from kvpool.launch.local_cluster import LocalCluster
from kvpool.net.netutil import wait_until

SIZE = 1 << 20
COUNT = 300


def value_of(key: str) -> bytes:
    seed = hashlib.blake2b(key.encode(), digest_size=64).digest()
    return (seed * (SIZE // 64))[:SIZE]


def served_after_a_clean_stop(tmp_path, node_args: list) -> int:
    options = dict(nodes=2, dram_per_node="64MiB", shared_dir=tmp_path / "shared", lease_ttl=2,
                   node_args=["--high-watermark", "0.8", "--low-watermark", "0.6", *node_args])
    keys = [f"clean-stop/{i:04d}" for i in range(COUNT)]  # 300 MiB through 128 MiB of DRAM
    with LocalCluster(data_dir=tmp_path / "first", **options) as first, Client(first.master_address) as client:
        for start in range(0, COUNT, 8):
            client.batch_put(keys[start:start + 8], [value_of(key) for key in keys[start:start + 8]])
            wait_until(lambda: all(t.used <= 0.8 * t.capacity for n in first.master_stats().nodes
                                   for t in n.tiers), 30, what="the nodes' DRAM under its high watermark")
        in_dram = sum(t.objects for n in first.master_stats().nodes for t in n.tiers)
        assert in_dram >= 60  # what only DRAM holds when the stop comes
    with LocalCluster(data_dir=tmp_path / "again", **options) as again, Client(again.master_address) as client:
        wait_until(lambda: again.master_stats().shared.objects > 0, 30, what="the shared tier adopted")
        served = 0
        for key in keys:
            if client.exists(key):
                assert client.get(key) == value_of(key), key
                served += 1
        return served


def test_a_cluster_stopped_cleanly_serves_every_object_when_started_again(tmp_path):
    assert served_after_a_clean_stop(tmp_path, []) == COUNT


def test_without_a_stop_grace_what_only_dram_held_is_gone(tmp_path):
    assert served_after_a_clean_stop(tmp_path, ["--stop-grace", "0"]) < COUNT - 50


def served_after_one_node_stops(tmp_path, node_args: list) -> tuple[int, int, str]:
    """(objects node-0 held, objects served, its log) after node-0 of two, without a shared tier, is stopped (SIGTERM)."""
    keys = [f"hand-off/{i:03d}" for i in range(40)]
    with LocalCluster(nodes=2, dram_per_node="64MiB", data_dir=tmp_path, node_args=node_args) as cluster, \
            Client(cluster.master_address) as client:
        for key in keys:
            client.put(key, value_of(key))
        on_first = {n.node_id: n.objects for n in cluster.master_stats().nodes}["node-0"]
        assert on_first >= 5  # placement spreads them
        assert cluster.nodes[0].stop(30) == 0
        cluster.wait_for_nodes(1)
        served = 0
        for key in keys:
            if client.exists(key):
                assert client.get(key) == value_of(key), key
                served += 1
        log = cluster.nodes[0].log_path.read_text()
    return on_first, served, log


def test_a_node_without_a_shared_tier_hands_its_objects_to_the_others_when_stopped(tmp_path):
    held, served, log = served_after_one_node_stops(tmp_path, [])
    assert served == 40
    assert f"stopping: {held} objects handed to other nodes, 0 not" in log


def test_without_a_stop_grace_a_stopped_nodes_objects_are_gone(tmp_path):
    held, served, _ = served_after_one_node_stops(tmp_path, ["--stop-grace", "0"])
    assert served == 40 - held
