"""A short etcd outage: the cluster keeps serving reads, and writes resume when etcd is back."""

import os

from kvpool import Client
from kvpool.errors import KvpoolError
from kvpool.net.netutil import wait_until


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


def test_a_lone_master_that_loses_leadership_follows_and_leads_again(own_cluster):
    cluster = own_cluster(nodes=2, master_args=["--election-ttl", "2"], lease_ttl=5)
    address = cluster.master.info["address"]
    first_term = cluster.master_stats().term
    values = {f"deposed/{i}": os.urandom(10_000 + i) for i in range(20)}
    with Client(cluster.master_address) as before:
        for key, value in values.items():
            before.put(key, value)
    cluster.etcd.stop()  # longer than the election ttl: the master can no longer know it leads
    try:
        wait_until(lambda: cluster.master_stats().leader == "", timeout=20, interval=0.2,
                   what="the master to step down while etcd is away")
        assert cluster.master.alive
    finally:
        cluster.etcd.start()

    wait_until(lambda: cluster.master_stats().leader == address, timeout=30, interval=0.2,
               what="the master to lead again once etcd is back")
    assert cluster.master_stats().term > first_term
    with Client(cluster.master_address) as after:
        def all_readable():
            try:
                return after.batch_get(list(values)) == list(values.values())
            except KvpoolError:
                return False

        wait_until(all_readable, timeout=20, interval=0.2, what="every object put before the outage to be read")
        for key, value in values.items():
            assert after.get(key) == value
        after.put("deposed/after", b"leading again")
        assert after.get("deposed/after") == b"leading again"
    assert cluster.master.alive and all(node.alive for node in cluster.nodes)
    assert len(cluster.master_stats().nodes) == 2
