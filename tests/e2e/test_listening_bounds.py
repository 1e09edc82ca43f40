"""What bounds the master's gRPC port (grpc core's own options, master/main.py grpc_bounds) and every server's
descriptor limit (kvpool/runtime/process.py descriptor_budget; one too low to serve refuses to start), on real
processes. The node and control ports'
unproved pools and deadlines are benchmarks/hostile_sockets.py's cases (tests/e2e/test_hostile_peers.py)."""

import resource
import select
import socket
import subprocess
import sys
import time

from storenode_harness import member_credential

from kvpool.net.netutil import wait_until
from kvpool.proto import kvpool_pb2 as pb
from kvpool.proto import kvpool_pb2_grpc
from kvpool.security.grpc_auth import blocking_channel

# An HTTP/2 client's connection preface and an empty SETTINGS frame: the gRPC handshake done, then silence.
PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + b"\x00\x00\x00\x04\x00\x00\x00\x00\x00"


def _hostport(address: str) -> tuple[str, int]:
    host, port = address.rsplit(":", 1)
    return host, int(port)


def _closed_within(socks: list, seconds: float) -> int:
    """How many of `socks` the peer closes within `seconds` (what it sends is read and dropped)."""
    open_, deadline = list(socks), time.monotonic() + seconds
    while open_ and time.monotonic() < deadline:
        readable, _, _ = select.select(open_, [], [], 0.05)
        for sock in readable:
            try:
                gone = not sock.recv(65536)
            except OSError:
                gone = True
            if gone:
                open_.remove(sock)
    return len(socks) - len(open_)


def _stats(address: str) -> None:
    with blocking_channel(address, member_credential()) as channel:
        kvpool_pb2_grpc.MasterStub(channel).Stats(pb.StatsRequest(), timeout=5)


def test_grpc_closes_connections_past_its_cap_silent_ones_and_idle_ones(own_cluster):
    cluster = own_cluster(1, master_args=["--grpc-max-connections", "8", "--grpc-handshake-timeout", "1",
                                          "--grpc-idle-timeout", "2"])
    address = cluster.master_address
    flood = [socket.create_connection(_hostport(address), timeout=5) for _ in range(20)]
    try:
        # Past the cap, closed on accept; the rest, which never send the HTTP/2 preface, at the handshake timeout.
        assert _closed_within(flood, 0.5) >= 20 - 8
        assert _closed_within(flood, 3.0) == 20
        wait_until(lambda: _stats(address) is None, 5, what="a real call served once the flood is gone")
    finally:
        for sock in flood:
            sock.close()
    with socket.create_connection(_hostport(address), timeout=5) as idle:
        idle.sendall(PREFACE)  # a finished handshake and no call: closed after --grpc-idle-timeout
        started = time.monotonic()
        assert _closed_within([idle], 10) == 1
        assert 1.0 < time.monotonic() - started < 5


def test_every_server_raises_its_descriptor_limit_to_the_hard_one(own_cluster):
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    low = min(soft, 1024, hard)
    resource.setrlimit(resource.RLIMIT_NOFILE, (low, hard))  # what the children inherit
    try:
        cluster = own_cluster(1)
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    for child in (cluster.master, cluster.nodes[0]):
        with open(f"/proc/{child.proc.pid}/limits") as f:
            line = next(line for line in f if line.startswith("Max open files"))
        assert line.split()[3] == line.split()[4] == str(hard), (child.name, line, low)


def test_a_descriptor_limit_too_low_to_serve_stops_each_server_at_start_with_one_line():
    def low_limit():  # what a container started with --ulimit nofile=256 gives its processes
        resource.setrlimit(resource.RLIMIT_NOFILE, (256, 256))

    for command in (["storenode", "--etcd", "127.0.0.1:1", "--dram", "16MiB"], ["master", "--etcd", "127.0.0.1:1"]):
        done = subprocess.run([sys.executable, "-m", "kvpool.commands.cli", *command], capture_output=True, text=True,
                              timeout=60, preexec_fn=low_limit)
        lines = done.stderr.strip().splitlines()
        assert done.returncode == 1 and len(lines) == 1, (command, done.stderr)
        assert "open-file limit (256)" in lines[0] and "ulimit -n" in lines[0], lines[0]


def test_dram_beyond_the_memory_there_is_stops_the_node_at_start_with_one_line():
    done = subprocess.run([sys.executable, "-m", "kvpool.commands.cli", "storenode", "--etcd", "127.0.0.1:1",
                           "--dram", "64TiB"], capture_output=True, text=True, timeout=60)
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 1 and len(lines) == 1, done.stderr
    assert "--dram 64.0TiB is more than the" in lines[0] and "give --dram a smaller size" in lines[0], lines[0]
