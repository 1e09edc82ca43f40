"""The read grant: a node serves reads only while the leader's last REPORT is recent, and once lapsed
only after an INVENTORY then a REPORT (storenode/serving/read_grant.py); the leader's side (master/nodes/read_grants.py,
node_io.py, ledger.py): its bound on when a node that did not confirm a FREE stops serving, REPORTs only
over confirmed FREEs and at most one unanswered, FREEs still ordered on a node dropped under a grant."""

import asyncio
import time

import pytest

from kvpool.errors import KeyNotFoundError, StaleReplicaError, UnavailableError
from kvpool.master.table.ledger import FreeOrder
from kvpool.master.nodes.node_io import NodeIO
from kvpool.master.table.objects import ObjectTable
from kvpool.master.nodes.read_grants import ReadGrants
from kvpool.storenode.serving.read_grant import ReadGrant

from test_objects import record


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def test_a_node_serves_until_its_grant_lapses_then_only_after_an_inventory_and_a_report():
    clock = Clock()
    grant = ReadGrant(period=3.0, clock=clock)
    grant.check()  # before any leader reported: serves
    assert grant.reported()
    clock.now += 2.9
    grant.check()
    clock.now += 0.2
    with pytest.raises(StaleReplicaError):
        grant.check()
    assert not grant.reported()  # a REPORT alone (maybe one sent long ago) does not renew a lapsed grant
    with pytest.raises(StaleReplicaError):
        grant.check()
    grant.inventoried()
    assert grant.reported()
    grant.check()


def test_a_new_leaders_inventory_reconciles_a_node_whose_grant_lapses_before_its_first_report():
    """A takeover: the new leader's INVENTORY (a new term) arrives while the old leader's grant still holds,
    and that grant lapses before the new leader's first REPORT (adopting a large inventory takes seconds).
    The new leader knows only what the inventory said and REPORTs only over confirmed FREEs: its REPORT
    renews the grant (else every node refuses reads after each takeover until inventoried once more)."""
    clock = Clock()
    grant = ReadGrant(period=3.0, clock=clock)
    assert grant.reported()  # the old leader's last REPORT
    clock.now += 1.0
    grant.inventoried(new_term=True)  # the new leader's first INVENTORY, the grant still holding
    clock.now += 2.5
    with pytest.raises(StaleReplicaError):
        grant.check()  # lapsed meanwhile: no reads until the new leader reports
    assert grant.reported()
    grant.check()
    clock.now += 3.5  # and a later lapse within the same term needs an INVENTORY again
    grant.inventoried()
    assert grant.reported()
    clock.now += 3.5
    assert not grant.reported()


def test_an_etcd_lease_plays_no_part_a_node_serves_on_the_leaders_reports_alone():
    clock = Clock()
    grant = ReadGrant(period=3.0, clock=clock)
    assert grant.reported()
    for _ in range(10):  # REPORTs every 2 s, whatever etcd does: reads served throughout
        clock.now += 2.0
        grant.check()
        assert grant.reported()


def test_a_node_dropped_while_its_grant_may_last_is_still_freed_on_until_then():
    clock = Clock()
    table = ObjectTable(clock=clock, first_generation=100)
    table.upsert_node(record("n1"))
    table.upsert_node(record("n2", port=7001))
    kept, lost, late = "k/kept", "k/lost", "k/late"
    generation = {}
    for key, replicas in ((kept, 2), (lost, 1), (late, 2)):
        generation[key] = table.put_start(key, 100, 7, replicas=replicas).generation
        table.put_end(key, generation[key])
    dropped = table.lookup(lost).replicas[0].node_id  # holds every key, `lost` its only copy
    address = table.nodes[dropped].address
    table.take_frees()
    table.drop_node(dropped, grant_until=clock.now + 3.0)
    assert table.take_frees() == []  # dropping frees nothing: its versions are still the current ones
    assert table.lookup(lost) is None
    table.remove(kept)
    assert FreeOrder(address, kept.encode(), generation[kept]) in table.take_frees()
    table.put_end(lost, table.put_start(lost, 100, 7).generation)  # a new put of a key lost with it
    assert FreeOrder(address, lost.encode(), generation[lost]) in table.take_frees()
    clock.now += 3.1  # its grant has ended: nothing more is owed there
    table.remove(late)
    assert all(order.address != address for order in table.take_frees())


def test_reports_one_at_a_time_settled_first_and_none_after_an_unanswered_one_until_reconciled():
    calls = []

    class Transport:
        async def free_many(self, address, pairs):
            calls.append(("FREE", pairs))
            return [True] * len(pairs)

        async def report(self, address, term):
            calls.append(("REPORT", address))
            if address == "silent:1":
                await asyncio.sleep(10)
            return {}

    async def scenario():
        node_io = NodeIO(Transport())
        node_io.grants.ordered([FreeOrder("n:1", b"a", 1)])
        assert await node_io.report("n:1", 1.0) == {}
        assert calls == [("FREE", [(b"a", 1)]), ("REPORT", "n:1")]  # the FREE owed went first
        with pytest.raises(TimeoutError):
            await node_io.report("silent:1", 0.05)
        with pytest.raises(UnavailableError):
            await node_io.report("silent:1", 0.05)  # not sent: one unanswered may still arrive
        assert calls.count(("REPORT", "silent:1")) == 1
        node_io.grants.reconciled("silent:1")
        with pytest.raises(TimeoutError):
            await node_io.report("silent:1", 0.05)
        assert calls.count(("REPORT", "silent:1")) == 2

    asyncio.run(scenario())


def test_frees_stay_owed_until_confirmed_and_not_held_counts_as_confirmed():
    grants = ReadGrants(clock=Clock())
    orders = [FreeOrder("n:1", b"a", 1), FreeOrder("n:1", b"b", 2)]
    grants.ordered(orders)
    assert not grants.answered("n:1", orders, [True, UnavailableError("down")])
    assert grants.owed("n:1") == [orders[1]]
    assert grants.answered("n:1", orders[1:], [KeyNotFoundError("not held")])
    assert grants.owed("n:1") == []


def test_the_leaders_bound_on_a_nodes_grant():
    clock = Clock()
    grants = ReadGrants(clock=clock, period=3.0)
    assert grants.grant_ends("n:1", 100.0) >= 103.0  # never reported by this leader
    grants.report_sent("n:1")
    grants.report_answered("n:1")  # at 100
    clock.now = 101.0
    assert 103.0 <= grants.grant_ends("n:1", 101.0) < 103.5
    grants.report_sent("n:1")  # no answer: it may reach the node later
    assert grants.grant_ends("n:1", 101.0) >= 104.0  # the FREE at 101 may follow a REPORT delivered just before
    assert grants.grant_ends("n:1", 110.0) >= 106.0  # a lapsed node is not renewed by it: 2 grants at most
    assert grants.grant_ends("n:1", 110.0) < 110.0


def test_a_report_answered_while_the_masters_loop_was_busy_past_its_deadline_counts_as_answered():
    class Transport:
        async def free_many(self, address, pairs):
            return [True] * len(pairs)

        async def report(self, address, term):
            await asyncio.sleep(0.01)
            for _ in range(3):  # the answer passes a few tasks (socket reader, link) on its way
                await asyncio.sleep(0)
            return {"tiers": {}}

    async def busy_loop():
        await asyncio.sleep(0)
        time.sleep(0.5)  # the loop blocked (a large adoption, say) well past the REPORT's deadline

    async def scenario():
        node_io = NodeIO(Transport())
        asyncio.get_running_loop().create_task(busy_loop())
        assert await node_io.report("n:1", 0.1) == {"tiers": {}}
        assert node_io.grants.may_report("n:1")

    asyncio.run(scenario())


def test_an_answer_waits_out_an_unconfirmed_free_only_of_a_replaced_version():
    """A FREE of a version readers may hold (replaced=True) keeps the answer until the silent node's grant ends;
    that of a pending put's copy (a put ending without the copy it could not write, or revoked: never named to a
    reader) is owed just the same but holds nobody (else a put with min_replicas waits a grant past its deadline)."""

    class Silent:
        async def free_many(self, address, pairs):
            await asyncio.sleep(10)

        async def report(self, address, term):
            return {}

    async def answered_in(order: FreeOrder) -> float:
        node_io = NodeIO(Silent())
        assert await node_io.report(order.address, 1.0) == {}  # the node's grant: READ_GRANT from now
        started = time.monotonic()
        await node_io.free_now([order], wait=0.05)
        took = time.monotonic() - started
        assert order in node_io.grants.owed(order.address)  # owed either way: no REPORT until confirmed
        await node_io.close()
        return took

    assert asyncio.run(answered_in(FreeOrder("n:1", b"k", 1, replaced=False))) < 1.0
    assert asyncio.run(answered_in(FreeOrder("n:1", b"k", 1))) > 1.0
    table = ObjectTable(first_generation=100)
    table.upsert_node(record("n1"))
    table.upsert_node(record("n2", port=7001))
    version = table.put_start("k/partial", 100, 7, replicas=2, min_replicas=1)
    table.take_frees()
    failed = version.replicas[0].node_id
    table.put_end("k/partial", version.generation, [failed])
    assert [order.replaced for order in table.take_frees()] == [False]  # the copy it could not write
    table.put_end("k/partial", table.put_start("k/partial", 100, 7, overwrite=True).generation)
    assert all(order.replaced for order in table.take_frees())  # the version it replaced


def test_a_node_no_leader_reported_to_yet_stops_serving_a_grant_after_a_leaders_inventory():
    """Cut off before the first REPORT (a partition right after joining): the open start must end, else the
    node serves versions overwritten meanwhile for ever."""
    clock = Clock()
    grant = ReadGrant(period=3.0, clock=clock)
    grant.inventoried()  # an INVENTORY of no newer term (an operator's tool): the open start stays
    clock.now += 100.0
    grant.check()
    grant.inventoried(new_term=True)  # the first leader takes the node in
    clock.now += 2.9
    grant.check()
    clock.now += 0.2
    with pytest.raises(StaleReplicaError):
        grant.check()
    assert grant.reported()  # its first REPORT, however late, renews it (the leader reconciled the node)
    grant.check()


def test_waiting_out_the_grant_of_a_node_that_never_answered_a_report_ends():
    """A node cut off before answering this leader's first REPORT, then back: taking it in again waits one
    grant, not for ever (it was asked with a bound that moved with the clock)."""
    async def scenario():
        grants = ReadGrants(period=0.2, delivery=0.3)
        grants.report_sent("n:1")
        grants.report_unanswered("n:1")
        started = time.monotonic()
        await asyncio.wait_for(grants.until_ended("n:1"), 5)
        waited = time.monotonic() - started
        grants.report_sent("n:2")  # answered, then one more left unanswered: two grants past the answer
        grants.report_answered("n:2")
        grants.report_sent("n:2")
        grants.report_unanswered("n:2")
        started = time.monotonic()
        await asyncio.wait_for(grants.until_ended("n:2"), 5)
        return waited, time.monotonic() - started

    never_answered, answered_then_silent = asyncio.run(scenario())
    assert 0.45 < never_answered < 2  # the REPORT's delivery window, then a grant
    assert 0.4 < answered_then_silent < 2  # two grants past the answered REPORT
