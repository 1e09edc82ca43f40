"""Run with the vLLM venv's python (tests/engines/test_engines.py does), against a running cluster:

    in_vllm_hybrid.py --master HOST:PORT --model gemma3|qwen3next --role save|load --workdir DIR

A hybrid model with random weights in vLLM's CPU engine, its hybrid KV cache manager on (the connector
declares SupportsHMA): gemma3 mixes sliding-window and full-attention layers, qwen3next gated delta-net
linear attention (a recurrent state per block, --mamba-cache-mode align) and full attention. "save": one engine
computes a prompt and its blocks are saved, every group's; "load": another engine serves the same prompt, loads
it (tokens must equal the saver's), then, for each group that is not full attention, the same prompt with that
group's stored blocks replaced by random bytes of the same size: the tokens must change, so the group's loaded
KV is really used. Prints one JSON line.
"""

import argparse
import json
import os
import random
import sys
import time
from pathlib import Path

PROMPT_BLOCKS = {"gemma3": 5, "qwen3next": 2}  # full blocks before the prompt's last token
NEW_TOKENS = 24


def make_model(kind: str, directory: Path) -> None:
    import torch
    torch.manual_seed(0)
    if kind == "gemma3":
        from transformers import Gemma3ForCausalLM, Gemma3TextConfig
        # query_pre_attn_scalar 16: sharper attention, or the random model repeats one token whatever its KV.
        config = Gemma3TextConfig(vocab_size=1000, hidden_size=256, intermediate_size=512, num_hidden_layers=6,
                                  num_attention_heads=4, num_key_value_heads=2, head_dim=64, sliding_window=128,
                                  query_pre_attn_scalar=16, max_position_embeddings=2048, eos_token_id=None,
                                  layer_types=["sliding_attention"] * 2 + ["full_attention"]
                                  + ["sliding_attention"] * 2 + ["full_attention"])
        Gemma3ForCausalLM(config).save_pretrained(directory)
    else:
        from transformers import Qwen3NextConfig, Qwen3NextForCausalLM
        # bf16 (the CPU kernels of gated delta-net want it) and linear heads of 128 (the sizes they know).
        config = Qwen3NextConfig(vocab_size=1000, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                                 num_attention_heads=4, num_key_value_heads=2, head_dim=64, linear_num_key_heads=2,
                                 linear_num_value_heads=2, linear_key_head_dim=128, linear_value_head_dim=128,
                                 layer_types=["linear_attention", "full_attention"] * 2, num_experts=4,
                                 num_experts_per_tok=2, moe_intermediate_size=128,
                                 shared_expert_intermediate_size=128, max_position_embeddings=2048,
                                 eos_token_id=None, torch_dtype="bfloat16")
        Qwen3NextForCausalLM(config).to(torch.bfloat16).save_pretrained(directory)


def prompt_of(kind: str, block: int) -> list[int]:
    rng = random.Random(7)
    return [rng.randrange(1, 1000) for _ in range(PROMPT_BLOCKS[kind] * block + 20)]


def engine(kind: str, model: Path, master: str):
    from vllm import LLM
    from vllm.config import KVTransferConfig
    transfer = KVTransferConfig(kv_connector="KVPoolConnector", kv_connector_module_path="kvpool.connectors.vllm",
                                kv_role="kv_both", kv_load_failure_policy="recompute",
                                kv_connector_extra_config={"master": master, "model_id": f"hybrid-{kind}"})
    # Prefix caching on (a state group needs it); reset_prefix_cache between requests makes every reuse kvpool's.
    return LLM(model=str(model), skip_tokenizer_init=True, dtype="bfloat16" if kind == "qwen3next" else "float32",
               max_model_len=2048, enforce_eager=True, disable_log_stats=False, seed=0, kv_transfer_config=transfer)


def serve(llm, tokens: list[int]) -> tuple[list[int], dict]:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt
    greedy = SamplingParams(temperature=0, ignore_eos=True, detokenize=False, max_tokens=NEW_TOKENS)
    llm.reset_prefix_cache()
    [out] = llm.generate([TokensPrompt(prompt_token_ids=tokens)], greedy, use_tqdm=False)
    return list(out.outputs[0].token_ids), out.kv_transfer_params["kvpool"]


def group_keys(moved: dict, tokens: list[int], block: int) -> list[list[str]]:
    """Every group's keys of the prompt's full blocks before its last token."""
    from kvpool.connectors.block_keys import block_hashes
    hashes = block_hashes(tokens[:len(tokens) - 1], block)
    return [[namespace + h for h in hashes] for namespace in moved["namespaces"]]


def kind_of(namespace: str) -> str:
    """The group kind a hybrid model's namespace names in its layout (...-g<N>-<kind><span>)."""
    from kvpool.connectors.block_keys import BlockNamespace
    return BlockNamespace.from_prefix(namespace).layout.rsplit("-", 1)[-1].rstrip("0123456789")


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--master", required=True)
    parser.add_argument("--model", choices=sorted(PROMPT_BLOCKS), required=True)
    parser.add_argument("--role", choices=("save", "load"), required=True)
    parser.add_argument("--workdir", required=True)
    args = parser.parse_args()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from kvpool import Client

    model = Path(args.workdir) / f"model-{args.model}"
    if args.role == "save":
        make_model(args.model, model)
    llm = engine(args.model, model, args.master)
    config = llm.llm_engine.vllm_config
    block = config.cache_config.block_size
    tokens = prompt_of(args.model, block)
    computed, moved = serve(llm, tokens)
    result = {"model": args.model, "role": args.role, "block_size": block, "tokens": computed,
              "groups": len(moved["namespaces"]), "namespaces": moved["namespaces"], "lookups": moved["lookups"],
              "moved": {k: v for k, v in moved.items() if k not in ("namespace", "namespaces")}}
    keys = group_keys(moved, tokens, block)
    with Client(args.master) as client:
        if args.role == "save":
            # Saves are written after the request returned: wait for every group's last block (each kind
            # needs it), written in the same batch as the rest of the step's.
            deadline = time.monotonic() + 30
            while not all(client.batch_exists([group[-1] for group in keys])):
                if time.monotonic() > deadline:
                    raise SystemExit("the blocks were not saved within 30 s")
                time.sleep(0.05)
            result["stored_per_group"] = [sum(client.batch_exists(group)) for group in keys]
        else:
            result["corrupted"] = {}
            for group, namespace in enumerate(moved["namespaces"]):
                if kind_of(namespace) == "full":
                    continue
                there = [key for key in keys[group] if client.exists(key)]
                original = [client.get(key) for key in there]
                junk = [os.urandom(len(value)) for value in original]
                client.batch_put(there, junk, overwrite=True)
                try:
                    damaged, moved_damaged = serve(llm, tokens)
                finally:
                    client.batch_put(there, original, overwrite=True)
                result["corrupted"][str(group)] = {
                    "blocks": len(there), "tokens_changed": damaged != computed,
                    "blocks_loaded": moved_damaged.get(f"blocks_loaded_g{group}", 0)}
            again, moved_again = serve(llm, tokens)
            result["restored_identical"] = again == computed
            result["restored_moved"] = {k: v for k, v in moved_again.items() if k.startswith("blocks_")}
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
