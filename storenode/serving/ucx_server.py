"""The node's UCX endpoint (optional extra kvpool[ucx]): WRITE and READ of the data protocol over ucxx.

Messages and their tags are laid out in kvpool/net/ucx_common.py. This is the listener: it takes CONNECT
(proving a ticket handed out in HELLO), REQUEST and BYE messages off the worker and hands each request to
its client's session (ucx_session.UcxSession), which serves them in order; what each does is
storenode/serving/ops.py's, as over TCP. UCX does not notice a dead client (error handling is off so that
shared memory can be used): a session with a request overdue is dropped, and so is one idle for
IDLE_TIMEOUT.
"""

import asyncio
import hmac
import logging
import time

from kvpool.security import auth
from kvpool.protocol import wire
from kvpool.net import ucx_common as layout
from kvpool.errors import Code, UnavailableError
from kvpool.net.ucx_common import Op, Progress, close_endpoint, load, new_context, new_worker

from kvpool.storenode.serving.ucx_session import UcxSession

log = logging.getLogger(__name__)

IDLE_TIMEOUT = 300.0  # seconds: told to clients in the offer, so they reconnect before this
WATCH_INTERVAL = 1.0  # how often deadlines and idleness are checked


class UcxServer:
    """Takes CONNECT, REQUEST and BYE messages off the worker and hands requests to their connection."""

    def __init__(self, store, server, context, worker):
        self.store = store
        self.server = server
        self.node = server.node
        self.metrics = server.metrics
        self.ucx = load()
        self._context = context
        self.worker = worker
        self.progress = Progress(worker, asyncio.get_running_loop(), on_progress=self._take_messages)
        self.connections: dict[int, UcxSession] = {}
        self.expected: dict[int, object] = {}  # tag of a message awaited by a connection -> handler(probe)
        self._next_conn = 0
        self._address = bytes(worker.address)
        self._process = layout.this_process()  # clients on this host check it lives while they wait
        self._watcher = asyncio.create_task(self._watch(), name="ucx-watch")
        self._stopped = False
        ucx = self.ucx
        self._probes = [(ucx.Tag(kind << layout.KIND_SHIFT), handler) for kind, handler in (
            (layout.CONNECT, self._on_connect), (layout.REQUEST, self._on_request), (layout.BYE, self._on_bye))]
        self._kind_mask = ucx.TagMask(layout.KIND_MASK)

    @property
    def offer(self) -> dict:
        """What a client needs to connect: goes into the node's HELLO reply and etcd record under "ucx"."""
        return {"address": self._address.hex(), "idle_timeout": IDLE_TIMEOUT, "version": layout.PROTOCOL_VERSION,
                **self._process}

    async def stop(self) -> None:
        """Drop every connection and free the worker (before the node unmaps its segments)."""
        if self._stopped:
            return
        self._stopped = True
        self._watcher.cancel()
        connections = list(self.connections.values())
        for connection in connections:
            connection.close("node stopping")
        await asyncio.gather(self._watcher, *(c.task for c in connections), return_exceptions=True)
        for connection in connections:
            # A finished task keeps its last frames (and the segment views in them) through its exception.
            connection.task = connection.endpoint = None
        self.progress.shutdown(UnavailableError("node stopping"), release=True)
        self.progress = None
        self.worker = None  # the last references: UCX destroys the worker and context now
        self._context = None

    # -- messages arriving

    def _take_messages(self) -> None:
        worker, mask = self.worker, self._kind_mask
        for tag, handler in self._probes:
            while True:
                probe = worker.tag_probe(tag, mask, remove=True)
                if not probe.matched:
                    break
                handler(probe)
        if self.expected:
            Tag = self.ucx.Tag
            for tag in list(self.expected):
                probe = worker.tag_probe(Tag(tag), remove=True)
                if probe.matched:
                    self.expected.pop(tag)(probe)

    def receive(self, probe, limit: int, future: bool = True):
        """Receive a probed message into a new buffer of its length: (Op, buffer), or (None, None)
        after discarding one longer than `limit`."""
        if probe.length > limit:
            self.discard(probe)
            return None, None
        buf = bytearray(probe.length)
        request = self.worker.tag_recv_with_handle(self.ucx.Array(buf), probe)
        return self.progress.track(request, buf, future), buf

    def discard(self, probe) -> None:
        """Consume a message nobody wants (a 1-byte receive truncates it; UCX then releases the sender)."""
        sink = bytearray(1)
        self.progress.track(self.worker.tag_recv_with_handle(self.ucx.Array(sink), probe), sink, future=False)

    def _on_connect(self, probe) -> None:
        nonce = probe.sender_tag.value & layout.LOW_MASK
        op, buf = self.receive(probe, layout.CONNECT_MSG.size + layout.MAX_WORKER_ADDRESS, future=False)
        if op is None:
            log.warning("ignored a UCX CONNECT of %d bytes", probe.length)
            return
        op.after(lambda _: self._connect(op, buf, nonce))

    def _connect(self, op: Op, buf: bytearray, nonce: int) -> None:
        if op.error is not None or self._stopped or len(buf) <= layout.CONNECT_MSG.size:
            return
        magic, version, role, ticket, proof = layout.CONNECT_MSG.unpack_from(buf)
        worker_address = bytes(buf[layout.CONNECT_MSG.size:])
        verifier = self.server.verifier
        if verifier.open:  # a node without a secret takes any peer as a member
            caller = auth.MEMBER
        else:  # no reply, not even an endpoint, for a peer that proves nothing
            taken = self.server.ucx_tickets.take(ticket)  # who the ticket was handed to, and their key
            if taken is None or taken[0].role != role or self.node.lapsed(taken[0]) or not hmac.compare_digest(
                    proof, auth.ticket_proof(taken[1], role, ticket, worker_address)):
                self.metrics.error("ucx_connect", "FORBIDDEN")
                log.warning("dropped a UCX CONNECT without a valid ticket and proof")
                return
            caller = taken[0]
        api = self.ucx.api
        try:
            endpoint = api.UCXEndpoint.create_from_worker_address(
                self.worker, api.UCXAddress.create_from_buffer(worker_address), False)
        except Exception as exc:  # e.g. no transport in common: the client times out and uses TCP
            log.info("cannot reach a UCX client back: %s", exc)
            return
        if magic != wire.MAGIC or version != layout.PROTOCOL_VERSION:
            answer = layout.ACCEPT_MSG.pack(wire.MAGIC, layout.PROTOCOL_VERSION, Code.PROTOCOL, 0)
            sent = self.progress.track(endpoint.tag_send(
                self.ucx.Array(answer), self.ucx.Tag(layout.tag_of(layout.ACCEPT, nonce))), answer, future=False)
            sent.after(lambda _: self.close_quietly(endpoint))
            return
        conn = self._new_conn_id()
        connection = UcxSession(self, conn, endpoint, caller)
        self.connections[conn] = connection
        self.metrics.connections.inc()
        answer = layout.ACCEPT_MSG.pack(wire.MAGIC, layout.PROTOCOL_VERSION, Code.OK, conn)
        connection.send(layout.tag_of(layout.ACCEPT, nonce), answer, 0)

    def close_quietly(self, endpoint) -> None:
        closing = close_endpoint(endpoint)
        if closing is not None:
            self.progress.track(closing, None, future=False)

    def _new_conn_id(self) -> int:
        while True:
            self._next_conn = self._next_conn % layout.MAX_CONN + 1
            if self._next_conn not in self.connections:
                return self._next_conn

    def _on_request(self, probe) -> None:
        low = probe.sender_tag.value & layout.LOW_MASK
        connection = self.connections.get(low >> layout.CONN_SHIFT)
        if connection is None:  # dropped meanwhile (timeout, idle): the client times out and reconnects
            self.discard(probe)
            return
        op, frame = self.receive(probe, layout.MAX_FRAME)
        if op is None:
            connection.close(f"request frame of {probe.length} bytes")
            return
        connection.last_used = time.monotonic()
        connection.queue.put_nowait((op, frame, low))

    def _on_bye(self, probe) -> None:
        low = probe.sender_tag.value & layout.LOW_MASK
        self.discard(probe)
        connection = self.connections.get(low >> layout.CONN_SHIFT)
        if connection is not None:
            connection.queue.put_nowait(None)  # after the requests that came before it

    async def _watch(self) -> None:
        while True:
            await asyncio.sleep(WATCH_INTERVAL)
            now = time.monotonic()
            for connection in list(self.connections.values()):
                if any(deadline < now for deadline in connection.deadlines.values()):
                    connection.close("a request took too long (client gone?)")
                elif not connection.deadlines and connection.queue.empty() \
                        and now - connection.last_used > IDLE_TIMEOUT:
                    connection.close("idle")


async def start_ucx(store, server, host: str) -> UcxServer | None:
    """A running UCX endpoint for this node, or None (logged) when UCX cannot be used here.

    `server` is the node's storenode.server.DataServer (its NodeOps, verifier and metrics are shared).
    `host` is the address the node serves TCP on; UCX picks its own interfaces (UCX_NET_DEVICES).
    """
    try:
        context = new_context()
        ucx_server = UcxServer(store, server, context, new_worker(context))
    except UnavailableError as exc:
        log.info("UCX transport not available: %s", exc)
        return None
    except Exception as exc:  # the native library failing in some other way must not stop the node
        log.warning("UCX transport not available: %r", exc)
        return None
    log.info("UCX endpoint ready beside %s (worker address of %d bytes)", host, len(ucx_server.offer["address"]) // 2)
    return ucx_server
