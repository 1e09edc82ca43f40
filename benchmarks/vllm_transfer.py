"""Time to first token with the vLLM connector's asynchronous transfer against its synchronous one.

    python benchmarks/vllm_transfer.py [--prefix-blocks 8] [--requests 4]

Starts a local cluster, builds vLLM's CPU venv on first use, makes a random-weight Llama with a wide KV cache
(16 layers, 8 KV heads of 64: 64 KiB of KV per token, so loading a prompt's stored blocks takes longer than
one layer's compute over the tokens after them), and runs three engines one after another:
  save   computes the prompts (a stored prefix of --prefix-blocks blocks + 20 tokens each) and saves their blocks
  sync   transfer "sync":  loads before the forward pass that needs them
  async  transfer "async": a request waits off the step while a worker thread loads its blocks
sync and async each serve (a) every stored prompt alone, and prompts of the same length computed, and (b) one
batch: the stored prompts together with as many new prompts to compute, where a synchronous load holds up the
others' step and an asynchronous one runs beside it. Prints one JSON line: TTFT per case, the time the loads
took (timed inside the engine) and each layer's compute over a prompt's last tokens, both modes' tokens
compared.
"""

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BLOCK = 128  # the vLLM CPU engine's block size
TAIL = 20    # prompt tokens after the stored blocks
NEW_TOKENS = 16
LAYERS = 16


def make_model(directory: Path) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(vocab_size=1000, hidden_size=512, intermediate_size=1408,
                                 num_hidden_layers=LAYERS, num_attention_heads=8, num_key_value_heads=8,
                                 max_position_embeddings=4096, initializer_range=0.1,
                                 eos_token_id=None)).save_pretrained(directory)


def prompts(blocks: int, requests: int) -> dict[str, list[list[int]]]:
    rng = random.Random(5)

    def some(n):
        return [[rng.randrange(1, 1000) for _ in range(n)] for _ in range(requests)]

    length = blocks * BLOCK + TAIL
    return {"stored_alone": some(length), "computed_alone": some(length), "stored_batch": some(length),
            "computed_batch": some(4 * BLOCK + TAIL), "warm": some(BLOCK + TAIL)[:1],
            "warm_computed": some(length)[:1]}


def run_engine(role: str, model: str, master: str, blocks: int, requests: int) -> dict:
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine in this process: its loads can be timed
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.inputs import TokensPrompt

    from kvpool.connectors.vllm_worker import KVPoolWorker

    loads = []
    real_load = KVPoolWorker._timed_load

    def timed_load(self, load):
        loaded, seconds = real_load(self, load)
        loads.append({"blocks": loaded, "ms": seconds * 1e3})
        return loaded, seconds

    KVPoolWorker._timed_load = timed_load
    table = prompts(blocks, requests)
    transfer = "sync" if role == "save" else role
    config = KVTransferConfig(kv_connector="KVPoolConnector", kv_connector_module_path="kvpool.connectors.vllm",
                              kv_role="kv_producer" if role == "save" else "kv_consumer",
                              kv_load_failure_policy="recompute",
                              kv_connector_extra_config={"master": master, "model_id": "wide-kv-bench",
                                                         "transfer": transfer})
    llm = LLM(model=model, skip_tokenizer_init=True, dtype="float32", max_model_len=4096, enforce_eager=True,
              enable_prefix_caching=False, disable_log_stats=False, seed=0, kv_transfer_config=config)
    greedy = SamplingParams(temperature=0, ignore_eos=True, detokenize=False, max_tokens=NEW_TOKENS)

    def serve(batch):
        started = time.perf_counter()
        outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in batch], greedy, use_tqdm=False)
        return ([o.metrics.first_token_latency * 1e3 for o in outs], [list(o.outputs[0].token_ids) for o in outs],
                (time.perf_counter() - started) * 1e3)

    if role == "save":
        for name in ("warm", "stored_alone", "stored_batch"):
            for prompt in table[name]:
                serve([prompt])
        return {}
    serve(table["warm"])  # connections made, the warm-up's blocks loaded
    serve(table["warm_computed"])  # the first long prefills of a process are slower (kernels for new shapes)
    serve(table["warm_computed"])
    loads.clear()
    result = {"stored_alone_ttft_ms": [], "computed_alone_ttft_ms": [], "tokens": {}}
    for name in ("stored_alone", "computed_alone"):
        for i, prompt in enumerate(table[name]):
            [ttft], [tokens], _ = serve([prompt])
            result[f"{name}_ttft_ms"].append(ttft)
            result["tokens"][f"{name}{i}"] = tokens
    result["alone_loads"] = list(loads)
    loads.clear()
    ttfts, tokens, wall = serve(table["stored_batch"] + table["computed_batch"])
    result["batch"] = {"stored_ttft_ms": ttfts[:requests], "computed_ttft_ms": ttfts[requests:], "wall_ms": wall,
                       "loads": list(loads)}
    result["tokens"].update({f"batch{i}": t for i, t in enumerate(tokens)})
    return result


def p50(values):
    return round(statistics.median(values), 1)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prefix-blocks", type=int, default=8)
    parser.add_argument("--requests", type=int, default=4)
    parser.add_argument("--engine", choices=("save", "sync", "async"), help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    parser.add_argument("--master", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument("--make-model", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.make_model:
        make_model(Path(args.make_model))
        return 0
    if args.engine:
        result = run_engine(args.engine, args.model, args.master, args.prefix_blocks, args.requests)
        Path(args.out).write_text(json.dumps(result))
        return 0

    sys.path.insert(0, str(ROOT / "examples"))
    from engine_venvs import ensure

    from kvpool.launch.local_cluster import LocalCluster

    python = str(ensure("vllm"))
    runs = {}
    with tempfile.TemporaryDirectory(prefix="kvpool-vllm-transfer-") as tmp:
        work = Path(tmp)
        subprocess.run([python, __file__, "--make-model", str(work / "model")], check=True)
        with LocalCluster(nodes=2, dram_per_node="1GiB", data_dir=work / "cluster") as cluster:
            for role in ("save", "sync", "async"):
                out = work / f"{role}.json"
                subprocess.run([python, __file__, "--engine", role, "--model", str(work / "model"), "--master",
                                cluster.master_address, "--out", str(out), "--prefix-blocks", str(args.prefix_blocks),
                                "--requests", str(args.requests)], stdout=subprocess.DEVNULL, check=True)
                runs[role] = json.loads(out.read_text())
    sync, run_async = runs["sync"], runs["async"]
    block_bytes = BLOCK * LAYERS * 2 * 512 * 4

    def summary(run):
        alone_load = p50([load["ms"] for load in run["alone_loads"]])
        # Each layer's compute over the prompt's last tokens: what a loaded prompt's TTFT has beyond its load.
        layer = (p50(run["stored_alone_ttft_ms"]) - alone_load) / LAYERS
        return {"stored_alone_ttft_p50_ms": p50(run["stored_alone_ttft_ms"]),
                "computed_alone_ttft_p50_ms": p50(run["computed_alone_ttft_ms"]),
                "load_ms_p50": alone_load, "load_ms_per_layer": round(alone_load / LAYERS, 2),
                "compute_ms_per_layer_after_load": round(layer, 2),
                "batch_stored_ttft_p50_ms": p50(run["batch"]["stored_ttft_ms"]),
                "batch_computed_ttft_p50_ms": p50(run["batch"]["computed_ttft_ms"]),
                "batch_wall_ms": round(run["batch"]["wall_ms"], 1),
                "blocks_loaded": sum(load["blocks"] for load in run["alone_loads"] + run["batch"]["loads"]),
                "ttft_ms": {name: [round(v, 1) for v in run[f"{name}_ttft_ms"]]
                            for name in ("stored_alone", "computed_alone")}}

    result = {"prefix_blocks": args.prefix_blocks, "requests": args.requests, "block_bytes": block_bytes,
              "bytes_loaded_per_prompt": args.prefix_blocks * block_bytes,
              "sync": summary(sync), "async": summary(run_async),
              "tokens_identical": sync["tokens"] == run_async["tokens"]}
    result["async_vs_sync"] = {key: round(result["async"][key] / result["sync"][key], 3) for key in
                               ("stored_alone_ttft_p50_ms", "batch_stored_ttft_p50_ms", "batch_computed_ttft_p50_ms",
                                "batch_wall_ms")}
    print(json.dumps(result), flush=True)
    return 0 if result["tokens_identical"] else 1


if __name__ == "__main__":
    sys.exit(main())
