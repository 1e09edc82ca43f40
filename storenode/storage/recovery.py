"""Rebuild the index from the SSD segment at start: what a killed earlier run left there.

Headers sit on ALIGNMENT boundaries. The scan reads the file in blocks, jumps
over holes, checks each header found (its keyed check) and the payload's
checksum, and adopts the intact objects. A header whose payload does not
match is a torn or damaged object: it is logged, its header cleared, and it is
listed as dropped in the next REPORT, so it is never served. Only an intact
object's extent is skipped whole; after anything else the scan goes on at the
next boundary, so the size a torn header claims cannot hide what follows it.
"""

import errno
import logging
import os
import time

from kvpool.protocol.wire import MAX_GENERATION
from kvpool.storenode.storage.allocator import align_up

from kvpool.storenode.storage.ssd import ALIGNMENT, IO_CHUNK, MAGIC, SsdSegment
from kvpool.storenode.storage.store import ObjectStore

log = logging.getLogger(__name__)

SCAN_BLOCK = 1024 * 1024  # a multiple of ALIGNMENT


def scan(segment: SsdSegment, now_ms: int):
    """Yield (offset, object, verdict) for every header found; verdict is "ok", "torn" or "expired"."""
    buffer = bytearray(IO_CHUNK)
    offset = 0
    while offset < segment.capacity:
        offset = _next_data(segment.fd, offset)
        if offset is None or offset >= segment.capacity:
            return
        block = os.pread(segment.fd, min(SCAN_BLOCK, segment.capacity - offset), offset)
        if not block:
            return
        hit = _aligned_find(block, MAGIC)
        if hit is None:
            offset += len(block)
            continue
        at = offset + hit
        obj = segment.read_header(at)
        if obj is None:  # magic without an intact header: a torn header or payload bytes
            offset = at + ALIGNMENT
            continue
        if obj.expires_ms and obj.expires_ms <= now_ms:
            verdict = "expired"
        elif not 0 < obj.generation <= MAX_GENERATION:  # stored before nodes bounded it: no master could adopt it
            verdict = "out_of_range"
        elif segment.payload_intact(at, obj, buffer):
            verdict = "ok"
        else:
            verdict = "torn"
        yield at, obj, verdict
        if verdict == "ok":
            offset = at + align_up(segment.extent_length(len(obj.key), obj.size), ALIGNMENT)
        else:
            offset = at + ALIGNMENT


def recover(store: ObjectStore) -> dict:
    """Adopt every intact object of the store's SSD tier; returns counts by verdict."""
    segment = store.ssd.segment
    counts = {"ok": 0, "torn": 0, "expired": 0, "duplicate": 0, "out_of_range": 0}
    started = time.monotonic()
    for offset, obj, verdict in scan(segment, int(time.time() * 1000)):
        if verdict == "ok" and not store.adopt(offset, obj):
            verdict = "duplicate"
        counts[verdict] += 1
        if verdict == "ok":
            continue
        if verdict == "duplicate":
            segment.clear_header(offset)
            continue
        if verdict == "torn":
            log.warning("discarding torn object %r generation %d at SSD offset %d: payload checksum differs",
                        obj.key, obj.generation, offset)
        elif verdict == "out_of_range":
            log.warning("discarding object %r at SSD offset %d: generation %d is beyond %d",
                        obj.key, offset, obj.generation, MAX_GENERATION)
        segment.clear_header(offset)
        store.note_dropped(obj.key, obj.generation)
    log.info("SSD recovery: %d objects adopted, %d torn, %d expired, %d duplicates in %.2fs",
             counts["ok"], counts["torn"], counts["expired"], counts["duplicate"], time.monotonic() - started)
    return counts


def _aligned_find(block: bytes, magic: bytes) -> int | None:
    i = block.find(magic)
    while i != -1 and i % ALIGNMENT:
        i = block.find(magic, (i // ALIGNMENT + 1) * ALIGNMENT)
    return None if i == -1 else i


def _next_data(fd: int, offset: int) -> int | None:
    """The first aligned offset at or after `offset` that may hold data (holes are skipped)."""
    try:
        found = os.lseek(fd, offset, os.SEEK_DATA)
    except OSError as exc:
        if exc.errno == errno.ENXIO:  # nothing but holes from here on
            return None
        return offset  # SEEK_DATA unsupported: read everything
    return max(offset, found - found % ALIGNMENT)

