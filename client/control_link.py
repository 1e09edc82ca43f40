"""The client's side of the master's control port over asyncio (master/serving/control_port.py; frames and
their meaning: kvpool/protocol/control.py).

One persistent connection per master, shared by every caller on the event loop.
A call takes a req_id and, on an idle connection, writes its frame at once;
while others are in flight, frames wait for the end of the loop's turn and
leave together in one write. Each reply, which may overtake earlier ones,
settles the call waiting on its req_id. An idle connection is checked before
it is used again (on Linux, its TCP state): one the master closed while the
loop was not looking is replaced, and the call goes out on the new one.
"""

import asyncio
import functools
import socket

from kvpool.security.auth import PeerHandshake, handshake
from kvpool.protocol import control
from kvpool.protocol.cluster_layout import parse_hostport
from kvpool.errors import KvpoolError, ProtocolError, UnavailableError
from kvpool.net.netutil import ConnectAttempt, open_socket
from kvpool.protocol.control import ControlCalls, NotSent

_TCP_INFO = getattr(socket, "TCP_INFO", None)  # Linux: its first byte is the connection's TCP state
_ESTABLISHED = 1


class _Call:
    __slots__ = ("method", "future", "deadline")

    def __init__(self, method: str, future: asyncio.Future, deadline: float):
        self.method = method
        self.future = future
        self.deadline = deadline  # loop time


class ControlConnection(asyncio.Protocol):
    """handshake: over TLS (asyncio's transport), the AUTH handshake is done here as the first frames
    arrive; `authenticated` resolves when it is done. Over plain TCP it was done on the socket before."""

    def __init__(self, address: str, handshake: PeerHandshake | None = None):
        self.address = address
        self.loop = asyncio.get_running_loop()
        self._handshake = handshake
        self.authenticated = self.loop.create_future()
        if handshake is None:
            self.authenticated.set_result(None)
        self.transport: asyncio.Transport | None = None
        self._calls = ControlCalls(address)  # req_id -> (method, _Call)
        self._queued: list[bytes] = []  # frames that leave at the end of this turn, and their req_ids
        self._queued_ids: list[int] = []
        self._sock = None
        # One timer for every call's deadline, not one per call: it fires at the earliest it knew of.
        self._watchdog: asyncio.TimerHandle | None = None
        self._watch_at = 0.0

    @property
    def closed(self) -> bool:
        return self._calls.closed

    # -- asyncio.Protocol

    def connection_made(self, transport) -> None:
        self.transport = transport
        self._sock = transport.get_extra_info("socket")

    def connection_lost(self, exc) -> None:
        self._fail(f"connection lost: {exc}" if exc else "connection closed by the master")
        if not self.authenticated.done():
            self.authenticated.set_exception(UnavailableError(f"master control port {self.address}: closed during "
                                                              f"the handshake"))

    def data_received(self, data: bytes) -> None:
        calls = self._calls
        try:
            frames = calls.frames(data)
        except ProtocolError as exc:
            self.close(str(exc))
            return
        for header, req_id, status, body in frames:
            if self._handshake is not None:
                if not self._handshake_step(bytes(header), bytes(body)):
                    return
                continue
            settled = calls.settle(req_id, status, body)
            if settled is not None:  # else a call that timed out or was cancelled
                future = settled[0].future
                if not future.done():
                    if isinstance(settled[1], BaseException):
                        future.set_exception(settled[1])
                    else:
                        future.set_result(settled[1])

    def _handshake_step(self, header: bytes, body: bytes) -> bool:
        """The challenge, then the answer to ours; False once the connection is closed for it."""
        handshake = self._handshake
        try:
            if not handshake.server_nonce:
                answer = handshake.respond(header, body)
                if answer:
                    self.transport.write(answer)
                    return True
            else:
                handshake.check(header + body)
        except KvpoolError as exc:
            self.authenticated.set_exception(exc)
            self.close(str(exc))
            return False
        self._handshake = None
        self.authenticated.set_result(None)
        return True

    # -- calls

    async def call(self, method: str, request, timeout: float):
        """The response of Master.<method>; raises LeaderHint, UnavailableError (NotSent if the frame
        never left), or the typed error of a refused frame."""
        req_id, future = self._send(method, request, timeout)
        try:
            return await future
        except asyncio.CancelledError:
            self._calls.forget(req_id)
            raise

    def post(self, method: str, request, timeout: float, callback) -> None:
        """Send Master.<method> without waiting: callback(response or error) runs when it is answered
        (or fails as call would). Raises NotSent if the connection is closed."""
        _, future = self._send(method, request, timeout, control.POSTED)
        future.add_done_callback(lambda done: callback(
            UnavailableError(f"master {self.address} {method}: cancelled") if done.cancelled()
            else done.exception() or done.result()))

    def _send(self, method: str, request, timeout: float, flags: int = 0) -> tuple[int, asyncio.Future]:
        calls = self._calls
        idle = not calls.waiting
        if idle and not calls.closed and self._peer_left():
            self.close("closed by the master")
        future = self.loop.create_future()
        deadline = self.loop.time() + timeout
        req_id, frame = calls.start(method, request, _Call(method, future, deadline), flags)
        if self._watchdog is None or deadline < self._watch_at:
            self._watch(deadline)
        if idle:
            self.transport.write(frame)
        else:  # busy: this frame leaves with the others of this turn
            if not self._queued:
                self.loop.call_soon(self._flush)
            self._queued.append(frame)
            self._queued_ids.append(req_id)
        return req_id, future

    def _peer_left(self) -> bool:
        """Whether the master closed this connection while the loop was not there to see it."""
        if _TCP_INFO is None or self._sock is None:
            return False
        try:
            return self._sock.getsockopt(socket.IPPROTO_TCP, _TCP_INFO, 1)[0] != _ESTABLISHED
        except OSError:
            return True

    def _flush(self) -> None:
        frames, ids = self._queued, self._queued_ids
        self._queued, self._queued_ids = [], []
        if self.closed or self.transport.is_closing():
            # Closed while these waited for the end of the turn: not sent.
            for req_id in ids:
                entry = self._calls.forget(req_id)
                if entry is not None and not entry[1].future.done():
                    entry[1].future.set_exception(NotSent(f"master control port {self.address}: connection closed"))
            self.close("closed by the master")
            return
        self.transport.write(frames[0] if len(frames) == 1 else b"".join(frames))

    def _watch(self, deadline: float) -> None:
        if self._watchdog is not None:
            self._watchdog.cancel()
        self._watch_at = deadline
        self._watchdog = self.loop.call_at(deadline, self._expire)

    def _expire(self) -> None:
        """Fail the calls past their deadline; watch for the next one."""
        self._watchdog = None
        now, nearest = self.loop.time(), None
        for req_id, (_method, call) in list(self._calls.waiting.items()):
            if call.deadline <= now:
                self._calls.forget(req_id)
                if not call.future.done():
                    call.future.set_exception(UnavailableError(f"master {self.address} {call.method}: "
                                                               "no answer in time"))
            elif nearest is None or call.deadline < nearest:
                nearest = call.deadline
        if nearest is not None:
            self._watch(nearest)

    def pending(self) -> list[_Call]:
        return [call for _method, call in self._calls.waiting.values()]

    # -- failure

    def close(self, reason: str = "closed") -> None:
        if self.transport is not None and not self.transport.is_closing():
            self.transport.abort()
        self._fail(reason)

    def _fail(self, reason: str) -> None:
        if self._watchdog is not None:
            self._watchdog.cancel()
            self._watchdog = None
        for call, error in self._calls.end(reason):
            if not call.future.done():
                call.future.set_exception(error)


class ControlLinks:
    """One ControlConnection per control address, opened on first use (concurrent first calls share
    the attempt) and again after it closed. The blocking Client's are control_blocking.py's."""

    def __init__(self, credential=None, tls=None):
        self.credential = credential  # proved to the master as a connection opens (kvpool/security/auth.py)
        self.tls = tls  # kvpool/security/tls.py TlsFiles: connections are TLS
        self._connections: dict[str, ControlConnection] = {}
        self._opening: dict[str, asyncio.Future] = {}

    async def call(self, address: str, method: str, request, deadline: float):
        """Master.<method> through the control port at `address`, answered by `deadline` (loop time)."""
        loop = asyncio.get_running_loop()
        for attempt in range(2):
            connection = await self._connection(address, deadline - loop.time())
            try:
                return await connection.call(method, request, deadline - loop.time())
            except NotSent:
                if attempt:
                    raise

    def post(self, address: str, method: str, request, deadline: float, callback) -> bool:
        """Send Master.<method> through the open connection to `address` without waiting for it
        (see ControlConnection.post); False, with nothing sent, when no connection is open."""
        connection = self._connections.get(address)
        if connection is None or connection.closed or connection.loop is not asyncio.get_running_loop():
            return False
        try:
            connection.post(method, request, deadline - connection.loop.time(), callback)
        except NotSent:
            return False
        return True

    async def drain(self, deadline: float) -> None:
        """Wait until every posted call was answered (or failed), by `deadline` (loop time)."""
        loop = asyncio.get_running_loop()
        for connection in list(self._connections.values()):
            pending = [call.future for call in connection.pending()]
            if pending:
                await asyncio.wait(pending, timeout=max(deadline - loop.time(), 0))

    async def _connection(self, address: str, timeout: float) -> ControlConnection:
        connection = self._connections.get(address)
        if connection is not None and not connection.closed and connection.loop is asyncio.get_running_loop():
            return connection
        opening = self._opening.get(address)
        if opening is None:
            opening = self._opening[address] = asyncio.ensure_future(self._open(address, timeout))
            opening.add_done_callback(functools.partial(self._opened, address))
        return await asyncio.shield(opening)

    async def _open(self, address: str, timeout: float) -> ControlConnection:
        try:
            host, port = parse_hostport(address)
        except ValueError as exc:
            raise UnavailableError(f"bad master control address {address!r}: {exc}") from None
        loop = asyncio.get_running_loop()
        with ConnectAttempt(f"master control port {address}", NotSent) as attempt:
            async with asyncio.timeout(max(timeout, 0.001)):
                sock = attempt.sock = await open_socket(host, port)
                if self.tls is None:
                    await handshake(sock, self.credential, f"master control port {address}")
                    _, connection = await loop.create_connection(lambda: ControlConnection(address), sock=sock)
                else:
                    peer = PeerHandshake(self.credential, f"master control port {address}")
                    _, connection = await loop.create_connection(
                        lambda: ControlConnection(address, peer), sock=sock, ssl=self.tls.client_context(),
                        server_hostname=host)
                    attempt.sock = None  # the transport owns it now
                    try:
                        await connection.authenticated
                    except BaseException:
                        connection.close("handshake failed")
                        raise
        old = self._connections.get(address)
        if old is not None:
            old.close("replaced")
        self._connections[address] = connection
        return connection

    def _opened(self, address: str, opening: asyncio.Future) -> None:
        if self._opening.get(address) is opening:
            del self._opening[address]
        if not opening.cancelled():
            opening.exception()  # retrieved: a failed attempt is reported to its callers only

    async def close(self) -> None:
        for opening in list(self._opening.values()):
            opening.cancel()
        for connection in self._connections.values():
            connection.close("client closed")
        self._connections.clear()
        await asyncio.sleep(0)  # the transports close their sockets in the loop's next turn
