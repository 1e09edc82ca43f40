"""Moves the master's etcd client to a new connection while etcd is silent to it.

etcd cut off silently leaves the master's one connection to it dead without
knowing it: its lease refreshes and watches wait, and TCP's retransmission
back-off finds etcd again up to tens of seconds after it returned. While this
master's lease goes unrefreshed (Election.etcd_in_doubt), the client is moved
to a new connection every second (kvpool.cluster.etcd_client.reconnect): the
calls stuck on the old one end with an error and are retried on the new one,
which reaches etcd within about a second of its return.
"""

import asyncio
import logging

import aetcd

from kvpool.cluster.etcd_client import reconnect

from .election import LeadershipState

log = logging.getLogger(__name__)

INTERVAL = 1.0


async def reconnect_while_silent(etcd: aetcd.Client, election: LeadershipState) -> None:
    silent = False
    while True:
        await asyncio.sleep(INTERVAL)
        if not election.etcd_in_doubt(0.0):
            silent = False
            continue
        if not silent:
            log.warning("etcd silent (the lease not refreshed for half its ttl): reconnecting every %gs", INTERVAL)
            silent = True
        try:
            await reconnect(etcd, INTERVAL)
        except Exception as exc:  # noqa: BLE001 - tried again next time
            log.debug("reconnecting to etcd failed: %s", exc)
