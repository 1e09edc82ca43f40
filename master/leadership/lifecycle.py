"""The master's leadership lifecycle: becoming leader (take over the cluster, then serve) and
stepping down (stop the term's work, forget the table), campaigning again in between.

Start-up (main.py) builds the parts and hands them here; the election itself
(etcd lease and leader key) is election.py. A term's work, started only once this
master won: the node watch (membership.py), the table rebuilt from the nodes'
inventories (takeover.py), and the background loops (reclaiming puts and expired
objects, REPORTs, eviction news, repair).
"""

import asyncio
import logging

import aetcd

from kvpool.master.leadership import takeover
from kvpool.master.leadership.adoption import Adopter
from kvpool.master.leadership.election import Election
from kvpool.master.leadership.inventory_mirror import MIRROR_INTERVAL, InventoryMirror
from kvpool.master.nodes.eviction_watch import EvictionWatch
from kvpool.master.nodes.membership import Membership
from kvpool.master.nodes.node_io import NodeIO
from kvpool.master.nodes.node_reports import ReportPoller
from kvpool.master.table.objects import ObjectTable
from kvpool.master.nodes.repair import Repairer
from kvpool.master.table.shared_tier import SHARED_NODE

log = logging.getLogger("kvpool.master")

RECLAIM_INTERVAL = 0.5
ETCD_CONNECT_TIMEOUT = 10.0
STARTUP_INVENTORY_TIMEOUT = 10.0  # how long serving waits for the nodes' inventories at start
# After etcd was silent, nodes whose leases expired meanwhile register again within about a second of its
# return (storenode/background/registration.py): a takeover then waits for them, this long at most, before it serves.
REGISTRATION_GRACE = 5.0
REGISTRATION_SETTLE = 1.0  # with no nodes remembered: the node set unchanged this long counts as complete


async def _reclaim_loop(table: ObjectTable, node_io: NodeIO) -> None:
    while True:
        await asyncio.sleep(RECLAIM_INTERVAL)
        keys = table.reclaim_expired()
        if keys:
            log.info("reclaimed %d puts not ended within %gs", len(keys), table.put_timeout)
        expired = table.drop_expired()
        if expired:
            log.info("dropped %d objects past their ttl", len(expired))
        evicted = table.evict_shared()  # the leader alone chooses what leaves the shared tier
        if evicted:
            log.debug("%d objects left the shared tier at its capacity", len(evicted))
        node_io.submit_frees(table.take_frees())


class Leader:
    """What only the leading master runs, started by take_over(): the node watch, the
    table rebuilt from the nodes, and the background loops."""

    def __init__(self, args, etcd: aetcd.Client, election: Election, table: ObjectTable, node_io: NodeIO,
                 adopter: Adopter, known_nodes: frozenset = frozenset(), mirror: InventoryMirror | None = None):
        self._args, self._etcd, self._election = args, etcd, election
        self._table, self._node_io, self._adopter = table, node_io, adopter
        self._mirror = mirror  # the inventories this master kept while it followed
        self._known_nodes = known_nodes  # node ids this master's previous term had
        self.tasks: list[asyncio.Task] = []
        self._joins: list | None = []  # node instances met before the table was rebuilt
        self._shared_asked = False  # whether this term asked for the shared tier's scan

    def _node_joined(self, node_id: str, instance: str, address: str) -> None:
        shared = self._table.shared
        if not self._shared_asked and shared.node is not None and node_id in shared.servers:
            # The first node mounting the shared tier: its manifests are read through it, as an inventory.
            self._shared_asked = True
            self._node_joined(SHARED_NODE, shared.node.instance, address)
        if self._joins is not None:
            self._joins.append((node_id, instance, address))
        else:
            self._adopter.node_joined(node_id, instance, address)

    async def take_over(self) -> None:
        """Know the nodes, then rebuild the table from what they hold (nothing per object is in etcd)."""
        args, loop = self._args, asyncio.get_running_loop()
        self._node_io.term = self._election.term  # REPORT and INVENTORY carry it: nodes refuse older leaders
        membership = Membership(self._etcd, args.cluster, self._table, self._node_io, on_join=self._node_joined,
                                etcd_in_doubt=self._election.etcd_in_doubt)
        self.tasks.append(loop.create_task(membership.run(), name="membership"))
        await asyncio.wait_for(membership.synced.wait(), ETCD_CONNECT_TIMEOUT)
        in_doubt = self._election.etcd_in_doubt(membership.grace)
        if in_doubt:
            await self._until_registered()
        joins, self._joins = self._joins, None
        # Every node at once; later joins (and nodes that did not answer now) go to the adopter, once
        # these inventories are adopted. Serving begins once they are in: they are adopted meanwhile.
        asked = loop.time()
        answered, silent = await asyncio.wait_for(
            takeover.inventories(self._table, self._node_io, joins, STARTUP_INVENTORY_TIMEOUT, self._mirror),
            STARTUP_INVENTORY_TIMEOUT * 2)
        received = loop.time()
        left = takeover.start_adopting(self._table, self._node_io, answered,
                                       self._mirror.disputes if self._mirror is not None else None)
        if self._mirror is not None:
            self._mirror.clear()
        indexed = loop.time()
        self._adopter.initial_adoption(True)  # before any node is handed to it (the silent ones, below)
        if in_doubt:  # nodes may still be registering again after etcd's silence: the whole table first
            await self._adopt_rest()
        else:
            self.tasks.append(loop.create_task(self._adopt_rest(), name="adopt-inventories"))
        for node in silent:
            self._adopter.node_joined(*node)
        self.tasks.append(loop.create_task(_reclaim_loop(self._table, self._node_io), name="reclaim"))
        self.tasks.append(loop.create_task(ReportPoller(self._table, self._node_io, args.report_interval,
                                                        on_lapsed=self._adopter.node_joined).run(),
                                           name="node-reports"))
        self.tasks.append(loop.create_task(EvictionWatch(self._table, self._node_io).run(),
                                           name="eviction-watch"))
        self.tasks.append(loop.create_task(Repairer(self._table, self._node_io, args.repair_rate).run(),
                                           name="repair"))
        log.info("took over with term %d: %d inventory entries from %d nodes (in %.2fs, indexed in %.2fs) to adopt "
                 "while serving (%d did not answer yet)", self._election.term, left, len(answered), received - asked,
                 indexed - received, len(silent))

    async def _adopt_rest(self) -> None:
        try:
            await takeover.adopt_rest(self._table, self._node_io)
        finally:
            self._adopter.initial_adoption(False)

    async def _until_registered(self) -> None:
        """etcd was silent just now, so nodes may have lost their leases for that alone and be registering
        again: a table built before they did would miss them (puts refused for want of nodes, their keys
        unknown). Waits until every node the previous term had is back (with none remembered: until the
        node set stops changing), REGISTRATION_GRACE s at most."""
        loop = asyncio.get_running_loop()
        start = loop.time()
        deadline, seen, changed = start + REGISTRATION_GRACE, set(self._table.nodes), start
        while loop.time() < deadline:
            nodes = set(self._table.nodes)
            if nodes != seen:
                seen, changed = nodes, loop.time()
            if self._known_nodes and self._known_nodes <= nodes:
                break
            if not self._known_nodes and nodes and loop.time() - changed >= REGISTRATION_SETTLE:
                break
            await asyncio.sleep(0.05)
        missing = sorted(self._known_nodes - set(self._table.nodes))
        log.info("etcd was silent: waited %.1fs for the nodes to register again (%d registered%s)",
                 loop.time() - start, len(self._table.nodes), f"; not back: {missing}" if missing else "")

    async def stop(self) -> None:
        for task in self.tasks:
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        self._adopter.initial_adoption(False)  # the adoption task may have been cancelled before it ran


async def _first_of(*events: asyncio.Event) -> None:
    waiters = [asyncio.ensure_future(e.wait()) for e in events]
    try:
        await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for waiter in waiters:
            waiter.cancel()


class Leadership:
    """This master's part in the election from its first campaign to its stop. `election.serving`
    is set only here: once a won term has taken over, cleared the moment it is lost."""

    def __init__(self, args, etcd: aetcd.Client, election: Election, table: ObjectTable, node_io: NodeIO,
                 adopter: Adopter):
        self._args, self._etcd, self._election = args, etcd, election
        self._table, self._node_io, self._adopter = table, node_io, adopter
        self._leader: Leader | None = None  # the current term's work, while this master leads
        interval = getattr(args, "standby_copy_interval", MIRROR_INTERVAL)
        # A standby keeps each node's inventory current, so its takeover reads only what changed since.
        self._mirror = InventoryMirror(etcd, args.cluster, node_io.transport, interval) if interval > 0 else None
        self._known_nodes: frozenset = frozenset()  # node ids the last term had, awaited by the next takeover
        self._campaign: asyncio.Task | None = None

    async def first_campaign(self) -> bool:
        """Lead at once if nobody does (a lone master leads before it says it is ready, so its first
        client is served at once); True if it does."""
        if not await self._election.campaign(give_up_after=0):
            return False
        await self._lead()
        return True

    async def run(self, stop: asyncio.Event) -> None:
        """Follow, lead, step down and campaign again, until `stop` is set."""
        election = self._election
        while not stop.is_set():
            if self._leader is None:
                if self._mirror is not None:
                    self._mirror.start()
                if not await self._until_done(election.campaign(), "campaign", stop):
                    break  # stopped while following
                try:
                    await self._lead()
                except Exception as exc:  # noqa: BLE001 - etcd or the nodes failed the takeover: try again
                    log.error("taking over failed (%s: %s)", type(exc).__name__, exc)
                    election.step_down()
            if election.is_leader:
                await _first_of(stop, election.lost)
            if stop.is_set():
                break
            # Deposed: stop the term's work, forget its (possibly stale) table, campaign afresh.
            election.step_down()
            await self._step_down()
            if not await self._until_done(election.rejoin(), "rejoin", stop):
                break

    async def _until_done(self, step, name: str, stop: asyncio.Event) -> bool:
        """Run the election's `step` (a coroutine) until it is done (True) or `stop` is set first (False;
        the step keeps running until stop_campaign)."""
        loop = asyncio.get_running_loop()
        self._campaign = loop.create_task(step, name=name)
        stopping = loop.create_task(stop.wait(), name="stop-wait")
        await asyncio.wait([self._campaign, stopping], return_when=asyncio.FIRST_COMPLETED)
        stopping.cancel()
        if not self._campaign.done():
            return False
        self._campaign.result()
        self._campaign = None
        return True

    async def _lead(self) -> None:
        if self._mirror is not None:
            await self._mirror.stop()
        self._leader = Leader(self._args, self._etcd, self._election, self._table, self._node_io, self._adopter,
                              self._known_nodes, self._mirror)
        await self._leader.take_over()
        self._election.serving = self._election.is_leader  # the lease may have expired while taking over

    async def _step_down(self) -> None:
        """End a lost term: nothing it started may act for the next one."""
        self._election.serving = False  # from now on every RPC but Stats answers NOT_LEADER
        log.error("leadership of term %d lost; following until this master wins again", self._election.term)
        await self._leader.stop()
        self._leader = None
        await self._adopter.close()
        self._node_io.discard_frees()
        self._known_nodes = frozenset(self._table.nodes)
        self._table.reset()

    async def stop_campaign(self) -> None:
        """Stopping: no campaign (or rejoin) goes on."""
        self._election.serving = False
        if self._campaign is not None:
            self._campaign.cancel()
            await asyncio.gather(self._campaign, return_exceptions=True)
        if self._mirror is not None:
            await self._mirror.stop()

    async def stop_term(self) -> None:
        """Stopping: the current term's work ends."""
        if self._leader is not None:
            await self._leader.stop()
