"""The master's binary control port: the Master RPCs in kvpool/protocol/wire.py frames (kvpool/protocol/control.py).

A gRPC unary call costs many raw socket round trips' worth of time between two
processes, and a put makes two master calls; this port serves the same RPCs
through the same code (MasterService.serve_now, as dispatch) for the price of one round trip;
a call that needs no waiting is answered inside the read that brought it, with no coroutine or task;
one whose coroutine finishes in its first step (kvpool/runtime/coroutine_driver.py start) with no task either.

A connection may carry many requests at once. Each complete frame is decoded
and dispatched as it arrives, in arrival order: a handler changes the table
before its first await, so arrival order is the order of effects. Replies go
out as calls finish, matched by req_id, and replies ready together leave in one
write; the answer to a call its caller posted (control.POSTED: it does not wait
for it) is held back to leave with the next reply, or after control.HOLD_POSTED,
so it costs the caller no wake-up of its own. A peer cannot hurt anyone else: a bad magic or version closes its
connection; a body over MAX_BODY is refused (TOO_LARGE) and the connection
closed; a frame that stalls half-received for frame_timeout seconds closes it;
an undecodable body is answered INVALID_ARGUMENT; an unknown op PROTOCOL.
A connection opens with the AUTH handshake (kvpool/security/auth.py): until the peer
answers the challenge with a valid proof, within frame_timeout of connecting, nothing else is
read; a wrong one is answered FORBIDDEN and the connection closed.
Slots (kvpool/sockets/admission.py): a proved connection holds one of max_connections; one
still in its handshake one of max_unproved (max_unproved_per_address from one address; past
either it displaces the oldest unproved one); with every proved slot taken a new connection is
answered UNAVAILABLE (op TURNED_AWAY) and closed.
"""

import asyncio
import logging
import types

from google.protobuf.message import DecodeError
from prometheus_client import CollectorRegistry, Counter, Gauge

from kvpool.protocol import control, wire
from kvpool.security.auth import MAX_IDENT, NONCE, PROOF, ServerHandshake, Verifier, refusal
from kvpool.security.roles import CLIENT, MEMBER
from kvpool.sockets.admission import UNPROVED, UNPROVED_PER_ADDRESS, Admission
from kvpool.errors import Code, ForbiddenError, KvpoolError
from kvpool.runtime.coroutine_driver import resume, start

from kvpool.master.serving.metrics import CallCounter
from kvpool.master.serving.service import EtcdSilent, MasterService, NotLeading

log = logging.getLogger(__name__)

FRAME_TIMEOUT = 10.0  # seconds a frame may sit half-received without a byte more
MAX_IN_FLIGHT = 1024  # calls served at once per connection; reading pauses beyond
MAX_CONNECTIONS = 4096  # default --control-max-connections: proved connections at once
_HEADER = wire.REQUEST.size
_unpack_header = wire.REQUEST.unpack_from
_OK, _NOT_LEADER = int(Code.OK), int(Code.NOT_LEADER)
_POSTED = control.POSTED
_COROUTINE = types.CoroutineType  # what MasterService.serve_now returns for a call still to finish


class ControlPort:
    def __init__(self, service: MasterService, registry: CollectorRegistry | None = None,
                 frame_timeout: float = FRAME_TIMEOUT, max_body: int = control.MAX_BODY,
                 verifier: Verifier | None = None, max_connections: int = MAX_CONNECTIONS,
                 max_unproved: int = UNPROVED, max_unproved_per_address: int = UNPROVED_PER_ADDRESS):
        self.service = service
        self.verifier = verifier or Verifier(None)
        self.slots = Admission(max_connections, max_unproved, max_unproved_per_address)
        self.frame_timeout = frame_timeout
        self.max_body = max_body
        self._server: asyncio.AbstractServer | None = None
        self._connections: set[_Connection] = set()
        # Counted per call: plain ints read at scrape time (metrics.CallCounter), not a locked Counter.
        self.requests = CallCounter("kvpool_master_control_requests", "RPCs received on the control port",
                                    ("method",), registry)
        self.refused = Counter("kvpool_master_control_refused", "Control port frames refused, by reason",
                               ["reason"], registry=registry)
        self.connections = Gauge("kvpool_master_control_connections", "Open control port connections",
                                 registry=registry)
        self.accepted = Counter("kvpool_master_control_accepted", "Control port connections accepted",
                                registry=registry)
        # op -> (method, request parser, its request counter's labels): one look-up per frame
        self.entries = {int(op): (name, control.MESSAGES[name][0].FromString, (name,))
                        for name, op in control.OP_BY_RPC.items()}
        self.entries[int(wire.Op.LOOKUP)] = (control.LOOKUP, control.parse_keys, (control.LOOKUP,))
        for name, _parse, labels in self.entries.values():
            self.requests.touch(labels)

    async def bind(self, host: str, port: int, tls=None) -> int:
        """Listen on host:port (0: a free port), without serving yet; returns the port. tls: an
        ssl.SSLContext to serve TLS with (the AUTH handshake then runs inside it)."""
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(lambda: _Connection(self), host, port, start_serving=False,
                                                backlog=1024, ssl=tls,
                                                ssl_handshake_timeout=self.frame_timeout if tls else None)
        return self._server.sockets[0].getsockname()[1]

    async def start(self) -> None:
        await self._server.start_serving()

    def end_lapsed_tenants(self) -> int:
        """Close every connection whose tenant's token ended (rotated or deleted), at once; how many."""
        lapsed = [c for c in self._connections if not self.verifier.current(c.caller)]
        for connection in lapsed:
            connection.close()
        return len(lapsed)

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
        for connection in list(self._connections):
            connection.close()
        if self._server is not None:
            await self._server.wait_closed()


def _body(response) -> bytes:
    """An OK reply's body: the serialized protobuf response, or a LOOKUP's answer (already bytes)."""
    return response if type(response) is bytes else response.SerializeToString()


def _error_frame(op: int, req_id: int, name: str, exc: Exception) -> bytes:
    """The answer to a call that raised `exc` instead of answering."""
    if isinstance(exc, EtcdSilent):  # no leader can be confirmed: the caller fails at once
        return control.pack_error(op, req_id, Code.UNAVAILABLE, str(exc))
    if isinstance(exc, NotLeading):
        return control.pack_answer(op, req_id, _NOT_LEADER, control.not_leader_body(exc.leader, exc.control_address))
    if isinstance(exc, KvpoolError):  # a request refused whole (e.g. past --max-batch)
        return control.pack_error(op, req_id, exc.code, str(exc))
    log.error("control port: %s failed", name, exc_info=exc)  # a bug costs this call, not the connection
    return control.pack_error(op, req_id, Code.INTERNAL, f"internal error: {type(exc).__name__}: {exc}")


class _Connection(asyncio.Protocol):
    def __init__(self, port: ControlPort):
        self.port = port
        self.service = port.service
        self.loop = asyncio.get_running_loop()
        self.transport: asyncio.Transport | None = None
        self.buf = bytearray()
        self.out: list[bytes] = []  # replies not written yet
        self.held: list[bytes] = []  # answers to posted calls, to leave with the next reply (control.POSTED)
        self.held_timer: asyncio.TimerHandle | None = None
        self.flushing = False
        self.receiving = False
        self.calls: set[asyncio.Task] = set()
        self.closed = False
        self.reading = True
        self.writable = True
        self.progress = 0.0  # loop time input last arrived while a frame was incomplete
        self.stall_timer: asyncio.TimerHandle | None = None
        self.handshake: ServerHandshake | None = ServerHandshake(port.verifier)  # None once authenticated
        self.caller = MEMBER if port.verifier.open else CLIENT  # what the peer proved (roles.py Caller)
        self.auth_timer: asyncio.TimerHandle | None = None

    # -- connection

    def connection_made(self, transport) -> None:
        self.transport = transport
        peer = transport.get_extra_info("peername")
        admitted, displaced = self.port.slots.admit(self, peer[0] if peer else "?")
        if not admitted:
            self.port.refused.labels("turned_away").inc()
            transport.write(self._turned_away())
            self.closed = True
            transport.close()
            return
        for old in displaced:  # unproved connections pushed out by this newer one
            self.port.refused.labels("displaced").inc()
            old.close()
        self.port._connections.add(self)
        self.port.connections.inc()
        self.port.accepted.inc()
        transport.write(self.handshake.challenge())
        if self.port.verifier.open:
            self.handshake = None
            self.port.slots.prove(self)
        else:  # an unauthenticated connection holds a slot for frame_timeout at most
            self.auth_timer = self.loop.call_later(self.port.frame_timeout, self._auth_overdue)

    def connection_lost(self, exc) -> None:
        self.closed = True
        self.port.slots.forget(self)
        for timer in (self.stall_timer, self.auth_timer, self.held_timer):
            if timer is not None:
                timer.cancel()
        if self in self.port._connections:
            self.port._connections.discard(self)
            self.port.connections.dec()
        # Calls in flight finish (their effects stand, as over gRPC); their replies are dropped.

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.transport.abort()

    def pause_writing(self) -> None:
        self.writable = False
        self._pace()

    def resume_writing(self) -> None:
        self.writable = True
        self._pace()

    def _pace(self) -> None:
        """Read only while the peer takes its replies and its calls in flight are bounded."""
        want = self.writable and len(self.calls) < MAX_IN_FLIGHT
        if want != self.reading and not self.closed:
            self.reading = want
            self.progress = self.loop.time()  # a pause of ours does not count against the peer
            (self.transport.resume_reading if want else self.transport.pause_reading)()

    # -- input

    def data_received(self, data: bytes) -> None:
        if self.closed:
            return
        self.receiving = True
        try:
            self._take(data)
        finally:
            self.receiving = False
            self._flush()  # the replies to what this read brought, in one write

    def _take(self, data: bytes) -> None:
        buf = self.buf
        if buf:
            buf += data
        else:  # the read starts at a frame (the common case): parsed where it lies, the rest kept
            buf = data
        size, start = len(buf), 0
        while size - start >= _HEADER:
            magic, version, op, req_id, key_len, _flags, _gen, _arg, length, _sum = _unpack_header(buf, start)
            if magic != wire.MAGIC or version != wire.VERSION:
                if magic == wire.MAGIC:  # a peer of another release: told so, naming both versions
                    self._reply(wire.version_refusal("this master", version))
                    self._refuse("version", str(wire.version_mismatch(self._peer(), version)))
                    return
                self._refuse("bad_frame", f"bad magic/version {bytes(magic)!r}/{version}")
                return
            if self.handshake is not None and (key_len > MAX_IDENT or length != NONCE + PROOF):
                self._unauthenticated(req_id, ForbiddenError("authenticate first: this master needs the "
                                                             "cluster token (KVPOOL_TOKEN_FILE or KVPOOL_TOKEN)"))
                return
            if length > self.port.max_body:
                self._reply(control.pack_error(op, req_id, Code.TOO_LARGE,
                                               f"body of {length} bytes exceeds {self.port.max_body}"))
                self._refuse("too_large", f"a body of {length} bytes")
                return
            end = start + _HEADER + key_len + length
            if size < end:
                break
            body = bytes(buf[start + _HEADER + key_len:end])  # one copy: a slice of bytes is bytes
            if self.handshake is not None:
                ident = bytes(buf[start + _HEADER:start + _HEADER + key_len])  # a tenant's NAME:VERSION
                start = end
                try:
                    self.caller, reply = self.handshake.answer(op, req_id, ident, _flags, length, body)
                except ForbiddenError as exc:
                    self._unauthenticated(req_id, exc)
                    return
                self.handshake = None
                self.auth_timer.cancel()
                if not self.port.slots.prove(self):  # every proved slot taken meanwhile
                    self._reply(self._turned_away())
                    self._refuse("turned_away", "every connection slot is taken")
                    return
                self._reply(reply)
                continue
            start = end
            if key_len:
                self.port.refused.labels("protocol").inc()
                self._reply(control.pack_error(op, req_id, Code.PROTOCOL, "control frames carry no key"))
                continue
            self._call(op, req_id, body, _flags)
            if self.closed:
                return
        if buf is self.buf:
            if start:
                del buf[:start]
        elif start < size:
            self.buf += memoryview(buf)[start:]
        self._watch_stall(bool(self.buf))

    def _call(self, op: int, req_id: int, body: bytes, flags: int = 0) -> None:
        entry = self.port.entries.get(op)
        if entry is None:
            self.port.refused.labels("protocol").inc()
            self._reply(control.pack_error(op, req_id, Code.PROTOCOL, f"unknown op {op}"))
            return
        name, parse, labels = entry
        try:
            request = parse(body)
        except (DecodeError, ValueError) as exc:  # a protobuf that does not parse, a LOOKUP not in UTF-8
            self.port.refused.labels("undecodable").inc()
            self._reply(control.pack_error(op, req_id, Code.INVALID_ARGUMENT, f"{name}: undecodable body: {exc}"))
            return
        self.port.requests.counts[labels] += 1
        try:
            response = self.service.serve_now(name, request, self.caller)
        except Exception as exc:  # noqa: BLE001 - answered as an error frame (_error_frame)
            self._reply(_error_frame(op, req_id, name, exc))
            return
        if type(response) is not _COROUTINE:  # most calls finish here: no task, no further turn of the loop
            frame = control.pack_answer(op, req_id, _OK, _body(response))
            if flags & _POSTED:
                self._hold(frame)
            else:
                self._reply(frame)
            return
        call = self._serve(op, req_id, name, response)
        finished, waiting_on = start(call)  # a hold or FREEs may still finish here, without a task
        if finished:
            return
        task = self.loop.create_task(resume(call, waiting_on))
        self.calls.add(task)
        task.add_done_callback(self._call_done)
        if len(self.calls) >= MAX_IN_FLIGHT:
            self._pace()

    def _call_done(self, task: asyncio.Task) -> None:
        self.calls.discard(task)
        if not self.reading:
            self._pace()

    async def _serve(self, op: int, req_id: int, name: str, finishing) -> None:
        """Await the rest of a call (MasterService.serve_now's coroutine) and reply."""
        try:
            response = await finishing
        except Exception as exc:  # noqa: BLE001 - answered as an error frame (_error_frame)
            frame = _error_frame(op, req_id, name, exc)
        else:
            frame = control.pack_answer(op, req_id, _OK, _body(response))
        self._reply(frame)

    # -- output

    def _reply(self, frame: bytes) -> None:
        if self.closed:
            return
        self.out.append(frame)
        if not self.flushing and not self.receiving:
            # Replies finished in this turn of the loop leave together.
            self.flushing = True
            self.loop.call_soon(self._flush)

    def _hold(self, frame: bytes) -> None:
        self.held.append(frame)
        if self.held_timer is None:
            self.held_timer = self.loop.call_later(control.HOLD_POSTED, self._release)

    def _release(self) -> None:
        """Let the held answers go even with no reply to ride with."""
        self._take_held()
        self._flush()

    def _take_held(self) -> None:
        """Put the held answers ahead of the replies due (their calls came first); their timer is done."""
        if self.held_timer is not None:
            self.held_timer.cancel()
            self.held_timer = None
        self.out[:0], self.held = self.held, []

    def _flush(self) -> None:
        self.flushing = False
        if self.out and not self.closed:
            if self.held:  # the posted calls' answers ride along
                self._take_held()
            out, self.out = self.out, []
            self.transport.write(out[0] if len(out) == 1 else b"".join(out))

    # -- hostile or broken peers

    def _refuse(self, reason: str, what: str) -> None:
        """End a connection whose stream cannot be trusted (after the replies already due)."""
        log.warning("control port: closing a connection from %s: %s", self._peer(), what)
        self.port.refused.labels(reason).inc()
        self._take_held()
        self._flush()
        self.closed = True
        self.transport.close()  # flushes what was written

    def _unauthenticated(self, req_id: int, exc: ForbiddenError) -> None:
        self._reply(refusal(req_id, exc))
        self._refuse("forbidden", str(exc))

    def _turned_away(self) -> bytes:
        return wire.pack_error(wire.TURNED_AWAY, 0, Code.UNAVAILABLE,
                               f"master at its limit of {self.port.slots.limit} control connections")

    def _auth_overdue(self) -> None:
        self.auth_timer = None
        if not self.closed and self.handshake is not None:
            self._refuse("forbidden", f"no credential within {self.port.frame_timeout:g}s")

    def _watch_stall(self, incomplete: bool) -> None:
        if not incomplete:
            if self.stall_timer is not None:
                self.stall_timer.cancel()
                self.stall_timer = None
            return
        self.progress = self.loop.time()
        if self.stall_timer is None:
            self.stall_timer = self.loop.call_at(self.progress + self.port.frame_timeout, self._stalled)

    def _stalled(self) -> None:
        self.stall_timer = None
        if self.closed or not self.buf:
            return
        due = self.progress + self.port.frame_timeout
        if not self.reading or self.loop.time() < due:  # paused by us, or it moved on since
            self.stall_timer = self.loop.call_at(max(due, self.loop.time() + 0.01), self._stalled)
            return
        self._refuse("stalled", f"a frame stalled half-received for {self.port.frame_timeout:g}s")

    def _peer(self) -> str:
        peer = self.transport.get_extra_info("peername") if self.transport is not None else None
        return f"{peer[0]}:{peer[1]}" if peer else "?"
