"""The node's NodeRecord in etcd, held under a lease that lives only as long as the node does."""

import asyncio
import logging
import math
import time

import aetcd

from kvpool.protocol.cluster_layout import NodeRecord, node_key, parse_hostport
from kvpool.errors import UnavailableError
from kvpool.cluster.etcd_client import OWN_CONNECTION, EtcdClient, reconnect

log = logging.getLogger(__name__)

ATTEMPT_TIMEOUT = 1.0  # longest wait for one etcd call while the lease is kept: a silent etcd is found by the clock
RETRY_DELAY = 0.2  # pause between attempts once one failed (etcd may be back any moment)


class NodeRegistration:
    """Puts the record under a lease, refreshes it every ttl/3, and registers again if the lease is lost.

    The master treats the key vanishing (lease expired or revoked) as the node leaving,
    so a clean stop revokes the lease to make that immediate. When etcd stops answering,
    each attempt is bounded (ATTEMPT_TIMEOUT) and made on a fresh connection: the old one may
    be dead without knowing it (a silent partition), and TCP's retransmission back-off would
    find etcd again many seconds after it came back. So a lease that expired meanwhile is
    replaced within about a second of etcd's return; the node serves throughout.
    """

    def __init__(self, etcd: str, cluster: str, record: NodeRecord, ttl: float, credential=None, tls=None,
                 allow_open: bool = False):
        self.etcd_host, self.etcd_port = parse_hostport(etcd)
        self.key = node_key(cluster, record.node_id)
        self.value = record.to_json()
        self.ttl = max(1, math.ceil(ttl))  # etcd leases are whole seconds
        self.lease_id: int | None = None
        self.credential = credential  # logs in to etcd as a member (kvpool/cluster/etcd_client.py)
        self.tls = tls  # TlsFiles: etcd is reached over TLS
        self.allow_open = allow_open  # go on when etcd has authentication off (else OpenEtcdError)
        self.refreshed = float("-inf")  # when the last grant or refresh of the lease that etcd took was sent
        self._client: aetcd.Client | None = None
        self._keepalive: asyncio.Task | None = None

    async def start(self, timeout: float = 30.0) -> None:
        """Register, retrying while etcd is unreachable; UnavailableError after `timeout` s."""
        # A per-call deadline keeps a stalled etcd from outliving the lease unnoticed.
        self._client = EtcdClient(self.etcd_host, self.etcd_port, self.credential, timeout=self.ttl, tls=self.tls,
                                  allow_open=self.allow_open, options=dict(OWN_CONNECTION))
        deadline = time.monotonic() + timeout
        while True:
            try:
                await self._register()
                break
            except aetcd.ClientError as exc:
                if time.monotonic() >= deadline:
                    raise UnavailableError(f"no registration within {timeout:g}s: {exc}") from None
                log.warning("etcd at %s:%d not usable yet (%s); retrying", self.etcd_host, self.etcd_port, exc)
                await asyncio.sleep(0.5)
        self._keepalive = asyncio.create_task(self._keep_alive(), name="etcd-keepalive")

    @property
    def etcd(self):
        """The etcd client the registration keeps (for the node's other reads and watches), once started."""
        return self._client

    def in_etcd(self) -> bool:
        """Registered, and the lease refreshed within its ttl (so the master still counts this node)."""
        return time.monotonic() - self.refreshed < self.ttl

    async def stop(self) -> None:
        if self._keepalive:
            self._keepalive.cancel()
            await asyncio.gather(self._keepalive, return_exceptions=True)
        if self._client is None:
            return
        if self.lease_id is not None:
            try:
                await asyncio.wait_for(self._client.revoke_lease(self.lease_id), ATTEMPT_TIMEOUT)
            except Exception as exc:  # the lease then expires on its own after ttl
                log.warning("could not revoke lease %x: %s", self.lease_id, exc)
        await self._client.close()

    async def _register(self) -> None:
        sent = time.monotonic()  # etcd counts the ttl from later: in_etcd() errs on the safe side
        lease = await self._client.lease(self.ttl)
        await self._client.put(self.key, self.value, lease=lease)
        self.lease_id = lease.id
        self.refreshed = sent
        log.info("registered %s in etcd (lease %x, ttl %ds)", self.key.decode(), lease.id, self.ttl)

    async def _keep_alive(self) -> None:
        failing = False
        while True:
            await asyncio.sleep(RETRY_DELAY if failing else self.ttl / 3)
            try:
                await asyncio.wait_for(self._refresh(), ATTEMPT_TIMEOUT * 2)
                if failing:
                    log.info("etcd answers again; lease %x held", self.lease_id)
                failing = False
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - keep trying: etcd may come back before the lease runs out
                if not failing:
                    log.warning("etcd keepalive failed (%s: %s); retrying on a new connection",
                                type(exc).__name__, exc)
                failing = True
                await reconnect(self._client, ATTEMPT_TIMEOUT)

    async def _refresh(self) -> None:
        sent = time.monotonic()
        reply = await asyncio.wait_for(self._client.refresh_lease(self.lease_id), ATTEMPT_TIMEOUT)
        if reply is None or reply.TTL <= 0:
            # Expired while etcd was unreachable, or etcd lost its data: the key is gone.
            log.warning("lease %x lost; registering again", self.lease_id)
            await self._register()
        else:
            self.refreshed = sent

