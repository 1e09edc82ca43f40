"""A call's deadline: every public call of a client ends by it, whatever it waits on.

The client's `timeout` (DEFAULT_TIMEOUT) or a call's own `timeout=` bounds the call end to end: its
master calls (every attempt, failover and retry included), node reads and writes, and the retries
inside it. The body runs inside the io's timeout (waiting.py: an asyncio.timeout on the loop; for the
blocking Client, the deadline its socket waits keep, which the master link reads too as
io.deadline()). A call that fails once its deadline has passed, for want of an answer, raises
DeadlineExceededError; a put whose end had left for the master raises PutOutcomeUnknownError instead
(it may have been stored: writes.py).
"""

import time

from kvpool.errors import (
    BatchError, DeadlineExceededError, InvalidArgumentError, KvpoolError, NotLeaderError, PutOutcomeUnknownError,
    UnavailableError,
)

DEFAULT_TIMEOUT = 5.0  # seconds a call may take, end to end, unless the client or the call says otherwise
_SLACK = 0.005  # a socket wait given the time left ends this close to the deadline, not always past it
_NO_ANSWER = (TimeoutError, UnavailableError, NotLeaderError)  # what a call past its deadline fails with


def check_timeout(timeout, name: str = "timeout") -> float:
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
        raise InvalidArgumentError(f"{name} must be a positive number of seconds, got {timeout!r}")
    return float(timeout)


def _for_want_of_answer(exc: BaseException) -> bool:
    if isinstance(exc, BatchError):
        return bool(exc.errors) and all(isinstance(e, _NO_ANSWER) for e in exc.errors.values())
    return isinstance(exc, _NO_ANSWER)


class CallDeadline:
    """`async with CallDeadline(io, seconds, what)`: the body bounded by `seconds`; past them it raises
    DeadlineExceededError (or PutOutcomeUnknownError once `ending` says a put's end was sent). With no
    io it only names the deadline (`when`) and judges errors (`overdue`), for a caller that passes
    `when` on to its waits itself (the blocking Client's lookups)."""

    def __init__(self, io, seconds: float, what: str):
        self.seconds = seconds
        self.what = what
        self.when = time.monotonic() + seconds  # the event loop's clock
        self.ending = False  # a put's end has left for the master: past the deadline its outcome is unknown
        self._timeout = None if io is None else io.timeout(seconds)

    async def __aenter__(self) -> "CallDeadline":
        await self._timeout.__aenter__()
        return self

    async def __aexit__(self, exc_type, exc, tb):
        try:
            handled = await self._timeout.__aexit__(exc_type, exc, tb)
        except TimeoutError as expired:  # the loop's timeout fired: the body was cancelled
            raise self.error(expired) from None
        if handled or exc is None or not isinstance(exc, Exception):
            return handled
        error = self.overdue(exc)
        if error is not None:
            raise error from exc
        return False

    def overdue(self, exc: Exception) -> UnavailableError | None:
        """The error to raise instead of `exc` when the call failed for want of an answer once its
        deadline had passed; None otherwise."""
        if isinstance(exc, (DeadlineExceededError, PutOutcomeUnknownError)):
            return None  # already says so
        if time.monotonic() >= self.when - _SLACK and _for_want_of_answer(exc):
            return self.error(exc)
        return None

    def error(self, cause: BaseException) -> UnavailableError:
        detail = str(cause) or "no answer"
        if self.ending:
            return PutOutcomeUnknownError(f"{self.what}: its end was sent to the master but not answered within "
                                          f"its {self.seconds:g}s deadline: the value may or may not be stored "
                                          f"({detail})")
        return DeadlineExceededError(f"{self.what} did not finish within its {self.seconds:g}s deadline ({detail})")


async def node_in_time(io, seconds: float, items: list, single, many, no_answer) -> list:
    """Per item of one node's `items`, its outcome: `single(item)`'s for a lone item (the transport's single
    transfer, no batch to track; a KvpoolError it raises is the item's outcome), else `many(items)`'s list; and
    `no_answer()` for every item when the node does not answer within `seconds` (they try elsewhere or fail:
    a silent node must not hold a call longer). The reads' and the writes' step alike (reads.py, writes.py)."""
    try:
        # A timeout context, unlike wait_for, runs the transfer in this task: no extra task per call.
        async with io.timeout(seconds):
            if len(items) == 1:
                try:
                    return [await single(items[0])]
                except KvpoolError as exc:
                    return [exc]
            return await many(items)
    except TimeoutError:
        return [no_answer() for _ in items]
