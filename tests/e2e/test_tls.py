"""A cluster that serves TLS on every plane (`kvpool up --tls`): etcd, the master's gRPC and control
ports, the nodes' TCP data path, node-to-node copies; and what a peer without TLS gets."""

import os
import socket
import ssl

import pytest
from storenode_harness import client_credential, metric_samples, metric_total

from kvpool import Client
from kvpool.errors import KvpoolError
from kvpool.security.grpc_auth import blocking_channel
from kvpool.net.netutil import wait_until
from kvpool.proto import kvpool_pb2 as pb
from kvpool.proto import kvpool_pb2_grpc

MiB = 1 << 20


@pytest.fixture(scope="module")
def tls_cluster(tmp_path_factory):
    from kvpool.launch.local_cluster import LocalCluster

    with LocalCluster(nodes=2, dram_per_node="96MiB", ssd_per_node="64MiB", tls=True, lease_ttl=2,
                      data_dir=tmp_path_factory.mktemp("tls")) as cluster:
        yield cluster


def test_values_of_every_size_cross_the_tls_data_path_intact(tls_cluster):
    ca = str(tls_cluster.tls_files.ca)
    values = {f"tls/{size}": os.urandom(size) for size in (1, 1000, 64 * 1024 + 3, MiB, 9 * MiB + 7)}
    with Client(tls_cluster.master_address, transports="tcp", tls_ca=ca) as client:
        for key, value in values.items():
            client.put(key, value)
        client.batch_put([f"tls/batch/{i}" for i in range(50)], [os.urandom(20_000) for _ in range(50)])
        for key, value in values.items():
            assert client.get(key) == value
        buffers = [bytearray(20_000) for _ in range(50)]
        assert client.batch_get_into([f"tls/batch/{i}" for i in range(50)], buffers) == [20_000] * 50
        assert client.bytes_by_transport().keys() == {"tcp"}
        # From the SSD tier: what sendfile would send goes through the encryption instead.
        ssd_value = os.urandom(3 * MiB)
        client.put("tls/ssd", ssd_value, tier="ssd")
        assert client.get("tls/ssd") == ssd_value
    with Client(tls_cluster.master_address, transports="tcp", tls_ca=ca) as blocking:  # the inline write path
        blocking.put("tls/inline", b"i" * 5000)
        assert blocking.get("tls/inline") == b"i" * 5000


def test_a_client_finds_the_master_through_etcd_over_tls(tls_cluster):
    with Client(etcd=tls_cluster.etcd_endpoint, tls_ca=str(tls_cluster.tls_files.ca)) as client:
        client.put("tls/by-etcd", b"e" * 3000)
        assert client.get("tls/by-etcd") == b"e" * 3000


def test_a_copy_between_nodes_goes_over_tls(own_cluster):
    """A drain copies a node's only copy to the other node, node to node: it lands there byte-exact, through a
    connection that passed the TLS handshake (a plain peer's attempt is counted as a failed one)."""
    cluster = own_cluster(2, tls=True, metrics=True, dram_per_node="64MiB")
    value = os.urandom(2 * MiB + 5)
    with Client(cluster.master_address, transports="tcp", replicas=1, tls_ca=str(cluster.tls_files.ca)) as client:
        client.put("tls/one-copy", value)
        [holder] = _holders(cluster, "tls/one-copy")
        source, destination = (node for node in sorted(cluster.nodes, key=lambda n: n.info["node_id"] != holder))
        before = metric_samples(cluster.metrics_urls[destination.name])
        assert client.drain(holder) == 1  # the master COPYs the node's one object to the other node

        # The drain is asynchronous: done once the only copy is the one on the other node.
        wait_until(lambda: _holders(cluster, "tls/one-copy") == [destination.info["node_id"]], 20,
                   what="the drained object to live on the other node only")
        after = metric_samples(cluster.metrics_urls[destination.name])
        assert client.get("tls/one-copy") == value
    copies = metric_total(metric_samples(cluster.metrics_urls[source.name]), "kvpool_node_ops_total", op="copy")
    assert copies == 1
    # What arrived on the destination is exactly that one WRITE of the value, received on a TLS connection.
    assert metric_total(after, "kvpool_node_bytes_in_total") - metric_total(before, "kvpool_node_bytes_in_total") \
        == len(value)
    assert metric_total(after, "kvpool_node_ops_total", op="write") - \
        metric_total(before, "kvpool_node_ops_total", op="write") == 1
    handshake_failures = {"name": "kvpool_node_errors_total", "op": "tls", "status": "HANDSHAKE"}
    assert _errors(after, handshake_failures) == 0
    # The destination takes no connection that does not do TLS: a plain peer is refused and counted.
    host, port = destination.info["address"].rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(b"KV\x03" + bytes(61))
        try:
            sock.recv(4096)
        except OSError:
            pass
    wait_until(lambda: _errors(metric_samples(cluster.metrics_urls[destination.name]), handshake_failures) == 1,
               10, what="the plain peer's failed handshake to be counted")


def _holders(cluster, key: str) -> list:
    with blocking_channel(cluster.master_address, client_credential(), tls=cluster.tls_files) as channel:
        answer = kvpool_pb2_grpc.MasterStub(channel).GetReplicaList(pb.GetReplicaListRequest(key=key), timeout=5)
    assert answer.status == pb.OK, answer.message
    return sorted(r.node_id for r in answer.object.replicas)


def _errors(samples: dict, which: dict) -> float:
    labels = {k: v for k, v in which.items() if k != "name"}
    return metric_total(samples, which["name"], **labels)


def test_plain_peers_get_nothing_from_a_tls_cluster(tls_cluster):
    for address in [tls_cluster.nodes[0].info["address"], tls_cluster.master.info["control"]]:
        host, port = address.rsplit(":", 1)
        with socket.create_connection((host, int(port)), timeout=10) as sock:
            sock.sendall(b"KV\x03" + bytes(61))
            sock.settimeout(10)
            try:
                answer = sock.recv(4096)
            except OSError:
                answer = b""
            assert not answer.startswith(b"KV")  # no kvpool frame in clear, ever
    with pytest.raises(KvpoolError):
        with Client(tls_cluster.master_address, tls_ca="", rpc_timeout=3) as plain:
            plain.get("tls/1")


def test_a_server_with_another_ca_is_refused(tls_cluster, tmp_path):
    from kvpool.security.tls import make_local

    other = make_local(tmp_path / "other")
    with pytest.raises((KvpoolError, ssl.SSLError)):
        with Client(tls_cluster.master_address, tls_ca=str(other.ca), transports="tcp", rpc_timeout=3) as client:
            client.get("tls/1")
