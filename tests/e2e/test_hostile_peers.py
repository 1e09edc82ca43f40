"""Hostile and broken peers against a real cluster (benchmarks/hostile_peers.py, run small), and what a
client's credential may not do to a node, checked one by one."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
from storenode_harness import client_credential, closed_by_node, member_credential, read_reply

from kvpool import Client
from kvpool.security import auth, roles
from kvpool.protocol import wire
from kvpool.protocol.checksum import checksum
from kvpool.errors import Code, ForbiddenError, KeyNotFoundError

ROOT = Path(__file__).resolve().parents[2]


def test_hostile_peers_are_refused_and_nothing_stored_is_lost():
    result = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "hostile_peers.py"), "--examples", "150",
                             "--connections", "1100", "--objects", "60", "--made-up", "1000"],
                            capture_output=True, text=True, timeout=600)
    assert result.stdout.strip(), result.stderr[-3000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    unauthenticated = report["without_secret"]
    assert unauthenticated["frames_tried"] >= 3 * 256 and unauthenticated["grpc_calls_tried"] >= 30
    assert unauthenticated["refused_fraction"] == 1.0, unauthenticated  # every request without the secret
    peer = report["etcd_peer"]  # etcd's peer port, by a peer without the members' certificate
    assert peer["peer_calls_refused"] == peer["peer_calls_tried"] == 6 and peer["members_listed"] == 0, peer
    assert not peer["lease_renewed"] and peer["lease_ttl_after"] <= peer["lease_ttl_before"], peer
    role = report["client_role"]
    assert role["member_ops_refused"] == role["member_ops_tried"] == len(roles.MEMBER_OPS)
    assert role["member_rpcs_refused"] == role["member_rpcs_tried"] == 2 * len(roles.MEMBER_RPCS)  # both planes
    assert role["nodes_draining"] == [] and role["high_term_writes_refused"] == role["high_term_writes"] == 20
    assert report["fuzz"]["frames"] >= 150 and report["fuzz"]["grpc_calls"] > 20
    assert report["stalls"]["closed_by_server"] == report["stalls"]["stalled_requests"]
    assert report["unread_replies"]["closed_by_server"] and report["unread_replies"]["node_logged_giving_up"]
    assert report["flood"]["connections_held"] == 1100 and report["flood"]["served_meanwhile"]
    assert report["flood"]["closed_unauthenticated"] == 1100
    writes = report["client_writes"]  # WRITEs no leader placed: refused, nothing stored changed
    for case in ("generation", "overwrite", "unplaced", "header_only", "huge_ttl", "other_node"):
        assert writes[case]["refused"] == writes[case]["tried"] > 0, (case, writes[case])
        assert writes[case]["next_honest_call_s"] < 1.0, (case, writes[case])
    assert writes["placed_unchanged"] and not writes["unplaced_visible"]
    made_up = report["made_up_options"]  # figures for the note; the bounds themselves: tests/unit (tracemalloc)
    assert made_up["puts_per_round"] == 1000 and len(made_up["heap_growth_per_round"]) == 3
    failover = report["after_failover"]  # the new leader adopts nothing poisoned and takes puts
    assert failover["objects"] == 60 and failover["objects_lost_or_changed"] == 0 and failover["new_puts_accepted"]
    proofs = report["proofs"]  # benchmarks/hostile_proofs.py
    assert proofs["replays"]["refused"] == proofs["replays"]["tried"] >= 4 + proofs["replays"]["standbys"] >= 5  # and the standby
    assert proofs["flood"]["tried"] > proofs["flood"]["remembered"] and proofs["flood"]["refused"] == 0
    assert proofs["flood"]["honest_served"] and proofs["flood"]["honest_refused"] == 0
    assert proofs["flood"]["seconds_to_honest_call"] < 1.0
    assert proofs["router"]["refused"] == proofs["router"]["tried"] >= 10 and proofs["router"]["honest_status"] == 200
    router_flood = proofs["router"]["flood"]  # idle connections held on the router's port: all closed, /route served
    assert router_flood["closed_by_server"] == router_flood["tried"] == 300, router_flood
    assert router_flood["served_meanwhile_s"] < 1.0 and router_flood["served_at_end_s"] < 1.0, router_flood
    assert report["processes_alive"] and report["objects_lost"] == 0 and report["new_puts_accepted"]
    sockets = report["sockets"]  # benchmarks/hostile_sockets.py: strangers holding ports
    assert set(sockets) == {"slow_auth_node", "slow_auth_control", "flood_node", "flood_control", "flood_grpc",
                            "flood_health", "ok"}
    for name, case in sockets.items():
        if name == "ok":
            continue
        assert case["tried"] >= 4 and case["closed_by_server"] == case["tried"], (name, case)
        assert case["longest_held_s"] <= case["deadline_s"] + 2.0, (name, case)  # a deadline from the accept
        assert case["served_meanwhile_s"] is not None and case["served_meanwhile_s"] <= 1.0, (name, case)
        assert case["open_when_served"] > 0, (name, case)  # served while hostile connections were held
        assert case["served_at_end_s"] is not None and case["served_at_end_s"] <= 1.0, (name, case)
    assert sockets["flood_node"]["tried"] >= 2 * 300 and sockets["ok"]
    assert report["ok"] and result.returncode == 0


@pytest.fixture(scope="module")
def secured(tmp_path_factory):
    from kvpool.launch.local_cluster import LocalCluster

    with LocalCluster(nodes=2, dram_per_node="64MiB", data_dir=tmp_path_factory.mktemp("secured"),
                      lease_ttl=2) as cluster:
        yield cluster


def node_connection(cluster, index: int, credential):
    import socket

    host, port = cluster.nodes[index].info["address"].rsplit(":", 1)
    sock = socket.create_connection((host, int(port)), timeout=10)
    auth.handshake_blocking(sock, credential, "node")
    return sock


@pytest.mark.parametrize("op", sorted(roles.MEMBER_OPS))
def test_a_client_credential_cannot_send_what_only_a_master_may(secured, op):
    with Client(secured.master_address) as client:
        client.put(f"guarded/{op.name}", b"g" * 5000, overwrite=True)
        payload = secured.nodes[1].info["address"].encode() if op == wire.Op.COPY else b""
        with node_connection(secured, 0, client_credential()) as sock:
            sock.sendall(wire.pack_request(op, 9, b"guarded", 1, 10**12, len(payload)) + payload)
            _op, req_id, status, _sum, message = read_reply(sock)
            assert (req_id, status) == (9, Code.FORBIDDEN) and b"master only" in message
            assert closed_by_node(sock)
        assert client.get(f"guarded/{op.name}") == b"g" * 5000


def test_no_frame_from_a_client_raises_a_nodes_term(secured):
    data = b"t" * 4096
    with Client(secured.master_address) as client:
        client.put("term/before", data, overwrite=True)
        for index in range(len(secured.nodes)):
            with node_connection(secured, index, client_credential()) as sock:
                # Far ahead of any real term: taken as a fence only, never believed.
                sock.sendall(wire.pack_request(wire.Op.WRITE, 1, b"term/forged", 7, 10**15, len(data),
                                               checksum(data)) + wire.WRITE_OPTIONS.pack(0, 0, len(data), wire.NO_SEAL) + data)
                _op, req_id, status, _sum, message = read_reply(sock)
                # No leader placed it: refused before a byte is stored, and its term never believed.
                assert (req_id, status) == (1, Code.FORBIDDEN) and b"seal" in message
        assert not client.exists("term/forged")
        with pytest.raises(KeyNotFoundError):
            client.get("term/forged")
        for i in range(20):  # the real leader's puts still land on every node
            client.put(f"term/after-{i}", data, overwrite=True)
            assert client.get(f"term/after-{i}") == data
        assert client.get("term/before") == data


def test_the_member_credential_still_may(secured):
    with node_connection(secured, 0, member_credential()) as sock:
        sock.sendall(wire.pack_request(wire.Op.REPORT, 3, b""))
        _op, req_id, status, _sum, body = read_reply(sock)
    assert (req_id, status) == (3, Code.OK) and json.loads(body)["node_id"] == "node-0"


def test_a_client_with_a_wrong_or_missing_token_is_told_so(secured):
    with pytest.raises(ForbiddenError, match="refused our credential|wrong cluster token"):
        with Client(secured.master_address, token="kvpool-client-v1:" + "00" * 32) as client:
            client.put("wrong/token", b"x")
    with pytest.raises(ForbiddenError, match="needs the cluster token"):
        with Client(secured.master_address, token="") as client:
            client.get("anything")
