"""Copies kept up to each object's target: what repair (repair.py) and drain change in the table.

A part of ObjectTable (objects.py), working on the table's Ledger: the objects
short of copies, a node drained (no new placement; its objects copied elsewhere,
then freed there), a copy a repair made.
"""

from kvpool.errors import KeyNotFoundError

from kvpool.master.table.ledger import Ledger
from kvpool.master.table.versions import Replica


class Replication:
    def __init__(self, ledger: Ledger):
        self._ledger = ledger

    def under_replicated(self) -> int:
        """Objects with fewer live copies than their target (repair may not find room for all)."""
        ledger = self._ledger
        count = 0
        for key in ledger.repair_keys:
            version = ledger.committed.get(key)
            if version is not None and ledger.live_count(version) < version.target_replicas:
                count += 1
        return count

    def start_drain(self, node_id: str) -> int:
        """Stop placing on a node and have repair copy its objects elsewhere; returns how many
        objects have a copy there."""
        node = self._ledger.nodes.get(node_id)
        if node is None:
            raise KeyNotFoundError(f"no storage node {node_id!r}")
        node.draining = True
        keys = list(node.keys)
        self._ledger.repair_keys.update(keys)
        for key in keys:
            self.settle_drain(key)
        return len(keys)

    def add_replica(self, key: str, generation: int, node_id: str, tier: str) -> bool:
        """A repair copied (key, generation) to node_id. False (and the copy is freed) when that
        version is no longer current or the node is gone or restarted."""
        ledger = self._ledger
        node = ledger.nodes.get(node_id)
        version = ledger.committed.get(key)
        if node is None or version is None or version.generation != generation:
            if node is not None:
                ledger.free(node.address, key.encode(), generation)
            return False
        if any(r.node_id == node_id for r in version.replicas):
            return True
        ledger.committed[key] = version._replace(replicas=version.replicas + (Replica(node_id, node.address, tier),))
        node.keys.add(key)
        node.landed(ledger.next_seq(), tier, version.size)
        ledger.counters.repairs_done += 1
        ledger.counters.repair_bytes += version.size
        self.settle_drain(key)
        return True

    def settle_drain(self, key: str) -> None:
        """Once an object has its target of copies off draining nodes, free its draining copies."""
        ledger = self._ledger
        version = ledger.committed.get(key)
        if version is None or ledger.live_count(version) < version.target_replicas:
            return
        leaving = tuple(r for r in version.replicas
                        if (node := ledger.nodes.get(r.node_id)) is not None and node.draining)
        if not leaving:
            return
        ledger.committed[key] = version._replace(replicas=tuple(r for r in version.replicas if r not in leaving))
        ledger.release_committed(version._replace(replicas=leaving))
