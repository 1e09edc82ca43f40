"""The master's control port contract: which wire.Op carries which Master RPC, and its frames.

Both ends use it: master/control_port.py serves it, client/control_link.py calls it.
A frame is wire.REQUEST (no key) or wire.REPLY, then `length` bytes of body; see
the wire.py docstring for what the bodies and reply statuses are.
"""

import json

from ..errors import Code
from ..proto import kvpool_pb2 as pb
from .wire import MAGIC, REPLY, REQUEST, VERSION, Op

MAX_BODY = 64 << 20  # as gRPC's message limit at the master: batches of thousands of keys fit

# Unary RPCs only: a stream (WatchKeys) stays on gRPC.
OP_BY_RPC = {
    "PutStart": Op.PUT_START, "PutEnd": Op.PUT_END, "PutRevoke": Op.PUT_REVOKE,
    "BatchPutStart": Op.BATCH_PUT_START, "BatchPutEnd": Op.BATCH_PUT_END, "BatchPutRevoke": Op.BATCH_PUT_REVOKE,
    "GetReplicaList": Op.GET_REPLICA_LIST, "BatchGetReplicaList": Op.BATCH_GET_REPLICA_LIST,
    "Exists": Op.EXISTS, "BatchExists": Op.BATCH_EXISTS, "Remove": Op.REMOVE,
    "RemoveByPrefix": Op.REMOVE_BY_PREFIX, "Drain": Op.DRAIN, "Stats": Op.STATS,
}
RPC_BY_OP = {int(op): name for name, op in OP_BY_RPC.items()}

_METHODS = pb.DESCRIPTOR.services_by_name["Master"].methods_by_name
# RPC name -> (request class, response class), as the service declares them.
MESSAGES = {name: (getattr(pb, _METHODS[name].input_type.name), getattr(pb, _METHODS[name].output_type.name))
            for name in OP_BY_RPC}

# A request's flags. POSTED: the caller does not wait for this answer (a put's end it posted), so the
# master may hold it back to leave with its next reply on the connection, within HOLD_POSTED seconds,
# instead of waking the caller for it alone.
POSTED = 1
HOLD_POSTED = 0.001

_pack_request = REQUEST.pack
_pack_reply = REPLY.pack


def pack_call(op: int, req_id: int, body: bytes, flags: int = 0) -> bytes:
    """One request frame: header and body."""
    return _pack_request(MAGIC, VERSION, op, req_id, 0, flags, 0, 0, len(body), 0) + body


def pack_answer(op: int, req_id: int, status: int, body: bytes) -> bytes:
    """One reply frame: header and body."""
    return _pack_reply(MAGIC, VERSION, op, req_id, status, 0, len(body), 0) + body


def pack_error(op: int, req_id: int, status: Code, message: str) -> bytes:
    return pack_answer(op, req_id, status, message.encode("utf-8", "replace")[:4096])


def not_leader_body(leader: str, control_address: str) -> bytes:
    return json.dumps({"leader": leader, "control_address": control_address}).encode()


def parse_not_leader(body: bytes) -> tuple[str, str]:
    """(leader's gRPC address, its control address) from a NOT_LEADER body; "" for what it does not name."""
    try:
        named = json.loads(body)
        return str(named.get("leader") or ""), str(named.get("control_address") or "")
    except (ValueError, AttributeError):
        return "", ""
