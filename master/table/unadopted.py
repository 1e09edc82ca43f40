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

from typing import NamedTuple

import numpy as np

from kvpool.protocol.inventory import Columns, Reply

_PRIME = np.uint64(0x100000001B3)
_MIX = np.uint64(0x9E3779B97F4A7C15)
_HASH_SLICE = 65_536  # keys hashed at a time: bounds the temporary arrays


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


class _NodeInventory:
    def __init__(self, node_id: str, instance: str, reply: Reply):
        self.node_id, self.instance, self.reply = node_id, instance, reply
        self.hashes = key_hashes(*reply.key_bytes)
        self.order = np.argsort(self.hashes)
        self.sorted = self.hashes[self.order]
        self.taken = np.zeros(len(reply), dtype=bool)
        self.left = len(reply)
        self.cursor = 0  # the background adoption's place: every entry before it is taken

    def take(self, positions: np.ndarray) -> Found:
        positions = positions[~self.taken[positions]]
        self.taken[positions] = True
        self.left -= len(positions)
        return Found(self.node_id, self.instance, self.reply.columns_at(positions))


class Unadopted:
    def __init__(self):
        self._nodes: list[_NodeInventory] = []

    def add(self, node_id: str, instance: str, reply: Reply) -> None:
        if len(reply):
            self._nodes.append(_NodeInventory(node_id, instance, reply))

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
            low = np.searchsorted(node.sorted, query, "left")
            high = np.searchsorted(node.sorted, query, "right")
            hits = np.flatnonzero(high > low)
            if not len(hits):
                continue
            positions = np.concatenate([node.order[low[i]:high[i]] for i in hits.tolist()])
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

    def disputed_keys(self) -> list[str]:
        """Keys found at more than one generation (on one node or several; a hash shared by two keys
        counts too): an overwrite or a remove the previous leader did not see through everywhere.
        Adopted before anything is served, so no node is trusted to serve reads (REPORTed) while it
        holds a version another holds a newer one of."""
        clashes = []
        nodes = self._nodes
        for i, node in enumerate(nodes):
            here = node.sorted
            twice = here[1:] == here[:-1]  # a hash twice on one node (rare): settled whatever its generations
            if twice.any():
                clashes.append(here[1:][twice])
            for other in nodes[i + 1:]:
                there = other.sorted
                if not len(there):
                    continue
                at = np.minimum(np.searchsorted(there, here), len(there) - 1)
                # Generations are looked up for the hashes both hold only (few, usually): a gather over
                # every record costs more than the rest of this together.
                both = np.flatnonzero(there[at] == here)
                generations = node.reply.records["generation"][node.order[both]]
                other_generations = other.reply.records["generation"][other.order[at[both]]]
                clashes.append(here[both][other_generations != generations])
        disputed = np.unique(np.concatenate(clashes)) if clashes else np.zeros(0, dtype=np.uint64)
        if not len(disputed):
            return []
        keys = []
        for node in self._nodes:
            positions = np.flatnonzero(np.isin(node.hashes, disputed))
            keys += node.reply.columns_at(positions).keys
        return keys

