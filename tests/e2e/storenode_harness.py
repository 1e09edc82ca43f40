"""Start real storage-node processes and talk to them over raw sockets with kvpool.protocol.wire."""

import json
import os
import re
import selectors
import socket
import subprocess
import sys
from dataclasses import dataclass

from kvpool.security import auth, placement_seal
from kvpool.protocol import wire
from kvpool.protocol.checksum import checksum
from kvpool.errors import Code
from kvpool.security.grpc_auth import blocking_channel
from kvpool.protocol.inventory import DRAM_BIT, SHARED_BIT, SSD_BIT, decode as decode_inventory
from kvpool.net.netutil import wait_until
from kvpool.protocol.wire import Op

_READY = re.compile(rb"^kvpool-storenode ready node_id=(\S+) address=(\S+):(\d+)$")


@dataclass
class Node:
    proc: subprocess.Popen
    node_id: str
    host: str
    port: int
    log_path: str

    def connect(self, credential="member") -> socket.socket:
        """A connection that proved `credential` ("member": the master's, from $KVPOOL_TOKEN; None: none)."""
        sock = socket.create_connection((self.host, self.port), timeout=10)
        if credential == "member":
            credential = member_credential()
        if credential is not None:
            auth.handshake_blocking(sock, credential, f"node {self.node_id}")
        return sock

    def connect_raw(self) -> socket.socket:
        """A connection that has not answered the node's challenge (which is waiting to be read)."""
        return socket.create_connection((self.host, self.port), timeout=10)

    def log(self) -> str:
        with open(self.log_path) as f:
            return f.read()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        self.proc.stdout.close()


def start_node(etcd: str, tmp_path, node_id: str = "n1", lease_ttl: int = 30, dram: str = "64MiB",
               args: tuple = ()) -> Node:
    """A node process; returns once it printed its ready line."""
    # A long lease by default: a record that vanishes at once on SIGTERM was revoked, not expired.
    log_path = str(tmp_path / f"{node_id}.log")
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "kvpool.storenode", "--etcd", etcd, "--dram", dram, "--port", "0",
             "--node-id", node_id, "--lease-ttl", str(lease_ttl), *args],
            stdout=subprocess.PIPE, stderr=log)
    selector = selectors.DefaultSelector()
    selector.register(proc.stdout, selectors.EVENT_READ)

    def ready_line():
        if selector.select(0):
            line = proc.stdout.readline()
            if line:
                return line
        if proc.poll() is not None:
            with open(log_path) as f:
                raise RuntimeError(f"storenode exited with {proc.returncode}: {f.read()}")
        return None

    try:
        line = wait_until(ready_line, 20, what="storenode ready line")
    except BaseException:
        proc.kill()
        proc.wait()
        raise
    finally:
        selector.close()
    match = _READY.match(line.strip())
    assert match, line
    assert match.group(1).decode() == node_id
    return Node(proc, node_id, match.group(2).decode(), int(match.group(3)), log_path)


async def ping(link, address: str) -> str:
    """PING on a link's connection to the node at `address` (served to any peer): the node's id."""
    connection = await link.connection(address)
    return await connection.request(Op.PING, b"", 0, 0, 0)


def member_credential() -> auth.Credential:
    """The masters' credential for this run's cluster secret ($KVPOOL_TOKEN, set by conftest.py)."""
    return auth.Credential.for_member(os.environ["KVPOOL_TOKEN"])


def client_credential() -> auth.Credential:
    return auth.Credential.for_client(auth.client_token(os.environ["KVPOOL_TOKEN"]))


def master_channel(address: str):
    """A blocking gRPC channel to a master, its calls proving the client role."""
    return blocking_channel(address, client_credential())


# -- frames

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
    header = recv_exact(sock, wire.REPLY.size)
    magic, version, op, req_id, status, _flags, length, value_checksum = wire.REPLY.unpack(header)
    assert (magic, version) == (wire.MAGIC, wire.VERSION)
    return op, req_id, status, value_checksum, recv_exact(sock, length)


def write_frame(key: bytes, generation: int, data: bytes, req_id: int = 1, value_checksum=None, flags: int = 0,
                ttl_ms: int = 0, soft_pin_ms: int = 0, raw_size: int = 0, seal: bytes = wire.NO_SEAL,
                term: int = 0) -> bytes:
    """A WRITE frame (unsealed by default: what a member may send; a client needs `seal`)."""
    cs = checksum(data) if value_checksum is None else value_checksum
    return (wire.pack_request(Op.WRITE, req_id, key, generation, term, len(data), cs, flags)
            + wire.WRITE_OPTIONS.pack(ttl_ms, soft_pin_ms, raw_size, seal) + data)


def seal_for(node_id: str, key: bytes, generation: int, data: bytes, flags: int = 0, ttl_ms: int = 0,
             soft_pin_ms: int = 0, raw_size: int = 0, term: int = 0, secret: str | None = None) -> bytes:
    """The seal a leader of the cluster with `secret` (default $KVPOOL_TOKEN) would give this WRITE."""
    sealer = placement_seal.for_secret(secret or os.environ["KVPOOL_TOKEN"])
    return sealer.seal(node_id.encode(), key, generation, len(data), checksum(data), term, flags, ttl_ms,
                       soft_pin_ms, raw_size or len(data))


def read_frame(key: bytes, generation: int, length: int, req_id: int = 1) -> bytes:
    return wire.pack_request(Op.READ, req_id, key, generation, 0, length)


def call(node: Node, frame: bytes):
    with node.connect() as sock:
        sock.sendall(frame)
        return read_reply(sock)


def put(node: Node, key: bytes, generation: int, data: bytes, **options) -> None:
    _, _, status, _, message = call(node, write_frame(key, generation, data, **options))
    assert status == Code.OK, message


def write_status(node: Node, key: bytes, generation: int, data: bytes, **options):
    """(status, message) of a WRITE whose refusal may close the connection."""
    _, _, status, _, message = call(node, write_frame(key, generation, data, **options))
    return status, message.decode()


def get(node: Node, key: bytes, generation: int, length: int):
    """(status, payload) of a READ on a fresh connection."""
    _, _, status, _, payload = call(node, read_frame(key, generation, length))
    return status, payload


def free(node: Node, key: bytes, generation: int) -> int:
    return call(node, wire.pack_request(Op.FREE, 1, key, generation))[2]


def hold(node: Node, key: bytes, generation: int, ms: int) -> int:
    return call(node, wire.pack_request(Op.HOLD, 1, key, generation, arg=ms))[2]


def report(node: Node) -> dict:
    _, _, status, value_checksum, body = call(node, wire.pack_request(Op.REPORT, 1, b""))
    assert status == Code.OK and value_checksum == checksum(body)
    return json.loads(body)


def inventory(node: Node) -> dict:
    """{(key, generation): entry} of the node's INVENTORY."""
    _, _, status, _, body = call(node, wire.pack_request(Op.INVENTORY, 1, b""))
    assert status == Code.OK
    return {(e.key, e.generation): entry_fields(e) for e in decode_inventory(body)}


def entry_fields(entry) -> dict:
    """An INVENTORY entry as a dict, its tiers by name."""
    return entry._asdict() | {"tiers": tier_names(entry)}


def tier_names(entry) -> list[str]:
    """The tiers an INVENTORY entry says hold it, by name."""
    named = (("dram", DRAM_BIT), ("ssd", SSD_BIT), ("shared", SHARED_BIT))
    return [name for name, bit in named if entry.tiers & bit]


def closed_by_node(sock: socket.socket) -> bool:
    """True once the node closes the connection (replies sent before that are skipped)."""
    try:
        while sock.recv(65536):
            pass
        return True
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False


def inventory_at(address: str) -> dict:
    """key -> INVENTORY entry of the node serving at HOST:PORT, asked as the master asks (a TcpLink)."""
    import asyncio

    from kvpool.net.tcp_link import TcpLink

    async def ask():
        transport = TcpLink(credential=member_credential())
        try:
            return await transport.inventory(address)
        finally:
            await transport.close()

    return {entry.key: entry_fields(entry) for entry in asyncio.run(ask())}


# -- metrics

def metric_samples(url: str) -> dict:
    """Every sample a Prometheus endpoint exports: (name, sorted labels) -> value."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(url, timeout=5) as resp:
        text = resp.read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def metric_total(samples: dict, name: str, **labels) -> float:
    """The sum of `name`'s samples whose labels include `labels`."""
    return sum(v for (n, lab), v in samples.items()
               if n == name and all(dict(lab).get(k) == want for k, want in labels.items()))


# -- failing fast, told apart from waiting out a timeout whatever the machine's load

PATIENT = 30.0  # every timeout of a client made with PATIENT_TIMEOUTS
FAIL_FAST = 10.0  # well above what a fast failure takes on two busy cores, well below PATIENT
PATIENT_TIMEOUTS = {"rpc_timeout": PATIENT, "connect_timeout": PATIENT, "read_timeout": PATIENT, "timeout": PATIENT}
