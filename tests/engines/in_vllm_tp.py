"""Run with the vLLM venv's python (tests/engines/test_engines.py does), against a running cluster:

    in_vllm_tp.py --master HOST:PORT --kv-heads N

One vLLM engine at tensor parallelism 2 (two worker processes, each with its own connector) serves a prompt
twice: computed and saved, then loaded (no local prefix cache), greedy tokens compared. With one KV head the
head is replicated on both ranks (as MLA's latent is on every rank): one copy of each block is stored, written
by rank 0 and read by both; with two, each rank holds its own head and stores its own shard. Prints one JSON
line with the objects stored under the model's name per namespace.
"""

import argparse
import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path

BLOCK = 128


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--master", required=True)
    parser.add_argument("--kv-heads", type=int, required=True)
    args = parser.parse_args()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.inputs import TokensPrompt

    from kvpool import Client

    model_id = f"tp2-kv{args.kv_heads}-{os.getpid()}"
    tokens = [random.Random(3).randrange(1, 1000) for _ in range(4 * BLOCK + 10)]
    greedy = SamplingParams(temperature=0, ignore_eos=True, detokenize=False, max_tokens=16)
    with tempfile.TemporaryDirectory() as tmp:
        torch.manual_seed(0)
        LlamaForCausalLM(LlamaConfig(vocab_size=1000, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                                     num_attention_heads=4, num_key_value_heads=args.kv_heads,
                                     initializer_range=0.3, eos_token_id=None)).save_pretrained(tmp)
        transfer = KVTransferConfig(kv_connector="KVPoolConnector", kv_connector_module_path="kvpool.connectors.vllm",
                                    kv_role="kv_both", kv_load_failure_policy="recompute",
                                    kv_connector_extra_config={"master": args.master, "model_id": model_id})
        llm = LLM(model=tmp, skip_tokenizer_init=True, dtype="float32", max_model_len=1024, enforce_eager=True,
                  enable_prefix_caching=False, tensor_parallel_size=2, distributed_executor_backend="mp", seed=0,
                  kv_transfer_config=transfer)
        [computed] = llm.generate([TokensPrompt(prompt_token_ids=tokens)], greedy, use_tqdm=False)
        blocks = (len(tokens) - 1) // BLOCK
        with Client(args.master) as client:
            deadline = time.monotonic() + 30
            stored = {}
            while time.monotonic() < deadline:  # saves are written after the request returned
                stored = {}
                for key in client.iter_keys(f"kv/{model_id}/"):
                    namespace = key.rsplit("/", 1)[0] + "/"
                    stored[namespace] = stored.get(namespace, 0) + 1
                if stored and all(count >= blocks for count in stored.values()):
                    break
                time.sleep(0.1)
        [loaded] = llm.generate([TokensPrompt(prompt_token_ids=tokens)], greedy, use_tqdm=False)
    moved = loaded.kv_transfer_params["kvpool"]
    print(json.dumps({"kv_heads": args.kv_heads, "stored": stored, "blocks": blocks,
                      "identical": list(loaded.outputs[0].token_ids) == list(computed.outputs[0].token_ids),
                      "lookups": moved["lookups"], "blocks_loaded": moved.get("blocks_loaded", 0),
                      "blocks_failed": moved.get("blocks_failed", 0)}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
