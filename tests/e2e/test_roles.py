"""What each role may call on the master (kvpool/security/roles.py), on both of its planes: every RPC of the
Master service × {client token, cluster secret} × {control port, gRPC}, expected against seen. A refused call
changes nothing and the master serves the next one. (The node's side, every member-only op × every transport:
test_client_credential_on_every_transport.py.)"""

import time

import grpc
import pytest

from kvpool.client.control_blocking import BlockingControlConnection
from kvpool.errors import ForbiddenError, KvpoolError
from kvpool.proto import kvpool_pb2 as pb
from kvpool.proto import kvpool_pb2_grpc
from kvpool.protocol import control
from kvpool.security import auth
from kvpool.security.grpc_auth import blocking_channel
from kvpool.security.roles import MEMBER_RPCS, Role

pytestmark = pytest.mark.quick  # among the fastest end-to-end tests (tests/tiers.py)

MASTER = pb.DESCRIPTOR.services_by_name["Master"]
ROLES = {"client": Role.CLIENT, "member": Role.MEMBER}


def credential(cluster, role: str) -> auth.Credential:
    return cluster.client_credential if role == "client" else auth.Credential.for_member(cluster.secret)


def expected(role: str, rpc: str) -> str:
    return "refused" if rpc in MEMBER_RPCS and ROLES[role] is not Role.MEMBER else "served"


def over_grpc(cluster, role: str, rpc: str) -> str:
    method = MASTER.methods_by_name[rpc]
    request = pb.__dict__[method.input_type.name]()  # empty: harmless to every RPC (refused or not found)
    with blocking_channel(cluster.master_address, credential(cluster, role)) as channel:
        call = getattr(kvpool_pb2_grpc.MasterStub(channel), rpc)
        try:
            answer = call(request, timeout=5)
            if method.server_streaming:
                next(iter(answer), None)
        except grpc.RpcError as exc:
            if exc.code() == grpc.StatusCode.PERMISSION_DENIED:
                return "refused"
            assert exc.code() != grpc.StatusCode.UNAUTHENTICATED, exc  # the proof itself holds
    return "served"  # answered, if with an error of its own (or a stream that opened and waits for events)


def over_control_port(cluster, role: str, rpc: str, control_address: str) -> str:
    request = control.MESSAGES[rpc][0]()
    connection = BlockingControlConnection.open(control_address, 5, credential(cluster, role))
    try:
        connection.call(rpc, request, time.monotonic() + 5)
    except ForbiddenError:
        return "refused"
    except KvpoolError:
        return "served"  # answered, if with an error of its own (e.g. no such node)
    finally:
        connection.close()
    return "served"


@pytest.fixture(scope="module")
def control_address(cluster):
    with blocking_channel(cluster.master_address, cluster.client_credential) as channel:
        return kvpool_pb2_grpc.MasterStub(channel).Stats(pb.StatsRequest(), timeout=5).control_address


def test_every_master_rpc_by_every_role_on_both_planes(cluster, control_address):
    assert cluster.secret, "the suite runs with a cluster secret (tests/conftest.py)"
    seen, wanted = {}, {}
    for rpc in MASTER.methods_by_name:
        for role in ROLES:
            wanted[(rpc, role, "grpc")] = expected(role, rpc)
            seen[(rpc, role, "grpc")] = over_grpc(cluster, role, rpc)
            if rpc in control.OP_BY_RPC:
                wanted[(rpc, role, "control")] = expected(role, rpc)
                seen[(rpc, role, "control")] = over_control_port(cluster, role, rpc, control_address)
    assert seen == wanted
    assert ("Drain", "client", "control") in seen and ("Drain", "client", "grpc") in seen
    assert sum(v == "refused" for v in seen.values()) == 2 * len(MEMBER_RPCS)  # the table is not empty


def test_a_client_drain_is_refused_and_changes_nothing(cluster):
    from kvpool import Client

    with Client(cluster.master_address, token=cluster.client_token) as client:
        node = client.stats().nodes[0].node_id
        with pytest.raises(ForbiddenError, match="operator's call"):
            client.drain(node)
        assert not next(n for n in client.stats().nodes if n.node_id == node).draining
        client.put("roles/after-refused-drain", b"v")  # the master serves on
        assert client.get("roles/after-refused-drain") == b"v"
