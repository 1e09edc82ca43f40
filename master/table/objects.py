"""The master's object table: which version of each key is visible, which nodes hold it,
and how full every node is believed to be.

Pure bookkeeping: no I/O. Every method runs to completion on the event loop, so
the table needs no locks. Nodes place objects inside themselves; the master
only names nodes. What it knows of a node's usage is the node's last REPORT plus
the bytes of puts it sent there since, which that report could not yet show.

The table is the one interface the rest of the master uses. It answers lookups
itself and hands each other concern to a part, all working on one Ledger (the
state and the steps that keep it consistent: ledger.py):
- PendingPuts (pending_puts.py): puts opened, ended, revoked, reclaimed;
- NodeEvents (node_events.py): nodes joining, leaving, reporting, evicting;
- InventoryMatch (inventory_match.py): a node's inventory taken back;
- Replication (replication.py): copies kept up to each object's target, drains.

Whatever releases a replica (overwrite, remove, revoke, reclaim, expiry, a
rejected inventory entry) queues a FreeOrder; the owner drains them with
take_frees() and tells the nodes.

Ends that wait: a BatchPutEnd is usually followed at once by its client's next
lookup. end_later takes a batch whose every end is plain (a new key, its put
pending and in time: nothing to release, free or refuse) and keeps it to fold
into the table later; exists_many reads through the kept ends, and every other
method folds them first (_folds_first), so no reader and no change ever sees
the table without them. The owner folds them soon after (fold_ends).

Adopting while serving: a new leader's inventories are given to take_inventory and
start_adopting, and adopted by adopt_next in the background; until then every
method naming keys adopts their entries first (_adopt_named, unadopted.py), so no
answer depends on how far the background adoption got.
"""

import functools
import logging
import time
from collections.abc import Callable

from kvpool.protocol.cluster_layout import NodeRecord
from kvpool.errors import KeyNotFoundError, KvpoolError, UnavailableError
from kvpool.protocol.inventory import Columns
from kvpool.protocol.tenants import Scope

from kvpool.master.table import key_order
from kvpool.master.table.inventory_match import Adopted, InventoryMatch
from kvpool.master.table.ledger import Counters, FreeOrder, Ledger
from kvpool.master.table.node_events import Dropped, NodeEvents
from kvpool.master.table.node_state import NodeState
from kvpool.master.table.pending_puts import MAX_REPLICAS, PendingPuts
from kvpool.master.table.placement import PlacementPolicy
from kvpool.master.table.replication import Replication
from kvpool.master.table.shared_tier import SHARED_NODE, SharedTier
from kvpool.master.table.unadopted import Unadopted
from kvpool.master.table.versions import NO_OPTIONS, ObjectVersion, PutOptions

log = logging.getLogger(__name__)


class ObjectTable:
    def __init__(self, *, placement: PlacementPolicy | None = None, put_timeout: float = 30.0,
                 max_object_size: int | None = None, clock: Callable[[], float] = time.monotonic,
                 first_generation: int | None = None, max_replicas: int = MAX_REPLICAS):
        self._ledger = ledger = Ledger(clock, first_generation)
        self._puts = PendingPuts(ledger, placement, put_timeout, max_object_size, max_replicas)
        self._node_events = NodeEvents(ledger, self._puts)
        self._inventory = InventoryMatch(ledger, self._puts)
        self._replication = Replication(ledger)
        self._waiting_ends: list[tuple[list, list, float]] = []  # (keys, generations, arrived at), in order
        self._waiting_keys: set[str] = set()  # every key of _waiting_ends
        self._unadopted = Unadopted()  # a new leader's inventories not adopted yet (unadopted.py)

    def reset(self) -> None:
        """Forget every node, object and pending put (a deposed leader's table may be stale; the next
        term rebuilds it from the nodes' inventories). The generation counter and the counters go on,
        so no generation is ever handed out twice."""
        self._ledger.reset()
        self._puts.reset()
        self._unadopted = Unadopted()

    # ----- what the table holds -----

    @property
    def nodes(self) -> dict[str, NodeState]:
        """Every registered node, by id (read only: change it through upsert_node and drop_node)."""
        return self._ledger.nodes

    @property
    def counters(self) -> Counters:
        return self._ledger.counters

    @property
    def repair_keys(self) -> set[str]:
        """Keys that may have fewer live copies than their target (repair.py checks and clears)."""
        return self._ledger.repair_keys

    @property
    def placement(self) -> PlacementPolicy:
        return self._puts.placement

    @property
    def put_timeout(self) -> float:
        return self._puts.put_timeout

    @property
    def max_object_size(self) -> int:
        """The largest tier of any node, or the configured limit if that is smaller."""
        largest = max((n.largest_tier for n in self._ledger.nodes.values() if not n.shared), default=0)
        limit = self._puts.max_object_size
        return largest if limit is None else min(limit, largest)

    # ----- membership and what nodes tell the master (node_events.py) -----

    def upsert_node(self, record: NodeRecord) -> Dropped | None:
        return self._node_events.upsert_node(record)

    def drop_node(self, node_id: str, grant_until: float = float("-inf")) -> Dropped:
        return self._node_events.drop_node(node_id, grant_until)

    def report_mark(self) -> int:
        return self._node_events.report_mark()

    def apply_report(self, node_id: str, instance: str, report: dict, mark: int) -> list[str]:
        if self._unadopted and report.get("evicted"):
            self._adopt_named(_evicted_keys(report["evicted"]))
        return self._node_events.apply_report(node_id, instance, report, mark)

    def apply_evictions(self, node_id: str, instance: str, evicted) -> list[str]:
        if self._unadopted:
            self._adopt_named(_evicted_keys(evicted))
        return self._node_events.apply_evictions(node_id, instance, evicted)

    def drop_replica(self, key: str, generation: int, node_id: str) -> bool:
        if self._unadopted:
            self._adopt_named((key,))
        return self._node_events.drop_replica(key, generation, node_id)

    # ----- inventories (inventory_match.py) -----

    def adopt_inventory(self, node_id: str, instance: str, entries: list) -> Adopted:
        return self._inventory.adopt_inventory(node_id, instance, entries)

    def adopt_columns(self, node_id: str, instance: str, columns: Columns) -> Adopted:
        return self._inventory.adopt_columns(node_id, instance, columns)

    def take_inventory(self, node_id: str, instance: str, reply) -> None:
        """A new leader's INVENTORY reply of one node, indexed (unadopted.py) as it comes, to adopt
        once start_adopting has seen them all."""
        self._unadopted.add(node_id, instance, reply)

    def take_entries(self, node_id: str, instance: str, layers) -> None:
        """take_inventory of a node's inventory as a standby kept it: (unadopted.NodeEntries, mask of those
        not to adopt) each (master/leadership/inventory_mirror.py)."""
        for entries, taken in layers:
            self._unadopted.add_entries(node_id, instance, entries, taken)

    def start_adopting(self, known_disputes: dict | None = None) -> int:
        """Adopt the inventories take_inventory was given while serving: no generation any of them
        holds is handed out again, and keys held at several generations are adopted at once
        (unadopted.py; `known_disputes`: found ahead, Unadopted.disputed_keys). Returns how many entries are
        left to adopt_next."""
        unadopted = self._unadopted
        self._ledger.generation_seen(unadopted.max_generation())
        self._adopt_named(unadopted.disputed_keys(known_disputes))
        return unadopted.left

    def adopt_next(self, size: int) -> Adopted | None:
        """Adopt up to `size` more entries of one node's inventory given to start_adopting; None once
        every entry was adopted."""
        found = self._unadopted.next_slice(size)
        return None if found is None else self.adopt_columns(*found)

    @property
    def adopting(self) -> int:
        """Inventory entries given to start_adopting not adopted yet."""
        return self._unadopted.left

    def _adopt_named(self, keys) -> None:
        """Adopt every entry still unadopted of `keys`, before a call that names them reads or changes them."""
        for found in self._unadopted.take(keys):
            self._inventory.adopt_columns(*found)

    def _unless_adopting(self, what: str) -> None:
        if self._unadopted:
            raise UnavailableError(f"{what} needs every object known: this leader is still adopting "
                                   f"{self._unadopted.left} inventory entries; try again in a moment")

    # ----- puts (pending_puts.py) -----

    def put_start(self, key: str, size: int, checksum: int, overwrite: bool = False, replicas: int = 1,
                  options: PutOptions = NO_OPTIONS, compressed: bool = False, raw_size: int = 0,
                  min_replicas: int = 0) -> ObjectVersion:
        """Choose nodes for a new version of `key`; it stays invisible until put_end (PendingPuts.start_many)."""
        if self._unadopted:
            self._adopt_named((key,))
        (started,) = self._puts.start_many((key,), (size,), (checksum,), overwrite, replicas, options,
                                           (compressed,), (raw_size,), min_replicas)
        if isinstance(started, KvpoolError):
            raise started
        return started

    def put_start_many(self, keys, sizes, checksums, overwrite: bool = False, replicas: int = 1,
                       options: PutOptions = NO_OPTIONS, compressed=None, raw_sizes=None,
                       min_replicas: int = 0) -> list:
        if self._unadopted:
            self._adopt_named(keys)
        return self._puts.start_many(keys, sizes, checksums, overwrite, replicas, options, compressed,
                                     raw_sizes, min_replicas)

    def put_end(self, key: str, generation: int, failed_nodes=()) -> ObjectVersion:
        if self._unadopted:  # a put the previous leader started, asked again: maybe adopted already
            self._adopt_named((key,))
        return self._puts.end(key, generation, failed_nodes)

    def put_end_many(self, keys, generations) -> list:
        if self._unadopted:
            self._adopt_named(keys)
        return self._puts.end_many(keys, generations)

    def end_later(self, keys, generations) -> bool:
        """If every one of these ends is plain (PendingPuts.endable: each would commit a new key and
        free or refuse nothing), keep them to fold later (fold_ends) and return True: each is as good
        as done. Else False, and nothing changes."""
        now = self._ledger.clock()
        if not self._puts.endable(keys, generations, now):
            return False
        keys = list(keys)
        self._waiting_ends.append((keys, list(generations), now))
        self._waiting_keys.update(keys)
        return True

    def fold_ends(self) -> None:
        """Commit the ends end_later kept, in the order they came, each judged at the moment it came
        (as it was answered)."""
        if self._waiting_ends:
            waiting, self._waiting_ends = self._waiting_ends, []
            self._waiting_keys = set()
            for keys, generations, arrived in waiting:
                refused = [exc for exc in self._puts.end_many(keys, generations, arrived) if exc is not None]
                if refused:  # cannot happen (end_later took only plain ends, and nothing ran between)
                    log.error("%d ends answered OK were refused when folded, e.g. %s", len(refused), refused[0])

    def put_revoke(self, key: str, generation: int) -> None:
        self._puts.revoke(key, generation)

    def reclaim_expired(self) -> list[str]:
        return self._puts.reclaim_expired()

    # ----- reads and removes -----

    def get(self, key: str) -> ObjectVersion:
        """The live committed version for a reader: a shared copy named at a node serving the tier now."""
        version = self.lookup(key)
        counters = self._ledger.counters
        if version is None:
            counters.misses += 1
            raise KeyNotFoundError(f"{key!r} not found")
        counters.hits += 1
        replicas = version.replicas
        if replicas and replicas[-1].node_id == SHARED_NODE:  # (with_copy keeps it last)
            shared = self._ledger.shared
            shared.keys.touch(key)  # what readers ask for goes last at capacity
            version = version._replace(replicas=replicas[:-1] + shared.replica)
        return version

    def lookup(self, key: str) -> ObjectVersion | None:
        """The live committed version, without counting a hit or miss."""
        if self._unadopted:
            self._adopt_named((key,))
        ledger = self._ledger
        if ledger.committed.expiring:
            ledger.expire_if_due(key)
        return ledger.committed.get(key)

    def exists(self, key: str) -> bool:
        if self._unadopted:
            self._adopt_named((key,))
        ledger = self._ledger
        committed = ledger.committed
        if committed.expiring:
            ledger.expire_if_due(key)
        return key in committed

    def exists_many(self, keys: list[str]) -> list[bool]:
        """exists() of each key, in order; a key of an end still waiting is there (it is new)."""
        if self._unadopted:  # no waiting end's key is left to adopt: its put adopted it
            self._adopt_named(keys)
        ledger = self._ledger
        committed = ledger.committed
        if committed.expiring:
            self.fold_ends()
            for key in keys:
                ledger.expire_if_due(key)
        found = committed.contains_many(keys)
        waiting = self._waiting_keys
        if waiting:
            return [there or key in waiting for key, there in zip(keys, found)]
        return found

    def remove(self, key: str) -> None:
        """Drop the committed version of `key` (a pending put of it is left alone)."""
        if self._unadopted:
            self._adopt_named((key,))
        ledger = self._ledger
        ledger.expire_if_due(key)
        if ledger.discard(key) is None:
            raise KeyNotFoundError(f"{key!r} not found")
        ledger.counters.removes += 1

    def remove_by_prefix(self, prefix: str) -> int:
        """Remove every live committed key starting with `prefix`; returns how many."""
        self._unless_adopting("removing by prefix")
        keys = [k for k in self._ledger.committed if k.startswith(prefix)]
        removed = 0
        for key in keys:
            if not self._ledger.expire_if_due(key):
                self.remove(key)
                removed += 1
        return removed

    def drop_expired(self) -> list[str]:
        """Drop every committed object past its ttl; returns their keys."""
        ledger = self._ledger
        now = ledger.clock()
        keys = [k for k, expires_at in ledger.committed.expiring.items() if expires_at <= now]
        for key in keys:
            ledger.expire_if_due(key)
        return keys

    # ----- the shared tier (shared_tier.py) -----

    @property
    def shared(self) -> SharedTier:
        return self._ledger.shared

    def evict_shared(self) -> list[str]:
        """Above the shared tier's high watermark: its coldest copies go (FREEs ordered to the node serving
        it, which unlinks their files). Returns the keys that lost their last copy."""
        ledger = self._ledger
        victims = ledger.shared.victims()
        if not victims:
            return []
        if self._unadopted:
            self._adopt_named(victims)
        committed = ledger.committed
        entries = [(key, committed[key].generation) for key in victims if key in committed]
        removed = []
        for (key, generation), outcome in zip(entries, ledger.drop_copies(entries, SHARED_NODE)):
            if outcome is None:
                continue
            ledger.free_shared(key.encode(), generation, replaced=False)
            ledger.counters.evicted_replicas += 1
            if outcome:
                ledger.counters.evicted_objects += 1
                removed.append(key)
        ledger.shared.keys.difference_update([key for key in victims if key not in committed])
        return removed

    def take_frees(self) -> list[FreeOrder]:
        """The replicas released since the last call, for the nodes to forget."""
        return self._ledger.take_frees()

    # ----- change tracking, for whoever follows the table -----

    def track_changes(self, on: bool = True) -> None:
        """Start (or stop) marking the keys whose committed version changes, for take_appeared_and_gone()."""
        self._ledger.committed.tracking = on

    @property
    def has_changes(self) -> bool:
        return self._ledger.committed.has_changes

    def take_appeared_and_gone(self) -> tuple[list[str], list[str]]:
        """Keys committed since the last take that were absent before, and keys gone that were present
        (what the key feed reports); a key only replaced or re-placed is in neither."""
        return self._ledger.committed.take_appeared_and_gone()

    def list_keys(self, prefix: str, limit: int, cursor: str = "", scope: Scope | None = None) -> tuple[list[str], str]:
        """A page of the live committed keys beginning with `prefix`, above `cursor`, in `scope` (None:
        every key), in order: (up to `limit` keys, the next page's cursor or "" at the end). A
        page reads about as many keys as it gives (key_order.py), whatever the table holds."""
        self._unless_adopting("listing keys")
        expiring = self._ledger.committed.expiring
        if expiring:
            now = self._ledger.clock()
            hidden = lambda key: expiring.get(key, now + 1) <= now  # noqa: E731 - past its ttl, not swept yet
        else:
            hidden = _never
        return key_order.page(self._ledger.committed.order, prefix, limit, cursor, scope, hidden)

    def committed_keys(self, prefix: str = "") -> list[str]:
        """Every committed key starting with `prefix` (one not yet dropped after its ttl included)."""
        return [key for key in self._ledger.committed if key.startswith(prefix)]

    # ----- accounting -----

    @property
    def object_count(self) -> int:
        return len(self._ledger.committed)

    @property
    def total_bytes(self) -> int:
        return self._ledger.bytes

    @property
    def pending_count(self) -> int:
        return len(self._puts)

    def objects_on(self, node_id: str) -> int:
        """Committed replicas on one node."""
        return len(self._ledger.nodes[node_id].keys)

    # ----- replication: what repair and drain need (replication.py) -----

    def live_count(self, version: ObjectVersion) -> int:
        return self._ledger.live_count(version)

    def under_replicated(self) -> int:
        return self._replication.under_replicated()

    def start_drain(self, node_id: str) -> int:
        self._unless_adopting("a drain")
        return self._replication.start_drain(node_id)

    def add_replica(self, key: str, generation: int, node_id: str, tier: str) -> bool:
        if self._unadopted:
            self._adopt_named((key,))
        return self._replication.add_replica(key, generation, node_id, tier)

    def settle_drain(self, key: str) -> None:
        self._replication.settle_drain(key)


def _never(_key: str) -> bool:
    return False


def _evicted_keys(evicted) -> list[str]:
    """The keys of a node's evictions ([key, generation] each; malformed ones are skipped later)."""
    return [str(entry[0]) for entry in evicted or () if isinstance(entry, (list, tuple)) and entry]


# What may run with ends still waiting: exists_many reads through them, end_later adds to them (a key
# it takes is new and pending, so one waiting end cannot change another's verdict), take_frees gets
# nothing from them (a plain end frees nothing), fold_ends is about them.
_READ_THROUGH = {"end_later", "exists_many", "take_frees", "fold_ends"}


def _folding(method):
    @functools.wraps(method)
    def folded_first(table, *args, **kwargs):
        if table._waiting_ends:
            table.fold_ends()
        return method(table, *args, **kwargs)
    return folded_first


def _folds_first(cls):
    """Every public method and property of cls not in _READ_THROUGH folds the waiting ends first."""
    for name, attr in list(vars(cls).items()):
        if name.startswith("_") or name in _READ_THROUGH:
            continue
        if isinstance(attr, property):
            setattr(cls, name, property(_folding(attr.fget), attr.fset, attr.fdel, attr.__doc__))
        elif callable(attr):
            setattr(cls, name, _folding(attr))
    return cls


_folds_first(ObjectTable)
