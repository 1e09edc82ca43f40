"""The master's health, as gRPC's standard health service (grpc.health.v1) and the HTTP probes (kvpool/runtime/health.py),
and the leader and term gauges.

Service "" (the whole server) is SERVING once the master has joined the election, as leader or standby: either
can answer clients (a standby names the leader) and take over; NOT_SERVING before that and while stopping.
Service "kvpool.Leader" is SERVING only on the leader that has taken over the cluster and serves requests, with
a lease that cannot have expired by its own clock (Election.answering): a leader cut off from etcd stops saying
so before a successor may lead, as does its leader gauge and /readyz's "leading".
The health methods need no proof (ServerAuth lets them through): they tell nothing but these states.
"""

import asyncio

from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio

from kvpool.runtime.health import Health

from kvpool.master.leadership.election import LeadershipState
from kvpool.master.serving.metrics import MasterMetrics

LEADER_SERVICE = "kvpool.Leader"
REFRESH = 0.2  # seconds between looks at the election (well inside the lease margin)


class MasterHealth:
    def __init__(self, server, election: LeadershipState, metrics: MasterMetrics | None = None):
        self.servicer = health_aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.servicer, server)
        self.election = election
        self.metrics = metrics  # MasterMetrics: its leader and term gauges follow the election too
        self.joined = False    # set once the master campaigned (won or lost)
        self.stopping = False
        self.probes = Health(self.ready)

    def leading(self) -> bool:
        return self.election.answering()

    def ready(self) -> tuple[bool, str]:
        if self.stopping:
            return False, "stopping"
        if not self.joined:
            return False, "joining the election"
        return True, "leading" if self.leading() else "standing by"

    async def run(self) -> None:
        """Keep the gRPC statuses in step with the election (and the event loop's heartbeat for /healthz)."""
        serving, not_serving = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING
        beat = asyncio.ensure_future(self.probes.beat())
        try:
            while True:
                await self.servicer.set("", serving if self.ready()[0] else not_serving)
                leading = self.leading()
                await self.servicer.set(LEADER_SERVICE, serving if leading else not_serving)
                if self.metrics is not None:
                    self.metrics.leader.set(1 if leading else 0)
                    self.metrics.term.set(self.election.term or 0)
                await asyncio.sleep(REFRESH)
        finally:
            beat.cancel()
