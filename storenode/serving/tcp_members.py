"""The member-only ops over a TCP data connection: the frames of FREE, HOLD, REPORT, INVENTORY, EVICTIONS
and COPY. Each takes (connection, members, request), `members` being what NodeOps.members handed the
connection once its peer's member role was checked (tcp_session.TcpSession._as_member); each returns
whether the connection stays usable (FREE and HOLD at once; the others, coroutines, once done)."""

from kvpool.protocol import wire
from kvpool.errors import Code, KvpoolError

from kvpool.storenode.serving.ops import MemberOps, Request


def free(conn, members: MemberOps, req: Request) -> bool:
    return _acknowledge(conn, req, members.free)


def hold(conn, members: MemberOps, req: Request) -> bool:
    return _acknowledge(conn, req, members.hold)


def _acknowledge(conn, req: Request, operation) -> bool:
    """operation(req), answered OK or with its typed error."""
    try:
        operation(req)
    except KvpoolError as exc:
        conn.error(req.op, req.req_id, exc.code, str(exc))
    else:
        conn.reply_ok(req.op, req.req_id)
    return True


async def free_shared(conn, members: MemberOps, req: Request) -> bool:
    shared = conn.node.shared
    if shared is None:
        conn.error(req.op, req.req_id, Code.NOT_FOUND, "this node does not mount a shared tier")
    elif await shared.unlink(req.key, req.generation):
        conn.reply_ok(req.op, req.req_id)
    else:
        conn.error(req.op, req.req_id, Code.NOT_FOUND, f"no file of generation {req.generation} of this key")
    return True


async def shared_scan(conn, members: MemberOps, req: Request) -> bool:
    shared = conn.node.shared
    if shared is None:
        conn.error(req.op, req.req_id, Code.NOT_FOUND, "this node does not mount a shared tier")
        return True
    await conn.flush()  # the replies before this one need not wait for the scan
    conn.reply_body(req.op, req.req_id, await shared.scan())
    return True


async def report(conn, members: MemberOps, req: Request) -> bool:
    conn.reply_json(req.op, req.req_id, members.report(req.term))
    return True


async def inventory(conn, members: MemberOps, req: Request) -> bool:
    conn.reply_parts(req.op, req.req_id, members.inventory(req.term))
    return True


async def inventory_changes(conn, members: MemberOps, req: Request) -> bool:
    conn.reply_parts(req.op, req.req_id, members.inventory_changes(req.term, req.generation))
    return True


async def evictions(conn, members: MemberOps, req: Request) -> bool:
    try:
        # The replies before this one must not wait for it.
        evicted = await members.evictions(req.term, before_waiting=conn.flush)
    except KvpoolError as exc:
        conn.error(req.op, req.req_id, exc.code, str(exc))
    else:
        conn.reply_json(req.op, req.req_id, {"evicted": evicted})
    return True


async def copy(conn, members: MemberOps, req: Request) -> bool:
    target = await conn.small_payload(req.op, req.req_id, req.length, wire.MAX_COPY_TARGET, "COPY destination")
    if target is None:
        return False
    await conn.flush()  # the replies before this one need not wait for the copy
    try:
        sent = await members.copy(req, target.decode("utf-8", "replace"))
    except KvpoolError as exc:
        conn.error(req.op, req.req_id, exc.code, str(exc))
        return True
    conn.metrics.bytes_out.inc(sent)
    conn.reply_ok(req.op, req.req_id)
    return True
