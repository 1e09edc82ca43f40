"""The placement record: every committed object's metadata, kept in etcd by the leader.

A master that takes over (after the leader died, or after every master was
down) rebuilds its object table from this record and then checks it against what
the nodes really hold (takeover.py).

Layout: /kvpool/<cluster>/objects/<key> = JSON of the ObjectVersion (codec below).

Writes are group-committed: the table marks changed keys; one flusher takes all
of them at once (waiting LINGER first when the last flush answered concurrent
requests) and writes their current state in transactions of at most
MAX_TXN_OPS operations (etcd's default limit), so many concurrent puts share one
round trip. `sync()` returns once everything changed before the call is durable;
PutEnd and every other changing RPC answer only after it. Every transaction is
fenced on the leader's election key still having the creation revision it won
with (its term): a deposed leader's write is refused by etcd itself.
"""

import asyncio
import dataclasses
import json
import logging
import time

import aetcd
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from kvpool import cluster_layout
from kvpool.errors import NotLeaderError, UnavailableError

from .objects import ObjectTable, ObjectVersion, PutOptions, Replica

log = logging.getLogger(__name__)

MAX_TXN_OPS = 128       # etcd's default --max-txn-ops
IDLE_CHECK = 0.05       # changes made outside an RPC (node loss, expiry) are flushed at least this often
LINGER = 0.002          # under concurrent changes, how long a flush waits for more to join it
RETRY_DELAY = 0.2       # after a failed (not fenced) transaction
LOAD_PAGE = 1000        # records read per range request when loading
COMPACT_INTERVAL = 60.0


objects_prefix = cluster_layout.objects_prefix


# ----- codec -----

def encode(version: ObjectVersion, table_now: float, wall_now: float) -> bytes:
    """JSON of every field of the version; the expiry, kept on the table's monotonic clock,
    is stored as wall-clock time so another process can read it."""
    data = {}
    for f in dataclasses.fields(version):
        value = getattr(version, f.name)
        if f.name == "replicas":
            value = [dataclasses.asdict(r) for r in value]
        elif f.name == "options":
            value = dataclasses.asdict(value)
        elif f.name == "expires_at":
            f_name = "expires_wall"
            data[f_name] = None if value is None else wall_now + (value - table_now)
            continue
        data[f.name] = value
    return json.dumps(data, separators=(",", ":")).encode()


def _known(cls, data: dict) -> dict:
    names = {f.name for f in dataclasses.fields(cls)}
    return {k: v for k, v in data.items() if k in names}


def decode(raw: bytes, table_now: float, wall_now: float) -> ObjectVersion:
    """The version a record describes (ValueError if it is not one); fields this version of
    the code does not know are ignored, missing ones take their defaults."""
    try:
        data = json.loads(raw)
        replicas = tuple(Replica(**_known(Replica, r)) for r in data.pop("replicas", ()))
        options = PutOptions(**_known(PutOptions, data.pop("options", None) or {}))
        expires_wall = data.pop("expires_wall", None)
        expires_at = None if expires_wall is None else table_now + (expires_wall - wall_now)
        return ObjectVersion(**_known(ObjectVersion, data), replicas=replicas, options=options,
                             expires_at=expires_at)
    except (TypeError, KeyError, AttributeError) as exc:
        raise ValueError(f"not a placement record: {exc}") from None


# ----- the writer -----

class Fence:
    """What a leader's transactions are conditioned on: its election key, created at `term`."""

    def __init__(self, key: bytes, term: int):
        self.key, self.term = key, term


class PlacementRecord:
    def __init__(self, etcd: aetcd.Client, cluster: str, table: ObjectTable, fence: Fence,
                 max_ops: int = MAX_TXN_OPS, linger: float = LINGER, clock=time.monotonic):
        self._etcd = etcd
        self._prefix = objects_prefix(cluster)
        self._table = table
        self.fence = fence
        self._max_ops = max_ops
        self._linger = linger
        self._last_batch = 0  # requests the last flush answered: more than one means they are concurrent
        self._clock = clock
        self._wake = asyncio.Event()
        self._taken = 0    # flushes started (each takes every change marked until then)
        self._durable = 0  # flushes whose every transaction succeeded
        self._waiters: list[tuple[int, asyncio.Future]] = []
        self.fenced: NotLeaderError | None = None
        self.lost = asyncio.Event()  # set when etcd refused a transaction: this master no longer leads
        self.txns = 0
        self.ops = 0

    # ----- for the service -----

    async def sync(self) -> None:
        """Return once every change made before this call is in etcd."""
        if self.fenced is not None:
            raise self.fenced
        want = self._taken + 1 if self._table.has_changes else self._taken
        if self._durable >= want:
            return
        future = asyncio.get_running_loop().create_future()
        self._waiters.append((want, future))
        self._wake.set()
        await future

    # ----- the flusher -----

    async def run(self) -> None:
        try:
            while True:
                try:
                    await asyncio.wait_for(self._wake.wait(), IDLE_CHECK)
                except TimeoutError:
                    pass
                self._wake.clear()
                if self._table.has_changes:
                    if self._last_batch > 1:
                        # Requests come in concurrently: a moment's wait lets more share the transaction.
                        await asyncio.sleep(self._linger)
                    await self._flush()
        except NotLeaderError as exc:
            self._refuse(exc)
            self.lost.set()
        except asyncio.CancelledError:
            # Stopped with its term (stepping down): what still waits must not wait for ever, nor
            # be told it is durable.
            self._refuse(NotLeaderError(f"leadership of term {self.fence.term} ended"))
            raise

    def _refuse(self, exc: NotLeaderError) -> None:
        """From now on sync() raises `exc`, and so does every sync() waiting now."""
        self.fenced = exc
        for _, future in self._waiters:
            if not future.done():
                future.set_exception(exc)
        self._waiters.clear()

    async def _flush(self) -> None:
        self._taken += 1
        epoch = self._taken
        self._last_batch = len(self._waiters)  # requests waiting on this flush
        keys = self._table.take_changed_keys()
        table_now, wall_now = self._clock(), time.time()
        ops = []
        for key in keys:
            version = self._table.lookup(key)
            path = self._prefix + key.encode()
            if version is None:
                ops.append(self._etcd.transactions.delete(path))
            else:
                ops.append(self._etcd.transactions.put(path, encode(version, table_now, wall_now)))
        chunks = [ops[i:i + self._max_ops] for i in range(0, len(ops), self._max_ops)]
        await asyncio.gather(*(self._commit(chunk) for chunk in chunks))
        self._durable = epoch
        still = []
        for want, future in self._waiters:
            if want <= epoch:
                if not future.done():
                    future.set_result(None)
            else:
                still.append((want, future))
        self._waiters = still

    async def _commit(self, ops: list) -> None:
        """One fenced transaction, retried until etcd answers; NotLeaderError if the fence failed."""
        tx = self._etcd.transactions
        while True:
            try:
                succeeded, _ = await self._etcd.transaction(
                    compare=[tx.create(self.fence.key) == self.fence.term], success=ops, failure=[])
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - etcd away: the answers wait, the leader keeps trying
                log.warning("writing the placement record failed (%s: %s); retrying", type(exc).__name__, exc)
                await asyncio.sleep(RETRY_DELAY)
                continue
            self.txns += 1
            if not succeeded:
                raise NotLeaderError(f"leadership of term {self.fence.term} was lost; the record refused the write")
            self.ops += len(ops)
            return


# ----- reading it back -----

async def load(etcd: aetcd.Client, cluster: str, table: ObjectTable, clock=time.monotonic) -> int:
    """Put every recorded object into the table (page by page); returns how many records were read."""
    prefix = objects_prefix(cluster)
    end = aetcd.utils.prefix_range_end(prefix)
    start = prefix
    count = 0
    while True:
        request = aetcd.rpc.RangeRequest(key=start, range_end=end, limit=LOAD_PAGE,
                                         sort_order=aetcd.rpc.RangeRequest.ASCEND,
                                         sort_target=aetcd.rpc.RangeRequest.KEY)
        try:
            response = await etcd.kvstub.Range(request, timeout=etcd._timeout, metadata=etcd.metadata)
        except Exception as exc:  # noqa: BLE001
            raise UnavailableError(f"reading the placement record failed: {exc}") from None
        table_now, wall_now = clock(), time.time()
        for kv in response.kvs:
            count += 1
            try:
                table.load_record(decode(kv.value, table_now, wall_now))
            except ValueError as exc:
                log.warning("ignoring placement record %r: %s", kv.key, exc)
        if not response.more or not response.kvs:
            return count
        start = response.kvs[-1].key + b"\0"


async def current_revision(etcd: aetcd.Client, cluster: str) -> int:
    request = aetcd.rpc.RangeRequest(key=cluster_layout.prefix(cluster), count_only=True)
    response = await etcd.kvstub.Range(request, timeout=etcd._timeout, metadata=etcd.metadata)
    return response.header.revision


async def compact_loop(etcd: aetcd.Client, cluster: str, interval: float = COMPACT_INTERVAL,
                       on_compacted=None) -> None:
    """Drop etcd's history older than now every `interval` seconds, so the record's churn
    does not grow etcd without bound (the node watch resyncs by itself after a compaction)."""
    while True:
        await asyncio.sleep(interval)
        try:
            revision = await current_revision(etcd, cluster)
            await etcd.compact(revision)
            log.debug("compacted etcd history to revision %d", revision)
            if on_compacted is not None:
                on_compacted(revision)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - compacted already, or etcd away: try next time
            log.debug("etcd compaction skipped: %s", exc)


class RecordCollector:
    """Prometheus view of the record writer and the leadership (registered by main)."""

    def __init__(self, state):
        self._state = state  # object with .record (PlacementRecord | None), .term, .is_leader

    def collect(self):
        record = self._state.record
        yield CounterMetricFamily("kvpool_master_record_txns", "Placement-record transactions sent to etcd",
                                  value=record.txns if record else 0)
        yield CounterMetricFamily("kvpool_master_record_ops", "Placement-record puts and deletes written",
                                  value=record.ops if record else 0)
        yield GaugeMetricFamily("kvpool_master_term", "Leader term of this master (0 while following)",
                                value=self._state.term if self._state.is_leader else 0)
        yield GaugeMetricFamily("kvpool_master_is_leader", "1 while this master leads",
                                value=1 if self._state.is_leader else 0)
