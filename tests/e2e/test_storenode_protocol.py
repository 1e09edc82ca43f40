"""A real storage node process and a real etcd, driven over raw sockets with the data protocol."""

import asyncio
import os
import re
import selectors
import signal
import socket
import stat
import subprocess
import sys
from dataclasses import dataclass

import aetcd
import pytest

from kvpool import wire
from kvpool.checksum import checksum
from kvpool.cluster_layout import NodeRecord, node_key, parse_hostport
from kvpool.errors import Code
from kvpool.netutil import wait_until
from kvpool.wire import Op

SEGMENT = 64 * 1024 * 1024
_READY = re.compile(rb"^kvpool-storenode ready node_id=(\S+) address=(\S+):(\d+)$")


@dataclass
class Node:
    proc: subprocess.Popen
    node_id: str
    host: str
    port: int
    log_path: str

    def connect(self) -> socket.socket:
        return socket.create_connection((self.host, self.port), timeout=10)


def start_node(etcd: str, tmp_path, node_id: str = "n1", lease_ttl: int = 30) -> Node:
    # A long lease by default: a record that vanishes at once on SIGTERM was revoked, not expired.
    log_path = str(tmp_path / f"{node_id}.log")
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "kvpool.storenode", "--etcd", etcd, "--dram", "64MiB", "--port", "0",
             "--node-id", node_id, "--lease-ttl", str(lease_ttl)],
            stdout=subprocess.PIPE, stderr=log)
    selector = selectors.DefaultSelector()
    selector.register(proc.stdout, selectors.EVENT_READ)

    def ready_line():
        if selector.select(0):
            line = proc.stdout.readline()
            if line:
                return line
        if proc.poll() is not None:
            raise RuntimeError(f"storenode exited with {proc.returncode}: {open(log_path).read()}")
        return None

    try:
        line = wait_until(ready_line, 20, what="storenode ready line")
    except BaseException:
        proc.kill()
        proc.wait()
        raise
    match = _READY.match(line.strip())
    assert match, line
    assert match.group(1).decode() == node_id
    return Node(proc, node_id, match.group(2).decode(), int(match.group(3)), log_path)


@pytest.fixture
def node(etcd, tmp_path):
    n = start_node(etcd, tmp_path)
    yield n
    if n.proc.poll() is None:
        n.proc.kill()
    n.proc.wait()
    n.proc.stdout.close()
    assert "Traceback" not in open(n.log_path).read()  # bad input never reached an unhandled error


# -- raw protocol helpers

def recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise ConnectionError(f"closed after {len(buf)} of {n} bytes")
        buf += chunk
    return bytes(buf)


def read_reply(sock: socket.socket):
    """(op, req_id, status, checksum, payload) of the next reply."""
    magic, version, op, req_id, status, length, value_checksum = wire.REPLY.unpack(recv_exact(sock, wire.REPLY.size))
    assert (magic, version) == (wire.MAGIC, wire.VERSION)
    return op, req_id, status, value_checksum, recv_exact(sock, length)


def write_frame(key: bytes, generation: int, offset: int, data: bytes, req_id: int = 1, value_checksum=None) -> bytes:
    cs = checksum(data) if value_checksum is None else value_checksum
    return wire.pack_request(Op.WRITE, req_id, key, generation, offset, len(data), cs) + data


def read_frame(key: bytes, generation: int, offset: int, length: int, req_id: int = 1) -> bytes:
    return wire.pack_request(Op.READ, req_id, key, generation, offset, length)


def call(node: Node, frame: bytes):
    with node.connect() as sock:
        sock.sendall(frame)
        return read_reply(sock)


def put(node: Node, key: bytes, generation: int, offset: int, data: bytes) -> None:
    assert call(node, write_frame(key, generation, offset, data))[2] == Code.OK


def get(node: Node, key: bytes, generation: int, offset: int, length: int):
    """(status, payload) of a READ on a fresh connection."""
    _, _, status, _, payload = call(node, read_frame(key, generation, offset, length))
    return status, payload


def closed_by_node(sock: socket.socket) -> bool:
    """True once the node closes the connection (replies sent before that are skipped)."""
    try:
        while sock.recv(65536):
            pass
        return True
    except ConnectionResetError:
        return True
    except socket.timeout:
        return False


def etcd_get(endpoint: str, key: bytes):
    async def fetch():
        host, port = parse_hostport(endpoint)
        async with aetcd.Client(host=host, port=port) as client:
            return await client.get(key)
    return asyncio.run(fetch())


# -- tests

def test_write_then_read_round_trip_is_byte_exact(node):
    offset = 0
    for i, size in enumerate([1, 100, 4096, 65536, 65537, 300_000, 3 * 1024 * 1024 + 5]):
        data = os.urandom(size)
        put(node, b"obj-%d" % i, 100 + i, offset, data)
        with node.connect() as sock:
            sock.sendall(read_frame(b"obj-%d" % i, 100 + i, offset, size, req_id=7))
            op, req_id, status, value_checksum, payload = read_reply(sock)
        assert (op, req_id, status) == (Op.READ, 7, Code.OK)
        assert value_checksum == checksum(data)
        assert payload == data, f"size {size}"
        offset += size


def test_pipelined_requests_get_replies_in_order(node):
    small, big = os.urandom(1000), os.urandom(700_000)  # big is larger than the node's staging buffer
    frames = [
        write_frame(b"a", 1, 0, small, req_id=1),
        write_frame(b"b", 1, 4096, big, req_id=2),
        read_frame(b"a", 1, 0, len(small), req_id=3),
        wire.pack_request(Op.PING, 4, b""),
        read_frame(b"b", 1, 4096, len(big), req_id=5),
        read_frame(b"a", 2, 0, len(small), req_id=6),
        wire.pack_request(Op.FREE, 7, b"a", 1, 0),
        read_frame(b"a", 1, 0, len(small), req_id=8),
    ]
    with node.connect() as sock:
        sock.sendall(b"".join(frames) + b"garbage that ends the connection".ljust(wire.REQUEST.size))
        replies = [read_reply(sock) for _ in frames]
        assert closed_by_node(sock)
    assert [r[1] for r in replies] == list(range(1, 9))
    assert [r[2] for r in replies] == [Code.OK, Code.OK, Code.OK, Code.OK, Code.OK, Code.STALE, Code.OK, Code.STALE]
    assert replies[2][4] == small
    assert replies[3][4] == node.node_id.encode()
    assert replies[4][4] == big


def test_stale_reads_and_frees(node):
    data = os.urandom(5000)
    put(node, b"k", 10, 8192, data)
    assert get(node, b"k", 11, 8192, len(data))[0] == Code.STALE
    assert get(node, b"other", 10, 8192, len(data))[0] == Code.STALE
    assert get(node, b"k", 10, 8192, len(data) - 1)[0] == Code.STALE
    assert call(node, wire.pack_request(Op.FREE, 1, b"k", 11, 8192))[2] == Code.NOT_FOUND
    assert get(node, b"k", 10, 8192, len(data)) == (Code.OK, data)
    assert call(node, wire.pack_request(Op.FREE, 1, b"k", 10, 8192))[2] == Code.OK
    status, message = get(node, b"k", 10, 8192, len(data))
    assert status == Code.STALE and message  # error replies carry a message
    assert call(node, wire.pack_request(Op.FREE, 1, b"k", 10, 8192))[2] == Code.NOT_FOUND


def test_overlapping_write_makes_older_extent_stale(node):
    put(node, b"old", 1, 0, os.urandom(1000))
    put(node, b"new", 2, 500, os.urandom(1000))
    assert get(node, b"old", 1, 0, 1000)[0] == Code.STALE
    assert get(node, b"new", 2, 500, 1000)[0] == Code.OK


def test_bad_checksum_is_refused_and_not_readable(node):
    data = os.urandom(200_000)
    with node.connect() as sock:
        sock.sendall(write_frame(b"k", 1, 0, data, req_id=3, value_checksum=checksum(data) ^ 1))
        assert read_reply(sock)[1:3] == (3, Code.CHECKSUM_MISMATCH)
        # The whole payload was consumed, so the connection stays in step.
        sock.sendall(read_frame(b"k", 1, 0, len(data), req_id=4))
        assert read_reply(sock)[1:3] == (4, Code.STALE)


def test_out_of_range_extents_get_error_replies(node):
    with node.connect() as sock:
        sock.sendall(read_frame(b"k", 1, SEGMENT - 10, 11, req_id=1) + wire.pack_request(Op.PING, 2, b""))
        assert read_reply(sock)[1:3] == (1, Code.INVALID_ARGUMENT)
        assert read_reply(sock)[1:3] == (2, Code.OK)  # a bad READ leaves the connection usable
    for offset, length in [(SEGMENT - 10, 11), (2**63, 10), (0, 0)]:
        with node.connect() as sock:
            sock.sendall(wire.pack_request(Op.WRITE, 9, b"k", 1, offset, length, 0) + b"x" * min(length, 11))
            assert read_reply(sock)[1:3] == (9, Code.INVALID_ARGUMENT)
            assert closed_by_node(sock), (offset, length)  # its payload can't be trusted


def _header(**fields) -> bytes:
    values = dict(magic=wire.MAGIC, version=wire.VERSION, op=Op.READ, req_id=1, key_len=1, flags=0,
                  generation=1, offset=0, length=1, checksum=0)
    values.update(fields)
    return wire.REQUEST.pack(*values.values())


def test_malformed_input_closes_only_that_connection(node):
    reference = os.urandom(100_000)
    put(node, b"ref", 1, 1 << 20, reference)
    payload = os.urandom(50_000)
    cases = {
        "garbage": (os.urandom(64), False),
        "bad magic": (_header(magic=b"XX") + b"k", False),
        "bad version": (_header(version=99) + b"k", False),
        "huge key_len": (_header(key_len=60_000) + b"k" * 100, False),
        "unknown op": (_header(op=77) + b"k", False),
        "truncated header": (_header()[:10], True),
        "truncated key": (_header(key_len=50) + b"k" * 10, True),
        "truncated write payload": (write_frame(b"w", 1, 0, payload)[:-20_000], True),
    }
    for name, (data, then_hang_up) in cases.items():
        with node.connect() as sock:
            sock.sendall(data)
            if then_hang_up:  # the peer leaves mid-frame
                sock.shutdown(socket.SHUT_WR)
            assert closed_by_node(sock), name
        assert node.proc.poll() is None, name
        assert get(node, b"ref", 1, 1 << 20, len(reference)) == (Code.OK, reference), name
    # The truncated WRITE was never recorded.
    assert get(node, b"w", 1, 0, len(payload))[0] == Code.STALE


def test_unknown_op_gets_a_protocol_error_before_close(node):
    with node.connect() as sock:
        sock.sendall(_header(op=77, req_id=5) + b"k")
        assert read_reply(sock)[1:3] == (5, Code.PROTOCOL)
        assert closed_by_node(sock)


def test_registers_in_etcd_and_leaves_on_sigterm(etcd, node):
    got = wait_until(lambda: etcd_get(etcd, node_key("default", node.node_id)), 10, what="node record")
    record = NodeRecord.from_json(got.value)
    assert (record.node_id, record.address, record.pid) == (node.node_id, f"{node.host}:{node.port}", node.proc.pid)
    segment = record.tiers["dram"]
    assert segment.capacity == SEGMENT
    assert segment.path or not os.path.isdir("/dev/shm")
    if segment.path:  # /dev/shm backing: private to the node's user
        assert stat.S_IMODE(os.stat(segment.path).st_mode) == 0o600
        assert os.path.basename(segment.path) == f"kvpool-default-{node.node_id}-{record.instance}"

    node.proc.send_signal(signal.SIGTERM)
    assert node.proc.wait(15) == 0
    # The lease is 30 s, so a record gone right away means it was revoked on the way out.
    assert etcd_get(etcd, node_key("default", node.node_id)) is None
    assert not segment.path or not os.path.exists(segment.path)


def test_registers_again_after_losing_its_lease(etcd, tmp_path):
    node = start_node(etcd, tmp_path, node_id="n2", lease_ttl=3)
    try:
        key = node_key("default", "n2")
        first = etcd_get(etcd, key)
        host, port = parse_hostport(etcd)

        async def revoke():
            async with aetcd.Client(host=host, port=port) as client:
                await client.revoke_lease(first.lease)
        asyncio.run(revoke())

        again = wait_until(lambda: etcd_get(etcd, key), 10, what="node to register again")
        assert again.lease != first.lease
        assert NodeRecord.from_json(again.value).address == f"{node.host}:{node.port}"
        node.proc.send_signal(signal.SIGINT)
        assert node.proc.wait(15) == 0
    finally:
        if node.proc.poll() is None:
            node.proc.kill()
        node.proc.wait()
        node.proc.stdout.close()
