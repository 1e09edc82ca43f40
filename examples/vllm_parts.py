"""What the vLLM examples share: the model they serve and the local kvpool cluster they start."""

import os
import subprocess
from pathlib import Path


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
