"""The client's link to the leading master, found from a list of masters or through etcd.

A master is known by its gRPC address. Calls go to its control port
(control_link.py, or control_blocking.py for the blocking io: one round trip
instead of gRPC's several) once the link knows it: from the master's etcd
record, a NOT_LEADER answer naming the leader, or else the Stats of the master
it first reaches, which also lists every other master, so a client given one
address can fail over to the others.
A master without a control port is called over gRPC, as are streams.

Every failure leaves here as a kvpool.errors type: a status in a response
becomes its typed error (see convert.check), an unreachable master becomes
UnavailableError. A master that does not lead answers NOT_LEADER naming the
leader (over gRPC: FAILED_PRECONDITION with the leader's address in the
"kvpool-leader" trailing metadata, see the end of kvpool.proto): the link
switches to that master and retries. With several masters known, or etcd, an
unreachable master is also retried elsewhere (the next known one, or whoever
etcd names) until the RPC timeout ends; and a silent one (its host cut off:
nothing answers, nothing is refused) is left after ATTEMPT_TIMEOUT, far less
than the RPC timeout, so a client finds a new leader in about the time the
election takes. A call left this way may have been applied: it is sent again
elsewhere, as after a lost connection. A master that answers it cannot serve
because etcd is silent to it (ClusterUnavailableError) is not waited out: the
call fails at once, after asking each other master it knows once. Every call
also ends by its caller's deadline (client/deadlines.py): on the loop its
timeout cancels the call; for the blocking io, `io.deadline()` bounds each
attempt, and a call out of time sends nothing.
"""

import asyncio
import json
import time

import grpc
from kvpool.proto import kvpool_pb2 as pb
from kvpool.proto import kvpool_pb2_grpc

from kvpool.protocol.cluster_layout import DEFAULT_CLUSTER, master_key, parse_hostport
from kvpool.protocol.control import LOOKUP, OP_BY_RPC, LeaderHint, NotSent, pack_keys
from kvpool.security.grpc_auth import MasterName, client_interceptors
from kvpool.errors import (
    ClusterUnavailableError,
    ForbiddenError,
    InternalError,
    InvalidArgumentError,
    NotLeaderError,
    ProtocolError,
    UnavailableError,
)

from kvpool.client.waiting import LOOP_IO, LoopIO

DEFAULT_RPC_TIMEOUT = 10.0
ATTEMPT_TIMEOUT = 2.0  # with another master to turn to: how long one may stay silent before the next is tried
_CHANNEL_OPTIONS = (
    # A restarted master should be found again in well under a second, not after gRPC's 1s+ backoff.
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 2000),
    ("grpc.max_receive_message_length", 64 * 1024 * 1024),
    ("grpc.max_send_message_length", 64 * 1024 * 1024),
)
_UNREACHABLE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED)
_ELSEWHERE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)  # another master may answer


LEADER_METADATA = "kvpool-leader"
# First and longest pause before asking again when nothing new is known (no leader named). The longest
# bounds how late a client finds a new leader once it serves: at 0.5 s, a put after a takeover came up to
# 0.8 s after the new leader began serving.
RETRY_BACKOFF = (0.02, 0.2)


def _leader_hint(exc: grpc.aio.AioRpcError) -> str | None:
    """The leader a NOT_LEADER answer names ("" if none is elected); None if it is not such an answer."""
    if exc.code() != grpc.StatusCode.FAILED_PRECONDITION:
        return None
    for key, value in exc.trailing_metadata() or ():
        if key == LEADER_METADATA:
            return value.decode() if isinstance(value, bytes) else value
    return None


class MasterLink:
    def __init__(self, address: str | None = None, etcd: str | None = None,
                 cluster: str = DEFAULT_CLUSTER, rpc_timeout: float = DEFAULT_RPC_TIMEOUT,
                 io: LoopIO = LOOP_IO, credential=None, tls=None):
        if (address is None) == (etcd is None):
            raise InvalidArgumentError("give either the master address(es) or the etcd endpoint (not both)")
        self.addresses = [a.strip() for a in address.split(",") if a.strip()] if address is not None else []
        if address is not None and not self.addresses:
            raise InvalidArgumentError(f"no master address in {address!r}")
        for endpoint in [*self.addresses, *([etcd] if etcd else [])]:
            try:
                parse_hostport(endpoint)
            except ValueError as exc:
                raise InvalidArgumentError(str(exc)) from None
        self.address = self.addresses[0] if self.addresses else None
        self.etcd = etcd
        self.cluster = cluster
        self.rpc_timeout = rpc_timeout
        self.attempt_timeout = min(rpc_timeout, ATTEMPT_TIMEOUT)
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._stubs: dict[str, kvpool_pb2_grpc.MasterStub] = {}
        self._names: dict[str, MasterName] = {}  # master (address dialled) -> the name its call proofs are for
        self._controls: dict[str, str] = {}  # master (gRPC address) -> its control port ("": none)
        self._learning: dict[str, asyncio.Future] = {}  # Stats asked of a master, shared by its callers
        self.credential = credential  # proved on every call (kvpool/security/auth.py, kvpool/security/grpc_auth.py)
        self.tls = tls  # kvpool/security/tls.py TlsFiles: every connection to a master (and etcd) is TLS
        self.io = io  # how calls wait (client/waiting.py)
        self._links = io.control_links(credential, tls)
        self.lookups = True  # ask LOOKUP (lookup_now) until a master answers it does not know it

    @property
    def _can_move(self) -> bool:
        """Whether another master may answer when this one cannot."""
        return self.etcd is not None or len(self.addresses) > 1

    def _attempt_end(self, now: float, deadline: float) -> float:
        """When an attempt on one master gives up (loop time): with another master to turn to, a silent one
        is left after attempt_timeout and the call goes on elsewhere until `deadline`."""
        return min(deadline, now + self.attempt_timeout) if self._can_move else deadline

    def _stub(self, address: str) -> kvpool_pb2_grpc.MasterStub:
        stub = self._stubs.get(address)
        if stub is None:
            name = self._names[address] = MasterName(address)
            interceptors = client_interceptors(self.credential, name)
            if self.tls is not None:
                channel = grpc.aio.secure_channel(address, self.tls.grpc_channel_credentials(),
                                                  options=_CHANNEL_OPTIONS, interceptors=interceptors)
            else:
                channel = grpc.aio.insecure_channel(address, options=_CHANNEL_OPTIONS, interceptors=interceptors)
            self._channels[address] = channel
            stub = self._stubs[address] = kvpool_pb2_grpc.MasterStub(channel)
        return stub

    async def call(self, method: str, request, failed: Exception | None = None, deadline: float | None = None):
        """Invoke Master.<method> on the leader; the response is returned as is (statuses unchecked).
        failed, deadline: what call_now's attempt on the leader's control port ended with, and by
        when it had to be answered; that failure is followed as if it happened here."""
        loop = asyncio.get_running_loop()
        deadline = self._deadline(loop.time(), deadline)
        pause = RETRY_BACKOFF[0]
        if self.address is None:
            self.address = await self._resolve()
        relearned = False
        unserved = set()  # masters that answered they cannot serve (ClusterUnavailableError)
        attempted = False
        while True:
            address = self.address
            if not attempted and failed is None and loop.time() >= deadline:  # the caller's deadline came first
                raise UnavailableError(f"master {address} {method}: no time left to call it")
            attempted = True
            try:
                if failed is not None:
                    error, failed = failed, None
                    raise error
                attempt_end = self._attempt_end(loop.time(), deadline)
                control = self._controls.get(address)
                if control is None and method in OP_BY_RPC:
                    control = await self._learn(address, attempt_end)
                if control and method in OP_BY_RPC:
                    return await self._links.call(control, method, request, attempt_end)
                # Posted calls first: a gRPC call must not overtake what this client sent before it.
                await self._links.drain(deadline)
                remaining = attempt_end - loop.time()
                return await getattr(self._stub(address), method)(request, timeout=max(remaining, 0.001))
            except grpc.aio.AioRpcError as exc:
                pause = await self._move_on(method, exc, address, deadline, pause)
            except LeaderHint as hint:
                self._know(hint.leader, hint.control_address)
                pause = await self._follow(hint.leader, False, NotLeaderError(f"{hint} (no leader answered in time)"),
                                           address, deadline, pause)
            except ClusterUnavailableError:
                # The master is there but cannot confirm any leader (etcd is silent to it): fail now, unless
                # another master not asked yet in this call may lead.
                if not self._can_move or address in unserved:
                    raise
                unserved.add(address)
                self.address = await self._other_master(address)
            except UnavailableError as exc:
                self._controls.pop(address, None)
                # (Another caller may have found it gone first: a posted PutEnd retried.)
                if isinstance(exc, NotSent) and not relearned:
                    relearned = True  # its port may have moved (a master restarted): ask its Stats again
                    continue
                pause = await self._follow(None, True, exc, address, deadline, pause)

    def _deadline(self, now: float, deadline: float | None) -> float:
        """When a call made now must be answered: the RPC timeout, the `deadline` its caller gave or the
        one the io's timeouts set (a blocking socket's waits), whichever comes first."""
        end = now + self.rpc_timeout if deadline is None else min(deadline, now + self.rpc_timeout)
        bound = self.io.deadline()
        return end if bound is None or bound > end else bound

    def call_now(self, method: str, request, deadline: float | None = None):
        """call() answered in this thread without running the event loop, for the blocking io: over the
        leader's control connection when it is known; anything more (finding the leader, following a
        NOT_LEADER, a lost connection, gRPC) continues as call() on the io's loop. deadline: when the
        caller's call ends (time.monotonic); TimeoutError if it comes while waiting on the loop."""
        now = time.monotonic()  # the event loop's clock
        deadline = self._deadline(now, deadline)
        control = self._controls.get(self.address) if self.address is not None else None
        if not control or method not in OP_BY_RPC:
            return self.io.run(self._call_by(deadline, method, request, None))
        try:
            return self._links.call_now(control, method, request, self._attempt_end(now, deadline))
        except (LeaderHint, UnavailableError) as exc:
            return self.io.run(self._call_by(deadline, method, request, exc))

    async def _call_by(self, deadline: float, method: str, request, failed: Exception | None):
        async with self.io.timeout(max(deadline - time.monotonic(), 0.0)):
            return await self.call(method, request, failed, deadline)

    def lookup_now(self, keys: list[str], batch_exists, deadline: float | None = None):
        """Whether each of `keys` (valid) exists, for the blocking io: a LOOKUP (control.LOOKUP, BatchExists
        without a hold in a frame without protobuf) answered in this thread on the leader's control
        connection: a list of bools. Anything else, as call_now does: BatchExists (the request
        `batch_exists()` makes), whose response is returned as is: before a control port is known, to a
        master older than LOOKUP (it answers PROTOCOL; this link asks BatchExists from then on) and to
        follow a NOT_LEADER or a lost connection. A lookup changes nothing: asking again is safe."""
        control = self._controls.get(self.address) if self.address is not None and self.lookups else None
        if not control:
            return self.call_now("BatchExists", batch_exists(), deadline)
        now = time.monotonic()  # the event loop's clock
        deadline = self._deadline(now, deadline)
        try:
            return self._links.call_now(control, LOOKUP, pack_keys(keys), self._attempt_end(now, deadline))
        except ProtocolError:
            self.lookups = False
            return self.call_now("BatchExists", batch_exists(), deadline)
        except (LeaderHint, UnavailableError) as exc:
            return self.io.run(self._call_by(deadline, "BatchExists", batch_exists(), exc))

    async def lookup(self, keys: list[str], batch_exists):
        """lookup_now on the loop (AsyncClient): a LOOKUP on the leader's control connection when one is
        open, else, and to follow an older master, a NOT_LEADER or a lost connection, BatchExists by call()."""
        control = self._controls.get(self.address) if self.address is not None and self.lookups else None
        if not control:
            return await self.call("BatchExists", batch_exists())
        now = asyncio.get_running_loop().time()
        deadline = self._deadline(now, None)
        try:
            return await self._links.call(control, LOOKUP, pack_keys(keys), self._attempt_end(now, deadline))
        except ProtocolError:
            self.lookups = False
            return await self.call("BatchExists", batch_exists(), None, deadline)
        except (LeaderHint, UnavailableError) as exc:
            return await self.call("BatchExists", batch_exists(), exc, deadline)

    def post(self, method: str, request, callback) -> bool:
        """Send Master.<method> to the leader's control port without waiting for the answer, which
        goes to callback(response or error) once read; later calls through this link reach the
        master after it. False, with nothing sent, when no control connection to the leader is open
        (then call() it)."""
        control = self._controls.get(self.address) if self.address is not None else None
        if not control:
            return False
        deadline = time.monotonic() + self.rpc_timeout  # the event loop's clock
        return self._links.post(control, method, request, deadline, callback)

    async def drain(self, timeout: float | None = None) -> None:
        """Wait for the answers of every posted call."""
        loop = asyncio.get_running_loop()
        await self._links.drain(loop.time() + (self.rpc_timeout if timeout is None else timeout))

    async def _learn(self, address: str, deadline: float) -> str:
        """The control port of the master at `address` ("" if it has none), from its Stats, which
        also names the other masters; one Stats per master, whoever asks."""
        learning = self._learning.get(address)
        if learning is None:
            learning = self._learning[address] = asyncio.ensure_future(self._ask_stats(address, deadline))
            learning.add_done_callback(self._learned)
        return await asyncio.shield(learning)

    def _learned(self, learning: asyncio.Future) -> None:
        for address, pending in list(self._learning.items()):
            if pending is learning:
                del self._learning[address]
        if not learning.cancelled():
            learning.exception()  # retrieved: it reached the callers that waited, if any still did

    async def _ask_stats(self, address: str, deadline: float) -> str:
        remaining = max(deadline - asyncio.get_running_loop().time(), 0.001)
        stats = await self._stub(address).Stats(pb.StatsRequest(), timeout=remaining)
        self._names[address].learned(stats.address)
        self._know(address, stats.control_address)
        for other in (stats.leader, *stats.followers):
            self._know(other, None)
        return stats.control_address

    def _know(self, address: str, control: str | None) -> None:
        """Note a master (and its control port when known): another one to fail over to."""
        if not address:
            return
        if address not in self.addresses and self.etcd is None:
            self.addresses.append(address)
        if control is not None:
            self._controls[address] = control

    async def stream(self, method: str, request, idle_timeout: float | None = None):
        """Messages of the server stream Master.<method> from the leader.

        Until the first message, NOT_LEADER and an unreachable master are followed as in call()
        (for up to rpc_timeout); after it, a broken stream raises (NotLeaderError, UnavailableError)
        and the caller decides how to resume. No message for `idle_timeout` seconds is
        UnavailableError too (the master may be gone without the connection noticing)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.rpc_timeout
        pause = RETRY_BACKOFF[0]
        if self.address is None:
            self.address = await self._resolve()
        await self._links.drain(deadline)  # what this client posted comes first
        while True:
            address = self.address
            stub, call = self._stub(address), None
            try:
                try:
                    if not self._names[address].confirmed:  # its call proofs name the master: ask its Stats first
                        await self._learn(address, deadline)
                    call = getattr(stub, method)(request)
                    message = await asyncio.wait_for(call.read(), max(deadline - loop.time(), 0.001))
                except TimeoutError:
                    raise UnavailableError(f"master {address} {method}: no answer in {self.rpc_timeout:g}s") from None
                except grpc.aio.AioRpcError as exc:
                    pause = await self._move_on(method, exc, address, deadline, pause)
                    continue
                while message is not grpc.aio.EOF:
                    yield message
                    try:
                        message = await asyncio.wait_for(call.read(), idle_timeout)
                    except TimeoutError:
                        raise UnavailableError(f"master {address} {method}: no message for {idle_timeout:g}s") from None
                    except grpc.aio.AioRpcError as exc:
                        raise self._error(method, exc) from None
                return
            finally:
                if call is not None:
                    call.cancel()

    async def _move_on(self, method: str, exc: grpc.aio.AioRpcError, address: str, deadline: float,
                       pause: float) -> float:
        """After `exc` from the master at `address`: go to the leader it named, or to the next master
        after a pause; returns the next pause. Raises the typed error when nothing else may answer in time."""
        return await self._follow(_leader_hint(exc), exc.code() in _ELSEWHERE,
                                  self._error(method, exc), address, deadline, pause)

    async def _follow(self, leader: str | None, unreachable: bool, error: Exception, address: str,
                      deadline: float, pause: float) -> float:
        """After a call to `address` failed with `error`: go to the `leader` it named (None: not a
        NOT_LEADER answer; "": no leader elected), or, when it is unreachable or names nobody, to the
        next master after a pause; returns the next pause. Raises `error` when nothing else may answer
        in time."""
        loop = asyncio.get_running_loop()
        if leader is None and (not unreachable or not self._can_move):
            raise error from None
        if deadline - loop.time() <= 0:
            raise error from None
        if leader and leader != address:
            self.address = leader  # told where to go: no pause
            return pause
        # Nobody named (no leader yet, or this one is gone): look elsewhere after a pause.
        await asyncio.sleep(min(pause, max(0.0, deadline - loop.time())))
        if deadline - loop.time() <= 0:
            raise error from None  # no time left for another attempt
        try:
            self.address = await self._next_address(address)
        except UnavailableError:
            if deadline - loop.time() <= 0:
                raise
        return min(pause * 2, RETRY_BACKOFF[1])

    async def _other_master(self, address: str) -> str:
        """The master to ask after `address` (itself when nothing else is known in time)."""
        try:
            return await self._next_address(address)
        except UnavailableError:
            return address

    async def _next_address(self, failed: str) -> str:
        if self.etcd is not None:
            return await self._resolve(self.attempt_timeout)
        if failed in self.addresses:
            return self.addresses[(self.addresses.index(failed) + 1) % len(self.addresses)]
        return self.addresses[0]

    def _error(self, method: str, exc: grpc.aio.AioRpcError):
        code = exc.code()
        text = f"master {self.address or '?'} {method}: {code.name}: {exc.details()}"
        if _leader_hint(exc) is not None:
            return NotLeaderError(text + " (no leader answered in time)")
        if code in _UNREACHABLE:
            return UnavailableError(text)
        if code == grpc.StatusCode.INVALID_ARGUMENT:
            return InvalidArgumentError(text)
        if code in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED):
            return ForbiddenError(text)
        return InternalError(text)

    async def _resolve(self, timeout: float | None = None) -> str:
        """The master address registered in etcd for this cluster (etcd answering within `timeout`,
        by default the RPC timeout)."""
        import aetcd  # only etcd-configured clients need it

        from kvpool.cluster.etcd_client import EtcdClient

        host, port = parse_hostport(self.etcd)
        try:
            # A client only reads the leader's address there, and the master proves the secret to it: an etcd
            # with authentication off is the cluster's to refuse (its master and nodes do), not each client's.
            async with EtcdClient(host, port, self.credential, timeout=timeout or self.rpc_timeout,
                                  tls=self.tls, allow_open=True) as etcd:
                record = await etcd.get(master_key(self.cluster))
        except (aetcd.exceptions.ClientError, grpc.aio.AioRpcError, OSError) as exc:
            raise UnavailableError(f"etcd {self.etcd} unreachable: {exc}") from None
        if record is None or not record.value:
            raise UnavailableError(f"no master registered in etcd {self.etcd} for cluster {self.cluster!r}")
        try:
            value = json.loads(record.value)
            address = value["address"]
        except (ValueError, KeyError, TypeError) as exc:
            raise UnavailableError(f"unreadable master record in etcd: {exc!r}") from None
        if isinstance(value.get("control_address"), str):  # a master without one: Stats will tell
            self._controls[address] = value["control_address"]
        return address

    async def close(self) -> None:
        await self._links.close()
        channels = list(self._channels.values())
        self._channels, self._stubs, self._names = {}, {}, {}
        for channel in channels:
            await channel.close()
