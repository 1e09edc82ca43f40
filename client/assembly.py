"""What a client is made of, shared by its operations (writes.py, reads.py, the lookups in aio.py and sync.py).

The options of AsyncClient / Client checked once, and the parts they build: the
link to the master, the data transport, the placement cache, the ends of puts
(commits.py), and how every wait is done (waiting.py, chosen by which client it is).
"""

import os

from kvpool.security import auth
from kvpool.protocol import transports as transport_names
from kvpool.protocol.cluster_layout import DEFAULT_CLUSTER
from kvpool.protocol.tenants import scope_of
from kvpool.errors import BatchError, InvalidArgumentError, KvpoolError
from kvpool.net.node_connections import DEFAULT_CONNECT_TIMEOUT
from kvpool.security.tls import client_files
from kvpool.objectstore.bucket import Bucket
from kvpool.objectstore.settings import settings_for
from kvpool.objectstore.stacked import StackedTier
from kvpool.objectstore.tier import BucketTier
from kvpool.sharedfs.file_gate import FileGate
from kvpool.sharedfs.files import SharedDir

from kvpool.client import compression
from kvpool.client.deadlines import DEFAULT_TIMEOUT, CallDeadline, check_timeout
from kvpool.client.waiting import LOOP_IO, LoopIO
from kvpool.client.master_link import DEFAULT_RPC_TIMEOUT, MasterLink
from kvpool.client.placement_cache import DEFAULT_CAPACITY, PlacementCache
from kvpool.client.selector import TransportSelector
from kvpool.client.transport import Transport
from kvpool.client.commits import Commits
from kvpool.client.device.transfers import DeviceTransfers

# A silent node gets less than a call's default deadline (deadlines.DEFAULT_TIMEOUT, 5 s), so a read moves on
# to another replica, and a put with min_replicas returns without that copy, before the call itself runs out.
DEFAULT_READ_TIMEOUT = 3.0
DEFAULT_WRITE_TIMEOUT = 3.0
# Unless given, a node's share of a call is at most this part of the call's timeout: a silent replica then leaves
# the call time to move on to another (a connector's 2 s calls wait 1.2 s for one node, not 3 s).
NODE_SHARE = 0.6
CLOSE_FLUSH_TIMEOUT = 2.0  # how long close() waits for the master's answers to posted put ends


class Core:
    """The parts of one client (options as AsyncClient's)."""

    def __init__(self, address: str | None = None, *, etcd: str | None = None,
                 cluster: str = DEFAULT_CLUSTER, replicas: int = 1, cache_size: int = DEFAULT_CAPACITY,
                 rpc_timeout: float = DEFAULT_RPC_TIMEOUT, connect_timeout: float = DEFAULT_CONNECT_TIMEOUT,
                 transport: Transport | None = None, compress_above: int | None = None,
                 read_timeout: float | None = None, transports: str | None = None,
                 token: str | None = None, confirm_puts: bool = False, tls_ca: str | None = None,
                 write_timeout: float | None = None, timeout: float = DEFAULT_TIMEOUT,
                 shared_dir: str | None = None, device_pool_size: int | None = None,
                 device_chunk_size: int | None = None, copy_engine=None, object_store: str | None = None,
                 io: LoopIO = LOOP_IO):
        if not isinstance(replicas, int) or replicas < 1:
            raise InvalidArgumentError(f"replicas must be a positive integer, got {replicas!r}")
        self.compress_above = compression.check_threshold(compress_above)
        try:
            credential = auth.caller_credential(token)
        except ValueError as exc:
            raise InvalidArgumentError(str(exc)) from None
        tls = client_files(tls_ca)
        # A tenant's keys are stored under its scope (kvpool/protocol/tenants.py): added to every key and
        # prefix it names here, taken off every key it is shown; "" for the others.
        self.prefix = scope_of(credential.tenant).prefix if credential is not None and credential.tenant else ""
        self.io = io
        self.master = MasterLink(address, etcd, cluster, rpc_timeout, io=io, credential=credential, tls=tls)
        if transport is None:
            try:
                allowed = transport_names.parse(transports if transports is not None
                                                else os.environ.get(transport_names.ENV))
            except ValueError as exc:
                raise InvalidArgumentError(str(exc)) from None
            if self.prefix:  # nodes offer tenants no shared memory (its mapping holds every tenant's bytes)
                allowed = [name for name in allowed if name != transport_names.SHM]
            transport = TransportSelector(connect_timeout, allowed, credential, io=io, tls=tls)
        self.transport = transport
        self.cache = PlacementCache(cache_size)
        # Device memory (CUDA) in any call that takes a buffer: the staging pipeline, its pool made on first use.
        self.devices = DeviceTransfers(io, self.transport, device_pool_size, device_chunk_size, copy_engine)
        # The shared tier's store, reachable from here too (its directory mounted, or its bucket): its objects
        # are read from there, no node between.
        self.shared = _shared_reader(shared_dir, object_store, cluster, self.prefix, token)
        self.shared_bytes = 0  # value bytes read from the shared tier's files by this client
        self.commits = Commits(self.master, self.cache.invalidate, confirm_puts)
        self.replicas = replicas  # copies written per put unless it says otherwise
        self.timeout = check_timeout(timeout)
        if read_timeout is None:
            read_timeout = min(DEFAULT_READ_TIMEOUT, NODE_SHARE * self.timeout)
        if write_timeout is None:
            write_timeout = min(DEFAULT_WRITE_TIMEOUT, NODE_SHARE * self.timeout)
        if not read_timeout > 0:
            raise InvalidArgumentError(f"read_timeout must be positive, got {read_timeout!r}")
        self.read_timeout = read_timeout
        # A mounted shared tier may fail or hang (an NFS server that stopped answering): each direct read runs in
        # a thread of this gate's, within the read timeout; meanwhile, and until its probe answers, reads go
        # through the nodes.
        self.shared_gate = FileGate(f"shared tier {shared_dir or object_store}", self.shared.probe, threads=8,
                                    timeout=read_timeout) if self.shared is not None else None
        if not write_timeout > 0:
            raise InvalidArgumentError(f"write_timeout must be positive, got {write_timeout!r}")
        self.write_timeout = write_timeout

    def stored(self, key):
        """The key stored for the key `key` this client names (its tenant's scope before it)."""
        return self.prefix + key if self.prefix and type(key) is str else key

    def stored_keys(self, keys: list) -> list:
        prefix = self.prefix
        return [prefix + key if type(key) is str else key for key in keys] if prefix else keys

    def named(self, stored: str) -> str:
        """The key this client names for a stored key of its scope."""
        return stored[len(self.prefix):] if self.prefix and stored.startswith(self.prefix) else stored

    def named_errors(self, exc: BatchError) -> BatchError:
        """`exc` keyed by the keys this client named."""
        if self.prefix:
            exc.errors = {self.named(key): error for key, error in exc.errors.items()}
        return exc

    def bounded(self, timeout: float | None, what: str, nbytes: int = 0, armed: bool = True) -> CallDeadline:
        """The deadline of one public call (`async with`): its own `timeout`, else the client's plus a
        second per 100 MB it moves (`nbytes`, when known), as a read's or a copy's. Not armed: only its
        end and how errors past it read (deadlines.CallDeadline without an io)."""
        seconds = self.timeout + nbytes / 100e6 if timeout is None else check_timeout(timeout)
        return CallDeadline(self.io if armed else None, seconds, what)

    def read_deadline(self, nbytes: int) -> float:
        """Seconds a replica may take to deliver `nbytes` before the read moves on."""
        return self.read_timeout + nbytes / 100e6

    def write_deadline(self, nbytes: int) -> float:
        """Seconds a node may take to store `nbytes` before its copy counts as failed."""
        return self.write_timeout + nbytes / 100e6

    async def close(self) -> None:
        try:
            await self.commits.flush(CLOSE_FLUSH_TIMEOUT)
        except KvpoolError:
            pass  # logged as each answer came
        await self.transport.close()
        await self.master.close()


def _shared_reader(shared_dir: str | None, object_store: str | None, cluster: str, prefix: str,
                   token: str | None):
    """A reader's view of the shared tier's directory or bucket, or None (`token`: the client's, which the key
    of an encrypted bucket comes from)."""
    if not shared_dir and not object_store:
        return None
    if prefix:
        raise InvalidArgumentError("a tenant reads shared objects through the nodes: the shared tier holds every "
                                   "tenant's objects (leave out shared_dir and object_store)")
    if not object_store:
        return SharedDir.reader(shared_dir, cluster)
    try:
        bucket = BucketTier(Bucket(settings_for(object_store)), cluster, None,
                            auth.read_token() if token is None else token)
    except ValueError as exc:
        raise InvalidArgumentError(str(exc)) from None
    # both: the directory, the bucket beneath it (kvpool/objectstore/stacked.py)
    return StackedTier(SharedDir.reader(shared_dir, cluster), bucket, 0) if shared_dir else bucket
