"""One client's session on the node's UCX endpoint (ucx_server.py): WRITE and READ of the data protocol.

What each request does is storenode/serving/ops.py's, as over TCP: the caller's check (its tenant token
current, its keys), a WRITE's admission, commit and term fence, a READ's record or the shared tier's file;
a member-only op is refused FORBIDDEN to a client (and served to nobody over UCX). Here only the bytes
move: a WRITE payload is received straight into its DRAM extent (an SSD one into a buffer, then pwritten),
then committed; a READ value leaves straight from the DRAM mapping (an SSD one through a buffer), the
record held until UCX is done with it. A session's requests are handled one after the other in arrival
order; a READ's value may still be on its way while the next request runs.

A WRITE payload is received only once a probe shows it has arrived, so a client that never sends it leaves
no receive posted into an extent (UCX cannot cancel one that a transfer has begun to fill). UCX does not
notice a dead client (error handling is off so that shared memory can be used), so every UCX request a
session has in flight carries a deadline (its server drops a session with one overdue). An extent or record
that a transfer uses is given back only once UCX has let go of it (if the client died in the middle, that
is never: the extent is lost until a restart, rather than reused under a transfer that might still write
into it).
"""

import asyncio
import logging
import time

from kvpool.protocol import wire
from kvpool.net import ucx_common as layout
from kvpool.security.auth import Caller
from kvpool.protocol.checksum import checksum
from kvpool.errors import Code, KvpoolError
from kvpool.protocol.keys import MAX_KEY_BYTES
from kvpool.net.ucx_common import Op

from kvpool.storenode.serving.ops import OP_NAMES, Request, StoredOptions
from kvpool.storenode.storage.store import Reservation

log = logging.getLogger(__name__)

TIMEOUT = 30.0  # seconds any one request may take, on top of its bytes at MIN_RATE
MIN_RATE = 50e6  # bytes/s
_HEADER = wire.REQUEST.size
_OPTIONS = wire.WRITE_OPTIONS.size
_new_record = tuple.__new__  # a NamedTuple from a tuple, without the Python-level constructor


class UcxSession:
    """One client: its endpoint, and a task serving its requests in order. owner: the node's UcxServer
    (ucx_server.py), which takes the messages off the worker and hands this session its requests."""

    def __init__(self, owner, conn: int, endpoint, caller: Caller):
        self.owner = owner
        self.conn = conn
        self.endpoint = endpoint
        self.caller = caller  # what its CONNECT proved (the TCP connection its ticket was handed on)
        self.role = caller.role
        self.node = owner.node
        self.store = owner.store
        self.dram = owner.store.dram
        self.metrics = owner.metrics
        self.ucx = owner.ucx
        self.progress = owner.progress
        self.loop = asyncio.get_running_loop()
        self.deadlines: dict = {}  # Op in flight, or tag of an awaited message -> deadline (monotonic)
        self.expecting: set[int] = set()  # tags this connection registered in owner.expected
        self.on_close: list = []  # callables run when the connection closes
        self.queue: asyncio.Queue = asyncio.Queue()
        self.last_used = time.monotonic()
        self.closed = False
        self.task = asyncio.create_task(self._serve(), name=f"ucx-connection {conn}")

    def close(self, reason: str) -> None:
        if self.closed:
            return
        self.closed = True
        log.debug("UCX connection %d closed: %s", self.conn, reason)
        if self.owner.connections.get(self.conn) is self:
            del self.owner.connections[self.conn]
        self.metrics.connections.dec()
        for tag in self.expecting:
            self.owner.expected.pop(tag, None)
        self.expecting.clear()
        self.owner.close_quietly(self.endpoint)
        self.task.cancel()
        callbacks, self.on_close = self.on_close, []
        for callback in callbacks:
            callback()
        if self.deadlines:
            log.info("UCX connection %d closed with %d transfers under way; what they use is given back "
                     "when they end", self.conn, len(self.deadlines))
        self._discard_leftovers()
        self.progress.kick()

    def _discard_leftovers(self) -> None:
        """Messages this client sent that nobody will take now (e.g. payloads of requests never served)."""
        ucx, worker = self.ucx, self.owner.worker
        mask = ucx.TagMask(layout.KIND_MASK | layout.CONN_MASK)
        for kind in (layout.REQUEST, layout.PAYLOAD):
            tag = ucx.Tag(layout.tag_of(kind, self.conn << layout.CONN_SHIFT))
            while True:
                probe = worker.tag_probe(tag, mask, remove=True)
                if not probe.matched:
                    break
                self.owner.discard(probe)

    # -- UCX requests of this connection, each bounded by a deadline

    def _follow(self, request, buffer, size: int, future: bool = True) -> Op:
        op = self.progress.track(request, buffer, future)
        if not op.finished:
            self.deadlines[op] = time.monotonic() + TIMEOUT + size / MIN_RATE
            op.after(self._done)
        return op

    def _done(self, key) -> None:
        self.deadlines.pop(key, None)
        if isinstance(key, Op) and len(self.on_close) > 64:
            self.on_close = [c for c in self.on_close if not c.done]

    def expect(self, tag: int, handler, size: int) -> None:
        """Call handler(probe) when the message tagged `tag` arrives (not if the connection closes first)."""
        def arrived(probe):
            self.expecting.discard(tag)
            self._done(tag)
            handler(probe)

        self.owner.expected[tag] = arrived
        self.expecting.add(tag)
        self.deadlines[tag] = time.monotonic() + TIMEOUT + size / MIN_RATE
        self.progress.kick()  # it may be waiting in UCX already

    def send(self, tag: int, data, size: int) -> Op:
        return self._follow(self.endpoint.tag_send(self.ucx.Array(data), self.ucx.Tag(tag)), data, size, False)

    def _reply(self, low: int, frame: bytes) -> None:
        self.send(layout.tag_of(layout.REPLY, low), frame, 0)

    def _error(self, op: int, req_id: int, low: int, code: Code, message: str) -> None:
        self.metrics.error(OP_NAMES.get(op, "unknown"), code.name)
        self._reply(low, wire.pack_error(op, req_id, code, message))

    def _refuse(self, op: int, req_id: int, low: int, code: Code, message: str, length: int) -> None:
        """Answer a WRITE we will not take, and swallow its payload so the client's send completes."""
        self._error(op, req_id, low, code, message)
        if length:
            self.expect(layout.tag_of(layout.PAYLOAD, low), self.owner.discard, 0)

    # -- serving

    async def _serve(self) -> None:
        try:
            while True:
                item = await self.queue.get()
                if item is None:  # BYE
                    self.close("client left")
                    return
                op, frame, low = item
                try:
                    await op.future
                except Exception as exc:
                    log.debug("UCX request frame lost: %s", exc)
                    continue
                if not await self._handle(frame, low):
                    self.close("malformed request")
                    return
        except asyncio.CancelledError:
            pass
        except Exception:  # a bug must cost one connection, not the node
            log.exception("UCX connection failed")
            self.close("internal error")

    async def _handle(self, frame: bytearray, low: int) -> bool:
        """Serve one request; False if its frame is garbage (the connection cannot be trusted)."""
        if len(frame) < _HEADER:
            return False
        magic, version, op, req_id, key_len, flags, generation, arg, length, value_checksum = \
            wire.REQUEST.unpack_from(frame)
        if magic == wire.MAGIC and version != wire.VERSION:
            log.warning("closing a UCX connection: %s", wire.version_mismatch("its peer", version))
            return False
        if magic != wire.MAGIC or key_len > MAX_KEY_BYTES \
                or len(frame) < _HEADER + key_len + (_OPTIONS if op == wire.Op.WRITE else 0):
            log.warning("closing a UCX connection: malformed request frame")
            return False
        req = _new_record(Request, (op, req_id, bytes(frame[_HEADER:_HEADER + key_len]), generation, flags, arg,
                                    length, value_checksum))
        began = time.perf_counter()
        # Its tenant token still current (a UCX connection closed here is not seen by its peer: a lapsed
        # token's requests are refused instead), the keys it names its own.
        refused = self.node.refusal(self.caller, op, req.key)
        if refused is not None:
            if op == wire.Op.WRITE:
                self._refuse(op, req_id, low, refused.code, str(refused), length)
            else:
                self._error(op, req_id, low, refused.code, str(refused))
            return True
        if op == wire.Op.WRITE:
            options = _new_record(StoredOptions, wire.WRITE_OPTIONS.unpack_from(frame, _HEADER + key_len))
            await self._write(req, low, options)
        elif op == wire.Op.READ:
            await self._read(req, low)
        else:
            try:
                if self.node.member_only(op):  # refused as over TCP, before saying UCX does not serve it
                    self.node.members(self.role, op)
            except KvpoolError as exc:
                self._error(op, req_id, low, exc.code, str(exc))
                return True
            self._error(op, req_id, low, Code.PROTOCOL,
                        f"op {OP_NAMES.get(op, op)} is not served over UCX; use the node's TCP connection")
            return True
        self.metrics.per_op(OP_NAMES[op]).record(time.perf_counter() - began)
        return True

    async def _write(self, req: Request, low: int, options: StoredOptions) -> None:
        op, req_id, length = req.op, req.req_id, req.length
        node = self.node
        try:
            res = node.admit_write(req, options, self.role)
        except KvpoolError as exc:  # (an empty WRITE has no payload message to swallow)
            self._refuse(op, req_id, low, exc.code, str(exc), length)
            return
        in_dram = res.tier is self.dram
        target = self.dram.segment.view(res.offset, length) if in_dram else bytearray(length)
        came = self.loop.create_future()
        self.expect(layout.tag_of(layout.PAYLOAD, low), came.set_result, length)
        try:
            probe = await came
        except BaseException:  # the connection closed first: no transfer ever touched the extent
            self.store.abort(res)
            raise
        if probe.length != length:
            self.owner.discard(probe)
            self.store.abort(res)
            self._error(op, req_id, low, Code.INVALID_ARGUMENT, f"payload of {probe.length} bytes, not {length}")
            return
        arrival = self._follow(self.owner.worker.tag_recv_with_handle(self.ucx.Array(target), probe), target, length)
        try:
            await arrival.future
        except asyncio.CancelledError:
            arrival.after(lambda _: self.store.abort(res))  # not before UCX has let go of the extent
            raise
        except Exception as exc:  # e.g. a payload longer than announced
            arrival.after(lambda _: self.store.abort(res))
            self._error(op, req_id, low, Code.INVALID_ARGUMENT, f"payload not received: {exc}")
            return
        self.metrics.bytes_in.inc(length)
        digest = checksum(target)
        if not in_dram and not await self._write_to_ssd(req, low, res, target):
            return
        try:
            node.commit_write(res, req, options, digest)
        except KvpoolError as exc:
            self._error(op, req_id, low, exc.code, str(exc))
            return
        self._reply(low, wire.pack_reply(op, req_id, Code.OK))

    async def _write_to_ssd(self, req: Request, low: int, res: Reservation, payload: bytearray) -> bool:
        """A received SSD WRITE's key and payload into its extent, by a thread (its header, which makes it an
        object, is commit_write's); False after replying why not."""
        writing = self.loop.run_in_executor(None, res.tier.segment.write_body, res.offset, req.key, payload)
        try:
            await asyncio.shield(writing)
        except asyncio.CancelledError:
            # No thread may still write into the extent once it is given back.
            writing.add_done_callback(lambda _: self.store.abort(res))
            raise
        except OSError as exc:
            self.store.abort(res)
            self._error(req.op, req.req_id, low, Code.INTERNAL, f"SSD write failed: {exc}")
            return False
        return True

    async def _read(self, req: Request, low: int) -> None:
        store = self.store
        try:
            rec = self.node.readable(req)
            if rec is None:  # not held here: the shared tier's file answers
                obj, data = await self.node.read_shared(req)
        except KvpoolError as exc:
            self._error(req.op, req.req_id, low, exc.code, str(exc))
            return
        if rec is None:
            self._reply(low, wire.pack_reply(req.op, req.req_id, Code.OK, obj.size, obj.checksum))
            self.send(layout.tag_of(layout.DATA, low), data, obj.size)
            self.metrics.bytes_out.inc(obj.size)
            return
        store.acquire(rec)  # the extent stays put until UCX has sent it
        from_dram = rec.dram is not None
        try:
            self.node.note_read(rec)
            if from_dram:
                data = self.dram.segment.view(rec.dram, rec.size)
            else:
                segment = store.ssd.segment
                data = bytearray(rec.size)
                await self.loop.run_in_executor(None, segment.pread_into, data,
                                                segment.payload_offset(rec.ssd, len(rec.key)))
        except OSError as exc:
            store.release(rec)
            self._error(req.op, req.req_id, low, Code.INTERNAL, f"SSD read failed: {exc}")
            return
        except BaseException:
            store.release(rec)
            raise
        self._reply(low, wire.pack_reply(req.op, req.req_id, Code.OK, rec.size, rec.checksum))
        sent = self.send(layout.tag_of(layout.DATA, low), data, rec.size)
        if from_dram:
            release = _Once(store.release, rec)
            sent.after(release)
            # A send only reads the extent: if its client is gone, the record need not wait for UCX
            # (bytes read after reuse would reach nobody, or fail the reader's checksum).
            self.on_close.append(release)
        else:
            store.release(rec)  # an SSD value was copied out already
        self.metrics.bytes_out.inc(rec.size)


class _Once:
    """fn(arg) on the first call only."""

    __slots__ = ("fn", "arg", "done")

    def __init__(self, fn, arg):
        self.fn, self.arg, self.done = fn, arg, False

    def __call__(self, *_ignored) -> None:
        if not self.done:
            self.done = True
            self.fn(self.arg)
