"""The read grant: a node serves reads only while the leader's last REPORT is recent and its lease fresh,
and once lapsed only after an INVENTORY then a REPORT (storenode/read_grant.py); the leader's bound on
when a node that did not confirm a FREE stops serving (master/read_grants.py)."""

import pytest

from kvpool.errors import KeyNotFoundError, StaleReplicaError, UnavailableError
from master.ledger import FreeOrder
from master.read_grants import ReadGrants
from storenode.read_grant import ReadGrant


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


class Registration:
    def __init__(self):
        self.lease_id = 1
        self.fresh = True

    def in_etcd(self):
        return self.fresh


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


def test_a_lease_that_may_have_expired_or_was_replaced_lapses_the_grant():
    clock, registration = Clock(), Registration()
    grant = ReadGrant(period=3.0, clock=clock)
    grant.registered(registration)
    grant.check()
    registration.lease_id = 2  # registered again: the leader may have dropped this node meanwhile
    with pytest.raises(StaleReplicaError):
        grant.check()
    registration.lease_id = 1
    with pytest.raises(StaleReplicaError):  # stays lapsed until reconciled
        grant.check()
    grant.inventoried()
    assert grant.reported()
    grant.check()
    registration.fresh = False
    with pytest.raises(StaleReplicaError):
        grant.check()


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
