"""gRPC call proofs and the router's token against a client gone hostile (run by benchmarks/hostile_peers.py).

With the client token, a peer replays a proof the leader took (at the leader, and at a standby when the
cluster has one), sends it with another request or method, and floods the master with distinct valid
proofs, more than it remembers (its --remembered-proofs is PROOF_MASTER_ARGS' for this run); then an honest
client's gRPC calls must still be served. The router's HTTP endpoints are asked without the client token,
with a wrong one and with the secret itself. Each case reports tried / refused and the seconds until the
next honest call is served.
"""

import json
import time
import urllib.error
import urllib.request

import grpc

import hostile_sockets
from kvpool.proto import kvpool_pb2 as pb
from kvpool.proto import kvpool_pb2_grpc
from kvpool.security import auth
from kvpool.security.grpc_auth import METADATA, blocking_channel, call_proof
from kvpool.runtime.http_endpoint import REQUEST_DEADLINE
from kvpool.security.replay_cache import CAPACITY, MAX_AHEAD_MS

REMEMBERED = 1000  # proofs the master remembers in this run: a flood of a few thousand overflows it in seconds
PROOF_MASTER_ARGS = ["--remembered-proofs", str(REMEMBERED)]
FLOOD = 4 * REMEMBERED
IN_FLIGHT = 64  # flood calls sent before the first is waited for
EXISTS, REMOVE = "/kvpool.Master/Exists", "/kvpool.Master/Remove"
NOWHERE = "192.0.2.1:50051"  # a master that is not this one (a standby's address, as a replayer would aim)


def _caller(channel, method: str, request_type, response_type):
    return channel.unary_unary(method, request_serializer=request_type.SerializeToString,
                               response_deserializer=response_type.FromString)


def _refused(call, request, proof: str) -> bool:
    try:
        call(request, metadata=[(METADATA, proof)], timeout=5)
    except grpc.RpcError as exc:
        return exc.code() == grpc.StatusCode.UNAUTHENTICATED
    return False


def replays(leader: str, standbys: list[str], credential) -> dict:
    """A proof the leader took, replayed there and at each standby, and made to carry another request or
    method or to name another master."""
    request = pb.ExistsRequest(key="proofs/replayed")
    body = request.SerializeToString()
    taken = call_proof(credential, EXISTS, leader, body)
    tried = refused = 0
    with grpc.insecure_channel(leader) as channel:
        exists = _caller(channel, EXISTS, pb.ExistsRequest, pb.ExistsResponse)
        exists(request, metadata=[(METADATA, taken)], timeout=5)
        remove = _caller(channel, REMOVE, pb.RemoveRequest, pb.RemoveResponse)  # its request has the same bytes
        attempts = [(exists, request, taken),
                    (exists, pb.ExistsRequest(key="proofs/other"), call_proof(credential, EXISTS, leader, body)),
                    (remove, pb.RemoveRequest(key="proofs/replayed"), call_proof(credential, EXISTS, leader, body)),
                    (exists, request, call_proof(credential, EXISTS, NOWHERE, body))]
        for call, sent, proof in attempts:
            tried += 1
            refused += _refused(call, sent, proof)
    for standby in standbys:
        with grpc.insecure_channel(standby) as channel:
            tried += 1
            refused += _refused(_caller(channel, EXISTS, pb.ExistsRequest, pb.ExistsResponse), request, taken)
    return {"tried": tried, "refused": refused, "standbys": len(standbys)}


def flood(leader: str, credential, count: int = FLOOD) -> dict:
    """`count` distinct valid proofs as fast as the master takes them, then an honest client's calls."""
    request = pb.ExistsRequest(key="proofs/flood")
    body = request.SerializeToString()
    refused = 0
    started = time.monotonic()
    with grpc.insecure_channel(leader) as channel:
        exists = _caller(channel, EXISTS, pb.ExistsRequest, pb.ExistsResponse)
        pending = []
        for _ in range(count):
            pending.append(exists.future(request, metadata=[(METADATA, call_proof(credential, EXISTS, leader, body))],
                                         timeout=30))
            if len(pending) >= IN_FLIGHT:
                refused += _failed(pending.pop(0))
        refused += sum(_failed(call) for call in pending)
    flooded = time.monotonic()
    rate = count / max(flooded - started, 1e-9)
    honest_refused, served = 0, False
    with blocking_channel(leader, credential) as channel:  # an honest client: its own channel, fresh proofs
        stub = kvpool_pb2_grpc.MasterStub(channel)
        while not served and time.monotonic() - flooded < 10:
            try:
                stub.Exists(pb.ExistsRequest(key="proofs/honest"), timeout=5)
                stub.Stats(pb.StatsRequest(), timeout=5)
                served = True
            except grpc.RpcError:
                honest_refused += 1
    return {"tried": count, "refused": refused, "remembered": REMEMBERED, "per_second": round(rate),
            "honest_served": served, "honest_refused": honest_refused,
            "seconds_to_honest_call": round(time.monotonic() - flooded, 3),
            # how fast a flood must come before a fresh proof meets the floor, at the default --remembered-proofs
            "per_second_to_refuse_fresh_by_default": CAPACITY * 1000 // MAX_AHEAD_MS}


def _failed(call) -> bool:
    try:
        call.result()
    except grpc.RpcError:
        return True
    return False


def router(client_token: str, secret: str) -> dict:
    """The router's HTTP endpoints asked without the client token, with a wrong one and with the secret."""
    from kvpool.connectors.block_keys import BlockNamespace
    from kvpool.connectors.routing_service import RoutingService

    space = BlockNamespace("hostile", "float32", "vllm-nhd", 16)
    with RoutingService({"a": ""}, space, token=client_token) as service:
        port = service.serve_http()

        def status(path: str, token: str | None) -> int:
            headers = {"Authorization": f"Bearer {token}"} if token is not None else {}
            data = json.dumps({"token_ids": list(range(32))}).encode() if path == "/route" else None
            request = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=data, headers=headers)
            try:
                with urllib.request.urlopen(request, timeout=5) as reply:
                    return reply.status
            except urllib.error.HTTPError as exc:
                return exc.code

        strangers = [None, "", "kvpool-client-v1:" + "00" * 32, secret, client_token + "0"]
        codes = [status(path, token) for path in ("/route", "/engines") for token in strangers]
        started = time.monotonic()
        honest = status("/route", client_token)
        seconds_to_honest_call = round(time.monotonic() - started, 3)

        def route():
            if status("/route", client_token) != 200:
                raise AssertionError("the honest /route was not answered 200")

        # Idle connections held open, as against the components' metrics port (hostile_sockets.py).
        flood = hostile_sockets.flood_case(f"127.0.0.1:{port}", route, REQUEST_DEADLINE)
        return {"tried": len(codes), "refused": codes.count(401), "honest_status": honest,
                "seconds_to_honest_call": seconds_to_honest_call, "flood": flood}


def hostile_proofs(cluster, secret: str) -> dict:
    """Every case above against `cluster` (its masters run with PROOF_MASTER_ARGS); "ok" when each held."""
    client_token = auth.client_token(secret)
    credential = auth.Credential.for_client(client_token)
    leader = cluster.master_stats().leader
    standbys = [m.info["address"] for m in cluster.masters if m.alive and m.info["address"] != leader]
    report = {"replays": replays(leader, standbys, credential), "flood": flood(leader, credential),
              "router": router(client_token, secret)}
    report["ok"] = (report["replays"]["refused"] == report["replays"]["tried"]
                    and report["flood"]["refused"] == 0 and report["flood"]["honest_served"]
                    and report["flood"]["honest_refused"] == 0
                    and report["router"]["refused"] == report["router"]["tried"]
                    and report["router"]["honest_status"] == 200 and hostile_sockets.held(report["router"]["flood"]))
    return report
