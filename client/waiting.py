"""How a client waits: on an event loop (AsyncClient), or blocking in the caller's thread (Client).

Chosen once, when the client is made, and handed to the layers that wait: the
master link takes its control-port connections from it (`control_links`), the
TCP transport sends node requests through it (`request`, `batch`), a read's
deadline is set through it (`timeout`), the ends of posted puts retry through it
(`spawn`). No layer asks which one it has.

The blocking Client runs an operation's coroutine (the same one AsyncClient
runs) in the caller's thread with no event loop running (`run`, stepped by hand:
kvpool/runtime/coroutine_driver.py): master calls
are answered on the control socket (control_blocking.py) and node requests on an
idle node connection are sent and answered on its socket (Connection.request_now),
so the coroutine completes without ever suspending. When it does wait on
something only a loop can give (a first connection, a leader to find, several
nodes at once, TLS, shared memory, UCX), the rest of it is run on the client's
private event loop, in this thread, until it is done.
"""

import asyncio
import time

from kvpool.runtime.coroutine_driver import Resumed, start

from kvpool.client.control_blocking import BlockingControlLinks
from kvpool.client.control_link import ControlLinks

# A node request outside any deadline of its call (reads and writes have theirs: assembly.py) that is not
# answered in this long, plus the time its bytes take at 50 MB/s, fails the connection: a caller
# blocked on the socket must not hang.
REQUEST_TIMEOUT = 5.0


class LoopIO:
    """Every wait goes through the running event loop."""

    def control_links(self, credential, tls) -> ControlLinks:
        """The connections to masters' control ports."""
        return ControlLinks(credential, tls)

    async def request(self, connection, op: int, *args, **fields):
        """One request on a node connection (kvpool/net/tcp_connection.py); raises the node's error."""
        return await connection.request(op, *args, **fields)

    async def batch(self, connection, op: int, items) -> list:
        """Pipelined requests on a node connection; per-item results."""
        return await connection.batch(op, items)

    def timeout(self, seconds: float):
        """An async context that raises TimeoutError when its body takes longer than `seconds`."""
        return asyncio.timeout(seconds)

    def deadline(self) -> float | None:
        """When the timeouts being run end (time.monotonic), for waits they do not cancel by themselves
        (a blocking socket's); None when every wait is cancelled by them, as on the loop."""
        return None

    async def gather(self, *coros, return_exceptions: bool = False) -> list:
        """The results of `coros` (per node transfers), run side by side as asyncio.gather runs them."""
        return await asyncio.gather(*coros, return_exceptions=return_exceptions)

    async def to_loop(self) -> None:
        """Go on from here as a task on the event loop (what follows waits only there, e.g. in an
        asyncio.timeout); already so here."""

    def spawn(self, coro) -> asyncio.Future:
        """Run `coro` in the background on the client's loop."""
        return asyncio.ensure_future(coro)

    async def blocking(self, function, *args):
        """function(*args), which blocks (file I/O): in a thread, the loop running meanwhile."""
        return await asyncio.to_thread(function, *args)


class BlockingIO(LoopIO):
    """For the blocking Client: an operation runs in the caller's thread, its I/O on the sockets."""

    def __init__(self):
        self.loop = asyncio.new_event_loop()
        self._deadlines: list[_Deadline] = []  # the bodies of timeout() being run, outermost first
        self._background: set[asyncio.Future] = set()

    def control_links(self, credential, tls) -> BlockingControlLinks:
        return BlockingControlLinks(credential, tls)

    def _on_socket(self, connection) -> bool:
        """Whether a node request can be sent and answered here: not inside a task on the loop (its
        tasks run side by side), and the next bytes from the node answer it."""
        return asyncio.current_task() is None and not connection.tls and connection.idle()

    def deadline(self) -> float | None:
        """The earliest end of the timeouts the caller's call runs in (work spawned in the background
        runs in none of them)."""
        if not self._deadlines or _current_task() in self._background:
            return None
        return min(deadline.when for deadline in self._deadlines)

    def _deadline(self, nbytes: int) -> float:
        if self._deadlines:
            return min(deadline.when for deadline in self._deadlines)
        return time.monotonic() + REQUEST_TIMEOUT + nbytes / 50e6

    async def request(self, connection, op: int, key, generation, arg, length, checksum=0, payload=None,
                      buf=None, options=None):
        if not self._on_socket(connection):
            await self.to_loop()
            return await connection.request(op, key, generation, arg, length, checksum, payload, buf, options)
        return connection.request_now(self._deadline(length), op, key, generation, arg, length, checksum, payload,
                                      buf, options)

    async def batch(self, connection, op: int, items) -> list:
        if not self._on_socket(connection):
            await self.to_loop()
            return await connection.batch(op, items)
        nbytes = sum(len(item[2]) for item in items)  # WriteItem.data, ReadItem.buf
        return connection.batch_now(self._deadline(nbytes), op, items)

    def timeout(self, seconds: float) -> "_Deadline":
        return _Deadline(self, seconds)

    async def blocking(self, function, *args):
        """In the caller's thread, outside the loop (the Client's call blocks anyway); on the loop, in a thread."""
        if asyncio.current_task() is None:
            return function(*args)
        return await super().blocking(function, *args)

    async def to_loop(self) -> None:
        if asyncio.current_task() is None:  # outside the loop: suspend once, the rest runs as a task
            resumed = self.loop.create_future()
            self.loop.call_soon(resumed.set_result, None)
            await resumed

    async def gather(self, *coros, return_exceptions: bool = False) -> list:
        """Outside the loop, one after the other, each on its sockets (its node works meanwhile on what
        it was sent); from the first that waits on the loop on, side by side on the loop."""
        if asyncio.current_task() is not None:
            return await asyncio.gather(*coros, return_exceptions=return_exceptions)
        results = []
        deadlines = self._deadlines
        for i, coro in enumerate(coros):
            mark = len(deadlines)
            try:
                finished, outcome = start(coro)  # its result, or what it waits on
            except Exception as exc:
                if not return_exceptions:
                    for rest in coros[i + 1:]:
                        rest.close()
                    raise
                results.append(exc)
                continue
            if finished:
                results.append(outcome)
                continue
            # The timeouts it is inside are its own: armed in its task, not the caller's.
            owned = deadlines[mark:]
            del deadlines[mark:]
            rest = await asyncio.gather(self._continue(coro, outcome, owned), *coros[i + 1:],
                                        return_exceptions=return_exceptions)
            return results + rest
        return results

    def spawn(self, coro) -> asyncio.Future:
        """Scheduled on the private loop: the next call runs on the loop until it is done."""
        task = self.loop.create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        return task

    def run(self, coro):
        """Run `coro` in this thread (the caller takes turns: one at a time): without the loop while it
        needs none, then on the loop until it is done."""
        if self._background or self._deadlines:  # spawned work (or an interrupted call) waits for the loop
            return self._run_on_loop(coro)
        finished, outcome = start(coro, self.loop)  # futures, tasks made for later: this loop's
        if finished:
            return outcome
        return self._run_on_loop(self._continue(coro, outcome, self._deadlines))

    def _run_on_loop(self, coro):
        task = self.loop.create_task(coro)
        try:
            return self.loop.run_until_complete(task)
        finally:
            task.cancel()  # no-op once done; an interrupted call stops at the next turn

    @staticmethod
    async def _continue(coro, waiting_on, deadlines: list):
        """The rest of `coro`, which suspended on `waiting_on` outside the loop, in this task: the
        timeouts it is inside (`deadlines`) are now armed on the loop too."""
        for deadline in list(deadlines):
            await deadline.arm()
        return await Resumed(coro, waiting_on)

    def close(self) -> None:
        self.loop.close()


class _Deadline:
    """BlockingIO.timeout: a deadline its socket waits keep (they raise TimeoutError); once the body
    waits on the loop instead, an asyncio.timeout armed with the same deadline takes over."""

    def __init__(self, io: BlockingIO, seconds: float):
        self.io = io
        self.when = time.monotonic() + seconds  # the event loop's clock
        self._on_loop = None

    async def __aenter__(self) -> "_Deadline":
        if asyncio.current_task() is not None:
            await self.arm()
        self.io._deadlines.append(self)
        return self

    async def arm(self) -> None:
        if self._on_loop is None:
            self._on_loop = asyncio.timeout_at(self.when)
            await self._on_loop.__aenter__()

    async def __aexit__(self, exc_type, exc, tb):
        if self in self.io._deadlines:  # not when it went on to the loop inside a gather
            self.io._deadlines.remove(self)
        if self._on_loop is not None:
            return await self._on_loop.__aexit__(exc_type, exc, tb)
        return None


def _current_task() -> asyncio.Task | None:
    """The task running here; None outside one, also where no loop runs (a lookup's deadline)."""
    try:
        return asyncio.current_task()
    except RuntimeError:
        return None


LOOP_IO = LoopIO()
