"""What the vLLM examples share: the model they serve, the engines they run on it (each in its own process), and
the local kvpool cluster they start."""

import json
import os
import subprocess
import sys
from pathlib import Path

MODEL_ID = "tiny-llama-example"  # the name the engines' blocks are stored under in kvpool


def make_model(directory: Path, max_tokens: int = 1024) -> None:
    """A small Llama (8 layers, 22 M parameters) with random weights, saved where vLLM loads it from (nothing
    is downloaded). Big enough that a prefill costs what it saves: with a much smaller model, computing the
    prompt is as cheap as fetching its KV."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=1000, hidden_size=512, intermediate_size=1408, num_hidden_layers=8,
                         num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=max_tokens,
                         initializer_range=0.1, eos_token_id=None)  # a wide init, or the model repeats one token
    LlamaForCausalLM(config).save_pretrained(directory)


def start_cluster(python: str, workdir: Path, dram_per_node: str = "256MiB") -> tuple[subprocess.Popen, str]:
    """A local kvpool cluster (`kvpool up`): etcd, a master and two storage nodes; returns it and the master."""
    cluster = subprocess.Popen([python, "-m", "kvpool.commands.cli", "up", "--nodes", "2", "--dram-per-node", dram_per_node,
                                "--data-dir", str(workdir / "kvpool")], stdout=subprocess.PIPE, text=True)
    line = cluster.stdout.readline()
    if not line.startswith("kvpool ready"):
        cluster.kill()
        raise SystemExit(f"kvpool up did not start: {line!r}")
    clients = cluster.stdout.readline()  # "clients: export KVPOOL_TOKEN_FILE=..." (the cluster's client token)
    if clients.startswith("clients: export "):
        # This process and the engines it starts are the cluster's clients.
        os.environ.update(word.split("=", 1) for word in clients.split()[2:])
    return cluster, dict(word.split("=", 1) for word in line.split()[2:])["master"]


def make_engine(model: str, kv_role: str | None = None, master: str | None = None, transfer: str = "async",
                **options):
    """A vLLM engine serving the model in `model`, greedy and deterministic. With kv_role, its KV goes through
    kvpool at `master` (a block that cannot be loaded is computed instead). No local prefix cache, so every reuse
    goes through kvpool. `options`: more of vLLM's LLM arguments."""
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from vllm import LLM
    from vllm.config import KVTransferConfig

    connector = None
    if kv_role:
        connector = KVTransferConfig(kv_connector="KVPoolConnector", kv_connector_module_path="kvpool.connectors.vllm",
                                     kv_role=kv_role, kv_load_failure_policy="recompute",
                                     kv_connector_extra_config={"master": master, "model_id": MODEL_ID,
                                                                "transfer": transfer})
    return LLM(model=model, skip_tokenizer_init=True, dtype="float32", max_model_len=1024, enforce_eager=True,
               enable_prefix_caching=False, disable_log_stats=False, kv_transfer_config=connector, seed=0, **options)


def serve(llm, tokens: list[int], new_tokens: int) -> dict:
    """One request, generated greedily: its tokens, the prompt tokens vLLM loaded instead of computing
    (cached_tokens), its time to first token, and what kvpool moved for it (the connector's report)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    greedy = SamplingParams(temperature=0, ignore_eos=True, detokenize=False, max_tokens=new_tokens)
    [out] = llm.generate([TokensPrompt(prompt_token_ids=tokens)], greedy, use_tqdm=False)
    return {"tokens": list(out.outputs[0].token_ids), "prompt_tokens": len(tokens),
            "cached_tokens": out.num_cached_tokens or 0,
            "ttft_s": out.metrics.first_token_latency if out.metrics else None,
            "kvpool": (out.kv_transfer_params or {}).get("kvpool", {})}


def engine_process(script: str, role: str, model: Path, master: str | None, python: str, quiet: bool) -> dict:
    """Run `script --engine ROLE` (one engine) in a new process; vLLM logs to stdout, so the engine's result
    comes back in a file beside the model."""
    result = model.parent / f"{role}.json"
    subprocess.run([python, script, "--engine", role, "--model", str(model), "--out", str(result)]
                   + (["--master", master] if master else []),
                   stdout=subprocess.DEVNULL if quiet else sys.stderr, check=True)
    return json.loads(result.read_text())
