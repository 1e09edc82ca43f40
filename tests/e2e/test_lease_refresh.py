"""A leader whose event loop is busy for longer than its lease keeps the lease: it is refreshed from a thread
of its own over etcd's JSON gateway (master/leadership/lease_refresh.py), not on the loop. A real etcd; the master's
Election in this process."""

import asyncio
import time

import pytest

from kvpool.cluster.etcd_client import EtcdClient
from kvpool.master.leadership.election import Election
from kvpool.master.leadership.lease_refresh import GatewayLease
from storenode_harness import member_credential

TTL = 2


async def _lead_through_a_busy_loop(endpoint: str, on_thread: bool) -> tuple[bool, bool, int]:
    """(still leading, the leader key still under its lease, refresh failures seen) after the loop was
    blocked for longer than the ttl."""
    host, port = endpoint.rsplit(":", 1)
    async with EtcdClient(host, int(port), member_credential()) as etcd:
        refresh = GatewayLease(endpoint).refresh if on_thread else None
        election = Election(etcd, "busy", "m1", "127.0.0.1:1", ttl=TTL, refresh=refresh)
        await election.start()
        try:
            assert await election.campaign(give_up_after=10)
            time.sleep(TTL * 1.6)  # the loop blocked (a large adoption, say): nothing on it runs meanwhile
            await asyncio.sleep(TTL)  # the loop's own lease task has its turns again
            record = await etcd.get(election.key)
            kept = record is not None and record.lease == election._lease.id
            return election.is_leader and election.holds_lease(), kept, election._asked_unanswered
        finally:
            await election.resign()


def test_a_leader_keeps_its_lease_through_a_loop_busy_longer_than_the_ttl(etcd):
    assert asyncio.run(_lead_through_a_busy_loop(etcd, on_thread=True)) == (True, True, False)


def test_refreshed_on_the_loop_the_same_busy_spell_costs_the_lease(etcd):
    """What the thread prevents (and that the scenario above could fail)."""
    leading, kept, _ = asyncio.run(_lead_through_a_busy_loop(etcd, on_thread=False))
    assert not leading and not kept


def test_a_lease_etcd_no_longer_has_reads_as_gone(etcd):
    async def scenario():
        host, port = etcd.rsplit(":", 1)
        async with EtcdClient(host, int(port), member_credential()) as client:
            lease = await client.lease(TTL)
            gateway = GatewayLease(etcd)
            alive = gateway.refresh(lease.id, 1.0)
            await client.revoke_lease(lease.id)
            return alive, gateway.refresh(lease.id, 1.0)

    assert asyncio.run(scenario()) == (TTL, 0)
    with pytest.raises(OSError):
        GatewayLease("127.0.0.1:1").refresh(1, 1.0)  # nothing listens: an error, not "gone"


def test_a_loop_stuck_for_good_lets_the_lease_go():
    """Busy is not stuck: once the loop has not run its lease task for LOOP_STALL ttls the thread stops
    refreshing, the lease lapses and a follower can take over."""
    from types import SimpleNamespace

    from kvpool.master.leadership.election import LOOP_STALL

    election = Election(None, "c", "m1", "127.0.0.1:1", ttl=TTL)
    election._lease = SimpleNamespace(id=7)
    election._loop_beat = time.monotonic()
    assert election._lease_to_refresh() == 7
    election._loop_beat -= LOOP_STALL * TTL + 0.1
    assert election._lease_to_refresh() is None


def test_without_the_json_gateway_the_lease_is_refreshed_on_the_loop(etcd):
    async def scenario():
        host, port = etcd.rsplit(":", 1)
        async with EtcdClient(host, int(port), member_credential()) as client:
            election = Election(client, "nogw", "m1", "127.0.0.1:1", ttl=TTL,
                                refresh=GatewayLease("127.0.0.1:1").refresh)  # nothing answers there
            await election.start()
            try:
                assert await election.campaign(give_up_after=10)
                await asyncio.sleep(TTL * 1.5)
                return election._refresher is None, election.is_leader and election.holds_lease()
            finally:
                await election.resign()

    assert asyncio.run(scenario()) == (True, True)
