"""The data protocol over UCX (the optional extra kvpool[ucx], through ucxx).

UCX picks the fastest path two processes share: TCP (or RDMA, where UCX has
it) across hosts, shared memory on one host. Endpoints are made from worker
addresses with UCX error handling off, which is what lets UCX use shared
memory at all, and why every operation here is bounded by its own deadline:
UCX would not notice a dead peer.

Messages are tag-matched. A tag is kind (8 bits) | connection id (24 bits,
handed out by the node) | request id (32 bits, unique per client):

  client -> node  CONNECT  low 56 bits: a nonce; body: CONNECT_MSG + the client's worker address
  node -> client  ACCEPT   the same nonce; body: ACCEPT_MSG (status, connection id)
  client -> node  REQUEST  a kvpool.wire REQUEST frame: header, key and, for a WRITE, WRITE_OPTIONS
  client -> node  PAYLOAD  a WRITE's value
  node -> client  REPLY    a kvpool.wire REPLY frame, with the error message when status != OK
  node -> client  DATA     a READ's value (sent only after an OK REPLY)
  client -> node  BYE      the client leaves

A READ's receive is posted before its request goes out, so the value lands
straight in the caller's buffer; the node receives a WRITE's payload straight
into its extent. The node serves each connection's requests in order, as over
TCP. Only WRITE and READ travel over UCX; everything else uses the node's TCP
connection.

Cross-memory attach (cma) is left out unless UCX_TLS (or the options given)
asks for it, although it is UCX's fastest path between processes of one host:
without error handling UCX treats a failed cma copy as fatal, so a peer dying
mid-transfer would abort this process (a node killed under a reading client,
or a client killed while a node pulls its WRITE). Error handling would exclude
shared memory altogether. Without cma, UCX copies through shared-memory
segments (sysv/posix), which survives a dead peer; kvpool's own shared-memory
path serves one host better anyway.

Without error handling UCX does not notice a node that died either; over TCP
its transfers fail with a reset, but over shared memory they would just wait.
So a node's offer names its process, and a client on the same host checks
while its requests wait that the process still lives: a dead node costs about
Progress.TICK, not the whole timeout.

Progress: a worker is driven by the asyncio loop that uses it, through the
worker's event file descriptor (no progress thread and no busy polling), so it
only progresses while that loop runs. A blocking client's loop runs during each
call, which is exactly when replies are due. A client has one worker per node:
UCX cannot cancel a transfer under way, but a worker that is never progressed
again touches no buffer again, so dropping a node's worker ends everything in
flight to it and nothing else.

The node's side (storenode/ucx_server.py) shares the tag layout and the
progress driver defined here.
"""

import asyncio
import functools
import logging
import os
import random
import struct
import time
from typing import NamedTuple, Sequence

from kvpool import transports, wire
from kvpool.checksum import checksum
from kvpool.errors import Code, KvpoolError, ProtocolError, UnavailableError, error_for
from kvpool.keys import MAX_KEY_BYTES

from .transport import NO_OPTIONS, DataPath, ReadItem, WriteItem

log = logging.getLogger(__name__)

DEFAULT_TIMEOUT = 5.0  # seconds any exchange may take, on top of its bytes at MIN_RATE
DEFAULT_CONNECT_TIMEOUT = 3.0
MIN_RATE = 100e6  # bytes/s: a transfer slower than this counts as stuck
DEFAULT_IDLE_TIMEOUT = 300.0  # a node forgets a connection unused this long (its offer may say otherwise)

# -- message layout (shared with the node)

CONNECT, ACCEPT, REQUEST, PAYLOAD, REPLY, DATA, BYE = range(1, 8)
KIND_SHIFT = 56
KIND_MASK = 0xFF << KIND_SHIFT
CONN_SHIFT = 32
MAX_CONN = (1 << 24) - 1
LOW_MASK = (1 << KIND_SHIFT) - 1
CONN_MASK = MAX_CONN << CONN_SHIFT
PROTOCOL_VERSION = 1
CONNECT_MSG = struct.Struct("<2sB")  # magic, version; the client's worker address follows
ACCEPT_MSG = struct.Struct("<2sBBI")  # magic, version, status (kvpool.errors.Code), connection id
MAX_FRAME = wire.REQUEST.size + MAX_KEY_BYTES + wire.WRITE_OPTIONS.size
MAX_REPLY = wire.REPLY.size + 4096  # wire.pack_error cuts messages at 4096 bytes
MAX_WORKER_ADDRESS = 64 * 1024

_WRITE, _READ = wire.Op.WRITE, wire.Op.READ


def tag_of(kind: int, low: int) -> int:
    return kind << KIND_SHIFT | low


def low_of(conn: int, req_id: int) -> int:
    return conn << CONN_SHIFT | req_id


# -- ucxx, imported on first use


class Ucx(NamedTuple):
    api: object  # ucxx._lib.libucxx: UCXContext, UCXWorker, UCXEndpoint, UCXAddress, UCXError
    Array: type  # wraps a buffer for a send or receive
    Tag: type
    TagMask: type


@functools.cache
def _import() -> Ucx:
    # ucxx sets UCX_MEMTYPE_CACHE, which this UCX no longer knows: without this, every worker warns about it.
    os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")
    import ucxx  # noqa: F401  (sets UCX defaults in the environment before the bindings load)
    from ucxx._lib import libucxx
    from ucxx._lib.arr import Array
    from ucxx.types import Tag, TagMask

    return Ucx(libucxx, Array, Tag, TagMask)


def load() -> Ucx:
    """ucxx's bindings (importing them takes ~0.5 s, so only once UCX is wanted); UnavailableError if missing."""
    try:
        return _import()
    except Exception as exc:  # ImportError, or a native library that does not load
        raise UnavailableError(f"UCX is not available here (pip install 'kvpool[ucx]'): {exc}") from None


def available() -> bool:
    try:
        load()
    except UnavailableError:
        return False
    return True


SAFE_TLS = "^cma"  # every transport but cross-memory attach (see the module docstring)


def settings(options: dict | None = None) -> dict:
    """UCX settings for a context: `options` (names without the UCX_ prefix, e.g. {"TLS": "tcp"}),
    and unless they or the environment choose the transports, all but cma."""
    chosen = {str(name): str(value) for name, value in (options or {}).items()}
    if "TLS" not in chosen and "UCX_TLS" not in os.environ:
        chosen["TLS"] = SAFE_TLS
    return chosen


def new_context(options: dict | None = None):
    """A UCX context with settings(options), which override the environment's."""
    ucx = load()
    try:
        return ucx.api.UCXContext(settings(options))
    except Exception as exc:  # no usable transport, a bad option...
        raise UnavailableError(f"UCX cannot start: {exc}") from None


def new_worker(context):
    try:
        return load().api.UCXWorker(context)
    except Exception as exc:
        raise UnavailableError(f"UCX cannot start a worker: {exc}") from None


def process_start(pid: int) -> int | None:
    """When process `pid` of this host started (clock ticks after boot), or None if there is none."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    try:
        return int(stat[stat.rindex(b")") + 2:].split()[19])  # field 22; the name in () may hold spaces
    except (ValueError, IndexError):
        return None


def this_process() -> dict:
    """What a node's offer says about its process, so that clients on its host can tell it is alive."""
    return {"host_id": transports.host_id(), "pid": os.getpid(), "started": process_start(os.getpid())}


def close_endpoint(endpoint):
    """Start closing; returns the close request (or None), which completes on progress.

    Closing first also keeps the endpoint's destructor from its own blocking close,
    which would spin forever on a peer that died (error handling is off).
    """
    try:
        return endpoint.close()
    except Exception as exc:  # closing a broken endpoint may complain; it is gone either way
        log.debug("closing a UCX endpoint: %s", exc)
        return None


def settle_quietly(future: asyncio.Future) -> None:
    """Nobody will await this future any more: cancel it, or mark its error as seen."""
    if not future.done():
        future.cancel()
    elif not future.cancelled():
        future.exception()


# -- progress


class Op:
    """One UCX request in flight and the buffer it uses (which must live while UCX may touch it)."""

    __slots__ = ("request", "buffer", "future", "error", "finished", "_after")

    def __init__(self, request, buffer, future):
        self.request = request
        self.buffer = buffer
        self.future = future  # None: nobody waits (an error is logged at debug level)
        self.error = None
        self.finished = False
        self._after = None

    def after(self, callback) -> None:
        """Call callback(op) once UCX is done with the request (now, if it is): from then on its
        buffer is the owner's again, whatever happened to whoever waited for it."""
        if self.finished:
            callback(self)
        elif self._after is None:
            self._after = [callback]
        else:
            self._after.append(callback)

    def _finish(self, error) -> None:
        self.finished = True
        self.error = error
        self.request = None  # frees UCX's request
        future = self.future
        if future is not None:
            if not future.done():
                if error is None:
                    future.set_result(None)
                else:
                    future.set_exception(error)
        elif error is not None:
            log.debug("UCX request failed: %s", error)
        callbacks, self._after = self._after, None
        for callback in callbacks or ():
            try:
                callback(self)
            except Exception:
                log.exception("UCX completion callback failed")


class Progress:
    """Drives one UCX worker from the asyncio loop it was made on.

    UCX moves bytes only inside worker progress calls (no progress thread runs).
    This makes them when the worker's event descriptor becomes readable and right
    after new requests are posted, then settles the requests that finished and
    re-arms the descriptor. Once shut down the worker is never progressed again,
    so UCX touches none of its buffers any more.
    """

    TICK = 0.05  # while requests are in flight, progress at least this often in case an event goes missing
    SHUTDOWN_PASSES = 3  # progress passes that let cancellations land before a worker is left alone

    def __init__(self, worker, loop: asyncio.AbstractEventLoop, on_progress=None):
        self.worker = worker
        self.loop = loop
        self.on_progress = on_progress  # called after each progress (the node takes new messages there)
        self.on_tick = None  # called every TICK while requests are in flight
        self.closed = False
        self._ops: list[Op] = []
        self._scheduled = False
        self._timer: asyncio.TimerHandle | None = None
        worker.init_blocking_progress_mode()
        self._fd = worker.epoll_file_descriptor
        loop.add_reader(self._fd, self.run)

    def track(self, request, buffer, future: bool = True) -> Op:
        """Follow a request just posted; its Op's future (unless future=False) settles when it finishes."""
        op = Op(request, buffer, self.loop.create_future() if future else None)
        if request.completed:  # eager messages often finish while being posted
            op._finish(_error_of(request))
        else:
            self._ops.append(op)
            self.kick()
        return op

    def forget(self, op: Op) -> None:
        """Cancel a request that has not matched anything (e.g. the value of a READ the node refused):
        the bindings cancel a request whose handle goes."""
        if op.finished:
            return
        try:
            self._ops.remove(op)
        except ValueError:
            pass
        if op.future is not None:
            settle_quietly(op.future)
        op.request = None
        self.kick()

    def kick(self) -> None:
        if not self._scheduled and not self.closed and not self.loop.is_closed():
            self._scheduled = True
            self.loop.call_soon(self.run)

    def run(self) -> None:
        self._scheduled = False
        if self.closed:
            return
        try:
            self.worker.progress()
        except Exception:  # a transport error surfaces on its requests too; keep the loop alive
            log.exception("UCX progress failed")
        self._settle()
        if self.on_progress is not None:
            try:
                self.on_progress()
            except Exception:  # one bad message must not stop the worker from being re-armed
                log.exception("handling UCX messages failed")
        if not self.worker.arm():  # events came in meanwhile: progress again before sleeping
            self.kick()
        if self._ops and self._timer is None:
            self._timer = self.loop.call_later(self.TICK, self._tick)

    def _tick(self) -> None:
        self._timer = None
        if self.on_tick is not None:
            try:
                self.on_tick()
            except Exception:
                log.exception("UCX watchdog failed")
        self.run()

    def _settle(self) -> None:
        if not self._ops:
            return
        pending = []
        for op in self._ops:
            if op.request.completed:
                op._finish(_error_of(op.request))
            else:
                pending.append(op)
        self._ops = pending

    def shutdown(self, error: BaseException, release: bool = False) -> None:
        """Stop driving the worker: requests in flight are cancelled and fail with `error`.

        Their buffers stay referenced through a few last progress passes (a transfer
        under way may still complete then), after which UCX never touches them again.
        release=True also runs their Op.after callbacks: only when nothing will reuse
        what those give back (the node is stopping).
        """
        if self.closed:
            return
        self._settle()
        ops, self._ops = self._ops, []
        for op in ops:
            if op.future is not None and not op.future.done():
                op.future.set_exception(error)  # whoever awaits it sees why
                op.future.exception()  # and nobody else need be told
            op.request = None  # cancels it
        for _ in range(self.SHUTDOWN_PASSES):
            try:
                self.worker.progress()
            except Exception:
                break
        self.closed = True
        if self._timer is not None:
            self._timer.cancel()
        if not self.loop.is_closed():
            self.loop.remove_reader(self._fd)
        for op in ops:
            if release:
                op._finish(error)
            else:
                op.finished, op.error, op._after = True, error, None
        self.worker = None


def _error_of(request):
    try:
        request.check_error()
    except Exception as exc:
        return exc
    return None


# -- the client's transport


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
                 min_rate: float = MIN_RATE, options: dict | None = None):
        """timeout: seconds an exchange may take on top of its bytes at min_rate bytes/s;
        options: UCX settings for this client (e.g. {"TLS": "tcp"}); see settings()."""
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
        greeting = CONNECT_MSG.pack(wire.MAGIC, PROTOCOL_VERSION) + bytes(worker.address)
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
                    options = options or NO_OPTIONS
                    size = len(data)
                    total += size
                    frame = wire.pack_request(_WRITE, req_id, key, generation, term, size, value_checksum,
                                              options.flags) + options.pack(size)
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
    if magic != wire.MAGIC or version != wire.VERSION or reply_op != op or reply_id != req_id:
        raise ProtocolError(f"node {address}: UCX reply (op {reply_op}, id {reply_id}) does not answer "
                            f"op {op}, id {req_id}")
    if status == Code.OK:
        return status, ""
    end = wire.REPLY.size + min(length, MAX_REPLY - wire.REPLY.size)
    return status, bytes(answer[wire.REPLY.size:end]).decode("utf-8", "replace")
