"""Ending puts: the PutEnd / BatchPutEnd that makes written values visible, posted or awaited.

By the time a put ends, every copy is on its nodes under the put's generation,
and the nodes list it in the INVENTORY a new leader adopts from: what is left
is to tell the master. By default that frame is posted: it leaves on the
client's ordered connection to the leader and the put returns without waiting
for the answer, which saves a round trip per put. Every later call of this
client reaches the master after it, so the client reads its own writes.
An answer that reports a failure (rare: the copies were evicted before the end
arrived, or the put outlived --put-timeout) drops the key from the placement
cache and is kept for flush(), which raises it; an answer lost with its
connection (the leader died) is asked again of whoever leads now, which finds
the version it adopted. `confirm=True` waits for every answer instead.

An overwrite always waits: the master frees the version it replaces before it
answers, so once the put returns no reader, whatever placement it cached, gets
the old bytes.
"""

import asyncio
import logging

from kvpool.errors import BatchError, NotLeaderError, UnavailableError, error_for

from .convert import batch_end_errors, check
from .master_link import MasterLink

log = logging.getLogger(__name__)


class Commits:
    def __init__(self, master: MasterLink, forget, confirm: bool = False):
        self._master = master
        self._forget = forget  # forget(key): drop a key whose put did not end from the placement cache
        self.confirm = confirm
        self._failed: dict = {}  # key -> error of posted ends that failed since the last flush
        self._retries: set = set()

    async def end(self, key: str, request, overwrite: bool) -> None:
        """PutEnd; raises its error only when waited for."""
        if self.confirm or overwrite or not self._master.post(
                "PutEnd", request, lambda r: self._answered("PutEnd", request, [key], r)):
            check(await self._master.call("PutEnd", request))

    async def end_batch(self, keys: list, request, overwrite: bool) -> dict | None:
        """BatchPutEnd of `keys` (in the request's order: items, then the keys column). Returns
        index -> error of the puts that failed when it waited for the answer; None when posted."""
        if not (self.confirm or overwrite) and self._master.post(
                "BatchPutEnd", request, lambda r: self._answered("BatchPutEnd", request, keys, r)):
            return None
        response = await self._master.call("BatchPutEnd", request)
        return batch_end_errors(response, len(keys))

    def _answered(self, method: str, request, keys: list, result) -> None:
        if isinstance(result, (NotLeaderError, UnavailableError)):
            # Whether the master it reached applied it is unknown: ask again, wherever the lead is now.
            retry = self._master.io.spawn(self._master.call(method, request))
            self._retries.add(retry)
            retry.add_done_callback(lambda done: self._retried(done, method, keys))
            return
        self._note(method, keys, result)

    def _retried(self, retry: asyncio.Future, method: str, keys: list) -> None:
        self._retries.discard(retry)
        if retry.cancelled():
            result = UnavailableError(f"{method} cancelled")
        else:
            result = retry.exception() or retry.result()
        self._note(method, keys, result)

    def _note(self, method: str, keys: list, result) -> None:
        if isinstance(result, BaseException):
            errors = dict.fromkeys(range(len(keys)), result)
        elif method == "PutEnd":
            errors = {0: error_for(result.status, result.message)} if result.status else {}
        else:
            errors = batch_end_errors(result, len(keys))
        for i, exc in errors.items():
            self._forget(keys[i])
            self._failed[keys[i]] = exc
            log.warning("put of %r did not end: %s", keys[i], exc)

    async def flush(self, timeout: float | None = None) -> None:
        """Wait for the answer to every posted end (for up to `timeout` seconds, then give up on the
        rest: the master reclaims a put it never hears the end of); raise BatchError naming the puts
        whose end failed since the last flush (those values are not stored)."""
        loop = asyncio.get_running_loop()
        deadline = None if timeout is None else loop.time() + timeout
        await self._master.drain(timeout)
        while self._retries:
            left = None if deadline is None else deadline - loop.time()
            if left is not None and left <= 0:
                for retry in self._retries:
                    retry.cancel()
                await asyncio.wait(list(self._retries))
                break
            await asyncio.wait(list(self._retries), timeout=left)
        failed, self._failed = self._failed, {}
        if failed:
            first_key, first = next(iter(failed.items()))
            raise BatchError(f"{len(failed)} puts did not end (first: {first_key!r}: {first})", failed)
