"""The ends of one client's puts (PutEnd, BatchPutEnd): posted or awaited, and what flush() reports.

By the time a put ends, every copy is on its nodes under the put's generation,
and the nodes list it in the INVENTORY a new leader adopts from: what is left is
to tell the master. By default that frame is posted: it leaves on the client's
ordered connection to the leader and the put returns without waiting for the
answer. An answer that reports a failure drops the key from the placement cache
and is kept for flush(), which raises it. `confirm=True` waits for every answer
instead, and an overwrite always waits (the master frees the version it replaces
before it answers, so once the put returns no reader gets the old bytes).

What an end's failure means is settled before it is reported. An end whose
answer was lost (the connection, or the leader, went) may have been applied: it
is asked again of whoever leads. An end refused as unknown (PutExpiredError: the
put was revoked, reclaimed, or already ended by the lost attempt) or left without
an answer is checked against where the key is now (`settle`): a master naming
the key at the put's generation means the put took (the lost answer said so, or
the version was adopted from its nodes), and no error is reported. Otherwise the
put is not stored (PutExpiredError), unless no master could be asked, or the
key is now at a newer generation (the put may have been applied and then
overwritten): PutOutcomeUnknownError, the one error that does not mean "not
stored". flush() reports, for ends it stopped waiting for at its deadline,
PutOutcomeUnknownError too.
"""

import asyncio
import logging

from kvpool.errors import (
    BatchError, KvpoolError, NotLeaderError, PutExpiredError, PutOutcomeUnknownError, UnavailableError, error_for,
)

from kvpool.client import convert
from kvpool.client.convert import batch_end_errors
from kvpool.client.master_link import MasterLink

log = logging.getLogger(__name__)

_UNANSWERED = (UnavailableError, NotLeaderError)  # an end that may or may not have been applied
_DOUBTFUL = (PutExpiredError, *_UNANSWERED)  # an end's errors checked against the master's table


class Commits:
    """The ends of one client's puts: posted or awaited, and the answers flush() reports."""

    def __init__(self, master: MasterLink, forget, confirm: bool = False):
        self._master = master
        self._forget = forget  # forget(key): drop a key whose put did not end from the placement cache
        self.confirm = confirm
        self._failed: dict = {}  # key -> error of posted ends that failed since the last flush
        self._settling: set = set()  # tasks asking again and settling doubtful ends

    async def end(self, method: str, request, keys: list, generations: list, overwrite: bool) -> dict | None:
        """A put_end_call (PutEnd or BatchPutEnd) of `keys` (in the request's order: items, then the keys
        column) at their `generations`. Returns index -> error of the puts that failed when it waited for the
        answer; None when posted."""
        if not (self.confirm or overwrite) and self._master.post(
                method, request, lambda r: self._answered(method, request, keys, generations, r)):
            return None
        errors = _errors(method, await self._call(method, request), len(keys))
        return await settle(self._master, keys, generations, errors) if errors else errors

    async def _call(self, method: str, request):
        """The answer, or the error that stands for none."""
        try:
            return await self._master.call(method, request)
        except _UNANSWERED as exc:
            return exc

    def _answered(self, method: str, request, keys: list, generations: list, result) -> None:
        errors = _errors(method, result, len(keys))
        if not any(isinstance(error, _DOUBTFUL) for error in errors.values()):
            self._note(keys, errors)
            return
        lost = isinstance(result, BaseException)  # no answer: whether the master applied it is unknown
        task = self._master.io.spawn(self._settle(method, request, keys, generations, errors, lost))
        self._settling.add(task)
        task.add_done_callback(lambda done: self._settled(done, keys))

    async def _settle(self, method: str, request, keys: list, generations: list, errors: dict, lost: bool) -> dict:
        if lost:  # ask again, wherever the lead is now (a PutEnd asked again of a leader that ended it succeeds)
            errors = _errors(method, await self._call(method, request), len(keys))
        return await settle(self._master, keys, generations, errors) if errors else errors

    def _settled(self, task: asyncio.Future, keys: list) -> None:
        self._settling.discard(task)
        if task.cancelled():
            error = PutOutcomeUnknownError("no answer before flush() stopped waiting: the value may or may "
                                           "not be stored")
            self._note(keys, dict.fromkeys(range(len(keys)), error))
        elif task.exception() is not None:
            self._note(keys, dict.fromkeys(range(len(keys)), task.exception()))
        else:
            self._note(keys, task.result())

    def _note(self, keys: list, errors: dict) -> None:
        for i, exc in errors.items():
            self._forget(keys[i])
            self._failed[keys[i]] = exc
            log.warning("put of %r did not end: %s", keys[i], exc)

    async def flush(self, timeout: float | None = None) -> None:
        """Wait for the answer to every posted end (for up to `timeout` seconds, then give up on the
        rest: the master reclaims a put it never hears the end of); raise BatchError naming the puts
        whose end failed since the last flush (PutOutcomeUnknownError for those whose outcome could
        not be learnt in time; every other error means the value is not stored)."""
        loop = asyncio.get_running_loop()
        deadline = None if timeout is None else loop.time() + timeout
        await self._master.drain(timeout)
        while self._settling:
            left = None if deadline is None else deadline - loop.time()
            if left is not None and left <= 0:
                for task in self._settling:
                    task.cancel()
                await asyncio.wait(list(self._settling))
                break
            await asyncio.wait(list(self._settling), timeout=left)
        failed, self._failed = self._failed, {}
        if failed:
            first_key, first = next(iter(failed.items()))
            raise BatchError(f"{len(failed)} puts did not end (first: {first_key!r}: {first})", failed)


def _errors(method: str, result, count: int) -> dict:
    """index -> error of the puts an end's answer (or the error standing for it) says did not end."""
    if isinstance(result, BaseException):
        return dict.fromkeys(range(count), result)
    if method == "PutEnd":
        return {0: error_for(result.status, result.message)} if result.status else {}
    return batch_end_errors(result, count)


async def settle(master: MasterLink, keys: list, generations: list, errors: dict) -> dict:
    """`errors` (index -> error of an end) with the doubtful ones settled by where the master says each
    key is now: at the put's generation, the put took (no error); elsewhere, not stored
    (PutExpiredError); at a newer generation or with no master to ask, PutOutcomeUnknownError."""
    doubtful = [i for i, error in errors.items() if isinstance(error, _DOUBTFUL)]
    if not doubtful:
        return errors
    asked = [keys[i] for i in doubtful]
    try:
        found = convert.placements(await master.call(*convert.lookup_call(asked)), asked)
    except KvpoolError as exc:
        found = [exc] * len(asked)
    settled = dict(errors)
    for i, where in zip(doubtful, found):
        error, generation = errors[i], generations[i]
        if not isinstance(where, BaseException) and where.generation == generation:
            del settled[i]
        elif isinstance(where, BaseException) and not isinstance(where, KeyError):
            settled[i] = PutOutcomeUnknownError(f"put of {keys[i]!r} (generation {generation}): {error}; asking "
                                                f"where the key is failed too ({where}): it may or may not be stored")
        elif not isinstance(where, BaseException) and where.generation > generation:
            settled[i] = PutOutcomeUnknownError(f"put of {keys[i]!r} (generation {generation}): {error}; the key "
                                                f"is now at the newer generation {where.generation}: it may have "
                                                f"been stored and overwritten since")
        elif not isinstance(error, PutExpiredError):
            found_what = "no version" if isinstance(where, BaseException) else f"generation {where.generation}"
            settled[i] = PutExpiredError(f"put of {keys[i]!r} (generation {generation}) is not stored: its end "
                                         f"went unanswered ({error}) and the master holds {found_what} of it")
    return settled

