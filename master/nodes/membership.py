"""Keeps the object table's node set equal to the node records in etcd.

A node's record lives under its lease, so etcd deletes it when the node stops
or stops refreshing; that DELETE is how the master learns a node is gone.
After any watch failure the full record set is read again before watching
resumes, so events missed meanwhile (or compacted away) cannot leave a dead
node in the table.

Every new node instance (a node seen for the first time, or restarted) is
handed to `on_join`, which asks it what it still holds.

A record can also vanish because etcd itself was silent (cut off, stalled) for
longer than the node's lease: the node is fine and registers again as soon as
etcd answers. So while etcd is in doubt to this master (election.etcd_in_doubt),
a vanished node is not dropped on that alone: it is asked directly (REPORT),
and one that answers keeps its place (and its objects) for up to `grace`
seconds to register again; one that does not answer, or does not register in
time, is dropped as before.
"""

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable

import aetcd
from aetcd.rtypes import EventKind

from kvpool.protocol import cluster_layout
from kvpool.protocol.cluster_layout import NodeRecord

from kvpool.master.nodes.node_io import NodeIO
from kvpool.master.table.node_events import Dropped
from kvpool.master.table.objects import ObjectTable
from kvpool.master.table.shared_tier import SHARED_NODE

log = logging.getLogger(__name__)

GRACE = 10.0  # seconds a node that answers has to register again after etcd's silence
PROBE_INTERVAL = 0.5  # how often such a node is asked again meanwhile
PROBE_TIMEOUT = 1.0


class Membership:
    def __init__(self, etcd: aetcd.Client, cluster: str, table: ObjectTable, node_io: NodeIO,
                 on_join: Callable[[str, str, str], None] | None = None, retry_delay: float = 0.5,
                 etcd_in_doubt: Callable[[float], bool] = lambda window: False, grace: float = GRACE):
        self._etcd = etcd
        self._prefix = cluster_layout.nodes_prefix(cluster)
        self._table = table
        self._node_io = node_io
        self._on_join = on_join
        self._retry_delay = retry_delay
        self.synced = asyncio.Event()  # set once the first full read was applied
        self._etcd_in_doubt = etcd_in_doubt
        self.grace = grace
        self._unregistered: dict[str, asyncio.Task] = {}  # node id -> its wait to register again
        self._closed = False

    async def run(self) -> None:
        try:
            await self._follow()
        finally:
            self.close()

    async def _follow(self) -> None:
        while True:
            try:
                revision = await self._resync()
                self.synced.set()
                watch = await self._etcd.watch_prefix(self._prefix, start_revision=revision + 1)
                try:
                    async for event in watch:
                        self._apply(event.kind, event.kv.key, event.kv.value)
                finally:
                    with contextlib.suppress(Exception):
                        await watch.cancel()
                log.warning("node watch ended; reading the node set again")
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - etcd unreachable or watch broken: resync and retry
                log.warning("node watch failed (%s: %s); retrying in %.1fs", type(exc).__name__, exc,
                            self._retry_delay)
                await asyncio.sleep(self._retry_delay)

    async def _resync(self) -> int:
        response = await self._etcd.get_prefix(self._prefix)
        present = set()
        for kv in response:
            node_id = self._apply(EventKind.PUT, kv.key, kv.value)
            if node_id is not None:
                present.add(node_id)
        for node_id in set(self._table.nodes) - present - {SHARED_NODE}:
            self._vanished(node_id, "no longer registered")
        return response.header.revision

    def _apply(self, kind, key: bytes, value: bytes) -> str | None:
        """Apply one record change; returns the node id a PUT registered (None if ignored)."""
        node_id = key[len(self._prefix):].decode("utf-8", "replace")
        if kind == EventKind.DELETE:
            self._vanished(node_id, "registration gone")
            return None
        try:
            record = NodeRecord.from_json(value)
        except (ValueError, TypeError, KeyError) as exc:
            log.warning("ignoring malformed node record %r: %s", key, exc)
            return None
        if record.node_id != node_id:
            log.warning("ignoring node record under %r that names node %r", key, record.node_id)
            return None
        waiting = self._unregistered.pop(node_id, None)
        if waiting is not None:
            waiting.cancel()
            log.info("node %s registered again", node_id)
        known = self._table.nodes.get(node_id)
        new_instance = known is None or known.instance != record.instance
        dropped = self._table.upsert_node(record)
        if dropped is not None:
            self._report(dropped, f"restarted as instance {record.instance}")
        elif known is None:
            log.info("node %s joined at %s", node_id, record.address)
        if new_instance and self._on_join is not None:
            self._on_join(node_id, record.instance, record.address)
        return node_id

    def _vanished(self, node_id: str, why: str) -> None:
        """A node's record is gone: dropped at once, unless etcd is in doubt (then it is asked)."""
        node = self._table.nodes.get(node_id)
        if node is None or node_id in self._unregistered or self._closed:
            return
        if not self._etcd_in_doubt(self.grace):
            self._drop(node_id, why)
            return
        self._unregistered[node_id] = asyncio.get_running_loop().create_task(
            self._until_registered(node_id, node.instance, node.address, why), name=f"unregistered {node_id}")

    async def _until_registered(self, node_id: str, instance: str, address: str, why: str) -> None:
        """Keep a node whose record vanished while etcd was in doubt for as long as it answers,
        up to `grace` seconds; drop it when it does not answer or that time is up. Ends without
        a word once no longer in charge (a record put meanwhile, or the term ended: close())."""
        loop = asyncio.get_running_loop()
        me = asyncio.current_task()
        deadline, told = loop.time() + self.grace, False
        while self._unregistered.get(node_id) is me:
            try:
                await self._node_io.report(address, PROBE_TIMEOUT)
            except asyncio.CancelledError:
                return
            except Exception as exc:  # noqa: BLE001 - no answer: it is gone indeed
                self._give_up(node_id, instance, me, f"{why} and does not answer ({type(exc).__name__})")
                return
            if self._etcd_in_doubt(0.0):  # etcd silent to this master too: the wait counts from its return
                deadline = max(deadline, loop.time() + self.grace)
            if loop.time() >= deadline:
                self._give_up(node_id, instance, me, f"{why} and not registered again within {self.grace:g}s")
                return
            if not told and self._unregistered.get(node_id) is me:
                told = True
                log.warning("node %s %s while etcd was in doubt; it answers, so it keeps its objects "
                            "while it registers again (up to %gs)", node_id, why, self.grace)
            try:
                await asyncio.sleep(PROBE_INTERVAL)
            except asyncio.CancelledError:
                return

    def _give_up(self, node_id: str, instance: str, waiter: asyncio.Task, why: str) -> None:
        if self._unregistered.get(node_id) is not waiter:
            return  # registered again, or the term ended, meanwhile
        del self._unregistered[node_id]
        self._drop_instance(node_id, instance, why)

    def _drop_instance(self, node_id: str, instance: str, why: str) -> None:
        node = self._table.nodes.get(node_id)
        if node is not None and node.instance == instance:
            self._drop(node_id, why)

    def close(self) -> None:
        """Stop the waits of nodes that have not registered again (the term ends)."""
        self._closed = True
        for task in self._unregistered.values():
            task.cancel()
        self._unregistered.clear()

    def _drop(self, node_id: str, why: str) -> None:
        node = self._table.nodes.get(node_id)
        if node is not None:
            # It may still serve reads on the grant its last REPORTs gave: it is freed on until that ends.
            grant_until = self._node_io.grants.grant_ends(node.address, time.monotonic())
            self._report(self._table.drop_node(node_id, grant_until), why)

    def _report(self, dropped: Dropped, why: str) -> None:
        self._node_io.submit_frees(self._table.take_frees())
        log.info("node %s %s: %d objects lost their last replica, %d pending puts revoked",
                 dropped.node_id, why, len(dropped.removed), len(dropped.revoked))
