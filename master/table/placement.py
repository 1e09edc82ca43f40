"""Which storage nodes receive the replicas of a new object."""

from collections.abc import Callable, Iterable, Sequence
from typing import Protocol, TypeVar

from kvpool.errors import NoSpaceError, ValueTooLargeError

from kvpool.master.table.node_state import NodeState
from kvpool.master.table.versions import Replica

TIER_ORDER = ("dram", "ssd")


class Candidate(Protocol):
    """What a policy may look at: a node, its believed free space per tier, its largest tier."""

    node_id: str
    zone: str  # "" for none

    def free_bytes(self, tier: str) -> int: ...

    @property
    def largest_tier(self) -> int: ...


C = TypeVar("C", bound=Candidate)


class PlacementPolicy(Protocol):
    def choose(self, candidates: Sequence[C], size: int, count: int, tier: str = "dram") -> list[C]:
        """Up to `count` distinct candidates for an object of `size` bytes that prefers `tier`,
        best first. Fewer (or none) when fewer can hold it at all."""


class MostFreeSpace:
    """Spread load: the most free space in the preferred tier first, then in the other tier;
    ties by node id for stable tests.

    Free space is a belief (last report minus puts sent since) and a full node makes room
    by demoting and evicting, so only a node whose every tier is smaller than the object
    is left out; one that has no room right now answers NO_SPACE itself.
    """

    def choose(self, candidates: Sequence[C], size: int, count: int, tier: str = "dram") -> list[C]:
        fitting = [c for c in candidates if c.largest_tier >= size]
        if len(fitting) <= 1:  # nothing to rank
            return fitting[:max(count, 0)]
        first, *rest = (tier, *(t for t in TIER_ORDER if t != tier))
        if len(rest) == 1:  # the usual two tiers, without a generator per node
            second = rest[0]

            def rank(c):
                return -c.free_bytes(first), -c.free_bytes(second), c.node_id
        else:
            def rank(c):
                return -c.free_bytes(first), *(-c.free_bytes(t) for t in rest), c.node_id
        if count == 1:  # the best one: no need to order the rest
            return [min(fitting, key=rank)]
        fitting.sort(key=rank)
        return fitting[:max(count, 0)]


    def one_at_a_time(self, candidates: Sequence[C], tier: str = "dram"):
        """pick(size) -> what choose(candidates, size, 1, tier) would answer, for puts of one copy
        placed one after another, each then reserving its size in `tier` of the node picked: free
        space is read of every node once and kept up to date here, so a batch is placed in time
        linear in its size. None when no candidate can hold `size`."""
        first, *rest = (tier, *(t for t in TIER_ORDER if t != tier))
        # [-free in the preferred tier, -free in the others, node id, largest tier, candidate]
        state = [[-c.free_bytes(first), tuple(-c.free_bytes(t) for t in rest), c.node_id, c.largest_tier, c]
                 for c in candidates]

        def pick(size: int):
            best = None
            for e in state:
                if e[3] >= size and (best is None or e[0] < best[0] or e[0] == best[0] and (
                        e[1] < best[1] or e[1] == best[1] and e[2] < best[2])):
                    best = e
            if best is None:
                return None
            best[0] += size
            return best[4]

        return pick


def spread_zones(ranked: Sequence[C], count: int, taken: Sequence[str] = ()) -> list[C]:
    """Up to `count` of `ranked` (best first), taking nodes in zones not yet used (`taken`, then
    each pick's) before a second node of any zone, so one lost zone costs as few copies as possible.
    Nodes without a zone (\"\") are each a zone of their own."""
    used = {z for z in taken if z}
    chosen: list[C] = []
    for c in ranked:
        zone = c.zone
        if len(chosen) < count and (not zone or zone not in used):
            chosen.append(c)
            used.add(zone)
    for c in ranked:
        if len(chosen) >= count:
            break
        if c not in chosen:
            chosen.append(c)
    return chosen


def placer(nodes: Iterable[NodeState], policy: PlacementPolicy, max_object_size: int | None,
           shared: dict, count: int, tier: str) -> Callable[[int], tuple[Replica, ...]]:
    """place(size) -> the replicas for an object of that size, for puts that share `count` and
    `tier`: what every one of them would look at once (the candidates, the size limit) is
    looked at once. Raises for a size no node can take. `shared`: (node ids, tier) -> the
    replica tuple placed there, so equal placements share one tuple."""
    candidates, largest, registered = [], 0, False
    for n in nodes:
        if n.shared:  # the shared tier's pseudo-node: objects reach it from nodes, never by a put
            continue
        registered = True
        largest = max(largest, n.largest_tier)
        if not n.draining:
            candidates.append(n)
    limit = largest if max_object_size is None else min(max_object_size, largest)
    # One copy: the best node is the whole answer (spread_zones takes the first); more: rank them all.
    wanted = len(candidates) if count > 1 else 1
    choose = policy.choose
    simple = isinstance(policy, MostFreeSpace)
    only = candidates[0] if len(candidates) == 1 and simple else None
    pick = policy.one_at_a_time(candidates, tier) if simple and count == 1 and not only else None

    def place(size: int) -> tuple[Replica, ...]:
        if not registered:
            raise NoSpaceError("no storage nodes")
        if size > limit:
            raise ValueTooLargeError(f"object of {size} bytes exceeds the maximum of {limit}")
        if not candidates:
            raise NoSpaceError("every storage node is draining")
        if only is not None or pick is not None:  # one node to choose from, or one copy: the usual case
            best = (only if only.largest_tier >= size else None) if only is not None else pick(size)
            if best is not None:
                replicas = alone.get(best.node_id)
                if replicas is None:
                    replicas = alone[best.node_id] = replicas_on([best])
                return replicas
            chosen = []
        else:
            chosen = choose(candidates, size, wanted, tier)
            if count > 1:
                chosen = spread_zones(chosen, count)
        if not chosen:  # only when every node is smaller than the object
            raise NoSpaceError(f"no storage node can hold {size} bytes")
        return replicas_on(chosen)

    def replicas_on(chosen) -> tuple[Replica, ...]:
        ids = tuple(n.node_id for n in chosen)
        replicas = shared.get((ids, tier))
        if replicas is None:
            replicas = shared[(ids, tier)] = tuple(Replica(n.node_id, n.address, tier) for n in chosen)
        return replicas

    alone: dict[str, tuple[Replica, ...]] = {}  # node id -> replicas_on([that node]), for this batch
    return place
