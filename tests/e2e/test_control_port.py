"""The master's binary control port: clients' calls go over it, hostile peers cost only their own
connection, followers redirect to the leader, and a client given one master fails over to the others."""

import os
import socket
import time

import pytest
from kvpool.proto import kvpool_pb2 as pb
from storenode_harness import metric_samples, metric_total

from kvpool import Client
from kvpool.security import auth
from kvpool.protocol import control, wire
from kvpool.errors import Code
from kvpool.net.netutil import wait_until

FAST_ELECTION = ["--election-ttl", "2"]
RPC_BY_OP = {int(op): name for name, op in control.OP_BY_RPC.items()}  # a reply's op -> the RPC it answers
FRAME_TIMEOUT = 3.0  # long enough that a client's put on two busy cores ends well inside it


def connect(address: str, credential="client") -> socket.socket:
    """A connection that proved `credential` ("client": the client token of $KVPOOL_TOKEN; None: none,
    the master's challenge left unread)."""
    host, port = address.rsplit(":", 1)
    sock = socket.create_connection((host, int(port)), timeout=10)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    if credential == "client":
        credential = auth.client_credential()
    if credential is not None:
        auth.handshake_blocking(sock, credential, f"master {address}")
    return sock


def frame(method: str, req_id: int, request) -> bytes:
    return control.pack_call(control.OP_BY_RPC[method], req_id, request.SerializeToString())


def read_reply(sock: socket.socket):
    """(op, req_id, status, body) of the next reply, or None when the master closed the connection."""
    try:
        header = sock.recv(wire.REPLY.size, socket.MSG_WAITALL)
        if len(header) < wire.REPLY.size:
            return None
        magic, version, op, req_id, status, _flags, length, _sum = wire.REPLY.unpack(header)
        assert (magic, version) == (wire.MAGIC, wire.VERSION)
        body = sock.recv(length, socket.MSG_WAITALL) if length else b""
    except ConnectionResetError:
        return None
    return op, req_id, status, body


def closed_by_master(sock: socket.socket) -> bool:
    """Whether the master closed this connection (after any replies it still sent)."""
    while True:
        reply = read_reply(sock)
        if reply is None:
            return True


@pytest.fixture(scope="module")
def port_cluster(tmp_path_factory):
    from kvpool.launch.local_cluster import LocalCluster

    with LocalCluster(nodes=1, dram_per_node="128MiB", data_dir=tmp_path_factory.mktemp("control"), metrics=True,
                      lease_ttl=2, master_args=["--control-frame-timeout", str(FRAME_TIMEOUT)]) as running:
        yield running


def test_hot_calls_go_over_the_control_port_on_one_connection(port_cluster):
    url = port_cluster.metrics_urls["master"]
    before = metric_samples(url)
    value = os.urandom(64 * 1024)
    with Client(port_cluster.master_address) as client:
        for i in range(20):  # blocking calls, each running the client's loop anew
            client.put(f"hot/{i}", value)
        assert client.get("hot/3") == value
        assert client.exists("hot/4") and client.batch_exists(["hot/5", "hot/none"]) == [True, False]
        client.batch_put([f"hot/b{i}" for i in range(5)], [value] * 5)
        assert client.batch_get([f"hot/b{i}" for i in range(5)]) == [value] * 5
        client.remove("hot/0")
        assert len(client.list_keys("hot/")[0]) == 24
        assert client.remove_prefix("hot/") == 24
    with Client(etcd=port_cluster.etcd_endpoint) as client:  # learns the port from the leader's etcd record
        client.put("hot/etcd", value)
        assert client.exists("hot/etcd")
    after = metric_samples(url)
    # A blocking batch_exists without a hold is a Lookup (the lean frame, control.LOOKUP).
    for method in ("PutStart", "PutEnd", "Exists", "Lookup", "BatchPutStart", "BatchPutEnd", "Remove",
                   "RemoveByPrefix", "ListKeys"):
        served = metric_total(after, "kvpool_master_rpcs_total", method=method) - metric_total(
            before, "kvpool_master_rpcs_total", method=method)
        over_port = metric_total(after, "kvpool_master_control_requests_total", method=method) - metric_total(
            before, "kvpool_master_control_requests_total", method=method)
        assert served > 0 and over_port == served, method
    # One persistent connection per client, kept between the blocking calls.
    accepted = metric_total(after, "kvpool_master_control_accepted_total") - metric_total(
        before, "kvpool_master_control_accepted_total")
    assert accepted == 2


def test_an_async_clients_lookup_goes_in_the_lean_frame_and_sees_its_own_posted_puts(port_cluster):
    import asyncio

    from kvpool import AsyncClient
    from kvpool.errors import InvalidKeyError

    url = port_cluster.metrics_urls["master"]
    keys = [f"alookup/{i}" for i in range(16)]

    async def scenario():
        async with AsyncClient(port_cluster.master_address) as client:
            await client.put("alookup/warm", b"w" * 100)  # the leader's control port is known from here on
            before = metric_samples(url)
            assert await client.batch_exists(keys) == [False] * 16
            for i, key in enumerate(keys[:4]):
                await client.put(key, bytes([i]) * 1000)  # its PutEnd is posted: the lookup right after sees it
                assert await client.batch_exists(keys) == [k in keys[:i + 1] for k in keys]
            assert await client.batch_exists([]) == []
            with pytest.raises(InvalidKeyError):
                await client.batch_exists(["alookup/fine", "nul\x00key"])
            after = metric_samples(url)
            await client.remove_prefix("alookup/")
        return before, after

    before, after = asyncio.run(scenario())

    def served(method):
        return metric_total(after, "kvpool_master_rpcs_total", method=method) - metric_total(
            before, "kvpool_master_rpcs_total", method=method)

    assert served("Lookup") == 5 and served("BatchExists") == 0


def test_pipelined_calls_take_effect_in_arrival_order(port_cluster):
    with Client(port_cluster.master_address) as client:
        client.put("order/a", b"x" * 100)
    with connect(port_cluster.master.info["control"]) as sock:
        # Sent in one write: the Remove takes effect before the Exists behind it is answered.
        sock.sendall(frame("Remove", 1, pb.RemoveRequest(key="order/a"))
                     + frame("Exists", 2, pb.ExistsRequest(key="order/a"))
                     + b"".join(frame("PutStart", 10 + i, pb.PutStartRequest(key=f"order/p{i}", size=10, checksum=1))
                                for i in range(50)))
        replies = {}
        while len(replies) < 52:
            op, req_id, status, body = read_reply(sock)
            assert status == Code.OK
            replies[req_id] = control.MESSAGES[RPC_BY_OP[op]][1].FromString(body)
    assert replies[1].status == pb.OK and replies[1].removed == 1
    assert replies[2].status == pb.OK and replies[2].exists is False
    assert {replies[10 + i].object.key for i in range(50)} == {f"order/p{i}" for i in range(50)}


def served_meanwhile(cluster, key: str, held: socket.socket | None = None) -> None:
    """Another client is served whatever the hostile connection is doing; with `held`, while the master still
    holds that connection open (not once its frame timeout has closed it)."""
    with Client(cluster.master_address) as client:
        client.put(key, b"still serving")
        assert client.exists(key)
    if held is not None:
        held.setblocking(False)
        try:
            with pytest.raises(BlockingIOError):  # nothing to read and not closed: still held
                held.recv(1, socket.MSG_PEEK)
        finally:
            held.settimeout(10)


def test_hostile_input_costs_only_its_own_connection(port_cluster):
    address = port_cluster.master.info["control"]
    url = port_cluster.metrics_urls["master"]
    before = metric_samples(url)
    # Garbage: not a frame at all; the connection is closed, nothing answered.
    with connect(address) as sock:
        sock.sendall(b"GET / HTTP/1.1\r\nHost: master\r\n\r\n" + os.urandom(64))
        assert read_reply(sock) is None
    served_meanwhile(port_cluster, "hostile/1")
    # A body over the limit: refused, typed, then closed.
    with connect(address) as sock:
        sock.sendall(wire.REQUEST.pack(wire.MAGIC, wire.VERSION, wire.Op.PUT_START, 7, 0, 0, 0, 0, 1 << 40, 0))
        op, req_id, status, _body = read_reply(sock)
        assert (op, req_id, status) == (wire.Op.PUT_START, 7, Code.TOO_LARGE)
        assert closed_by_master(sock)
    # An undecodable body and an unknown op are answered, typed; the connection goes on serving.
    with connect(address) as sock:
        sock.sendall(control.pack_call(wire.Op.PUT_START, 1, b"\x0a\xff\xff")
                     + control.pack_call(99, 2, b"whatever")
                     + frame("Exists", 3, pb.ExistsRequest(key="hostile/1")))
        replies = {req_id: (status, body) for _op, req_id, status, body in (read_reply(sock) for _ in range(3))}
        assert replies[1][0] == Code.INVALID_ARGUMENT and b"undecodable" in replies[1][1]
        assert replies[2][0] == Code.PROTOCOL
        assert replies[3][0] == Code.OK and pb.ExistsResponse.FromString(replies[3][1]).exists
    # A frame whose body stalls: others are served meanwhile; it is closed after the frame timeout.
    with connect(address) as sock:
        sock.sendall(wire.REQUEST.pack(wire.MAGIC, wire.VERSION, wire.Op.PUT_START, 1, 0, 0, 0, 0, 100, 0) + b"\x0a")
        stalled_at = time.monotonic()
        served_meanwhile(port_cluster, "hostile/2", held=sock)
        assert closed_by_master(sock)
        assert FRAME_TIMEOUT * 0.9 <= time.monotonic() - stalled_at < FRAME_TIMEOUT + 5
    served_meanwhile(port_cluster, "hostile/3")
    after = metric_samples(url)
    for reason in ("bad_frame", "too_large", "undecodable", "protocol", "stalled"):
        refused = metric_total(after, "kvpool_master_control_refused_total", reason=reason) - metric_total(
            before, "kvpool_master_control_refused_total", reason=reason)
        assert refused == 1, reason


def test_a_follower_redirects_to_the_leader(own_cluster):
    cluster = own_cluster(nodes=1, masters=2, master_args=FAST_ELECTION)
    leader, follower = cluster.masters
    with connect(follower.info["control"]) as sock:
        sock.sendall(frame("PutStart", 5, pb.PutStartRequest(key="k", size=10, checksum=1)))
        op, req_id, status, body = read_reply(sock)
    assert (op, req_id, status) == (wire.Op.PUT_START, 5, Code.NOT_LEADER)
    assert control.parse_not_leader(body) == (leader.info["address"], leader.info["control"])
    # A client given only the follower goes to the leader's control port, told so by the follower.
    with Client(follower.info["address"]) as client:
        client.put("via-follower", b"abc")
        assert client.get("via-follower") == b"abc"


def test_a_client_given_one_master_fails_over_to_the_others(own_cluster):
    cluster = own_cluster(nodes=1, masters=2, master_args=FAST_ELECTION)
    leader, follower = cluster.masters
    # The leader reads the standby masters from etcd every third of the election ttl; a client that
    # asks before that learns of no other master to fail over to.
    wait_until(lambda: follower.info["address"] in cluster.master_stats().followers, 10,
               what="the leader to list the standby master")
    # The address `kvpool up --masters 2` prints: the first master's alone.
    with Client(cluster.master_address, rpc_timeout=20, timeout=20) as client:
        client.put("before-kill", b"v" * 1000)
        leader.kill()
        killed_at = time.monotonic()
        assert client.exists("before-kill")  # the new leader learns it from the node
        client.put("after-kill", b"w" * 1000)
        assert client.get("after-kill") == b"w" * 1000
        took = time.monotonic() - killed_at
    assert took < 15, f"the client took {took:.1f}s to reach the new leader"
    assert cluster.master_stats().leader == follower.info["address"]


def test_a_restarted_master_is_found_on_its_new_control_port(own_cluster):
    from kvpool.net.netutil import free_port

    cluster = own_cluster(nodes=1, master_port=free_port())
    with Client(cluster.master_address) as client:
        client.put("kept", b"k" * 1000)
        old_control = cluster.master.info["control"]
        cluster.restart_master(0)  # same gRPC port, a new control port; the client's connection sat idle
        assert cluster.master.info["control"] != old_control
        assert client.exists("kept")
        client.put("new", b"n" * 1000)
