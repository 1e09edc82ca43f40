"""This node's side of the shared tier (kvpool/sharedfs): the directory every node given --shared-dir mounts.

What the node's last tier gives up (SSD, or DRAM without one) is written there instead of dropped, and the
node's copy goes: the master learns it as MOVED (store.note_dropped) and from then on names the shared copy,
at whichever node serves the tier. Any such node serves a shared object it does not hold (READ and LOCATE
fall back here, the file verified before a byte leaves), and copies one read twice within the promotion
window into its DRAM (PROMOTED: the master adds the copy). The leader alone decides which files go (FREE_SHARED)
and reads the manifests through one node when it takes over (SHARED_SCAN).

File I/O runs in the threads of a FileGate (kvpool/sharedfs/file_gate.py), each call within --shared-timeout: a
mount that fails or stops answering holds only those threads, and until its probe answers the tier is skipped
(victims go as they would without one, what the sweep staged waits in memory, reads are refused at once).
"""

import asyncio
import logging
import time
from collections import OrderedDict

from kvpool.errors import BatchError, KeyNotFoundError, KvpoolError, StaleReplicaError, UnavailableError
from kvpool.protocol import wire
from kvpool.sharedfs.file_gate import FileGate
from kvpool.sharedfs.files import DeepTier
from kvpool.sharedfs.layout import SharedObject

from kvpool.storenode.storage import quota
from kvpool.storenode.storage.index import ObjectRecord
from kvpool.storenode.storage.store import STAGED, ObjectStore, Reservation

log = logging.getLogger(__name__)

_TO_SHARED = int(wire.WriteFlag.TO_SHARED)
RECENT_READS = 4096
STAGING_MAX = 256 << 20  # bytes of victims kept in memory until written to the shared tier
STAGED_BATCH = 32  # shared objects whose reads this node counts towards a promotion
THREADS = 24  # calls into the tier at once (a batch's writes fan out further inside kvpool/sharedfs/files.py)
TIMEOUT = 10.0  # seconds a call into the tier may take (--shared-timeout)


class SharedTier:
    def __init__(self, directory: DeepTier, store: ObjectStore, capacity: int, timeout: float = TIMEOUT,
                 name: str = "shared tier"):
        self.dir = directory
        self.gate = FileGate(name, directory.probe, threads=THREADS, timeout=timeout)
        self.store = store
        self.capacity = capacity  # --shared-capacity: registered for the leader, which keeps the tier within it
        self.moved = self.moved_bytes = self.reads = self.read_bytes = self.promotions = self.unlinked = 0
        self.damaged = 0  # files that failed their checks when read
        self.spilled = 0  # files moved from the directory on to the bucket beneath it
        self._spilling: asyncio.Task | None = None
        self._reads: OrderedDict[tuple[bytes, int], tuple[int, float]] = OrderedDict()  # -> (reads, first at)
        # Victims a WRITE made room with (store.release_from), kept until written here: (key, generation) ->
        # (SharedObject, bytes), served from memory meanwhile; at most `staging_limit` bytes of them.
        self._staged: dict[tuple[bytes, int], tuple[SharedObject, bytes]] = {}
        self._staged_bytes = 0
        self.staging_limit = min(store.dram.capacity // 4, STAGING_MAX)
        store.stage, store.unstage = self.stage, self.unstage

    async def _run(self, function, *args, timeout: float | None | bool = True):
        return await self.gate.run(function, *args, timeout=timeout)

    @property
    def usable(self) -> bool:
        """Whether the tier answers now: while it does not, the sweeps go on as without one."""
        return self.gate.fault is None

    # -- demotion

    async def move_out(self, recs: list[ObjectRecord]) -> None:
        """Write idle objects of the node's last tier to the shared tier and drop them here (those that cannot
        be written are evicted).
        The file of one freed meanwhile (the master replaced or removed it) goes at once: this node would
        otherwise serve it from there to a reader whose placement still names this node."""
        store = self.store
        batch = [rec for rec in recs if rec.held and rec.refcount == 0]
        for rec in batch:
            store.acquire(rec)  # neither freed nor moved while the thread reads it
        try:
            results = await self._run(self._write, batch)
        except BatchError as exc:  # some were written (and recorded), some not
            results = exc.results
        except (OSError, KvpoolError) as exc:  # none recorded
            results = [exc] * len(batch)
        freed, failed = [], None
        for rec, result in zip(batch, results):
            store.release(rec)
            if isinstance(result, BaseException):
                failed = result
                if rec.live and rec.refcount == 0:
                    store.evict(rec, "shared tier unwritable")
            elif rec.live:
                store.moved_to_shared(rec)
                self.moved += 1
                self.moved_bytes += rec.size
            else:
                freed.append((rec.key, rec.generation))
        if failed is not None:
            log.error("writing to the shared tier failed (%s): what could not be written was evicted", failed)
        if freed:
            await self._run(self.dir.remove_many, freed)

    def stage(self, rec: ObjectRecord) -> bool:
        """A WRITE's victim (idle, its last copy here): its bytes kept until the sweep writes them to the shared
        tier, the record dropped now; False (it is evicted) when the staging is full."""
        if self._staged_bytes + rec.size > self.staging_limit:
            return False
        store = self.store
        if rec.dram is not None:
            payload = bytes(store.dram.segment.view(rec.dram, rec.size))
        else:  # (a page-cache read on the loop: SSD victims are staged only when the sweep fell behind)
            payload = bytearray(rec.size)
            store.ssd.segment.pread_into(payload, store.ssd.segment.payload_offset(rec.ssd, len(rec.key)))
        self._staged[(rec.key, rec.generation)] = (self._object(rec), payload)
        self._staged_bytes += rec.size
        store.moved_to_shared(rec, STAGED)
        store.on_pressure()  # the sweep writes it
        return True

    def unstage(self, key: bytes, generation: int) -> bool:
        """The master freed a staged object: it is not written (or, being written, its file goes after)."""
        entry = self._staged.pop((key, generation), None)
        if entry is None:
            return False
        self._staged_bytes -= entry[0].size
        return True

    async def write_staged(self) -> None:
        """Write what stage() kept, a batch at a time; the master learns each as MOVED once its file is in place
        (as evicted if it cannot be written). While the tier does not answer they wait, served from memory."""
        while self._staged and self.usable:
            batch = list(self._staged.items())[:STAGED_BATCH]
            try:
                results = await self._run(self.dir.write_many, [entry for _, entry in batch])
            except BatchError as exc:
                results = exc.results
            except (OSError, KvpoolError) as exc:
                results = [exc] * len(batch)
            freed = []
            for (name, (obj, _)), result in zip(batch, results):
                written = not isinstance(result, BaseException)
                if self._staged.pop(name, None) is None:  # freed while it was written
                    if written:
                        freed.append(name)
                    continue
                self._staged_bytes -= obj.size
                if written:
                    self.moved += 1
                    self.moved_bytes += obj.size
                    self.store.note_dropped(obj.key, obj.generation, wire.MOVED_TO_SHARED)
                else:
                    log.error("writing %r to the shared tier failed (%s); it is lost", obj.key, result)
                    self.store.note_dropped(obj.key, obj.generation)
            if freed:
                await self._run(self.dir.remove_many, freed)

    def spill_soon(self) -> None:
        """A directory with a bucket beneath it: what this node keeps there beyond its share goes on down, in a
        thread beside the sweeps (the bucket is far slower than the directory that absorbs the sweeps' writes)."""
        if self.usable and (self._spilling is None or self._spilling.done()):
            self._spilling = asyncio.create_task(self._spill())

    async def _spill(self) -> None:
        try:
            self.spilled += await self._run(self.dir.spill, timeout=None)  # (each bucket call has its deadline)
        except Exception:  # the next sweep starts another
            log.exception("moving the shared directory's files on to the bucket failed")

    async def stop_spilling(self) -> None:
        """Ends a spill after its batch (each call to the bucket has its deadline)."""
        self.dir.halt_spill()
        if self._spilling is not None:
            await asyncio.gather(self._spilling, return_exceptions=True)

    @staticmethod
    def _object(rec: ObjectRecord) -> SharedObject:
        return SharedObject(rec.key, rec.generation, rec.size, rec.checksum, rec.flags, rec.raw_size,
                            int(rec.expires_at * 1000))

    def _write(self, recs: list[ObjectRecord]) -> list[int]:
        store, items = self.store, []
        for rec in recs:
            if rec.dram is not None:
                payload = store.dram.segment.view(rec.dram, rec.size)
            else:
                payload = bytearray(rec.size)
                store.ssd.segment.pread_into(payload, store.ssd.segment.payload_offset(rec.ssd, len(rec.key)))
            items.append((self._object(rec), payload))
        return self.dir.write_many(items)

    # -- reads of what this node does not hold

    async def read(self, key: bytes, generation: int, length: int) -> tuple[SharedObject, bytes]:
        """The verified bytes of (key, generation) from the shared tier; KeyNotFoundError if no such file,
        ChecksumMismatchError if it fails its checks (never served), StaleReplicaError on a size mismatch."""
        staged = self._staged.get((key, generation))
        try:
            obj, payload = staged if staged is not None else await self._run(self.dir.read, key, generation)
        except KeyNotFoundError:
            raise KeyNotFoundError(f"no generation {generation} of this key here or in the shared tier") from None
        except UnavailableError:  # the tier does not answer or fails now: nothing said of the file
            raise
        except Exception:
            self.damaged += 1
            raise
        if obj.expires_ms and obj.expires_ms <= time.time() * 1000:
            raise KeyNotFoundError(f"generation {generation} of this key has expired")
        if obj.size != length:
            raise StaleReplicaError(f"generation {generation} has {obj.size} bytes, not {length}")
        self.reads += 1
        self.read_bytes += obj.size
        if staged is None:  # (a staged one is still this node's to write: no second copy of it here)
            self._count_read(obj, payload)
        return obj, payload

    def _count_read(self, obj: SharedObject, payload: bytes) -> None:
        """A second read within the promotion window copies the object into DRAM if it has room now."""
        store, name, now = self.store, (obj.key, obj.generation), time.monotonic()
        reads, first = self._reads.pop(name, (0, now))
        if now - first > store.promote_window:
            reads, first = 0, now
        reads += 1
        if reads < store.promote_after:
            self._reads[name] = (reads, first)
            if len(self._reads) > RECENT_READS:
                self._reads.popitem(last=False)
            return
        self._promote(obj, payload)

    def _promote(self, obj: SharedObject, payload: bytes) -> None:
        store, dram = self.store, self.store.dram
        if store.index.has_key(obj.key):  # this or another version is here already
            return
        usage = store.tenants.of_key(obj.key)
        if not quota.tier_has_room(usage, dram, obj.size):
            return
        offset = dram.alloc.allocate(dram.segment.extent_length(len(obj.key), obj.size))
        if offset is None:  # never evicts for it: the sweep makes room for the hot ones
            return
        dram.segment.view(offset, obj.size)[:] = payload
        ttl_ms = max(1, obj.expires_ms - int(time.time() * 1000)) if obj.expires_ms else 0
        flags = obj.flags & ~_TO_SHARED  # a copy kept here for its reads, not one to move on again
        rec = store.new_record(obj.key, obj.generation, obj.size, obj.checksum, flags, obj.raw_size, ttl_ms, 0)
        store.commit(Reservation(dram, offset, 0, None), rec)
        self.promotions += 1
        dram.promotions += 1
        store.note_dropped(obj.key, obj.generation, wire.PROMOTED_FROM_SHARED)

    # -- what the leader asks

    async def unlink(self, key: bytes, generation: int) -> bool:
        """FREE_SHARED: the file of (key, generation) goes (a reader that has it open reads it whole). Every node
        mounting the tier is told: those that find it gone already answer so without a manifest record."""
        if not await self._run(self.dir.exists, key, generation):
            return False
        removed = await self._run(self.dir.remove, key, generation)
        self.unlinked += removed
        return removed

    async def scan(self) -> bytes:
        """SHARED_SCAN: every object the manifests hold, as an INVENTORY reply. The files of versions a newer
        one replaced, and of expired ones, go now (the leader asks this of one node at a time)."""
        started = time.monotonic()
        result = await self._run(self.dir.scan, int(time.time() * 1000), timeout=None)  # grows with the tier
        stale = [(obj.key, obj.generation) for obj in (*result.superseded, *result.expired)]
        if stale:
            self.unlinked += sum(await self._run(self.dir.remove_many, stale))
        log.info("shared tier scanned in %.2fs: %d records in %d manifests; %d stale files removed",
                 time.monotonic() - started, result.records, result.manifests, len(stale))
        return result.reply

    def report(self) -> dict:
        return {"capacity": self.capacity, "moved": self.moved, "moved_bytes": self.moved_bytes,
                "reads": self.reads, "read_bytes": self.read_bytes, "promotions": self.promotions,
                "unlinked": self.unlinked, "damaged": self.damaged, "spilled": self.spilled,
                "fault": self.gate.fault or "", "faults": self.gate.faults}
