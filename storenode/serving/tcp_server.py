"""The node's data server over plain TCP (or TLS) on asyncio: its listener, and the limit on connections.

Each accepted connection is served by tcp_session.TcpSession (AUTH handshake, framing, requests in
order); what each request does is storenode/serving/ops.py's, shared with the UCX endpoint (ucx_server.py).
Slots (kvpool/sockets/admission.py): a connection that proved its credential holds one of
--max-connections; one still in its handshake holds one of --max-unproved (at most
--max-unproved-per-address from one address; past either, it displaces the oldest unproved connection) and
must prove itself within --frame-timeout of its accept. With every proved slot taken, a new connection is
turned away with one UNAVAILABLE reply.
"""

import asyncio
import logging
import socket

from kvpool.protocol import wire
from kvpool.security.auth import Tickets, Verifier
from kvpool.errors import Code
from kvpool.net.netutil import long_lived
from kvpool.sockets.admission import UNPROVED, UNPROVED_PER_ADDRESS, Admission
from kvpool.security.tls_socket import TlsSocket

from kvpool.storenode.background.replica_push import Copier
from kvpool.storenode.background.maintenance import Maintenance
from kvpool.storenode.background.shared_tier import SharedTier
from kvpool.storenode.serving.metrics import NodeMetrics
from kvpool.storenode.serving.ops import NodeOps
from kvpool.storenode.storage.store import ObjectStore
from kvpool.storenode.serving.tcp_session import TcpSession

log = logging.getLogger(__name__)

FRAME_TIMEOUT = 10.0  # default --frame-timeout: seconds a half-received request may go without a byte
MAX_CONNECTIONS = 4096  # default --max-connections (kept below the process's descriptor limit by main.py)
MAX_UNPROVED, MAX_UNPROVED_PER_ADDRESS = UNPROVED, UNPROVED_PER_ADDRESS  # --max-unproved[-per-address]
TURN_AWAY_DRAINS = 64  # connections past the limit being closed politely at once; more are closed outright
TURN_AWAY_DRAIN_SECONDS = 0.5


class DataServer:
    """offers: transport name -> what a client needs to use it, sent in HELLO ("shm" to clients
    of this host). verifier: the cluster's keys (an open Verifier takes any peer as a member).
    shared: storenode/background/shared_tier.py SharedTier, when this node mounts the shared tier."""

    def __init__(self, store: ObjectStore, maintenance: Maintenance, node_id: str,
                 metrics: NodeMetrics | None = None, instance: str = "", verifier: Verifier | None = None,
                 frame_timeout: float = FRAME_TIMEOUT, max_connections: int = MAX_CONNECTIONS,
                 credential=None, tls=None, idle_timeout: float = 0.0, max_unproved: int = MAX_UNPROVED,
                 max_unproved_per_address: int = MAX_UNPROVED_PER_ADDRESS, shared: SharedTier | None = None):
        self.store = store
        self.max_connections = max_connections  # more are turned away, so no peer can take every descriptor
        self.slots = Admission(max_connections, max_unproved, max_unproved_per_address)
        self.frame_timeout = frame_timeout  # a request half-received with no byte for this long closes its connection
        self.idle_timeout = idle_timeout  # a connection with no request for this long is closed (0: never)
        self.maintenance = maintenance
        self.node_id = node_id
        self.instance = instance
        self.verifier = verifier or Verifier(None)
        self.tls = tls  # kvpool/security/tls.py TlsFiles: every connection is TLS (kvpool/security/tls_socket.py)
        self._tls_context = tls.server_context() if tls is not None else None
        self.ucx_tickets = Tickets()  # handed out in HELLO, taken by UCX CONNECTs (storenode/serving/ucx_server.py)
        self.offers: dict[str, dict] = {}
        self.metrics = metrics or NodeMetrics()
        # COPY's WRITEs to other nodes prove the member role (over TLS too when the cluster uses it).
        copier = Copier(store, credential, tls.client_context() if tls is not None else None)
        self.node = NodeOps(store, maintenance, node_id, copier, self.verifier, shared)  # each request, any transport
        self._listener: socket.socket | None = None
        self._accept_task: asyncio.Task | None = None
        self._connections: dict[TcpSession, asyncio.Task] = {}
        self._turning_away: set[asyncio.Task] = set()

    async def start(self, host: str, port: int) -> tuple[str, int]:
        """Listen on host:port (0 = any free port); returns the bound (host, port)."""
        sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((host, port))
            sock.listen(1024)
            sock.setblocking(False)
        except BaseException:
            sock.close()
            raise
        self._listener = sock
        self._accept_task = asyncio.create_task(self._accept_loop(), name="data-accept")
        return sock.getsockname()[:2]

    async def stop(self) -> None:
        tasks = [t for t in (self._accept_task, *self._connections.values(), *self._turning_away) if t]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self._listener:
            self._listener.close()
        await self.node.copier.close()

    def proved(self, session: TcpSession) -> bool:
        """The session's peer proved its credential: True if it now holds a proved slot; False if none
        is free (the session turns it away) or it was displaced meanwhile."""
        return self.slots.prove(session)

    def end_lapsed_tenants(self) -> int:
        """Close every connection whose tenant's token ended (rotated or deleted: NodeOps.lapsed), at once, idle
        ones too (their requests would be refused); how many. Called whenever the tenants' records change
        (kvpool/cluster/tenant_directory.py)."""
        lapsed = [task for session, task in self._connections.items() if self.node.lapsed(session.caller)]
        for task in lapsed:
            task.cancel()
        return len(lapsed)

    def turned_away_frame(self) -> bytes:
        return wire.pack_error(wire.TURNED_AWAY, 0, Code.UNAVAILABLE,
                               f"node at its limit of {self.max_connections} connections")

    def _turn_away(self, sock: socket.socket) -> None:
        """A connection past --max-connections: one UNAVAILABLE reply (op TURNED_AWAY), then closed. What
        the peer sent meanwhile is read and dropped for a moment first: closing on unread input resets
        the connection, and a reset can destroy the reply before the peer reads it."""
        self.metrics.error("accept", "UNAVAILABLE")
        try:
            sock.setblocking(False)
            sock.send(self.turned_away_frame())
            sock.shutdown(socket.SHUT_WR)
        except OSError:
            sock.close()
            return
        if len(self._turning_away) >= TURN_AWAY_DRAINS:  # a flood: no time for manners
            sock.close()
            return
        task = asyncio.create_task(self._drain_and_close(sock))
        self._turning_away.add(task)
        task.add_done_callback(self._turning_away.discard)

    async def _drain_and_close(self, sock: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(TURN_AWAY_DRAIN_SECONDS):
                while await loop.sock_recv(sock, 65536):
                    pass
        except (TimeoutError, OSError):
            pass
        finally:
            sock.close()

    async def _accept_loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            try:
                sock, _ = await loop.sock_accept(self._listener)
            except OSError as exc:  # e.g. out of file descriptors: keep serving the open connections
                log.warning("accept failed: %s", exc)
                await asyncio.sleep(0.1)
                continue
            if self.slots.full:
                self._turn_away(sock)
                continue
            try:
                address = sock.getpeername()[0]
            except OSError:  # already gone
                sock.close()
                continue
            sock.setblocking(False)
            long_lived(sock)  # a client that goes silent is dropped, and what it held released
            if self._tls_context is not None:
                sock = TlsSocket(sock, self._tls_context, server_side=True)
            session = TcpSession(self, sock)
            _, displaced = self.slots.admit(session, address)
            for old in displaced:  # an unproved connection pushed out by this newer one
                self.metrics.error("accept", "DISPLACED")
                self._connections[old].cancel()
            if self.verifier.open:  # every peer is a member: there is no handshake to wait for
                self.slots.prove(session)
            task = asyncio.create_task(session.run())
            self._connections[session] = task
            task.add_done_callback(lambda _task, session=session: self._ended(session))

    def _ended(self, session: TcpSession) -> None:
        self._connections.pop(session, None)
        self.slots.forget(session)
