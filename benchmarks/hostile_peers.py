"""Hostile and broken peers against a real cluster; prints one JSON line of what was tried and held.

    python3 benchmarks/hostile_peers.py [--examples N] [--connections N]

Against etcd, a master and two storage nodes (processes, real sockets, the cluster secret on):
- peers without the secret send every op, junk and replayed or forged proofs to each node port and
  the master's control port, every RPC to its gRPC port, and reads and writes to etcd: each must be
  refused (`refused_fraction` 1.0) and nothing listed, read, changed or freed;
- a peer without etcd's peer certificate lists its members and renews a lease on its peer port
  (benchmarks/hostile_etcd.py): refused, and the lease not renewed;
- a peer with the client token sends what only a master may (FREE, COPY, HOLD, REPORT, INVENTORY,
  EVICTIONS) and WRITEs with a term far ahead of the leader's: refused, and the leader's puts go on;
- random and mutated frames (hypothesis) on authenticated connections to every node and the control
  port, and undecodable bodies on every gRPC method;
- header-only WRITEs, replies never read, transfers stalled half-way, and more connections than the
  node serves, held open;
then checks that every process lives, every object stored before is read back byte-exact, new puts
are taken, and reports the nodes' memory before and after. Exit status 1 if any check failed.
"""

import argparse
import contextlib
import json
import os
import random
import socket
import sys
import time

import grpc
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import hostile_etcd
import hostile_proofs
import hostile_writes
from hostile_sockets import MASTER_CAPS, NODE_CAPS, hostile_sockets

from kvpool import Client
from kvpool.security import auth, roles
from kvpool.protocol import wire
from kvpool.protocol.checksum import checksum
from kvpool.protocol.control import OP_BY_RPC, pack_call
from kvpool.errors import Code, ForbiddenError
from kvpool.security.grpc_auth import blocking_channel
from kvpool.launch.local_cluster import LocalCluster
from kvpool.net.netutil import wait_until
from kvpool.proto import kvpool_pb2 as pb
from kvpool.proto import kvpool_pb2_grpc

FRAME_TIMEOUT = 2.0  # the nodes' and master's --frame-timeout for this run: stalls end quickly
MASTER_RPCS = [m.name for m in pb.DESCRIPTOR.services_by_name["Master"].methods]
STREAMING = {"WatchKeys"}


def hostport(address: str) -> tuple[str, int]:
    host, port = address.rsplit(":", 1)
    return host, int(port)


def connect(address: str, credential=None, timeout: float = 5.0) -> socket.socket:
    sock = socket.create_connection(hostport(address), timeout=timeout)
    if credential is not None:
        auth.handshake_blocking(sock, credential, address)
    return sock


def drain(sock: socket.socket, limit: float = 5.0) -> tuple[list, bool]:
    """Replies (op, status) read until the peer closes (True) or `limit` seconds pass (False)."""
    replies, buf = [], b""
    deadline = time.monotonic() + limit
    try:
        while time.monotonic() < deadline:
            sock.settimeout(max(0.01, deadline - time.monotonic()))
            chunk = sock.recv(65536)
            if not chunk:
                return _parse(buf, replies), True
            buf += chunk
    except socket.timeout:
        return _parse(buf, replies), False
    except OSError:  # reset: closed
        return _parse(buf, replies), True
    return _parse(buf, replies), False


def _parse(buf: bytes, replies: list) -> list:
    at = 0
    while len(buf) - at >= wire.REPLY.size:
        _m, _v, op, _req, status, _f, length, _c = wire.REPLY.unpack_from(buf, at)
        replies.append((op, status))
        at += wire.REPLY.size + length
    return replies


# -- peers without the secret


def every_first_frame() -> list[bytes]:
    """One first frame per op (every value a byte can take), plus junk, forged and replayed proofs."""
    frames = [wire.pack_request(op, 1, b"key", 1, 0, 8) + b"x" * 8 for op in range(256)]
    frames += [os.urandom(64), b"GET / HTTP/1.1\r\nHost: x\r\n\r\n", b"\x16\x03\x01\x02\x00" + os.urandom(60)]
    forged = wire.REQUEST.pack(wire.MAGIC, wire.VERSION, wire.Op.AUTH, 1, 0, auth.Role.MEMBER, 0, 0,
                               auth.NONCE + auth.PROOF, 0) + os.urandom(auth.NONCE + auth.PROOF)
    frames.append(forged)
    return frames


def without_secret(cluster: LocalCluster, secret: str, keys: dict) -> dict:
    tried = refused = 0
    ports = [n.info["address"] for n in cluster.nodes] + [cluster.master.info["control"]]
    for address in ports:
        for frame in every_first_frame():
            tried += 1
            with connect(address) as sock:
                sock.sendall(frame)
                replies, closed = drain(sock)
            # The challenge is the one OK frame allowed; anything else OK is a breach.
            answered = [r for r in replies if not (r[0] == wire.Op.AUTH and r[1] == Code.OK)]
            refused += closed and all(status != Code.OK for _op, status in answered)
        # A proof captured on a real connection is useless on another (a fresh nonce each time).
        tried += 1
        refused += _replay_refused(address, secret)
    grpc_tried = grpc_refused = 0
    with grpc.insecure_channel(cluster.master_address) as channel:
        for method in MASTER_RPCS:
            for metadata in ((), (("kvpool-auth", "2.0.0." + "0" * 64),)):
                grpc_tried += 1
                call = (channel.unary_stream if method in STREAMING else channel.unary_unary)(
                    f"/kvpool.Master/{method}")
                try:
                    answer = call(b"", timeout=5, metadata=metadata)
                    if method in STREAMING:
                        next(iter(answer))
                except grpc.RpcError as exc:
                    grpc_refused += exc.code() == grpc.StatusCode.UNAUTHENTICATED
    etcd_tried, etcd_refused = hostile_etcd.etcd_without_login(cluster)
    return {"frames_tried": tried, "frames_refused": refused, "grpc_calls_tried": grpc_tried,
            "grpc_calls_refused": grpc_refused, "etcd_calls_tried": etcd_tried, "etcd_calls_refused": etcd_refused,
            "refused_fraction": (refused + grpc_refused + etcd_refused) / (tried + grpc_tried + etcd_tried)}


def _replay_refused(address: str, secret: str) -> bool:
    """Record a real client's AUTH answer, then send it as our own on a new connection."""
    credential = auth.Credential.for_client(auth.client_token(secret))
    with connect(address) as sock:
        header = sock.recv(wire.REPLY.size, socket.MSG_WAITALL)
        body = sock.recv(wire.REPLY.unpack(header)[6], socket.MSG_WAITALL)
        answer = auth.PeerHandshake(credential, address).respond(header, body)
    with connect(address) as sock:
        sock.sendall(answer + wire.pack_request(wire.Op.HELLO, 2, b""))
        replies, closed = drain(sock)
    return closed and not any(op != wire.Op.AUTH and status == Code.OK for op, status in replies) \
        and (wire.Op.AUTH, Code.FORBIDDEN) in replies


# -- a client's credential against a master's operations


def client_role_limits(cluster: LocalCluster, secret: str) -> dict:
    credential = auth.Credential.for_client(auth.client_token(secret))
    address = cluster.nodes[0].info["address"]
    tried = refused = 0
    for op in sorted(roles.MEMBER_OPS):
        tried += 1
        payload = cluster.nodes[1].info["address"].encode() if op == wire.Op.COPY else b""
        with connect(address, credential) as sock:
            sock.sendall(wire.pack_request(op, 1, b"k", 1, 10**12, len(payload)) + payload)
            replies, closed = drain(sock)
        refused += closed and replies == [(op, Code.FORBIDDEN)]
    # WRITEs claiming a term far ahead of the leader's: refused (no leader sealed them), the node's term stays.
    data = b"t" * 1000
    high_term_refused = 0
    for i in range(20):
        with connect(address, credential) as sock:
            try:
                sock.sendall(wire.pack_request(wire.Op.WRITE, i, b"term/%d" % i, 10**15 + i, 10**12 + i, len(data),
                                               checksum(data)) + wire.WRITE_OPTIONS.pack(0, 0, len(data), wire.NO_SEAL)
                             + data)
            except OSError:  # closed on the refusal before the payload was all sent
                pass
            replies, _closed = drain(sock, 1.0)
        # FORBIDDEN, or closed before it could be read (the node hangs up on a refused WRITE's payload)
        high_term_refused += (wire.Op.WRITE, Code.OK) not in replies
    # An operator's master RPCs (Drain, Tenants) with the client token, over the control port and over gRPC.
    rpcs_tried = rpcs_refused = 0
    node_id = cluster.nodes[0].info["node_id"]
    # Each operator's call, as a client would make it: a drain of a node, a tenant of its own making.
    requests = {"Drain": pb.DrainRequest(node_id=node_id), "Tenants": pb.TenantsRequest(action="create", name="hostile")}
    assert set(requests) == roles.MEMBER_RPCS, "a member-only RPC without a hostile request here"
    with Client(cluster.master_address, token=auth.client_token(secret)) as client:
        for call in (lambda: client.drain(node_id), lambda: client.tenants("create", "hostile")):
            rpcs_tried += 1
            try:
                call()
            except ForbiddenError:
                rpcs_refused += 1
    with blocking_channel(cluster.master_address, credential) as channel:
        stub = kvpool_pb2_grpc.MasterStub(channel)
        for rpc, request in sorted(requests.items()):
            rpcs_tried += 1
            try:
                getattr(stub, rpc)(request, timeout=5)
            except grpc.RpcError as exc:
                rpcs_refused += exc.code() == grpc.StatusCode.PERMISSION_DENIED
    with Client(cluster.master_address, token=secret) as operator:
        draining = [n.node_id for n in operator.stats().nodes if n.draining]
    return {"member_ops_tried": tried, "member_ops_refused": refused, "high_term_writes": 20,
            "high_term_writes_refused": high_term_refused,
            "member_rpcs_tried": rpcs_tried, "member_rpcs_refused": rpcs_refused, "nodes_draining": draining}


# -- random and mutated frames


def _frames():
    valid_ops = [int(op) for op in wire.Op]
    header = st.builds(
        lambda op, req, key, flags, gen, arg, length, digest: wire.REQUEST.pack(
            wire.MAGIC, wire.VERSION, op, req, len(key), flags, gen, arg, length, digest) + key,
        st.one_of(st.sampled_from(valid_ops), st.integers(0, 255)), st.integers(0, 2**32 - 1),
        st.binary(max_size=300), st.integers(0, 2**16 - 1), st.integers(0, 2**64 - 1), st.integers(0, 2**64 - 1),
        st.one_of(st.integers(0, 4096), st.integers(0, 2**64 - 1)), st.integers(0, 2**64 - 1))
    frame = st.tuples(header, st.binary(max_size=2048)).map(lambda parts: parts[0] + parts[1])
    mutated = st.tuples(frame, st.integers(0, 10**6), st.binary(min_size=1, max_size=8)).map(
        lambda t: t[0][:t[1] % (len(t[0]) + 1)] + t[2] + t[0][t[1] % (len(t[0]) + 1) + len(t[2]):])
    return st.lists(st.one_of(frame, mutated, st.binary(max_size=512)), min_size=1, max_size=4)


def fuzz(addresses: list, credential, examples: int) -> dict:
    sent = {"frames": 0, "connections": 0}

    @settings(max_examples=examples, deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    @given(frames=_frames(), target=st.sampled_from(addresses))
    def one(frames, target):
        with connect(target, credential) as sock:
            sent["connections"] += 1
            for frame in frames:
                sent["frames"] += 1
                try:
                    sock.sendall(frame)
                except OSError:
                    break
            try:
                sock.shutdown(socket.SHUT_WR)
            except OSError:
                pass
            drain(sock, FRAME_TIMEOUT + 3)

    one()
    return sent


def fuzz_grpc(cluster: LocalCluster, credential, per_method: int, seed: int = 7) -> int:
    rng = random.Random(seed)
    tried = 0
    with blocking_channel(cluster.master_address, credential) as channel:
        for method in MASTER_RPCS:
            call = (channel.unary_stream if method in STREAMING else channel.unary_unary)(f"/kvpool.Master/{method}")
            for _ in range(per_method):
                tried += 1
                body = bytes(rng.getrandbits(8) for _ in range(rng.randrange(0, 300)))
                try:
                    answer = call(body, timeout=5)
                    if method in STREAMING:
                        next(iter(answer))
                except grpc.RpcError:
                    pass
        # Huge: just under and over the 64 MiB message limit.
        for size in (60 << 20, 70 << 20):
            tried += 1
            try:
                channel.unary_unary("/kvpool.Master/BatchPutStart")(os.urandom(1024) * (size // 1024), timeout=30)
            except grpc.RpcError:
                pass
    return tried


# -- stalls and floods


def stalls(cluster: LocalCluster, credential) -> dict:
    address = cluster.nodes[0].info["address"]
    held = []
    for i in range(20):  # header-only WRITEs reserving 1 MiB each, payload never sent
        sock = connect(address, credential)
        sock.sendall(wire.pack_request(wire.Op.WRITE, 1, b"stall/%d" % i, 1, 0, 1 << 20, 1)
                     + wire.WRITE_OPTIONS.pack(0, 0, 1 << 20, wire.NO_SEAL) + b"x" * 1000)
        held.append(sock)
    stalled_control = connect(cluster.master.info["control"], credential)
    stalled_control.sendall(pack_call(OP_BY_RPC["Stats"], 1, b"")[:10])  # half a header
    held.append(stalled_control)
    closed = 0
    for sock in held:
        closed += drain(sock, FRAME_TIMEOUT + 5)[1]
        sock.close()
    return {"stalled_requests": len(held), "closed_by_server": closed}


STALLED_READER = "closing a data connection: the peer took nothing"  # what a node logs on giving one up


def unread_replies(node, credential, key: str, size: int, generation: int) -> dict:
    """Pipelined READs of a stored object whose replies are never read."""
    def given_up() -> int:
        return node.log_path.read_text(errors="replace").count(STALLED_READER)

    earlier = given_up()
    sock = connect(node.info["address"], credential)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    frame = wire.pack_request(wire.Op.READ, 1, key.encode(), generation, 0, size)
    sent = 0
    sock.settimeout(FRAME_TIMEOUT + 5)
    try:
        for _ in range(2000):
            sock.sendall(frame)
            sent += 1
    except OSError:
        pass
    # Not reading: the node's replies stall, and after its --frame-timeout it gives the connection up.
    with contextlib.suppress(TimeoutError):  # if it never does, the replies below all arrive: reported
        wait_until(lambda: given_up() > earlier, FRAME_TIMEOUT + 10, what="the node to give up a stalled reader")
    logged = given_up() > earlier
    received = 0  # then what reaches us ends long before the 2000 replies would
    sock.settimeout(10)
    try:
        while chunk := sock.recv(1 << 20):
            received += len(chunk)
    except OSError:
        pass
    sock.close()
    return {"reads_sent_unread": sent, "reply_bytes_owed": sent * size, "reply_bytes_received": received,
            "closed_by_server": received < sent * size, "node_logged_giving_up": logged}


def flood(cluster: LocalCluster, count: int, token: str) -> dict:
    """`count` connections that never authenticate; the cluster must keep serving meanwhile."""
    address = cluster.nodes[1].info["address"]
    held = []
    for _ in range(count):
        held.append(socket.create_connection(hostport(address), timeout=10))
    with Client(cluster.master_address, token=token) as client:
        client.put("flood/served", b"f" * 4096, overwrite=True)
        served = client.get("flood/served") == b"f" * 4096
    closed = sum(drain(sock, FRAME_TIMEOUT + 10)[1] for sock in held)
    for sock in held:
        sock.close()
    return {"connections_held": count, "served_meanwhile": served, "closed_unauthenticated": closed}


def rss(pid: int) -> dict:
    """Resident bytes: the process's own (heap) and its touched shared memory (the DRAM segment, which
    --dram bounds)."""
    found = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            name = line.split(":")[0]
            if name in ("RssAnon", "RssShmem"):
                found[name] = int(line.split()[1]) * 1024
    return {"heap": found.get("RssAnon", 0), "shared": found.get("RssShmem", 0)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--examples", type=int, default=2000, help="hypothesis examples per fuzzed plane")
    parser.add_argument("--connections", type=int, default=1200, help="unauthenticated connections held at once")
    parser.add_argument("--objects", type=int, default=200)
    parser.add_argument("--made-up", type=int, default=3000, help="puts per round with option sets of their own")
    args = parser.parse_args()
    secret = auth.new_secret()
    timeouts = ["--frame-timeout", str(FRAME_TIMEOUT)]
    with LocalCluster(nodes=2, dram_per_node="96MiB", secret=secret, lease_ttl=2, node_args=timeouts + NODE_CAPS,
                      masters=2, metrics=True,
                      master_args=["--control-frame-timeout", str(FRAME_TIMEOUT), "--election-ttl", "2", *MASTER_CAPS,
                                   "--grpc-handshake-timeout", str(FRAME_TIMEOUT),
                                   *hostile_proofs.PROOF_MASTER_ARGS]) as cluster:
        client_token = auth.client_token(secret)
        client_credential = auth.Credential.for_client(client_token)
        rng = random.Random(1)
        stored = {f"obj/{i}": os.urandom(rng.randrange(1, 200_000)) for i in range(args.objects)}
        with Client(cluster.master_address, token=client_token) as client:
            client.batch_put(list(stored), list(stored.values()))
        with blocking_channel(cluster.master_address, client_credential) as channel:
            placed = channel.unary_unary("/kvpool.Master/GetReplicaList", request_serializer=pb.GetReplicaListRequest.
                                         SerializeToString, response_deserializer=pb.GetReplicaListResponse.FromString)(
                pb.GetReplicaListRequest(key="obj/0"), timeout=5).object
        processes = {child.name: child.proc.pid for child in [*cluster.nodes, cluster.master]}
        before = {name: rss(pid) for name, pid in processes.items()}
        started = time.monotonic()
        report = {"without_secret": without_secret(cluster, secret, stored),
                  "client_role": client_role_limits(cluster, secret),
                  "etcd_peer": hostile_etcd.peer_port(cluster, secret)}
        targets = [n.info["address"] for n in cluster.nodes] + [cluster.master.info["control"]]
        report["fuzz"] = fuzz(targets, client_credential, args.examples)
        report["fuzz"]["grpc_calls"] = fuzz_grpc(cluster, client_credential, max(2, args.examples // 50))
        report["stalls"] = stalls(cluster, client_credential)
        holder = next(n for n in cluster.nodes if n.info["address"] == placed.replicas[0].address)
        report["unread_replies"] = unread_replies(holder, client_credential, "obj/0", placed.size, placed.generation)
        report["flood"] = flood(cluster, args.connections, client_token)
        report["sockets"] = hostile_sockets(cluster, client_token, FRAME_TIMEOUT)
        report["client_writes"] = hostile_writes.client_writes(cluster, secret)
        report["proofs"] = hostile_proofs.hostile_proofs(cluster, secret)
        report["made_up_options"] = hostile_writes.made_up_options(cluster, client_token, args.made_up)
        alive = all(child.alive for child in [*cluster.nodes, cluster.master])
        with Client(cluster.master_address, token=client_token) as client:
            lost = [key for key, value in stored.items() if hostile_writes.value_or_none(client, key) != value]
            client.put("after/new", b"n" * 10_000)
            accepted = client.get("after/new") == b"n" * 10_000
        after = {name: rss(pid) for name, pid in processes.items()}
        report["after_failover"] = hostile_writes.after_failover(cluster, stored, client_token)
        report.update(seconds=round(time.monotonic() - started, 1), processes_alive=alive, objects=len(stored),
                      objects_lost=len(lost), new_puts_accepted=accepted, rss_before=before, rss_after=after)
    ok = (alive and not lost and accepted and report["without_secret"]["refused_fraction"] == 1.0
          and report["client_role"]["member_ops_refused"] == report["client_role"]["member_ops_tried"]
          and report["client_role"]["member_rpcs_refused"] == report["client_role"]["member_rpcs_tried"]
          and not report["client_role"]["nodes_draining"] and hostile_etcd.held(report["etcd_peer"])
          and report["client_role"]["high_term_writes_refused"] == 20
          and report["client_writes"]["ok"] and report["after_failover"]["objects_lost_or_changed"] == 0
          and report["after_failover"]["new_puts_accepted"] and report["proofs"]["ok"] and report["sockets"]["ok"])
    report["ok"] = ok
    print(json.dumps(report), flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
