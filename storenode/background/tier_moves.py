"""Copies between tiers: demotion (DRAM -> SSD) and promotion (SSD -> DRAM).

The copy runs in a worker thread (file I/O may block) while the record's
refcount keeps both extents in place; the result is applied on the event loop
only if the object is still live, otherwise the new extent is given back.
"""

import asyncio
import logging

from kvpool.protocol.checksum import checksum

from kvpool.storenode.storage import quota
from kvpool.storenode.storage.index import ObjectRecord
from kvpool.storenode.storage.store import ObjectStore

log = logging.getLogger(__name__)

SHARED_BATCH = 16  # SSD victims written to the shared tier at once to make room for a demotion


class Mover:
    def __init__(self, store: ObjectStore):
        self.store = store
        self.dram, self.ssd = store.dram, store.ssd
        self.shared = None  # the node's SharedTier (shared_tier.py), where a full SSD's coldest go on to

    async def demote(self, rec: ObjectRecord) -> bool:
        """Copy an idle DRAM-only object to SSD and drop its DRAM copy.

        A full SSD first gives up its own coldest objects (what it holds was
        demoted earlier, so it is colder); if nothing there may go, the object
        is evicted instead, unless that would take its tenant below its reserve
        (then it stays in DRAM). At its tenant's SSD quota, the tenant's own
        coldest SSD objects make room for it, or else it is evicted.
        """
        store, ssd = self.store, self.ssd
        offset = None
        if ssd is not None:
            if not quota.make_tier_room(store, rec.tenant, ssd, rec.size):
                store.evict(rec, quota.QUOTA)
                return False
            length = ssd.extent_length(rec)
            offset = ssd.alloc.allocate(length)
            if offset is None and self.shared is not None and self.shared.usable:  # SSD's coldest move on
                await self.shared.move_out(store.victims(ssd, length, SHARED_BATCH))
                if not (rec.live and rec.refcount == 0 and rec.dram is not None):
                    return False  # read, freed or moved while that ran: the sweep looks at it again
                offset = ssd.alloc.allocate(length)
            if offset is None:
                offset = store.make_room(ssd, length, rec.tenant)
        if offset is None:
            if not quota.protected(rec.tenant, rec.size):
                store.evict(rec, "dram full and no ssd room")
            return False
        store.acquire(rec)
        ok = False
        try:
            payload = self.dram.segment.view(rec.dram, rec.size)
            await asyncio.get_running_loop().run_in_executor(
                None, ssd.segment.write_object, offset, store.stored_object(rec), payload)
            payload.release()
            ok = True
        except OSError as exc:
            log.error("demoting %s to SSD failed: %s", rec.name, exc)
        finally:
            if not (ok and rec.live):
                store.free_extent(ssd, offset)
            else:
                rec.ssd = offset
                store.join_tier(ssd, rec)
                self.dram.demotions += 1
                ssd.demotions += 1
            store.release(rec)
        if ok and rec.live and rec.refcount == 0 and rec.dram is not None:
            store.drop_copy(rec, self.dram)  # a reader still busy with it leaves both: the next sweep drops it
        return ok

    async def promote(self, rec: ObjectRecord) -> bool:
        """Copy an SSD-only object into DRAM if a free extent is there (it never evicts for it).

        It may take DRAM over its high watermark: the sweep that follows demotes
        DRAM's coldest objects, and the promoted one was just read twice, so hot
        objects end up in DRAM and cold ones on SSD. It never takes its tenant
        past its DRAM quota.
        """
        store, dram = self.store, self.dram
        if not rec.live or rec.dram is not None or rec.ssd is None or rec.promoting:
            return False
        if not quota.tier_has_room(rec.tenant, dram, rec.size):
            return False
        offset = dram.alloc.allocate(rec.size)
        if offset is None:
            return False
        rec.promoting = True
        store.acquire(rec)
        usage = rec.tenant
        usage.pending_tier[0] += rec.size  # its DRAM quota counts the copy under way
        intact = False
        try:
            target = dram.segment.view(offset, rec.size)
            source = self.ssd.segment.payload_offset(rec.ssd, len(rec.key))
            intact = await asyncio.get_running_loop().run_in_executor(None, self._copy_in, target, source, rec)
            target.release()
        except OSError as exc:
            log.error("promoting %s from SSD failed: %s", rec.name, exc)
        finally:
            rec.promoting = False
            usage.pending_tier[0] -= rec.size
            if intact and rec.live:
                rec.dram = offset
                store.join_tier(dram, rec)
                dram.promotions += 1
                self.ssd.promotions += 1
            else:
                dram.alloc.free(offset)
            store.release(rec)
        if not intact and rec.live:
            log.error("SSD copy of %s fails its checksum; dropping the object", rec.name)
            store.evict(rec, "torn")
        if intact and dram.excess():
            store.on_pressure()
        return intact and rec.dram == offset

    def _copy_in(self, target: memoryview, source: int, rec: ObjectRecord) -> bool:
        self.ssd.segment.pread_into(target, source)
        return checksum(target) == rec.checksum
