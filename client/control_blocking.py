"""The master's control port for the blocking Client: one call at a time on a plain socket.

The blocking Client runs its event loop only inside a caller's call, and one
caller at a time. Waiting for a control answer through that loop costs several
turns of it per call (a task, the selector, a future's callbacks), which is
most of a round trip's price on this path. Here the call instead sends its
frame and waits on the socket itself, with the call's deadline as the socket
timeout. Calls that share a turn of the loop (a gather) simply take turns.

Same frames, same answers and the same NotSent contract as control_link.py.
A reply left over from a call that gave up is skipped by its req_id; a call
that runs out of time closes the connection (the next one opens a new one).

A posted call (post) sends its frame and returns; its answer is read by
whichever call or drain comes next on the connection and handed to the
poster's callback (an error if the connection ends first).
"""

import socket
import time

from kvpool.protocol import control
from kvpool.security.auth import handshake_blocking
from kvpool.protocol.cluster_layout import parse_hostport
from kvpool.errors import ProtocolError, UnavailableError
from kvpool.net.netutil import connect_failure
from kvpool.protocol.wire import MAGIC, REPLY, VERSION

from .control_answer import NotSent, answer

_REPLY_SIZE = REPLY.size
_unpack_reply = REPLY.unpack_from
_TCP_INFO = getattr(socket, "TCP_INFO", None)  # Linux: its first byte is the connection's TCP state
_ESTABLISHED = 1


class BlockingControlConnection:
    def __init__(self, address: str, sock: socket.socket):
        self.address = address
        self.closed = False
        self._sock = sock
        self._next_id = 0
        self._header = bytearray(_REPLY_SIZE)
        self._posted: dict = {}  # req_id -> (method, callback) of posted calls not answered yet

    @classmethod
    def open(cls, address: str, timeout: float, credential=None, tls=None) -> "BlockingControlConnection":
        try:
            host, port = parse_hostport(address)
        except ValueError as exc:
            raise UnavailableError(f"bad master control address {address!r}: {exc}") from None
        sock = None
        try:
            sock = socket.create_connection((host, port), timeout=max(timeout, 0.001))
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if tls is not None:
                sock = tls.client_context().wrap_socket(sock, server_hostname=host)
            handshake_blocking(sock, credential, f"master control port {address}")
        except BaseException as exc:
            if sock is not None:
                sock.close()
            failure = connect_failure(exc, f"master control port {address}", NotSent)
            if failure is None:
                raise
            raise failure from None
        return cls(address, sock)

    def call(self, method: str, request, deadline: float):
        """The response of Master.<method>, answered by `deadline` (time.monotonic); raises as
        ControlConnection.call does."""
        req_id = self._send(method, request, deadline)
        return self._read_until(lambda: req_id, method, deadline)

    def post(self, method: str, request, deadline: float, callback) -> None:
        """Send Master.<method> and return; callback(response or error) runs when a later call or
        drain() reads its answer, or the connection ends. Raises NotSent if the frame did not leave."""
        req_id = self._send(method, request, deadline)
        self._posted[req_id] = (method, callback)

    def drain(self, deadline: float) -> None:
        """Read the answers of every posted call (each to its callback)."""
        if self._posted:
            self._read_until(lambda: next(iter(self._posted), None), "posted calls", deadline)

    def _send(self, method: str, request, deadline: float) -> int:
        if self.closed or self._peer_left():
            self.close()
            raise NotSent(f"master control port {self.address}: connection closed")
        req_id = self._next_id = (self._next_id + 1) & 0xFFFFFFFF
        frame = control.pack_call(control.OP_BY_RPC[method], req_id, request.SerializeToString())
        sock = self._sock
        try:
            sock.settimeout(max(deadline - time.monotonic(), 0.001))
            sock.sendall(frame)
        except OSError as exc:  # a frame cut short is never served
            self.close()
            raise NotSent(f"master control port {self.address}: send failed: {exc}") from None
        return req_id

    def _read_until(self, wanted, method: str, deadline: float):
        """Read replies, handing posted calls' to their callbacks, up to the one `wanted()` names
        (None: nothing more is wanted); returns that call's answer."""
        try:
            while (req_id := wanted()) is not None:
                status, got, body = self._reply(deadline)
                posted = self._posted.pop(got, None)
                if posted is not None:
                    _settle(posted[1], self.address, posted[0], status, body)
                if got == req_id and posted is None:
                    return answer(self.address, method, status, body)
        except TimeoutError:
            self.close("no answer in time")
            raise UnavailableError(f"master {self.address} {method}: no answer in time") from None
        except (OSError, EOFError) as exc:
            self.close(f"connection lost: {exc}")
            raise UnavailableError(f"master control port {self.address}: connection lost: {exc}") from None
        return None

    def _reply(self, deadline: float) -> tuple[int, int, bytes]:
        header = self._header
        self._recv_into(memoryview(header), deadline)
        magic, version, _op, req_id, status, _flags, length, _sum = _unpack_reply(header)
        if magic != MAGIC or version != VERSION:
            self.close()
            raise ProtocolError(f"master {self.address}: bad reply frame (magic {bytes(magic)!r}, version {version})")
        body = bytearray(length)
        if length:
            self._recv_into(memoryview(body), deadline)
        return status, req_id, body

    def _recv_into(self, view: memoryview, deadline: float) -> None:
        sock, got, size = self._sock, 0, len(view)
        while got < size:
            sock.settimeout(max(deadline - time.monotonic(), 0.001))
            more = sock.recv_into(view[got:])
            if not more:
                raise EOFError("closed by the master")
            got += more

    def _peer_left(self) -> bool:
        """Whether the master closed this connection since the last call."""
        if _TCP_INFO is None:
            return False
        try:
            return self._sock.getsockopt(socket.IPPROTO_TCP, _TCP_INFO, 1)[0] != _ESTABLISHED
        except OSError:
            return True

    def close(self, reason: str = "closed") -> None:
        if not self.closed:
            self.closed = True
            self._sock.close()
        posted, self._posted = self._posted, {}
        for method, callback in posted.values():
            callback(UnavailableError(f"master control port {self.address}: {reason} before {method} was answered"))


def _settle(callback, address: str, method: str, status: int, body) -> None:
    try:
        result = answer(address, method, status, body)
    except Exception as exc:  # noqa: BLE001 - the poster's to handle
        result = exc
    callback(result)
