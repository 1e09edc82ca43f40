"""Run with the vLLM venv's python (tests/engines/test_engines.py does), against a running cluster:

    in_vllm_transfer.py --master HOST:PORT --transfer async|sync --rendezvous DIR

One vLLM engine with the kvpool connector in the given transfer mode computes a prompt (its blocks are saved),
then serves it again: the blocks are loaded and the greedy tokens must equal the computed run's. Then a second
prompt, and before its stored blocks are loaded the engine stops and tells the caller which keys it is about to
read (DIR/paused); the caller kills a storage node and says so (DIR/go); the load loses the blocks on that node
and vLLM computes them, and the tokens must still be equal. Prints one JSON line, with the counts the connector
reported per request and those vLLM's metrics received through its KVConnectorStats.
"""

import argparse
import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path

BLOCK = 128  # the CPU engine's block size
PAUSE = 120  # seconds the engine waits for the caller to kill a node


def make_model(directory: Path) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(vocab_size=1000, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                                 num_attention_heads=4, num_key_value_heads=2, initializer_range=0.3,
                                 eos_token_id=None)).save_pretrained(directory)


def wait_stored(master: str, namespace: str, tokens: list[int]) -> int:
    """Saves may finish after the request returns (async): wait until every full block is stored."""
    from kvpool import Client
    from kvpool.connectors.block_keys import block_hashes

    keys = [namespace + h for h in block_hashes(tokens[:len(tokens) - 1], BLOCK)]
    deadline = time.monotonic() + 30
    with Client(master) as client:
        while not all(client.batch_exists(keys)):
            if time.monotonic() > deadline:
                raise SystemExit("blocks were not saved within 30 s")
            time.sleep(0.05)
    return len(keys)


def pause_before_loading(rendezvous: Path) -> None:
    """The first load after this call writes the keys it is about to read to rendezvous/paused and waits for
    rendezvous/go (the engine runs in this process: VLLM_ENABLE_V1_MULTIPROCESSING=0)."""
    from kvpool.connectors.vllm_worker import KVPoolWorker

    real = KVPoolWorker._timed_load

    def paused(self, load):
        KVPoolWorker._timed_load = real
        (rendezvous / "paused").write_text(json.dumps(self._stores[load.group].keys(load.hashes)))
        deadline = time.monotonic() + PAUSE
        while not (rendezvous / "go").exists():
            if time.monotonic() > deadline:
                raise SystemExit("nobody said go")
            time.sleep(0.05)
        return real(self, load)

    KVPoolWorker._timed_load = paused


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--master", required=True)
    parser.add_argument("--transfer", choices=("async", "sync"), required=True)
    parser.add_argument("--rendezvous", required=True)
    args = parser.parse_args()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.inputs import TokensPrompt

    rng = random.Random(11)
    first = [rng.randrange(1, 1000) for _ in range(5 * BLOCK + 20)]
    second = [rng.randrange(1, 1000) for _ in range(6 * BLOCK + 7)]
    greedy = SamplingParams(temperature=0, ignore_eos=True, detokenize=False, max_tokens=24)
    with tempfile.TemporaryDirectory() as tmp:
        make_model(Path(tmp))
        transfer = KVTransferConfig(kv_connector="KVPoolConnector", kv_connector_module_path="kvpool.connectors.vllm",
                                    kv_role="kv_both", kv_load_failure_policy="recompute",
                                    kv_connector_extra_config={"master": args.master, "transfer": args.transfer,
                                                               "model_id": f"transfer-{args.transfer}"})
        # log stats on: the connector's KVConnectorStats reach vLLM's metrics (vllm:kvpool_*)
        llm = LLM(model=tmp, skip_tokenizer_init=True, dtype="float32", max_model_len=1024, enforce_eager=True,
                  enable_prefix_caching=False, disable_log_stats=False, seed=0, kv_transfer_config=transfer)
        per_request: dict[str, int] = {}  # the connector's own counts, summed over every request's output

        def serve(tokens):
            [out] = llm.generate([TokensPrompt(prompt_token_ids=tokens)], greedy, use_tqdm=False)
            moved = out.kv_transfer_params["kvpool"]
            for name, value in moved.items():
                if isinstance(value, (int, float)):  # counts (not the namespaces)
                    per_request[name] = per_request.get(name, 0) + value
            return list(out.outputs[0].token_ids), moved

        result = {"transfer": args.transfer}
        for name, tokens in (("first", first), ("second", second)):
            computed, moved = serve(tokens)
            result[name] = {"stored_blocks": wait_stored(args.master, moved["namespace"], tokens)}
            if name == "second":
                pause_before_loading(Path(args.rendezvous))
            loaded, moved = serve(tokens)
            result[name].update(identical=loaded == computed, blocks_loaded=moved.get("blocks_loaded", 0),
                                blocks_failed=moved.get("blocks_failed", 0))
        result["per_request"] = per_request
        # What vLLM received through KVConnectorStats, summed over steps by its own metrics.
        result["vllm_stats"] = {m.name.removeprefix("vllm:kvpool_"): m.value for m in llm.get_metrics()
                                if m.name.startswith("vllm:kvpool_")}
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
