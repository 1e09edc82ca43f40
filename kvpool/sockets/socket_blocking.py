"""Sending and receiving on a non-blocking socket in the caller's thread, each wait bounded by one deadline.

For a blocking caller that shares a connection with an event loop (client/waiting.py
BlockingIO): the socket stays non-blocking, as the loop wants it, and poll()
waits out a full or empty socket until the deadline (time.monotonic()), then
TimeoutError. recv_into is a coroutine that never suspends, so the reply reading
written for asyncio (kvpool/net/tcp_connection.py) runs with it through run_now.
"""

import select
import time

from .socket_output import sendmsg_some


def run_now(coro):
    """The result of a coroutine that completes without waiting on an event loop."""
    try:
        coro.send(None)
    except StopIteration as done:
        return done.value
    coro.close()
    raise RuntimeError("a blocking socket step waited on the event loop")


class BlockingSocket:
    def __init__(self, sock, deadline: float):
        self.sock = sock
        self.deadline = deadline
        self._poller = select.poll()
        self._poller.register(sock, select.POLLIN)

    def _wait(self, events: int) -> None:
        self._poller.modify(self.sock, events)
        left = self.deadline - time.monotonic()
        if left <= 0 or not self._poller.poll(left * 1000):
            raise TimeoutError("the peer did not answer in time")

    def send_parts(self, parts: list) -> None:
        """Send every buffer in order (header and payload in one sendmsg while the socket takes them)."""
        i, n = 0, len(parts)
        while True:
            i, sent = sendmsg_some(self.sock, parts, i)
            if i == n:
                return
            if sent:
                parts[i] = memoryview(parts[i]).cast("B")[sent:]
            self._wait(select.POLLOUT)

    async def recv_into(self, _sock, view) -> int:
        """As loop.sock_recv_into (its signature too), waiting in this thread."""
        sock = self.sock
        while True:
            try:
                return sock.recv_into(view)
            except (BlockingIOError, InterruptedError):
                self._wait(select.POLLIN)

    def recv_answer_into(self, view) -> int:
        """recv_into for an answer not yet sent when asked for: wait first (a recv tried at once would
        only find the socket empty), then receive what came."""
        sock = self.sock
        while True:
            self._wait(select.POLLIN)
            try:
                return sock.recv_into(view)
            except (BlockingIOError, InterruptedError):
                pass
