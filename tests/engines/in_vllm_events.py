"""Run with the vLLM venv's python (tests/engines/test_engines.py does): a real vLLM engine publishing its KV events
over ZMQ, followed by the router's EngineEvents, names its cached blocks exactly as kvpool does
(block_keys.block_hashes over the same tokens), and its removals empty the view again."""

import asyncio
import json
import os
import random
import socket
import sys
import tempfile
import threading
import time
from pathlib import Path

BLOCK = 128  # the CPU engine's block size
# The prompt's three full blocks as kvpool names them, written down: a change of block_hashes' encoding must fail
# here too, not be carried to both sides of the comparison.
PROMPT_BLOCKS = {
    "4916f50d34482f5d271e335731db1ea79ae5c446c9b432f7c908b0e1dc975df6",
    "ad0ad9e26bc2dbc2dfc7ba850dcfbf6e81e0a773fac77b78611d0da1f7757e6e",
    "cdc47d719d2187eb5c245e9cb67fd904ac7821e597c05a4a2d8cfdb773e9a395",
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def make_model(directory: Path) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(vocab_size=1000, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                                 num_attention_heads=4, num_key_value_heads=2, initializer_range=0.3,
                                 eos_token_id=None)).save_pretrained(directory)


def main() -> int:
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from vllm import LLM, SamplingParams
    from vllm.config import KVEventsConfig
    from vllm.inputs import TokensPrompt

    from kvpool.connectors.block_keys import block_hashes
    from kvpool.connectors.kv_events import EngineEvents
    from kvpool.connectors.router import EngineView

    port = free_port()
    view = EngineView("engine")
    follower = EngineEvents(view, f"tcp://127.0.0.1:{port}")
    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_until_complete, args=(follower.run(),), daemon=True).start()
    with tempfile.TemporaryDirectory() as tmp:
        make_model(Path(tmp))
        llm = LLM(model=tmp, skip_tokenizer_init=True, dtype="float32", max_model_len=1024, enforce_eager=True,
                  enable_prefix_caching=True, seed=0,
                  kv_events_config=KVEventsConfig(enable_kv_cache_events=True, publisher="zmq",
                                                  endpoint=f"tcp://*:{port}"))  # "*": the engine binds
        rng = random.Random(3)
        prompt = [rng.randrange(1, 1000) for _ in range(3 * BLOCK + 40)]
        assert prompt[:3] == [244, 607, 558], prompt[:3]  # the prompt PROMPT_BLOCKS were computed from
        greedy = SamplingParams(temperature=0, ignore_eos=True, detokenize=False, max_tokens=2 * BLOCK)
        [out] = llm.generate([TokensPrompt(prompt_token_ids=prompt)], greedy, use_tqdm=False)
        everything = prompt + list(out.outputs[0].token_ids)
        # The blocks whose KV the engine computed: all full blocks but the last token's.
        expected = set(block_hashes(everything[:len(everything) - 1], BLOCK))
        deadline = time.monotonic() + 30
        while not expected <= view.blocks and time.monotonic() < deadline:
            time.sleep(0.05)
        named = len(expected & view.blocks)
        golden_named = len(PROMPT_BLOCKS & view.blocks)
        result = {"expected_blocks": len(expected), "named": named, "extra": len(view.blocks - expected),
                  "golden_prompt_blocks_named": golden_named, "unmapped": view.unmapped,
                  "batches": follower.batches, "gaps": follower.gaps}
        llm.reset_prefix_cache()  # the engine drops its cache (told with the next step's events)
        other = [rng.randrange(1, 1000) for _ in range(BLOCK + 10)]
        llm.generate([TokensPrompt(prompt_token_ids=other)], SamplingParams(temperature=0, ignore_eos=True,
                                                                             detokenize=False, max_tokens=4),
                     use_tqdm=False)
        deadline = time.monotonic() + 30
        while view.blocks & expected and time.monotonic() < deadline:
            time.sleep(0.05)
        result["after_reset"] = len(view.blocks & expected)
    print(json.dumps(result), flush=True)
    ok = (named == len(expected) > 0 and golden_named == len(PROMPT_BLOCKS) and result["extra"] == 0
          and result["after_reset"] == 0)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
