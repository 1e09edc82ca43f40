"""Replay a request trace through a prefix KV cache in kvpool, as an engine connector does.

The trace (Mooncake's FAST'25 conversation workload by default) gives each
request its chain of prefix blocks (`hash_ids`, 512 tokens each; equal ids are
equal prefixes). Per request: one batch_exists on its block keys, then
batch_get_into of the leading run that exists into preallocated buffers, each
block checked byte for byte, then one batch save of the blocks from there on
that are not stored. A block's bytes are derived from its id, so a block read
back under the wrong key or damaged is caught.

The same requests go through an ideal whole-block LRU with pool // block-bytes
slots and the same lookup -> load -> save rules, which is the hit ratio to
compare with. Prints one JSON line; rates count only the time spent in client
calls (content checks and bookkeeping are left out).

    python benchmarks/trace_replay.py                     # 3000 requests, 32 KiB blocks, 256 MiB pool
    python benchmarks/trace_replay.py --block-bytes 256KiB --pool 2GiB --requests 1000
    python benchmarks/trace_replay.py --pool 64MiB --shared-dir /mnt/kv --shared-capacity 2GiB [--direct]
    python benchmarks/trace_replay.py --pool 64MiB --object-store local --shared-capacity 2GiB --miss-cost 30

With --shared-dir the cluster's nodes write what their DRAM gives up to that directory (the shared tier)
and the ideal LRU has the pool and the shared capacity's slots; --direct has the client read shared
objects from their files itself. --object-store puts that tier in a bucket instead (`local`: an S3 server
started here). --miss-cost charges each block not loaded the time an engine takes to compute it, and reports the
modelled time to first token per request: what a deeper tier is worth (more hits) against what it costs (slower
loads), which requests/s alone cannot show (a miss costs the replay only a put).
"""

import argparse
import json
import os
import shutil
import sys
import time
from collections import OrderedDict
from pathlib import Path

import numpy as np

from kvpool import Client
from kvpool.errors import BatchError, KeyExistsError, KvpoolError
from kvpool.launch.local_cluster import LocalCluster
from kvpool.proto import kvpool_pb2
from kvpool.protocol.units import format_size, parse_size

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_TRACE = ROOT.parent / "shared" / "traces" / "conversation_trace.jsonl"

# Mooncake Store 0.3.13 on this kind of machine (TCP, storage in another process), from the shared TARGETS.md.
MOONCAKE = (
    {"block_bytes": 32 << 10, "pool": 256 << 20, "requests": 3000, "requests_per_s": 299, "blocks_per_s": 8029,
     "hit_ratio": 0.148, "ideal_lru_hit_ratio": 0.180},
    {"block_bytes": 256 << 10, "pool": 2 << 30, "requests": 1000, "requests_per_s": 65,
     "hit_ratio": 0.147, "ideal_lru_hit_ratio": 0.159},
)
AIM_REQUESTS_RATIO = 1.5  # kvpool's aim: 1.5x Mooncake's requests/s
AIM_HIT_VS_LRU = 0.9  # and a hit ratio at least 0.9 of the ideal LRU's


def load_trace(path: Path, requests: int) -> list[list[int]]:
    """The hash_ids of the first `requests` requests."""
    chains = []
    with open(path) as lines:
        for line in lines:
            if len(chains) == requests:
                break
            if line.strip():
                chains.append(json.loads(line)["hash_ids"])
    return chains


def ideal_lru(chains: list[list[int]], slots: int) -> int:
    """Blocks an LRU of `slots` whole blocks loads: per request the leading run it holds is loaded
    (and becomes most recent), then the blocks after it that it lacks are inserted."""
    cache: OrderedDict = OrderedDict()
    hits = 0
    for chain in chains:
        n = 0
        for block in chain:
            if block not in cache:
                break
            cache.move_to_end(block)
            n += 1
        hits += n
        for block in chain[n:]:
            if block not in cache:
                cache[block] = None
                if len(cache) > slots:
                    cache.popitem(last=False)
    return hits


class BlockContent:
    """Bytes of block `id`: a fixed random pattern of 64-bit words plus the id (mod 2**64) in every word,
    so every word of a block differs from the same word of any other block."""

    def __init__(self, block_bytes: int, seed: int = 11):
        if block_bytes <= 0 or block_bytes % 8:
            raise ValueError(f"block size must be a positive multiple of 8 bytes, got {block_bytes}")
        self.words = block_bytes // 8
        self.base = np.random.default_rng(seed).integers(0, 2**63, self.words, dtype=np.uint64)

    def fill(self, rows: np.ndarray, ids: np.ndarray) -> None:
        np.add(self.base, ids[:, None], out=rows)

    def matches(self, rows: np.ndarray, ids: np.ndarray) -> np.ndarray:
        """Per row: whether it holds exactly the block of that id."""
        return ((rows - self.base) == ids[:, None]).all(axis=1)


class Buffers:
    """Reused rows of uint64 words, with a byte view of each row for the client."""

    def __init__(self, rows: int, words: int):
        self.words = np.zeros((rows, words), dtype=np.uint64)  # zeroed: pages faulted in before timing
        self.views = [memoryview(row.view(np.uint8)) for row in self.words]


def _leading(flags) -> int:
    try:
        return flags.index(False)
    except ValueError:
        return len(flags)


def replay(client, chains: list[list[int]], block_bytes: int, prefix: str, between=None,
           miss_cost: float = 0.0) -> dict:
    """between(): called after each request, outside the timed calls (e.g. another tenant's traffic).
    miss_cost: seconds an engine takes to compute one block it could not load: with it, each request's modelled
    time to first token (its lookup and load, then its missed blocks computed; the save follows the answer) is
    reported, p50 and p90."""
    content = BlockContent(block_bytes)
    keys = {}
    for chain in chains:
        for block in chain:
            if block not in keys:
                keys[block] = f"{prefix}{block}"
    work = [([keys[b] for b in chain], np.array(chain, dtype=np.uint64)) for chain in chains]
    longest = max(len(chain) for chain in chains)
    loads, saves = Buffers(longest, content.words), Buffers(longest, content.words)
    lookup_s = load_s = save_s = 0.0
    references = loaded = saved = wrong = lost = key_exists = failed_saves = 0
    perf = time.perf_counter
    ttft = []  # per request, modelled: lookup + load + missed blocks x miss_cost
    started = perf()
    for request_keys, ids in work:
        if between is not None:
            between()
        count = len(request_keys)
        references += count
        t0 = perf()
        present = client.batch_exists(request_keys)
        t1 = perf()
        lookup_s += t1 - t0
        n = _leading(present)
        outcomes = ()
        good = 0
        if n:
            loads.words[:n, 0] = 0  # a read that reports success but writes nothing must not pass the check
            try:
                outcomes = client.batch_get_into(request_keys[:n], loads.views[:n])
            except BatchError as exc:  # what did arrive is in results; the failed items carry their error
                outcomes = exc.results or [exc] * n
            except KvpoolError as exc:
                outcomes = [exc] * n
            load_s += perf() - t1
            intact = content.matches(loads.words[:n], ids[:n])
            ok = [size == block_bytes and bool(same) for size, same in zip(outcomes, intact)]
            good = _leading(ok)
            arrived = sum(isinstance(size, int) for size in outcomes)
            wrong += arrived - sum(ok)
            lost += n - arrived
        loaded += good
        ttft.append(perf() - t0 + (count - good) * miss_cost)
        if good == count:
            continue
        # Everything from the first block not loaded that is not stored: absent at lookup, or gone since.
        todo = [i for i in range(good, count) if not present[i] or (i < n and outcomes[i] is None)]
        if not todo:
            continue
        m = len(todo)
        content.fill(saves.words[:m], ids[todo])
        t2 = perf()
        try:
            client.batch_put_from([request_keys[i] for i in todo], saves.views[:m])
            saved += m
        except BatchError as exc:
            exists = sum(isinstance(e, KeyExistsError) for e in exc.errors.values())
            key_exists += exists
            failed_saves += len(exc.errors) - exists
            saved += m - len(exc.errors)
        except KvpoolError:
            failed_saves += m
        save_s += perf() - t2
    wall_s = perf() - started
    client_s = lookup_s + load_s + save_s
    return {"requests": len(chains), "block_references": references, "distinct_blocks": len(keys),
            "blocks_loaded": loaded, "blocks_saved": saved,
            "requests_per_s": round(len(chains) / client_s, 1),
            "blocks_per_s": round((loaded + saved) / client_s, 1),
            "hit_ratio": round(loaded / references, 4),
            "seconds": {"lookup": round(lookup_s, 2), "load": round(load_s, 2), "save": round(save_s, 2),
                        "client": round(client_s, 2), "wall": round(wall_s, 2)},
            "wrong_blocks": wrong, "lost_hits": lost, "failed_saves": failed_saves,
            "saves_refused_key_exists": key_exists,
            **({"modelled_ttft_ms": {"miss_cost_ms": round(miss_cost * 1e3, 3),
                                     "p50": round(float(np.percentile(ttft, 50)) * 1e3, 2),
                                     "p90": round(float(np.percentile(ttft, 90)) * 1e3, 2),
                                     "mean": round(float(np.mean(ttft)) * 1e3, 2)}} if miss_cost else {})}


def dram_usage(client) -> dict:
    """The cluster's DRAM tiers summed, as the nodes last reported them."""
    used = capacity = evictions = 0
    for node in client.stats().nodes:
        for tier in node.tiers:
            if tier.tier == kvpool_pb2.Tier.Value("DRAM"):
                used, capacity, evictions = used + tier.used, capacity + tier.capacity, evictions + tier.evictions
    return {"used_fraction": round(used / capacity, 3) if capacity else None, "evictions": evictions}


def reference(block_bytes: int, pool: int, requests: int, requests_per_s: float) -> dict:
    """Mooncake's figures at the nearest block size, and this run's requests/s as a ratio of them."""
    theirs = min(MOONCAKE, key=lambda m: abs(m["block_bytes"] - block_bytes))
    same = (theirs["block_bytes"], theirs["pool"], theirs["requests"]) == (block_bytes, pool, requests)
    return {"mooncake": theirs, "same_settings": same,
            "requests_per_s_ratio": round(requests_per_s / theirs["requests_per_s"], 3),
            "aim_requests_per_s_ratio": AIM_REQUESTS_RATIO, "aim_hit_ratio_vs_lru": AIM_HIT_VS_LRU}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trace", type=Path, default=DEFAULT_TRACE, help="JSON lines with hash_ids")
    parser.add_argument("--requests", type=int, default=3000, help="replay the first N requests")
    parser.add_argument("--block-bytes", type=parse_size, default="32KiB", help="bytes of one 512-token block")
    parser.add_argument("--pool", type=parse_size, default="256MiB",
                        help="DRAM of the cluster this starts, split over its nodes; also the ideal LRU's size")
    parser.add_argument("--nodes", type=int, default=1)
    parser.add_argument("--transports", default="tcp", help="data transports the client may use, e.g. tcp, shm")
    parser.add_argument("--high-watermark", type=float, help="passed to the nodes this starts (default: theirs)")
    parser.add_argument("--low-watermark", type=float, help="passed to the nodes this starts (default: theirs)")
    parser.add_argument("--master", help="HOST:PORT of a running cluster to use instead of starting one")
    parser.add_argument("--tls", action="store_true", help="start the cluster with TLS on every plane")
    parser.add_argument("--shared-dir", type=Path, help="the shared tier of the cluster this starts (a directory)")
    parser.add_argument("--shared-capacity", type=parse_size, default="2GiB", help="its capacity (default 2GiB)")
    parser.add_argument("--object-store", metavar="URL",
                        help="the shared tier in a bucket (s3://BUCKET/PREFIX, or local: an S3 server run here), "
                             "within --shared-capacity; with --shared-dir, beneath the directory")
    parser.add_argument("--shared-dir-share", type=parse_size, default=None, metavar="SIZE",
                        help="with both: what each node keeps in the directory before moving the oldest on")
    parser.add_argument("--direct", action="store_true", help="the client reads the shared tier's files itself")
    parser.add_argument("--miss-cost", type=float, default=0.0, metavar="MS",
                        help="milliseconds an engine takes to compute one block it could not load (e.g. a 512-token "
                             "block at the prefill rate of your model and GPU): reports modelled time to first "
                             "token per request")
    parser.add_argument("--tenant", action="store_true",
                        help="replay as a tenant of the cluster this starts (the cost of confinement), not with the "
                             "client token")
    args = parser.parse_args()
    if args.tenant and args.master:
        parser.error("--tenant makes its tenant in the cluster it starts: leave out --master")
    chains = load_trace(args.trace, args.requests)
    if not chains:
        parser.error(f"no requests in {args.trace}")
    deep = bool(args.shared_dir or args.object_store)
    if (args.direct or deep) and args.master:
        parser.error("--shared-dir, --object-store and --direct are for the cluster this starts: leave out --master")
    if args.shared_dir_share and not (args.shared_dir and args.object_store):
        parser.error("--shared-dir-share is for --shared-dir and --object-store both (the bucket beneath)")
    if args.direct and not deep:
        parser.error("--direct needs --shared-dir or --object-store")
    capacity = args.pool + (args.shared_capacity if deep else 0)
    ideal = ideal_lru(chains, capacity // args.block_bytes)
    node_args = []
    for option, value in (("--high-watermark", args.high_watermark), ("--low-watermark", args.low_watermark),
                          ("--shared-dir-share", args.shared_dir_share)):
        if value is not None:
            node_args += [option, str(value)]
    cluster = None
    if not args.master:
        shared = {"shared_dir": args.shared_dir / f"replay-{os.getpid()}-{time.time_ns()}"} if args.shared_dir else {}
        if args.object_store:  # (with a directory: beneath it)
            shared["object_store"] = args.object_store
        if shared:
            shared["shared_capacity"] = str(args.shared_capacity)
        cluster = LocalCluster(nodes=args.nodes, dram_per_node=str(args.pool // args.nodes),
                               node_args=node_args, tls=args.tls, **shared).start()
        args.master = cluster.master_address
    token = cluster.add_tenant("replay") if args.tenant else None
    prefix = f"trace-replay/{os.getpid()}-{time.time_ns()}/"  # never meets blocks of an earlier run
    try:
        direct = {}
        if args.direct:
            direct = {"shared_dir": str(cluster.shared_dir)} if args.shared_dir else {}
            if args.object_store:
                direct["object_store"] = cluster.object_store
        with Client(args.master, transports=args.transports, token=token, **direct) as client:
            report = replay(client, chains, args.block_bytes, prefix, miss_cost=args.miss_cost / 1e3)
            report["pool_after"] = dram_usage(client)
            if deep:
                shared_tier = client.stats().shared
                report["shared_tier"] = {"capacity": shared_tier.capacity, "used": shared_tier.used,
                                         "objects": shared_tier.objects}
            client.remove_prefix(prefix)
            report["bytes_by_transport"] = client.bytes_by_transport()
            report["tls"] = bool(args.tls)
            report["tenant"] = bool(args.tenant)
    finally:
        if cluster is not None:
            cluster.stop()
            if cluster.shared_dir is not None:
                shutil.rmtree(cluster.shared_dir, ignore_errors=True)
    ideal_ratio = ideal / report["block_references"]
    report.update(ideal_lru_hit_ratio=round(ideal_ratio, 4),
                  hit_ratio_vs_lru=round(report["hit_ratio"] / ideal_ratio, 3) if ideal_ratio else None)
    report["reference"] = reference(args.block_bytes, args.pool, len(chains), report["requests_per_s"])
    report["settings"] = {"trace": args.trace.name, "block_bytes": format_size(args.block_bytes),
                          "pool": format_size(args.pool), "nodes": args.nodes, "transports": args.transports,
                          "own_cluster": cluster is not None, "node_args": node_args,
                          "shared_capacity": format_size(args.shared_capacity) if deep else None,
                          "deep_tier": "+".join(name for name, given in (("directory", args.shared_dir),
                                                                         ("bucket", args.object_store)) if given) or None,
                          "direct": args.direct}
    print(json.dumps(report), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
