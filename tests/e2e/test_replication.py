"""Replication end to end: real etcd, master and storage node processes.

Copies land on distinct nodes (distinct zones first); reads survive a node killed
mid-load; the master repairs objects back to their target after the node's lease
expires, after a partial put, and when a node is drained; repair keeps to its rate.
"""

import subprocess
import sys
import threading
import time

import pytest

from kvpool import Client
from kvpool.errors import InvalidArgumentError, UnavailableError
from kvpool.launch.local_cluster import LocalCluster
from kvpool.net.netutil import wait_until
from kvpool.proto import kvpool_pb2 as pb
from kvpool.proto import kvpool_pb2_grpc
from storenode_harness import master_channel

KiB, MiB = 1 << 10, 1 << 20


class ZonedCluster(LocalCluster):
    """A LocalCluster whose node i runs with --zone zones[i]."""

    def __init__(self, zones: list, **options):
        super().__init__(nodes=len(zones), **options)
        self.zones = zones

    def _node_child(self, index: int):
        child = super()._node_child(index)
        child.argv += ["--zone", self.zones[index]]
        return child


@pytest.fixture
def start_cluster(tmp_path):
    started = []

    def start(zones, **options):
        options.setdefault("lease_ttl", 2)
        options.setdefault("put_timeout", 3)
        options.setdefault("dram_per_node", "128MiB")
        running = ZonedCluster(zones, data_dir=tmp_path / f"cluster{len(started)}", **options)
        started.append(running)
        return running.start()

    yield start
    for running in started:
        running.stop()


def replicas_of(cluster, key: str) -> list:
    with master_channel(cluster.master_address) as channel:
        answer = kvpool_pb2_grpc.MasterStub(channel).GetReplicaList(pb.GetReplicaListRequest(key=key), timeout=5)
    assert answer.status == pb.OK, answer.message
    return list(answer.object.replicas)


def value(i: int, size: int = 64 * KiB) -> bytes:
    return (i.to_bytes(4, "little") * (size // 4 + 1))[:size]


def fully_replicated(cluster, nodes: int, copies: int) -> bool:
    stats = cluster.master_stats()
    return (len(stats.nodes) == nodes and stats.under_replicated == 0
            and sum(n.objects for n in stats.nodes) == copies)


def test_replicas_land_on_distinct_nodes_in_distinct_zones(start_cluster):
    cluster = start_cluster(["east", "east", "west", "west"])
    zone_of = {n.node_id: n.zone for n in cluster.master_stats().nodes}
    assert sorted(zone_of.values()) == ["east", "east", "west", "west"]
    with Client(cluster.master_address) as client:
        client.batch_put([f"b{i}" for i in range(10)], [value(i) for i in range(10)], replicas=2)
        for i in range(10):
            client.put(f"p{i}", value(i), replicas=2)
        for key in [f"b{i}" for i in range(10)] + [f"p{i}" for i in range(10)]:
            nodes = [r.node_id for r in replicas_of(cluster, key)]
            assert len(set(nodes)) == 2, (key, nodes)
            assert {zone_of[n] for n in nodes} == {"east", "west"}, (key, nodes)
        assert client.get("p3") == value(3) and client.batch_get(["b4"]) == [value(4)]
        stats = client.stats()
        assert stats.under_replicated == 0 and sum(n.objects for n in stats.nodes) == 40
        with pytest.raises(InvalidArgumentError, match="min_replicas"):
            client.put("bad", b"x", replicas=2, min_replicas=3)


def test_kill_9_under_reads_loses_no_read_and_repair_restores_two_copies(start_cluster):
    cluster = start_cluster(["", "", ""])
    keys = [f"k{i}" for i in range(40)]
    with Client(cluster.master_address) as writer:
        writer.batch_put(keys, [value(i) for i in range(40)], replicas=2)
    on_victim = [k for k in keys if "node-0" in [r.node_id for r in replicas_of(cluster, k)]]
    assert on_victim

    reads, failures, wrong = [0], [], []
    stop = threading.Event()

    def reader():
        with Client(cluster.master_address) as client:
            while not stop.is_set():
                for i, key in enumerate(keys):
                    try:
                        if client.get(key) != value(i):
                            wrong.append(key)
                    except Exception as exc:  # noqa: BLE001 - counted, the test asserts none happen
                        failures.append((key, repr(exc)))
                    reads[0] += 1

    thread = threading.Thread(target=reader)
    thread.start()
    try:
        wait_until(lambda: reads[0] >= 2 * len(keys), 10, what="the reader to get going")
        cluster.nodes[0].kill()
        killed_at = reads[0]
        wait_until(lambda: fully_replicated(cluster, 2, 2 * len(keys)), 20,
                   what="repair to bring every object back to two copies")
        repaired_at = reads[0]
        wait_until(lambda: reads[0] >= repaired_at + 2 * len(keys), 10, what="reads after the repair")
    finally:
        stop.set()
        thread.join(10)
    assert reads[0] > killed_at
    assert failures == [] and wrong == []
    for key in keys:
        nodes = [r.node_id for r in replicas_of(cluster, key)]
        assert len(set(nodes)) == 2 and "node-0" not in nodes
    stats = cluster.master_stats()
    assert stats.repairs_done >= len(on_victim)
    assert stats.repair_bytes >= len(on_victim) * 64 * KiB


def test_min_replicas_put_succeeds_with_a_dead_target_and_is_repaired(start_cluster):
    # A long lease: the master still places on the killed node while these puts run.
    cluster = start_cluster(["", "", ""], lease_ttl=10)
    cluster.nodes[0].kill()
    keys = [f"m{i}" for i in range(6)]
    with Client(cluster.master_address) as client:
        for i, key in enumerate(keys[:3]):
            client.put(key, value(i), replicas=3, min_replicas=1)
        client.batch_put(keys[3:], [value(i) for i in range(3, 6)], replicas=3, min_replicas=2)
        with pytest.raises(UnavailableError):  # all three copies required: the dead node fails it
            client.put("strict", value(9), replicas=3)
        assert not client.exists("strict")
        for key in keys:
            assert sorted(r.node_id for r in replicas_of(cluster, key)) == ["node-1", "node-2"]
        assert client.stats().under_replicated == len(keys)
        # The node comes back as a new instance: repair gives every object its third copy there.
        cluster.restart_node(0)
        wait_until(lambda: fully_replicated(cluster, 3, 3 * len(keys)), 20,
                   what="repair to bring every object to three copies")
        for i, key in enumerate(keys):
            assert sorted(r.node_id for r in replicas_of(cluster, key)) == ["node-0", "node-1", "node-2"]
            assert client.get(key) == value(i)


def test_drain_moves_everything_off_a_node(start_cluster):
    cluster = start_cluster(["", "", ""])
    single = [f"s{i}" for i in range(20)]
    double = [f"d{i}" for i in range(10)]
    with Client(cluster.master_address) as client:
        client.batch_put(single, [value(i) for i in range(20)])
        client.batch_put(double, [value(100 + i) for i in range(10)], replicas=2)
        before = {n.node_id: n.objects for n in client.stats().nodes}
        assert before["node-0"] > 0
        done = subprocess.run([sys.executable, "-m", "kvpool.commands.cli", "drain", "node-0", "--master",
                               cluster.master_address, "--wait", "20"],
                              capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stderr
        assert f"draining node-0: {before['node-0']} objects" in done.stdout and "drained node-0" in done.stdout
        node0 = next(n for n in client.stats().nodes if n.node_id == "node-0")
        assert node0.draining and node0.objects == 0
        wait_until(lambda: fully_replicated(cluster, 3, len(single) + 2 * len(double)), 10,
                   what="every object at its target off the drained node")
        for i, key in enumerate(single):
            assert client.get(key) == value(i)
            assert [r.node_id for r in replicas_of(cluster, key)] != ["node-0"]
        for i, key in enumerate(double):
            assert client.get(key) == value(100 + i)
            assert sorted(r.node_id for r in replicas_of(cluster, key)) == ["node-1", "node-2"]
        client.put("after", value(7), replicas=3)  # best effort: the drained node takes no new copy
        assert sorted(r.node_id for r in replicas_of(cluster, "after")) == ["node-1", "node-2"]
        unknown = subprocess.run([sys.executable, "-m", "kvpool.commands.cli", "drain", "ghost", "--master",
                                  cluster.master_address], capture_output=True, text=True, timeout=30)
        assert unknown.returncode == 1 and "ghost" in unknown.stderr


def test_repair_keeps_to_its_rate(start_cluster):
    rate = 4 * MiB
    cluster = start_cluster(["", "", ""], master_args=["--repair-rate", "4MiB"])
    keys = [f"r{i}" for i in range(16)]
    with Client(cluster.master_address) as client:
        client.batch_put(keys, [value(i, MiB) for i in range(16)], replicas=2)
    lost = sum("node-0" in [r.node_id for r in replicas_of(cluster, k)] for k in keys)
    assert lost >= 4
    cluster.nodes[0].kill()
    wait_until(lambda: len(cluster.master_stats().nodes) == 2, 10, interval=0.01, what="the lease to expire")
    began = time.monotonic()
    wait_until(lambda: fully_replicated(cluster, 2, 2 * len(keys)), 30, what="repair to finish")
    took = time.monotonic() - began
    stats = cluster.master_stats()
    assert stats.repair_bytes == lost * MiB
    # Starts are paced at the rate: all but the first copy wait for their share of it.
    assert took >= 0.8 * (lost - 1) * MiB / rate, (took, lost)


def test_a_hung_replica_is_skipped_after_the_read_timeout(start_cluster):
    """A node that stops answering (frozen, as behind a partition) must not hang its readers."""
    import signal

    cluster = start_cluster(["a", "b"])
    data = value(7, 200_000)
    with Client(cluster.master_address, read_timeout=1.0) as c:
        c.put("hung/k", data, replicas=2)
        first, second = replicas_of(cluster, "hung/k")
        # Freeze the copy a reader tries first, so every read meets the hung node.
        frozen = next(node for node in cluster.nodes if node.info["address"] == first.address)
        frozen.signal(signal.SIGSTOP)
        try:
            for _ in range(3):
                started = time.monotonic()
                assert c.get("hung/k") == data  # served by the other copy
                assert time.monotonic() - started < 4.0
        finally:
            frozen.signal(signal.SIGCONT)
        assert c.get("hung/k") == data
