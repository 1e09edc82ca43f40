"""The inventories a new leader received and has not adopted yet: it serves while it adopts them.

Adopting a million inventory entries into the table takes seconds, and a put needs only the nodes'
free space, so a new leader serves as soon as every node's INVENTORY is in, and adopts the entries a
slice at a time in the background (takeover.py). Meanwhile a key the table does not show may still
exist, so every table call that names keys first takes those keys' entries out of here, from every
node, and adopts them (ObjectTable names them): a lookup never answers "missing" for a key a node
holds, an overwrite replaces the version it finds, a remove removes it. Each entry is adopted once,
on demand or in the background, whichever comes first.

Keys are found by a 64-bit hash of their bytes, computed with numpy over a whole reply (no Python
object per entry) and kept sorted; a hash that matches is confirmed by comparing the key itself.
Pure bookkeeping: no I/O.
"""

import itertools
from typing import NamedTuple

import numpy as np

from kvpool.protocol.inventory import Columns, Reply

_PRIME = np.uint64(0x100000001B3)
_MIX = np.uint64(0x9E3779B97F4A7C15)
_HASH_SLICE = 65_536  # keys hashed at a time: bounds the temporary arrays
_IDENTS = itertools.count(1)


def key_hashes(blob: bytes, ends: np.ndarray) -> np.ndarray:
    """A 64-bit hash of each key, the keys' bytes back to back in `blob` with `ends` their cumulative
    end offsets: a polynomial over its bytes, mixed with its length."""
    count = len(ends)
    out = np.zeros(count, dtype=np.uint64)
    data = np.frombuffer(blob, dtype=np.uint8)
    with np.errstate(over="ignore"):
        for first in range(0, count, _HASH_SLICE):
            part_ends = ends[first:first + _HASH_SLICE]
            begin = int(ends[first - 1]) if first else 0
            stop = int(part_ends[-1])
            lengths = np.diff(part_ends, prepend=begin)
            starts = part_ends - lengths - begin
            hashed = lengths.astype(np.uint64) * _MIX
            if stop > begin:
                longest = int(lengths.max())
                powers = np.cumprod(np.full(longest, _PRIME, dtype=np.uint64))
                if int(lengths.min()) == longest:  # keys of one length (the usual case): a matrix
                    rows = data[begin:stop].reshape(len(part_ends), longest).astype(np.uint64)
                    rows *= powers
                    hashed += rows.sum(axis=1, dtype=np.uint64)
                else:
                    position = np.arange(stop - begin) - np.repeat(starts, lengths)
                    weighted = data[begin:stop].astype(np.uint64) * powers[position]
                    sums = np.add.reduceat(weighted, np.minimum(starts, stop - begin - 1))
                    hashed += np.where(lengths > 0, sums, np.uint64(0))
            hashed ^= hashed >> np.uint64(31)
            hashed *= _MIX
            hashed ^= hashed >> np.uint64(29)
            out[first:first + len(part_ends)] = hashed
    return out


def hashes_of(keys) -> np.ndarray:
    """key_hashes of str keys, as a reply carries them."""
    raw = [key.encode("utf-8", "surrogateescape") for key in keys]
    return key_hashes(b"".join(raw), np.cumsum([len(k) for k in raw], dtype=np.int64))


class Found(NamedTuple):
    """Entries of one node taken out to adopt."""

    node_id: str
    instance: str
    columns: Columns


class NodeEntries:
    """One node's inventory reply with its keys' hashes sorted for lookups: built as a reply arrives, or
    ahead of a takeover by a standby (master/leadership/inventory_mirror.py)."""

    def __init__(self, reply: Reply):
        self.ident = next(_IDENTS)  # names it in a cache of disputes (an id() may be reused)
        self.reply = reply
        self.hashes = key_hashes(*reply.key_bytes)
        self.order = np.argsort(self.hashes)
        self.sorted = self.hashes[self.order]

    def __len__(self) -> int:
        return len(self.reply)


class _NodeInventory:
    def __init__(self, node_id: str, instance: str, entries: NodeEntries, taken: np.ndarray | None = None):
        self.node_id, self.instance, self.entries = node_id, instance, entries
        self.reply, self.hashes, self.order, self.sorted = entries.reply, entries.hashes, entries.order, entries.sorted
        # `taken` given: entries not to adopt (superseded in a standby's copy, or past their TTL)
        self.taken = np.zeros(len(entries), dtype=bool) if taken is None else taken.copy()
        self.left = len(entries) - int(np.count_nonzero(self.taken))
        self.cursor = 0  # the background adoption's place: every entry before it is taken

    def positions_of(self, hashes: np.ndarray) -> np.ndarray:
        """The positions in the reply of every entry whose key hashes to one of `hashes`."""
        low = np.searchsorted(self.sorted, hashes, "left")
        high = np.searchsorted(self.sorted, hashes, "right")
        hits = np.flatnonzero(high > low)
        if not len(hits):
            return np.zeros(0, dtype=np.int64)
        return np.concatenate([self.order[low[i]:high[i]] for i in hits.tolist()])

    def take(self, positions: np.ndarray) -> Found:
        positions = positions[~self.taken[positions]]
        self.taken[positions] = True
        self.left -= len(positions)
        return Found(self.node_id, self.instance, self.reply.columns_at(positions))


def clashes(one: NodeEntries, other: NodeEntries) -> np.ndarray:
    """The hashes `one` and `other` both hold at different generations (disputes between them), the
    smaller searched in the larger."""
    if len(one) > len(other):
        one, other = other, one
    here, there = one.sorted, other.sorted
    if not len(here) or not len(there):
        return np.zeros(0, dtype=np.uint64)
    at = np.minimum(np.searchsorted(there, here), len(there) - 1)
    # Generations are looked up for the hashes both hold only (few, usually): a gather over
    # every record costs more than the rest of this together.
    both = np.flatnonzero(there[at] == here)
    generations = one.reply.records["generation"][one.order[both]]
    other_generations = other.reply.records["generation"][other.order[at[both]]]
    return here[both][other_generations != generations]


class Unadopted:
    def __init__(self):
        self._nodes: list[_NodeInventory] = []

    def add(self, node_id: str, instance: str, reply: Reply) -> None:
        if len(reply):
            self._nodes.append(_NodeInventory(node_id, instance, NodeEntries(reply)))

    def add_entries(self, node_id: str, instance: str, entries: NodeEntries, taken: np.ndarray) -> None:
        """Entries prepared ahead (a standby's copy), those marked in `taken` not to be adopted."""
        if len(entries):
            self._nodes.append(_NodeInventory(node_id, instance, entries, taken))

    @property
    def left(self) -> int:
        """Entries not taken yet."""
        return sum(node.left for node in self._nodes)

    def __bool__(self) -> bool:
        return any(node.left for node in self._nodes)

    def max_generation(self) -> int:
        return max((int(node.reply.records["generation"].max()) for node in self._nodes), default=0)

    def take(self, keys) -> list[Found]:
        """Every entry of `keys` not taken yet, from every node."""
        if not self:
            return []
        wanted = set(keys)
        query = hashes_of(wanted)
        found = []
        for node in self._nodes:
            if not node.left:
                continue
            positions = node.positions_of(query)
            positions = positions[~node.taken[positions]]
            if not len(positions):
                continue
            candidates = node.reply.columns_at(positions)
            same = np.fromiter((key in wanted for key in candidates.keys), dtype=bool, count=len(positions))
            if same.any():
                found.append(node.take(positions[same]))
        return found

    def next_slice(self, size: int) -> Found | None:
        """Up to `size` entries not taken yet, of one node, in reply order (None when none is left)."""
        for node in self._nodes:
            while node.left:
                stop = min(node.cursor + size, len(node.taken))
                positions = np.arange(node.cursor, stop)
                node.cursor = stop
                part = node.take(positions)
                if part.columns.keys:
                    return part
        return None

    def disputed_keys(self, known: dict | None = None) -> list[str]:
        """Keys found at more than one generation (on one node or several; a hash shared by two keys
        counts too): an overwrite or a remove the previous leader did not see through everywhere.
        Adopted before anything is served, so no node is trusted to serve reads (REPORTed) while it
        holds a version another holds a newer one of. `known`: clashes() of pairs of entries computed
        ahead, by their entries' idents (a standby's, master/leadership/inventory_mirror.py)."""
        found = []
        nodes = self._nodes
        for i, node in enumerate(nodes):
            here = node.sorted
            twice = here[1:] == here[:-1]  # a hash twice on one node (rare): settled whatever its generations
            if twice.any():
                found.append(here[1:][twice])
            for other in nodes[i + 1:]:
                pair = (node.entries.ident, other.entries.ident)
                if known is not None and (pair in known or pair[::-1] in known):
                    found.append(known.get(pair, known.get(pair[::-1])))
                else:
                    found.append(clashes(node.entries, other.entries))
        disputed = np.unique(np.concatenate(found)) if found else np.zeros(0, dtype=np.uint64)
        if not len(disputed):
            return []
        keys = []
        for node in self._nodes:
            positions = node.positions_of(disputed)
            if len(positions):
                keys += node.reply.columns_at(np.sort(positions)).keys
        return keys
