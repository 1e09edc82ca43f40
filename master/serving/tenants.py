"""The master's side of tenants (kvpool/protocol/tenants.py): an operator's changes (the Tenants RPC), each
tenant's figures summed from the nodes' REPORTs, and what Stats shows a tenant.

A deleted tenant's objects are removed from the table at once (their FREEs go to every node before the
answer), and its token stops on every master and node a watch event later (kvpool/cluster/tenant_directory.py).
"""

import logging

from kvpool.cluster.tenant_directory import TenantRecords
from kvpool.errors import InvalidArgumentError
from kvpool.proto import kvpool_pb2 as pb
from kvpool.protocol.tenants import TenantRecord, scope_of

log = logging.getLogger(__name__)

FIGURES = ("objects", "dram_bytes", "ssd_bytes", "hits", "misses", "evicted_quota", "evicted_pressure", "refused")


def usage(names, nodes) -> dict[str, dict]:
    """name -> each of FIGURES summed over the nodes' last REPORTs, for the tenants `names`."""
    sums = {name: dict.fromkeys(FIGURES, 0) for name in names}
    for node in nodes:
        for name, figures in (node.tenants or {}).items():
            total = sums.get(name)
            if total is None or not isinstance(figures, dict):
                continue
            for figure in FIGURES:
                value = figures.get(figure)
                if type(value) is int and value > 0:
                    total[figure] += value
    return sums


def usage_message(record: TenantRecord, figures: dict) -> pb.TenantUsage:
    return pb.TenantUsage(name=record.name, version=record.version, limits=pb.TenantLimits(**record.limits()),
                          **figures)


class TenantAdmin:
    """Serves the Tenants RPC. records: the etcd changes; verifier: the master's (its `tenants` are the
    records as last read); table: the object table (nodes' reports, and a deleted tenant's objects)."""

    def __init__(self, records: TenantRecords | None, verifier, table):
        self.records = records
        self.verifier = verifier
        self.table = table

    def figures(self, names=None) -> list[pb.TenantUsage]:
        tenants = self.verifier.tenants
        names = sorted(tenants) if names is None else [n for n in names if n in tenants]
        sums = usage(names, self.table.nodes.values())
        return [usage_message(tenants[name], sums[name]) for name in names]

    async def serve(self, request: pb.TenantsRequest) -> pb.TenantsResponse:
        action, name = request.action, request.name
        if action in ("list", "usage"):
            return pb.TenantsResponse(status=pb.OK, tenants=self.figures([name] if name else None))
        if self.records is None:
            raise InvalidArgumentError("this master runs without etcd: it keeps no tenants")
        # Names TenantLimits lacks are refused by TenantRecords, naming them.
        given = {field: getattr(request.limits, field, None) for field in request.given}
        if action == "create":
            record = await self.records.create(name, given)
        elif action == "set":
            record = await self.records.set(name, given)
        elif action == "rotate":
            record = await self.records.rotate(name)
        elif action == "delete":
            record = await self.records.delete(name)
            removed = self.table.remove_by_prefix(scope_of(name).prefix)  # freed on every node before the answer
            log.info("tenant %s deleted: %d objects removed", name, removed)
        else:
            raise InvalidArgumentError(f"unknown tenants action {action!r}: list, usage, create, set, rotate, delete")
        if action != "delete":
            log.info("tenant %s: %s (token version %d, limits %s)", name, action, record.version, record.limits())
        return pb.TenantsResponse(status=pb.OK, tenants=[usage_message(record, dict.fromkeys(FIGURES, 0))])
