"""Probes an orchestrator uses: /healthz and /readyz beside every component's metrics, and the master's gRPC
health service (leader, standby, taking over)."""

import urllib.error
import urllib.request

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvpool.net.netutil import wait_until

pytestmark = pytest.mark.quick  # among the fastest end-to-end tests (tests/tiers.py)

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


def probe(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=5) as answer:
            return answer.status, answer.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def grpc_status(address: str, service: str) -> int:
    """Asked with no credential at all: the health service needs none."""
    with grpc.insecure_channel(address) as channel:
        return health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=service),
                                                          timeout=5).status


def test_probes_on_every_component_and_the_leaders_health(own_cluster):
    cluster = own_cluster(2, masters=2, metrics=True)
    for name, url in cluster.metrics_urls.items():
        base = url.rsplit("/", 1)[0]
        assert probe(base + "/healthz") == (200, "ok\n"), name
        wait_until(lambda: probe(base + "/readyz")[0] == 200, 10, what=f"{name} to be ready")
        assert probe(base + "/metrics")[0] == 200
    leader, standby = cluster.masters[0], cluster.masters[1]
    leader_address, standby_address = leader.info["address"], standby.info["address"]
    wait_until(lambda: grpc_status(leader_address, "kvpool.Leader") == SERVING, 10, what="the leader's health")
    assert grpc_status(leader_address, "") == SERVING
    assert grpc_status(standby_address, "") == SERVING  # ready: it answers and can take over
    assert grpc_status(standby_address, "kvpool.Leader") == NOT_SERVING
    # Other methods still need a proof.
    with grpc.insecure_channel(standby_address) as channel:
        try:
            channel.unary_unary("/kvpool.Master/Stats")(b"", timeout=5)
            raise AssertionError("an unauthenticated Stats was answered")
        except grpc.RpcError as exc:
            assert exc.code() == grpc.StatusCode.UNAUTHENTICATED
    leader.kill()
    wait_until(lambda: grpc_status(standby_address, "kvpool.Leader") == SERVING, 30,
               what="the standby to take over and say so")
