"""Prefill in one process, decode in another, the KV cache handed over through kvpool: a small transformers model.

    python examples/transformers_handoff/handoff.py [--master HOST:PORT]

Without --master a local kvpool cluster (etcd, a master, two storage nodes) runs for the length of the demo.
Every role is a process of its own, started one after another, so nothing but kvpool carries the KV between them:

  prefill  (one process per request) looks up the request's prompt blocks in kvpool, loads what is there, computes
           the rest and stores the full blocks it computed. The requests share a long system prompt, so the second
           request's prefill loads that part instead of computing it.
  decode   (after every prefill exited) loads the prompt's KV, computes only the tokens after the last loaded block
           and generates greedily.
  baseline computes every prompt from scratch, without kvpool.

The last line on stdout is one JSON object; the exit status is 1 if decode's tokens differ from the baseline's
(or decode loaded nothing, so there was no handoff to check).

The model is a Llama with random weights (seeded, so every process builds the same one) and needs no download.
A KV block is BLOCK_SIZE tokens of every layer's K and V, named by the chained hash of the prompt up to it, in a
namespace of the model, dtype and layout (kvpool.connectors.BlockNamespace).
"""

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import time

from kvpool.connectors import BlockNamespace, KVBlockStore, block_hashes
from kvpool.errors import KvpoolError

BLOCK_SIZE = 16
SEED = 0
SYSTEM_TOKENS = 410  # shared by every request; not a whole number of blocks, as real system prompts are not
USER_TOKENS = 45
NAMESPACE = BlockNamespace(model=f"tiny-llama-seed{SEED}", dtype="float32", layout="layers-kv-nhd",
                           block_size=BLOCK_SIZE)
HOLD_SECONDS = 30  # blocks a lookup found stay safe from eviction this long, until they are loaded


# ---- the model and the requests: the same in every process ----

def build_model():
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    # Small, but shaped like real models: grouped-query attention (2 KV heads for 8 query heads) and an MLP 4x
    # wider than the hidden size, so prefill does a realistic amount of compute per byte of KV. initializer_range
    # well above the default: at the default a random model repeats one token, and identical tokens prove little.
    config = LlamaConfig(vocab_size=1000, hidden_size=512, intermediate_size=2048, num_hidden_layers=4,
                         num_attention_heads=8, num_key_value_heads=2, initializer_range=0.3,
                         max_position_embeddings=1024, eos_token_id=None)
    torch.manual_seed(SEED)
    return LlamaForCausalLM(config).eval()


def make_requests(count: int) -> list[list[int]]:
    """Prompts as token ids: one system prompt for all, then a user part of each request's own."""
    import numpy

    rng = numpy.random.default_rng(SEED)
    system = rng.integers(0, 1000, SYSTEM_TOKENS).tolist()
    return [system + rng.integers(0, 1000, USER_TOKENS).tolist() for _ in range(count)]


def kv_shape(model) -> tuple[int, int, int]:
    """(layers, KV heads, head dim) of the model's cache."""
    config = model.config
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return config.num_hidden_layers, config.num_key_value_heads, head_dim


# ---- DynamicCache <-> KV blocks ----
# DynamicCache holds each layer as (batch, kv_heads, seq, head_dim), where a block of tokens is a strided slice along
# seq. Copied once into (2, blocks, block_size, kv_heads, head_dim) per layer (K then V, token-major), a block of a
# layer is one contiguous range, so KVBlockStore moves blocks straight from and into these tensors.

def blocks_of(cache, blocks: int) -> list:
    """The first `blocks` blocks of every layer of a DynamicCache, in the block layout (one copy per layer)."""
    import torch

    tokens = blocks * BLOCK_SIZE
    layers = []
    for layer in cache.layers:
        k, v = layer.keys[0, :, :tokens], layer.values[0, :, :tokens]  # (heads, tokens, head_dim)
        stacked = torch.stack([k.transpose(0, 1), v.transpose(0, 1)])  # (2, tokens, heads, head_dim), contiguous
        layers.append(stacked.view(2, blocks, BLOCK_SIZE, *stacked.shape[2:]))
    return layers


def empty_blocks(model, blocks: int) -> list:
    import torch

    layers, heads, head_dim = kv_shape(model)
    return [torch.empty((2, blocks, BLOCK_SIZE, heads, head_dim), dtype=model.dtype) for _ in range(layers)]


def cache_of(model, layers: list, blocks: int):
    """A DynamicCache holding the first `blocks` blocks of the block-layout tensors."""
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    for index, layer in enumerate(layers):
        kv = layer[:, :blocks].flatten(1, 2).transpose(1, 2)  # (2, heads, tokens, head_dim)
        cache.update(kv[0].unsqueeze(0), kv[1].unsqueeze(0), index)  # update copies: the cache owns its memory
    return cache


# ---- what every role does with one prompt ----

def bytes_moved(client) -> int:
    return sum(client.bytes_by_transport().values())


def prefill_with_pool(model, store, client, prompt: list[int], keep_tokens: int):
    """Load the longest stored prefix of `prompt` (at most `keep_tokens` tokens of it), compute the rest.
    Returns (logits of the last position or None if nothing was left to compute, cache, tokens loaded,
    bytes loaded)."""
    import torch
    from transformers import DynamicCache

    hashes = block_hashes(prompt, BLOCK_SIZE)[:keep_tokens // BLOCK_SIZE]
    moved = bytes_moved(client)
    loaded, layers = 0, None
    try:
        found = store.lookup(hashes, hold=HOLD_SECONDS)
        if found:
            layers = empty_blocks(model, found)
            loaded = store.load(hashes[:found], range(found), layers)  # fewer if one was evicted meanwhile
    except KvpoolError as exc:  # kvpool unreachable or a block unreadable: compute it all instead
        print(f"handoff: loading KV failed, computing instead: {exc}", file=sys.stderr)
        loaded = 0
    moved = bytes_moved(client) - moved
    cache = cache_of(model, layers, loaded) if loaded else DynamicCache(config=model.config)
    rest, logits = prompt[loaded * BLOCK_SIZE:], None
    if rest:
        out = model(input_ids=torch.tensor([rest]), past_key_values=cache, use_cache=True, logits_to_keep=1)
        logits = out.logits[0, -1]
    return logits, cache, loaded * BLOCK_SIZE, moved


def generate(model, cache, logits, new_tokens: int) -> list[int]:
    """Greedy tokens, the first from `logits` (the prompt's last position)."""
    import torch

    tokens = [int(logits.argmax())]
    while len(tokens) < new_tokens:
        step = model(input_ids=torch.tensor([[tokens[-1]]]), past_key_values=cache, use_cache=True)
        tokens.append(int(step.logits[0, -1].argmax()))
    return tokens


def timed(runs: int, first_token) -> tuple[float, object]:
    """Run first_token() runs + 1 times, the first to warm up; returns (median ms, the last run's result)."""
    times = []
    for run in range(runs + 1):
        started = time.perf_counter()
        result = first_token()
        if run:
            times.append((time.perf_counter() - started) * 1000)
    return statistics.median(times), result


# ---- roles (each its own process) ----

def role_prefill(args, model) -> dict:
    from kvpool import Client

    prompt = make_requests(args.requests)[args.request]
    with Client(args.master) as client:
        store = KVBlockStore(client, NAMESPACE)
        # Every stored block may be loaded: prefill wants the whole prompt's KV, not a next token.
        _, cache, loaded, _ = prefill_with_pool(model, store, client, prompt, len(prompt))
        full = len(prompt) // BLOCK_SIZE
        moved = bytes_moved(client)
        stored = store.save(block_hashes(prompt, BLOCK_SIZE), range(full), blocks_of(cache, full))
        moved = bytes_moved(client) - moved
    return {"request": args.request, "prompt_tokens": len(prompt), "loaded_tokens": loaded,
            "computed_tokens": len(prompt) - loaded, "stored_blocks": stored, "stored_bytes": moved}


def role_decode(args, model) -> dict:
    from kvpool import Client

    results = []
    with Client(args.master) as client:
        store = KVBlockStore(client, NAMESPACE)
        for prompt in make_requests(args.requests):
            # At least the last prompt token is computed: its logits give the first new token.
            ttft, (logits, cache, loaded, moved) = timed(
                args.repeats, lambda: prefill_with_pool(model, store, client, prompt, len(prompt) - 1))
            results.append({"prompt_tokens": len(prompt), "loaded_tokens": loaded,
                            "computed_tokens": len(prompt) - loaded, "loaded_bytes": moved, "ttft_ms": ttft,
                            "tokens": generate(model, cache, logits, args.new_tokens)})
        transports = sorted(client.bytes_by_transport())
    return {"requests": results, "transports": transports}


def role_baseline(args, model) -> dict:
    import torch
    from transformers import DynamicCache

    def compute_all(prompt):
        cache = DynamicCache(config=model.config)
        out = model(input_ids=torch.tensor([prompt]), past_key_values=cache, use_cache=True, logits_to_keep=1)
        return out.logits[0, -1], cache

    results = []
    for prompt in make_requests(args.requests):
        ttft, (logits, cache) = timed(args.repeats, lambda: compute_all(prompt))
        results.append({"prompt_tokens": len(prompt), "ttft_ms": ttft,
                        "tokens": generate(model, cache, logits, args.new_tokens)})
    return {"requests": results}


ROLES = {"prefill": role_prefill, "decode": role_decode, "baseline": role_baseline}


def run_role(args) -> int:
    import torch

    # One thread: the storage nodes and master share this machine's cores, and compute threads spinning against
    # them make the timings swing by several times. Every role runs the same way, so the ratio stays fair.
    torch.set_num_threads(1)
    model = build_model()
    with torch.inference_mode():
        report = ROLES[args.role](args, model)
    print(json.dumps(report), flush=True)
    return 0


# ---- the driver: a cluster, the roles in turn, the summary ----

def start_role(args, role: str, *extra: str) -> dict:
    argv = [sys.executable, os.path.abspath(__file__), "--role", role, "--requests", str(args.requests),
            "--new-tokens", str(args.new_tokens), "--repeats", str(args.repeats), *extra]
    if role != "baseline":
        argv += ["--master", args.master]
    done = subprocess.run(argv, stdout=subprocess.PIPE, text=True)  # stderr passes through
    if done.returncode != 0:
        raise SystemExit(f"handoff: the {role} process exited with {done.returncode}")
    return json.loads(done.stdout.strip().splitlines()[-1])


@contextlib.contextmanager
def kvpool_master(address: str | None):
    """The given master, or one of a local cluster (kvpool's own launcher) kept up for the demo."""
    if address:
        yield address
        return
    from kvpool.launch.local_cluster import LocalCluster

    with LocalCluster(nodes=2, dram_per_node="128MiB") as cluster:
        print(f"handoff: local kvpool cluster up, master {cluster.master_address}", file=sys.stderr)
        yield cluster.master_address


def remove_blocks(master: str) -> int:
    from kvpool import Client

    with Client(master) as client:
        return client.remove_prefix(NAMESPACE.prefix())


def summarize(prefills: list, decode: dict, baseline: dict, new_tokens: int) -> dict:
    decoded, computed = decode["requests"], baseline["requests"]
    identical = sum(d["tokens"] == b["tokens"] for d, b in zip(decoded, computed))
    loaded_ms = [round(d["ttft_ms"], 2) for d in decoded]
    computed_ms = [round(b["ttft_ms"], 2) for b in computed]
    return {
        "tokens_identical": identical == len(decoded),
        "requests": len(decoded),
        "identical_requests": identical,
        "new_tokens": new_tokens,
        "block_size": BLOCK_SIZE,
        "prompt_tokens": [d["prompt_tokens"] for d in decoded],
        # decode: what it loaded from kvpool and what it still computed
        "prompt_tokens_loaded": [d["loaded_tokens"] for d in decoded],
        "prompt_tokens_computed": [d["computed_tokens"] for d in decoded],
        # prefill, one process per request: the later ones load the shared system prompt
        "prefill_tokens_loaded": [p["loaded_tokens"] for p in prefills],
        "prefill_tokens_computed": [p["computed_tokens"] for p in prefills],
        "ttft_ms_loaded": loaded_ms,
        "ttft_ms_computed": computed_ms,
        "ttft_ratio_loaded_vs_computed": round(sum(loaded_ms) / sum(computed_ms), 3),
        "bytes_stored_per_request": [p["stored_bytes"] for p in prefills],
        "bytes_loaded_per_request": [d["loaded_bytes"] for d in decoded],
        "transports": decode["transports"],
        "namespace": NAMESPACE.prefix(),
    }


def run_demo(args) -> int:
    with kvpool_master(args.master) as master:
        args.master = master
        remove_blocks(master)  # blocks left by an earlier run would turn this run's prefill into loads
        try:
            prefills = []
            for request in range(args.requests):
                prefills.append(start_role(args, "prefill", "--request", str(request)))
                print(f"handoff: prefill {json.dumps(prefills[-1])}", file=sys.stderr)
            decode = start_role(args, "decode")
        finally:
            remove_blocks(master)
    baseline = start_role(args, "baseline")
    summary = summarize(prefills, decode, baseline, args.new_tokens)
    print(json.dumps(summary), flush=True)
    for d, b in zip(decode["requests"], baseline["requests"]):
        if d["tokens"] != b["tokens"]:
            print(f"handoff: tokens differ\n  decode   {d['tokens']}\n  baseline {b['tokens']}", file=sys.stderr)
    if not all(summary["prompt_tokens_loaded"]):
        print("handoff: decode loaded no KV for some request", file=sys.stderr)
    return 0 if summary["tokens_identical"] and all(summary["prompt_tokens_loaded"]) else 1


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--master", help="kvpool master HOST:PORT (default: start a local cluster)")
    parser.add_argument("--requests", type=int, default=2, help="requests sharing the system prompt")
    parser.add_argument("--new-tokens", type=int, default=16, help="tokens each request generates")
    parser.add_argument("--repeats", type=int, default=5, help="time to first token: median of this many runs")
    parser.add_argument("--role", choices=sorted(ROLES), help=argparse.SUPPRESS)
    parser.add_argument("--request", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.requests < 1 or args.new_tokens < 1 or args.repeats < 1:
        parser.error("--requests, --new-tokens and --repeats must be at least 1")
    return run_role(args) if args.role else run_demo(args)


if __name__ == "__main__":
    sys.exit(main())
