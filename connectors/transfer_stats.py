"""Counts of KV blocks an engine moved to and from kvpool, kept as a plain dict of numbers so that they cross
process boundaries as they are (vLLM sends a connector's stats from its workers to its logger as a dict).

No engine imports here: the vLLM connector wraps these in vLLM's KVConnectorStats (`vllm_stats.py`).
"""

# name -> what it counts; every count is summed across steps, workers and ranks
COUNTS = {
    "loads": "load transfers (one per request and step)",
    "blocks_loaded": "blocks loaded into the engine's caches",
    "bytes_loaded": "bytes loaded into the engine's caches",
    "blocks_failed": "blocks found by the lookup but not loadable (the engine computes them)",
    "load_seconds": "time spent loading",
    "saves": "save transfers (one per request and step)",
    "blocks_saved": "blocks written to kvpool (blocks it already held are not counted)",
    "bytes_saved": "bytes written to kvpool",
    "blocks_save_failed": "blocks a save could not write (a later cache miss, not a failed request)",
    "blocks_save_shed": "blocks not saved because the pool refused puts (no space, past their deadline) or the "
                        "save buffer was full",
    "save_seconds": "time spent saving",
}


def add_counts(into: dict, counts: dict) -> dict:
    """Add `counts` to `into`, name by name (names missing from `into` start at 0); returns `into`."""
    for name, value in counts.items():
        into[name] = into.get(name, 0) + value
    return into


def is_empty(counts: dict) -> bool:
    """True when nothing moved and nothing failed."""
    return not any(counts.values())


def summarize(counts: dict) -> dict[str, int | float]:
    """One interval's counts as logged: every count (0 when absent), times in seconds rounded to the
    millisecond, the average time a load took (the latency a request waiting for its blocks saw), and the
    blocks loaded per KV cache group of a hybrid model (blocks_loaded_g<N>)."""
    summary = {name: counts.get(name, 0) for name in COUNTS}
    summary.update({name: value for name, value in sorted(counts.items()) if name.startswith("blocks_loaded_g")})
    for name in ("load_seconds", "save_seconds"):
        summary[name] = round(summary[name], 3)
    loads = counts.get("loads", 0)
    summary["avg_load_ms"] = round(1000 * counts.get("load_seconds", 0) / loads, 3) if loads else 0.0
    return summary
