"""The master's control port for the blocking Client: calls answered on a plain socket, no event loop.

The blocking Client runs its event loop only inside a caller's call, and one
caller at a time. Waiting for a control answer through that loop costs several
turns of it per call (a task, the selector, a future's callbacks), more than
the round trip itself. Here a call sends its frame and reads the socket itself,
by the call's deadline: a plain socket stays non-blocking, so a call costs a
send, a poll and a recv (kvpool/sockets/socket_blocking.py; a socket timeout
would add a poll before the send and a mode switch before each step), a TLS
socket waits with the deadline as its timeout; frames, replies and the NotSent
contract are kvpool/protocol/control.py's, as for the asyncio connection. Calls that
share a turn of the loop (a gather) simply take turns. A call that runs out of
time closes the connection (the next one opens a new one).

A posted call (post) sends its frame and returns; its answer is read by
whichever call or drain comes next on the connection and handed to the
poster's callback (an error if the connection ends first).
"""

import socket
import ssl
import time

from kvpool.security.auth import handshake_blocking
from kvpool.protocol import control
from kvpool.protocol.cluster_layout import parse_hostport
from kvpool.errors import UnavailableError
from kvpool.net.netutil import ConnectAttempt, long_lived
from kvpool.protocol.control import ControlCalls, NotSent
from kvpool.sockets.socket_blocking import BlockingSocket

_READ_SIZE = 64 * 1024
_TCP_INFO = getattr(socket, "TCP_INFO", None)  # Linux: its first byte is the connection's TCP state
_ESTABLISHED = 1
_WAITED = object()  # the waiter of the call being waited for (posted calls have their callback)


class BlockingControlConnection:
    def __init__(self, address: str, sock: socket.socket):
        self.address = address
        self._sock = sock
        self._calls = ControlCalls(address)
        self._answer = None  # the waited call's response or error, once read
        self._buffer = memoryview(bytearray(_READ_SIZE))  # what each recv brings
        # A plain socket: non-blocking, waited on by poll() until each call's deadline (None: TLS,
        # whose decrypted bytes poll() cannot see, waits with a socket timeout instead).
        self._plain = None
        if not isinstance(sock, ssl.SSLSocket):
            sock.setblocking(False)
            self._plain = BlockingSocket(sock, 0.0)

    @property
    def closed(self) -> bool:
        return self._calls.closed

    @classmethod
    def open(cls, address: str, timeout: float, credential=None, tls=None) -> "BlockingControlConnection":
        try:
            host, port = parse_hostport(address)
        except ValueError as exc:
            raise UnavailableError(f"bad master control address {address!r}: {exc}") from None
        with ConnectAttempt(f"master control port {address}", NotSent) as attempt:
            sock = attempt.sock = socket.create_connection((host, port), timeout=max(timeout, 0.001))
            long_lived(sock)
            if tls is not None:
                sock = attempt.sock = tls.client_context().wrap_socket(sock, server_hostname=host)
            handshake_blocking(sock, credential, f"master control port {address}")
        return cls(address, sock)

    def call(self, method: str, request, deadline: float):
        """The response of Master.<method>, answered by `deadline` (time.monotonic); raises LeaderHint,
        UnavailableError (NotSent if the frame never left), or the typed error of a refused frame."""
        req_id = self._send(method, request, _WAITED, deadline)
        self._read_until(lambda: req_id if req_id in self._calls.waiting else None, method, deadline)
        result, self._answer = self._answer, None
        if isinstance(result, BaseException):
            raise result
        return result

    def post(self, method: str, request, deadline: float, callback) -> None:
        """Send Master.<method> and return; callback(response or error) runs when a later call or
        drain() reads its answer, or the connection ends. Raises NotSent if the frame did not leave."""
        self._send(method, request, callback, deadline, control.POSTED)

    def drain(self, deadline: float) -> None:
        """Read the answers of every posted call (each to its callback)."""
        waiting = self._calls.waiting
        self._read_until(lambda: next(iter(waiting), None), "posted calls", deadline)

    def _send(self, method: str, request, waiter, deadline: float, flags: int = 0) -> int:
        if not self.closed and self._peer_left():
            self.close("closed by the master")
        req_id, frame = self._calls.start(method, request, waiter, flags)
        sock, plain = self._sock, self._plain
        try:
            if plain is not None:
                plain.deadline = deadline
                plain.send_parts([frame])
            else:
                sock.settimeout(max(deadline - time.monotonic(), 0.001))
                sock.sendall(frame)
        except OSError as exc:  # a frame cut short is never served
            self._calls.forget(req_id)
            self.close(f"send failed: {exc}")
            raise NotSent(f"master control port {self.address}: send failed: {exc}") from None
        return req_id

    def _read_until(self, wanted, method: str, deadline: float) -> None:
        """Read replies, handing posted calls' to their callbacks and keeping the waited call's,
        until `wanted()` names no call still waiting."""
        sock, plain, calls, buffer = self._sock, self._plain, self._calls, self._buffer
        try:
            while wanted() is not None:
                if plain is not None:
                    plain.deadline = deadline
                    got = plain.recv_answer_into(buffer)
                else:
                    sock.settimeout(max(deadline - time.monotonic(), 0.001))
                    got = sock.recv_into(buffer)
                if not got:
                    raise EOFError("closed by the master")
                # Every reply in it is settled (its body read) before the buffer is filled again.
                for waiter, result in calls.received(buffer[:got]):
                    self._settle(waiter, result)
        except TimeoutError:
            self.close("no answer in time")
            raise UnavailableError(f"master {self.address} {method}: no answer in time") from None
        except (OSError, EOFError) as exc:
            self.close(f"connection lost: {exc}")
            raise UnavailableError(f"master control port {self.address}: connection lost: {exc}") from None
        except UnavailableError:
            raise
        except Exception as exc:  # a bad frame: nothing more on this connection can be trusted
            self.close(str(exc))
            raise

    def _settle(self, waiter, result) -> None:
        if waiter is _WAITED:
            self._answer = result
        else:
            waiter(result)

    def _peer_left(self) -> bool:
        """Whether the master closed this connection since the last call."""
        if _TCP_INFO is None:
            return False
        try:
            return self._sock.getsockopt(socket.IPPROTO_TCP, _TCP_INFO, 1)[0] != _ESTABLISHED
        except OSError:
            return True

    def close(self, reason: str = "closed") -> None:
        if not self._calls.closed:
            self._sock.close()
        for waiter, error in self._calls.end(reason):
            if waiter is not _WAITED:
                waiter(error)


class BlockingControlLinks:
    """One BlockingControlConnection per control address, opened on first use and again after it
    closed; the same calls as control_link.ControlLinks, answered without the event loop.
    Deadlines are time.monotonic() (the event loop's clock)."""

    def __init__(self, credential=None, tls=None):
        self.credential = credential  # proved to the master as a connection opens (kvpool/security/auth.py)
        self.tls = tls  # kvpool/security/tls.py TlsFiles: connections are TLS
        self._connections: dict[str, BlockingControlConnection] = {}

    def call_now(self, address: str, method: str, request, deadline: float):
        """Master.<method> through the control port at `address`, answered by `deadline`."""
        for attempt in range(2):
            connection = self._connections.get(address)
            if connection is None or connection.closed:
                connection = self._connections[address] = BlockingControlConnection.open(
                    address, deadline - time.monotonic(), self.credential, self.tls)
            try:
                return connection.call(method, request, deadline)
            except NotSent:
                if attempt:
                    raise
        raise AssertionError("unreachable")

    async def call(self, address: str, method: str, request, deadline: float):
        return self.call_now(address, method, request, deadline)

    def post(self, address: str, method: str, request, deadline: float, callback) -> bool:
        """Send Master.<method> on the open connection to `address` without waiting for it (see
        BlockingControlConnection.post); False, with nothing sent, when no connection is open."""
        connection = self._connections.get(address)
        if connection is None or connection.closed:
            return False
        try:
            connection.post(method, request, deadline, callback)
        except NotSent:
            return False
        return True

    async def drain(self, deadline: float) -> None:
        """Read the answer of every posted call (or fail it), by `deadline`."""
        for connection in list(self._connections.values()):
            if not connection.closed:
                try:
                    connection.drain(deadline)
                except UnavailableError:
                    pass  # the connection closed: its posted calls were failed to their callbacks

    async def close(self) -> None:
        for connection in self._connections.values():
            connection.close("client closed")
        self._connections.clear()
