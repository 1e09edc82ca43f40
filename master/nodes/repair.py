"""Re-replication: objects with fewer live copies than their target get new ones.

Keys land in ObjectTable.repair_keys when a copy is lost by failure (a node's
lease expired or it restarted empty), when a put committed with fewer copies than
asked (min_replicas), or when a node is drained. Evictions never put a key there:
a node that evicts decided to, and the object keeps one copy fewer.

Each repair is a COPY sent to a node holding the object, which writes it straight
to the chosen destination; the master only adds the replica once the destination
accepted it. Copies are throttled (a bounded number at once, and a byte rate paced
by start time) so repair after a node loss does not starve foreground traffic.
"""

import asyncio
import contextlib
import logging
from dataclasses import dataclass

from kvpool.net.tcp_link import TcpLink

from kvpool.master.nodes.node_io import NodeIO
from kvpool.master.table.node_state import NodeState
from kvpool.master.table.objects import ObjectTable
from kvpool.master.table.placement import spread_zones
from kvpool.master.table.versions import DRAM, Replica

log = logging.getLogger(__name__)

DEFAULT_RATE = 256 << 20     # bytes per second of copies
DEFAULT_CONCURRENCY = 16     # copies in flight at once (pipelined on one connection per source node)
TICK = 0.1                   # how often the repair set is looked at when no copy finishes
RETRY_DELAY = 1.0            # a key whose copy failed waits this long before another try
MIN_COPY_TIMEOUT = 10.0
SLOWEST_COPY_RATE = 32 << 20  # bytes/s below which a copy is considered stuck


@dataclass(frozen=True)
class CopyTask:
    key: str
    generation: int
    size: int
    source: Replica
    destination: NodeState
    tier: str  # where the destination is expected to keep it (its REPORT will say)


def plan(table: ObjectTable, limit: int, skip: frozenset | set = frozenset()) -> list[CopyTask]:
    """Up to `limit` copies that move the repair set towards every object's target, one per key,
    ignoring keys in `skip` (in flight or waiting to retry). Keys that need nothing any more
    leave the repair set; keys no node can take stay for a later try."""
    tasks: list[CopyTask] = []
    for key in sorted(table.repair_keys):
        if len(tasks) >= limit:
            break
        if key in skip:
            continue
        version = table.lookup(key)
        if version is None or not version.replicas:
            table.repair_keys.discard(key)
            continue
        if table.live_count(version) >= version.target_replicas:
            table.settle_drain(key)
            table.repair_keys.discard(key)
            continue
        holders = {r.node_id for r in version.replicas}
        tier = version.options.tier or DRAM
        candidates = [n for n in table.nodes.values()
                      if not (n.draining or n.shared) and n.node_id not in holders and n.largest_tier >= version.size]
        ranked = table.placement.choose(candidates, version.size, len(candidates), tier)
        taken = [table.nodes[r.node_id].zone for r in version.replicas
                 if r.node_id in table.nodes and not table.nodes[r.node_id].draining]
        chosen = spread_zones(ranked, 1, taken)
        if not chosen:
            continue  # no room anywhere now; a node joining or freeing space lets a later pass place it
        # A copy on a node that stays is the better source: a draining node may be going away.
        source = min(version.replicas, key=lambda r: table.nodes[r.node_id].draining)
        tasks.append(CopyTask(key, version.generation, version.size, source, chosen[0], tier))
    return tasks


class Throttle:
    """Paces copy starts so that bytes started per second stay at `rate` on average."""

    def __init__(self, rate: float, clock):
        self.rate = rate
        self._clock = clock
        self._next = 0.0

    def delay_for(self, size: int) -> float:
        """Seconds to wait before starting a copy of `size` bytes (and books its share)."""
        now = self._clock()
        start = max(now, self._next)
        self._next = start + size / self.rate
        return start - now


class Repairer:
    def __init__(self, table: ObjectTable, node_io: NodeIO, rate: float = DEFAULT_RATE,
                 concurrency: int = DEFAULT_CONCURRENCY, transport=None):
        self._table = table
        self._node_io = node_io
        self._concurrency = concurrency
        # Its own connections: a COPY occupies the source's connection until the copy is done,
        # which must not hold up FREEs and REPORTs.
        self._transport = transport
        self._throttle = Throttle(rate, lambda: asyncio.get_running_loop().time())
        self._inflight: dict[str, asyncio.Task] = {}
        self._retry_at: dict[str, float] = {}
        self._copy_done = asyncio.Event()  # a finished copy frees a slot: plan the next one at once

    @property
    def transport(self):
        if self._transport is None:
            self._transport = TcpLink(credential=self._node_io.credential, tls=self._node_io.tls)
        return self._transport

    async def run(self) -> None:
        """Until cancelled (then the copies in flight are cancelled and the connections closed)."""
        loop = asyncio.get_running_loop()
        try:
            while True:
                now = loop.time()
                self._retry_at = {k: t for k, t in self._retry_at.items() if t > now}
                room = self._concurrency - len(self._inflight)
                if room > 0 and self._table.repair_keys:
                    for task in plan(self._table, room, self._inflight.keys() | self._retry_at.keys()):
                        self._inflight[task.key] = loop.create_task(self._copy(task), name=f"repair {task.key}")
                self._copy_done.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._copy_done.wait(), TICK)
        finally:
            await self.close()

    async def _copy(self, task: CopyTask) -> None:
        try:
            await asyncio.sleep(self._throttle.delay_for(task.size))
            timeout = MIN_COPY_TIMEOUT + task.size / SLOWEST_COPY_RATE
            await asyncio.wait_for(self.transport.copy(task.source.address, task.key.encode(), task.generation,
                                                       task.destination.address), timeout)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - tried again later, maybe from another source or to another node
            self._retry_at[task.key] = asyncio.get_running_loop().time() + RETRY_DELAY
            log.warning("repair copy of %r from %s to %s failed (%s: %s)", task.key, task.source.node_id,
                        task.destination.node_id, type(exc).__name__, exc)
            return
        finally:
            self._inflight.pop(task.key, None)
            self._copy_done.set()
        if self._table.add_replica(task.key, task.generation, task.destination.node_id, task.tier):
            log.debug("repaired %r: copy on %s", task.key, task.destination.node_id)
        self._node_io.submit_frees(self._table.take_frees())

    async def close(self) -> None:
        tasks = list(self._inflight.values())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self._transport is not None:
            await self._transport.close()
            self._transport = None
