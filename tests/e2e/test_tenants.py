"""Tenants on a real cluster (etcd, a master, two nodes offering TCP, shared memory and UCX where installed): each
confined to its own keys on every plane, equal key names two objects, a rotated or deleted token refused at once
(open connections too), and the client token of old seeing no tenant's keys.

The isolation table sends every master call and every node op a caller can make, raw (not through the client
library, which would add the caller's own scope), naming another tenant's stored keys (and the client token's),
at their true generations and sizes: expected "refused" everywhere, seen against it, 0 leaks."""

import importlib.util
import os
import socket
import time

import grpc
import pytest
from storenode_harness import closed_by_node, read_reply, seal_for

from kvpool import Client
from kvpool.client.control_blocking import BlockingControlConnection
from kvpool.errors import Code, ForbiddenError, KvpoolError, UnavailableError
from kvpool.launch.local_cluster import LocalCluster
from kvpool.proto import kvpool_pb2 as pb
from kvpool.proto import kvpool_pb2_grpc
from kvpool.protocol import control, wire
from kvpool.protocol.checksum import checksum
from kvpool.protocol.cluster_layout import parse_hostport
from kvpool.protocol.tenants import scope_of
from kvpool.protocol.wire import Op
from kvpool.protocol.write_options import WriteOptions
from kvpool.security import auth
from kvpool.security.grpc_auth import blocking_channel

HAVE_UCX = importlib.util.find_spec("ucxx") is not None
VALUE_A, VALUE_B, VALUE_PLAIN = b"A" * 5000, b"B" * 7000, b"P" * 3000
KEY = "shared/name"  # what every tenant calls its object


@pytest.fixture(scope="module")
def pool(tmp_path_factory):
    transports = "tcp,shm,ucx" if HAVE_UCX else "tcp,shm"
    with pytest.MonkeyPatch.context() as env:
        env.setenv("UCX_TLS", "tcp")
        with LocalCluster(nodes=2, dram_per_node="64MiB", data_dir=tmp_path_factory.mktemp("tenants"), lease_ttl=2,
                          node_args=["--transports", transports]) as cluster:
            tokens = {name: cluster.add_tenant(name) for name in ("team-a", "team-b")}
            yield cluster, tokens


@pytest.fixture(scope="module")
def stored(pool):
    """Each tenant's object under the same name, and one of the client token's; their placements (a member's
    view: stored key -> (generation, size, node addresses))."""
    cluster, tokens = pool
    with Client(cluster.master_address, token=tokens["team-a"]) as a, \
            Client(cluster.master_address, token=tokens["team-b"]) as b, \
            Client(cluster.master_address, token=cluster.client_token) as plain:
        a.put(KEY, VALUE_A, replicas=2)
        b.put(KEY, VALUE_B, replicas=2)
        plain.put(KEY, VALUE_PLAIN, replicas=2)
    placed = {}
    with blocking_channel(cluster.master_address, auth.Credential.for_member(cluster.secret)) as channel:
        stub = kvpool_pb2_grpc.MasterStub(channel)
        for stored_key in (scope_of("team-a").key(KEY), scope_of("team-b").key(KEY), KEY):
            info = stub.GetReplicaList(pb.GetReplicaListRequest(key=stored_key), timeout=5).object
            placed[stored_key] = (info.generation, info.size, [r.address for r in info.replicas])
    return placed


def test_equal_names_in_two_tenants_are_two_objects(pool, stored):
    cluster, tokens = pool
    with Client(cluster.master_address, token=tokens["team-a"]) as a, \
            Client(cluster.master_address, token=tokens["team-b"]) as b, \
            Client(cluster.master_address, token=cluster.client_token) as plain:
        assert (a.get(KEY), b.get(KEY), plain.get(KEY)) == (VALUE_A, VALUE_B, VALUE_PLAIN)
        assert a.batch_get([KEY, "absent"]) == [VALUE_A, None]
        a.put("only/a", b"x")
        assert a.exists("only/a") and not b.exists("only/a") and not plain.exists("only/a")
        assert b.batch_exists(["only/a", KEY]) == [False, True]
        assert not b.remove("only/a") and a.exists("only/a")  # B removing the name removes nothing of A's
        assert b.remove_prefix("only/") == 0 and a.get("only/a") == b"x"
        assert a.remove_prefix("only/") == 1 and not a.exists("only/a")
        # A tenant gets no shared memory: its mapping holds every tenant's bytes.
        assert set(a.bytes_by_transport()) <= {"tcp", "ucx"} and a.bytes_by_transport().get("shm", 0) == 0
        # Its Stats name the masters and its own figures only.
        stats = a.stats()
        assert not stats.nodes and [t.name for t in stats.tenants] in ([], ["team-a"])


# -- the isolation table: (caller, plane, op, target) -> "refused" expected; seen as it came

CALLERS = ("team-a", "client token")


def credential_of(pool, caller: str) -> auth.Credential:
    cluster, tokens = pool
    return auth.Credential.for_client(tokens["team-a"] if caller == "team-a" else cluster.client_token)


def targets_of(caller: str) -> list:
    """The stored keys a caller must not reach: another tenant's, and (for a tenant) the client token's."""
    other = [scope_of("team-b").key(KEY)]
    return other + ([KEY] if caller == "team-a" else [])


def master_requests(key: str, generation: int, size: int) -> dict:
    """Every master call that names a key, naming `key` (its true generation and size where one is named)."""
    return {
        "PutStart": pb.PutStartRequest(key=key, size=size, checksum=1, overwrite=True),
        "PutEnd": pb.PutEndRequest(key=key, generation=generation),
        "PutRevoke": pb.PutRevokeRequest(key=key, generation=generation),
        "BatchPutStart": pb.BatchPutStartRequest(keys=[key], sizes=[size], checksums=[1]),
        "BatchPutEnd": pb.BatchPutEndRequest(keys=[key], generations=[generation]),
        "BatchPutRevoke": pb.BatchPutRevokeRequest(items=[pb.PutRevokeRequest(key=key, generation=generation)]),
        "GetReplicaList": pb.GetReplicaListRequest(key=key),
        "BatchGetReplicaList": pb.BatchGetReplicaListRequest(keys=[key]),
        "Exists": pb.ExistsRequest(key=key),
        "Exists(hold)": pb.ExistsRequest(key=key, hold_seconds=5),
        "BatchExists": pb.BatchExistsRequest(keys=["mine", key]),
        "Remove": pb.RemoveRequest(key=key),
        "RemoveByPrefix": pb.RemoveByPrefixRequest(prefix=key[:3]),
        "ListKeys": pb.ListKeysRequest(prefix=key[:3]),
        "ListKeys(cursor)": pb.ListKeysRequest(prefix="", cursor=key),
    }


def rpc_name(op: str) -> str:
    return op.split("(")[0]


def over_grpc(pool, caller: str, op: str, request) -> str:
    cluster, _ = pool
    with blocking_channel(cluster.master_address, credential_of(pool, caller)) as channel:
        try:
            answer = getattr(kvpool_pb2_grpc.MasterStub(channel), rpc_name(op))(request, timeout=5)
        except grpc.RpcError as exc:
            return "refused" if exc.code() == grpc.StatusCode.PERMISSION_DENIED else f"error {exc.code()}"
    return f"answered {str(answer)[:120]!r}"


def over_control_port(pool, caller: str, op: str, request, control_address: str) -> str:
    connection = BlockingControlConnection.open(control_address, 5, credential_of(pool, caller))
    try:
        name = rpc_name(op)
        if name == "BatchExists" and not request.hold_seconds:
            found = connection.call(control.LOOKUP, control.pack_keys(list(request.keys)), time.monotonic() + 5)
            return f"answered {found!r}"
        return f"answered {str(connection.call(name, request, time.monotonic() + 5))[:120]!r}"
    except ForbiddenError:
        return "refused"
    except KvpoolError as exc:
        return f"error {type(exc).__name__}: {exc}"
    finally:
        connection.close()


def node_frames(key: bytes, generation: int, size: int, address: str, node_id: str) -> dict:
    """Every node op a client may send that names a key, naming `key` at its true generation and size (a WRITE
    sealed as a leader would for exactly it: the scope alone must refuse it)."""
    data = os.urandom(size)
    seal = seal_for(node_id, key, generation + 1, data)
    return {
        "READ": wire.pack_request(Op.READ, 1, key, generation, 0, size),
        "WRITE": (wire.pack_request(Op.WRITE, 1, key, generation + 1, 0, size, checksum(data))
                  + wire.WRITE_OPTIONS.pack(0, 0, 0, seal) + data),
        "LOCATE": wire.pack_request(Op.LOCATE, 1, key, generation, 0, size),
        "ALLOCATE": (wire.pack_request(Op.ALLOCATE, 1, key, generation + 1, 0, size, checksum(data))
                     + wire.WRITE_OPTIONS.pack(0, 0, 0, seal)),
        "RELEASE": wire.pack_request(Op.RELEASE, 1, key, generation),
        "COMMIT": wire.pack_request(Op.COMMIT, 1, key, generation + 1),
        "HOLD": wire.pack_request(Op.HOLD, 1, key, generation, 5000),
        "FREE": wire.pack_request(Op.FREE, 1, key, generation),
        "COPY": wire.pack_request(Op.COPY, 1, key, generation, 0, len(address)) + address.encode(),
    }


def over_tcp(pool, caller: str, address: str, frame: bytes) -> str:
    host, port = parse_hostport(address)
    with socket.create_connection((host, port), timeout=10) as sock:
        auth.handshake_blocking(sock, credential_of(pool, caller), address)
        sock.sendall(frame)
        _op, _req_id, status, _sum, body = read_reply(sock)
    if status == Code.FORBIDDEN:
        return "refused"
    return f"status {Code(status).name}: {body[:80]!r}"


def node_ids(pool) -> dict:
    cluster, _ = pool
    with Client(cluster.master_address, token=cluster.secret) as operator:
        return {node.address: node.node_id for node in operator.stats().nodes}


def test_no_call_on_any_plane_reaches_another_tenants_keys(pool, stored):
    cluster, _ = pool
    with blocking_channel(cluster.master_address, auth.Credential.for_member(cluster.secret)) as channel:
        control_address = kvpool_pb2_grpc.MasterStub(channel).Stats(pb.StatsRequest(), timeout=5).control_address
    ids = node_ids(pool)
    expected, seen = {}, {}
    for caller in CALLERS:
        for target in targets_of(caller):
            generation, size, addresses = stored[target]
            for op, request in master_requests(target, generation, size).items():
                for plane in ("grpc", "control"):
                    expected[(caller, target, plane, op)] = "refused"
                    seen[(caller, target, plane, op)] = (
                        over_grpc(pool, caller, op, request) if plane == "grpc"
                        else over_control_port(pool, caller, op, request, control_address))
            for address in addresses:
                for op, frame in node_frames(target.encode(), generation, size, address, ids[address]).items():
                    expected[(caller, target, f"tcp {address}", op)] = "refused"
                    seen[(caller, target, f"tcp {address}", op)] = over_tcp(pool, caller, address, frame)
    assert seen == expected
    assert len(seen) >= 3 * (2 * 15 + 2 * 9)  # the table is not empty
    # Nothing of any object changed: each reads back byte-exact, at its generation.
    test_equal_names_in_two_tenants_are_two_objects(pool, stored)
    with Client(cluster.master_address, token=cluster.secret) as operator:
        for stored_key, (generation, size, _) in stored.items():
            assert operator.get(stored_key) == {scope_of("team-a").key(KEY): VALUE_A, KEY: VALUE_PLAIN,
                                                scope_of("team-b").key(KEY): VALUE_B}[stored_key]


@pytest.mark.skipif(not HAVE_UCX, reason="UCX is an optional extra (kvpool[ucx])")
def test_over_ucx_a_tenant_reads_and_writes_only_its_own_keys(pool, stored):
    from test_client_credential_on_every_transport import ucx_request, with_ucx_client

    class Node:  # what with_ucx_client needs of a node
        def __init__(self, address):
            self.host, self.port = parse_hostport(address)

    target = scope_of("team-b").key(KEY)
    generation, size, addresses = stored[target]
    own = scope_of("team-a").key(KEY)
    own_generation, own_size, _ = stored[own]
    for address in addresses:
        async def probe(transport, address=address):
            refused = {Op.READ: await ucx_request(transport, address, Op.READ, target.encode(), generation, 0)}
            data = os.urandom(size)  # sealed as a leader would for exactly it: the scope alone must refuse it
            seal = seal_for(node_ids(pool)[address], target.encode(), generation + 1, data)
            try:
                await transport.write(address, target.encode(), generation + 1, memoryview(data), checksum(data),
                                      WriteOptions(seal=seal))
                refused[Op.WRITE] = (Code.OK, "")
            except KvpoolError as exc:
                refused[Op.WRITE] = (exc.code, str(exc))
            buf = bytearray(own_size)
            mine = await transport.read_into(address, own.encode(), own_generation, memoryview(buf))
            return refused, mine == checksum(VALUE_A)

        refused, read_own = with_ucx_client(Node(address), probe, credential=credential_of(pool, "team-a"))
        assert {op: status for op, (status, _message) in refused.items()} == {Op.READ: Code.FORBIDDEN,
                                                                              Op.WRITE: Code.FORBIDDEN}
        assert read_own


def test_the_client_tokens_key_stream_and_listing_show_no_tenants_keys(pool, stored):
    cluster, tokens = pool
    with blocking_channel(cluster.master_address, credential_of(pool, "client token")) as channel:
        events = kvpool_pb2_grpc.MasterStub(channel).WatchKeys(pb.WatchKeysRequest(prefix=""), timeout=5)
        present = []
        for message in events:
            present.extend(message.present)
            if message.snapshot_done:
                break
        events.cancel()
    assert KEY in present and not any(key.startswith("\x01") for key in present)
    with blocking_channel(cluster.master_address, credential_of(pool, "team-a")) as channel:
        with pytest.raises(grpc.RpcError) as refused:
            next(iter(kvpool_pb2_grpc.MasterStub(channel).WatchKeys(
                pb.WatchKeysRequest(prefix=scope_of("team-b").prefix), timeout=5)))
        assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED


def test_a_rotated_or_deleted_token_is_refused_at_once_on_open_connections(pool):
    cluster, tokens = pool
    token = cluster.add_tenant("team-c")
    nodes = list(node_ids(pool))
    opened = []  # raw connections that proved the token, to every node
    for address in nodes:
        host, port = parse_hostport(address)
        sock = socket.create_connection((host, port), timeout=10)
        auth.handshake_blocking(sock, auth.Credential.for_client(token), address)
        opened.append(sock)
    with Client(cluster.master_address, token=token) as c:
        c.put("k", b"c" * 1000, replicas=2)
        assert c.get("k") == b"c" * 1000  # its connections to the master and both nodes are open now
        with Client(cluster.master_address, token=cluster.secret) as operator:
            [record] = operator.tenants("rotate", "team-c")
        rotated = time.monotonic()
        for sock in opened:  # each node closes the connections of the token at once
            sock.settimeout(2.0)
            assert closed_by_node(sock)
            sock.close()
        refused_after = {}
        for what, call in (("get", lambda: c.get("k")), ("exists", lambda: c.exists("k"))):
            deadline = time.monotonic() + 5
            while time.monotonic() < deadline:
                try:
                    call()
                except ForbiddenError:
                    refused_after[what] = time.monotonic() - rotated
                    break
                except UnavailableError:  # a call in flight when its connection was closed: the next is refused
                    pass
        assert set(refused_after) == {"get", "exists"}, refused_after
        assert max(refused_after.values()) < 2.0, refused_after
    new = auth.tenant_token(cluster.secret, "team-c", record.version)
    from kvpool.net.netutil import wait_until
    wait_until(lambda: cluster.takes(new, nodes), 10, what="the rotated token to be taken")
    with Client(cluster.master_address, token=new) as c:
        assert c.get("k") == b"c" * 1000  # the tenant's objects outlive its token
        with Client(cluster.master_address, token=cluster.secret) as operator:
            operator.tenants("delete", "team-c")
            assert not operator.exists(scope_of("team-c").key("k"))  # freed with the tenant
        deadline = time.monotonic() + 5
        with pytest.raises(ForbiddenError):
            while time.monotonic() < deadline:
                try:
                    c.exists("k")
                except UnavailableError:  # in flight when the master closed its connection: the next is refused
                    pass
    assert not cluster.takes(new, nodes)


def test_a_tenant_is_refused_the_operators_calls(pool):
    cluster, tokens = pool
    with Client(cluster.master_address, token=tokens["team-a"]) as a:
        for call in (lambda: a.drain("anything"), lambda: a.tenants("list"),
                     lambda: a.tenants("create", "team-z"), lambda: a.tenants("rotate", "team-b")):
            with pytest.raises(ForbiddenError, match="operator's call"):
                call()
    with blocking_channel(cluster.master_address, auth.Credential.for_member(cluster.secret)) as channel:
        unknown = kvpool_pb2_grpc.MasterStub(channel).Tenants(
            pb.TenantsRequest(action="create", name="team-z", given=["quota", "bogus"]), timeout=5)
        assert unknown.status == pb.INVALID_ARGUMENT and "unknown tenant limits ['bogus']" in unknown.message
    with Client(cluster.master_address, token=cluster.secret) as operator:
        assert [t.name for t in operator.tenants("list")] == ["team-a", "team-b"]  # nothing made or changed
        assert [t.version for t in operator.tenants("list")] == [1, 1]
