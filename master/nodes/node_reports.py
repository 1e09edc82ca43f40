"""Polls every storage node with REPORT and folds the answers into the object table.

A node evicts and moves objects on its own; its REPORT is how the master learns
how full each tier is (for placement, Stats and metrics) and which replicas it
dropped (those leave the table, and an object left with none is gone).
"""

import asyncio
import logging

from kvpool.master.nodes.node_io import NodeIO
from kvpool.master.table.objects import ObjectTable

log = logging.getLogger(__name__)


class ReportPoller:
    def __init__(self, table: ObjectTable, node_io: NodeIO, interval: float, on_lapsed=None):
        self._table = table
        # Called with (node_id, instance, address) of a node whose read grant may have lapsed: it is
        # REPORTed again once its inventory was adopted again (master/leadership/adoption.py).
        self._on_lapsed = on_lapsed
        self._node_io = node_io
        self.interval = interval
        # Long enough for a busy node, short enough that one stuck node delays the others little.
        self.timeout = max(1.0, 2 * interval)

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            started = loop.time()
            await self.poll_once()
            await asyncio.sleep(max(0.0, self.interval - (loop.time() - started)))

    async def poll_once(self) -> None:
        nodes = [(n.node_id, n.instance, n.address) for n in self._table.nodes.values() if n.reconciled]
        await asyncio.gather(*(self._poll(*node) for node in nodes))

    async def _poll(self, node_id: str, instance: str, address: str) -> None:
        mark = self._table.report_mark()
        try:
            report = await self._node_io.report(address, self.timeout)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - a node that does not answer keeps its last report
            self._node_io.failed(address, "REPORT", exc)
            self._lapsed(node_id, instance, address)
            return
        if report.get("lapsed"):
            self._lapsed(node_id, instance, address)
        removed = self._table.apply_report(node_id, instance, report, mark)
        self._node_io.submit_frees(self._table.take_frees())
        if removed:
            log.info("node %s evicted the last replica of %d objects", node_id, len(removed))

    def _lapsed(self, node_id: str, instance: str, address: str) -> None:
        """No more REPORTs until its inventory is adopted again (read_grants.py: at most one unanswered)."""
        node = self._table.nodes.get(node_id)
        if node is None or node.instance != instance or not node.reconciled:
            return
        node.reconciled = False
        log.info("node %s lost contact or its read grant; reconciling its inventory", node_id)
        if self._on_lapsed is not None:
            self._on_lapsed(node_id, instance, address)
