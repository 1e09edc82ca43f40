"""Partial puts, dead clients, dead nodes and hostile bytes on the data port."""

import asyncio
import os
import socket
import subprocess
import sys
import textwrap
import time

import pytest

from kvpool import Client
from kvpool.protocol.checksum import checksum
from kvpool.client.tcp import TcpTransport
from kvpool.protocol.write_options import WriteOptions
from kvpool.errors import KeyExistsError, KeyNotFoundError, UnavailableError
from kvpool.net.netutil import wait_until
from kvpool.proto import kvpool_pb2, kvpool_pb2_grpc
from storenode_harness import FAIL_FAST, PATIENT_TIMEOUTS, master_channel


def _stub(cluster):
    return kvpool_pb2_grpc.MasterStub(master_channel(cluster.master_address))


def test_object_invisible_between_put_start_and_put_end(cluster, client):
    value = os.urandom(300_000)
    stub = _stub(cluster)
    started = stub.PutStart(kvpool_pb2.PutStartRequest(key="twophase/k", size=len(value),
                                                       checksum=checksum(value)))
    assert started.status == kvpool_pb2.OK
    assert not client.exists("twophase/k")
    replica = started.object.replicas[0]

    async def write():
        transport = TcpTransport()
        try:
            await transport.write(replica.address, b"twophase/k", started.object.generation,
                                  memoryview(value), checksum(value), WriteOptions(seal=replica.seal),
                                  term=started.object.term)
        finally:
            await transport.close()

    asyncio.run(write())
    assert not client.exists("twophase/k")  # bytes are on the node, but not committed
    with pytest.raises(KeyNotFoundError):
        client.get("twophase/k")
    ended = stub.PutEnd(kvpool_pb2.PutEndRequest(key="twophase/k", generation=started.object.generation))
    assert ended.status == kvpool_pb2.OK
    assert client.get("twophase/k") == value
    client.remove("twophase/k")


def test_client_killed_mid_put_leaves_no_stuck_key(cluster, client):
    # A separate process starts a put and is killed before it can end it.
    script = textwrap.dedent(f"""
        import grpc, sys
        from kvpool.security.auth import client_credential
        from kvpool.security.grpc_auth import blocking_channel
        from kvpool.proto import kvpool_pb2, kvpool_pb2_grpc
        stub = kvpool_pb2_grpc.MasterStub(blocking_channel("{cluster.master_address}", client_credential()))
        r = stub.PutStart(kvpool_pb2.PutStartRequest(key="stuck/k", size=4096, checksum=1))
        print("started", r.status, flush=True)
        sys.stdin.read()
    """)
    child = subprocess.Popen([sys.executable, "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             text=True)
    assert child.stdout.readline().strip() == "started 0"
    child.kill()
    child.wait()
    with pytest.raises(KeyExistsError):
        client.put("stuck/k", b"mine")  # the dead client's put still holds the key ...

    def put_succeeds():
        try:
            client.put("stuck/k", b"mine")
            return True
        except KeyExistsError:
            return False

    wait_until(put_succeeds, timeout=15, what="the abandoned put to be reclaimed")  # ... until its timeout
    assert client.get("stuck/k") == b"mine"
    assert cluster.master_stats().reclaimed_puts >= 1
    client.remove("stuck/k")


def test_garbage_and_truncated_frames_leave_the_node_serving(cluster, client):
    client.put("hostile/k", b"precious" * 1000)
    for node in cluster.nodes:
        host, port = node.info["address"].rsplit(":", 1)
        for junk in (os.urandom(4096), b"KV\x01\x02" + b"\x00" * 10, b"GET / HTTP/1.1\r\n\r\n", b""):
            with socket.create_connection((host, int(port)), timeout=5) as sock:
                sock.sendall(junk)
                sock.shutdown(socket.SHUT_WR)
                sock.settimeout(5)
                while sock.recv(65536):  # the node answers with an error or closes; it must not hang
                    pass
        assert node.alive
    assert client.get("hostile/k") == b"precious" * 1000
    client.remove("hostile/k")


def test_killed_storage_node_is_dropped_and_its_objects_fail_fast(own_cluster):
    cluster = own_cluster(nodes=2, lease_ttl=2)
    with Client(cluster.master_address, **PATIENT_TIMEOUTS) as c:
        keys = [f"dead/{i}" for i in range(20)]
        values = [os.urandom(50_000) for _ in keys]
        c.batch_put(keys, values)
        victim = cluster.nodes[0]
        placement = {}
        for node in cluster.master_stats().nodes:
            placement[node.node_id] = node.address
        victim_address = placement[victim.info["node_id"]]
        on_victim = [k for k in keys if _replica_address(cluster, k) == victim_address]
        survivors = [(k, v) for k, v in zip(keys, values) if k not in on_victim]
        assert on_victim and survivors

        victim.kill()
        started = time.monotonic()
        with pytest.raises((UnavailableError, KeyNotFoundError)):
            c.get(on_victim[0])
        assert time.monotonic() - started < FAIL_FAST  # fails fast, does not wait out a timeout
        cluster.wait_for_nodes(1, timeout=15)  # its lease expired: dropped from placement
        for key in on_victim:
            with pytest.raises(KeyNotFoundError):
                c.get(key)
        for key, value in survivors:
            assert c.get(key) == value
        c.put("dead/after", b"new data lands on the survivor")
        assert c.get("dead/after") == b"new data lands on the survivor"


def _replica_address(cluster, key):
    reply = _stub(cluster).GetReplicaList(kvpool_pb2.GetReplicaListRequest(key=key))
    return reply.object.replicas[0].address
