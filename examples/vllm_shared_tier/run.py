"""A prompt's KV outlives its kvpool cluster in the shared tier, and a vLLM engine on a new cluster loads it.

    python3 examples/vllm_shared_tier/run.py [--json-only]

Builds vLLM's CPU venv on first use (examples/engine_venvs.py), makes a small random-weight Llama model, then, with
each vLLM engine in its own process:
  baseline  no kvpool: computes prompt P; its tokens are the reference
  save      kv_producer on cluster 1 (small DRAM, no SSD, nodes given a shared directory): computes P and saves
            its blocks; then other traffic (filler objects) pushes them out of DRAM into the shared directory,
            and every node and master of cluster 1 is killed
  load      kv_consumer on cluster 2 (new etcd, master, nodes and data dirs; only the shared directory is the
            same), once it has adopted what the directory holds: loads P's blocks instead of computing them
and prints one JSON line: tokens identical to the baseline, prompt tokens loaded (vLLM's own count), how many of
P's blocks the shared tier held before the restart, how long cluster 2 took to start and to find them, and the
time to first token computed vs loaded. Exits 1 if a token differs or nothing was loaded.
"""

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from vllm_parts import engine_process, make_engine, make_model, serve  # noqa: E402

BLOCK = 128              # the vLLM CPU engine's block size, in tokens
PROMPT_BLOCKS = 6        # full blocks of P (each 1 MiB of this model's KV)
NEW_TOKENS = 16
NODES = 2
DRAM_PER_NODE = 16 << 20
# Puts land in room the background sweep made (it moves the coldest objects on: into the shared directory);
# an object a write has to evict in place would be lost, not moved.
HIGH_WATERMARK, LOW_WATERMARK = 0.8, 0.6
FILLER_SIZE = 1 << 20
FILLER_BATCH = 4         # 2 MiB a node: within the room above the high watermark
FILLER_MAX = 3 * NODES * DRAM_PER_NODE  # other traffic, at most three times the cluster's DRAM
ADOPTION_TIMEOUT = 60.0

ROLES = {  # role -> (kv_role, transfer)
    "baseline": (None, "async"),
    "save": ("kv_producer", "sync"),  # sync: the request's output reports the blocks it saved
    "load": ("kv_consumer", "async"),
}


def prompts() -> dict[str, list[int]]:
    """Token ids from a fixed generator: P, and W, which warms an engine (and its connections to kvpool) up
    before P is timed."""
    rng = random.Random(11)
    return {"P": [rng.randrange(1, 1000) for _ in range(PROMPT_BLOCKS * BLOCK + 50)],
            "W": [rng.randrange(1, 1000) for _ in range(BLOCK + 10)]}


def run_engine(role: str, model: str, master: str | None) -> dict:
    kv_role, transfer = ROLES[role]
    llm = make_engine(model, kv_role, master, transfer)
    table = prompts()
    serve(llm, table["W"], NEW_TOKENS)
    return {"role": role, "P": serve(llm, table["P"], NEW_TOKENS)}


def start_cluster(workdir: Path, name: str):
    """A local cluster (etcd, master, storage nodes with DRAM only) whose nodes mount workdir/shared."""
    from kvpool.launch.local_cluster import LocalCluster

    return LocalCluster(nodes=NODES, dram_per_node=str(DRAM_PER_NODE), data_dir=workdir / name,
                        shared_dir=workdir / "shared", shared_capacity="2GiB",
                        node_args=["--high-watermark", str(HIGH_WATERMARK),
                                   "--low-watermark", str(LOW_WATERMARK)]).start()


def shared_tier_keys(shared_dir: Path) -> set[str]:
    """The keys the shared directory's manifests hold: what a new cluster's leader adopts."""
    from kvpool.protocol import inventory
    from kvpool.protocol.cluster_layout import DEFAULT_CLUSTER
    from kvpool.sharedfs.files import SharedDir

    with SharedDir.reader(str(shared_dir), DEFAULT_CLUSTER) as shared:
        scan = shared.scan(int(time.time() * 1000))
    return {entry.key for entry in inventory.decode(scan.reply)}


def push_to_shared_tier(cluster, keys: list[str], shared_dir: Path) -> int:
    """Put filler objects in small batches, each once the nodes' DRAM is back under its high watermark, until
    every key of `keys` is in the shared tier; returns the filler bytes put."""
    from kvpool import Client
    from kvpool.net.netutil import wait_until

    def under_high_watermark() -> bool:
        return all(tier.used <= HIGH_WATERMARK * tier.capacity
                   for node in cluster.master_stats().nodes for tier in node.tiers)

    filler, put = os.urandom(FILLER_SIZE), 0
    with Client(cluster.master_address) as client:
        while not set(keys) <= shared_tier_keys(shared_dir):
            if put >= FILLER_MAX:
                held = len(set(keys) & shared_tier_keys(shared_dir))
                raise SystemExit(f"after {put >> 20} MiB of other traffic only {held} of the prompt's "
                                 f"{len(keys)} blocks are in the shared tier")
            batch = [f"filler/{put // FILLER_SIZE + i:04d}" for i in range(FILLER_BATCH)]
            client.batch_put(batch, [filler] * len(batch))
            put += len(batch) * FILLER_SIZE
            wait_until(under_high_watermark, 30, what="the nodes' DRAM to come back under its high watermark")
        if not all(client.batch_exists(keys)):
            raise SystemExit("the prompt's blocks are in the shared directory but cluster 1 does not find them")
    return put


def count_found(cluster, keys: list[str]) -> int:
    from kvpool import Client

    with Client(cluster.master_address) as client:
        return sum(client.batch_exists(keys))


def drive(python: str, workdir: Path, quiet: bool) -> dict:
    from kvpool.connectors import block_hashes
    from kvpool.net.netutil import wait_until

    def step(text: str) -> None:
        if not quiet:
            print(f"-- {text}", file=sys.stderr, flush=True)

    model = workdir / "model"
    subprocess.run([python, __file__, "--make-model", str(model)], check=True)
    step("baseline engine (no kvpool)")
    baseline = engine_process(__file__, "baseline", model, None, python, quiet)

    step("cluster 1; save engine")
    first = start_cluster(workdir, "cluster-1")
    try:
        saved = engine_process(__file__, "save", model, first.master_address, python, quiet)
        namespace = saved["P"]["kvpool"]["namespace"]
        keys = [namespace + block_hash for block_hash in block_hashes(prompts()["P"], BLOCK)]
        step(f"other traffic pushes the prompt's {len(keys)} blocks into the shared tier")
        filler = push_to_shared_tier(first, keys, workdir / "shared")
        before = first.master_stats().shared
        in_shared = len(set(keys) & shared_tier_keys(workdir / "shared"))
        step("killing every node and master of cluster 1")
        for child in (*first.nodes, *first.masters):
            child.kill()
    finally:
        first.stop()

    step("cluster 2 over the same shared directory; load engine")
    started = time.monotonic()
    second = start_cluster(workdir, "cluster-2")
    try:
        restart_s = time.monotonic() - started
        try:
            wait_until(lambda: count_found(second, keys) == len(keys), ADOPTION_TIMEOUT,
                       what="cluster 2 to find the prompt's blocks")
            adoption_s = time.monotonic() - started
        except TimeoutError:
            adoption_s = None  # the load engine then computes what is missing: the summary shows it
        found = count_found(second, keys)
        adopted = second.master_stats().shared
        loaded = engine_process(__file__, "load", model, second.master_address, python, quiet)
    finally:
        second.stop()

    base, load = baseline["P"], loaded["P"]
    return {
        "tokens_identical": base["tokens"] == load["tokens"] == saved["P"]["tokens"],
        "prompt_tokens": load["prompt_tokens"], "prompt_tokens_loaded": load["cached_tokens"],
        "prompt_tokens_computed": load["prompt_tokens"] - load["cached_tokens"],
        "prompt_blocks": len(keys), "blocks_saved": saved["P"]["kvpool"].get("blocks_saved", 0),
        "filler_bytes": filler, "blocks_in_shared_tier_before_restart": in_shared,
        "shared_tier_before_restart": {"objects": before.objects, "bytes": before.used},
        "shared_tier_adopted": {"objects": adopted.objects, "bytes": adopted.used},
        "blocks_found_after_restart": found,
        "restart_s": round(restart_s, 2), "adoption_s": None if adoption_s is None else round(adoption_s, 2),
        "blocks_loaded": load["kvpool"].get("blocks_loaded", 0), "bytes_loaded": load["kvpool"].get("bytes_loaded", 0),
        "blocks_failed": load["kvpool"].get("blocks_failed", 0),
        "ttft_ms_computed": round(base["ttft_s"] * 1e3, 2), "ttft_ms_loaded": round(load["ttft_s"] * 1e3, 2),
        "ttft_ms_saving": round(saved["P"]["ttft_s"] * 1e3, 2),
        "ttft_ratio_loaded_vs_computed": round(load["ttft_s"] / base["ttft_s"], 3),
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json-only", action="store_true", help="print only the summary line")
    parser.add_argument("--drive", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--engine", choices=sorted(ROLES), help=argparse.SUPPRESS)
    parser.add_argument("--master", help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument("--make-model", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.make_model:
        make_model(Path(args.make_model))
        return 0
    if args.engine:
        Path(args.out).write_text(json.dumps(run_engine(args.engine, args.model, args.master)))
        return 0

    from engine_venvs import ensure
    python = str(ensure("vllm"))
    if not args.drive:  # the driver runs in the engine venv, beside kvpool: it starts, fills and kills clusters
        return subprocess.run([python, __file__, "--drive"] + (argv if argv is not None else sys.argv[1:])).returncode
    with tempfile.TemporaryDirectory(prefix="kvpool-vllm-shared-") as tmp:
        summary = drive(python, Path(tmp), args.json_only)
    print(json.dumps(summary), flush=True)
    return 0 if summary["tokens_identical"] and summary["prompt_tokens_loaded"] > 0 else 1


if __name__ == "__main__":
    sys.exit(main())
