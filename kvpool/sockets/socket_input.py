"""Receiving on a non-blocking socket from asyncio without re-registering it for every wait.

loop.sock_recv_into registers the socket with the selector each time it has to
wait and unregisters it when input came: two epoll_ctl calls and the loop's
bookkeeping for every request a connection serves. Here the socket stays
registered while its reader keeps waiting on it; it is unregistered only when
input arrives with nobody waiting (so a level-triggered selector does not
report it turn after turn) and on close.

Whoever uses a SocketInput must receive on that socket only through it.
"""

import asyncio
import socket


async def readable(sock) -> None:
    """Wait until `sock` has input (or was closed): for a handshake's few reads, not a stream's."""
    loop = asyncio.get_running_loop()
    ready = loop.create_future()
    fd = sock.fileno()
    loop.add_reader(fd, lambda: ready.done() or ready.set_result(None))
    try:
        await ready
    finally:
        loop.remove_reader(fd)


class SocketInput:
    def __init__(self, sock: socket.socket, loop: asyncio.AbstractEventLoop | None = None):
        self.sock = sock
        self.loop = loop or asyncio.get_running_loop()
        self._fd = sock.fileno()
        self._waiter: asyncio.Future | None = None
        self._view = None  # where the waiting recv_into wants its bytes
        self._watching = False

    def try_recv_into(self, view) -> int | None:
        """Bytes received into `view` (0: the peer closed), or None when none are there yet."""
        try:
            return self.sock.recv_into(view)
        except (BlockingIOError, InterruptedError):
            return None

    async def recv_into(self, view) -> int:
        """Bytes received into `view` (0: the peer closed), after waiting for input if none is there."""
        try:
            return self.sock.recv_into(view)
        except (BlockingIOError, InterruptedError):
            pass
        waiter = self._waiter = self.loop.create_future()
        self._view = view
        if not self._watching:
            self.loop.add_reader(self._fd, self._readable)
            self._watching = True
        try:
            return await waiter
        finally:
            self._waiter = self._view = None

    def _readable(self) -> None:
        # Received here, as loop.sock_recv_into does: the input is gone before the selector
        # looks again, so it does not report the same input twice.
        waiter = self._waiter
        if waiter is None or waiter.done():
            self.stop()  # nobody waits: the next recv_into finds the input
            return
        try:
            got = self.sock.recv_into(self._view)
        except (BlockingIOError, InterruptedError):
            return
        except OSError as exc:
            waiter.set_exception(exc)
            return
        waiter.set_result(got)

    def stop(self) -> None:
        """Unregister the socket (before closing it, or handing it to other readers)."""
        if self._watching:
            self._watching = False
            self.loop.remove_reader(self._fd)
