"""The client's data path over UCX (the optional extra kvpool[ucx], through ucxx).

UCX picks the fastest path two processes share: TCP (or RDMA, where UCX has
it) across hosts, shared memory on one host. Endpoints are made from worker
addresses with UCX error handling off, which is what lets UCX use shared
memory at all, and why every operation here is bounded by its own deadline:
UCX would not notice a dead peer.

The message layout, the UCX settings (no cma) and the progress driver are
shared with the node's side (storenode/serving/ucx_server.py, ucx_session.py): kvpool/net/ucx_common.py.

Without error handling UCX does not notice a node that died either; over TCP
its transfers fail with a reset, but over shared memory they would just wait.
So a node's offer names its process, and a client on the same host checks
while its requests wait that the process still lives: a dead node costs about
Progress.TICK, not the whole timeout.

A worker only progresses while the asyncio loop that uses it runs. A client has
one worker per node: UCX cannot cancel a transfer under way, but a worker that
is never progressed again touches no buffer again, so dropping a node's worker
ends everything in flight to it and nothing else.
"""

import asyncio
import functools
import logging
import random
import time
from typing import Sequence

from kvpool.security import auth
from kvpool.protocol import transports, wire
from kvpool.protocol.checksum import checksum
from kvpool.net.node_connections import NodeConnections
from kvpool.errors import Code, KvpoolError, ProtocolError, UnavailableError, error_for
from kvpool.net.ucx_common import (ACCEPT, ACCEPT_MSG, BYE, CONN_SHIFT, CONNECT, CONNECT_MSG, DATA, KIND_SHIFT,
                               MAX_REPLY, MAX_WORKER_ADDRESS, PAYLOAD, PROTOCOL_VERSION, REPLY, REQUEST, Op,
                               Progress, Ucx, close_endpoint, load, low_of, new_context, new_worker,
                               process_start, settle_quietly, tag_of)

from kvpool.client.transport import DataPath, ReadItem, WriteItem

log = logging.getLogger(__name__)

DEFAULT_TIMEOUT = 5.0  # seconds any exchange may take, on top of its bytes at MIN_RATE
ENVIRONMENT = object()  # the default credential: the client token of this process's environment
DEFAULT_CONNECT_TIMEOUT = 3.0
MIN_RATE = 100e6  # bytes/s: a transfer slower than this counts as stuck
DEFAULT_IDLE_TIMEOUT = 300.0  # a node forgets a connection unused this long (its offer may say otherwise)
_WRITE, _READ = wire.Op.WRITE, wire.Op.READ


def available() -> bool:
    try:
        load()
    except UnavailableError:
        return False
    return True


class _Peer:
    """This client's connection to one node: a worker of its own, so that dropping the
    connection can stop everything in flight on it and nothing else."""

    __slots__ = ("address", "progress", "endpoint", "conn", "idle", "process", "last_used", "failed")

    def __init__(self, address: str, progress: Progress, endpoint, conn: int, idle: float, process):
        self.address = address
        self.progress = progress
        self.endpoint = endpoint
        self.conn = conn
        self.idle = idle
        self.process = process  # (pid, start) of the node on this host, else None
        self.last_used = time.monotonic()
        self.failed = False
        progress.on_tick = self.check

    def alive(self) -> bool:
        """False once the node's process is known gone (only knowable on its host)."""
        if self.process is None:
            return True
        pid, started = self.process
        return process_start(pid) == started

    def check(self) -> None:
        if not self.alive():
            self.destroy("the node's process is gone")

    def destroy(self, reason: str) -> None:
        if self.failed:
            return
        self.failed = True
        log.debug("UCX connection to %s dropped: %s", self.address, reason)
        closing = close_endpoint(self.endpoint)
        if closing is not None:
            self.progress.track(closing, None, future=False)
        self.progress.shutdown(UnavailableError(f"node {self.address}: {reason}"))
        self.progress.on_tick = None
        self.endpoint = None


class UcxTransport(DataPath):
    """WRITE and READ over UCX, one worker and endpoint per node.

    attach() first, with the node's HELLO: its "ucx" offer carries the node's
    worker address. Any UCX failure (node gone, no answer in time, a garbled
    message) raises UnavailableError and drops that node's connection (the
    next call reconnects), so a caller can fall back to TCP. An instance serves
    one event loop at a time; moving to another loop starts afresh.
    """

    def __init__(self, timeout: float = DEFAULT_TIMEOUT, connect_timeout: float = DEFAULT_CONNECT_TIMEOUT,
                 min_rate: float = MIN_RATE, options: dict | None = None, credential=ENVIRONMENT, tickets=None):
        """timeout: seconds an exchange may take on top of its bytes at min_rate bytes/s;
        options: UCX settings for this client (e.g. {"TLS": "tcp"}); see settings().
        credential: what to prove in each CONNECT (kvpool/security/auth.py; default: the client token of this
        process's environment), with a ticket from `tickets(address)` (a coroutine: a fresh HELLO on
        the node's authenticated TCP connection; default: over a connection of this transport's own)."""
        self.credential = auth.client_credential() if credential is ENVIRONMENT else credential
        self.tickets = tickets or self._ticket_over_tcp
        self._tcp: NodeConnections | None = None
        self.timeout = timeout
        self.connect_timeout = connect_timeout
        self.min_rate = min_rate
        self.options = dict(options or {})
        self._offers: dict[str, tuple] = {}  # node address -> parse_offer(hello)
        self._peers: dict[str, _Peer] = {}
        self._connecting: dict[str, asyncio.Future] = {}
        self._ucx: Ucx | None = None
        self._context = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._next_id = random.getrandbits(32)
        self._closed = False

    # -- connections

    async def attach(self, address: str, hello: dict) -> None:
        """Connect to the node at `address` (its TCP data address) with the "ucx" offer of its HELLO
        reply; UnavailableError if UCX cannot reach it."""
        offer = parse_offer(hello)
        if self._closed:
            raise UnavailableError("transport is closed")
        if self._offers.get(address) != offer:
            self._offers[address] = offer
            peer = self._peers.pop(address, None)
            if peer is not None:  # the node restarted: its worker address changed
                peer.destroy("the node's UCX offer changed")
        await self._peer(address)

    def register_buffer(self, buf) -> None:
        """A no-op: ucxx 0.52 offers Python no memory registration, and the transports this UCX
        has (tcp, posix, cma) need none; UCX's own registration cache serves those that would."""

    def _bind(self) -> None:
        """UCX on the running loop (the context is made on first use)."""
        if self._closed:
            raise UnavailableError("transport is closed")
        loop = asyncio.get_running_loop()
        if self._loop is not loop:
            if self._loop is not None:
                self._shutdown("the event loop changed")
            self._loop = loop
        if self._context is None:
            self._ucx = load()
            self._context = new_context(self.options)

    async def _peer(self, address: str) -> _Peer:
        self._bind()
        peer = self._peers.get(address)
        if peer is not None:
            if peer.failed:  # dropped by its watchdog
                del self._peers[address]
            elif time.monotonic() - peer.last_used < peer.idle / 2:
                return peer
            else:  # the node may have forgotten a connection this quiet: start a new one
                self._leave(peer)
        offer = self._offers.get(address)
        if offer is None:
            raise UnavailableError(f"node {address}: not attached over UCX")
        # Concurrent first calls to a node share one handshake.
        opening = self._connecting.get(address)
        if opening is None:
            opening = asyncio.ensure_future(self._connect(address, *offer))
            self._connecting[address] = opening
            opening.add_done_callback(functools.partial(self._opened, address))
        return await asyncio.shield(opening)

    def _opened(self, address: str, opening: asyncio.Future) -> None:
        if self._connecting.get(address) is opening:
            del self._connecting[address]
        if not opening.cancelled():
            opening.exception()  # the callers awaiting it see it; nobody else must be told

    async def _connect(self, address: str, worker_address: bytes, idle: float, process) -> _Peer:
        ucx, loop = self._ucx, self._loop
        if process is not None and process_start(process[0]) != process[1]:
            raise UnavailableError(f"node {address}: its process is gone")
        worker = new_worker(self._context)
        progress = Progress(worker, loop)
        try:
            endpoint = ucx.api.UCXEndpoint.create_from_worker_address(
                worker, ucx.api.UCXAddress.create_from_buffer(worker_address), False)
        except Exception as exc:
            progress.shutdown(UnavailableError("no endpoint"))
            raise UnavailableError(f"node {address}: no UCX path to it: {exc}") from None
        peer = _Peer(address, progress, endpoint, 0, idle, process)
        nonce = random.getrandbits(KIND_SHIFT)
        answer = bytearray(ACCEPT_MSG.size)
        try:
            greeting = await self._greeting(address, bytes(worker.address))
        except BaseException:
            peer.destroy("no ticket")
            raise
        try:
            accepted = progress.track(endpoint.tag_recv(ucx.Array(answer), ucx.Tag(tag_of(ACCEPT, nonce))), answer)
            sent = progress.track(endpoint.tag_send(ucx.Array(greeting), ucx.Tag(tag_of(CONNECT, nonce))), greeting)
            async with asyncio.timeout(self.connect_timeout):
                await sent.future
                await accepted.future
        except BaseException as exc:
            peer.destroy("handshake failed")
            if isinstance(exc, TimeoutError):
                raise UnavailableError(f"node {address}: no UCX answer within {self.connect_timeout}s") from None
            if isinstance(exc, Exception):
                raise UnavailableError(f"node {address}: UCX handshake failed: {exc}") from None
            raise
        magic, version, status, conn = ACCEPT_MSG.unpack(answer)
        if magic != wire.MAGIC or version != PROTOCOL_VERSION or status != Code.OK:
            peer.destroy("refused")
            raise UnavailableError(f"node {address}: UCX connection refused (version {version}, status {status})")
        if self._closed or self._loop is not loop:
            peer.destroy("transport closed")
            raise UnavailableError("transport is closed")
        peer.conn = conn
        self._peers[address] = peer
        return peer

    async def _greeting(self, address: str, worker_address: bytes) -> bytes:
        """CONNECT's body: with a credential, its proof over a fresh ticket from the node."""
        role, ticket, proof = 0, bytes(32), bytes(32)
        if self.credential is not None:
            async with asyncio.timeout(self.connect_timeout):
                ticket = await self.tickets(address)
            role = self.credential.role
            proof = auth.ticket_proof(self.credential.key, role, ticket, worker_address)
        return CONNECT_MSG.pack(wire.MAGIC, PROTOCOL_VERSION, role, ticket, proof) + worker_address

    async def _ticket_over_tcp(self, address: str) -> bytes:
        if self._tcp is None:
            self._tcp = NodeConnections(self.connect_timeout, self.credential)
        return ticket_of(await self._tcp.hello(address), address)

    def _fail(self, peer: _Peer, reason: str) -> None:
        """Drop a connection that cannot be trusted any more: what is in flight on it is cancelled."""
        if self._peers.get(peer.address) is peer:
            del self._peers[peer.address]
        peer.destroy(reason)

    def _leave(self, peer: _Peer) -> None:
        """Say goodbye (so the node frees the connection now) and drop it."""
        self._say_bye(peer)
        self._fail(peer, "left")

    def _say_bye(self, peer: _Peer) -> None:
        ucx = self._ucx
        try:
            bye = peer.endpoint.tag_send(ucx.Array(b""), ucx.Tag(tag_of(BYE, low_of(peer.conn, 0))))
            peer.progress.track(bye, b"", future=False)
            peer.progress.run()  # an eager goodbye leaves now, before the endpoint closes
        except Exception as exc:
            log.debug("UCX goodbye to %s failed: %s", peer.address, exc)

    # -- data

    def _request_id(self) -> int:
        self._next_id = (self._next_id + 1) & 0xFFFFFFFF
        return self._next_id

    async def write(self, address, key, generation, data, checksum, options=None, term=0) -> None:
        peer = await self._peer(address)
        [result] = await self._exchange(peer, _WRITE, [WriteItem(key, generation, data, checksum, options, term)])
        if isinstance(result, BaseException):
            raise result

    async def read_into(self, address, key, generation, buf) -> int:
        peer = await self._peer(address)
        [result] = await self._exchange(peer, _READ, [ReadItem(key, generation, buf)])
        if isinstance(result, BaseException):
            raise result
        return result

    async def write_many(self, address: str, items: Sequence[WriteItem]) -> list:
        return await self._many(address, _WRITE, items)

    async def read_many(self, address: str, items: Sequence[ReadItem]) -> list:
        return await self._many(address, _READ, items)

    async def _many(self, address: str, op: int, items: Sequence) -> list:
        if not items:
            return []
        try:
            peer = await self._peer(address)
        except KvpoolError as exc:
            return [type(exc)(str(exc)) for _ in items]
        return await self._exchange(peer, op, items)

    async def _exchange(self, peer: _Peer, op: int, items: Sequence) -> list:
        """Post every item's receives and sends at once, then collect the replies in order:
        per item None (WRITE) or the checksum of what arrived (READ), or the error."""
        progress, ucx = peer.progress, self._ucx
        Array, Tag = ucx.Array, ucx.Tag
        endpoint, conn = peer.endpoint, peer.conn
        total = 0
        posted = []  # (req_id, reply Op, payload or value Op or None, READ buffer)
        try:
            for item in items:
                req_id = self._request_id()
                low = conn << CONN_SHIFT | req_id
                answer = bytearray(MAX_REPLY)
                reply = progress.track(endpoint.tag_recv(Array(answer), Tag(REPLY << KIND_SHIFT | low)), answer)
                second = None
                if op == _WRITE:
                    key, generation, data, value_checksum, options = item[:5]
                    term = item[5] if len(item) > 5 else 0
                    size = len(data)
                    total += size
                    frame = wire.pack_with_options(_WRITE, req_id, key, generation, term, size, value_checksum,
                                                   options)
                    progress.track(endpoint.tag_send(Array(frame), Tag(REQUEST << KIND_SHIFT | low)), frame,
                                   future=False)
                    if size:
                        second = progress.track(endpoint.tag_send(Array(data), Tag(PAYLOAD << KIND_SHIFT | low)),
                                                data)
                    posted.append((req_id, reply, second, None))
                else:
                    key, generation, buf = item
                    size = len(buf)
                    total += size
                    if size:  # posted before the request goes out, so the value lands in place
                        second = progress.track(endpoint.tag_recv(Array(buf), Tag(DATA << KIND_SHIFT | low)), buf)
                    frame = wire.pack_request(_READ, req_id, key, generation, 0, size)
                    progress.track(endpoint.tag_send(Array(frame), Tag(REQUEST << KIND_SHIFT | low)), frame,
                                   future=False)
                    posted.append((req_id, reply, second, buf))
        except Exception as exc:  # the endpoint refused a request: the connection is broken
            reason = f"UCX refused a request: {exc}"
            self._abandon(peer, posted, reason)
            return [UnavailableError(f"node {peer.address}: {reason}") for _ in items]
        budget = self.timeout + total / self.min_rate
        results = []
        try:
            async with asyncio.timeout(budget):
                for req_id, reply, second, buf in posted:
                    results.append(await self._outcome(peer, op, req_id, reply, second, buf))
        except TimeoutError:
            reason = f"no UCX answer within {budget:.1f}s"
            self._abandon(peer, posted[len(results):], reason)
            results += [UnavailableError(f"node {peer.address}: {reason}")] * (len(posted) - len(results))
        except ProtocolError as exc:
            self._abandon(peer, posted[len(results):], str(exc))
            results.append(exc)
            results += [UnavailableError(f"node {peer.address}: {exc}")] * (len(posted) - len(results))
        except asyncio.CancelledError:
            # A READ still posted could write into its buffer later: the connection goes.
            self._abandon(peer, posted[len(results):], "request cancelled")
            raise
        except UnavailableError as exc:  # the connection was dropped meanwhile (e.g. the node died)
            self._abandon(peer, posted[len(results):], str(exc))
            results += [UnavailableError(str(exc))] * (len(posted) - len(results))
        except Exception as exc:  # a UCX error on a request: the connection is broken
            reason = f"UCX failed: {exc}"
            self._abandon(peer, posted[len(results):], reason)
            results += [UnavailableError(f"node {peer.address}: {reason}")] * (len(posted) - len(results))
        peer.last_used = time.monotonic()
        return results

    async def _outcome(self, peer: _Peer, op: int, req_id: int, reply: Op, second: Op | None, buf):
        await reply.future
        status, message = parse_reply(reply.buffer, op, req_id, peer.address)
        if status != Code.OK:
            if second is not None:
                if op == _READ:
                    peer.progress.forget(second)  # no value follows an error
                else:
                    await second.future  # the node swallows a refused payload: the send completes
            return error_for(status, f"node {peer.address}: {message}")
        if second is not None:
            await second.future
        return checksum(buf) if op == _READ else None

    def _abandon(self, peer: _Peer, posted: list, reason: str) -> None:
        self._fail(peer, reason)
        for _, reply, second, _ in posted:
            settle_quietly(reply.future)
            if second is not None:
                settle_quietly(second.future)

    # -- closing

    async def close(self) -> None:
        self._closed = True
        for opening in list(self._connecting.values()):
            opening.cancel()
        self._shutdown("transport closed", goodbye=True)
        self._context = None  # UCX frees it once its workers are gone
        if self._tcp is not None:
            await self._tcp.close()
            self._tcp = None

    def _shutdown(self, reason: str, goodbye: bool = False) -> None:
        peers, self._peers = list(self._peers.values()), {}
        try:
            here = asyncio.get_running_loop() is self._loop
        except RuntimeError:
            here = False
        for peer in peers:
            if goodbye and here:
                self._say_bye(peer)
            peer.destroy(reason)


def ticket_of(hello, address: str) -> bytes:
    """The one-use UCX ticket in a node's HELLO reply."""
    try:
        return bytes.fromhex(hello["transports"][transports.UCX]["ticket"])
    except (KeyError, TypeError, ValueError) as exc:
        raise UnavailableError(f"node {address}: no UCX ticket in its HELLO ({exc!r})") from None


def parse_offer(hello) -> tuple:
    """(worker address, idle timeout, (pid, start) of the node's process if it runs on this host, else None)
    from a node's HELLO reply; UnavailableError if it offers no UCX."""
    offers = hello.get("transports") if isinstance(hello, dict) else None
    offer = offers.get("ucx") if isinstance(offers, dict) else None
    if not isinstance(offer, dict):
        raise UnavailableError("the node offers no UCX")
    try:
        worker_address = bytes.fromhex(offer["address"])
        idle = float(offer.get("idle_timeout", DEFAULT_IDLE_TIMEOUT))
    except (KeyError, TypeError, ValueError) as exc:
        raise UnavailableError(f"the node's UCX offer is malformed: {exc!r}") from None
    if not worker_address or len(worker_address) > MAX_WORKER_ADDRESS or idle <= 0:
        raise UnavailableError("the node's UCX offer is malformed")
    process = None
    if offer.get("host_id") == transports.host_id() and isinstance(offer.get("pid"), int) \
            and isinstance(offer.get("started"), int):
        process = (offer["pid"], offer["started"])
    return worker_address, idle, process


def parse_reply(answer: bytearray, op: int, req_id: int, address: str) -> tuple[int, str]:
    """(status, error message) of a REPLY; ProtocolError if it does not answer (op, req_id)."""
    magic, version, reply_op, reply_id, status, _flags, length, _checksum = wire.REPLY.unpack_from(answer)
    if magic == wire.MAGIC and version != wire.VERSION:
        raise wire.version_mismatch(f"node {address}", version)
    if magic != wire.MAGIC or reply_op != op or reply_id != req_id:
        raise ProtocolError(f"node {address}: UCX reply (op {reply_op}, id {reply_id}) does not answer "
                            f"op {op}, id {req_id}")
    if status == Code.OK:
        return status, ""
    end = wire.REPLY.size + min(length, MAX_REPLY - wire.REPLY.size)
    return status, bytes(answer[wire.REPLY.size:end]).decode("utf-8", "replace")
