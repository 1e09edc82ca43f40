"""Prefill/decode disaggregation and prefix reuse with real vLLM engines and kvpool, on a CPU.

    python3 examples/vllm_disaggregation/run.py [--master HOST:PORT] [--json-only]

Builds vLLM's CPU venv on first use (examples/engine_venvs.py), makes a small random-weight Llama model, starts a
local kvpool cluster (unless --master names one), then runs three vLLM engines one after another, each in its
own process:
  baseline  no kvpool: every prompt computed; its tokens are the reference
  prefill   kv_producer: computes prompts A and C and saves their KV blocks to kvpool, then exits
  decode    kv_consumer, started after prefill is gone: prompt B (the system prompt of A with another question:
            prefix reuse), then A and C (a whole prefill handed over): loads the stored blocks instead of
            computing them, and generates greedily; then D, whose blocks were replaced by junk just before:
            found, not loadable, so computed
and prints one JSON line: tokens identical to the baseline, prompt tokens loaded vs computed (vLLM's own counts),
the time to first token with and without the loaded KV, and the bytes kvpool moved per request.
Exits 1 if any token differs or nothing was loaded.
"""

import argparse
import json
import subprocess
import sys
import tempfile
from contextlib import contextmanager
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from vllm_parts import engine_process, make_engine, make_model, serve, start_cluster  # noqa: E402

BLOCK = 128             # the vLLM CPU engine's block size, in tokens
SYSTEM_PROMPT = 4 * BLOCK
NEW_TOKENS = 16
TURN_TOKENS = 2 * BLOCK + 10  # the first turn's answer: it fills blocks the second turn then loads


def prompts() -> dict[str, list[int]]:
    """Token ids from a fixed generator: A and B share a 512-token system prompt, C shares nothing; W warms an
    engine up (and, once stored, the decode engine's connections to kvpool) before anything is timed."""
    import random
    rng = random.Random(7)
    system = [rng.randrange(1, 1000) for _ in range(SYSTEM_PROMPT)]
    return {"A": system + [rng.randrange(1, 1000) for _ in range(100)],
            "B": system + [rng.randrange(1, 1000) for _ in range(80)],
            "C": [rng.randrange(1, 1000) for _ in range(3 * BLOCK + 20)],
            "D": [rng.randrange(1, 1000) for _ in range(2 * BLOCK + 30)],
            "W": [rng.randrange(1, 1000) for _ in range(BLOCK + 10)],
            # A conversation: T's first turn (prefill engine), then T + its answer + U (decode engine).
            "T": [rng.randrange(1, 1000) for _ in range(2 * BLOCK + 20)],
            "U": [rng.randrange(1, 1000) for _ in range(30)]}


# The prefill engine saves synchronously, so each request's output reports what it saved; the decode engine loads
# asynchronously (the connector's default: a request waits off the step while its blocks load).
TRANSFER = {"prefill": "sync", "decode": "async"}
ROLES = {  # role -> (kv_role, prompts in the order the engine serves them)
    "baseline": (None, ["A", "B", "C", "D"]),
    "prefill": ("kv_producer", ["A", "C"]),
    "decode": ("kv_consumer", ["B", "A", "C", "D"]),  # D's blocks are damaged first (damage_blocks)
}


@contextmanager
def damaged_blocks(master: str, namespace: str, tokens: list[int]):
    """While in use, something that is not a KV block sits under the keys of the prompt's full blocks: a lookup
    finds them, the load cannot use them, and the engine must compute the prompt instead."""
    from kvpool import Client
    from kvpool.connectors import block_hashes

    keys = [namespace + block_hash for block_hash in block_hashes(tokens, BLOCK)]
    with Client(master) as client:
        client.batch_put(keys, [b"not a KV block"] * len(keys), overwrite=True)
        try:
            yield
        finally:
            for key in keys:
                client.remove(key)


def run_engine(role: str, model: str, master: str | None) -> dict:
    """One vLLM engine serving its role's prompts one at a time; returns what each request did."""
    kv_role, order = ROLES[role]
    # The prefill engine computes at most 256 tokens a step, so a long prompt is prefilled in chunks and its
    # blocks are saved as each chunk completes.
    chunked = {"max_num_batched_tokens": 2 * BLOCK} if role == "prefill" else {}
    llm = make_engine(model, kv_role, master, TRANSFER.get(role, "async"), **chunked)
    table = prompts()
    warm = serve(llm, table["W"], NEW_TOKENS)
    served = {}
    for name in order:
        if name == "D" and kv_role:
            with damaged_blocks(master, warm["kvpool"]["namespace"], table["D"]):
                served[name] = serve(llm, table[name], NEW_TOKENS)
        else:
            served[name] = serve(llm, table[name], NEW_TOKENS)
    turns = conversation(llm, role, table, Path(model).parent / "turn1.json")
    metrics = {m.name: m.value for m in llm.get_metrics() if m.name.startswith("vllm:external_prefix_cache")}
    return {"role": role, "requests": served, "metrics": metrics, "turns": turns}


def conversation(llm, role: str, table: dict, answer_file: Path) -> dict:
    """Two turns of one conversation: the first on the prefill engine (its answer's blocks are saved as they
    fill), the second, whose prompt holds that answer, on the decode engine; the baseline computes both."""
    turns = {}
    if role in ("baseline", "prefill"):
        turns["T1"] = serve(llm, table["T"], TURN_TOKENS)
        if role == "prefill":
            answer_file.write_text(json.dumps(turns["T1"]["tokens"]))
    if role in ("baseline", "decode"):
        answer = turns["T1"]["tokens"] if role == "baseline" else json.loads(answer_file.read_text())
        turns["T2"] = serve(llm, table["T"] + answer + table["U"], NEW_TOKENS)
    return turns


def summarize(runs: dict) -> dict:
    base, decode = runs["baseline"]["requests"], runs["decode"]["requests"]
    identical = {name: base[name]["tokens"] == decode[name]["tokens"] for name in decode}
    turns = {role: runs[role]["turns"] for role in runs}
    identical["T1"] = turns["baseline"]["T1"]["tokens"] == turns["prefill"]["T1"]["tokens"]
    identical["T2"] = turns["baseline"]["T2"]["tokens"] == turns["decode"]["T2"]["tokens"]
    handed = [name for name in decode if name != "D"]  # D is the damaged one: computed, so not in the sums
    loaded = sum(decode[n]["cached_tokens"] for n in handed)
    prompt = sum(decode[n]["prompt_tokens"] for n in handed)
    ttft_base = sum(base[n]["ttft_s"] for n in handed)
    ttft_loaded = sum(decode[n]["ttft_s"] for n in handed)
    return {
        "tokens_identical": all(identical.values()), "requests_compared": len(identical), "identical": identical,
        "prompt_tokens": prompt, "prompt_tokens_loaded": loaded, "prompt_tokens_computed": prompt - loaded,
        "prefix_reuse_B": {"prompt_tokens": decode["B"]["prompt_tokens"], "loaded": decode["B"]["cached_tokens"]},
        "damaged_D": {"prompt_tokens": decode["D"]["prompt_tokens"],
                      "blocks_failed": decode["D"]["kvpool"].get("blocks_failed", 0),
                      "bytes_loaded": decode["D"]["kvpool"].get("bytes_loaded", 0)},
        "vllm_external_prefix_cache": runs["decode"]["metrics"],
        "ttft_ms_computed": {n: round(base[n]["ttft_s"] * 1e3, 2) for n in handed},
        "ttft_ms_loaded": {n: round(decode[n]["ttft_s"] * 1e3, 2) for n in handed},
        "ttft_ms_prefill_saving": {n: round(r["ttft_s"] * 1e3, 2) for n, r in runs["prefill"]["requests"].items()},
        "ttft_ratio_loaded_vs_computed": round(ttft_loaded / ttft_base, 3),
        "bytes_saved_per_request": {n: r["kvpool"].get("bytes_saved", 0)
                                    for n, r in runs["prefill"]["requests"].items()},
        "bytes_loaded_per_request": {n: decode[n]["kvpool"].get("bytes_loaded", 0) for n in handed},
        "second_turn": {"prompt_tokens": turns["decode"]["T2"]["prompt_tokens"],
                        "first_turn_prompt_tokens": turns["prefill"]["T1"]["prompt_tokens"],
                        "loaded": turns["decode"]["T2"]["cached_tokens"],
                        "blocks_saved_by_first_turn": turns["prefill"]["T1"]["kvpool"].get("blocks_saved", 0)},
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--master", help="an existing kvpool master HOST:PORT (default: start a local cluster)")
    parser.add_argument("--json-only", action="store_true", help="print only the summary line")
    parser.add_argument("--engine", choices=sorted(ROLES), help=argparse.SUPPRESS)
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
    with tempfile.TemporaryDirectory(prefix="kvpool-vllm-") as tmp:
        workdir = Path(tmp)
        subprocess.run([python, __file__, "--make-model", str(workdir / "model")], check=True)
        cluster, master = (None, args.master) if args.master else start_cluster(python, workdir)
        try:
            runs = {}
            for role in ("baseline", "prefill", "decode"):
                if not args.json_only:
                    print(f"-- {role} engine", file=sys.stderr, flush=True)
                runs[role] = engine_process(__file__, role, workdir / "model", master, python, args.json_only)
        finally:
            if cluster:
                cluster.terminate()
                cluster.wait(timeout=30)
    summary = summarize(runs)
    print(json.dumps(summary), flush=True)
    return 0 if summary["tokens_identical"] and summary["prompt_tokens_loaded"] > 0 else 1


if __name__ == "__main__":
    sys.exit(main())
