"""WatchKeys: the committed keys with a prefix, streamed from the leader's KeyFeed (key_feed.py).

A stream opens with a snapshot, in pages, the last one marked done; then batches
of changes, each carrying the feed sequence it brings the subscriber to. A
request that resumes from a position of the same feed still in its log gets an
empty batch at once instead of a snapshot (so it knows it is connected), then
the changes after that position. A subscriber that falls out of the log
mid-stream gets a fresh snapshot in the same stream. While nothing matching
changes, an empty batch goes out every HEARTBEAT seconds: it moves the
subscriber's resume position on and tells it the leader is alive.

What a peer can make the master hold is bounded: at most `max_streams` streams,
at most SNAPSHOT_SLOTS snapshots (each a list of keys) being sent at once, and a
subscriber that does not take a message within SEND_TIMEOUT is dropped.
"""

import asyncio
import logging

import grpc

from kvpool.errors import KvpoolError
from kvpool.protocol.keys import validate_key
from kvpool.proto import kvpool_pb2 as pb

from kvpool.master.serving.key_feed import REMOVED, STORED, FeedClosed, KeyFeed

log = logging.getLogger(__name__)

MAX_STREAMS = 256
SNAPSHOT_SLOTS = 4
PAGE_KEYS = 4096         # keys per snapshot page ...
PAGE_BYTES = 1 << 20     # ... or bytes of keys, whichever comes first (keys are at most 1 KiB)
BATCH_CHANGES = 1024     # changes per batch (at most 1 MiB of keys)
HEARTBEAT = 2.0
SEND_TIMEOUT = 30.0
KINDS = {STORED: pb.KEY_STORED, REMOVED: pb.KEY_REMOVED}


class KeyWatch:
    def __init__(self, feed: KeyFeed, max_streams: int = MAX_STREAMS):
        self.feed = feed
        self.max_streams = max_streams
        self.streams = 0
        self._snapshots = asyncio.Semaphore(SNAPSHOT_SLOTS)

    async def serve(self, request: pb.WatchKeysRequest, context, scope=None, current=lambda: True) -> None:
        """Stream until the subscriber goes; FeedClosed when this master stops leading. scope: the keys the
        caller may see (kvpool/protocol/tenants.py Scope; None: all), its prefix already checked to lie in
        it; current(): whether the caller's credential still holds (a tenant's token rotated: the stream ends)."""
        prefix = request.prefix
        # Only the client token's scope with no prefix reaches keys outside it (tenants'): filter those.
        keep = scope.holds if scope is not None and not prefix else None
        if prefix:
            try:
                validate_key(prefix)
            except KvpoolError as exc:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"prefix: {exc}")
        if self.streams >= self.max_streams:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                f"{self.streams} key watches already; try again later")
        self.streams += 1
        try:
            await self._stream(request, prefix, context, keep, current)
        finally:
            self.streams -= 1

    async def _stream(self, request: pb.WatchKeysRequest, prefix: str, context, keep, current) -> None:
        feed = self.feed
        feed_id = feed.open_for_subscriber()
        if not feed_id:
            raise FeedClosed("this master does not lead")
        cursor: int | None = None
        if feed.can_resume(request.feed_id, request.after_sequence):
            cursor = request.after_sequence
            await _send(context, pb.KeyEvents(feed_id=feed_id, sequence=cursor))
        loop = asyncio.get_running_loop()
        last_sent = loop.time()
        while True:
            if feed.id != feed_id:
                raise FeedClosed("the leader's term ended")
            if not current():
                await context.abort(grpc.StatusCode.UNAUTHENTICATED, "this tenant's token was rotated or deleted")
            if cursor is None:
                cursor = await self._snapshot(context, feed_id, prefix, keep)
                last_sent = loop.time()
                continue
            found = feed.since(cursor, prefix, BATCH_CHANGES)
            if found is None:
                log.info("a key watch of %r fell out of the feed's log; sending it a snapshot", prefix)
                cursor = None
                continue
            changes, cursor = found
            if keep is not None:
                changes = [(kind, key) for kind, key in changes if keep(key)]
            if changes or loop.time() - last_sent >= HEARTBEAT:
                await _send(context, pb.KeyEvents(
                    feed_id=feed_id, sequence=cursor,
                    changes=[pb.KeyChange(kind=KINDS[kind], key=key) for kind, key in changes]))
                last_sent = loop.time()
            if cursor >= feed.sequence:
                await feed.wait(cursor, max(0.0, last_sent + HEARTBEAT - loop.time()))
            else:
                await asyncio.sleep(0)  # more to scan: let the rest of the master run first

    async def _snapshot(self, context, feed_id: str, prefix: str, keep=None) -> int:
        """Send the keys with `prefix` present now, in pages; returns the sequence they were taken at."""
        async with self._snapshots:
            if self.feed.id != feed_id:
                raise FeedClosed("the leader's term ended")
            sequence, keys = self.feed.snapshot(prefix)
            page, size = [], 0
            for key in keys:
                if keep is not None and not keep(key):
                    continue
                if len(page) == 0 and self.feed.id != feed_id:
                    raise FeedClosed("the leader's term ended")
                page.append(key)
                size += len(key) + 3
                if len(page) >= PAGE_KEYS or size >= PAGE_BYTES:
                    await _send(context, pb.KeyEvents(feed_id=feed_id, sequence=sequence, snapshot=True,
                                                      present=page))
                    page, size = [], 0
            await _send(context, pb.KeyEvents(feed_id=feed_id, sequence=sequence, snapshot=True,
                                              snapshot_done=True, present=page))
            return sequence


async def _send(context, message: pb.KeyEvents) -> None:
    try:
        await asyncio.wait_for(context.write(message), SEND_TIMEOUT)
    except TimeoutError:
        await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                            f"the subscriber took no message for {SEND_TIMEOUT:g}s")
