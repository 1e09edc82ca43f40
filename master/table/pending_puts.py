"""The puts under way: how a put opens and ends in the master's object table.

A part of ObjectTable (objects.py), working on the table's Ledger: start_many
places each new version and keeps it pending (invisible) with its bytes reserved
on its nodes; end makes it the visible version (the Ledger frees the one it
replaces); revoke, the put timeout, an eviction reported first or the loss of a
target node end it otherwise. Batches place every put with what is read of the
nodes once.
"""

from dataclasses import dataclass

from kvpool.errors import (
    InvalidArgumentError, KeyExistsError, KeyNotFoundError, KvpoolError, NoSpaceError, PutExpiredError,
    UnavailableError,
)
from kvpool.protocol.write_options import raw_size_problem

from kvpool.master.table.ledger import Ledger
from kvpool.master.table.node_state import NodeState
from kvpool.master.table.placement import MostFreeSpace, PlacementPolicy, placer
from kvpool.master.table.versions import DRAM, NO_OPTIONS, SHARED, ObjectVersion, PutOptions, Replica

MAX_REPLICAS = 16  # default --max-replicas: copies one put may ask for
new_version = tuple.__new__  # ObjectVersion from all its fields in order


@dataclass
class PendingPut:
    version: ObjectVersion
    deadline: float
    min_replicas: int = 0  # copies PutEnd needs written (0 = every target)
    gone: tuple = ()  # ids of targets taken off because their node left (PutEnd may still name them failed)


class PendingPuts:
    """Puts started and not yet ended, by key (at most one per key)."""

    def __init__(self, ledger: Ledger, placement: PlacementPolicy | None = None, put_timeout: float = 30.0,
                 max_object_size: int | None = None, max_replicas: int = MAX_REPLICAS):
        self._ledger = ledger
        self.placement = placement or MostFreeSpace()
        self.put_timeout = put_timeout
        self.max_replicas = max_replicas
        self.max_object_size = max_object_size  # the configured limit (None: the largest tier decides)
        self._open: dict[str, PendingPut] = {}
        self._replica_sets: dict = {}  # (node ids, tier) -> replicas placed there; dropped as nodes change

    def reset(self) -> None:
        self._open = {}
        self._replica_sets = {}

    def nodes_changed(self) -> None:
        """A node joined, left or moved: placements remembered by node id may name a stale address."""
        self._replica_sets = {}

    def __len__(self) -> int:
        return len(self._open)

    def __contains__(self, key: str) -> bool:
        return key in self._open

    def keys(self):
        return self._open.keys()

    def placed(self, key: str, generation: int) -> bool:
        """(key, generation) is an open put: its copies are its own to end or revoke."""
        pending = self._open.get(key)
        return pending is not None and pending.version.generation == generation

    # ----- opening -----

    def start_many(self, keys, sizes, checksums, overwrite: bool = False, replicas: int = 1,
                   options: PutOptions = NO_OPTIONS, compressed=None, raw_sizes=None,
                   min_replicas: int = 0) -> list:
        """Choose nodes for a new version of each key; each stays invisible until end().

        `replicas` distinct nodes (distinct zones first) when that many can hold it, else as
        many as can; with `min_replicas` > 0, fewer than that many candidates is NO_SPACE.
        compressed and raw_sizes: per key, or None for uncompressed values. One result per
        key: its pending ObjectVersion, or the KvpoolError that refused it. Settings no key
        could be put with raise."""
        replicas = max(replicas, 1)
        if replicas > self.max_replicas:  # each copy is work for the table, the client and repair
            raise InvalidArgumentError(f"replicas {replicas} exceeds --max-replicas {self.max_replicas}")
        if min_replicas < 0 or min_replicas > replicas:
            raise InvalidArgumentError(f"min_replicas must be between 0 and replicas ({replicas}), "
                                       f"got {min_replicas}")
        options.validate()
        tier = options.tier or DRAM
        ledger = self._ledger
        nodes, committed = ledger.nodes, ledger.committed
        candidates = nodes.values()
        if tier == SHARED:  # stored in the DRAM of a node that mounts the shared tier, which moves it on at once
            tier, servers = DRAM, ledger.shared.servers
            candidates = [node for node_id, node in nodes.items() if node_id in servers]
            if not candidates:
                raise NoSpaceError("tier='shared': no storage node mounts a shared tier (--shared-dir)")
        place = placer(candidates, self.placement, self.max_object_size, self._replica_sets, replicas, tier)
        now = ledger.clock()
        deadline = now + self.put_timeout
        expires_at = now + options.ttl_seconds if options.ttl_seconds > 0 else None
        pending = self._open
        if committed.expiring:  # an object past its ttl is gone: drop it before asking what exists
            for key in keys:
                ledger.expire_if_due(key)
        exists = [False] * len(keys) if overwrite else committed.contains_many(keys)
        results = []
        for i, key in enumerate(keys):
            size = sizes[i]
            packed = bool(compressed[i]) if compressed is not None else False
            raw_size = raw_sizes[i] if raw_sizes is not None else 0
            try:
                if size < 0:
                    raise InvalidArgumentError(f"size must not be negative, got {size}")
                if packed or raw_size and raw_size != size:  # else raw_size_problem has none
                    problem = raw_size_problem(size, raw_size, packed)
                    if problem:
                        raise InvalidArgumentError(problem)
                if key in pending:
                    self._expire_if_due(key)
                    if key in pending:
                        raise KeyExistsError(f"put of {key!r} in progress")
                if exists[i]:
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
            generation = ledger.new_generation()
            # A plain tuple: ObjectVersion() with keywords costs several times more.
            version = new_version(ObjectVersion, (key, size, checksums[i], generation, placed, options, packed,
                                                  raw_size if packed else size, expires_at,
                                                  replicas if size > 0 else 0))
            for r in placed:
                nodes[r.node_id].reserve(generation, tier, size, key)
            pending[key] = PendingPut(version, deadline, min_replicas)
            results.append(version)
        return results

    # ----- ending -----

    def end(self, key: str, generation: int, failed_nodes=()) -> ObjectVersion:
        """Make the pending version visible; the version it replaces is freed.

        `failed_nodes`: targets the client could not write. The rest are committed if they are at
        least the put's min_replicas (the object is then repaired up to its target); else the put
        stays pending for the client to revoke."""
        failed = set(failed_nodes) if failed_nodes else None
        ledger = self._ledger
        pending = self._open.get(key)
        if pending is None or pending.version.generation != generation:
            current = ledger.committed.get(key)
            if current is not None and current.generation == generation:
                # Already committed: a new leader adopted it from its nodes, and the client asks again.
                return current
        if failed:
            self._check_written(key, generation, failed)
        pending = self._take(key, generation)
        if failed:
            lost = pending.version._replace(replicas=tuple(r for r in pending.version.replicas
                                                           if r.node_id in failed))
            ledger.release_pending(lost)  # whatever part of the payload reached them is freed
            pending.version = pending.version._replace(replicas=tuple(
                r for r in pending.version.replicas if r.node_id not in failed))
        version = pending.version
        nodes = ledger.nodes
        for r in version.replicas:
            node = nodes.get(r.node_id)
            if node is not None:
                node.unreserve(generation)
        if version.size > 0:
            if not version.replicas:
                raise KeyNotFoundError(f"{key!r} was evicted by its storage nodes before the put ended")
            if ledger.live_count(version) < version.target_replicas:
                ledger.repair_keys.add(key)
        ledger.commit(key, version)
        ledger.counters.puts += 1
        return version

    def endable(self, keys, generations, now: float) -> bool:
        """Whether end_many(keys, generations, now) would end every one of these puts on its common
        path, committing a version where none was (so it would release nothing, free nothing and
        refuse nothing): the test ObjectTable makes before it lets such a batch wait to be folded."""
        open_ = self._open
        for key, generation in zip(keys, generations):
            pending = open_.get(key)
            if pending is None or pending.deadline <= now:
                return False
            version = pending.version
            if version.generation != generation or version.size <= 0 or not version.replicas:
                return False
        return not any(self._ledger.committed.contains_many(keys))

    def end_many(self, keys, generations, now: float | None = None) -> list:
        """end() of each (key, generation) with every copy written: None for each that ended,
        else the KvpoolError that refused it. The common case, a put still pending and in time with
        copies left, is committed here as end() would, without its general steps. now: the moment
        the ends arrived (default: the clock's now), against which each put's deadline is judged."""
        results = []
        ledger, open_ = self._ledger, self._open
        nodes = ledger.nodes
        if now is None:
            now = ledger.clock()  # one batch, one moment
        ending, versions = [], []  # committed together (Ledger.commit_many)
        for key, generation in zip(keys, generations):
            pending = open_.get(key)
            if pending is not None and pending.deadline > now:
                version = pending.version
                if version.generation == generation and version.size > 0 and version.replicas:
                    del open_[key]
                    live = 0  # Ledger.live_count
                    for r in version.replicas:
                        node = nodes.get(r.node_id)
                        if node is not None:
                            node.unreserve(generation)
                            live += not node.draining
                    if live < version.target_replicas:
                        ledger.repair_keys.add(key)
                    ending.append(key)
                    versions.append(version)
                    results.append(None)
                    continue
            self._commit(ending, versions)  # end() may look at what those made visible
            try:
                self.end(key, generation)
            except KvpoolError as exc:
                results.append(exc)
            else:
                results.append(None)
        self._commit(ending, versions)
        return results

    def _commit(self, keys: list[str], versions: list[ObjectVersion]) -> None:
        """Commit the puts end_many has taken so far (and forget them)."""
        if keys:
            self._ledger.commit_many(keys, versions)
            self._ledger.counters.puts += len(keys)
            keys.clear()
            versions.clear()

    def _check_written(self, key: str, generation: int, failed: set) -> None:
        self._expire_if_due(key)
        pending = self._open.get(key)
        if pending is None or pending.version.generation != generation:
            return  # _take names the problem
        targets = {r.node_id for r in pending.version.replicas}
        unknown = failed - targets - set(pending.gone)  # a target whose node left (revoke_on) may be named
        if unknown:
            raise InvalidArgumentError(f"failed_nodes {sorted(unknown)} are not targets of this put")
        needed = pending.min_replicas or len(targets)
        if len(targets - failed) < needed:
            raise UnavailableError(f"only {len(targets - failed)} of {len(targets)} copies of {key!r} "
                                   f"were written; {needed} needed")

    def revoke(self, key: str, generation: int) -> None:
        """Abandon a pending put; the previous version (if any) stays."""
        self._ledger.release_pending(self._take(key, generation).version)

    def _take(self, key: str, generation: int) -> PendingPut:
        self._expire_if_due(key)
        pending = self._open.get(key)
        if pending is None or pending.version.generation != generation:
            raise PutExpiredError(f"no pending put of {key!r} with generation {generation} "
                                  f"(never started, revoked, or reclaimed after {self.put_timeout:g}s)")
        del self._open[key]
        return pending

    # ----- ended otherwise -----

    def reclaim_expired(self) -> list[str]:
        """Revoke every pending put past its deadline; returns their keys."""
        now = self._ledger.clock()
        keys = [k for k, p in self._open.items() if p.deadline <= now]
        for key in keys:
            self._ledger.release_pending(self._open.pop(key).version)
        self._ledger.counters.reclaimed_puts += len(keys)
        return keys

    def _expire_if_due(self, key: str) -> None:
        # The periodic reclaim may not have run yet; the outcome must not depend on it.
        pending = self._open.get(key)
        if pending is not None and pending.deadline <= self._ledger.clock():
            del self._open[key]
            self._ledger.counters.reclaimed_puts += 1
            self._ledger.release_pending(pending.version)

    def target_evicted(self, node: NodeState, key: str, generation: int) -> bool:
        """`node` evicted (key, generation) before PutEnd, if that is a pending put: the target no longer
        counts (end() decides whether any is left). False if it is no pending put."""
        pending = self._open.get(key)
        if pending is None or pending.version.generation != generation:
            return False
        version = pending.version
        pending.version = version._replace(replicas=tuple(r for r in version.replicas
                                                          if r.node_id != node.node_id))
        node.unreserve(generation)
        return True

    def target_moved(self, node: NodeState, key: str, generation: int, shared: tuple) -> bool:
        """`node` wrote (key, generation) on to the shared tier before PutEnd (a put(tier="shared") moves on
        as soon as it is stored, and the client's PutEnd may come after the node's word): the put commits with
        the shared copy in place of the node's. False if it is no pending put."""
        pending = self._open.get(key)
        if pending is None or pending.version.generation != generation:
            return False
        version = pending.version
        kept = tuple(r for r in version.replicas if r.node_id not in (node.node_id, shared[0].node_id))
        pending.version = version._replace(replicas=kept + shared)
        node.unreserve(generation)
        return True

    def revoke_on(self, node: NodeState) -> list[str]:
        """Revoke the puts with a target on `node`, which is gone (the client cannot finish writing to
        it); returns their keys. A put that needs fewer copies (min_replicas) than it has targets left
        only loses this one: its client may still end it with the copies it wrote elsewhere."""
        revoked = []
        for generation, (_, _, key) in node.pending.items():
            pending = self._open.get(key)
            if pending is not None and pending.version.generation == generation:
                version = pending.version
                left = tuple(r for r in version.replicas if r.node_id != node.node_id)
                if pending.min_replicas and len(left) >= pending.min_replicas:
                    pending.version = version._replace(replicas=left)
                    pending.gone += (node.node_id,)
                    continue
                del self._open[key]
                revoked.append(key)
                self._ledger.release_pending(pending.version)
        return revoked
