"""How a client waits: on an event loop (AsyncClient), or blocking in the caller's thread (Client).

Chosen once, when the client is made, and handed to the layers that wait: the
master link takes its control-port connections from it (`control_links`), the
TCP transport sends a WRITE through it (`write`), the ends of posted puts
retry through it (`spawn`). No layer asks which one it has.

The blocking Client owns a private event loop that runs only inside one
caller's call (`run`). Waiting through it costs several turns of the loop per
call (a task, the selector, a future's callbacks), so what needs nothing else
of the loop waits on its socket instead: master calls (control_blocking.py)
and a WRITE on a node connection with nothing else in flight (tcp_inline.py).
"""

import asyncio

from kvpool.protocol import wire

from . import tcp_inline
from .control_blocking import BlockingControlLinks
from .control_link import ControlLinks

_WRITE = wire.Op.WRITE


class LoopIO:
    """Every wait goes through the running event loop."""

    def control_links(self, credential, tls) -> ControlLinks:
        """The connections to masters' control ports."""
        return ControlLinks(credential, tls)

    async def write(self, connection, key, generation, data, checksum, options, term) -> None:
        """A WRITE on a node connection (kvpool/net/tcp_connection.py); raises the node's error."""
        await connection.request(_WRITE, key, generation, term, len(data), checksum, payload=data, options=options)

    def spawn(self, coro) -> asyncio.Future:
        """Run `coro` in the background on the client's loop."""
        return asyncio.ensure_future(coro)


class BlockingIO(LoopIO):
    """For the blocking Client: waits that need nothing else of the loop are done on the socket."""

    def __init__(self):
        self.loop = asyncio.new_event_loop()

    def control_links(self, credential, tls) -> BlockingControlLinks:
        return BlockingControlLinks(credential, tls)

    async def write(self, connection, key, generation, data, checksum, options, term) -> None:
        if connection.idle() and not connection.tls:  # the next bytes from the node answer this WRITE
            return tcp_inline.write(connection, key, generation, term, data, checksum, options)
        return await super().write(connection, key, generation, data, checksum, options, term)

    def spawn(self, coro) -> asyncio.Future:
        """Scheduled on the private loop: it runs during this or the next call that runs the loop."""
        return self.loop.create_task(coro)

    def run(self, coro):
        """Run the loop in this thread until `coro` is done (the caller takes turns: one at a time)."""
        task = self.loop.create_task(coro)
        try:
            return self.loop.run_until_complete(task)
        finally:
            task.cancel()  # no-op once done; an interrupted call stops at the next turn

    def close(self) -> None:
        self.loop.close()


LOOP_IO = LoopIO()
