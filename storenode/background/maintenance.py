"""The background task that keeps tiers below their high watermarks and drops expired objects.

It wakes when a WRITE or promotion pushes a tier above its high watermark, and
every `interval` seconds for TTL sweeps. Work goes in small batches with an
await between them, and copies run in threads, so WRITEs that have room are
never held up by it.
"""

import asyncio
import logging

from kvpool.storenode.storage import quota
from kvpool.storenode.storage.index import ObjectRecord
from kvpool.storenode.background.tier_moves import Mover
from kvpool.storenode.storage.store import ObjectStore

log = logging.getLogger(__name__)

BATCH = 32  # victims handled between yields to the event loop
MAX_PROMOTIONS = 4  # concurrent SSD -> DRAM copies; more hits wait for a later read


class Maintenance:
    def __init__(self, store: ObjectStore, interval: float = 0.5):
        self.store = store
        self.mover = Mover(store)
        self.interval = interval
        self._shared = None
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None
        self._promotions: set[asyncio.Task] = set()

    @property
    def shared(self):
        """This node's SharedTier (shared_tier.py) when it mounts one: the last tier's victims go there."""
        return self._shared

    @shared.setter
    def shared(self, tier) -> None:
        self._shared = self.mover.shared = tier

    def _shared_now(self):
        """The shared tier while it answers; None meanwhile (victims then go as they would without one)."""
        shared = self._shared
        return shared if shared is not None and shared.usable else None

    def start(self) -> None:
        self.store.on_pressure = self.kick
        self._task = asyncio.create_task(self._run(), name="tier-maintenance")

    async def stop(self) -> None:
        tasks = [t for t in (self._task, *self._promotions) if t]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self.shared is not None:
            await self.shared.stop_spilling()

    def kick(self) -> None:
        self._wake.set()

    def promote(self, rec: ObjectRecord) -> None:
        """Copy an SSD-only object to DRAM in the background (skipped while enough copies run)."""
        if len(self._promotions) >= MAX_PROMOTIONS or self.store.ssd is None:
            return
        task = asyncio.create_task(self.mover.promote(rec))
        self._promotions.add(task)
        task.add_done_callback(self._promotion_done)

    def _promotion_done(self, task: asyncio.Task) -> None:
        self._promotions.discard(task)
        if not task.cancelled() and task.exception():
            log.error("promotion failed", exc_info=task.exception())

    async def _run(self) -> None:
        while True:
            try:
                await asyncio.wait_for(self._wake.wait(), self.interval)
            except TimeoutError:
                pass
            self._wake.clear()
            try:
                await self.sweep()
            except Exception:  # a bug must not end maintenance for good
                log.exception("tier maintenance sweep failed")

    async def sweep(self) -> None:
        self.store.expire_due()
        await self._move_to_share()
        if self.shared is not None:
            await self.shared.write_staged()
            self.shared.spill_soon()
        await self._relieve_dram_shares()
        quota.enforce(self.store)  # what demotion could not bring within a share is evicted
        await self._relieve_dram()
        await self._relieve_ssd()

    async def _move_to_share(self) -> None:
        """put(tier="shared") objects go on to the shared tier (a node without one keeps them)."""
        store = self.store
        if self._shared_now() is None:  # (without one they stay; while it fails they wait)
            if self.shared is None:
                store.to_share = []
            return
        waiting, store.to_share, busy = store.to_share, [], []
        for start in range(0, len(waiting), BATCH):
            batch = [rec for rec in waiting[start:start + BATCH] if rec.live]
            busy += [rec for rec in batch if rec.refcount]  # being read: the next sweep moves them
            await self.shared.move_out([rec for rec in batch if not rec.refcount])
        store.to_share[:0] = busy

    async def _relieve_dram(self) -> None:
        """Above the high watermark: demote the coldest to SSD (or drop their DRAM copy) down to the low one.
        Any tenant's objects may be demoted; without an SSD they are evicted, so reserves are kept."""
        store, dram = self.store, self.store.dram
        while (need := dram.excess()) > 0:
            to_ssd = store.placing_ssd  # (an SSD that fails takes no demotions: DRAM is the last tier meanwhile)
            batch = store.victims(dram, need, BATCH, protect=not to_ssd)
            before = dram.used
            shared = self._shared_now()
            if not to_ssd and shared is not None:  # DRAM is the last tier: on to the shared one
                await shared.move_out(batch)
                batch = ()
            for rec in batch:
                if rec.live and rec.refcount == 0 and rec.dram is not None:
                    if rec.ssd is not None or not to_ssd:  # another copy, or nowhere to demote to
                        store.release_from(dram, rec)
                    else:
                        await self.mover.demote(rec)
            if dram.used >= before:  # nothing could move (all busy or protected)
                return
            await asyncio.sleep(0)

    async def _relieve_dram_shares(self) -> None:
        """Tenants above their DRAM share's high watermark: demote their own coldest to SSD down to its low one."""
        store, dram = self.store, self.store.dram
        if not store.placing_ssd:
            return
        for usage in store.tenants.limited():
            while (need := quota.dram_excess(usage, dram)) > 0:
                before = usage.tier_bytes[0]
                for rec in quota.own_victims(store, usage, dram, need, BATCH):
                    if rec.live and rec.refcount == 0 and rec.dram is not None:
                        if rec.ssd is not None:
                            store.release_from(dram, rec)
                        else:
                            await self.mover.demote(rec)
                if usage.tier_bytes[0] >= before:
                    break
                await asyncio.sleep(0)

    async def _relieve_ssd(self) -> None:
        """Above the high watermark: evict the coldest SSD objects for good down to the low one."""
        store, ssd = self.store, self.store.ssd
        while ssd and (need := ssd.excess()) > 0:
            batch = store.victims(ssd, need, BATCH)  # sparing tenants at their reserve
            before = ssd.used
            shared = self._shared_now()
            if shared is not None:
                # What has a DRAM copy too only leaves SSD; the rest goes on to the shared tier.
                await shared.move_out([rec for rec in batch if rec.dram is None])
                batch = [rec for rec in batch if rec.live and rec.dram is not None]
            for rec in batch:
                if rec.live and rec.refcount == 0 and rec.ssd is not None:
                    store.release_from(ssd, rec)
            if ssd.used >= before:
                return
            await asyncio.sleep(0)
