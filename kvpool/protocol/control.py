"""The master's control port contract: which wire.Op carries which Master RPC, its frames, and what a reply means.

Both ends use it: master/serving/control_port.py serves it; the client's connections to
it, over asyncio (client/control_link.py) and blocking (client/control_blocking.py),
write the frames `ControlCalls.start` packs and feed what they read to
`received`, which splits it into replies, matches each to its call by req_id
(replies may overtake each other; one whose call gave up is skipped) and says
what it means: the response, or the typed error it stands for. A call on a
connection found closed never leaves: NotSent, which the caller may safely send
again elsewhere. A reply whose frame status is UNAVAILABLE comes from a master
that cannot serve because etcd is silent to it (no leader can be confirmed):
ClusterUnavailableError, raised at once rather than waited out. No I/O here.
A frame is wire.REQUEST (no key) or wire.REPLY, then `length` bytes of body; see
the wire.py docstring for what the bodies and reply statuses are.
"""

import json

from ..errors import ClusterUnavailableError, Code, NotLeaderError, ProtocolError, UnavailableError, error_for
from ..proto import kvpool_pb2 as pb
from .wire import MAGIC, REPLY, REQUEST, VERSION, Op, version_mismatch

MAX_BODY = 64 << 20  # as gRPC's message limit at the master: batches of thousands of keys fit

# Unary RPCs only: a stream (WatchKeys) stays on gRPC.
OP_BY_RPC = {
    "PutStart": Op.PUT_START, "PutEnd": Op.PUT_END, "PutRevoke": Op.PUT_REVOKE,
    "BatchPutStart": Op.BATCH_PUT_START, "BatchPutEnd": Op.BATCH_PUT_END, "BatchPutRevoke": Op.BATCH_PUT_REVOKE,
    "GetReplicaList": Op.GET_REPLICA_LIST, "BatchGetReplicaList": Op.BATCH_GET_REPLICA_LIST,
    "Exists": Op.EXISTS, "BatchExists": Op.BATCH_EXISTS, "Remove": Op.REMOVE,
    "RemoveByPrefix": Op.REMOVE_BY_PREFIX, "Drain": Op.DRAIN, "Stats": Op.STATS, "ListKeys": Op.LIST_KEYS,
    "Tenants": Op.TENANTS,
}

# A lookup (BatchExists without a hold) in its lean frame, Op.LOOKUP: no protobuf on either side.
LOOKUP = "Lookup"
OP_BY_METHOD = {**OP_BY_RPC, LOOKUP: Op.LOOKUP}

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


def pack_keys(keys: list[str]) -> bytes:
    """A LOOKUP's body: the keys (valid, so without NUL) in UTF-8, joined by NUL."""
    return "\0".join(keys).encode()


def parse_keys(body: bytes) -> list[str]:
    """The keys of a LOOKUP's body; ValueError if it is not UTF-8."""
    return body.decode().split("\0") if body else []


def found_body(found: list[bool]) -> bytes:
    """A LOOKUP's answer: one byte per key, 1 where it exists."""
    return bytes(found)


def parse_found(body: bytes) -> list[bool]:
    """The answer of a LOOKUP, a bool per key; ValueError for a byte other than 0 or 1."""
    if body.translate(None, b"\0\1"):
        raise ValueError("a lookup answer holds bytes other than 0 and 1")
    return list(map(bool, body))


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


# -- a caller's side: its calls in flight on one connection, and what each reply means

_OK, _NOT_LEADER, _UNAVAILABLE = int(Code.OK), int(Code.NOT_LEADER), int(Code.UNAVAILABLE)
_REPLY_SIZE = REPLY.size
_unpack_reply = REPLY.unpack_from


class LeaderHint(NotLeaderError):
    """A master answered NOT_LEADER; it names the `leader` (gRPC) and its `control_address`
    ("" for what it does not know)."""

    def __init__(self, message: str, leader: str, control_address: str):
        super().__init__(message)
        self.leader = leader
        self.control_address = control_address


class NotSent(UnavailableError):
    """The call never reached the master: no connection, or one found closed before the frame left."""


# method -> what reads the body of its OK reply
_ANSWER = {name: response.FromString for name, (_request, response) in MESSAGES.items()} | {LOOKUP: parse_found}


def answer(address: str, method: str, status: int, body):
    """The response a reply frame carries, or raise the error it stands for."""
    if status == _OK:
        try:
            return _ANSWER[method](bytes(body))
        except Exception as exc:  # noqa: BLE001 - a garbled answer fails that call only
            raise ProtocolError(f"master {address} {method}: bad answer: {exc}") from None
    if status == _NOT_LEADER:
        leader, control_address = parse_not_leader(bytes(body))
        raise LeaderHint(f"master {address} {method}: not leader", leader, control_address)
    message = bytes(body).decode("utf-8", "replace")
    if status == _UNAVAILABLE:
        raise ClusterUnavailableError(f"master {address} {method}: {message}")
    raise error_for(status, f"master {address} {method}: {message}")


def outcome(address: str, method: str, status: int, body):
    """answer(), with the error returned instead of raised (each reply settles its own caller)."""
    try:
        return answer(address, method, status, body)
    except Exception as exc:  # noqa: BLE001 - handed to the call it answers
        return exc


class ControlCalls:
    """The calls in flight on one connection: req_id -> (method, waiter), where the waiter is
    whatever the I/O side settles (a future, a callback). `closed` once the connection ended."""

    def __init__(self, address: str):
        self.address = address
        self.closed = False
        self.waiting: dict[int, tuple[str, object]] = {}
        self._next_id = 0
        self._rest = bytearray()  # the start of a reply not whole yet

    def start(self, method: str, request, waiter, flags: int = 0) -> tuple[int, bytes]:
        """(req_id, frame) of a new call; raises NotSent when the connection already ended.
        request: the protobuf request of an RPC, the body (bytes) of a LOOKUP.
        flags: POSTED for a call whose caller does not wait for the answer."""
        if self.closed:
            raise NotSent(f"master control port {self.address}: connection closed")
        req_id = self._next_id = (self._next_id + 1) & 0xFFFFFFFF
        body = request if type(request) is bytes else request.SerializeToString()
        frame = pack_call(OP_BY_METHOD[method], req_id, body, flags)
        self.waiting[req_id] = (method, waiter)
        return req_id, frame

    def forget(self, req_id: int):
        """Stop waiting for req_id (it timed out or was cancelled): (method, waiter) or None."""
        return self.waiting.pop(req_id, None)

    def frames(self, data) -> list[tuple[bytes, int, int, bytes]]:
        """Whole reply frames in what was read so far: (header, req_id, status, body) each.
        Raises ProtocolError for a frame that is not a reply of this protocol."""
        if self._rest:  # the rest of a reply that began in an earlier read
            self._rest += data
            data = self._rest
        size, start, found = len(data), 0, []
        while size - start >= _REPLY_SIZE:
            magic, version, _op, req_id, status, _flags, length, _sum = _unpack_reply(data, start)
            if magic != MAGIC or version != VERSION:
                if magic == MAGIC:
                    raise version_mismatch(f"master {self.address}", version)
                raise ProtocolError(f"master {self.address}: bad reply frame (magic {bytes(magic)!r}, "
                                    f"version {version})")
            end = start + _REPLY_SIZE + length
            if size < end:
                break
            found.append((data[start:start + _REPLY_SIZE], req_id, status, data[start + _REPLY_SIZE:end]))
            start = end
        if start == size:
            if self._rest:
                self._rest = bytearray()
        elif start or data is not self._rest:  # keep what a reply not whole yet has so far
            self._rest = bytearray(data[start:])
        return found

    def settle(self, req_id: int, status: int, body) -> tuple[object, object] | None:
        """(waiter, response or error) of the call a reply answers; None if no call waits for it."""
        entry = self.waiting.pop(req_id, None)
        if entry is None:
            return None
        method, waiter = entry
        return waiter, outcome(self.address, method, status, body)

    def received(self, data) -> list[tuple[object, object]]:
        """(waiter, response or error) of every call the replies in `data` answer."""
        settled = []
        for _header, req_id, status, body in self.frames(data):
            done = self.settle(req_id, status, body)
            if done is not None:
                settled.append(done)
        return settled

    def end(self, reason: str) -> list[tuple[object, UnavailableError]]:
        """The connection ended: every waiting call with the error it ends with."""
        self.closed = True
        waiting, self.waiting = self.waiting, {}
        return [(waiter, UnavailableError(f"master control port {self.address}: {reason}"))
                for _method, waiter in waiting.values()]
