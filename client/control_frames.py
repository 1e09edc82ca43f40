"""The client's side of one control-port connection, without I/O (frames: kvpool/protocol/control.py).

Both ways of talking to the master's control port, the asyncio connection
(control_link.py) and the blocking socket (control_blocking.py), write the
frames `ControlCalls.start` packs and feed what they read to `received`, which
splits it into replies, matches each to its call by req_id (replies may
overtake each other; one whose call gave up is skipped) and says what it means:
the response, or the typed error it stands for. A call on a connection found
closed never leaves: NotSent, which the caller may safely send again elsewhere.
"""

from kvpool.protocol import control
from kvpool.errors import Code, NotLeaderError, ProtocolError, UnavailableError, error_for
from kvpool.protocol.wire import MAGIC, REPLY, VERSION

_OK, _NOT_LEADER = int(Code.OK), int(Code.NOT_LEADER)
_REPLY_SIZE = REPLY.size
_unpack_reply = REPLY.unpack_from
_pack_call = control.pack_call
_OPS = control.OP_BY_RPC


class LeaderHint(NotLeaderError):
    """A master answered NOT_LEADER; it names the `leader` (gRPC) and its `control_address`
    ("" for what it does not know)."""

    def __init__(self, message: str, leader: str, control_address: str):
        super().__init__(message)
        self.leader = leader
        self.control_address = control_address


class NotSent(UnavailableError):
    """The call never reached the master: no connection, or one found closed before the frame left."""


def answer(address: str, method: str, status: int, body):
    """The response a reply frame carries, or raise the error it stands for."""
    if status == _OK:
        try:
            return control.MESSAGES[method][1].FromString(bytes(body))
        except Exception as exc:  # noqa: BLE001 - a garbled answer fails that call only
            raise ProtocolError(f"master {address} {method}: bad answer: {exc}") from None
    if status == _NOT_LEADER:
        leader, control_address = control.parse_not_leader(bytes(body))
        raise LeaderHint(f"master {address} {method}: not leader", leader, control_address)
    message = bytes(body).decode("utf-8", "replace")
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
        flags: control.POSTED for a call whose caller does not wait for the answer."""
        if self.closed:
            raise NotSent(f"master control port {self.address}: connection closed")
        req_id = self._next_id = (self._next_id + 1) & 0xFFFFFFFF
        frame = _pack_call(_OPS[method], req_id, request.SerializeToString(), flags)
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
