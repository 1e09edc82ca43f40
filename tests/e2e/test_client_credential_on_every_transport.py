"""What a client's credential may not do to a storage node, on every transport it can reach the node by:
TCP, shared memory (its ATTACH / ALLOCATE frames on the TCP connection) and UCX. A client's WRITE or
ALLOCATE is stored only under the leader's seal over exactly it; a term is believed only from a member (a
client's write carrying a huge term only passes the fence, the node's term stays), and no member-only op is
served to a client (each refused FORBIDDEN, the node still serving)."""

import asyncio
import importlib.util
import os

import pytest
from storenode_harness import (call, client_credential, closed_by_node, get, member_credential, put, read_reply,
                               recv_exact, seal_for, start_node)

from kvpool.security import auth, roles
from kvpool.protocol import wire
from kvpool.net import ucx_common as layout
from kvpool.protocol.checksum import checksum
from kvpool.client.tcp import TcpTransport
from kvpool.errors import Code, KvpoolError
from kvpool.protocol.write_options import WriteOptions
from kvpool.cluster.etcd_client import enable_auth
from kvpool.launch.etcd_server import EtcdServer
from kvpool.protocol.wire import Op

TRANSPORTS = ["tcp", "shm", pytest.param("ucx", marks=pytest.mark.skipif(
    importlib.util.find_spec("ucxx") is None, reason="UCX is an optional extra (kvpool[ucx])"))]
UCX_TLS = "tcp"  # a UCX transport every host has
LEADER_TERM = 5  # what the real master told the node
FORGED_TERM = 10**15  # far ahead of any real term
GUARDED = (b"guarded", 1)
GUARDED_VALUE = b"g" * 5000


@pytest.fixture(scope="module")
def node(tmp_path_factory):
    """One node serving TCP, shared memory and UCX, its term set by a member's REPORT; a guarded object."""
    tmp = tmp_path_factory.mktemp("credential")
    etcd = EtcdServer(tmp / "etcd-data", log_path=tmp / "etcd.log").start()
    try:
        enable_auth(etcd.endpoint, os.environ["KVPOOL_TOKEN"])
        with pytest.MonkeyPatch.context() as env:
            env.setenv("UCX_TLS", UCX_TLS)
            started = start_node(etcd.endpoint, tmp, args=("--transports", "tcp,shm,ucx"))
        try:
            assert call(started, wire.pack_request(Op.REPORT, 1, b"", 0, LEADER_TERM))[2] == Code.OK
            put(started, *GUARDED, GUARDED_VALUE)
            yield started
        finally:
            started.stop()
    finally:
        etcd.stop()


def member_write_status(node, key: bytes, term: int) -> int:
    data = b"m" * 1000
    frame = (wire.pack_request(Op.WRITE, 1, key, 1, term, len(data), checksum(data))
             + wire.WRITE_OPTIONS.pack(0, 0, 0, wire.NO_SEAL) + data)
    return call(node, frame)[2]


def assert_term_and_data_unchanged(node, label: str) -> None:
    """The node still serves, still holds the guarded object, and still takes its leader's term (and
    fences an older one): a client did not raise its term nor free, hold or copy anything."""
    assert member_write_status(node, f"{label}/older".encode(), LEADER_TERM - 1) == Code.NOT_LEADER
    assert member_write_status(node, f"{label}/leader".encode(), LEADER_TERM) == Code.OK
    assert get(node, *GUARDED, len(GUARDED_VALUE)) == (Code.OK, GUARDED_VALUE)


def client_connection(node, attach: bool):
    """A TCP connection that proved the client role; attached for shared memory if asked."""
    sock = node.connect(client_credential())
    if attach:
        sock.sendall(wire.pack_request(Op.ATTACH, 1, b""))
        _op, _req_id, status, _sum, body = read_reply(sock)
        assert status == Code.OK, body
    return sock


def with_ucx_client(node, work, credential=None):
    """work(transport, address) on a UcxTransport that proves `credential` (default: the client role), on a fresh
    event loop."""
    from test_ucx import with_ucx

    address = f"{node.host}:{node.port}"
    credential = credential or client_credential()

    async def ask_hello():
        tcp = TcpTransport(credential=credential)
        try:
            return await tcp.hello(address)
        finally:
            await tcp.close()

    return with_ucx((UCX_TLS, address, asyncio.run(ask_hello())), work, credential=credential)


async def ucx_request(transport, address: str, op: int, key: bytes, generation: int, arg: int):
    """(status, message) of one raw request frame sent on the transport's UCX connection to the node (nothing
    else in flight on it meanwhile, so any request id will do)."""
    peer = await transport._peer(address)
    ucx, req_id = layout.load(), 0xC0FFEE
    low = peer.conn << layout.CONN_SHIFT | req_id
    answer = bytearray(layout.MAX_REPLY)
    reply = peer.progress.track(peer.endpoint.tag_recv(ucx.Array(answer), ucx.Tag(layout.tag_of(layout.REPLY, low))),
                                answer)
    frame = wire.pack_request(op, req_id, key, generation, arg)
    peer.progress.track(peer.endpoint.tag_send(ucx.Array(frame), ucx.Tag(layout.tag_of(layout.REQUEST, low))),
                        frame, future=False)
    await asyncio.wait_for(reply.future, 10)
    *_, reply_op, reply_id, status, _flags, length, _sum = wire.REPLY.unpack_from(answer)
    assert (reply_op, reply_id) == (op, req_id)
    return status, bytes(answer[wire.REPLY.size:wire.REPLY.size + length]).decode()


def client_write_status(node, transport: str, key: bytes, data: bytes, term: int, seal: bytes) -> tuple[int, str]:
    """(status, message) of a client's WRITE (ALLOCATE over shared memory) of generation 7 carrying `seal`."""
    if transport == "ucx":
        async def write(ucx, address):
            try:
                await ucx.write(address, key, 7, memoryview(data), checksum(data), WriteOptions(seal=seal), term=term)
            except KvpoolError as exc:
                return exc.code, str(exc)
            return Code.OK, ""
        return with_ucx_client(node, write)
    with client_connection(node, attach=transport == "shm") as sock:
        op = Op.ALLOCATE if transport == "shm" else Op.WRITE
        sock.sendall(wire.pack_request(op, 2, key, 7, term, len(data), checksum(data))
                     + wire.WRITE_OPTIONS.pack(0, 0, 0, seal) + (data if op == Op.WRITE else b""))
        *_, req_id, status, flags, length, _sum = wire.REPLY.unpack(recv_exact(sock, wire.REPLY.size))
        message = b"" if flags & wire.ReplyFlag.MAPPED else recv_exact(sock, length)  # MAPPED: an offset
        assert req_id == 2, message
        if op == Op.ALLOCATE and status == Code.OK:  # the extent is not wanted: give it back
            sock.sendall(wire.pack_request(Op.RELEASE, 3, key, 7))
    return status, message.decode()


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_client_credential_never_raises_the_nodes_term(node, transport):
    data = os.urandom(4096)
    key = f"forged/{transport}".encode()
    # As if a leader of a term far ahead had placed it (the test holds the secret; a client could not seal it).
    seal = seal_for(node.node_id, key, 7, data, term=FORGED_TERM)
    assert client_write_status(node, transport, key, data, FORGED_TERM, seal)[0] == Code.OK  # passes the fence...
    assert_term_and_data_unchanged(node, f"term-{transport}")  # ...and is not believed


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_client_stores_only_what_the_leader_sealed(node, transport):
    data = os.urandom(4096)
    key = f"unsealed/{transport}".encode()
    seal = seal_for(node.node_id, key, 7, data, term=LEADER_TERM)
    wrong = {"no seal": wire.NO_SEAL, "another node's": seal_for("elsewhere", key, 7, data, term=LEADER_TERM),
             "another cluster's": seal_for(node.node_id, key, 7, data, term=LEADER_TERM, secret="another" * 8),
             "other bytes'": seal_for(node.node_id, key, 7, os.urandom(4096), term=LEADER_TERM)}
    for what, bad in wrong.items():
        status, message = client_write_status(node, transport, key, data, LEADER_TERM, bad)
        assert (status, "seal" in message) == (Code.FORBIDDEN, True), (what, status, message)
    assert get(node, key, 7, len(data))[0] == Code.NOT_FOUND  # nothing of it stored
    assert client_write_status(node, transport, key, data, LEADER_TERM, seal)[0] == Code.OK
    assert_term_and_data_unchanged(node, f"sealed-{transport}")


@pytest.mark.parametrize("op", sorted(roles.MEMBER_OPS), ids=lambda op: op.name)
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_client_credential_never_reaches_a_member_only_op(node, transport, op):
    # Each carries the guarded object's key and a term (HOLD: milliseconds) far ahead of the node's.
    key, generation = GUARDED
    if transport == "ucx":
        async def send(ucx, address):
            refused = await ucx_request(ucx, address, op, key, generation, FORGED_TERM)
            buf = bytearray(len(GUARDED_VALUE))  # the connection still serves this client's reads
            assert await ucx.read_into(address, key, generation, memoryview(buf)) == checksum(GUARDED_VALUE)
            return refused
        status, message = with_ucx_client(node, send)
    else:
        payload = f"{node.host}:{node.port}".encode() if op == Op.COPY else b""
        with client_connection(node, attach=transport == "shm") as sock:
            sock.sendall(wire.pack_request(op, 9, key, generation, FORGED_TERM, len(payload)) + payload)
            _op, req_id, status, _sum, body = read_reply(sock)
            message = body.decode()
            assert req_id == 9 and closed_by_node(sock)
    assert status == Code.FORBIDDEN and "master only" in message, (status, message)
    assert_term_and_data_unchanged(node, f"{op.name}-{transport}")


# -- the whole table: every node op × role over TCP (shared memory's ops ride the same connection), expected
# from kvpool/security/roles.py against seen

NODE_OPS = [op for op in wire.Op if op < 32 and op != Op.AUTH]  # AUTH is the handshake itself
# What a client may send only under the leader's seal over exactly that copy (kvpool/security/placement_seal.py):
# what stores data, admitted by storenode/serving/ops.py NodeOps.admit_write.
SEALED_OPS = frozenset({Op.WRITE, Op.ALLOCATE})
CALLERS = ["client", "client with the leader's seal", "member"]


def expected_answer(op: Op, caller: str) -> str:
    if op in roles.MEMBER_OPS:
        return "served" if caller == "member" else "refused"
    if op in SEALED_OPS:
        return "refused" if caller == "client" else "served"
    return "served"


def seen_answer(node, op: Op, caller: str) -> str:
    """"refused" (FORBIDDEN) or "served" (anything else: answered OK, or with an error of the op's own)."""
    credential = member_credential() if caller == "member" else client_credential()
    key = f"table/{op.name}/{caller}".encode()
    data = b"t" * 2000
    seal = wire.NO_SEAL if caller == "client" else seal_for(node.node_id, key, 1, data, term=LEADER_TERM)
    arg = LEADER_TERM if op in (Op.WRITE, Op.ALLOCATE, Op.REPORT, Op.INVENTORY, Op.EVICTIONS) else 0
    with node.connect(credential) as sock:
        sock.sendall(wire.pack_request(Op.ATTACH, 1, b""))  # shared memory's ops need it first
        assert read_reply(sock)[2] == Code.OK
        if op in (Op.WRITE, Op.ALLOCATE):
            body = wire.WRITE_OPTIONS.pack(0, 0, 0, seal) + (data if op == Op.WRITE else b"")
            frame = wire.pack_request(op, 2, key, 1, arg, len(data), checksum(data)) + body
        elif op in (Op.COPY,):
            target = f"{node.host}:{node.port}".encode()
            frame = wire.pack_request(op, 2, key, 1, arg, len(target)) + target
        elif op in (Op.READ, Op.LOCATE):
            frame = wire.pack_request(op, 2, GUARDED[0], GUARDED[1], 0, len(GUARDED_VALUE))
        else:  # a key nobody stored: harmless to FREE, HOLD or COMMIT
            frame = wire.pack_request(op, 2, key, 1, arg)
        if op == Op.RELEASE:  # never answered: served if the connection goes on
            sock.sendall(frame + wire.pack_request(Op.PING, 3, b""))
            return "served" if read_reply(sock)[1:3] == (3, Code.OK) else "refused"
        sock.sendall(frame)
        *_, req_id, status, flags, length, _sum = wire.REPLY.unpack(recv_exact(sock, wire.REPLY.size))
        if not flags & wire.ReplyFlag.MAPPED:
            recv_exact(sock, length)
        assert req_id == 2
        if flags & wire.ReplyFlag.MAPPED:  # LOCATE or ALLOCATE took a reference: give it back
            sock.sendall(wire.pack_request(Op.RELEASE, 4, key if op == Op.ALLOCATE else GUARDED[0],
                                           1 if op == Op.ALLOCATE else GUARDED[1]))
    return "refused" if status == Code.FORBIDDEN else "served"


def test_every_node_op_by_every_caller_is_served_or_refused_as_the_role_table_says(node):
    expected = {(op.name, caller): expected_answer(op, caller) for op in NODE_OPS for caller in CALLERS}
    seen = {(op.name, caller): seen_answer(node, op, caller) for op in NODE_OPS for caller in CALLERS}
    assert seen == expected
    # EVICTIONS waited out the read grant: the leader reconciles the node (INVENTORY, then REPORT) to renew it.
    for op in (Op.INVENTORY, Op.REPORT):
        assert call(node, wire.pack_request(op, 1, b"", 0, LEADER_TERM))[2] == Code.OK
    assert_term_and_data_unchanged(node, "table")


def expected_over_ucx(op: Op, caller: str) -> str:
    if op in (Op.WRITE, Op.READ):  # the data path UCX carries
        return expected_answer(op, caller)
    if op in roles.MEMBER_OPS and caller != "member":
        return "refused"  # refused as over TCP, before saying UCX does not carry it
    return "not over UCX"


@pytest.mark.skipif(importlib.util.find_spec("ucxx") is None, reason="UCX is an optional extra (kvpool[ucx])")
def test_every_node_op_by_every_caller_over_ucx_is_served_refused_or_sent_to_tcp_as_the_table_says(node):
    expected = {(op.name, caller): expected_over_ucx(op, caller) for op in NODE_OPS for caller in CALLERS}
    seen = {}
    for caller in CALLERS:
        async def every_op(ucx, address):
            for op in NODE_OPS:
                key, data = f"ucx-table/{op.name}/{caller}".encode(), b"u" * 3000
                if op == Op.WRITE:
                    seal = wire.NO_SEAL if caller == "client" else seal_for(node.node_id, key, 1, data,
                                                                              term=LEADER_TERM)
                    try:
                        await ucx.write(address, key, 1, memoryview(data), checksum(data), WriteOptions(seal=seal),
                                        term=LEADER_TERM)
                        status = Code.OK
                    except KvpoolError as exc:
                        status = exc.code
                elif op == Op.READ:
                    buf = bytearray(len(GUARDED_VALUE))
                    try:
                        await ucx.read_into(address, *GUARDED, memoryview(buf))
                        status = Code.OK
                    except KvpoolError as exc:
                        status = exc.code
                else:
                    status, _message = await ucx_request(ucx, address, op, key, 1, 0)
                seen[op.name, caller] = ("refused" if status == Code.FORBIDDEN else
                                         "not over UCX" if status == Code.PROTOCOL else "served")
            return True
        with_ucx_client(node, every_op, member_credential() if caller == "member" else None)
    assert seen == expected
    assert_term_and_data_unchanged(node, "ucx-table")
