"""Every request the master sends to storage nodes, over TCP (kvpool/net/tcp_link.py).

FREE orders are best effort: a node only frees a (key, generation) it still
holds, so an order that arrives late or twice is harmless, and one that never
arrives only leaves an object the node will evict in time. Those caused by a
client's request (overwrite, remove) are awaited for a moment, so that once the
answer is out a reader holding an old placement finds the old version gone
rather than still served: a node that did not confirm one in that moment is
waited out until it stops serving reads on its own (read_grants.py). The rest
go out in the background; every FREE is owed to its node until confirmed. HOLD, REPORT and
INVENTORY are awaited by whoever needs the answer, each bounded by a timeout.
"""

import asyncio
import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass

from kvpool.errors import UnavailableError
from kvpool.net.tcp_link import TcpLink

from kvpool.master.table.ledger import FreeOrder
from kvpool.master.nodes.read_grants import ReadGrants
from kvpool.master.table.shared_tier import SHARED_NODE

log = logging.getLogger(__name__)

FREE_TIMEOUT = 5.0
FREES_PER_SEND = 1024  # FREEs pipelined in one send (a removal of millions goes in many)
OVERSLEPT = 0.25  # seconds late past a deadline that show this loop was busy, not the node silent
MAX_FREES_IN_FLIGHT = 256


def _by_node(orders: Iterable[FreeOrder]) -> list[tuple[str, list[FreeOrder]]]:
    """The orders grouped by node address (in order within each), at most FREES_PER_SEND a group."""
    groups: dict[str, list[FreeOrder]] = {}
    for order in orders:
        groups.setdefault(order.address, []).append(order)
    return [(address, group[i:i + FREES_PER_SEND]) for address, group in groups.items()
            for i in range(0, len(group), FREES_PER_SEND)]


def _confirmed(task: asyncio.Task) -> bool:
    """A NodeIO._free task that ended with its node confirming every FREE."""
    return task.done() and not task.cancelled() and task.result()


async def _answer(call, timeout: float):
    """The result of `call`, TimeoutError after `timeout` s. A deadline this loop overslept (busy for
    seconds: adopting a large inventory, say) is extended once: the answer may be in already, and a
    healthy node taken for silent would lose its read grant (read_grants.py)."""
    loop = asyncio.get_running_loop()
    task = loop.create_task(call)
    try:
        for _ in range(2):
            deadline = loop.time() + timeout
            await asyncio.wait((task,), timeout=timeout)
            if task.done() or loop.time() - deadline < OVERSLEPT:
                break
    finally:
        if not task.done():
            task.cancel()
    if not task.done() or task.cancelled():
        raise TimeoutError(f"no answer within {timeout:g}s")
    return task.result()


@dataclass(frozen=True)
class HoldOrder:
    address: str
    key: bytes
    generation: int
    ms: int


class NodeIO:
    def __init__(self, transport=None, credential=None, tls=None):
        self._transport = transport
        self.credential = credential  # the member credential, proved to every node (kvpool/security/auth.py)
        self.tls = tls  # a client ssl context when the cluster runs TLS
        self._queue: asyncio.Queue[FreeOrder] = asyncio.Queue()
        self._task: asyncio.Task | None = None
        self._inflight: set[asyncio.Task] = set()  # FREEs a request stopped waiting for
        self._failing: set[str] = set()  # addresses whose failure was logged; logged again once they recover
        self.grants = ReadGrants()  # FREEs owed to each node, and when each node's read grant ends
        self.term = 0  # the leader's term, sent with every REPORT and INVENTORY so nodes fence older leaders' WRITEs

    @property
    def transport(self):
        if self._transport is None:
            self._transport = TcpLink(credential=self.credential, tls=self.tls)
        return self._transport

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._send_frees(), name="node-free")

    # ----- FREE, in the background -----

    def submit_frees(self, orders: Iterable[FreeOrder]) -> None:
        for order in orders:
            self.grants.ordered((order,))
            self._queue.put_nowait(order)

    def discard_frees(self) -> int:
        """Drop the FREEs still queued (a deposed leader's decisions); returns how many."""
        dropped = 0
        while not self._queue.empty():
            self._queue.get_nowait()
            self._queue.task_done()
            dropped += 1
        return dropped

    async def free_now(self, orders: list[FreeOrder], wait: float) -> None:
        """Send FREEs and wait up to `wait` s for the nodes to confirm them; slower ones
        complete in the background."""
        if not orders:
            return
        loop = asyncio.get_running_loop()
        sent = time.monotonic()
        self.grants.ordered(orders)
        tasks = {loop.create_task(self._free(address, group)): address for address, group in _by_node(orders)}
        for task in tasks:
            self._inflight.add(task)
            task.add_done_callback(self._inflight.discard)
        await asyncio.wait(tasks, timeout=wait)
        replaced = {order.address for order in orders if order.replaced}
        for task, address in tasks.items():
            # Not confirmed: the node may still serve the replaced version; wait until it stops on its own.
            ends = self.grants.grant_ends(address, sent)
            if address in replaced and not _confirmed(task) and ends > time.monotonic():
                await asyncio.wait([task], timeout=ends - time.monotonic())
                if not _confirmed(task) and ends > time.monotonic():
                    await asyncio.sleep(ends - time.monotonic())

    async def settle(self, address: str, timeout: float) -> bool:
        """Send the node at `address` the FREEs owed to it now; whether it confirmed them all (FREEs
        ordered meanwhile go out on the same connection, ahead of or right behind what follows)."""
        owed = self.grants.owed(address)
        for i in range(0, len(owed), FREES_PER_SEND):
            try:
                async with asyncio.timeout(timeout):
                    if not await self._free(address, owed[i:i + FREES_PER_SEND]):
                        return False
            except TimeoutError:
                return False
        return True

    async def _send_frees(self) -> None:
        while True:
            batch = [await self._queue.get()]
            while not self._queue.empty() and len(batch) < MAX_FREES_IN_FLIGHT:
                batch.append(self._queue.get_nowait())
            await asyncio.gather(*(self._free(address, group) for address, group in _by_node(batch)))
            for _ in batch:
                self._queue.task_done()

    async def _free(self, address: str, orders: list[FreeOrder]) -> bool:
        """FREE each of `orders` at the node at `address`: pipelined on its connection in one send
        (a FREE each, answered each), not a request, a task and a send per order. True if the node
        confirmed them all (freed, or not held)."""
        try:
            async with asyncio.timeout(FREE_TIMEOUT):  # not wait_for: no second task
                if any(o.shared for o in orders):  # the shared tier's files (the node mounts it) apart
                    results = [None] * len(orders)
                    for shared in (False, True):
                        where = [i for i, o in enumerate(orders) if o.shared == shared]
                        if where:
                            got = await self.transport.free_many(
                                address, [(orders[i].key, orders[i].generation) for i in where], shared)
                            for i, result in zip(where, got):
                                results[i] = result
                else:
                    results = await self.transport.free_many(address, [(o.key, o.generation) for o in orders])
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - owed to the node until it confirms (read_grants.py)
            self.failed(address, "FREE", exc)
            return False
        refused = next((r for r in results if isinstance(r, BaseException)), None)
        if refused is not None:
            self.failed(address, "FREE", refused)
        else:
            self._recovered(address)
        return self.grants.answered(address, orders, results)

    # ----- requests whose answer the caller needs -----

    async def hold(self, orders: list[HoldOrder], timeout: float) -> list:
        """Send every HOLD at once; per order True (held), False (the node does not hold it),
        or the exception it failed with."""
        async def one(order: HoldOrder):
            try:
                async with asyncio.timeout(timeout):
                    held = await self.transport.hold(order.address, order.key, order.generation, order.ms)
                self._recovered(order.address)
                return held
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - reported per order
                self.failed(order.address, "HOLD", exc)
                return exc

        return list(await asyncio.gather(*(one(order) for order in orders)))

    async def report(self, address: str, timeout: float) -> dict:
        """REPORT the node at `address`, which renews its read grant: one at a time per node, only once
        every FREE owed to it is confirmed, and none after one went unanswered until the node was
        reconciled (read_grants.py counts on at most one unanswered). Whoever asks (the report loop,
        membership's probe) goes through here."""
        async with self.grants.reporting(address):
            if not self.grants.may_report(address):
                raise UnavailableError(f"node at {address} left a REPORT unanswered; not reconciled since")
            if not await self.settle(address, timeout):
                raise UnavailableError(f"node at {address} did not confirm the FREEs owed to it")
            self.grants.report_sent(address)
            try:
                report = await _answer(self.transport.report(address, self.term), timeout)
            except BaseException:
                self.grants.report_unanswered(address)
                raise
            self.grants.report_answered(address)
        self._recovered(address)
        return report

    async def inventory(self, address: str, timeout: float, node_id: str = ""):
        """What the node at `address` holds; of the shared tier's pseudo-node (`node_id`), what the tier's
        manifests hold, read by the node at `address`, which mounts it."""
        if node_id == SHARED_NODE:
            return await asyncio.wait_for(self.transport.shared_scan(address), timeout)
        entries = await asyncio.wait_for(self.transport.inventory(address, self.term), timeout)
        self._recovered(address)
        return entries

    async def inventory_changes(self, address: str, since: int, timeout: float):
        """What changed on the node at `address` after change number `since`, asked with this term
        (fencing older leaders, as INVENTORY)."""
        changes = await asyncio.wait_for(self.transport.inventory_changes(address, since, self.term), timeout)
        self._recovered(address)
        return changes

    # ----- failure logging: once per address until it works again -----

    def failed(self, address: str, what: str, exc: BaseException) -> None:
        if address not in self._failing:
            self._failing.add(address)
            log.warning("%s to node %s failed (%s: %s); later failures there are not logged until one "
                        "succeeds", what, address, type(exc).__name__, exc)

    def _recovered(self, address: str) -> None:
        if address in self._failing:
            self._failing.discard(address)
            log.info("node %s answers again", address)

    async def close(self, drain_timeout: float = 1.0) -> None:
        """Send the FREEs that are queued (for at most `drain_timeout` s), then stop."""
        if self._task is not None:
            try:
                await asyncio.wait_for(self._queue.join(), drain_timeout)
            except TimeoutError:
                pass
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        for task in list(self._inflight):
            task.cancel()
        await asyncio.gather(*list(self._inflight), return_exceptions=True)
        if self._transport is not None:
            try:
                await self._transport.close()
            except Exception as exc:  # noqa: BLE001
                log.debug("closing the transport failed: %s", exc)
