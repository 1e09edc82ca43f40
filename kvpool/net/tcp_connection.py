"""The data protocol (kvpool/protocol/wire.py) over TCP: one pipelined connection to a node.

Raw non-blocking sockets driven by loop.sock_* calls rather than asyncio
streams, so a WRITE payload leaves straight from the caller's buffer and a READ
payload lands straight in the caller's destination.

Many coroutines share a connection. Sending a request appends it to a FIFO of
pending requests and writes its frame under a lock, so FIFO order is wire
order; one reader task per connection takes replies in that order (the node
answers strictly in order) and settles each request.
"""

import asyncio
import collections
import socket
from typing import NamedTuple, Sequence

from ..protocol import wire
from ..protocol.checksum import Digest
from ..errors import Code, ProtocolError, UnavailableError, error_for
from ..protocol.parts import pieces
from ..sockets.socket_input import SocketInput
from ..sockets.socket_blocking import BlockingSocket, run_now
from ..sockets.socket_output import flush_backlog, send_all, sendmsg_some
from ..security.tls_socket import TlsSocket
from ..protocol.write_options import WriteOptions

_DRAIN_BYTES = 64 * 1024
_READ_AHEAD = 64 * 1024
_HASH_CHUNK = 128 * 1024  # received and hashed while still in cache (measured: faster than 512 KiB)
_REPLY_SIZE = wire.REPLY.size
_unpack_reply = wire.REPLY.unpack
_OK = Code.OK
_NOT_FOUND = Code.NOT_FOUND
_CHECKSUM_MISMATCH = Code.CHECKSUM_MISMATCH
_WRITE, _READ, _FREE, _PING = wire.Op.WRITE, wire.Op.READ, wire.Op.FREE, wire.Op.PING
_HOLD, _REPORT, _INVENTORY = wire.Op.HOLD, wire.Op.REPORT, wire.Op.INVENTORY
_HELLO, _ATTACH, _EVICTIONS = wire.Op.HELLO, wire.Op.ATTACH, wire.Op.EVICTIONS
_LOCATE, _RELEASE, _ALLOCATE = wire.Op.LOCATE, wire.Op.RELEASE, wire.Op.ALLOCATE
_FOUND_OR_NOT = (_FREE, _HOLD, wire.Op.FREE_SHARED)  # ops whose NOT_FOUND is an answer (False), not an error
# Replies with a body the caller reads (JSON, or INVENTORY's and SHARED_SCAN's binary)
_JSON_REPLY = (_REPORT, _INVENTORY, _HELLO, _ATTACH, _EVICTIONS, wire.Op.SHARED_SCAN, wire.Op.INVENTORY_CHANGES)
_PAYLOAD_REPLY = (_READ, _LOCATE)  # the value's bytes may follow
_WITH_OPTIONS = (_WRITE, _ALLOCATE)  # WRITE_OPTIONS follow the key
_MAPPED = int(wire.ReplyFlag.MAPPED)  # a plain int: IntFlag arithmetic is slow on the hot path


class Location(NamedTuple):
    """A MAPPED reply: where the object's bytes are in the node's DRAM segment (their size is
    the one the request gave)."""

    offset: int
    checksum: int


class _Batch:
    """One future for a whole pipelined batch instead of one per item."""

    __slots__ = ("results", "remaining", "future")

    def __init__(self, count: int, future: asyncio.Future):
        self.results = [None] * count
        self.remaining = count
        self.future = future

    def settle(self, index: int, result) -> None:
        self.results[index] = result
        self.remaining -= 1
        if not self.remaining and not self.future.done():
            self.future.set_result(self.results)


class _Request:
    """A request on the wire waiting for its reply: settles a future, or one slot of a batch."""

    __slots__ = ("req_id", "op", "buf", "future", "batch", "index", "held")

    def __init__(self, req_id: int, op: int, buf, future=None, batch=None, index=0, held=None):
        self.req_id = req_id
        self.op = op
        self.buf = buf  # READ / LOCATE destination
        self.future = future
        self.batch = batch
        self.index = index
        self.held = held  # LOCATE / ALLOCATE: (key, generation), released if nobody takes the reply

    def abandoned(self) -> bool:
        """Nobody waits any more (cancelled): a READ must then not touch the caller's buffer."""
        return (self.future if self.batch is None else self.batch.future).done()

    def settle(self, result) -> None:
        if self.batch is not None:
            self.batch.settle(self.index, result)
        elif not self.future.done():
            if isinstance(result, BaseException):
                self.future.set_exception(result)
            else:
                self.future.set_result(result)


def _ended_by(exc: Exception) -> str:
    """Why a connection ends when reading its replies raised `exc` (whatever it is, no request may be
    left waiting)."""
    if isinstance(exc, (OSError, EOFError)):
        return f"connection lost: {exc or type(exc).__name__}"
    if isinstance(exc, ProtocolError):
        return str(exc)
    return f"reply reader failed: {exc!r}"


class Connection:
    """One node's connection, shared by every coroutine that talks to the node on this event loop."""

    def __init__(self, owner, address: str, sock: socket.socket):
        self.owner = owner  # the NodeConnections (kvpool/net/node_connections.py) that opened it: told when it closes
        self.address = address
        self.sock = sock
        self.loop = asyncio.get_running_loop()
        self.closed = False
        self.closed_because = "connection closed"
        self._next_id = 0
        self._pending: collections.deque[_Request] = collections.deque()
        self._send_lock = asyncio.Lock()
        self._header = bytearray(_REPLY_SIZE)
        self._header_view = memoryview(self._header)
        # Replies are received ahead into this buffer: a batch's replies then cost one recv, not one each.
        self._ahead = memoryview(bytearray(_READ_AHEAD))
        self._ahead_start = self._ahead_end = 0
        self._drain_buf: memoryview | None = None
        self._posting: set[asyncio.Task] = set()
        self._deferred: list[bytes] = []  # unanswered frames that ride along with the next send
        self._deferred_flush: asyncio.TimerHandle | None = None
        # A TLS socket (kvpool/security/tls_socket.py) is read through a SocketInput: the loop's sock_* calls take
        # real sockets only, and what the TLS session already decrypted must be read before waiting.
        self.tls = isinstance(sock, TlsSocket)
        self._input = SocketInput(sock, self.loop) if self.tls else None
        self._sock_recv_into = (lambda _sock, view: self._input.recv_into(view)) if self.tls \
            else self.loop.sock_recv_into
        self.reader = self.loop.create_task(self._read_replies(), name=f"kvpool-reply-reader {address}")

    # -- for a blocking caller: the same frames and replies, sent and read on the socket itself

    def idle(self) -> bool:
        """Nothing in flight or being sent: the next bytes from the node answer the next request."""
        return (not self._pending and not self._send_lock.locked() and not self.closed
                and self._ahead_start == self._ahead_end)

    def request_now(self, deadline: float, op: int, key: bytes, generation: int, arg: int, length: int,
                    checksum: int = 0, payload=None, buf=None, options: WriteOptions | None = None):
        """request() on an idle connection without the event loop: sent and answered in this thread
        by `deadline` (time.monotonic()), else the connection fails (UnavailableError)."""
        future = self.loop.create_future()
        request, parts = self._one(future, op, key, generation, arg, length, checksum, payload, buf, options)
        self._exchange_now((request,), parts, deadline)
        return future.result()

    def batch_now(self, deadline: float, op: int, items: Sequence) -> list:
        """batch() on an idle connection without the event loop, as request_now."""
        batch = _Batch(len(items), self.loop.create_future())
        requests, parts = self._many(batch, op, items)
        if requests:
            self._exchange_now(requests, parts, deadline)
        return batch.results

    def _exchange_now(self, requests, parts: list, deadline: float) -> None:
        """Send the frames of `requests` and settle each from the replies read here. The reader task
        stays parked on the socket: it sees nothing, as every byte the node sends answers these."""
        socket_now = BlockingSocket(self.sock, deadline)
        self._pending.extend(requests)
        if self._deferred:
            parts = [b"".join(self._deferred), *parts]
            self._deferred.clear()
        reason = None
        loop_recv_into, self._sock_recv_into = self._sock_recv_into, socket_now.recv_into  # for _read_reply
        try:
            socket_now.send_parts(parts)
            while self._pending and reason is None:
                reason = run_now(self._read_reply())
            if reason is None and self._ahead_start != self._ahead_end:
                reason = "bytes from the node that answer no request"
        except Exception as exc:  # a TimeoutError too: a silent node fails its requests
            reason = _ended_by(exc)
        except BaseException as exc:  # interrupted mid-frame: the stream cannot be resynchronised
            self.fail(f"request interrupted: {exc!r}")
            raise
        finally:
            self._sock_recv_into = loop_recv_into
        if reason is not None:
            self.fail(reason)  # settles what is left; the parked reader then closes the socket

    # -- sending

    async def request(self, op: int, key: bytes, generation: int, arg: int, length: int,
                      checksum: int = 0, payload=None, buf=None, options: WriteOptions | None = None):
        """Send one request and wait for its reply's result (raises its error)."""
        future = self.loop.create_future()
        request, parts = self._one(future, op, key, generation, arg, length, checksum, payload, buf, options)
        await self._submit((request,), parts)
        return await future

    def _one(self, future, op, key, generation, arg, length, checksum, payload, buf, options) -> tuple:
        """The request waiting on `future` and its frame (parts to send in order)."""
        req_id = self._next_id = (self._next_id + 1) & 0xFFFFFFFF
        request = _Request(req_id, op, buf, future, held=(key, generation) if op in (_LOCATE, _ALLOCATE) else None)
        if op in _WITH_OPTIONS:
            parts = [wire.pack_with_options(op, req_id, key, generation, arg, length, checksum, options)]
        else:
            parts = [wire.pack_request(op, req_id, key, generation, arg, length, checksum)]
        if payload is not None:  # WRITE: the value (header and payload leave in one sendmsg); COPY, ATTACH
            parts.extend(pieces(payload))
        return request, parts

    def defer(self, op: int, keys: Sequence[tuple], delay: float) -> None:
        """Like post, but the frames go with this connection's next request, or after `delay`
        seconds if the event loop runs that long without one (RELEASE of a LOCATE: the lease
        covers the wait)."""
        self._deferred.extend(self._unanswered(op, keys))
        if self._deferred and self._deferred_flush is None:
            self._deferred_flush = self.loop.call_later(delay, self._flush_deferred)

    def _flush_deferred(self) -> None:
        self._deferred_flush = None
        if self._deferred and not self.closed:
            task = self.loop.create_task(self._submit((), []))
            self._posting.add(task)
            task.add_done_callback(self._posting.discard)

    async def post(self, op: int, keys: Sequence[tuple]) -> None:
        """Send one request the node never answers (RELEASE) per (key, generation)."""
        frames = self._unanswered(op, keys)
        if frames:
            await self._submit((), [b"".join(frames)])

    def _unanswered(self, op: int, keys: Sequence[tuple]) -> list[bytes]:
        frames = []
        for key, generation in keys:
            req_id = self._next_id = (self._next_id + 1) & 0xFFFFFFFF
            frames.append(wire.pack_request(op, req_id, key, generation))
        return frames

    async def batch(self, op: int, items: Sequence) -> list:
        """Pipeline one request per item (WriteItem or ReadItem); per-item results."""
        batch = _Batch(len(items), self.loop.create_future())
        requests, parts = self._many(batch, op, items)
        if requests:
            await self._submit(requests, parts)
            await batch.future
        return batch.results

    def _many(self, batch: _Batch, op: int, items: Sequence) -> tuple[list, list]:
        """One request per item, each settling its slot of `batch`, and their frames."""
        requests, parts = [], []
        pack, pack_with_options = wire.pack_request, wire.pack_with_options
        for index, item in enumerate(items):
            req_id = self._next_id = (self._next_id + 1) & 0xFFFFFFFF
            if op in _PAYLOAD_REPLY:  # ReadItems
                key, generation, buf = item
                requests.append(_Request(req_id, op, buf, None, batch, index,
                                         (key, generation) if op == _LOCATE else None))
                parts.append(pack(op, req_id, key, generation, 0, len(buf)))
                continue
            # WriteItems: WRITE sends the payload, ALLOCATE only asks for room, COMMIT says it is filled
            key, generation, data, checksum, options = item[:5]
            term = item[5] if len(item) > 5 else 0
            size = len(data)
            requests.append(_Request(req_id, op, None, None, batch, index,
                                     (key, generation) if op == _ALLOCATE else None))
            if op in _WITH_OPTIONS:
                parts.append(pack_with_options(op, req_id, key, generation, term, size, checksum, options))
                if op == _WRITE:
                    parts.extend(pieces(data))
            else:
                parts.append(pack(op, req_id, key, generation, 0, size, checksum))
        if op != _WRITE:
            parts = [b"".join(parts)]  # headers only: one small buffer beats many iovecs
        return requests, parts

    async def _submit(self, requests, parts: list) -> None:
        async with self._send_lock:
            if self.closed:
                for request in requests:
                    request.settle(UnavailableError(f"node {self.address}: {self.closed_because}"))
                return
            self._pending.extend(requests)
            if self._deferred:
                parts = [b"".join(self._deferred), *parts]
                self._deferred.clear()
            try:
                await self._send(parts)
            except OSError as exc:
                self.fail(f"send failed: {exc}")  # settles these requests too
            except BaseException:
                # Cancelled with a frame half sent: the stream cannot be resynchronised.
                for request in requests:
                    if request.batch is None:
                        request.future.cancel()
                    else:
                        request.batch.future.cancel()
                self.fail("request cancelled while sending")
                raise

    async def _send(self, parts: list) -> None:
        """Send every buffer in order: sendmsg (header and payload in one call) while the
        socket takes it, sock_sendall to wait out a full socket buffer."""
        sock = self.sock
        i, n = 0, len(parts)
        while i < n:
            i, sent = sendmsg_some(sock, parts, i)
            if i < n:
                if self.tls:
                    await send_all(sock, memoryview(parts[i]).cast("B")[sent:])
                else:
                    await self.loop.sock_sendall(sock, memoryview(parts[i])[sent:])
                i += 1
        if self.tls and sock.backlog:
            await flush_backlog(sock)

    # -- receiving

    async def _read_replies(self) -> None:
        reason = "connection closed by the node"
        try:
            while True:
                ended = await self._read_reply()
                if ended is not None:
                    reason = ended
                    return
        except asyncio.CancelledError:
            reason = "connection closed"
            raise
        except Exception as exc:
            reason = _ended_by(exc)
        finally:
            self.fail(reason)
            # A sender may still be inside sock_sendall on this fd; shutdown() makes it
            # error out, and closing only after it has let go keeps the loop's fd map sane.
            async with self._send_lock:
                if self._input is not None:
                    self._input.stop()
                self.sock.close()

    async def _read_reply(self) -> str | None:
        """Receive the next reply and settle its request; returns why the connection ends after it
        (turned away, a refused WRITE), else None. Receives with self._sock_recv_into: the loop's,
        or a blocking caller's (_exchange_now)."""
        header = self._header
        await self._recv_header(self._header_view)
        magic, version, op, req_id, status, flags, length, stored_checksum = _unpack_reply(header)
        if magic != wire.MAGIC or version != wire.VERSION:
            if magic == wire.MAGIC:
                raise wire.version_mismatch(f"node {self.address}", version)
            raise ProtocolError(f"bad reply frame (magic {magic!r}, version {version})")
        if op == wire.TURNED_AWAY and status != _OK:  # answers no request: the node closes
            message = (await self._recv_bytes(length)).decode("utf-8", "replace")
            return f"node turned the connection away: {message}"
        pending = self._pending
        if not pending:
            raise ProtocolError(f"reply {req_id} to no request")
        request = pending[0]  # stays queued until settled, so a failure mid-payload fails it too
        if request.req_id != req_id or request.op != op:
            raise ProtocolError(f"reply {req_id} (op {op}) out of order; expected {request.req_id}")
        if status == _OK:
            if flags & _MAPPED:
                result = Location(length, stored_checksum)
                if request.abandoned() and request.held:
                    # Nobody will copy or fill it: give the node its extent back.
                    self.defer(_RELEASE, (request.held,), 0)
            elif op in _PAYLOAD_REPLY:
                result = await self._receive_payload(request, length)
            elif op == _PING:
                result = (await self._recv_bytes(length)).decode("utf-8", "replace")
            elif op in _JSON_REPLY:
                result = await self._recv_bytes(length)  # parsed by the caller: bad JSON fails only that call
            else:
                await self._drain(length)
                result = True if op in _FOUND_OR_NOT else None
        elif op in _FOUND_OR_NOT and status == _NOT_FOUND:
            await self._drain(length)
            result = False
        else:
            message = (await self._recv_bytes(length)).decode("utf-8", "replace")
            result = error_for(status, f"node {self.address}: {message}")
        pending.popleft()
        request.settle(result)
        if op == _WRITE and status not in (_OK, _CHECKSUM_MISMATCH):
            # The node could not trust the payload that followed: it hangs up after
            # this reply, so the next request must not be sent on this connection.
            return f"node refused a WRITE ({Code(status).name}) and closes the connection"
        return None

    async def _receive_payload(self, request: _Request, length: int):
        """Receive a READ payload into its destination; returns the checksum of what arrived."""
        buf = request.buf
        if length != len(buf):
            await self._drain(length)
            return ProtocolError(f"node {self.address}: READ reply of {length} bytes for a {len(buf)}-byte buffer")
        if request.abandoned():
            await self._drain(length)
            return None
        # Hash each chunk as it lands: the node keeps sending meanwhile, so the
        # checksum costs little beyond the receive instead of a pass after it.
        digest = Digest()
        recv_into, sock = self._sock_recv_into, self.sock
        left = length
        for view in pieces(buf):
            got, size = self._take_ahead(view), len(view)
            if got:
                digest.update(view[:got])
                left -= got
            while got < size:
                if request.abandoned():
                    # The caller gave up (e.g. timed out and is reading another replica into
                    # the same buffer): the rest must not land there.
                    await self._drain(left)
                    return None
                # Chunks small enough to still be in cache when hashed.
                more = await recv_into(sock, view[got:got + _HASH_CHUNK])
                if not more:
                    raise EOFError("connection closed by the node")
                digest.update(view[got:got + more])
                got += more
                left -= more
        return digest.intdigest()

    async def _recv_header(self, view: memoryview) -> None:
        """Fill `view` from the read-ahead buffer, receiving as much as is there when it runs short."""
        need, ahead = len(view), self._ahead
        start, end = self._ahead_start, self._ahead_end
        if end - start < need:
            if start == end:
                start = end = 0
            elif start + need > len(ahead):
                tail = end - start  # shorter than a header: move it to the front
                ahead[:tail] = ahead[start:end]
                start, end = 0, tail
            recv_into, sock = self._sock_recv_into, self.sock
            while end - start < need:
                more = await recv_into(sock, ahead[end:])
                if not more:
                    raise EOFError("connection closed by the node")
                end += more
        view[:] = ahead[start:start + need]
        self._ahead_start, self._ahead_end = start + need, end

    def _take_ahead(self, view: memoryview) -> int:
        """Copy what the read-ahead buffer holds (up to len(view)) into `view`; returns how much."""
        start = self._ahead_start
        n = min(len(view), self._ahead_end - start)
        if n:
            view[:n] = self._ahead[start:start + n]
            self._ahead_start = start + n
        return n

    async def _recv_exactly(self, view: memoryview) -> None:
        recv_into, sock = self._sock_recv_into, self.sock
        got, total = self._take_ahead(view), len(view)
        while got < total:
            more = await recv_into(sock, view[got:] if got else view)
            if not more:
                raise EOFError("connection closed by the node")
            got += more

    async def _recv_bytes(self, length: int) -> bytearray:
        """`length` bytes (a reply's body; an INVENTORY of millions of objects is hundreds of MB, not copied
        again into bytes)."""
        data = bytearray(length)
        await self._recv_exactly(memoryview(data))
        return data

    async def _drain(self, length: int) -> None:
        if self._drain_buf is None:
            self._drain_buf = memoryview(bytearray(_DRAIN_BYTES))
        while length:
            chunk = min(length, _DRAIN_BYTES)
            await self._recv_exactly(self._drain_buf[:chunk])
            length -= chunk

    # -- failure

    def fail(self, reason: str) -> None:
        """Drop the connection: every pending request fails, the next call reconnects."""
        if self.closed:
            return
        self.closed = True
        self.closed_because = reason  # what a request that comes too late is told
        self.owner.forget(self)
        try:
            # Wakes the reader and any sender blocked on this socket.
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        pending, self._pending = self._pending, collections.deque()
        for request in pending:
            request.settle(UnavailableError(f"node {self.address}: {reason}"))
