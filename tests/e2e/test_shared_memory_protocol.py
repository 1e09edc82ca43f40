"""The node's side of the shared-memory path, over raw sockets: ATTACH, LOCATE/RELEASE, ALLOCATE/COMMIT; a LOCATE
of a version only the shared tier holds is answered as a READ (TCP or UCX) of it is."""

import asyncio
import importlib.util
import json
import mmap
import os
import socket
import stat
import subprocess

import pytest

from kvpool.security import auth
from kvpool.protocol import wire
from kvpool.protocol.checksum import checksum
from kvpool.errors import Code
from kvpool.net.netutil import wait_until
from kvpool.protocol.wire import Op
from kvpool.sharedfs.files import SharedDir
from kvpool.sharedfs.layout import SharedObject

from storenode_harness import closed_by_node, free, get, inventory, put, read_reply, report, start_node, write_status

pytestmark = pytest.mark.quick  # among the fastest end-to-end tests (tests/tiers.py)
HAVE_UCX = importlib.util.find_spec("ucxx") is not None

MIB = 1024 * 1024


@pytest.fixture(scope="module")
def shared_node(module_etcd, tmp_path_factory):
    started = start_node(module_etcd, tmp_path_factory.mktemp("shm"), dram="4MiB")
    yield started
    started.stop()


@pytest.fixture
def node(shared_node):
    """The module's node, empty: every object a test left is freed after it, and its segment given back
    whole (a pin or an allocation a test left lapses by then) before the next test."""
    yield shared_node
    for key, generation in inventory(shared_node):
        free(shared_node, key.encode(), generation)
    wait_until(lambda: report(shared_node)["tiers"]["dram"]["used"] == 0, wire.LOCATE_LEASE + 10,
               what="the node's segment empty")


def attach(sock: socket.socket):
    sock.sendall(wire.pack_request(Op.ATTACH, 1, b""))
    return read_reply(sock)


def mapped_reply(sock: socket.socket):
    """(status, flags, offset, checksum) of a LOCATE / ALLOCATE reply (an error's message is skipped)."""
    *_, status, flags, length, value_checksum = wire.REPLY.unpack(_recv(sock, wire.REPLY.size))
    if status != Code.OK:
        _recv(sock, length)
    return status, flags, length, value_checksum


def locate(sock: socket.socket, key: bytes, generation: int, length: int):
    sock.sendall(wire.pack_request(Op.LOCATE, 2, key, generation, 0, length))
    return mapped_reply(sock)


def _recv(sock: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        data += sock.recv(n - len(data))
    return data


def attached(node) -> tuple[socket.socket, dict]:
    sock = node.connect()
    _, _, status, _, body = attach(sock)
    assert status == Code.OK, body
    return sock, json.loads(body)


def test_attach_needs_a_credential_and_the_segment_is_private(node):
    with node.connect_raw() as sock:  # no credential: the ATTACH is the refused first frame
        read_reply(sock)  # the challenge
        assert attach(sock)[2] == Code.FORBIDDEN
        assert closed_by_node(sock)
    client = auth.Credential.for_client(auth.client_token(os.environ["KVPOOL_TOKEN"]))
    with node.connect(client) as sock:  # the client role may map the segment
        assert locate(sock, b"k", 1, 10)[0] == Code.FORBIDDEN  # before any ATTACH
        _, _, status, _, body = attach(sock)
        assert status == Code.OK
    offer = json.loads(body)
    assert offer["size"] == 4 * MIB and os.path.exists(offer["path"])
    assert stat.S_IMODE(os.stat(offer["path"]).st_mode) == 0o600  # only the node's user may map it


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run a process as another user")
def test_another_user_cannot_map_the_segment(node):
    sock, offer = attached(node)
    sock.close()
    # A shell, not this venv's python, which that user may not be able to run.
    probe = '( : 3<>"$0" ) 2>/dev/null && echo opened || echo refused'
    result = subprocess.run(["/bin/sh", "-c", probe, offer["path"]], user=65534, capture_output=True,
                            text=True, timeout=30)
    assert result.stdout.strip() == "refused", result.stderr


def test_hello_names_the_offered_transports(node):
    with node.connect() as sock:
        sock.sendall(wire.pack_request(Op.HELLO, 1, b""))
        _, _, status, _, body = read_reply(sock)
    hello = json.loads(body)
    assert status == Code.OK and hello["node_id"] == node.node_id
    assert hello["transports"]["shm"]["size"] == 4 * MIB and "path" not in hello["transports"]["shm"]


def test_locate_maps_the_bytes_and_pins_them_until_release(node):
    value = os.urandom(3 * MIB)
    put(node, b"a", 7, value)
    sock, offer = attached(node)
    with sock, open(offer["path"], "r+b") as f, mmap.mmap(f.fileno(), offer["size"]) as segment:
        status, flags, offset, value_checksum = locate(sock, b"a", 7, len(value))
        assert status == Code.OK and flags & wire.ReplyFlag.MAPPED and value_checksum == checksum(value)
        assert segment[offset:offset + len(value)] == value
        assert locate(sock, b"a", 8, len(value))[0] == Code.STALE  # another generation is never mapped
        # Freed while pinned: the bytes stay where they are, so nothing else fits yet.
        with node.connect() as other:
            other.sendall(wire.pack_request(Op.FREE, 1, b"a", 7))
            assert read_reply(other)[2] == Code.OK
        assert write_status(node, b"b", 1, os.urandom(3 * MIB))[0] == Code.NO_SPACE
        assert segment[offset:offset + len(value)] == value
        sock.sendall(wire.pack_request(Op.RELEASE, 3, b"a", 7))
        # RELEASE is never answered: the next reply on this connection is the PING's.
        sock.sendall(wire.pack_request(Op.PING, 4, b""))
        op, req_id, status, _, body = read_reply(sock)
        assert (op, req_id, body.decode()) == (Op.PING, 4, node.node_id)
    put(node, b"b", 1, os.urandom(3 * MIB))


@pytest.mark.parametrize("how", ["connection closed", "lease over"])
def test_a_pin_never_released_ends_anyway(node, how):
    put(node, b"a", 7, os.urandom(3 * MIB))
    sock, _ = attached(node)
    assert locate(sock, b"a", 7, 3 * MIB)[0] == Code.OK
    with node.connect() as other:
        other.sendall(wire.pack_request(Op.FREE, 1, b"a", 7))
        assert read_reply(other)[2] == Code.OK
    if how == "connection closed":
        sock.close()
    value = os.urandom(3 * MIB)
    wait_until(lambda: write_status(node, b"b", 1, value)[0] == Code.OK, wire.LOCATE_LEASE + 10,
               what="the pinned extent freed")
    sock.close()
    assert get(node, b"b", 1, len(value)) == (Code.OK, value)


def allocate(sock: socket.socket, key: bytes, generation: int, value_checksum: int, length: int):
    sock.sendall(wire.pack_request(Op.ALLOCATE, 5, key, generation, 0, length, value_checksum)
                 + wire.WRITE_OPTIONS.pack(0, 0, 0, wire.NO_SEAL))
    return mapped_reply(sock)


def test_allocate_then_commit_stores_what_the_client_copied_in(node):
    value, wrong = os.urandom(MIB), os.urandom(MIB)
    sock, offer = attached(node)
    with sock, open(offer["path"], "r+b") as f, mmap.mmap(f.fileno(), offer["size"]) as segment:
        status, flags, offset, _ = allocate(sock, b"good", 3, checksum(value), len(value))
        assert status == Code.OK and flags & wire.ReplyFlag.MAPPED
        segment[offset:offset + len(value)] = value
        sock.sendall(wire.pack_request(Op.COMMIT, 6, b"good", 3))
        assert read_reply(sock)[2] == Code.OK
        # Bytes that do not match the checksum given at ALLOCATE are not kept.
        status, _, offset, _ = allocate(sock, b"bad", 3, checksum(value), len(value))
        assert status == Code.OK
        segment[offset:offset + len(wrong)] = wrong
        sock.sendall(wire.pack_request(Op.COMMIT, 7, b"bad", 3))
        assert read_reply(sock)[2] == Code.CHECKSUM_MISMATCH
        sock.sendall(wire.pack_request(Op.COMMIT, 8, b"never-allocated", 3))
        assert read_reply(sock)[2] == Code.NOT_FOUND
        # An allocation its writer abandons (connection gone) is given back.
        assert allocate(sock, b"abandoned", 3, 0, 3 * MIB)[0] == Code.OK
    assert get(node, b"good", 3, len(value)) == (Code.OK, value)
    assert get(node, b"bad", 3, len(value))[0] == Code.NOT_FOUND
    wait_until(lambda: write_status(node, b"later", 1, os.urandom(3 * MIB))[0] == Code.OK, 10,
               what="the abandoned extent freed")


def test_an_allocation_never_committed_is_given_back_while_its_connection_lives(etcd, tmp_path):
    node = start_node(etcd, tmp_path, node_id="n2", dram="4MiB", args=("--frame-timeout", "1"))
    try:
        sock, _offer = attached(node)
        with sock:
            assert allocate(sock, b"hoarded", 3, 0, 3 * MIB)[0] == Code.OK  # then never COMMITted
            # The connection stays open; the room comes back after --frame-timeout anyway.
            wait_until(lambda: write_status(node, b"later", 1, os.urandom(3 * MIB))[0] == Code.OK, 10,
                       what="the uncommitted extent freed")
            sock.sendall(wire.pack_request(Op.COMMIT, 9, b"hoarded", 3))  # too late: nothing to commit
            assert read_reply(sock)[2] == Code.NOT_FOUND
            sock.sendall(wire.pack_request(Op.PING, 10, b""))  # and the connection still serves
            assert read_reply(sock)[2] == Code.OK
        assert get(node, b"later", 1, 3 * MIB)[0] == Code.OK
    finally:
        node.stop()


def test_a_version_only_the_shared_tier_holds_is_located_as_it_is_read(etcd, tmp_path, monkeypatch):
    """A version this node does not hold, with its key held here at no generation, an older or a newer one, is
    answered from the shared tier's file by LOCATE (over the socket, unmapped), READ and a UCX READ alike: the
    file is what says the version stands (the leader has it unlinked before an overwrite of it returns, and a
    newer generation held here may be a put not yet ended). One the tier lacks too gets one answer from all;
    the version held here is still mapped."""
    (tmp_path / "shared").mkdir()
    in_tier = {(b"k", 3): os.urandom(5000), (b"k", 9): os.urandom(7000), (b"elsewhere", 4): os.urandom(3000)}
    with SharedDir(str(tmp_path / "shared"), "default", "peer-node") as peer:  # as another node moved them there
        for (key, generation), value in in_tier.items():
            peer.write(SharedObject(key, generation, len(value), checksum(value), 0, len(value), 0), value)
    monkeypatch.setenv("UCX_TLS", "tcp")
    node = start_node(etcd, tmp_path, node_id="n3", dram="4MiB", args=(
        "--shared-dir", str(tmp_path / "shared"), "--transports", "tcp,shm,ucx" if HAVE_UCX else "tcp,shm"))
    try:
        held = os.urandom(1000)
        put(node, b"k", 6, held)  # generation 6 of key k, in DRAM
        sock, _offer = attached(node)
        with sock:
            for (key, generation), value in in_tier.items():
                status, flags, length, value_checksum = locate(sock, key, generation, len(value))
                assert (status, flags & wire.ReplyFlag.MAPPED, value_checksum) == (Code.OK, 0, checksum(value)), \
                    (key, generation)
                assert _recv(sock, length) == value
                assert get(node, key, generation, len(value)) == (Code.OK, value)
            missing = locate(sock, b"k", 5, 100)[0]  # in neither: answered as a READ of it is
            assert missing in (Code.NOT_FOUND, Code.STALE) and get(node, b"k", 5, 100)[0] == missing
            status, flags, _, value_checksum = locate(sock, b"k", 6, len(held))
            assert (status, bool(flags & wire.ReplyFlag.MAPPED), value_checksum) == (Code.OK, True, checksum(held))
            sock.sendall(wire.pack_request(Op.RELEASE, 3, b"k", 6))
        if HAVE_UCX:
            from test_client_credential_on_every_transport import with_ucx_client

            async def read_over_ucx(transport, address):
                read = {}
                for (key, generation), value in in_tier.items():
                    buf = bytearray(len(value))
                    read[key, generation] = (await transport.read_into(address, key, generation, memoryview(buf)),
                                             bytes(buf))
                return read

            assert with_ucx_client(node, read_over_ucx) == {
                name: (checksum(value), value) for name, value in in_tier.items()}
    finally:
        node.stop()
