"""What nodes joining, leaving and reporting do to the master's object table.

A part of ObjectTable (objects.py), working on the table's Ledger and its
PendingPuts: a node registered or refreshed; a node lost (its copies are gone:
objects with none left are removed, the rest repaired, puts to it revoked); a
REPORT (usage per tier, evictions); a copy the node says it no longer holds.
A node losing a copy by failure has it made again (repair); a node choosing to
drop one (eviction) lowers the object's target instead.
"""

from dataclasses import dataclass, field

from kvpool.protocol.cluster_layout import NodeRecord

from kvpool.master.table.ledger import Ledger
from kvpool.master.table.node_state import NodeState, capacities
from kvpool.master.table.pending_puts import PendingPuts
from kvpool.master.table.shared_tier import MOVED, PROMOTED, SHARED_NODE
from kvpool.master.table.versions import DRAM, Replica


@dataclass
class Dropped:
    """What losing (or restarting) a node cost."""

    node_id: str
    removed: list[str] = field(default_factory=list)  # committed keys whose last replica was there
    revoked: list[str] = field(default_factory=list)  # pending puts that had a target there


class NodeEvents:
    def __init__(self, ledger: Ledger, pending: PendingPuts):
        self._ledger = ledger
        self._pending = pending

    # ----- membership -----

    def upsert_node(self, record: NodeRecord) -> Dropped | None:
        """Add a node, or refresh one; a new instance of a known node lost what it held
        (until its inventory gives some of it back)."""
        self._pending.nodes_changed()  # an address may change
        nodes = self._ledger.nodes
        self._ledger.shared.node_seen(record)
        node = nodes.get(record.node_id)
        if node is not None and node.instance == record.instance:
            node.address = record.address
            node.transports = list(record.transports)
            node.capacity = capacities(record)
            node.zone = record.zone
            return None
        dropped = self.drop_node(record.node_id) if node is not None else None
        nodes[record.node_id] = NodeState(record)
        nodes[record.node_id].draining = node is not None and node.draining  # a restart does not undo a drain
        return dropped

    def drop_node(self, node_id: str, grant_until: float = float("-inf")) -> Dropped:
        """Forget a node and every replica on it; unknown nodes are a no-op. A node whose read grant
        may last until `grant_until` is still freed on meanwhile (Ledger.still_serving)."""
        self._pending.nodes_changed()
        ledger = self._ledger
        dropped = Dropped(node_id)
        if node_id == SHARED_NODE:
            return dropped  # the cluster's, not a registered node's
        ledger.shared.node_gone(node_id)
        node = ledger.nodes.pop(node_id, None)
        if node is None:
            return dropped
        ledger.still_serving(node_id, node.address, node.keys, grant_until)
        dropped.revoked = self._pending.revoke_on(node)
        dropped.removed, kept, gone_bytes = ledger.committed.without_node(node_id, node.keys)
        ledger.bytes -= gone_bytes
        ledger.repair_keys.update(kept)  # a lost node is a failure: its copies are made again
        return dropped

    # ----- what nodes tell the master -----

    def report_mark(self) -> int:
        """Taken just before asking a node for a REPORT: commits up to here are in its answer."""
        return self._ledger.last_seq

    def apply_report(self, node_id: str, instance: str, report: dict, mark: int) -> list[str]:
        """Take in one REPORT (asked for at `mark`): usage per tier, and drop the replicas the
        node evicted. Returns the keys that lost their last replica. A report from an instance
        that is no longer registered is ignored."""
        node = self._ledger.nodes.get(node_id)
        if node is None or node.instance != instance:
            return []
        tiers = report.get("tiers") or {}
        node.reported = {name: dict(stats) for name, stats in tiers.items() if isinstance(stats, dict)}
        tenants = report.get("tenants")
        node.tenants = tenants if isinstance(tenants, dict) else {}
        version = report.get("version")
        node.version = version[:32] if isinstance(version, str) else ""
        fault = report.get("shared_fault")
        node.shared_fault = fault[:200] if isinstance(fault, str) else ""
        node.reported_up_to(mark)
        node.reports += 1
        self._ledger.counters.reports += 1
        return self._apply_evicted(node, report.get("evicted"))

    def apply_evictions(self, node_id: str, instance: str, evicted) -> list[str]:
        """Drop the replicas a node says it evicted ([key, generation] each, from REPORT or
        EVICTIONS); returns the keys that lost their last replica. Ignored from an instance
        no longer registered."""
        node = self._ledger.nodes.get(node_id)
        if node is None or node.instance != instance:
            return []
        return self._apply_evicted(node, evicted)

    def _apply_evicted(self, node: NodeState, evicted) -> list[str]:
        entries, moves = [], []
        for entry in evicted or ():
            try:
                if len(entry) > 2:  # [key, generation, how]: moved to the shared tier, or a copy made here
                    moves.append((str(entry[0]), int(entry[1]), str(entry[2])))
                else:
                    entries.append((str(entry[0]), int(entry[1])))
            except (TypeError, ValueError, IndexError):
                continue
        if moves:
            self._apply_moves(node, moves)
        counters = self._ledger.counters
        pending = self._pending
        if len(pending):  # a pending put's target evicted before PutEnd no longer counts
            committed = [(k, g) for k, g in entries if not (k in pending and pending.target_evicted(node, k, g))]
            counters.evicted_replicas += len(entries) - len(committed)
            entries = committed
        removed = []
        for (key, _), dropped in zip(entries, self._ledger.drop_copies(entries, node.node_id)):
            if dropped is None:
                continue  # not the version here (or none)
            counters.evicted_replicas += 1
            if dropped:
                counters.evicted_objects += 1
                removed.append(key)
            else:
                self._accept_loss(key)
        return removed

    def _apply_moves(self, node: NodeState, moves: list[tuple[str, int, str]]) -> None:
        """A node wrote (key, generation) to the shared tier and dropped its own copy (MOVED), or copied a
        shared object into its DRAM (PROMOTED). A version no longer current has its new copy freed."""
        ledger = self._ledger
        committed, shared = ledger.committed, ledger.shared
        for key, generation, how in moves:
            version = committed.get(key)
            current = version is not None and version.generation == generation
            if how == MOVED:
                if shared.node is None:  # no node mounting the tier is registered: as an eviction
                    self._apply_evicted(node, [(key, generation)])
                    continue
                if not current:
                    if self._pending.target_moved(node, key, generation, shared.replica):  # before its PutEnd
                        continue
                    # superseded or removed while it was written: its file goes
                    ledger.free_shared(key.encode(), generation, replaced=False)
                    continue
                replicas = tuple(r for r in version.replicas if r.node_id not in (node.node_id, SHARED_NODE))
                committed[key] = version._replace(replicas=replicas + shared.replica)
                node.keys.discard(key)
                shared.keys.add(key)
            elif how == PROMOTED:
                if not current:
                    ledger.free(node.address, key.encode(), generation, replaced=False)
                elif all(r.node_id != node.node_id for r in version.replicas):
                    # Before the shared copy: readers take the first replica, and DRAM is nearer.
                    committed[key] = version._replace(replicas=(Replica(node.node_id, node.address, DRAM),)
                                                      + version.replicas)
                    node.keys.add(key)

    def _accept_loss(self, key: str) -> None:
        """A node chose to drop a copy (eviction, not failure): the object keeps one copy fewer
        rather than being repaired back onto a node that is short of room."""
        committed = self._ledger.committed
        version = committed[key]
        if version.target_replicas > 1:
            committed[key] = version._replace(target_replicas=version.target_replicas - 1)

    def drop_replica(self, key: str, generation: int, node_id: str) -> bool:
        """The node said it does not hold (key, generation): forget that replica.
        True if the object is gone as a result."""
        removed = bool(self._ledger.drop_copy(key, generation, node_id))
        if removed:
            self._ledger.counters.evicted_objects += 1
        elif key in self._ledger.committed:
            self._accept_loss(key)
        return removed
