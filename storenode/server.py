"""The node's data server: the protocol of kvpool.protocol.wire over plain TCP on asyncio.

Raw non-blocking sockets (received through kvpool/sockets/socket_input.py, sent through
kvpool/sockets/socket_output.py), so a DRAM WRITE payload is received straight into the
segment and a DRAM READ reply is sent straight from it; SSD payloads go through a
small reusable buffer to pwrite, and SSD READs leave with sendfile. Each
connection is one task that handles its requests strictly in order; replies to
pipelined requests are gathered and sent together before the task waits for more
input. A peer that stalls mid-request, or stops reading its replies, for
--frame-timeout loses its connection and whatever its transfers held.

Each connection opens with the AUTH handshake (kvpool/security/auth.py); a peer that
proves only the client role gets FORBIDDEN, and its connection closed, for the
ops only a master may send (auth.MEMBER_OPS). A WRITE's term only fences: it is
refused when older than the node's, but only a member's REPORT, INVENTORY or
EVICTIONS can raise it.
"""

import asyncio
import json
import logging
import socket
import ssl
import time

from kvpool.protocol import transports, wire
from kvpool.security.auth import MEMBER_OPS, Role, ServerHandshake, Tickets, Verifier, refusal
from kvpool.protocol.checksum import Digest, checksum
from kvpool.errors import Code, ForbiddenError, KvpoolError
from kvpool.protocol.keys import MAX_KEY_BYTES
from kvpool.sockets.socket_output import PeerStalled, flush_backlog, send_all, send_file
from kvpool.security.tls_socket import TlsSocket
from kvpool.security.tls_socket import handshake as tls_handshake
from kvpool.protocol.write_options import raw_size_problem
from kvpool.sockets.socket_input import SocketInput

from .copier import Copier
from .index import ObjectRecord
from .maintenance import Maintenance
from .metrics import NodeMetrics
from .store import ObjectStore, Reservation

log = logging.getLogger(__name__)

STAGING_BYTES = 256 * 1024  # per connection: headers and keys of pipelined frames, and payload prefixes
HANDSHAKE_STAGING = 4096  # until the peer proved its credential: an unproved connection holds little
REPLY_BUFFER = 4 * 1024 * 1024  # replies queued past this are sent before more requests are read
SMALL_READ = 64 * 1024  # READ payloads up to this ride in the reply buffer: one send instead of two
HASH_CHUNK = 256 * 1024  # receive and hash WRITE payloads in pieces that fit in cache
# After a large WRITE, frames are staged only this far ahead (plenty for pipelined headers), so
# most of the next large payload is received straight into its extent, not staged and copied;
# after small ones a whole staging buffer is read at once, which costs fewer receives.
LARGE_WRITE = 128 * 1024
READ_AHEAD_AFTER_LARGE = 16 * 1024
SSD_CHUNK = 1024 * 1024  # SSD WRITE payloads: received into one buffer while the other is written
DRAIN_LIMIT = 64 * 1024 * 1024  # payload bytes read and dropped after refusing a WRITE
DRAIN_SECONDS = 2.0
FRAME_TIMEOUT = 10.0  # default --frame-timeout: seconds a half-received request may go without a byte
MAX_CONNECTIONS = 4096  # default --max-connections (kept below the process's descriptor limit by main.py)
TURN_AWAY_DRAINS = 64  # connections past the limit being closed politely at once; more are closed outright
TURN_AWAY_DRAIN_SECONDS = 0.5
_HEADER = wire.REQUEST.size
_OPTIONS = wire.WRITE_OPTIONS.size
_unpack_request = wire.REQUEST.unpack_from
_unpack_options = wire.WRITE_OPTIONS.unpack_from
_MAGIC, _VERSION = wire.MAGIC, wire.VERSION
_clock = time.perf_counter
_COMPRESSED = int(wire.WriteFlag.COMPRESSED)
_OP_NAMES = {op.value: op.name.lower() for op in wire.Op}


class _Disconnect(Exception):
    """End this connection: the peer left, or its stream can no longer be trusted."""


class DataServer:
    """offers: transport name -> what a client needs to use it, sent in HELLO ("shm" to clients
    of this host). verifier: the cluster's keys (an open Verifier takes any peer as a member)."""

    def __init__(self, store: ObjectStore, maintenance: Maintenance, node_id: str,
                 metrics: NodeMetrics | None = None, instance: str = "", verifier: Verifier | None = None,
                 frame_timeout: float = FRAME_TIMEOUT, max_connections: int = MAX_CONNECTIONS,
                 credential=None, tls=None, idle_timeout: float = 0.0):
        self.store = store
        self.max_connections = max_connections  # more are turned away, so no peer can take every descriptor
        self.frame_timeout = frame_timeout  # a request half-received with no byte for this long closes its connection
        self.idle_timeout = idle_timeout  # a connection with no request for this long is closed (0: never)
        self.maintenance = maintenance
        self.node_id = node_id
        self.instance = instance
        self.verifier = verifier or Verifier(None)
        self.tls = tls  # kvpool/security/tls.py TlsFiles: every connection is TLS (kvpool/security/tls_socket.py)
        self._tls_context = tls.server_context() if tls is not None else None
        self.ucx_tickets = Tickets()  # handed out in HELLO, taken by UCX CONNECTs (storenode/ucx_server.py)
        self.offers: dict[str, dict] = {}
        self.metrics = metrics or NodeMetrics()
        # COPY's WRITEs to other nodes prove the member role (over TLS too when the cluster uses it).
        self.copier = Copier(store, credential, tls.client_context() if tls is not None else None)
        self.term = 0  # highest term a member's REPORT, INVENTORY or EVICTIONS carried: older WRITEs are refused
        self.dropped = asyncio.Event()  # set when the store lists a dropped object: EVICTIONS answers
        store.on_dropped = self.dropped.set
        self._listener: socket.socket | None = None
        self._accept_task: asyncio.Task | None = None
        self._connections: set[asyncio.Task] = set()
        self._turning_away: set[asyncio.Task] = set()

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
        tasks = [t for t in (self._accept_task, *self._connections, *self._turning_away) if t]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self._listener:
            self._listener.close()
        await self.copier.close()

    def _turn_away(self, sock: socket.socket) -> None:
        """A connection past --max-connections: one UNAVAILABLE reply (op TURNED_AWAY), then closed. What
        the peer sent meanwhile is read and dropped for a moment first: closing on unread input resets
        the connection, and a reset can destroy the reply before the peer reads it."""
        self.metrics.error("accept", "UNAVAILABLE")
        try:
            sock.setblocking(False)
            sock.send(wire.pack_error(wire.TURNED_AWAY, 0, Code.UNAVAILABLE,
                                      f"node at its limit of {self.max_connections} connections"))
            sock.shutdown(socket.SHUT_WR)
        except OSError:
            sock.close()
            return
        if len(self._turning_away) >= TURN_AWAY_DRAINS:  # a flood: no time for manners
            sock.close()
            return
        task = asyncio.create_task(self._drain_and_close(sock))
        self._turning_away.add(task)
        task.add_done_callback(self._turning_away.discard)

    async def _drain_and_close(self, sock: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(TURN_AWAY_DRAIN_SECONDS):
                while await loop.sock_recv(sock, 65536):
                    pass
        except (TimeoutError, OSError):
            pass
        finally:
            sock.close()

    async def _accept_loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            try:
                sock, _ = await loop.sock_accept(self._listener)
            except OSError as exc:  # e.g. out of file descriptors: keep serving the open connections
                log.warning("accept failed: %s", exc)
                await asyncio.sleep(0.1)
                continue
            if len(self._connections) >= self.max_connections:
                self._turn_away(sock)
                continue
            sock.setblocking(False)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if self._tls_context is not None:
                sock = TlsSocket(sock, self._tls_context, server_side=True)
            task = asyncio.create_task(_Connection(self, sock).run())
            self._connections.add(task)
            task.add_done_callback(self._connections.discard)


class _Connection:
    def __init__(self, server: DataServer, sock: socket.socket):
        self.server = server
        self.store = server.store
        self.dram = server.store.dram
        self.ssd = server.store.ssd
        self.metrics = server.metrics
        self.sock = sock
        self.loop = asyncio.get_running_loop()
        self.input = SocketInput(sock, self.loop)  # every receive on sock goes through it
        self.buf = bytearray(HANDSHAKE_STAGING)  # grown to STAGING_BYTES once the peer is authenticated
        self.view = memoryview(self.buf)
        self.start = self.end = 0  # unparsed input is buf[start:end]
        self.read_ahead = STAGING_BYTES  # how much _fill may read at once (see LARGE_WRITE)
        self.out = bytearray()  # replies not sent yet
        self._ssd_buffers: tuple[memoryview, memoryview] | None = None  # made on the first SSD WRITE
        # Shared memory: set by ATTACH. What this client holds through the mapping, given back
        # on RELEASE, when a LOCATE's lease ends, or when the connection ends:
        # (key, generation) -> [(record LOCATEd, lease end)], oldest first, and
        # (key, generation) -> (reservation, ALLOCATE header fields) not committed yet.
        self.attached = False
        self.located: dict[tuple, list[tuple[ObjectRecord, float]]] = {}
        self.allocated: dict[tuple, tuple] = {}
        self._lease_timer: asyncio.TimerHandle | None = None
        self._allocation_timer: asyncio.TimerHandle | None = None
        handlers = {wire.Op.WRITE: self._write, wire.Op.READ: self._read, wire.Op.FREE: self._free,
                    wire.Op.PING: self._ping, wire.Op.HOLD: self._hold, wire.Op.REPORT: self._report,
                    wire.Op.INVENTORY: self._inventory, wire.Op.COPY: self._copy,
                    wire.Op.HELLO: self._hello, wire.Op.ATTACH: self._attach,
                    wire.Op.LOCATE: self._locate, wire.Op.RELEASE: self._release,
                    wire.Op.ALLOCATE: self._allocate, wire.Op.COMMIT: self._commit,
                    wire.Op.EVICTIONS: self._evictions}
        # op -> (handler, its request counters), looked up once per request
        self._serving = {int(op): (handler, self.metrics.per_op(_OP_NAMES[op])) for op, handler in handlers.items()}

    async def run(self) -> None:
        self.metrics.connections.inc()
        try:
            try:
                if await self._tls_handshake() and await self._authenticate():
                    while await self._serve_one():
                        pass
            except _Disconnect:
                pass
            await self._flush()  # requests before a bad frame still get their replies
        except PeerStalled as exc:  # it stopped reading its replies: what its transfers hold is let go
            self.metrics.error("reply", "STALLED")
            log.warning("closing a data connection: %s", exc)
        except OSError:  # peer gone or reset
            pass
        except Exception:  # a bug must cost one connection, not the node
            log.exception("data connection failed")
        finally:
            self._give_back()
            self.metrics.connections.dec()
            self.input.stop()
            self.sock.close()

    async def _tls_handshake(self) -> bool:
        """On a TLS connection, the TLS handshake first, within --frame-timeout; False if it failed."""
        if not isinstance(self.sock, TlsSocket):
            return True
        try:
            async with asyncio.timeout(self.server.frame_timeout):
                await tls_handshake(self.sock)
        except (TimeoutError, ssl.SSLError, OSError) as exc:
            self.metrics.error("tls", "HANDSHAKE")
            log.warning("closing a data connection: TLS handshake failed: %s", exc or type(exc).__name__)
            return False
        return True

    async def _authenticate(self) -> bool:
        """Challenge the peer and take its answer (within --frame-timeout); False: refused, close."""
        handshake = ServerHandshake(self.server.verifier)
        self.out += handshake.challenge()
        await self._flush()
        if self.server.verifier.open:
            self._grow_staging()
            return True
        await self._fill(_HEADER)
        magic, version, op, req_id, key_len, role, _gen, _arg, length, _sum = _unpack_request(self.buf, self.start)
        if magic != _MAGIC or version != _VERSION:
            log.warning("closing a data connection: bad magic/version %r/%d before AUTH", magic, version)
            return False
        size = _HEADER + key_len + length
        payload = b""
        if size <= HANDSHAKE_STAGING:  # a well-formed AUTH is far smaller; never wait for more
            await self._fill(size)
            payload = bytes(self.view[self.start + _HEADER + key_len:self.start + size])
            self.start += size
        try:
            role, reply = handshake.answer(op, req_id, key_len, role, length, payload)
        except ForbiddenError as exc:
            self.metrics.error("auth", "FORBIDDEN")
            log.warning("refused a data connection: %s", exc)
            self.out += refusal(req_id, exc)
            return False
        self.out += reply
        self._grow_staging()
        if role is not Role.MEMBER:
            for op in MEMBER_OPS:
                self._serving[int(op)] = (self._members_only, self._serving[int(op)][1])
        return True

    def _grow_staging(self) -> None:
        staged = bytes(self.view[self.start:self.end])
        self.view.release()
        self.buf = bytearray(STAGING_BYTES)
        self.view = memoryview(self.buf)
        self.view[:len(staged)] = staged
        self.start, self.end = 0, len(staged)

    async def _members_only(self, op, req_id, *_unused) -> bool:
        await self._fail(op, req_id, Code.FORBIDDEN, f"{_OP_NAMES[op].upper()} may be sent by a master only")
        return False

    async def _serve_one(self) -> bool:
        """Handle the next request; False when the connection must end."""
        if self.end - self.start < _HEADER:  # (the awaits only when input is short: no coroutine per request)
            await self._fill(_HEADER, between_requests=self.start == self.end)
        start = self.start
        magic, version, op, req_id, key_len, flags, generation, arg, length, value_checksum = \
            _unpack_request(self.buf, start)
        if magic != _MAGIC or version != _VERSION:
            log.warning("closing a data connection: bad magic/version %r/%d", magic, version)
            return False
        if key_len > MAX_KEY_BYTES:
            log.warning("closing a data connection: key_len %d > %d", key_len, MAX_KEY_BYTES)
            return False
        if self.end - start < _HEADER + key_len:
            await self._fill(_HEADER + key_len)
            start = self.start
        key = bytes(self.view[start + _HEADER:start + _HEADER + key_len])
        self.start = start + _HEADER + key_len

        serving = self._serving.get(op)  # not every wire.Op is a node's (the master's control ops)
        if serving is None:
            await self._fail(op, req_id, Code.PROTOCOL, f"unknown op {op}", "unknown")
            return False
        handler, stats = serving
        began = _clock()
        keep_open = await handler(op, req_id, key, generation, flags, arg, length, value_checksum)
        stats.record(_clock() - began)
        if len(self.out) > REPLY_BUFFER:  # a peer that pipelines reads and never takes the replies holds little
            await self._flush()
        return keep_open

    # -- requests: each returns whether the connection stays usable

    async def _write(self, op, req_id, key, generation, flags, term, length, value_checksum) -> bool:
        if self.end - self.start < _OPTIONS:
            await self._fill(_OPTIONS)
        ttl_ms, soft_pin_ms, raw_size = _unpack_options(self.buf, self.start)
        self.start += _OPTIONS
        if not self._term_current(term):  # placed by a master that no longer leads
            await self._refuse(op, req_id, Code.NOT_LEADER,
                               f"WRITE placed in term {term}; a master of term {self.server.term} leads", length)
            return False
        # On refusal the payload that follows cannot be skipped safely: reply, then hang up.
        if length == 0:
            await self._refuse(op, req_id, Code.INVALID_ARGUMENT, "WRITE of an empty payload", 0)
            return False
        problem = raw_size_problem(length, raw_size, bool(flags & _COMPRESSED))
        if problem:  # a reader would believe it (and allocate it)
            await self._refuse(op, req_id, Code.INVALID_ARGUMENT, problem, length)
            return False
        try:
            res = self.store.reserve(key, length, flags)
        except KvpoolError as exc:
            await self._refuse(op, req_id, exc.code, str(exc), length)
            return False
        self.read_ahead = READ_AHEAD_AFTER_LARGE if length >= LARGE_WRITE else STAGING_BYTES
        received = False
        try:
            if res.tier is self.dram and self.end - self.start >= length:  # all here: no waiting
                digest = self._take_staged(res.offset, length)
            elif res.tier is self.dram:
                digest = await self._receive_to_dram(res.offset, length)
            else:
                digest = await self._receive_to_ssd(res, key, length)
            received = True
        finally:
            if not received:  # the peer left mid-payload: nothing was recorded
                self.store.abort(res)
        self.metrics.bytes_in.inc(length)
        if digest != value_checksum:
            self.store.abort(res)
            self._error(op, req_id, Code.CHECKSUM_MISMATCH,
                        f"payload checksum differs from {value_checksum:#x}; object not stored")
            return True
        rec = self.store.new_record(key, generation, length, value_checksum, flags, raw_size, ttl_ms, soft_pin_ms)
        if res.tier is not self.dram:
            res.tier.segment.write_header(res.offset, self.store.stored_object(rec))  # last: makes it an object
        self.store.commit(res, rec)
        self.out += wire.pack_reply(op, req_id, Code.OK)
        return True

    def _term_current(self, term: int) -> bool:
        """False for a write placed by a master older than one we have heard from (0: unfenced).
        A writer cannot raise the term: only the leader's own requests do."""
        return term >= self.server.term or not term

    def _take_staged(self, offset: int, length: int) -> int:
        """Copy a payload that is all in the staging buffer into DRAM; its digest."""
        start = self.start
        target = self.dram.segment.view(offset, length)
        target[:] = self.view[start:start + length]
        self.start = start + length
        return checksum(target)

    async def _receive_to_dram(self, offset: int, length: int) -> int:
        target = self.dram.segment.view(offset, length)
        staged = min(length, self.end - self.start)
        target[:staged] = self.view[self.start:self.start + staged]
        self.start += staged
        # Hash each chunk as it lands, while it is still in cache and the client keeps sending.
        digest = Digest(target[:staged])
        if staged < length:
            received = staged
            while received < length:
                got = await self._recv_into(target[received:received + HASH_CHUNK])
                if not got:
                    raise _Disconnect
                digest.update(target[received:received + got])
                received += got
        return digest.intdigest()

    async def _receive_to_ssd(self, res: Reservation, key: bytes, length: int) -> int:
        """Key, then payload chunks pwritten by a thread while the next chunk arrives; returns the digest."""
        segment = res.tier.segment
        segment.pwrite_all(key, segment.key_offset(res.offset))
        position = segment.payload_offset(res.offset, len(key))
        staged = min(length, self.end - self.start)
        digest = Digest(self.view[self.start:self.start + staged])
        segment.pwrite_all(self.view[self.start:self.start + staged], position)
        self.start += staged
        received = staged
        if received == length:
            return digest.intdigest()
        await self._flush()
        if self._ssd_buffers is None:
            self._ssd_buffers = (memoryview(bytearray(SSD_CHUNK)), memoryview(bytearray(SSD_CHUNK)))
        writing = None  # the previous chunk's pwrite, running in a thread
        which = 0
        try:
            while received < length:
                chunk = self._ssd_buffers[which][:min(SSD_CHUNK, length - received)]
                which ^= 1
                filled = 0
                while filled < len(chunk):
                    got = await self._recv_mid_frame(chunk[filled:filled + HASH_CHUNK])
                    if not got:
                        raise _Disconnect
                    digest.update(chunk[filled:filled + got])
                    filled += got
                if writing is not None:
                    await writing
                writing = self.loop.run_in_executor(None, segment.pwrite_all, chunk, position + received)
                received += len(chunk)
            await writing
            writing = None
        finally:
            if writing is not None and not writing.done():
                # The extent may be given back after this: no thread may still write into it.
                await asyncio.wait([writing])
        return digest.intdigest()

    async def _read(self, op, req_id, key, generation, _flags, _arg, length, _checksum) -> bool:
        rec = self._readable(op, req_id, key, generation, length)
        if rec is not None:
            await self._send_object(op, req_id, rec)
        return True

    def _readable(self, op, req_id, key, generation, length) -> ObjectRecord | None:
        """The record a READ or LOCATE asks for; None after replying why not."""
        rec, why = self.store.lookup(key, generation)
        if rec is None:
            self.store.count_miss()
            if why == "stale":
                self._error(op, req_id, Code.STALE, f"this node no longer holds generation {generation} of the key")
            else:
                self._error(op, req_id, Code.NOT_FOUND, f"no generation {generation} of this key here")
            return None
        if length != rec.size:
            self._error(op, req_id, Code.STALE, f"generation {generation} has {rec.size} bytes, not {length}")
            return None
        return rec

    async def _send_object(self, op, req_id, rec: ObjectRecord) -> None:
        self.out += wire.pack_reply(op, req_id, Code.OK, rec.size, rec.checksum)
        if rec.dram is not None:
            self.store.count_read(rec, from_dram=True)
            await self._send_from_dram(rec)
        else:
            if self.store.count_read(rec, from_dram=False):
                self.server.maintenance.promote(rec)
            await self._send_from_ssd(rec)
        self.metrics.bytes_out.inc(rec.size)

    async def _send_from_dram(self, rec: ObjectRecord) -> None:
        data = self.dram.segment.view(rec.dram, rec.size)
        if rec.size <= SMALL_READ:
            self.out += data  # copied now: the extent may change once we await
            return
        self.store.acquire(rec)
        try:
            # The replies so far and this payload leave in one sendmsg while the socket takes them.
            out, self.out = self.out, bytearray()
            await self._send_all(out, data)
        finally:
            self.store.release(rec)

    async def _send_from_ssd(self, rec: ObjectRecord) -> None:
        segment = self.ssd.segment
        position = segment.payload_offset(rec.ssd, len(rec.key))
        if rec.size <= SMALL_READ:
            start = len(self.out)
            self.out.extend(bytes(rec.size))
            with memoryview(self.out) as out:
                segment.pread_into(out[start:], position)
            return
        self.store.acquire(rec)
        try:
            await self._flush()
            await send_file(self.sock, segment.file, position, rec.size, self.server.frame_timeout)
        finally:
            self.store.release(rec)

    async def _free(self, op, req_id, key, generation, *_unused) -> bool:
        if self.store.free(key, generation):
            self.out += wire.pack_reply(op, req_id, Code.OK)
        else:
            self._error(op, req_id, Code.NOT_FOUND, f"no generation {generation} of this key here")
        return True

    async def _hold(self, op, req_id, key, generation, _flags, arg, *_unused) -> bool:
        if self.store.hold(key, generation, arg):
            self.out += wire.pack_reply(op, req_id, Code.OK)
        else:
            self._error(op, req_id, Code.NOT_FOUND, f"no generation {generation} of this key here")
        return True

    async def _ping(self, op, req_id, *_unused) -> bool:
        self._reply_body(op, req_id, self.server.node_id.encode())
        return True

    async def _report(self, op, req_id, _key, _generation, _flags, term, *_unused) -> bool:
        self.server.term = max(self.server.term, term)
        self._reply_json(op, req_id, self.store.report(self.server.node_id))
        return True

    async def _evictions(self, op, req_id, _key, _generation, _flags, term, *_unused) -> bool:
        """Answer once something was dropped (or after EVICTIONS_WAIT), so the master's table
        loses an evicted copy a round trip after the eviction, not at its next REPORT."""
        if term and term < self.server.term:
            self._error(op, req_id, Code.NOT_LEADER, f"term {term} is older than {self.server.term}")
            return True
        self.server.term = max(self.server.term, term)
        await self._flush()  # replies before this one must not wait for it
        store, dropped = self.store, self.server.dropped
        deadline = self.loop.time() + wire.EVICTIONS_WAIT
        while not store.has_dropped() and (left := deadline - self.loop.time()) > 0:
            dropped.clear()
            try:
                await asyncio.wait_for(dropped.wait(), left)
            except TimeoutError:
                break
        if term and term < self.server.term:  # deposed (maybe while waiting): leave them to the leader
            self._error(op, req_id, Code.NOT_LEADER, f"term {term} is older than {self.server.term}")
        else:
            self._reply_json(op, req_id, {"evicted": store.take_dropped()})
        return True

    async def _inventory(self, op, req_id, _key, _generation, _flags, term, *_unused) -> bool:
        self.server.term = max(self.server.term, term)  # a new leader asks this first: older WRITEs end here
        self._reply_body(op, req_id, self.store.inventory_reply())
        return True

    async def _copy(self, op, req_id, key, generation, _flags, _arg, length, _checksum) -> bool:
        target = await self._small_payload(op, req_id, length, wire.MAX_COPY_TARGET, "COPY destination")
        if target is None:
            return False
        destination = target.decode("utf-8", "replace")
        await self._flush()  # the replies before this one need not wait for the copy
        try:
            sent = await self.server.copier.copy(key, generation, destination)
        except KvpoolError as exc:
            self._error(op, req_id, exc.code, str(exc))
            return True
        self.metrics.bytes_out.inc(sent)
        self.out += wire.pack_reply(op, req_id, Code.OK)
        return True

    async def _hello(self, op, req_id, *_unused) -> bool:
        server = self.server
        offers = server.offers
        if transports.UCX in offers and not server.verifier.open:  # a ticket to prove on UCX's CONNECT
            offers = {**offers, transports.UCX: {**offers[transports.UCX], "ticket": server.ucx_tickets.issue().hex()}}
        self._reply_json(op, req_id, {"node_id": server.node_id, "instance": server.instance,
                                      "host_id": transports.host_id(), "transports": offers})
        return True

    # -- shared memory: the client copies through the mapping, the node keeps the books

    async def _attach(self, op, req_id, _key, _generation, _flags, _arg, length, _checksum) -> bool:
        """The connection proved its credential already; the segment file's mode does the rest."""
        if await self._small_payload(op, req_id, length, 0, "ATTACH payload") is None:
            return False
        offer = self.server.offers.get(transports.SHM)
        if offer is None:
            self._error(op, req_id, Code.FORBIDDEN, "this node does not offer shared memory")
        else:
            self.attached = True
            self._reply_json(op, req_id, {"path": self.dram.segment.path, "size": self.dram.segment.capacity,
                                          "instance": self.server.instance})
        return True

    def _check_attached(self, op, req_id) -> bool:
        if not self.attached:
            self._error(op, req_id, Code.FORBIDDEN, f"{_OP_NAMES[op].upper()} before a successful ATTACH")
        return self.attached

    async def _locate(self, op, req_id, key, generation, _flags, _arg, length, _checksum) -> bool:
        if not self._check_attached(op, req_id):
            return True
        rec = self._readable(op, req_id, key, generation, length)
        if rec is None:
            return True
        if rec.dram is None:  # on SSD only: the bytes come over the socket, as for a READ
            await self._send_object(op, req_id, rec)
            return True
        self.store.acquire(rec)  # neither freed nor moved while the client copies
        self.located.setdefault((key, generation), []).append((rec, time.monotonic() + wire.LOCATE_LEASE))
        if self._lease_timer is None:
            self._lease_timer = self.loop.call_later(wire.LOCATE_LEASE, self._end_leases)
        self.store.count_read(rec, from_dram=True)
        self.metrics.bytes_out.inc(rec.size)
        self._reply_location(op, req_id, rec.dram, rec.checksum)
        return True

    async def _allocate(self, op, req_id, key, generation, flags, term, length, value_checksum) -> bool:
        await self._fill(_OPTIONS)
        options = wire.WRITE_OPTIONS.unpack_from(self.buf, self.start)
        self.start += _OPTIONS
        if not self._check_attached(op, req_id):
            return True
        if not self._term_current(term):
            self._error(op, req_id, Code.NOT_LEADER,
                        f"ALLOCATE placed in term {term}; a master of term {self.server.term} leads")
            return True
        if length == 0 or (key, generation) in self.allocated:
            self._error(op, req_id, Code.INVALID_ARGUMENT, "ALLOCATE of an empty or already allocated object")
            return True
        problem = raw_size_problem(length, options[2], bool(flags & _COMPRESSED))
        if problem:
            self._error(op, req_id, Code.INVALID_ARGUMENT, problem)
            return True
        try:
            res = self.store.reserve(key, length, flags, dram_only=True)
        except KvpoolError as exc:
            self._error(op, req_id, exc.code, str(exc))
            return True
        # Until COMMIT, for --frame-timeout at most: a client that never commits holds no room for long.
        self.allocated[(key, generation)] = (res, flags, length, value_checksum, options,
                                             time.monotonic() + self.server.frame_timeout)
        if self._allocation_timer is None:
            self._allocation_timer = self.loop.call_later(self.server.frame_timeout, self._end_allocations)
        self._reply_location(op, req_id, res.offset, value_checksum)
        return True

    def _end_allocations(self) -> None:
        """Give back the ALLOCATEd extents whose COMMIT is overdue (a late COMMIT finds nothing)."""
        self._allocation_timer = None
        now = time.monotonic()
        for where, pending in list(self.allocated.items()):
            if pending[5] <= now:
                del self.allocated[where]
                self.store.abort(pending[0])
                self.metrics.error("allocate", "EXPIRED")
        if self.allocated:
            soonest = min(pending[5] for pending in self.allocated.values())
            self._allocation_timer = self.loop.call_later(max(0.0, soonest - now), self._end_allocations)

    async def _commit(self, op, req_id, key, generation, *_unused) -> bool:
        pending = self.allocated.pop((key, generation), None)
        if pending is None:
            self._error(op, req_id, Code.NOT_FOUND, f"no ALLOCATEd generation {generation} of this key")
            return True
        res, flags, length, value_checksum, (ttl_ms, soft_pin_ms, raw_size), _due = pending
        # The client wrote these bytes itself: check them as a received WRITE is checked.
        if checksum(self.dram.segment.view(res.offset, length)) != value_checksum:
            self.store.abort(res)
            self._error(op, req_id, Code.CHECKSUM_MISMATCH,
                        f"bytes in the segment differ from checksum {value_checksum:#x}; object not stored")
            return True
        rec = self.store.new_record(key, generation, length, value_checksum, flags, raw_size, ttl_ms, soft_pin_ms)
        self.store.commit(res, rec)
        self.metrics.bytes_in.inc(length)
        self.out += wire.pack_reply(op, req_id, Code.OK)
        return True

    async def _release(self, op, req_id, key, generation, *_unused) -> bool:
        """Give back a LOCATE's reference, or an ALLOCATE never committed (the writer gave up).
        Not answered; releasing what is not held is a no-op (e.g. a COMMIT got there first)."""
        located = self.located.get((key, generation))
        if located:
            self.store.release(located.pop(0)[0])
            if not located:
                del self.located[(key, generation)]
        else:
            pending = self.allocated.pop((key, generation), None)
            if pending is not None:
                self.store.abort(pending[0])
        return True

    def _end_leases(self) -> None:
        """Release the LOCATEs whose lease is over (their RELEASE is late or will never come)."""
        self._lease_timer = None
        now = time.monotonic()
        for where, located in list(self.located.items()):
            while located and located[0][1] <= now:
                self.store.release(located.pop(0)[0])
            if not located:
                del self.located[where]
        if self.located:
            soonest = min(located[0][1] for located in self.located.values())
            self._lease_timer = self.loop.call_later(max(0.0, soonest - now), self._end_leases)

    def _give_back(self) -> None:
        """The connection ended: whatever its client held through the mapping is the node's again."""
        for timer in (self._lease_timer, self._allocation_timer):
            if timer is not None:
                timer.cancel()
        for located in self.located.values():
            for rec, _lease_end in located:
                self.store.release(rec)
        for pending in self.allocated.values():
            self.store.abort(pending[0])
        self.located.clear()
        self.allocated.clear()

    # -- helpers

    async def _small_payload(self, op: int, req_id: int, length: int, limit: int, what: str) -> bytes | None:
        """The request's payload when it is at most `limit` bytes; else None after an error reply
        (the connection must then close: the payload cannot be skipped)."""
        if length > limit:
            await self._fail(op, req_id, Code.PROTOCOL, f"{what} of {length} bytes")
            return None
        await self._fill(length)
        payload = bytes(self.view[self.start:self.start + length])
        self.start += length
        return payload

    def _reply_location(self, op: int, req_id: int, offset: int, value_checksum: int) -> None:
        self.out += wire.pack_reply(op, req_id, Code.OK, offset, value_checksum, wire.ReplyFlag.MAPPED)

    def _reply_json(self, op: int, req_id: int, value) -> None:
        self._reply_body(op, req_id, json.dumps(value).encode())

    def _reply_body(self, op: int, req_id: int, body: bytes) -> None:
        self.out += wire.pack_reply(op, req_id, Code.OK, len(body), checksum(body))
        self.out += body

    def _error(self, op: int, req_id: int, code: Code, message: str, name: str | None = None) -> None:
        self.out += wire.pack_error(op, req_id, code, message)
        self.metrics.error(name or _OP_NAMES[op], code.name)

    async def _fail(self, op: int, req_id: int, code: Code, message: str, name: str | None = None) -> None:
        """Send an error reply before the connection is closed."""
        self._error(op, req_id, code, message, name)
        await self._flush()

    async def _refuse(self, op: int, req_id: int, code: Code, message: str, length: int) -> None:
        """Reply to a WRITE we will not take, then swallow (a bounded part of) its payload before closing.

        Closing with the payload still unread would make the kernel reset the
        connection, and a reset may destroy the reply before the client reads it.
        """
        await self._fail(op, req_id, code, message)
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

    async def _fill(self, n: int, between_requests: bool = False) -> None:
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
            got = await self._recv_into(self.view[self.end:self.end + room], between_requests)
            if not got:
                raise _Disconnect
            self.end += got
            between_requests = False

    async def _recv_into(self, view, between_requests: bool = False) -> int:
        """Receive what is there; only when nothing is, send the replies owed first (the peer may
        be waiting for them), then wait. A pipelined batch's replies so leave together."""
        got = self.input.try_recv_into(view)
        if got is None:
            await self._flush()
            got = await (self._recv_idle(view) if between_requests else self._recv_mid_frame(view))
        return got

    async def _recv_idle(self, view) -> int:
        """Wait for the next request; with --idle-timeout, a connection quiet that long is closed (its
        client opens a new one on its next request)."""
        if not self.server.idle_timeout:
            return await self.input.recv_into(view)
        try:
            async with asyncio.timeout(self.server.idle_timeout):
                return await self.input.recv_into(view)
        except TimeoutError:
            self.metrics.error("idle", "CLOSED")
            raise _Disconnect from None

    async def _recv_mid_frame(self, view) -> int:
        """Wait for more of a request begun: a peer that stops sending mid-request (a header-only WRITE
        holding its reserved extent, say) loses its connection, and what it held, after --frame-timeout."""
        try:
            async with asyncio.timeout(self.server.frame_timeout):
                return await self.input.recv_into(view)
        except TimeoutError:
            self.metrics.error("frame", "STALLED")
            log.warning("closing a data connection: a request stalled half-received for %gs",
                        self.server.frame_timeout)
            raise _Disconnect from None

    async def _send_all(self, head: bytearray, data: memoryview) -> None:
        try:
            sent = self.sock.sendmsg((head, data))
        except (BlockingIOError, InterruptedError):
            sent = 0
        stall = self.server.frame_timeout
        if sent < len(head):
            await send_all(self.sock, memoryview(head)[sent:], stall)
            sent = len(head)
        if sent - len(head) < len(data):
            await send_all(self.sock, data[sent - len(head):], stall)
        elif getattr(self.sock, "backlog", None):  # TLS: what was encrypted must leave before we wait for input
            await flush_backlog(self.sock, stall)

    async def _flush(self) -> None:
        if self.out:
            out, self.out = self.out, bytearray()
            await send_all(self.sock, out, self.server.frame_timeout)
