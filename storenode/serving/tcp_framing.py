"""One data connection's byte stream (plain TCP or TLS): staged input, queued replies, and their deadlines.

Raw non-blocking sockets, received through kvpool/sockets/socket_input.py and sent through
kvpool/sockets/socket_output.py. Input is staged in one buffer per connection and parsed in place;
replies are queued and sent together before the connection waits for more input, so the replies
to a pipelined batch leave at once. A peer that stalls mid-request, or stops reading its replies,
for --frame-timeout loses its connection (_Disconnect, PeerStalled).
"""

import asyncio
import json
import logging
import socket

from kvpool.protocol import wire
from kvpool.protocol.checksum import Digest, checksum
from kvpool.errors import Code
from kvpool.sockets.socket_input import SocketInput
from kvpool.sockets.socket_output import flush_backlog, send_all

from kvpool.storenode.serving.metrics import NodeMetrics
from kvpool.storenode.serving.ops import OP_NAMES, StoredOptions

log = logging.getLogger(__name__)

STAGING_BYTES = 256 * 1024  # per connection: headers and keys of pipelined frames, and payload prefixes
HANDSHAKE_STAGING = 4096  # until the peer proved its credential: an unproved connection holds little
DRAIN_LIMIT = 64 * 1024 * 1024  # payload bytes read and dropped after refusing a WRITE
DRAIN_SECONDS = 2.0
_OPTIONS = wire.WRITE_OPTIONS.size
_unpack_options = wire.WRITE_OPTIONS.unpack_from
_new_options = tuple.__new__  # a NamedTuple from the unpacked tuple, without its Python-level constructor


class _Disconnect(Exception):
    """End this connection: the peer left, or its stream can no longer be trusted."""


class Framing:
    """frame_timeout: seconds a half-received request may go without a byte; idle_timeout: seconds a
    connection may go without a request (0: forever)."""

    def __init__(self, sock: socket.socket, metrics: NodeMetrics, frame_timeout: float, idle_timeout: float):
        self.sock = sock
        self.metrics = metrics
        self.frame_timeout = frame_timeout
        self.idle_timeout = idle_timeout
        self.loop = asyncio.get_running_loop()
        self.input = SocketInput(sock, self.loop)  # every receive on sock goes through it
        self.buf = bytearray(HANDSHAKE_STAGING)  # grown to STAGING_BYTES once the peer is authenticated
        self.view = memoryview(self.buf)
        self.start = self.end = 0  # unparsed input is buf[start:end]
        self.read_ahead = STAGING_BYTES  # how much fill may read at once (see tcp_session.LARGE_WRITE)
        self.out = bytearray()  # replies not sent yet

    def grow_staging(self) -> None:
        staged = bytes(self.view[self.start:self.end])
        self.view.release()
        self.buf = bytearray(STAGING_BYTES)
        self.view = memoryview(self.buf)
        self.view[:len(staged)] = staged
        self.start, self.end = 0, len(staged)

    # -- input

    async def fill(self, n: int, between_requests: bool = False) -> None:
        """Make sure at least n unparsed bytes are staged (n <= STAGING_BYTES). between_requests: nothing
        of the next request has come yet, so its first byte may take as long as the peer likes."""
        if self.end - self.start >= n:
            return
        if self.start == self.end:
            self.start = self.end = 0
        elif self.start + n > len(self.buf):
            # Move the staged tail (shorter than one header and key) to the front.
            tail = bytes(self.view[self.start:self.end])
            self.view[:len(tail)] = tail
            self.start, self.end = 0, len(tail)
        while self.end - self.start < n:
            room = max(n - (self.end - self.start), self.read_ahead)
            got = await self.recv_into(self.view[self.end:self.end + room], between_requests)
            if not got:
                raise _Disconnect
            self.end += got
            between_requests = False

    async def take_options(self) -> StoredOptions:
        """The WRITE_OPTIONS block that follows an ALLOCATE's key (a WRITE's is parsed inline, without a
        coroutine, in tcp_session.TcpSession._write)."""
        await self.fill(_OPTIONS)
        options = _new_options(StoredOptions, _unpack_options(self.buf, self.start))
        self.start += _OPTIONS
        return options

    async def small_payload(self, op: int, req_id: int, length: int, limit: int, what: str) -> bytes | None:
        """The request's payload when it is at most `limit` bytes; else None after an error reply
        (the connection must then close: the payload cannot be skipped)."""
        if length > limit:
            await self.fail(op, req_id, Code.PROTOCOL, f"{what} of {length} bytes")
            return None
        await self.fill(length)
        payload = bytes(self.view[self.start:self.start + length])
        self.start += length
        return payload

    async def recv_into(self, view, between_requests: bool = False) -> int:
        """Receive what is there; only when nothing is, send the replies owed first (the peer may
        be waiting for them), then wait. A pipelined batch's replies so leave together."""
        got = self.input.try_recv_into(view)
        if got is None:
            await self.flush()
            got = await (self._recv_idle(view) if between_requests else self.recv_mid_frame(view))
        return got

    async def _recv_idle(self, view) -> int:
        """Wait for the next request; with --idle-timeout, a connection quiet that long is closed (its
        client opens a new one on its next request)."""
        if not self.idle_timeout:
            return await self.input.recv_into(view)
        try:
            async with asyncio.timeout(self.idle_timeout):
                return await self.input.recv_into(view)
        except TimeoutError:
            self.metrics.error("idle", "CLOSED")
            raise _Disconnect from None

    async def recv_mid_frame(self, view) -> int:
        """Wait for more of a request begun: a peer that stops sending mid-request (a header-only WRITE
        holding its reserved extent, say) loses its connection, and what it held, after --frame-timeout."""
        try:
            async with asyncio.timeout(self.frame_timeout):
                return await self.input.recv_into(view)
        except TimeoutError:
            self.metrics.error("frame", "STALLED")
            log.warning("closing a data connection: a request stalled half-received for %gs", self.frame_timeout)
            raise _Disconnect from None

    # -- replies

    def reply_ok(self, op: int, req_id: int) -> None:
        self.out += wire.pack_reply(op, req_id, Code.OK)

    def reply_location(self, op: int, req_id: int, offset: int, value_checksum: int) -> None:
        self.out += wire.pack_reply(op, req_id, Code.OK, offset, value_checksum, wire.ReplyFlag.MAPPED)

    def reply_json(self, op: int, req_id: int, value) -> None:
        self.reply_body(op, req_id, json.dumps(value).encode())

    def reply_body(self, op: int, req_id: int, body: bytes) -> None:
        self.out += wire.pack_reply(op, req_id, Code.OK, len(body), checksum(body))
        self.out += body

    def reply_parts(self, op: int, req_id: int, parts: list) -> None:
        """reply_body of the buffers `parts` joined, without joining them first."""
        digest = Digest()
        for part in parts:
            digest.update(part)
        self.out += wire.pack_reply(op, req_id, Code.OK, sum(len(part) for part in parts), digest.intdigest())
        for part in parts:
            self.out += part

    def error(self, op: int, req_id: int, code: Code, message: str, name: str | None = None) -> None:
        self.out += wire.pack_error(op, req_id, code, message)
        self.metrics.error(name or OP_NAMES[op], code.name)

    async def fail(self, op: int, req_id: int, code: Code, message: str, name: str | None = None) -> None:
        """Send an error reply before the connection is closed."""
        self.error(op, req_id, code, message, name)
        await self.flush()

    async def refuse(self, op: int, req_id: int, code: Code, message: str, length: int) -> None:
        """Reply to a WRITE we will not take, then swallow (a bounded part of) its payload before closing.

        Closing with the payload still unread would make the kernel reset the
        connection, and a reset may destroy the reply before the client reads it.
        """
        await self.fail(op, req_id, code, message)
        self.sock.shutdown(socket.SHUT_WR)
        left = min(length, DRAIN_LIMIT) - (self.end - self.start)
        self.start = self.end
        try:
            async with asyncio.timeout(DRAIN_SECONDS):
                while left > 0:
                    got = await self.input.recv_into(self.view)
                    if not got:
                        break
                    left -= got
        except TimeoutError:
            pass

    async def send_all(self, head: bytearray, data: memoryview) -> None:
        """head, then data, in as few sends as the socket takes."""
        try:
            sent = self.sock.sendmsg((head, data))
        except (BlockingIOError, InterruptedError):
            sent = 0
        stall = self.frame_timeout
        if sent < len(head):
            await send_all(self.sock, memoryview(head)[sent:], stall)
            sent = len(head)
        if sent - len(head) < len(data):
            await send_all(self.sock, data[sent - len(head):], stall)
        elif getattr(self.sock, "backlog", None):  # TLS: what was encrypted must leave before we wait for input
            await flush_backlog(self.sock, stall)

    async def flush(self) -> None:
        if self.out:
            out, self.out = self.out, bytearray()
            await send_all(self.sock, out, self.frame_timeout)
