"""The garbage collector's pauses in a server: kept short by freezing what survived a long full collection.

A collection holds the event loop (and every thread) for as long as it walks the objects it tracks. A node
tracks its index's records (two objects per stored object): at 2,000,000 objects per node a full collection
held each node 1.24 s, at 5,000,000 past a client's 3 s write deadline, and both nodes of an evenly filled
pool collect at the same moment, since the collector runs as the number of long-lived objects grows by a
quarter. The records are freed by reference count (they form no cycles), so walking them again finds
nothing: once a full collection takes longer than FREEZE_AFTER_S, everything that survived it goes to the
permanent generation (gc.freeze) and later collections walk only what came after. The price is that a cycle
among frozen objects that later becomes garbage is never collected: only objects alive at such a moment,
which in a server are its records, sessions and tasks. The collector schedules its next full collection by
the size it last saw (frozen objects included), so a full collection of the few unfrozen ones follows each
freeze on the loop: the next one then comes as those grow by a quarter, and none walks much more than
FREEZE_AFTER_S of objects.
"""

import gc
import logging
import time

log = logging.getLogger("kvpool.gc")

FREEZE_AFTER_S = 0.05  # a full collection this long freezes its survivors (about 200,000 objects walked)
LONG_PAUSE_S = 0.2  # a collection this long is logged


class GcPauses:
    """Times every collection (gc.callbacks), freezes after a long full one; counts both."""

    def __init__(self, freeze_after_s: float = FREEZE_AFTER_S, long_pause_s: float = LONG_PAUSE_S):
        self.freeze_after_s = freeze_after_s
        self.long_pause_s = long_pause_s
        self.collections = [0, 0, 0]
        self.freezes = 0
        self._started = 0.0
        self._loop = None

    def install(self, loop=None) -> "GcPauses":
        """Watch every collection; `loop`: the event loop a freeze's follow-up collection runs on."""
        self._loop = loop
        gc.callbacks.append(self._on_collection)
        return self

    def uninstall(self) -> None:
        if self._on_collection in gc.callbacks:
            gc.callbacks.remove(self._on_collection)

    def _on_collection(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._started = time.perf_counter()
            return
        took = time.perf_counter() - self._started
        generation = info.get("generation", 2)
        self.collections[generation] += 1
        if took >= self.long_pause_s:
            log.warning("a generation-%d collection held the process %.2f s (%d freed)",
                        generation, took, info.get("collected", 0))
        if generation == 2 and took >= self.freeze_after_s:
            gc.freeze()  # the survivors are the long-lived records: the next full collection skips them
            self.freezes += 1
            self._after_freeze()
            if log.isEnabledFor(logging.DEBUG):  # counting them walks them all
                log.debug("%d objects frozen after a %.2f s full collection", gc.get_freeze_count(), took)

    def _after_freeze(self) -> None:
        """A full collection of what is not frozen (next to nothing) once this callback has returned (none
        runs inside one), so the collector's next full one is due as that grows by a quarter."""
        if self._loop is not None:
            try:
                self._loop.call_soon_threadsafe(gc.collect)
            except RuntimeError:  # the loop is closed: the process is ending
                pass


PAUSES = GcPauses()  # the process's own, installed by run_server


def install(loop=None) -> GcPauses:
    """Install the process's watcher (once); `loop` as GcPauses.install."""
    if PAUSES._on_collection not in gc.callbacks:
        PAUSES.install(loop)
    else:
        PAUSES._loop = loop or PAUSES._loop
    return PAUSES
