"""A node whose etcd record vanishes while etcd is in doubt to the master (membership.py): kept while it answers
the master directly, until it registers again or its grace ends; dropped at once when etcd is fine."""

import asyncio

from aetcd.rtypes import EventKind

from kvpool.master.nodes.membership import Membership
from kvpool.master.nodes.read_grants import ReadGrants
from kvpool.master.table.objects import ObjectTable
from kvpool.protocol import cluster_layout
from kvpool.protocol.cluster_layout import NodeRecord, TierRecord
from async_wait import until

CLUSTER = "c"


class _Nodes:
    """NodeIO's report(): answers while `answering`."""

    def __init__(self):
        self.answering = True
        self.asked = 0
        self.answer_despite_cancel = False  # as asyncio.wait_for may when the answer comes with the cancel
        self.grants = ReadGrants()

    async def report(self, address, timeout):
        self.asked += 1
        if not self.answering:
            raise ConnectionError("silent")
        try:
            await asyncio.sleep(0.01)
        except asyncio.CancelledError:
            if not self.answer_despite_cancel:
                raise
        return {}

    def submit_frees(self, orders):
        pass


def _record(node_id="n1"):
    return NodeRecord(node_id, f"{node_id}-i1", "127.0.0.1", 9001, tiers={"dram": TierRecord(1 << 30)})


def _key(node_id="n1"):
    return cluster_layout.nodes_prefix(CLUSTER) + node_id.encode()


def _membership(in_doubt: bool, grace=0.3, silent_now=False):
    """in_doubt: etcd was silent to the master lately; silent_now: it still is (the grace waits for its return)."""
    table, nodes = ObjectTable(), _Nodes()
    membership = Membership(None, CLUSTER, table, nodes, grace=grace,
                            etcd_in_doubt=lambda window: silent_now or (in_doubt and window > 0))
    membership._apply(EventKind.PUT, _key(), _record().to_json())
    assert "n1" in table.nodes
    return membership, table, nodes


def test_a_vanished_registration_drops_the_node_at_once_while_etcd_is_fine():
    async def scenario():
        membership, table, nodes = _membership(in_doubt=False)
        membership._apply(EventKind.DELETE, _key(), b"")
        assert "n1" not in table.nodes and nodes.asked == 0
    asyncio.run(scenario())


def test_after_etcd_was_silent_a_node_that_answers_is_kept_until_it_registers_again():
    async def scenario():
        membership, table, nodes = _membership(in_doubt=True, grace=5.0)
        membership._apply(EventKind.DELETE, _key(), b"")
        await until(lambda: nodes.asked >= 2, interval=0.01)
        assert "n1" in table.nodes  # it answers: kept
        membership._apply(EventKind.PUT, _key(), _record().to_json())  # registered again (same instance)
        assert "n1" in table.nodes and not membership._unregistered
        membership.close()
    asyncio.run(scenario())


def test_after_etcd_was_silent_a_node_is_dropped_when_it_does_not_answer_or_its_grace_ends():
    async def scenario():
        membership, table, nodes = _membership(in_doubt=True, grace=5.0)
        nodes.answering = False
        membership._apply(EventKind.DELETE, _key(), b"")
        await until(lambda: "n1" not in table.nodes, interval=0.01)

        membership, table, nodes = _membership(in_doubt=True, grace=0.3)  # answers, never registers again
        membership._apply(EventKind.DELETE, _key(), b"")
        await asyncio.sleep(0)
        assert "n1" in table.nodes
        await until(lambda: "n1" not in table.nodes, interval=0.01)
        assert nodes.asked >= 1
    asyncio.run(scenario())


def test_the_grace_counts_from_etcds_return_to_the_master():
    async def scenario():
        membership, table, nodes = _membership(in_doubt=True, grace=0.2, silent_now=True)
        membership._apply(EventKind.DELETE, _key(), b"")
        await until(lambda: nodes.asked >= 3, interval=0.01)  # well past the grace: etcd is still silent to the master
        assert "n1" in table.nodes
        membership.close()
    asyncio.run(scenario())


def test_a_wait_ends_with_the_term_and_drops_nothing_after_it():
    async def scenario():
        membership, table, nodes = _membership(in_doubt=True, grace=0.1)
        nodes.answer_despite_cancel = True
        membership._apply(EventKind.DELETE, _key(), b"")
        await until(lambda: nodes.asked >= 1, interval=0.01)
        membership.close()  # the term ended; the table is the next term's now
        await asyncio.sleep(0.8)  # several graces: nothing may be dropped by the old wait
        assert "n1" in table.nodes
        membership._apply(EventKind.DELETE, _key(), b"")  # a closed membership starts no new wait
        assert not membership._unregistered
    asyncio.run(scenario())
