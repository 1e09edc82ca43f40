"""The shared-memory ops over a TCP data connection: ATTACH, then LOCATE/RELEASE to read through the node's
DRAM mapping and ALLOCATE/COMMIT to write through it. The connection carries only the small frames; the
client copies the bytes itself. What a client holds meanwhile is leases.SharedMemoryHolds'; what each op
decides (term fence, room, checksum, generation) is ops.NodeOps', as for a WRITE or READ."""

from kvpool.protocol import transports
from kvpool.protocol.checksum import checksum
from kvpool.errors import Code, KvpoolError

from kvpool.storenode.serving.shm_holds import SharedMemoryHolds
from kvpool.storenode.serving.ops import Request


class SharedMemoryRequests:
    """conn: the tcp_session.TcpSession these requests arrive on."""

    def __init__(self, conn):
        self.conn = conn
        self.node = conn.node
        self.holds: SharedMemoryHolds | None = None  # made by a successful ATTACH

    def give_back(self) -> None:
        """The connection ended: what its client held through the mapping is the node's again."""
        if self.holds is not None:
            self.holds.give_back()

    async def attach(self, req: Request) -> bool:
        """The connection proved its credential already; the segment file's mode does the rest."""
        conn = self.conn
        if await conn.small_payload(req.op, req.req_id, req.length, 0, "ATTACH payload") is None:
            return False
        server = conn.server
        if transports.SHM not in server.offers:
            conn.error(req.op, req.req_id, Code.FORBIDDEN, "this node does not offer shared memory")
            return True
        if self.holds is None:
            self.holds = SharedMemoryHolds(conn.store, conn.metrics, conn.frame_timeout)
        segment = conn.dram.segment
        conn.reply_json(req.op, req.req_id, {"path": segment.path, "size": segment.capacity,
                                             "instance": server.instance})
        return True

    def _attached(self, req: Request) -> SharedMemoryHolds | None:
        if self.holds is None:
            self.conn.error(req.op, req.req_id, Code.FORBIDDEN, f"{req.name} before a successful ATTACH")
        return self.holds

    async def locate(self, req: Request) -> bool:
        holds = self._attached(req)
        if holds is None:
            return True
        conn = self.conn
        try:
            rec = self.node.readable(req)
        except KvpoolError as exc:
            conn.error(req.op, req.req_id, exc.code, str(exc))
            return True
        if rec is None:  # not held here: the shared tier's file answers, over the socket (as for a READ)
            return await conn.send_shared(req)
        if rec.dram is None:  # on SSD only: the bytes come over the socket, as for a READ
            await conn.send_object(req, rec)
            return True
        holds.locate(rec)  # neither freed nor moved while the client copies
        self.node.note_read(rec)
        conn.metrics.bytes_out.inc(rec.size)
        conn.reply_location(req.op, req.req_id, rec.dram, rec.checksum)
        return True

    async def allocate(self, req: Request) -> bool:
        conn = self.conn
        options = await conn.take_options()
        holds = self._attached(req)
        if holds is None:
            return True
        if holds.is_allocated(req.key, req.generation):
            conn.error(req.op, req.req_id, Code.INVALID_ARGUMENT, "ALLOCATE of an already allocated object")
            return True
        try:
            res = self.node.admit_write(req, options, conn.role, dram_only=True)
        except KvpoolError as exc:
            conn.error(req.op, req.req_id, exc.code, str(exc))
            return True
        # Until COMMIT, for --frame-timeout at most: a client that never commits holds no room for long.
        holds.allocate(res, req, options)
        conn.reply_location(req.op, req.req_id, res.offset, req.checksum)
        return True

    async def commit(self, req: Request) -> bool:
        conn = self.conn
        pending = self.holds.take_allocation(req.key, req.generation) if self.holds is not None else None
        if pending is None:
            conn.error(req.op, req.req_id, Code.NOT_FOUND, f"no ALLOCATEd generation {req.generation} of this key")
            return True
        res, allocated = pending.reservation, pending.request
        # The client wrote these bytes itself: check them as a received WRITE is checked.
        try:
            self.node.commit_write(res, allocated, pending.options,
                                   checksum(conn.dram.segment.view(res.offset, allocated.length)))
        except KvpoolError as exc:
            conn.error(req.op, req.req_id, exc.code, str(exc))
            return True
        conn.metrics.bytes_in.inc(allocated.length)
        conn.reply_ok(req.op, req.req_id)
        return True

    async def release(self, req: Request) -> bool:
        """Not answered; releasing what is not held is a no-op."""
        if self.holds is not None:
            self.holds.release(req.key, req.generation)
        return True
