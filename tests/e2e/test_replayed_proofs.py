"""gRPC call proofs against real masters (kvpool/security/grpc_auth.py): a proof taken at the leader is
refused when replayed there or at the standby, and one made for another request is refused; a client
that dials a master by another name than it advertises learns the name from its Stats."""

import asyncio

import grpc
import pytest
from kvpool.proto import kvpool_pb2 as pb
from kvpool.proto import kvpool_pb2_grpc

from kvpool import AsyncClient
from kvpool.security.auth import client_credential
from kvpool.security.grpc_auth import METADATA, call_proof

REMOVE = "/kvpool.Master/Remove"


def remove_with(address: str, proof: str, key: str):
    with grpc.insecure_channel(address) as channel:
        return kvpool_pb2_grpc.MasterStub(channel).Remove(pb.RemoveRequest(key=key), metadata=[(METADATA, proof)],
                                                           timeout=5)


def refusal(address: str, proof: str, key: str) -> str:
    with pytest.raises(grpc.RpcError) as caught:
        remove_with(address, proof, key)
    assert caught.value.code() == grpc.StatusCode.UNAUTHENTICATED, caught.value
    return caught.value.details()


def test_a_proof_taken_by_the_leader_is_refused_at_the_standby_and_again_at_the_leader(own_cluster):
    cluster = own_cluster(nodes=1, masters=2, master_args=["--election-ttl", "2"])
    leader = cluster.master_stats().leader
    standby = next(m.info["address"] for m in cluster.masters if m.info["address"] != leader)
    credential = client_credential()
    proof = call_proof(credential, REMOVE, leader, pb.RemoveRequest(key="k").SerializeToString())
    assert remove_with(leader, proof, "k").status  # taken: the key is unknown, said in the response
    assert "made for master" in refusal(standby, proof, "k")
    assert "already used" in refusal(leader, proof, "k")
    other = call_proof(credential, REMOVE, leader, pb.RemoveRequest(key="k").SerializeToString())
    assert "another method or request" in refusal(leader, other, "other-key")
    # A proof made for the standby is taken there, which answers NOT_LEADER naming the leader.
    with pytest.raises(grpc.RpcError) as caught:
        remove_with(standby, call_proof(credential, REMOVE, standby, pb.RemoveRequest(key="k").SerializeToString()),
                    "k")
    assert caught.value.code() == grpc.StatusCode.FAILED_PRECONDITION


def test_a_stream_to_a_master_dialled_by_another_name_is_proved_for_its_advertised_name(cluster):
    port = cluster.master_address.rsplit(":", 1)[1]
    assert not cluster.master_address.startswith("localhost")

    async def first_message():
        async with AsyncClient(f"localhost:{port}") as client:
            stream = client._core.master.stream("WatchKeys", pb.WatchKeysRequest(prefix="none/"), idle_timeout=5)
            try:
                return await stream.__anext__()  # ForbiddenError if proved for "localhost"
            finally:
                await stream.aclose()

    assert isinstance(asyncio.run(first_message()), pb.KeyEvents)
