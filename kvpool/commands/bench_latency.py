"""Per-call measurements of `kvpool bench`: latencies, and puts of keys that never existed before.

Every call is timed on its own. A fresh-key run removes the keys it wrote every
_CHUNK_BYTES between two timed calls, so it never fills the pool and the clean-up
is not counted. Keys carry the process id and a run counter: a key that existed
once (even removed since) is never written again, so every put is a first put.
"""

import itertools
import os
import statistics
import time

import numpy as np

from ..protocol.units import format_size

SMALL = 64 * 1024
LARGE = 1 << 20
EXISTS_KEYS = 32
_CHUNK_BYTES = 64 << 20  # live fresh bytes at most, whatever the cluster's size
_MAX_CALLS = 5000
_runs = itertools.count()

# Aims of the issue and Mooncake Store's figures measured on the same kind of machine (TARGETS.md).
AIM_PUT_SMALL_P50_US = 400.0
AIM_PUT_LARGE_MBPS = 1000.0
AIM_BATCH_EXISTS_P50_US = 300.0
MOONCAKE = {"put_fresh_p50_us": 393.0, "put_fresh_MBps": 551.0, "put_from_fresh_MBps": 873.0,
            "batch_put_from_fresh_MBps": 1777.0}


def _percentiles(seconds: list, **fields) -> dict:
    times = sorted(t * 1e6 for t in seconds)
    return {**fields, "samples": len(times), "p50_us": round(statistics.median(times), 1),
            "p99_us": round(times[max(int(len(times) * 0.99) - 1, 0)], 1)}


def get_latency(client, value: bytes, samples: int = 2000) -> dict:
    """Per-call latency of get with a warm placement cache, in microseconds."""
    keys = [f"bench/latency/{i}" for i in range(64)]
    client.batch_put(keys, [value] * len(keys), overwrite=True)
    for k in keys:
        client.get(k)  # warm the placement cache and the connections
    times = []
    for i in range(samples):
        started = time.perf_counter()
        client.get(keys[i % len(keys)])
        times.append(time.perf_counter() - started)
    client.remove_prefix("bench/latency/")
    return _percentiles(times, size=len(value))


def _fresh_prefix(label: str) -> str:
    return f"bench/fresh/{os.getpid()}-{next(_runs)}/{label}/"


def _fresh_calls(client, call, nbytes: int, label: str, seconds: float, min_calls: int) -> list:
    """Per-call seconds of call(new key), each call storing `nbytes`, for about `seconds` of calls and at
    least `min_calls` calls; the keys are removed every _CHUNK_BYTES, outside the timing."""
    prefix = _fresh_prefix(label)
    chunk = max(1, _CHUNK_BYTES // nbytes)
    times, total = [], 0.0
    try:
        while (total < seconds or len(times) < min_calls) and len(times) < _MAX_CALLS:
            n = len(times)
            key = f"{prefix}{n // chunk}/{n}"
            started = time.perf_counter()
            call(key)
            elapsed = time.perf_counter() - started
            times.append(elapsed)
            total += elapsed
            if (n + 1) % chunk == 0:
                client.remove_prefix(f"{prefix}{n // chunk}/")
    finally:
        client.remove_prefix(prefix)
    return times


def fresh_puts(client, seconds: float, batch: int, step=lambda label: None) -> tuple[list, dict]:
    """Puts of new keys: ([(op, size, bytes/s, batch or None), ...], {"put_fresh_latency": ...}).

    64 KiB put (also its latency), 1 MiB put (from bytes) and put_from (from a numpy array),
    and batch_put_from of `batch` x 1 MiB from one buffer at offsets, as KV caches are laid out."""
    small = os.urandom(SMALL)
    large = os.urandom(LARGE)
    array = np.frombuffer(os.urandom(LARGE), dtype=np.uint8)
    count = max(1, min(batch, _CHUNK_BYTES // LARGE))
    whole = np.frombuffer(os.urandom(count * LARGE), dtype=np.uint8)
    offsets = [i * LARGE for i in range(count)]
    sizes = [LARGE] * count
    suffixes = [f"/{i}" for i in range(count)]
    rows = []

    small_times = _fresh_calls(client, lambda key: client.put(key, small), SMALL, "put64k", seconds, 200)
    rows.append(("put_fresh", SMALL, SMALL * len(small_times) / sum(small_times), None))
    step("put fresh 64KiB")
    times = _fresh_calls(client, lambda key: client.put(key, large), LARGE, "put1m", seconds, 10)
    rows.append(("put_fresh", LARGE, LARGE * len(times) / sum(times), None))
    step("put fresh 1MiB")
    times = _fresh_calls(client, lambda key: client.put_from(key, array), LARGE, "put_from1m", seconds, 10)
    rows.append(("put_from_fresh", LARGE, LARGE * len(times) / sum(times), None))
    step("put_from fresh 1MiB")

    def batch_put_from(key):
        client.batch_put_from([key + s for s in suffixes], whole, offsets=offsets, sizes=sizes)

    times = _fresh_calls(client, batch_put_from, count * LARGE, "batch1m", seconds, 3)
    rows.append(("batch_put_from_fresh", LARGE, count * LARGE * len(times) / sum(times), count))
    step(f"batch_put_from fresh {count} x 1MiB")
    return rows, {"put_fresh_latency": _percentiles(small_times, size=SMALL)}


def batch_exists_latency(client, count: int = EXISTS_KEYS, samples: int = 1000) -> dict:
    """Per-call latency of batch_exists on `count` keys that all exist."""
    prefix = _fresh_prefix("exists")
    keys = [f"{prefix}{i}" for i in range(count)]
    # 16 KiB: over shm, smaller values go on the socket and the run would not be shm's alone.
    client.batch_put(keys, [b"k" * (16 * 1024)] * count)
    try:
        answers = client.batch_exists(keys)  # also warms the connection
        times = []
        for _ in range(samples):
            started = time.perf_counter()
            client.batch_exists(keys)
            times.append(time.perf_counter() - started)
    finally:
        client.remove_prefix(prefix)
    return _percentiles(times, keys=count, all_existed=all(answers))


def call_targets(transport: str, run: dict, rows: list) -> dict:
    """The aims about single calls of one transport's run; each says the figure, its aim
    (None where the issue sets none) and Mooncake's figure for the same call."""
    def mbps(op):
        row = next((r for r in rows if r["op"] == op and r["size"] == LARGE), None)
        return (row["MBps"], row.get("batch")) if row else (None, None)

    targets = {}
    p50 = run["put_fresh_latency"]["p50_us"]
    targets[f"{transport} put fresh 64KiB p50"] = {
        "p50_us": p50, "aim_us": AIM_PUT_SMALL_P50_US, "met": p50 <= AIM_PUT_SMALL_P50_US,
        "mooncake_us": MOONCAKE["put_fresh_p50_us"]}
    p50 = run["batch_exists_latency"]["p50_us"]
    targets[f"{transport} batch_exists {run['batch_exists_latency']['keys']} keys p50"] = {
        "p50_us": p50, "aim_us": AIM_BATCH_EXISTS_P50_US, "met": p50 <= AIM_BATCH_EXISTS_P50_US}
    for op, aim in (("put_fresh", AIM_PUT_LARGE_MBPS), ("put_from_fresh", None), ("batch_put_from_fresh", None)):
        measured, count = mbps(op)
        name = f"{transport} {op.replace('_fresh', '')} fresh {f'{count} x ' if count else ''}{format_size(LARGE)}"
        target = {"MBps": measured, "aim_MBps": aim, "mooncake_MBps": MOONCAKE[f"{op}_MBps"],
                  "met": None if aim is None or measured is None else measured >= aim}
        if aim is None:
            target["note"] = "no aim of its own: compare with Mooncake"
        targets[name] = target
    return targets
