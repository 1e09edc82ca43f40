"""Which storage nodes receive the replicas of a new object."""

from typing import Protocol, Sequence, TypeVar


class Candidate(Protocol):
    """What a policy may look at: a node and the free space of its target tier."""

    node_id: str

    @property
    def free_bytes(self) -> int: ...

    @property
    def largest_free(self) -> int: ...


C = TypeVar("C", bound=Candidate)


class PlacementPolicy(Protocol):
    def choose(self, candidates: Sequence[C], size: int, count: int) -> list[C]:
        """Up to `count` distinct candidates that can each hold `size` bytes, best first.

        Fewer (or none) when fewer fit; the caller decides whether that is enough.
        """


class MostFreeSpace:
    """Spread load: the nodes with the most free bytes first, ties by node id for stable tests."""

    def choose(self, candidates: Sequence[C], size: int, count: int) -> list[C]:
        # largest_free, not free_bytes, decides whether it fits: a fragmented node
        # may have plenty of free bytes and still no single extent large enough.
        fitting = [c for c in candidates if c.largest_free >= size]
        fitting.sort(key=lambda c: (-c.free_bytes, c.node_id))
        return fitting[:max(count, 0)]
