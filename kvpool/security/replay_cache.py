"""The master's memory of gRPC call proofs already taken, bounded without refusing honest callers.

A proof names the time it was made (milliseconds) and a fresh nonce; one is taken once. The cache
remembers the nonces of the proofs it took, ordered by their time. Those older than the window are
forgotten: the window refuses them anyway. When it is full it drops the oldest and from then refuses
every proof not newer than the one dropped (the floor): a replay of it, or of anything older, can no
longer be told apart. An honest caller's proof is fresh, so it stays above the floor as long as the
cache spans more time than proofs may run ahead of the master's clock: a flood that fills `capacity`
entries must come faster than capacity / MAX_AHEAD proofs a second (20,000 a second at the defaults,
more than a master takes) before a fresh proof meets the floor.
"""

import heapq

WINDOW_MS = 300_000  # how old a proof may be on the master's clock (a caller's clock behind it)
MAX_AHEAD_MS = 10_000  # how far ahead of the master's clock (one ahead of it): bounds what a flood can raise the floor to
CAPACITY = 200_000  # nonces remembered


class ProofRefused(Exception):
    """A proof the cache will not take; the message says why."""


class ReplayCache:
    def __init__(self, capacity: int = CAPACITY, window_ms: int = WINDOW_MS, max_ahead_ms: int = MAX_AHEAD_MS):
        if capacity < 1:
            raise ValueError(f"a replay cache needs room for at least one proof, got {capacity}")
        self.capacity = capacity
        self.window_ms = window_ms
        self.max_ahead_ms = max_ahead_ms
        self.floor_ms = -1  # proofs made at or before this are refused (the newest dropped while full)
        self._by_time: list[tuple[int, str]] = []  # (made at, nonce), oldest first
        self._nonces: set[str] = set()

    def __len__(self) -> int:
        return len(self._nonces)

    def take(self, made_ms: int, nonce: str, now_ms: int) -> None:
        """Take the proof made at `made_ms` with `nonce`, or raise ProofRefused."""
        if made_ms < now_ms - self.window_ms:
            raise ProofRefused(f"call proof made {(now_ms - made_ms) / 1000:.1f}s before the master's clock "
                               f"(more than {self.window_ms / 1000:g}s): check this host's clock")
        if made_ms > now_ms + self.max_ahead_ms:
            raise ProofRefused(f"call proof made {(made_ms - now_ms) / 1000:.1f}s ahead of the master's clock "
                               f"(more than {self.max_ahead_ms / 1000:g}s): check this host's clock")
        self._forget_before(now_ms - self.window_ms)
        if nonce in self._nonces:
            raise ProofRefused("call proof already used (a replayed call)")
        if len(self._nonces) >= self.capacity:
            dropped_ms, dropped = heapq.heappop(self._by_time)
            self._nonces.discard(dropped)
            self.floor_ms = max(self.floor_ms, dropped_ms)
        if made_ms <= self.floor_ms:
            raise ProofRefused(f"call proof not newer than the last one the master forgot under load "
                               f"({self.floor_ms - made_ms} ms older): make a new call")
        heapq.heappush(self._by_time, (made_ms, nonce))
        self._nonces.add(nonce)

    def _forget_before(self, oldest_ms: int) -> None:
        by_time = self._by_time
        while by_time and by_time[0][0] < oldest_ms:
            self._nonces.discard(heapq.heappop(by_time)[1])
