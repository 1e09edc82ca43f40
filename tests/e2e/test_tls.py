"""A cluster that serves TLS on every plane (`kvpool up --tls`): etcd, the master's gRPC and control
ports, the nodes' TCP data path, node-to-node copies; and what a peer without TLS gets."""

import os
import socket
import ssl

import pytest

from kvpool import Client
from kvpool.errors import KvpoolError

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


def test_a_copy_between_nodes_goes_over_tls(tls_cluster):
    with Client(tls_cluster.master_address, transports="tcp", replicas=2) as client:
        value = os.urandom(2 * MiB)
        client.put("tls/two-copies", value)
        assert client.get("tls/two-copies") == value
        node_id = tls_cluster.nodes[0].info["node_id"]
        assert client.drain(node_id) >= 0  # the master COPYs the node's objects to the other one
        assert client.get("tls/two-copies") == value


def test_plain_peers_get_nothing_from_a_tls_cluster(tls_cluster):
    for address in [tls_cluster.nodes[0].info["address"], tls_cluster.master.info["control"]]:
        host, port = address.rsplit(":", 1)
        with socket.create_connection((host, int(port)), timeout=10) as sock:
            sock.sendall(b"KV\x02" + bytes(61))
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
