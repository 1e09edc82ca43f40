"""Eight client processes doing mixed puts and gets at once, every byte verified."""

import hashlib
import multiprocessing
import random
import time

from kvpool.errors import KeyExistsError, KeyNotFoundError

PROCESSES = 8
SECONDS = 20
LIVE_KEYS = 48  # per process: bounds the live set (~90 MiB in all) however fast the machine puts


def value_for(key: str, size: int) -> bytes:
    """Bytes any process can recompute from the key alone, so reads of others' keys can be checked."""
    seed = hashlib.sha256(key.encode()).digest()
    return (seed * (size // len(seed) + 1))[:size]


def worker(master: str, index: int, seconds: float, results) -> None:
    from kvpool import Client

    rng = random.Random(index)
    counts = {"puts": 0, "gets": 0, "hits": 0, "wrong": 0, "errors": 0, "batch": 0, "removes": 0}
    with Client(master) as client:
        deadline = time.monotonic() + seconds
        written = []
        while time.monotonic() < deadline:
            roll = rng.random()
            try:
                if (roll < 0.35 or not written) and len(written) < LIVE_KEYS:
                    size = rng.choice([0, 100, 4096, 65536, 300_000, 1 << 20])
                    key = f"mix/{index}/{counts['puts']}/{size}"
                    client.put(key, value_for(key, size))
                    written.append(key)
                    counts["puts"] += 1
                elif roll < 0.5:
                    # Removing keeps the live set bounded and makes readers meet freed and reused extents.
                    key = written.pop(rng.randrange(len(written)))
                    counts["removes"] += client.remove(key)
                elif roll < 0.6:
                    keys = rng.sample(written, min(8, len(written)))
                    got = client.batch_get(keys)
                    counts["batch"] += 1
                    counts["wrong"] += sum(g != value_for(k, int(k.rsplit("/", 1)[1])) for k, g in zip(keys, got))
                else:
                    # Mostly other processes' keys: some exist already, some never will.
                    other = rng.randrange(PROCESSES)
                    key = f"mix/{other}/{rng.randrange(max(1, counts['puts']))}/" \
                          f"{rng.choice([0, 100, 4096, 65536, 300_000, 1 << 20])}"
                    if other == index and written:
                        key = rng.choice(written)
                    counts["gets"] += 1
                    try:
                        got = client.get(key)
                    except KeyNotFoundError:
                        continue
                    counts["hits"] += 1
                    counts["wrong"] += got != value_for(key, int(key.rsplit("/", 1)[1]))
            except KeyExistsError:
                counts["errors"] += 1
            except Exception as exc:  # any other failure is a test failure, reported by the parent
                counts["errors"] += 1
                counts.setdefault("messages", []).append(repr(exc))
    results.put((index, counts))


def test_eight_processes_mixed_load(own_cluster):
    cluster = own_cluster(nodes=2, dram_per_node="512MiB")
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=worker, args=(cluster.master_address, i, SECONDS, results)) for i in range(PROCESSES)]
    for p in procs:
        p.start()
    collected = dict(results.get(timeout=SECONDS + 60) for _ in procs)
    for p in procs:
        p.join(30)
        assert p.exitcode == 0
    total = {k: sum(c.get(k, 0) for c in collected.values())
             for k in ("puts", "gets", "hits", "wrong", "errors", "removes")}
    messages = [m for c in collected.values() for m in c.get("messages", [])]
    assert total["wrong"] == 0
    assert total["errors"] == 0, messages[:5]
    assert total["puts"] > 100 and total["hits"] > 100, total
    assert cluster.master_stats().objects == total["puts"] - total["removes"]
