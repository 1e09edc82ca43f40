"""The part of each tenant's limits this node keeps (kvpool/protocol/tenants.py node_share): its limits times
this node's part of the pool's capacity, per tier and in total, so the shares of every node add up to the
tenant's limits and no node asks another what it holds. The pool's capacity is read from the nodes' records
in etcd, every few seconds and whenever a tenant's record changes; a node alone in etcd keeps whole limits.
"""

import asyncio
import contextlib
import logging

from kvpool.protocol import cluster_layout
from kvpool.protocol.cluster_layout import NodeRecord
from kvpool.protocol.tenants import node_share

log = logging.getLogger(__name__)

REFRESH = 2.0  # seconds between reads of the nodes' capacities
READ_TIMEOUT = 2.0


def capacity_of(record: NodeRecord) -> tuple[int, int]:
    tiers = record.tiers
    return (tiers["dram"].capacity if "dram" in tiers else 0, tiers["ssd"].capacity if "ssd" in tiers else 0)


class TenantShares:
    """Keeps store.set_tenant_shares current (run() until cancelled). own: this node's (DRAM, SSD) capacity; verifier: its
    `tenants` are the records (kvpool/cluster/tenant_directory.py)."""

    def __init__(self, etcd, cluster: str, node_id: str, own: tuple[int, int], verifier, store,
                 refresh: float = REFRESH):
        self._etcd = etcd
        self._prefix = cluster_layout.nodes_prefix(cluster)
        self.node_id = node_id
        self.own = own
        self.pool = own  # until the nodes' records are read: this node alone
        self.verifier = verifier
        self.store = store
        self.refresh = refresh
        self.shares: dict = {}
        self._changed = asyncio.Event()  # a tenant's record changed: read the pool's capacity again now

    def changed(self) -> None:
        """A tenant's record changed: its new shares now, and again once the pool's capacity is read afresh
        (a node that joined since the last read would otherwise count for nothing until the next one)."""
        self.apply()
        self._changed.set()

    def apply(self) -> None:
        """Give the store the shares of the tenants' current records over the pool as last read."""
        shares = {name: node_share(record, self.own, self.pool) for name, record in self.verifier.tenants.items()}
        if shares != self.shares:
            self.shares = shares
            self.store.set_tenant_shares(shares)

    async def run(self) -> None:
        while True:
            self._changed.clear()  # (a change during the read below makes the wait end at once: read again)
            try:
                records = await asyncio.wait_for(self._etcd.get_prefix(self._prefix), READ_TIMEOUT)
                pool = [0, 0]
                seen_self = False
                for kv in records:
                    with contextlib.suppress(ValueError, TypeError, KeyError):
                        record = NodeRecord.from_json(kv.value)
                        dram, ssd = capacity_of(record)
                        pool[0] += dram
                        pool[1] += ssd
                        seen_self |= record.node_id == self.node_id
                if not seen_self:  # not registered (yet, or etcd lost it): count this node anyway
                    pool = [pool[0] + self.own[0], pool[1] + self.own[1]]
                self.pool = tuple(pool)
                self.apply()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - etcd away: keep the shares we have
                log.debug("reading the pool's capacity failed (%s: %s)", type(exc).__name__, exc)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._changed.wait(), self.refresh)
