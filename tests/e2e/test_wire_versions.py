"""Peers of two wire protocols never misread each other (docs/upgrades.md): a node or master that gets a frame of
another version answers once, naming both versions, and closes; a client, node or master that meets a server of
another version raises VersionMismatchError naming both. "Another version" is this release with its wire
protocol set one ahead before anything is imported, in real processes."""

import json
import os
import re
import selectors
import socket
import subprocess
import sys

import pytest

from kvpool import Client
from kvpool.errors import Code, VersionMismatchError
from kvpool.launch.local_cluster import LocalCluster
from kvpool.net.netutil import wait_until
from kvpool.protocol import wire
from kvpool.security import auth

NEXT = wire.VERSION + 1
# This release, speaking the next wire protocol: every module reads wire.VERSION after this assignment.
AHEAD = f"import kvpool.protocol.wire as w; w.VERSION = {NEXT}; "


def ahead(code: str, env=None, **popen) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", AHEAD + code], env=env, **popen)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    with LocalCluster(nodes=1, data_dir=tmp_path_factory.mktemp("versions"), dram_per_node="64MiB") as c:
        yield c


def refusal_to(address: str) -> tuple[int, int, str]:
    """(op, status, message) of what a server answers to a frame of the next wire protocol after its challenge."""
    host, port = address.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        challenge = sock.recv(wire.REPLY.size + auth.NONCE, socket.MSG_WAITALL)
        assert challenge[:3] == wire.MAGIC + bytes([wire.VERSION])
        sock.sendall(wire.REQUEST.pack(wire.MAGIC, NEXT, wire.Op.AUTH, 1, 0, 0, 0, 0, 0, 0))
        header = sock.recv(wire.REPLY.size, socket.MSG_WAITALL)
        magic, version, op, _req, status, _flags, length, _sum = wire.REPLY.unpack(header)
        assert (magic, version) == (wire.MAGIC, wire.VERSION)
        message = sock.recv(length, socket.MSG_WAITALL).decode()
        assert sock.recv(1) == b""  # and closed
    return op, status, message


def test_a_node_and_a_master_answer_a_frame_of_another_wire_protocol_naming_both_and_keep_serving(cluster):
    stats = cluster.master_stats()
    for address in (stats.nodes[0].address, stats.control_address):
        op, status, message = refusal_to(address)
        assert (op, status) == (wire.TURNED_AWAY, Code.PROTOCOL), message
        assert f"speaks wire protocol {NEXT}, this process wire protocol {wire.VERSION}" in message
    with Client(cluster.master_address) as client:
        client.put("versions/served", b"still here")
        assert client.get("versions/served") == b"still here"


def test_a_client_of_another_wire_protocol_raises_a_typed_error_naming_both(cluster):
    code = ("import json; from kvpool import Client\n"
            "try:\n"
            f"    Client({cluster.master_address!r}, timeout=10).put('versions/ahead', b'x')\n"
            "except Exception as exc:\n"
            "    print(json.dumps([type(exc).__name__, str(exc), getattr(exc, 'ours', 0), getattr(exc, 'theirs', 0)]))\n")
    proc = ahead(code, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    out, err = proc.communicate(timeout=60)
    name, message, ours, theirs = json.loads(out.strip().splitlines()[-1])
    assert name == "VersionMismatchError", (message, err)
    assert (ours, theirs) == (NEXT, wire.VERSION)
    assert f"speaks wire protocol {wire.VERSION}, this process wire protocol {NEXT}" in message


def test_a_node_of_another_wire_protocol_is_refused_by_this_release_naming_both(cluster, tmp_path):
    log_path = tmp_path / "ahead.log"
    code = ("import sys; from kvpool.storenode.main import main; "
            f"sys.exit(main(['--etcd', {cluster.etcd_endpoint!r}, '--dram', '16MiB', '--port', '0', "
            "'--node-id', 'ahead', '--lease-ttl', '2']))")
    with open(log_path, "wb") as log:
        proc = ahead(code, stdout=subprocess.PIPE, stderr=log)
    try:
        selector = selectors.DefaultSelector()
        selector.register(proc.stdout, selectors.EVENT_READ)
        line = wait_until(lambda: proc.stdout.readline() if selector.select(0) else None, 30,
                          what="the ahead node's ready line")
        address = re.search(rb"address=(\S+)", line).group(1).decode()
        host, port = address.rsplit(":", 1)
        with socket.create_connection((host, int(port)), timeout=10) as sock:
            with pytest.raises(VersionMismatchError) as caught:
                auth.handshake_blocking(sock, auth.Credential.for_member(os.environ["KVPOOL_TOKEN"]),
                                        f"node {address}")
        assert f"node {address} speaks wire protocol {NEXT}, this process wire protocol {wire.VERSION}" \
            in str(caught.value)
        # The master meets it in etcd and never reads it: its log names the node and both versions, and no
        # put is placed there.
        master_log = cluster.master.log_path
        wait_until(lambda: f"node {address} speaks wire protocol {NEXT}, this process wire protocol "
                   f"{wire.VERSION}" in master_log.read_text(), 30, what="the master's line naming both versions")
        with Client(cluster.master_address) as client:
            for i in range(8):
                client.put(f"versions/placed/{i}", b"x")
                assert client.get(f"versions/placed/{i}") == b"x"
        assert {n.node_id: n.objects for n in cluster.master_stats().nodes}.get("ahead", 0) == 0
    finally:
        proc.kill()
        proc.wait()
