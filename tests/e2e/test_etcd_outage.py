"""A short etcd outage: the cluster keeps serving reads, and writes resume when etcd is back."""

import os

from kvpool import Client
from kvpool.errors import KvpoolError
from kvpool.netutil import wait_until


def test_reads_continue_through_a_short_etcd_outage(own_cluster):
    cluster = own_cluster(nodes=2, lease_ttl=5)
    values = {f"outage/{i}": os.urandom(20_000 + i) for i in range(20)}
    with Client(cluster.master_address) as warm:
        for key, value in values.items():
            warm.put(key, value)
        cluster.etcd.stop()  # shorter than the leases (5 s): nobody loses membership or leadership
        try:
            for key, value in values.items():  # cached placements: no master needed
                assert warm.get(key) == value
            with Client(cluster.master_address) as cold:  # no cache: the master answers from memory
                assert cold.batch_get(list(values)) == list(values.values())
        finally:
            cluster.etcd.start()

        def put_works():
            try:
                warm.put("outage/after", b"etcd is back")
                return True
            except KvpoolError:
                return False

        wait_until(put_works, timeout=20, interval=0.2, what="puts to work again once etcd is back")
        assert warm.get("outage/after") == b"etcd is back"
        assert cluster.master.alive and all(node.alive for node in cluster.nodes)
        assert len(cluster.master_stats().nodes) == 2


def test_a_three_member_etcd_cluster_survives_losing_a_member(own_cluster):
    cluster = own_cluster(nodes=2, lease_ttl=2, etcd_members=3)
    assert len(cluster.etcd_servers) == 3
    with Client(cluster.master_address) as c:
        c.put("quorum/before", b"stored with three members")
        cluster.etcd_servers[2].stop()  # a member the components do not talk to: quorum (2 of 3) remains
        c.put("quorum/after", b"stored with two members")  # PutEnd needs a durable etcd record
        assert c.get("quorum/before") == b"stored with three members"
        assert c.get("quorum/after") == b"stored with two members"
        # Leases still expire through the surviving quorum: a dead node is noticed.
        cluster.nodes[1].kill()
        cluster.wait_for_nodes(1, timeout=15)
        c.put("quorum/one-node", b"still placing")
        assert c.get("quorum/one-node") == b"still placing"
