"""Tells storage nodes to forget extents the master took back, in the background.

Best effort by design: a node only frees an extent that still holds the same
(key, generation), so an order that arrives late, twice, or after the extent was
reused is harmless, and one that never arrives only leaves a stale record that
the next WRITE to that extent replaces. RPC handlers must never wait on it.
"""

import asyncio
import logging
from typing import Iterable

from .objects import FreeOrder

log = logging.getLogger(__name__)

SEND_TIMEOUT = 5.0
MAX_IN_FLIGHT = 256


def _make_transport():
    # Imported here so the master starts (and its pure logic is testable) without the client package.
    from kvpool.client.tcp import TcpTransport

    return TcpTransport()


class NodeFreer:
    def __init__(self):
        self._queue: asyncio.Queue[FreeOrder] = asyncio.Queue()
        self._task: asyncio.Task | None = None
        self._transport = None
        self._failing: set[str] = set()  # addresses whose failure was logged; logged again once they recover
        self.sent = 0
        self.failed = 0

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name="node-free")

    def submit(self, orders: Iterable[FreeOrder]) -> None:
        for order in orders:
            self._queue.put_nowait(order)

    async def _run(self) -> None:
        while True:
            batch = [await self._queue.get()]
            while not self._queue.empty() and len(batch) < MAX_IN_FLIGHT:
                batch.append(self._queue.get_nowait())
            # Sent together so the transport can pipeline them on each node's connection.
            await asyncio.gather(*(self._send(order) for order in batch))
            for _ in batch:
                self._queue.task_done()

    async def _send(self, order: FreeOrder) -> None:
        try:
            if self._transport is None:
                self._transport = _make_transport()
            await asyncio.wait_for(
                self._transport.free(order.address, order.key, order.generation, order.offset), SEND_TIMEOUT)
            self.sent += 1
            self._failing.discard(order.address)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - any failure only delays reuse of a stale record
            self.failed += 1
            if order.address not in self._failing:
                self._failing.add(order.address)
                log.warning("could not send FREE to %s (%s: %s); later failures there are not logged "
                            "until one succeeds", order.address, type(exc).__name__, exc)

    async def close(self, drain_timeout: float = 1.0) -> None:
        """Send what is queued (for at most `drain_timeout` s), then stop."""
        if self._task is not None:
            try:
                await asyncio.wait_for(self._queue.join(), drain_timeout)
            except asyncio.TimeoutError:
                pass
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        if self._transport is not None:
            try:
                await self._transport.close()
            except Exception as exc:  # noqa: BLE001
                log.debug("closing the transport failed: %s", exc)
