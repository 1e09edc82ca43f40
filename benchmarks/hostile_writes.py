"""What a client's token may not make a storage node store (cases of benchmarks/hostile_peers.py).

Each case is tried with the client token straight against a node, as a hostile engine would:
- generation: WRITEs of generation 2^64-1 (unsealed, and under the seal of a real placement), which a new
  leader adopting them could never follow with a larger one;
- overwrite: other bytes under a stored (key, generation), with the seal its honest put was given;
- unplaced: a WRITE of a version no leader placed;
- header_only: a WRITE header claiming the node's whole DRAM, its payload never sent, to make it evict;
- huge_ttl: a TTL past what the SSD header holds, through the client, PutStart and a raw WRITE;
- other_node: an honest placement's seal presented to another node.
Each reports tried / refused and the seconds until an honest client's next put and get succeed; then
`after_failover` kills the leader and checks, under its successor, that every object stored before is
read back byte-exact and new puts are taken.
"""

import socket
import time

from kvpool import Client
from kvpool.errors import Code, InvalidArgumentError, KvpoolError
from kvpool.launch.local_cluster import LocalCluster
from kvpool.net.netutil import wait_until
from kvpool.proto import kvpool_pb2 as pb
from kvpool.protocol import wire
from kvpool.protocol.checksum import checksum
from kvpool.security import auth
from kvpool.security.grpc_auth import blocking_channel

HUGE_TTL_SECONDS = 1.8e16  # the finding's: past the SSD header's signed 64-bit milliseconds


def _connect(address: str, credential) -> socket.socket:
    host, port = address.rsplit(":", 1)
    sock = socket.create_connection((host, int(port)), timeout=10)
    auth.handshake_blocking(sock, credential, address)
    return sock


def _reply(sock: socket.socket) -> tuple[int, str]:
    """(status, message) of the next reply on `sock`."""
    header = _exactly(sock, wire.REPLY.size)
    *_, status, flags, length, _sum = wire.REPLY.unpack(header)
    body = b"" if flags & wire.ReplyFlag.MAPPED else _exactly(sock, length)
    return status, body.decode(errors="replace")


def _exactly(sock: socket.socket, size: int) -> bytes:
    buf = b""
    while len(buf) < size:
        chunk = sock.recv(size - len(buf))
        if not chunk:
            raise ConnectionError("closed")
        buf += chunk
    return buf


def _write(address: str, credential, key: bytes, generation: int, data: bytes, *, seal=wire.NO_SEAL, term=0,
           ttl_ms=0, length=None, send_payload=True, value_checksum=None) -> int:
    """The status a node answers one client WRITE with (the connection is closed after)."""
    length = len(data) if length is None else length
    frame = (wire.pack_request(wire.Op.WRITE, 1, key, generation, term, length,
                               checksum(data) if value_checksum is None else value_checksum)
             + wire.WRITE_OPTIONS.pack(ttl_ms, 0, length, seal))
    with _connect(address, credential) as sock:
        sock.sendall(frame + (data if send_payload else b""))
        try:
            return _reply(sock)[0]
        except (ConnectionError, socket.timeout):
            return -1  # closed or silent: not stored either way


def _honest_call(cluster: LocalCluster, token: str, tag: str) -> float:
    """Seconds an honest client's put and get of a fresh key take, from now."""
    started = time.monotonic()
    with Client(cluster.master_addresses, token=token) as client:
        client.put(f"honest/{tag}", tag.encode() * 100, overwrite=True)
        assert client.get(f"honest/{tag}") == tag.encode() * 100
    return round(time.monotonic() - started, 3)


class _Placed:
    """A put made by hand with the client token (PutStart, WRITE, PutEnd): its placement and seal."""

    def __init__(self, cluster: LocalCluster, credential, key: str, data: bytes):
        with blocking_channel(cluster.master_address, credential) as channel:
            call = channel.unary_unary
            started = call("/kvpool.Master/PutStart", request_serializer=pb.PutStartRequest.SerializeToString,
                           response_deserializer=pb.PutStartResponse.FromString)(
                pb.PutStartRequest(key=key, size=len(data), checksum=checksum(data)), timeout=5)
            assert started.status == pb.OK, started.message
            self.info = started.object
            self.replica = self.info.replicas[0]
            status = _write(self.replica.address, credential, key.encode(), self.info.generation, data,
                            seal=self.replica.seal, term=self.info.term)
            assert status == Code.OK, status
            ended = call("/kvpool.Master/PutEnd", request_serializer=pb.PutEndRequest.SerializeToString,
                         response_deserializer=pb.StatusResponse.FromString)(
                pb.PutEndRequest(key=key, generation=self.info.generation), timeout=5)
            assert ended.status == pb.OK, ended.message


def client_writes(cluster: LocalCluster, secret: str) -> dict:
    """Every case above; per case tried / refused / seconds to the next honest call."""
    token = auth.client_token(secret)
    credential = auth.Credential.for_client(token)
    honest = b"h" * 50_000
    placed = _Placed(cluster, credential, "hostile/placed", honest)
    address, seal, term = placed.replica.address, placed.replica.seal, placed.info.term
    generation = placed.info.generation
    other = next(n.info["address"] for n in cluster.nodes if n.info["address"] != address)
    forged = b"F" * len(honest)
    cases = {
        "generation": [lambda: _write(address, credential, b"poison", 2**64 - 1, b"p" * 100),
                       lambda: _write(address, credential, b"hostile/placed", 2**64 - 1, honest, seal=seal,
                                      term=term)],
        "overwrite": [lambda: _write(address, credential, b"hostile/placed", generation, forged, seal=seal,
                                     term=term),
                      lambda: _write(address, credential, b"hostile/placed", generation, forged, seal=seal,
                                     term=term, value_checksum=checksum(honest))],
        "unplaced": [lambda: _write(address, credential, b"hostile/unplaced", 12345, b"u" * 1000)],
        "header_only": [lambda: _write(address, credential, b"hostile/whole", 777, b"", length=96 << 20,
                                       send_payload=False)],
        "huge_ttl": [lambda: _write(address, credential, b"hostile/ttl", 778, b"t" * 1000, ttl_ms=2**63 - 1)],
        "other_node": [lambda: _write(other, credential, b"hostile/placed", generation, honest, seal=seal,
                                      term=term)],
    }
    report = {}
    for name, attempts in cases.items():
        refused = sum(attempt() != Code.OK for attempt in attempts)
        report[name] = {"tried": len(attempts), "refused": refused}
    # The same huge TTL through the client and through PutStart, refused before any node is involved.
    tried = refused = 0
    with Client(cluster.master_address, token=token) as client:
        for tier in (None, "ssd"):
            tried += 1
            try:
                client.put("hostile/ttl", b"t" * 1000, ttl=HUGE_TTL_SECONDS, tier=tier)
            except InvalidArgumentError:
                refused += 1
    with blocking_channel(cluster.master_address, credential) as channel:
        tried += 1
        started = channel.unary_unary("/kvpool.Master/PutStart",
                                      request_serializer=pb.PutStartRequest.SerializeToString,
                                      response_deserializer=pb.PutStartResponse.FromString)(
            pb.PutStartRequest(key="hostile/ttl", size=10, checksum=1,
                               options=pb.PutOptions(ttl_seconds=HUGE_TTL_SECONDS)), timeout=5)
        refused += started.status == pb.INVALID_ARGUMENT
    report["huge_ttl"]["tried"] += tried
    report["huge_ttl"]["refused"] += refused
    for name in report:
        try:
            report[name]["next_honest_call_s"] = _honest_call(cluster, token, name)
        except KvpoolError as exc:
            report[name]["next_honest_call_s"] = None
            report[name]["honest_call_error"] = str(exc)
    with Client(cluster.master_address, token=token) as client:
        try:
            report["placed_unchanged"] = client.get("hostile/placed") == honest
        except KvpoolError as exc:
            report["placed_unchanged"] = False
            report["placed_error"] = str(exc)
        report["unplaced_visible"] = any(client.exists(key) for key in ("poison", "hostile/unplaced",
                                                                        "hostile/whole", "hostile/ttl"))
    report["ok"] = (all(case["refused"] == case["tried"] and case["next_honest_call_s"] is not None
                        for case in report.values() if isinstance(case, dict))
                    and report["placed_unchanged"] and not report["unplaced_visible"])
    return report


def value_or_none(client: Client, key: str) -> bytes | None:
    """The value of `key`, None where it cannot be read (lost, or the cluster broken)."""
    try:
        return client.get(key)
    except KvpoolError:
        return None


def after_failover(cluster: LocalCluster, stored: dict, token: str) -> dict:
    """Kill the leader; under its successor every object of `stored` (key -> bytes) must read back
    byte-exact, and new puts be taken."""
    leader = next(m for m in cluster.masters if m.info["address"] == cluster.leader_address())
    standby = next(m for m in cluster.masters if m is not leader)
    started = time.monotonic()
    leader.kill()
    with Client(standby.info["address"], token=token) as client:
        wait_until(lambda: cluster.master_stats().leader == standby.info["address"], 30, what="the standby to lead")
        led = round(time.monotonic() - started, 2)
        wrong = [key for key, value in stored.items() if value_or_none(client, key) != value]
        client.put("after-failover/new", b"n" * 10_000)
        accepted = client.get("after-failover/new") == b"n" * 10_000
    return {"seconds_to_lead": led, "objects": len(stored), "objects_lost_or_changed": len(wrong),
            "new_puts_accepted": accepted}
