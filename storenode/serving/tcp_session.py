"""One peer's session on a node's TCP data port: its AUTH handshake, then its requests, strictly in order, as
typed records.

Each request's header and key are parsed into an ops.Request and handed to its op's handler: WRITE and
READ here (a DRAM WRITE payload is received straight into its extent and a DRAM READ reply sent straight
from it; SSD payloads go through a small reusable buffer to pwrite, and SSD READs leave with sendfile),
the member-only ops in tcp_members.py, the shared-memory ops in tcp_shm.py; what each op decides is
storenode/serving/ops.py's. A handler returns whether the connection stays usable, or, when it has to wait (for
input, or for the socket to take a large reply), an awaitable of that: the requests of a pipelined
batch that are staged whole are served without a coroutine each. A peer that proves only the client
role gets FORBIDDEN, and its connection closed, for the ops only a master may send (the role check is
ops.NodeOps.members).
"""

import asyncio
import logging
import ssl
import time

from kvpool.protocol import transports, wire
from kvpool.security.auth import CLIENT, MEMBER, Role, ServerHandshake, refusal
from kvpool.protocol.checksum import Digest, checksum
from kvpool.errors import Code, ForbiddenError, KvpoolError
from kvpool.protocol.keys import MAX_KEY_BYTES
from kvpool.sockets.socket_output import PeerStalled, send_file
from kvpool.security.tls_socket import TlsSocket
from kvpool.security.tls_socket import handshake as tls_handshake

from kvpool.storenode.serving import tcp_members
from kvpool.storenode.storage.index import ObjectRecord
from kvpool.storenode.serving.ops import OP_NAMES, Request, StoredOptions
from kvpool.storenode.storage.store import Reservation
from kvpool.storenode.serving.tcp_framing import HANDSHAKE_STAGING, STAGING_BYTES, Framing, _Disconnect
from kvpool.storenode.serving.tcp_shm import SharedMemoryRequests

log = logging.getLogger(__name__)

REPLY_BUFFER = 4 * 1024 * 1024  # replies queued past this are sent before more requests are read
SMALL_READ = 64 * 1024  # READ payloads up to this ride in the reply buffer: one send instead of two
HASH_CHUNK = 256 * 1024  # receive and hash WRITE payloads in pieces that fit in cache
# After a large WRITE, frames are staged only this far ahead (plenty for pipelined headers), so
# most of the next large payload is received straight into its extent, not staged and copied;
# after small ones a whole staging buffer is read at once, which costs fewer receives.
LARGE_WRITE = 128 * 1024
READ_AHEAD_AFTER_LARGE = 16 * 1024
SSD_CHUNK = 1024 * 1024  # SSD WRITE payloads: received into one buffer while the other is written
_HEADER = wire.REQUEST.size
_OPTIONS = wire.WRITE_OPTIONS.size
_unpack_request = wire.REQUEST.unpack_from
_unpack_options = wire.WRITE_OPTIONS.unpack_from
_new_record = tuple.__new__  # a NamedTuple from a tuple, without the Python-level constructor
_MAGIC, _VERSION = wire.MAGIC, wire.VERSION
_pack_reply = wire.REPLY.pack
_OK = int(Code.OK)
_clock = time.perf_counter


class TcpSession(Framing):
    """server: the node's DataServer (storenode/serving/tcp_server.py), for its NodeOps, settings and offers."""

    def __init__(self, server, sock):
        super().__init__(sock, server.metrics, server.frame_timeout, server.idle_timeout)
        self.server = server
        self.node = server.node
        self.store = server.store
        self.dram = server.store.dram
        self.ssd = server.store.ssd
        self.caller = CLIENT  # until the peer proves more (kvpool/security/roles.py Caller)
        self.role = CLIENT.role
        self.caller_key = b""  # the key it proved with (a UCX ticket handed to it is bound to it)
        self.handshake_due = self.loop.time() + server.frame_timeout  # from the accept, not from the last byte
        self._ssd_buffers: tuple[memoryview, memoryview] | None = None  # made on the first SSD WRITE
        self.shm = SharedMemoryRequests(self)
        self._bytes_in, self._bytes_out = self.metrics.bytes_in, self.metrics.bytes_out
        member = self._as_member
        handlers = {wire.Op.WRITE: self._write, wire.Op.READ: self._read, wire.Op.PING: self._ping,
                    wire.Op.HELLO: self._hello,
                    wire.Op.FREE: member(tcp_members.free), wire.Op.HOLD: member(tcp_members.hold),
                    wire.Op.REPORT: member(tcp_members.report), wire.Op.INVENTORY: member(tcp_members.inventory),
                    wire.Op.COPY: member(tcp_members.copy), wire.Op.EVICTIONS: member(tcp_members.evictions),
                    wire.Op.FREE_SHARED: member(tcp_members.free_shared),
                    wire.Op.SHARED_SCAN: member(tcp_members.shared_scan),
                    wire.Op.INVENTORY_CHANGES: member(tcp_members.inventory_changes),
                    wire.Op.ATTACH: self.shm.attach, wire.Op.LOCATE: self.shm.locate,
                    wire.Op.RELEASE: self.shm.release, wire.Op.ALLOCATE: self.shm.allocate,
                    wire.Op.COMMIT: self.shm.commit}
        # op -> (handler, its request counters), looked up once per request
        self._serving = {int(op): (handler, self.metrics.per_op(OP_NAMES[op])) for op, handler in handlers.items()}

    async def run(self) -> None:
        self.metrics.connections.inc()
        try:
            try:
                if await self._handshakes():
                    await self._serve()
            except _Disconnect:
                pass
            await self.flush()  # requests before a bad frame still get their replies
        except PeerStalled as exc:  # it stopped reading its replies: what its transfers held is let go
            self.metrics.error("reply", "STALLED")
            log.warning("closing a data connection: %s", exc)
        except OSError:  # peer gone or reset
            pass
        except Exception:  # a bug must cost one connection, not the node
            log.exception("data connection failed")
        finally:
            self.shm.give_back()
            self.metrics.connections.dec()
            self.input.stop()
            self.sock.close()

    async def _handshakes(self) -> bool:
        """TLS (if any) and AUTH, both done within --frame-timeout of the accept, however the peer spaces
        its bytes: a stranger holds its unproved slot no longer. False: refused, or too slow; close."""
        try:
            async with asyncio.timeout_at(self.handshake_due):
                return await self._tls_handshake() and await self._authenticate()
        except TimeoutError:
            self.metrics.error("auth", "OVERDUE")
            log.warning("closing a data connection: no credential within %gs of connecting", self.frame_timeout)
            return False

    async def _tls_handshake(self) -> bool:
        """On a TLS connection, the TLS handshake first; False if it failed."""
        if not isinstance(self.sock, TlsSocket):
            return True
        try:
            await tls_handshake(self.sock)
        except (ssl.SSLError, OSError) as exc:
            self.metrics.error("tls", "HANDSHAKE")
            log.warning("closing a data connection: TLS handshake failed: %s", exc or type(exc).__name__)
            return False
        return True

    async def _authenticate(self) -> bool:
        """Challenge the peer and take its answer; False: refused, close."""
        verifier = self.server.verifier
        handshake = ServerHandshake(verifier)
        self.out += handshake.challenge()
        await self.flush()
        if verifier.open:  # a node without a secret takes any peer as a member
            self.caller, self.role = MEMBER, MEMBER.role
            self.grow_staging()
            return True
        await self.fill(_HEADER)
        magic, version, op, req_id, key_len, role, _gen, _arg, length, _sum = _unpack_request(self.buf, self.start)
        if magic != _MAGIC or version != _VERSION:
            self._refuse_frame(magic, version, "before AUTH")
            return False
        size = _HEADER + key_len + length
        ident = payload = b""
        if size <= HANDSHAKE_STAGING:  # a well-formed AUTH is far smaller; never wait for more
            await self.fill(size)
            ident = bytes(self.view[self.start + _HEADER:self.start + _HEADER + key_len])
            payload = bytes(self.view[self.start + _HEADER + key_len:self.start + size])
            self.start += size
        try:
            self.caller, reply = handshake.answer(op, req_id, ident, role, length, payload)
            self.role, self.caller_key = self.caller.role, handshake.key
        except ForbiddenError as exc:
            self.metrics.error("auth", "FORBIDDEN")
            log.warning("refused a data connection: %s", exc)
            self.out += refusal(req_id, exc)
            return False
        if not self.server.proved(self):  # every proved slot taken meanwhile
            self.out += self.server.turned_away_frame()
            return False
        self.out += reply
        self.grow_staging()
        return True

    def _refuse_frame(self, magic, version: int, when: str) -> None:
        """A frame this node cannot read: a peer of another wire protocol is told so, naming both versions
        (the connection then closes)."""
        if magic == _MAGIC:
            try:
                peer = "%s:%s" % self.sock.getpeername()[:2]
            except OSError:
                peer = "a peer"
            refusal = wire.version_mismatch(peer, version)
            log.warning("closing a data connection: %s", refusal)
            self.out += wire.version_refusal("this node", version)
            return
        log.warning("closing a data connection: bad magic/version %r/%d %s", bytes(magic), version, when)

    def _as_member(self, handler):
        """handler(connection, members, req), reached only by a peer that proved the member role:
        any other gets FORBIDDEN and loses its connection (a payload may follow that cannot be skipped)."""
        def checked(req: Request):
            try:
                members = self.node.members(self.role, req.op)
            except ForbiddenError as exc:
                return self._fail_and_close(req, exc)
            return handler(self, members, req)
        return checked

    async def _fail_and_close(self, req: Request, exc: KvpoolError) -> bool:
        await self.fail(req.op, req.req_id, exc.code, str(exc))
        return False

    async def _serve(self) -> None:
        """Handle requests, in order, until the connection must end."""
        serving = self._serving
        while True:
            if self.end - self.start < _HEADER:  # (the awaits only when input is short)
                await self.fill(_HEADER, between_requests=self.start == self.end)
            start = self.start
            magic, version, op, req_id, key_len, flags, generation, arg, length, value_checksum = \
                _unpack_request(self.buf, start)
            if magic != _MAGIC or version != _VERSION:
                self._refuse_frame(magic, version, "")
                return
            if key_len > MAX_KEY_BYTES:
                log.warning("closing a data connection: key_len %d > %d", key_len, MAX_KEY_BYTES)
                return
            if self.end - start < _HEADER + key_len:
                await self.fill(_HEADER + key_len)
                start = self.start
            key = bytes(self.view[start + _HEADER:start + _HEADER + key_len])
            self.start = start + _HEADER + key_len
            if self.caller.scope is not None:  # a client's: its token current, the keys it may name (ops.py)
                refused = self.node.refusal(self.caller, op, key)
                if refused is not None:  # (a payload may follow that cannot be skipped)
                    await self.fail(op, req_id, refused.code, str(refused))
                    return

            serving_op = serving.get(op)  # not every wire.Op is a node's (the master's control ops)
            if serving_op is None:
                await self.fail(op, req_id, Code.PROTOCOL, f"unknown op {op}", "unknown")
                return
            handler, stats = serving_op
            began = _clock()
            keep_open = handler(_new_record(Request, (op, req_id, key, generation, flags, arg, length,
                                                      value_checksum)))
            if keep_open is not True and keep_open is not False:  # it has to wait: an awaitable
                keep_open = await keep_open
            stats.record(_clock() - began)
            if len(self.out) > REPLY_BUFFER:  # a peer that pipelines reads and never takes the replies holds little
                await self.flush()
            if not keep_open:
                return

    # -- WRITE and READ; each handler returns whether the connection stays usable

    def _write(self, req: Request):
        """A WRITE whose options and payload are staged whole, into DRAM, is served here without
        waiting; any other goes on in _write_waiting."""
        start = self.start
        length = req.length
        if self.end - start < _OPTIONS + length:
            return self._write_waiting(req)
        options = _new_record(StoredOptions, _unpack_options(self.buf, start))
        self.start = start = start + _OPTIONS
        try:
            res = self.node.admit_write(req, options, self.role)
        except KvpoolError as exc:
            return self._refuse_write(req, exc)
        if res.tier is not self.dram:
            return self._write_admitted(req, options, res)
        self.read_ahead = READ_AHEAD_AFTER_LARGE if length >= LARGE_WRITE else STAGING_BYTES
        try:
            target = self.dram.segment.view(res.offset, length)
            target[:] = self.view[start:start + length]
            digest = checksum(target)
        except BaseException:
            self.store.abort(res)
            raise
        self.start = start + length
        self._commit_write(req, options, res, digest)
        return True

    async def _write_waiting(self, req: Request) -> bool:
        if self.end - self.start < _OPTIONS:
            await self.fill(_OPTIONS)
        options = _new_record(StoredOptions, _unpack_options(self.buf, self.start))
        self.start += _OPTIONS
        try:
            res = self.node.admit_write(req, options, self.role)
        except KvpoolError as exc:
            return await self._refuse_write(req, exc)
        return await self._write_admitted(req, options, res)

    async def _refuse_write(self, req: Request, exc: KvpoolError) -> bool:
        # The payload that follows cannot be skipped safely: reply, then hang up.
        await self.refuse(req.op, req.req_id, exc.code, str(exc), req.length)
        return False

    async def _write_admitted(self, req: Request, options: StoredOptions, res: Reservation) -> bool:
        """Receive the payload of an admitted WRITE into its reservation, then commit it."""
        length = req.length
        self.read_ahead = READ_AHEAD_AFTER_LARGE if length >= LARGE_WRITE else STAGING_BYTES
        received = False
        try:
            if res.tier is self.dram:
                digest = await self._receive_to_dram(res.offset, length)
            else:
                digest = await self._receive_to_ssd(res, req.key, length)
            received = True
        finally:
            if not received:  # the peer left mid-payload: nothing was recorded
                self.store.abort(res)
        self._commit_write(req, options, res, digest)
        return True

    def _commit_write(self, req: Request, options: StoredOptions, res: Reservation, digest: int) -> None:
        """The payload is in its extent: commit it (ops.NodeOps.commit_write), reply."""
        self._bytes_in.inc(req.length)
        try:
            self.node.commit_write(res, req, options, digest)
        except KvpoolError as exc:
            self.error(req.op, req.req_id, exc.code, str(exc))
            return
        self.out += _pack_reply(_MAGIC, _VERSION, req.op, req.req_id, _OK, 0, 0, 0)

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
                got = await self.recv_into(target[received:received + HASH_CHUNK])
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
        await self.flush()
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
                    got = await self.recv_mid_frame(chunk[filled:filled + HASH_CHUNK])
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

    def _read(self, req: Request):
        try:
            rec = self.node.readable(req)
        except KvpoolError as exc:
            self.error(req.op, req.req_id, exc.code, str(exc))
            return True
        if rec is None:  # not held here: the shared tier's file answers
            return self.send_shared(req)
        if rec.dram is not None and rec.size <= SMALL_READ:  # a reply buffered whole: no waiting
            self.out += _pack_reply(_MAGIC, _VERSION, req.op, req.req_id, _OK, 0, rec.size, rec.checksum)
            self.node.note_read(rec)
            self.out += self.dram.segment.view(rec.dram, rec.size)
            self._bytes_out.inc(rec.size)
            return True
        return self.send_object(req, rec)

    async def send_shared(self, req: Request) -> bool:
        """Answer a READ (or LOCATE) of a version ops.NodeOps.readable left to the shared tier with its file's
        bytes, over the socket."""
        try:
            obj, payload = await self.node.read_shared(req)
        except KvpoolError as exc:
            self.error(req.op, req.req_id, exc.code, str(exc))
            return True
        self.out += _pack_reply(_MAGIC, _VERSION, req.op, req.req_id, _OK, 0, obj.size, obj.checksum)
        if obj.size <= SMALL_READ:
            self.out += payload
        else:
            out, self.out = self.out, bytearray()
            await self.send_all(out, payload)
        self._bytes_out.inc(obj.size)
        return True

    async def send_object(self, req: Request, rec: ObjectRecord) -> bool:
        self.out += _pack_reply(_MAGIC, _VERSION, req.op, req.req_id, _OK, 0, rec.size, rec.checksum)
        self.node.note_read(rec)
        if rec.dram is not None:
            await self._send_from_dram(rec)
        else:
            await self._send_from_ssd(rec)
        self._bytes_out.inc(rec.size)
        return True

    async def _send_from_dram(self, rec: ObjectRecord) -> None:
        data = self.dram.segment.view(rec.dram, rec.size)
        if rec.size <= SMALL_READ:
            self.out += data  # copied now: the extent may change once we await
            return
        self.store.acquire(rec)
        try:
            # The replies so far and this payload leave in one sendmsg while the socket takes them.
            out, self.out = self.out, bytearray()
            await self.send_all(out, data)
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
            await self.flush()
            await send_file(self.sock, segment.file, position, rec.size, self.frame_timeout)
        finally:
            self.store.release(rec)

    # -- what any authenticated peer may ask

    async def _ping(self, req: Request) -> bool:
        self.reply_body(req.op, req.req_id, self.node.node_id.encode())
        return True

    async def _hello(self, req: Request) -> bool:
        server = self.server
        offers = server.offers
        if self.role is Role.TENANT:  # never a mapping that holds other tenants' bytes
            offers = {name: offer for name, offer in offers.items() if name != transports.SHM}
        if transports.UCX in offers and not server.verifier.open:  # a ticket to prove on UCX's CONNECT
            ticket = server.ucx_tickets.issue(self.caller, self.caller_key)
            offers = {**offers, transports.UCX: {**offers[transports.UCX], "ticket": ticket.hex()}}
        self.reply_json(req.op, req.req_id, {"node_id": server.node_id, "instance": server.instance,
                                             "host_id": transports.host_id(), "transports": offers})
        return True
