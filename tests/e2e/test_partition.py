"""A storage node cut off by a network partition: a node in its own network namespace, joined to the
rest by a veth pair whose link the test takes down and up again."""

import os
import subprocess

import pytest

from kvpool import Client
from kvpool.launch.local_cluster import LocalCluster
from kvpool.net.netutil import wait_until
from kvpool.proto import kvpool_pb2 as pb
from kvpool.proto import kvpool_pb2_grpc
from storenode_harness import inventory_at, master_channel

# Link-local addresses that exist only on this veth pair, inside this machine.
HOST, NS_HOST = "169.254.201.1", "169.254.201.2"


def _ip(*args, ns: str | None = None) -> None:
    subprocess.run([*(["ip", "netns", "exec", ns] if ns else []), "ip", *args], check=True, capture_output=True)


@pytest.fixture
def netns():
    """(namespace, host-side interface) of a fresh namespace wired to the host by a veth pair."""
    name = f"kvp{os.getpid() % 100000}"
    host_if, ns_if = f"{name}h", f"{name}n"
    try:
        _ip("netns", "add", name)
    except (FileNotFoundError, subprocess.CalledProcessError) as exc:
        pytest.skip(f"network namespaces are not available here: {exc}")
    try:
        _ip("link", "add", host_if, "type", "veth", "peer", "name", ns_if)
        _ip("link", "set", ns_if, "netns", name)
        _ip("addr", "add", f"{HOST}/30", "dev", host_if)
        _ip("link", "set", host_if, "up")
        _ip("addr", "add", f"{NS_HOST}/30", "dev", ns_if, ns=name)
        _ip("link", "set", ns_if, "up", ns=name)
        _ip("link", "set", "lo", "up", ns=name)
        yield name, host_if
    finally:
        subprocess.run(["ip", "link", "del", host_if], capture_output=True)
        subprocess.run(["ip", "netns", "del", name], capture_output=True)


def _placement(cluster, key: str):
    with master_channel(cluster.master_address) as channel:
        answer = kvpool_pb2_grpc.MasterStub(channel).GetReplicaList(pb.GetReplicaListRequest(key=key), timeout=5)
    return answer.object


def test_partitioned_node_is_served_around_and_heals_without_split_brain(netns, tmp_path):
    namespace, host_if = netns
    with LocalCluster(nodes=2, host=HOST, lease_ttl=2, dram_per_node="64MiB", data_dir=tmp_path / "cluster") as cluster:
        isolated = cluster.add_node(NS_HOST, prefix=("ip", "netns", "exec", namespace))
        cluster.wait_for_nodes(3)
        address = isolated.info["address"]
        values = {f"part/{i}": os.urandom(50_000 + i) for i in range(30)}
        with Client(cluster.master_address, read_timeout=1.0) as c:
            for key, value in values.items():
                c.put(key, value, replicas=2)
            on_isolated = [k for k in values if address in {r.address for r in _placement(cluster, k).replicas}]
            assert on_isolated
            moved = on_isolated[0]
            old_generation = _placement(cluster, moved).generation

            _ip("link", "set", host_if, "down")  # the partition
            try:
                for key, value in values.items():  # every object is still served, from its other copy
                    assert c.get(key) == value
                cluster.wait_for_nodes(2, timeout=20)  # its lease expired on the majority side
                c.put(moved, b"written while the node was cut off", overwrite=True)
                assert address not in {r.address for r in _placement(cluster, moved).replicas}
            finally:
                _ip("link", "set", host_if, "up")  # the partition heals

            cluster.wait_for_nodes(3, timeout=30)
            # The healed node's copy of the old version is dropped, never served as current.
            wait_until(lambda: inventory_at(address).get(moved, {}).get("generation") != old_generation, timeout=20,
                       what="the healed node to drop the version overwritten during the partition")
            assert c.get(moved) == b"written while the node was cut off"
            for key in values:
                if key != moved:
                    assert c.get(key) == values[key]
