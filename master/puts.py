"""How a put opens and ends in the master's object table: placement, pending versions, commit.

A mixin of ObjectTable (objects.py), whose state it works on: a put_start places
the new version and keeps it pending (invisible) with its bytes reserved on its
nodes; put_end makes it the visible version (freeing the one it replaces);
put_revoke, the put timeout or an eviction reported first end it otherwise.
Batches place every put with what is read of the nodes once.
"""

from dataclasses import dataclass

from kvpool.errors import (
    InvalidArgumentError, KeyExistsError, KeyNotFoundError, KvpoolError, NoSpaceError, PutExpiredError,
    UnavailableError, ValueTooLargeError,
)

from kvpool.protocol.write_options import raw_size_problem

from .placement import MostFreeSpace, spread_zones
from .versions import DRAM, NO_OPTIONS, ObjectVersion, PutOptions, Replica


MAX_REPLICAS = 16  # default --max-replicas: copies one put may ask for


@dataclass
class PendingPut:
    version: ObjectVersion
    deadline: float
    min_replicas: int = 0  # copies PutEnd needs written (0 = every target)


class Puts:
    """The put lifecycle of ObjectTable (which holds the state it uses)."""

    def put_start(self, key: str, size: int, checksum: int, overwrite: bool = False, replicas: int = 1,
                  options: PutOptions = NO_OPTIONS, compressed: bool = False, raw_size: int = 0,
                  min_replicas: int = 0) -> ObjectVersion:
        """Choose nodes for a new version of `key`; it stays invisible until put_end.

        `replicas` distinct nodes (distinct zones first) when that many can hold it, else as
        many as can; with `min_replicas` > 0, fewer than that many candidates is NO_SPACE."""
        (started,) = self.put_start_many((key,), (size,), (checksum,), overwrite, replicas, options,
                                         (compressed,), (raw_size,), min_replicas)
        if isinstance(started, KvpoolError):
            raise started
        return started

    def put_start_many(self, keys, sizes, checksums, overwrite: bool = False, replicas: int = 1,
                       options: PutOptions = NO_OPTIONS, compressed=None, raw_sizes=None,
                       min_replicas: int = 0) -> list:
        """put_start of every key with the same settings (compressed and raw_sizes: per key, or None
        for uncompressed values). One result per key: its pending ObjectVersion, or the KvpoolError
        that refused it. Settings no key could be put with raise."""
        replicas = max(replicas, 1)
        if replicas > self.max_replicas:  # each copy is work for the table, the client and repair
            raise InvalidArgumentError(f"replicas {replicas} exceeds --max-replicas {self.max_replicas}")
        if min_replicas < 0 or min_replicas > replicas:
            raise InvalidArgumentError(f"min_replicas must be between 0 and replicas ({replicas}), "
                                       f"got {min_replicas}")
        options.validate()
        tier = options.tier or DRAM
        place = self._placer(replicas, tier)
        now = self._clock()
        deadline = now + self.put_timeout
        expires_at = now + options.ttl_seconds if options.ttl_seconds > 0 else None
        pending, committed, nodes = self._pending, self._committed, self.nodes
        results = []
        for i, key in enumerate(keys):
            size = sizes[i]
            packed = bool(compressed[i]) if compressed is not None else False
            raw_size = raw_sizes[i] if raw_sizes is not None else 0
            try:
                if size < 0:
                    raise InvalidArgumentError(f"size must not be negative, got {size}")
                problem = raw_size_problem(size, raw_size, packed)
                if problem:
                    raise InvalidArgumentError(problem)
                if key in pending:
                    self._expire_if_due(key)
                    if key in pending:
                        raise KeyExistsError(f"put of {key!r} in progress")
                if self._committed.expiring:
                    self._expire_object_if_due(key)
                if not overwrite and key in committed:
                    raise KeyExistsError(f"{key!r} already exists")
                placed: tuple[Replica, ...] = ()
                if size > 0:
                    placed = place(size)
                    if len(placed) < min_replicas:
                        raise NoSpaceError(f"only {len(placed)} storage nodes can take {key!r}; "
                                           f"min_replicas is {min_replicas}")
            except KvpoolError as exc:
                results.append(exc)
                continue
            version = ObjectVersion(key, size, checksums[i], self._new_generation(), placed, options=options,
                                    compressed=packed, raw_size=raw_size if packed else size,
                                    expires_at=expires_at, target_replicas=replicas if size > 0 else 0)
            for r in placed:
                nodes[r.node_id].reserve(version.generation, tier, size, key)
            pending[key] = PendingPut(version, deadline, min_replicas)
            results.append(version)
        return results

    def _placer(self, count: int, tier: str):
        """place(size) -> the replicas for an object of that size, for puts that share `count` and
        `tier`: what every one of them would look at once (the candidates, the size limit) is
        looked at once. Raises for a size no node can take."""
        candidates, largest = [], 0
        for n in self.nodes.values():
            largest = max(largest, n.largest_tier)
            if not n.draining:
                candidates.append(n)
        limit = largest if self._max_object_size is None else min(self._max_object_size, largest)
        # One copy: the best node is the whole answer (spread_zones takes the first); more: rank them all.
        wanted = len(candidates) if count > 1 else 1
        choose, shared = self.placement.choose, self._replica_sets
        simple = isinstance(self.placement, MostFreeSpace)
        only = candidates[0] if len(candidates) == 1 and simple else None
        pick = self.placement.one_at_a_time(candidates, tier) if simple and count == 1 and not only else None

        def place(size: int) -> tuple[Replica, ...]:
            if not self.nodes:
                raise NoSpaceError("no storage nodes")
            if size > limit:
                raise ValueTooLargeError(f"object of {size} bytes exceeds the maximum of {limit}")
            if not candidates:
                raise NoSpaceError("every storage node is draining")
            if only is not None:  # one node to choose from: the usual small cluster
                chosen = [only] if only.largest_tier >= size else []
            elif pick is not None:
                best = pick(size)
                chosen = [best] if best is not None else []
            else:
                chosen = choose(candidates, size, wanted, tier)
                if count > 1:
                    chosen = spread_zones(chosen, count)
            if not chosen:  # only when every node is smaller than the object
                raise NoSpaceError(f"no storage node can hold {size} bytes")
            ids = tuple(n.node_id for n in chosen)
            replicas = shared.get((ids, tier))
            if replicas is None:
                replicas = shared[(ids, tier)] = tuple(Replica(n.node_id, n.address, tier) for n in chosen)
            return replicas

        return place

    def put_end(self, key: str, generation: int, failed_nodes=()) -> ObjectVersion:
        """Make the pending version visible; frees whatever version it replaces.

        `failed_nodes`: targets the client could not write. The rest are committed if they are at
        least the put's min_replicas (the object is then repaired up to its target); else the put
        stays pending for the client to revoke."""
        failed = set(failed_nodes) if failed_nodes else None
        pending = self._pending.get(key)
        current = self._committed.get(key)
        if (pending is None or pending.version.generation != generation) and current is not None \
                and current.generation == generation:
            # Already committed: a new leader adopted it from its nodes, and the client asks again.
            return current
        if failed:
            self._check_written(key, generation, failed)
        pending = self._take_pending(key, generation)
        if failed:
            lost = pending.version._replace(replicas=tuple(r for r in pending.version.replicas
                                                           if r.node_id in failed))
            self._release_pending(lost)  # whatever part of the payload reached them is freed
            pending.version = pending.version._replace(replicas=tuple(
                r for r in pending.version.replicas if r.node_id not in failed))
        version = pending.version
        self._unreserve(version)
        if version.size > 0 and not version.replicas:
            raise KeyNotFoundError(f"{key!r} was evicted by its storage nodes before the put ended")
        if version.size > 0 and self.live_count(version) < version.target_replicas:
            self.repair_keys.add(key)
        old = self._committed.get(key)
        if old is not None:  # its copies are let go before the new version's are noted
            self._bytes -= old.size
            self._release_committed(old)
        seq = self._last_seq = next(self._seq)
        for r in version.replicas:
            node = self.nodes.get(r.node_id)
            if node is not None:
                node.landed(seq, r.tier, version.size)
                node.keys.add(key)
        self._committed[key] = version
        self._bytes += version.size
        self.counters.puts += 1
        return version

    def put_end_many(self, keys, generations) -> list:
        """put_end of each (key, generation) with every copy written: None for each that ended,
        else the KvpoolError that refused it."""
        results = []
        end = self.put_end
        for key, generation in zip(keys, generations):
            try:
                end(key, generation)
            except KvpoolError as exc:
                results.append(exc)
            else:
                results.append(None)
        return results

    def _check_written(self, key: str, generation: int, failed: set) -> None:
        self._expire_if_due(key)
        pending = self._pending.get(key)
        if pending is None or pending.version.generation != generation:
            return  # _take_pending names the problem
        targets = {r.node_id for r in pending.version.replicas}
        unknown = failed - targets
        if unknown:
            raise InvalidArgumentError(f"failed_nodes {sorted(unknown)} are not targets of this put")
        needed = pending.min_replicas or len(targets)
        if len(targets) - len(failed) < needed:
            raise UnavailableError(f"only {len(targets) - len(failed)} of {len(targets)} copies of {key!r} "
                                   f"were written; {needed} needed")

    def put_revoke(self, key: str, generation: int) -> None:
        """Abandon a pending put; the previous version (if any) stays."""
        self._release_pending(self._take_pending(key, generation).version)

    def _take_pending(self, key: str, generation: int) -> PendingPut:
        self._expire_if_due(key)
        pending = self._pending.get(key)
        if pending is None or pending.version.generation != generation:
            raise PutExpiredError(f"no pending put of {key!r} with generation {generation} "
                                  f"(never started, revoked, or reclaimed after {self.put_timeout:g}s)")
        del self._pending[key]
        return pending

    def _unreserve(self, version: ObjectVersion) -> None:
        for r in version.replicas:
            node = self.nodes.get(r.node_id)
            if node is not None:
                node.unreserve(version.generation)

    def reclaim_expired(self) -> list[str]:
        """Revoke every pending put past its deadline; returns their keys."""
        now = self._clock()
        keys = [k for k, p in self._pending.items() if p.deadline <= now]
        for key in keys:
            self._release_pending(self._pending.pop(key).version)
        self.counters.reclaimed_puts += len(keys)
        return keys

    def _expire_if_due(self, key: str) -> None:
        # The periodic reclaim may not have run yet; the outcome must not depend on it.
        pending = self._pending.get(key)
        if pending is not None and pending.deadline <= self._clock():
            del self._pending[key]
            self.counters.reclaimed_puts += 1
            self._release_pending(pending.version)
