"""What both ends of the UCX data path share (client/ucx.py, storenode/serving/ucx_server.py and ucx_session.py):
the message layout, loading ucxx (the optional extra kvpool[ucx]), contexts and workers, and the
progress driver.

Messages are tag-matched. A tag is kind (8 bits) | connection id (24 bits,
handed out by the node) | request id (32 bits, unique per client):

  client -> node  CONNECT  low 56 bits: a nonce; body: CONNECT_MSG + the client's worker address
                           (CONNECT_MSG's proof: kvpool/security/auth.py ticket_proof over a ticket the node gave
                           the client in a HELLO on its authenticated TCP connection, and the worker
                           address; a CONNECT that proves nothing is dropped unanswered)
  node -> client  ACCEPT   the same nonce; body: ACCEPT_MSG (status, connection id)
  client -> node  REQUEST  a kvpool.protocol.wire REQUEST frame: header, key and, for a WRITE, WRITE_OPTIONS
  client -> node  PAYLOAD  a WRITE's value
  node -> client  REPLY    a kvpool.protocol.wire REPLY frame, with the error message when status != OK
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

Progress: a worker is driven by the asyncio loop that uses it, through the
worker's event file descriptor (no progress thread and no busy polling), so it
only progresses while that loop runs. A blocking client's loop runs during each
call, which is exactly when replies are due.
"""

import asyncio
import functools
import logging
import os
import struct
from typing import NamedTuple

from ..protocol import transports, wire
from ..errors import UnavailableError
from ..protocol.keys import MAX_KEY_BYTES

log = logging.getLogger(__name__)

# -- message layout

CONNECT, ACCEPT, REQUEST, PAYLOAD, REPLY, DATA, BYE = range(1, 8)
KIND_SHIFT = 56
KIND_MASK = 0xFF << KIND_SHIFT
CONN_SHIFT = 32
MAX_CONN = (1 << 24) - 1
LOW_MASK = (1 << KIND_SHIFT) - 1
CONN_MASK = MAX_CONN << CONN_SHIFT
PROTOCOL_VERSION = 2  # 2: CONNECT carries a proof
CONNECT_MSG = struct.Struct("<2sBB32s32s")  # magic, version, role, ticket, proof; the worker address follows
ACCEPT_MSG = struct.Struct("<2sBBI")  # magic, version, status (kvpool.errors.Code), connection id
MAX_FRAME = wire.REQUEST.size + MAX_KEY_BYTES + wire.WRITE_OPTIONS.size
MAX_REPLY = wire.REPLY.size + 4096  # wire.pack_error cuts messages at 4096 bytes
MAX_WORKER_ADDRESS = 64 * 1024


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
