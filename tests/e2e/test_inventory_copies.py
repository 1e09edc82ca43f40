"""A standby's copies of the nodes' inventories against real nodes and etcd (master/leadership/inventory_mirror.py):
copies read while following, the nodes changed after, and a takeover that reads only what changed since adopts
exactly what the nodes hold, as a takeover reading every INVENTORY whole does."""

import asyncio
import os

import pytest
from storenode_harness import free, inventory, member_credential, put, start_node

from kvpool.cluster.etcd_client import EtcdClient
from kvpool.master.leadership import takeover
from kvpool.master.leadership.inventory_mirror import InventoryMirror
from kvpool.master.nodes.node_io import NodeIO
from kvpool.master.table.objects import ObjectTable
from kvpool.net.tcp_link import TcpLink
from kvpool.protocol import cluster_layout
from kvpool.protocol.cluster_layout import NodeRecord, parse_hostport


@pytest.fixture
def two_nodes(etcd, tmp_path):
    nodes = [start_node(etcd, tmp_path, node_id=f"n{i}") for i in (1, 2)]
    yield nodes
    for node in nodes:
        node.stop()


async def registered(etcd: str) -> list[NodeRecord]:
    host, port = parse_hostport(etcd)
    async with EtcdClient(host, port, member_credential()) as client:
        return [NodeRecord.from_json(kv.value)
                for kv in await client.get_prefix(cluster_layout.nodes_prefix(cluster_layout.DEFAULT_CLUSTER))]


async def take_over(etcd: str, mirror_changes, term: int):
    """A table rebuilt as a new leader of `term` does: with a standby's copies read before `mirror_changes()`
    changed the nodes (mirror_changes None: every INVENTORY whole)."""
    records = await registered(etcd)
    link = TcpLink(credential=member_credential())
    host, port = parse_hostport(etcd)
    try:
        mirror = None
        if mirror_changes is not None:
            async with EtcdClient(host, port, member_credential()) as client:
                mirror = InventoryMirror(client, cluster_layout.DEFAULT_CLUSTER, link)
                await mirror.refresh()
                await mirror.refresh()  # a second read: what changed since the first (nothing)
            assert all(len(copy.layers) == 2 for copy in mirror._copies.values())
            mirror_changes()
        node_io = NodeIO(transport=link)
        node_io.term = term
        table = ObjectTable(first_generation=1)
        for record in records:
            table.upsert_node(record)
        nodes = [(r.node_id, r.instance, r.address) for r in records]
        answered, silent = await takeover.inventories(table, node_io, nodes, 10.0, mirror)
        assert len(answered) == 2 and not silent
        takeover.start_adopting(table, node_io, answered, mirror.disputes if mirror else None)
        await takeover.adopt_rest(table, node_io)
        return table, mirror
    finally:
        await link.close()


def contents(table: ObjectTable, keys) -> dict:
    out = {}
    for key in keys:
        version = table.lookup(key)
        if version is not None:
            out[key] = (version.generation, version.checksum, sorted(r.node_id for r in version.replicas))
    return out


def test_a_takeover_from_copies_adopts_what_the_nodes_hold(etcd, two_nodes):
    n1, n2 = two_nodes
    for i in range(200):
        put(n1 if i % 2 else n2, f"k{i}".encode(), 10 + i, os.urandom(100))
    put(n1, b"both", 5, b"same" * 25)
    put(n2, b"both", 5, b"same" * 25)

    def change_the_nodes():
        for i in range(0, 40, 2):
            assert free(n2, f"k{i}".encode(), 10 + i) == 0  # removed (status OK)
        put(n1, b"k1", 900, os.urandom(100))  # a newer generation beside the older (not freed yet)
        put(n2, b"k3", 901, os.urandom(100))  # a newer one on the other node
        for i in range(300, 330):
            put(n2, f"k{i}".encode(), i, os.urandom(100))

    table, mirror = asyncio.run(take_over(etcd, change_the_nodes, term=7))
    keys = [f"k{i}" for i in range(330)] + ["both"]
    from_copies = contents(table, keys)
    assert "k0" not in from_copies and from_copies["k1"][0] == 900 and from_copies["k3"][0] == 901
    assert from_copies["k301"][0] == 301 and from_copies["both"][2] == ["n1", "n2"]
    whole, _ = asyncio.run(take_over(etcd, None, term=8))
    assert from_copies == contents(whole, keys)
    assert {e[0] for e in inventory(n1)} >= {"k1"}  # the nodes still hold what they held
