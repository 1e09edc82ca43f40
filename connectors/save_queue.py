"""Saves of KV blocks: copied out of the engine's caches in the step that completed them, written to kvpool in
the background, shed when the pool pushes back.

Copying in the step (a gather into a staging ring, on the caches' device) is what lets a save wait: the engine
may free and reuse a block as soon as the step is done (a sliding window's blocks leave the window, a finished
request's blocks go back to the pool), and the copy is what is written, whenever the writer gets to it. The
ring bounds the memory pending saves take; a save that does not fit is shed, not waited for. The writer takes
every staged save at once (one existence check and one batch put for many requests and steps) on its own
thread and client, so loads, on theirs, never queue behind saves.

Back-pressure: when puts are refused for space (NoSpaceError, a tenant's quota), evicted before they end (a
pool whose every block is held has nothing else to give up), or are not answered within their deadline,
new saves are shed for a while (0.25 s, doubling while the pool keeps refusing, up to 8 s), counted as
blocks_save_shed, instead of queueing behind a pool that cannot take them: the engine's step never waits for
a saturated pool, and what it sheds is a later cache miss, not a failed request.
"""

import logging
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Sequence

from kvpool.errors import (BatchError, KeyExistsError, KeyNotFoundError, KvpoolError, NoSpaceError,
                           UnavailableError)

from . import stream_order
from .paged_layout import gather_blocks

log = logging.getLogger(__name__)

BACKOFF_FIRST, BACKOFF_MOST = 0.25, 8.0  # seconds of shedding after a refusal, doubling while refusals go on
# The pool pushing back: no room (refused, or a block evicted before its put ended), or a node or the master
# not answering within the deadline.
PUSHBACK = (NoSpaceError, UnavailableError, KeyNotFoundError)


@dataclass
class Saved:
    """What became of one staged save: blocks written (None: the save failed), blocks shed, seconds taken."""
    tag: object
    blocks: int
    written: int | None
    shed: int
    seconds: float


@dataclass
class _Staged:
    tag: object
    keys: list[str]
    offset: int      # of the first block in the ring
    size: int        # bytes per block
    ready: object    # the caches' stream event after the gather (None on the CPU)
    began: float


class StagingRing:
    """One buffer, taken from in order and given back in the same order (the writer finishes saves in the
    order they were staged): a ring of byte ranges."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.buffer = None
        self._taken: deque[tuple[int, int]] = deque()  # (start, end) of each range still pending, oldest first

    def take(self, nbytes: int, like) -> int | None:
        """The offset of `nbytes` free bytes, or None when the ring has no such room now."""
        if self.buffer is None:
            import torch
            self.buffer = torch.empty(self.capacity, dtype=torch.uint8, device=like.device)
        if nbytes > self.capacity:
            return None
        if not self._taken:
            start = 0
        else:
            head, tail = self._taken[0][0], self._taken[-1][1]
            if self._taken[-1][0] >= head:  # not wrapped: free are [tail, capacity) and [0, head)
                start = tail if tail + nbytes <= self.capacity else (0 if nbytes <= head else None)
            else:  # wrapped (the newest range starts before the oldest): free is [tail, head)
                start = tail if tail + nbytes <= head else None
        if start is not None:
            self._taken.append((start, start + nbytes))
        return start

    def give_back(self, ranges: int) -> None:
        for _ in range(ranges):
            self._taken.popleft()

    def pending(self) -> int:
        return sum(end - start for start, end in self._taken)


class SaveQueue:
    def __init__(self, client, capacity: int, background: bool = True):
        self._client = client
        self._ring = StagingRing(capacity)
        self._lock = threading.Condition()
        self._staged: list[_Staged] = []
        self._done: list[Saved] = []
        self._writing = 0                 # saves taken by the writer, not yet done
        self._shed_until = 0.0
        self._backoff = BACKOFF_FIRST
        self._closed = False
        self._writer = None
        if background:
            self._writer = threading.Thread(target=self._write_loop, name="kvpool-saves", daemon=True)
            self._writer.start()

    def stage(self, tag, keys: Sequence[str], block_ids: Sequence[int], layer_caches: Sequence, kv_first: bool,
              size: int) -> None:
        """Copy the blocks out of the caches now (on the caller's thread and stream) and queue them to be
        written; shed what the ring has no room for, or everything while the pool pushes back."""
        began = time.perf_counter()
        with self._lock:
            shedding = time.monotonic() < self._shed_until
        staged = []
        chunk = max(1, self._ring.capacity // 4 // max(size, 1))  # a long prompt is staged in parts
        at = 0
        while not shedding and at < len(keys):
            count = min(chunk, len(keys) - at)
            with self._lock:
                offset = self._ring.take(count * size, layer_caches[0])
            if offset is None:
                break
            out = self._ring.buffer[offset:offset + count * size].view(count, size)
            gather_blocks(layer_caches, block_ids[at:at + count], kv_first, out=out)
            staged.append(_Staged(tag, list(keys[at:at + count]), offset, size, stream_order.mark(layer_caches),
                                  began))
            at += count
        shed = len(keys) - at
        with self._lock:
            if shed:
                self._done.append(Saved(tag, 0, 0, shed, 0.0))
            self._staged.extend(staged)
            self._lock.notify_all()
        if self._writer is None and staged:
            self._write(self._take())

    def outcomes(self) -> list[Saved]:
        """Saves done (or shed) since the last call."""
        with self._lock:
            done, self._done = self._done, []
        return done

    def pending_bytes(self) -> int:
        with self._lock:
            return self._ring.pending()

    def drain(self, timeout: float) -> bool:
        """Wait until every staged save is written (True) or `timeout` seconds pass (False)."""
        deadline = time.monotonic() + timeout
        with self._lock:
            while self._staged or self._writing:
                left = deadline - time.monotonic()
                if left <= 0 or self._writer is None:
                    return not (self._staged or self._writing)
                self._lock.wait(left)
        return True

    def close(self, timeout: float) -> None:
        """Write what is staged (for `timeout` seconds at most), then stop the writer and close its client."""
        self.drain(timeout)
        with self._lock:
            self._closed = True
            self._lock.notify_all()
        if self._writer is not None:
            self._writer.join(timeout)
        self._client.close()

    # ------------------------------------------------------------------ the writer

    def _take(self) -> list[_Staged]:
        with self._lock:
            batch, self._staged = self._staged, []
            self._writing += len(batch)
        return batch

    def _write_loop(self) -> None:
        while True:
            with self._lock:
                while not self._staged and not self._closed:
                    self._lock.wait()
                if self._closed and not self._staged:
                    return
            self._write(self._take())

    def _write(self, batch: list[_Staged]) -> None:
        try:
            self._write_batch(batch)
        except Exception:  # never leave the engine's saves waiting on a writer that is gone
            log.exception("kvpool: writing %d saves failed", len(batch))
            self._finish(batch, None, dict.fromkeys(range(sum(len(s.keys) for s in batch)), RuntimeError()))

    def _write_batch(self, batch: list[_Staged]) -> None:
        """Write every staged save of `batch` kvpool does not hold yet, in one batch; record each outcome."""
        for staged in batch:
            stream_order.follow(staged.ready)
        keys = [key for staged in batch for key in staged.keys]
        offsets = [staged.offset + n * staged.size for staged in batch for n in range(len(staged.keys))]
        sizes = [staged.size for staged in batch for _ in staged.keys]
        failed: dict[int, BaseException] = {}   # index in keys -> why it was not written
        written = [False] * len(keys)
        try:
            todo = [i for i, there in enumerate(self._client.batch_exists(keys)) if not there]
            if todo:
                try:
                    self._client.batch_put_from([keys[i] for i in todo], self._ring.buffer,
                                                offsets=[offsets[i] for i in todo], sizes=[sizes[i] for i in todo])
                except BatchError as exc:
                    failed.update(self._failures(keys, exc))
                try:  # the puts' ends: a pool with no room evicts what was just written before its end
                    self._client.flush()
                except BatchError as exc:
                    failed.update(self._failures(keys, exc))
                for i in todo:
                    written[i] = i not in failed
        except KvpoolError as exc:
            failed = {i: exc for i in range(len(keys))}
            written = [False] * len(keys)
        self._finish(batch, written, failed)

    def _finish(self, batch: list[_Staged], written, failed: dict[int, BaseException]) -> None:
        """Record each staged save's outcome (written[i]: key i was written; failed: index -> error), free its
        room in the ring, and shed for a while if the pool pushed back."""
        if failed:
            count = sum(len(staged.keys) for staged in batch)
            log.warning("kvpool: %d of %d blocks not saved: %s", len(failed), count, next(iter(failed.values())))
        now = time.perf_counter()
        with self._lock:
            self._push_back(any(isinstance(error, PUSHBACK) for error in failed.values()))
            self._ring.give_back(len(batch))
            at = 0
            for staged in batch:
                indices = range(at, at + len(staged.keys))
                at += len(staged.keys)
                lost = any(i in failed for i in indices)
                done = None if lost else sum(bool(written and written[i]) for i in indices)
                self._done.append(Saved(staged.tag, len(indices), done, 0, now - staged.began))
            self._writing -= len(batch)
            self._lock.notify_all()

    @staticmethod
    def _failures(keys: list[str], exc: BatchError) -> dict[int, BaseException]:
        """Index in `keys` -> error, of a batch's failed keys (a block someone else stored first, same hash and
        same bytes, is not a failure)."""
        where = {key: i for i, key in enumerate(keys)}
        return {where[key]: error for key, error in exc.errors.items()
                if key in where and not isinstance(error, KeyExistsError)}

    def _push_back(self, refused: bool) -> None:
        """Shed new saves for a while after the pool refused some (under the lock)."""
        if refused:
            self._shed_until = time.monotonic() + self._backoff
            log.warning("kvpool: the pool refused saves (no space or past their deadline): shedding saves for "
                        "%.2f s", self._backoff)
            self._backoff = min(self._backoff * 2, BACKOFF_MOST)
        else:
            self._backoff = BACKOFF_FIRST
