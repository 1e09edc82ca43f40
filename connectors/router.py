"""KV-aware routing: send each prompt to the engine that has to compute the least of it.

The router follows where every prompt prefix's KV already is, in kvpool's own names (block_keys.block_hashes:
a chained hash of the token prefix, block by block):
- each engine's own prefix cache, from its KV events (vLLM publishes BlockStored / BlockRemoved /
  AllBlocksCleared with `--kv-events-config`; connectors/kv_events.py turns them into `EngineView` calls). An
  engine names its blocks with hashes of its own (seeded per process), so the view maps each engine hash to
  ours, recomputed from the event's tokens and the parent it names; blocks whose KV depends on more than their
  tokens (a LoRA adapter, a cache salt, multimodal input: the event's extra keys) are not mapped and so never
  counted as reusable.
- the pool, from kvpool's own stream of stored and removed blocks (connectors/block_events.py).

For a prompt the router counts, per engine, the leading blocks it holds itself and the leading blocks the pool
holds; a block the engine holds costs nothing, a pool block costs a load (`pool_weight` of a local one; the rest
is computed). An engine's cost for the prompt is the blocks it would compute (those not reusable) plus the work
already queued there (`load_weight` x the blocks each request in flight there computes, plus one for the
request itself), so a busy engine holding a prefix loses to an idle one that can load it from the pool; with
load_weight 0 the most reusable prefix always wins. The lowest cost wins, then the fewest requests in flight, then
the order engines were given in. finished(engine) ends the oldest request in flight there.
"""

from dataclasses import dataclass

from .block_keys import block_hashes


class EngineView:
    """The blocks one engine holds in its own cache, as kvpool block hashes."""

    def __init__(self, name: str):
        self.name = name
        self.blocks: set[str] = set()
        self._ours: dict = {}  # the engine's hash of a block -> ours
        self.queued: list[float] = []  # per request routed here and not finished, oldest first: its work
        self.unmapped = 0  # stored blocks that could not be named (unknown parent, extra keys)

    def stored(self, engine_hashes: list, parent, token_ids: list[int], block_size: int,
               extra_keys: list | None = None) -> int:
        """A run of blocks the engine now holds, chained after `parent` (None: the first blocks of a prompt);
        returns how many could be named."""
        if parent is None:
            previous = ""
        else:
            previous = self._ours.get(parent)
            if previous is None:  # its parent was never seen (events lost, or the engine started before us)
                self.unmapped += len(engine_hashes)
                return 0
        named = 0
        for i, engine_hash in enumerate(engine_hashes):
            tokens = token_ids[i * block_size:(i + 1) * block_size]
            if len(tokens) < block_size or (extra_keys and extra_keys[i]):
                self.unmapped += len(engine_hashes) - i
                break
            ours = block_hashes(tokens, block_size, parent=previous)[0]
            self._ours[engine_hash] = ours
            self.blocks.add(ours)
            previous = ours
            named += 1
        return named

    def removed(self, engine_hashes: list) -> None:
        for engine_hash in engine_hashes:
            ours = self._ours.pop(engine_hash, None)
            if ours is not None:
                self.blocks.discard(ours)

    @property
    def in_flight(self) -> int:
        return len(self.queued)

    def cleared(self) -> None:
        self.blocks.clear()
        self._ours.clear()


@dataclass(frozen=True)
class Score:
    engine: str
    local_blocks: int  # leading prompt blocks the engine holds itself
    pool_blocks: int   # leading prompt blocks kvpool holds
    in_flight: int
    reusable: float    # local blocks, plus pool_weight for each pool block beyond them
    cost: float        # blocks this engine would compute, plus load_weight x the work queued there


def leading(hashes: list[str], held: set[str]) -> int:
    count = 0
    for block in hashes:
        if block not in held:
            break
        count += 1
    return count


class Router:
    """engines: their names, in the order that breaks the last ties; block_size: tokens per block, as the
    engines' caches and the connector's namespace use it."""

    def __init__(self, engines: list[str], block_size: int, pool_weight: float = 0.8, load_weight: float = 1.0):
        if not engines:
            raise ValueError("a router needs at least one engine")
        if not 0 <= pool_weight <= 1:
            raise ValueError(f"pool_weight must be within [0, 1], got {pool_weight}")
        if load_weight < 0:
            raise ValueError(f"load_weight must not be negative, got {load_weight}")
        self.views = {name: EngineView(name) for name in engines}
        self.block_size = block_size
        self.pool_weight = pool_weight
        self.load_weight = load_weight
        self.pool: set[str] = set()

    def view(self, engine: str) -> EngineView:
        return self.views[engine]

    def pool_changed(self, kind: str, block: str) -> None:
        """A block_events event: ("stored" | "removed", block hash)."""
        (self.pool.add if kind == "stored" else self.pool.discard)(block)

    def scores(self, token_ids, parent: str = "") -> list[Score]:
        """Per engine, what of this prompt's prefix it could reuse. At least the last prompt token is always
        computed (its logits give the first output token), so only blocks before it count."""
        loadable = (len(token_ids) - 1) // self.block_size if len(token_ids) else 0
        hashes = block_hashes(token_ids[:loadable * self.block_size], self.block_size, parent=parent)
        pool = leading(hashes, self.pool)
        total = len(token_ids) / self.block_size
        result = []
        for view in self.views.values():
            local = leading(hashes, view.blocks)
            reusable = local + self.pool_weight * max(0, pool - local)
            result.append(Score(view.name, local, pool, view.in_flight, reusable,
                                total - reusable + self.load_weight * sum(view.queued)))
        return result

    def choose(self, token_ids, parent: str = "") -> tuple[str, list[Score]]:
        """The engine to send this prompt to (counted as in flight there until finished())."""
        scores = self.scores(token_ids, parent)
        order = {name: i for i, name in enumerate(self.views)}
        best = min(scores, key=lambda s: (s.cost, s.in_flight, order[s.engine]))
        # What this request adds to the engine's queue: the blocks it computes, and one for the request itself.
        self.views[best.engine].queued.append(len(token_ids) / self.block_size - best.reusable + 1)
        return best.engine, scores

    def finished(self, engine: str) -> None:
        queued = self.views[engine].queued
        if queued:
            queued.pop(0)


class RoundRobin:
    """The baseline: engines in turn, whatever they hold."""

    def __init__(self, engines: list[str]):
        self.engines = list(engines)
        self._next = 0

    def choose(self, _token_ids, _parent: str = "") -> tuple[str, list]:
        engine = self.engines[self._next % len(self.engines)]
        self._next += 1
        return engine, []

    def finished(self, _engine: str) -> None:
        pass
