"""What a node with a shared tier does with its objects when told to stop (SIGTERM, SIGINT: every Kubernetes
rollout, drain and scale-down): before it leaves, it writes what its DRAM and SSD hold to the shared tier, hottest
first, within --stop-grace, so a cluster stopped and started again over the same directory or bucket serves every
object. Then, within the same grace, it waits until the master has taken the list of what moved (the EVICTIONS it
asks for), so a node that leaves alone (a rolling restart) leaves every such object named at the shared tier.
The node keeps serving meanwhile: a read of an object it moved is answered from the shared tier.
"""

import asyncio
import logging

from kvpool.storenode.storage.store import ObjectStore

from kvpool.storenode.background.shared_tier import SharedTier

log = logging.getLogger(__name__)

STOP_GRACE = 25.0  # seconds (--stop-grace): Kubernetes kills a pod 30 s after its SIGTERM by default
BATCH = 32  # objects written per step, the deadline checked between steps
HEARD_POLL = 0.05  # seconds between looks at whether the master took the list of what moved


async def keep_on_stop(store: ObjectStore, shared: SharedTier, grace: float) -> tuple[int, int]:
    """Write what the node holds to the shared tier within `grace` seconds; (objects kept, objects left)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + grace
    before = shared.moved
    await shared.write_staged()
    held = sorted((rec for rec in store.index if rec.held), key=lambda rec: (rec.hits, rec.last_access),
                  reverse=True)
    for start in range(0, len(held), BATCH):
        if loop.time() >= deadline:
            break
        batch, moved = [rec for rec in held[start:start + BATCH] if rec.live], shared.moved
        await shared.move_out(batch)
        if batch and shared.moved == moved:  # the tier takes nothing (down, full): the grace is not spent on it
            break
    kept = shared.moved - before
    left = sum(1 for rec in held if rec.held)
    while store.has_dropped() and loop.time() < deadline:
        await asyncio.sleep(HEARD_POLL)
    spent = grace - max(0.0, deadline - loop.time())
    why = "" if not left else " (the grace ran out)" if spent >= grace else " (being read)"
    log.log(logging.WARNING if left or store.has_dropped() else logging.INFO,
            "stopping: %d objects written to the shared tier in %.1fs, %d not%s%s", kept, spent, left, why,
            "; the master had not taken the list of what moved" if store.has_dropped() else "")
    return kept, left
