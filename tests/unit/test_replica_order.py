"""Client-side replication choices: replicas/min_replicas validation, and the order reads try
replicas in (this host's nodes first, then the master's order)."""

import pytest

from kvpool.client import put_options
from kvpool.client.replica_order import drop_replicas, nearest_first
from kvpool.errors import InvalidArgumentError
from kvpool.proto import kvpool_pb2 as pb


def info(*addresses):
    return pb.ObjectInfo(key="k", replicas=[pb.Replica(node_id=f"n{i}", address=a)
                                            for i, a in enumerate(addresses)])


def test_replica_counts_default_and_bounds():
    assert put_options.replica_counts(None, None, 2) == (2, 0)
    assert put_options.replica_counts(3, 2, 1) == (3, 2)
    for replicas, minimum in ((0, None), (True, None), (2.0, None), (2, 0), (2, 3), (2, True)):
        with pytest.raises(InvalidArgumentError):
            put_options.replica_counts(replicas, minimum, 1)


def test_reads_try_this_hosts_nodes_first_then_the_masters_order():
    placed = info("10.9.9.1:70", "127.0.0.1:71", "10.9.9.2:72", "[::1]:73")
    nearest_first(placed)
    assert [r.node_id for r in placed.replicas] == ["n1", "n3", "n0", "n2"]
    remote = info("10.9.9.1:70", "10.9.9.2:72")
    nearest_first(remote)
    assert [r.node_id for r in remote.replicas] == ["n0", "n1"]


def test_copies_never_written_are_not_read():
    placed = info("127.0.0.1:70", "127.0.0.1:71", "127.0.0.1:72")
    drop_replicas(placed, {"n1": RuntimeError("down")})
    assert [(r.node_id, r.address) for r in placed.replicas] == [("n0", "127.0.0.1:70"), ("n2", "127.0.0.1:72")]
