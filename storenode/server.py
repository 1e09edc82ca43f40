"""The node's data server: the protocol of kvpool.wire over plain TCP on asyncio.

Raw non-blocking sockets with loop.sock_* calls, so a WRITE payload is received
straight into the segment and a READ reply is sent straight from it. Each
connection is one task that handles its requests strictly in order; replies to
pipelined requests are gathered and sent together before the task waits for
more input.
"""

import asyncio
import logging
import socket
import time

from kvpool import wire
from kvpool.checksum import Digest, checksum
from kvpool.errors import Code
from kvpool.keys import MAX_KEY_BYTES

from .extents import ExtentTable
from .metrics import NodeMetrics
from .tier import Tier

log = logging.getLogger(__name__)

STAGING_BYTES = 256 * 1024  # per connection: headers and keys of pipelined frames, and payload prefixes
SMALL_READ = 64 * 1024  # READ payloads up to this ride in the reply buffer: one send instead of two
HASH_CHUNK = 256 * 1024  # receive and hash WRITE payloads in pieces that fit in cache
_HEADER = wire.REQUEST.size
_OP_NAMES = {op.value: op.name.lower() for op in wire.Op}


class _Disconnect(Exception):
    """End this connection: the peer left, or its stream can no longer be trusted."""


class DataServer:
    def __init__(self, tier: Tier, table: ExtentTable, node_id: str, metrics: NodeMetrics | None = None):
        self.tier = tier
        self.table = table
        self.node_id = node_id.encode()
        self.metrics = metrics or NodeMetrics()
        self._listener: socket.socket | None = None
        self._accept_task: asyncio.Task | None = None
        self._connections: set[asyncio.Task] = set()

    async def start(self, host: str, port: int) -> tuple[str, int]:
        """Listen on host:port (0 = any free port); returns the bound (host, port)."""
        sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((host, port))
            sock.listen(1024)
            sock.setblocking(False)
        except BaseException:
            sock.close()
            raise
        self._listener = sock
        self._accept_task = asyncio.create_task(self._accept_loop(), name="data-accept")
        return sock.getsockname()[:2]

    async def stop(self) -> None:
        tasks = [t for t in (self._accept_task, *self._connections) if t]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self._listener:
            self._listener.close()

    async def _accept_loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            try:
                sock, _ = await loop.sock_accept(self._listener)
            except OSError as exc:  # e.g. out of file descriptors: keep serving the open connections
                log.warning("accept failed: %s", exc)
                await asyncio.sleep(0.1)
                continue
            sock.setblocking(False)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            task = asyncio.create_task(_Connection(self, sock).run())
            self._connections.add(task)
            task.add_done_callback(self._connections.discard)


class _Connection:
    def __init__(self, server: DataServer, sock: socket.socket):
        self.server = server
        self.tier = server.tier
        self.table = server.table
        self.metrics = server.metrics
        self.sock = sock
        self.loop = asyncio.get_running_loop()
        self.buf = bytearray(STAGING_BYTES)
        self.view = memoryview(self.buf)
        self.start = self.end = 0  # unparsed input is buf[start:end]
        self.out = bytearray()  # replies not sent yet
        self._handlers = {wire.Op.WRITE: self._write, wire.Op.READ: self._read,
                          wire.Op.FREE: self._free, wire.Op.PING: self._ping}

    async def run(self) -> None:
        self.metrics.connections.inc()
        try:
            try:
                while await self._serve_one():
                    pass
            except _Disconnect:
                pass
            await self._flush()  # requests before a bad frame still get their replies
        except OSError:  # peer gone or reset
            pass
        except Exception:  # a bug must cost one connection, not the node
            log.exception("data connection failed")
        finally:
            self.metrics.connections.dec()
            self.sock.close()

    async def _serve_one(self) -> bool:
        """Handle the next request; False when the connection must end."""
        await self._fill(_HEADER)
        magic, version, op, req_id, key_len, _flags, generation, offset, length, value_checksum = \
            wire.REQUEST.unpack_from(self.buf, self.start)
        if magic != wire.MAGIC or version != wire.VERSION:
            log.warning("closing a data connection: bad magic/version %r/%d", magic, version)
            return False
        if key_len > MAX_KEY_BYTES:
            log.warning("closing a data connection: key_len %d > %d", key_len, MAX_KEY_BYTES)
            return False
        await self._fill(_HEADER + key_len)
        key = bytes(self.view[self.start + _HEADER:self.start + _HEADER + key_len])
        self.start += _HEADER + key_len

        name = _OP_NAMES.get(op)
        if name is None:
            await self._fail(op, req_id, Code.PROTOCOL, f"unknown op {op}", "unknown")
            return False
        began = time.perf_counter()
        keep_open = await self._handlers[op](op, req_id, key, generation, offset, length, value_checksum)
        count, latency = self.metrics.per_op(name)
        count.inc()
        latency.observe(time.perf_counter() - began)
        return keep_open

    # -- requests: each returns whether the connection stays usable

    async def _write(self, op, req_id, key, generation, offset, length, value_checksum) -> bool:
        if length == 0 or not self.tier.contains(offset, length):
            # The payload that follows cannot be skipped safely: reply, then hang up.
            await self._fail(op, req_id, Code.INVALID_ARGUMENT, self._range_message(offset, length))
            return False
        # The bytes are about to change, so whatever the range held is gone.
        self.table.invalidate(offset, length)
        target = self.tier.view(offset, length)
        staged = min(length, self.end - self.start)
        target[:staged] = self.view[self.start:self.start + staged]
        self.start += staged
        # Hash each chunk as it lands, while it is still in cache and the client keeps sending.
        digest = Digest(target[:staged])
        if staged < length:
            await self._flush()
            received = staged
            while received < length:
                got = await self.loop.sock_recv_into(self.sock, target[received:received + HASH_CHUNK])
                if not got:
                    raise _Disconnect
                digest.update(target[received:received + got])
                received += got
        self.metrics.bytes_in.inc(length)
        if digest.intdigest() != value_checksum:
            self._error(op, req_id, Code.CHECKSUM_MISMATCH,
                        f"payload checksum differs from {value_checksum:#x}; extent not stored")
            return True
        self.table.record(offset, key, generation, length, value_checksum)
        self.out += wire.pack_reply(op, req_id, Code.OK)
        return True

    async def _read(self, op, req_id, key, generation, offset, length, _checksum) -> bool:
        if not self.tier.contains(offset, length):
            self._error(op, req_id, Code.INVALID_ARGUMENT, self._range_message(offset, length))
            return True
        record = self.table.lookup(offset, key, generation, length)
        if record is None:
            self._error(op, req_id, Code.STALE,
                        f"extent at offset {offset} no longer holds generation {generation} of this key")
            return True
        self.out += wire.pack_reply(op, req_id, Code.OK, length, record.checksum)
        data = self.tier.view(offset, length)
        if length <= SMALL_READ:
            self.out += data
        else:
            await self._flush()
            await self.loop.sock_sendall(self.sock, data)
        self.metrics.bytes_out.inc(length)
        return True

    async def _free(self, op, req_id, key, generation, offset, _length, _checksum) -> bool:
        if self.table.free(offset, key, generation):
            self.out += wire.pack_reply(op, req_id, Code.OK)
        else:
            self._error(op, req_id, Code.NOT_FOUND, f"no extent at offset {offset} holds generation {generation}")
        return True

    async def _ping(self, op, req_id, *_unused) -> bool:
        self.out += wire.pack_reply(op, req_id, Code.OK, len(self.server.node_id), checksum(self.server.node_id))
        self.out += self.server.node_id
        return True

    # -- helpers

    def _range_message(self, offset: int, length: int) -> str:
        return f"extent [{offset}, {offset + length}) is empty or outside the {self.tier.capacity}-byte segment"

    def _error(self, op: int, req_id: int, code: Code, message: str, name: str | None = None) -> None:
        self.out += wire.pack_error(op, req_id, code, message)
        self.metrics.errors.labels(name or _OP_NAMES[op], code.name).inc()

    async def _fail(self, op: int, req_id: int, code: Code, message: str, name: str | None = None) -> None:
        """Send an error reply before the connection is closed."""
        self._error(op, req_id, code, message, name)
        await self._flush()

    async def _fill(self, n: int) -> None:
        """Make sure at least n unparsed bytes are staged (n <= STAGING_BYTES)."""
        if self.end - self.start >= n:
            return
        if self.start == self.end:
            self.start = self.end = 0
        elif self.start + n > len(self.buf):
            # Move the staged tail (shorter than one header and key) to the front.
            tail = bytes(self.view[self.start:self.end])
            self.view[:len(tail)] = tail
            self.start, self.end = 0, len(tail)
        # Nothing more to do without the peer: send what it is waiting for first.
        await self._flush()
        while self.end - self.start < n:
            got = await self.loop.sock_recv_into(self.sock, self.view[self.end:])
            if not got:
                raise _Disconnect
            self.end += got

    async def _flush(self) -> None:
        if self.out:
            out, self.out = self.out, bytearray()
            await self.loop.sock_sendall(self.sock, out)
